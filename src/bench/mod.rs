//! `hubsync bench`: what hubsync's work costs, each figure divided by a
//! baseline measured in the same run, on the same cores.
//!
//! Why ratios: these machines are shared and noisy, so an absolute figure
//! from one run says little about the next. Each pair runs its two sides in
//! alternating slices (baseline first in even rounds, hubsync first in odd
//! ones) so both see the same machine, and the report gives the ratio of
//! their totals next to the figures. Nothing here asserts a time: the
//! figures are for people and for docs/performance.md.
//!
//! The pairs measured now:
//! - durable compare-and-set publishes, each publisher on its own topic,
//!   against a raw tokio-tungstenite echo of the same bytes;
//! - fan-out from one publisher to N subscribers through the hub, against
//!   a raw tokio-tungstenite broadcast of the same frames;
//! - an application message end to end in a group of N devices, against
//!   raw OpenMLS encryption, every receiver's decryption and a WebSocket
//!   round trip of the ciphertext.

mod app;
mod load;
pub mod raw;
mod report;

pub use report::{Figure, Report, Row};

use crate::hub::Limits;
use crate::testkit::{signing_key, TestHub};
use load::Slice;
use std::path::PathBuf;
use std::time::Duration;

/// What to measure, and how long.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Concurrent compare-and-set publishers.
    pub publishers: usize,
    /// Subscriber counts of the fan-out pairs, one pair each.
    pub subscribers: Vec<usize>,
    /// Group sizes of the application message pairs, one pair each.
    pub members: Vec<usize>,
    /// Payload bytes of every frame.
    pub payload: usize,
    /// Length of one slice.
    pub slice: Duration,
    /// Slices per side of each pair.
    pub rounds: usize,
    /// Where the report goes (created if missing).
    pub out: PathBuf,
    /// Draw a progress bar on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
}

impl BenchOptions {
    /// The sizes of docs/performance.md: 64 publishers, fan-out to 10 and
    /// 100, 1 KiB frames, five 2-second slices per side.
    pub fn full(out: PathBuf) -> Self {
        Self {
            publishers: 64,
            subscribers: vec![10, 100],
            members: vec![10],
            payload: 1024,
            slice: Duration::from_secs(2),
            rounds: 5,
            out,
            progress: true,
        }
    }

    /// A smoke size for CI: every pair runs, briefly, so the bench cannot
    /// rot; its figures mean little.
    pub fn smoke(out: PathBuf) -> Self {
        Self {
            publishers: 4,
            subscribers: vec![3],
            members: vec![3],
            payload: 256,
            slice: Duration::from_millis(200),
            rounds: 1,
            out,
            progress: false,
        }
    }
}

/// Why a bench run stopped.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A server, client or socket could not be set up.
    #[error("bench setup failed: {0}")]
    Setup(String),
    /// A measured operation failed: the figure would be wrong, so none is
    /// given. The text names the work.
    #[error("{work}: {reason}")]
    Work {
        /// Which pair.
        work: String,
        /// What failed.
        reason: String,
    },
    /// The report could not be written.
    #[error("cannot write the report: {0}")]
    Report(#[from] std::io::Error),
}

/// Run every pair, write the report into `opts.out` (report.md,
/// summary.json, ratios.svg) and return it.
///
/// # Errors
/// As [`BenchError`]; nothing is written for a failed run.
pub async fn run(opts: &BenchOptions) -> Result<Report, BenchError> {
    let steps = (1 + opts.subscribers.len() + opts.members.len()) * opts.rounds * 2;
    let bar = progress_bar(opts.progress, steps as u64);
    let mut rows = Vec::new();
    rows.push(cas_pair(opts, &bar).await?);
    for &n in &opts.subscribers {
        rows.push(fanout_pair(opts, n, &bar).await?);
    }
    for &n in &opts.members {
        rows.push(app_pair(opts, n, &bar).await?);
    }
    bar.finish_and_clear();
    let report = Report::new(rows, opts);
    report.write(&opts.out)?;
    Ok(report)
}

fn progress_bar(show: bool, steps: u64) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// A hub on loopback over a fresh sled store, with rates and quotas that
/// never trigger (a bench measures the work, not the limiter).
async fn bench_hub() -> Result<TestHub, BenchError> {
    TestHub::start_with(|c| c.limits = Limits::unthrottled())
        .await
        .map_err(|e| BenchError::Setup(format!("hub: {e}")))
}

async fn clients(
    hub: &TestHub,
    first: u64,
    n: usize,
) -> Result<Vec<crate::client::HubClient>, BenchError> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n as u64 {
        out.push(
            hub.client(&signing_key(first + i))
                .await
                .map_err(|e| BenchError::Setup(format!("client: {e}")))?,
        );
    }
    Ok(out)
}

/// Alternate `baseline` and `hub` slices for `rounds` rounds.
async fn alternate<B, H>(
    work: &str,
    rounds: usize,
    bar: &indicatif::ProgressBar,
    mut baseline: B,
    mut hub: H,
) -> Result<(Vec<Slice>, Vec<Slice>), BenchError>
where
    B: AsyncFnMut() -> Result<Slice, String>,
    H: AsyncFnMut() -> Result<Slice, String>,
{
    let fail = |reason: String| BenchError::Work {
        work: work.to_string(),
        reason,
    };
    let (mut b, mut h) = (Vec::new(), Vec::new());
    bar.set_message(work.to_string());
    for round in 0..rounds {
        if round % 2 == 0 {
            b.push(baseline().await.map_err(fail)?);
            bar.inc(1);
            h.push(hub().await.map_err(fail)?);
        } else {
            h.push(hub().await.map_err(fail)?);
            bar.inc(1);
            b.push(baseline().await.map_err(fail)?);
        }
        bar.inc(1);
    }
    Ok((b, h))
}

async fn cas_pair(opts: &BenchOptions, bar: &indicatif::ProgressBar) -> Result<Row, BenchError> {
    let work = format!(
        "durable CAS publishes, {} publishers, own topics, {} B",
        opts.publishers, opts.payload
    );
    let hub = bench_hub().await?;
    let pubs = clients(&hub, 1, opts.publishers).await?;
    let echo = raw::EchoServer::start()
        .await
        .map_err(|e| BenchError::Setup(format!("echo server: {e}")))?;
    let mut sockets = Vec::with_capacity(opts.publishers);
    for _ in 0..opts.publishers {
        sockets.push(raw::dial(&echo.url()).await.map_err(BenchError::Setup)?);
    }
    let (payload, len) = (opts.payload, opts.slice);
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || load::echo_round_trips(&mut sockets, payload, len).await,
        async || load::cas_publishes(&pubs, payload, len).await,
    )
    .await?;
    hub.stop().await;
    Ok(Row::new(
        work,
        Figure::rate("publishes/s", &h),
        Figure::rate("round trips/s (tokio-tungstenite echo)", &b),
        // Its target is against NATS JetStream, not yet measured here.
        None,
    ))
}

async fn fanout_pair(
    opts: &BenchOptions,
    n: usize,
    bar: &indicatif::ProgressBar,
) -> Result<Row, BenchError> {
    let work = format!(
        "fan-out, 1 publisher to {n} subscribers, {} B",
        opts.payload
    );
    let hub = bench_hub().await?;
    let publisher = clients(&hub, 1_000_000, 1).await?.remove(0);
    let subs = load::HubSubscribers::start(clients(&hub, 2_000_000, n).await?)
        .await
        .map_err(BenchError::Setup)?;
    let server = raw::BroadcastServer::start()
        .await
        .map_err(|e| BenchError::Setup(format!("broadcast server: {e}")))?;
    let raw_subs = load::RawSubscribers::start(&server.url(), n)
        .await
        .map_err(BenchError::Setup)?;
    let mut raw_pub = raw::dial(&server.url()).await.map_err(BenchError::Setup)?;
    {
        use futures::SinkExt;
        raw_pub
            .send(tokio_tungstenite::tungstenite::Message::binary(
                raw::ROLE_PUBLISHER,
            ))
            .await
            .map_err(|e| BenchError::Setup(e.to_string()))?;
    }
    let (payload, len) = (opts.payload, opts.slice);
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || load::raw_fanout(&mut raw_pub, &raw_subs, payload, len).await,
        async || load::hub_fanout(&publisher, &subs, payload, len).await,
    )
    .await?;
    drop(subs);
    hub.stop().await;
    Ok(Row::new(
        work,
        Figure::rate("deliveries/s", &h),
        Figure::rate("deliveries/s (tokio-tungstenite broadcast)", &b),
        Some(0.7),
    ))
}

async fn app_pair(
    opts: &BenchOptions,
    n: usize,
    bar: &indicatif::ProgressBar,
) -> Result<Row, BenchError> {
    let n = n.max(2);
    let work = format!(
        "app message until all {} others received, group of {n}, {} B",
        n - 1,
        opts.payload
    );
    let hub = bench_hub().await?;
    let group = app::HubGroup::form(&hub, n)
        .await
        .map_err(|e| BenchError::Setup(format!("hub group: {e}")))?;
    let mut raw_group = app::RawGroup::form(n)
        .await
        .map_err(|e| BenchError::Setup(format!("raw group: {e}")))?;
    let (payload, len) = (opts.payload, opts.slice);
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || app::raw_messages(&mut raw_group, payload, len).await,
        async || app::hub_messages(&group, payload, len).await,
    )
    .await?;
    group.close().await;
    hub.stop().await;
    Ok(Row::new(
        work,
        Figure::rate("messages/s", &h),
        Figure::rate(
            "messages/s (OpenMLS encrypt + decrypts + WebSocket round trip)",
            &b,
        ),
        // The target is on latency (at most 1.5 times the raw
        // work); one message at a time, the rate ratio is its inverse.
        Some(1.0 / 1.5),
    ))
}
