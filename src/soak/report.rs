//! The soak's report: every sample as CSV, the summary as JSON, and a
//! page for people (a table of samples, the verdict and its figures).

use super::judge::format_value;
use super::{report_files, Sample, SoakError, Summary};
use std::fmt::Write as _;
use std::path::Path;

/// Rows of the report's table at most; the CSV holds every sample.
const TABLE_ROWS: usize = 30;

/// Write `samples.csv`, `report.md` and `summary.json` into `dir`.
pub(super) fn write(dir: &Path, summary: &Summary) -> Result<(), SoakError> {
    let [csv, md, json] = report_files(dir);
    let put = |path: &Path, text: String| {
        std::fs::write(path, text).map_err(|source| SoakError::Report {
            path: path.to_path_buf(),
            source,
        })
    };
    put(&csv, samples_csv(&summary.samples))?;
    put(&md, markdown(summary))?;
    let text = serde_json::to_string_pretty(summary).map_err(|e| SoakError::Report {
        path: json.clone(),
        source: std::io::Error::other(e),
    })?;
    put(&json, text)
}

const CSV_HEADER: &str = "t_s,hub_rss_bytes,hub_fds,devices_rss_bytes,devices_fds,sent,delivered,\
    send_errors,cuts,reconnects,hub_restarts,device_restarts,commits,commit_errors\n";

/// `samples.csv` written as the run goes, so a run that is killed, or
/// watched, has its samples on disk (the report rewrites it whole at the
/// end).
pub(super) struct CsvLog {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl CsvLog {
    /// Create (or empty) `samples.csv` in `dir` and write its header.
    pub(super) fn create(dir: &Path) -> Result<CsvLog, SoakError> {
        let [path, _, _] = report_files(dir);
        let io = |source| SoakError::Report {
            path: path.clone(),
            source,
        };
        let mut file = std::fs::File::create(&path).map_err(io)?;
        std::io::Write::write_all(&mut file, CSV_HEADER.as_bytes()).map_err(io)?;
        Ok(CsvLog { file, path })
    }

    /// Append one sample's line.
    pub(super) fn append(&mut self, s: &Sample) -> Result<(), SoakError> {
        let mut line = String::new();
        csv_line(&mut line, s);
        std::io::Write::write_all(&mut self.file, line.as_bytes()).map_err(|source| {
            SoakError::Report {
                path: self.path.clone(),
                source,
            }
        })
    }
}

/// One line per sample, with a header.
pub(super) fn samples_csv(samples: &[Sample]) -> String {
    let mut out = String::from(CSV_HEADER);
    for s in samples {
        csv_line(&mut out, s);
    }
    out
}

fn csv_line(out: &mut String, s: &Sample) {
    let _ = writeln!(
        out,
        "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{}",
        s.t_s,
        s.hub_rss,
        s.hub_fds,
        s.devices_rss,
        s.devices_fds,
        s.sent,
        s.delivered,
        s.send_errors,
        s.cuts,
        s.reconnects,
        s.hub_restarts,
        s.device_restarts,
        s.commits,
        s.commit_errors
    );
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1024.0 * 1024.0))
}

fn markdown(s: &Summary) -> String {
    let mut out = String::new();
    let verdict = if s.passed { "PASSED" } else { "FAILED" };
    let _ = writeln!(out, "# Soak: {verdict}\n");
    let _ = writeln!(
        out,
        "{} devices in {} groups, {} messages/s, seed {}, load for {:.0} s of {:.0} s planned.\n",
        s.devices, s.groups, s.rate, s.seed, s.ran_s, s.planned_s
    );
    if !s.failures.is_empty() {
        let _ = writeln!(out, "## Failures\n");
        for f in &s.failures {
            let _ = writeln!(out, "- {f}");
        }
        out.push('\n');
    }
    let _ = writeln!(out, "## Verdict per measure\n");
    let _ = writeln!(
        out,
        "After the warm-up (the first {:.0} %), the peak of the second half against the first's, \
         with the slack allowed; the slope is a least-squares fit over the same samples.\n",
        super::judge::WARM_UP_FRACTION * 100.0
    );
    let _ = writeln!(
        out,
        "| measure | first half peak | second half peak | allowed | slope per minute | |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for j in &s.judgements {
        let f = |v: f64| format_value(v, &j.unit);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            j.measure,
            f(j.first_max),
            f(j.second_max),
            f(j.allowed),
            f(j.slope_per_min),
            if j.grew { "grew" } else { "flat" }
        );
    }
    if let Some(last) = &s.last {
        let _ = writeln!(out, "\n## Totals\n");
        let _ = writeln!(
            out,
            "- messages: {} sent, {} delivered (each once per receiving member), {} sends refused or timed out",
            last.sent, last.delivered, last.send_errors
        );
        let _ = writeln!(
            out,
            "- faults: {} cuts, {} hub restarts (SIGKILL), {} device restarts; {} hub links came up",
            last.cuts, last.hub_restarts, last.device_restarts, last.reconnects
        );
        let _ = writeln!(
            out,
            "- commits: {} landed ({} invites and removals), {} failed or timed out ({} invites and removals)",
            last.commits, s.membership_changes, last.commit_errors, s.membership_errors
        );
        let _ = writeln!(
            out,
            "- at the end: {}",
            if s.converged {
                "every group converged and every member received its admin's last message"
            } else {
                "not every group converged (see the failures)"
            }
        );
    }
    let _ = writeln!(
        out,
        "\n## Samples\n\nEvery sample is in `samples.csv`; here at most {TABLE_ROWS} of them, evenly spaced, and the last.\n"
    );
    let _ = writeln!(
        out,
        "| t (s) | hub RSS (MiB) | hub fds | devices RSS (MiB) | devices fds | sent | delivered | cuts | hub restarts | device restarts |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    let step = s.samples.len().div_ceil(TABLE_ROWS).max(1);
    let last = s.samples.len().saturating_sub(1);
    for (i, x) in s.samples.iter().enumerate() {
        if i % step != 0 && i != last {
            continue;
        }
        let _ = writeln!(
            out,
            "| {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            x.t_s,
            mib(x.hub_rss),
            x.hub_fds,
            mib(x.devices_rss),
            x.devices_fds,
            x.sent,
            x.delivered,
            x.cuts,
            x.hub_restarts,
            x.device_restarts
        );
    }
    out
}
