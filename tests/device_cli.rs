//! `hubsync device` end to end: the real binary, one process per command,
//! against a real hub over loopback.

use hubsync::testkit::TestHub;
use serde_json::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_hubsync");
const WAIT: Duration = Duration::from_secs(30);

/// Run one command; answer its JSON output, or its stderr as the error.
async fn device(dir: &Path, hub: &str, args: &[&str]) -> Result<Value, String> {
    let out = Command::new(BIN)
        .arg("device")
        .arg("--data")
        .arg(dir)
        .args(["--hub", hub])
        .args(args)
        .output()
        .await
        .expect("the hubsync binary runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().expect("one JSON line");
    Ok(serde_json::from_str(line).expect("JSON output"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_terminal_devices_form_a_group_and_talk() {
    let hub = TestHub::start().await.unwrap();
    let url = hub.url().to_string();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = device(da.path(), &url, &["id"]).await.unwrap()["device"]
        .as_str()
        .unwrap()
        .to_string();
    let b = device(db.path(), &url, &["id"]).await.unwrap()["device"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(a, b);
    assert_eq!(
        device(db.path(), &url, &["ready"]).await.unwrap()["ready"],
        true
    );

    // b listens (its key packages are on the hub from the `ready` run).
    let mut listener = Command::new(BIN)
        .arg("device")
        .arg("--data")
        .arg(db.path())
        .args(["--hub", &url, "listen", "--secs", "60"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(listener.stdout.take().unwrap()).lines();

    let g = device(da.path(), &url, &["create-group"]).await.unwrap()["group"]
        .as_str()
        .unwrap()
        .to_string();
    device(da.path(), &url, &["invite", &g, &b]).await.unwrap();
    device(da.path(), &url, &["send", &g, "hello from the terminal"])
        .await
        .unwrap();

    let heard = tokio::time::timeout(WAIT, async {
        let mut joined = false;
        while let Some(line) = lines.next_line().await.unwrap() {
            let v: Value = serde_json::from_str(&line).unwrap();
            if v["event"] == "joined" && v["group"] == g.as_str() {
                joined = true;
            }
            if v["event"] == "message" {
                assert!(joined, "the join is announced before the message");
                assert_eq!(v["sender"], a.as_str());
                assert_eq!(v["position"], 1);
                return v["text"].as_str().unwrap().to_string();
            }
        }
        panic!("the listener ended without the message");
    })
    .await
    .expect("the listener prints the message");
    assert_eq!(heard, "hello from the terminal");
    listener.kill().await.unwrap();
    let _ = listener.wait().await;

    let members = device(da.path(), &url, &["members", &g]).await.unwrap();
    let mut got: Vec<&str> = members["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    got.sort();
    let mut want = vec![a.as_str(), b.as_str()];
    want.sort();
    assert_eq!(got, want);

    // b is no admin: its invite is refused, with the reason, and nothing
    // changes.
    let dc = tempfile::tempdir().unwrap();
    let c = device(dc.path(), &url, &["id"]).await.unwrap()["device"]
        .as_str()
        .unwrap()
        .to_string();
    let refused = device(db.path(), &url, &["invite", &g, &c])
        .await
        .unwrap_err();
    assert!(refused.contains("may not"), "{refused}");
    // A bad argument is a clear error, not a panic.
    let bad = device(da.path(), &url, &["members", "not-hex"])
        .await
        .unwrap_err();
    assert!(bad.contains("not a group id"), "{bad}");
}
