//! The `Device` facade: what an app links.
//!
//! ```no_run
//! # async fn demo() -> Result<(), hubsync::device::DeviceError> {
//! use hubsync::device::{Device, DeviceOptions};
//! let hubs = vec!["ws://127.0.0.1:7400".to_string()];
//! let alice = Device::open("alice-data".as_ref(), DeviceOptions::new(hubs.clone())).await?;
//! let group = alice.create_group(&hubs).await?;
//! alice.send(group, b"hello").await?;
//! # Ok(()) }
//! ```

use super::control::{LeaveOutcome, Settings};
use super::directory::HubDirectory;
use super::error::DeviceError;
use super::events::EventStream;
use super::gather::{LedgerCatchupSummary, PolicyCatchupSummary};
use super::identity::DeviceIdentity;
use super::inbox::{InboxMessage, InboxStatus};
use super::lane::{CommitError, LaneResult};
use super::ledger::{Entry, LedgerState};
use super::loopback::{LoopbackHub, RoutingConnector};
use super::manager::{DeviceStats, GroupPeerManager, ManagerConfig};
use super::outbox::{Outbox, OutboxConfig};
use super::provider::DeviceProvider;
use super::records::{GroupId, Records};
use super::registry::Registry;
use super::rejoin::RejoinResult;
use crate::clock::Clock;
use crate::kv::{KvStore, SledKv};
use crate::rng::SharedRng;
use crate::transport::{Connector, NetConnector};
use crate::wire::DeviceId;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How a device is opened.
#[derive(Clone)]
pub struct DeviceOptions {
    /// The device's own hubs: it keeps key packages there and hears
    /// Welcomes there. Groups may bind other hubs too.
    pub hubs: Vec<String>,
    /// How hubs are reached. [`DeviceOptions::new`] gives a
    /// [`NetConnector`]: `wss://` over TLS trusting the webpki roots, plain
    /// `ws://` to loopback only. To trust a private CA or allow plain
    /// `ws://`, set `NetConnector::new(TlsConfig { .. })`; simulations set
    /// their own.
    pub connector: Arc<dyn Connector>,
    /// Links, peers and the commit lane.
    pub manager: ManagerConfig,
    /// The durable outbox.
    pub outbox: OutboxConfig,
    /// Wall-clock source.
    pub clock: Clock,
    /// The engine's randomness; `None` seeds from the operating system.
    pub rng: Option<SharedRng>,
    /// Seed of the MLS randomness: simulations only, never production.
    pub mls_seed: Option<u64>,
    /// How long the hub directory's answers count as fresh.
    pub directory_ttl: Duration,
}

impl DeviceOptions {
    /// Production defaults for a device whose own hubs are `hubs`.
    pub fn new(hubs: Vec<String>) -> Self {
        Self {
            hubs,
            connector: Arc::new(NetConnector::default()),
            manager: ManagerConfig::default(),
            outbox: OutboxConfig::default(),
            clock: Clock::System,
            rng: None,
            mls_seed: None,
            directory_ttl: Duration::from_secs(60),
        }
    }
}

/// One device: its identity, its groups, its hub connections.
pub struct Device {
    id: DeviceId,
    manager: GroupPeerManager,
    loopback: LoopbackHub,
}

impl Drop for Device {
    fn drop(&mut self) {
        // Without `close()`, at least stop every task so nothing keeps
        // running (and holding the store) for a device nobody has.
        self.manager.shared.shutdown.cancel();
    }
}

impl Device {
    /// Open (or create) the device whose state lives in `dir` (one sled
    /// database), and start its hub links and peers.
    ///
    /// # Errors
    /// `Store` when the directory cannot be opened (for example another
    /// process holds it: a device closed a moment ago in this process is
    /// waited for, up to five seconds, while sled lets go of its lock).
    pub async fn open(dir: &Path, options: DeviceOptions) -> Result<Device, DeviceError> {
        let path = dir.to_path_buf();
        let opened = tokio::task::spawn_blocking(move || {
            SledKv::open_waiting(&path, std::time::Duration::from_secs(5))
        })
        .await
        .map_err(|e| DeviceError::Store(e.to_string()))?;
        let kv: Arc<dyn KvStore> = Arc::new(opened?);
        Self::open_store(kv, options).await
    }

    /// Open the device over any store (the simulation's crash-semantics
    /// store, or sled).
    ///
    /// # Errors
    /// `Store` when the store cannot be read.
    pub async fn open_store(
        kv: Arc<dyn KvStore>,
        options: DeviceOptions,
    ) -> Result<Device, DeviceError> {
        let rng = options.rng.clone().unwrap_or_else(SharedRng::from_entropy);
        let mut id_rng = rng.fork();
        let identity = DeviceIdentity::load_or_create(&*kv, &mut id_rng)
            .map_err(|e| DeviceError::Store(e.to_string()))?;
        let provider = Arc::new(match options.mls_seed {
            Some(seed) => DeviceProvider::seeded(kv.clone(), seed),
            None => DeviceProvider::new(kv.clone()),
        });
        let outbox = Outbox::open(
            kv.clone(),
            options.clock.clone(),
            rng.fork(),
            options.outbox.clone(),
        )
        .map_err(|e| DeviceError::Store(e.to_string()))?;
        let directory =
            HubDirectory::open(kv.clone(), options.clock.clone(), options.directory_ttl)
                .map_err(|e| DeviceError::Store(e.to_string()))?;
        let id = identity.id();
        // The in-process hub a group with no hub bound commits through, on
        // this device's own store.
        let loopback = LoopbackHub::start(kv.clone(), id, options.clock.clone(), rng.fork())
            .await
            .map_err(|e| DeviceError::Store(e.to_string()))?;
        let connector: Arc<dyn Connector> = Arc::new(RoutingConnector::new(
            options.connector.clone(),
            loopback.url(),
            loopback.connector(),
        ));
        let manager = GroupPeerManager::new(
            identity,
            Registry::new(provider),
            Records::new(kv),
            outbox,
            directory,
            connector,
            options.manager.clone(),
            rng,
            options.clock.clone(),
        );
        manager.start(&options.hubs).await?;
        Ok(Device {
            id,
            manager,
            loopback,
        })
    }

    /// This device's id (its ed25519 public key).
    pub fn id(&self) -> DeviceId {
        self.id
    }

    /// Create a group bound to `hubs` (the first is its commit hub), with
    /// this device its first member and admin. With no hub, the group
    /// commits through this device's loopback hub until one is bound.
    ///
    /// # Errors
    /// MLS or store errors.
    pub async fn create_group(&self, hubs: &[String]) -> Result<GroupId, DeviceError> {
        self.manager.create_group(hubs).await
    }

    /// Invite a device into a group (admins only); it joins once it hears
    /// the Welcome.
    ///
    /// # Errors
    /// See [`GroupPeerManager::invite`].
    pub async fn invite(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.invite(group, device))
            .await
    }

    /// Invite several devices into a group in one commit (admins only);
    /// all or nothing.
    ///
    /// # Errors
    /// See [`GroupPeerManager::invite_many`].
    pub async fn invite_many(
        &self,
        group: GroupId,
        devices: &[DeviceId],
    ) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.invite_many(group, devices))
            .await
    }

    /// Remove a device from a group (admins only).
    ///
    /// # Errors
    /// See [`GroupPeerManager::remove`].
    pub async fn remove(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.remove(group, device))
            .await
    }

    /// Make a member an admin (admins only).
    ///
    /// # Errors
    /// See [`GroupPeerManager::grant_admin`].
    pub async fn grant_admin(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.grant_admin(group, device))
            .await
    }

    /// Take admin rights from a member, never from the last admin (admins
    /// only).
    ///
    /// # Errors
    /// See [`GroupPeerManager::revoke_admin`].
    pub async fn revoke_admin(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.revoke_admin(group, device))
            .await
    }

    /// Bind the group to another hub, for every member (admins only).
    ///
    /// # Errors
    /// See [`GroupPeerManager::bind_hub`].
    pub async fn bind_hub(&self, group: GroupId, url: &str) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.bind_hub(group, url))
            .await
    }

    /// Unbind the group from a hub that is not its commit hub, for every
    /// member (admins only).
    ///
    /// # Errors
    /// See [`GroupPeerManager::unbind_hub`].
    pub async fn unbind_hub(&self, group: GroupId, url: &str) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.unbind_hub(group, url))
            .await
    }

    /// Move every member's commits to a bound hub (admins only).
    ///
    /// # Errors
    /// See [`GroupPeerManager::set_commit_hub`].
    pub async fn set_commit_hub(
        &self,
        group: GroupId,
        url: &str,
    ) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.set_commit_hub(group, url))
            .await
    }

    /// Set a setting: `self.`-prefixed names are this device's own (any
    /// member), other names are group-wide (admins only).
    ///
    /// # Errors
    /// See [`GroupPeerManager::set_setting`].
    pub async fn set_setting(
        &self,
        group: GroupId,
        name: &str,
        value: &[u8],
    ) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.set_setting(group, name, value))
            .await
    }

    /// The group's settings.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn settings(&self, group: GroupId) -> Result<Settings, CommitError> {
        self.manager.settings(group)
    }

    /// The group's ledger, in enactment order.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn ledger(&self, group: GroupId) -> Result<Vec<Entry>, CommitError> {
        self.manager.ledger(group)
    }

    /// The group's ledger folded: admins, members, hubs, commit hub.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn ledger_view(&self, group: GroupId) -> Result<LedgerState, CommitError> {
        self.manager.ledger_view(group)
    }

    /// Send `body` to every member of the group; answers the message id and
    /// the epoch it was encrypted in.
    /// Durable once this returns: a hub outage only delays it.
    ///
    /// Backpressure: while the outbox owes its hubs
    /// [`OutboxConfig::max_owed`] publishes, this waits until they take
    /// some, so an app sending faster than its hubs accept is slowed to
    /// their pace and the device's memory and disk stay bounded. Use
    /// [`Device::try_send`] to be told instead.
    ///
    /// # Errors
    /// See [`GroupPeerManager::broadcast`].
    ///
    /// # Cancel safety
    /// Cancel safe while it waits for room (nothing is sent then).
    pub async fn send(&self, group: GroupId, body: &[u8]) -> Result<super::Sent, DeviceError> {
        self.manager.broadcast(group, body, true).await
    }

    /// As [`Device::send`], but when the outbox is full it answers
    /// [`DeviceError::OutboxFull`] at once, sending nothing.
    ///
    /// # Errors
    /// `OutboxFull`, and as [`Device::send`].
    pub async fn try_send(&self, group: GroupId, body: &[u8]) -> Result<super::Sent, DeviceError> {
        self.manager.broadcast(group, body, false).await
    }

    /// Update this device's keys in the group (a self-update commit).
    ///
    /// # Errors
    /// See [`GroupPeerManager::rotate`].
    pub async fn rotate_keys(&self, group: GroupId) -> Result<LaneResult, CommitError> {
        self.manager
            .commit_with_recovery(group, || self.manager.rotate(group))
            .await
    }

    /// The group's members.
    ///
    /// # Errors
    /// `UnknownGroup`.
    pub async fn members(&self, group: GroupId) -> Result<Vec<DeviceId>, DeviceError> {
        self.manager.members(group).await
    }

    /// The group's epoch.
    ///
    /// # Errors
    /// `UnknownGroup`.
    pub async fn epoch(&self, group: GroupId) -> Result<u64, DeviceError> {
        Ok(self.manager.epoch(group).await?.0)
    }

    /// The group's epoch authenticator: equal on two devices exactly when
    /// they agree on the epoch's state.
    ///
    /// # Errors
    /// `UnknownGroup`.
    pub async fn epoch_authenticator(&self, group: GroupId) -> Result<Vec<u8>, DeviceError> {
        Ok(self.manager.epoch(group).await?.1)
    }

    /// Groups this device is in.
    ///
    /// # Errors
    /// The store's error.
    pub fn groups(&self) -> Result<Vec<GroupId>, DeviceError> {
        Ok(self
            .manager
            .shared
            .records
            .groups()?
            .into_iter()
            .map(|r| r.id)
            .collect())
    }

    /// Up to `limit` messages of `group`'s durable inbox with positions
    /// above `after`, in order. Every delivered app message is here (with
    /// the position its [`Event::MessageReceived`] named) from before the
    /// hub delivery that carried it was acked, until it is marked processed
    /// ([`Device::mark_processed`]); after a restart, read from
    /// [`InboxStatus::processed`]. A group this device left or was removed
    /// from keeps its inbox.
    ///
    /// # Errors
    /// The store's error.
    pub fn messages(
        &self,
        group: GroupId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<InboxMessage>, DeviceError> {
        Ok(self.manager.shared.inbox.read(&group, after, limit)?)
    }

    /// Mark `group`'s inbox processed up to position `through` (at most its
    /// newest): those messages are deleted (past
    /// [`InboxConfig::keep_processed`](super::InboxConfig::keep_processed))
    /// and never offered again. Durable when it returns (it waits for one
    /// store flush). A mark never goes back. Answers the processed position
    /// now.
    ///
    /// # Errors
    /// The store's error; nothing was marked.
    pub fn mark_processed(&self, group: GroupId, through: u64) -> Result<u64, DeviceError> {
        Ok(self.manager.shared.inbox.mark_processed(&group, through)?)
    }

    /// Where `group`'s inbox stands: its newest position and what is
    /// marked processed.
    ///
    /// # Errors
    /// The store's error.
    pub fn inbox_status(&self, group: GroupId) -> Result<InboxStatus, DeviceError> {
        Ok(self.manager.shared.inbox.status(&group)?)
    }

    /// Ask the group's members for the whole ledger and install the first
    /// answer that reproduces the authenticated head, waiting at most
    /// `ManagerConfig::gather_deadline`. The group operations above do this
    /// on their own when they need it; this is for an app that wants
    /// control.
    ///
    /// # Errors
    /// See [`GroupPeerManager::request_ledger_catchup`].
    pub async fn request_ledger_catchup(
        &self,
        group: GroupId,
    ) -> Result<LedgerCatchupSummary, DeviceError> {
        let deadline = self.manager.shared.config.gather_deadline;
        self.manager.request_ledger_catchup(group, deadline).await
    }

    /// Bring this device's view of the group's settings up to what the
    /// group enacted (rejoining first when stranded, then reading the
    /// commit log, then gathering the ledger when it is incomplete, waiting
    /// at most `ManagerConfig::gather_deadline`); the summary says how many
    /// settings landed.
    ///
    /// # Errors
    /// See [`GroupPeerManager::request_policy_catchup`].
    pub async fn request_policy_catchup(
        &self,
        group: GroupId,
    ) -> Result<PolicyCatchupSummary, DeviceError> {
        let deadline = self.manager.shared.config.gather_deadline;
        self.manager.request_policy_catchup(group, deadline).await
    }

    /// Rejoin a group that moved on without this device (it is stranded:
    /// offline past the commit log's depth, or on the losing side of a
    /// fork) by external commit through a member's GroupInfo, then gather
    /// the ledger and issue again this device's own entries the group
    /// lacks. The group operations above do this on their own when they
    /// need it; this is for an app that wants control.
    ///
    /// # Errors
    /// See [`GroupPeerManager::rejoin_group`].
    pub async fn rejoin_group(&self, group: GroupId) -> Result<RejoinResult, DeviceError> {
        self.manager.rejoin_group(group).await
    }

    /// Serve `procedures` to co-members over tunnels, replacing what was
    /// served before; until called, this device answers no tunnel. See
    /// [`GroupPeerManager::serve`].
    pub fn serve(&self, procedures: super::tunnel::Procedures) {
        self.manager.serve(procedures);
    }

    /// Open a tunnel to `device`, a co-member in `group` that serves
    /// procedures, for calling them ([`super::tunnel::Tunnel::call`]).
    ///
    /// # Errors
    /// See [`GroupPeerManager::open_tunnel`].
    pub async fn open_tunnel(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<super::tunnel::Tunnel, super::tunnel::TunnelError> {
        self.manager.open_tunnel(group, device).await
    }

    /// Fetch the group's newest messages this device was not there for
    /// from a co-member, as many as the group's `history.share_last`
    /// setting allows (off by default), into the inbox in order. See
    /// [`GroupPeerManager::sync_history`].
    ///
    /// # Errors
    /// See [`GroupPeerManager::sync_history`].
    pub async fn sync_history(
        &self,
        group: GroupId,
    ) -> Result<super::tunnel::history::HistorySummary, super::tunnel::TunnelError> {
        self.manager.sync_history(group).await
    }

    /// Where and when each co-member in `group` was last seen, live ones
    /// first. See [`GroupPeerManager::presence`].
    ///
    /// # Errors
    /// `UnknownGroup`, or reading the group's MLS state failing.
    pub async fn presence(
        &self,
        group: GroupId,
    ) -> Result<Vec<super::presence::MemberPresence>, DeviceError> {
        self.manager.presence(group).await
    }

    /// The hub a tunnel in `group` rides (the group's first bound hub).
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn tunnel_hub(&self, group: GroupId) -> Result<Option<String>, DeviceError> {
        self.manager.tunnel_hub(group)
    }

    /// Close every tunnel in `group` whose other device is no longer a
    /// member; runs on its own after every roster change. See
    /// [`GroupPeerManager::reconcile_tunnel_listeners`].
    pub async fn reconcile_tunnel_listeners(&self, group: GroupId) {
        self.manager.reconcile_tunnel_listeners(group).await;
    }

    /// Wait until this device can be invited: its key packages are on
    /// every hub of its own. A device just opened is not invitable until
    /// then (an invite answers `NoKeyPackage`).
    ///
    /// # Errors
    /// See [`GroupPeerManager::ready_for_invites`].
    pub async fn ready_for_invites(&self, within: Duration) -> Result<(), DeviceError> {
        self.manager.ready_for_invites(within).await
    }

    /// Leave a group: a member commits this device's own removal (see
    /// [`GroupPeerManager::leave_group`]).
    ///
    /// # Errors
    /// See [`GroupPeerManager::leave_group`].
    pub async fn leave_group(&self, group: GroupId) -> Result<LeaveOutcome, CommitError> {
        self.manager.leave_group(group).await
    }

    /// Forget a group on this device only (see
    /// [`GroupPeerManager::forget_group`]): its state goes, nobody is told,
    /// the durable inbox stays.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub async fn forget_group(&self, group: GroupId) -> Result<(), DeviceError> {
        self.manager.forget_group(group).await
    }

    /// A new subscription to the device's events (messages, membership,
    /// epochs, hub status): every event from now on, as a `Stream` (see
    /// [`EventStream`]). Every subscription gets the same events.
    pub fn events(&self) -> EventStream {
        self.manager.events()
    }

    /// Counters.
    pub fn stats(&self) -> DeviceStats {
        self.manager.stats()
    }

    /// The manager underneath, for what the facade does not cover.
    pub fn manager(&self) -> &GroupPeerManager {
        &self.manager
    }

    /// Stop every task and connection. The state on disk stays; `open`
    /// resumes it.
    pub async fn close(&self) {
        self.manager.stop().await;
        self.loopback.stop().await;
    }
}
