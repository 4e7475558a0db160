//! The durable outbox: every publish the device owes a hub.
//!
//! A hub outage or a device crash loses nothing that reached the outbox: each
//! owed publish is an [`OutboxEntry`] in the device's [`KvStore`], and
//! [`Outbox::run`] keeps sending it until the hub answers, the hub refuses
//! it for good, or it grows older than [`OutboxConfig::max_age`].
//!
//! # States
//!
//! ```text
//!  stage/enqueue ──► Pending ──► Sent ──┬──► (deleted)          accepted, duplicate,
//!                       │          ▲    │                       history_missing on a replay
//!                       │          └────┤ retry (backoff)
//!                       │               ├──► Done + last_error  refused by the hub
//!                       └───────────────┴──► Expired            older than max_age
//! ```
//!
//! - `Pending`: owed, never handed to the hub, so the hub cannot hold it.
//! - `Sent`: handed to the hub at least once; the answer is not known, or it
//!   was a transient failure and the entry waits for `next_attempt_ms`.
//! - `Done`: finished. A delivered entry (accepted, duplicate, or
//!   history_missing for a `replay_only` publish) is deleted in the very batch
//!   that finishes it, so `Done` is only ever *stored* for a refused entry,
//!   with the hub's reason in `last_error`.
//! - `Expired`: given up on, never delivered.
//!
//! Refused and expired entries stay readable through [`Outbox::entries`] for
//! [`FAILURE_GRACE`] (their `next_attempt_ms` is then the time they are
//! deleted), so an app can see what failed; the [`OutboxMetrics`] counters
//! count every outcome either way.
//!
//! # Durability
//!
//! An entry exists once the batch carrying it is applied, and survives a
//! crash once that batch is flushed. [`Outbox::enqueue`] applies and flushes
//! its own batch; [`Outbox::stage`] only adds to the caller's batch, so the
//! entry lands atomically with the caller's own change and is exactly as
//! durable as the caller's flush makes it. The driver never flushes: every
//! mark it writes (`Sent`, a retry time, a deletion) is safe to lose, since
//! the worst case is a resend that the hub answers `duplicate`.
//!
//! # Order
//!
//! Entries of one hub are handed to the sink in creation order, and an entry
//! waiting for its retry time holds back every younger entry of its hub.
//! Up to [`OutboxConfig::batch`] entries of one hub are in flight at once;
//! after a transient failure the hub is probed with its oldest entry alone
//! until that succeeds. So a hub that handles requests in arrival order and
//! fails a suffix of them (an outage, a rate limit) stores them in creation
//! order; only a hub that accepts a younger entry while failing an older one
//! in the same window can hold them out of order. Hubs never wait for each
//! other.
//!
//! # Store layout
//!
//! - `outbox/e/` + hub length (u64 BE) + hub + sequence (u64 BE) → the
//!   postcard-encoded [`OutboxEntry`]. The sequence grows across all hubs,
//!   so key order within a hub is creation order.
//! - `outbox/i/` + hub length (u64 BE) + hub + publish id → the sequence
//!   (u64 BE), so staging the same publish twice finds the first entry.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::client::ClientError;
use crate::clock::Clock;
use crate::kv::{prefix_end, KvError, KvStore, WriteBatch};
use crate::rng::SharedRng;
use crate::wire::{ExpectedHead, HubError, Publish, PublishId, PublishOutcome};

/// How long a refused or expired entry stays readable through
/// [`Outbox::entries`] before the driver deletes it. Delivered entries are
/// deleted at once.
pub const FAILURE_GRACE: Duration = Duration::from_secs(10 * 60);

const ENTRY_PREFIX: &[u8] = b"outbox/e/";
const INDEX_PREFIX: &[u8] = b"outbox/i/";
/// Page size of whole-outbox scans that are not bounded by the config's
/// `batch` (opening, [`Outbox::entries`]).
const SCAN_PAGE: usize = 1024;
/// The shortest retry delay, so a sink that keeps answering "retry after
/// zero" cannot spin the driver without time moving (under simulated time
/// that would never end).
const MIN_RETRY: Duration = Duration::from_millis(1);

/// Where an entry is in its life; see the module doc for the transitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutboxState {
    /// Owed and never handed to the hub.
    Pending,
    /// Handed to the hub at least once, outcome not known yet (or a
    /// transient failure, waiting for `next_attempt_ms`).
    Sent,
    /// Finished. Stored only for a refused entry (with `last_error`), until
    /// [`FAILURE_GRACE`] has passed; delivered entries are deleted instead.
    Done,
    /// Not delivered within [`OutboxConfig::max_age`]; kept for
    /// [`FAILURE_GRACE`], then deleted.
    Expired,
}

/// One publish owed to one hub, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxEntry {
    /// The hub URL it is owed to.
    pub hub: String,
    /// The publish, sent unchanged on every attempt (same `publish_id`, so
    /// the hub recognises a resend as a duplicate).
    pub publish: Publish,
    /// Where it is in its life.
    pub state: OutboxState,
    /// When it was staged ([`Clock`] ms); it expires at `created_ms + max_age`.
    pub created_ms: u64,
    /// How many times it was handed to the sink.
    pub attempts: u32,
    /// For `Pending` and `Sent`: not sent again before this time ([`Clock`]
    /// ms). For `Done` and `Expired`: when the record is deleted.
    pub next_attempt_ms: u64,
    /// Why the last attempt failed, the hub's refusal, or why it expired.
    pub last_error: Option<String>,
}

/// How the outbox retries and gives up.
#[derive(Clone, Debug)]
pub struct OutboxConfig {
    /// An entry not delivered within this long after staging expires
    /// (default 7 days).
    pub max_age: Duration,
    /// Delay after the first failed attempt; each further failure doubles it
    /// (default 250 ms).
    pub retry_base: Duration,
    /// The largest delay between attempts (default 30 s). A hub's own
    /// `after` (rate limiting) is obeyed even when longer.
    pub retry_max: Duration,
    /// Randomisation in `[0, 1]`: each delay is shortened by a random
    /// fraction of up to this much, drawn from the injected [`SharedRng`], so
    /// devices that lost the same hub do not come back in step (default 0.5).
    pub jitter: f64,
    /// At most this many entries of one hub in flight at once, and the page
    /// size of the driver's reads (default 64).
    pub batch: usize,
    /// The outbox is full once this many entries are owed (default 4,096):
    /// [`Outbox::wait_for_room`] waits and [`Outbox::has_room`] answers
    /// `false` until the driver delivers, refuses or expires some. This is
    /// what bounds a device's memory and disk when an app sends faster than
    /// its hubs take, or while they are down. Staging itself never refuses,
    /// so a commit's own publishes are not held up by app traffic; callers
    /// that produce unbounded work ([`crate::device::Device::send`]) check
    /// for room first.
    pub max_owed: usize,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        Self {
            max_age: Duration::from_secs(7 * 24 * 60 * 60),
            retry_base: Duration::from_millis(250),
            retry_max: Duration::from_secs(30),
            jitter: 0.5,
            batch: 64,
            max_owed: 4096,
        }
    }
}

/// Why an outbox operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutboxError {
    /// The store failed, or holds a value that does not decode.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The publish carries a compare-and-set condition. The outbox resends
    /// blindly, possibly much later, so a condition would be stale by then;
    /// conditional publishes go through the commit lane instead.
    #[error("the outbox holds unconditional publishes only; {publish_id:?} for {hub} expects {expected_head:?}")]
    ConditionalPublish {
        /// The hub it was meant for.
        hub: String,
        /// The publish's id.
        publish_id: PublishId,
        /// The condition it carried.
        expected_head: ExpectedHead,
    },
    /// An entry with this publish id is already owed to this hub with
    /// different content (the hub would answer `conflict`).
    #[error("publish id {publish_id:?} is already owed to {hub} with different content")]
    IdReused {
        /// The hub.
        hub: String,
        /// The publish id used twice.
        publish_id: PublishId,
    },
    /// The configuration cannot work; the text says why.
    #[error("invalid outbox config: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
    /// An entry could not be encoded (a bug: every field is encodable).
    #[error("cannot encode an outbox entry: {reason}")]
    Encode {
        /// What the encoder said.
        reason: String,
    },
}

/// What a sink says when a publish did not produce a [`PublishOutcome`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendFailure {
    /// Transient (no connection, timeout, rate limited, hub busy): send it
    /// again later, after `after` when given, else after the backoff delay.
    Retry {
        /// What went wrong, kept in the entry's `last_error`.
        reason: String,
        /// The hub's own "retry after" (rate limiting).
        after: Option<Duration>,
    },
    /// The hub refused this publish for good; it is finished with this error.
    Refused(HubError),
}

impl SendFailure {
    /// How a [`ClientError`] from a publish maps onto the outbox's decision:
    /// connection-level failures, rate limiting and a hub that is shutting
    /// down or failing internally, and a storage quota the device is over
    /// for now, are transient; a hub error that judges the publish itself
    /// (size, topic, retention, conflict, not authorized) is a refusal.
    pub fn from_client_error(e: ClientError) -> SendFailure {
        let retry = |reason: String| SendFailure::Retry {
            reason,
            after: None,
        };
        match e {
            ClientError::Hub(h) => match h {
                HubError::RateLimited { retry_after_ms, .. } => SendFailure::Retry {
                    reason: h.to_string(),
                    after: Some(Duration::from_millis(retry_after_ms)),
                },
                // Nothing about the publish itself: the connection or the
                // hub's state is at fault, and a later attempt can succeed.
                HubError::ShuttingDown
                | HubError::Internal { .. }
                | HubError::NotAuthenticated
                | HubError::AlreadyAuthenticated
                | HubError::UnsupportedVersion { .. }
                | HubError::BadSignature
                | HubError::UnknownChallenge
                | HubError::ChallengeReplayed
                | HubError::ChallengeExpired
                | HubError::WrongHub { .. }
                | HubError::ReceiveReplaced
                // Room comes back as the device's stored frames are acked,
                // trimmed or expire; the entry's maximum age still ends it.
                | HubError::StorageQuotaExceeded { .. }
                // The owner has not read its mailbox yet.
                | HubError::MailboxFull { .. }
                // A notice of the receive stream, never a publish answer.
                | HubError::FramesMissed { .. } => retry(h.to_string()),
                HubError::Malformed { .. }
                | HubError::FrameTooLarge { .. }
                | HubError::UnknownFrameKind { .. }
                | HubError::UnknownOperation { .. }
                | HubError::TextFrame
                | HubError::PayloadTooLarge { .. }
                | HubError::BadTopic { .. }
                | HubError::HeadConditionOnMailbox
                | HubError::TooManySubscriptions { .. }
                | HubError::RetentionTooLong { .. }
                | HubError::BadFetchLimit { .. }
                | HubError::TooManyAcks { .. }
                | HubError::TooManyChanges { .. }
                | HubError::BadKeyPackage { .. }
                | HubError::KeyPackagePoolFull { .. }
                | HubError::NoKeyPackage
                | HubError::NotAuthorized
                | HubError::Conflict { .. } => SendFailure::Refused(h),
            },
            other @ (ClientError::Connect { .. }
            | ClientError::Handshake { .. }
            | ClientError::Timeout { .. }
            | ClientError::Disconnected
            | ClientError::NotSent { .. }
            | ClientError::Protocol(_)
            | ClientError::Version { .. }) => retry(other.to_string()),
        }
    }
}

/// Where the driver hands publishes: in production the device's hub links,
/// in tests a script.
pub trait OutboxSink: Send + Sync + 'static {
    /// Publish `p` on `hub`.
    ///
    /// The outbox calls this for the entries of one hub in creation order,
    /// and polls the returned futures in that order, so a sink that queues
    /// the request on its first poll (or in this call) keeps that order on
    /// the wire. The future may be dropped before it completes (shutdown);
    /// the publish is then sent again later under the same id.
    fn publish(
        &self,
        hub: &str,
        p: Publish,
    ) -> BoxFuture<'static, Result<PublishOutcome, SendFailure>>;
}

/// Counts of what the driver did since [`Outbox::open`] (in memory only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutboxMetrics {
    /// Publishes handed to the sink, every attempt counted.
    pub sent: u64,
    /// Entries delivered: accepted, duplicate, or history_missing for a
    /// `replay_only` publish. Refused and expired entries are not in here.
    pub done: u64,
    /// Of `done`, those the hub answered `duplicate` (a resend after a lost
    /// answer or a crash).
    pub duplicates: u64,
    /// Attempts that failed transiently and were scheduled again.
    pub retries: u64,
    /// Entries given up on after `max_age`.
    pub expired: u64,
    /// Entries the hub refused for good (including a `conflict`).
    pub refused: u64,
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    done: AtomicU64,
    duplicates: AtomicU64,
    retries: AtomicU64,
    expired: AtomicU64,
    refused: AtomicU64,
}

/// Outcomes of one pass, added to [`Counters`] only once its batch is
/// applied, so a failed apply (whose work is redone) is not counted twice.
#[derive(Default)]
struct Tally {
    sent: u64,
    done: u64,
    duplicates: u64,
    retries: u64,
    expired: u64,
    refused: u64,
}

impl Tally {
    fn add_to(&self, c: &Counters) {
        c.sent.fetch_add(self.sent, Ordering::Relaxed);
        c.done.fetch_add(self.done, Ordering::Relaxed);
        c.duplicates.fetch_add(self.duplicates, Ordering::Relaxed);
        c.retries.fetch_add(self.retries, Ordering::Relaxed);
        c.expired.fetch_add(self.expired, Ordering::Relaxed);
        c.refused.fetch_add(self.refused, Ordering::Relaxed);
    }
}

/// A staged entry whose batch may not be applied yet: lets a second `stage`
/// of the same publish before that apply reuse the same key.
struct Reservation {
    seq: u64,
    created_ms: u64,
    digest: [u8; 32],
}

struct StageState {
    next_seq: u64,
    reserved: BTreeMap<(String, PublishId), Reservation>,
    /// Entries owed: counted when a new entry is staged, uncounted when the
    /// driver finishes one. An entry staged into a batch its caller then
    /// dropped stays counted until the outbox is reopened: the count may run
    /// high, never low, so the bound holds.
    owed: usize,
}

struct Inner {
    kv: Arc<dyn KvStore>,
    clock: Clock,
    rng: SharedRng,
    config: OutboxConfig,
    stage: Mutex<StageState>,
    wake: Notify,
    /// Woken whenever entries are finished, for [`Outbox::wait_for_room`].
    room: Notify,
    running: AtomicBool,
    counters: Counters,
}

/// The durable outbox of one device. Cheap to clone; clones share one
/// queue. Only one [`Outbox`] (with its clones) may be open over one store.
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section leaves the state whole before anything that
    // could panic, so a poisoned lock holds consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn hub_part(prefix: &[u8], hub: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + 8 + hub.len() + 32);
    k.extend_from_slice(prefix);
    // The length prefix keeps one hub's keys from being a prefix of another
    // hub's ("a" vs "ab").
    k.extend_from_slice(&(hub.len() as u64).to_be_bytes());
    k.extend_from_slice(hub.as_bytes());
    k
}

fn entry_key(hub: &str, seq: u64) -> Vec<u8> {
    let mut k = hub_part(ENTRY_PREFIX, hub);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

fn index_key(hub: &str, id: &PublishId) -> Vec<u8> {
    let mut k = hub_part(INDEX_PREFIX, hub);
    k.extend_from_slice(&id.0);
    k
}

/// The hub and sequence of an entry key, or `None` for a malformed key.
fn parse_entry_key(key: &[u8]) -> Option<(String, u64)> {
    let rest = key.strip_prefix(ENTRY_PREFIX)?;
    let (len, rest) = rest.split_first_chunk::<8>()?;
    let len = usize::try_from(u64::from_be_bytes(*len)).ok()?;
    if rest.len() != len.checked_add(8)? {
        return None;
    }
    let (hub, seq) = rest.split_at(len);
    let hub = String::from_utf8(hub.to_vec()).ok()?;
    let seq = u64::from_be_bytes(seq.try_into().ok()?);
    Some((hub, seq))
}

/// The smallest key after `key`, to resume a range read.
fn successor(key: &[u8]) -> Vec<u8> {
    let mut k = key.to_vec();
    k.push(0);
    k
}

fn corrupt(key: &[u8], reason: impl ToString) -> KvError {
    KvError::Corrupt {
        key: hex::encode(key),
        reason: reason.to_string(),
    }
}

fn decode_entry(key: &[u8], value: &[u8]) -> Result<OutboxEntry, KvError> {
    postcard::from_bytes(value).map_err(|e| corrupt(key, e))
}

fn encode_entry(entry: &OutboxEntry) -> Result<Vec<u8>, OutboxError> {
    postcard::to_allocvec(entry).map_err(|e| OutboxError::Encode {
        reason: e.to_string(),
    })
}

fn publish_digest(p: &Publish) -> Result<[u8; 32], OutboxError> {
    let bytes = postcard::to_allocvec(p).map_err(|e| OutboxError::Encode {
        reason: e.to_string(),
    })?;
    Ok(Sha256::digest(&bytes).into())
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn earliest(slot: &mut Option<u64>, at: u64) {
    *slot = Some(slot.map_or(at, |s| s.min(at)));
}

fn validate(config: &OutboxConfig) -> Result<(), OutboxError> {
    let bad = |reason: &str| {
        Err(OutboxError::InvalidConfig {
            reason: reason.to_string(),
        })
    };
    if config.max_age.is_zero() {
        return bad("max_age must be positive");
    }
    if config.retry_base.is_zero() {
        return bad("retry_base must be positive");
    }
    if config.retry_max < config.retry_base {
        return bad("retry_max must be at least retry_base");
    }
    if !(0.0..=1.0).contains(&config.jitter) {
        return bad("jitter must be within 0..=1");
    }
    if config.batch == 0 {
        return bad("batch must be at least 1");
    }
    if config.max_owed == 0 {
        return bad("max_owed must be at least 1");
    }
    Ok(())
}

/// One entry handed to the sink, with what the sink answered.
struct Attempt {
    seq: u64,
    entry: OutboxEntry,
    answer: Result<PublishOutcome, SendFailure>,
}

/// What one round of sends to one hub came back with.
struct Round {
    hub: String,
    attempts: Vec<Attempt>,
}

/// State of one [`Outbox::run`] call that need not outlive it.
#[derive(Default)]
struct Driver {
    /// Hubs with a round in flight: not planned again until it returns.
    busy: BTreeSet<String>,
    /// Hubs whose last round had a transient failure: sent one entry at a
    /// time until one gets through, so an outage is probed, not flooded.
    probing: BTreeSet<String>,
}

/// Clears the single-driver flag however `run` ends, including by drop.
struct RunGuard<'a>(&'a AtomicBool);

impl Drop for RunGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Outbox {
    /// Open the outbox kept in `kv`, resuming whatever a previous run left
    /// (entries in state `Sent` are sent again by [`Outbox::run`]).
    ///
    /// `clock` stamps entries and decides expiry and retry times; `rng`
    /// draws the retry jitter. Stored times are `clock` times, so a reopened
    /// outbox needs a clock that continues the old one (a simulation keeps
    /// one [`Clock`] across a host's restarts; a fresh `Clock::tokio` at an
    /// earlier origin would make stored retry and expiry times lie in its
    /// future). Reads every entry key once, to continue the creation
    /// sequence.
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] when `config` cannot work (a zero
    /// duration, `retry_max < retry_base`, jitter outside `0..=1`, a zero
    /// batch); [`OutboxError::Kv`] when the store fails.
    pub fn open(
        kv: Arc<dyn KvStore>,
        clock: Clock,
        rng: SharedRng,
        config: OutboxConfig,
    ) -> Result<Outbox, OutboxError> {
        validate(&config)?;
        // The sequence only has to exceed every live entry's: a sequence
        // freed by a deleted entry may be reused, since creation order only
        // matters among entries that exist together.
        let mut next_seq = 0u64;
        let mut owed = 0usize;
        let end = prefix_end(ENTRY_PREFIX);
        let mut start = ENTRY_PREFIX.to_vec();
        loop {
            let page = kv.range(&start, end.as_deref(), SCAN_PAGE)?;
            let full = page.len() == SCAN_PAGE;
            for (key, value) in &page {
                if let Some((_, seq)) = parse_entry_key(key) {
                    next_seq = next_seq.max(seq.saturating_add(1));
                    // An entry that does not decode is never sent (the
                    // driver skips it), so it does not count as owed.
                    if let Ok(e) = decode_entry(key, value) {
                        if matches!(e.state, OutboxState::Pending | OutboxState::Sent) {
                            owed += 1;
                        }
                    }
                }
            }
            match page.last() {
                Some((key, _)) if full => start = successor(key),
                _ => break,
            }
        }
        Ok(Outbox {
            inner: Arc::new(Inner {
                kv,
                clock,
                rng,
                config,
                stage: Mutex::new(StageState {
                    next_seq,
                    reserved: BTreeMap::new(),
                    owed,
                }),
                wake: Notify::new(),
                room: Notify::new(),
                running: AtomicBool::new(false),
                counters: Counters::default(),
            }),
        })
    }

    /// Add an entry owing `publish` to `hub` to the caller's `batch`, so it
    /// lands atomically with the caller's own changes (an MLS state change,
    /// a cursor). Call [`Outbox::wake`] once the batch is applied.
    ///
    /// Idempotent on (`hub`, `publish_id`): staging a publish that is already
    /// stored (owed, or refused or expired within [`FAILURE_GRACE`]) stages
    /// nothing, and one staged into a batch not applied yet is staged again
    /// under the same key, so it stays one entry and keeps its progress. A
    /// publish staged after its entry was delivered and deleted is a new
    /// entry; the hub answers its resend `duplicate`.
    ///
    /// The entry is as durable as the caller makes the batch: it survives a
    /// crash only once the caller has applied *and flushed* it
    /// ([`Outbox::enqueue`] does both for a publish of its own).
    ///
    /// # Errors
    /// [`OutboxError::ConditionalPublish`] when `expected_head` is not
    /// `Unconditional`; [`OutboxError::IdReused`] when the same id is owed to
    /// `hub` with different content; [`OutboxError::Kv`] when the store
    /// fails. On error `batch` is unchanged.
    pub fn stage(
        &self,
        batch: &mut WriteBatch,
        hub: &str,
        publish: &Publish,
    ) -> Result<(), OutboxError> {
        if publish.expected_head != ExpectedHead::Unconditional {
            return Err(OutboxError::ConditionalPublish {
                hub: hub.to_string(),
                publish_id: publish.publish_id,
                expected_head: publish.expected_head,
            });
        }
        let inner = &self.inner;
        let id = publish.publish_id;
        let ikey = index_key(hub, &id);
        let reused = || OutboxError::IdReused {
            hub: hub.to_string(),
            publish_id: id,
        };
        // Held across the store lookup so two stages of one publish cannot
        // both miss the index and take two sequences.
        let mut st = lock(&inner.stage);
        if let Some(seq) = self.indexed_seq(&ikey)? {
            let key = entry_key(hub, seq);
            if let Some(value) = inner.kv.get(&key)? {
                st.reserved.remove(&(hub.to_string(), id));
                let existing = decode_entry(&key, &value)?;
                if existing.publish != *publish {
                    return Err(reused());
                }
                return Ok(());
            }
        }
        let digest = publish_digest(publish)?;
        let (seq, created_ms) = match st.reserved.get(&(hub.to_string(), id)) {
            Some(r) if r.digest != digest => return Err(reused()),
            Some(r) => (r.seq, r.created_ms),
            None => {
                let seq = st.next_seq;
                st.next_seq = seq.saturating_add(1);
                st.owed = st.owed.saturating_add(1);
                (seq, inner.clock.now_ms())
            }
        };
        let entry = OutboxEntry {
            hub: hub.to_string(),
            publish: publish.clone(),
            state: OutboxState::Pending,
            created_ms,
            attempts: 0,
            next_attempt_ms: created_ms,
            last_error: None,
        };
        batch.put(entry_key(hub, seq), encode_entry(&entry)?);
        batch.put(ikey, seq.to_be_bytes().to_vec());
        st.reserved.insert(
            (hub.to_string(), id),
            Reservation {
                seq,
                created_ms,
                digest,
            },
        );
        Ok(())
    }

    /// Owe `publish` to `hub` on its own: [`Outbox::stage`] into a fresh
    /// batch, apply it, flush the store, and wake the driver.
    ///
    /// When this returns `Ok`, the publish survives a crash (or was already
    /// owed or delivered). Blocks on the store's flush (on sled an fsync
    /// of its log; see docs/operations.md, "Durability").
    ///
    /// # Errors
    /// As [`Outbox::stage`], plus [`OutboxError::Kv`] when the apply or the
    /// flush fails (the entry may then exist but not be durable).
    pub fn enqueue(&self, hub: &str, publish: Publish) -> Result<(), OutboxError> {
        let mut batch = WriteBatch::new();
        self.stage(&mut batch, hub, &publish)?;
        if !batch.is_empty() {
            self.inner.kv.apply(&batch)?;
        }
        // Flushed even when the publish was already owed: the earlier stage
        // may sit in a batch its caller has not flushed yet.
        self.inner.kv.flush()?;
        self.wake();
        Ok(())
    }

    /// Tell the driver that entries may be due now. Cheap; a wake while the
    /// driver is busy is remembered, so none is lost.
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// Every stored entry, or those owed to `hub`: grouped by hub, in
    /// creation order within a hub. Includes refused and expired entries
    /// still within [`FAILURE_GRACE`].
    ///
    /// # Errors
    /// [`OutboxError::Kv`] when the store fails or an entry does not decode.
    pub fn entries(&self, hub: Option<&str>) -> Result<Vec<OutboxEntry>, OutboxError> {
        let prefix = match hub {
            Some(h) => hub_part(ENTRY_PREFIX, h),
            None => ENTRY_PREFIX.to_vec(),
        };
        let end = prefix_end(&prefix);
        let mut start = prefix;
        let mut out = Vec::new();
        loop {
            let page = self.inner.kv.range(&start, end.as_deref(), SCAN_PAGE)?;
            let full = page.len() == SCAN_PAGE;
            for (key, value) in &page {
                if parse_entry_key(key).is_none() {
                    return Err(corrupt(key, "malformed outbox key").into());
                }
                out.push(decode_entry(key, value)?);
            }
            match page.last() {
                Some((key, _)) if full => start = successor(key),
                _ => break,
            }
        }
        Ok(out)
    }

    /// How many entries are still owed (`Pending` or `Sent`), read from the
    /// store: exact, and a scan of every entry.
    ///
    /// # Errors
    /// As [`Outbox::entries`].
    pub fn pending(&self) -> Result<usize, OutboxError> {
        Ok(self
            .entries(None)?
            .iter()
            .filter(|e| matches!(e.state, OutboxState::Pending | OutboxState::Sent))
            .count())
    }

    /// How many entries are owed, from memory: what the bound of
    /// [`OutboxConfig::max_owed`] counts. At least [`Outbox::pending`]; more
    /// only by entries staged into batches that were never applied.
    pub fn owed(&self) -> usize {
        lock(&self.inner.stage).owed
    }

    /// The bound [`OutboxConfig::max_owed`].
    pub fn max_owed(&self) -> usize {
        self.inner.config.max_owed
    }

    /// Whether the outbox has room: fewer than [`OutboxConfig::max_owed`]
    /// entries are owed.
    pub fn has_room(&self) -> bool {
        self.owed() < self.inner.config.max_owed
    }

    /// Wait until the outbox has room ([`Outbox::has_room`]). Returns at
    /// once when it has. While the hubs are down this waits until they are
    /// back, or until entries expire after [`OutboxConfig::max_age`].
    ///
    /// # Cancel safety
    /// Cancel safe: it changes nothing.
    pub async fn wait_for_room(&self) {
        loop {
            // Registered before the check, so a finish between the check
            // and the wait still wakes this waiter.
            let notified = self.inner.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.has_room() {
                return;
            }
            notified.await;
        }
    }

    /// Count `n` owed entries as finished and wake whoever waits for room.
    fn finished(&self, n: u64) {
        if n == 0 {
            return;
        }
        let mut st = lock(&self.inner.stage);
        st.owed = st
            .owed
            .saturating_sub(usize::try_from(n).unwrap_or(usize::MAX));
        drop(st);
        self.inner.room.notify_waiters();
    }

    /// Whether nothing is owed: every entry was delivered, refused or
    /// expired.
    ///
    /// # Errors
    /// As [`Outbox::entries`].
    pub fn is_drained(&self) -> Result<bool, OutboxError> {
        Ok(self.pending()? == 0)
    }

    /// What the driver has done since [`Outbox::open`].
    pub fn metrics(&self) -> OutboxMetrics {
        let c = &self.inner.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        OutboxMetrics {
            sent: r(&c.sent),
            done: r(&c.done),
            duplicates: r(&c.duplicates),
            retries: r(&c.retries),
            expired: r(&c.expired),
            refused: r(&c.refused),
        }
    }

    /// The driver: sends what is owed through `sink` until `shutdown` is
    /// cancelled.
    ///
    /// Per hub, entries go out in creation order (see the module doc), each
    /// hub independently of the others. On an answer: accepted, duplicate,
    /// or history_missing for a `replay_only` publish deletes the entry;
    /// [`SendFailure::Retry`] schedules it again after `after`, or else after
    /// `retry_base` doubled per attempt up to `retry_max` and shortened by the
    /// jitter; [`SendFailure::Refused`] (and an answer that cannot come to an
    /// unconditional publish) marks it `Done` with `last_error` and logs a
    /// warning; an entry older than `max_age` is marked `Expired` without
    /// being sent. It wakes on [`Outbox::wake`] and when the next entry is
    /// due. Only one driver runs per outbox: a second call logs an error
    /// and returns at once.
    ///
    /// # Cancel safety
    /// Cancel safe, and so is cancelling `shutdown` (which returns without
    /// waiting for answers): publishes in flight are dropped and stay `Sent`
    /// (or `Pending`, if that mark was lost), so the next run sends them
    /// again under the same id and the hub answers `duplicate`.
    pub async fn run(&self, sink: Arc<dyn OutboxSink>, shutdown: CancellationToken) {
        let inner = &self.inner;
        if inner
            .running
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            tracing::error!("outbox driver already running; this second one stops");
            return;
        }
        let _guard = RunGuard(&inner.running);
        let mut driver = Driver::default();
        let mut rounds: FuturesUnordered<BoxFuture<'static, Round>> = FuturesUnordered::new();
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let wake_at = match self.plan(&sink, &mut driver, &mut rounds) {
                Ok(at) => at,
                Err(e) => {
                    // A store failure must not end the driver: what is owed
                    // stays owed, so try again after the longest backoff.
                    tracing::error!(error = %e, "outbox pass failed");
                    Some(
                        inner
                            .clock
                            .now_ms()
                            .saturating_add(ms(inner.config.retry_max)),
                    )
                }
            };
            let sleep = async {
                match wake_at {
                    Some(at) => {
                        let wait = at.saturating_sub(inner.clock.now_ms());
                        tokio::time::sleep(Duration::from_millis(wait)).await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(round) = rounds.next(), if !rounds.is_empty() => {
                    driver.busy.remove(&round.hub);
                    if let Err(e) = self.record(round, &mut driver) {
                        // The answers are lost, not the entries: they stay
                        // Sent and go out again, answered as duplicates.
                        tracing::error!(error = %e, "outbox could not record answers");
                    }
                }
                () = inner.wake.notified() => {}
                () = sleep => {}
            }
        }
    }

    fn indexed_seq(&self, ikey: &[u8]) -> Result<Option<u64>, KvError> {
        match self.inner.kv.get(ikey)? {
            None => Ok(None),
            Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                Ok(b) => Ok(Some(u64::from_be_bytes(b))),
                Err(_) => Err(corrupt(ikey, "index value is not 8 bytes")),
            },
        }
    }

    /// Stage the removal of an entry and, when it still points there, of its
    /// index key.
    fn stage_delete(
        &self,
        batch: &mut WriteBatch,
        hub: &str,
        seq: u64,
        id: &PublishId,
    ) -> Result<(), KvError> {
        batch.delete(entry_key(hub, seq));
        let ikey = index_key(hub, id);
        if self.indexed_seq(&ikey)? == Some(seq) {
            batch.delete(ikey);
        }
        Ok(())
    }

    /// Every hub with at least one entry, found by skipping from one hub's
    /// keys to the next so the cost is one read per hub.
    fn hubs(&self) -> Result<Vec<String>, KvError> {
        let end = prefix_end(ENTRY_PREFIX);
        let mut start = ENTRY_PREFIX.to_vec();
        let mut hubs = Vec::new();
        while let Some((key, _)) = self
            .inner
            .kv
            .range(&start, end.as_deref(), 1)?
            .into_iter()
            .next()
        {
            match parse_entry_key(&key) {
                Some((hub, _)) => {
                    let next = prefix_end(&hub_part(ENTRY_PREFIX, &hub));
                    hubs.push(hub);
                    match next {
                        Some(next) => start = next,
                        None => break,
                    }
                }
                None => {
                    tracing::warn!(key = %hex::encode(&key), "outbox skips a malformed key");
                    start = successor(&key);
                }
            }
        }
        Ok(hubs)
    }

    /// Forget reservations whose batch was applied (the index now answers
    /// for them) or that are so old their batch was surely dropped.
    fn prune_reservations(&self, now: u64) -> Result<(), KvError> {
        let max_age = ms(self.inner.config.max_age);
        let mut st = lock(&self.inner.stage);
        let mut gone = Vec::new();
        for ((hub, id), r) in &st.reserved {
            let stale = now >= r.created_ms.saturating_add(max_age);
            if stale || self.indexed_seq(&index_key(hub, id))?.is_some() {
                gone.push((hub.clone(), *id));
            }
        }
        for k in gone {
            st.reserved.remove(&k);
        }
        Ok(())
    }

    /// One pass over every idle hub: delete finished records past their
    /// grace, expire what is too old, mark the due window of each hub `Sent`
    /// and start its round. Answers when the next pass is needed.
    fn plan(
        &self,
        sink: &Arc<dyn OutboxSink>,
        driver: &mut Driver,
        rounds: &mut FuturesUnordered<BoxFuture<'static, Round>>,
    ) -> Result<Option<u64>, OutboxError> {
        let inner = &self.inner;
        let now = inner.clock.now_ms();
        self.prune_reservations(now)?;
        let mut wake_at = None;
        let mut batch = WriteBatch::new();
        let mut tally = Tally::default();
        let mut starts = Vec::new();
        for hub in self.hubs()? {
            if driver.busy.contains(&hub) {
                continue;
            }
            let window = if driver.probing.contains(&hub) {
                1
            } else {
                inner.config.batch
            };
            let live = self.scan_hub(&hub, now, window, &mut batch, &mut tally, &mut wake_at)?;
            let mut due = Vec::new();
            for (seq, mut entry) in live {
                if entry.next_attempt_ms > now {
                    // Holds back every younger entry of this hub.
                    earliest(&mut wake_at, entry.next_attempt_ms);
                    break;
                }
                entry.state = OutboxState::Sent;
                entry.attempts = entry.attempts.saturating_add(1);
                batch.put(entry_key(&hub, seq), encode_entry(&entry)?);
                due.push((seq, entry));
            }
            if !due.is_empty() {
                starts.push((hub, due));
            }
        }
        if !batch.is_empty() {
            inner.kv.apply(&batch)?;
        }
        for (hub, due) in starts {
            tally.sent += due.len() as u64;
            driver.busy.insert(hub.clone());
            rounds.push(send_round(sink.clone(), hub, due));
        }
        tally.add_to(&inner.counters);
        self.finished(tally.done + tally.refused + tally.expired);
        Ok(wake_at)
    }

    /// Read `hub`'s entries in creation order until `window` owed ones are
    /// found, staging the deletion of finished records past their grace and
    /// the expiry of entries past `max_age` on the way.
    fn scan_hub(
        &self,
        hub: &str,
        now: u64,
        window: usize,
        batch: &mut WriteBatch,
        tally: &mut Tally,
        wake_at: &mut Option<u64>,
    ) -> Result<Vec<(u64, OutboxEntry)>, OutboxError> {
        let config = &self.inner.config;
        let prefix = hub_part(ENTRY_PREFIX, hub);
        let end = prefix_end(&prefix);
        let mut start = prefix;
        let mut live = Vec::new();
        loop {
            let page = self.inner.kv.range(&start, end.as_deref(), config.batch)?;
            let full = page.len() == config.batch;
            for (key, value) in &page {
                start = successor(key);
                let Some((_, seq)) = parse_entry_key(key) else {
                    continue;
                };
                let mut entry = match decode_entry(key, value) {
                    Ok(e) => e,
                    Err(e) => {
                        // Left in place for inspection; it must not block
                        // the hub's other entries.
                        tracing::warn!(hub, error = %e, "outbox skips an unreadable entry");
                        continue;
                    }
                };
                match entry.state {
                    OutboxState::Done | OutboxState::Expired => {
                        if entry.next_attempt_ms <= now {
                            self.stage_delete(batch, hub, seq, &entry.publish.publish_id)?;
                        } else {
                            earliest(wake_at, entry.next_attempt_ms);
                        }
                    }
                    OutboxState::Pending | OutboxState::Sent => {
                        let expires_at = entry.created_ms.saturating_add(ms(config.max_age));
                        if now >= expires_at {
                            tracing::warn!(
                                hub,
                                publish_id = ?entry.publish.publish_id,
                                attempts = entry.attempts,
                                "outbox entry expired undelivered"
                            );
                            entry.state = OutboxState::Expired;
                            entry.last_error = Some(format!(
                                "not delivered within {:?} ({} attempts; last error: {})",
                                config.max_age,
                                entry.attempts,
                                entry.last_error.as_deref().unwrap_or("none"),
                            ));
                            entry.next_attempt_ms = now.saturating_add(ms(FAILURE_GRACE));
                            earliest(wake_at, entry.next_attempt_ms);
                            batch.put(key.clone(), encode_entry(&entry)?);
                            tally.expired += 1;
                        } else {
                            earliest(wake_at, expires_at);
                            live.push((seq, entry));
                            if live.len() >= window {
                                return Ok(live);
                            }
                        }
                    }
                }
            }
            if !full {
                return Ok(live);
            }
        }
    }

    /// The delay before attempt `attempts + 1` after a transient failure.
    fn backoff(&self, attempts: u32) -> Duration {
        let c = &self.inner.config;
        let doublings = attempts.saturating_sub(1).min(31);
        let nominal = c
            .retry_base
            .saturating_mul(1u32 << doublings)
            .min(c.retry_max);
        // Only shortening keeps every delay within retry_max and keeps each
        // nominal step at least as long as the previous one after jitter.
        let factor = 1.0 - c.jitter * self.inner.rng.unit();
        nominal.mul_f64(factor.clamp(0.0, 1.0))
    }

    /// Write what one round's answers mean for its entries, as one batch
    /// (never flushed: see the module doc).
    fn record(&self, round: Round, driver: &mut Driver) -> Result<(), OutboxError> {
        let inner = &self.inner;
        let now = inner.clock.now_ms();
        let hub = round.hub;
        let mut batch = WriteBatch::new();
        let mut tally = Tally::default();
        let mut any_retry = false;
        for Attempt {
            seq,
            mut entry,
            answer,
        } in round.attempts
        {
            let id = entry.publish.publish_id;
            let refusal = match answer {
                Ok(PublishOutcome::Accepted { .. }) => None,
                Ok(PublishOutcome::Duplicate { .. }) => {
                    tally.duplicates += 1;
                    None
                }
                // The hub never saw the original and a replay stores
                // nothing: there is nothing left to deliver.
                Ok(PublishOutcome::HistoryMissing) if entry.publish.replay_only => None,
                Ok(PublishOutcome::HistoryMissing) => Some(
                    "hub answered history_missing to a publish that is not replay_only".to_string(),
                ),
                Ok(PublishOutcome::HeadMismatch { current }) => Some(format!(
                    "hub answered head_mismatch (head {current:?}) to an unconditional publish"
                )),
                Err(SendFailure::Refused(HubError::Conflict { seq: held })) => {
                    // Not a transient fault: another publish reused this id,
                    // so what this entry carries is not what the hub holds.
                    Some(format!(
                        "hub holds other content under this publish id (seq {held})"
                    ))
                }
                Err(SendFailure::Refused(e)) => Some(e.to_string()),
                Err(SendFailure::Retry { reason, after }) => {
                    any_retry = true;
                    tally.retries += 1;
                    let delay = after
                        .unwrap_or_else(|| self.backoff(entry.attempts))
                        .max(MIN_RETRY);
                    tracing::debug!(hub = %hub, publish_id = ?id, attempts = entry.attempts, ?delay, %reason, "outbox retry");
                    entry.next_attempt_ms = now.saturating_add(ms(delay));
                    entry.last_error = Some(reason);
                    batch.put(entry_key(&hub, seq), encode_entry(&entry)?);
                    continue;
                }
            };
            match refusal {
                None => {
                    tally.done += 1;
                    self.stage_delete(&mut batch, &hub, seq, &id)?;
                }
                Some(reason) => {
                    tally.refused += 1;
                    tracing::warn!(hub = %hub, publish_id = ?id, %reason, "outbox entry refused, not delivered");
                    entry.state = OutboxState::Done;
                    entry.last_error = Some(reason);
                    entry.next_attempt_ms = now.saturating_add(ms(FAILURE_GRACE));
                    batch.put(entry_key(&hub, seq), encode_entry(&entry)?);
                }
            }
        }
        if any_retry {
            driver.probing.insert(hub);
        } else {
            driver.probing.remove(&hub);
        }
        if !batch.is_empty() {
            inner.kv.apply(&batch)?;
        }
        tally.add_to(&inner.counters);
        self.finished(tally.done + tally.refused + tally.expired);
        Ok(())
    }
}

/// Hand `due` to the sink in order and collect every answer.
fn send_round(
    sink: Arc<dyn OutboxSink>,
    hub: String,
    due: Vec<(u64, OutboxEntry)>,
) -> BoxFuture<'static, Round> {
    // The calls happen here, in creation order, before anything is polled.
    let calls: Vec<_> = due
        .iter()
        .map(|(_, e)| sink.publish(&hub, e.publish.clone()))
        .collect();
    Box::pin(async move {
        let answers = futures::future::join_all(calls).await;
        let attempts = due
            .into_iter()
            .zip(answers)
            .map(|((seq, entry), answer)| Attempt { seq, entry, answer })
            .collect();
        Round { hub, attempts }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemKv;
    use crate::wire::{RetentionClass, TopicId};
    use std::collections::VecDeque;

    const ORIGIN_MS: u64 = 1_700_000_000_000;

    /// What the scripted hub does with one call.
    #[derive(Clone, Debug)]
    enum Answer {
        /// Store it (or answer duplicate / history_missing as a hub would).
        Accept,
        /// Store it but lose the answer: the sink reports a transient error.
        AcceptButLose,
        Retry(Option<Duration>),
        Refuse(HubError),
    }

    #[derive(Default)]
    struct HubSim {
        script: VecDeque<Answer>,
        /// Answer every unscripted call with a transient failure.
        down: bool,
        /// Never answer.
        hang: bool,
        accepted: Vec<PublishId>,
    }

    #[derive(Clone, Debug, PartialEq, Eq)]
    struct Call {
        hub: String,
        id: PublishId,
        at_ms: u64,
    }

    /// A scripted set of hubs that remember what they accepted, so a
    /// resend is answered `duplicate` across outbox restarts.
    struct TestSink {
        clock: Clock,
        hubs: Mutex<BTreeMap<String, HubSim>>,
        calls: Mutex<Vec<Call>>,
    }

    impl TestSink {
        fn new(clock: &Clock) -> Arc<Self> {
            Arc::new(Self {
                clock: clock.clone(),
                hubs: Mutex::new(BTreeMap::new()),
                calls: Mutex::new(Vec::new()),
            })
        }

        fn with_hub(&self, hub: &str, f: impl FnOnce(&mut HubSim)) {
            f(lock(&self.hubs).entry(hub.to_string()).or_default());
        }

        fn calls(&self, hub: &str) -> Vec<Call> {
            lock(&self.calls)
                .iter()
                .filter(|c| c.hub == hub)
                .cloned()
                .collect()
        }

        fn accepted(&self, hub: &str) -> Vec<PublishId> {
            lock(&self.hubs)
                .get(hub)
                .map(|h| h.accepted.clone())
                .unwrap_or_default()
        }
    }

    impl OutboxSink for TestSink {
        fn publish(
            &self,
            hub: &str,
            p: Publish,
        ) -> BoxFuture<'static, Result<PublishOutcome, SendFailure>> {
            lock(&self.calls).push(Call {
                hub: hub.to_string(),
                id: p.publish_id,
                at_ms: self.clock.now_ms(),
            });
            let mut hubs = lock(&self.hubs);
            let sim = hubs.entry(hub.to_string()).or_default();
            if sim.hang {
                return Box::pin(futures::future::pending());
            }
            let answer = match sim.script.pop_front() {
                Some(a) => a,
                None if sim.down => Answer::Retry(None),
                None => Answer::Accept,
            };
            let store =
                |sim: &mut HubSim| match sim.accepted.iter().position(|a| *a == p.publish_id) {
                    Some(i) => PublishOutcome::Duplicate { seq: i as u64 + 1 },
                    None if p.replay_only => PublishOutcome::HistoryMissing,
                    None => {
                        sim.accepted.push(p.publish_id);
                        PublishOutcome::Accepted {
                            seq: sim.accepted.len() as u64,
                            head: None,
                        }
                    }
                };
            let result = match answer {
                Answer::Accept => Ok(store(sim)),
                Answer::AcceptButLose => {
                    store(sim);
                    Err(SendFailure::Retry {
                        reason: "connection closed".into(),
                        after: None,
                    })
                }
                Answer::Retry(after) => Err(SendFailure::Retry {
                    reason: "hub unreachable".into(),
                    after,
                }),
                Answer::Refuse(e) => Err(SendFailure::Refused(e)),
            };
            Box::pin(futures::future::ready(result))
        }
    }

    fn publish(n: u8) -> Publish {
        Publish {
            topic: TopicId::from("topic"),
            publish_id: PublishId([n; 32]),
            class: RetentionClass::Log,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: None,
            payload: vec![n; 4],
            writer: None,
        }
    }

    fn open(kv: &MemKv, clock: &Clock, config: OutboxConfig) -> Outbox {
        Outbox::open(
            Arc::new(kv.clone()),
            clock.clone(),
            SharedRng::seeded(7),
            config,
        )
        .expect("open outbox")
    }

    fn start(
        outbox: &Outbox,
        sink: &Arc<TestSink>,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let stop = CancellationToken::new();
        let ob = outbox.clone();
        let sink: Arc<dyn OutboxSink> = sink.clone();
        let token = stop.clone();
        let task = tokio::spawn(async move { ob.run(sink, token).await });
        (stop, task)
    }

    async fn stop(driver: (CancellationToken, tokio::task::JoinHandle<()>)) {
        driver.0.cancel();
        driver.1.await.expect("driver task");
    }

    /// Poll `cond` in 1 ms steps of (paused) tokio time.
    async fn wait_until(
        clock: &Clock,
        what: &str,
        limit: Duration,
        mut cond: impl FnMut() -> bool,
    ) {
        let deadline = clock.now_ms() + ms(limit);
        while !cond() {
            assert!(clock.now_ms() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn ids(range: std::ops::RangeInclusive<u8>) -> Vec<PublishId> {
        range.map(|n| PublishId([n; 32])).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn retry_until_accepted_counts_attempts_and_backs_off() {
        let clock = Clock::tokio(ORIGIN_MS);
        let kv = MemKv::new();
        let outbox = open(&kv, &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        sink.with_hub("h", |h| {
            h.script.extend([
                Answer::Retry(None),
                Answer::Retry(None),
                Answer::Retry(None),
            ])
        });
        let driver = start(&outbox, &sink);
        outbox.enqueue("h", publish(1)).expect("enqueue");

        wait_until(
            &clock,
            "third failure recorded",
            Duration::from_secs(5),
            || {
                outbox
                    .entries(None)
                    .expect("entries")
                    .first()
                    .map(|e| e.attempts)
                    == Some(3)
            },
        )
        .await;
        let entry = &outbox.entries(Some("h")).expect("entries")[0];
        assert_eq!(entry.state, OutboxState::Sent);
        assert_eq!(entry.last_error.as_deref(), Some("hub unreachable"));
        assert_eq!(outbox.pending(), Ok(1));

        wait_until(&clock, "drained", Duration::from_secs(5), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        let calls = sink.calls("h");
        assert_eq!(calls.len(), 4, "three failures and the accepted attempt");
        assert_eq!(sink.accepted("h"), ids(1..=1));
        assert!(
            outbox.entries(None).expect("entries").is_empty(),
            "delivered entries are deleted"
        );
        let gaps: Vec<u64> = calls.windows(2).map(|w| w[1].at_ms - w[0].at_ms).collect();
        // Nominal 250, 500, 1000 ms, each shortened by at most half.
        assert!((125..=250).contains(&gaps[0]), "{gaps:?}");
        assert!((250..=500).contains(&gaps[1]), "{gaps:?}");
        assert!((500..=1000).contains(&gaps[2]), "{gaps:?}");
        assert!(
            gaps[0] < gaps[1] && gaps[1] < gaps[2],
            "delays grow: {gaps:?}"
        );
        assert_eq!(
            outbox.metrics(),
            OutboxMetrics {
                sent: 4,
                done: 1,
                duplicates: 0,
                retries: 3,
                expired: 0,
                refused: 0
            }
        );
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_from_the_hub_is_obeyed() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        sink.with_hub("h", |h| {
            h.script
                .push_back(Answer::Retry(Some(Duration::from_secs(5))))
        });
        let driver = start(&outbox, &sink);
        outbox.enqueue("h", publish(1)).expect("enqueue");
        wait_until(&clock, "drained", Duration::from_secs(10), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        let calls = sink.calls("h");
        assert_eq!(calls.len(), 2);
        assert_eq!(
            calls[1].at_ms - calls[0].at_ms,
            5000,
            "rate limit's after, not the 250 ms backoff"
        );
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn creation_order_is_kept_per_hub_through_an_outage() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        sink.with_hub("h", |h| h.down = true);
        let driver = start(&outbox, &sink);
        for n in 1..=5 {
            outbox.enqueue("h", publish(n)).expect("enqueue");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(sink.calls("h")[0].at_ms, ORIGIN_MS, "wake() sends at once");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let outage = sink.calls("h");
        assert!(outage.len() >= 4, "retried during the outage");
        assert!(
            outage.iter().all(|c| c.id == PublishId([1; 32])),
            "the oldest entry holds back the younger ones: {outage:?}"
        );

        sink.with_hub("h", |h| h.down = false);
        wait_until(&clock, "drained", Duration::from_secs(60), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        let mut first_sends = Vec::new();
        for c in sink.calls("h") {
            if !first_sends.contains(&c.id) {
                first_sends.push(c.id);
            }
        }
        assert_eq!(first_sends, ids(1..=5), "handed over in creation order");
        assert_eq!(
            sink.accepted("h"),
            ids(1..=5),
            "hub stores them in creation order"
        );
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_goes_out_as_one_window_in_creation_order() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        for n in 1..=5 {
            outbox.enqueue("h", publish(n)).expect("enqueue");
        }
        let sink = TestSink::new(&clock);
        let driver = start(&outbox, &sink);
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        let calls = sink.calls("h");
        assert_eq!(calls.iter().map(|c| c.id).collect::<Vec<_>>(), ids(1..=5));
        assert!(
            calls.iter().all(|c| c.at_ms == ORIGIN_MS),
            "one round, no waiting"
        );
        assert_eq!(sink.accepted("h"), ids(1..=5));
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn hubs_proceed_independently() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        sink.with_hub("hang", |h| h.hang = true);
        sink.with_hub("down", |h| h.down = true);
        let driver = start(&outbox, &sink);
        outbox.enqueue("hang", publish(1)).expect("enqueue");
        outbox.enqueue("down", publish(2)).expect("enqueue");
        outbox.enqueue("up", publish(3)).expect("enqueue");
        wait_until(
            &clock,
            "the healthy hub got its entry",
            Duration::from_millis(50),
            || sink.accepted("up") == ids(3..=3),
        )
        .await;
        outbox.enqueue("up", publish(4)).expect("enqueue");
        wait_until(
            &clock,
            "a later entry too",
            Duration::from_millis(50),
            || sink.accepted("up") == ids(3..=4),
        )
        .await;
        assert!(outbox.entries(Some("up")).expect("entries").is_empty());
        assert_eq!(
            outbox.pending(),
            Ok(2),
            "the other two hubs still owe theirs"
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            sink.calls("down").len() >= 3,
            "the down hub is retried meanwhile"
        );
        assert_eq!(
            sink.calls("hang").len(),
            1,
            "the hung round is still waiting"
        );
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn entry_older_than_max_age_expires() {
        let clock = Clock::tokio(ORIGIN_MS);
        let config = OutboxConfig {
            max_age: Duration::from_secs(10),
            ..OutboxConfig::default()
        };
        let outbox = open(&MemKv::new(), &clock, config);
        let sink = TestSink::new(&clock);
        sink.with_hub("h", |h| h.down = true);
        let driver = start(&outbox, &sink);
        outbox.enqueue("h", publish(1)).expect("enqueue");
        wait_until(&clock, "expired", Duration::from_secs(20), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        assert!(clock.now_ms() >= ORIGIN_MS + 10_000, "not before max_age");
        let entries = outbox.entries(None).expect("entries");
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].state, OutboxState::Expired);
        assert!(entries[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("hub unreachable"));
        let sends = sink.calls("h").len();
        assert_eq!(outbox.metrics().expired, 1);
        assert_eq!(outbox.metrics().done, 0);

        tokio::time::sleep(FAILURE_GRACE + Duration::from_secs(1)).await;
        assert!(
            outbox.entries(None).expect("entries").is_empty(),
            "deleted after the grace"
        );
        assert_eq!(sink.calls("h").len(), sends, "never sent again");
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn entry_that_aged_while_offline_expires_unsent() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        outbox.enqueue("h", publish(1)).expect("enqueue");
        tokio::time::advance(Duration::from_secs(8 * 24 * 3600)).await;
        let sink = TestSink::new(&clock);
        let driver = start(&outbox, &sink);
        wait_until(&clock, "expired", Duration::from_secs(1), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        assert!(sink.calls("h").is_empty());
        assert_eq!(
            outbox.entries(None).expect("entries")[0].state,
            OutboxState::Expired
        );
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn refused_is_done_with_the_error() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        let too_large = HubError::PayloadTooLarge { len: 9, max: 8 };
        sink.with_hub("h", |h| {
            h.script.extend([
                Answer::Refuse(too_large.clone()),
                Answer::Refuse(HubError::Conflict { seq: 3 }),
            ])
        });
        let driver = start(&outbox, &sink);
        outbox.enqueue("h", publish(1)).expect("enqueue");
        outbox.enqueue("h", publish(2)).expect("enqueue");
        wait_until(&clock, "both refused", Duration::from_secs(1), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        let entries = outbox.entries(Some("h")).expect("entries");
        assert_eq!(entries.len(), 2);
        assert!(entries
            .iter()
            .all(|e| e.state == OutboxState::Done && e.attempts == 1));
        assert_eq!(entries[0].last_error, Some(too_large.to_string()));
        assert_eq!(
            entries[1].last_error,
            Some("hub holds other content under this publish id (seq 3)".to_string())
        );
        assert_eq!(sink.calls("h").len(), 2, "a refusal is not retried");
        let m = outbox.metrics();
        assert_eq!((m.refused, m.done, m.retries), (2, 0, 0));
        tokio::time::sleep(FAILURE_GRACE + Duration::from_secs(1)).await;
        assert!(outbox.entries(None).expect("entries").is_empty());
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn staging_twice_is_one_entry() {
        let clock = Clock::tokio(ORIGIN_MS);
        let kv = MemKv::new();
        let outbox = open(&kv, &clock, OutboxConfig::default());
        let mut batch = WriteBatch::new();
        outbox.stage(&mut batch, "h", &publish(1)).expect("stage");
        outbox
            .stage(&mut batch, "h", &publish(1))
            .expect("stage again, same batch");
        kv.apply(&batch).expect("apply");
        let mut batch = WriteBatch::new();
        outbox
            .stage(&mut batch, "h", &publish(1))
            .expect("stage once applied");
        assert!(batch.is_empty(), "an owed publish stages nothing");
        outbox.enqueue("h", publish(1)).expect("enqueue");
        assert_eq!(outbox.entries(None).expect("entries").len(), 1);
        // The same id on another hub is another entry.
        outbox.enqueue("g", publish(1)).expect("enqueue");
        assert_eq!(outbox.entries(None).expect("entries").len(), 2);

        let mut other = publish(1);
        other.payload = b"different".to_vec();
        let reused = Err(OutboxError::IdReused {
            hub: "h".into(),
            publish_id: other.publish_id,
        });
        assert_eq!(outbox.enqueue("h", other.clone()), reused);
        let mut batch = WriteBatch::new();
        outbox.stage(&mut batch, "x", &publish(2)).expect("stage");
        let mut other2 = publish(2);
        other2.payload.clear();
        assert!(matches!(
            outbox.stage(&mut batch, "x", &other2),
            Err(OutboxError::IdReused { .. })
        ));

        let sink = TestSink::new(&clock);
        let driver = start(&outbox, &sink);
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        assert_eq!(sink.calls("h").len(), 1);
        assert_eq!(sink.calls("g").len(), 1);
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_outbox_has_no_room_until_the_driver_finishes_entries() {
        let clock = Clock::tokio(ORIGIN_MS);
        let kv = MemKv::new();
        let config = OutboxConfig {
            max_owed: 2,
            ..OutboxConfig::default()
        };
        let outbox = open(&kv, &clock, config.clone());
        outbox.enqueue("h", publish(1)).expect("enqueue");
        // The same publish again is the same entry: counted once.
        outbox.enqueue("h", publish(1)).expect("enqueue");
        assert!(outbox.has_room());
        outbox.enqueue("h", publish(2)).expect("enqueue");
        assert_eq!((outbox.owed(), outbox.has_room()), (2, false));

        // The count survives a reopen: it is read back from the store.
        drop(outbox);
        let outbox = open(&kv, &clock, config);
        assert_eq!((outbox.owed(), outbox.pending()), (2, Ok(2)));
        let waiter = {
            let ob = outbox.clone();
            tokio::spawn(async move { ob.wait_for_room().await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "no room while nothing is delivered");

        // One refused and one delivered: both finished, both make room.
        let sink = TestSink::new(&clock);
        sink.with_hub("h", |h| {
            h.script.push_back(Answer::Refuse(HubError::NotAuthorized));
        });
        let driver = start(&outbox, &sink);
        wait_until(&clock, "room", Duration::from_secs(1), || {
            waiter.is_finished()
        })
        .await;
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            outbox.owed() == 0
        })
        .await;
        assert_eq!(outbox.pending(), Ok(0));
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn crash_after_enqueue_keeps_the_entry_and_reopen_sends_it() {
        let clock = Clock::tokio(ORIGIN_MS);
        let kv = MemKv::new();
        let outbox = open(&kv, &clock, OutboxConfig::default());
        outbox.enqueue("h", publish(1)).expect("enqueue");
        drop(outbox);
        kv.crash();

        let reopened = open(&kv, &clock, OutboxConfig::default());
        let entries = reopened.entries(None).expect("entries");
        assert_eq!(entries.len(), 1);
        assert_eq!(
            (entries[0].state, entries[0].publish.clone()),
            (OutboxState::Pending, publish(1))
        );
        let sink = TestSink::new(&clock);
        let driver = start(&reopened, &sink);
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            reopened.is_drained() == Ok(true)
        })
        .await;
        assert_eq!(sink.accepted("h"), ids(1..=1));
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn crash_before_the_callers_flush_loses_a_staged_entry() {
        let clock = Clock::tokio(ORIGIN_MS);
        let kv = MemKv::new();
        let outbox = open(&kv, &clock, OutboxConfig::default());
        let mut batch = WriteBatch::new();
        outbox.stage(&mut batch, "h", &publish(1)).expect("stage");
        kv.apply(&batch).expect("apply");
        assert_eq!(outbox.pending(), Ok(1));
        kv.crash();
        let reopened = open(&kv, &clock, OutboxConfig::default());
        assert!(reopened.entries(None).expect("entries").is_empty());
        assert_eq!(reopened.is_drained(), Ok(true));
    }

    #[tokio::test(start_paused = true)]
    async fn restart_resends_a_sent_entry_and_duplicate_is_done() {
        let clock = Clock::tokio(ORIGIN_MS);
        let kv = MemKv::new();
        let sink = TestSink::new(&clock);
        // The hub stores the publish but its answer is lost.
        sink.with_hub("h", |h| h.script.push_back(Answer::AcceptButLose));
        let outbox = open(&kv, &clock, OutboxConfig::default());
        let driver = start(&outbox, &sink);
        outbox.enqueue("h", publish(1)).expect("enqueue");
        wait_until(
            &clock,
            "first attempt recorded",
            Duration::from_millis(100),
            || {
                outbox
                    .entries(None)
                    .expect("entries")
                    .first()
                    .map(|e| e.state)
                    == Some(OutboxState::Sent)
            },
        )
        .await;
        stop(driver).await;
        // As sled's background flush would, before the process dies.
        kv.flush().expect("flush");
        drop(outbox);
        kv.crash();

        let reopened = open(&kv, &clock, OutboxConfig::default());
        let entries = reopened.entries(None).expect("entries");
        assert_eq!(
            (entries[0].state, entries[0].attempts),
            (OutboxState::Sent, 1)
        );
        let driver = start(&reopened, &sink);
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            reopened.is_drained() == Ok(true)
        })
        .await;
        assert_eq!(sink.calls("h").len(), 2);
        assert_eq!(sink.accepted("h"), ids(1..=1), "stored once");
        let m = reopened.metrics();
        assert_eq!((m.done, m.duplicates), (1, 1));
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn duplicate_answer_counts_as_done() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        sink.with_hub("h", |h| h.accepted.push(PublishId([1; 32])));
        let driver = start(&outbox, &sink);
        outbox.enqueue("h", publish(1)).expect("enqueue");
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        assert!(outbox.entries(None).expect("entries").is_empty());
        let m = outbox.metrics();
        assert_eq!((m.sent, m.done, m.duplicates, m.refused), (1, 1, 1, 0));
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn history_missing_for_a_replay_is_done() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        let driver = start(&outbox, &sink);
        let mut replay = publish(1);
        replay.replay_only = true;
        outbox.enqueue("h", replay).expect("enqueue");
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        assert!(outbox.entries(None).expect("entries").is_empty());
        assert_eq!((outbox.metrics().done, outbox.metrics().refused), (1, 0));
        assert!(sink.accepted("h").is_empty(), "a replay stores nothing");
        stop(driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn compare_and_set_publish_is_refused() {
        let clock = Clock::tokio(ORIGIN_MS);
        let kv = MemKv::new();
        let outbox = open(&kv, &clock, OutboxConfig::default());
        for head in [ExpectedHead::Seq(3), ExpectedHead::Empty] {
            let mut cas = publish(1);
            cas.expected_head = head;
            let expected = Err(OutboxError::ConditionalPublish {
                hub: "h".into(),
                publish_id: cas.publish_id,
                expected_head: head,
            });
            assert_eq!(outbox.enqueue("h", cas.clone()), expected);
            let mut batch = WriteBatch::new();
            assert_eq!(outbox.stage(&mut batch, "h", &cas), expected);
            assert!(batch.is_empty());
        }
        assert!(outbox.entries(None).expect("entries").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_driver_stops_at_once() {
        let clock = Clock::tokio(ORIGIN_MS);
        let outbox = open(&MemKv::new(), &clock, OutboxConfig::default());
        let sink = TestSink::new(&clock);
        let driver = start(&outbox, &sink);
        tokio::task::yield_now().await;
        let second: Arc<dyn OutboxSink> = sink.clone();
        tokio::time::timeout(
            Duration::from_secs(1),
            outbox.run(second, CancellationToken::new()),
        )
        .await
        .expect("second run returns");
        stop(driver).await;
        // The flag is cleared when the first driver ends.
        let again = start(&outbox, &sink);
        outbox.enqueue("h", publish(1)).expect("enqueue");
        wait_until(&clock, "drained", Duration::from_secs(1), || {
            outbox.is_drained() == Ok(true)
        })
        .await;
        stop(again).await;
    }

    #[test]
    fn invalid_config_is_named() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let bad = OutboxConfig {
            jitter: 1.5,
            ..OutboxConfig::default()
        };
        let r = Outbox::open(kv, Clock::System, SharedRng::seeded(1), bad);
        assert!(matches!(r, Err(OutboxError::InvalidConfig { .. })));
    }

    #[test]
    fn client_errors_map_onto_retry_or_refusal() {
        let f = SendFailure::from_client_error;
        assert_eq!(
            f(ClientError::Hub(HubError::RateLimited {
                scope: "device".into(),
                retry_after_ms: 1500
            })),
            SendFailure::Retry {
                reason: "rate limited (device); retry in 1500 ms".into(),
                after: Some(Duration::from_millis(1500)),
            }
        );
        assert!(matches!(
            f(ClientError::Disconnected),
            SendFailure::Retry { after: None, .. }
        ));
        assert!(matches!(
            f(ClientError::Hub(HubError::ShuttingDown)),
            SendFailure::Retry { .. }
        ));
        assert_eq!(
            f(ClientError::Hub(HubError::Conflict { seq: 4 })),
            SendFailure::Refused(HubError::Conflict { seq: 4 })
        );
    }

    #[test]
    fn entry_keys_keep_hubs_apart_and_parse_back() {
        let a = entry_key("a", 7);
        assert_eq!(parse_entry_key(&a), Some(("a".to_string(), 7)));
        assert!(!entry_key("ab", 1).starts_with(&hub_part(ENTRY_PREFIX, "a")));
        assert!(
            entry_key("h", 2) < entry_key("h", 10),
            "creation order is key order"
        );
        assert_eq!(parse_entry_key(b"outbox/e/short"), None);
    }
}
