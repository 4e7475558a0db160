//! Pair (d): sustained load, many groups on one hub, at rising offered
//! load: deliveries per second handed to apps, and their latency, until
//! the 99th percentile passes 50 ms.
//!
//! Each group's first device sends at its share of the offered rate
//! (open loop: the next send is due on the clock, whether or not the last
//! one arrived; `Device::send` itself may hold a sender back when its
//! outbox is full, which then shows as offered load not met). A delivery's
//! latency is from the `send` call until a receiving device handed the
//! message to its app.

use super::app::HubGroup;
use serde::Serialize;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a step waits, after its sends, for their deliveries.
const DRAIN: Duration = Duration::from_secs(10);

/// The latency the steps rise towards: a step past it is the last.
pub const P99_LIMIT: Duration = Duration::from_millis(50);

/// One step of offered load.
#[derive(Clone, Debug, Serialize)]
pub struct LoadStep {
    /// Messages per second asked of all senders together.
    pub offered: f64,
    /// Messages the senders sent in the step.
    pub sent: u64,
    /// Deliveries handed to apps (each message once per receiving device).
    pub deliveries: u64,
    /// Deliveries that were due (sent messages times receivers each).
    pub expected: u64,
    /// Deliveries per second, from the step's start to its last delivery.
    pub deliveries_per_sec: f64,
    /// Median delivery latency, in microseconds.
    pub p50_us: u64,
    /// 99th percentile delivery latency, in microseconds.
    pub p99_us: u64,
}

fn percentile(sorted: &[u64], q: usize) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

/// One step: every group sends at `offered / groups` messages per second
/// for `len`, then the step waits for the deliveries.
///
/// # Errors
/// A refused send.
pub async fn step(groups: &[HubGroup], offered: f64, len: Duration) -> Result<LoadStep, String> {
    let per_group = offered / groups.len().max(1) as f64;
    let every = Duration::from_secs_f64(1.0 / per_group.max(0.001));
    for g in groups {
        g.record_arrivals(true);
    }
    let start = Instant::now();
    let body = vec![0x5au8; 256];
    let sends = groups.iter().map(|g| {
        let body = &body;
        async move {
            let mut sent: HashMap<[u8; 16], Instant> = HashMap::new();
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            while start.elapsed() < len {
                tick.tick().await;
                let t0 = Instant::now();
                let s = g
                    .sender()
                    .send(g.group, body)
                    .await
                    .map_err(|e| format!("send: {e}"))?;
                sent.insert(s.id, t0);
            }
            Ok::<_, String>(sent)
        }
    });
    let sent: Vec<HashMap<[u8; 16], Instant>> = futures::future::try_join_all(sends).await?;
    let expected: u64 = groups
        .iter()
        .zip(&sent)
        .map(|(g, s)| (s.len() * (g.devices.len() - 1)) as u64)
        .sum();
    let mut arrivals: Vec<Vec<([u8; 16], Instant)>> = vec![Vec::new(); groups.len()];
    let deadline = Instant::now() + DRAIN;
    loop {
        for (g, a) in groups.iter().zip(arrivals.iter_mut()) {
            a.extend(g.take_arrivals());
        }
        let got: usize = arrivals.iter().map(Vec::len).sum();
        if got as u64 >= expected || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for g in groups {
        g.record_arrivals(false);
    }
    let mut lat = Vec::new();
    let mut last = start;
    for (s, a) in sent.iter().zip(&arrivals) {
        for (id, at) in a {
            if let Some(t0) = s.get(id) {
                lat.push(at.saturating_duration_since(*t0).as_micros() as u64);
                last = last.max(*at);
            }
        }
    }
    lat.sort_unstable();
    let secs = last.saturating_duration_since(start).as_secs_f64();
    Ok(LoadStep {
        offered,
        sent: sent.iter().map(|s| s.len() as u64).sum(),
        deliveries: lat.len() as u64,
        expected,
        deliveries_per_sec: if secs > 0.0 {
            lat.len() as f64 / secs
        } else {
            0.0
        },
        p50_us: percentile(&lat, 50),
        p99_us: percentile(&lat, 99),
    })
}
