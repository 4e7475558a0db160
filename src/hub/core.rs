//! The hub's protocol logic over its store, with no networking.
//!
//! Every call is one [`HubTxn`] of the store: it reads what it needs and
//! commits all of its changes at once, so a crash leaves either the state
//! before the call or the state after it, and a call that conflicted with
//! another (on a store shared by several processes) runs again from its
//! reads. Each call returns its commit's generation; the caller answers only
//! once [`HubCore::durable`] says that generation is durable. Reads only ever
//! return what is durable, so no device can act on a frame a crash could
//! still take back.

use super::layout::{self as l, DeviceMeta, DeviceUsage, ExpiryKind, KeyPackageMeta};
use super::layout::{PublishRecord, StoredFrame, Subscription, TopicMeta};
use super::limits::{Limits, RateKey, RateLimiter};
use super::rules::{self, Attempt, Decision, TopicView};
use super::store::{HubStore, HubTxn, StoreError};
use super::stream::TopicStart;
use crate::clock::Clock;
use crate::wire::{
    ChangeOutcome, Delivery, DeviceId, ExpectedHead, FetchResult, HubError, LogFrame, Publish,
    PublishOutcome, RetentionClass, StoreId, SubscriptionChange, TopicId, MAX_SUBSCRIPTION_CHANGES,
};
use sha2::{Digest, Sha256};
use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How often a call runs again after its transaction conflicted with
/// another before the hub gives up and answers `Internal`.
pub(super) const MAX_CONFLICT_RETRIES: u32 = 32;

/// Run `$body` (an expression using the transaction `$tx`) in a transaction
/// of `$core`'s store and commit it, running it again on a conflict. A `?`
/// in the body returns from the caller with nothing written. Evaluates to
/// the body's value as a [`Durable`].
macro_rules! transact {
    ($core:expr, $tx:ident => $body:expr) => {{
        let mut conflicts = 0u32;
        loop {
            let mut $tx = $core.store.begin().await.map_err(internal)?;
            let value = $body;
            let started = std::time::Instant::now();
            let committed = $tx.commit().await;
            $core.counters.commit_latency.observe(started.elapsed());
            match committed {
                Ok(gen) => break Durable { value, gen },
                Err(StoreError::Conflict) if conflicts < MAX_CONFLICT_RETRIES => {
                    conflicts += 1;
                    $core
                        .counters
                        .conflict_retries
                        .fetch_add(1, Ordering::Relaxed);
                    let wait = conflict_backoff(conflicts);
                    if !wait.is_zero() {
                        tokio::time::sleep(wait).await;
                    }
                }
                Err(e) => return Err(internal(e)),
            }
        }
    }};
}

/// How long to wait before running a change again after its `n`th
/// conflict: nothing after the first (the rival has most likely committed
/// by now), then a random time up to 1 ms, doubled per conflict, at most
/// 64 ms. Changes that conflict again and again touch records others keep
/// writing (a topic's head, a device's usage), so running again at once
/// mostly meets the same rivals; a random wait lets one through. Only stores shared by
/// several transactions at once conflict (PostgreSQL); the randomness is
/// the thread's, not the hub's seeded one, because no deterministic run
/// (the simulation's one-at-a-time store) ever gets here.
fn conflict_backoff(n: u32) -> std::time::Duration {
    use rand::Rng;
    if n <= 1 {
        return std::time::Duration::ZERO;
    }
    let cap_us = 1_000u64 << (n - 2).min(6);
    std::time::Duration::from_micros(rand::thread_rng().gen_range(0..=cap_us))
}

/// Read and decode the record under `key` in `tx`.
async fn read<T: serde::de::DeserializeOwned>(
    tx: &mut dyn HubTxn,
    key: &[u8],
) -> Result<Option<T>, HubError> {
    match tx.get(key).await.map_err(internal)? {
        Some(bytes) => Ok(Some(l::decode(key, &bytes).map_err(kv_internal)?)),
        None => Ok(None),
    }
}

/// A result whose writes become durable with generation `gen`.
#[derive(Debug)]
pub struct Durable<T> {
    /// The answer to give once `gen` is durable.
    pub value: T,
    /// The generation to wait for.
    pub gen: u64,
}

/// What a publish did, and whom to wake once it is durable.
#[derive(Debug)]
pub struct Published {
    /// The answer.
    pub outcome: PublishOutcome,
    /// Devices whose receive stream has a new frame to push: the topic's
    /// subscribers but the publisher (for a device's mailbox, its owner).
    pub recipients: Vec<DeviceId>,
}

/// A page of one topic's frames for one receive stream.
#[derive(Debug, Default)]
pub struct StreamPage {
    /// Frames to push, in sequence order.
    pub frames: Vec<Delivery>,
    /// Every frame up to this one was looked at (pushed or passed over).
    pub scanned_through: u64,
    /// `Some((after, through))` when frames of the log in that range were
    /// trimmed before this stream reached them.
    pub missed: Option<(u64, u64)>,
}

/// What one purge pass removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Log frames trimmed (always a prefix of their topic's log).
    pub log_frames: u64,
    /// Mailbox frames dropped.
    pub mailbox_frames: u64,
    /// Per-device delivery records of a store written before protocol
    /// version 4, dropped when due.
    pub legacy_deliveries: u64,
    /// Idempotency records forgotten.
    pub publish_records: u64,
}

/// Counters for operators.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub accepted: AtomicU64,
    pub duplicates: AtomicU64,
    pub head_mismatches: AtomicU64,
    pub conflicts: AtomicU64,
    pub history_missing: AtomicU64,
    pub trimmed: AtomicU64,
    pub mailbox_full: AtomicU64,
    pub frames_missed: AtomicU64,
    pub quota_refusals: AtomicU64,
    pub not_authorized: AtomicU64,
    pub conflict_retries: AtomicU64,
    /// How long each transaction's commit took (on PostgreSQL, the round
    /// trip and the WAL flush; on sled, applying the batch).
    pub commit_latency: crate::prom::Histogram,
    /// How long each wait for durability took (on sled, the group-commit
    /// flush; on PostgreSQL, nothing: a commit is durable when it answers).
    pub durable_latency: crate::prom::Histogram,
}

/// The usage records one operation reads and changes, staged into its
/// batch at the end (only those that changed).
struct UsageStage {
    map: BTreeMap<DeviceId, (DeviceUsage, DeviceUsage)>,
}

impl UsageStage {
    fn new() -> Self {
        Self {
            map: BTreeMap::new(),
        }
    }

    /// `device`'s usage as this operation has changed it so far.
    async fn get(
        &mut self,
        tx: &mut dyn HubTxn,
        device: DeviceId,
    ) -> Result<&mut DeviceUsage, HubError> {
        let slot = match self.map.entry(device) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => {
                let u: DeviceUsage = read(tx, &l::device_usage(&device))
                    .await?
                    .unwrap_or_default();
                v.insert((u, u))
            }
        };
        Ok(&mut slot.1)
    }

    /// A frame of `sender` holding `bytes` of payload is going away.
    async fn release_bytes(
        &mut self,
        tx: &mut dyn HubTxn,
        sender: DeviceId,
        bytes: usize,
    ) -> Result<(), HubError> {
        let u = self.get(tx, sender).await?;
        u.stored_bytes = u.stored_bytes.saturating_sub(bytes as u64);
        Ok(())
    }

    /// A frame of `owner`'s own mailbox is going away.
    async fn release_mailbox_frame(
        &mut self,
        tx: &mut dyn HubTxn,
        owner: DeviceId,
    ) -> Result<(), HubError> {
        let u = self.get(tx, owner).await?;
        u.mailbox_frames = u.mailbox_frames.saturating_sub(1);
        Ok(())
    }

    fn stage(self, tx: &mut dyn HubTxn) {
        for (device, (read, now)) in self.map {
            if read != now {
                tx.put(l::device_usage(&device), l::encode(&now));
            }
        }
    }
}

/// The hub's logic: publish, fetch, subscriptions, deliveries, key packages,
/// retention.
pub struct HubCore {
    store: Arc<dyn HubStore>,
    limits: Limits,
    clock: Clock,
    rate: RateLimiter,
    pub(crate) counters: Counters,
}

fn internal(e: StoreError) -> HubError {
    tracing::error!(error = %e, "hub store failed");
    HubError::Internal {
        reason: e.to_string(),
    }
}

fn kv_internal(e: crate::kv::KvError) -> HubError {
    internal(StoreError::Engine(e))
}

fn content_digest(class: RetentionClass, payload: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update([match class {
        RetentionClass::Mailbox => 0u8,
        RetentionClass::Log => 1u8,
    }]);
    h.update(payload);
    h.finalize().into()
}

impl HubCore {
    /// A core over `store` (which may already hold a hub's state).
    pub fn open(store: Arc<dyn HubStore>, limits: Limits, clock: Clock) -> Arc<Self> {
        Arc::new(Self {
            rate: RateLimiter::new(&limits),
            store,
            limits,
            clock,
            counters: Counters::default(),
        })
    }

    /// The identity of this core's store: the same for every core opened
    /// over the same store (or a copy of it), different for another store.
    pub fn store_id(&self) -> StoreId {
        self.store.store_id()
    }

    /// The store this core works on.
    pub fn store(&self) -> &Arc<dyn HubStore> {
        &self.store
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Wait until generation `gen` is durable.
    ///
    /// # Errors
    /// `Internal` when the flush covering it failed.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn durable(&self, gen: u64) -> Result<(), HubError> {
        let started = std::time::Instant::now();
        let done = self.store.durable(gen).await.map_err(internal);
        self.counters.durable_latency.observe(started.elapsed());
        done
    }

    fn check_topic(&self, topic: &TopicId) -> Result<(), HubError> {
        let len = topic.0.len();
        if len == 0 || len > self.limits.max_topic {
            return Err(HubError::BadTopic {
                len: len as u64,
                max: self.limits.max_topic as u64,
            });
        }
        Ok(())
    }

    fn retention_ms(&self, secs: Option<u64>) -> Result<u64, HubError> {
        let max = self.limits.max_retention.as_secs();
        match secs {
            None => Ok(self.limits.default_retention.as_millis() as u64),
            Some(s) if s > max => Err(HubError::RetentionTooLong {
                requested_secs: s,
                max_secs: max,
            }),
            Some(s) => Ok(s.saturating_mul(1000)),
        }
    }

    /// Publish one frame: idempotency, then compare-and-set, then sequence,
    /// append, deliveries and head, all in one transaction.
    ///
    /// # Errors
    /// A limit error, `Conflict` for a reused id with other content, or
    /// `Internal` when the store failed; none of them changed anything.
    pub async fn publish(
        &self,
        sender: DeviceId,
        p: Publish,
    ) -> Result<Durable<Published>, HubError> {
        self.check_topic(&p.topic)?;
        if p.payload.len() > self.limits.max_payload {
            return Err(HubError::PayloadTooLarge {
                len: p.payload.len() as u64,
                max: self.limits.max_payload as u64,
            });
        }
        if p.class == RetentionClass::Mailbox && p.expected_head != ExpectedHead::Unconditional {
            return Err(HubError::HeadConditionOnMailbox);
        }
        // A device's mailbox takes mailbox frames only: a log there would be
        // a second, fetchable channel into it.
        if p.topic.mailbox_owner().is_some() && p.class == RetentionClass::Log {
            return Err(self.not_authorized());
        }
        // A writer-bound topic takes only what its writer key signed. The
        // name binds the key, so this needs no state and no transaction.
        if p.check_writer().is_err() {
            return Err(self.not_authorized());
        }
        let retention_ms = self.retention_ms(p.retention_secs)?;
        let digest = content_digest(p.class, &p.payload);
        // A call run again after a conflict is still one publish: it takes
        // its rate token once.
        let mut charged = false;
        let done = transact!(self, tx => {
            self.publish_in(&mut *tx, sender, &p, digest, retention_ms, &mut charged)
                .await?
        });
        let c = &self.counters;
        let counter = match done.value.outcome {
            PublishOutcome::Accepted { .. } => &c.accepted,
            PublishOutcome::Duplicate { .. } => &c.duplicates,
            PublishOutcome::HeadMismatch { .. } => &c.head_mismatches,
            PublishOutcome::HistoryMissing => &c.history_missing,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(done)
    }

    /// [`HubCore::publish`]'s transaction: the rules of DESIGN.md section 2
    /// over the topic's view as `tx` reads it; the store's isolation makes
    /// the decision and the writes one atomic step.
    async fn publish_in(
        &self,
        tx: &mut dyn HubTxn,
        sender: DeviceId,
        p: &Publish,
        digest: [u8; 32],
        retention_ms: u64,
        charged: &mut bool,
    ) -> Result<Published, HubError> {
        let answer = |outcome: PublishOutcome| {
            // A refusal writes nothing, but its commit still answers a
            // generation: a head it reports must not be one a crash could
            // take back.
            Ok(Published {
                outcome,
                recipients: Vec::new(),
            })
        };
        let owner = p.topic.mailbox_owner();
        let record_key = l::publish_record(&p.topic, &p.publish_id);
        let record = read::<PublishRecord>(tx, &record_key).await?;
        let meta_key = l::topic_meta(&p.topic);
        let mut meta: TopicMeta = read(tx, &meta_key).await?.unwrap_or_default();
        let decision = rules::decide(
            TopicView {
                record: record.as_ref(),
                meta: Some(&meta),
            },
            Attempt {
                digest,
                expected_head: p.expected_head,
                replay_only: p.replay_only,
            },
        );
        // Rate limits count new work only: a retry answered from the
        // idempotency record costs no token, so a replay after an outage
        // is never refused as rate limited.
        if decision.is_new_work() && !*charged {
            let mut keys = vec![RateKey::Device(&sender), RateKey::Topic(&p.topic)];
            if let Some(owner) = &owner {
                keys.push(RateKey::Mailbox {
                    sender: &sender,
                    owner,
                });
            }
            self.rate.check_all(&keys)?;
            *charged = true;
        }
        let seq = match decision {
            Decision::Duplicate { seq } => return answer(PublishOutcome::Duplicate { seq }),
            Decision::Conflict { seq } => {
                self.counters.conflicts.fetch_add(1, Ordering::Relaxed);
                return Err(HubError::Conflict { seq });
            }
            Decision::HistoryMissing => return answer(PublishOutcome::HistoryMissing),
            Decision::HeadMismatch { current } => {
                return answer(PublishOutcome::HeadMismatch { current })
            }
            Decision::Append { seq } => seq,
        };

        // Append: sequence, frame, deliveries, head.
        let now = self.clock.now_ms();
        meta.last_seq = seq;
        let record_expiry = now.saturating_add(self.limits.max_retention.as_millis() as u64);
        tx.put(
            record_key.clone(),
            l::encode(&PublishRecord { seq, digest }),
        );
        tx.put(
            l::expiry(record_expiry, ExpiryKind::PublishRecord, &record_key),
            vec![],
        );

        let mut usage = UsageStage::new();
        // Nothing is written per subscriber: each one's receive stream reads
        // the frame from the topic after its cursor. The subscribers are
        // read only to know whose stream to wake (and, for a mailbox frame,
        // how many must pass it before it goes).
        let recipients: Vec<DeviceId> = match &owner {
            // A device's mailbox delivers to that device alone, whoever else
            // may hold a subscription to it (one made before the form was
            // reserved, say), and whether or not it subscribed here (it may
            // never have, or its subscription went with a store restored
            // from a backup): a Welcome must not depend on the joiner's
            // subscription being in place first.
            Some(owner) if *owner != sender => {
                let u = usage.get(tx, *owner).await?;
                if u.mailbox_frames >= self.limits.max_mailbox_frames {
                    self.counters.mailbox_full.fetch_add(1, Ordering::Relaxed);
                    return Err(HubError::MailboxFull {
                        max: self.limits.max_mailbox_frames,
                    });
                }
                u.mailbox_frames += 1;
                vec![*owner]
            }
            Some(_) => Vec::new(),
            None => {
                let prefix = l::subscriber_prefix(&p.topic);
                let end = crate::kv::prefix_end(&prefix);
                tx.range(&prefix, end.as_deref(), usize::MAX)
                    .await
                    .map_err(internal)?
                    .into_iter()
                    .filter_map(|(k, _)| {
                        let dev = k.get(k.len().saturating_sub(32)..)?;
                        Some(DeviceId(<[u8; 32]>::try_from(dev).ok()?))
                    })
                    .filter(|d| *d != sender)
                    .collect()
            }
        };

        // The publisher's stored bytes: counted for a frame the hub keeps (a
        // log frame, or a mailbox frame someone will receive).
        let adding = p.payload.len() as u64;
        if p.class == RetentionClass::Log || !recipients.is_empty() {
            let u = usage.get(tx, sender).await?;
            if u.stored_bytes.saturating_add(adding) > self.limits.max_stored_bytes {
                self.counters.quota_refusals.fetch_add(1, Ordering::Relaxed);
                return Err(HubError::StorageQuotaExceeded {
                    stored: u.stored_bytes,
                    adding,
                    max: self.limits.max_stored_bytes,
                });
            }
            u.stored_bytes += adding;
        }

        let expires = now.saturating_add(retention_ms);
        let mut frame = StoredFrame {
            sender,
            publish_id: p.publish_id,
            published_at_ms: now,
            expires_at_ms: expires,
            payload: p.payload.clone(),
            remaining: 0,
        };
        match p.class {
            RetentionClass::Log => {
                let fkey = l::log_frame(&p.topic, seq);
                tx.put(l::expiry(expires, ExpiryKind::LogFrame, &fkey), vec![]);
                tx.put(fkey, l::encode(&frame));
                meta.head = Some(seq);
                meta.oldest.get_or_insert(seq);
                meta.log_len += 1;
                if meta.log_len > self.limits.max_log_depth {
                    let excess = meta.log_len - self.limits.max_log_depth;
                    self.trim_prefix(tx, &p.topic, &mut meta, excess, None, &mut usage)
                        .await?;
                    // The new frame is staged, not stored, so the walk cannot
                    // see it: it is the oldest when every stored one went.
                    meta.oldest.get_or_insert(seq);
                }
            }
            RetentionClass::Mailbox => {
                // A mailbox frame nobody will receive is not kept; its
                // idempotency record still is.
                if !recipients.is_empty() {
                    frame.remaining = recipients.len() as u32;
                    let fkey = l::mailbox_frame(&p.topic, seq);
                    tx.put(l::expiry(expires, ExpiryKind::MailboxFrame, &fkey), vec![]);
                    tx.put(fkey, l::encode(&frame));
                }
            }
        }
        tx.put(meta_key, l::encode(&meta));
        usage.stage(tx);
        if !recipients.is_empty() {
            // Other hub processes on this store wake the recipients'
            // streams they hold; this one wakes its own (the server).
            tx.announce(&p.topic, seq, &recipients);
        }
        Ok(Published {
            outcome: PublishOutcome::Accepted {
                seq,
                head: meta.head,
            },
            recipients,
        })
    }

    /// Count and name a refusal of something this device may not do.
    fn not_authorized(&self) -> HubError {
        self.counters.not_authorized.fetch_add(1, Ordering::Relaxed);
        HubError::NotAuthorized
    }

    /// Refuse `device` access to `topic` when it is another device's
    /// mailbox.
    fn check_reader(&self, device: &DeviceId, topic: &TopicId) -> Result<(), HubError> {
        match topic.mailbox_owner() {
            Some(owner) if owner != *device => Err(self.not_authorized()),
            _ => Ok(()),
        }
    }

    /// Remove up to `count` frames from the oldest end of a topic's log, or,
    /// with `expired_at`, every frame from the oldest end while it is expired.
    /// Stages the removals into `tx` and changes `meta`; returns how many.
    async fn trim_prefix(
        &self,
        tx: &mut dyn HubTxn,
        topic: &TopicId,
        meta: &mut TopicMeta,
        count: u64,
        expired_at: Option<u64>,
        usage: &mut UsageStage,
    ) -> Result<u64, HubError> {
        const CHUNK: usize = 256;
        let Some(oldest) = meta.oldest else {
            return Ok(0);
        };
        let end = crate::kv::prefix_end(&l::log_prefix(topic));
        let mut cursor = l::log_frame(topic, oldest);
        let mut removed = 0u64;
        let mut new_oldest = None;
        'walk: loop {
            let rows = tx
                .range(&cursor, end.as_deref(), CHUNK)
                .await
                .map_err(internal)?;
            for (k, v) in &rows {
                let Some((_, seq)) = l::parse_frame_key(k) else {
                    continue;
                };
                let frame = l::decode::<StoredFrame>(k, v).map_err(kv_internal)?;
                let expires = frame.expires_at_ms;
                let keep = removed >= count || expired_at.is_some_and(|at| expires > at);
                if keep {
                    new_oldest = Some(seq);
                    // Frames behind this one may have expired already and had
                    // their expiry entries spent while this one blocked them:
                    // the new oldest frame carries the trigger that resumes
                    // the walk (a repeated put of the same key is harmless).
                    tx.put(l::expiry(expires, ExpiryKind::LogFrame, k), vec![]);
                    break 'walk;
                }
                tx.delete(k.clone());
                usage
                    .release_bytes(tx, frame.sender, frame.payload.len())
                    .await?;
                meta.removed_through = meta.removed_through.max(seq);
                meta.log_len = meta.log_len.saturating_sub(1);
                removed += 1;
            }
            match rows.last() {
                Some((last, _)) if rows.len() == CHUNK => {
                    cursor = last.clone();
                    cursor.push(0);
                }
                _ => break,
            }
        }
        meta.oldest = new_oldest;
        self.counters.trimmed.fetch_add(removed, Ordering::Relaxed);
        Ok(removed)
    }

    /// Read a topic's log after `after`, for `device`. Returns only durable
    /// frames.
    ///
    /// # Errors
    /// `BadTopic`, `NotAuthorized` (another device's mailbox),
    /// `BadFetchLimit`, or `Internal`.
    ///
    /// # Cancel safety
    /// Cancel safe: it changes nothing.
    pub async fn fetch(
        &self,
        device: DeviceId,
        topic: &TopicId,
        after: u64,
        limit: u32,
    ) -> Result<FetchResult, HubError> {
        self.check_topic(topic)?;
        self.check_reader(&device, topic)?;
        if limit == 0 || limit > self.limits.max_fetch {
            return Err(HubError::BadFetchLimit {
                requested: limit,
                max: self.limits.max_fetch,
            });
        }
        let meta_key = l::topic_meta(topic);
        let seen = transact!(self, tx => {
            read::<TopicMeta>(&mut *tx, &meta_key).await?.unwrap_or_default()
        });
        self.durable(seen.gen).await?;
        let seen = seen.value;
        // Trims since the snapshot only move `removed_through` and `oldest`
        // forward; report the newest values so a reader never misses a gap.
        let now: TopicMeta = self.read_committed(&meta_key).await?.unwrap_or_default();
        let mut messages = Vec::new();
        let mut bytes = 0usize;
        if after < seen.last_seq {
            let start = l::log_frame(topic, after + 1);
            let end = l::log_frame(topic, seen.last_seq + 1);
            for (k, v) in self
                .store
                .range(&start, Some(&end), limit as usize)
                .await
                .map_err(internal)?
            {
                let Some((_, seq)) = l::parse_frame_key(&k) else {
                    continue;
                };
                let f: StoredFrame = l::decode(&k, &v).map_err(kv_internal)?;
                // Keep the answer within one frame: stop before the payloads
                // add up past the payload limit (always at least one frame).
                bytes += f.payload.len();
                if !messages.is_empty() && bytes > self.limits.max_payload {
                    break;
                }
                messages.push(LogFrame {
                    seq,
                    sender: f.sender,
                    publish_id: f.publish_id,
                    published_at_ms: f.published_at_ms,
                    payload: f.payload,
                });
            }
        }
        Ok(FetchResult {
            messages,
            head: seen.head,
            oldest: now.oldest,
            gap: now.removed_through > after,
        })
    }

    /// Read and decode `key` outside a transaction (what is committed now).
    async fn read_committed<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
    ) -> Result<Option<T>, HubError> {
        match self.store.get(key).await.map_err(internal)? {
            Some(bytes) => Ok(Some(l::decode(key, &bytes).map_err(kv_internal)?)),
            None => Ok(None),
        }
    }

    /// Requests refused with `RateLimited` so far, by scope.
    pub fn rate_limit_refusals(&self) -> crate::hub::RateLimitRefusals {
        self.rate.refusals()
    }

    /// The last sequence number `topic` has given out (0 for none), as
    /// committed now: how far a receive stream may read it.
    ///
    /// # Errors
    /// `Internal`.
    pub async fn last_seq(&self, topic: &TopicId) -> Result<u64, HubError> {
        Ok(self
            .read_committed::<TopicMeta>(&l::topic_meta(topic))
            .await?
            .map_or(0, |m| m.last_seq))
    }

    /// Subscribe `device` to `topic` (or change the retention of an existing
    /// subscription): [`HubCore::change_subscriptions`] with that one change.
    ///
    /// # Errors
    /// `BadTopic`, `NotAuthorized` (another device's mailbox),
    /// `RetentionTooLong`, `TooManySubscriptions`, `RateLimited`, `Internal`.
    pub async fn subscribe(
        &self,
        device: DeviceId,
        topic: &TopicId,
        retention_secs: Option<u64>,
    ) -> Result<Durable<()>, HubError> {
        let change = SubscriptionChange::Subscribe {
            topic: topic.clone(),
            retention_secs,
        };
        let r = self.change_subscriptions(device, &[change]).await?;
        match r.value.into_iter().next() {
            Some(ChangeOutcome::Refused(e)) => Err(e),
            _ => Ok(Durable {
                value: (),
                gen: r.gen,
            }),
        }
    }

    /// Drop a subscription and its cursor: [`HubCore::change_subscriptions`]
    /// with that one change. Answers whether there was one.
    ///
    /// # Errors
    /// `BadTopic`, `RateLimited`, `Internal`.
    pub async fn unsubscribe(
        &self,
        device: DeviceId,
        topic: &TopicId,
    ) -> Result<Durable<bool>, HubError> {
        let change = SubscriptionChange::Unsubscribe {
            topic: topic.clone(),
        };
        let r = self.change_subscriptions(device, &[change]).await?;
        match r.value.into_iter().next() {
            Some(ChangeOutcome::Refused(e)) => Err(e),
            Some(ChangeOutcome::Unsubscribed { existed }) => Ok(Durable {
                value: existed,
                gen: r.gen,
            }),
            _ => Ok(Durable {
                value: false,
                gen: r.gen,
            }),
        }
    }

    /// Apply `changes` to `device`'s subscriptions in order, in one
    /// transaction; each is taken or refused on its own, and a later change
    /// of a topic sees an earlier one.
    ///
    /// - **Subscribe** creates a subscription, or changes the retention of
    ///   one. A new subscription's cursor starts at the topic's last frame:
    ///   frames published from now on are pushed to it. A device's own
    ///   mailbox keeps the cursor it has (from its first frame when it never
    ///   had one), so nothing posted there before is skipped.
    /// - **Unsubscribe** drops a subscription and its cursor (a device's
    ///   own mailbox keeps its cursor: the mailbox is its whoever
    ///   subscribes).
    ///
    /// Paced by the device's subscription bucket: one token per request,
    /// checked before anything is read, and one per subscription written,
    /// charged after. Subscribing again with the same retention writes
    /// nothing, so re-subscribing after a reconnect costs one token.
    ///
    /// # Errors
    /// The whole request: `TooManyChanges`, `RateLimited`, `Internal`, and
    /// nothing changed. One change ([`ChangeOutcome::Refused`]): `BadTopic`,
    /// `NotAuthorized` (another device's mailbox), `RetentionTooLong`,
    /// `TooManySubscriptions` (only for a new subscription).
    pub async fn change_subscriptions(
        &self,
        device: DeviceId,
        changes: &[SubscriptionChange],
    ) -> Result<Durable<Vec<ChangeOutcome>>, HubError> {
        if changes.len() > MAX_SUBSCRIPTION_CHANGES {
            return Err(HubError::TooManyChanges {
                count: changes.len() as u64,
                max: MAX_SUBSCRIPTION_CHANGES as u64,
            });
        }
        // What each change asks for: `Some(retention)` to be subscribed
        // with, `None` not to be; or why it is refused before any read.
        let wanted: Vec<Result<Option<u64>, HubError>> = changes
            .iter()
            .map(|c| {
                self.check_topic(c.topic())?;
                match c {
                    SubscriptionChange::Subscribe {
                        topic,
                        retention_secs,
                    } => {
                        self.check_reader(&device, topic)?;
                        Ok(Some(self.retention_ms(*retention_secs)? / 1000))
                    }
                    SubscriptionChange::Unsubscribe { .. } => Ok(None),
                }
            })
            .collect();
        self.rate.check_all(&[RateKey::Subscriptions(&device)])?;
        let dkey = l::device_meta(&device);
        let max = self.limits.max_subscriptions;
        let done = transact!(self, tx => {
            let mut dmeta: DeviceMeta = read(&mut *tx, &dkey).await?.unwrap_or_default();
            let count_before = dmeta.subscriptions;
            // The subscriptions the changes touch and the heads of the
            // topics they subscribe to, read at once.
            let touched: Vec<&TopicId> = changes
                .iter()
                .zip(&wanted)
                .filter(|(_, w)| w.is_ok())
                .map(|(c, _)| c.topic())
                .collect();
            let sub_keys: Vec<Vec<u8>> =
                touched.iter().map(|t| l::subscriber(t, &device)).collect();
            let meta_keys: Vec<Vec<u8>> = touched.iter().map(|t| l::topic_meta(t)).collect();
            let subs = tx.get_many(&sub_keys).await.map_err(internal)?;
            let metas = tx.get_many(&meta_keys).await.map_err(internal)?;
            // What each touched topic is as the transaction goes: its
            // retention when subscribed, and its head. (The transaction's
            // reads see the store as it began, not its own writes.)
            let mut now: BTreeMap<TopicId, (Option<u64>, u64)> = BTreeMap::new();
            for (i, topic) in touched.iter().enumerate() {
                let sub: Option<Subscription> = match &subs[i] {
                    Some(v) => Some(l::decode(&sub_keys[i], v).map_err(kv_internal)?),
                    None => None,
                };
                let meta: TopicMeta = match &metas[i] {
                    Some(v) => l::decode(&meta_keys[i], v).map_err(kv_internal)?,
                    None => TopicMeta::default(),
                };
                now.entry((*topic).clone())
                    .or_insert((sub.map(|s| s.retention_secs), meta.last_seq));
            }
            let mut written = 0usize;
            let mut outcomes = Vec::with_capacity(changes.len());
            for (change, wanted) in changes.iter().zip(&wanted) {
                let want = match wanted {
                    Ok(w) => *w,
                    Err(e) => {
                        outcomes.push(ChangeOutcome::Refused(e.clone()));
                        continue;
                    }
                };
                let topic = change.topic();
                let skey = l::subscriber(topic, &device);
                let (current, last_seq) = now.get(topic).copied().unwrap_or_default();
                let own_mailbox = topic.mailbox_owner() == Some(device);
                let outcome = match (want, current) {
                    (Some(secs), current) => {
                        if current.is_none() {
                            if dmeta.subscriptions >= max {
                                outcomes.push(ChangeOutcome::Refused(
                                    HubError::TooManySubscriptions { max },
                                ));
                                continue;
                            }
                            dmeta.subscriptions += 1;
                            tx.put(l::device_subscription(&device, topic), vec![]);
                            if !own_mailbox {
                                tx.put(l::cursor(&device, topic), l::cursor_value(last_seq));
                            }
                        }
                        if current != Some(secs) {
                            tx.put(
                                skey,
                                l::encode(&Subscription {
                                    retention_secs: secs,
                                }),
                            );
                            written += 1;
                        }
                        ChangeOutcome::Subscribed
                    }
                    (None, Some(_)) => {
                        dmeta.subscriptions = dmeta.subscriptions.saturating_sub(1);
                        tx.delete(skey);
                        tx.delete(l::device_subscription(&device, topic));
                        if !own_mailbox {
                            tx.delete(l::cursor(&device, topic));
                        }
                        written += 1;
                        ChangeOutcome::Unsubscribed { existed: true }
                    }
                    (None, None) => ChangeOutcome::Unsubscribed { existed: false },
                };
                now.insert(topic.clone(), (want, last_seq));
                outcomes.push(outcome);
            }
            if dmeta.subscriptions != count_before {
                tx.put(dkey.clone(), l::encode(&dmeta));
            }
            (outcomes, written)
        });
        self.rate.charge_subscriptions(&device, done.value.1);
        Ok(Durable {
            value: done.value.0,
            gen: done.gen,
        })
    }

    /// Where `device`'s receive stream starts: every topic it subscribed to
    /// and its own mailbox, each with its stored cursor and how far its
    /// frames are durable.
    ///
    /// # Errors
    /// `Internal`.
    pub async fn stream_start(&self, device: DeviceId) -> Result<Vec<TopicStart>, HubError> {
        let prefix = l::device_subscription_prefix(&device);
        let end = crate::kv::prefix_end(&prefix);
        let seen = transact!(self, tx => {
            let rows = tx
                .range(&prefix, end.as_deref(), usize::MAX)
                .await
                .map_err(internal)?;
            let mut topics: Vec<TopicId> = rows
                .iter()
                .filter_map(|(k, _)| l::parse_device_subscription(k))
                .collect();
            let mailbox = TopicId::mailbox(&device);
            if !topics.contains(&mailbox) {
                topics.push(mailbox);
            }
            self.topic_starts_in(&mut *tx, device, topics).await?
        });
        self.durable(seen.gen).await?;
        Ok(seen.value)
    }

    /// [`HubCore::stream_start`] for one topic: `None` when `device` neither
    /// subscribed to it nor owns it.
    ///
    /// # Errors
    /// `Internal`.
    pub async fn topic_start(
        &self,
        device: DeviceId,
        topic: &TopicId,
    ) -> Result<Option<TopicStart>, HubError> {
        let seen = transact!(self, tx => {
            self.topic_starts_in(&mut *tx, device, vec![topic.clone()])
                .await?
                .pop()
        });
        self.durable(seen.gen).await?;
        Ok(seen.value)
    }

    /// Where `device`'s stream starts on each of `topics` it subscribed to
    /// or owns (the others are left out), in three batched reads: the
    /// subscriptions, the cursors, the topics' heads.
    async fn topic_starts_in(
        &self,
        tx: &mut dyn HubTxn,
        device: DeviceId,
        topics: Vec<TopicId>,
    ) -> Result<Vec<TopicStart>, HubError> {
        let keys: Vec<Vec<u8>> = topics.iter().map(|t| l::subscriber(t, &device)).collect();
        let subs = tx.get_many(&keys).await.map_err(internal)?;
        let mut followed = Vec::with_capacity(topics.len());
        for ((topic, key), sub) in topics.into_iter().zip(&keys).zip(subs) {
            let sub: Option<Subscription> = match sub {
                Some(v) => Some(l::decode(key, &v).map_err(kv_internal)?),
                None => None,
            };
            let retention_secs = match sub {
                Some(s) => s.retention_secs,
                None if topic.mailbox_owner() == Some(device) => {
                    self.limits.max_retention.as_secs()
                }
                None => continue,
            };
            followed.push((topic, retention_secs));
        }
        let cursor_keys: Vec<Vec<u8>> = followed
            .iter()
            .map(|(t, _)| l::cursor(&device, t))
            .collect();
        let meta_keys: Vec<Vec<u8>> = followed.iter().map(|(t, _)| l::topic_meta(t)).collect();
        let cursors = tx.get_many(&cursor_keys).await.map_err(internal)?;
        let metas = tx.get_many(&meta_keys).await.map_err(internal)?;
        let mut out = Vec::with_capacity(followed.len());
        for (i, ((topic, retention_secs), (cursor, meta))) in followed
            .into_iter()
            .zip(cursors.into_iter().zip(metas))
            .enumerate()
        {
            // No cursor: the device's own mailbox, or a subscription of a
            // store written before protocol version 4. Both read
            // everything held.
            let cursor = match cursor {
                Some(v) => l::parse_cursor(&cursor_keys[i], &v).map_err(kv_internal)?,
                None => 0,
            };
            let meta: TopicMeta = match meta {
                Some(v) => l::decode(&meta_keys[i], &v).map_err(kv_internal)?,
                None => TopicMeta::default(),
            };
            out.push(TopicStart {
                topic,
                cursor,
                durable_through: meta.last_seq,
                max_age_ms: retention_secs.saturating_mul(1000),
            });
        }
        Ok(out)
    }

    /// Up to `limit` frames of `topic` for `device`'s receive stream, above
    /// `after` and up to `through` (which the caller knows to be durable):
    /// log and mailbox frames in sequence order, but the device's own frames
    /// and frames older than `max_age_ms`, which are passed over.
    ///
    /// # Errors
    /// `Internal`.
    ///
    /// # Cancel safety
    /// Cancel safe: it changes nothing.
    pub async fn stream_page(
        &self,
        device: DeviceId,
        topic: &TopicId,
        after: u64,
        through: u64,
        max_age_ms: u64,
        limit: usize,
    ) -> Result<StreamPage, HubError> {
        let mut page = StreamPage {
            frames: Vec::new(),
            scanned_through: after,
            missed: None,
        };
        if through <= after {
            return Ok(page);
        }
        let meta: TopicMeta = self
            .read_committed(&l::topic_meta(topic))
            .await?
            .unwrap_or_default();
        if meta.removed_through > after {
            let through_seq = meta.removed_through.min(through);
            page.missed = Some((after, through_seq));
            self.counters.frames_missed.fetch_add(1, Ordering::Relaxed);
        }
        // Log and mailbox frames of one topic share its sequence numbers;
        // read both and merge. When either read is cut by `limit`, the page
        // ends at the last frame of the shorter one.
        let mut bound = through;
        let mut rows = Vec::new();
        for (class, start, end) in [
            (
                RetentionClass::Log,
                l::log_frame(topic, after + 1),
                l::log_frame(topic, through.saturating_add(1)),
            ),
            (
                RetentionClass::Mailbox,
                l::mailbox_frame(topic, after + 1),
                l::mailbox_frame(topic, through.saturating_add(1)),
            ),
        ] {
            let got = self
                .store
                .range(&start, Some(&end), limit)
                .await
                .map_err(internal)?;
            if got.len() == limit {
                if let Some((_, seq)) = got.last().and_then(|(k, _)| l::parse_frame_key(k)) {
                    bound = bound.min(seq);
                }
            }
            rows.extend(got.into_iter().map(|(k, v)| (class, k, v)));
        }
        let now = self.clock.now_ms();
        let mut frames = Vec::new();
        for (class, k, v) in rows {
            let Some((_, seq)) = l::parse_frame_key(&k) else {
                continue;
            };
            if seq > bound {
                continue;
            }
            let f: StoredFrame = l::decode(&k, &v).map_err(kv_internal)?;
            if f.sender == device || f.published_at_ms.saturating_add(max_age_ms) < now {
                continue;
            }
            frames.push(Delivery {
                topic: topic.clone(),
                seq,
                class,
                sender: f.sender,
                publish_id: f.publish_id,
                published_at_ms: f.published_at_ms,
                payload: f.payload,
            });
        }
        frames.sort_by_key(|d| d.seq);
        page.frames = frames;
        page.scanned_through = bound;
        Ok(page)
    }

    /// Save the cursors of `device`'s subscriptions that its receive stream
    /// moved: each `(topic, cursor)` moves forward only, and only for a
    /// topic the device still subscribes to (or owns). A mailbox frame the
    /// cursor passes counts this device as done with it; it goes when
    /// every recipient is.
    ///
    /// # Errors
    /// `Internal`.
    pub async fn save_cursors(
        &self,
        device: DeviceId,
        cursors: &[(TopicId, u64)],
    ) -> Result<Durable<()>, HubError> {
        Ok(transact!(self, tx => {
            let mut usage = UsageStage::new();
            let mut frames: BTreeMap<Vec<u8>, Option<StoredFrame>> = BTreeMap::new();
            for (topic, new) in cursors {
                let own_mailbox = topic.mailbox_owner() == Some(device);
                if !own_mailbox
                    && tx
                        .get(&l::subscriber(topic, &device))
                        .await
                        .map_err(internal)?
                        .is_none()
                {
                    continue;
                }
                let ckey = l::cursor(&device, topic);
                let old = match tx.get(&ckey).await.map_err(internal)? {
                    Some(v) => l::parse_cursor(&ckey, &v).map_err(kv_internal)?,
                    None => 0,
                };
                if *new <= old {
                    continue;
                }
                tx.put(ckey, l::cursor_value(*new));
                let start = l::mailbox_frame(topic, old + 1);
                let end = l::mailbox_frame(topic, new.saturating_add(1));
                for (k, v) in tx.range(&start, Some(&end), usize::MAX).await.map_err(internal)? {
                    let f: StoredFrame = l::decode(&k, &v).map_err(kv_internal)?;
                    if f.sender != device {
                        release_mailbox(&mut *tx, &k, &mut frames).await?;
                    }
                }
            }
            stage_mailbox_frames(&mut *tx, frames, &mut usage).await?;
            usage.stage(&mut *tx);
        }))
    }

    /// What `device` uses of its per-device quotas now (including changes
    /// not yet durable).
    ///
    /// # Errors
    /// `Internal`.
    pub async fn usage(&self, device: DeviceId) -> Result<DeviceUsage, HubError> {
        Ok(self
            .read_committed(&l::device_usage(&device))
            .await?
            .unwrap_or_default())
    }

    /// Add key packages to `device`'s pool (all or none) and optionally set
    /// its last-resort package.
    ///
    /// # Errors
    /// `BadKeyPackage`, `KeyPackagePoolFull`, `RateLimited`, `Internal`.
    pub async fn upload_key_packages(
        &self,
        device: DeviceId,
        packages: &[Vec<u8>],
        last_resort: Option<Vec<u8>>,
    ) -> Result<Durable<u32>, HubError> {
        self.store_key_packages(device, packages, last_resort, false)
            .await
    }

    /// Replace `device`'s whole pool with `packages` (and set its last
    /// resort when given), in one transaction: no claim sees a mix of old
    /// and new. Only the device itself reaches this (its authenticated
    /// connection names it). Answers the pool size.
    ///
    /// # Errors
    /// As [`Self::upload_key_packages`].
    pub async fn replace_key_packages(
        &self,
        device: DeviceId,
        packages: &[Vec<u8>],
        last_resort: Option<Vec<u8>>,
    ) -> Result<Durable<u32>, HubError> {
        self.store_key_packages(device, packages, last_resort, true)
            .await
    }

    async fn store_key_packages(
        &self,
        device: DeviceId,
        packages: &[Vec<u8>],
        last_resort: Option<Vec<u8>>,
        replace: bool,
    ) -> Result<Durable<u32>, HubError> {
        let max = self.limits.max_key_package_bytes;
        for kp in packages.iter().chain(last_resort.iter()) {
            if kp.is_empty() || kp.len() > max {
                return Err(HubError::BadKeyPackage {
                    len: kp.len() as u64,
                    max: max as u64,
                });
            }
        }
        self.rate.check(&device, None)?;
        let mkey = l::key_package_meta(&device);
        let prefix = l::key_package_prefix(&device);
        let prefix_end = crate::kv::prefix_end(&prefix);
        Ok(transact!(self, tx => {
            let mut meta: KeyPackageMeta = read(&mut *tx, &mkey).await?.unwrap_or_default();
            if replace {
                // The pool is bounded (`max_key_packages`): one range read.
                let rows = tx
                    .range(&prefix, prefix_end.as_deref(), usize::MAX)
                    .await
                    .map_err(internal)?;
                for (k, _) in rows {
                    tx.delete(k);
                }
                meta.pool = 0;
            }
            let adding = packages.len() as u64;
            if meta.pool as u64 + adding > self.limits.max_key_packages as u64 {
                return Err(HubError::KeyPackagePoolFull {
                    pool: meta.pool,
                    adding: adding.min(u32::MAX as u64) as u32,
                    max: self.limits.max_key_packages,
                });
            }
            for kp in packages {
                tx.put(l::key_package(&device, meta.next), kp.clone());
                meta.next += 1;
                meta.pool += 1;
            }
            if last_resort.is_some() {
                meta.last_resort = last_resort.clone();
            }
            tx.put(mkey.clone(), l::encode(&meta));
            meta.pool
        }))
    }

    /// Claim one of `device`'s key packages: each pool package goes to exactly
    /// one claimer; only with the pool empty, the reusable last resort.
    ///
    /// A claim takes a token from the claimer's device bucket, its claimer
    /// bucket and the target's bucket, or from none of them: a burst of
    /// claims, by one claimer or by many, stops at a rate limit and never
    /// empties a pool faster than the target's rate.
    ///
    /// # Errors
    /// `RateLimited` (`device`, `claimer` or `target`; nothing is handed
    /// out, not even the last resort), `NoKeyPackage`, `Internal`.
    pub async fn claim_key_package(
        &self,
        claimer: DeviceId,
        device: DeviceId,
    ) -> Result<Durable<(Vec<u8>, bool)>, HubError> {
        self.rate.check_all(&[
            RateKey::Device(&claimer),
            RateKey::Claimer(&claimer),
            RateKey::Target(&device),
        ])?;
        let mkey = l::key_package_meta(&device);
        let prefix = l::key_package_prefix(&device);
        let prefix_end = crate::kv::prefix_end(&prefix);
        let claimed = transact!(self, tx => {
            let mut meta: KeyPackageMeta = read(&mut *tx, &mkey).await?.unwrap_or_default();
            let mut from_pool = None;
            if meta.pool > 0 {
                let rows = tx
                    .range(&prefix, prefix_end.as_deref(), 1)
                    .await
                    .map_err(internal)?;
                match rows.into_iter().next() {
                    Some((k, v)) => {
                        meta.pool -= 1;
                        tx.delete(k);
                        from_pool = Some(v);
                    }
                    None => {
                        // The stored packages are the truth: a count with
                        // none behind it is repaired, and only then is the
                        // pool empty.
                        tracing::error!(%device, pool = meta.pool, "key package count without packages; repaired");
                        meta.pool = 0;
                    }
                }
                tx.put(mkey.clone(), l::encode(&meta));
            }
            match from_pool {
                Some(kp) => Some((kp, false)),
                None => meta.last_resort.map(|kp| (kp, true)),
            }
        });
        match claimed.value {
            Some(value) => Ok(Durable {
                value,
                gen: claimed.gen,
            }),
            None => Err(HubError::NoKeyPackage),
        }
    }

    /// How many key packages `device` has in its pool, and whether it has a
    /// last resort.
    ///
    /// # Errors
    /// `Internal`.
    pub async fn key_package_status(
        &self,
        device: DeviceId,
    ) -> Result<Durable<(u32, bool)>, HubError> {
        let mkey = l::key_package_meta(&device);
        Ok(transact!(self, tx => {
            let meta: KeyPackageMeta = read(&mut *tx, &mkey).await?.unwrap_or_default();
            (meta.pool, meta.last_resort.is_some())
        }))
    }

    /// The SHA-256 of each package in `device`'s pool, in claim order
    /// (the pool is bounded by `max_key_packages`).
    ///
    /// # Errors
    /// `Internal`.
    pub async fn key_package_digests(
        &self,
        device: DeviceId,
    ) -> Result<Durable<Vec<[u8; 32]>>, HubError> {
        let prefix = l::key_package_prefix(&device);
        let prefix_end = crate::kv::prefix_end(&prefix);
        Ok(transact!(self, tx => {
            let rows = tx
                .range(&prefix, prefix_end.as_deref(), usize::MAX)
                .await
                .map_err(internal)?;
            rows.iter()
                .map(|(_, v)| Sha256::digest(v).into())
                .collect::<Vec<[u8; 32]>>()
        }))
    }

    /// Drop everything whose retention ran out by `now_ms` (the clock's now
    /// when `None`). Logs are trimmed only from their oldest end.
    ///
    /// # Errors
    /// `Internal`.
    pub async fn purge(&self, now_ms: Option<u64>) -> Result<Durable<PurgeReport>, HubError> {
        const PAGE: usize = 512;
        let now = now_ms.unwrap_or_else(|| self.clock.now_ms());
        self.rate.prune();
        let mut report = PurgeReport::default();
        loop {
            let pass = transact!(self, tx => self.purge_page(&mut *tx, now, PAGE).await?);
            let (part, rows) = pass.value;
            report.log_frames += part.log_frames;
            report.mailbox_frames += part.mailbox_frames;
            report.legacy_deliveries += part.legacy_deliveries;
            report.publish_records += part.publish_records;
            if rows < PAGE {
                return Ok(Durable {
                    value: report,
                    gen: pass.gen,
                });
            }
        }
    }

    /// One page of [`HubCore::purge`]: up to `page` expiry entries due by
    /// `now`, and what they name. Returns what it removed and how many
    /// entries it read.
    async fn purge_page(
        &self,
        tx: &mut dyn HubTxn,
        now: u64,
        page: usize,
    ) -> Result<(PurgeReport, usize), HubError> {
        let mut report = PurgeReport::default();
        let rows = tx
            .range(&l::expiry_start(), Some(&l::expiry_end(now)), page)
            .await
            .map_err(internal)?;
        let mut usage = UsageStage::new();
        let mut frames: BTreeMap<Vec<u8>, Option<StoredFrame>> = BTreeMap::new();
        let mut metas: BTreeMap<TopicId, TopicMeta> = BTreeMap::new();
        let mut deleted = std::collections::BTreeSet::new();
        for (ek, _) in &rows {
            tx.delete(ek.clone());
            let Some((kind, target)) = l::parse_expiry(ek) else {
                continue;
            };
            match kind {
                ExpiryKind::PublishRecord => {
                    if deleted.insert(target.to_vec())
                        && tx.get(target).await.map_err(internal)?.is_some()
                    {
                        tx.delete(target.to_vec());
                        report.publish_records += 1;
                    }
                }
                ExpiryKind::Delivery => {
                    if deleted.insert(target.to_vec())
                        && tx.get(target).await.map_err(internal)?.is_some()
                    {
                        tx.delete(target.to_vec());
                        report.legacy_deliveries += 1;
                    }
                }
                ExpiryKind::MailboxFrame => {
                    if !frames.contains_key(target) {
                        // A frame gone already (every recipient passed it)
                        // stays out of the map: nothing of it to release.
                        if let Some(f) = read::<StoredFrame>(tx, target).await? {
                            frames.insert(target.to_vec(), Some(f));
                        }
                    }
                    if let Some(slot) = frames.get_mut(target) {
                        if let Some(f) = slot.take() {
                            usage.release_bytes(tx, f.sender, f.payload.len()).await?;
                            report.mailbox_frames += 1;
                        }
                    }
                }
                ExpiryKind::LogFrame => {
                    let Some((topic, _)) = l::parse_frame_key(target) else {
                        continue;
                    };
                    if metas.contains_key(&topic) {
                        continue;
                    }
                    let mut meta: TopicMeta =
                        read(tx, &l::topic_meta(&topic)).await?.unwrap_or_default();
                    let n = self
                        .trim_prefix(tx, &topic, &mut meta, u64::MAX, Some(now), &mut usage)
                        .await?;
                    report.log_frames += n;
                    metas.insert(topic, meta);
                }
            }
        }
        stage_mailbox_frames(tx, frames, &mut usage).await?;
        for (topic, meta) in metas {
            tx.put(l::topic_meta(&topic), l::encode(&meta));
        }
        usage.stage(tx);
        Ok((report, rows.len()))
    }

    /// The wall clock this core uses.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }
}

/// Write back the mailbox frames an operation touched: a frame some
/// recipient still holds is kept, any other is deleted and its bytes are
/// released from its sender's usage (and, in a device's own mailbox, from
/// the owner's count). A frame already taken out (`None`) had its bytes
/// released when it was taken.
async fn stage_mailbox_frames(
    tx: &mut dyn HubTxn,
    frames: BTreeMap<Vec<u8>, Option<StoredFrame>>,
    usage: &mut UsageStage,
) -> Result<(), HubError> {
    for (k, f) in frames {
        match f {
            Some(f) if f.remaining > 0 => tx.put(k, l::encode(&f)),
            Some(f) => {
                usage.release_bytes(tx, f.sender, f.payload.len()).await?;
                release_owner(tx, &k, usage).await?;
                tx.delete(k);
            }
            None => {
                release_owner(tx, &k, usage).await?;
                tx.delete(k);
            }
        }
    }
    Ok(())
}

/// A frame of a device's own mailbox is going away: it no longer counts
/// against that device's `max_mailbox_frames`.
async fn release_owner(
    tx: &mut dyn HubTxn,
    fkey: &[u8],
    usage: &mut UsageStage,
) -> Result<(), HubError> {
    if let Some(owner) = l::parse_frame_key(fkey).and_then(|(t, _)| t.mailbox_owner()) {
        usage.release_mailbox_frame(tx, owner).await?;
    }
    Ok(())
}

/// Count one recipient of a mailbox frame as done, staging in `frames`.
async fn release_mailbox(
    tx: &mut dyn HubTxn,
    fkey: &[u8],
    frames: &mut BTreeMap<Vec<u8>, Option<StoredFrame>>,
) -> Result<(), HubError> {
    if !frames.contains_key(fkey) {
        if let Some(f) = read::<StoredFrame>(tx, fkey).await? {
            frames.insert(fkey.to_vec(), Some(f));
        }
    }
    if let Some(Some(f)) = frames.get_mut(fkey) {
        f.remaining = f.remaining.saturating_sub(1);
    }
    Ok(())
}
