//! A hybrid logical clock: wall-clock milliseconds with a counter that keeps
//! values strictly increasing when the wall clock stands still or goes back.
//!
//! The clock never reads system time: the caller passes `now_ms` from the
//! injected [`crate::clock::Clock`], so a simulation drives it
//! deterministically.

use serde::{Deserialize, Serialize};
use std::sync::Mutex;

/// A hybrid logical clock value, ordered by `wall_ms`, then `counter`.
///
/// The field order is the comparison order (derived `Ord`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
pub struct Hlc {
    /// Milliseconds since the Unix epoch (the largest one seen).
    pub wall_ms: u64,
    /// Tie-breaker among values with the same `wall_ms`.
    pub counter: u32,
}

impl Hlc {
    /// The smallest value strictly greater than `self`.
    ///
    /// Saturates at the maximum value (`u64::MAX`, `u32::MAX`), which no
    /// real clock reaches: [`HlcClock::observe_bounded`] keeps a peer from
    /// pushing a clock there.
    fn successor(self) -> Hlc {
        match self.counter.checked_add(1) {
            Some(counter) => Hlc {
                wall_ms: self.wall_ms,
                counter,
            },
            // The counter is exhausted: move to the next millisecond rather
            // than wrap, so order is kept.
            None => match self.wall_ms.checked_add(1) {
                Some(wall_ms) => Hlc {
                    wall_ms,
                    counter: 0,
                },
                None => self,
            },
        }
    }
}

/// A shared hybrid logical clock.
///
/// Every value [`tick`](Self::tick) returns is strictly greater than every
/// value it returned before and every value passed to
/// [`observe`](Self::observe). It is `Send + Sync`; its lock is held only for
/// a comparison, and a poisoned lock is recovered (the state is a plain
/// value that is never half-written).
#[derive(Debug, Default)]
pub struct HlcClock {
    last: Mutex<Hlc>,
}

impl HlcClock {
    /// A clock that has returned and observed nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// A clock that has already seen `last` (for example the greatest `ord`
    /// of a ledger loaded from storage).
    pub fn starting_at(last: Hlc) -> Self {
        HlcClock {
            last: Mutex::new(last),
        }
    }

    /// The next value: `max(now_ms, last.wall_ms)`, with the counter bumped
    /// when the wall does not advance, reset to 0 when it does.
    ///
    /// Strictly greater than everything returned or observed before, even
    /// when `now_ms` goes backwards.
    pub fn tick(&self, now_ms: u64) -> Hlc {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let next = if now_ms > last.wall_ms {
            Hlc {
                wall_ms: now_ms,
                counter: 0,
            }
        } else {
            last.successor()
        };
        *last = next;
        next
    }

    /// Records a value seen elsewhere (an entry's `ord`), so later ticks are
    /// greater than it.
    ///
    /// A hostile author can put any `ord` in its entries; prefer
    /// [`observe_bounded`](Self::observe_bounded) for values from others.
    pub fn observe(&self, seen: Hlc) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if seen > *last {
            *last = seen;
        }
    }

    /// Like [`observe`](Self::observe), but ignores a value more than
    /// `max_ahead_ms` ahead of `now_ms`, so one peer with a wrong (or
    /// malicious) clock cannot drag this clock into the far future.
    ///
    /// Returns whether the value was taken into account.
    pub fn observe_bounded(&self, seen: Hlc, now_ms: u64, max_ahead_ms: u64) -> bool {
        if seen.wall_ms > now_ms.saturating_add(max_ahead_ms) {
            return false;
        }
        self.observe(seen);
        true
    }

    /// The greatest value returned or observed so far.
    pub fn last(&self) -> Hlc {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hlc(wall_ms: u64, counter: u32) -> Hlc {
        Hlc { wall_ms, counter }
    }

    #[test]
    fn order_is_wall_then_counter() {
        assert!(hlc(1, 9) < hlc(2, 0));
        assert!(hlc(2, 0) < hlc(2, 1));
        assert_eq!(Hlc::default(), hlc(0, 0));
    }

    #[test]
    fn tick_follows_an_advancing_wall_clock() {
        let c = HlcClock::new();
        assert_eq!(c.tick(100), hlc(100, 0));
        assert_eq!(c.tick(105), hlc(105, 0));
    }

    #[test]
    fn tick_is_strictly_monotonic_when_the_clock_stalls_or_goes_backwards() {
        let c = HlcClock::new();
        let mut prev = c.tick(1_000);
        for now in [1_000, 999, 500, 0, 1_000, 1_001, 3, 1_001] {
            let next = c.tick(now);
            assert!(next > prev, "{next:?} after {prev:?} at now={now}");
            prev = next;
        }
        // The wall never goes below what was seen; the counter carries order.
        assert_eq!(c.tick(10), hlc(1_001, 3));
    }

    #[test]
    fn tick_after_observe_is_greater_than_the_observed_value() {
        let c = HlcClock::new();
        c.tick(100);
        c.observe(hlc(5_000, 7));
        assert_eq!(c.tick(200), hlc(5_000, 8));
        // Observing something older changes nothing.
        c.observe(hlc(1, 0));
        assert_eq!(c.tick(200), hlc(5_000, 9));
        // A wall clock that overtakes the observed value resets the counter.
        assert_eq!(c.tick(6_000), hlc(6_000, 0));
    }

    #[test]
    fn exhausted_counter_moves_to_the_next_millisecond() {
        let c = HlcClock::starting_at(hlc(10, u32::MAX));
        assert_eq!(c.tick(0), hlc(11, 0));
    }

    #[test]
    fn observe_bounded_ignores_values_far_ahead() {
        let c = HlcClock::new();
        assert!(!c.observe_bounded(hlc(u64::MAX, 0), 1_000, 60_000));
        assert_eq!(c.last(), hlc(0, 0));
        assert!(c.observe_bounded(hlc(30_000, 2), 1_000, 60_000));
        assert_eq!(c.tick(1_000), hlc(30_000, 3));
    }

    #[test]
    fn clock_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<HlcClock>();
    }
}
