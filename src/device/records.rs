//! The engine's own records on a device, beside the MLS state: which groups
//! it is in, their hub bindings and cursors, and the inbox that makes every
//! message arrive once. Values are serde_json, like the MLS state, so the
//! store stays readable across versions.

use super::lane::JournalEntry;
use super::topics;
use crate::kv::{KvError, KvStore, WriteBatch};
use crate::wire::{DeviceId, TopicId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
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
    /// Hub URLs the group is bound to, as its ledger says (`hub.bind`,
    /// `hub.unbind`), in bind order.
    pub hubs: Vec<String>,
    /// The group's canonical commit hub as every member computes it from
    /// the ledger (see `GroupPeerManager::select_commit_hub`).
    pub commit_hub: String,
    /// Per hub: the sequence number of the last commit-topic frame applied
    /// or judged there (0: none). Only the commit hub's moves; the others
    /// keep where they were, for when the commit hub moves back.
    pub cursors: BTreeMap<String, u64>,
    /// App topics, newest first: the current one and a few previous ones,
    /// still read so a message that raced a roster change is not lost.
    pub app_topics: Vec<TopicId>,
    /// The exporter secrets `app_topics` derive from, in the same order:
    /// what signs a publish on each ([`topics::app_writer`]).
    #[serde(default)]
    pub app_secrets: Vec<[u8; 32]>,
    /// Set on positive evidence that the group moved on without us.
    pub stranded: bool,
    /// Commit-topic frames skipped without being applied.
    pub poison: u64,
    /// The secret the group's current commit topic and its writer key
    /// derive from ([`topics::commit_writer`]): the MLS exporter secret of
    /// the epoch of the last roster change this device merged (its joining
    /// or the group's creation counting as one). A roster change moves the
    /// commit log to a new topic ([`GroupRecord::rotate_commit_seed`]).
    #[serde(alias = "topic_seed")]
    pub commit_seed: [u8; 32],
    /// Whether this device holds the group's whole ledger (its recomputed
    /// head equals the authenticated one). A joiner whose snapshot did not
    /// verify has an incomplete ledger until a gather repairs it.
    pub ledger_complete: bool,
    /// The commits this device merged at its last few epochs: what tells a
    /// replayed frame (history) from a competing one (fork).
    pub merged: Vec<MergedCommit>,
    /// Per hub: the store identity its cursor was read from. A hub that
    /// answers with another identity lost its store: the cursor means
    /// nothing there and is reset before anything is compared against it.
    #[serde(default)]
    pub cursor_stores: BTreeMap<String, crate::wire::StoreId>,
    /// Per hub: SHA-256 of the frame at the cursor. A pull first checks
    /// that the hub still holds that very frame there: a hub restored from
    /// an older copy whose head climbed back past our cursor holds another.
    #[serde(default)]
    pub cursor_digests: BTreeMap<String, [u8; 32]>,
    /// The group's topic seed (its GroupContext extension's, which never
    /// changes): what its rendezvous mailbox derives from
    /// ([`topics::rendezvous_topic`]), kept here so the mailbox is found
    /// with no MLS state at hand.
    #[serde(default)]
    pub rendezvous_seed: Option<[u8; 32]>,
    /// The first epoch of a branch this device lost (a fork it lost: its
    /// commit framed in the epoch before was displaced by a member's). App
    /// messages it encrypted in that epoch or later are unreadable to the
    /// group; once it is a member again it sends them again
    /// ([`Records::sent_since`]). `None`: nothing known lost.
    #[serde(default)]
    pub lost_from: Option<u64>,
    /// The commit seeds this device drew on the branch it lost, after its
    /// displaced commit ([`GroupRecord::note_lost_branch`]): exporter
    /// secrets of epochs only that branch has, so a member holding one is
    /// on that branch too. Its rejoin request names them (hashed) so such
    /// members learn their branch was lost, and it takes no GroupInfo from
    /// one. Emptied when a rejoin lands.
    #[serde(default)]
    pub lost_seeds: Vec<[u8; 32]>,
    /// The member that wrote the commit that took the place of this
    /// device's on the lost branch's log, when known: its rejoin request
    /// names it, and a member that has since merged a commit of that
    /// member's on its own branch knows the claim is stale
    /// ([`GroupRecord::came_over`]). Emptied with `lost_seeds`.
    #[serde(default)]
    pub lost_to: Option<DeviceId>,
    /// When a pull last found this device at the end of the group's commit
    /// log (ms on this device's clock; kept to within
    /// `CAUGHT_UP_GRANULARITY_MS`, so a busy group's record is not written
    /// on every pull). What it sent before, the group could read.
    #[serde(default)]
    pub caught_up_at_ms: u64,
    /// An epoch probe is owed and none has concluded since: this device
    /// found its current commit log rewound, or joined from a Welcome that
    /// may be old (posted again after a restore, the group moved on since).
    /// Kept so that a probe cut short (the device stopped, nobody
    /// answered, the log unreadable) runs again when the device starts.
    #[serde(default)]
    pub probe_owed: bool,
}

/// One commit this device merged, remembered to judge frames of its epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedCommit {
    /// The epoch the commit was framed in.
    pub epoch: u64,
    /// SHA-256 of the frame's payload.
    pub digest: [u8; 32],
    /// The hub it was read from or published to.
    pub hub: String,
    /// Its position there; `None` once the hub rewound (positions from
    /// before a rewind say nothing about positions after it) until the
    /// frame is met again on the rewound log.
    pub seq: Option<u64>,
    /// The frame itself, so a hub that lost it can be given it back.
    #[serde(default)]
    pub payload: Vec<u8>,
    /// The commit seed of the topic it was on (the commit's own roster
    /// change moves the group on only after it).
    #[serde(default)]
    pub commit_seed: Option<[u8; 32]>,
    /// The device that wrote the frame to the hub (this device for its own
    /// commits; a member giving a rewound hub back a commit writes it
    /// again under its own name). `None` in records of earlier versions.
    #[serde(default)]
    pub writer: Option<DeviceId>,
}

/// Commit seeds of a lost branch remembered per group
/// ([`GroupRecord::lost_seeds`]).
pub const LOST_SEEDS_KEPT: usize = 8;

/// Merged commits remembered per group.
pub const MERGED_KEPT: usize = 16;

/// Of those, how many keep their frame (to heal a rewound hub); the last
/// commit of each commit log keeps its frame too.
pub const PAYLOADS_KEPT: usize = 4;

/// How many app topics a group keeps reading: enough to cover every epoch
/// whose messages are still readable (a roster change at each of them at
/// worst), so a member that fell behind and sends from an old epoch, on
/// that epoch's topic, is still heard.
pub const APP_TOPICS_KEPT: usize = super::mls::MAX_PAST_EPOCHS + 1;

impl GroupRecord {
    /// Make the topic of the exporter secret `secret` the current app
    /// topic, keeping a few previous ones. Answers whether it was new.
    pub fn rotate_app_topic(&mut self, secret: [u8; 32]) -> bool {
        let topic = topics::app_topic(&secret);
        if self.app_topics.first() == Some(&topic) {
            return false;
        }
        // Keep the two lists paired even if an older record had no secrets.
        self.app_secrets.resize(self.app_topics.len(), [0; 32]);
        if let Some(i) = self.app_topics.iter().position(|t| t == &topic) {
            self.app_topics.remove(i);
            self.app_secrets.remove(i);
        }
        self.app_topics.insert(0, topic);
        self.app_secrets.insert(0, secret);
        self.app_topics.truncate(APP_TOPICS_KEPT);
        self.app_secrets.truncate(APP_TOPICS_KEPT);
        true
    }

    /// The writer of `topic` if it is one of the group's kept app topics.
    pub fn app_writer(&self, topic: &TopicId) -> Option<topics::TopicWriter> {
        let i = self.app_topics.iter().position(|t| t == topic)?;
        let w = topics::app_writer(self.app_secrets.get(i)?);
        (w.topic() == topic).then_some(w)
    }

    /// The current commit topic's writer.
    pub fn commit_writer(&self) -> topics::TopicWriter {
        topics::commit_writer(&self.commit_seed)
    }

    /// A roster change drew a new commit seed: the commit log moves to the
    /// new topic, where nothing was read yet on any hub. Answers whether
    /// it moved.
    pub fn rotate_commit_seed(&mut self, seed: [u8; 32]) -> bool {
        if self.commit_seed == seed {
            return false;
        }
        self.commit_seed = seed;
        self.cursors.clear();
        self.cursor_stores.clear();
        self.cursor_digests.clear();
        true
    }

    /// The commit hub's cursor.
    pub fn cursor(&self) -> u64 {
        self.cursors.get(&self.commit_hub).copied().unwrap_or(0)
    }

    /// Move `hub`'s cursor to `seq` (never backwards; a rewind resets it
    /// with [`GroupRecord::rewind`]).
    pub fn advance(&mut self, hub: &str, seq: u64, digest: [u8; 32]) {
        let c = self.cursors.entry(hub.to_string()).or_insert(0);
        if seq >= *c {
            *c = seq;
            self.cursor_digests.insert(hub.to_string(), digest);
        }
    }

    /// `hub` lost or restored its store: read it again from the start, and
    /// forget positions learned there.
    pub fn rewind(&mut self, hub: &str) {
        self.cursors.insert(hub.to_string(), 0);
        self.cursor_stores.remove(hub);
        self.cursor_digests.remove(hub);
        for m in self.merged.iter_mut().filter(|m| m.hub == hub) {
            m.seq = None;
        }
    }

    /// Whether `writer` wrote a commit this device merged that was framed
    /// after epoch `epoch`: a member whose commit of `epoch` took the
    /// place of this device's on some log has since committed on this
    /// device's branch, so it left the branch its commit began, and that
    /// commit says nothing about this branch (sim seeds 1337, 1723).
    pub fn came_over(&self, writer: &DeviceId, epoch: u64) -> bool {
        self.merged
            .iter()
            .any(|k| k.epoch > epoch && k.writer.as_ref() == Some(writer))
    }

    /// Note that this device's branch from `epoch` on was lost (the
    /// earliest such epoch is kept).
    pub fn note_lost_from(&mut self, epoch: u64) {
        self.lost_from = Some(self.lost_from.map_or(epoch, |e| e.min(epoch)));
    }

    /// This device's commit `lost` lost its place to a member's: its
    /// branch is lost from the next epoch on, and the commit seeds it drew
    /// on that branch after `lost` are remembered (at most
    /// [`LOST_SEEDS_KEPT`], the newest). Seeds only move forward along a
    /// branch, so every seed of a commit after `lost` other than `lost`'s
    /// own, and the current one if it differs, came after it.
    pub fn note_lost_branch(&mut self, lost: &MergedCommit) {
        // Saturating: a record read back from a damaged store may hold any
        // epoch, and a panic here would take the device down.
        self.note_lost_from(lost.epoch.saturating_add(1));
        let mut after: Vec<&MergedCommit> = self
            .merged
            .iter()
            .filter(|k| k.epoch > lost.epoch)
            .collect();
        after.sort_by_key(|k| k.epoch);
        let seeds = after
            .into_iter()
            .filter_map(|k| k.commit_seed)
            .chain(std::iter::once(self.commit_seed));
        for s in seeds {
            if Some(s) != lost.commit_seed && !self.lost_seeds.contains(&s) {
                self.lost_seeds.push(s);
            }
        }
        let cut = self.lost_seeds.len().saturating_sub(LOST_SEEDS_KEPT);
        self.lost_seeds.drain(..cut);
    }

    /// Whether this device holds one of `seeds` (its current commit seed,
    /// or that of a commit it remembers merging): it is on that branch.
    pub fn holds_any_seed(&self, seeds: impl Fn(&[u8; 32]) -> bool) -> bool {
        seeds(&self.commit_seed)
            || self
                .merged
                .iter()
                .filter_map(|k| k.commit_seed.as_ref())
                .any(&seeds)
    }

    /// Remember a merged commit.
    pub fn remember(&mut self, m: MergedCommit) {
        self.merged.retain(|k| k.epoch != m.epoch);
        self.merged.push(m);
        if self.merged.len() > MERGED_KEPT {
            let cut = self.merged.len() - MERGED_KEPT;
            self.merged.drain(..cut);
        }
        // Frames are kept for the last few commits, enough to give a
        // rewound hub back what it lost in a short window, and for the last
        // commit of each commit log (hub and topic): a former commit hub
        // restored from before a move or a roster change needs only that
        // one back, however many commits came since elsewhere. Others drop
        // theirs so the record (rewritten on every frame) stays small.
        let keep_from = self.merged.len().saturating_sub(PAYLOADS_KEPT);
        let mut logs_seen: Vec<(&str, Option<[u8; 32]>)> = Vec::new();
        let mut drop = Vec::new();
        for (i, k) in self.merged.iter().enumerate().rev() {
            let log = (k.hub.as_str(), k.commit_seed);
            let last_of_log = !logs_seen.contains(&log);
            if last_of_log {
                logs_seen.push(log);
            }
            if i < keep_from && !last_of_log {
                drop.push(i);
            }
        }
        for i in drop {
            self.merged[i].payload = Vec::new();
        }
    }

    /// The hubs the group's frames travel: its bound hubs, or its commit
    /// hub alone (the loopback hub) when none is bound.
    pub fn routes(&self) -> Vec<String> {
        if self.hubs.is_empty() {
            vec![self.commit_hub.clone()]
        } else {
            self.hubs.clone()
        }
    }
}

const GROUP: &[u8] = b"eng/group/";
const LEDGER: &[u8] = b"eng/ledger/";
const APP_CURSOR: &[u8] = b"eng/appcur/";
const HUB_STORE: &[u8] = b"eng/hubstore/";
const PENDING_WELCOME: &[u8] = b"eng/welcome-pending/";
const INVITED: &[u8] = b"eng/invited/";
const JOURNAL: &[u8] = b"eng/journal/";
const INBOX: &[u8] = b"eng/inbox/";
const MESSAGE: &[u8] = b"eng/msg/";
const FUTURE: &[u8] = b"eng/future/";
const SENT: &[u8] = b"eng/sent/";
const SENT_PRUNED: &[u8] = b"eng/sent-pruned/";
const KEY_PACKAGES_UPLOADED: &[u8] = b"eng/kp-uploaded/";

/// App messages this device sent, kept per group (the newest) so that a
/// branch it loses can be sent again in the group's epoch.
pub const SENT_KEPT: usize = 256;

/// One app message this device sent, as kept for sending again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentMessage {
    /// The epoch it was encrypted in.
    pub epoch: u64,
    /// Its message id (kept when it is sent again, so receivers that read
    /// it the first time drop the second).
    pub id: [u8; 16],
    /// The app's bytes.
    pub body: Vec<u8>,
    /// When it was sent, on this device's clock (ms since the Unix epoch).
    #[serde(default)]
    pub at_ms: u64,
}

/// A pool key package this device uploaded to a hub.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UploadedKeyPackage {
    /// Its reference: what its private key is stored under.
    pub r: openmls::prelude::KeyPackageRef,
    /// SHA-256 of its bytes, as the hub lists them.
    pub digest: [u8; 32],
}

fn sent_key(group: &GroupId, epoch: u64, id: &[u8; 16]) -> Vec<u8> {
    let mut rest = epoch.to_be_bytes().to_vec();
    rest.extend_from_slice(id);
    key(SENT, group, &rest)
}

fn key(prefix: &[u8], group: &GroupId, rest: &[u8]) -> Vec<u8> {
    let mut k = prefix.to_vec();
    k.extend_from_slice(&group.0);
    k.extend_from_slice(rest);
    k
}

/// How far a device has read an app topic on one hub: the sequence number
/// of the last frame handled, and that frame's digest when known. The
/// digest is what shows a hub restored from an older copy of its store:
/// another frame at the same position there (sim seed 1105).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppCursor {
    /// The last sequence number read (0: nothing yet).
    pub seq: u64,
    /// The digest of the frame at `seq`, when it was read.
    pub digest: Option<[u8; 32]>,
}

/// An app cursor as stored: a bare sequence number before digests were
/// kept (2026-12-06), or the whole cursor.
#[derive(Deserialize)]
#[serde(untagged)]
enum StoredAppCursor {
    Seq(u64),
    Full(AppCursor),
}

fn app_cursor_key(group: &GroupId, hub: &str, topic: &TopicId) -> Vec<u8> {
    let mut rest = (hub.len() as u32).to_be_bytes().to_vec();
    rest.extend_from_slice(hub.as_bytes());
    rest.extend_from_slice(&topic.0);
    key(APP_CURSOR, group, &rest)
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    // Serializing these plain records cannot fail: no maps with non-string
    // keys, no foreign Serialize impls.
    serde_json::to_vec(v).unwrap_or_default()
}

fn read<T: DeserializeOwned>(kv: &dyn KvStore, k: &[u8]) -> Result<Option<T>, KvError> {
    kv.get(k)?.map(|b| decode(k, &b)).transpose()
}

/// Decode the JSON record `b` stored under `k`.
fn decode<T: DeserializeOwned>(k: &[u8], b: &[u8]) -> Result<T, KvError> {
    serde_json::from_slice(b).map_err(|e| KvError::Corrupt {
        key: hex::encode(k),
        reason: e.to_string(),
    })
}

/// Typed access to the engine's records in the device store.
#[derive(Clone)]
pub struct Records {
    kv: std::sync::Arc<dyn KvStore>,
}

impl Records {
    /// Records over the device's store.
    /// The store these records live in.
    pub fn kv(&self) -> &std::sync::Arc<dyn KvStore> {
        &self.kv
    }

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

    /// Stage the removal of a group's record, frame marks and the rest of
    /// its state. Its message-id marks stay: a device invited back into
    /// the group may be sent a message it already delivered (a member
    /// sends again what a lost branch or a long absence may have hidden,
    /// under the same id), and the app's inbox, which also stays, already
    /// has it.
    ///
    /// # Errors
    /// The store's error.
    pub fn delete_group(&self, batch: &mut WriteBatch, id: &GroupId) -> Result<(), KvError> {
        batch.delete(key(GROUP, id, &[]));
        batch.delete(key(JOURNAL, id, &[]));
        batch.delete(key(SENT_PRUNED, id, &[]));
        for prefix in [INBOX, FUTURE, LEDGER, APP_CURSOR, SENT, INVITED] {
            for (k, _) in self.kv.scan_prefix(&key(prefix, id, &[]), usize::MAX)? {
                batch.delete(k);
            }
        }
        Ok(())
    }

    /// The group's ledger entries in enactment order, as stored (encoded).
    ///
    /// # Errors
    /// The store's error.
    pub fn ledger(&self, group: &GroupId) -> Result<Vec<Vec<u8>>, KvError> {
        Ok(self
            .kv
            .scan_prefix(&key(LEDGER, group, &[]), usize::MAX)?
            .into_iter()
            .map(|(_, v)| v)
            .collect())
    }

    /// Stage ledger entries (encoded) at positions `from`, `from + 1`, ...
    pub fn put_ledger(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        from: u64,
        entries: &[Vec<u8>],
    ) {
        for (i, e) in entries.iter().enumerate() {
            batch.put(
                key(LEDGER, group, &(from + i as u64).to_be_bytes()),
                e.clone(),
            );
        }
    }

    /// Stage the replacement of the group's whole ledger by `entries`
    /// (encoded, in enactment order, from position 0).
    ///
    /// # Errors
    /// The store's error.
    pub fn replace_ledger(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        entries: &[Vec<u8>],
    ) -> Result<(), KvError> {
        for (k, _) in self.kv.scan_prefix(&key(LEDGER, group, &[]), usize::MAX)? {
            batch.delete(k);
        }
        self.put_ledger(batch, group, 0, entries);
        Ok(())
    }

    /// Where catch-up stopped reading `topic` on `hub` (0: never read).
    ///
    /// # Errors
    /// The store's error.
    pub fn app_cursor(
        &self,
        group: &GroupId,
        hub: &str,
        topic: &TopicId,
    ) -> Result<AppCursor, KvError> {
        let stored: Option<StoredAppCursor> = read(&*self.kv, &app_cursor_key(group, hub, topic))?;
        Ok(match stored {
            None => AppCursor::default(),
            Some(StoredAppCursor::Seq(seq)) => AppCursor { seq, digest: None },
            Some(StoredAppCursor::Full(c)) => c,
        })
    }

    /// Stage the catch-up position of `topic` on `hub`.
    pub fn put_app_cursor(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        hub: &str,
        topic: &TopicId,
        cursor: AppCursor,
    ) {
        batch.put(app_cursor_key(group, hub, topic), json(&cursor));
    }

    /// Stage the reset of every catch-up position on `hub` (it rewound).
    ///
    /// # Errors
    /// The store's error.
    pub fn reset_app_cursors(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        hub: &str,
    ) -> Result<(), KvError> {
        let mut prefix = key(APP_CURSOR, group, &[]);
        prefix.extend_from_slice(&(hub.len() as u32).to_be_bytes());
        prefix.extend_from_slice(hub.as_bytes());
        for (k, _) in self.kv.scan_prefix(&prefix, usize::MAX)? {
            batch.delete(k);
        }
        Ok(())
    }

    /// The Welcome envelopes kept for a group this device held when they
    /// arrived: at most one per inviter (its latest), in inviter order.
    ///
    /// # Errors
    /// The store's error.
    pub fn pending_welcomes(&self, group: &GroupId) -> Result<Vec<Vec<u8>>, KvError> {
        Ok(self
            .kv
            .scan_prefix(&key(PENDING_WELCOME, group, &[]), usize::MAX)?
            .into_iter()
            .map(|(_, v)| v)
            .collect())
    }

    /// Stage `inviter`'s Welcome envelope to try once the group is left
    /// (replacing that inviter's earlier one).
    pub fn put_pending_welcome(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        inviter: &DeviceId,
        envelope: &[u8],
    ) {
        batch.put(key(PENDING_WELCOME, group, &inviter.0), envelope.to_vec());
    }

    /// Stage the end of every Welcome kept for `group`.
    ///
    /// # Errors
    /// The store's error.
    pub fn clear_pending_welcomes(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
    ) -> Result<(), KvError> {
        for (k, _) in self
            .kv
            .scan_prefix(&key(PENDING_WELCOME, group, &[]), usize::MAX)?
        {
            batch.delete(k);
        }
        Ok(())
    }

    /// Stage the Welcome publish this device made for `joiner`, kept while
    /// `joiner` is a member, so a hub that loses it (a store restored from
    /// a backup, or lost) can be given it again however many commits came
    /// since. One per joiner: a later invite replaces it.
    pub fn put_invited_welcome(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        joiner: &DeviceId,
        publish: &crate::wire::Publish,
    ) {
        batch.put(key(INVITED, group, &joiner.0), json(publish));
    }

    /// The Welcome publishes this device keeps for a group's joiners.
    ///
    /// # Errors
    /// The store's error; an undecodable record is `Corrupt`.
    pub fn invited_welcomes(
        &self,
        group: &GroupId,
    ) -> Result<Vec<(DeviceId, crate::wire::Publish)>, KvError> {
        let prefix = key(INVITED, group, &[]);
        let mut out = Vec::new();
        for (k, v) in self.kv.scan_prefix(&prefix, usize::MAX)? {
            let joiner = k
                .get(prefix.len()..)
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .map(DeviceId)
                .ok_or_else(|| KvError::Corrupt {
                    key: hex::encode(&k),
                    reason: "an invited-Welcome key ends in a 32-byte device id".into(),
                })?;
            out.push((joiner, decode(&k, &v)?));
        }
        Ok(out)
    }

    /// Stage forgetting the Welcome kept for `joiner` (no longer a member).
    pub fn delete_invited_welcome(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        joiner: &DeviceId,
    ) {
        batch.delete(key(INVITED, group, &joiner.0));
    }

    /// The store identity last seen on `hub`, if any.
    ///
    /// # Errors
    /// The store's error.
    pub fn hub_store_id(&self, hub: &str) -> Result<Option<crate::wire::StoreId>, KvError> {
        let mut k = HUB_STORE.to_vec();
        k.extend_from_slice(hub.as_bytes());
        read(&*self.kv, &k)
    }

    /// Stage the store identity seen on `hub`.
    pub fn put_hub_store_id(&self, batch: &mut WriteBatch, hub: &str, id: crate::wire::StoreId) {
        let mut k = HUB_STORE.to_vec();
        k.extend_from_slice(hub.as_bytes());
        batch.put(k, json(&id));
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

    /// Whether a frame with this ciphertext digest was already handled:
    /// marked in `batch` (several frames handled under one flush) or in
    /// the store.
    ///
    /// # Errors
    /// The store's error.
    pub fn seen_frame(
        &self,
        batch: &WriteBatch,
        group: &GroupId,
        digest: &[u8; 32],
    ) -> Result<bool, KvError> {
        let k = key(INBOX, group, digest);
        Ok(match batch.staged(&k) {
            Some(v) => v.is_some(),
            None => self.kv.get(&k)?.is_some(),
        })
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

    /// The body digest recorded for a message id, if any: staged in
    /// `batch`, or else in the store.
    ///
    /// # Errors
    /// The store's error.
    pub fn message(
        &self,
        batch: &WriteBatch,
        group: &GroupId,
        id: &[u8; 16],
    ) -> Result<Option<[u8; 32]>, KvError> {
        let k = key(MESSAGE, group, id);
        match batch.staged(&k) {
            Some(Some(v)) => decode(&k, v).map(Some),
            Some(None) => Ok(None),
            None => read(&*self.kv, &k),
        }
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

    /// The pool key packages this device uploaded to `hub` that were still
    /// there at its last look: each one's reference (what its private key
    /// is stored under) and the SHA-256 of its bytes (what the hub lists).
    ///
    /// # Errors
    /// The store's error, or a record that does not decode.
    pub fn uploaded_key_packages(&self, hub: &str) -> Result<Vec<UploadedKeyPackage>, KvError> {
        Ok(read(&*self.kv, &[KEY_PACKAGES_UPLOADED, hub.as_bytes()].concat())?.unwrap_or_default())
    }

    /// Stage the pool key packages this device has uploaded to `hub`.
    pub fn put_uploaded_key_packages(
        &self,
        batch: &mut WriteBatch,
        hub: &str,
        uploaded: &[UploadedKeyPackage],
    ) {
        batch.put(
            [KEY_PACKAGES_UPLOADED, hub.as_bytes()].concat(),
            json(&uploaded),
        );
    }

    /// Stage an app message this device sent (see [`SentMessage`]).
    pub fn put_sent(&self, batch: &mut WriteBatch, group: &GroupId, m: &SentMessage) {
        batch.put(sent_key(group, m.epoch, &m.id), json(m));
    }

    /// Stage forgetting a sent message (it was sent again in a later epoch).
    pub fn forget_sent(&self, batch: &mut WriteBatch, group: &GroupId, m: &SentMessage) {
        batch.delete(sent_key(group, m.epoch, &m.id));
    }

    /// The kept app messages this device sent in `group` in epoch `from`
    /// or later, oldest epoch first.
    ///
    /// # Errors
    /// The store's error, or a record that does not decode.
    pub fn sent_since(&self, group: &GroupId, from: u64) -> Result<Vec<SentMessage>, KvError> {
        let mut out = Vec::new();
        for (k, v) in self.kv.scan_prefix(&key(SENT, group, &[]), usize::MAX)? {
            let m: SentMessage = serde_json::from_slice(&v).map_err(|e| KvError::Corrupt {
                key: hex::encode(&k),
                reason: e.to_string(),
            })?;
            if m.epoch >= from {
                out.push(m);
            }
        }
        Ok(out)
    }

    /// The earliest epoch among `group`'s kept sent messages that were
    /// encrypted in epoch `through` or earlier and sent at `after_ms` or
    /// later (`None`: there are none).
    ///
    /// # Errors
    /// The store's error, or a record that does not decode.
    pub fn first_sent_behind(
        &self,
        group: &GroupId,
        through: u64,
        after_ms: u64,
    ) -> Result<Option<u64>, KvError> {
        let prefix = key(SENT, group, &[]);
        // Keys run in epoch order: most merges find the oldest already
        // past `through` and read one entry.
        let oldest = self.kv.scan_prefix(&prefix, 1)?;
        let past = |k: &[u8]| {
            k.get(prefix.len()..prefix.len() + 8)
                .and_then(|b| b.try_into().ok())
                .is_none_or(|e| u64::from_be_bytes(e) > through)
        };
        if oldest.first().is_none_or(|(k, _)| past(k)) {
            return Ok(None);
        }
        for (k, v) in self.kv.scan_prefix(&prefix, usize::MAX)? {
            if past(&k) {
                break;
            }
            let m: SentMessage = serde_json::from_slice(&v).map_err(|e| KvError::Corrupt {
                key: hex::encode(&k),
                reason: e.to_string(),
            })?;
            if m.at_ms >= after_ms {
                return Ok(Some(m.epoch));
            }
        }
        Ok(None)
    }

    /// Stage forgetting all but the newest `keep` sent messages of `group`.
    ///
    /// # Errors
    /// The store's error.
    pub fn prune_sent(
        &self,
        batch: &mut WriteBatch,
        group: &GroupId,
        keep: usize,
    ) -> Result<(), KvError> {
        let all = self.kv.scan_prefix(&key(SENT, group, &[]), usize::MAX)?;
        let cut = all.len().saturating_sub(keep);
        if cut == 0 {
            return Ok(());
        }
        let mut through = self.sent_pruned_through(group)?;
        let prefix = key(SENT, group, &[]).len();
        for (k, _) in all.into_iter().take(cut) {
            if let Some(e) = k.get(prefix..prefix + 8).and_then(|b| b.try_into().ok()) {
                through = through.max(Some(u64::from_be_bytes(e)));
            }
            batch.delete(k);
        }
        if let Some(e) = through {
            batch.put(key(SENT_PRUNED, group, &[]), json(&e));
        }
        Ok(())
    }

    /// The latest epoch of a sent message pruned from `group`'s kept ones.
    ///
    /// # Errors
    /// The store's error.
    pub fn sent_pruned_through(&self, group: &GroupId) -> Result<Option<u64>, KvError> {
        read(&*self.kv, &key(SENT_PRUNED, group, &[]))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemKv;

    fn sent(epoch: u64, n: u8) -> SentMessage {
        SentMessage {
            epoch,
            id: [n; 16],
            body: vec![n],
            at_ms: u64::from(n) * 1000,
        }
    }

    /// A lost commit at the last epoch a u64 holds (a record read back
    /// from a damaged store) marks the branch lost without overflowing.
    #[test]
    fn a_lost_branch_at_the_last_epoch_does_not_overflow() {
        let lost = MergedCommit {
            epoch: u64::MAX,
            digest: [3; 32],
            hub: "ws://h".into(),
            seq: Some(1),
            payload: Vec::new(),
            commit_seed: Some([2; 32]),
            writer: None,
        };
        let mut rec = GroupRecord {
            id: GroupId([7; 32]),
            hubs: vec!["ws://h".into()],
            commit_hub: "ws://h".into(),
            cursors: Default::default(),
            app_topics: Vec::new(),
            app_secrets: Vec::new(),
            stranded: false,
            poison: 0,
            commit_seed: [5; 32],
            ledger_complete: true,
            merged: vec![lost.clone()],
            cursor_stores: Default::default(),
            cursor_digests: Default::default(),
            rendezvous_seed: None,
            lost_from: None,
            lost_seeds: Vec::new(),
            lost_to: None,
            caught_up_at_ms: 0,
            probe_owed: false,
        };
        rec.note_lost_branch(&lost);
        assert_eq!(rec.lost_from, Some(u64::MAX));
        assert_eq!(rec.lost_seeds, vec![[5; 32]]);
    }

    /// A cursor stored before digests were kept (a bare number) reads as
    /// that position with no digest; a whole one reads back as written.
    #[test]
    fn app_cursors_read_both_stored_forms() {
        let kv: std::sync::Arc<dyn KvStore> = std::sync::Arc::new(MemKv::new());
        let r = Records::new(kv.clone());
        let g = GroupId([7; 32]);
        let topic = TopicId(vec![2; 33]);
        assert_eq!(
            r.app_cursor(&g, "ws://h", &topic).unwrap(),
            AppCursor::default()
        );
        let mut b = WriteBatch::new();
        b.put(app_cursor_key(&g, "ws://h", &topic), b"41".to_vec());
        kv.apply(&b).unwrap();
        assert_eq!(
            r.app_cursor(&g, "ws://h", &topic).unwrap(),
            AppCursor {
                seq: 41,
                digest: None
            }
        );
        let full = AppCursor {
            seq: 42,
            digest: Some([9; 32]),
        };
        let mut b = WriteBatch::new();
        r.put_app_cursor(&mut b, &g, "ws://h", &topic, full);
        kv.apply(&b).unwrap();
        assert_eq!(r.app_cursor(&g, "ws://h", &topic).unwrap(), full);
        // Another hub's cursor for the same topic is its own.
        assert_eq!(
            r.app_cursor(&g, "ws://i", &topic).unwrap(),
            AppCursor::default()
        );
    }

    /// Sent messages come back from an epoch on, oldest epoch first; the
    /// prune keeps the newest and remembers the latest epoch it dropped,
    /// which is how a resend learns that older ones are gone.
    #[test]
    fn sent_messages_are_kept_newest_first_and_pruning_is_remembered() {
        let kv: std::sync::Arc<dyn KvStore> = std::sync::Arc::new(MemKv::new());
        let r = Records::new(kv.clone());
        let g = GroupId([7; 32]);
        let other = GroupId([8; 32]);
        let mut b = WriteBatch::new();
        for (epoch, n) in [(3, 1), (1, 2), (2, 3), (3, 4)] {
            r.put_sent(&mut b, &g, &sent(epoch, n));
        }
        r.put_sent(&mut b, &other, &sent(2, 9));
        kv.apply(&b).unwrap();
        let epochs: Vec<u64> = r
            .sent_since(&g, 2)
            .unwrap()
            .iter()
            .map(|m| m.epoch)
            .collect();
        assert_eq!(epochs, vec![2, 3, 3]);
        assert_eq!(r.sent_pruned_through(&g).unwrap(), None);
        // Sent at 1, 2, 3 and 4 s, in epochs 3, 1, 2 and 3.
        assert_eq!(r.first_sent_behind(&g, 0, 0).unwrap(), None);
        assert_eq!(r.first_sent_behind(&g, 3, 0).unwrap(), Some(1));
        assert_eq!(r.first_sent_behind(&g, 3, 2500).unwrap(), Some(2));
        assert_eq!(r.first_sent_behind(&g, 2, 3500).unwrap(), None);
        assert_eq!(r.first_sent_behind(&g, 3, 3500).unwrap(), Some(3));

        let mut b = WriteBatch::new();
        r.prune_sent(&mut b, &g, 2).unwrap();
        kv.apply(&b).unwrap();
        let left: Vec<(u64, u8)> = r
            .sent_since(&g, 0)
            .unwrap()
            .iter()
            .map(|m| (m.epoch, m.body[0]))
            .collect();
        assert_eq!(left, vec![(3, 1), (3, 4)]);
        assert_eq!(r.sent_pruned_through(&g).unwrap(), Some(2));
        assert_eq!(
            r.sent_since(&other, 0).unwrap().len(),
            1,
            "another group's are untouched"
        );

        let mut b = WriteBatch::new();
        r.forget_sent(&mut b, &g, &sent(3, 1));
        r.delete_group(&mut b, &g).unwrap();
        kv.apply(&b).unwrap();
        assert!(r.sent_since(&g, 0).unwrap().is_empty());
        assert_eq!(r.sent_pruned_through(&g).unwrap(), None);
    }
}
