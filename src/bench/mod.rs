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
//! The pairs measured now (`--pairs` picks kinds by the name in brackets):
//! - [cas] durable compare-and-set publishes, each publisher on its own
//!   topic, against a raw tokio-tungstenite echo of the same bytes;
//! - [postgres] the same publishes on the PostgreSQL store, with one hub
//!   process and with two on one database, against them on sled (the bench
//!   starts its own PostgreSQL server, `fsync = on`, from the machine's
//!   binaries; without them, these pairs are reported as not measured);
//! - [fanout] fan-out from one publisher to N subscribers through the hub,
//!   against a raw tokio-tungstenite broadcast of the same frames;
//! - [app] an application message end to end in a group of N devices,
//!   against raw OpenMLS encryption, every receiver's decryption and a
//!   WebSocket round trip of the ciphertext;
//! - [nats] the performance issue's pair (g): the same compare-and-set
//!   publishes against NATS JetStream's (`Nats-Expected-Last-Subject-Sequence`,
//!   file storage), once with the server's default sync (acks before fsync)
//!   and once with `sync_interval: always` (every ack after its fsync, as the
//!   hub flushes before each ack; nats-server 2.10 or later), and the hub's
//!   fan-out against core NATS fan-out at each N. The bench starts
//!   `nats-server` itself; where it is not installed, or too old for an
//!   option, the report lists those pairs as not measured.

mod app;
mod commit;
mod load;
mod memory;
mod nats;
pub mod raw;
mod report;
mod sustained;

pub use nats::NatsError;
pub use report::{Figure, NotMeasured, Report, Row};
pub use sustained::LoadStep;

use crate::hub::Limits;
use crate::testkit::{signing_key, TestHub};
use load::Slice;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A kind of pair `hubsync bench` can run; each kind runs at every size its
/// options give (every subscriber count, every group size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairKind {
    /// Durable compare-and-set publishes against a raw WebSocket echo.
    Cas,
    /// The same publishes on the PostgreSQL store (one and two hub
    /// processes) against sled.
    Postgres,
    /// Fan-out against a raw WebSocket broadcast.
    Fanout,
    /// An application message end to end against raw OpenMLS.
    App,
    /// Pair (g): compare-and-set publishes against NATS JetStream and
    /// fan-out against core NATS.
    Nats,
    /// Pair (a): a commit until every member merged it, against raw
    /// OpenMLS.
    Commit,
    /// Pair (e): a device far behind catching up, against raw OpenMLS.
    CatchUp,
    /// Pair (h): forming a group of N in one invite, against raw OpenMLS.
    Form,
    /// Pair (f): the hub's memory per idle connected device, against a raw
    /// WebSocket server's per connection.
    Memory,
    /// Pair (d): sustained load on many groups at rising offered load.
    Sustained,
}

impl PairKind {
    /// Every kind, in the order a run measures them.
    pub const ALL: [PairKind; 10] = [
        PairKind::Cas,
        PairKind::Postgres,
        PairKind::Fanout,
        PairKind::App,
        PairKind::Nats,
        PairKind::Commit,
        PairKind::CatchUp,
        PairKind::Form,
        PairKind::Memory,
        PairKind::Sustained,
    ];

    /// The name `--pairs` takes.
    pub fn name(self) -> &'static str {
        match self {
            PairKind::Cas => "cas",
            PairKind::Postgres => "postgres",
            PairKind::Fanout => "fanout",
            PairKind::App => "app",
            PairKind::Nats => "nats",
            PairKind::Commit => "commit",
            PairKind::CatchUp => "catchup",
            PairKind::Form => "form",
            PairKind::Memory => "memory",
            PairKind::Sustained => "sustained",
        }
    }
}

impl std::str::FromStr for PairKind {
    type Err = String;

    /// A kind from its [`PairKind::name`].
    fn from_str(s: &str) -> Result<Self, String> {
        PairKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = PairKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown pair {s:?} ({})", names.join(", "))
            })
    }
}

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
    /// The kinds of pair to run (all of them unless narrowed).
    pub pairs: Vec<PairKind>,
    /// The nats-server binary of the NATS pairs: a path, or a name looked
    /// up on PATH. When there is none, those pairs are reported as not
    /// measured.
    pub nats_server: PathBuf,
    /// Group sizes of the commit pairs (a), one pair each.
    pub commit_members: Vec<usize>,
    /// Group sizes of the forming pairs (h), one pair each.
    pub form_members: Vec<usize>,
    /// How many commits behind the catching-up device of pair (e) is.
    pub behind: usize,
    /// Idle devices connected for the memory pair (f).
    pub idle_devices: usize,
    /// Groups formed on a hub process to measure what one group costs it
    /// in memory and on disk (5 members, 10 messages each).
    pub footprint_groups: usize,
    /// Groups of the sustained load (d), each with its own sender.
    pub load_groups: usize,
    /// Members of each group of the sustained load.
    pub load_members: usize,
    /// The first step's offered load, in messages per second; each next
    /// step doubles it.
    pub load_start: f64,
    /// Steps at most (the steps also end once p99 passes 50 ms).
    pub load_steps: usize,
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
            pairs: PairKind::ALL.to_vec(),
            nats_server: PathBuf::from("nats-server"),
            commit_members: vec![10, 100],
            form_members: vec![10, 100],
            behind: 1000,
            idle_devices: 10_000,
            footprint_groups: 50,
            load_groups: 10,
            load_members: 5,
            load_start: 50.0,
            load_steps: 8,
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
            pairs: PairKind::ALL.to_vec(),
            nats_server: PathBuf::from("nats-server"),
            commit_members: vec![3],
            form_members: vec![3],
            behind: 5,
            idle_devices: 20,
            footprint_groups: 2,
            load_groups: 2,
            load_members: 3,
            load_start: 20.0,
            load_steps: 2,
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
    /// nats-server could not be started or set up for a NATS pair, or
    /// answered something that is not the protocol.
    #[error("NATS baseline: {0}")]
    Nats(#[from] NatsError),
}

/// Run every pair, write the report into `opts.out` (report.md,
/// summary.json, ratios.svg) and return it.
///
/// # Errors
/// As [`BenchError`]; nothing is written for a failed run.
pub async fn run(opts: &BenchOptions) -> Result<Report, BenchError> {
    let has = |k: PairKind| opts.pairs.contains(&k);
    let pairs = usize::from(has(PairKind::Cas))
        + usize::from(has(PairKind::Postgres)) * 2
        + usize::from(has(PairKind::Fanout)) * opts.subscribers.len()
        + usize::from(has(PairKind::App)) * opts.members.len()
        + usize::from(has(PairKind::Nats)) * (2 + opts.subscribers.len())
        + usize::from(has(PairKind::Commit)) * opts.commit_members.len()
        + usize::from(has(PairKind::CatchUp))
        + usize::from(has(PairKind::Form)) * opts.form_members.len()
        + usize::from(has(PairKind::Memory))
        + usize::from(has(PairKind::Sustained)) * opts.load_steps.div_ceil(2);
    let bar = progress_bar(opts.progress, (pairs * opts.rounds * 2) as u64);
    let mut rows = Vec::new();
    let mut not_measured = Vec::new();
    if has(PairKind::Cas) {
        rows.push(cas_pair(opts, &bar).await?);
    }
    if has(PairKind::Postgres) {
        postgres_pairs(opts, &bar, &mut rows, &mut not_measured).await?;
    }
    if has(PairKind::Fanout) {
        for &n in &opts.subscribers {
            rows.push(fanout_pair(opts, n, &bar).await?);
        }
    }
    if has(PairKind::App) {
        for &n in &opts.members {
            rows.push(app_pair(opts, n, &bar).await?);
        }
    }
    if has(PairKind::Nats) {
        nats_pairs(opts, &bar, &mut rows, &mut not_measured).await?;
    }
    if has(PairKind::Commit) {
        for &n in &opts.commit_members {
            rows.push(commit_pair(opts, n, &bar).await?);
        }
    }
    if has(PairKind::CatchUp) {
        rows.push(catch_up_pair(opts, &bar).await?);
    }
    if has(PairKind::Form) {
        for &n in &opts.form_members {
            rows.push(form_pair(opts, n, &bar).await?);
        }
    }
    let mut footprint = Vec::new();
    if has(PairKind::Memory) {
        match crate::process::hubsync_exe() {
            Some(exe) => {
                rows.push(memory_pair(opts, &exe, &bar).await?);
                footprint.push(group_footprint(opts, &exe).await?);
            }
            None => {
                not_measured.push(NotMeasured::new(
                    memory_work(opts),
                    "the hub and raw servers run as processes of the hubsync binary: \
                     run it as `hubsync bench`",
                    None,
                ));
                bar.inc((opts.rounds * 2) as u64);
            }
        }
    }
    let load = if has(PairKind::Sustained) {
        sustained_load(opts, &bar).await?
    } else {
        Vec::new()
    };
    bar.finish_and_clear();
    let mut report = Report::new(rows, not_measured, opts);
    report.load = load;
    report.footprint = footprint;
    report.write(&opts.out)?;
    Ok(report)
}

/// A fresh bench hub with one group of `n` devices on it: the setup of
/// every pair over a group.
///
/// # Errors
/// `Setup` when the hub cannot start or the group cannot be formed.
async fn hub_with_group(n: usize) -> Result<(TestHub, app::HubGroup), BenchError> {
    let hub = bench_hub().await?;
    let group = app::HubGroup::form(&hub, n)
        .await
        .map_err(|e| BenchError::Setup(format!("hub group: {e}")))?;
    Ok((hub, group))
}

/// The same group of `n` in raw OpenMLS.
///
/// # Errors
/// `Setup` when OpenMLS or the echo server fails.
async fn raw_group(n: usize) -> Result<app::RawGroup, BenchError> {
    app::RawGroup::form(n)
        .await
        .map_err(|e| BenchError::Setup(format!("raw group: {e}")))
}

/// Close a group's devices, then stop its hub.
async fn close_group(hub: TestHub, group: app::HubGroup) {
    group.close().await;
    hub.stop().await;
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

/// The PostgreSQL store's durable compare-and-set publishes, with one hub
/// process and with two on the same database (the publishers split between
/// them), against the same publishes on sled, on a PostgreSQL server of the
/// bench's own with `fsync = on` (so both sides flush before every ack).
async fn postgres_pairs(
    opts: &BenchOptions,
    bar: &indicatif::ProgressBar,
    rows: &mut Vec<Row>,
    not_measured: &mut Vec<NotMeasured>,
) -> Result<(), BenchError> {
    let work = |processes: usize| {
        format!(
            "durable CAS publishes, {} publishers, own topics, {} B, PostgreSQL store, \
             {processes} hub process{}, vs sled",
            opts.publishers,
            opts.payload,
            if processes == 1 { "" } else { "es" }
        )
    };
    let server = match crate::testkit::TestPostgres::start_durable() {
        Ok(server) => server,
        Err(e) => {
            let reason = format!("no PostgreSQL server: {e}");
            for processes in [1, 2] {
                not_measured.push(NotMeasured::new(work(processes), &reason, None));
            }
            bar.inc((opts.rounds * 2 * 2) as u64);
            return Ok(());
        }
    };
    let setup = |what: &str, e: std::io::Error| BenchError::Setup(format!("{what}: {e}"));
    let url = server
        .database()
        .await
        .map_err(|e| setup("PostgreSQL database", e))?;
    let unthrottled = |c: &mut crate::hub::HubConfig| c.limits = Limits::unthrottled();
    let first = TestHub::start_on_database(&url, &crate::hub::PgOptions::default(), unthrottled)
        .await
        .map_err(|e| setup("hub on PostgreSQL", e))?;
    let second = TestHub::start_beside(&first, unthrottled)
        .await
        .map_err(|e| setup("second hub on PostgreSQL", e))?;
    let sled = bench_hub().await?;
    let sled_pubs = clients(&sled, 1, opts.publishers).await?;
    let (payload, len) = (opts.payload, opts.slice);
    for processes in [1usize, 2] {
        let on_second = if processes == 2 {
            opts.publishers / 2
        } else {
            0
        };
        let first_key = 1_000_000 * processes as u64;
        let mut pubs = clients(&first, first_key, opts.publishers - on_second).await?;
        pubs.extend(clients(&second, first_key + 500_000, on_second).await?);
        let (base, hub) = alternate(
            &work(processes),
            opts.rounds,
            bar,
            async || load::cas_publishes(&sled_pubs, payload, len).await,
            async || load::cas_publishes(&pubs, payload, len).await,
        )
        .await?;
        rows.push(Row::new(
            work(processes),
            Figure::rate("publishes/s", &hub),
            Figure::rate("publishes/s (sled store)", &base),
            None,
        ));
    }
    first.stop().await;
    second.stop().await;
    sled.stop().await;
    drop(server);
    Ok(())
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
    let (hub, group) = hub_with_group(n).await?;
    let mut raw_group = raw_group(n).await?;
    let (payload, len) = (opts.payload, opts.slice);
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || app::raw_messages(&mut raw_group, payload, len).await,
        async || app::hub_messages(&group, payload, len).await,
    )
    .await?;
    close_group(hub, group).await;
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

/// Pair (g): the hub against NATS. Pushes a row per measured pair and a
/// [`NotMeasured`] per pair this machine's nats-server cannot run.
async fn nats_pairs(
    opts: &BenchOptions,
    bar: &indicatif::ProgressBar,
    rows: &mut Vec<Row>,
    not_measured: &mut Vec<NotMeasured>,
) -> Result<(), BenchError> {
    let steps = (opts.rounds * 2) as u64;
    let cas_work = |against: &str| {
        format!(
            "durable CAS publishes, {} publishers, own topics, {} B, vs {against}",
            opts.publishers, opts.payload
        )
    };
    let default_work = cas_work("JetStream, default sync (acks before fsync)");
    let always_work = cas_work("JetStream, sync_interval: always (every ack after its fsync)");
    let fanout_work = |n: usize| {
        format!(
            "fan-out, 1 publisher to {n} subscribers, {} B, vs core NATS",
            opts.payload
        )
    };
    let Some(binary) = nats::locate(&opts.nats_server) else {
        let reason = format!("{} not installed", opts.nats_server.display());
        not_measured.push(NotMeasured::new(default_work, &reason, None));
        not_measured.push(NotMeasured::new(always_work, &reason, Some(1.0)));
        for &n in &opts.subscribers {
            not_measured.push(NotMeasured::new(fanout_work(n), &reason, Some(1.0)));
        }
        bar.inc(steps * (2 + opts.subscribers.len() as u64));
        return Ok(());
    };
    let version = nats::server_version(&binary).await;
    rows.push(
        jetstream_pair(
            opts,
            bar,
            &binary,
            &version,
            nats::Durability::DefaultSync,
            default_work,
        )
        .await?,
    );
    match jetstream_pair(
        opts,
        bar,
        &binary,
        &version,
        nats::Durability::SyncAlways,
        always_work.clone(),
    )
    .await
    {
        Ok(row) => rows.push(row),
        // Debian's nats-server is 2.9: `sync_interval` came in 2.10. That
        // is this machine's limit, not a failure of the run.
        Err(BenchError::Nats(NatsError::Unsupported(said))) => {
            not_measured.push(NotMeasured::new(
                always_work,
                &format!(
                    "nats-server {version} cannot fsync before each ack ({said}; \
                     sync_interval: always needs 2.10 or later)"
                ),
                Some(1.0),
            ));
            bar.inc(steps);
        }
        Err(e) => return Err(e),
    }
    for &n in &opts.subscribers {
        rows.push(core_fanout_pair(opts, n, bar, &binary, &version, fanout_work(n)).await?);
    }
    Ok(())
}

/// The hub's durable compare-and-set publishes against JetStream's, each
/// publisher on its own topic / subject, one publish at a time.
async fn jetstream_pair(
    opts: &BenchOptions,
    bar: &indicatif::ProgressBar,
    binary: &Path,
    version: &str,
    durability: nats::Durability,
    work: String,
) -> Result<Row, BenchError> {
    // NATS first: a server that cannot run this durability ends the pair
    // before the hub is set up for nothing.
    let server = nats::NatsServer::start(binary, durability).await?;
    let mut js = nats::JetStreamCas::start(&server, opts.publishers).await?;
    let hub = bench_hub().await?;
    let pubs = clients(&hub, 1, opts.publishers).await?;
    let (payload, len) = (opts.payload, opts.slice);
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || nats::jetstream_cas(&mut js, payload, len).await,
        async || load::cas_publishes(&pubs, payload, len).await,
    )
    .await?;
    hub.stop().await;
    drop(js);
    drop(server);
    let (unit, target) = match durability {
        nats::Durability::DefaultSync => (
            format!("publishes/s (JetStream {version}, file storage, acks before fsync)"),
            // The target is against acks after the flush only.
            None,
        ),
        nats::Durability::SyncAlways => (
            format!("publishes/s (JetStream {version}, file storage, every ack after its fsync)"),
            Some(1.0),
        ),
    };
    Ok(Row::new(
        work,
        Figure::rate("publishes/s", &h),
        Figure::rate(&unit, &b),
        target,
    ))
}

/// The hub's fan-out to `n` subscribers (the same side as
/// [`fanout_pair`]'s) against core NATS fan-out to `n` subscribers.
async fn core_fanout_pair(
    opts: &BenchOptions,
    n: usize,
    bar: &indicatif::ProgressBar,
    binary: &Path,
    version: &str,
    work: String,
) -> Result<Row, BenchError> {
    let server = nats::NatsServer::start(binary, nats::Durability::DefaultSync).await?;
    let nats_subs = nats::CoreSubscribers::start(&server, n).await?;
    let mut nats_pub = nats::fanout_publisher(&server).await?;
    let hub = bench_hub().await?;
    let publisher = clients(&hub, 1_000_000, 1).await?.remove(0);
    let subs = load::HubSubscribers::start(clients(&hub, 2_000_000, n).await?)
        .await
        .map_err(BenchError::Setup)?;
    let (payload, len) = (opts.payload, opts.slice);
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || nats::core_fanout(&mut nats_pub, &nats_subs, payload, len).await,
        async || load::hub_fanout(&publisher, &subs, payload, len).await,
    )
    .await?;
    drop(subs);
    hub.stop().await;
    drop(nats_subs);
    drop(server);
    Ok(Row::new(
        work,
        Figure::rate("deliveries/s", &h),
        Figure::rate(&format!("deliveries/s (core NATS {version})"), &b),
        Some(1.0),
    ))
}

/// Pair (a): `rotate_keys` in a group of `n` until every member merged it,
/// against the raw OpenMLS work of the same commit.
async fn commit_pair(
    opts: &BenchOptions,
    n: usize,
    bar: &indicatif::ProgressBar,
) -> Result<Row, BenchError> {
    let n = n.max(2);
    let work = format!("commit (rotate_keys) until all {n} members merged, group of {n}");
    let (hub, group) = hub_with_group(n).await?;
    let mut raw_group = raw_group(n).await?;
    let len = opts.slice;
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || commit::raw_commits(&mut raw_group, len).await,
        async || commit::hub_commits(&group, len).await,
    )
    .await?;
    close_group(hub, group).await;
    Ok(Row::new(
        work,
        Figure::rate("commits/s", &h),
        Figure::rate(
            "commits/s (OpenMLS commit + merge, every receiver's process + merge)",
            &b,
        ),
        // The target is on time (at most 1.25 times the raw work); one
        // commit at a time, the rate ratio is its inverse.
        Some(1.0 / 1.25),
    ))
}

/// Pair (e): a device `opts.behind` commits behind catching up, against
/// raw OpenMLS processing the same number of commits.
async fn catch_up_pair(
    opts: &BenchOptions,
    bar: &indicatif::ProgressBar,
) -> Result<Row, BenchError> {
    let k = opts.behind.max(1);
    let work = format!("a device {k} commits behind, from reopening until it merged the last");
    let (hub, mut group) = hub_with_group(2).await?;
    let mut raw_group = raw_group(2).await?;
    let len = opts.slice;
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || commit::raw_catch_up(&mut raw_group, k, len).await,
        async || commit::hub_catch_up(&mut group, k, len).await,
    )
    .await?;
    close_group(hub, group).await;
    Ok(Row::new(
        work,
        Figure::rate("catch-ups/s", &h),
        Figure::rate("catch-ups/s (OpenMLS process + merge of each commit)", &b),
        Some(0.9),
    ))
}

/// Pair (h): forming a group of `n` (create, one `invite_many`, every
/// joiner joined) against the raw OpenMLS work of the same.
async fn form_pair(
    opts: &BenchOptions,
    n: usize,
    bar: &indicatif::ProgressBar,
) -> Result<Row, BenchError> {
    let n = n.max(2);
    let work = format!("forming a group of {n} (create + invite_many of {})", n - 1);
    let (hub, group) = hub_with_group(n).await?;
    let len = opts.slice;
    let (b, h) = alternate(
        &work,
        opts.rounds,
        bar,
        async || commit::raw_forming(n, len).await,
        async || commit::hub_forming(&group, len).await,
    )
    .await?;
    close_group(hub, group).await;
    Ok(Row::new(
        work,
        Figure::rate("groups/s", &h),
        Figure::rate(
            "groups/s (OpenMLS create + add all in one commit + every Welcome)",
            &b,
        ),
        Some(1.0 / 1.5),
    ))
}

fn memory_work(opts: &BenchOptions) -> String {
    format!(
        "resident memory per idle connected device, {} devices",
        opts.idle_devices
    )
}

/// Pair (f): the hub's resident memory per idle connected device against a
/// raw WebSocket server's per idle connection, each server a process of
/// its own, measured `opts.rounds` times each. Reported as devices held
/// per MiB, so that, like every other row, higher is better.
async fn memory_pair(
    opts: &BenchOptions,
    exe: &Path,
    bar: &indicatif::ProgressBar,
) -> Result<Row, BenchError> {
    let work = memory_work(opts);
    let n = opts.idle_devices.max(1);
    let fail = |reason: String| BenchError::Work {
        work: work.clone(),
        reason,
    };
    let (mut hub, mut raw) = (Vec::new(), Vec::new());
    bar.set_message(work.clone());
    for _ in 0..opts.rounds {
        raw.push(memory::raw_per_connection(exe, n).await.map_err(fail)?);
        bar.inc(1);
        hub.push(memory::hub_per_device(exe, n).await.map_err(fail)?);
        bar.inc(1);
    }
    let figure = |unit: &str, per: &[memory::PerConnection]| {
        let rates: Vec<f64> = per
            .iter()
            .map(|p| (1 << 20) as f64 / p.bytes_per_connection.max(1.0))
            .collect();
        let mean_bytes =
            per.iter().map(|p| p.bytes_per_connection).sum::<f64>() / per.len().max(1) as f64;
        Figure {
            unit: format!("{unit} per MiB ({:.1} KiB each)", mean_bytes / 1024.0),
            rate: (1 << 20) as f64 / mean_bytes.max(1.0),
            p50_us: None,
            p99_us: None,
            slice_rates: rates,
        }
    };
    Ok(Row::new(
        work,
        figure("idle devices", &hub),
        figure("idle connections (tokio-tungstenite)", &raw),
        // The target is absolute (at most 64 KiB per device), not a ratio.
        None,
    ))
}

/// Pair (d): `opts.load_groups` groups of `opts.load_members` devices on one
/// hub, offered load doubling from `opts.load_start` messages per second
/// until the 99th percentile latency passes 50 ms, deliveries fall short,
/// or `opts.load_steps` steps ran.
async fn sustained_load(
    opts: &BenchOptions,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<LoadStep>, BenchError> {
    let work = format!(
        "sustained load, {} groups of {} on one hub",
        opts.load_groups, opts.load_members
    );
    bar.set_message(work.clone());
    let hub = bench_hub().await?;
    let mut groups = Vec::with_capacity(opts.load_groups);
    for _ in 0..opts.load_groups.max(1) {
        groups.push(
            app::HubGroup::form(&hub, opts.load_members.max(2))
                .await
                .map_err(|e| BenchError::Setup(format!("hub group: {e}")))?,
        );
    }
    let mut steps = Vec::new();
    let mut offered = opts.load_start.max(1.0);
    for i in 0..opts.load_steps.max(1) {
        let step = sustained::step(&groups, offered, opts.slice)
            .await
            .map_err(|reason| BenchError::Work {
                work: work.clone(),
                reason,
            })?;
        if i % 2 == 1 {
            bar.inc(1);
        }
        let past = step.p99_us > sustained::P99_LIMIT.as_micros() as u64
            // Saturated: what was due did not arrive within the drain.
            || step.deliveries * 10 < step.expected * 9;
        steps.push(step);
        if past {
            break;
        }
        offered *= 2.0;
    }
    for g in groups {
        g.close().await;
    }
    hub.stop().await;
    Ok(steps)
}

/// What one more group costs a hub process, in memory and on disk: a
/// sentence for the report's footprint list.
async fn group_footprint(opts: &BenchOptions, exe: &Path) -> Result<String, BenchError> {
    let (members, messages) = (5, 10);
    let groups = opts.footprint_groups.max(1);
    let per = memory::hub_per_group(exe, groups, members, messages)
        .await
        .map_err(|reason| BenchError::Work {
            work: "hub memory and disk per group".into(),
            reason,
        })?;
    Ok(format!(
        "per group on the hub ({groups} groups of {members} devices, {messages} messages of \
         256 B each): {:.1} KiB of resident memory, {:.1} KiB of store on disk",
        per.memory_bytes / 1024.0,
        per.disk_bytes / 1024.0
    ))
}
