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

    /// The text.
    pub(crate) fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
