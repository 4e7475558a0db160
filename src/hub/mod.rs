//! The hub: a group-blind publish/subscribe store over opaque topics.
//!
//! [`HubCore`] holds the protocol logic over a [`HubStore`] (one transaction
//! per call); [`Hub`] drives it over WebSocket connections from any
//! [`Listener`], with the store's background work (for [`KvHubStore`], the
//! group-commit flusher) and a retention purge running beside it.

mod announce;
mod core;
mod flush;
pub(crate) mod fuzzing;
mod layout;
mod limits;
mod metrics;
mod postgres;
mod rules;
mod server;
mod store;
mod stream;

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod quota_tests;

pub use self::announce::Remote;
pub use self::core::{Durable, HubCore, Published, PurgeReport, StreamPage};
pub use self::layout::DeviceUsage;
pub use self::limits::{Limits, Rate, RateLimitRefusals};
pub use self::metrics::prometheus_text;
pub use self::postgres::{Announce, PgHubStore, PgOpenError, PgOptions, DEFAULT_POOL_SIZE};
pub use self::store::{Generation, HubStore, HubTxn, KvHubStore, StoreError};
pub use self::stream::TopicStart;
pub use crate::prom::HistogramSnapshot;

use crate::clock::Clock;
use crate::kv::KvStore;
use crate::rng::SharedRng;
use crate::transport::Listener;
use crate::wire::{DeviceId, TopicId};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How a hub runs.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// The URL devices dial and sign (`ws://host:port`, or `loopback://…`
    /// for a device's in-process hub), without a trailing slash. A device that signed another URL is refused with `WrongHub`.
    pub url: String,
    /// Limits, each answering a named error.
    pub limits: Limits,
    /// How long a challenge stays valid.
    pub challenge_ttl: Duration,
    /// How long a connection has, from the moment it is accepted, to finish
    /// the WebSocket handshake and authenticate; then it is closed (1008
    /// `authentication timed out`, or with no reason when the WebSocket
    /// handshake never finished).
    pub auth_deadline: Duration,
    /// Connections that have not authenticated yet, at most, at once. One
    /// more is closed at once (1013 `too many unauthenticated
    /// connections`) without a challenge.
    pub max_unauthenticated: usize,
    /// How often retention is enforced.
    pub purge_interval: Duration,
    /// Requests one connection may have waiting for durability at once;
    /// further frames wait (backpressure), they are not refused.
    pub max_in_flight: usize,
}

impl HubConfig {
    /// Defaults for a hub reachable at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into().trim_end_matches('/').to_string(),
            limits: Limits::default(),
            challenge_ttl: Duration::from_secs(10),
            auth_deadline: Duration::from_secs(20),
            max_unauthenticated: 256,
            purge_interval: Duration::from_secs(60),
            max_in_flight: 256,
        }
    }
}

impl HubConfig {
    /// Whether the configuration makes sense.
    ///
    /// # Errors
    /// `Limits` or `Url`, naming what is wrong.
    fn check(&self) -> Result<(), HubStartError> {
        self.limits.validate().map_err(HubStartError::Limits)?;
        if self.max_unauthenticated == 0 || self.auth_deadline.is_zero() {
            return Err(HubStartError::Limits(
                "max_unauthenticated and auth_deadline must be above 0".into(),
            ));
        }
        let scheme_ok = ["ws://", "wss://", crate::transport::LOOPBACK_SCHEME]
            .iter()
            .any(|s| self.url.starts_with(s));
        if !scheme_ok {
            return Err(HubStartError::Url(self.url.clone()));
        }
        Ok(())
    }
}

/// Why a hub could not start.
#[derive(Debug, thiserror::Error)]
pub enum HubStartError {
    /// A limit makes no sense.
    #[error("invalid hub limits: {0}")]
    Limits(String),
    /// The URL is not `ws://`, `wss://` or (for an in-process hub)
    /// `loopback://`.
    #[error("hub URL must start with ws://, wss:// or loopback://, got {0}")]
    Url(String),
    /// The store's identity could not be read, or a new store's identity
    /// could not be written and flushed.
    #[error("hub store identity: {0}")]
    Store(#[from] crate::kv::KvError),
}

/// A snapshot of the hub's counters, for operators.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HubMetrics {
    /// Connections accepted since start.
    pub connections: u64,
    /// Connections open now.
    pub open_connections: u64,
    /// Authentications refused.
    pub auth_failures: u64,
    /// Frames refused as malformed, oversized, unknown or text.
    pub bad_frames: u64,
    /// Publishes accepted.
    pub accepted: u64,
    /// Publishes answered `duplicate`.
    pub duplicates: u64,
    /// Publishes that lost the compare-and-set.
    pub head_mismatches: u64,
    /// Publishes refused as `conflict`.
    pub conflicts: u64,
    /// Calls run again because their store transaction conflicted with
    /// another's (only on a store shared by several processes).
    pub conflict_retries: u64,
    /// Replays answered `history_missing`.
    pub history_missing: u64,
    /// Deliveries pushed on receive streams.
    pub deliveries_pushed: u64,
    /// Pushed deliveries that devices acknowledged (each counted once, on
    /// the stream that pushed it).
    pub deliveries_acked: u64,
    /// Store flushes (group commit: far fewer than accepted publishes).
    pub flushes: u64,
    /// Log frames trimmed.
    pub trimmed: u64,
    /// Subscription changes asked for (each change of a `Subscriptions`
    /// request counts once; refused ones too): after a restart every device
    /// subscribes again, so this is the re-subscription storm's measure.
    pub subscription_changes: u64,
    /// Receive streams started (a device starts one per connection).
    pub receive_starts: u64,
    /// Connections open now that have not authenticated yet.
    pub unauthenticated: u64,
    /// Connections closed at once because `max_unauthenticated` others
    /// were still unauthenticated.
    pub unauthenticated_refused: u64,
    /// Connections closed because they had not authenticated by the
    /// `auth_deadline`.
    pub auth_timeouts: u64,
    /// Posts refused because the owner's mailbox was full.
    pub mailbox_full: u64,
    /// Times a receive stream found frames trimmed from a log before it
    /// reached them (each reported to the device as `FramesMissed`).
    pub frames_missed: u64,
    /// Publishes refused because the publisher's stored bytes would exceed
    /// its quota.
    pub quota_refusals: u64,
    /// Requests refused as `NotAuthorized`.
    pub not_authorized: u64,
    /// Times a receive stream could not save the cursors its device's acks
    /// moved (a store failure). Nothing is lost: the frames behind an
    /// unsaved cursor are pushed again on the device's next stream.
    pub cursor_save_failures: u64,
    /// Requests refused with `RateLimited`, by scope.
    pub rate_limited: RateLimitRefusals,
    /// [`HubMetrics::auth_failures`] by the error the device was told.
    pub auth_failures_by_reason: AuthFailures,
    /// How long store commits took (on PostgreSQL the round trip and the
    /// WAL flush; on sled applying the batch).
    pub commit_latency: HistogramSnapshot,
    /// How long waits for durability took (on sled the group-commit flush;
    /// on PostgreSQL nothing).
    pub durable_latency: HistogramSnapshot,
    /// Receive streams open now (at most one per connected device).
    pub receive_streams: u64,
    /// Deliveries pushed on open streams and not acknowledged yet: the
    /// hub's delivery queue (each stream holds at most a window of them).
    pub unacked_deliveries: u64,
    /// Bytes the store takes, as sampled at start and at every retention
    /// purge (`HubConfig::purge_interval`); `None` when the store cannot
    /// say.
    pub store_bytes: Option<u64>,
    /// Frames other hub processes on the store announced to this one.
    pub announcements: u64,
    /// Times this process may have missed other processes' announcements
    /// (its listening connection was cut, or its queue was full) or swept
    /// for them (a polling store, now and then), and had every receive
    /// stream read its topics' heads again.
    pub announcement_gaps: u64,
    /// Text on the announcement channel that was not an announcement
    /// (only something else with access to the database can send it).
    pub bad_announcements: u64,
}

/// Authentications refused, by the error the device was told.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuthFailures {
    /// `UnsupportedVersion`: no protocol version in common.
    pub unsupported_version: u64,
    /// `ChallengeReplayed`: an answer to a challenge already used.
    pub challenge_replayed: u64,
    /// `UnknownChallenge`: an answer to a challenge this connection was
    /// not given.
    pub unknown_challenge: u64,
    /// `ChallengeExpired`: answered after the challenge's TTL.
    pub challenge_expired: u64,
    /// `WrongHub`: signed for another hub URL.
    pub wrong_hub: u64,
    /// `BadSignature`: not a valid key or signature.
    pub bad_signature: u64,
    /// Any other refusal.
    pub other: u64,
}

impl AuthFailures {
    /// Count a refusal with `e`.
    fn count(&mut self, e: &crate::wire::HubError) {
        use crate::wire::HubError as E;
        let n = match e {
            E::UnsupportedVersion { .. } => &mut self.unsupported_version,
            E::ChallengeReplayed => &mut self.challenge_replayed,
            E::UnknownChallenge => &mut self.unknown_challenge,
            E::ChallengeExpired => &mut self.challenge_expired,
            E::WrongHub { .. } => &mut self.wrong_hub,
            E::BadSignature => &mut self.bad_signature,
            _ => &mut self.other,
        };
        *n += 1;
    }

    /// Refusals of every reason together.
    pub fn total(&self) -> u64 {
        self.by_reason().iter().map(|(_, n)| n).sum()
    }

    /// Every reason with its count, in a fixed order.
    pub fn by_reason(&self) -> [(&'static str, u64); 7] {
        [
            ("unsupported_version", self.unsupported_version),
            ("challenge_replayed", self.challenge_replayed),
            ("unknown_challenge", self.unknown_challenge),
            ("challenge_expired", self.challenge_expired),
            ("wrong_hub", self.wrong_hub),
            ("bad_signature", self.bad_signature),
            ("other", self.other),
        ]
    }
}

#[derive(Default)]
struct ServerCounters {
    auth_failures: Mutex<AuthFailures>,
    /// The store's size as last sampled; `u64::MAX` for none.
    store_bytes: AtomicU64,
    cursor_save_failures: AtomicU64,
    connections: AtomicU64,
    open: AtomicU64,
    bad_frames: AtomicU64,
    pushed: AtomicU64,
    acked: AtomicU64,
    subscription_changes: AtomicU64,
    receive_starts: AtomicU64,
    unauthenticated: AtomicU64,
    unauthenticated_refused: AtomicU64,
    auth_timeouts: AtomicU64,
    announcements: AtomicU64,
    announcement_gaps: AtomicU64,
}

/// The receive stream a device has open.
struct Session {
    conn: u64,
    stream: Arc<server::Stream>,
    cancel: CancellationToken,
}

pub(crate) struct HubShared {
    core: Arc<HubCore>,
    config: HubConfig,
    clock: Clock,
    rng: SharedRng,
    sessions: Mutex<BTreeMap<DeviceId, Session>>,
    /// One lock per device with a receive stream: a new stream starts once
    /// the one it replaces has saved its cursors.
    stream_locks: Mutex<BTreeMap<DeviceId, std::sync::Weak<tokio::sync::Mutex<()>>>>,
    used_nonces: Mutex<BTreeMap<[u8; 32], u64>>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    next_conn: AtomicU64,
    counters: ServerCounters,
}

impl HubShared {
    /// Frame `seq` of `topic` is durable: wake the receive stream of each
    /// device, if it has one, to push it.
    fn wake(&self, devices: &[DeviceId], topic: &TopicId, seq: u64) {
        let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        for d in devices {
            if let Some(s) = sessions.get(d) {
                s.stream.woken(topic, seq);
            }
        }
    }

    /// Frame `seq` of `topic` is durable: wake every stream that follows
    /// the topic (an announcement that did not name its recipients).
    fn wake_followers(&self, topic: &TopicId, seq: u64) {
        let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        for s in sessions.values() {
            if s.stream.follows(topic) {
                s.stream.woken(topic, seq);
            }
        }
    }

    /// Announcements may have been missed: every stream reads each topic
    /// it follows up to the topic's committed head.
    async fn wake_all(&self) {
        let streams: Vec<Arc<server::Stream>> = {
            let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            sessions.values().map(|s| s.stream.clone()).collect()
        };
        let mut heads: BTreeMap<TopicId, u64> = BTreeMap::new();
        for stream in streams {
            for topic in stream.followed() {
                let seq = match heads.get(&topic) {
                    Some(seq) => *seq,
                    // A failed read is counted as an internal error; that
                    // stream reads the topic at its next wake.
                    None => match self.core.last_seq(&topic).await {
                        Ok(seq) => *heads.entry(topic.clone()).or_insert(seq),
                        Err(_) => continue,
                    },
                };
                stream.woken(&topic, seq);
            }
        }
    }

    /// What another hub process on the store announced.
    async fn remote(&self, r: Remote) {
        let counter = match r {
            Remote::Frame { .. } => &self.counters.announcements,
            Remote::Missed => &self.counters.announcement_gaps,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        match r {
            Remote::Frame {
                topic,
                seq,
                recipients: Some(devices),
            } => self.wake(&devices, &topic, seq),
            Remote::Frame {
                topic,
                seq,
                recipients: None,
            } => self.wake_followers(&topic, seq),
            Remote::Missed => self.wake_all().await,
        }
    }

    /// The lock a receive stream of `device` holds while it runs.
    fn stream_lock(&self, device: DeviceId) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.stream_locks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = locks.get(&device).and_then(std::sync::Weak::upgrade) {
            return l;
        }
        if locks.len() % 1024 == 1023 {
            locks.retain(|_, l| l.strong_count() > 0);
        }
        let l = Arc::new(tokio::sync::Mutex::new(()));
        locks.insert(device, Arc::downgrade(&l));
        l
    }
}

/// A running hub. Cloning gives another handle to the same hub.
#[derive(Clone)]
pub struct Hub {
    shared: Arc<HubShared>,
    flusher: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

impl Hub {
    /// Start a hub over the key-value store `kv` (which may hold a previous
    /// run's state), through a [`KvHubStore`]: see [`Hub::start_on`].
    ///
    /// A store that holds no identity yet gets one now, drawn from `rng`
    /// and flushed before this returns (one blocking flush); a store that
    /// has one keeps it. Every `AuthOk` carries it ([`Hub::store_id`]).
    ///
    /// Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`HubStartError`] when the configuration is invalid, or `Store` when
    /// the store's identity cannot be read or made durable.
    pub fn start(
        kv: Arc<dyn KvStore>,
        config: HubConfig,
        clock: Clock,
        rng: SharedRng,
    ) -> Result<Hub, HubStartError> {
        // An invalid configuration leaves a new store untouched (no
        // identity written into it).
        config.check()?;
        let store = KvHubStore::open(kv, &rng)?;
        Self::start_on(store, config, clock, rng)
    }

    /// Start a hub over `store`: the store's background work and the
    /// retention purge start now; connections are served by [`Hub::serve`].
    ///
    /// Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`HubStartError`] when the configuration is invalid.
    pub fn start_on(
        store: Arc<dyn HubStore>,
        config: HubConfig,
        clock: Clock,
        rng: SharedRng,
    ) -> Result<Hub, HubStartError> {
        config.check()?;
        let flusher = tokio::spawn(store.background());
        let announcements = store.announcements();
        let core = HubCore::open(store, config.limits.clone(), clock.clone());
        let shared = Arc::new(HubShared {
            core,
            config,
            clock,
            rng,
            sessions: Mutex::new(BTreeMap::new()),
            stream_locks: Mutex::new(BTreeMap::new()),
            used_nonces: Mutex::new(BTreeMap::new()),
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
            next_conn: AtomicU64::new(1),
            counters: ServerCounters::default(),
        });
        if let Some(mut announcements) = announcements {
            // Frames other hub processes on the store accepted: wake the
            // streams this one holds for them.
            let s = shared.clone();
            shared.tasks.spawn(async move {
                loop {
                    let r = tokio::select! {
                        _ = s.shutdown.cancelled() => break,
                        r = announcements.recv() => r,
                    };
                    match r {
                        Some(r) => s.remote(r).await,
                        None => break,
                    }
                }
            });
        }
        shared
            .counters
            .store_bytes
            .store(u64::MAX, Ordering::Relaxed);
        let purger = shared.clone();
        shared.tasks.spawn(async move {
            let interval = purger.config.purge_interval;
            loop {
                // The store's size for the metrics, sampled at every purge
                // (and at start).
                match purger.core.store().size_bytes().await {
                    Ok(Some(n)) => purger.counters.store_bytes.store(n, Ordering::Relaxed),
                    Ok(None) => {}
                    // The metric keeps its last value; this says why.
                    Err(e) => tracing::warn!(error = %e, "hub store: size not read"),
                }
                tokio::select! {
                    _ = purger.shutdown.cancelled() => break,
                    _ = tokio::time::sleep(interval) => {}
                }
                match purger.core.purge(None).await {
                    Ok(d) if d.value != PurgeReport::default() => {
                        tracing::info!(report = ?d.value, "retention purge");
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "retention purge failed"),
                }
            }
        });
        Ok(Hub {
            shared,
            flusher: Arc::new(Mutex::new(Some(flusher))),
        })
    }

    /// Accept connections from `listener` until [`Hub::shutdown`]. Returns at
    /// once; the accept loop runs as a task of the hub.
    pub fn serve(&self, mut listener: impl Listener) {
        let shared = self.shared.clone();
        self.shared.tasks.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = shared.shutdown.cancelled() => break,
                    r = listener.accept() => r,
                };
                match accepted {
                    Ok((stream, peer)) => {
                        let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                        let s = shared.clone();
                        shared
                            .tasks
                            .spawn(server::connection(s, conn, stream, peer));
                    }
                    Err(e) => {
                        // A failed accept (out of file descriptors, a reset
                        // during the handshake) must not end the hub.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }

    /// The protocol core, for tests and tools that drive it directly.
    pub fn core(&self) -> &Arc<HubCore> {
        &self.shared.core
    }

    /// The identity of the hub's store, as every `AuthOk` announces it.
    pub fn store_id(&self) -> crate::wire::StoreId {
        self.shared.core.store_id()
    }

    /// The configuration in force.
    pub fn config(&self) -> &HubConfig {
        &self.shared.config
    }

    /// Enforce retention now rather than at the next purge interval.
    ///
    /// # Errors
    /// `Internal` when the store failed.
    pub async fn purge_now(&self) -> Result<PurgeReport, crate::wire::HubError> {
        let d = self.shared.core.purge(None).await?;
        self.shared.core.durable(d.gen).await?;
        Ok(d.value)
    }

    /// The hub's counters.
    pub fn metrics(&self) -> HubMetrics {
        let c = &self.shared.core.counters;
        let s = &self.shared.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let auth_failures = *s.auth_failures.lock().unwrap_or_else(|p| p.into_inner());
        let (receive_streams, unacked_deliveries) = {
            let sessions = self
                .shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let unacked: usize = sessions.values().map(|s| s.stream.unacked()).sum();
            (sessions.len() as u64, unacked as u64)
        };
        HubMetrics {
            connections: r(&s.connections),
            open_connections: r(&s.open),
            auth_failures: auth_failures.total(),
            bad_frames: r(&s.bad_frames),
            accepted: r(&c.accepted),
            duplicates: r(&c.duplicates),
            head_mismatches: r(&c.head_mismatches),
            conflicts: r(&c.conflicts),
            conflict_retries: r(&c.conflict_retries),
            history_missing: r(&c.history_missing),
            deliveries_pushed: r(&s.pushed),
            deliveries_acked: r(&s.acked),
            flushes: self.shared.core.store().flushes(),
            trimmed: r(&c.trimmed),
            unauthenticated: r(&s.unauthenticated),
            subscription_changes: r(&s.subscription_changes),
            receive_starts: r(&s.receive_starts),
            unauthenticated_refused: r(&s.unauthenticated_refused),
            auth_timeouts: r(&s.auth_timeouts),
            mailbox_full: r(&c.mailbox_full),
            frames_missed: r(&c.frames_missed),
            quota_refusals: r(&c.quota_refusals),
            not_authorized: r(&c.not_authorized),
            cursor_save_failures: r(&s.cursor_save_failures),
            rate_limited: self.shared.core.rate_limit_refusals(),
            auth_failures_by_reason: auth_failures,
            commit_latency: c.commit_latency.snapshot(),
            durable_latency: c.durable_latency.snapshot(),
            receive_streams,
            unacked_deliveries,
            store_bytes: match s.store_bytes.load(Ordering::Relaxed) {
                u64::MAX => None,
                n => Some(n),
            },
            announcements: r(&s.announcements),
            announcement_gaps: r(&s.announcement_gaps),
            bad_announcements: self.shared.core.store().bad_announcements(),
        }
    }

    /// Serve the hub's counters in Prometheus's text format
    /// ([`prometheus_text`]) on `listener`, to `GET /metrics`, until
    /// [`Hub::shutdown`]. Returns at once; the endpoint runs as a task of
    /// the hub. Bind it where only the operator reaches it.
    pub fn serve_metrics(&self, listener: tokio::net::TcpListener) {
        let hub = self.clone();
        self.shared.tasks.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = hub.shared.shutdown.cancelled() => break,
                    r = listener.accept() => r,
                };
                match accepted {
                    Ok((socket, _)) => {
                        let h = hub.clone();
                        hub.shared
                            .tasks
                            .spawn(async move { metrics::serve_one(socket, || h.metrics()).await });
                    }
                    Err(e) => {
                        // Out of file descriptors, say: the hub's own
                        // accept loop meets the same; wait a moment.
                        tracing::warn!(error = %e, "metrics endpoint: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
    }

    /// Stop accepting, close every connection (answers already being made
    /// durable are still sent), flush the store, and stop the flusher.
    ///
    /// # Cancel safety
    /// Not cancel safe: call it to completion.
    pub async fn shutdown(&self) {
        self.shared.shutdown.cancel();
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
        if let Err(e) = self.shared.core.store().close().await {
            // Nothing is answered after this, so no device was told of
            // what the failed flush covered; the operator is.
            tracing::error!(error = %e, "hub store: the final flush failed");
        }
        let flusher = self
            .flusher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(f) = flusher {
            f.abort();
            // Wait until the task is gone, so its handle on the store is too.
            let _ = f.await;
        }
    }
}
