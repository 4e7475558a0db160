//! The report folder: per-seed figures as JSON and an SVG plot of the time
//! each seed took to converge after its faults stopped.

use crate::{SeedReport, SimConfig};
use std::fmt::Write as _;
use std::path::Path;

/// Write `summary.json`, `converge.svg` and, when a hub restarted,
/// `storms.md` (each restart's reconnect storm) into `dir`.
///
/// # Errors
/// The I/O error.
pub fn write(dir: &Path, base: &SimConfig, reports: &[SeedReport]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let violations: usize = reports.iter().map(|r| r.violations.len()).sum();
    let summary = serde_json::json!({
        "seeds": reports.len(),
        "violations": violations,
        "strands": reports.iter().map(|r| r.strands).sum::<usize>(),
        "gathers": reports.iter().map(|r| r.gathers).sum::<usize>(),
        "rejoins": reports.iter().map(|r| r.rejoins).sum::<usize>(),
        "recoveries_failed": reports.iter().map(|r| r.recoveries_failed).sum::<usize>(),
        "devices": base.devices,
        "hubs": base.hubs,
        "groups": base.groups,
        "ops": base.ops,
        "faults": base.faults.to_arg(),
        "devices_per_host": base.devices_per_host,
        "runs": reports,
    });
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_vec_pretty(&summary).map_err(std::io::Error::other)?,
    )?;
    std::fs::write(dir.join("converge.svg"), svg(reports))?;
    let storms: Vec<(u64, &crate::storm::Storm)> = reports
        .iter()
        .flat_map(|r| r.storms.iter().map(|s| (r.seed, s)))
        .collect();
    if !storms.is_empty() {
        let all: Vec<crate::storm::Storm> = storms.iter().map(|(_, s)| (*s).clone()).collect();
        std::fs::write(
            dir.join("storms.md"),
            format!(
                "# Reconnect storms\n\n{}.\n\n{}",
                crate::storm::summary(&all),
                crate::storm::table(&storms)
            ),
        )?;
    }
    Ok(())
}

/// A scatter plot: x = seed index, y = ms to converge after faults stopped
/// (red crosses: seeds with violations or that never converged).
pub fn svg(reports: &[SeedReport]) -> String {
    let (w, h, pad) = (800.0f64, 400.0f64, 50.0f64);
    let max_y = reports
        .iter()
        .filter_map(|r| r.converge_ms)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let n = reports.len().max(1) as f64;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<line x1="{pad}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{}" stroke="black"/>"#,
        h - pad,
        w - pad,
        h - pad,
        h - pad
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">seed (run order)</text><text x="15" y="{}" transform="rotate(-90 15 {})" text-anchor="middle">ms to converge after faults stop</text>"#,
        w / 2.0,
        h - 15.0,
        h / 2.0,
        h / 2.0
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">{max_y:.0}</text>"#,
        pad - 5.0,
        pad + 4.0
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">0</text>"#,
        pad - 5.0,
        h - pad + 4.0
    );
    for (i, r) in reports.iter().enumerate() {
        let x = pad + (w - 2.0 * pad) * (i as f64 + 0.5) / n;
        match (r.converge_ms, r.violations.is_empty()) {
            (Some(ms), true) => {
                let y = h - pad - (h - 2.0 * pad) * ms as f64 / max_y;
                let _ = write!(
                    s,
                    r#"<circle cx="{x:.1}" cy="{y:.1}" r="2" fill="steelblue"/>"#
                );
            }
            _ => {
                let y = pad;
                let _ = write!(
                    s,
                    r#"<text x="{x:.1}" y="{y:.1}" fill="red" text-anchor="middle">x</text>"#
                );
            }
        }
    }
    s.push_str("</svg>\n");
    s
}
