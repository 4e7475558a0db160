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
pub mod store;
pub mod storm;

use hubsync::clock::Clock;
use hubsync::device::lane::CommitError;
use hubsync::device::{Device, DeviceOptions, Event, GroupId, Observer};
use hubsync::hub::{Hub, HubConfig, Limits};
use hubsync::kv::{KvStore, MemKv};
use hubsync::rng::SharedRng;
use hubsync::wire::DeviceId;
use invariants::{Accepted, FinalGroup, FinalState, History, Outage, Rewind, Sent, Violation};
use net::{SimConnector, SimListener};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::{HubDisk, Snapshot};
use tokio::sync::{mpsc, oneshot};

/// Wall-clock time at the start of every simulated run (ms since the Unix
/// epoch), so stamps do not depend on when the run happens.
///
/// It lies in the past (2025-06-15) because OpenMLS checks a key package's
/// lifetime against the real system clock: the devices' key packages start
/// at this time and last [`SIM_KEY_PACKAGE_LIFETIME`], so they are valid now
/// and for a century, whenever the run happens.
pub const SIM_EPOCH_MS: u64 = 1_750_000_000_000;

/// The devices' key package lifetime (see [`SIM_EPOCH_MS`]).
pub const SIM_KEY_PACKAGE_LIFETIME: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);
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
    /// Restart a hub from an older snapshot of its durable store, or from
    /// an empty store (a restore from backup, a lost data directory).
    pub rewinds: bool,
    /// Devices outside a group that learned its commit topic publish on it
    /// (garbage, replayed commit frames, frames claiming far-future epochs),
    /// and removed members keep publishing old commit frames.
    pub strangers: bool,
    /// Long device outages: a device stays down for 8 to 15 workload steps
    /// while the hubs keep only [`OUTAGE_LOG_DEPTH`] frames a log, so it
    /// comes back past the logs' depth (stranded, it must rejoin; app
    /// frames trimmed before it read them are reported, not delivered).
    pub outages: bool,
}

/// Frames a hub keeps per log when `outages` are on (otherwise the hub's
/// default), so that a device away for a while really finds its logs
/// trimmed.
pub const OUTAGE_LOG_DEPTH: u64 = 4;

impl Faults {
    /// Every fault on.
    pub const ALL: Faults = Faults {
        partitions: true,
        hub_crashes: true,
        device_crashes: true,
        latency: true,
        drops: true,
        rewinds: true,
        strangers: true,
        outages: true,
    };
    /// No fault.
    pub const NONE: Faults = Faults {
        partitions: false,
        hub_crashes: false,
        device_crashes: false,
        latency: false,
        drops: false,
        rewinds: false,
        strangers: false,
        outages: false,
    };

    /// Parse `all`, `none`, or a comma list of `partitions,hub-crashes,
    /// device-crashes,latency,drops,rewinds,strangers,outages`.
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
                "rewinds" => f.rewinds = true,
                "strangers" => f.strangers = true,
                "outages" => f.outages = true,
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
            (self.rewinds, "rewinds"),
            (self.strangers, "strangers"),
            (self.outages, "outages"),
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
    /// Halfway through the workload, one member's store loses the last entry of its
    /// stored ledger of the first group, as an engine that failed to
    /// persist the entries a commit enacted would. (No engine switch
    /// breaks the ledger; this breaks the device's store from outside.)
    pub forget_ledger_entry: bool,
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
    /// Add tunnel calls between members to the workload: a streamed
    /// procedure answers a count of numbered items, which must arrive in
    /// order exactly once, or the call must report why it ended.
    pub tunnels: bool,
    /// Tokio tasks spawned (and finished) before the run. Tokio numbers
    /// tasks from one counter per process, and a crashed host's tasks are
    /// dropped in an order that follows those numbers (its task list is
    /// sharded by task id), so the same seed after another number of tasks
    /// is another run: this replays a seed under another drop order. Only
    /// a fresh process starts the counter at a known value, which is why
    /// the binary runs every seed in its own process.
    pub tasks_before: u64,
    /// Devices that share one simulated machine (a turmoil host): they
    /// crash, restart and are cut off together. More than one keeps a
    /// crowd affordable: turmoil's cost per step grows with hosts times
    /// links. 1 (the default) gives every device its own machine.
    pub devices_per_host: usize,
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
            tunnels: false,
            tasks_before: 0,
            devices_per_host: 1,
        }
    }

    /// The command-line arguments of `hubsync-sim` that give this run
    /// (breaks aside: only tests set them).
    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = [
            ("--seed", self.seed.to_string()),
            ("--devices", self.devices.to_string()),
            ("--hubs", self.hubs.to_string()),
            ("--groups", self.groups.to_string()),
            ("--ops", self.ops.to_string()),
            ("--faults", self.faults.to_arg()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if self.tunnels {
            a.push("--tunnels".into());
        }
        if self.devices_per_host != 1 {
            a.extend([
                "--devices-per-host".into(),
                self.devices_per_host.to_string(),
            ]);
        }
        if self.tasks_before != 0 {
            a.extend(["--tasks-before".into(), self.tasks_before.to_string()]);
        }
        a
    }

    /// The command that replays this run.
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run --release -p hubsync-sim -- {}",
            self.args().join(" ")
        )
    }

    /// Which simulated machine device `i` runs on, by name.
    fn host_of(&self, i: usize) -> String {
        match self.devices_per_host {
            0 | 1 => dev_name(i),
            k => format!("host{}", i / k),
        }
    }

    /// The devices that share device `i`'s machine (`i` among them).
    fn co_hosted(&self, i: usize) -> std::ops::Range<usize> {
        let k = self.devices_per_host.max(1);
        let first = i / k * k;
        first..(first + k).min(self.devices)
    }
}

/// What one run found and measured.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
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
    /// Hub rewinds among them (to an older copy or an empty store).
    pub rewinds: usize,
    /// Long device outages among them.
    pub outages: usize,
    /// Frames strangers and removed members published on commit topics.
    pub stranger_frames: usize,
    /// Admin operations tried by non-admins and refused by the ledger.
    pub refused: usize,
    /// Tunnel calls that ended, with all their items or reporting why not
    /// (with `tunnels` on).
    pub tunnel_calls: usize,
    /// Tunnel calls that got all their items.
    pub tunnels_done: usize,
    /// History syncs that answered (with `tunnels` on).
    pub history_syncs: usize,
    /// Accepted commits and missing deliveries not judged because a rewind
    /// may have erased them.
    pub excused: usize,
    /// Times a device found itself stranded (`Event::Stranded`).
    pub strands: usize,
    /// Ledgers gathered from members and installed (`Event::LedgerGathered`).
    pub gathers: usize,
    /// Rejoins by external commit (`Event::Rejoined`).
    pub rejoins: usize,
    /// Remedies that did not help (`Event::RecoveryFailed`).
    pub recoveries_failed: usize,
    /// Simulated ms from the end of faults until every invariant's
    /// precondition held (converged, outboxes drained), if it did.
    pub converge_ms: Option<u64>,
    /// Simulated ms of the whole run.
    pub sim_ms: u64,
    /// Each hub restart's reconnect storm (see [`storm`]).
    #[serde(default)]
    pub storms: Vec<storm::Storm>,
}

impl SeedReport {
    /// The report of a seed whose process died before it could report:
    /// one `no-panic` violation saying why, nothing measured.
    pub fn process_died(seed: u64, why: String) -> Self {
        Self {
            seed,
            violations: vec![Violation::new("no-panic", None, Vec::new(), why)],
            trace_hash: String::new(),
            ops: 0,
            ops_ok: 0,
            messages_sent: 0,
            deliveries: 0,
            commits: 0,
            faults_injected: 0,
            rewinds: 0,
            outages: 0,
            stranger_frames: 0,
            refused: 0,
            tunnel_calls: 0,
            tunnels_done: 0,
            history_syncs: 0,
            excused: 0,
            strands: 0,
            gathers: 0,
            rejoins: 0,
            recoveries_failed: 0,
            converge_ms: None,
            sim_ms: 0,
            storms: Vec::new(),
        }
    }
}

/// A commit that landed: the epoch it made and the committer's commit hub
/// right after.
#[derive(Clone, Debug)]
struct Landed {
    epoch: u64,
    hub: String,
}

/// Why an operation did not land; `ledger` when the ledger refused it
/// (`CommitError::Ledger`).
#[derive(Clone, Debug)]
struct Refusal {
    ledger: bool,
    /// Shown in the trace (through `Debug`).
    #[allow(dead_code)]
    text: String,
}

impl Landed {
    /// The history's record of this commit, by `by` in `group`, now.
    fn accepted(&self, group: GroupId, by: DeviceId) -> Accepted {
        Accepted {
            group,
            by,
            epoch: self.epoch,
            hub: self.hub.clone(),
            at_ms: now_ms(),
        }
    }
}

/// What a commit operation answered.
type Outcome = Result<Landed, Refusal>;

type Answer = oneshot::Sender<Outcome>;

/// One device's view of a group, for the driver's choices.
#[derive(Clone, Debug)]
struct View {
    commit_seed: [u8; 32],
    commit_hub: String,
    /// Bound hubs, as the ledger says.
    hubs: Vec<String>,
}

/// A request from the driver to one device host.
enum Cmd {
    Create(Vec<String>, oneshot::Sender<Result<GroupId, String>>),
    Invite(GroupId, DeviceId, Answer),
    Remove(GroupId, DeviceId, Answer),
    Grant(GroupId, DeviceId, Answer),
    Revoke(GroupId, DeviceId, Answer),
    Rotate(GroupId, Answer),
    Send(
        GroupId,
        Vec<u8>,
        oneshot::Sender<Result<([u8; 16], u64), String>>,
    ),
    Bind(GroupId, String, bool, Answer),
    SetCommitHub(GroupId, String, Answer),
    View(GroupId, oneshot::Sender<Option<View>>),
    /// Publish, as this device, copies of up to `n` old frames of a commit
    /// topic on a hub (a removed member that keeps writing); answers how
    /// many were accepted.
    Replay(
        hubsync::wire::TopicId,
        Option<Box<hubsync::device::topics::TopicWriter>>,
        String,
        usize,
        u64,
        oneshot::Sender<usize>,
    ),
    State(oneshot::Sender<FinalState>),
    /// Open a tunnel to a member and call [`COUNT`] for this many items.
    Tunnel(GroupId, DeviceId, u32, oneshot::Sender<TunnelCall>),
    /// Let members hand on this many of the group's newest messages.
    ShareHistory(GroupId, u64, Answer),
    /// Ask a member over a tunnel for the history the group allows.
    SyncHistory(
        GroupId,
        oneshot::Sender<Result<hubsync::device::tunnel::history::HistorySummary, String>>,
    ),
}

/// How many messages the simulated groups let members hand on (with
/// `tunnels` on).
const SHARE_LAST: u64 = 8;

/// The streamed procedure every device serves in the simulation: the
/// body is a count n (u32, big-endian), the responses are 0..n in order.
const COUNT: &str = "sim.count";

/// What one tunnel call of the workload saw.
#[derive(Clone, Debug)]
struct TunnelCall {
    /// The items, in the order they arrived.
    items: Vec<u32>,
    /// How the call ended: `Ok` once the procedure ended, else the error
    /// the device reported (opening, calling, or mid-stream).
    end: Result<(), String>,
}

/// The procedures every simulated device serves.
fn sim_procedures() -> hubsync::device::tunnel::Procedures {
    hubsync::device::tunnel::Procedures::new().streamed(COUNT, |_, body, sink| async move {
        let n = body
            .get(..4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_be_bytes)
            .ok_or("a count is 4 bytes")?;
        for k in 0..n {
            sink.send(k.to_be_bytes().to_vec())
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}

/// Open a tunnel from `d` to `to` in `g`, call [`COUNT`] for `n` items,
/// and read the stream to its end.
async fn tunnel_call(d: &Device, g: GroupId, to: DeviceId, n: u32) -> TunnelCall {
    let mut items = Vec::new();
    let t = match d.open_tunnel(g, to).await {
        Ok(t) => t,
        Err(e) => {
            return TunnelCall {
                items,
                end: Err(e.to_string()),
            }
        }
    };
    let end = match t.call_stream(COUNT, n.to_be_bytes().to_vec()).await {
        Err(e) => Err(e.to_string()),
        Ok(mut stream) => loop {
            match stream.next().await {
                None => break Ok(()),
                Some(Ok(b)) => match <[u8; 4]>::try_from(b.as_slice()) {
                    Ok(x) => items.push(u32::from_be_bytes(x)),
                    Err(_) => break Err(format!("an item of {} bytes", b.len())),
                },
                Some(Err(e)) => break Err(e.to_string()),
            }
        },
    };
    t.close();
    TunnelCall { items, end }
}

/// Judge a tunnel call: the items are 0, 1, 2, ... (in order, none
/// repeated, none skipped), and all `n` of them unless the call reported
/// why it ended. `None` when it holds.
fn judge_tunnel(n: u32, c: &TunnelCall) -> Option<String> {
    if let Some(k) = c.items.iter().enumerate().find(|(k, x)| **x as usize != *k) {
        return Some(format!(
            "item {} arrived where item {} belonged: {:?}",
            k.1, k.0, c.items
        ));
    }
    match &c.end {
        Ok(()) if c.items.len() != n as usize => Some(format!(
            "the call ended with {} of {n} items and no error",
            c.items.len()
        )),
        _ => None,
    }
}

/// What the outer loop does between steps on the driver's request.
#[derive(Debug)]
enum Control {
    CrashHub(usize),
    RestartHub(usize),
    /// Copy the hub's durable store (an operator's backup).
    SnapshotHub(usize),
    /// Crash the hub and put back its last copy, or an empty store.
    RewindHub(usize, bool),
    /// Delete the last stored ledger entry of a group from a device's
    /// store (the `forget_ledger_entry` break).
    ForgetLedgerEntry(usize, GroupId),
    /// Crash the machine device `i` runs on (with every device on it).
    CrashDevice(usize),
    /// Restart the machine device `i` runs on.
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
    rewinds: Mutex<Vec<Rewind>>,
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

/// Hub `i` goes down now: the load meter reads its counters first.
fn hub_down(
    meter: &mut storm::LoadMeter,
    running: &RefCell<Vec<Option<Hub>>>,
    i: usize,
    at: Duration,
) {
    let hub = running.borrow_mut().get_mut(i).and_then(Option::take);
    meter.down(i, at.as_millis() as u64, hub.map(|h| h.metrics()).as_ref());
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

/// Spawn `n` empty tokio tasks and wait for them: moves tokio's task-id
/// counter on by `n` (see [`SimConfig::tasks_before`]).
fn spend_task_ids(n: u64) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
        return;
    };
    rt.block_on(async {
        for _ in 0..n {
            let _ = tokio::spawn(async {}).await;
        }
    });
}

/// Run one seed to the end and check the invariants.
pub fn run_seed(cfg: &SimConfig) -> SeedReport {
    if cfg.tasks_before > 0 {
        spend_task_ids(cfg.tasks_before);
    }
    let panics = invariants::PanicCatcher::install();
    let world = Arc::new(World {
        trace: Mutex::new(Vec::new()),
        events: Mutex::new(Vec::new()),
        control: Mutex::new(Vec::new()),
        ids: Mutex::new(BTreeMap::new()),
        rewinds: Mutex::new(Vec::new()),
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

    let hub_stores: Vec<HubDisk> = (0..cfg.hubs).map(|_| HubDisk::new()).collect();
    let mut snapshots: Vec<Option<(u64, Snapshot)>> = vec![None; cfg.hubs];
    // Each running hub, for the load meter to read its counters.
    let running: Rc<RefCell<Vec<Option<Hub>>>> = Rc::new(RefCell::new(vec![None; cfg.hubs]));
    let mut meter = storm::LoadMeter::new();
    let mut next_sample = storm::SAMPLE_MS;
    for (i, store) in hub_stores.iter().enumerate() {
        let store = store.clone();
        let restarts = restarts.clone();
        let running = running.clone();
        let seed = cfg.seed;
        let outages = cfg.faults.outages;
        sim.host(hub_name(i), move || {
            let store = store.clone();
            let n = next_incarnation(&restarts, &hub_name(i));
            let running = running.clone();
            async move {
                let listener = turmoil::net::TcpListener::bind(("0.0.0.0", HUB_PORT)).await?;
                let mut config = HubConfig::new(hub_url(i));
                config.limits = Limits::unthrottled();
                if outages {
                    config.limits.max_log_depth = OUTAGE_LOG_DEPTH;
                }
                let kv: Arc<dyn KvStore> = Arc::new(store);
                let hub = Hub::start(
                    kv,
                    config,
                    host_clock(),
                    SharedRng::seeded(mix(seed, 1000 + i as u64, n)),
                )
                .map_err(|e| e.to_string())?;
                if let Some(slot) = running.borrow_mut().get_mut(i) {
                    *slot = Some(hub.clone());
                }
                hub.serve(SimListener(listener));
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }

    let dev_stores: Vec<MemKv> = (0..cfg.devices).map(|_| MemKv::new()).collect();
    let mut senders = Vec::new();
    let mut on_host = Vec::new();
    for (i, store) in dev_stores.iter().enumerate() {
        let (tx, rx) = mpsc::channel::<Cmd>(64);
        senders.push(tx);
        // The receiver outlives the host (the driver keeps the sender), so
        // a restarted host picks up where the crashed one left off.
        on_host.push((i, store.clone(), Rc::new(RefCell::new(rx))));
        if cfg.co_hosted(i).end != i + 1 {
            continue;
        }
        let devices = std::mem::take(&mut on_host);
        let restarts = restarts.clone();
        let world = world.clone();
        let cfg = cfg.clone();
        sim.host(cfg.host_of(i), move || {
            let runs: Vec<_> = devices
                .iter()
                .map(|(i, store, rx)| {
                    let n = next_incarnation(&restarts, &dev_name(*i));
                    device_host(*i, n, cfg.clone(), store.clone(), rx.clone(), world.clone())
                })
                .collect();
            async move {
                // A machine runs until all its devices stop.
                futures::future::join_all(runs)
                    .await
                    .into_iter()
                    .collect::<turmoil::Result<Vec<()>>>()
                    .map(|_| ())
            }
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
                    hub_down(&mut meter, &running, i, sim.elapsed());
                    sim.crash(hub_name(i));
                    hub_stores[i].crash();
                }
                Control::RestartHub(i) => {
                    meter.restarted(i, sim.elapsed().as_millis() as u64);
                    sim.bounce(hub_name(i))
                }
                Control::SnapshotHub(i) => {
                    let at = sim.elapsed().as_millis() as u64;
                    snapshots[i] = Some((at, hub_stores[i].snapshot()));
                }
                Control::RewindHub(i, empty) => {
                    faults_injected += 1;
                    hub_down(&mut meter, &running, i, sim.elapsed());
                    sim.crash(hub_name(i));
                    hub_stores[i].crash();
                    let (snapshot_ms, snap) = match (&snapshots[i], empty) {
                        (Some((at, snap)), false) => (*at, snap.clone()),
                        _ => (0, Snapshot::new()),
                    };
                    hub_stores[i].restore(&snap);
                    let at_ms = sim.elapsed().as_millis() as u64;
                    world.trace(format!(
                        "{at_ms} rewind hub{i} to the copy of {snapshot_ms} ms ({} keys)",
                        snap.len()
                    ));
                    world
                        .rewinds
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(Rewind {
                            hub: hub_url(i),
                            snapshot_ms,
                            at_ms,
                        });
                }
                Control::CrashDevice(i) => {
                    faults_injected += 1;
                    sim.crash(cfg.host_of(i));
                    for k in cfg.co_hosted(i) {
                        dev_stores[k].crash();
                    }
                }
                Control::RestartDevice(i) => sim.bounce(cfg.host_of(i)),
                Control::ForgetLedgerEntry(i, g) => {
                    let mut prefix = b"eng/ledger/".to_vec();
                    prefix.extend_from_slice(&g.0);
                    let entries = dev_stores[i].scan_prefix(&prefix, usize::MAX);
                    if let Some((k, _)) = entries.ok().and_then(|mut e| e.pop()) {
                        let mut b = hubsync::kv::WriteBatch::new();
                        b.delete(k);
                        let _ = dev_stores[i].apply(&b);
                        let _ = dev_stores[i].flush();
                    }
                }
                Control::Drops(on) => {
                    if on {
                        faults_injected += 1;
                    }
                    sim.set_fail_rate(if on { 0.002 } else { 0.0 });
                }
            }
        }
        let now = sim.elapsed().as_millis() as u64;
        if now >= next_sample {
            next_sample = now + storm::SAMPLE_MS;
            for (i, hub) in running.borrow().iter().enumerate() {
                if let Some(hub) = hub {
                    meter.sample(i, now, &hub.metrics());
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
    let d = match driver {
        Some(d) => d,
        None => {
            violations.push(Violation::new(
                "no-panic",
                None,
                vec![],
                "the driver did not finish".into(),
            ));
            DriverResult::default()
        }
    };
    let ids = world.ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut history = d.history;
    history.short_logs = cfg.faults.outages;
    history.rewinds = world
        .rewinds
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    violations.extend(d.violations);
    let (found, excused) = invariants::check(&d.finals, &d.heads, &history, &events, &ids);
    violations.extend(found);
    let converge_ms = d.converge_ms;
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
        let index: BTreeMap<DeviceId, usize> = ids.iter().map(|(i, d)| (*d, *i)).collect();
        for f in &d.finals {
            for g in &f.groups {
                out.push(format!(
                    "end dev{} ({}) {}: epoch {} auth {} cursor {} on {} hubs {:?} stranded {} ledger {}",
                    index.get(&f.device).copied().unwrap_or(usize::MAX),
                    &f.device.to_string()[..8],
                    &g.group.to_string()[..8],
                    g.epoch,
                    hex::encode(&g.authenticator[..4.min(g.authenticator.len())]),
                    g.commit_cursor,
                    g.commit_hub,
                    g.hubs,
                    g.stranded,
                    g.ledger_head
                        .map(|h| hex::encode(&h[..4]))
                        .unwrap_or_default()
                ));
            }
        }
        for (g, h) in &d.heads {
            out.push(format!("end head {}: {h:?}", &g.to_string()[..8]));
        }
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
    let count = |f: fn(&Event) -> bool| events.iter().filter(|(_, _, e)| f(e)).count();
    let deliveries = count(|e| matches!(e, Event::MessageReceived { .. }));
    let commits = d.finals.iter().map(|f| f.commits as usize).sum();
    SeedReport {
        seed: cfg.seed,
        violations,
        trace_hash: hex::encode(h.finalize()),
        ops: d.ops,
        ops_ok: d.ops_ok,
        messages_sent: history.sent.len(),
        deliveries,
        commits,
        faults_injected: faults_injected + d.faults,
        rewinds: history.rewinds.len(),
        outages: history.outages.len(),
        stranger_frames: d.stranger_frames,
        refused: d.refused,
        tunnel_calls: d.tunnel_calls,
        tunnels_done: d.tunnels_done,
        history_syncs: d.history_syncs,
        excused: excused.commits + excused.deliveries,
        strands: count(|e| matches!(e, Event::Stranded { .. })),
        gathers: count(|e| matches!(e, Event::LedgerGathered { .. })),
        rejoins: count(|e| matches!(e, Event::Rejoined { .. })),
        recoveries_failed: count(|e| matches!(e, Event::RecoveryFailed { .. })),
        converge_ms,
        sim_ms,
        storms: meter.finish(),
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
    // A tunnel call to a member cut off must end well within the
    // operation limit, reported as idle.
    o.manager.tunnel_idle_timeout = Duration::from_secs(30);
    o.manager.key_package_lifetime = SIM_KEY_PACKAGE_LIFETIME;
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
    if cfg.tunnels {
        device.serve(sim_procedures());
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

fn landed(
    d: &Device,
    g: GroupId,
    r: Result<hubsync::device::lane::LaneResult, CommitError>,
) -> Result<Landed, Refusal> {
    match r {
        Ok(l) => Ok(Landed {
            epoch: l.outcome.epoch,
            hub: d
                .manager()
                .record(g)
                .map(|r| r.commit_hub)
                .unwrap_or_default(),
        }),
        Err(e) => Err(Refusal {
            ledger: matches!(e, CommitError::Ledger(_)),
            text: e.to_string(),
        }),
    }
}

async fn serve(d: Arc<Device>, cmd: Cmd) {
    let s = |e: hubsync::device::DeviceError| e.to_string();
    match cmd {
        Cmd::Create(hubs, r) => {
            let _ = r.send(d.create_group(&hubs).await.map_err(s));
        }
        Cmd::Invite(g, who, r) => {
            let _ = r.send(landed(&d, g, d.invite(g, who).await));
        }
        Cmd::Remove(g, who, r) => {
            let _ = r.send(landed(&d, g, d.remove(g, who).await));
        }
        Cmd::Grant(g, who, r) => {
            let _ = r.send(landed(&d, g, d.grant_admin(g, who).await));
        }
        Cmd::Revoke(g, who, r) => {
            let _ = r.send(landed(&d, g, d.revoke_admin(g, who).await));
        }
        Cmd::Rotate(g, r) => {
            let _ = r.send(landed(&d, g, d.rotate_keys(g).await));
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
            let _ = r.send(landed(&d, g, res));
        }
        Cmd::Tunnel(g, to, n, r) => {
            let _ = r.send(tunnel_call(&d, g, to, n).await);
        }
        Cmd::ShareHistory(g, n, r) => {
            let value = n.to_string();
            let res = d
                .set_setting(
                    g,
                    hubsync::device::tunnel::history::SETTING,
                    value.as_bytes(),
                )
                .await;
            let _ = r.send(landed(&d, g, res));
        }
        Cmd::SyncHistory(g, r) => {
            let _ = r.send(d.sync_history(g).await.map_err(|e| e.to_string()));
        }
        Cmd::SetCommitHub(g, hub, r) => {
            // The move is committed on the hub it moves away from.
            let from = d.manager().record(g).map(|r| r.commit_hub).ok();
            let res = landed(&d, g, d.set_commit_hub(g, &hub).await);
            let _ = r.send(res.map(|l| Landed {
                hub: from.unwrap_or(l.hub),
                ..l
            }));
        }
        Cmd::View(g, r) => {
            let view = match (d.manager().record(g), d.ledger_view(g)) {
                (Ok(rec), Ok(l)) => Some(View {
                    commit_seed: rec.commit_seed,
                    commit_hub: rec.commit_hub,
                    hubs: l.hubs,
                }),
                _ => None,
            };
            let _ = r.send(view);
        }
        Cmd::Replay(topic, writer, hub, n, pick, r) => {
            let _ = r.send(replay_old_frames(&d, &topic, writer.as_deref(), &hub, n, pick).await);
        }
        Cmd::State(r) => {
            let _ = r.send(final_state(&d).await);
        }
    }
}

/// A removed member at work: read the commit topic on `hub` through this
/// device's own link and publish copies of old frames on it, as itself.
async fn replay_old_frames(
    d: &Device,
    topic: &hubsync::wire::TopicId,
    writer: Option<&hubsync::device::topics::TopicWriter>,
    hub: &str,
    n: usize,
    pick: u64,
) -> usize {
    let link = d.manager().hub_link(hub);
    let work = async {
        let Ok(f) = link.fetch(topic, 0, 100).await else {
            return 0;
        };
        if f.messages.is_empty() {
            return 0;
        }
        let mut published = 0;
        for k in 0..n {
            let i = (pick as usize + k * 7) % f.messages.len();
            let frame = &f.messages[i];
            let mut op = pick.to_be_bytes().to_vec();
            op.extend_from_slice(&(k as u64).to_be_bytes());
            op.extend_from_slice(b"replay");
            let mut p = hubsync::wire::Publish {
                topic: topic.clone(),
                publish_id: hubsync::device::frames::publish_id(&op, topic),
                class: hubsync::wire::RetentionClass::Log,
                expected_head: hubsync::wire::ExpectedHead::Unconditional,
                replay_only: false,
                retention_secs: None,
                payload: frame.payload.clone(),
                writer: None,
            };
            if let Some(w) = writer {
                w.sign(&mut p);
            }
            if let Ok(hubsync::wire::PublishOutcome::Accepted { .. }) = link.publish(p).await {
                published += 1;
            }
        }
        published
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .unwrap_or(0)
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
            commit_seed: rec.commit_seed,
            hubs: rec.hubs,
            ledger_head: d.ledger_view(g).ok().map(|l| l.head),
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

#[derive(Default)]
struct DriverResult {
    ops: usize,
    ops_ok: usize,
    history: History,
    finals: Vec<FinalState>,
    heads: BTreeMap<GroupId, Option<u64>>,
    converge_ms: Option<u64>,
    faults: usize,
    stranger_frames: usize,
    refused: usize,
    /// Tunnel calls that ended (done or reported), and those done.
    tunnel_calls: usize,
    tunnels_done: usize,
    /// History syncs that answered.
    history_syncs: usize,
    violations: Vec<Violation>,
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

/// How long a tunnel call may take: with connections breaking mid-frame a
/// call goes on slowly (a resend waits up to 16 s, a publish times out in
/// 5 s), but one that stops moving closes after the simulation's idle
/// timeout of 30 s.
const TUNNEL_LIMIT: Duration = Duration::from_secs(300);

/// The driver's belief about one device's admin rights in one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Adm {
    /// Certainly an admin (its grant returned `Ok`, or it created the group).
    Yes,
    /// Certainly not (never granted, or revoked or removed with `Ok`).
    No,
    /// An operation that would change it did not answer clearly.
    Unknown,
}

/// The driver's belief about one group.
struct GroupBelief {
    id: GroupId,
    members: BTreeSet<usize>,
    admins: BTreeMap<usize, Adm>,
    /// When each belief in `admins` last changed (simulated ms).
    admins_changed_ms: BTreeMap<usize, u64>,
}

impl GroupBelief {
    fn adm(&self, d: usize) -> Adm {
        self.admins.get(&d).copied().unwrap_or(Adm::No)
    }

    fn set_adm(&mut self, d: usize, a: Adm) {
        self.admins.insert(d, a);
        self.admins_changed_ms.insert(d, now_ms());
    }

    /// A hub went back to a copy taken at `since_ms`: a grant or revoke
    /// accepted after it may be lost (until its author, rejoining, issues
    /// it again), so what it did is no longer known.
    fn rewound_since(&mut self, since_ms: u64) {
        for (d, at) in &self.admins_changed_ms {
            if *at >= since_ms {
                self.admins.insert(*d, Adm::Unknown);
            }
        }
    }
}

/// Who performs an admin operation: usually a certain admin; sometimes a
/// member certainly not an admin, whose attempt must be refused by the
/// ledger (the second value says so).
fn admin_actor(rng: &mut ChaCha20Rng, up: &[usize], g: &GroupBelief) -> (usize, bool) {
    let yes: Vec<usize> = up
        .iter()
        .copied()
        .filter(|d| g.adm(*d) == Adm::Yes)
        .collect();
    let no: Vec<usize> = up
        .iter()
        .copied()
        .filter(|d| g.adm(*d) == Adm::No)
        .collect();
    if !no.is_empty() && (yes.is_empty() || rng.gen_bool(0.15)) {
        return (no[rng.gen_range(0..no.len())], true);
    }
    if !yes.is_empty() {
        return (yes[rng.gen_range(0..yes.len())], false);
    }
    (up[rng.gen_range(0..up.len())], false)
}

/// Frames a stranger publishes in one go.
#[derive(Clone, Copy, Debug)]
enum StrangerFrame {
    Garbage(usize),
    Replay(usize),
    FutureEpoch(usize, u64),
}

/// Rewrite the epoch an MLS message (public or private) claims: after the
/// version and wire format (two u16) come the group id (a variable-length
/// vector) and the epoch (u64).
fn claim_epoch(frame: &[u8], epoch: u64) -> Option<Vec<u8>> {
    let wire_format = u16::from_be_bytes([*frame.get(2)?, *frame.get(3)?]);
    if wire_format != 1 && wire_format != 2 {
        return None;
    }
    let first = *frame.get(4)?;
    let (len, n) = match first >> 6 {
        0 => (usize::from(first & 0x3f), 1),
        1 => (
            (usize::from(first & 0x3f) << 8) | usize::from(*frame.get(5)?),
            2,
        ),
        2 => (
            u32::from_be_bytes([first & 0x3f, *frame.get(5)?, *frame.get(6)?, *frame.get(7)?])
                as usize,
            4,
        ),
        _ => return None,
    };
    let at = 4 + n + len;
    let old = frame.get(at..at + 8)?;
    let old = u64::from_be_bytes(old.try_into().ok()?);
    let mut out = frame.to_vec();
    out[at..at + 8].copy_from_slice(&old.saturating_add(epoch).to_be_bytes());
    Some(out)
}

/// A stranger (its own key, no member) that learned a group's commit topic
/// publishes on it: garbage, copies of old commit frames, frames claiming
/// far-future epochs. Answers how many the hub accepted.
async fn stranger_publishes(
    key: &ed25519_dalek::SigningKey,
    hub: &str,
    topic: &hubsync::wire::TopicId,
    writer: Option<&hubsync::device::topics::TopicWriter>,
    frames: &[StrangerFrame],
    nonce: u64,
) -> usize {
    let work = async {
        let Ok(c) =
            hubsync::client::HubClient::connect(&SimConnector, hub, key, Default::default()).await
        else {
            return 0;
        };
        let old = c
            .fetch(topic, 0, 100)
            .await
            .map(|f| f.messages)
            .unwrap_or_default();
        let mut n = 0;
        for (k, f) in frames.iter().enumerate() {
            let payload = match *f {
                StrangerFrame::Garbage(len) => {
                    let mut h = Sha256::new();
                    h.update(nonce.to_be_bytes());
                    h.update((k as u64).to_be_bytes());
                    h.finalize().iter().cycle().take(len).copied().collect()
                }
                StrangerFrame::Replay(i) if !old.is_empty() => old[i % old.len()].payload.clone(),
                StrangerFrame::FutureEpoch(i, ahead) if !old.is_empty() => {
                    match claim_epoch(&old[i % old.len()].payload, ahead) {
                        Some(p) => p,
                        None => continue,
                    }
                }
                _ => continue,
            };
            let mut op = nonce.to_be_bytes().to_vec();
            op.extend_from_slice(&(k as u64).to_be_bytes());
            op.extend_from_slice(b"stranger");
            let mut p = hubsync::wire::Publish {
                topic: topic.clone(),
                publish_id: hubsync::device::frames::publish_id(&op, topic),
                class: hubsync::wire::RetentionClass::Log,
                expected_head: hubsync::wire::ExpectedHead::Unconditional,
                replay_only: false,
                retention_secs: None,
                payload,
                writer: None,
            };
            if let Some(w) = writer {
                w.sign(&mut p);
            }
            if let Ok(hubsync::wire::PublishOutcome::Accepted { .. }) = c.publish(p).await {
                n += 1;
            }
        }
        c.close();
        n
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .unwrap_or(0)
}

/// Whom an admin operation targets.
fn pick_from(rng: &mut ChaCha20Rng, v: &[usize]) -> Option<usize> {
    if v.is_empty() {
        None
    } else {
        Some(v[rng.gen_range(0..v.len())])
    }
}

async fn drive(cfg: SimConfig, devs: Vec<mpsc::Sender<Cmd>>, world: Arc<World>) -> DriverResult {
    let mut rng = ChaCha20Rng::seed_from_u64(mix(cfg.seed, 7, 7));
    // Let every host come up and stock its key packages.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: BTreeMap<usize, DeviceId> =
        world.ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let id_of = |d: usize| ids.get(&d).copied().unwrap_or(DeviceId([0; 32]));
    let mut out = DriverResult::default();
    // The driver's belief about membership and admin rights (devices'
    // answers decide in the end).
    let mut groups: Vec<GroupBelief> = Vec::new();
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
        out.ops += 1;
        world.trace(format!(
            "{} create by dev{creator}: {:?}",
            now_ms(),
            r.as_ref().map(|x| x.is_ok())
        ));
        if let Some(Ok(g)) = r {
            out.ops_ok += 1;
            out.history
                .hubs
                .insert(g, hubs.iter().cloned().collect::<BTreeSet<_>>());
            groups.push(GroupBelief {
                id: g,
                members: BTreeSet::from([creator]),
                admins: BTreeMap::from([(creator, Adm::Yes)]),
                admins_changed_ms: BTreeMap::new(),
            });
        }
    }
    if groups.is_empty() {
        return out;
    }

    // Give each group a couple of members before the faults start (the
    // creator, its only admin, invites them); with tunnels on, the creator
    // first lets members hand on the group's history.
    for (gi, gb) in groups.iter_mut().enumerate() {
        let by = *gb.members.iter().next().unwrap_or(&0);
        if cfg.tunnels {
            let g = gb.id;
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::ShareHistory(g, SHARE_LAST, r)).await;
            out.ops += 1;
            if let Some(Ok(l)) = &r {
                out.ops_ok += 1;
                out.history.accepted.push(l.accepted(g, id_of(by)));
            }
            world.trace(format!(
                "{} setup g{gi} history {SHARE_LAST} by dev{by} -> {r:?}",
                now_ms()
            ));
        }
        // Two invites at most in a small run; in a crowd, enough to share
        // the devices out among the groups.
        let most = (cfg.devices / cfg.groups.max(1)).saturating_sub(1).max(2);
        for _ in 0..rng.gen_range(1..=most) {
            let outsiders: Vec<usize> = (0..cfg.devices)
                .filter(|k| !gb.members.contains(k))
                .collect();
            let Some(who) = pick_from(&mut rng, &outsiders) else {
                break;
            };
            let g = gb.id;
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Invite(g, id_of(who), r)).await;
            out.ops += 1;
            if let Some(Ok(l)) = &r {
                out.ops_ok += 1;
                gb.members.insert(who);
                out.history.accepted.push(l.accepted(g, id_of(by)));
            }
            world.trace(format!(
                "{} setup g{gi} invite dev{who} by dev{by} -> {r:?}",
                now_ms()
            ));
        }
    }

    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&mix(cfg.seed, 11, 11).to_be_bytes());
    let stranger = ed25519_dalek::SigningKey::from_bytes(&key);
    let mut removed: Vec<(usize, usize)> = Vec::new();
    let mut snapshotted: BTreeSet<usize> = BTreeSet::new();
    // When each hub's latest copy was asked for.
    let mut snapshot_ms: BTreeMap<usize, u64> = BTreeMap::new();
    // Crashed machines, each by its first device (see
    // `SimConfig::devices_per_host`): `down(m)` says whether device m is.
    let mut crashed_devs: BTreeSet<usize> = BTreeSet::new();
    let machine = |i: usize| cfg.co_hosted(i).start;
    let down = |crashed: &BTreeSet<usize>, m: usize| crashed.contains(&machine(m));
    // Devices in a long outage: the step they come back at, and since when
    // they are down.
    let mut held: BTreeMap<usize, (usize, u64)> = BTreeMap::new();
    let mut crashed_hubs: BTreeSet<usize> = BTreeSet::new();
    let mut partitions: Vec<(String, String)> = Vec::new();
    for step in 0..cfg.ops {
        if cfg.breaks.forget_ledger_entry && step == cfg.ops / 2 {
            let victim = groups[0]
                .members
                .iter()
                .copied()
                .find(|d| groups[0].adm(*d) != Adm::Yes)
                .unwrap_or(0);
            world.control(Control::ForgetLedgerEntry(victim, groups[0].id));
        }
        // Faults: each kind on its own schedule drawn from the seed.
        if cfg.faults.device_crashes && rng.gen_bool(0.08) {
            let i = machine(rng.gen_range(0..cfg.devices));
            if crashed_devs.insert(i) {
                world.control(Control::CrashDevice(i));
            }
        }
        if !crashed_devs.is_empty() && rng.gen_bool(0.3) {
            if let Some(i) = crashed_devs.iter().copied().find(|i| !held.contains_key(i)) {
                crashed_devs.remove(&i);
                world.control(Control::RestartDevice(i));
            }
        }
        if cfg.faults.outages {
            if held.is_empty() && rng.gen_bool(0.05) {
                let i = machine(rng.gen_range(0..cfg.devices));
                if crashed_devs.insert(i) {
                    world.control(Control::CrashDevice(i));
                    held.insert(i, (step + rng.gen_range(8..16), now_ms()));
                    world.trace(format!("{} outage dev{i}", now_ms()));
                }
            }
            let due: Vec<usize> = held
                .iter()
                .filter(|(_, (back, _))| *back <= step)
                .map(|(i, _)| *i)
                .collect();
            for i in due {
                if let Some((_, since)) = held.remove(&i) {
                    crashed_devs.remove(&i);
                    world.control(Control::RestartDevice(i));
                    world.trace(format!("{} back dev{i}", now_ms()));
                    out.history.outages.extend(cfg.co_hosted(i).map(|k| Outage {
                        device: id_of(k),
                        start_ms: since,
                        end_ms: now_ms(),
                    }));
                }
            }
        }
        if cfg.faults.hub_crashes && rng.gen_bool(0.04) {
            let i = rng.gen_range(0..cfg.hubs);
            if crashed_hubs.insert(i) {
                world.control(Control::CrashHub(i));
            }
        }
        if cfg.faults.rewinds {
            if rng.gen_bool(0.1) {
                let i = rng.gen_range(0..cfg.hubs);
                if !crashed_hubs.contains(&i) {
                    snapshotted.insert(i);
                    snapshot_ms.insert(i, now_ms());
                    world.control(Control::SnapshotHub(i));
                }
            }
            if rng.gen_bool(0.035) {
                let i = rng.gen_range(0..cfg.hubs);
                let empty = !snapshotted.contains(&i) || rng.gen_bool(0.25);
                if crashed_hubs.insert(i) {
                    world.control(Control::RewindHub(i, empty));
                    let since = if empty {
                        0
                    } else {
                        snapshot_ms.get(&i).copied().unwrap_or(0)
                    };
                    for g in groups.iter_mut() {
                        g.rewound_since(since);
                    }
                }
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
                Some(cfg.host_of(rng.gen_range(0..cfg.devices)))
            };
            match other {
                Some(d) => {
                    turmoil::partition(h.as_str(), d.as_str());
                    partitions.push((h.clone(), d.clone()));
                    world.trace(format!("{} partition {h} {d}", now_ms()));
                }
                None => {
                    for k in (0..cfg.devices).step_by(cfg.devices_per_host.max(1)) {
                        turmoil::partition(h.as_str(), cfg.host_of(k).as_str());
                        partitions.push((h.clone(), cfg.host_of(k)));
                    }
                    world.trace(format!("{} isolate {h}", now_ms()));
                }
            }
            out.faults += 1;
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

        // Strangers and removed members write on commit topics.
        if cfg.faults.strangers {
            if rng.gen_bool(0.12) {
                let gi = rng.gen_range(0..groups.len());
                let frames: Vec<StrangerFrame> = (0..rng.gen_range(1..=3))
                    .map(|_| match rng.gen_range(0..3) {
                        0 => StrangerFrame::Garbage(rng.gen_range(1..300)),
                        1 => StrangerFrame::Replay(rng.gen_range(0..100)),
                        _ => StrangerFrame::FutureEpoch(
                            rng.gen_range(0..100),
                            if rng.gen_bool(0.5) {
                                rng.gen_range(1..5)
                            } else {
                                u64::MAX / 2
                            },
                        ),
                    })
                    .collect();
                let nonce: u64 = rng.gen();
                let other_hub = rng.gen_bool(0.2);
                let up: Vec<usize> = groups[gi]
                    .members
                    .iter()
                    .copied()
                    .filter(|m| !down(&crashed_devs, *m))
                    .collect();
                if let Some(m) = pick_from(&mut rng, &up) {
                    let g = groups[gi].id;
                    if let Some(Some(view)) =
                        ask(&devs[m], Duration::from_secs(10), |r| Cmd::View(g, r)).await
                    {
                        let hub = if other_hub && !view.hubs.is_empty() {
                            view.hubs[(nonce as usize) % view.hubs.len()].clone()
                        } else {
                            view.commit_hub.clone()
                        };
                        // Half the time the topic's writer key leaked to the
                        // stranger (or the hub itself injects): the members'
                        // judgement must hold. Otherwise the hub refuses it.
                        let writer = hubsync::device::topics::commit_writer(&view.commit_seed);
                        let leaked = nonce.is_multiple_of(2).then_some(&writer);
                        let n = stranger_publishes(
                            &stranger,
                            &hub,
                            writer.topic(),
                            leaked,
                            &frames,
                            nonce,
                        )
                        .await;
                        out.stranger_frames += n;
                        world.trace(format!(
                            "{} stranger g{gi} on {hub}: {frames:?} -> {n} accepted",
                            now_ms()
                        ));
                    }
                }
            }
            if !removed.is_empty() && rng.gen_bool(0.15) {
                let (gi, who) = removed[rng.gen_range(0..removed.len())];
                let n = rng.gen_range(1..=3usize);
                let pick: u64 = rng.gen();
                let up: Vec<usize> = groups[gi]
                    .members
                    .iter()
                    .copied()
                    .filter(|m| !down(&crashed_devs, *m))
                    .collect();
                let asker = pick_from(&mut rng, &up);
                if let (Some(m), false, false) = (
                    asker,
                    down(&crashed_devs, who),
                    groups[gi].members.contains(&who),
                ) {
                    let g = groups[gi].id;
                    if let Some(Some(view)) =
                        ask(&devs[m], Duration::from_secs(10), |r| Cmd::View(g, r)).await
                    {
                        // The removed member cannot compute the topic its
                        // removal moved the log to; half the time a member
                        // leaked it with its writer key.
                        let writer = hubsync::device::topics::commit_writer(&view.commit_seed);
                        let topic = writer.topic().clone();
                        let leaked = pick.is_multiple_of(2).then_some(Box::new(writer));
                        let hub = view.commit_hub.clone();
                        let k = ask(&devs[who], Duration::from_secs(20), |r| {
                            Cmd::Replay(topic, leaked, hub.clone(), n, pick, r)
                        })
                        .await
                        .unwrap_or(0);
                        out.stranger_frames += k;
                        world.trace(format!(
                            "{} removed dev{who} replays {n} old frames of g{gi} on {hub} -> {k} accepted",
                            now_ms()
                        ));
                    }
                }
            }
        }

        // The operation, by members that are up (a crashed device cannot
        // take a command; one crashed mid-command simply never answers).
        let gi = rng.gen_range(0..groups.len());
        let g = groups[gi].id;
        let member: Vec<usize> = groups[gi]
            .members
            .iter()
            .copied()
            .filter(|m| !down(&crashed_devs, *m))
            .collect();
        if member.is_empty() {
            continue;
        }
        let pick = |rng: &mut ChaCha20Rng| member[rng.gen_range(0..member.len())];
        if cfg.tunnels && member.len() >= 2 && rng.gen_bool(0.06) {
            // A member asks another for the group's history: never more
            // than the group allows (duplicates are judged with every
            // delivery, by `message-duplicated`).
            out.ops += 1;
            let by = pick(&mut rng);
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::SyncHistory(g, r)).await;
            if let Some(Ok(h)) = &r {
                out.ops_ok += 1;
                out.history_syncs += 1;
                if h.received + h.duplicates > h.allowed || h.allowed > SHARE_LAST {
                    out.violations.push(Violation::new(
                        "history-bound",
                        Some(g),
                        vec![id_of(by)],
                        format!(
                            "op {step}: {} messages handed on ({} new), the group allows {} (set to {SHARE_LAST})",
                            h.received + h.duplicates,
                            h.received,
                            h.allowed
                        ),
                    ));
                }
            }
            world.trace(format!(
                "{} op {step} g{gi} history dev{by} -> {:?}",
                now_ms(),
                r.map(|x| x.map(|h| (h.allowed, h.received, h.duplicates)))
            ));
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
            continue;
        }
        if cfg.tunnels && member.len() >= 2 && rng.gen_bool(0.2) {
            // A tunnel call between two members.
            out.ops += 1;
            let by = pick(&mut rng);
            let to = loop {
                let t = pick(&mut rng);
                if t != by {
                    break t;
                }
            };
            let n = rng.gen_range(1..=64);
            let r = ask(&devs[by], TUNNEL_LIMIT, |r| Cmd::Tunnel(g, id_of(to), n, r)).await;
            match &r {
                Some(c) => {
                    out.tunnel_calls += 1;
                    if c.end.is_ok() {
                        out.ops_ok += 1;
                        out.tunnels_done += 1;
                    }
                    if let Some(why) = judge_tunnel(n, c) {
                        out.violations.push(Violation::new(
                            "tunnel-order",
                            Some(g),
                            vec![id_of(by), id_of(to)],
                            format!("op {step}: {why}"),
                        ));
                    }
                }
                None if !down(&crashed_devs, by) => {
                    out.violations.push(Violation::new(
                        "tunnel-order",
                        Some(g),
                        vec![id_of(by), id_of(to)],
                        format!("op {step}: a tunnel call neither ended nor reported why within {TUNNEL_LIMIT:?}"),
                    ));
                }
                None => {}
            }
            world.trace(format!(
                "{} op {step} g{gi} tunnel dev{by} -> dev{to} count {n} -> {:?}",
                now_ms(),
                r.map(|c| (c.items.len(), c.end))
            ));
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
            continue;
        }
        let roll = rng.gen_range(0..100);
        out.ops += 1;
        // An admin operation's actor, and whether the ledger must refuse it.
        let mut attempt: Option<(usize, bool, Option<Outcome>)> = None;
        let line = if roll < 40 {
            let by = pick(&mut rng);
            let body = format!("s{} m{step} from dev{by}", cfg.seed).into_bytes();
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Send(g, body.clone(), r)).await;
            if let Some(Ok((id, epoch))) = r {
                out.ops_ok += 1;
                out.history.sent.push(Sent {
                    group: g,
                    sender: id_of(by),
                    id,
                    epoch,
                    at_ms: now_ms(),
                });
            }
            format!("send dev{by} -> {:?}", r.map(|x| x.map(|v| v.1)))
        } else if roll < 52 {
            let by = pick(&mut rng);
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Rotate(g, r)).await;
            attempt = Some((by, false, r.clone()));
            format!("rotate dev{by} -> {r:?}")
        } else if roll < 60 {
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
            out.ops_ok += usize::from(rs.iter().all(|r| matches!(r, Some(Ok(_)))));
            for (by, r) in who.iter().zip(&rs) {
                if let Some(Ok(l)) = r {
                    out.history.accepted.push(l.accepted(g, id_of(*by)));
                }
            }
            format!("concurrent {who:?} -> {rs:?}")
        } else if roll < 73 {
            let (by, refuse) = admin_actor(&mut rng, &member, &groups[gi]);
            let outsiders: Vec<usize> = (0..cfg.devices)
                .filter(|k| !groups[gi].members.contains(k) && !down(&crashed_devs, *k))
                .collect();
            let Some(who) = pick_from(&mut rng, &outsiders) else {
                out.ops -= 1;
                continue;
            };
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Invite(g, id_of(who), r)).await;
            if let Some(Ok(_)) = r {
                groups[gi].members.insert(who);
                groups[gi].set_adm(who, Adm::No);
            }
            attempt = Some((by, refuse, r.clone()));
            format!("invite dev{who} by dev{by} -> {r:?}")
        } else if roll < 80 {
            if member.len() < 3 {
                out.ops -= 1;
                continue;
            }
            let (by, refuse) = admin_actor(&mut rng, &member, &groups[gi]);
            let who = pick(&mut rng);
            if who == by {
                out.ops -= 1;
                continue;
            }
            let r = ask(&devs[by], OP_LIMIT, |r| Cmd::Remove(g, id_of(who), r)).await;
            match &r {
                Some(Ok(_)) => {
                    groups[gi].members.remove(&who);
                    groups[gi].set_adm(who, Adm::No);
                    removed.push((gi, who));
                }
                Some(Err(e)) if e.ledger => {}
                _ => {
                    if groups[gi].adm(who) == Adm::Yes {
                        groups[gi].set_adm(who, Adm::Unknown);
                    }
                }
            }
            attempt = Some((by, refuse, r.clone()));
            format!("remove dev{who} by dev{by} -> {r:?}")
        } else if roll < 89 {
            // Hub binding, through the ledger: bind a hub, move the commit
            // hub to another bound hub, or unbind one that is not it.
            let (by, refuse) = admin_actor(&mut rng, &member, &groups[gi]);
            let Some(Some(view)) =
                ask(&devs[by], Duration::from_secs(10), |r| Cmd::View(g, r)).await
            else {
                out.ops -= 1;
                continue;
            };
            let unbound: Vec<String> = (0..cfg.hubs)
                .map(hub_url)
                .filter(|h| !view.hubs.contains(h))
                .collect();
            let others: Vec<String> = view
                .hubs
                .iter()
                .filter(|h| **h != view.commit_hub)
                .cloned()
                .collect();
            let choice = rng.gen_range(0..3);
            let (what, hub) = if !unbound.is_empty() && (others.is_empty() || choice == 0) {
                ("bind", unbound[rng.gen_range(0..unbound.len())].clone())
            } else if !others.is_empty() && choice == 1 {
                ("commit-hub", others[rng.gen_range(0..others.len())].clone())
            } else if !others.is_empty() {
                ("unbind", others[rng.gen_range(0..others.len())].clone())
            } else {
                out.ops -= 1;
                continue;
            };
            if what == "bind" {
                out.history.hubs.entry(g).or_default().insert(hub.clone());
            }
            let r = ask(&devs[by], OP_LIMIT, |r| match what {
                "bind" => Cmd::Bind(g, hub.clone(), true, r),
                "unbind" => Cmd::Bind(g, hub.clone(), false, r),
                _ => Cmd::SetCommitHub(g, hub.clone(), r),
            })
            .await;
            attempt = Some((by, refuse, r.clone()));
            format!("{what} {hub} dev{by} -> {r:?}")
        } else {
            // Admin rights: grant to a member, or revoke from an admin.
            let (by, refuse) = admin_actor(&mut rng, &member, &groups[gi]);
            let all: Vec<usize> = groups[gi]
                .members
                .iter()
                .copied()
                .filter(|d| *d != by)
                .collect();
            let admins: Vec<usize> = all
                .iter()
                .copied()
                .filter(|d| groups[gi].adm(*d) == Adm::Yes)
                .collect();
            let plain: Vec<usize> = all
                .iter()
                .copied()
                .filter(|d| groups[gi].adm(*d) != Adm::Yes)
                .collect();
            let revoke = !admins.is_empty() && (plain.is_empty() || rng.gen_bool(0.4));
            let Some(who) = pick_from(&mut rng, if revoke { &admins } else { &plain }) else {
                out.ops -= 1;
                continue;
            };
            let r = ask(&devs[by], OP_LIMIT, |r| {
                if revoke {
                    Cmd::Revoke(g, id_of(who), r)
                } else {
                    Cmd::Grant(g, id_of(who), r)
                }
            })
            .await;
            match &r {
                Some(Ok(_)) => {
                    groups[gi].set_adm(who, if revoke { Adm::No } else { Adm::Yes });
                }
                Some(Err(e)) if e.ledger => {}
                _ => {
                    groups[gi].set_adm(who, Adm::Unknown);
                }
            }
            attempt = Some((by, refuse, r.clone()));
            format!(
                "{} dev{who} by dev{by} -> {r:?}",
                if revoke { "revoke" } else { "grant" }
            )
        };
        if let Some((by, refuse, r)) = &attempt {
            let (by, refuse) = (*by, *refuse);
            match r {
                Some(Ok(l)) => {
                    out.ops_ok += 1;
                    out.history.accepted.push(l.accepted(g, id_of(by)));
                    if refuse {
                        out.violations.push(Violation::new(
                            "ledger-authority",
                            Some(g),
                            vec![id_of(by)],
                            format!(
                                "op {step}: a member that is not an admin did an admin operation"
                            ),
                        ));
                    }
                }
                Some(Err(e)) if refuse && e.ledger => out.refused += 1,
                _ => {}
            }
        }
        world.trace(format!(
            "{} op {step} g{gi} {line}{}",
            now_ms(),
            match attempt {
                Some((_, true, _)) => " (by a non-admin)",
                _ => "",
            }
        ));
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
    }

    // Heal everything, then wait for quiet.
    for (a, b) in partitions.drain(..) {
        turmoil::repair(a.as_str(), b.as_str());
    }
    for i in std::mem::take(&mut crashed_devs) {
        world.control(Control::RestartDevice(i));
    }
    for (i, (_, since)) in std::mem::take(&mut held) {
        out.history.outages.extend(cfg.co_hosted(i).map(|k| Outage {
            device: id_of(k),
            start_ms: since,
            end_ms: now_ms(),
        }));
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
            out.converge_ms.get_or_insert(since);
            if since >= QUIET {
                break;
            }
        } else {
            out.converge_ms = None;
        }
        if since >= GIVE_UP {
            break;
        }
    }
    out.heads = commit_heads(&finals, cfg.seed).await;
    out.finals = finals;
    out
}

/// The head of each group's commit log on its commit hub, read by an
/// outside client.
async fn commit_heads(finals: &[FinalState], seed: u64) -> BTreeMap<GroupId, Option<u64>> {
    let mut hubs: BTreeMap<GroupId, (String, [u8; 32])> = BTreeMap::new();
    for f in finals {
        for g in &f.groups {
            hubs.insert(g.group, (g.commit_hub.clone(), g.commit_seed));
        }
    }
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&mix(seed, 9, 9).to_be_bytes());
    let key = ed25519_dalek::SigningKey::from_bytes(&key);
    let mut heads = BTreeMap::new();
    for (g, (hub, seed)) in hubs {
        let head = match hubsync::client::HubClient::connect(
            &SimConnector,
            &hub,
            &key,
            Default::default(),
        )
        .await
        {
            Ok(c) => c
                .fetch(&hubsync::device::topics::commit_topic(&seed), 0, 1)
                .await
                .ok()
                .and_then(|f| f.head),
            Err(_) => None,
        };
        heads.insert(g, head);
    }
    heads
}

#[cfg(test)]
mod tunnel_judge_tests {
    use super::{judge_tunnel, TunnelCall};

    fn call(items: &[u32], end: Result<(), &str>) -> TunnelCall {
        TunnelCall {
            items: items.to_vec(),
            end: end.map_err(str::to_string),
        }
    }

    #[test]
    fn every_item_in_order_or_a_reported_end_holds() {
        assert_eq!(judge_tunnel(3, &call(&[0, 1, 2], Ok(()))), None);
        assert_eq!(judge_tunnel(3, &call(&[0], Err("tunnel closed"))), None);
        assert_eq!(judge_tunnel(3, &call(&[], Err("no answer"))), None);
    }

    #[test]
    fn a_gap_a_repeat_a_swap_or_a_silent_short_end_is_caught() {
        assert!(judge_tunnel(3, &call(&[0, 2], Err("closed"))).is_some());
        assert!(judge_tunnel(3, &call(&[0, 0, 1, 2], Ok(()))).is_some());
        assert!(judge_tunnel(3, &call(&[1, 0, 2], Ok(()))).is_some());
        assert!(judge_tunnel(3, &call(&[0, 1], Ok(()))).is_some());
    }
}
