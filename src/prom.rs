//! Prometheus's text exposition format (version 0.0.4), written by hand:
//! the hub's counters ([`crate::hub::prometheus_text`]) and a device's
//! ([`crate::device::DeviceStats::prometheus_text`]) are rendered with it.

use std::fmt::Write as _;

/// A metrics text being written: each metric gets its `# HELP`, its
/// `# TYPE` and its samples, every name prefixed.
pub(crate) struct PromText {
    out: String,
    prefix: &'static str,
}

/// Whether a metric only goes up or may go down.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Counter,
    Gauge,
}

impl PromText {
    /// An empty text whose metric names start with `prefix`.
    pub(crate) fn new(prefix: &'static str) -> Self {
        Self {
            out: String::new(),
            prefix,
        }
    }

    /// A metric with one unlabelled sample.
    pub(crate) fn one(&mut self, name: &str, kind: Kind, help: &str, value: u64) {
        self.head(name, kind, help);
        let _ = writeln!(self.out, "{}{name} {value}", self.prefix);
    }

    /// A metric with one sample per `(value, count)`, labelled `label`.
    pub(crate) fn labelled(
        &mut self,
        name: &str,
        kind: Kind,
        help: &str,
        label: &str,
        samples: &[(&str, u64)],
    ) {
        self.head(name, kind, help);
        for (value, n) in samples {
            let _ = writeln!(self.out, "{}{name}{{{label}=\"{value}\"}} {n}", self.prefix);
        }
    }

    fn head(&mut self, name: &str, kind: Kind, help: &str) {
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        };
        let _ = writeln!(self.out, "# HELP {}{name} {help}", self.prefix);
        let _ = writeln!(self.out, "# TYPE {}{name} {kind}", self.prefix);
    }

    /// A histogram: cumulative `_bucket` samples for each bound and
    /// `+Inf`, then `_sum` (seconds) and `_count`.
    pub(crate) fn histogram(&mut self, name: &str, help: &str, h: &HistogramSnapshot) {
        let _ = writeln!(self.out, "# HELP {}{name} {help}", self.prefix);
        let _ = writeln!(self.out, "# TYPE {}{name} histogram", self.prefix);
        let mut cumulative = 0;
        for (bound, n) in BOUNDS_SECS.iter().zip(h.buckets) {
            cumulative += n;
            let _ = writeln!(
                self.out,
                "{}{name}_bucket{{le=\"{bound}\"}} {cumulative}",
                self.prefix
            );
        }
        let _ = writeln!(
            self.out,
            "{}{name}_bucket{{le=\"+Inf\"}} {}",
            self.prefix, h.count
        );
        let _ = writeln!(
            self.out,
            "{}{name}_sum {}",
            self.prefix,
            h.sum_us as f64 / 1e6
        );
        let _ = writeln!(self.out, "{}{name}_count {}", self.prefix, h.count);
    }

    /// The text.
    pub(crate) fn finish(self) -> String {
        self.out
    }
}

/// The upper bounds of a [`Histogram`]'s buckets, in seconds: from half a
/// millisecond (a commit that shared a flush) to 2.5 s (a disk in trouble).
pub(crate) const BOUNDS_SECS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Durations counted into fixed buckets, lock-free.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    buckets: [std::sync::atomic::AtomicU64; 12],
    sum_us: std::sync::atomic::AtomicU64,
    count: std::sync::atomic::AtomicU64,
}

/// What a [`Histogram`] counted: per bucket (not cumulative), the sum in
/// microseconds, and how many in all (those above the last bound are only
/// in `count`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Durations per bucket of [`BOUNDS_SECS`], each counted in the first
    /// bucket whose bound it does not exceed.
    pub buckets: [u64; 12],
    /// The sum of every duration, in microseconds.
    pub sum_us: u64,
    /// How many durations.
    pub count: u64,
}

impl Histogram {
    /// Count one duration.
    pub(crate) fn observe(&self, d: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let secs = d.as_secs_f64();
        if let Some(i) = BOUNDS_SECS.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.sum_us
            .fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// What was counted so far.
    pub(crate) fn snapshot(&self) -> HistogramSnapshot {
        use std::sync::atomic::Ordering::Relaxed;
        HistogramSnapshot {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Relaxed)),
            sum_us: self.sum_us.load(Relaxed),
            count: self.count.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_is_cumulative_and_counts_what_is_past_every_bound() {
        let h = Histogram::default();
        for ms in [0, 3, 3, 40, 10_000] {
            h.observe(std::time::Duration::from_millis(ms));
        }
        let mut t = PromText::new("x_");
        t.histogram("d_seconds", "Ds.", &h.snapshot());
        let text = t.finish();
        assert!(text.contains("# TYPE x_d_seconds histogram\n"));
        assert!(
            text.contains("x_d_seconds_bucket{le=\"0.0005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("x_d_seconds_bucket{le=\"0.005\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("x_d_seconds_bucket{le=\"2.5\"} 4\n"),
            "{text}"
        );
        assert!(
            text.contains("x_d_seconds_bucket{le=\"+Inf\"} 5\n"),
            "{text}"
        );
        assert!(text.contains("x_d_seconds_sum 10.046\n"), "{text}");
        assert!(text.contains("x_d_seconds_count 5\n"), "{text}");
    }

    #[test]
    fn every_sample_follows_its_help_and_type() {
        let mut t = PromText::new("x_");
        t.one("a_total", Kind::Counter, "As.", 3);
        t.labelled("b", Kind::Gauge, "Bs.", "k", &[("v", 1), ("w", 2)]);
        assert_eq!(
            t.finish(),
            "# HELP x_a_total As.\n# TYPE x_a_total counter\nx_a_total 3\n\
             # HELP x_b Bs.\n# TYPE x_b gauge\nx_b{k=\"v\"} 1\nx_b{k=\"w\"} 2\n"
        );
    }
}
