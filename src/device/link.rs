//! `HubLink`: the one reconnecting connection of a device to one hub URL.
//!
//! Every group bound to a hub shares that hub's link. The link owns one
//! [`HubClient`] at a time and replaces it when it drops:
//!
//! 1. **Connect.** Authenticate with [`HubClient::connect`], which learns
//!    the identity of the hub's store (below).
//! 2. **Re-subscribe** every routed topic (and retry every unsubscribe the hub
//!    has not confirmed), in batches of up to 1,000 changes per request
//!    ([`HubClient::change_subscriptions`]); subscriptions the hub holds
//!    already cost it nothing. A hub that rate-limits the burst gets the
//!    rest from a background worker, paced by the hub's `retry_after_ms`.
//! 3. **Receive**: start the receive stream. The hub pushes, for each
//!    subscription, every frame after the frames this device acknowledged
//!    there (its cursor, kept by the hub), then each new one, so nothing
//!    is kept here between connections.
//! 4. **Route** pushed deliveries by topic to the receiver that
//!    [`HubLink::subscribe`] returned, until the connection drops, the hub
//!    ends the receive stream ([`Push::ReceiveEnded`], for example because a
//!    newer stream of the same device replaced it), a keepalive ping fails,
//!    or a resync is due (below). Then back to 1 after a backoff delay.
//!
//! # A hub that lost or restored its store
//! Every connection learns the hub's store identity
//! ([`HubClient::store_id`]); [`HubLink::store_id`] publishes a new one once
//! that connection is up, and is `None` until the first. A new store (a hub
//! that lost its data directory, or a new hub at the same URL) holds no
//! subscription of this device until the link subscribes again, which it
//! does on every connection; a store restored from an older copy keeps its
//! identity, and its cursors and logs went back with it: frames acknowledged
//! since come again (consumers deduplicate), and logs' heads went back,
//! which the link does not look at; the device compares them against its
//! own.
//!
//! # Backoff
//! Delays come from [`ReconnectBackoff`]: the `backoff` crate's exponential
//! schedule (multiplier 2, capped at `backoff_max`) with the crate's own
//! randomization turned off, then jittered downwards with the injected
//! [`SharedRng`]: `delay * (1 - jitter * u)`, `u` uniform in `[0, 1)`. The
//! schedule is reset only once a connection stayed up `stable_after`, so a
//! hub that accepts and drops at once is retried ever more slowly.
//! [`HubLink::retry_now`] skips the wait in progress.
//!
//! # Buffers
//! Each receiver holds [`ROUTE_CAPACITY`] deliveries. Deliveries that cannot
//! be handed over at once (no route for their topic yet, or a full receiver)
//! wait in per-topic queues holding [`BUFFER_CAPACITY`] deliveries in all;
//! a topic's queue is handed over in order when the topic is subscribed or
//! its receiver has room. Beyond that deliveries are dropped, not acked, and
//! the link resynchronises (reconnects at once, without a backoff wait, so
//! the hub pushes every unacked delivery again) once the dropping topic's
//! queue has drained or every queue is empty. Routing never blocks: a slow
//! consumer costs memory up to these bounds and then a resync, never a
//! stalled connection.
//!
//! # Delivery promise
//! At least once, in hub order per topic. A delivery can come twice (after
//! a reconnect, if its ack had not reached the hub): consumers deduplicate
//! by topic and sequence number, or by publish id.
//!
//! # Determinism
//! Time is tokio's (`tokio::time`), randomness is the injected rng, and
//! every map the link iterates is ordered, so a simulation with a seeded rng
//! and simulated time replays the same schedule.

use crate::client::{ClientError, ClientOptions, HubClient, Push};
use crate::rng::SharedRng;
use crate::transport::Connector;
use crate::wire::{
    ChangeOutcome, Delivery, DeviceId, FetchResult, FrameRef, HubError, Publish, PublishOutcome,
    StoreId, SubscriptionChange, TopicId, MAX_SUBSCRIPTION_CHANGES,
};
use backoff::backoff::Backoff as _;
use ed25519_dalek::SigningKey;
use futures::future::BoxFuture;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::mpsc::error::{SendError, TrySendError};
use tokio::sync::mpsc::OwnedPermit;
use tokio::sync::{mpsc, watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

/// Deliveries each receiver returned by [`HubLink::subscribe`] holds.
pub const ROUTE_CAPACITY: usize = 1024;
/// Deliveries the link holds, over all topics, that it could not hand to a
/// receiver yet. Beyond this they are dropped unacked and fetched again by a
/// resync.
pub const BUFFER_CAPACITY: usize = 1024;
/// Interval of the keepalive ping on an idle-looking connection; a ping that
/// times out or finds the connection closed ends the connection.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// The most ids the link sends in one ack frame (the protocol's limit).
const MAX_ACK_BATCH: usize = 1000;
/// How many unsubscribed topics the link remembers in order to ack and drop
/// their late deliveries.
const UNSUBSCRIBED_MEMORY: usize = 4096;
/// Pause before retrying a subscription change that failed on a live
/// connection.
const SUB_RETRY: Duration = Duration::from_secs(1);
/// Smallest backoff step, so that a zero base cannot make a busy loop.
const MIN_BACKOFF: Duration = Duration::from_millis(1);

/// Reconnection and request settings of a [`HubLink`].
#[derive(Clone, Debug)]
pub struct LinkConfig {
    /// First reconnect delay before jitter (default 250 ms; at least 1 ms is
    /// used).
    pub backoff_base: Duration,
    /// Largest reconnect delay before jitter (default 30 s).
    pub backoff_max: Duration,
    /// Fraction of each delay that is randomised away: a delay `d` becomes
    /// `d * (1 - jitter * u)` with `u` uniform in `[0, 1)` (default 0.5;
    /// clamped to `0..=1`, 0 disables jitter).
    pub jitter: f64,
    /// How long a connection must stay up before the backoff schedule starts
    /// again from `backoff_base` (default 5 s).
    pub stable_after: Duration,
    /// Connect and request timeouts of each connection. `request_timeout`
    /// also bounds how long a request waits for a connection.
    pub client: ClientOptions,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            backoff_base: Duration::from_millis(250),
            backoff_max: Duration::from_secs(30),
            jitter: 0.5,
            stable_after: Duration::from_secs(5),
            client: ClientOptions::default(),
        }
    }
}

/// Where a link stands. Published through [`HubLink::status`].
///
/// Transitions: `Connecting` → `Connected` or `Reconnecting`;
/// `Connected` → `Reconnecting`; `Reconnecting` → `Connected` or
/// `Reconnecting` (next attempt); any → `Stopped`, which is final.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkStatus {
    /// The first connection attempt is under way; no attempt has failed yet.
    Connecting,
    /// Authenticated, subscriptions restored, receive stream running.
    Connected,
    /// The last attempt failed or the connection was lost. The status is
    /// published when the wait starts and stays while attempt `attempt`
    /// runs after it.
    Reconnecting {
        /// Number of the next attempt since the link was last stably
        /// connected (1 for the first retry).
        attempt: u32,
        /// The wait before that attempt, jitter included.
        retry_in: Duration,
        /// Why the previous attempt or connection ended.
        last_error: String,
    },
    /// [`HubLink::stop`] was called or every handle was dropped.
    Stopped,
}

/// Why a link request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// No connection came up within the request timeout; nothing was sent.
    #[error("not connected to {url}")]
    NotConnected {
        /// The hub URL.
        url: String,
    },
    /// The link was stopped; nothing was sent.
    #[error("the link is stopped")]
    Stopped,
    /// The request was sent and failed. `Client(Disconnected)` means the
    /// connection dropped before the answer: the request may or may not
    /// have taken effect (retry a publish with the same publish id).
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// The reconnect delay schedule: exponential from the `backoff` crate
/// (randomization off) plus jitter from a [`SharedRng`].
///
/// With jitter 0 the delays are `base, 2·base, 4·base, …` capped at `max`.
/// With jitter `j`, each delay `d` is drawn from `(d·(1-j), d]`, so the cap
/// is never exceeded. The same rng seed gives the same delays.
pub struct ReconnectBackoff {
    inner: backoff::exponential::ExponentialBackoff<TokioClock>,
    jitter: f64,
    rng: SharedRng,
}

impl std::fmt::Debug for ReconnectBackoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReconnectBackoff")
            .field("current", &self.inner.current_interval)
            .field("max", &self.inner.max_interval)
            .field("jitter", &self.jitter)
            .finish()
    }
}

/// The backoff crate's clock, read from tokio's (possibly simulated) time.
/// Only used for the crate's elapsed-time limit, which is off.
#[derive(Clone, Copy, Debug, Default)]
struct TokioClock;

impl backoff::Clock for TokioClock {
    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
}

impl ReconnectBackoff {
    /// Growth factor between consecutive delays.
    pub const MULTIPLIER: f64 = 2.0;

    /// A schedule starting at `base` (at least 1 ms, at most `max`), capped
    /// at `max`, with `jitter` (clamped to `0..=1`) drawn from `rng`.
    pub fn new(base: Duration, max: Duration, jitter: f64, rng: SharedRng) -> Self {
        let max = max.max(MIN_BACKOFF);
        let base = base.clamp(MIN_BACKOFF, max);
        let mut inner = backoff::exponential::ExponentialBackoff {
            current_interval: base,
            initial_interval: base,
            randomization_factor: 0.0,
            multiplier: Self::MULTIPLIER,
            max_interval: max,
            start_time: TokioClock.now_std(),
            max_elapsed_time: None,
            clock: TokioClock,
        };
        inner.reset();
        Self {
            inner,
            jitter: clamp_jitter(jitter),
            rng,
        }
    }

    /// The schedule of `config`.
    pub fn from_config(config: &LinkConfig, rng: SharedRng) -> Self {
        Self::new(config.backoff_base, config.backoff_max, config.jitter, rng)
    }

    /// The next delay, jitter applied, and advance the schedule.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next_step();
        if self.jitter == 0.0 {
            return step;
        }
        jittered(step, self.jitter, self.rng.unit())
    }

    /// The next un-jittered delay. With randomization off the crate still
    /// adds a random fraction of one nanosecond (it calls `rand::random`
    /// regardless); truncating to whole microseconds removes it, so the
    /// schedule is deterministic.
    fn next_step(&mut self) -> Duration {
        let raw = self.inner.next_backoff().unwrap_or(self.inner.max_interval);
        let micros = raw.as_micros().min(u128::from(u64::MAX)) as u64;
        Duration::from_micros(micros).clamp(MIN_BACKOFF, self.inner.max_interval)
    }

    /// Start the schedule again from the base delay.
    pub fn reset(&mut self) {
        self.inner.reset();
    }
}

impl TokioClock {
    fn now_std(&self) -> std::time::Instant {
        backoff::Clock::now(self)
    }
}

fn clamp_jitter(j: f64) -> f64 {
    if j.is_nan() {
        0.0
    } else {
        j.clamp(0.0, 1.0)
    }
}

/// `delay * (1 - jitter * unit)`: the jitter this link applies, with
/// `jitter` clamped to `0..=1` and `unit` to `[0, 1]`. Never longer than
/// `delay`.
pub fn jittered(delay: Duration, jitter: f64, unit: f64) -> Duration {
    let unit = if unit.is_nan() {
        0.0
    } else {
        unit.clamp(0.0, 1.0)
    };
    let factor = (1.0 - clamp_jitter(jitter) * unit).clamp(0.0, 1.0);
    delay.mul_f64(factor)
}

/// What the link's tasks share.
struct Shared {
    url: String,
    key: SigningKey,
    connector: Arc<dyn Connector>,
    config: LinkConfig,
    rng: SharedRng,
    status: watch::Sender<LinkStatus>,
    /// The store identity of the last connection that came up.
    store_id: watch::Sender<Option<StoreId>>,
    /// How many connections have come up (see [`HubLink::connections`]).
    connections: watch::Sender<u64>,
    /// Subscriptions the hub refused, in order, newest last (see
    /// [`HubLink::refused_subscriptions`]); at most [`MAX_REFUSALS_KEPT`].
    refusals: watch::Sender<RefusalLog>,
    /// `FramesMissed` notices of the receive stream.
    missed: watch::Sender<RefusalLog>,
    conn: watch::Sender<Conn>,
    state: Mutex<State>,
    /// Serialises hub subscribe/unsubscribe requests, so the last desired
    /// state of a topic is the one the hub ends up with.
    sub_lock: tokio::sync::Mutex<()>,
    /// `retry_now`: wakes a backoff wait in progress (never stored).
    retry: Notify,
    /// Wakes the session loop: routes changed.
    wake: Notify,
    /// Wakes the subscription worker: topics to sync.
    sub_wake: Notify,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

/// The current connection as requests see it.
#[derive(Clone)]
enum Conn {
    Down,
    Up(HubClient),
    Stopped,
}

struct Route {
    tx: mpsc::Sender<Delivery>,
    retention_secs: Option<u64>,
}

#[derive(Default)]
struct State {
    routes: BTreeMap<TopicId, Route>,
    /// Deliveries waiting for a route or for room in their receiver.
    pending: BTreeMap<TopicId, VecDeque<Delivery>>,
    pending_total: usize,
    /// Topics that lost deliveries to a full buffer on this connection.
    dropped: BTreeSet<TopicId>,
    /// Topics unsubscribed through the link: late deliveries are acked and
    /// dropped. Bounded by `UNSUBSCRIBED_MEMORY` (oldest forgotten first).
    unsubscribed: BTreeSet<TopicId>,
    unsubscribed_order: VecDeque<TopicId>,
    /// Unsubscribes the hub has not confirmed yet.
    unsub_unconfirmed: BTreeSet<TopicId>,
    /// Topics whose hub subscription may differ from what is wanted.
    dirty: BTreeSet<TopicId>,
    /// The identity of the store the last connection reached.
    store: Option<StoreId>,
    stopped: bool,
}

/// What the hub should hold for a topic.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Desired {
    Subscribed(Option<u64>),
    Unsubscribed,
    Nothing,
}

impl State {
    /// Take a pushed delivery: route it, queue it, or drop it. Deliveries
    /// for unsubscribed topics go to `ack_now`.
    fn accept(&mut self, d: Delivery, ack_now: &mut Vec<FrameRef>) {
        if self.unsubscribed.contains(&d.topic) {
            ack_now.push(d.frame_ref());
            return;
        }
        let queued = self.pending.get(&d.topic).is_some_and(|q| !q.is_empty());
        let d = match (queued, self.routes.get(&d.topic)) {
            (false, Some(route)) => match route.tx.try_send(d) {
                Ok(()) => return,
                Err(TrySendError::Full(d)) => d,
                Err(TrySendError::Closed(d)) => {
                    tracing::debug!(topic = ?d.topic, "receiver dropped; buffering its topic");
                    self.routes.remove(&d.topic);
                    d
                }
            },
            _ => d,
        };
        self.buffer(d);
    }

    fn buffer(&mut self, d: Delivery) {
        if self.pending_total >= BUFFER_CAPACITY {
            // Said once per topic until its resync: a device far behind
            // can overflow by thousands of frames, each of which the
            // resync fetches again.
            if !self.dropped.contains(&d.topic) {
                tracing::warn!(
                    topic = ?d.topic,
                    seq = d.seq,
                    "delivery buffer full; dropping unacked, a resync will fetch them again"
                );
            }
            self.dropped.insert(d.topic);
            return;
        }
        self.pending
            .entry(d.topic.clone())
            .or_default()
            .push_back(d);
        self.pending_total += 1;
    }

    /// Hand `topic`'s queue to its receiver while it has room.
    fn drain(&mut self, topic: &TopicId) {
        let Some(queue) = self.pending.get_mut(topic) else {
            return;
        };
        let mut closed = false;
        if let Some(route) = self.routes.get(topic) {
            while let Some(d) = queue.pop_front() {
                match route.tx.try_send(d) {
                    Ok(()) => self.pending_total -= 1,
                    Err(TrySendError::Full(d)) => {
                        queue.push_front(d);
                        break;
                    }
                    Err(TrySendError::Closed(d)) => {
                        queue.push_front(d);
                        closed = true;
                        break;
                    }
                }
            }
        }
        if queue.is_empty() {
            self.pending.remove(topic);
        }
        if closed {
            self.routes.remove(topic);
        }
    }

    /// Remove `topic`'s queue, answering the frames it held.
    fn discard(&mut self, topic: &TopicId) -> Vec<FrameRef> {
        let q = self.pending.remove(topic).unwrap_or_default();
        self.pending_total -= q.len();
        q.into_iter().map(|d| d.frame_ref()).collect()
    }

    fn remember_unsubscribed(&mut self, topic: TopicId) {
        if self.unsubscribed.insert(topic.clone()) {
            self.unsubscribed_order.push_back(topic);
        }
        while self.unsubscribed_order.len() > UNSUBSCRIBED_MEMORY {
            if let Some(old) = self.unsubscribed_order.pop_front() {
                self.unsubscribed.remove(&old);
            }
        }
    }

    fn forget_unsubscribed(&mut self, topic: &TopicId) {
        if self.unsubscribed.remove(topic) {
            self.unsubscribed_order.retain(|t| t != topic);
        }
        self.unsub_unconfirmed.remove(topic);
    }

    /// Whether dropped deliveries should be fetched again now: a topic that
    /// lost some is routed and has nothing queued, or nothing is queued.
    fn needs_resync(&self) -> bool {
        !self.dropped.is_empty()
            && (self.pending_total == 0
                || self
                    .dropped
                    .iter()
                    .any(|t| self.routes.contains_key(t) && !self.pending.contains_key(t)))
    }

    /// A connection reached the store `id`; answers the previous identity
    /// when it was another.
    fn enter_store(&mut self, id: StoreId) -> Option<StoreId> {
        match self.store.replace(id) {
            Some(old) if old != id => Some(old),
            _ => None,
        }
    }

    /// Forget per-connection state before a new stream. Everything queued
    /// or dropped is unacked and comes again.
    fn reset_for_connect(&mut self) {
        self.pending.clear();
        self.pending_total = 0;
        self.dropped.clear();
        let routed: Vec<TopicId> = self.routes.keys().cloned().collect();
        self.dirty.extend(routed);
        let unconfirmed: Vec<TopicId> = self.unsub_unconfirmed.iter().cloned().collect();
        self.dirty.extend(unconfirmed);
    }

    fn desired(&self, topic: &TopicId) -> Desired {
        match self.routes.get(topic) {
            Some(r) => Desired::Subscribed(r.retention_secs),
            None if self.unsub_unconfirmed.contains(topic) => Desired::Unsubscribed,
            None => Desired::Nothing,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state holds no invariant that a panic half-way could break badly:
    // at worst a delivery is redelivered.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How topic sync reacts to the hub's rate limit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// Leave the rest to the worker (during connect).
    Defer,
    /// Wait as the hub says and go on.
    Wait,
}

/// One routed topic ready to take a queued delivery.
type DrainReady = (
    TopicId,
    mpsc::Sender<Delivery>,
    Result<OwnedPermit<Delivery>, SendError<()>>,
);

impl Shared {
    fn set_status(&self, s: LinkStatus) {
        self.status.send_replace(s);
    }

    fn current_client(&self) -> Option<HubClient> {
        match &*self.conn.borrow() {
            Conn::Up(c) if c.is_connected() => Some(c.clone()),
            _ => None,
        }
    }

    /// Wait for a live connection (or the stop).
    async fn wait_up(&self) -> Option<HubClient> {
        let mut rx = self.conn.subscribe();
        let conn = rx
            .wait_for(|c| match c {
                Conn::Down => false,
                Conn::Up(c) => c.is_connected(),
                Conn::Stopped => true,
            })
            .await
            .ok()?
            .clone();
        match conn {
            Conn::Up(c) => Some(c),
            _ => None,
        }
    }

    /// Bring the hub's subscriptions in line with the dirty topics, up to
    /// [`MAX_SUBSCRIPTION_CHANGES`] of them per request. Answers the first
    /// change the hub refused (each refusal is logged and kept in the
    /// refusal log); a failed request puts its topics back and returns at
    /// once.
    async fn sync_topics(
        &self,
        client: &HubClient,
        pace: Pace,
    ) -> Result<Option<HubError>, ClientError> {
        let mut refused: Option<HubError> = None;
        loop {
            let wait = {
                let _serial = self.sub_lock.lock().await;
                let batch: Vec<(TopicId, Desired)> = {
                    let mut st = lock(&self.state);
                    let mut batch = Vec::new();
                    while batch.len() < MAX_SUBSCRIPTION_CHANGES {
                        let Some(topic) = st.dirty.pop_first() else {
                            break;
                        };
                        let d = st.desired(&topic);
                        if d != Desired::Nothing {
                            batch.push((topic, d));
                        }
                    }
                    batch
                };
                if batch.is_empty() {
                    break;
                }
                let changes = batch
                    .iter()
                    .map(|(topic, d)| match d {
                        Desired::Subscribed(retention_secs) => SubscriptionChange::Subscribe {
                            topic: topic.clone(),
                            retention_secs: *retention_secs,
                        },
                        _ => SubscriptionChange::Unsubscribe {
                            topic: topic.clone(),
                        },
                    })
                    .collect();
                match client.change_subscriptions(changes).await {
                    Ok(outcomes) => {
                        for ((topic, desired), outcome) in batch.into_iter().zip(outcomes) {
                            if desired == Desired::Unsubscribed {
                                // Done either way: a refused unsubscribe
                                // (a bad topic) would be refused again.
                                lock(&self.state).unsub_unconfirmed.remove(&topic);
                            }
                            let ChangeOutcome::Refused(e) = outcome else {
                                continue;
                            };
                            tracing::warn!(?topic, error = %e, "hub refused a subscription change");
                            if desired != Desired::Unsubscribed {
                                self.refusals
                                    .send_modify(|log| log.push(topic.clone(), e.clone()));
                            }
                            refused.get_or_insert(e);
                        }
                        None
                    }
                    Err(e) => {
                        lock(&self.state)
                            .dirty
                            .extend(batch.into_iter().map(|(topic, _)| topic));
                        match e {
                            ClientError::Hub(HubError::RateLimited { retry_after_ms, .. }) => {
                                if pace == Pace::Defer {
                                    self.sub_wake.notify_one();
                                    break;
                                }
                                Some(Duration::from_millis(retry_after_ms.max(10)))
                            }
                            e => return Err(e),
                        }
                    }
                }
            };
            if let Some(wait) = wait {
                tokio::select! {
                    _ = self.cancel.cancelled() => return Err(ClientError::Disconnected),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
        Ok(refused)
    }

    /// Ack `frames` on `client`. Failures are logged and dropped: the hub
    /// pushes the frames again.
    async fn ack_on(&self, client: &HubClient, frames: Vec<FrameRef>) {
        for chunk in frames.chunks(MAX_ACK_BATCH) {
            match client.ack(chunk.to_vec()).await {
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, count = chunk.len(), "ack not confirmed; the hub will redeliver");
                    return;
                }
            }
        }
    }

    /// One connection attempt: authenticate, restore subscriptions, resume.
    async fn connect_once(&self) -> Result<(HubClient, mpsc::Receiver<Push>), String> {
        let client = HubClient::connect(
            &*self.connector,
            &self.url,
            &self.key,
            self.config.client.clone(),
        )
        .await
        .map_err(|e| e.to_string())?;
        let result = async {
            let pushes = client
                .take_pushes()
                .ok_or_else(|| "push channel already taken".to_string())?;
            let store_id = client.store_id();
            {
                let mut st = lock(&self.state);
                if let Some(old) = st.enter_store(store_id) {
                    tracing::warn!(
                        %old,
                        new = %store_id,
                        "hub store identity changed; subscribing again"
                    );
                }
                st.reset_for_connect();
            }
            match self.sync_topics(&client, Pace::Defer).await {
                // A hub that failed the request (not the connection): the
                // worker, woken once the connection is up, tries again.
                Ok(_) | Err(ClientError::Hub(_)) => {}
                Err(e) => return Err(format!("re-subscribing failed: {e}")),
            }
            client
                .receive()
                .await
                .map_err(|e| format!("starting the receive stream failed: {e}"))?;
            tracing::debug!("receive stream started");
            Ok(pushes)
        }
        .await;
        match result {
            Ok(pushes) => Ok((client, pushes)),
            Err(e) => {
                client.close();
                Err(e)
            }
        }
    }

    fn deliver(self: &Arc<Self>, client: &HubClient, d: Delivery) {
        let mut ack_now = Vec::new();
        lock(&self.state).accept(d, &mut ack_now);
        if !ack_now.is_empty() {
            let shared = self.clone();
            let client = client.clone();
            self.tasks
                .spawn(async move { shared.ack_on(&client, ack_now).await });
        }
    }

    fn drain_future(&self) -> Option<BoxFuture<'static, DrainReady>> {
        let st = lock(&self.state);
        if st.pending_total == 0 {
            return None;
        }
        let waits: Vec<_> = st
            .pending
            .keys()
            .filter_map(|t| {
                let tx = st.routes.get(t)?.tx.clone();
                let topic = t.clone();
                Some(Box::pin(async move {
                    let probe = tx.clone();
                    let r = tx.reserve_owned().await;
                    (topic, probe, r)
                }))
            })
            .collect();
        if waits.is_empty() {
            return None;
        }
        Some(Box::pin(async move {
            futures::future::select_all(waits).await.0
        }))
    }

    fn drained(&self, (topic, probe, permit): DrainReady) {
        let mut st = lock(&self.state);
        let same = st
            .routes
            .get(&topic)
            .is_some_and(|r| r.tx.same_channel(&probe));
        if !same {
            return;
        }
        match permit {
            Ok(permit) => {
                if let Some(d) = st.pending.get_mut(&topic).and_then(|q| q.pop_front()) {
                    st.pending_total -= 1;
                    permit.send(d);
                }
                st.drain(&topic);
            }
            Err(_) => {
                st.routes.remove(&topic);
            }
        }
    }
}

enum SessionEnd {
    Cancelled,
    Lost(String),
    /// Deliveries were dropped because the buffer was full: reconnect at
    /// once, without a backoff wait (nothing failed; the new stream pushes
    /// every unacknowledged frame again).
    Resync(String),
}

async fn maybe<F: Future + Unpin>(f: &mut Option<F>) -> F::Output {
    match f.as_mut() {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// The link's main task: connect, run the session, back off, repeat.
async fn run(shared: Arc<Shared>) {
    let mut backoff = ReconnectBackoff::from_config(&shared.config, shared.rng.clone());
    let mut attempt: u32 = 0;
    let mut failure: Option<String> = None;
    let mut resync: Option<String> = None;
    loop {
        if let Some(reason) = resync.take() {
            attempt = attempt.saturating_add(1);
            shared.set_status(LinkStatus::Reconnecting {
                attempt,
                retry_in: Duration::ZERO,
                last_error: reason,
            });
        } else if let Some(error) = failure.take() {
            attempt = attempt.saturating_add(1);
            let delay = backoff.next_delay();
            let retry = shared.retry.notified();
            tokio::pin!(retry);
            // Registered before the status says so: a `retry_now` that sees
            // `Reconnecting` is never lost.
            retry.as_mut().enable();
            tracing::info!(attempt, ?delay, %error, "hub link down; retrying");
            shared.set_status(LinkStatus::Reconnecting {
                attempt,
                retry_in: delay,
                last_error: error,
            });
            tokio::select! {
                _ = shared.cancel.cancelled() => break,
                _ = tokio::time::sleep(delay) => {}
                _ = &mut retry => tracing::debug!("retry_now: skipping the backoff wait"),
            }
        }
        let connected = tokio::select! {
            _ = shared.cancel.cancelled() => break,
            r = shared.connect_once() => r,
        };
        let (client, pushes) = match connected {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "connection attempt failed");
                failure = Some(e);
                continue;
            }
        };
        let store_id = Some(client.store_id());
        shared.store_id.send_if_modified(|cur| {
            let changed = *cur != store_id;
            *cur = store_id;
            changed
        });
        shared.conn.send_replace(Conn::Up(client.clone()));
        shared.set_status(LinkStatus::Connected);
        shared.connections.send_modify(|n| *n += 1);
        shared.sub_wake.notify_one();
        tracing::info!("hub link connected");
        let end = session(&shared, &client, pushes, &mut backoff, &mut attempt).await;
        shared.conn.send_replace(Conn::Down);
        client.close();
        match end {
            SessionEnd::Cancelled => break,
            SessionEnd::Lost(reason) => {
                tracing::info!(%reason, "hub link lost");
                failure = Some(reason);
            }
            SessionEnd::Resync(reason) => {
                tracing::debug!(%reason, "hub link reconnecting to resynchronise");
                resync = Some(reason);
            }
        }
    }
    shared.finish();
}

impl Shared {
    /// Final state: no connection, no routes (receivers see the end),
    /// status `Stopped`.
    fn finish(&self) {
        if let Conn::Up(c) = self.conn.send_replace(Conn::Stopped) {
            c.close();
        }
        {
            let mut st = lock(&self.state);
            st.stopped = true;
            st.routes.clear();
            st.pending.clear();
            st.pending_total = 0;
        }
        self.set_status(LinkStatus::Stopped);
    }
}

/// Route pushes until the connection ends.
async fn session(
    shared: &Arc<Shared>,
    client: &HubClient,
    mut pushes: mpsc::Receiver<Push>,
    backoff: &mut ReconnectBackoff,
    attempt: &mut u32,
) -> SessionEnd {
    let stable = tokio::time::sleep(shared.config.stable_after);
    tokio::pin!(stable);
    let mut stable_done = false;
    let mut keepalive = tokio::time::interval_at(
        tokio::time::Instant::now() + KEEPALIVE_INTERVAL,
        KEEPALIVE_INTERVAL,
    );
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ping: Option<BoxFuture<'static, Result<u64, ClientError>>> = None;
    loop {
        if lock(&shared.state).needs_resync() {
            return SessionEnd::Resync(
                "resynchronising deliveries that did not fit the buffer".into(),
            );
        }
        let wake = shared.wake.notified();
        let mut drain = shared.drain_future();
        tokio::select! {
            _ = shared.cancel.cancelled() => return SessionEnd::Cancelled,
            push = pushes.recv() => match push {
                None => return SessionEnd::Lost("connection closed".into()),
                Some(Push::Delivery(d)) => shared.deliver(client, d),
                Some(Push::ReceiveEnded(e)) => {
                    return SessionEnd::Lost(format!("receive stream ended: {e}"))
                }
                Some(Push::Error(e)) => match &e {
                    // Frames trimmed from a log before the stream pushed
                    // them: gone from this hub. The pushes after them move
                    // on, so the device must hear of it here.
                    HubError::FramesMissed { topic, .. } => {
                        let topic = topic.clone();
                        shared.missed.send_modify(|log| log.push(topic, e));
                    }
                    _ => tracing::warn!(error = %e, "hub reported an error"),
                },
            },
            ready = maybe(&mut drain) => shared.drained(ready),
            _ = wake => {}
            _ = &mut stable, if !stable_done => {
                stable_done = true;
                backoff.reset();
                *attempt = 0;
                tracing::debug!("connection stable; backoff reset");
            }
            _ = keepalive.tick() => {
                if ping.is_none() {
                    let c = client.clone();
                    ping = Some(Box::pin(async move { c.ping().await }));
                }
            }
            r = maybe(&mut ping) => {
                ping = None;
                match r {
                    Ok(_) => {}
                    Err(
                        e @ (ClientError::Timeout { .. }
                        | ClientError::Disconnected
                        | ClientError::NotSent { .. }),
                    ) => {
                        return SessionEnd::Lost(format!("keepalive failed: {e}"));
                    }
                    Err(e) => tracing::warn!(error = %e, "keepalive ping refused"),
                }
            }
        }
    }
}

/// Keeps the subscriptions of dirty topics in line while connected.
async fn subscription_worker(shared: Arc<Shared>) {
    loop {
        tokio::select! {
            _ = shared.cancel.cancelled() => return,
            _ = shared.sub_wake.notified() => {}
        }
        while !lock(&shared.state).dirty.is_empty() {
            let client = tokio::select! {
                _ = shared.cancel.cancelled() => return,
                c = shared.wait_up() => match c {
                    Some(c) => c,
                    None => return,
                },
            };
            match shared.sync_topics(&client, Pace::Wait).await {
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "subscription sync interrupted");
                    // A dead connection: `wait_up` waits for the next one
                    // (whose setup syncs them anyway). A live one that
                    // failed (timeout, protocol error): pause, then retry.
                    if client.is_connected() {
                        tokio::select! {
                            _ = shared.cancel.cancelled() => return,
                            _ = tokio::time::sleep(SUB_RETRY) => {}
                        }
                    }
                }
            }
        }
    }
}

/// How many refused subscriptions a link keeps for its device to read.
pub const MAX_REFUSALS_KEPT: usize = 64;

/// What a hub reported about topics, newest last: subscriptions it refused
/// ([`HubLink::refused_subscriptions`]), or frames trimmed before the
/// receive stream pushed them ([`HubLink::frames_missed`]). The device
/// turns each into an event, so it reaches the app, not only the log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RefusalLog {
    /// Refusals since the link started (also those no longer kept).
    pub total: u64,
    /// The newest [`MAX_REFUSALS_KEPT`] refusals: the topic and the hub's
    /// answer.
    pub recent: std::collections::VecDeque<(TopicId, HubError)>,
}

impl RefusalLog {
    fn push(&mut self, topic: TopicId, e: HubError) {
        self.total += 1;
        if self.recent.len() == MAX_REFUSALS_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back((topic, e));
    }
}

/// The reconnecting connection of a device to one hub. Cheap to clone; all
/// clones share one connection, and it ends when [`HubLink::stop`] is called
/// or the last clone is dropped.
#[derive(Clone)]
pub struct HubLink {
    inner: Arc<LinkInner>,
}

struct LinkInner {
    shared: Arc<Shared>,
}

impl Drop for LinkInner {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

impl std::fmt::Debug for HubLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubLink")
            .field("url", &self.inner.shared.url)
            .field("status", &*self.inner.shared.status.borrow())
            .finish()
    }
}

impl HubLink {
    /// Start the link to `url` (a trailing `/` is dropped) as `key`, and
    /// spawn its task, which connects at once and reconnects for as long as
    /// the link lives. Jitter is drawn from `rng`.
    ///
    /// Must be called inside a tokio runtime.
    pub fn start(
        url: &str,
        key: SigningKey,
        connector: Arc<dyn Connector>,
        config: LinkConfig,
        rng: SharedRng,
    ) -> HubLink {
        let url = url.trim_end_matches('/').to_string();
        let (status, _) = watch::channel(LinkStatus::Connecting);
        let (store_id, _) = watch::channel(None);
        let (conn, _) = watch::channel(Conn::Down);
        let shared = Arc::new(Shared {
            url: url.clone(),
            key,
            connector,
            config,
            rng,
            status,
            store_id,
            connections: watch::Sender::new(0),
            refusals: watch::Sender::new(RefusalLog::default()),
            missed: watch::Sender::new(RefusalLog::default()),
            conn,
            state: Mutex::new(State::default()),
            sub_lock: tokio::sync::Mutex::new(()),
            retry: Notify::new(),
            wake: Notify::new(),
            sub_wake: Notify::new(),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
        });
        let span = tracing::info_span!("hub_link", url = %url);
        shared
            .tasks
            .spawn(run(shared.clone()).instrument(span.clone()));
        shared
            .tasks
            .spawn(subscription_worker(shared.clone()).instrument(span));
        HubLink {
            inner: Arc::new(LinkInner { shared }),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// The hub URL, without a trailing `/`.
    pub fn url(&self) -> &str {
        &self.shared().url
    }

    /// The link's status, now and as it changes. `Stopped` is the last
    /// value ever published.
    pub fn status(&self) -> watch::Receiver<LinkStatus> {
        self.shared().status.subscribe()
    }

    /// The identity of the hub's store as of the last connection that came
    /// up (authenticated, re-subscribed, receive stream resumed); `None`
    /// before the first. A new value means the hub behind this URL now
    /// serves another store: the link has already started receiving from
    /// the beginning of it (see the module doc), and whatever the device
    /// knows of that hub's heads and sequence numbers is stale.
    ///
    /// A hub restored from an older copy of its own store keeps its
    /// identity, so this does not change for it; compare heads as well.
    pub fn store_id(&self) -> watch::Receiver<Option<StoreId>> {
        self.shared().store_id.subscribe()
    }

    /// How many connections have come up since the link was made, as it
    /// changes. Unlike [`Self::status`], whose watchers may see only the
    /// last of a quick down and up, every new connection moves it: what the
    /// hub pushed to the one before may have a gap before what the new one
    /// pushes, if the hub lost subscriptions in between.
    pub fn connections(&self) -> watch::Receiver<u64> {
        self.shared().connections.subscribe()
    }

    /// Whether a connection is up right now (a request made now is sent at
    /// once).
    pub fn is_connected(&self) -> bool {
        self.shared().current_client().is_some()
    }

    /// Skip the backoff wait in progress and attempt at once. No effect
    /// while connected or while an attempt is running.
    pub fn retry_now(&self) {
        self.shared().retry.notify_waiters();
    }

    /// Wait until the link is connected, at most `timeout`. Answers whether
    /// it is (false on timeout or when the link stopped).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait_connected(&self, timeout: Duration) -> bool {
        matches!(
            tokio::time::timeout(timeout, self.shared().wait_up()).await,
            Ok(Some(_))
        )
    }

    /// Route `topic`'s deliveries to the returned receiver (it holds
    /// [`ROUTE_CAPACITY`]; deliveries beyond wait in the link's buffer).
    /// Deliveries that arrived before, while the topic had no route, come
    /// first, in order. The hub subscription (with `retention_secs`, `None`
    /// for the hub's default) is made now if connected, or as part of the
    /// next connection, and again on every reconnect; a refusal (for
    /// example `RetentionTooLong`) is logged, and
    /// [`HubLink::flush_subscriptions`] reports it.
    ///
    /// A second call for the same topic replaces the first receiver, which
    /// then ends. After [`HubLink::stop`] the receiver is closed at once.
    /// Consumers ack what they processed with [`HubLink::ack`] and must
    /// tolerate a delivery twice.
    pub fn subscribe(
        &self,
        topic: TopicId,
        retention_secs: Option<u64>,
    ) -> mpsc::Receiver<Delivery> {
        let (tx, rx) = mpsc::channel(ROUTE_CAPACITY);
        let shared = self.shared();
        {
            let mut st = lock(&shared.state);
            if st.stopped {
                return rx;
            }
            st.forget_unsubscribed(&topic);
            st.routes
                .insert(topic.clone(), Route { tx, retention_secs });
            st.dirty.insert(topic.clone());
            st.drain(&topic);
        }
        shared.sub_wake.notify_one();
        shared.wake.notify_one();
        rx
    }

    /// Stop routing `topic` (its receiver ends, queued deliveries are acked
    /// and dropped, late ones too) and unsubscribe at the hub: now if
    /// connected, else on the next connection. Best effort: failures are
    /// logged.
    ///
    /// # Cancel safety
    /// Cancel safe: routing stops before the first await; an interrupted
    /// hub unsubscribe is retried on the next connection.
    pub async fn unsubscribe(&self, topic: &TopicId) {
        let shared = self.shared();
        let queued = {
            let mut st = lock(&shared.state);
            st.routes.remove(topic);
            st.remember_unsubscribed(topic.clone());
            st.unsub_unconfirmed.insert(topic.clone());
            st.dirty.insert(topic.clone());
            st.discard(topic)
        };
        shared.wake.notify_one();
        let Some(client) = shared.current_client() else {
            return;
        };
        if let Err(e) = shared.sync_topics(&client, Pace::Defer).await {
            tracing::debug!(?topic, error = %e, "unsubscribe not confirmed yet");
        }
        if !queued.is_empty() {
            shared.ack_on(&client, queued).await;
        }
    }

    /// Subscriptions the hub refused (too many subscriptions, a retention
    /// too long, a topic not this device's to read, ...), newest last;
    /// changes each time the hub refuses one.
    pub fn refused_subscriptions(&self) -> watch::Receiver<RefusalLog> {
        self.shared().refusals.subscribe()
    }

    /// The hub's `FramesMissed` notices on this link's receive streams:
    /// frames of a topic trimmed (by log depth or retention) before they
    /// were pushed, which no hub read here can bring back.
    pub fn frames_missed(&self) -> watch::Receiver<RefusalLog> {
        self.shared().missed.subscribe()
    }

    /// Make every subscribe and unsubscribe requested so far take effect at
    /// the hub, waiting for a connection up to the request timeout. After
    /// `Ok`, a publish on a subscribed topic reaches this link.
    ///
    /// # Errors
    /// `NotConnected`, `Stopped`, `Client` with the first refusal or the
    /// failure that interrupted it.
    ///
    /// # Cancel safety
    /// Cancel safe: unfinished topics stay queued for the next sync.
    pub async fn flush_subscriptions(&self) -> Result<(), LinkError> {
        let client = self.connected().await?;
        match self.shared().sync_topics(&client, Pace::Wait).await {
            Ok(None) => Ok(()),
            Ok(Some(refused)) => Err(LinkError::Client(ClientError::Hub(refused))),
            Err(e) => Err(LinkError::Client(e)),
        }
    }

    /// Acknowledge deliveries ([`Delivery::frame_ref`]) so the hub does not
    /// push them again. Best effort: acks made while disconnected, or lost
    /// with the connection, are dropped and the hub pushes the frames again.
    ///
    /// # Cancel safety
    /// Cancel safe: an interrupted ack may or may not have reached the hub;
    /// at worst the deliveries come again.
    pub async fn ack(&self, frames: Vec<FrameRef>) {
        if frames.is_empty() {
            return;
        }
        let shared = self.shared();
        match shared.current_client() {
            Some(client) => shared.ack_on(&client, frames).await,
            None => tracing::debug!(count = frames.len(), "ack dropped: not connected"),
        }
    }

    /// A live connection, waiting up to the request timeout.
    async fn connected(&self) -> Result<HubClient, LinkError> {
        let shared = self.shared();
        if lock(&shared.state).stopped {
            return Err(LinkError::Stopped);
        }
        let limit = shared.config.client.request_timeout;
        match tokio::time::timeout(limit, shared.wait_up()).await {
            Ok(Some(c)) => Ok(c),
            Ok(None) => Err(LinkError::Stopped),
            Err(_) => Err(LinkError::NotConnected {
                url: shared.url.clone(),
            }),
        }
    }

    /// Publish a frame (see [`HubClient::publish`]): a lost compare-and-set
    /// or a duplicate is an `Ok` outcome.
    ///
    /// # Errors
    /// `NotConnected` when no connection came up within the request
    /// timeout (nothing sent), `Stopped`, or `Client`: `Disconnected` when
    /// the connection dropped before the answer (retry with the same
    /// publish id), `Timeout`, `Hub` with the hub's refusal.
    ///
    /// # Cancel safety
    /// Cancel safe for the link, but the publish may still take effect:
    /// retry with the same publish id.
    pub async fn publish(&self, p: Publish) -> Result<PublishOutcome, LinkError> {
        Ok(self.connected().await?.publish(p).await?)
    }

    /// Read a topic's log after `after`, at most `limit` frames (see
    /// [`HubClient::fetch`]).
    ///
    /// # Errors
    /// As [`HubLink::publish`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn fetch(
        &self,
        topic: &TopicId,
        after: u64,
        limit: u32,
    ) -> Result<FetchResult, LinkError> {
        Ok(self.connected().await?.fetch(topic, after, limit).await?)
    }

    /// Upload key packages and optionally the last resort; answers the pool
    /// size.
    ///
    /// # Errors
    /// As [`HubLink::publish`].
    ///
    /// # Cancel safety
    /// Cancel safe for the link; the upload may still take effect.
    pub async fn upload_key_packages(
        &self,
        packages: Vec<Vec<u8>>,
        last_resort: Option<Vec<u8>>,
    ) -> Result<u32, LinkError> {
        Ok(self
            .connected()
            .await?
            .upload_key_packages(packages, last_resort)
            .await?)
    }

    /// The SHA-256 of each of this device's pool packages on the hub.
    ///
    /// # Errors
    /// As [`HubLink::publish`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn list_key_packages(&self) -> Result<Vec<[u8; 32]>, LinkError> {
        Ok(self.connected().await?.list_key_packages().await?)
    }

    /// Replace this device's whole key package pool on the hub; answers
    /// the pool size.
    ///
    /// # Errors
    /// As [`HubLink::publish`].
    ///
    /// # Cancel safety
    /// Cancel safe for the link; the replacement may still take effect.
    pub async fn replace_key_packages(
        &self,
        packages: Vec<Vec<u8>>,
        last_resort: Option<Vec<u8>>,
    ) -> Result<u32, LinkError> {
        Ok(self
            .connected()
            .await?
            .replace_key_packages(packages, last_resort)
            .await?)
    }

    /// Claim one key package of `device`: `(package, is_last_resort)`.
    ///
    /// # Errors
    /// As [`HubLink::publish`]; `Client(Hub(NoKeyPackage))` when none is
    /// left.
    ///
    /// # Cancel safety
    /// Cancel safe for the link, but a claim that reached the hub consumed
    /// the package.
    pub async fn claim_key_package(&self, device: DeviceId) -> Result<(Vec<u8>, bool), LinkError> {
        Ok(self.connected().await?.claim_key_package(device).await?)
    }

    /// This device's key package pool size and whether it has a last
    /// resort.
    ///
    /// # Errors
    /// As [`HubLink::publish`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn key_package_status(&self) -> Result<(u32, bool), LinkError> {
        Ok(self.connected().await?.key_package_status().await?)
    }

    /// End the link: close the connection, end every receiver, fail waiting
    /// and later requests with `Stopped`, publish `Stopped`, and join the
    /// link's tasks. Idempotent; concurrent calls all wait for the end.
    ///
    /// # Cancel safety
    /// Cancel safe: the link stops regardless; only the join is abandoned.
    pub async fn stop(&self) {
        let shared = self.shared();
        shared.cancel.cancel();
        shared.tasks.close();
        shared.tasks.wait().await;
        // The main task already did this, unless it panicked.
        if *shared.status.borrow() != LinkStatus::Stopped {
            shared.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn backoff_without_jitter_doubles_and_is_capped() {
        let mut b =
            ReconnectBackoff::new(ms(250), Duration::from_secs(30), 0.0, SharedRng::seeded(1));
        let got: Vec<Duration> = (0..12).map(|_| b.next_delay()).collect();
        let want: Vec<Duration> = [
            250, 500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000, 30000, 30000,
        ]
        .into_iter()
        .map(ms)
        .collect();
        assert_eq!(got, want);
        b.reset();
        assert_eq!(b.next_delay(), ms(250));
        assert_eq!(b.next_delay(), ms(500));
    }

    #[test]
    fn backoff_jitter_stays_below_the_step_and_replays_with_the_seed() {
        let run = |seed| {
            let mut b = ReconnectBackoff::new(ms(100), ms(1600), 0.5, SharedRng::seeded(seed));
            (0..10).map(|_| b.next_delay()).collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7), "same seed, same delays");
        assert_ne!(a, run(8), "another seed, other delays");
        let steps = [100, 200, 400, 800, 1600, 1600, 1600, 1600, 1600, 1600];
        for (d, step) in a.iter().zip(steps) {
            assert!(
                *d <= ms(step) && *d > ms(step / 2),
                "{d:?} outside ({}/2, {}]",
                step,
                step
            );
        }
    }

    #[test]
    fn backoff_guards_odd_settings() {
        // Zero base: never a busy loop.
        let mut b = ReconnectBackoff::new(Duration::ZERO, ms(10), 0.0, SharedRng::seeded(1));
        assert_eq!(b.next_delay(), MIN_BACKOFF);
        // Base above the cap: the cap.
        let mut b = ReconnectBackoff::new(ms(50), ms(10), 0.0, SharedRng::seeded(1));
        assert_eq!(b.next_delay(), ms(10));
        // Out-of-range jitter is clamped.
        assert_eq!(jittered(ms(100), 2.0, 0.5), ms(50));
        assert_eq!(jittered(ms(100), -1.0, 0.5), ms(100));
        assert_eq!(jittered(ms(100), f64::NAN, 0.5), ms(100));
        assert_eq!(jittered(ms(100), 0.5, 0.0), ms(100));
        assert_eq!(jittered(ms(100), 1.0, 1.0), Duration::ZERO);
    }

    #[test]
    fn another_store_is_told_the_same_one_is_not() {
        let (a, b) = (StoreId([1; 16]), StoreId([2; 16]));
        let mut st = State::default();
        assert_eq!(st.enter_store(a), None, "the first store is no change");
        assert_eq!(st.enter_store(a), None);
        assert_eq!(st.enter_store(b), Some(a));
    }

    fn delivery(id: u64, topic: &str) -> Delivery {
        Delivery {
            topic: TopicId::from(topic),
            seq: id,
            class: crate::wire::RetentionClass::Mailbox,
            sender: DeviceId([0; 32]),
            publish_id: crate::wire::PublishId([0; 32]),
            published_at_ms: 0,
            payload: Vec::new(),
        }
    }

    #[test]
    fn unrouted_deliveries_wait_then_overflow_asks_for_a_resync() {
        let mut st = State::default();
        let mut ack = Vec::new();
        for id in 1..=BUFFER_CAPACITY as u64 {
            st.accept(delivery(id, "a"), &mut ack);
        }
        assert_eq!(st.pending_total, BUFFER_CAPACITY);
        assert!(!st.needs_resync());
        st.accept(delivery(5000, "b"), &mut ack);
        assert_eq!(st.pending_total, BUFFER_CAPACITY, "dropped, not queued");
        assert!(st.dropped.contains(&TopicId::from("b")));
        assert!(!st.needs_resync(), "b has no route yet");
        // Route b: it has nothing queued, so its loss is fetched again now.
        let (tx, _rx) = mpsc::channel(4);
        st.routes.insert(
            TopicId::from("b"),
            Route {
                tx,
                retention_secs: None,
            },
        );
        assert!(st.needs_resync());
        assert!(ack.is_empty());
        // A new connection forgets the queues.
        st.reset_for_connect();
        assert_eq!(st.pending_total, 0);
        assert!(!st.needs_resync());
    }

    #[test]
    fn routed_deliveries_keep_order_through_a_full_receiver() {
        let mut st = State::default();
        let (tx, mut rx) = mpsc::channel(2);
        st.routes.insert(
            TopicId::from("a"),
            Route {
                tx,
                retention_secs: None,
            },
        );
        let mut ack = Vec::new();
        for id in 1..=5 {
            st.accept(delivery(id, "a"), &mut ack);
        }
        assert_eq!(st.pending_total, 3);
        let mut got = Vec::new();
        while let Ok(d) = rx.try_recv() {
            got.push(d.seq);
        }
        st.drain(&TopicId::from("a"));
        while let Ok(d) = rx.try_recv() {
            got.push(d.seq);
        }
        st.drain(&TopicId::from("a"));
        while let Ok(d) = rx.try_recv() {
            got.push(d.seq);
        }
        assert_eq!(got, vec![1, 2, 3, 4, 5]);
        assert_eq!(st.pending_total, 0);
    }
}
