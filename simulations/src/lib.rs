//! Deterministic multi-node simulations of hubsync.
//!
//! One run takes a seed, a size and a fault plan. It starts real hubs and
//! real devices (the crate's own code, not models of it) on turmoil's
//! simulated network and clock, drives a workload drawn from the seed while
//! faults are injected, heals everything, waits for quiet, and checks the
//! invariants. The same seed gives the same run: every source of randomness
//! (turmoil's network, each tokio runtime's `select!`, the engine's RNG, the
//! MLS randomness) is seeded from it.

pub mod invariants;
pub mod net;
pub mod report;

use hubsync::clock::Clock;
use hubsync::device::{Device, DeviceOptions, Event, GroupId, Observer};
use hubsync::hub::{Hub, HubConfig, Limits};
use hubsync::kv::{KvStore, MemKv};
use hubsync::rng::SharedRng;
use hubsync::wire::DeviceId;
use invariants::{FinalGroup, FinalState, Sent, Violation};
use net::{SimConnector, SimListener};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Wall-clock time at the start of every simulated run (ms since the Unix
/// epoch), so stamps do not depend on when the run happens.
pub const SIM_EPOCH_MS: u64 = 1_800_000_000_000;
const HUB_PORT: u16 = 7400;

/// Which faults a run injects while the workload runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Faults {
    /// Partition a device from a hub, or a hub from everyone, for a while.
    pub partitions: bool,
    /// Crash a hub (losing what it had not flushed) and restart it from its
    /// store.
    pub hub_crashes: bool,
    /// Crash a device at any point, mid-commit included, and restart it
    /// from its store.
    pub device_crashes: bool,
    /// Message latency with jitter (otherwise a fixed 1 ms).
    pub latency: bool,
    /// Break TCP connections mid-frame.
    pub drops: bool,
}

impl Faults {
    /// Every fault on.
    pub const ALL: Faults = Faults {
        partitions: true,
        hub_crashes: true,
        device_crashes: true,
        latency: true,
        drops: true,
    };
    /// No fault.
    pub const NONE: Faults = Faults {
        partitions: false,
        hub_crashes: false,
        device_crashes: false,
        latency: false,
        drops: false,
    };

    /// Parse `all`, `none`, or a comma list of `partitions,hub-crashes,
    /// device-crashes,latency,drops`.
    ///
    /// # Errors
    /// The unknown name.
    pub fn parse(s: &str) -> Result<Faults, String> {
        match s {
            "all" => return Ok(Faults::ALL),
            "none" | "" => return Ok(Faults::NONE),
            _ => {}
        }
        let mut f = Faults::NONE;
        for part in s.split(',') {
            match part.trim() {
                "partitions" => f.partitions = true,
                "hub-crashes" => f.hub_crashes = true,
                "device-crashes" => f.device_crashes = true,
                "latency" => f.latency = true,
                "drops" => f.drops = true,
                other => return Err(format!("unknown fault {other:?}")),
            }
        }
        Ok(f)
    }

    /// The form [`Faults::parse`] reads back.
    pub fn to_arg(&self) -> String {
        if *self == Faults::ALL {
            return "all".into();
        }
        let mut v = Vec::new();
        for (on, name) in [
            (self.partitions, "partitions"),
            (self.hub_crashes, "hub-crashes"),
            (self.device_crashes, "device-crashes"),
            (self.latency, "latency"),
            (self.drops, "drops"),
        ] {
            if on {
                v.push(name);
            }
        }
        if v.is_empty() {
            "none".into()
        } else {
            v.join(",")
        }
    }
}

/// Deliberate engine breaks, to show the invariants catch them. Never on in
/// a normal run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Breaks {
    /// Devices merge their commit even when it lost the race.
    pub merge_on_mismatch: bool,
    /// Devices hand every message to the app twice.
    pub double_emit: bool,
    /// Outboxes never deliver.
    pub blackhole_outbox: bool,
    /// Devices never follow commits others made.
    pub no_pull: bool,
    /// Devices panic on every received message.
    pub panic_on_receive: bool,
}

/// One run's parameters.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The seed everything is drawn from.
    pub seed: u64,
    /// Devices.
    pub devices: usize,
    /// Hubs.
    pub hubs: usize,
    /// Groups.
    pub groups: usize,
    /// Workload operations after the groups are created.
    pub ops: usize,
    /// Faults injected during the workload.
    pub faults: Faults,
    /// Engine breaks (tests only).
    pub breaks: Breaks,
}

impl SimConfig {
    /// Defaults for `seed`: 5 devices, 2 hubs, 2 groups, 30 operations, all
    /// faults.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            devices: 5,
            hubs: 2,
            groups: 2,
            ops: 30,
            faults: Faults::ALL,
            breaks: Breaks::default(),
        }
    }

    /// The command that replays this run.
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run --release -p hubsync-sim -- --seed {} --devices {} --hubs {} --groups {} --ops {} --faults {}",
            self.seed,
            self.devices,
            self.hubs,
            self.groups,
            self.ops,
            self.faults.to_arg()
        )
    }
}

/// What one run found and measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SeedReport {
    /// The seed.
    pub seed: u64,
    /// Invariant violations (empty: the run passed).
    pub violations: Vec<Violation>,
    /// SHA-256 over the run's event trace: equal for equal seeds.
    pub trace_hash: String,
    /// Workload operations attempted.
    pub ops: usize,
    /// Operations that succeeded.
    pub ops_ok: usize,
    /// Messages sent (send returned).
    pub messages_sent: usize,
    /// Message deliveries observed.
    pub deliveries: usize,
    /// Commits landed (by the devices' own count, crashes aside).
    pub commits: usize,
    /// Faults injected.
    pub faults_injected: usize,
    /// Simulated ms from the end of faults until every invariant's
    /// precondition held (converged, outboxes drained), if it did.
    pub converge_ms: Option<u64>,
    /// Simulated ms of the whole run.
    pub sim_ms: u64,
}

/// A request from the driver to one device host.
enum Cmd {
    Create(Vec<String>, oneshot::Sender<Result<GroupId, String>>),
    Invite(GroupId, DeviceId, oneshot::Sender<Result<u64, String>>),
    Remove(GroupId, DeviceId, oneshot::Sender<Result<u64, String>>),
    Rotate(GroupId, oneshot::Sender<Result<u64, String>>),
    Send(
        GroupId,
        Vec<u8>,
        oneshot::Sender<Result<([u8; 16], u64), String>>,
    ),
    Bind(GroupId, String, bool, oneshot::Sender<Result<(), String>>),
    State(oneshot::Sender<FinalState>),
}

/// What the outer loop does between steps on the driver's request.
#[derive(Debug)]
enum Control {
    CrashHub(usize),
    RestartHub(usize),
    CrashDevice(usize),
    RestartDevice(usize),
    Drops(bool),
}

/// Everything the hosts, the driver and the outer loop share. The
/// simulation runs on one thread; the mutexes are for `Send` bounds only.
struct World {
    trace: Mutex<Vec<String>>,
    events: Mutex<Vec<(u64, usize, Event)>>,
    control: Mutex<Vec<Control>>,
    ids: Mutex<BTreeMap<usize, DeviceId>>,
}

impl World {
    fn trace(&self, line: String) {
        self.trace
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(line);
    }
    fn control(&self, c: Control) {
        self.trace(format!("{} control {c:?}", now_ms()));
        self.control
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(c);
    }
}

fn now_ms() -> u64 {
    turmoil::sim_elapsed()
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn hub_name(i: usize) -> String {
    format!("hub{i}")
}

fn hub_url(i: usize) -> String {
    format!("ws://hub{i}:{HUB_PORT}")
}

fn dev_name(i: usize) -> String {
    format!("dev{i}")
}

/// Per-host restart counters: a restarted host draws fresh randomness (a
/// device must never replay the secrets of its previous run).
type Restarts = Rc<RefCell<BTreeMap<String, u64>>>;

fn next_incarnation(restarts: &Restarts, name: &str) -> u64 {
    let mut r = restarts.borrow_mut();
    let n = r.entry(name.to_string()).or_insert(0);
    *n += 1;
    *n
}

fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut h = Sha256::new();
    h.update(seed.to_be_bytes());
    h.update(a.to_be_bytes());
    h.update(b.to_be_bytes());
    let d = h.finalize();
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

fn host_clock() -> Clock {
    // Continue the simulated wall clock across restarts of the host.
    Clock::tokio(SIM_EPOCH_MS + now_ms())
}

/// Run one seed to the end and check the invariants.
pub fn run_seed(cfg: &SimConfig) -> SeedReport {
    let panics = invariants::PanicCatcher::install();
    let world = Arc::new(World {
        trace: Mutex::new(Vec::new()),
        events: Mutex::new(Vec::new()),
        control: Mutex::new(Vec::new()),
        ids: Mutex::new(BTreeMap::new()),
    });
    let mut builder = turmoil::Builder::new();
    builder
        .rng_seed(cfg.seed)
        .simulation_duration(Duration::from_secs(3600))
        .tick_duration(Duration::from_millis(1))
        .tcp_capacity(1 << 16);
    if cfg.faults.latency {
        builder
            .min_message_latency(Duration::from_millis(1))
            .max_message_latency(Duration::from_millis(40));
    } else {
        builder
            .min_message_latency(Duration::from_millis(1))
            .max_message_latency(Duration::from_millis(1));
    }
    let mut sim = builder.build();
    let restarts: Restarts = Rc::default();

    let hub_stores: Vec<MemKv> = (0..cfg.hubs).map(|_| MemKv::new()).collect();
    for (i, store) in hub_stores.iter().enumerate() {
        let store = store.clone();
        let restarts = restarts.clone();
        let seed = cfg.seed;
        sim.host(hub_name(i), move || {
            let store = store.clone();
            let n = next_incarnation(&restarts, &hub_name(i));
            async move {
                let listener = turmoil::net::TcpListener::bind(("0.0.0.0", HUB_PORT)).await?;
                let mut config = HubConfig::new(hub_url(i));
                config.limits = Limits::unthrottled();
                let kv: Arc<dyn KvStore> = Arc::new(store);
                let hub = Hub::start(
                    kv,
                    config,
                    host_clock(),
                    SharedRng::seeded(mix(seed, 1000 + i as u64, n)),
                )
                .map_err(|e| e.to_string())?;
                hub.serve(SimListener(listener));
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }

    let dev_stores: Vec<MemKv> = (0..cfg.devices).map(|_| MemKv::new()).collect();
    let mut senders = Vec::new();
    for (i, store) in dev_stores.iter().enumerate() {
        let (tx, rx) = mpsc::channel::<Cmd>(64);
        senders.push(tx);
        let rx = Rc::new(RefCell::new(rx));
        let store = store.clone();
        let restarts = restarts.clone();
        let world = world.clone();
        let cfg = cfg.clone();
        sim.host(dev_name(i), move || {
            let store = store.clone();
            let rx = rx.clone();
            let world = world.clone();
            let n = next_incarnation(&restarts, &dev_name(i));
            let cfg = cfg.clone();
            async move { device_host(i, n, cfg, store, rx, world).await }
        });
    }

    let driver_world = world.clone();
    let driver_cfg = cfg.clone();
    let result: Rc<RefCell<Option<DriverResult>>> = Rc::default();
    let out = result.clone();
    sim.client("driver", async move {
        let r = drive(driver_cfg, senders, driver_world).await;
        *out.borrow_mut() = Some(r);
        Ok(())
    });

    let mut faults_injected = 0usize;
    let mut sim_error = None;
    loop {
        let pending: Vec<Control> =
            std::mem::take(&mut *world.control.lock().unwrap_or_else(|p| p.into_inner()));
        for c in pending {
            match c {
                Control::CrashHub(i) => {
                    faults_injected += 1;
                    sim.crash(hub_name(i));
                    hub_stores[i].crash();
                }
                Control::RestartHub(i) => sim.bounce(hub_name(i)),
                Control::CrashDevice(i) => {
                    faults_injected += 1;
                    sim.crash(dev_name(i));
                    dev_stores[i].crash();
                }
                Control::RestartDevice(i) => sim.bounce(dev_name(i)),
                Control::Drops(on) => {
                    if on {
                        faults_injected += 1;
                    }
                    sim.set_fail_rate(if on { 0.002 } else { 0.0 });
                }
            }
        }
        // A panicking task shuts its host's runtime down and the panic comes
        // out of the step: record it as the violation it is.
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.step()));
        match step {
            Ok(Ok(true)) => break,
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                sim_error = Some(e.to_string());
                break;
            }
            Err(_) => {
                sim_error = Some("a host panicked".into());
                break;
            }
        }
    }
    let sim_ms = sim.elapsed().as_millis() as u64;
    drop(sim);

    let driver = result.borrow_mut().take();
    let events = std::mem::take(&mut *world.events.lock().unwrap_or_else(|p| p.into_inner()));
    let mut violations = Vec::new();
    if let Some(e) = sim_error {
        violations.push(Violation::new(
            "no-panic",
            None,
            vec![],
            format!("simulation failed: {e}"),
        ));
    }
    for p in panics.take() {
        violations.push(Violation::new("no-panic", None, vec![], p));
    }
    let (ops, ops_ok, sent, finals, heads, converge_ms, faults_from_driver) = match driver {
        Some(d) => (
            d.ops,
            d.ops_ok,
            d.sent,
            d.finals,
            d.heads,
            d.converge_ms,
            d.faults,
        ),
        None => {
            violations.push(Violation::new(
                "no-panic",
                None,
                vec![],
                "the driver did not finish".into(),
            ));
            (0, 0, vec![], vec![], BTreeMap::new(), None, 0)
        }
    };
    let ids = world.ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
    violations.extend(invariants::check(&finals, &heads, &sent, &events, &ids));
    if converge_ms.is_none() && violations.is_empty() {
        violations.push(Violation::new(
            "quiescence",
            None,
            vec![],
            "the system did not settle after the faults stopped".into(),
        ));
    }

    if let Ok(path) = std::env::var("HUBSYNC_SIM_TRACE") {
        // A readable trace of the run, for chasing a failing seed.
        let mut out = world
            .trace
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        out.extend(
            events
                .iter()
                .map(|(t, d, e)| format!("{t} dev{d} {}", invariants::event_line(e))),
        );
        let _ = std::fs::write(path, out.join("\n"));
    }
    let mut h = Sha256::new();
    for line in world.trace.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        h.update(line.as_bytes());
        h.update(b"\n");
    }
    for (t, d, e) in &events {
        h.update(format!("{t} {d} {}\n", invariants::event_line(e)).as_bytes());
    }
    let deliveries = events
        .iter()
        .filter(|(_, _, e)| matches!(e, Event::MessageReceived { .. }))
        .count();
    let commits = finals.iter().map(|f| f.commits as usize).sum();
    SeedReport {
        seed: cfg.seed,
        violations,
        trace_hash: hex::encode(h.finalize()),
        ops,
        ops_ok,
        messages_sent: sent.len(),
        deliveries,
        commits,
        faults_injected: faults_injected + faults_from_driver,
        converge_ms,
        sim_ms,
    }
}

/// A device host: open the device from its store and serve the driver's
/// commands until the host is crashed.
async fn device_host(
    i: usize,
    incarnation: u64,
    cfg: SimConfig,
    store: MemKv,
    rx: Rc<RefCell<mpsc::Receiver<Cmd>>>,
    world: Arc<World>,
) -> turmoil::Result {
    let hubs: Vec<String> = (0..cfg.hubs).map(hub_url).collect();
    let mut o = DeviceOptions::new(hubs);
    o.connector = Arc::new(SimConnector);
    o.clock = host_clock();
    o.rng = Some(SharedRng::seeded(mix(cfg.seed, i as u64, incarnation)));
    o.mls_seed = Some(mix(cfg.seed, 500 + i as u64, incarnation));
    o.manager.link.backoff_base = Duration::from_millis(100);
    o.manager.link.backoff_max = Duration::from_secs(2);
    o.manager.link.stable_after = Duration::from_millis(500);
    o.manager.link.client.request_timeout = Duration::from_secs(5);
    o.manager.link.client.connect_timeout = Duration::from_secs(5);
    o.outbox.retry_base = Duration::from_millis(100);
    o.outbox.retry_max = Duration::from_secs(2);
    o.manager.commit_deadline = Duration::from_secs(60);
    let w = world.clone();
    o.manager.observer = Some(Observer(Arc::new(move |e: &Event| {
        if let Event::HubStatus { .. } = e {
            return;
        }
        w.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((now_ms(), i, e.clone()));
    })));
    let device = Arc::new(
        Device::open_store(Arc::new(store), o)
            .await
            .map_err(|e| e.to_string())?,
    );
    {
        use std::sync::atomic::Ordering::Relaxed;
        let f = device.manager().faults();
        f.merge_on_mismatch
            .store(cfg.breaks.merge_on_mismatch, Relaxed);
        f.double_emit.store(cfg.breaks.double_emit, Relaxed);
        f.blackhole_outbox
            .store(cfg.breaks.blackhole_outbox, Relaxed);
        f.no_pull.store(cfg.breaks.no_pull, Relaxed);
        f.panic_on_receive
            .store(cfg.breaks.panic_on_receive, Relaxed);
    }
    world
        .ids
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(i, device.id());
    world.trace(format!("{} dev{i} up (run {incarnation})", now_ms()));
    loop {
        // The receiver outlives the host (the driver keeps the sender), so a
        // restarted host picks up where the crashed one left off.
        let cmd = {
            let mut r = rx.borrow_mut();
            match r.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::error::TryRecvError::Empty) => None,
                Err(mpsc::error::TryRecvError::Disconnected) => return Ok(()),
            }
        };
        let Some(cmd) = cmd else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let d = device.clone();
        tokio::task::spawn_local(async move { serve(d, cmd).await });
    }
}

async fn serve(d: Arc<Device>, cmd: Cmd) {
    let s = |e: hubsync::device::DeviceError| e.to_string();
    let c = |e: hubsync::device::CommitError| e.to_string();
    match cmd {
        Cmd::Create(hubs, r) => {
            let _ = r.send(d.create_group(&hubs).await.map_err(s));
        }
        Cmd::Invite(g, who, r) => {
            let _ = r.send(d.invite(g, who).await.map(|r| r.outcome.epoch).map_err(c));
        }
        Cmd::Remove(g, who, r) => {
            let _ = r.send(d.remove(g, who).await.map(|r| r.outcome.epoch).map_err(c));
        }
        Cmd::Rotate(g, r) => {
            let _ = r.send(d.rotate_keys(g).await.map(|r| r.outcome.epoch).map_err(c));
        }
        Cmd::Send(g, body, r) => {
            let _ = r.send(d.send(g, &body).await.map(|m| (m.id, m.epoch)).map_err(s));
        }
        Cmd::Bind(g, hub, on, r) => {
            let res = if on {
                d.bind_hub(g, &hub).await
            } else {
                d.unbind_hub(g, &hub).await
            };
            let _ = r.send(res.map(|_| ()).map_err(c));
        }
        Cmd::State(r) => {
            let _ = r.send(final_state(&d).await);
        }
    }
}

async fn final_state(d: &Device) -> FinalState {
    let mut groups = Vec::new();
    for g in d.groups().unwrap_or_default() {
        let (Ok(epoch), Ok(auth), Ok(members), Ok(rec)) = (
            d.epoch(g).await,
            d.epoch_authenticator(g).await,
            d.members(g).await,
            d.manager().record(g),
        ) else {
            continue;
        };
        groups.push(FinalGroup {
            group: g,
            epoch,
            authenticator: auth,
            members,
            commit_cursor: rec.cursor(),
            commit_hub: rec.commit_hub,
            stranded: rec.stranded,
        });
    }
    let stats = d.stats();
    FinalState {
        device: d.id(),
        groups,
        outbox_pending: d.manager().outbox().pending().unwrap_or(usize::MAX),
        commits: stats.commits,
    }
}

struct DriverResult {
    ops: usize,
    ops_ok: usize,
    sent: Vec<Sent>,
    finals: Vec<FinalState>,
    heads: BTreeMap<GroupId, Option<u64>>,
    converge_ms: Option<u64>,
    faults: usize,
}

/// Ask a device something; `None` when it did not answer (crashed, or
/// still busy after `limit`).
async fn ask<T>(
    tx: &mpsc::Sender<Cmd>,
    limit: Duration,
    make: impl FnOnce(oneshot::Sender<T>) -> Cmd,
) -> Option<T> {
    let (rtx, rrx) = oneshot::channel();
    tx.send(make(rtx)).await.ok()?;
    tokio::time::timeout(limit, rrx).await.ok()?.ok()
}

const OP_LIMIT: Duration = Duration::from_secs(90);

async fn drive(cfg: SimConfig, devs: Vec<mpsc::Sender<Cmd>>, world: Arc<World>) -> DriverResult {
    let mut rng = ChaCha20Rng::seed_from_u64(mix(cfg.seed, 7, 7));
    // Let every host come up and stock its key packages.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: BTreeMap<usize, DeviceId> =
        world.ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut ops = 0usize;
    let mut ok = 0usize;
    let mut sent = Vec::new();
    let mut faults = 0usize;
    // The driver's belief about membership (devices' answers decide in the end).
    let mut groups: Vec<(GroupId, BTreeSet<usize>)> = Vec::new();
    for _ in 0..cfg.groups {
        let creator = rng.gen_range(0..cfg.devices);
        let mut hubs: Vec<String> = (0..cfg.hubs).map(hub_url).collect();
        // A random non-empty subset in random order; the first is the
        // commit hub.
        for k in (1..hubs.len()).rev() {
            hubs.swap(k, rng.gen_range(0..=k));
        }
        hubs.truncate(rng.gen_range(1..=cfg.hubs));
        let r = ask(&devs[creator], OP_LIMIT, |r| Cmd::Create(hubs.clone(), r)).await;
        ops += 1;
        world.trace(format!(
            "{} create by dev{creator}: {:?}",
            now_ms(),
            r.as_ref().map(|x| x.is_ok())
        ));
        if let Some(Ok(g)) = r {
            ok += 1;
            groups.push((g, BTreeSet::from([creator])));
        }
    }
    if groups.is_empty() {
        return DriverResult {
            ops,
            ops_ok: ok,
            sent,
            finals: Vec::new(),
            heads: BTreeMap::new(),
            converge_ms: None,
            faults,
        };
    }

    // Give each group a couple of members before the faults start.
    for (gi, (g, members)) in groups.iter_mut().enumerate() {
        let by = *members.iter().next().unwrap_or(&0);
        for _ in 0..rng.gen_range(1..=2usize) {
            let outsiders: Vec<usize> = (0..cfg.devices).filter(|k| !members.contains(k)).collect();
            if outsiders.is_empty() {
                break;
            }
            let who = outsiders[rng.gen_range(0..outsiders.len())];
            let Some(id) = ids.get(&who).copied() else {
                continue;
            };
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Invite(*g, id, r)).await;
            ops += 1;
            if let Some(Ok(_)) = r {
                ok += 1;
                members.insert(who);
            }
            world.trace(format!(
                "{} setup g{gi} invite dev{who} by dev{by} -> {r:?}",
                now_ms()
            ));
        }
    }

    let mut crashed_devs: BTreeSet<usize> = BTreeSet::new();
    let mut crashed_hubs: BTreeSet<usize> = BTreeSet::new();
    let mut partitions: Vec<(String, String)> = Vec::new();
    for step in 0..cfg.ops {
        // Faults: each kind on its own schedule drawn from the seed.
        if cfg.faults.device_crashes && rng.gen_bool(0.08) {
            let i = rng.gen_range(0..cfg.devices);
            if crashed_devs.insert(i) {
                world.control(Control::CrashDevice(i));
            }
        }
        if !crashed_devs.is_empty() && rng.gen_bool(0.3) {
            let i = *crashed_devs.iter().next().unwrap_or(&0);
            crashed_devs.remove(&i);
            world.control(Control::RestartDevice(i));
        }
        if cfg.faults.hub_crashes && rng.gen_bool(0.04) {
            let i = rng.gen_range(0..cfg.hubs);
            if crashed_hubs.insert(i) {
                world.control(Control::CrashHub(i));
            }
        }
        if !crashed_hubs.is_empty() && rng.gen_bool(0.4) {
            let i = *crashed_hubs.iter().next().unwrap_or(&0);
            crashed_hubs.remove(&i);
            world.control(Control::RestartHub(i));
        }
        if cfg.faults.partitions && rng.gen_bool(0.08) {
            let h = hub_name(rng.gen_range(0..cfg.hubs));
            let other = if rng.gen_bool(0.3) {
                None
            } else {
                Some(dev_name(rng.gen_range(0..cfg.devices)))
            };
            match other {
                Some(d) => {
                    turmoil::partition(h.as_str(), d.as_str());
                    partitions.push((h.clone(), d.clone()));
                    world.trace(format!("{} partition {h} {d}", now_ms()));
                }
                None => {
                    for k in 0..cfg.devices {
                        turmoil::partition(h.as_str(), dev_name(k).as_str());
                        partitions.push((h.clone(), dev_name(k)));
                    }
                    world.trace(format!("{} isolate {h}", now_ms()));
                }
            }
            faults += 1;
        }
        if !partitions.is_empty() && rng.gen_bool(0.25) {
            for (a, b) in partitions.drain(..) {
                turmoil::repair(a.as_str(), b.as_str());
            }
            world.trace(format!("{} repair", now_ms()));
        }
        if cfg.faults.drops && step % 10 == 0 {
            world.control(Control::Drops(rng.gen_bool(0.5)));
        }

        // The operation, by members that are up (a crashed device cannot
        // take a command; one crashed mid-command simply never answers).
        let gi = rng.gen_range(0..groups.len());
        let (g, members) = groups[gi].clone();
        let member: Vec<usize> = members
            .iter()
            .copied()
            .filter(|m| !crashed_devs.contains(m))
            .collect();
        if member.is_empty() {
            continue;
        }
        let pick = |rng: &mut ChaCha20Rng| member[rng.gen_range(0..member.len())];
        let roll = rng.gen_range(0..100);
        ops += 1;
        let line = if roll < 45 {
            let by = pick(&mut rng);
            let body = format!("s{} m{step} from dev{by}", cfg.seed).into_bytes();
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Send(g, body.clone(), r)).await;
            if let Some(Ok((id, epoch))) = r {
                ok += 1;
                sent.push(Sent {
                    group: g,
                    sender: ids.get(&by).copied().unwrap_or(DeviceId([0; 32])),
                    id,
                    epoch,
                });
            }
            format!("send dev{by} -> {:?}", r.map(|x| x.map(|v| v.1)))
        } else if roll < 60 {
            let by = pick(&mut rng);
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Rotate(g, r)).await;
            ok += usize::from(matches!(r, Some(Ok(_))));
            format!("rotate dev{by} -> {r:?}")
        } else if roll < 70 {
            // Several members commit at the same moment.
            let n = rng.gen_range(2..=3).min(member.len());
            let mut who = member.clone();
            for k in (1..who.len()).rev() {
                who.swap(k, rng.gen_range(0..=k));
            }
            who.truncate(n);
            let waits = who
                .iter()
                .map(|by| ask(&devs[*by], OP_LIMIT, |r| Cmd::Rotate(g, r)));
            let rs = futures::future::join_all(waits).await;
            ok += usize::from(rs.iter().all(|r| matches!(r, Some(Ok(_)))));
            format!("concurrent {who:?} -> {rs:?}")
        } else if roll < 85 {
            let by = pick(&mut rng);
            let outsiders: Vec<usize> = (0..cfg.devices)
                .filter(|k| !members.contains(k) && !crashed_devs.contains(k))
                .collect();
            if outsiders.is_empty() {
                ops -= 1;
                continue;
            }
            let who = outsiders[rng.gen_range(0..outsiders.len())];
            let Some(id) = ids.get(&who).copied() else {
                continue;
            };
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Invite(g, id, r)).await;
            if let Some(Ok(_)) = r {
                ok += 1;
                groups[gi].1.insert(who);
            }
            format!("invite dev{who} by dev{by} -> {r:?}")
        } else if roll < 93 {
            if member.len() < 3 {
                ops -= 1;
                continue;
            }
            let by = pick(&mut rng);
            let who = pick(&mut rng);
            if who == by {
                ops -= 1;
                continue;
            }
            let Some(id) = ids.get(&who).copied() else {
                continue;
            };
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Remove(g, id, r)).await;
            if let Some(Ok(_)) = r {
                ok += 1;
                groups[gi].1.remove(&who);
            }
            format!("remove dev{who} by dev{by} -> {r:?}")
        } else {
            let by = pick(&mut rng);
            let hub = hub_url(rng.gen_range(0..cfg.hubs));
            let on = rng.gen_bool(0.5);
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Bind(g, hub.clone(), on, r)).await;
            ok += usize::from(matches!(r, Some(Ok(_))));
            format!("bind {on} {hub} dev{by} -> {r:?}")
        };
        world.trace(format!("{} op {step} g{gi} {line}", now_ms()));
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
    }

    // Heal everything, then wait for quiet.
    for (a, b) in partitions.drain(..) {
        turmoil::repair(a.as_str(), b.as_str());
    }
    for i in std::mem::take(&mut crashed_devs) {
        world.control(Control::RestartDevice(i));
    }
    for i in std::mem::take(&mut crashed_hubs) {
        world.control(Control::RestartHub(i));
    }
    world.control(Control::Drops(false));
    let healed_at = now_ms();
    world.trace(format!("{healed_at} healed"));
    // Quiet long enough that a connection the faults left hanging is found
    // dead by its keepalive and resumed; then look.
    const QUIET: u64 = 45_000;
    const GIVE_UP: u64 = 300_000;
    let mut converge_ms = None;
    let mut finals = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        finals.clear();
        for tx in &devs {
            match ask(tx, Duration::from_secs(20), Cmd::State).await {
                Some(s) => finals.push(s),
                None => finals.push(FinalState::unreachable()),
            }
        }
        let since = now_ms() - healed_at;
        if invariants::settled(&finals) {
            converge_ms.get_or_insert(since);
            if since >= QUIET {
                break;
            }
        } else {
            converge_ms = None;
        }
        if since >= GIVE_UP {
            break;
        }
    }
    let heads = commit_heads(&finals, cfg.seed).await;
    DriverResult {
        ops,
        ops_ok: ok,
        sent,
        finals,
        heads,
        converge_ms,
        faults,
    }
}

/// The head of each group's commit log on its commit hub, read by an
/// outside client.
async fn commit_heads(finals: &[FinalState], seed: u64) -> BTreeMap<GroupId, Option<u64>> {
    let mut hubs: BTreeMap<GroupId, String> = BTreeMap::new();
    for f in finals {
        for g in &f.groups {
            hubs.insert(g.group, g.commit_hub.clone());
        }
    }
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&mix(seed, 9, 9).to_be_bytes());
    let key = ed25519_dalek::SigningKey::from_bytes(&key);
    let mut heads = BTreeMap::new();
    for (g, hub) in hubs {
        let head = match hubsync::client::HubClient::connect(
            &SimConnector,
            &hub,
            &key,
            Default::default(),
        )
        .await
        {
            Ok(c) => c
                .fetch(&hubsync::device::topics::commit_topic(&g.0), 0, 1)
                .await
                .ok()
                .and_then(|f| f.head),
            Err(_) => None,
        };
        heads.insert(g, head);
    }
    heads
}
