//! The one wall-clock handle.
//!
//! Logic that the simulation runs never reads `SystemTime` directly: it asks a
//! [`Clock`], which in production is the system clock and in a simulation is
//! a fixed origin advanced by tokio's (simulated) time.

use std::time::{SystemTime, UNIX_EPOCH};

/// Where wall-clock time (ms since the Unix epoch) comes from.
#[derive(Clone, Debug)]
pub enum Clock {
    /// The operating system's clock.
    System,
    /// `origin_ms` plus the tokio time elapsed since `started`: deterministic
    /// under a paused or simulated tokio clock.
    Tokio {
        /// Wall-clock value at `started`.
        origin_ms: u64,
        /// The tokio instant the origin corresponds to.
        started: tokio::time::Instant,
    },
}

impl Clock {
    /// A clock driven by tokio's time, starting at `origin_ms`.
    ///
    /// Must be called inside a tokio runtime.
    pub fn tokio(origin_ms: u64) -> Self {
        Clock::Tokio {
            origin_ms,
            started: tokio::time::Instant::now(),
        }
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            Clock::Tokio { origin_ms, started } => origin_ms + started.elapsed().as_millis() as u64,
        }
    }
}
