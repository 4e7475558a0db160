//! `GroupPeerManager`: every hub link and group peer of one device.
//!
//! One [`HubLink`] per hub URL, created on first use and shared by every
//! group bound to that hub; one [`GroupPeer`] per (group, hub) pair that
//! exists while the group is joined and bound to that hub. The manager owns
//! their lifecycle, fans broadcasts out to every hub of a group, routes
//! commits through the group's commit hub, and answers Welcomes.

use super::directory::HubDirectory;
use super::error::DeviceError;
use super::events::{Event, EventStream};
use super::frames::WelcomeEnvelope;
use super::identity::DeviceIdentity;
use super::inbox::{Inbox, InboxConfig};
use super::lane::LOOPBACK_HUB;
use super::ledger::HlcClock;
use super::link::{HubLink, LinkConfig, LinkError, LinkStatus};
use super::outbox::{Outbox, OutboxSink, SendFailure};
use super::records::{GroupId, GroupRecord, Records, UploadedKeyPackage};
use super::registry::Registry;
use super::topics;
use crate::clock::Clock;
use crate::rng::SharedRng;
use crate::transport::Connector;
use crate::wire::{HubError, Publish, PublishOutcome, TopicId};
use futures::future::BoxFuture;
use openmls::prelude::{KeyPackageBundle, KeyPackageRef};
use openmls_traits::storage::StorageProvider as _;
use openmls_traits::OpenMlsProvider as _;
use sha2::Digest as _;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What to do with an app frame from an epoch this device has not reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FutureFrames {
    /// Keep it durably and read it after the next epoch change (default).
    #[default]
    Persist,
    /// Drop it and count it.
    Drop,
}

/// How a manager behaves.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Reconnection and request settings of every hub link.
    pub link: LinkConfig,
    /// Future-epoch app frames.
    pub future_frames: FutureFrames,
    /// Re-broadcast frames received on one hub to the group's other hubs.
    pub forwarding: bool,
    /// How long a commit keeps retrying lost races.
    pub commit_deadline: Duration,
    /// Key packages kept in the pool on each hub.
    pub key_packages: u32,
    /// How long the key packages this device makes, and its leaf in a group
    /// it creates, stay valid (their MLS lifetime, counted from the device's
    /// clock, starting [`mls::LIFETIME_MARGIN`](super::mls::LIFETIME_MARGIN)
    /// in the past). OpenMLS refuses a key package outside it.
    pub key_package_lifetime: Duration,
    /// Called synchronously with every event as it is emitted, after the
    /// state it reports is durable: for harnesses that must not miss one
    /// (the broadcast channel drops events for a lagging receiver).
    pub observer: Option<Observer>,
    /// What the app's durable inbox keeps.
    pub inbox: InboxConfig,
    /// How long a ledger catch-up waits for an answer that fits.
    pub gather_deadline: Duration,
    /// How long a rejoin (the deep remedy) keeps asking members for a
    /// GroupInfo and racing its external commit.
    pub rejoin_deadline: Duration,
    /// Rejoin a group on its own, in the background, as soon as this
    /// device finds itself stranded there, then gather its ledger if the
    /// rejoin left it incomplete (each again after a failed attempt,
    /// waiting 5 s, then twice as long each time up to 5 min, or at once
    /// when a hub link connects again), so a device that only reads heals
    /// too. Off: a stranded group waits for a commit
    /// (`commit_with_recovery`) or the app's `rejoin_group`.
    pub auto_rejoin: bool,
    /// A tunnel on which nothing came from the other side and no new data
    /// went to it for this long closes ([`super::tunnel::CloseReason::Idle`]):
    /// resends to a device that stopped answering do not keep it open.
    pub tunnel_idle_timeout: Duration,
}

/// A synchronous event callback (see [`ManagerConfig::observer`]).
#[derive(Clone)]
pub struct Observer(pub Arc<dyn Fn(&Event) + Send + Sync>);

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Observer")
    }
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            link: LinkConfig::default(),
            future_frames: FutureFrames::Persist,
            forwarding: false,
            commit_deadline: Duration::from_secs(30),
            key_packages: 10,
            key_package_lifetime: super::mls::KEY_PACKAGE_LIFETIME,
            observer: None,
            inbox: InboxConfig::default(),
            gather_deadline: Duration::from_secs(10),
            rejoin_deadline: Duration::from_secs(30),
            auto_rejoin: true,
            tunnel_idle_timeout: Duration::from_secs(300),
        }
    }
}

/// How often a device checks its key package pool on each of its hubs.
const RESTOCK_INTERVAL: Duration = Duration::from_secs(60);

/// Events buffered for a receiver that lags.
const EVENT_CAPACITY: usize = 65_536;

/// Counters a device reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// App messages delivered to the app.
    pub delivered: u64,
    /// Frames dropped because another hub already delivered them.
    pub duplicates: u64,
    /// App frames dropped (dead epoch, or a future one in drop mode).
    pub dropped: u64,
    /// Commit-topic frames skipped as unreadable.
    pub poison: u64,
    /// Commits this device landed.
    pub commits: u64,
    /// Commit attempts that lost the race and were rebuilt.
    pub lost_races: u64,
    /// Publishes the outbox owes its hubs now ([`Outbox::owed`]); sends
    /// wait once this reaches `OutboxConfig::max_owed`.
    pub outbox_owed: usize,
    /// Unprocessed inbox messages deleted because their group's inbox was
    /// full ([`InboxConfig::max_unprocessed`]); each was also reported as
    /// [`Event::InboxTrimmed`].
    pub inbox_trimmed: u64,
    /// Members' control requests (ledger requests) this device could not
    /// answer (a store or MLS failure; the requester sees no answer).
    pub control_failures: u64,
    /// Times a hub held key packages this device no longer had the keys
    /// of (restored from a backup) and its pool there was replaced.
    pub key_packages_replaced: u64,
    /// Reads of a group's commit log that failed (a hub or store error);
    /// those in the background (after a reconnect, on a push, on the
    /// periodic tick) are retried by the next. A steady rise means a hub
    /// this device cannot read from.
    pub pull_failures: u64,
    /// App frames a peer could not handle (a store failure), and reads of
    /// an app topic's log that failed. Both are retried: the topic's log is
    /// read again, every second until a read succeeds, with its pushes held
    /// meanwhile. A steady rise means a store or hub that keeps failing.
    pub receive_failures: u64,
    /// Subscriptions a hub refused (each also an
    /// [`Event::SubscriptionRefused`], for the newest of a burst).
    pub subscriptions_refused: u64,
    /// Welcomes this device could not read because they named a key
    /// package it no longer held, for each of which it asked the inviter to
    /// invite it again.
    pub reinvites_asked: u64,
    /// Requests to be invited again that this device, as the inviter,
    /// acted on (removed the joiner's dead leaf and invited it again).
    pub reinvites_answered: u64,
    /// Requests to be invited again that this device refused: not its
    /// Welcome, not signed by the joiner, or no longer its to answer.
    pub reinvites_refused: u64,
    /// Notices from hubs that frames of a topic this device follows were
    /// trimmed (by log depth or retention) before they were pushed (each
    /// also an [`Event::AppFramesMissed`] when the topic is a group's app
    /// topic).
    pub frames_missed_notices: u64,
}

impl DeviceStats {
    /// The counters in Prometheus's text format (version 0.0.4), every
    /// name prefixed `hubsync_device_`, for an app to serve or push to its
    /// metrics system as it does its own.
    pub fn prometheus_text(&self) -> String {
        use crate::prom::{Kind::Counter, Kind::Gauge, PromText};
        let mut t = PromText::new("hubsync_device_");
        let counters: [(&str, &str, u64); 16] = [
            (
                "delivered_total",
                "App messages delivered to the app.",
                self.delivered,
            ),
            (
                "duplicates_total",
                "Frames dropped because another hub already delivered them.",
                self.duplicates,
            ),
            (
                "dropped_total",
                "App frames dropped (a dead epoch, or a future one in drop mode).",
                self.dropped,
            ),
            (
                "poison_total",
                "Commit-topic frames skipped as unreadable.",
                self.poison,
            ),
            ("commits_total", "Commits this device landed.", self.commits),
            (
                "lost_races_total",
                "Commit attempts that lost the race and were rebuilt.",
                self.lost_races,
            ),
            (
                "inbox_trimmed_total",
                "Unprocessed inbox messages deleted because the inbox was full.",
                self.inbox_trimmed,
            ),
            (
                "control_failures_total",
                "Members' control requests this device could not answer.",
                self.control_failures,
            ),
            (
                "key_packages_replaced_total",
                "Times a hub's pool of this device's key packages was replaced.",
                self.key_packages_replaced,
            ),
            (
                "reinvites_asked_total",
                "Welcomes on a key package this device no longer held, each answered by asking to be invited again.",
                self.reinvites_asked,
            ),
            (
                "reinvites_answered_total",
                "Requests to be invited again that this device acted on.",
                self.reinvites_answered,
            ),
            (
                "reinvites_refused_total",
                "Requests to be invited again that this device refused.",
                self.reinvites_refused,
            ),
            (
                "frames_missed_notices_total",
                "Notices from hubs that frames were trimmed before they were pushed.",
                self.frames_missed_notices,
            ),
            (
                "pull_failures_total",
                "Reads of a group's commit log that failed.",
                self.pull_failures,
            ),
            (
                "receive_failures_total",
                "App frames not handled and app log reads that failed (retried).",
                self.receive_failures,
            ),
            (
                "subscriptions_refused_total",
                "Subscriptions a hub refused.",
                self.subscriptions_refused,
            ),
        ];
        for (name, help, value) in counters {
            t.one(name, Counter, help, value);
        }
        t.one(
            "outbox_owed",
            Gauge,
            "Publishes the outbox owes its hubs now.",
            self.outbox_owed as u64,
        );
        t.finish()
    }
}

#[derive(Default)]
pub(super) struct Counters {
    pub delivered: AtomicU64,
    pub duplicates: AtomicU64,
    pub dropped: AtomicU64,
    pub poison: AtomicU64,
    pub commits: AtomicU64,
    pub lost_races: AtomicU64,
    pub inbox_trimmed: AtomicU64,
    pub control_failures: AtomicU64,
    pub key_packages_replaced: AtomicU64,
    pub pull_failures: AtomicU64,
    pub receive_failures: AtomicU64,
    pub subscriptions_refused: AtomicU64,
    pub reinvites_asked: AtomicU64,
    pub reinvites_answered: AtomicU64,
    pub reinvites_refused: AtomicU64,
    pub frames_missed_notices: AtomicU64,
}

/// The topics a group's peers read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct GroupTopics {
    pub commit_hub: String,
    pub commit: TopicId,
    pub app: Vec<TopicId>,
    /// The group's rendezvous mailbox (read on every hub of the group).
    pub rendezvous: Option<TopicId>,
}

impl GroupTopics {
    pub(super) fn of(rec: &GroupRecord) -> Self {
        Self {
            commit_hub: rec.commit_hub.clone(),
            commit: topics::commit_topic(&rec.commit_seed),
            app: rec.app_topics.clone(),
            rendezvous: rec.rendezvous_seed.as_ref().map(topics::rendezvous_topic),
        }
    }
}

/// One (group, hub) peer: subscribes the group's topics on that hub and
/// applies what arrives.
#[derive(Clone)]
pub struct GroupPeer {
    group: GroupId,
    hub: String,
    link: HubLink,
    cancel: CancellationToken,
    /// Asks the peer to read its app topics' logs again.
    recatch: Arc<tokio::sync::Notify>,
}

impl GroupPeer {
    /// Have the peer read its app topics' logs again from their cursors
    /// (at once, or after the reads in progress).
    pub(super) fn recatch_app_logs(&self) {
        self.recatch.notify_one();
    }

    /// The group.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// The hub.
    pub fn hub(&self) -> &str {
        &self.hub
    }

    /// The shared link to the hub.
    pub fn link(&self) -> &HubLink {
        &self.link
    }
}

/// A request this device sent or answers: the group and the request's nonce.
pub(super) type RequestKey = (GroupId, [u8; 16]);

pub(super) struct Shared {
    pub identity: DeviceIdentity,
    pub registry: Registry,
    pub records: Records,
    pub inbox: Inbox,
    /// Ledger requests of this device waiting for answers.
    pub gathers: Mutex<BTreeMap<RequestKey, super::gather::Pending>>,
    /// Rejoin requests of this device waiting for answers.
    pub rejoins: Mutex<BTreeMap<RequestKey, mpsc::Sender<super::rejoin::Incoming>>>,
    /// Members' rejoin requests this device means to answer: cancelled when
    /// another member's answer to the same request is seen first.
    pub answering: Mutex<BTreeMap<RequestKey, Arc<super::rejoin::Answering>>>,
    /// Groups a background rejoin is healing now (one task per group).
    pub healing: Mutex<std::collections::BTreeSet<GroupId>>,
    /// Groups a background epoch probe runs for now (one per group), each
    /// with whether another probe was asked for while it ran (it then runs
    /// once more: what it found may predate the cause of the new ask).
    pub probing: Mutex<BTreeMap<GroupId, bool>>,
    /// Groups whose lost messages a background task sends again now (one
    /// per group).
    pub resending: Mutex<std::collections::BTreeSet<GroupId>>,
    /// Members' control requests this device is handling now (at most
    /// [`super::control_msg::MAX_CONTROL_TASKS`]).
    pub control_tasks: AtomicU64,
    pub outbox: Outbox,
    pub directory: HubDirectory,
    pub connector: Arc<dyn Connector>,
    pub config: ManagerConfig,
    pub rng: SharedRng,
    /// The injected wall clock (ledger entries are ordered on it).
    pub clock: Clock,
    /// The device's hybrid logical clock for ledger entries.
    pub hlc: HlcClock,
    /// One commit run at a time per group (apart from the group lock).
    pub lanes: Mutex<BTreeMap<GroupId, Arc<tokio::sync::Mutex<()>>>>,
    /// When each group's former commit logs were last checked (ms).
    pub former_checked: Mutex<BTreeMap<GroupId, u64>>,
    /// Per group: app messages sent since its kept sent messages were last
    /// pruned (see [`super::records::SENT_KEPT`]).
    pub sends_unpruned: Mutex<BTreeMap<GroupId, usize>>,
    /// The URL of this device's loopback hub, which the sentinel
    /// [`LOOPBACK_HUB`] stands for.
    pub loopback_url: String,
    pub links: Mutex<BTreeMap<String, HubLink>>,
    pub peers: Mutex<BTreeMap<(GroupId, String), GroupPeer>>,
    pub topics: Mutex<BTreeMap<GroupId, watch::Sender<GroupTopics>>>,
    pub events: broadcast::Sender<Event>,
    /// The device's own hubs: their links stay even when no group uses them.
    pub own_hubs: Mutex<Vec<String>>,
    /// Per own hub: `Ok` once key packages are stocked there, else the last
    /// restock failure (absent: not tried yet).
    pub stocked: watch::Sender<BTreeMap<String, Result<(), String>>>,
    pub counters: Counters,
    pub shutdown: CancellationToken,
    pub tasks: TaskTracker,
    /// Tunnels to and from co-members, and the procedures served on them.
    pub tunnels: super::tunnel::Tunnels,
    /// Counts the connections any hub link made: background heals waiting
    /// out a backoff try again when it moves (the hub they could not reach
    /// may be back).
    pub links_up: watch::Sender<u64>,
    /// What this device learned of its co-members' presence.
    pub presence: Mutex<super::presence::PresenceBook>,
    /// Per group and hub: when this device last said it is live there
    /// (ms), so answers to several askers at once are one beacon.
    pub presence_sent: Mutex<BTreeMap<(GroupId, String), u64>>,
    /// Test-only fault switches (see [`Faults`]).
    pub faults: Faults,
}

/// Deliberate faults, for showing that the checks that should catch them
/// do. Never set outside tests.
#[derive(Debug, Default)]
pub struct Faults {
    /// Skip the inbox's duplicate check.
    pub skip_dedup: std::sync::atomic::AtomicBool,
    /// Stop a commit right after its journal entry is durable, before the
    /// publish, as a crash there would.
    pub halt_after_journal: std::sync::atomic::AtomicBool,
    /// Stop a commit right after the hub accepted it, before the merge, as a
    /// crash there would.
    pub halt_after_accept: std::sync::atomic::AtomicBool,
    /// Merge a commit even when it lost the compare-and-set (forks the
    /// group).
    pub merge_on_mismatch: std::sync::atomic::AtomicBool,
    /// Hand every received message to the app twice (a broken inbox).
    pub double_emit: std::sync::atomic::AtomicBool,
    /// Never deliver anything from the outbox.
    pub blackhole_outbox: std::sync::atomic::AtomicBool,
    /// Never apply commits from the commit log.
    pub no_pull: std::sync::atomic::AtomicBool,
    /// Panic on every received app frame.
    pub panic_on_receive: std::sync::atomic::AtomicBool,
    /// Answer ledger requests with a lie: 1 swaps the first two entries, 2
    /// drops the last one.
    pub lying_ledger: std::sync::atomic::AtomicU8,
    /// Wait this many milliseconds before answering a ledger request.
    pub answer_delay_ms: AtomicU64,
    /// Seal a Welcome's ledger snapshot without its last this many
    /// entries, so the joiner's ledger is incomplete.
    pub welcome_ledger_short_by: std::sync::atomic::AtomicUsize,
    /// Lose every n-th tunnel frame this device sends (0: none), as a hub
    /// that accepted it and lost it would.
    pub lose_tunnel_frames: AtomicU64,
    /// Hear nothing back for this many accepted commit publishes (the hub
    /// has the commit; the device sends it again after
    /// [`LOST_ANSWER_RETRY`]), as an answer lost in transit would.
    pub lose_commit_answers: AtomicU64,
}

/// When a commit whose answer [`Faults::lose_commit_answers`] dropped is
/// sent again.
pub const LOST_ANSWER_RETRY: std::time::Duration = std::time::Duration::from_secs(3);

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every link and peer of one device.
#[derive(Clone)]
pub struct GroupPeerManager {
    pub(super) shared: Arc<Shared>,
}

struct LinkSink(Weak<Shared>);

impl OutboxSink for LinkSink {
    fn publish(
        &self,
        hub: &str,
        p: Publish,
    ) -> BoxFuture<'static, Result<PublishOutcome, SendFailure>> {
        let shared = self.0.upgrade();
        let hub = hub.to_string();
        Box::pin(async move {
            let Some(shared) = shared else {
                return Err(SendFailure::Retry {
                    reason: "device stopped".into(),
                    after: None,
                });
            };
            if shared.faults.blackhole_outbox.load(Ordering::Relaxed) {
                return Err(SendFailure::Retry {
                    reason: "blackholed (test fault)".into(),
                    after: None,
                });
            }
            let me = GroupPeerManager { shared };
            // Never bring a link back for a hub no group uses any more: what
            // is still owed there cannot be delivered to anyone who reads it.
            let existing = lock(&me.shared.links).get(&hub).cloned();
            let link = match existing {
                Some(l) => l,
                None if me.hub_in_use(&hub) => me.hub_link(&hub),
                None => {
                    return Err(SendFailure::Refused(crate::wire::HubError::Internal {
                        reason: format!("{hub} is no longer used by any group of this device"),
                    }))
                }
            };
            link.publish(p).await.map_err(send_failure)
        })
    }
}

/// Whether a link error is worth retrying (the outbox's and the commit
/// lane's one classification).
pub(crate) fn send_failure(e: LinkError) -> SendFailure {
    match e {
        LinkError::Client(c) => SendFailure::from_client_error(c),
        other => SendFailure::Retry {
            reason: other.to_string(),
            after: None,
        },
    }
}

pub(super) fn hub_error(url: &str, e: impl std::fmt::Display) -> DeviceError {
    DeviceError::Hub {
        url: url.to_string(),
        reason: e.to_string(),
    }
}

impl GroupPeerManager {
    /// A manager for `identity` over its registry and records. Nothing
    /// connects until [`GroupPeerManager::start`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        identity: DeviceIdentity,
        registry: Registry,
        records: Records,
        outbox: Outbox,
        directory: HubDirectory,
        connector: Arc<dyn Connector>,
        config: ManagerConfig,
        rng: SharedRng,
        clock: Clock,
    ) -> Self {
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let loopback_url = super::loopback::loopback_url(&identity.id());
        Self {
            shared: Arc::new(Shared {
                clock,
                hlc: HlcClock::new(),
                lanes: Mutex::new(BTreeMap::new()),
                former_checked: Mutex::new(BTreeMap::new()),
                sends_unpruned: Mutex::new(BTreeMap::new()),
                loopback_url,
                identity,
                registry,
                inbox: Inbox::new(records.kv().clone(), config.inbox),
                gathers: Mutex::new(BTreeMap::new()),
                rejoins: Mutex::new(BTreeMap::new()),
                answering: Mutex::new(BTreeMap::new()),
                probing: Mutex::new(BTreeMap::new()),
                resending: Mutex::new(std::collections::BTreeSet::new()),
                healing: Mutex::new(std::collections::BTreeSet::new()),
                control_tasks: AtomicU64::new(0),
                records,
                outbox,
                directory,
                connector,
                config,
                rng,
                links: Mutex::new(BTreeMap::new()),
                peers: Mutex::new(BTreeMap::new()),
                topics: Mutex::new(BTreeMap::new()),
                events,
                own_hubs: Mutex::new(Vec::new()),
                stocked: watch::Sender::new(BTreeMap::new()),
                counters: Counters::default(),
                shutdown: CancellationToken::new(),
                tasks: TaskTracker::new(),
                tunnels: Default::default(),
                links_up: watch::Sender::new(0),
                presence: Mutex::new(Default::default()),
                presence_sent: Mutex::new(BTreeMap::new()),
                faults: Faults::default(),
            }),
        }
    }

    /// Bring up links to `hubs` (the device's own hubs, where it keeps key
    /// packages and hears Welcomes), the outbox, and a peer for each binding
    /// of each joined group.
    ///
    /// # Errors
    /// The store's error reading the group records.
    pub async fn start(&self, hubs: &[String]) -> Result<(), DeviceError> {
        let sink: Arc<dyn OutboxSink> = Arc::new(LinkSink(Arc::downgrade(&self.shared)));
        let outbox = self.shared.outbox.clone();
        let stop = self.shared.shutdown.clone();
        self.shared
            .tasks
            .spawn(async move { outbox.run(sink, stop).await });
        for hub in hubs {
            lock(&self.shared.own_hubs).push(hub.trim_end_matches('/').to_string());
            self.hub_link(hub);
        }
        for rec in self.shared.records.groups()? {
            self.add_group(rec.id).await?;
            if rec.stranded {
                self.heal_in_background(rec.id);
            } else if rec.probe_owed {
                self.probe_in_background(rec.id);
            }
        }
        Ok(())
    }

    /// A new subscription to the device's events: every event from now on
    /// (see [`EventStream`]).
    pub fn events(&self) -> EventStream {
        EventStream::new(self.shared.events.subscribe())
    }

    pub(super) fn emit(&self, e: Event) {
        if let Some(o) = &self.shared.config.observer {
            (o.0)(&e);
        }
        self.tunnels_follow(&e);
        let _ = self.shared.events.send(e);
    }

    /// Counters.
    pub fn stats(&self) -> DeviceStats {
        let c = &self.shared.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceStats {
            delivered: r(&c.delivered),
            duplicates: r(&c.duplicates),
            dropped: r(&c.dropped),
            poison: r(&c.poison),
            commits: r(&c.commits),
            lost_races: r(&c.lost_races),
            inbox_trimmed: r(&c.inbox_trimmed),
            control_failures: r(&c.control_failures),
            key_packages_replaced: r(&c.key_packages_replaced),
            pull_failures: r(&c.pull_failures),
            receive_failures: r(&c.receive_failures),
            subscriptions_refused: r(&c.subscriptions_refused),
            reinvites_asked: r(&c.reinvites_asked),
            reinvites_answered: r(&c.reinvites_answered),
            reinvites_refused: r(&c.reinvites_refused),
            frames_missed_notices: r(&c.frames_missed_notices),
            outbox_owed: self.shared.outbox.owed(),
        }
    }

    /// Test-only fault switches.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// The outbox of this device.
    pub fn outbox(&self) -> &Outbox {
        &self.shared.outbox
    }

    /// The device's view of its hubs.
    pub fn directory(&self) -> &HubDirectory {
        &self.shared.directory
    }

    /// The shared link for `url`, created (and connecting) on first use.
    /// [`LOOPBACK_HUB`] names this device's own loopback hub.
    pub fn hub_link(&self, url: &str) -> HubLink {
        let url = if url == LOOPBACK_HUB {
            self.shared.loopback_url.clone()
        } else {
            url.trim_end_matches('/').to_string()
        };
        let mut links = lock(&self.shared.links);
        if let Some(l) = links.get(&url) {
            return l.clone();
        }
        let link = HubLink::start(
            &url,
            self.shared.identity.signing_key().clone(),
            self.shared.connector.clone(),
            self.shared.config.link.clone(),
            self.shared.rng.fork(),
        );
        links.insert(url.clone(), link.clone());
        drop(links);
        self.shared.directory.track(&link);
        self.spawn_link_duties(link.clone());
        link
    }

    /// Until the device stops, hand `count` how many entries a link's topic
    /// log (`rx`) gained each time it changes (those no longer kept too),
    /// and `each` every new entry still kept.
    fn follow_topic_log(
        &self,
        mut rx: watch::Receiver<super::link::RefusalLog>,
        count: impl Fn(&Self, u64) + Send + 'static,
        each: impl Fn(&Self, &TopicId, &HubError) + Send + 'static,
    ) {
        let me = self.clone();
        let stop = self.shared.shutdown.clone();
        self.shared.tasks.spawn(async move {
            let mut seen = 0u64;
            loop {
                let log = rx.borrow_and_update().clone();
                let new = log.total.saturating_sub(seen);
                seen = log.total;
                count(&me, new);
                // Those older than the kept ones are counted only.
                let kept = usize::try_from(new)
                    .unwrap_or(usize::MAX)
                    .min(log.recent.len());
                for (topic, error) in log.recent.iter().skip(log.recent.len() - kept) {
                    each(&me, topic, error);
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    r = rx.changed() => if r.is_err() { break },
                }
            }
        });
    }

    /// The group whose peers read `topic` (its commit, app or rendezvous
    /// topic), if any.
    fn group_of_topic(&self, topic: &TopicId) -> Option<GroupId> {
        lock(&self.shared.topics).iter().find_map(|(g, t)| {
            let t = t.borrow();
            (t.commit == *topic || t.app.contains(topic) || t.rendezvous.as_ref() == Some(topic))
                .then_some(*g)
        })
    }

    /// Device-wide duties on a new link: report its status, hear Welcomes
    /// addressed to this device, keep key packages stocked.
    fn spawn_link_duties(&self, link: HubLink) {
        let me = self.clone();
        let stop = self.shared.shutdown.clone();
        let mut status = link.status();
        let l = link.clone();
        let restock = Arc::new(tokio::sync::Notify::new());
        let restock_rx = restock.clone();
        self.shared.tasks.spawn(async move {
            // Restock on every connection, when a Welcome shows a package
            // was claimed, and on a timer: claims by others are not seen
            // otherwise, and a pool drained between connections would leave
            // the device uninvitable.
            let mut tick = tokio::time::interval(RESTOCK_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.reset();
            let mut announce = true;
            loop {
                let s = status.borrow_and_update().clone();
                if announce {
                    me.emit(Event::HubStatus {
                        url: l.url().to_string(),
                        status: s.clone(),
                    });
                }
                // Nobody can claim a key package on our own loopback hub.
                if s == super::link::LinkStatus::Connected && !super::loopback::is_loopback(l.url())
                {
                    let r = me.restock_key_packages(&l).await;
                    if let Err(e) = &r {
                        tracing::warn!(hub = l.url(), error = %e, "key package restock failed");
                    }
                    let url = l.url().to_string();
                    me.shared.stocked.send_modify(|m| {
                        m.insert(url, r.map_err(|e| e.to_string()));
                    });
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    r = status.changed() => { if r.is_err() { break } announce = true; }
                    _ = tick.tick() => announce = false,
                    _ = restock_rx.notified() => announce = false,
                }
            }
        });
        // A subscription the hub refused reaches the app as an event (and a
        // counter), not only the log.
        let url = link.url().to_string();
        self.follow_topic_log(
            link.refused_subscriptions(),
            |me, new| {
                me.shared
                    .counters
                    .subscriptions_refused
                    .fetch_add(new, Ordering::Relaxed);
            },
            move |me, topic, error| {
                me.emit(Event::SubscriptionRefused {
                    hub: url.clone(),
                    group: me.group_of_topic(topic),
                    topic: topic.clone(),
                    error: error.clone(),
                });
            },
        );
        // So do app frames a hub trimmed before its stream pushed them: the
        // pushes after them move the group's cursor there past them.
        let url = link.url().to_string();
        self.follow_topic_log(
            link.frames_missed(),
            |me, new| {
                me.shared
                    .counters
                    .frames_missed_notices
                    .fetch_add(new, Ordering::Relaxed);
            },
            move |me, topic, error| {
                let HubError::FramesMissed {
                    after_seq,
                    through_seq,
                    ..
                } = error
                else {
                    return;
                };
                let group = lock(&me.shared.topics)
                    .iter()
                    .find_map(|(g, t)| t.borrow().app.contains(topic).then_some(*g));
                if let Some(group) = group {
                    tracing::warn!(%group, hub = url, "app frames trimmed before they were pushed");
                    me.emit(Event::AppFramesMissed {
                        group,
                        hub: url.clone(),
                        missed: through_seq.saturating_sub(*after_seq),
                    });
                }
            },
        );
        let me = self.clone();
        let stop = self.shared.shutdown.clone();
        let mut store_id = link.store_id();
        let url = link.url().to_string();
        self.shared.tasks.spawn(async move {
            loop {
                let id = *store_id.borrow_and_update();
                if let Some(id) = id {
                    if let Err(e) = me.note_store_id(&url, id).await {
                        tracing::warn!(hub = %url, error = %e, "could not record the hub's store identity");
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    r = store_id.changed() => if r.is_err() { break },
                }
            }
        });
        // After a reconnect, read every group's log there once: the hub
        // pushes only frames after the cursors it holds, and a hub restored
        // from an older copy (same identity) holds cursors and logs from
        // before; reading the logs is how the device sees that they went
        // back (its heads against the hub's), not only when a new frame
        // happens to be pushed.
        let me = self.clone();
        let stop = self.shared.shutdown.clone();
        let mut status = link.status();
        let url = link.url().to_string();
        self.shared.tasks.spawn(async move {
            let mut was_up = false;
            loop {
                let up = matches!(*status.borrow_and_update(), LinkStatus::Connected);
                if up && !was_up {
                    me.pull_groups_on(&url);
                    me.shared.links_up.send_modify(|n| *n += 1);
                }
                was_up = up;
                tokio::select! {
                    _ = stop.cancelled() => break,
                    r = status.changed() => if r.is_err() { break },
                }
            }
        });
        let me = self.clone();
        let stop = self.shared.shutdown.clone();
        let topic = topics::welcome_topic(&self.shared.identity.id());
        let mut rx = link.subscribe(topic, None);
        self.shared.tasks.spawn(async move {
            loop {
                let d = tokio::select! {
                    _ = stop.cancelled() => break,
                    d = rx.recv() => match d { Some(d) => d, None => break },
                };
                if super::tunnel::handshake::Handshake::is_one(&d.payload) {
                    let frame = d.frame_ref();
                    me.on_tunnel_handshake(link.url(), &d.payload);
                    link.ack(vec![frame]).await;
                    continue;
                }
                if super::frames::ReinviteRequest::is_one(&d.payload) {
                    let frame = d.frame_ref();
                    me.answer_reinvite_in_background(d.payload);
                    link.ack(vec![frame]).await;
                    continue;
                }
                match me.accept_welcome(&d.payload).await {
                    Ok(()) => {
                        link.ack(vec![d.frame_ref()]).await;
                        restock.notify_one();
                    }
                    // accept_welcome asked the inviter to invite it again.
                    Err(DeviceError::KeyPackageGone { group, .. }) => {
                        me.emit(Event::WelcomeRefused {
                            group: Some(group),
                            reason: "the Welcome names a key package this device no longer holds; \
                                     asked the inviter to invite it again"
                                .into(),
                        });
                        link.ack(vec![d.frame_ref()]).await;
                    }
                    // A store failure may pass: leave it unacked so the hub
                    // delivers it again.
                    Err(e @ DeviceError::Store(_)) => {
                        tracing::warn!(error = %e, "welcome not handled; will be redelivered");
                    }
                    Err(e) => {
                        // A refused Welcome will never become acceptable.
                        tracing::warn!(error = %e, "welcome refused");
                        me.emit(Event::WelcomeRefused {
                            group: WelcomeEnvelope::open(&d.payload).ok().map(|w| w.group),
                            reason: e.to_string(),
                        });
                        link.ack(vec![d.frame_ref()]).await;
                    }
                }
            }
        });
    }

    /// Pull, each on a task of its own, every group that reads a log on
    /// `url` (bound there, or holding a cursor there), and say in each
    /// group bound there that this device is live on it
    /// ([`super::presence`]).
    fn pull_groups_on(&self, url: &str) {
        let names: Vec<&str> = if url == self.shared.loopback_url {
            vec![url, LOOPBACK_HUB]
        } else {
            vec![url]
        };
        let groups = match self.shared.records.groups() {
            Ok(g) => g,
            Err(e) => {
                self.shared
                    .counters
                    .pull_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(hub = url, error = %e, "reading groups after a reconnect failed");
                return;
            }
        };
        for rec in groups {
            let here = names
                .iter()
                .any(|n| rec.cursors.contains_key(*n) || rec.hubs.iter().any(|h| h == n));
            if !here {
                continue;
            }
            let me = self.clone();
            let group = rec.id;
            let bound = url != self.shared.loopback_url && rec.hubs.iter().any(|h| h == url);
            let url = url.to_string();
            self.shared.tasks.spawn(async move {
                if let Err(e) = me.pull(group).await {
                    tracing::debug!(%group, error = %e, "pull after a reconnect failed; the periodic pull tries again");
                }
                if bound {
                    if let Err(e) = me.announce_live(group, &url).await {
                        me.shared.counters.control_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%group, hub = url, error = %e, "presence beacon not posted");
                    }
                }
            });
        }
    }

    /// A connection to `url` reported the hub's store identity. A new
    /// identity where another was known means the hub lost its store: every
    /// group read there is read again from the start (and never
    /// compared-and-set against what the new store holds below our cursor).
    async fn note_store_id(&self, url: &str, id: crate::wire::StoreId) -> Result<(), DeviceError> {
        let known = self.shared.records.hub_store_id(url)?;
        if known == Some(id) {
            return Ok(());
        }
        if known.is_some() {
            // Groups name the loopback hub by its sentinel.
            let names: Vec<&str> = if url == self.shared.loopback_url {
                vec![url, LOOPBACK_HUB]
            } else {
                vec![url]
            };
            let mut told = false;
            let mut former = Vec::new();
            for rec in self.shared.records.groups()? {
                for name in &names {
                    if rec.cursors.contains_key(*name) || rec.hubs.iter().any(|h| h == name) {
                        self.rewound(rec.id, name)
                            .await
                            .map_err(|e| DeviceError::Store(e.to_string()))?;
                        told = true;
                        if rec.commit_hub != *name {
                            former.push(rec.id);
                        }
                    }
                }
            }
            // A former commit log there may have lost the commit that moved
            // the group away; a member that has not read it learns of the
            // move from that log only. The pull gives the current log back
            // what it lost; give former logs theirs now, not at the next
            // check, which waits for a caught-up pull.
            for group in former {
                lock(&self.shared.former_checked).remove(&group);
                let me = self.clone();
                self.shared.tasks.spawn(async move {
                    if let Err(e) = me.check_former_logs(group).await {
                        tracing::debug!(%group, error = %e, "giving a rewound former commit log back its commits failed; checked again later");
                    }
                });
            }
            if !told {
                self.emit(Event::HubRewound {
                    url: url.to_string(),
                });
            }
        }
        let mut b = crate::kv::WriteBatch::new();
        self.shared.records.put_hub_store_id(&mut b, url, id);
        let kv = self.shared.registry.provider().kv();
        kv.apply(&b)?;
        kv.flush()?;
        if known.is_some() {
            // The key packages we kept there are gone with the store.
            let link = self.hub_link(url);
            if let Err(e) = self.restock_key_packages(&link).await {
                tracing::warn!(hub = url, error = %e, "restock on a new hub store failed");
            }
        }
        Ok(())
    }

    /// Mark a group joined and create a peer for each hub it travels.
    ///
    /// # Errors
    /// `UnknownGroup` when no record exists.
    pub async fn add_group(&self, group: GroupId) -> Result<(), DeviceError> {
        let rec = self.record(group)?;
        {
            let mut t = lock(&self.shared.topics);
            match t.get(&group) {
                Some(tx) => {
                    tx.send_replace(GroupTopics::of(&rec));
                }
                None => {
                    t.insert(group, watch::Sender::new(GroupTopics::of(&rec)));
                }
            }
        }
        self.sync_peers(&rec);
        Ok(())
    }

    /// Dispose every peer of a group and what this device keeps in memory
    /// about it (topics, checks, presence).
    pub async fn remove_group(&self, group: GroupId) {
        let peers: Vec<GroupPeer> = {
            let mut p = lock(&self.shared.peers);
            let keys: Vec<_> = p.keys().filter(|(g, _)| *g == group).cloned().collect();
            keys.into_iter().filter_map(|k| p.remove(&k)).collect()
        };
        for peer in peers {
            peer.cancel.cancel();
        }
        lock(&self.shared.topics).remove(&group);
        lock(&self.shared.former_checked).remove(&group);
        lock(&self.shared.sends_unpruned).remove(&group);
        // Who was live in a group this device left says nothing any more.
        lock(&self.shared.presence).forget(group);
        lock(&self.shared.presence_sent).retain(|(g, _), _| *g != group);
    }

    /// Make the group's peers follow the hubs its ledger binds (or its
    /// loopback hub when none is bound): a peer for each new hub, none for
    /// a hub unbound, and a link dropped when nothing uses it any more.
    pub(super) fn sync_peers(&self, rec: &GroupRecord) {
        self.publish_topics(rec);
        let wanted = rec.routes();
        let gone: Vec<GroupPeer> = {
            let mut p = lock(&self.shared.peers);
            let keys: Vec<_> = p
                .keys()
                .filter(|(g, h)| *g == rec.id && !wanted.contains(h))
                .cloned()
                .collect();
            keys.into_iter().filter_map(|k| p.remove(&k)).collect()
        };
        for peer in gone {
            peer.cancel.cancel();
            let me = self.clone();
            self.shared
                .tasks
                .spawn(async move { me.gc_link(&peer.hub).await });
        }
        for hub in &wanted {
            self.add_binding_peer(rec.id, hub);
        }
    }

    /// Whether a hub is still used: by a peer, or as one of the device's
    /// own hubs.
    pub(super) fn hub_in_use(&self, hub: &str) -> bool {
        lock(&self.shared.peers).keys().any(|(_, h)| h == hub)
            || lock(&self.shared.own_hubs).iter().any(|h| h == hub)
    }

    /// Stop and drop a link that no peer uses, unless it is one of the
    /// device's own hubs (those stay for Welcomes and key packages).
    async fn gc_link(&self, hub: &str) {
        let used = lock(&self.shared.peers).keys().any(|(_, h)| h == hub)
            || lock(&self.shared.own_hubs).iter().any(|h| h == hub);
        if used {
            return;
        }
        let link = lock(&self.shared.links).remove(hub);
        if let Some(l) = link {
            l.stop().await;
        }
    }

    fn add_binding_peer(&self, group: GroupId, hub: &str) {
        let key = (group, hub.to_string());
        if lock(&self.shared.peers).contains_key(&key) {
            return;
        }
        let Some(topics_rx) = lock(&self.shared.topics).get(&group).map(|t| t.subscribe()) else {
            return;
        };
        let link = self.hub_link(hub);
        let cancel = self.shared.shutdown.child_token();
        let recatch = Arc::new(tokio::sync::Notify::new());
        let peer = GroupPeer {
            group,
            hub: hub.to_string(),
            link: link.clone(),
            cancel: cancel.clone(),
            recatch: recatch.clone(),
        };
        lock(&self.shared.peers).insert(key, peer);
        let me = self.clone();
        let hub = hub.to_string();
        self.shared.tasks.spawn(async move {
            me.run_peer(group, hub, link, topics_rx, cancel, recatch)
                .await
        });
    }

    /// The peer for one (group, hub), if it exists.
    pub fn peer(&self, group: GroupId, hub: &str) -> Option<GroupPeer> {
        lock(&self.shared.peers)
            .get(&(group, hub.trim_end_matches('/').to_string()))
            .cloned()
    }

    /// The peer of the group's canonical commit hub, the one hub its
    /// commits go through: the hub its ledger names with `hub.commit`; with
    /// none, the bound hub whose URL sorts first; with no hub bound, the
    /// loopback peer. Every member computes the same hub (see
    /// [`select_commit_hub`](super::lane::select_commit_hub)). `None` only
    /// while the peer is not up yet.
    ///
    /// # Errors
    /// `UnknownGroup`.
    pub fn select_commit_peer(&self, group: GroupId) -> Result<Option<GroupPeer>, DeviceError> {
        let rec = self.record(group)?;
        Ok(self.peer(group, &rec.commit_hub))
    }

    /// Hubs this device has links to.
    pub fn hubs(&self) -> Vec<String> {
        let links = lock(&self.shared.links);
        let set: BTreeSet<String> = links.keys().cloned().collect();
        set.into_iter().collect()
    }

    /// Try every hub now rather than when its backoff says, and answer
    /// whether any is connected afterwards (waiting up to `wait`).
    pub async fn retry_hubs(&self, wait: Duration) -> bool {
        let links: Vec<HubLink> = lock(&self.shared.links).values().cloned().collect();
        for l in &links {
            l.retry_now();
        }
        let waits = links.iter().map(|l| l.wait_connected(wait));
        futures::future::join_all(waits)
            .await
            .into_iter()
            .any(|c| c)
    }

    /// Publish a new app-topic set to a group's peers.
    pub(super) fn publish_topics(&self, rec: &GroupRecord) {
        if let Some(tx) = lock(&self.shared.topics).get(&rec.id) {
            tx.send_if_modified(|t| {
                let new = GroupTopics::of(rec);
                if *t == new {
                    false
                } else {
                    *t = new;
                    true
                }
            });
        }
    }

    /// Dispose every peer and link and wait for every task.
    pub async fn stop(&self) {
        let first = !self.shared.shutdown.is_cancelled();
        self.shared.shutdown.cancel();
        if first {
            // After the cancel: no `Live` goes out after the `Away`.
            self.announce_away().await;
        }
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
        let links: Vec<HubLink> = std::mem::take(&mut *lock(&self.shared.links))
            .into_values()
            .collect();
        for l in links {
            l.stop().await;
        }
        self.shared.directory.stop().await;
        lock(&self.shared.peers).clear();
        lock(&self.shared.topics).clear();
    }

    /// Accept a Welcome envelope addressed to this device: join the group,
    /// record its hubs, and start its peers. A Welcome for a group already
    /// joined is ignored (Welcomes are delivered at least once).
    ///
    /// A Welcome naming a key package this device no longer holds answers
    /// `KeyPackageGone`, and the device has asked its inviter to invite it
    /// again (on a task of its own), whoever called: the mailbox's reader,
    /// or the join of Welcomes kept while the device still held the group.
    pub(super) async fn accept_welcome(&self, payload: &[u8]) -> Result<(), DeviceError> {
        let env = WelcomeEnvelope::open(payload).map_err(|e| DeviceError::Mls(e.to_string()))?;
        let joined = match self.join(&env).await {
            Err(DeviceError::KeyPackageGone {
                group,
                inviter,
                welcome_digest,
                hubs,
            }) => {
                self.ask_reinvite_in_background(group, inviter, welcome_digest, hubs.clone());
                return Err(DeviceError::KeyPackageGone {
                    group,
                    inviter,
                    welcome_digest,
                    hubs,
                });
            }
            r => r?,
        };
        if joined {
            self.add_group(env.group).await?;
            self.probe_in_background(env.group);
        }
        Ok(())
    }

    pub(super) fn next_message_id(&self) -> [u8; 16] {
        let mut id = [0u8; 16];
        self.shared.rng.fill(&mut id);
        id
    }

    /// Wait until this device can be invited: its key packages are stocked
    /// on every hub of its own (each restocks on connecting; a pool that
    /// others drain is restocked later, so this says "was stocked", not
    /// "holds one now").
    ///
    /// # Errors
    /// `NotReady` at `within`, naming each hub still missing and why (the
    /// last restock failure, or that it was not reached); `Stopped`.
    pub async fn ready_for_invites(&self, within: Duration) -> Result<(), DeviceError> {
        let hubs: Vec<String> = lock(&self.shared.own_hubs)
            .iter()
            .filter(|h| !super::loopback::is_loopback(h))
            .cloned()
            .collect();
        if hubs.is_empty() {
            return Err(DeviceError::NotReady {
                missing: vec![(
                    String::new(),
                    "the device has no hub of its own to keep key packages on".into(),
                )],
            });
        }
        let mut rx = self.shared.stocked.subscribe();
        let until = tokio::time::Instant::now() + within;
        loop {
            let missing: Vec<(String, String)> = {
                let stocked = rx.borrow_and_update();
                hubs.iter()
                    .filter_map(|h| match stocked.get(h) {
                        Some(Ok(())) => None,
                        Some(Err(e)) => Some((h.clone(), e.clone())),
                        None => Some((h.clone(), "not reached yet".to_string())),
                    })
                    .collect()
            };
            if missing.is_empty() {
                return Ok(());
            }
            match tokio::time::timeout_at(until, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(DeviceError::Stopped),
                Err(_) => return Err(DeviceError::NotReady { missing }),
            }
        }
    }

    /// Keep `pool` key packages on the hub behind `link`, plus a last resort.
    pub(super) async fn restock_key_packages(&self, link: &HubLink) -> Result<(), DeviceError> {
        // A Welcome goes to a mailbox, which only reaches current
        // subscribers: be subscribed before anyone can claim a package.
        link.flush_subscriptions()
            .await
            .map_err(|e| hub_error(link.url(), e))?;
        let (_, has_last) = link
            .key_package_status()
            .await
            .map_err(|e| hub_error(link.url(), e))?;
        let want = self.shared.config.key_packages;
        let records = &self.shared.records;
        let hub = link.url();
        let on_hub = link
            .list_key_packages()
            .await
            .map_err(|e| hub_error(hub, e))?;
        // Of those uploaded here, the ones still on the hub whose private
        // keys this device still holds (a Welcome that used one deleted it).
        let storage = self.shared.registry.provider().storage();
        let mut live = Vec::new();
        for u in records.uploaded_key_packages(hub)? {
            let held = storage
                .key_package::<KeyPackageRef, KeyPackageBundle>(&u.r)
                .map_err(|e| DeviceError::Store(e.to_string()))?
                .is_some();
            if held && on_hub.contains(&u.digest) {
                live.push(u);
            }
        }
        let uploaded = |refs: Vec<KeyPackageRef>, packages: &[Vec<u8>]| {
            refs.into_iter()
                .zip(packages)
                .map(|(r, p)| UploadedKeyPackage {
                    r,
                    digest: sha2::Sha256::digest(p).into(),
                })
                .collect::<Vec<_>>()
        };
        if on_hub.len() > live.len() {
            // The hub holds packages this device has no keys for (a hub
            // restored from a backup brings back packages claimed and used
            // since): a Welcome built on one could never be read, and its
            // member would never join. Replace the whole pool.
            let (packages, refs, last) = self.make_key_packages(want as usize, !has_last)?;
            let new = uploaded(refs, &packages);
            let mut b = crate::kv::WriteBatch::new();
            records.put_uploaded_key_packages(&mut b, hub, &new);
            records.kv().apply(&b)?;
            // Durable before the hub holds them: a Welcome built on a
            // package whose keys a power cut took could never be read.
            records.kv().flush()?;
            link.replace_key_packages(packages, last)
                .await
                .map_err(|e| hub_error(hub, e))?;
            tracing::warn!(
                hub,
                held = on_hub.len(),
                live = live.len(),
                "the hub held key packages this device has no keys for; replaced its pool"
            );
            self.shared
                .counters
                .key_packages_replaced
                .fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let pool = on_hub.len() as u32;
        if pool >= want && has_last {
            return Ok(());
        }
        let n = want.saturating_sub(pool) as usize;
        let (packages, refs, last) = self.make_key_packages(n, !has_last)?;
        // Recorded before the upload: a package on the hub this device does
        // not know of would look like one it has no keys for.
        live.extend(uploaded(refs, &packages));
        let mut b = crate::kv::WriteBatch::new();
        records.put_uploaded_key_packages(&mut b, hub, &live);
        records.kv().apply(&b)?;
        // The packages' keys (in the same store) and this list are durable
        // before the hub hands the packages out.
        records.kv().flush()?;
        link.upload_key_packages(packages, last)
            .await
            .map_err(|e| hub_error(hub, e))?;
        Ok(())
    }
}
