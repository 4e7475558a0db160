//! The hub's protocol logic over its store, with no networking.
//!
//! Every mutating call runs under one write lock, reads what it needs, and
//! applies all of its changes as one atomic batch, so a crash leaves either
//! the state before the call or the state after it. Each call returns the
//! batch's generation; the caller answers only once [`HubCore::durable`] says
//! that generation is flushed. Reads only ever return what is durable, so no
//! device can act on a frame a crash could still take back.
//!
//! Opening a core reads the store's identity ([`StoreId`]), or, in a store
//! that has none, draws one from the hub's rng and flushes it before the
//! core serves anything, so every answer the hub gives is tied to an
//! identity that a crash cannot take back.

use super::flush::GroupCommit;
use super::layout::{self as l, DeliveryRef, DeviceMeta, DeviceUsage, ExpiryKind, KeyPackageMeta};
use super::layout::{PublishRecord, StoredFrame, Subscription, TopicMeta};
use super::limits::{Limits, RateKey, RateLimiter};
use super::rules::{self, Attempt, Decision, TopicView};
use crate::clock::Clock;
use crate::kv::{KvError, KvStore, WriteBatch};
use crate::rng::SharedRng;
use crate::wire::{
    Delivery, DeviceId, ExpectedHead, FetchResult, HubError, LogFrame, Publish, PublishOutcome,
    RetentionClass, StoreId, TopicId,
};
use sha2::{Digest, Sha256};
use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

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
    /// Devices that got a new delivery.
    pub recipients: Vec<DeviceId>,
    /// Subscribers whose delivery was dropped because their queue was full
    /// (their receive stream, if any, is woken to report it).
    pub dropped_for: Vec<DeviceId>,
}

/// A page of a device's deliveries.
#[derive(Debug, Default)]
pub struct DeliveryBatch {
    /// Deliveries in id order.
    pub deliveries: Vec<Delivery>,
    /// The cursor to continue after (past dropped references too).
    pub scanned_through: u64,
    /// Whether more may follow right away.
    pub more: bool,
    /// On the last page only: `(after_id, count)` when deliveries to this
    /// device were dropped because its queue was full and that was not yet
    /// reported. Report it, then [`HubCore::clear_dropped`] the count.
    pub dropped: Option<(u64, u64)>,
}

/// What one purge pass removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Log frames trimmed (always a prefix of their topic's log).
    pub log_frames: u64,
    /// Mailbox frames dropped.
    pub mailbox_frames: u64,
    /// Deliveries dropped unacknowledged.
    pub deliveries: u64,
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
    pub deliveries_dropped: AtomicU64,
    pub quota_refusals: AtomicU64,
    pub not_authorized: AtomicU64,
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
    fn get(&mut self, core: &HubCore, device: DeviceId) -> Result<&mut DeviceUsage, HubError> {
        let slot = match self.map.entry(device) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => {
                let u: DeviceUsage = core.read(&l::device_usage(&device))?.unwrap_or_default();
                v.insert((u, u))
            }
        };
        Ok(&mut slot.1)
    }

    /// A frame of `sender` holding `bytes` of payload is going away.
    fn release_bytes(
        &mut self,
        core: &HubCore,
        sender: DeviceId,
        bytes: usize,
    ) -> Result<(), HubError> {
        let u = self.get(core, sender)?;
        u.stored_bytes = u.stored_bytes.saturating_sub(bytes as u64);
        Ok(())
    }

    /// One queued delivery of `device` is going away.
    fn release_delivery(&mut self, core: &HubCore, device: DeviceId) -> Result<(), HubError> {
        let u = self.get(core, device)?;
        u.queued = u.queued.saturating_sub(1);
        Ok(())
    }

    fn stage(self, batch: &mut WriteBatch) {
        for (device, (read, now)) in self.map {
            if read != now {
                batch.put(l::device_usage(&device), l::encode(&now));
            }
        }
    }
}

/// The hub's logic: publish, fetch, subscriptions, deliveries, key packages,
/// retention.
pub struct HubCore {
    store: Arc<dyn KvStore>,
    store_id: StoreId,
    limits: Limits,
    clock: Clock,
    writer: Mutex<()>,
    commit: Arc<GroupCommit>,
    rate: RateLimiter,
    pub(crate) counters: Counters,
}

fn internal(e: KvError) -> HubError {
    tracing::error!(error = %e, "hub store failed");
    HubError::Internal {
        reason: e.to_string(),
    }
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

/// The identity of `store`: the one it holds, or a new one drawn from `rng`,
/// written and flushed before this returns.
///
/// # Errors
/// The store's error when it cannot be read, written or flushed, and
/// [`KvError::Corrupt`] when the stored value is not 16 bytes.
fn load_or_create_store_id(store: &dyn KvStore, rng: &SharedRng) -> Result<StoreId, KvError> {
    let key = l::store_id();
    if let Some(bytes) = store.get(&key)? {
        let id: [u8; 16] = bytes.as_slice().try_into().map_err(|_| KvError::Corrupt {
            key: hex::encode(&key),
            reason: format!("a store identity is 16 bytes, found {}", bytes.len()),
        })?;
        return Ok(StoreId(id));
    }
    let mut id = [0u8; 16];
    rng.fill(&mut id);
    let mut batch = WriteBatch::new();
    batch.put(key, id.to_vec());
    store.apply(&batch)?;
    store.flush()?;
    tracing::info!(store_id = %StoreId(id), "new hub store: identity created");
    Ok(StoreId(id))
}

impl HubCore {
    /// A core over `store` (which may already hold a hub's state). Reads the
    /// store's identity, or creates one from `rng` and flushes it (a
    /// blocking flush, once, in a store that has none).
    ///
    /// # Errors
    /// The store's error when the identity cannot be read or made durable.
    pub fn open(
        store: Arc<dyn KvStore>,
        limits: Limits,
        clock: Clock,
        rng: &SharedRng,
    ) -> Result<Arc<Self>, KvError> {
        let store_id = load_or_create_store_id(&*store, rng)?;
        Ok(Arc::new(Self {
            rate: RateLimiter::new(&limits),
            store,
            store_id,
            limits,
            clock,
            writer: Mutex::new(()),
            commit: GroupCommit::new(),
            counters: Counters::default(),
        }))
    }

    /// The identity of this core's store: the same for every core opened
    /// over the same store (or a copy of it), different for another store.
    pub fn store_id(&self) -> StoreId {
        self.store_id
    }

    pub(crate) fn group_commit(&self) -> &Arc<GroupCommit> {
        &self.commit
    }

    pub(crate) fn store(&self) -> &Arc<dyn KvStore> {
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
        self.commit
            .durable(gen)
            .await
            .map_err(|reason| HubError::Internal { reason })
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        // The guard protects no data of its own; a panic elsewhere cannot
        // leave it inconsistent.
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn apply(&self, batch: &WriteBatch) -> Result<u64, HubError> {
        if batch.is_empty() {
            return Ok(self.commit.current());
        }
        self.store.apply(batch).map_err(internal)?;
        Ok(self.commit.applied())
    }

    fn read<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, HubError> {
        l::read(&*self.store, key).map_err(internal)
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
    /// append, deliveries and head, all in one batch.
    ///
    /// # Errors
    /// A limit error, `Conflict` for a reused id with other content, or
    /// `Internal` when the store failed; none of them changed anything.
    pub fn publish(&self, sender: DeviceId, p: Publish) -> Result<Durable<Published>, HubError> {
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
        let owner = p.topic.mailbox_owner();
        if owner.is_some() && p.class == RetentionClass::Log {
            return Err(self.not_authorized());
        }
        // A writer-bound topic takes only what its writer key signed. The
        // name binds the key, so this needs no state and no lock.
        if p.check_writer().is_err() {
            return Err(self.not_authorized());
        }
        let retention_ms = self.retention_ms(p.retention_secs)?;
        let digest = content_digest(p.class, &p.payload);

        let _guard = self.lock();
        let answer = |outcome: PublishOutcome| {
            Ok(Durable {
                value: Published {
                    outcome,
                    recipients: Vec::new(),
                    dropped_for: Vec::new(),
                },
                // Even a refusal waits for what it read to be durable: a
                // head it reports must not be one a crash could take back.
                gen: self.commit.current(),
            })
        };

        // The rules of DESIGN.md section 2 over what the store holds for
        // this topic; the write lock held since the reads makes the
        // decision and the writes one atomic step.
        let record_key = l::publish_record(&p.topic, &p.publish_id);
        let record = self.read::<PublishRecord>(&record_key)?;
        let meta_key = l::topic_meta(&p.topic);
        let mut meta: TopicMeta = self.read(&meta_key)?.unwrap_or_default();
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
        if decision.is_new_work() {
            let mut keys = vec![RateKey::Device(&sender), RateKey::Topic(&p.topic)];
            if let Some(owner) = &owner {
                keys.push(RateKey::Mailbox {
                    sender: &sender,
                    owner,
                });
            }
            self.rate.check_all(&keys)?;
        }
        let seq = match decision {
            Decision::Duplicate { seq } => {
                self.counters.duplicates.fetch_add(1, Ordering::Relaxed);
                return answer(PublishOutcome::Duplicate { seq });
            }
            Decision::Conflict { seq } => {
                self.counters.conflicts.fetch_add(1, Ordering::Relaxed);
                return Err(HubError::Conflict { seq });
            }
            Decision::HistoryMissing => {
                self.counters
                    .history_missing
                    .fetch_add(1, Ordering::Relaxed);
                return answer(PublishOutcome::HistoryMissing);
            }
            Decision::HeadMismatch { current } => {
                self.counters
                    .head_mismatches
                    .fetch_add(1, Ordering::Relaxed);
                return answer(PublishOutcome::HeadMismatch { current });
            }
            Decision::Append { seq } => seq,
        };

        // Append: sequence, frame, deliveries, head.
        let now = self.clock.now_ms();
        meta.last_seq = seq;
        let mut batch = WriteBatch::new();
        let record_expiry = now.saturating_add(self.limits.max_retention.as_millis() as u64);
        batch.put(
            record_key.clone(),
            l::encode(&PublishRecord { seq, digest }),
        );
        batch.put(
            l::expiry(record_expiry, ExpiryKind::PublishRecord, &record_key),
            vec![],
        );

        let mut usage = UsageStage::new();
        let mut recipients = Vec::new();
        let mut dropped_for = Vec::new();
        // A device's mailbox delivers to that device alone, whoever else
        // may hold a subscription to it (one made before the form was
        // reserved, say).
        let subscribers = match &owner {
            Some(owner) => {
                let k = l::subscriber(&p.topic, owner);
                match self.store.get(&k).map_err(internal)? {
                    Some(v) => vec![(k, v)],
                    None => Vec::new(),
                }
            }
            None => self
                .store
                .scan_prefix(&l::subscriber_prefix(&p.topic), usize::MAX)
                .map_err(internal)?,
        };
        for (k, v) in subscribers {
            let Some(dev) = k
                .get(k.len().saturating_sub(32)..)
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
            else {
                continue;
            };
            let dev = DeviceId(dev);
            if dev == sender {
                continue;
            }
            let sub: Subscription = l::decode(&k, &v).map_err(internal)?;
            let dmeta_key = l::device_meta(&dev);
            let mut dmeta: DeviceMeta = self.read(&dmeta_key)?.unwrap_or_default();
            // A full queue drops the new delivery: publishers never wait or
            // fail for a subscriber that does not read, and what is queued
            // stays in order. The drop is counted and reported.
            let u = usage.get(self, dev)?;
            if u.queued >= self.limits.max_queued_deliveries {
                if u.dropped == 0 {
                    u.dropped_after = dmeta.last_delivery;
                }
                u.dropped += 1;
                dropped_for.push(dev);
                continue;
            }
            u.queued += 1;
            dmeta.last_delivery += 1;
            let dkey = l::delivery(&dev, dmeta.last_delivery);
            let expires = now.saturating_add(sub.retention_secs.saturating_mul(1000));
            batch.put(
                dkey.clone(),
                l::encode(&DeliveryRef {
                    topic: p.topic.clone(),
                    seq,
                    class: p.class,
                    expires_at_ms: expires,
                }),
            );
            batch.put(l::expiry(expires, ExpiryKind::Delivery, &dkey), vec![]);
            batch.put(dmeta_key, l::encode(&dmeta));
            recipients.push(dev);
        }

        // The publisher's stored bytes: counted for a frame the hub keeps (a
        // log frame, or a mailbox frame someone will receive).
        let adding = p.payload.len() as u64;
        if p.class == RetentionClass::Log || !recipients.is_empty() {
            let u = usage.get(self, sender)?;
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
            payload: p.payload,
            remaining: 0,
        };
        match p.class {
            RetentionClass::Log => {
                let fkey = l::log_frame(&p.topic, seq);
                batch.put(l::expiry(expires, ExpiryKind::LogFrame, &fkey), vec![]);
                batch.put(fkey, l::encode(&frame));
                meta.head = Some(seq);
                meta.oldest.get_or_insert(seq);
                meta.log_len += 1;
                if meta.log_len > self.limits.max_log_depth {
                    let excess = meta.log_len - self.limits.max_log_depth;
                    self.trim_prefix(&p.topic, &mut meta, excess, None, &mut batch, &mut usage)?;
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
                    batch.put(l::expiry(expires, ExpiryKind::MailboxFrame, &fkey), vec![]);
                    batch.put(fkey, l::encode(&frame));
                }
            }
        }
        batch.put(meta_key, l::encode(&meta));
        usage.stage(&mut batch);
        let gen = self.apply(&batch)?;
        self.counters.accepted.fetch_add(1, Ordering::Relaxed);
        self.counters
            .deliveries_dropped
            .fetch_add(dropped_for.len() as u64, Ordering::Relaxed);
        Ok(Durable {
            value: Published {
                outcome: PublishOutcome::Accepted {
                    seq,
                    head: meta.head,
                },
                recipients,
                dropped_for,
            },
            gen,
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
    /// Stages the removals and the new meta into `batch`; returns how many.
    fn trim_prefix(
        &self,
        topic: &TopicId,
        meta: &mut TopicMeta,
        count: u64,
        expired_at: Option<u64>,
        batch: &mut WriteBatch,
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
            let rows = self
                .store
                .range(&cursor, end.as_deref(), CHUNK)
                .map_err(internal)?;
            for (k, v) in &rows {
                let Some((_, seq)) = l::parse_frame_key(k) else {
                    continue;
                };
                let frame = l::decode::<StoredFrame>(k, v).map_err(internal)?;
                let expires = frame.expires_at_ms;
                let keep = removed >= count || expired_at.is_some_and(|at| expires > at);
                if keep {
                    new_oldest = Some(seq);
                    // Frames behind this one may have expired already and had
                    // their expiry entries spent while this one blocked them:
                    // the new oldest frame carries the trigger that resumes
                    // the walk (a repeated put of the same key is harmless).
                    batch.put(l::expiry(expires, ExpiryKind::LogFrame, k), vec![]);
                    break 'walk;
                }
                batch.delete(k.clone());
                usage.release_bytes(self, frame.sender, frame.payload.len())?;
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
        let (seen, gen) = {
            let _g = self.lock();
            let m: TopicMeta = self.read(&l::topic_meta(topic))?.unwrap_or_default();
            (m, self.commit.current())
        };
        self.durable(gen).await?;
        // Trims since the snapshot only move `removed_through` and `oldest`
        // forward; report the newest values so a reader never misses a gap.
        let now: TopicMeta = self.read(&l::topic_meta(topic))?.unwrap_or_default();
        let mut messages = Vec::new();
        let mut bytes = 0usize;
        if after < seen.last_seq {
            let start = l::log_frame(topic, after + 1);
            let end = l::log_frame(topic, seen.last_seq + 1);
            for (k, v) in self
                .store
                .range(&start, Some(&end), limit as usize)
                .map_err(internal)?
            {
                let Some((_, seq)) = l::parse_frame_key(&k) else {
                    continue;
                };
                let f: StoredFrame = l::decode(&k, &v).map_err(internal)?;
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

    /// Subscribe `device` to `topic` (or change the retention of an existing
    /// subscription).
    ///
    /// # Errors
    /// `BadTopic`, `NotAuthorized` (another device's mailbox),
    /// `RetentionTooLong`, `TooManySubscriptions`, `RateLimited`, `Internal`.
    pub fn subscribe(
        &self,
        device: DeviceId,
        topic: &TopicId,
        retention_secs: Option<u64>,
    ) -> Result<Durable<()>, HubError> {
        self.check_topic(topic)?;
        self.check_reader(&device, topic)?;
        let retention_ms = self.retention_ms(retention_secs)?;
        self.rate.check(&device, None)?;
        let _g = self.lock();
        let skey = l::subscriber(topic, &device);
        let dkey = l::device_meta(&device);
        let mut dmeta: DeviceMeta = self.read(&dkey)?.unwrap_or_default();
        let mut batch = WriteBatch::new();
        if self.store.get(&skey).map_err(internal)?.is_none() {
            if dmeta.subscriptions >= self.limits.max_subscriptions {
                return Err(HubError::TooManySubscriptions {
                    max: self.limits.max_subscriptions,
                });
            }
            dmeta.subscriptions += 1;
            batch.put(dkey, l::encode(&dmeta));
            batch.put(l::device_subscription(&device, topic), vec![]);
        }
        batch.put(
            skey,
            l::encode(&Subscription {
                retention_secs: retention_ms / 1000,
            }),
        );
        let gen = self.apply(&batch)?;
        Ok(Durable { value: (), gen })
    }

    /// Drop a subscription. Deliveries already queued stay until acked or
    /// expired.
    ///
    /// # Errors
    /// `BadTopic`, `Internal`.
    pub fn unsubscribe(
        &self,
        device: DeviceId,
        topic: &TopicId,
    ) -> Result<Durable<bool>, HubError> {
        self.check_topic(topic)?;
        let _g = self.lock();
        let skey = l::subscriber(topic, &device);
        if self.store.get(&skey).map_err(internal)?.is_none() {
            return Ok(Durable {
                value: false,
                gen: self.commit.current(),
            });
        }
        let dkey = l::device_meta(&device);
        let mut dmeta: DeviceMeta = self.read(&dkey)?.unwrap_or_default();
        dmeta.subscriptions = dmeta.subscriptions.saturating_sub(1);
        let mut batch = WriteBatch::new();
        batch.delete(skey);
        batch.delete(l::device_subscription(&device, topic));
        batch.put(dkey, l::encode(&dmeta));
        let gen = self.apply(&batch)?;
        Ok(Durable { value: true, gen })
    }

    /// The highest delivery id ever given to `device` (0: none yet), as
    /// `Receive` answers it. It never decreases while the store is kept;
    /// it may name deliveries that are not durable yet.
    ///
    /// # Errors
    /// `Internal`.
    pub fn last_delivery_id(&self, device: DeviceId) -> Result<u64, HubError> {
        let _g = self.lock();
        let m: DeviceMeta = self.read(&l::device_meta(&device))?.unwrap_or_default();
        Ok(m.last_delivery)
    }

    /// Up to `limit` durable deliveries of `device` with ids above `after`.
    /// References to frames that were trimmed or expired are dropped. The
    /// last page also carries an unreported count of deliveries dropped
    /// for a full queue ([`DeliveryBatch::dropped`]).
    ///
    /// # Errors
    /// `Internal`.
    ///
    /// # Cancel safety
    /// Cancel safe: at worst a dangling reference is dropped later.
    pub async fn deliveries(
        &self,
        device: DeviceId,
        after: u64,
        limit: usize,
    ) -> Result<DeliveryBatch, HubError> {
        let (last, usage, gen) = {
            let _g = self.lock();
            let m: DeviceMeta = self.read(&l::device_meta(&device))?.unwrap_or_default();
            let u: DeviceUsage = self.read(&l::device_usage(&device))?.unwrap_or_default();
            (m.last_delivery, u, self.commit.current())
        };
        let dropped = (usage.dropped > 0).then_some((usage.dropped_after, usage.dropped));
        let mut out = DeliveryBatch {
            deliveries: Vec::new(),
            scanned_through: after,
            more: false,
            dropped: None,
        };
        if last <= after {
            if dropped.is_some() {
                self.durable(gen).await?;
                out.dropped = dropped;
            }
            return Ok(out);
        }
        self.durable(gen).await?;
        let start = l::delivery(&device, after + 1);
        let end = l::delivery(&device, last + 1);
        let rows = self
            .store
            .range(&start, Some(&end), limit)
            .map_err(internal)?;
        out.more = rows.len() == limit;
        let mut dangling = Vec::new();
        for (k, v) in rows {
            let Some((_, id)) = l::parse_delivery(&k) else {
                continue;
            };
            out.scanned_through = id;
            let r: DeliveryRef = l::decode(&k, &v).map_err(internal)?;
            let fkey = match r.class {
                RetentionClass::Log => l::log_frame(&r.topic, r.seq),
                RetentionClass::Mailbox => l::mailbox_frame(&r.topic, r.seq),
            };
            match self.read::<StoredFrame>(&fkey)? {
                Some(f) => out.deliveries.push(Delivery {
                    id,
                    topic: r.topic,
                    seq: r.seq,
                    class: r.class,
                    sender: f.sender,
                    publish_id: f.publish_id,
                    published_at_ms: f.published_at_ms,
                    payload: f.payload,
                }),
                None => dangling.push(k),
            }
        }
        if !out.more {
            out.scanned_through = last;
            out.dropped = dropped;
        }
        if !dangling.is_empty() {
            let _g = self.lock();
            let mut batch = WriteBatch::new();
            let mut usage = UsageStage::new();
            for k in dangling {
                // An ack or a purge since the read may have removed it.
                if self.store.get(&k).map_err(internal)?.is_some() {
                    batch.delete(k);
                    usage.release_delivery(self, device)?;
                }
            }
            usage.stage(&mut batch);
            self.apply(&batch)?;
        }
        Ok(out)
    }

    /// The device was told that `count` of its deliveries were dropped:
    /// take them off the unreported count (drops since stay on it).
    ///
    /// # Errors
    /// `Internal`.
    pub fn clear_dropped(&self, device: DeviceId, count: u64) -> Result<(), HubError> {
        let _g = self.lock();
        let mut usage = UsageStage::new();
        let u = usage.get(self, device)?;
        u.dropped = u.dropped.saturating_sub(count);
        if u.dropped == 0 {
            u.dropped_after = 0;
        }
        let mut batch = WriteBatch::new();
        usage.stage(&mut batch);
        self.apply(&batch)?;
        Ok(())
    }

    /// What `device` uses of its per-device quotas now (including changes
    /// not yet durable).
    ///
    /// # Errors
    /// `Internal`.
    pub fn usage(&self, device: DeviceId) -> Result<DeviceUsage, HubError> {
        let _g = self.lock();
        Ok(self.read(&l::device_usage(&device))?.unwrap_or_default())
    }

    /// Forget acknowledged deliveries; unknown ids are ignored. A mailbox
    /// frame goes once every recipient acked it.
    ///
    /// # Errors
    /// `TooManyAcks`, `Internal`.
    pub fn ack(&self, device: DeviceId, ids: &[u64]) -> Result<Durable<u32>, HubError> {
        if ids.len() > self.limits.max_acks {
            return Err(HubError::TooManyAcks {
                count: ids.len() as u64,
                max: self.limits.max_acks as u64,
            });
        }
        let _g = self.lock();
        let mut batch = WriteBatch::new();
        let mut usage = UsageStage::new();
        let mut removed = 0u32;
        let mut frames: BTreeMap<Vec<u8>, Option<StoredFrame>> = BTreeMap::new();
        let mut seen = std::collections::BTreeSet::new();
        for id in ids {
            if !seen.insert(*id) {
                continue;
            }
            let dkey = l::delivery(&device, *id);
            let Some(r) = self.read::<DeliveryRef>(&dkey)? else {
                continue;
            };
            batch.delete(dkey);
            removed += 1;
            usage.release_delivery(self, device)?;
            if r.class == RetentionClass::Mailbox {
                self.release_mailbox(&l::mailbox_frame(&r.topic, r.seq), &mut frames)?;
            }
        }
        self.stage_mailbox_frames(frames, &mut batch, &mut usage)?;
        usage.stage(&mut batch);
        let gen = self.apply(&batch)?;
        Ok(Durable {
            value: removed,
            gen,
        })
    }

    /// Write back the mailbox frames an operation touched: a frame some
    /// recipient still holds is kept, any other is deleted and its bytes
    /// are released from its sender's usage. A frame already taken out
    /// (`None`) had its bytes released when it was taken.
    fn stage_mailbox_frames(
        &self,
        frames: BTreeMap<Vec<u8>, Option<StoredFrame>>,
        batch: &mut WriteBatch,
        usage: &mut UsageStage,
    ) -> Result<(), HubError> {
        for (k, f) in frames {
            match f {
                Some(f) if f.remaining > 0 => batch.put(k, l::encode(&f)),
                Some(f) => {
                    usage.release_bytes(self, f.sender, f.payload.len())?;
                    batch.delete(k);
                }
                None => batch.delete(k),
            }
        }
        Ok(())
    }

    /// Count one recipient of a mailbox frame as done, staging in `frames`.
    fn release_mailbox(
        &self,
        fkey: &[u8],
        frames: &mut BTreeMap<Vec<u8>, Option<StoredFrame>>,
    ) -> Result<(), HubError> {
        if !frames.contains_key(fkey) {
            let f = self.read::<StoredFrame>(fkey)?;
            frames.insert(fkey.to_vec(), f);
        }
        if let Some(Some(f)) = frames.get_mut(fkey) {
            f.remaining = f.remaining.saturating_sub(1);
        }
        Ok(())
    }

    /// Add key packages to `device`'s pool (all or none) and optionally set
    /// its last-resort package.
    ///
    /// # Errors
    /// `BadKeyPackage`, `KeyPackagePoolFull`, `RateLimited`, `Internal`.
    pub fn upload_key_packages(
        &self,
        device: DeviceId,
        packages: &[Vec<u8>],
        last_resort: Option<Vec<u8>>,
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
        let _g = self.lock();
        let mkey = l::key_package_meta(&device);
        let mut meta: KeyPackageMeta = self.read(&mkey)?.unwrap_or_default();
        let adding = packages.len() as u64;
        if meta.pool as u64 + adding > self.limits.max_key_packages as u64 {
            return Err(HubError::KeyPackagePoolFull {
                pool: meta.pool,
                adding: adding.min(u32::MAX as u64) as u32,
                max: self.limits.max_key_packages,
            });
        }
        let mut batch = WriteBatch::new();
        for kp in packages {
            batch.put(l::key_package(&device, meta.next), kp.clone());
            meta.next += 1;
            meta.pool += 1;
        }
        if last_resort.is_some() {
            meta.last_resort = last_resort;
        }
        batch.put(mkey, l::encode(&meta));
        let gen = self.apply(&batch)?;
        Ok(Durable {
            value: meta.pool,
            gen,
        })
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
    pub fn claim_key_package(
        &self,
        claimer: DeviceId,
        device: DeviceId,
    ) -> Result<Durable<(Vec<u8>, bool)>, HubError> {
        self.rate.check_all(&[
            RateKey::Device(&claimer),
            RateKey::Claimer(&claimer),
            RateKey::Target(&device),
        ])?;
        let _g = self.lock();
        let mkey = l::key_package_meta(&device);
        let mut meta: KeyPackageMeta = self.read(&mkey)?.unwrap_or_default();
        let mut gen = self.commit.current();
        if meta.pool > 0 {
            let rows = self
                .store
                .scan_prefix(&l::key_package_prefix(&device), 1)
                .map_err(internal)?;
            let mut batch = WriteBatch::new();
            match rows.into_iter().next() {
                Some((k, v)) => {
                    meta.pool -= 1;
                    batch.delete(k);
                    batch.put(mkey, l::encode(&meta));
                    let gen = self.apply(&batch)?;
                    return Ok(Durable {
                        value: (v, false),
                        gen,
                    });
                }
                None => {
                    // The stored packages are the truth: a count with none
                    // behind it is repaired, and only then is the pool empty.
                    tracing::error!(%device, pool = meta.pool, "key package count without packages; repaired");
                    meta.pool = 0;
                    batch.put(mkey, l::encode(&meta));
                    gen = self.apply(&batch)?;
                }
            }
        }
        match meta.last_resort {
            Some(kp) => Ok(Durable {
                value: (kp, true),
                gen,
            }),
            None => Err(HubError::NoKeyPackage),
        }
    }

    /// How many key packages `device` has in its pool, and whether it has a
    /// last resort.
    ///
    /// # Errors
    /// `Internal`.
    pub fn key_package_status(&self, device: DeviceId) -> Result<Durable<(u32, bool)>, HubError> {
        let _g = self.lock();
        let meta: KeyPackageMeta = self
            .read(&l::key_package_meta(&device))?
            .unwrap_or_default();
        Ok(Durable {
            value: (meta.pool, meta.last_resort.is_some()),
            gen: self.commit.current(),
        })
    }

    /// Drop everything whose retention ran out by `now_ms` (the clock's now
    /// when `None`). Logs are trimmed only from their oldest end.
    ///
    /// # Errors
    /// `Internal`.
    pub fn purge(&self, now_ms: Option<u64>) -> Result<Durable<PurgeReport>, HubError> {
        let now = now_ms.unwrap_or_else(|| self.clock.now_ms());
        self.rate.prune();
        let mut report = PurgeReport::default();
        let mut gen = self.commit.current();
        loop {
            let _g = self.lock();
            let rows = self
                .store
                .range(&l::expiry_start(), Some(&l::expiry_end(now)), 512)
                .map_err(internal)?;
            if rows.is_empty() {
                break;
            }
            let mut batch = WriteBatch::new();
            let mut usage = UsageStage::new();
            let mut frames: BTreeMap<Vec<u8>, Option<StoredFrame>> = BTreeMap::new();
            let mut metas: BTreeMap<TopicId, TopicMeta> = BTreeMap::new();
            let mut deleted = std::collections::BTreeSet::new();
            for (ek, _) in &rows {
                batch.delete(ek.clone());
                let Some((kind, target)) = l::parse_expiry(ek) else {
                    continue;
                };
                match kind {
                    ExpiryKind::PublishRecord => {
                        if deleted.insert(target.to_vec())
                            && self.store.get(target).map_err(internal)?.is_some()
                        {
                            batch.delete(target.to_vec());
                            report.publish_records += 1;
                        }
                    }
                    ExpiryKind::Delivery => {
                        if !deleted.insert(target.to_vec()) {
                            continue;
                        }
                        if let Some(r) = self.read::<DeliveryRef>(target)? {
                            batch.delete(target.to_vec());
                            report.deliveries += 1;
                            if let Some((device, _)) = l::parse_delivery(target) {
                                usage.release_delivery(self, device)?;
                            }
                            if r.class == RetentionClass::Mailbox {
                                self.release_mailbox(
                                    &l::mailbox_frame(&r.topic, r.seq),
                                    &mut frames,
                                )?;
                            }
                        }
                    }
                    ExpiryKind::MailboxFrame => {
                        if !frames.contains_key(target) {
                            let f = self.read::<StoredFrame>(target)?;
                            frames.insert(target.to_vec(), f);
                        }
                        if let Some(slot) = frames.get_mut(target) {
                            if let Some(f) = slot.take() {
                                usage.release_bytes(self, f.sender, f.payload.len())?;
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
                            self.read(&l::topic_meta(&topic))?.unwrap_or_default();
                        let n = self.trim_prefix(
                            &topic,
                            &mut meta,
                            u64::MAX,
                            Some(now),
                            &mut batch,
                            &mut usage,
                        )?;
                        report.log_frames += n;
                        metas.insert(topic, meta);
                    }
                }
            }
            self.stage_mailbox_frames(frames, &mut batch, &mut usage)?;
            for (topic, meta) in metas {
                batch.put(l::topic_meta(&topic), l::encode(&meta));
            }
            usage.stage(&mut batch);
            gen = self.apply(&batch)?;
            if rows.len() < 512 {
                break;
            }
        }
        Ok(Durable { value: report, gen })
    }

    /// The wall clock this core uses.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }
}
