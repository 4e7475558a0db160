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
    /// Devices per run.
    #[arg(long, default_value_t = 5)]
    devices: usize,
    /// Hubs per run.
    #[arg(long, default_value_t = 2)]
    hubs: usize,
    /// Groups per run.
    #[arg(long, default_value_t = 2)]
    groups: usize,
    /// Workload operations per run.
    #[arg(long, default_value_t = 30)]
    ops: usize,
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
    cmd.args(["--child", "--seed", &cfg.seed.to_string()])
        .args(["--devices", &cfg.devices.to_string()])
        .args(["--hubs", &cfg.hubs.to_string()])
        .args(["--groups", &cfg.groups.to_string()])
        .args(["--ops", &cfg.ops.to_string()])
        .args(["--faults", &cfg.faults.to_arg()])
        .args(["--tasks-before", &cfg.tasks_before.to_string()])
        .stderr(std::process::Stdio::inherit());
    if cfg.tunnels {
        cmd.arg("--tunnels");
    }
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
    let base = SimConfig {
        devices: args.devices,
        hubs: args.hubs,
        groups: args.groups,
        ops: args.ops,
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
    if violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
