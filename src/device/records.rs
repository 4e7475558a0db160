//! The engine's own records on a device, beside the MLS state: which groups
//! it is in, their hub bindings and cursors, and the inbox that makes every
//! message arrive once. Values are serde_json, like the MLS state, so the
//! store stays readable across versions.

use crate::kv::{KvError, KvStore, WriteBatch};
use crate::wire::TopicId;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A group's id: 32 random bytes fixed at creation.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GroupId(pub [u8; 32]);

impl GroupId {
    /// The MLS group id with the same bytes.
    pub fn to_mls(&self) -> openmls::group::GroupId {
        openmls::group::GroupId::from_slice(&self.0)
    }

    /// The hubsync id of an MLS group id, if it has the 32 bytes ours have.
    pub fn from_mls(id: &openmls::group::GroupId) -> Option<Self> {
        Some(GroupId(id.as_slice().try_into().ok()?))
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GroupId({})", &hex::encode(self.0)[..12])
    }
}

/// What the engine keeps about one joined group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// The group.
    pub id: GroupId,
    /// Hub URLs the group is bound to.
    pub hubs: Vec<String>,
    /// The hub every commit goes through.
    pub commit_hub: String,
    /// Sequence number of the last commit-topic frame applied from the
    /// commit hub (0: none).
    pub commit_cursor: u64,
    /// App topics, newest first: the current one and a few previous ones,
    /// still read so a message that raced a roster change is not lost.
    pub app_topics: Vec<TopicId>,
    /// Set on positive evidence that the group moved on without us.
    pub stranded: bool,
    /// Commit-topic frames skipped as unreadable.
    pub poison: u64,
}

/// How many app topics a group keeps reading: enough to cover every epoch
/// whose messages are still readable (a roster change at each of them at
/// worst), so a member that fell behind and sends from an old epoch, on
/// that epoch's topic, is still heard.
pub const APP_TOPICS_KEPT: usize = super::mls::MAX_PAST_EPOCHS + 1;

impl GroupRecord {
    /// Make `topic` the current app topic, keeping a few previous ones.
    /// Answers whether it was new.
    pub fn rotate_app_topic(&mut self, topic: TopicId) -> bool {
        if self.app_topics.first() == Some(&topic) {
            return false;
        }
        self.app_topics.retain(|t| t != &topic);
        self.app_topics.insert(0, topic);
        self.app_topics.truncate(APP_TOPICS_KEPT);
        true
    }
}

/// The commit in flight, written with the MLS pending commit in one batch
/// before the publish, so a crash never loses or doubles a commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// The exact bytes published.
    pub payload: Vec<u8>,
    /// Their publish id (a replay must carry the same).
    pub publish_id: crate::wire::PublishId,
    /// The head the publish compared against.
    pub expected_head: crate::wire::ExpectedHead,
    /// Whether the commit changes the roster.
    pub roster: bool,
    /// Who the commit adds, and the Welcome to send them once it landed.
    pub welcome: Option<(crate::wire::DeviceId, Vec<u8>)>,
}

const GROUP: &[u8] = b"eng/group/";
const JOURNAL: &[u8] = b"eng/journal/";
const INBOX: &[u8] = b"eng/inbox/";
const MESSAGE: &[u8] = b"eng/msg/";
const FUTURE: &[u8] = b"eng/future/";

fn key(prefix: &[u8], group: &GroupId, rest: &[u8]) -> Vec<u8> {
    let mut k = prefix.to_vec();
    k.extend_from_slice(&group.0);
    k.extend_from_slice(rest);
    k
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    // Serializing these plain records cannot fail: no maps with non-string
    // keys, no foreign Serialize impls.
    serde_json::to_vec(v).unwrap_or_default()
}

fn read<T: DeserializeOwned>(kv: &dyn KvStore, k: &[u8]) -> Result<Option<T>, KvError> {
    match kv.get(k)? {
        None => Ok(None),
        Some(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| KvError::Corrupt {
                key: hex::encode(k),
                reason: e.to_string(),
            }),
    }
}

/// Typed access to the engine's records in the device store.
#[derive(Clone)]
pub struct Records {
    kv: std::sync::Arc<dyn KvStore>,
}

impl Records {
    /// Records over the device's store.
    pub fn new(kv: std::sync::Arc<dyn KvStore>) -> Self {
        Self { kv }
    }

    /// Every joined group.
    ///
    /// # Errors
    /// The store's error.
    pub fn groups(&self) -> Result<Vec<GroupRecord>, KvError> {
        let mut out = Vec::new();
        for (k, v) in self.kv.scan_prefix(GROUP, usize::MAX)? {
            out.push(serde_json::from_slice(&v).map_err(|e| KvError::Corrupt {
                key: hex::encode(&k),
                reason: e.to_string(),
            })?);
        }
        Ok(out)
    }

    /// One group's record.
    ///
    /// # Errors
    /// The store's error.
    pub fn group(&self, id: &GroupId) -> Result<Option<GroupRecord>, KvError> {
        read(&*self.kv, &key(GROUP, id, &[]))
    }

    /// Stage a group record write.
    pub fn put_group(&self, batch: &mut WriteBatch, r: &GroupRecord) {
        batch.put(key(GROUP, &r.id, &[]), json(r));
    }

    /// Stage the removal of a group's record and inbox.
    ///
    /// # Errors
    /// The store's error.
    pub fn delete_group(&self, batch: &mut WriteBatch, id: &GroupId) -> Result<(), KvError> {
        batch.delete(key(GROUP, id, &[]));
        batch.delete(key(JOURNAL, id, &[]));
        for prefix in [INBOX, MESSAGE, FUTURE] {
            for (k, _) in self.kv.scan_prefix(&key(prefix, id, &[]), usize::MAX)? {
                batch.delete(k);
            }
        }
        Ok(())
    }

    /// The group's commit in flight, if any.
    ///
    /// # Errors
    /// The store's error.
    pub fn journal(&self, group: &GroupId) -> Result<Option<JournalEntry>, KvError> {
        read(&*self.kv, &key(JOURNAL, group, &[]))
    }

    /// Stage the group's commit in flight.
    pub fn put_journal(&self, batch: &mut WriteBatch, group: &GroupId, entry: &JournalEntry) {
        batch.put(key(JOURNAL, group, &[]), json(entry));
    }

    /// Stage the end of the group's commit in flight.
    pub fn clear_journal(&self, batch: &mut WriteBatch, group: &GroupId) {
        batch.delete(key(JOURNAL, group, &[]));
    }

    /// Whether a frame with this ciphertext digest was already handled.
    ///
    /// # Errors
    /// The store's error.
    pub fn seen_frame(&self, group: &GroupId, digest: &[u8; 32]) -> Result<bool, KvError> {
        Ok(self.kv.get(&key(INBOX, group, digest))?.is_some())
    }

    /// Stage "this frame was handled" (at `epoch`, for later pruning).
    pub fn mark_frame(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        digest: &[u8; 32],
        epoch: u64,
    ) {
        batch.put(key(INBOX, group, digest), json(&epoch));
    }

    /// The body digest recorded for a message id, if any.
    ///
    /// # Errors
    /// The store's error.
    pub fn message(&self, group: &GroupId, id: &[u8; 16]) -> Result<Option<[u8; 32]>, KvError> {
        read(&*self.kv, &key(MESSAGE, group, id))
    }

    /// Stage a delivered message id with its body digest.
    pub fn mark_message(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        id: &[u8; 16],
        digest: &[u8; 32],
    ) {
        batch.put(key(MESSAGE, group, id), json(digest));
    }

    /// Stage a frame that cannot be read yet (a future epoch).
    pub fn keep_future(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        digest: &[u8; 32],
        frame: &[u8],
    ) {
        batch.put(key(FUTURE, group, digest), frame.to_vec());
    }

    /// Frames kept for a later epoch, with their keys.
    ///
    /// # Errors
    /// The store's error.
    pub fn future_frames(&self, group: &GroupId) -> Result<crate::kv::Entries, KvError> {
        self.kv.scan_prefix(&key(FUTURE, group, &[]), usize::MAX)
    }

    /// Stage the removal of inbox entries older than `keep_from` epochs.
    ///
    /// # Errors
    /// The store's error.
    pub fn prune_inbox(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        keep_from: u64,
    ) -> Result<(), KvError> {
        for (k, v) in self.kv.scan_prefix(&key(INBOX, group, &[]), usize::MAX)? {
            let epoch: u64 = serde_json::from_slice(&v).unwrap_or(0);
            if epoch < keep_from {
                batch.delete(k);
            }
        }
        Ok(())
    }
}
