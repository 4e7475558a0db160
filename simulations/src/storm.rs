//! The hubs' load after a restart: the reconnect storm.
//!
//! When a hub comes back, every device that was connected to it reconnects
//! at about the same moment (their backoff after a lost connection is
//! short), authenticates, subscribes to its topics again and starts a
//! receive stream. [`LoadMeter`] samples each running hub's counters once
//! per simulated second and, for every restart, turns them into a
//! [`Storm`]: how many reconnects and re-subscriptions the hub took, their
//! peak per simulated second, and how long until as many devices had a
//! receive stream open on it again as before it went down (the crowd has
//! settled back on it).
//!
//! It only reads the hubs' counters ([`hubsync::hub::Hub::metrics`]), so a
//! run measured is the run not measured.

use hubsync::hub::HubMetrics;
use std::collections::BTreeMap;

/// How often the meter samples the hubs, in simulated ms.
pub const SAMPLE_MS: u64 = 1000;

/// One hub restart and the load it brought.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Storm {
    /// The hub (its index in the run).
    pub hub: usize,
    /// Simulated ms of the run at which it came back.
    pub restart_ms: u64,
    /// How long it had been down, in ms.
    pub down_ms: u64,
    /// Receive streams open on it just before it went down: the devices
    /// that must come back.
    pub streams_before: u64,
    /// The most receive streams open on it at once after the restart,
    /// while the storm was measured (until they were as many as before,
    /// the hub went down again, a minute passed or the run ended).
    pub streams_after: u64,
    /// Connections it accepted in that window.
    pub reconnects: u64,
    /// Subscription changes devices asked of it in that window.
    pub resubscriptions: u64,
    /// The most connections accepted in one simulated second.
    pub peak_reconnects_per_s: u64,
    /// The most subscription changes asked in one simulated second.
    pub peak_resubscriptions_per_s: u64,
    /// Simulated ms from the restart until `streams_before` receive streams
    /// were open again; `None` when that did not happen in the window (a
    /// device that was connected went down or was cut off meanwhile).
    pub settle_ms: Option<u64>,
    /// Second by second from the restart: connections accepted,
    /// subscription changes asked, and receive streams open at its end.
    pub seconds: Vec<[u64; 3]>,
}

/// How long after a restart the storm is measured at most, in simulated
/// ms: a storm that has not settled in a minute is reported as not settled.
const WINDOW_MS: u64 = 60_000;

/// One sample of one hub's counters (since that run of the hub started).
#[derive(Clone, Copy, Debug)]
struct Sample {
    at_ms: u64,
    connections: u64,
    subscription_changes: u64,
    receive_streams: u64,
}

impl Sample {
    fn of(at_ms: u64, m: &HubMetrics) -> Self {
        Self {
            at_ms,
            connections: m.connections,
            subscription_changes: m.subscription_changes,
            receive_streams: m.receive_streams,
        }
    }
}

/// A hub's run after a restart, while it is measured.
#[derive(Clone, Debug)]
struct Open {
    restart_ms: u64,
    down_ms: u64,
    streams_before: u64,
    samples: Vec<Sample>,
}

/// Samples every hub's counters and keeps one [`Storm`] per restart.
#[derive(Debug, Default)]
pub struct LoadMeter {
    /// The latest sample of each hub (for what it had before a crash).
    last: BTreeMap<usize, Sample>,
    /// When each hub went down, and its receive streams then.
    down: BTreeMap<usize, (u64, u64)>,
    /// Restarts being measured.
    open: BTreeMap<usize, Open>,
    done: Vec<Storm>,
}

impl LoadMeter {
    /// A meter that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Take `hub`'s counters at `at_ms` (every [`SAMPLE_MS`] while it runs).
    pub fn sample(&mut self, hub: usize, at_ms: u64, m: &HubMetrics) {
        let s = Sample::of(at_ms, m);
        self.last.insert(hub, s);
        let over = match self.open.get_mut(&hub) {
            Some(o) => {
                o.samples.push(s);
                let settled = s.receive_streams >= o.streams_before;
                settled || at_ms >= o.restart_ms + WINDOW_MS
            }
            None => false,
        };
        if over {
            self.close(hub);
        }
    }

    /// `hub` goes down at `at_ms` (crashed, or rewound), with `m` its
    /// counters just before.
    pub fn down(&mut self, hub: usize, at_ms: u64, m: Option<&HubMetrics>) {
        self.close(hub);
        let streams = m
            .map(|m| m.receive_streams)
            .or_else(|| self.last.get(&hub).map(|s| s.receive_streams))
            .unwrap_or(0);
        self.down.entry(hub).or_insert((at_ms, streams));
        self.last.remove(&hub);
    }

    /// `hub` is started again at `at_ms`.
    pub fn restarted(&mut self, hub: usize, at_ms: u64) {
        let Some((since, streams_before)) = self.down.remove(&hub) else {
            return;
        };
        self.open.insert(
            hub,
            Open {
                restart_ms: at_ms,
                down_ms: at_ms.saturating_sub(since),
                streams_before,
                samples: Vec::new(),
            },
        );
    }

    /// Every storm measured, in the order they ended.
    pub fn finish(mut self) -> Vec<Storm> {
        let hubs: Vec<usize> = self.open.keys().copied().collect();
        for h in hubs {
            self.close(h);
        }
        self.done
    }

    fn close(&mut self, hub: usize) {
        if let Some(o) = self.open.remove(&hub) {
            self.done.push(storm(hub, &o));
        }
    }
}

/// The storm of one restart from its samples (counters start at zero with
/// the hub's new run, so the first sample's counts are all since the
/// restart).
fn storm(hub: usize, o: &Open) -> Storm {
    let mut prev = (0, 0);
    let mut seconds = Vec::with_capacity(o.samples.len());
    for s in &o.samples {
        seconds.push([
            s.connections.saturating_sub(prev.0),
            s.subscription_changes.saturating_sub(prev.1),
            s.receive_streams,
        ]);
        prev = (s.connections, s.subscription_changes);
    }
    let peak = |k: usize| seconds.iter().map(|x| x[k]).max().unwrap_or(0);
    Storm {
        hub,
        restart_ms: o.restart_ms,
        down_ms: o.down_ms,
        streams_before: o.streams_before,
        streams_after: o
            .samples
            .iter()
            .map(|s| s.receive_streams)
            .max()
            .unwrap_or(0),
        reconnects: prev.0,
        resubscriptions: prev.1,
        peak_reconnects_per_s: peak(0),
        peak_resubscriptions_per_s: peak(1),
        settle_ms: o
            .samples
            .iter()
            .find(|s| s.receive_streams >= o.streams_before)
            .map(|s| s.at_ms.saturating_sub(o.restart_ms)),
        seconds,
    }
}

/// The storms as a markdown table, one row per restart.
pub fn table(storms: &[(u64, &Storm)]) -> String {
    let mut t = String::from(
        "| seed | hub | at (s) | down (ms) | streams before | reconnects | peak/s | re-subscriptions | peak/s | settled in (ms) | streams after |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (seed, s) in storms {
        t.push_str(&format!(
            "| {seed} | hub{} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            s.hub,
            s.restart_ms as f64 / 1000.0,
            s.down_ms,
            s.streams_before,
            s.reconnects,
            s.peak_reconnects_per_s,
            s.resubscriptions,
            s.peak_resubscriptions_per_s,
            s.settle_ms
                .map_or("not settled".to_string(), |ms| ms.to_string()),
            s.streams_after,
        ));
    }
    t
}

/// The storms' figures in one line: restarts, peak rates, and how long the
/// slowest and the median storm took to settle.
pub fn summary(storms: &[Storm]) -> String {
    if storms.is_empty() {
        return "no hub restarts".into();
    }
    let mut settled: Vec<u64> = storms.iter().filter_map(|s| s.settle_ms).collect();
    settled.sort_unstable();
    let peak = |f: fn(&Storm) -> u64| storms.iter().map(f).max().unwrap_or(0);
    format!(
        "{} hub restarts ({} with devices to bring back); peak {} reconnects/s and {} re-subscriptions/s; \
         {} of them settled, median {} ms, slowest {} ms",
        storms.len(),
        storms.iter().filter(|s| s.streams_before > 0).count(),
        peak(|s| s.peak_reconnects_per_s),
        peak(|s| s.peak_resubscriptions_per_s),
        settled.len(),
        settled.get(settled.len() / 2).copied().unwrap_or(0),
        settled.last().copied().unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(connections: u64, subs: u64, streams: u64) -> HubMetrics {
        HubMetrics {
            connections,
            subscription_changes: subs,
            receive_streams: streams,
            ..HubMetrics::default()
        }
    }

    #[test]
    fn a_restart_is_measured_until_the_devices_are_back() {
        let mut m = LoadMeter::new();
        m.sample(0, 1000, &metrics(50, 120, 40));
        m.down(0, 1500, Some(&metrics(50, 120, 40)));
        m.restarted(0, 4000);
        m.sample(0, 5000, &metrics(30, 90, 25));
        m.sample(0, 6000, &metrics(42, 100, 39));
        m.sample(0, 7000, &metrics(44, 104, 40));
        // Past the settle: not part of the storm.
        m.sample(0, 8000, &metrics(90, 500, 40));
        let s = m.finish();
        assert_eq!(
            s,
            vec![Storm {
                hub: 0,
                restart_ms: 4000,
                down_ms: 2500,
                streams_before: 40,
                streams_after: 40,
                reconnects: 44,
                resubscriptions: 104,
                peak_reconnects_per_s: 30,
                peak_resubscriptions_per_s: 90,
                settle_ms: Some(3000),
                seconds: vec![[30, 90, 25], [12, 10, 39], [2, 4, 40]],
            }]
        );
    }

    #[test]
    fn a_crowd_that_does_not_come_back_is_not_settled() {
        let mut m = LoadMeter::new();
        m.sample(1, 1000, &metrics(10, 10, 10));
        m.down(1, 1200, None);
        m.restarted(1, 2000);
        for k in 1..=70u64 {
            m.sample(1, 2000 + k * 1000, &metrics(5, 5, 5));
        }
        let s = m.finish();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].streams_before, 10);
        assert_eq!(s[0].streams_after, 5);
        assert_eq!(s[0].settle_ms, None);
    }

    #[test]
    fn a_second_crash_ends_the_first_storm_and_the_run_ends_the_last() {
        let mut m = LoadMeter::new();
        m.sample(2, 1000, &metrics(3, 3, 3));
        m.down(2, 1100, None);
        m.restarted(2, 2000);
        m.sample(2, 3000, &metrics(1, 1, 1));
        m.down(2, 3500, Some(&metrics(2, 2, 2)));
        m.restarted(2, 5000);
        m.sample(2, 6000, &metrics(1, 1, 1));
        let s = m.finish();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].streams_before, s[0].settle_ms), (3, None));
        assert_eq!((s[1].streams_before, s[1].reconnects), (2, 1));
        assert!(summary(&s).starts_with("2 hub restarts"));
    }

    #[test]
    fn a_restart_without_a_crash_is_not_a_storm() {
        let mut m = LoadMeter::new();
        m.restarted(0, 1000);
        m.sample(0, 2000, &metrics(1, 1, 1));
        assert!(m.finish().is_empty());
        assert_eq!(summary(&[]), "no hub restarts");
    }
}
