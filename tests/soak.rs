//! `hubsync soak` end to end, short: the real binary runs its hub as a
//! child process, kills and restarts it, cuts connections and restarts
//! devices for 15 s, and writes its report.

use std::process::Command;

#[test]
fn a_short_soak_delivers_survives_its_faults_and_writes_its_report() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report");
    let out = Command::new(env!("CARGO_BIN_EXE_hubsync"))
        .args([
            "soak",
            "--duration",
            "15s",
            "--devices",
            "6",
            "--groups",
            "2",
            "--sample-every",
            "1s",
            "--seed",
            "7",
            "--report",
        ])
        .arg(&report)
        .output()
        .expect("run hubsync soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said = format!("stdout:\n{stdout}\nstderr:\n{stderr}");

    for name in ["samples.csv", "report.md", "summary.json", "hub.log"] {
        assert!(report.join(name).exists(), "no {name}; {said}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(report.join("summary.json")).unwrap())
            .unwrap();
    let last = &summary["last"];
    let count = |k: &str| last[k].as_u64().unwrap_or_else(|| panic!("no {k}; {said}"));
    assert!(count("sent") > 0, "{said}");
    assert!(count("delivered") > 0, "{said}");
    assert!(count("hub_restarts") >= 1, "{said}");
    assert!(count("cuts") >= 1, "{said}");
    assert!(count("device_restarts") >= 1, "{said}");
    assert_eq!(summary["converged"], true, "{said}");
    assert!(summary["stalled"].is_null(), "{said}");
    // A run this short judges memory on a dozen samples taken while the
    // allocator is still warming up, so its growth verdict is not held
    // against the test; but the exit status must say what the summary
    // says, and a failed one must say why.
    let passed = summary["passed"].as_bool().unwrap();
    assert_eq!(out.status.success(), passed, "{said}");
    if !passed {
        assert!(stderr.contains("soak failed: "), "{said}");
        let failures = summary["failures"].as_array().unwrap();
        assert!(!failures.is_empty(), "{said}");
        for f in failures {
            let f = f.as_str().unwrap();
            assert!(
                f.contains(" grew: "),
                "a failure other than growth: {f}; {said}"
            );
        }
    }
    let csv = std::fs::read_to_string(report.join("samples.csv")).unwrap();
    // One sample a second for 15 s, and one at the end.
    assert!(csv.lines().count() >= 12, "{csv}");
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(md.contains("| hub rss |"), "{md}");
}
