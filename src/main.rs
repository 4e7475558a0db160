//! The `hubsync` binary: run a hub, the end-to-end demo, or the bench.

mod demo;
mod device_cli;

use clap::{Parser, Subcommand, ValueEnum};
use hubsync::clock::Clock;
use hubsync::hub::{
    Announce, Hub, HubConfig, HubStore, KvHubStore, Limits, PgHubStore, PgOptions, Rate,
};
use hubsync::kv::{KvStore, SledKv};
use hubsync::rng::SharedRng;
use hubsync::transport::{server_config_from_pem, TcpAcceptor, TlsListener};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "hubsync",
    version,
    about = "End-to-end encrypted group sync over MLS"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a hub: a group-blind relay storing opaque frames.
    Hub(HubArgs),
    /// Two real hubs and five devices on loopback, end to end.
    Demo,
    /// Run a real device from the terminal: one command per run, JSON out
    /// (see `hubsync device --help`).
    Device(device_cli::DeviceArgs),
    /// Measure hubsync against raw baselines in the same run (see
    /// docs/performance.md).
    Bench(BenchArgs),
    /// Run a hub (a child process) and many devices for a while, under load
    /// and random faults, sampling both sides' memory and open files; fails
    /// if either grows, deliveries stall or the groups end unconverged (see
    /// docs/operations.md).
    Soak(SoakArgs),
    /// A raw tokio-tungstenite echo server on a free loopback port, until
    /// killed: the baseline process of the bench's memory pair.
    #[command(hide = true)]
    BenchRawServer,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Where the report goes (report.md, summary.json, ratios.svg).
    #[arg(long, default_value = "bench-report")]
    report: PathBuf,
    /// A few seconds at small sizes, to check that every pair runs (CI).
    #[arg(long)]
    smoke: bool,
    /// Concurrent compare-and-set publishers.
    #[arg(long)]
    publishers: Option<usize>,
    /// Subscriber counts of the fan-out pairs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    subscribers: Option<Vec<usize>>,
    /// Group sizes of the application message pairs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    members: Option<Vec<usize>>,
    /// Payload bytes of every frame.
    #[arg(long)]
    payload: Option<usize>,
    /// Milliseconds per slice.
    #[arg(long)]
    slice_ms: Option<u64>,
    /// Slices per side of each pair.
    #[arg(long)]
    rounds: Option<usize>,
    /// Only these kinds of pair, comma-separated: cas, fanout, app, nats
    /// (all of them by default).
    #[arg(long, value_delimiter = ',')]
    pairs: Option<Vec<hubsync::bench::PairKind>>,
    /// The nats-server binary of the NATS pairs (a path, or a name looked
    /// up on PATH); without one they are reported as not measured.
    #[arg(long)]
    nats_server: Option<PathBuf>,
    /// Group sizes of the commit pairs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    commit_members: Option<Vec<usize>>,
    /// Group sizes of the forming pairs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    form_members: Option<Vec<usize>>,
    /// Commits the catching-up device is behind.
    #[arg(long)]
    behind: Option<usize>,
    /// Idle devices connected for the memory pair.
    #[arg(long)]
    idle_devices: Option<usize>,
    /// Groups of the sustained load, each with its own sender.
    #[arg(long)]
    load_groups: Option<usize>,
    /// Members of each group of the sustained load.
    #[arg(long)]
    load_members: Option<usize>,
    /// The sustained load's first offered rate (messages/s); each step
    /// doubles it.
    #[arg(long)]
    load_start: Option<f64>,
}

impl BenchArgs {
    fn options(&self) -> hubsync::bench::BenchOptions {
        let mut o = if self.smoke {
            hubsync::bench::BenchOptions::smoke(self.report.clone())
        } else {
            hubsync::bench::BenchOptions::full(self.report.clone())
        };
        if let Some(n) = self.publishers {
            o.publishers = n;
        }
        if let Some(s) = &self.subscribers {
            o.subscribers = s.clone();
        }
        if let Some(m) = &self.members {
            o.members = m.clone();
        }
        if let Some(p) = self.payload {
            o.payload = p;
        }
        if let Some(ms) = self.slice_ms {
            o.slice = Duration::from_millis(ms);
        }
        if let Some(r) = self.rounds {
            o.rounds = r.max(1);
        }
        if let Some(p) = &self.pairs {
            o.pairs = p.clone();
        }
        if let Some(n) = &self.nats_server {
            o.nats_server = n.clone();
        }
        if let Some(m) = &self.commit_members {
            o.commit_members = m.clone();
        }
        if let Some(m) = &self.form_members {
            o.form_members = m.clone();
        }
        if let Some(k) = self.behind {
            o.behind = k;
        }
        if let Some(n) = self.idle_devices {
            o.idle_devices = n;
        }
        if let Some(n) = self.load_groups {
            o.load_groups = n;
        }
        if let Some(n) = self.load_members {
            o.load_members = n;
        }
        if let Some(r) = self.load_start {
            o.load_start = r;
        }
        o
    }
}

#[derive(clap::Args)]
struct SoakArgs {
    /// How long the load and the faults run: 90s, 10m, 1h.
    #[arg(long, default_value = "10m", value_parser = hubsync::soak::parse_duration)]
    duration: Duration,
    /// Devices in all.
    #[arg(long, default_value_t = 24)]
    devices: usize,
    /// Groups the devices are dealt into.
    #[arg(long, default_value_t = 4)]
    groups: usize,
    /// Where the report goes (samples.csv, report.md, summary.json, hub.log).
    #[arg(long, default_value = "soak-report")]
    report: PathBuf,
    /// Seed of the run's draws (which device, which group, when); printed
    /// when drawn from the clock.
    #[arg(long)]
    seed: Option<u64>,
    /// Time between samples.
    #[arg(long, default_value = "10s", value_parser = hubsync::soak::parse_duration)]
    sample_every: Duration,
    /// Application messages per second, all groups together.
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
}

async fn soak(args: &SoakArgs) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let mut opts = hubsync::soak::SoakOptions::new(exe, args.duration, args.report.clone());
    opts.devices = args.devices;
    opts.groups = args.groups.max(1);
    opts.sample_every = args.sample_every.max(Duration::from_millis(100));
    opts.rate = args.rate;
    opts.seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1)
    });
    let summary = hubsync::soak::run(&opts).await.map_err(|e| e.to_string())?;
    for j in &summary.judgements {
        println!("soak: {}", j.sentence());
    }
    println!("report written to {}", opts.report.display());
    if summary.passed {
        println!("soak: passed");
        Ok(())
    } else {
        Err(format!("soak failed: {}", summary.failures.join("; ")))
    }
}

async fn raw_server() -> Result<(), String> {
    let server = hubsync::bench::raw::EchoServer::start()
        .await
        .map_err(|e| format!("cannot listen: {e}"))?;
    // The bench reads this line to learn the port.
    println!(
        "raw echo listening on {}",
        server.url().trim_start_matches("ws://")
    );
    std::future::pending::<()>().await;
    Ok(())
}

async fn bench(args: &BenchArgs) -> Result<(), String> {
    let opts = args.options();
    let report = hubsync::bench::run(&opts)
        .await
        .map_err(|e| e.to_string())?;
    print!("{}", report.markdown());
    println!("\nreport written to {}", opts.out.display());
    Ok(())
}

#[derive(clap::Args)]
struct HubArgs {
    /// Address to listen on, e.g. 127.0.0.1:7400 (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: String,
    /// Directory of the hub's sled store (created if missing). Not used
    /// with --store.
    #[arg(long, default_value = "./hub-data")]
    data: PathBuf,
    /// Keep the hub's data in PostgreSQL instead of sled: a postgres:// URL
    /// (or a libpq key=value string). Several hub processes may share one
    /// database (docs/operations.md).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Connections to PostgreSQL this process keeps at most (--store).
    #[arg(long, default_value_t = hubsync::hub::DEFAULT_POOL_SIZE)]
    store_pool: usize,
    /// How hub processes sharing the database announce frames to each
    /// other: `listen` (LISTEN/NOTIFY, PostgreSQL) or `poll` (a table read
    /// every --store-poll-ms, for CockroachDB and YugabyteDB) (--store).
    #[arg(long, value_enum, default_value_t = AnnounceMode::Listen)]
    store_announce: AnnounceMode,
    /// Milliseconds between polls with --store-announce poll.
    #[arg(long, default_value_t = 100)]
    store_poll_ms: u64,
    /// Serve the hub's counters in Prometheus's text format at
    /// http://ADDR/metrics (bind it where only operators reach it).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// The URL devices dial and sign; defaults to ws://<listen address>, or
    /// wss://<listen address> with TLS. With TLS it must be wss://, and its
    /// host one the certificate names.
    #[arg(long)]
    public_url: Option<String>,
    /// Serve wss:// (TLS) with this PEM certificate chain, leaf first
    /// (e.g. fullchain.pem). Needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert. Needs --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Largest payload in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_payload: usize,
    /// Sustained publishes per second per device.
    #[arg(long, default_value_t = 20.0)]
    device_rate: f64,
    /// Burst of publishes per device.
    #[arg(long, default_value_t = 50.0)]
    device_burst: f64,
    /// Sustained publishes per second per topic.
    #[arg(long, default_value_t = 100.0)]
    topic_rate: f64,
    /// Burst of publishes per topic.
    #[arg(long, default_value_t = 200.0)]
    topic_burst: f64,
    /// Sustained key-package claims per second by one claimer.
    #[arg(long, default_value_t = 1.0)]
    claimer_rate: f64,
    /// Burst of key-package claims by one claimer.
    #[arg(long, default_value_t = 30.0)]
    claimer_burst: f64,
    /// Sustained claims per second of one device's key packages, by all
    /// claimers together.
    #[arg(long, default_value_t = 10.0 / 60.0)]
    target_rate: f64,
    /// Burst of claims of one device's key packages.
    #[arg(long, default_value_t = 10.0)]
    target_burst: f64,
    /// Log frames kept per topic before the oldest are trimmed.
    #[arg(long, default_value_t = 100_000)]
    max_log_depth: u64,
    /// Subscriptions per device (a device follows 3 topics per group on
    /// its commit hub, up to 13 right after many roster changes).
    #[arg(long, default_value_t = 20_000)]
    max_subscriptions: u32,
    /// Sustained subscription changes per second per device (topics whose
    /// subscription was written, plus one per request).
    #[arg(long, default_value_t = 100.0)]
    subscription_rate: f64,
    /// Burst of subscription changes per device.
    #[arg(long, default_value_t = 20_000.0)]
    subscription_burst: f64,
    /// Seconds between retention purges.
    #[arg(long, default_value_t = 60)]
    purge_interval: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo narrates on stdout; its logs stay quiet unless asked for.
    let default = match cli.command {
        Command::Demo
        | Command::Bench(_)
        | Command::BenchRawServer
        | Command::Device(_)
        | Command::Soak(_) => "warn",
        Command::Hub(_) => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Hub(args) => rt.block_on(run_hub(args)),
        Command::Demo => rt.block_on(demo::run()),
        Command::Device(args) => rt.block_on(device_cli::run(args)),
        Command::Bench(args) => rt.block_on(bench(&args)),
        Command::Soak(args) => rt.block_on(soak(&args)),
        Command::BenchRawServer => rt.block_on(raw_server()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--store-announce`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AnnounceMode {
    /// LISTEN/NOTIFY (PostgreSQL).
    Listen,
    /// A table every process polls (databases without LISTEN/NOTIFY).
    Poll,
}

/// The PostgreSQL store's options from the command line.
fn pg_options(args: &HubArgs) -> PgOptions {
    PgOptions {
        pool_size: args.store_pool,
        announce: match args.store_announce {
            AnnounceMode::Listen => Announce::Listen,
            AnnounceMode::Poll => Announce::Poll {
                interval: Duration::from_millis(args.store_poll_ms.max(1)),
            },
        },
    }
}

/// The URL the hub announces: `public` if given, else the scheme's URL of
/// the bound address. With TLS it must be `wss://`: a device dialling a
/// `ws://` URL would not speak TLS to it.
fn hub_url(
    public: Option<String>,
    addr: std::net::SocketAddr,
    tls: bool,
) -> Result<String, String> {
    let scheme = if tls { "wss" } else { "ws" };
    let url = public.unwrap_or_else(|| format!("{scheme}://{addr}"));
    if tls && !url.starts_with("wss://") {
        return Err(format!(
            "--public-url must be a wss:// URL when serving TLS, got {url}"
        ));
    }
    Ok(url)
}

async fn run_hub(args: HubArgs) -> Result<(), String> {
    // Read the certificate before binding, so a bad file fails fast.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            Some(server_config_from_pem(cert, key).map_err(|e| format!("TLS: {e}"))?)
        }
        (None, None) => None,
        _ => return Err("--tls-cert and --tls-key must be given together".into()),
    };
    let listener = TcpAcceptor::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let metrics = match &args.metrics {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?,
        ),
        None => None,
    };
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let url = hub_url(args.public_url.clone(), addr, tls.is_some())?;
    let rng = SharedRng::from_entropy();
    let store: Arc<dyn HubStore> = match &args.store {
        Some(url) => PgHubStore::open(url, &pg_options(&args), &rng)
            .await
            .map_err(|e| e.to_string())?,
        None => {
            std::fs::create_dir_all(&args.data)
                .map_err(|e| format!("cannot create {}: {e}", args.data.display()))?;
            let kv: Arc<dyn KvStore> = Arc::new(
                SledKv::open(&args.data)
                    .map_err(|e| format!("cannot open {}: {e}", args.data.display()))?,
            );
            KvHubStore::open(kv, &rng).map_err(|e| format!("hub store: {e}"))?
        }
    };
    let mut config = HubConfig::new(url.clone());
    config.purge_interval = Duration::from_secs(args.purge_interval.max(1));
    config.limits = Limits {
        max_payload: args.max_payload,
        device_rate: Rate {
            per_sec: args.device_rate,
            burst: args.device_burst,
        },
        topic_rate: Rate {
            per_sec: args.topic_rate,
            burst: args.topic_burst,
        },
        claimer_rate: Rate {
            per_sec: args.claimer_rate,
            burst: args.claimer_burst,
        },
        target_rate: Rate {
            per_sec: args.target_rate,
            burst: args.target_burst,
        },
        subscription_rate: Rate {
            per_sec: args.subscription_rate,
            burst: args.subscription_burst,
        },
        max_log_depth: args.max_log_depth,
        max_subscriptions: args.max_subscriptions,
        ..Limits::default()
    };
    let hub = Hub::start_on(store, config, Clock::System, rng).map_err(|e| e.to_string())?;
    if let Some(listener) = metrics {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "metrics at http://{addr}/metrics");
        }
        hub.serve_metrics(listener);
    }
    let tls_stats = match tls {
        Some(config) => {
            let listener = TlsListener::new(listener, config);
            let stats = listener.stats();
            hub.serve(listener);
            Some(stats)
        }
        None => {
            hub.serve(listener);
            None
        }
    };
    // Tests and scripts read this line to learn the port (and the scheme).
    println!("hubsync hub listening on {addr} as {url}");
    tracing::info!(
        %addr,
        %url,
        store = %match &args.store {
            Some(_) => "postgres".to_string(),
            None => args.data.display().to_string(),
        },
        store_id = %hub.store_id(),
        "hub started"
    );
    wait_for_signal().await;
    tracing::info!("shutting down: no new connections, flushing");
    hub.shutdown().await;
    let m = hub.metrics();
    tracing::info!(?m, "hub stopped");
    if let Some(t) = tls_stats {
        tracing::info!(
            handshakes = t.handshakes(),
            failed = t.failed(),
            timed_out = t.timed_out(),
            "TLS handshakes"
        );
    }
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::hub_url;

    #[test]
    fn hub_url_is_wss_with_tls_and_refuses_a_ws_public_url() {
        let addr = "127.0.0.1:7400".parse().unwrap();
        assert_eq!(hub_url(None, addr, false).unwrap(), "ws://127.0.0.1:7400");
        assert_eq!(hub_url(None, addr, true).unwrap(), "wss://127.0.0.1:7400");
        let public = Some("wss://hub.example".to_string());
        assert_eq!(hub_url(public, addr, true).unwrap(), "wss://hub.example");
        let err = hub_url(Some("ws://hub.example".into()), addr, true).unwrap_err();
        assert!(err.contains("wss://"), "{err}");
        // Without TLS here, a wss:// URL is a proxy terminating TLS in front.
        let proxied = Some("wss://hub.example".to_string());
        assert_eq!(hub_url(proxied, addr, false).unwrap(), "wss://hub.example");
    }
}
