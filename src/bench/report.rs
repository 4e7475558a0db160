//! The bench's report: a markdown table, a JSON summary and an SVG plot of
//! the ratios, written side by side into one folder.

use super::load::Slice;
use super::BenchOptions;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// One side's figure over all its slices.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    /// What `rate` counts, per second.
    pub unit: String,
    /// Operations per second over all slices (total operations divided by
    /// total time, so a slow slice weighs by its length).
    pub rate: f64,
    /// Median latency in microseconds, where the work has one.
    pub p50_us: Option<u64>,
    /// 99th percentile latency in microseconds, where the work has one.
    pub p99_us: Option<u64>,
    /// Each slice's own rate, to show the spread.
    pub slice_rates: Vec<f64>,
}

impl Figure {
    pub(super) fn rate(unit: &str, slices: &[Slice]) -> Self {
        let ops: u64 = slices.iter().map(|s| s.ops).sum();
        let secs: f64 = slices.iter().map(|s| s.secs).sum();
        let mut lat: Vec<u64> = slices
            .iter()
            .flat_map(|s| s.latencies_us.iter().copied())
            .collect();
        lat.sort_unstable();
        Figure {
            unit: unit.to_string(),
            rate: if secs > 0.0 { ops as f64 / secs } else { 0.0 },
            p50_us: percentile(&lat, 50),
            p99_us: percentile(&lat, 99),
            slice_rates: slices
                .iter()
                .map(|s| {
                    if s.secs > 0.0 {
                        s.ops as f64 / s.secs
                    } else {
                        0.0
                    }
                })
                .collect(),
        }
    }

    fn cell(&self) -> String {
        let mut s = format!("{} {}", group_digits(self.rate), self.unit);
        if let (Some(p50), Some(p99)) = (self.p50_us, self.p99_us) {
            let _ = write!(s, ", p50 {}, p99 {}", ms(p50), ms(p99));
        }
        s
    }
}

/// The `q`th percentile (nearest rank) of sorted values.
fn percentile(sorted: &[u64], q: usize) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied()
}

fn ms(us: u64) -> String {
    format!("{:.2} ms", us as f64 / 1000.0)
}

/// `12345.6` as `12,346`.
fn group_digits(v: f64) -> String {
    let n = v.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One pair: hubsync's figure, its baseline's, and their ratio.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// What was measured.
    pub work: String,
    /// hubsync's side.
    pub hubsync: Figure,
    /// The raw baseline's side.
    pub baseline: Figure,
    /// `hubsync.rate / baseline.rate`.
    pub ratio: f64,
    /// The ratio docs/performance.md aims for, where it names one.
    pub target: Option<f64>,
}

impl Row {
    pub(super) fn new(
        work: String,
        hubsync: Figure,
        baseline: Figure,
        target: Option<f64>,
    ) -> Self {
        let ratio = if baseline.rate > 0.0 {
            hubsync.rate / baseline.rate
        } else {
            0.0
        };
        Row {
            work,
            hubsync,
            baseline,
            ratio,
            target,
        }
    }
}

/// A pair this run could not measure on this machine (a baseline's server
/// is missing or lacks an option), and why: listed in the report so that
/// its absence is visible rather than silent.
#[derive(Clone, Debug, Serialize)]
pub struct NotMeasured {
    /// What would have been measured.
    pub work: String,
    /// Why it was not.
    pub reason: String,
    /// The ratio docs/performance.md aims for, where it names one.
    pub target: Option<f64>,
}

impl NotMeasured {
    pub(super) fn new(work: String, reason: &str, target: Option<f64>) -> Self {
        NotMeasured {
            work,
            reason: reason.to_string(),
            target,
        }
    }
}

/// Every pair of one run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The pairs, in the order they ran.
    pub rows: Vec<Row>,
    /// The pairs that could not be measured here, after the measured ones.
    pub not_measured: Vec<NotMeasured>,
    /// Cores the machine offered this process.
    pub cores: usize,
    /// Slices per side of each pair.
    pub rounds: usize,
    /// Length of one slice in milliseconds.
    pub slice_ms: u64,
    /// The sustained-load steps (pair (d)), in the order they ran.
    pub load: Vec<super::LoadStep>,
    /// Figures with no baseline to divide by (what a group costs a hub),
    /// one sentence each.
    pub footprint: Vec<String>,
}

impl Report {
    pub(super) fn new(rows: Vec<Row>, not_measured: Vec<NotMeasured>, opts: &BenchOptions) -> Self {
        Report {
            rows,
            not_measured,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            rounds: opts.rounds,
            slice_ms: opts.slice.as_millis() as u64,
            load: Vec::new(),
            footprint: Vec::new(),
        }
    }

    /// The markdown table docs/performance.md quotes.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} cores; {} alternating slices of {} ms per side.\n",
            self.cores, self.rounds, self.slice_ms
        );
        s.push_str("| work | hubsync | same-run raw baseline | ratio | target |\n");
        s.push_str("|---|---|---|---|---|\n");
        for r in &self.rows {
            let target = r.target.map_or("-".to_string(), |t| format!("≥ {t:.2}"));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.3} | {} |",
                r.work,
                r.hubsync.cell(),
                r.baseline.cell(),
                r.ratio,
                target
            );
        }
        for m in &self.not_measured {
            let target = m.target.map_or("-".to_string(), |t| format!("≥ {t:.2}"));
            let _ = writeln!(
                s,
                "| {} | not measured: {} | - | - | {} |",
                m.work, m.reason, target
            );
        }
        if !self.footprint.is_empty() {
            s.push_str("\nFootprint:\n\n");
            for f in &self.footprint {
                let _ = writeln!(s, "- {f}");
            }
        }
        if !self.load.is_empty() {
            s.push_str(
                "\nSustained load (one step per row; target: at least 5,000 deliveries/s \
                 with p99 under 50 ms):\n\n",
            );
            s.push_str(
                "| offered messages/s | sent | deliveries (due) | deliveries/s | p50 | p99 |\n",
            );
            s.push_str("|---|---|---|---|---|---|\n");
            for l in &self.load {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} ({}) | {} | {} | {} |",
                    group_digits(l.offered),
                    l.sent,
                    l.deliveries,
                    l.expected,
                    group_digits(l.deliveries_per_sec),
                    ms(l.p50_us),
                    ms(l.p99_us)
                );
            }
        }
        s
    }

    /// A horizontal bar per pair: its ratio, with its target marked.
    pub fn svg(&self) -> String {
        let bar_h = 28;
        let label_w = 420;
        let plot_w = 360;
        let h = 40 + bar_h * self.rows.len() as i64 + 20 * self.not_measured.len() as i64 + 30;
        let max = self
            .rows
            .iter()
            .flat_map(|r| [r.ratio, r.target.unwrap_or(0.0)])
            .fold(1.0f64, f64::max);
        let x = |v: f64| label_w as f64 + v / max * plot_w as f64;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n",
            label_w + plot_w + 60
        );
        let _ = writeln!(
            s,
            "<text x=\"10\" y=\"20\" font-size=\"14\">hubsync / same-run raw baseline (1.0 = as fast as raw)</text>"
        );
        for (i, r) in self.rows.iter().enumerate() {
            let y = 40 + bar_h * i as i64;
            let _ = writeln!(
                s,
                "<text x=\"10\" y=\"{}\">{}</text>",
                y + 17,
                xml_escape(&r.work)
            );
            let _ = writeln!(
                s,
                "<rect x=\"{label_w}\" y=\"{}\" width=\"{:.1}\" height=\"{}\" fill=\"#4878a8\"/>",
                y + 4,
                x(r.ratio) - label_w as f64,
                bar_h - 8
            );
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{}\">{:.3}</text>",
                x(r.ratio) + 4.0,
                y + 17,
                r.ratio
            );
            if let Some(t) = r.target {
                let _ = writeln!(
                    s,
                    "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"{1}\" y2=\"{2}\" stroke=\"#c03030\" stroke-width=\"2\"/>",
                    x(t),
                    y + 2,
                    y + bar_h - 2
                );
            }
        }
        let plot_end = 40 + bar_h * self.rows.len() as i64;
        for (i, m) in self.not_measured.iter().enumerate() {
            let _ = writeln!(
                s,
                "<text x=\"10\" y=\"{}\" fill=\"#888\">not measured: {} ({})</text>",
                plot_end + 14 + 20 * i as i64,
                xml_escape(&m.work),
                xml_escape(&m.reason)
            );
        }
        let _ = writeln!(
            s,
            "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"36\" y2=\"{1}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>",
            x(1.0),
            plot_end + 6
        );
        let _ = writeln!(
            s,
            "<text x=\"{label_w}\" y=\"{}\" fill=\"#c03030\">red mark: target</text>",
            h - 8
        );
        s.push_str("</svg>\n");
        s
    }

    /// Write report.md, summary.json and ratios.svg into `dir`.
    ///
    /// # Errors
    /// When the folder or a file cannot be written.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("report.md"), self.markdown())?;
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("summary.json"), json)?;
        std::fs::write(dir.join("ratios.svg"), self.svg())?;
        Ok(())
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50), Some(50));
        assert_eq!(percentile(&v, 99), Some(99));
        assert_eq!(percentile(&[7], 99), Some(7));
        assert_eq!(percentile(&[], 50), None);
    }

    #[test]
    fn a_figure_is_total_operations_over_total_time() {
        let slices = [
            Slice {
                ops: 100,
                secs: 1.0,
                latencies_us: vec![],
            },
            Slice {
                ops: 300,
                secs: 3.0,
                latencies_us: vec![],
            },
        ];
        let f = Figure::rate("x/s", &slices);
        assert!((f.rate - 100.0).abs() < 1e-9);
        assert_eq!(f.slice_rates, vec![100.0, 100.0]);
        assert_eq!(group_digits(1234567.4), "1,234,567");
        assert_eq!(group_digits(12.0), "12");
    }
}
