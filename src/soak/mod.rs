//! `hubsync soak`: a hub and many devices for a given time, under steady
//! load and random faults, with the memory and open files of both sides
//! sampled all along; the run fails if either grows without bound, if
//! deliveries stall, or if the devices end unconverged.
//!
//! What runs:
//! - the hub is this binary's `hub`, a child process on a loopback port
//!   with a store in a temporary directory, so what is sampled of it
//!   (`VmRSS`, entries of `/proc/<pid>/fd`) is its own;
//! - the devices are real [`Device`]s in this process, each with a sled
//!   store in a temporary directory, dialling the hub over loopback
//!   sockets through a [`CutConnector`]; this process's own memory and
//!   open files are "the devices' side";
//! - the devices are split into groups (the first of each share creates
//!   its group and is its admin); members send application messages at a
//!   steady total rate, members rotate their keys, the admins remove a
//!   member now and then and invite it back later;
//! - faults: connections cut (one device's, sometimes every device's),
//!   the hub killed with SIGKILL and started again on the same port and
//!   data directory, a device closed and reopened from its store.
//!
//! Every draw (which device, which group, when the next fault comes) comes
//! from one generator seeded with [`SoakOptions::seed`]; the schedule of
//! decisions repeats with the seed, the timing of the machine does not.
//!
//! At the end the load and the faults stop, every group must converge
//! (every member per its admin at the admin's epoch and epoch
//! authenticator) and a last message from each admin must reach every
//! member. The samples are then judged by [`judge::judge_series`].

pub mod judge;
mod report;

use crate::device::{CommitError, Device, DeviceOptions, Event, GroupId, Observer};
use crate::process::ChildServer;
use crate::rng::SharedRng;
use crate::testkit::{CutConnector, CutSwitch};
use crate::transport::NetConnector;
use crate::wire::DeviceId;
use judge::Judgement;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// A run fails when no message was delivered for this long while a sent
/// one waited: past any hub restart (a second or two) and any reconnect
/// backoff (half a second with these devices' options).
pub const STALL: Duration = Duration::from_secs(60);

/// How long one device operation (a send, a commit, an invite with its
/// retries) may take before it counts as failed; a device is not
/// restarted while an operation holds it, so this also bounds a restart.
const OP_TIMEOUT: Duration = Duration::from_secs(60);

/// How long, after the load stops, the groups have to converge and the
/// last messages to arrive.
const SETTLE: Duration = Duration::from_secs(120);

/// How long a hub restart may take, retries of its bind included (the old
/// process's port and store lock are free once it is reaped, but be
/// patient with a busy machine).
const HUB_START: Duration = Duration::from_secs(60);

/// The body of each group's last message, to tell it from the load.
const PROBE: &[u8] = b"soak-probe";

/// Bytes of each application message of the load.
const BODY: usize = 256;

/// What a soak runs and where it reports.
#[derive(Clone, Debug)]
pub struct SoakOptions {
    /// The `hubsync` binary whose `hub` subcommand serves the hub.
    pub exe: PathBuf,
    /// How long the load and the faults run (the setup and the final
    /// settling come on top).
    pub duration: Duration,
    /// Devices in all.
    pub devices: usize,
    /// Groups; each has about `devices / groups` members.
    pub groups: usize,
    /// Directory of `samples.csv`, `report.md`, `summary.json` and the
    /// hub's log `hub.log` (created if missing).
    pub report: PathBuf,
    /// Seed of every draw of the run.
    pub seed: u64,
    /// Time between samples.
    pub sample_every: Duration,
    /// Application messages per second, all groups together.
    pub rate: f64,
    /// The hub's `--max-log-depth`. Bounded low so the hub's data reaches
    /// a steady size within the run: with the hub's default (100 000
    /// frames per topic) the store would grow for the whole hour by design,
    /// and its cache with it, which is not a leak.
    pub max_log_depth: u64,
}

impl SoakOptions {
    /// The defaults: 24 devices in 4 groups, 4 messages a second, a sample
    /// every 10 s, for `duration`.
    pub fn new(exe: PathBuf, duration: Duration, report: PathBuf) -> Self {
        Self {
            exe,
            duration,
            devices: 24,
            groups: 4,
            report,
            seed: 1,
            sample_every: Duration::from_secs(10),
            rate: 4.0,
            max_log_depth: 2_000,
        }
    }
}

/// How often each kind of fault and change comes, on average (each wait
/// is drawn between half and one and a half times this), scaled to the
/// run's length so a short run (CI's minute) sees every kind a few times
/// and an hour sees each at a realistic pace.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Schedule {
    /// Connections cut (one device's, or one time in five every device's).
    pub cut_every: Duration,
    /// The hub killed and started again.
    pub hub_restart_every: Duration,
    /// A device closed and reopened.
    pub device_restart_every: Duration,
    /// A member rotates its keys (a commit).
    pub rotate_every: Duration,
    /// An admin removes a member, or invites a removed one back.
    pub membership_every: Duration,
}

impl Schedule {
    /// The schedule of a run of `duration`: each kind at least a few times
    /// (a fixed share of the run), and no more often than a floor, no less
    /// often than a ceiling (an hour: a hub restart every 5 minutes, a
    /// device restart a minute, a membership change every 30 s, a commit
    /// every 10 s, a cut every 15 s).
    pub fn for_run(duration: Duration) -> Self {
        let share = |n: u32, floor: u64, ceiling: u64| {
            (duration / n).clamp(Duration::from_secs(floor), Duration::from_secs(ceiling))
        };
        Self {
            cut_every: share(30, 2, 15),
            hub_restart_every: share(5, 5, 300),
            device_restart_every: share(12, 3, 60),
            rotate_every: share(20, 2, 10),
            membership_every: share(15, 3, 30),
        }
    }
}

/// Parse a duration as the command line takes it: a number and a unit,
/// `ms`, `s`, `m` or `h` (`500ms`, `90s`, `10m`, `1h`); a bare number is
/// seconds.
///
/// # Errors
/// A text that is not a whole number with one of those units.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 90s, 10m or 1h"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => return Err(format!("{text:?}: the unit must be ms, s, m or h")),
    };
    Ok(d)
}

/// One reading of both sides and of the counters so far.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Seconds since the load began.
    pub t_s: f64,
    /// The hub process's resident memory, bytes.
    pub hub_rss: u64,
    /// The hub process's open file descriptors.
    pub hub_fds: u64,
    /// This process's (the devices') resident memory, bytes.
    pub devices_rss: u64,
    /// This process's open file descriptors.
    pub devices_fds: u64,
    /// Application messages sent (accepted by a device's outbox).
    pub sent: u64,
    /// Application messages handed to receiving apps (each message once
    /// per receiving device).
    pub delivered: u64,
    /// Sends refused or timed out.
    pub send_errors: u64,
    /// Cuts of connections.
    pub cuts: u64,
    /// Times a device's hub link came up (first connections included).
    pub reconnects: u64,
    /// Hub restarts.
    pub hub_restarts: u64,
    /// Device restarts.
    pub device_restarts: u64,
    /// Commits landed by the load (key rotations, invites, removals).
    pub commits: u64,
    /// Commits that failed or timed out.
    pub commit_errors: u64,
}

/// What a soak found.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Whether the run passed: nothing grew, nothing stalled, every group
    /// converged and heard its last message, nothing failed.
    pub passed: bool,
    /// Why it did not pass, one sentence each.
    pub failures: Vec<String>,
    /// The seed of the run.
    pub seed: u64,
    /// Devices in all.
    pub devices: usize,
    /// Groups.
    pub groups: usize,
    /// Messages per second asked for.
    pub rate: f64,
    /// The load's planned length, seconds.
    pub planned_s: f64,
    /// How long the load ran, seconds (shorter when it stalled).
    pub ran_s: f64,
    /// The fault schedule.
    pub schedule: Schedule,
    /// Invites and removals that landed.
    pub membership_changes: u64,
    /// Invites and removals that failed or timed out.
    pub membership_errors: u64,
    /// Whether every group converged at the end.
    pub converged: bool,
    /// Set when deliveries stalled: what was seen.
    pub stalled: Option<String>,
    /// The judgement of each measure (empty when there were too few
    /// samples, which is then a failure).
    pub judgements: Vec<Judgement>,
    /// The first sample after the warm-up, and the last.
    pub first: Option<Sample>,
    /// The last sample.
    pub last: Option<Sample>,
    /// Every sample.
    #[serde(skip)]
    pub samples: Vec<Sample>,
}

/// Why a soak could not run (as opposed to a run that failed its checks,
/// which is a [`Summary`] with `passed` false).
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    /// The hub, a device or a group could not be set up.
    #[error("setup: {0}")]
    Setup(String),
    /// The report could not be written.
    #[error("cannot write the report in {path}: {source}")]
    Report {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Counters shared by the load, the faults and the devices' observers.
#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    send_errors: AtomicU64,
    delivered: AtomicU64,
    cuts: AtomicU64,
    reconnects: AtomicU64,
    hub_restarts: AtomicU64,
    device_restarts: AtomicU64,
    commits: AtomicU64,
    commit_errors: AtomicU64,
    membership_changes: AtomicU64,
    membership_errors: AtomicU64,
    /// Milliseconds since the start (plus one) of the first send after the
    /// last delivery; 0 when every send so far was followed by one.
    waiting_since_ms: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What a device's observer saw, kept across its restarts.
#[derive(Default)]
struct Seen {
    /// Groups the device is in by its own events.
    joined: Mutex<HashSet<GroupId>>,
    /// Ids of the probe messages it received.
    probes: Mutex<HashSet<[u8; 16]>>,
}

/// One device of the soak, open or being restarted.
struct Member {
    index: usize,
    dir: tempfile::TempDir,
    options: DeviceOptions,
    cut: Arc<CutSwitch>,
    /// `None` while the device is being restarted.
    device: Mutex<Option<Arc<Device>>>,
    seen: Arc<Seen>,
}

impl Member {
    fn device(&self) -> Option<Arc<Device>> {
        self.device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn joined(&self, g: &GroupId) -> bool {
        self.seen
            .joined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(g)
    }
}

/// One group of the soak.
struct SoakGroup {
    id: GroupId,
    /// The member that created it, its only admin.
    admin: usize,
    /// Every device of the group's share, member now or not.
    share: Vec<usize>,
    /// Its members, as its admin last said.
    members: Mutex<Vec<usize>>,
    /// A membership change is under way.
    changing: AtomicBool,
}

impl SoakGroup {
    fn members(&self) -> Vec<usize> {
        self.members
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// What every task of the run shares.
struct Ctx {
    start: Instant,
    members: Vec<Arc<Member>>,
    groups: Vec<Arc<SoakGroup>>,
    index_of: HashMap<DeviceId, usize>,
    counters: Arc<Counters>,
    /// Failures found by tasks (a device that could not be reopened).
    failures: Mutex<Vec<String>>,
    rng: SharedRng,
}

impl Ctx {
    fn fail(&self, why: String) {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(why);
    }

    /// A uniform draw in `0..n` (`n` > 0).
    fn pick(&self, n: usize) -> usize {
        ((self.rng.unit() * n as f64) as usize).min(n.saturating_sub(1))
    }

    /// A wait between half and one and a half times `every`.
    fn jitter(&self, every: Duration) -> Duration {
        every.mul_f64(0.5 + self.rng.unit())
    }

    /// The members of `g` that are open and joined by their own account:
    /// those that can send and commit in it now.
    fn active(&self, g: &SoakGroup) -> Vec<(usize, Arc<Device>)> {
        g.members()
            .into_iter()
            .filter_map(|i| {
                let m = &self.members[i];
                let d = m.device()?;
                m.joined(&g.id).then_some((i, d))
            })
            .collect()
    }

    /// Set `g`'s members from what its admin says now.
    async fn refresh_members(&self, g: &SoakGroup, admin: &Device) {
        if let Ok(ids) = admin.members(g.id).await {
            let mut now: Vec<usize> = ids
                .iter()
                .filter_map(|d| self.index_of.get(d).copied())
                .collect();
            now.sort_unstable();
            *g.members.lock().unwrap_or_else(|p| p.into_inner()) = now;
        }
    }
}

/// The hub child process, restartable on its port and data directory.
struct HubProcess {
    exe: PathBuf,
    data: PathBuf,
    log: PathBuf,
    listen: String,
    max_log_depth: u64,
    server: Option<ChildServer>,
}

impl HubProcess {
    async fn start(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + HUB_START;
        loop {
            match self.start_once().await {
                Ok(server) => {
                    // Every later start reuses the port the first one got,
                    // so the devices' URL stays valid.
                    self.listen = server.addr.clone();
                    self.server = Some(server);
                    return Ok(());
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!("hub start failed, trying again: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn start_once(&self) -> Result<ChildServer, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("cannot open {}: {e}", self.log.display()))?;
        let data = self.data.to_string_lossy().into_owned();
        let depth = self.max_log_depth.to_string();
        ChildServer::start_with(
            &self.exe,
            &[
                "hub",
                "--listen",
                &self.listen,
                "--data",
                &data,
                "--max-log-depth",
                &depth,
            ],
            log.into(),
            // Warnings only: the hub's info lines (one per connection)
            // would fill the disk over a long run.
            &[("RUST_LOG", "warn")],
        )
        .await
    }

    /// Kill the hub (SIGKILL: a crash, nothing flushed on the way out) and
    /// start it again after `pause`.
    async fn restart(&mut self, pause: Duration) -> Result<(), String> {
        if let Some(s) = self.server.take() {
            s.kill().await?;
        }
        tokio::time::sleep(pause).await;
        self.start().await
    }

    fn server(&mut self) -> Result<&mut ChildServer, String> {
        self.server
            .as_mut()
            .ok_or_else(|| "the hub is not running".to_string())
    }
}

/// Run a soak as `opts` says, write its report, and answer what it found.
///
/// # Errors
/// [`SoakError::Setup`] when the hub or the groups cannot be set up, and
/// [`SoakError::Report`] when the report cannot be written. A run that
/// fails its checks is not an error: its summary says `passed: false`.
pub async fn run(opts: &SoakOptions) -> Result<Summary, SoakError> {
    let setup = SoakError::Setup;
    std::fs::create_dir_all(&opts.report).map_err(|source| SoakError::Report {
        path: opts.report.clone(),
        source,
    })?;
    let mut csv = report::CsvLog::create(&opts.report)?;
    let temp = tempfile::tempdir().map_err(|e| setup(format!("temporary directory: {e}")))?;
    let mut hub = HubProcess {
        exe: opts.exe.clone(),
        data: temp.path().join("hub"),
        log: opts.report.join("hub.log"),
        listen: "127.0.0.1:0".into(),
        max_log_depth: opts.max_log_depth,
        server: None,
    };
    hub.start().await.map_err(setup)?;
    let url = format!("ws://{}", hub.listen);
    let counters = Arc::new(Counters::default());
    let (members, index_of) = open_devices(opts, &url, &counters).await?;
    let groups = form_groups(opts, &url, &members).await?;
    let ctx = Arc::new(Ctx {
        start: Instant::now(),
        members,
        groups,
        index_of,
        counters: counters.clone(),
        failures: Mutex::new(Vec::new()),
        rng: SharedRng::seeded(opts.seed),
    });
    // Setup's own deliveries and sends do not count.
    for c in [&counters.delivered, &counters.waiting_since_ms] {
        c.store(0, Ordering::SeqCst);
    }
    let schedule = Schedule::for_run(opts.duration);
    println!(
        "soak: hub {url}, {} devices in {} groups, {} messages/s, seed {}, for {:?}",
        ctx.members.len(),
        ctx.groups.len(),
        opts.rate,
        opts.seed,
        opts.duration
    );

    let stop = CancellationToken::new();
    let load = tokio::spawn(send_load(ctx.clone(), opts.rate, stop.clone()));
    let mut tasks = JoinSet::new();
    let mut samples = Vec::new();
    let mut stalled = None;
    let end = ctx.start + opts.duration;
    let mut next_sample = ctx.start + opts.sample_every;
    let mut next_cut = ctx.start + ctx.jitter(schedule.cut_every);
    let mut next_hub = ctx.start + ctx.jitter(schedule.hub_restart_every);
    let mut next_device = ctx.start + ctx.jitter(schedule.device_restart_every);
    let mut next_rotate = ctx.start + ctx.jitter(schedule.rotate_every);
    let mut next_member = ctx.start + ctx.jitter(schedule.membership_every);
    loop {
        let due = [
            next_sample,
            next_cut,
            next_hub,
            next_device,
            next_rotate,
            next_member,
            end,
        ]
        .into_iter()
        .min()
        .unwrap_or(end);
        tokio::time::sleep_until(due.into()).await;
        while tasks.try_join_next().is_some() {}
        let now = Instant::now();
        if now >= end {
            break;
        }
        if now >= next_sample {
            next_sample += opts.sample_every;
            let s = match sample(&ctx, &mut hub) {
                Ok(s) => s,
                Err(e) => {
                    ctx.fail(format!("sampling: {e}"));
                    break;
                }
            };
            print_sample(&s);
            csv.append(&s)?;
            samples.push(s);
            mark_processed(&ctx);
            if let Some(why) = stall(&ctx) {
                stalled = Some(why);
                break;
            }
        }
        if now >= next_cut {
            next_cut = now + ctx.jitter(schedule.cut_every);
            cut(&ctx);
        }
        if now >= next_hub {
            let pause = Duration::from_millis((ctx.rng.unit() * 2000.0) as u64);
            if let Err(e) = hub.restart(pause).await {
                ctx.fail(format!("the hub could not be restarted: {e}"));
                break;
            }
            bump(&counters.hub_restarts);
            next_hub = Instant::now() + ctx.jitter(schedule.hub_restart_every);
        }
        if now >= next_device {
            next_device = now + ctx.jitter(schedule.device_restart_every);
            let m = ctx.members[ctx.pick(ctx.members.len())].clone();
            let pause = Duration::from_millis((ctx.rng.unit() * 3000.0) as u64);
            tasks.spawn(restart_device(ctx.clone(), m, pause));
        }
        if now >= next_rotate {
            next_rotate = now + ctx.jitter(schedule.rotate_every);
            tasks.spawn(rotate(ctx.clone()));
        }
        if now >= next_member {
            next_member = now + ctx.jitter(schedule.membership_every);
            tasks.spawn(change_membership(ctx.clone()));
        }
        // Between samples too: a hub that died on its own is a finding,
        // not a fault of the run's making.
        if !hub.server().is_ok_and(|s| s.running()) {
            ctx.fail("the hub process exited on its own (see hub.log)".into());
            break;
        }
    }
    let ran = ctx.start.elapsed();
    stop.cancel();
    let _ = load.await;
    match sample(&ctx, &mut hub) {
        Ok(s) => {
            print_sample(&s);
            samples.push(s);
        }
        Err(e) => ctx.fail(format!("the last sample: {e}")),
    }
    println!("soak: load stopped after {ran:?}; waiting for the groups to settle");
    while tasks.join_next().await.is_some() {}
    // With deliveries stalled or the hub gone, waiting for the groups to
    // settle would only add minutes to a run that already failed.
    let converged = if stalled.is_none() && hub.server().is_ok_and(|s| s.running()) {
        settle(&ctx).await
    } else {
        false
    };
    for m in &ctx.members {
        let d = m.device.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(d) = d {
            d.close().await;
        }
    }
    if let Some(s) = hub.server.take() {
        let _ = s.kill().await;
    }

    let mut failures = std::mem::take(&mut *ctx.failures.lock().unwrap_or_else(|p| p.into_inner()));
    if let Some(why) = &stalled {
        failures.push(why.clone());
    }
    let judgements = match judge_samples(&samples, ran.as_secs_f64()) {
        Ok(js) => js,
        Err(e) => {
            failures.push(e.to_string());
            Vec::new()
        }
    };
    for j in judgements.iter().filter(|j| j.grew) {
        failures.push(j.sentence());
    }
    let warm_up = ran.as_secs_f64() * judge::WARM_UP_FRACTION;
    let summary = Summary {
        passed: failures.is_empty(),
        failures,
        seed: opts.seed,
        devices: ctx.members.len(),
        groups: ctx.groups.len(),
        rate: opts.rate,
        planned_s: opts.duration.as_secs_f64(),
        ran_s: ran.as_secs_f64(),
        schedule,
        membership_changes: counters.membership_changes.load(Ordering::Relaxed),
        membership_errors: counters.membership_errors.load(Ordering::Relaxed),
        converged,
        stalled,
        judgements,
        first: samples.iter().find(|s| s.t_s >= warm_up).cloned(),
        last: samples.last().cloned(),
        samples,
    };
    report::write(&opts.report, &summary)?;
    Ok(summary)
}

/// Judge the four measures of `samples` over a run of `run_secs`.
///
/// # Errors
/// As [`judge::judge_series`]: too few samples.
pub fn judge_samples(
    samples: &[Sample],
    run_secs: f64,
) -> Result<Vec<Judgement>, judge::JudgeError> {
    type Get = fn(&Sample) -> u64;
    let measures: [(&str, &str, Get, judge::Slack); 4] = [
        ("hub rss", "bytes", |s| s.hub_rss, judge::MEMORY_SLACK),
        ("hub fds", "fds", |s| s.hub_fds, judge::FILES_SLACK),
        (
            "devices rss",
            "bytes",
            |s| s.devices_rss,
            judge::MEMORY_SLACK,
        ),
        ("devices fds", "fds", |s| s.devices_fds, judge::FILES_SLACK),
    ];
    measures
        .into_iter()
        .map(|(name, unit, get, slack)| {
            let points: Vec<(f64, f64)> = samples.iter().map(|s| (s.t_s, get(s) as f64)).collect();
            judge::judge_series(name, unit, &points, run_secs, slack)
        })
        .collect()
}

/// Options of every soak device: the test kit's quick reconnects (the soak
/// wants many fault cycles, not long backoffs), through its own cut
/// switch, and an observer counting what it is told.
fn member_options(
    url: &str,
    cut: &Arc<CutSwitch>,
    seen: &Arc<Seen>,
    counters: &Arc<Counters>,
) -> DeviceOptions {
    let mut o = crate::testkit::device_options(&[url.to_string()]);
    o.connector = Arc::new(CutConnector::new(
        Arc::new(NetConnector::default()),
        cut.clone(),
    ));
    let (seen, counters) = (seen.clone(), counters.clone());
    o.manager.observer = Some(Observer(Arc::new(move |e: &Event| match e {
        Event::MessageReceived { id, body, .. } => {
            bump(&counters.delivered);
            counters.waiting_since_ms.store(0, Ordering::SeqCst);
            if body.starts_with(PROBE) {
                seen.probes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(*id);
            }
        }
        Event::GroupJoined { group, .. } | Event::Rejoined { group, .. } => {
            seen.joined
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(*group);
        }
        Event::Removed { group } | Event::Forgotten { group } => {
            seen.joined
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(group);
        }
        Event::HubStatus {
            status: crate::device::link::LinkStatus::Connected,
            ..
        } => bump(&counters.reconnects),
        _ => {}
    })));
    o
}

async fn open_devices(
    opts: &SoakOptions,
    url: &str,
    counters: &Arc<Counters>,
) -> Result<(Vec<Arc<Member>>, HashMap<DeviceId, usize>), SoakError> {
    let n = opts.devices.max(2 * opts.groups.max(1));
    let mut members = Vec::with_capacity(n);
    let mut index_of = HashMap::new();
    for index in 0..n {
        let dir = tempfile::tempdir().map_err(|e| SoakError::Setup(e.to_string()))?;
        let cut = CutSwitch::new();
        let seen = Arc::new(Seen::default());
        let options = member_options(url, &cut, &seen, counters);
        let device = Device::open(dir.path(), options.clone())
            .await
            .map_err(|e| SoakError::Setup(format!("device {index}: {e}")))?;
        index_of.insert(device.id(), index);
        members.push(Arc::new(Member {
            index,
            dir,
            options,
            cut,
            device: Mutex::new(Some(Arc::new(device))),
            seen,
        }));
    }
    for m in &members {
        if let Some(d) = m.device() {
            d.ready_for_invites(OP_TIMEOUT)
                .await
                .map_err(|e| SoakError::Setup(format!("device {}: {e}", m.index)))?;
        }
    }
    Ok((members, index_of))
}

/// Form the groups: the devices dealt round-robin, the first of each share
/// creates the group and invites the rest in one commit.
async fn form_groups(
    opts: &SoakOptions,
    url: &str,
    members: &[Arc<Member>],
) -> Result<Vec<Arc<SoakGroup>>, SoakError> {
    let setup = SoakError::Setup;
    let g_count = opts.groups.max(1);
    let mut groups = Vec::with_capacity(g_count);
    for gi in 0..g_count {
        let share: Vec<usize> = (gi..members.len()).step_by(g_count).collect();
        let admin = share[0];
        let a = members[admin]
            .device()
            .ok_or_else(|| setup("a device closed during setup".into()))?;
        let id = a
            .create_group(&[url.to_string()])
            .await
            .map_err(|e| setup(format!("group {gi}: create: {e}")))?;
        let others: Vec<DeviceId> = share[1..]
            .iter()
            .filter_map(|&i| members[i].device().map(|d| d.id()))
            .collect();
        a.invite_many(id, &others)
            .await
            .map_err(|e| setup(format!("group {gi}: invite: {e}")))?;
        let deadline = Instant::now() + OP_TIMEOUT;
        while !share.iter().all(|&i| members[i].joined(&id)) {
            if Instant::now() > deadline {
                return Err(setup(format!("group {gi}: not every device joined")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        groups.push(Arc::new(SoakGroup {
            id,
            admin,
            members: Mutex::new(share.clone()),
            share,
            changing: AtomicBool::new(false),
        }));
    }
    Ok(groups)
}

/// The load: every `1 / rate` seconds a random active member of a random
/// group sends a message (open loop: a slow send does not delay the next).
async fn send_load(ctx: Arc<Ctx>, rate: f64, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.01)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sends = JoinSet::new();
    let mut n = 0u64;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        while sends.try_join_next().is_some() {}
        let g = ctx.groups[ctx.pick(ctx.groups.len())].clone();
        let active = ctx.active(&g);
        if active.is_empty() {
            continue;
        }
        let (_, d) = active[ctx.pick(active.len())].clone();
        n += 1;
        let mut body = vec![0x5a; BODY];
        body[..8].copy_from_slice(&n.to_le_bytes());
        let ctx = ctx.clone();
        sends.spawn(async move {
            let c = &ctx.counters;
            match tokio::time::timeout(OP_TIMEOUT, d.try_send(g.id, &body)).await {
                Ok(Ok(_)) => {
                    bump(&c.sent);
                    let now = ctx.start.elapsed().as_millis() as u64 + 1;
                    let _ = c.waiting_since_ms.compare_exchange(
                        0,
                        now,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    );
                }
                Ok(Err(e)) => {
                    tracing::debug!("send: {e}");
                    bump(&c.send_errors);
                }
                Err(_) => bump(&c.send_errors),
            }
        });
    }
    while sends.join_next().await.is_some() {}
}

/// Cut one random device's connections, or one time in five everyone's.
fn cut(ctx: &Ctx) {
    if ctx.rng.unit() < 0.2 {
        for m in &ctx.members {
            m.cut.cut();
        }
    } else {
        ctx.members[ctx.pick(ctx.members.len())].cut.cut();
    }
    bump(&ctx.counters.cuts);
}

/// Close `m`, wait `pause`, and open it again from its directory.
async fn restart_device(ctx: Arc<Ctx>, m: Arc<Member>, pause: Duration) {
    let taken = m.device.lock().unwrap_or_else(|p| p.into_inner()).take();
    // Already being restarted.
    let Some(mut d) = taken else { return };
    d.close().await;
    // Operations that took the device before it was taken out end within
    // their timeout; its store is released when the last one lets go.
    let deadline = Instant::now() + OP_TIMEOUT + Duration::from_secs(10);
    loop {
        match Arc::try_unwrap(d) {
            Ok(device) => {
                drop(device);
                break;
            }
            Err(still) if Instant::now() < deadline => {
                d = still;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => {
                ctx.fail(format!(
                    "device {} was still held past every operation's timeout",
                    m.index
                ));
                return;
            }
        }
    }
    tokio::time::sleep(pause).await;
    let deadline = Instant::now() + OP_TIMEOUT;
    loop {
        match Device::open(m.dir.path(), m.options.clone()).await {
            Ok(device) => {
                *m.device.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(device));
                bump(&ctx.counters.device_restarts);
                return;
            }
            Err(e) if Instant::now() < deadline => {
                tracing::warn!("reopening device {}: {e}", m.index);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                ctx.fail(format!("device {} could not be reopened: {e}", m.index));
                return;
            }
        }
    }
}

/// A random active member of a random group rotates its keys.
async fn rotate(ctx: Arc<Ctx>) {
    let g = ctx.groups[ctx.pick(ctx.groups.len())].clone();
    let active = ctx.active(&g);
    if active.is_empty() {
        return;
    }
    let (_, d) = active[ctx.pick(active.len())].clone();
    let c = &ctx.counters;
    match tokio::time::timeout(OP_TIMEOUT, d.rotate_keys(g.id)).await {
        Ok(Ok(_)) => bump(&c.commits),
        Ok(Err(e)) => {
            tracing::info!("rotate_keys: {e}");
            bump(&c.commit_errors);
        }
        Err(_) => bump(&c.commit_errors),
    }
}

/// In a random group, the admin invites back a device of the group's share
/// that is out, or else removes a member (never below two members).
async fn change_membership(ctx: Arc<Ctx>) {
    let g = ctx.groups[ctx.pick(ctx.groups.len())].clone();
    if g.changing.swap(true, Ordering::SeqCst) {
        return;
    }
    let Some(admin) = ctx.members[g.admin].device() else {
        g.changing.store(false, Ordering::SeqCst);
        return;
    };
    let members = g.members();
    let out: Vec<usize> = g
        .share
        .iter()
        .copied()
        .filter(|i| !members.contains(i))
        .collect();
    let others: Vec<usize> = members.iter().copied().filter(|&i| i != g.admin).collect();
    // Invite back whoever is out before removing anyone else: the group
    // stays at its full size or one short, so the load's deliveries per
    // message stay steady over the run (a random walk of removals and
    // invites drifts towards small groups, and the later half of the run
    // would carry less load than the first).
    let invite = !out.is_empty();
    let c = &ctx.counters;
    let result = if invite {
        let who = out[ctx.pick(out.len())];
        let id = ctx.members[who].device().map(|d| d.id());
        match id {
            Some(id) => tokio::time::timeout(OP_TIMEOUT, invite_when_ready(&admin, g.id, id))
                .await
                .unwrap_or(Err("timed out".into())),
            // Restarting: try another time.
            None => Err("the invitee is restarting".into()),
        }
    } else if others.len() > 1 {
        let who = others[ctx.pick(others.len())];
        let id = ctx
            .index_of
            .iter()
            .find(|(_, &i)| i == who)
            .map(|(d, _)| *d);
        match id {
            Some(id) => tokio::time::timeout(OP_TIMEOUT, admin.remove(g.id, id))
                .await
                .map_err(|_| "timed out".to_string())
                .and_then(|r| r.map(|_| ()).map_err(|e| e.to_string())),
            None => Err("unknown device".into()),
        }
    } else {
        Ok(())
    };
    match result {
        Ok(()) => bump(&c.membership_changes),
        Err(e) => {
            tracing::info!("membership change: {e}");
            bump(&c.membership_errors);
        }
    }
    ctx.refresh_members(&g, &admin).await;
    g.changing.store(false, Ordering::SeqCst);
}

/// Invite `who`, trying again while it has no key package on the hub yet
/// (it uploads new ones after each claim, and a restart of the hub or of
/// the device delays that).
async fn invite_when_ready(admin: &Device, g: GroupId, who: DeviceId) -> Result<(), String> {
    loop {
        match admin.invite(g, who).await {
            Ok(_) => return Ok(()),
            Err(CommitError::NoKeyPackage(_)) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Read both sides and the counters.
fn sample(ctx: &Ctx, hub: &mut HubProcess) -> Result<Sample, String> {
    let server = hub.server()?;
    if !server.running() {
        return Err("the hub process exited on its own (see hub.log)".into());
    }
    let c = &ctx.counters;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Ok(Sample {
        t_s: ctx.start.elapsed().as_secs_f64(),
        hub_rss: server.rss()?,
        hub_fds: server.open_files()?,
        devices_rss: crate::process::rss_bytes("self")?,
        devices_fds: crate::process::open_files("self")?,
        sent: get(&c.sent),
        delivered: get(&c.delivered),
        send_errors: get(&c.send_errors),
        cuts: get(&c.cuts),
        reconnects: get(&c.reconnects),
        hub_restarts: get(&c.hub_restarts),
        device_restarts: get(&c.device_restarts),
        commits: get(&c.commits) + get(&c.membership_changes),
        commit_errors: get(&c.commit_errors) + get(&c.membership_errors),
    })
}

fn print_sample(s: &Sample) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "[{:>6.0} s] hub {:.1} MiB {} fds | devices {:.1} MiB {} fds | sent {} delivered {} | cuts {} hub restarts {} device restarts {} commits {} failed {}",
        s.t_s,
        mib(s.hub_rss),
        s.hub_fds,
        mib(s.devices_rss),
        s.devices_fds,
        s.sent,
        s.delivered,
        s.cuts,
        s.hub_restarts,
        s.device_restarts,
        s.commits,
        s.commit_errors + s.send_errors
    );
}

/// Mark every open device's inboxes processed, as an app that read its
/// messages does, so the inboxes stay bounded (a soak's growth must be a
/// leak, not messages nobody read).
fn mark_processed(ctx: &Ctx) {
    for m in &ctx.members {
        let Some(d) = m.device() else { continue };
        let joined: Vec<GroupId> = m
            .seen
            .joined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect();
        for g in joined {
            if let Ok(s) = d.inbox_status(g) {
                if s.head > s.processed {
                    let _ = d.mark_processed(g, s.head);
                }
            }
        }
    }
}

/// Whether deliveries stalled: a send has waited [`STALL`] with no
/// delivery since.
fn stall(ctx: &Ctx) -> Option<String> {
    let since = ctx.counters.waiting_since_ms.load(Ordering::SeqCst);
    if since == 0 {
        return None;
    }
    let now = ctx.start.elapsed().as_millis() as u64 + 1;
    let waited = Duration::from_millis(now.saturating_sub(since));
    (waited > STALL).then(|| {
        format!(
            "deliveries stalled: nothing delivered for {:.0} s while sent messages waited ({} sent, {} delivered in all)",
            waited.as_secs_f64(),
            ctx.counters.sent.load(Ordering::Relaxed),
            ctx.counters.delivered.load(Ordering::Relaxed)
        )
    })
}

/// After the load: every group converges and its admin's last message
/// reaches every member. Failures go to `ctx`; answers whether all
/// converged.
async fn settle(ctx: &Ctx) -> bool {
    let deadline = Instant::now() + SETTLE;
    let mut all = true;
    for (gi, g) in ctx.groups.iter().enumerate() {
        let Some(admin) = ctx.members[g.admin].device() else {
            ctx.fail(format!("group {gi}: its admin is closed at the end"));
            all = false;
            continue;
        };
        let mut last = String::new();
        let converged = loop {
            ctx.refresh_members(g, &admin).await;
            match agree(ctx, g, &admin).await {
                Ok(()) => break true,
                Err(why) => last = why,
            }
            if Instant::now() > deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if !converged {
            ctx.fail(format!("group {gi} did not converge: {last}"));
            all = false;
            continue;
        }
        let probe = match admin.send(g.id, PROBE).await {
            Ok(s) => s.id,
            Err(e) => {
                ctx.fail(format!("group {gi}: the last message was refused: {e}"));
                all = false;
                continue;
            }
        };
        let others: Vec<usize> = g.members().into_iter().filter(|&i| i != g.admin).collect();
        while !others.iter().all(|&i| {
            ctx.members[i]
                .seen
                .probes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&probe)
        }) {
            if Instant::now() > deadline {
                ctx.fail(format!(
                    "group {gi}: the last message did not reach every member"
                ));
                all = false;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    all
}

/// Whether every member of `g` (as its admin says) is open, joined, and at
/// the admin's epoch and epoch authenticator.
async fn agree(ctx: &Ctx, g: &SoakGroup, admin: &Device) -> Result<(), String> {
    let e = admin.epoch(g.id).await.map_err(|e| e.to_string())?;
    let a = admin
        .epoch_authenticator(g.id)
        .await
        .map_err(|e| e.to_string())?;
    for i in g.members() {
        let m = &ctx.members[i];
        let d = m.device().ok_or(format!("device {i} is closed"))?;
        let ei = d
            .epoch(g.id)
            .await
            .map_err(|e| format!("device {i}: {e}"))?;
        let ai = d
            .epoch_authenticator(g.id)
            .await
            .map_err(|e| format!("device {i}: {e}"))?;
        if ei != e || ai != a {
            return Err(format!(
                "device {i} is at epoch {ei}, its admin at {e}{}",
                if ei == e { " (another state)" } else { "" }
            ));
        }
    }
    Ok(())
}

/// Where the report files go.
pub fn report_files(dir: &Path) -> [PathBuf; 3] {
    [
        dir.join("samples.csv"),
        dir.join("report.md"),
        dir.join("summary.json"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_the_command_line_writes_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("15"), Ok(Duration::from_secs(15)));
        assert!(parse_duration("1d").is_err());
        assert!(parse_duration("m").is_err());
        assert!(parse_duration("-5s").is_err());
    }

    #[test]
    fn a_minute_sees_every_fault_several_times_and_an_hour_keeps_its_pace() {
        let minute = Schedule::for_run(Duration::from_secs(60));
        for every in [
            minute.cut_every,
            minute.hub_restart_every,
            minute.device_restart_every,
            minute.rotate_every,
            minute.membership_every,
        ] {
            assert!(every <= Duration::from_secs(15), "{every:?}");
        }
        let hour = Schedule::for_run(Duration::from_secs(3600));
        assert_eq!(hour.hub_restart_every, Duration::from_secs(300));
        assert_eq!(hour.cut_every, Duration::from_secs(15));
    }

    fn sample(t_s: f64, hub_rss: u64, hub_fds: u64) -> Sample {
        Sample {
            t_s,
            hub_rss,
            hub_fds,
            devices_rss: 200 << 20,
            devices_fds: 300,
            sent: 0,
            delivered: 0,
            send_errors: 0,
            cuts: 0,
            reconnects: 0,
            hub_restarts: 0,
            device_restarts: 0,
            commits: 0,
            commit_errors: 0,
        }
    }

    #[test]
    fn judging_samples_names_the_measure_that_grew() {
        let samples: Vec<Sample> = (0..60)
            .map(|t| sample(t as f64 * 60.0, 50 << 20, 40 + 2 * t))
            .collect();
        let js = judge_samples(&samples, 3600.0).unwrap();
        let grew: Vec<&str> = js
            .iter()
            .filter(|j| j.grew)
            .map(|j| j.measure.as_str())
            .collect();
        assert_eq!(grew, ["hub fds"]);
        assert!(judge_samples(&samples[..3], 180.0).is_err());
    }

    #[test]
    fn the_csv_has_a_header_and_a_line_per_sample() {
        let csv = report::samples_csv(&[sample(1.0, 10, 2), sample(2.0, 11, 3)]);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("t_s,hub_rss_bytes,hub_fds,"));
        assert!(lines[2].starts_with("2.0,11,3,"));
        assert_eq!(lines[0].split(',').count(), lines[1].split(',').count());
    }
}
