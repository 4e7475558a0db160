//! What must hold once the faults stop and the system is quiet. Each
//! violation names the invariant, the group and the devices.

use hubsync::device::{Event, GroupId};
use hubsync::wire::DeviceId;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, OnceLock};

/// An invariant's name. (An alias: serde would take a spelled-out
/// `&'static str` field for one borrowed from the input.)
pub type Name = &'static str;

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Violation {
    /// Which invariant: `convergence`, `ledger-head`, `membership`,
    /// `accepted-commits`, `ledger-authority`, `message-lost`,
    /// `message-duplicated`, `outbox-drained`, `no-panic`, `quiescence`,
    /// `strand-without-cause`.
    #[serde(deserialize_with = "interned")]
    pub invariant: Name,
    /// The group, hex.
    pub group: Option<String>,
    /// The devices involved (short hex).
    pub devices: Vec<String>,
    /// What was seen.
    pub detail: String,
}

impl Violation {
    /// A violation.
    pub fn new(
        invariant: &'static str,
        group: Option<GroupId>,
        devices: Vec<DeviceId>,
        detail: String,
    ) -> Self {
        Self {
            invariant,
            group: group.map(|g| g.to_string()[..12].to_string()),
            devices: devices.iter().map(short).collect(),
            detail,
        }
    }
}

/// An invariant's name read back from a report (a seed run in its own
/// process): each distinct name is allocated once for the process, so the
/// few names there are stay `&'static` without growing per report.
fn interned<'de, D: serde::Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    static NAMES: OnceLock<Mutex<std::collections::BTreeSet<&'static str>>> = OnceLock::new();
    let name = <String as serde::Deserialize>::deserialize(d)?;
    let mut names = NAMES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(known) = names.get(name.as_str()) {
        return Ok(known);
    }
    let leaked: &'static str = Box::leak(name.into_boxed_str());
    names.insert(leaked);
    Ok(leaked)
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.invariant)?;
        if let Some(g) = &self.group {
            write!(f, " in group {g}")?;
        }
        if !self.devices.is_empty() {
            write!(f, " at {}", self.devices.join(", "))?;
        }
        write!(f, ": {}", self.detail)
    }
}

fn short(d: &DeviceId) -> String {
    d.to_string()[..8].to_string()
}

/// A message whose `send` returned.
#[derive(Clone, Debug)]
pub struct Sent {
    /// The group.
    pub group: GroupId,
    /// The sender.
    pub sender: DeviceId,
    /// Its id.
    pub id: [u8; 16],
    /// The epoch it was encrypted in.
    pub epoch: u64,
    /// Simulated ms when `send` returned.
    pub at_ms: u64,
}

/// A commit whose operation returned `Ok`: its hub accepted it.
#[derive(Clone, Debug)]
pub struct Accepted {
    /// The group.
    pub group: GroupId,
    /// The committer.
    pub by: DeviceId,
    /// The epoch the commit made.
    pub epoch: u64,
    /// The hub that took it: the committer's commit hub right after the
    /// commit returned (before it, for a move of the commit hub).
    pub hub: String,
    /// Simulated ms when the operation returned.
    pub at_ms: u64,
}

/// A hub restarted from an older copy of its store, or from an empty one.
#[derive(Clone, Debug)]
pub struct Rewind {
    /// The hub's URL.
    pub hub: String,
    /// Simulated ms when the copy was taken (0: an empty store).
    pub snapshot_ms: u64,
    /// Simulated ms when the hub went down to be restored.
    pub at_ms: u64,
}

impl Rewind {
    /// Whether this rewind can have erased a commit its hub accepted and
    /// answered at `at_ms`: the copy predates it and the rewind follows it.
    fn erases_commit(&self, hub: &str, at_ms: u64) -> bool {
        self.hub == hub && self.snapshot_ms < at_ms && at_ms <= self.at_ms
    }

    /// Whether this rewind can have erased a message whose `send` returned
    /// at `at_ms`: the outbox hands it to the hubs at some later moment,
    /// which may fall between the copy and the rewind, so any rewind after
    /// the send may have erased it on that hub.
    fn erases_message(&self, hubs: &BTreeSet<String>, at_ms: u64) -> bool {
        hubs.contains(&self.hub) && at_ms <= self.at_ms
    }
}

/// One group as a device sees it at the end.
#[derive(Clone, Debug)]
pub struct FinalGroup {
    /// The group.
    pub group: GroupId,
    /// Its epoch.
    pub epoch: u64,
    /// Its epoch authenticator.
    pub authenticator: Vec<u8>,
    /// Its members.
    pub members: Vec<DeviceId>,
    /// Last commit-log position applied.
    pub commit_cursor: u64,
    /// The commit hub.
    pub commit_hub: String,
    /// Whether the device thinks it was left behind.
    pub stranded: bool,
    /// The group's topic seed (the commit topic derives from it).
    pub commit_seed: [u8; 32],
    /// The hubs the group is bound to, as this device's record says.
    pub hubs: Vec<String>,
    /// The head of the device's folded ledger (`None`: it did not fold).
    pub ledger_head: Option<[u8; 32]>,
}

/// One device at the end.
#[derive(Clone, Debug)]
pub struct FinalState {
    /// The device (zero when it did not answer).
    pub device: DeviceId,
    /// Its groups.
    pub groups: Vec<FinalGroup>,
    /// Outbox entries still owed.
    pub outbox_pending: usize,
    /// Commits it landed.
    pub commits: u64,
}

impl FinalState {
    /// A device that did not answer.
    pub fn unreachable() -> Self {
        Self {
            device: DeviceId([0; 32]),
            groups: Vec::new(),
            outbox_pending: usize::MAX,
            commits: 0,
        }
    }
}

/// Whether the system looks settled: every device answered, outboxes are
/// drained, and every group's holders agree.
pub fn settled(finals: &[FinalState]) -> bool {
    if finals.iter().any(|f| f.outbox_pending != 0) {
        return false;
    }
    let mut by_group: BTreeMap<GroupId, BTreeSet<(u64, Vec<u8>)>> = BTreeMap::new();
    for f in finals {
        for g in &f.groups {
            by_group
                .entry(g.group)
                .or_default()
                .insert((g.epoch, g.authenticator.clone()));
        }
    }
    by_group.values().all(|s| s.len() == 1)
}

/// A stable one-line form of an event for the trace hash.
pub fn event_line(e: &Event) -> String {
    match e {
        Event::MessageReceived {
            group, sender, id, ..
        } => {
            format!(
                "msg {} {} {}",
                &group.to_string()[..8],
                short(sender),
                hex::encode(id)
            )
        }
        Event::GroupJoined { group, epoch } => {
            format!("joined {} {epoch}", &group.to_string()[..8])
        }
        Event::EpochChanged { group, epoch } => {
            format!("epoch {} {epoch}", &group.to_string()[..8])
        }
        Event::MembersChanged { group, members } => {
            format!("members {} {}", &group.to_string()[..8], members.len())
        }
        Event::Removed { group } => format!("removed {}", &group.to_string()[..8]),
        Event::RecoveryFailed { group, remedy, .. } => {
            format!("recovery-failed {} {remedy:?}", &group.to_string()[..8])
        }
        Event::Forgotten { group } => format!("forgotten {}", &group.to_string()[..8]),
        Event::AppFramesMissed { group, hub, missed } => {
            format!(
                "app-frames-missed {} {hub} {missed}",
                &group.to_string()[..8]
            )
        }
        Event::LedgerGathered { group, entries, .. } => {
            format!("ledger-gathered {} {entries}", &group.to_string()[..8])
        }
        Event::Rejoined { group, epoch } => {
            format!("rejoined {} {epoch}", &group.to_string()[..8])
        }
        Event::MessagesSentAgain {
            group,
            ids,
            older_forgotten,
        } => format!(
            "sent-again {} {} {older_forgotten}",
            &group.to_string()[..8],
            ids.len()
        ),
        Event::KeyPackageRefused { device, hub, .. } => {
            format!("key-package-refused {} {hub}", short(device))
        }
        Event::InboxTrimmed { group, position } => {
            format!("inbox-trimmed {} {position}", &group.to_string()[..8])
        }
        Event::Conflict { group, id } => {
            format!("conflict {} {}", &group.to_string()[..8], hex::encode(id))
        }
        Event::Stranded { group } => format!("stranded {}", &group.to_string()[..8]),
        Event::FrameSkipped {
            group, seq, reason, ..
        } => format!("skipped {} {seq} {reason}", &group.to_string()[..8]),
        Event::HubRewound { url } => format!("rewound {url}"),
        Event::LedgerChanged { group } => format!("ledger {}", &group.to_string()[..8]),
        Event::CommitLost { group, kind, .. } => {
            format!("lost {} {kind:?}", &group.to_string()[..8])
        }
        Event::CommitFailed { group, kind, .. } => {
            format!("failed {} {kind:?}", &group.to_string()[..8])
        }
        Event::HubStatus { url, .. } => format!("hub {url}"),
        Event::SubscriptionRefused { hub, error, .. } => {
            format!("subscription refused {hub} {error}")
        }
        Event::WelcomeRefused { group, reason } => format!(
            "welcome refused {} {reason}",
            group
                .map(|g| g.to_string()[..8].to_string())
                .unwrap_or_default()
        ),
    }
}

/// What the run did, beside the end state, that the invariants judge.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// Messages whose `send` returned.
    pub sent: Vec<Sent>,
    /// Commits whose operation returned `Ok`.
    pub accepted: Vec<Accepted>,
    /// Hub rewinds, in order.
    pub rewinds: Vec<Rewind>,
    /// Every hub each group was bound to at some point (or asked to be).
    pub hubs: BTreeMap<GroupId, BTreeSet<String>>,
    /// Long device outages (the `outages` fault).
    pub outages: Vec<Outage>,
    /// Whether hubs kept their logs short (the `outages` fault), so that
    /// any device away for a few steps may find them trimmed.
    pub short_logs: bool,
}

/// A device down for a long while, with the hubs' logs kept short.
#[derive(Clone, Debug)]
pub struct Outage {
    /// The device.
    pub device: DeviceId,
    /// Simulated ms when it went down.
    pub start_ms: u64,
    /// Simulated ms when it came back.
    pub end_ms: u64,
}

/// What [`check`] excused because a rewind may have erased it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Excused {
    /// Accepted commits not judged.
    pub commits: usize,
    /// Missing deliveries not counted as lost.
    pub deliveries: usize,
}

/// Check every invariant over the end state, the history, and the events.
pub fn check(
    finals: &[FinalState],
    heads: &BTreeMap<GroupId, Option<u64>>,
    history: &History,
    events: &[(u64, usize, Event)],
    ids: &BTreeMap<usize, DeviceId>,
) -> (Vec<Violation>, Excused) {
    let sent = &history.sent;
    let mut excused = Excused::default();
    let mut v = Vec::new();
    let mut holders: BTreeMap<GroupId, Vec<(DeviceId, &FinalGroup)>> = BTreeMap::new();
    for f in finals {
        if f.device == DeviceId([0; 32]) {
            v.push(Violation::new(
                "quiescence",
                None,
                vec![],
                "a device did not answer".into(),
            ));
            continue;
        }
        if f.outbox_pending != 0 {
            v.push(Violation::new(
                "outbox-drained",
                None,
                vec![f.device],
                format!("{} entries still owed", f.outbox_pending),
            ));
        }
        for g in &f.groups {
            holders.entry(g.group).or_default().push((f.device, g));
        }
    }

    for (group, hs) in &holders {
        // Ledger head: every holder folds its ledger to the same head. Judged
        // even when the epochs disagree: it says whose ledger went astray.
        let ledger_heads: BTreeSet<Option<[u8; 32]>> =
            hs.iter().map(|(_, g)| g.ledger_head).collect();
        if ledger_heads.len() > 1 || ledger_heads.contains(&None) {
            let detail = hs
                .iter()
                .map(|(d, g)| {
                    format!(
                        "{}:{}",
                        short(d),
                        g.ledger_head
                            .map(|h| hex::encode(&h[..4]))
                            .unwrap_or_else(|| "unfoldable".into())
                    )
                })
                .collect::<Vec<_>>()
                .join(" ");
            v.push(Violation::new(
                "ledger-head",
                Some(*group),
                hs.iter().map(|(d, _)| *d).collect(),
                detail,
            ));
        }
        // Convergence: one epoch, one authenticator (no fork survives).
        let states: BTreeSet<(u64, Vec<u8>)> = hs
            .iter()
            .map(|(_, g)| (g.epoch, g.authenticator.clone()))
            .collect();
        if states.len() > 1 {
            let detail = hs
                .iter()
                .map(|(d, g)| {
                    format!(
                        "{}@{}:{}",
                        short(d),
                        g.epoch,
                        &hex::encode(&g.authenticator)[..8]
                    )
                })
                .collect::<Vec<_>>()
                .join(" ");
            v.push(Violation::new(
                "convergence",
                Some(*group),
                hs.iter().map(|(d, _)| *d).collect(),
                detail,
            ));
            continue;
        }
        // Membership: the agreed roster is exactly the devices holding it.
        let roster: BTreeSet<DeviceId> = hs[0].1.members.iter().copied().collect();
        let holding: BTreeSet<DeviceId> = hs.iter().map(|(d, _)| *d).collect();
        if roster != holding {
            let odd: Vec<DeviceId> = roster.symmetric_difference(&holding).copied().collect();
            v.push(Violation::new(
                "membership",
                Some(*group),
                odd,
                format!(
                    "roster has {} members, {} devices hold the group",
                    roster.len(),
                    holding.len()
                ),
            ));
        }
        // Every commit an operation saw accepted is in every member's
        // history: no member ends at an earlier epoch. A commit a rewind may
        // have erased from its hub (accepted after the copy the hub was
        // restored from, before the restore) is not judged.
        // A commit built on one a rewind may have erased is on a branch the
        // group may have left: what is owed then is that its committer
        // learns so (it strands, or finds itself removed) after it.
        let epoch = hs[0].1.epoch;
        let erased = |a: &Accepted| {
            history
                .rewinds
                .iter()
                .any(|r| r.erases_commit(&a.hub, a.at_ms))
        };
        let learned = |a: &Accepted| {
            events.iter().any(|(ms, i, e)| {
                *ms >= a.at_ms
                    && ids.get(i) == Some(&a.by)
                    && matches!(e, Event::Stranded { group: g } | Event::Removed { group: g } if *g == a.group)
            })
        };
        for a in history.accepted.iter().filter(|a| a.group == *group) {
            let on_erased = || {
                history.accepted.iter().any(|x| {
                    x.group == a.group && x.epoch <= a.epoch && x.at_ms <= a.at_ms && erased(x)
                })
            };
            if erased(a) || (on_erased() && learned(a)) {
                excused.commits += 1;
                continue;
            }
            if epoch < a.epoch {
                v.push(Violation::new(
                    "accepted-commits",
                    Some(*group),
                    vec![a.by],
                    format!(
                        "a commit accepted at epoch {} (at {} ms), the group ended at epoch {epoch}",
                        a.epoch, a.at_ms
                    ),
                ));
            }
        }
        // And every member applied the commit hub's log up to its head (as
        // the hub holds it now, rewound or not).
        if let Some(Some(head)) = heads.get(group) {
            let behind: Vec<DeviceId> = hs
                .iter()
                .filter(|(_, g)| g.commit_cursor < *head)
                .map(|(d, _)| *d)
                .collect();
            if !behind.is_empty() {
                v.push(Violation::new(
                    "accepted-commits",
                    Some(*group),
                    behind,
                    format!("commit hub head {head}, some members applied less"),
                ));
            }
        }
        let stranded: Vec<DeviceId> = hs
            .iter()
            .filter(|(_, g)| g.stranded)
            .map(|(d, _)| *d)
            .collect();
        if !stranded.is_empty() {
            v.push(Violation::new(
                "convergence",
                Some(*group),
                stranded,
                "stranded".into(),
            ));
        }
    }

    // A device strands only when a hub lost commits it had accepted (a
    // rewind) or trimmed them before it read them (short logs): with
    // neither, a stranding is a fork the compare-and-set should have
    // prevented, even if a rejoin healed it afterwards.
    if history.rewinds.is_empty() && !history.short_logs {
        let mut stranded: BTreeMap<GroupId, BTreeSet<DeviceId>> = BTreeMap::new();
        for (_, dev, e) in events {
            if let (Event::Stranded { group }, Some(d)) = (e, ids.get(dev)) {
                stranded.entry(*group).or_default().insert(*d);
            }
        }
        for (group, devices) in stranded {
            v.push(Violation::new(
                "strand-without-cause",
                Some(group),
                devices.into_iter().collect(),
                "stranded though no hub lost a commit".into(),
            ));
        }
    }

    // Messages: every member of the message's epoch that still holds the
    // group got it exactly once; nobody got anything twice.
    let index: BTreeMap<DeviceId, usize> = ids.iter().map(|(i, d)| (*d, *i)).collect();
    let mut got: BTreeMap<(usize, GroupId, [u8; 16]), usize> = BTreeMap::new();
    let mut joined_at: BTreeMap<(usize, GroupId), u64> = BTreeMap::new();
    // The latest epoch each device rejoined each group at.
    let mut rejoined_at: BTreeMap<(usize, GroupId), u64> = BTreeMap::new();
    // When each device last said a hub trimmed app frames of a group
    // before it read them.
    let mut missed_at: BTreeMap<(usize, GroupId), u64> = BTreeMap::new();
    for (t, dev, e) in events {
        match e {
            Event::AppFramesMissed { group, .. } => {
                missed_at.insert((*dev, *group), *t);
            }
            Event::MessageReceived { group, id, .. } => {
                *got.entry((*dev, *group, *id)).or_default() += 1
            }
            Event::GroupJoined { group, epoch } => {
                joined_at.insert((*dev, *group), *epoch);
            }
            Event::Rejoined { group, epoch } => {
                let e = rejoined_at.entry((*dev, *group)).or_default();
                *e = (*e).max(*epoch);
            }
            _ => {}
        }
    }
    for ((dev, group, id), n) in &got {
        if *n > 1 {
            let d = ids.get(dev).copied().into_iter().collect();
            v.push(Violation::new(
                "message-duplicated",
                Some(*group),
                d,
                format!("message {} delivered {n} times", hex::encode(id)),
            ));
        }
    }
    for m in sent {
        let Some(hs) = holders.get(&m.group) else {
            continue;
        };
        for (d, _) in hs {
            if *d == m.sender {
                continue;
            }
            let Some(&i) = index.get(d) else { continue };
            let Some(&joined) = joined_at.get(&(i, m.group)) else {
                continue;
            };
            if joined > m.epoch {
                continue;
            }
            if got.get(&(i, m.group, m.id)).copied().unwrap_or(0) == 0 {
                let bound = history.hubs.get(&m.group).cloned().unwrap_or_default();
                // A device that rejoined at a later epoch never had the
                // keys of the epochs it was left behind in; one that was
                // told, after the send, that a hub trimmed app frames of
                // the group before it read them may have lost it there.
                let rejoined_past = rejoined_at.get(&(i, m.group)).is_some_and(|e| *e > m.epoch);
                let trimmed = missed_at.get(&(i, m.group)).is_some_and(|t| *t >= m.at_ms);
                // Sent on a branch built on a commit a rewind may have
                // erased, by a device that then found itself removed (its
                // own membership was on that branch): it has nobody to send
                // it again to. One that rejoins sends it again, and is
                // judged.
                let on_erased_branch = history.accepted.iter().any(|x| {
                    x.group == m.group
                        && x.epoch <= m.epoch
                        && x.at_ms <= m.at_ms
                        && history
                            .rewinds
                            .iter()
                            .any(|r| r.erases_commit(&x.hub, x.at_ms))
                });
                let sender_removed = events.iter().any(|(ms, i, e)| {
                    *ms >= m.at_ms
                        && ids.get(i) == Some(&m.sender)
                        && matches!(e, Event::Removed { group } if *group == m.group)
                });
                if rejoined_past
                    || trimmed
                    || (on_erased_branch && sender_removed)
                    || history
                        .rewinds
                        .iter()
                        .any(|r| r.erases_message(&bound, m.at_ms))
                {
                    excused.deliveries += 1;
                    continue;
                }
                v.push(Violation::new(
                    "message-lost",
                    Some(m.group),
                    vec![*d, m.sender],
                    format!(
                        "message {} of epoch {} never arrived (member since epoch {joined})",
                        hex::encode(m.id),
                        m.epoch
                    ),
                ));
            }
        }
    }
    (v, excused)
}

/// Records panics anywhere in the run (tokio catches a panicking task, so
/// without this a panic could pass unnoticed). A run is single-threaded, so
/// only panics on the calling thread are its own: other runs in the same
/// process (parallel tests) are not mixed in.
pub struct PanicCatcher {
    thread: std::thread::ThreadId,
}

type PanicLog = Arc<Mutex<Vec<(std::thread::ThreadId, String)>>>;

static PANICS: OnceLock<PanicLog> = OnceLock::new();

fn panic_log() -> &'static PanicLog {
    PANICS.get_or_init(|| {
        let seen: PanicLog = Arc::default();
        let s = seen.clone();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((std::thread::current().id(), info.to_string()));
            previous(info);
        }));
        seen
    })
}

impl PanicCatcher {
    /// Install the hook (once per process) and start a fresh record for
    /// this thread.
    pub fn install() -> Self {
        let thread = std::thread::current().id();
        panic_log()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(t, _)| *t != thread);
        Self { thread }
    }

    /// This thread's panics since `install`.
    pub fn take(&self) -> Vec<String> {
        let mut log = panic_log().lock().unwrap_or_else(|p| p.into_inner());
        let mine = log
            .iter()
            .filter(|(t, _)| *t == self.thread)
            .map(|(_, m)| m.clone())
            .collect();
        log.retain(|(t, _)| *t != self.thread);
        mine
    }
}
