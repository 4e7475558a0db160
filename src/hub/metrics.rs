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
use crate::prom::{Kind, PromText};
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
    use Kind::{Counter, Gauge};
    let mut t = PromText::new("hubsync_hub_");
    t.one(
        "connections_total",
        Counter,
        "Connections accepted since start.",
        m.connections,
    );
    t.one(
        "open_connections",
        Gauge,
        "Connections open now.",
        m.open_connections,
    );
    t.one(
        "unauthenticated_connections",
        Gauge,
        "Connections open now that have not authenticated.",
        m.unauthenticated,
    );
    t.one(
        "subscription_changes_total",
        Counter,
        "Subscription changes asked for, refused ones included (a reconnecting device subscribes again).",
        m.subscription_changes,
    );
    t.one(
        "receive_starts_total",
        Counter,
        "Receive streams started (one per device connection).",
        m.receive_starts,
    );
    t.labelled(
        "auth_failures_total",
        Counter,
        "Authentications refused, by the error the device was told.",
        "reason",
        &m.auth_failures_by_reason.by_reason(),
    );
    t.one(
        "auth_timeouts_total",
        Counter,
        "Connections closed for not authenticating in time.",
        m.auth_timeouts,
    );
    t.one(
        "unauthenticated_refused_total",
        Counter,
        "Connections closed at once because too many others had not authenticated.",
        m.unauthenticated_refused,
    );
    t.one(
        "bad_frames_total",
        Counter,
        "Frames refused as malformed, oversized, unknown, text, or before authentication.",
        m.bad_frames,
    );
    t.labelled(
        "publishes_total",
        Counter,
        "Publishes answered, by outcome.",
        "outcome",
        &[
            ("accepted", m.accepted),
            ("duplicate", m.duplicates),
            ("head_mismatch", m.head_mismatches),
            ("conflict", m.conflicts),
            ("history_missing", m.history_missing),
            ("mailbox_full", m.mailbox_full),
            ("quota_exceeded", m.quota_refusals),
        ],
    );
    t.labelled(
        "rate_limited_total",
        Counter,
        "Requests refused with RateLimited, by the scope of the empty bucket.",
        "scope",
        &m.rate_limited.by_scope(),
    );
    t.one(
        "not_authorized_total",
        Counter,
        "Requests refused with NotAuthorized.",
        m.not_authorized,
    );
    t.one(
        "deliveries_pushed_total",
        Counter,
        "Deliveries pushed on receive streams.",
        m.deliveries_pushed,
    );
    t.one(
        "deliveries_acked_total",
        Counter,
        "Pushed deliveries that devices acknowledged.",
        m.deliveries_acked,
    );
    t.one(
        "frames_missed_total",
        Counter,
        "Times a receive stream found log frames trimmed before it reached them.",
        m.frames_missed,
    );
    t.one(
        "cursor_save_failures_total",
        Counter,
        "Times a receive stream could not save its cursors (frames are pushed again).",
        m.cursor_save_failures,
    );
    t.one(
        "announcements_total",
        Counter,
        "Frames other hub processes on the store announced to this one.",
        m.announcements,
    );
    t.one(
        "announcement_gaps_total",
        Counter,
        "Times announcements may have been missed (or were swept for) and every stream read its topics again.",
        m.announcement_gaps,
    );
    t.one(
        "bad_announcements_total",
        Counter,
        "Text on the announcement channel that was not an announcement.",
        m.bad_announcements,
    );
    t.one(
        "store_commits_total",
        Counter,
        "Store flushes (sled, group commit) or database commits (PostgreSQL) that made data durable.",
        m.flushes,
    );
    t.one(
        "store_conflict_retries_total",
        Counter,
        "Calls run again because their store transaction conflicted with another's.",
        m.conflict_retries,
    );
    t.histogram(
        "store_commit_seconds",
        "How long store commits took (PostgreSQL: round trip and WAL flush; sled: applying the batch).",
        &m.commit_latency,
    );
    t.histogram(
        "store_durable_wait_seconds",
        "How long waits for durability took (sled: the group-commit flush; PostgreSQL: none).",
        &m.durable_latency,
    );
    t.one(
        "receive_streams",
        Gauge,
        "Receive streams open now.",
        m.receive_streams,
    );
    t.one(
        "unacked_deliveries",
        Gauge,
        "Deliveries pushed on open streams and not acknowledged yet.",
        m.unacked_deliveries,
    );
    if let Some(bytes) = m.store_bytes {
        t.one(
            "store_bytes",
            Gauge,
            "Bytes the store takes, as last sampled.",
            bytes,
        );
    }
    t.one(
        "trimmed_frames_total",
        Counter,
        "Log frames trimmed by depth or retention.",
        m.trimmed,
    );
    t.finish()
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
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            } else if !line.starts_with("# HELP ") {
                let (name, value) = line.rsplit_once(' ').unwrap();
                assert!(name.starts_with("hubsync_hub_"), "{line}");
                // Counts are integers; a histogram's sum is in seconds.
                if name.ends_with("_sum") {
                    value.parse::<f64>().unwrap();
                } else {
                    value.parse::<u64>().unwrap();
                }
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
