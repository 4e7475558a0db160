//! The hub's counters in Prometheus's text format, and the small HTTP
//! endpoint that serves them (`hubsync hub --metrics ADDR`).
//!
//! The endpoint answers `GET /metrics` (and `GET /`) with the text, and
//! anything else with 404 or 400; it reads at most [`MAX_REQUEST`] bytes
//! of a request within [`REQUEST_TIMEOUT`], answers once and closes. It
//! tells nothing a device could not count itself beyond totals, but it is
//! meant for the operator's network: bind it to loopback or a private
//! address (docs/operations.md).

use super::HubMetrics;
use std::fmt::Write as _;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The most bytes of a request the endpoint reads.
pub const MAX_REQUEST: usize = 8 * 1024;

/// How long a client has to send its request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// `m` in Prometheus's text exposition format (version 0.0.4): one
/// `# HELP`, one `# TYPE` and its samples per metric, every name prefixed
/// `hubsync_hub_`.
pub fn prometheus_text(m: &HubMetrics) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
        let _ = writeln!(out, "# HELP hubsync_hub_{name} {help}");
        let _ = writeln!(out, "# TYPE hubsync_hub_{name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "hubsync_hub_{name}{labels} {value}");
        }
    };
    let one = |v: u64| [("", v)];
    metric(
        "connections_total",
        "counter",
        "Connections accepted since start.",
        &one(m.connections),
    );
    metric(
        "open_connections",
        "gauge",
        "Connections open now.",
        &one(m.open_connections),
    );
    metric(
        "unauthenticated_connections",
        "gauge",
        "Connections open now that have not authenticated.",
        &one(m.unauthenticated),
    );
    metric(
        "auth_failures_total",
        "counter",
        "Authentications refused.",
        &one(m.auth_failures),
    );
    metric(
        "auth_timeouts_total",
        "counter",
        "Connections closed for not authenticating in time.",
        &one(m.auth_timeouts),
    );
    metric(
        "unauthenticated_refused_total",
        "counter",
        "Connections closed at once because too many others had not authenticated.",
        &one(m.unauthenticated_refused),
    );
    metric(
        "bad_frames_total",
        "counter",
        "Frames refused as malformed, oversized, unknown, text, or before authentication.",
        &one(m.bad_frames),
    );
    metric(
        "publishes_total",
        "counter",
        "Publishes answered, by outcome.",
        &[
            ("{outcome=\"accepted\"}", m.accepted),
            ("{outcome=\"duplicate\"}", m.duplicates),
            ("{outcome=\"head_mismatch\"}", m.head_mismatches),
            ("{outcome=\"conflict\"}", m.conflicts),
            ("{outcome=\"history_missing\"}", m.history_missing),
            ("{outcome=\"mailbox_full\"}", m.mailbox_full),
            ("{outcome=\"quota_exceeded\"}", m.quota_refusals),
        ],
    );
    let scopes = m.rate_limited.by_scope();
    let labelled: Vec<(String, u64)> = scopes
        .iter()
        .map(|(scope, n)| (format!("{{scope=\"{scope}\"}}"), *n))
        .collect();
    let refusals: Vec<(&str, u64)> = labelled.iter().map(|(l, n)| (l.as_str(), *n)).collect();
    metric(
        "rate_limited_total",
        "counter",
        "Requests refused with RateLimited, by the scope of the empty bucket.",
        &refusals,
    );
    metric(
        "not_authorized_total",
        "counter",
        "Requests refused with NotAuthorized.",
        &one(m.not_authorized),
    );
    metric(
        "deliveries_pushed_total",
        "counter",
        "Deliveries pushed on receive streams.",
        &one(m.deliveries_pushed),
    );
    metric(
        "frames_missed_total",
        "counter",
        "Times a receive stream found log frames trimmed before it reached them.",
        &one(m.frames_missed),
    );
    metric(
        "cursor_save_failures_total",
        "counter",
        "Times a receive stream could not save its cursors (frames are pushed again).",
        &one(m.cursor_save_failures),
    );
    metric(
        "store_commits_total",
        "counter",
        "Store flushes (sled, group commit) or database commits (PostgreSQL) that made data durable.",
        &one(m.flushes),
    );
    metric(
        "store_conflict_retries_total",
        "counter",
        "Calls run again because their store transaction conflicted with another's.",
        &one(m.conflict_retries),
    );
    metric(
        "trimmed_frames_total",
        "counter",
        "Log frames trimmed by depth or retention.",
        &one(m.trimmed),
    );
    out
}

/// What the endpoint answers to `request` (the bytes read so far, which
/// hold at least the request line): the status line and body.
fn answer(request: &[u8], metrics: impl FnOnce() -> HubMetrics) -> (&'static str, String) {
    let line = request.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.trim_end().split(' ');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("GET"), Some("/metrics" | "/"), Some(v)) if v.starts_with("HTTP/1.") => {
            ("200 OK", prometheus_text(&metrics()))
        }
        (Some(_), Some(_), Some(v)) if v.starts_with("HTTP/1.") => {
            ("404 Not Found", "only GET /metrics is served\n".into())
        }
        _ => ("400 Bad Request", "not an HTTP/1 request\n".into()),
    }
}

/// Serve one connection: read the request head (bounded in size and
/// time), answer, close. Errors only end this connection.
pub(crate) async fn serve_one(
    mut socket: tokio::net::TcpStream,
    metrics: impl FnOnce() -> HubMetrics,
) {
    let mut request = Vec::with_capacity(512);
    let read = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < MAX_REQUEST {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    if read.is_err() || request.is_empty() {
        return;
    }
    let (status, body) = answer(&request, metrics);
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = socket.write_all(head.as_bytes()).await;
    let _ = socket.write_all(body.as_bytes()).await;
    let _ = socket.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_type_and_samples_in_the_text_format() {
        let m = HubMetrics {
            accepted: 7,
            head_mismatches: 2,
            rate_limited: crate::hub::RateLimitRefusals {
                topic: 3,
                ..Default::default()
            },
            ..HubMetrics::default()
        };
        let text = prometheus_text(&m);
        assert!(text.contains("hubsync_hub_publishes_total{outcome=\"accepted\"} 7\n"));
        assert!(text.contains("hubsync_hub_publishes_total{outcome=\"head_mismatch\"} 2\n"));
        assert!(text.contains("hubsync_hub_rate_limited_total{scope=\"topic\"} 3\n"));
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let kind = rest.rsplit(' ').next().unwrap();
                assert!(kind == "counter" || kind == "gauge", "{line}");
            } else if !line.starts_with("# HELP ") {
                let (name, value) = line.rsplit_once(' ').unwrap();
                assert!(name.starts_with("hubsync_hub_"), "{line}");
                value.parse::<u64>().unwrap();
            }
        }
    }

    #[test]
    fn only_get_metrics_is_answered_with_the_text() {
        let m = HubMetrics::default;
        assert_eq!(answer(b"GET /metrics HTTP/1.1\r\n\r\n", m).0, "200 OK");
        assert_eq!(answer(b"GET / HTTP/1.0\r\n\r\n", m).0, "200 OK");
        assert_eq!(answer(b"GET /other HTTP/1.1\r\n\r\n", m).0, "404 Not Found");
        assert_eq!(
            answer(b"POST /metrics HTTP/1.1\r\n\r\n", m).0,
            "404 Not Found"
        );
        assert_eq!(answer(b"\x00\xff garbage", m).0, "400 Bad Request");
        assert_eq!(answer(b"", m).0, "400 Bad Request");
    }
}
