//! The app's durable inbox: every app message the device delivers is kept,
//! with a position in its group, until the app says it has processed it.
//!
//! A message goes into the inbox in the same flushed batch that records its
//! id as delivered, and the hub delivery that carried it is acked only after
//! that batch is durable. So an app that stops (or crashes) between the
//! device's ack and its own processing finds the message in
//! [`Device::messages`](super::Device::messages) when it opens the device
//! again; [`Event::MessageReceived`](super::Event::MessageReceived) still
//! announces each arrival, with the same position.
//!
//! Positions start at 1 in each group and grow by one per message. The app
//! marks what it has processed ([`Inbox::mark_processed`]); processed
//! messages are deleted then (or, with [`InboxConfig::keep_processed`], once
//! that many newer processed ones exist). An inbox is bounded: past
//! [`InboxConfig::max_unprocessed`] unprocessed messages in a group, the
//! oldest unprocessed one is deleted for each new one, counted in
//! [`DeviceStats::inbox_trimmed`](super::DeviceStats::inbox_trimmed) and
//! reported as [`Event::InboxTrimmed`](super::Event::InboxTrimmed): never
//! dropped silently.
//!
//! The inbox outlives the group's other state: messages delivered before
//! this device was removed from a group stay readable until marked
//! processed.

use super::records::GroupId;
use crate::kv::{KvError, KvStore, WriteBatch};
use crate::wire::DeviceId;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// How much the inbox keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InboxConfig {
    /// Unprocessed messages kept per group, at most (at least 1). One more
    /// deletes the oldest unprocessed one, reported.
    pub max_unprocessed: u64,
    /// Processed messages kept per group after marking (0: deleted when
    /// marked), for an app that re-reads recent history.
    pub keep_processed: u64,
}

impl Default for InboxConfig {
    fn default() -> Self {
        Self {
            max_unprocessed: 100_000,
            keep_processed: 0,
        }
    }
}

/// One delivered app message as the inbox holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboxMessage {
    /// Its position in the group's inbox (from 1, one per message).
    pub position: u64,
    /// The sending member.
    pub sender: DeviceId,
    /// The sender's message id.
    pub id: [u8; 16],
    /// The message.
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
}

/// Where a group's inbox stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InboxStatus {
    /// The newest position given (0: none yet).
    pub head: u64,
    /// Everything up to this position was marked processed.
    pub processed: u64,
}

/// A message staged into the inbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Staged {
    /// The position it got.
    pub position: u64,
    /// An unprocessed message deleted to make room, if the inbox was full.
    pub trimmed: Option<u64>,
}

const ENTRY: &[u8] = b"eng/appinbox/";
const HEAD: &[u8] = b"eng/appinbox-head/";
const PROCESSED: &[u8] = b"eng/appinbox-done/";

fn entry_key(group: &GroupId, position: u64) -> Vec<u8> {
    let mut k = group_key(ENTRY, group);
    k.extend_from_slice(&position.to_be_bytes());
    k
}

fn group_key(prefix: &[u8], group: &GroupId) -> Vec<u8> {
    let mut k = prefix.to_vec();
    k.extend_from_slice(&group.0);
    k
}

fn decode_u64(key: &[u8], v: &[u8]) -> Result<u64, KvError> {
    <[u8; 8]>::try_from(v)
        .map(u64::from_be_bytes)
        .map_err(|_| KvError::Corrupt {
            key: hex::encode(key),
            reason: format!("an inbox counter is 8 bytes, found {}", v.len()),
        })
}

/// The device's app inbox over its store.
pub(super) struct Inbox {
    kv: Arc<dyn KvStore>,
    config: InboxConfig,
    // Serialises marks, so two of them never interleave their read of the
    // processed position and its write.
    marks: std::sync::Mutex<()>,
}

impl Inbox {
    /// The inbox in `kv`.
    pub fn new(kv: Arc<dyn KvStore>, config: InboxConfig) -> Self {
        Self {
            kv,
            config: InboxConfig {
                max_unprocessed: config.max_unprocessed.max(1),
                ..config
            },
            marks: std::sync::Mutex::new(()),
        }
    }

    fn counter(&self, batch: Option<&WriteBatch>, key: &[u8]) -> Result<u64, KvError> {
        // An operation that delivers several messages stages them in one
        // batch: the newest head is the batch's, not yet the store's.
        let staged = batch.and_then(|b| b.staged(key));
        let value = match staged {
            Some(v) => v.map(<[u8]>::to_vec),
            None => self.kv.get(key)?,
        };
        value.map_or(Ok(0), |v| decode_u64(key, &v))
    }

    /// Stage `message` (its position is assigned here) into `batch`, which
    /// the caller applies and flushes with the delivery record. Call it
    /// with the group's lock held, so two deliveries never take one
    /// position.
    ///
    /// # Errors
    /// The store's error.
    pub fn stage(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        sender: DeviceId,
        id: [u8; 16],
        body: &[u8],
    ) -> Result<Staged, KvError> {
        let head_key = group_key(HEAD, group);
        let position = self.counter(Some(batch), &head_key)? + 1;
        let message = InboxMessage {
            position,
            sender,
            id,
            body: body.to_vec(),
        };
        let encoded = postcard::to_allocvec(&message).map_err(|e| KvError::Corrupt {
            key: hex::encode(entry_key(group, position)),
            reason: e.to_string(),
        })?;
        batch.put(entry_key(group, position), encoded);
        batch.put(head_key, position.to_be_bytes().to_vec());
        // Full: the oldest unprocessed message goes. A mark racing this
        // may have processed it just now; then the report over-counts,
        // it never hides a loss.
        // Only a position past the bound can make the inbox full: below
        // it, the processed position is not read at all.
        let mut trimmed = None;
        let full = position > self.config.max_unprocessed && {
            let processed = self.counter(None, &group_key(PROCESSED, group))?;
            position - processed > self.config.max_unprocessed
        };
        if full {
            let victim = position - self.config.max_unprocessed;
            let victim_key = entry_key(group, victim);
            if batch.staged(&victim_key).is_none() && self.kv.get(&victim_key)?.is_some() {
                batch.delete(victim_key);
                trimmed = Some(victim);
            }
        }
        Ok(Staged { position, trimmed })
    }

    /// Up to `limit` messages of `group` with positions above `after`, in
    /// position order.
    ///
    /// # Errors
    /// The store's error, or `Corrupt` for an unreadable entry.
    pub fn read(
        &self,
        group: &GroupId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<InboxMessage>, KvError> {
        let start = entry_key(group, after.saturating_add(1));
        let end = crate::kv::prefix_end(&group_key(ENTRY, group));
        self.kv
            .range(&start, end.as_deref(), limit)?
            .into_iter()
            .map(|(k, v)| {
                postcard::from_bytes(&v).map_err(|e| KvError::Corrupt {
                    key: hex::encode(&k),
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    /// Where `group`'s inbox stands.
    ///
    /// # Errors
    /// The store's error.
    pub fn status(&self, group: &GroupId) -> Result<InboxStatus, KvError> {
        Ok(InboxStatus {
            head: self.counter(None, &group_key(HEAD, group))?,
            processed: self.counter(None, &group_key(PROCESSED, group))?,
        })
    }

    /// Mark everything of `group` up to `through` (at most the head) as
    /// processed, and delete what is no longer kept; durable when it
    /// returns. A mark at or below the processed position changes nothing.
    /// Answers the processed position now.
    ///
    /// # Errors
    /// The store's error.
    pub fn mark_processed(&self, group: &GroupId, through: u64) -> Result<u64, KvError> {
        let _turn = self.marks.lock().unwrap_or_else(|p| p.into_inner());
        let status = self.status(group)?;
        let through = through.min(status.head);
        if through <= status.processed {
            return Ok(status.processed);
        }
        let mut batch = WriteBatch::new();
        batch.put(group_key(PROCESSED, group), through.to_be_bytes().to_vec());
        let keep_from = through.saturating_sub(self.config.keep_processed);
        if keep_from > 0 {
            let start = entry_key(group, 0);
            let end = entry_key(group, keep_from + 1);
            for (k, _) in self.kv.range(&start, Some(&end), usize::MAX)? {
                batch.delete(k);
            }
        }
        self.kv.apply(&batch)?;
        self.kv.flush()?;
        Ok(through)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemKv;

    fn inbox(max: u64, keep: u64) -> (Inbox, MemKv) {
        let kv = MemKv::new();
        let config = InboxConfig {
            max_unprocessed: max,
            keep_processed: keep,
        };
        (Inbox::new(Arc::new(kv.clone()), config), kv)
    }

    fn deliver(inbox: &Inbox, kv: &MemKv, group: &GroupId, n: u8) -> Vec<Staged> {
        // Two messages per batch, as one operation delivering several does.
        let mut out = Vec::new();
        for pair in (0..n).collect::<Vec<_>>().chunks(2) {
            let mut b = WriteBatch::new();
            for i in pair {
                out.push(
                    inbox
                        .stage(&mut b, group, DeviceId([9; 32]), [*i; 16], &[*i])
                        .unwrap(),
                );
            }
            kv.apply(&b).unwrap();
        }
        out
    }

    fn positions(inbox: &Inbox, g: &GroupId) -> Vec<u64> {
        inbox
            .read(g, 0, 100)
            .unwrap()
            .iter()
            .map(|m| m.position)
            .collect()
    }

    #[test]
    fn positions_grow_by_one_per_message_even_within_one_batch() {
        let (inbox, kv) = inbox(100, 0);
        let g = GroupId([1; 32]);
        let staged = deliver(&inbox, &kv, &g, 5);
        let positions: Vec<u64> = staged.iter().map(|s| s.position).collect();
        assert_eq!(positions, vec![1, 2, 3, 4, 5]);
        let read = inbox.read(&g, 2, 10).unwrap();
        assert_eq!(
            read.iter().map(|m| m.position).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        assert_eq!(read[0].body, vec![2]);
        // Another group has its own positions.
        let other = deliver(&inbox, &kv, &GroupId([2; 32]), 1);
        assert_eq!(other[0].position, 1);
        assert_eq!(inbox.read(&g, 0, 10).unwrap().len(), 5);
    }

    #[test]
    fn marking_deletes_what_is_not_kept_and_never_goes_back() {
        let (inbox, kv) = inbox(100, 1);
        let g = GroupId([1; 32]);
        deliver(&inbox, &kv, &g, 4);
        assert_eq!(inbox.mark_processed(&g, 3).unwrap(), 3);
        // One processed message is kept (position 3); 1 and 2 are gone.
        let left = positions(&inbox, &g);
        assert_eq!(left, vec![3, 4]);
        assert_eq!(
            inbox.mark_processed(&g, 1).unwrap(),
            3,
            "a mark never goes back"
        );
        assert_eq!(inbox.mark_processed(&g, 99).unwrap(), 4, "at most the head");
        assert_eq!(
            inbox.status(&g).unwrap(),
            InboxStatus {
                head: 4,
                processed: 4
            }
        );
        assert_eq!(
            kv.unflushed_batches(),
            0,
            "a mark is durable when it returns"
        );
    }

    #[test]
    fn a_full_inbox_trims_the_oldest_unprocessed_and_says_so() {
        let (inbox, kv) = inbox(3, 0);
        let g = GroupId([1; 32]);
        let staged = deliver(&inbox, &kv, &g, 5);
        let trimmed: Vec<Option<u64>> = staged.iter().map(|s| s.trimmed).collect();
        assert_eq!(trimmed, vec![None, None, None, Some(1), Some(2)]);
        let left = positions(&inbox, &g);
        assert_eq!(left, vec![3, 4, 5]);
        // Processing makes room again.
        inbox.mark_processed(&g, 4).unwrap();
        let more = deliver(&inbox, &kv, &g, 2);
        assert!(more.iter().all(|s| s.trimmed.is_none()));
    }
}
