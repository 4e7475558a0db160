//! `hubsync-sim`: run seeds of the deterministic simulation.

use clap::Parser;
use hubsync_sim::{run_seed, Faults, SimConfig};
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
    /// Where the report goes.
    #[arg(long, default_value = "sim-report")]
    report: PathBuf,
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
        ..SimConfig::new(0)
    };
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
        let r = run_seed(&cfg);
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
