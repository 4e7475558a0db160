//! `hubsync-sim`: run seeds of the deterministic simulation.

use clap::Parser;
use hubsync_sim::{run_seed, Faults, SeedReport, SimConfig};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "hubsync-sim",
    about = "Deterministic multi-node simulations of hubsync"
)]
struct Args {
    /// Run this many seeds, starting at --first.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 1)]
    first: u64,
    /// Run exactly this seed (overrides --seeds).
    #[arg(long)]
    seed: Option<u64>,
    /// Devices per run (5; a crowd 1,000).
    #[arg(long)]
    devices: Option<usize>,
    /// Hubs per run (2; a crowd 10).
    #[arg(long)]
    hubs: Option<usize>,
    /// Groups per run (2; a crowd 200).
    #[arg(long)]
    groups: Option<usize>,
    /// Workload operations per run (30; a crowd 200).
    #[arg(long)]
    ops: Option<usize>,
    /// A crowd: 1,000 devices, 10 hubs and 200 groups, 20 devices to a
    /// simulated machine, unless the sizes are given. Every device holds a
    /// connection to every hub, so a hub's restart brings all of them back
    /// at once; the report shows each restart's load (see
    /// docs/simulations.md, "Crowds").
    #[arg(long)]
    crowd: bool,
    /// Devices that share one simulated machine: they crash, restart and
    /// are cut off together (1; a crowd 20).
    #[arg(long)]
    devices_per_host: Option<usize>,
    /// Faults: all, none, or a list of partitions,hub-crashes,device-crashes,latency,drops,rewinds,strangers.
    #[arg(long, default_value = "all")]
    faults: String,
    /// Add tunnel calls between members to the workload (their items must
    /// arrive in order exactly once, or the call must say why it ended).
    #[arg(long)]
    tunnels: bool,
    /// Spawn this many tokio tasks before each run: the same seed under
    /// another order in which a crashed host's tasks are dropped (tokio
    /// numbers tasks process-wide; see docs/simulations.md, "Determinism").
    #[arg(long, default_value_t = 0)]
    tasks_before: u64,
    /// Where the report goes.
    #[arg(long, default_value = "sim-report")]
    report: PathBuf,
    /// Run the one seed of `--seed` here and print its report as one JSON
    /// line: how the binary runs each seed of a batch in a fresh process.
    #[arg(long, hide = true)]
    child: bool,
}

/// The line a child process prints its seed's report on.
const REPORT_LINE: &str = "hubsync-sim-report: ";

/// Run `cfg`'s seed in a fresh process (this binary with `--child`), so
/// that it is the run its replay command shows: runs in one process carry
/// tokio's task numbering over, which changes what a host crash does.
fn run_in_child(cfg: &SimConfig) -> SeedReport {
    let died = |why: String| SeedReport::process_died(cfg.seed, why);
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return died(format!("cannot find the simulator binary: {e}")),
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--child")
        .args(cfg.args())
        .stderr(std::process::Stdio::inherit());
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => return died(format!("cannot start the run's process: {e}")),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().find_map(|l| l.strip_prefix(REPORT_LINE)) {
        Some(json) => serde_json::from_str(json)
            .unwrap_or_else(|e| died(format!("its report does not read: {e}"))),
        None => died(format!(
            "the run's process ended ({}) without a report",
            out.status
        )),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let faults = match Faults::parse(&args.faults) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let seeds: Vec<u64> = match args.seed {
        Some(s) => vec![s],
        None => (args.first..args.first + args.seeds).collect(),
    };
    let size = |given: Option<usize>, small: usize, crowd: usize| {
        given.unwrap_or(if args.crowd { crowd } else { small })
    };
    let base = SimConfig {
        devices: size(args.devices, 5, 1000),
        hubs: size(args.hubs, 2, 10),
        groups: size(args.groups, 2, 200),
        ops: size(args.ops, 30, 200),
        devices_per_host: size(args.devices_per_host, 1, 20).max(1),
        faults,
        tunnels: args.tunnels,
        tasks_before: args.tasks_before,
        ..SimConfig::new(0)
    };
    if args.child {
        let r = run_seed(&SimConfig {
            seed: args.seed.unwrap_or(args.first),
            ..base
        });
        return match serde_json::to_string(&r) {
            Ok(json) => {
                println!("{REPORT_LINE}{json}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: cannot write the report: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let bar = ProgressBar::new(seeds.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} seeds, {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut reports = Vec::new();
    let mut violations = 0usize;
    for seed in seeds {
        let cfg = SimConfig {
            seed,
            ..base.clone()
        };
        let r = run_in_child(&cfg);
        if !r.violations.is_empty() {
            violations += r.violations.len();
            bar.suspend(|| {
                println!("seed {seed} failed:");
                for v in &r.violations {
                    println!("  {v}");
                }
                println!("  replay: {}", cfg.replay_command());
            });
        }
        bar.set_message(format!("{violations} violations"));
        bar.inc(1);
        reports.push(r);
    }
    bar.finish_and_clear();
    if let Err(e) = hubsync_sim::report::write(&args.report, &base, &reports) {
        eprintln!(
            "error: cannot write the report to {}: {e}",
            args.report.display()
        );
    }
    let total = |f: fn(&hubsync_sim::SeedReport) -> usize| reports.iter().map(f).sum::<usize>();
    println!(
        "sim: {} seeds, {violations} violations; {} strands, {} gathers, {} rejoins, {} remedies failed",
        reports.len(),
        total(|r| r.strands),
        total(|r| r.gathers),
        total(|r| r.rejoins),
        total(|r| r.recoveries_failed),
    );
    let storms: Vec<hubsync_sim::storm::Storm> =
        reports.iter().flat_map(|r| r.storms.clone()).collect();
    println!(
        "storms: {}; slowest settle after the faults stopped: {}",
        hubsync_sim::storm::summary(&storms),
        reports
            .iter()
            .filter_map(|r| r.converge_ms)
            .max()
            .map_or("none settled".into(), |ms| format!("{ms} ms")),
    );
    if violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
