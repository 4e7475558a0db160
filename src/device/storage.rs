//! OpenMLS storage over the device's [`KvStore`], staged per operation.
//!
//! OpenMLS's `StorageProvider` has no transaction boundary: one merge makes
//! dozens of separate writes and deletes, and a crash between two of them
//! would leave a group that can never be loaded again. So nothing written
//! through the trait reaches the store directly. Each operation gets a
//! [`StagedStorage`]: an overlay that records every write and delete, that
//! reads see, and that the owner turns into one [`WriteBatch`]
//! ([`StagedStorage::take_batch`]) to apply together with its own engine
//! changes (cursor, ledger, journal). Dropping a `StagedStorage` without
//! taking its batch discards the operation, leaving the store as it was.
//!
//! # Layout
//!
//! Every key is `mls/` + label + `/` + serde_json(key) + storage version (two
//! bytes, big endian). Every value is written as the byte `0x00` followed by
//! its MessagePack encoding (OpenMLS 0.9's types need a self-describing
//! format: some decode with `deserialize_any`). A value whose first byte is
//! anything else is serde_json, as this module wrote before 2026-12-06 (a
//! JSON text never starts with `0x00`); it is read as before and rewritten in
//! MessagePack the next time OpenMLS writes it, so stores migrate lazily.
//! MessagePack keeps byte strings as bytes where JSON made them arrays of
//! integers, which made the JSON about three times larger and its parsing a
//! tenth of a device's profile (docs/performance.md).
//! A group id is always encoded by the same function and always comes first
//! in group-scoped keys, so one prefix scan finds all of a group's state
//! ([`StagedStorage::purge_group`]). JSON objects and arrays are
//! self-delimiting, so no group's encoding is a prefix of another's, and the
//! (epoch, leaf index) pair of an epoch key pair is encoded as one JSON array
//! so that `epoch 5, leaf 10` and `epoch 51, leaf 0` cannot collide.
//!
//! Lists (own leaf nodes, the proposal queue) are one array value per key
//! (equal items are found by their MessagePack bytes), read-modify-written
//! through the overlay so that a staged append is seen by the next read of
//! the same operation. An emptied list is deleted.
//!
//! # Deletes are real
//!
//! A delete removes the key from the store once the batch is applied, never
//! a tombstone value. Beyond what OpenMLS asks for:
//! - `clear_proposal_queue` deletes every queued proposal of the group and the
//!   queue itself (OpenMLS's memory store deletes neither);
//! - `delete_own_leaf_nodes` also deletes the update key pairs of the deleted
//!   leaves, which OpenMLS 0.9 leaves behind when a commit settles the epoch
//!   without the update proposal or the group is deleted;
//! - [`StagedStorage::purge_group`] sweeps whatever a deleted group left.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use openmls::group::GroupId;
use openmls::prelude::LeafNode;
use openmls_traits::storage::{traits, StorageProvider, CURRENT_VERSION};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::kv::{KvError, KvStore, WriteBatch};

/// The first bytes of every key this module writes.
pub const MLS_KEY_PREFIX: &[u8] = b"mls/";

const KEY_PACKAGE: &[u8] = b"KeyPackage";
const PSK: &[u8] = b"Psk";
const ENCRYPTION_KEY_PAIR: &[u8] = b"EncryptionKeyPair";
const SIGNATURE_KEY_PAIR: &[u8] = b"SignatureKeyPair";
const EPOCH_KEY_PAIRS: &[u8] = b"EpochKeyPairs";
const TREE: &[u8] = b"Tree";
const GROUP_CONTEXT: &[u8] = b"GroupContext";
const INTERIM_TRANSCRIPT_HASH: &[u8] = b"InterimTranscriptHash";
const CONFIRMATION_TAG: &[u8] = b"ConfirmationTag";
const JOIN_CONFIG: &[u8] = b"MlsGroupJoinConfig";
const OWN_LEAF_NODES: &[u8] = b"OwnLeafNodes";
const GROUP_STATE: &[u8] = b"GroupState";
const QUEUED_PROPOSAL: &[u8] = b"QueuedProposal";
const PROPOSAL_QUEUE_REFS: &[u8] = b"ProposalQueueRefs";
const OWN_LEAF_INDEX: &[u8] = b"OwnLeafIndex";
const EPOCH_SECRETS: &[u8] = b"EpochSecrets";
const RESUMPTION_PSK_STORE: &[u8] = b"ResumptionPsk";
const MESSAGE_SECRETS: &[u8] = b"MessageSecrets";

/// Every label whose keys start with the group id: what a purge must sweep.
const GROUP_SCOPED: &[&[u8]] = &[
    TREE,
    GROUP_CONTEXT,
    INTERIM_TRANSCRIPT_HASH,
    CONFIRMATION_TAG,
    JOIN_CONFIG,
    OWN_LEAF_NODES,
    GROUP_STATE,
    QUEUED_PROPOSAL,
    PROPOSAL_QUEUE_REFS,
    OWN_LEAF_INDEX,
    EPOCH_SECRETS,
    RESUMPTION_PSK_STORE,
    MESSAGE_SECRETS,
    EPOCH_KEY_PAIRS,
];

/// A failure of the MLS storage. A missing value is never an error.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StorageError {
    /// The key-value store underneath failed.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A key or value handed over by OpenMLS could not be serialized.
    #[error("cannot encode {what} for storage: {reason}")]
    Encode {
        /// What was being encoded.
        what: &'static str,
        /// What the encoder said.
        reason: String,
    },
    /// A stored value could not be decoded: the store is corrupt or was
    /// written by an incompatible version.
    #[error("stored value under {key} is unreadable: {reason}")]
    Corrupt {
        /// Hex of the full storage key.
        key: String,
        /// What the decoder said.
        reason: String,
    },
    /// The proposal queue names a proposal whose body is not stored.
    #[error("queued proposal under {key} is listed but not stored")]
    MissingProposal {
        /// Hex of the missing proposal's storage key.
        key: String,
    },
}

/// The device's MLS storage: a handle on the store that hands out one
/// [`StagedStorage`] per operation.
///
/// It never writes by itself; cloning shares the same store.
#[derive(Clone)]
pub struct DeviceStorage {
    kv: Arc<dyn KvStore>,
}

impl DeviceStorage {
    /// MLS storage over `kv`, which may hold other data outside
    /// [`MLS_KEY_PREFIX`].
    pub fn new(kv: Arc<dyn KvStore>) -> Self {
        Self { kv }
    }

    /// The store underneath, for applying and flushing batches.
    pub fn kv(&self) -> &Arc<dyn KvStore> {
        &self.kv
    }

    /// A fresh, empty overlay for one operation. It reads the store as it is
    /// at each read, plus its own staged writes.
    pub fn staged(&self) -> StagedStorage {
        StagedStorage::new(self.kv.clone())
    }
}

/// One operation's view of the MLS storage: the store plus an overlay of
/// staged writes and deletes.
///
/// Implements OpenMLS's [`StorageProvider`]. Reads see the overlay first, then
/// the store. Writes and deletes only touch the overlay; they reach the store
/// when the owner applies [`take_batch`](Self::take_batch) (or
/// [`apply_with`](Self::apply_with)). Dropping it discards them.
pub struct StagedStorage {
    kv: Arc<dyn KvStore>,
    /// Staged state per storage key; `None` is a staged delete.
    overlay: Mutex<BTreeMap<Vec<u8>, Option<Vec<u8>>>>,
}

type Overlay = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

impl StagedStorage {
    /// An empty overlay over `kv`.
    pub fn new(kv: Arc<dyn KvStore>) -> Self {
        Self {
            kv,
            overlay: Mutex::new(BTreeMap::new()),
        }
    }

    /// Number of keys with a staged write or delete.
    pub fn staged_len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Move every staged write and delete into a batch, leaving the overlay
    /// empty.
    ///
    /// Until the caller applies the batch, later reads through this storage
    /// no longer see those writes: apply it before using the storage again.
    pub fn take_batch(&self) -> WriteBatch {
        let staged = std::mem::take(&mut *self.lock());
        to_batch(staged)
    }

    /// The staged writes and deletes as one batch, consuming the overlay.
    pub fn into_batch(self) -> WriteBatch {
        let staged = self.overlay.into_inner().unwrap_or_else(|p| p.into_inner());
        to_batch(staged)
    }

    /// Apply the staged writes followed by `extra` as one atomic batch (not
    /// yet durable: flush the store to make it so), then empty the overlay.
    ///
    /// # Errors
    /// [`StorageError::Kv`] when the store refuses the batch; the overlay is
    /// then kept whole, so the caller may retry or drop it.
    pub fn apply_with(&self, extra: WriteBatch) -> Result<(), StorageError> {
        let mut overlay = self.lock();
        let mut batch = to_batch(overlay.clone());
        batch.extend(extra);
        self.kv.apply(&batch)?;
        overlay.clear();
        Ok(())
    }

    /// Whether MLS state of the group `group_id` exists (staged or stored).
    ///
    /// # Errors
    /// [`StorageError`] when the store fails.
    pub fn contains_group(&self, group_id: &GroupId) -> Result<bool, StorageError> {
        let key = storage_key(GROUP_CONTEXT, &group_key(group_id)?);
        Ok(self.get_raw(&key)?.is_some())
    }

    /// The ids of every group with MLS state (staged or stored), in key order.
    ///
    /// # Errors
    /// [`StorageError`] when the store fails or a key is unreadable.
    pub fn group_ids(&self) -> Result<Vec<GroupId>, StorageError> {
        let prefix = label_prefix(GROUP_CONTEXT);
        let version = CURRENT_VERSION.to_be_bytes();
        let mut out = Vec::new();
        for key in self.live_keys(&prefix)? {
            let Some(json) = key
                .strip_prefix(prefix.as_slice())
                .and_then(|rest| rest.strip_suffix(version.as_slice()))
            else {
                // Another storage version's key: not ours to read.
                continue;
            };
            let id = serde_json::from_slice(json).map_err(|e| StorageError::Corrupt {
                key: hex::encode(&key),
                reason: e.to_string(),
            })?;
            out.push(id);
        }
        Ok(out)
    }

    /// Stage the deletion of everything the group `group_id` left behind.
    ///
    /// `MlsGroup::delete` removes the current epoch's state but can leave
    /// secrets that forward secrecy wants gone: key pairs of other epochs or
    /// leaf indices (a merge interrupted by a crash, an epoch the group
    /// skipped) and anything a future OpenMLS version adds under the group.
    /// This deletes every group-scoped key of the group (all epochs, all leaf
    /// indices), plus the update key pairs of its own pending leaf nodes,
    /// whether stored or only staged. Call it in the same operation as
    /// `MlsGroup::delete` (before or after); the group's in-memory handle must
    /// not be used afterwards.
    ///
    /// Signature keys are not touched: the device identity keeps its key
    /// outside MLS storage and shares it across groups.
    ///
    /// Returns how many existing keys were staged for deletion.
    ///
    /// # Errors
    /// [`StorageError`] when the store fails.
    pub fn purge_group<G: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &G,
    ) -> Result<usize, StorageError> {
        let gid = group_key(group_id)?;
        let mut doomed = self.delete_leaves_and_their_keys(&gid)?;
        for label in GROUP_SCOPED {
            let mut prefix = label_prefix(label);
            prefix.extend_from_slice(&gid);
            let keys = self.live_keys(&prefix)?;
            doomed += keys.len();
            let mut overlay = self.lock();
            for key in keys {
                overlay.insert(key, None);
            }
        }
        Ok(doomed)
    }

    /// Stage the deletion of the group's own-leaf list and of the update key
    /// pair of every leaf in it; returns how many existing keys that covers.
    ///
    /// OpenMLS stores an update leaf's private key on its own when the update
    /// is proposed. It deletes the key when a commit takes the proposal, but a
    /// commit that settles the epoch without it, or `MlsGroup::delete`,
    /// deletes only the leaf list, and the key would stay forever. The list is
    /// the key's only reader (OpenMLS reads it while staging a commit, before
    /// the merge deletes the list), so the key goes with it.
    fn delete_leaves_and_their_keys(&self, gid: &[u8]) -> Result<usize, StorageError> {
        let list_key = storage_key(OWN_LEAF_NODES, gid);
        let mut overlay = self.lock();
        let raw = self.get_in(&overlay, &list_key)?;
        let mut existing = usize::from(raw.is_some());
        let leaves: Vec<LeafNode> = decode_list(&list_key, raw).unwrap_or_else(|e| {
            // The list is being deleted anyway; an unreadable one must not
            // block a merge or a purge, but its keys cannot be found.
            tracing::warn!(error = %e, "own leaf nodes unreadable; their update keys stay");
            Vec::new()
        });
        for leaf in &leaves {
            let key = storage_key(
                ENCRYPTION_KEY_PAIR,
                &encode("encryption key", leaf.encryption_key())?,
            );
            if self.get_in(&overlay, &key)?.is_some() {
                existing += 1;
                overlay.insert(key, None);
            }
        }
        overlay.insert(list_key, None);
        Ok(existing)
    }

    fn lock(&self) -> MutexGuard<'_, Overlay> {
        // Every critical section computes first and inserts last, so a panic
        // cannot leave a half-made change behind: poisoning is ignored.
        self.overlay.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get_in(&self, overlay: &Overlay, key: &[u8]) -> Result<Option<Vec<u8>>, StorageError> {
        match overlay.get(key) {
            Some(staged) => Ok(staged.clone()),
            None => Ok(self.kv.get(key)?),
        }
    }

    fn get_raw(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StorageError> {
        let overlay = self.lock();
        self.get_in(&overlay, key)
    }

    /// Every key under `prefix` that exists once the overlay is applied.
    fn live_keys(&self, prefix: &[u8]) -> Result<BTreeSet<Vec<u8>>, StorageError> {
        let overlay = self.lock();
        let mut keys: BTreeSet<Vec<u8>> = self
            .kv
            .scan_prefix(prefix, usize::MAX)?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        for (k, v) in overlay.range(prefix.to_vec()..) {
            if !k.starts_with(prefix) {
                break;
            }
            match v {
                Some(_) => keys.insert(k.clone()),
                None => keys.remove(k),
            };
        }
        Ok(keys)
    }

    fn put(&self, label: &[u8], key: &[u8], value: &impl Serialize) -> Result<(), StorageError> {
        let value = encode_value("value", value)?;
        self.lock().insert(storage_key(label, key), Some(value));
        Ok(())
    }

    fn delete(&self, label: &[u8], key: &[u8]) -> Result<(), StorageError> {
        self.lock().insert(storage_key(label, key), None);
        Ok(())
    }

    fn read<V: DeserializeOwned>(
        &self,
        label: &[u8],
        key: &[u8],
    ) -> Result<Option<V>, StorageError> {
        let key = storage_key(label, key);
        match self.get_raw(&key)? {
            Some(bytes) => decode(&key, &bytes).map(Some),
            None => Ok(None),
        }
    }

    fn read_list<V: DeserializeOwned>(
        &self,
        label: &[u8],
        key: &[u8],
    ) -> Result<Vec<V>, StorageError> {
        self.read_list_at(&storage_key(label, key))
    }

    fn read_list_at<V: DeserializeOwned>(&self, key: &[u8]) -> Result<Vec<V>, StorageError> {
        decode_list(key, self.get_raw(key)?)
    }

    /// Append `item` to the list under (`label`, `key`) unless an equal item
    /// (one with the same encoding) is already there.
    fn list_push<T: Serialize + DeserializeOwned>(
        &self,
        label: &[u8],
        key: &[u8],
        item: &T,
    ) -> Result<(), StorageError> {
        let key = storage_key(label, key);
        let encoded = encode_item(item)?;
        let mut overlay = self.lock();
        let mut list: Vec<T> = decode_list(&key, self.get_in(&overlay, &key)?)?;
        if !contains_encoded(&list, &encoded)? {
            // An owned copy of `item`, which the trait hands over borrowed.
            list.push(rmp_serde::from_slice(&encoded).map_err(|e| corrupt(&key, e))?);
        }
        let bytes = encode_value("list", &list)?;
        overlay.insert(key, Some(bytes));
        Ok(())
    }

    /// Remove every item equal to `item` (with the same encoding) from the
    /// list under (`label`, `key`); an emptied list is deleted.
    fn list_remove<T: Serialize + DeserializeOwned>(
        &self,
        label: &[u8],
        key: &[u8],
        item: &T,
    ) -> Result<(), StorageError> {
        let key = storage_key(label, key);
        let encoded = encode_item(item)?;
        let mut overlay = self.lock();
        let list: Vec<T> = decode_list(&key, self.get_in(&overlay, &key)?)?;
        let mut kept = Vec::with_capacity(list.len());
        for other in list {
            if encode_item(&other)? != encoded {
                kept.push(other);
            }
        }
        let value = if kept.is_empty() {
            None
        } else {
            Some(encode_value("list", &kept)?)
        };
        overlay.insert(key, value);
        Ok(())
    }
}

fn to_batch(staged: Overlay) -> WriteBatch {
    let mut batch = WriteBatch::new();
    for (k, v) in staged {
        match v {
            Some(v) => batch.put(k, v),
            None => batch.delete(k),
        }
    }
    batch
}

fn label_prefix(label: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(MLS_KEY_PREFIX.len() + label.len() + 1);
    key.extend_from_slice(MLS_KEY_PREFIX);
    key.extend_from_slice(label);
    key.push(b'/');
    key
}

fn storage_key(label: &[u8], key: &[u8]) -> Vec<u8> {
    let mut out = label_prefix(label);
    out.extend_from_slice(key);
    out.extend_from_slice(&CURRENT_VERSION.to_be_bytes());
    out
}

/// The first byte of every value written in MessagePack; a value starting
/// with anything else is the JSON of earlier versions.
const MSGPACK: u8 = 0x00;

/// serde_json: the encoding of keys, which must never change (a key written
/// once is looked up by its bytes).
fn encode<T: Serialize + ?Sized>(what: &'static str, v: &T) -> Result<Vec<u8>, StorageError> {
    serde_json::to_vec(v).map_err(|e| StorageError::Encode {
        what,
        reason: e.to_string(),
    })
}

/// A value as stored: [`MSGPACK`], then its MessagePack encoding.
fn encode_value<T: Serialize + ?Sized>(what: &'static str, v: &T) -> Result<Vec<u8>, StorageError> {
    #[cfg(test)]
    if WRITE_JSON.get() {
        return encode(what, v);
    }
    let mut out = vec![MSGPACK];
    rmp_serde::encode::write_named(&mut out, v).map_err(|e| StorageError::Encode {
        what,
        reason: e.to_string(),
    })?;
    Ok(out)
}

#[cfg(test)]
thread_local! {
    /// Set by tests of the migration: values are then written in JSON, as
    /// versions before 2026-12-06 wrote them.
    pub(crate) static WRITE_JSON: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A list item's MessagePack encoding, by which equal items are found.
fn encode_item<T: Serialize + ?Sized>(v: &T) -> Result<Vec<u8>, StorageError> {
    rmp_serde::to_vec_named(v).map_err(|e| StorageError::Encode {
        what: "list item",
        reason: e.to_string(),
    })
}

fn contains_encoded<T: Serialize>(list: &[T], encoded: &[u8]) -> Result<bool, StorageError> {
    for item in list {
        if encode_item(item)? == encoded {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The one encoding of a group id in keys.
fn group_key<G: Serialize + ?Sized>(group_id: &G) -> Result<Vec<u8>, StorageError> {
    encode("group id", group_id)
}

fn proposal_key(
    group_id: &impl traits::GroupId<CURRENT_VERSION>,
    proposal_ref: &impl traits::ProposalRef<CURRENT_VERSION>,
) -> Result<Vec<u8>, StorageError> {
    let mut key = group_key(group_id)?;
    key.extend_from_slice(&encode("proposal ref", proposal_ref)?);
    Ok(key)
}

fn epoch_key_pairs_key(
    group_id: &impl traits::GroupId<CURRENT_VERSION>,
    epoch: &impl traits::EpochKey<CURRENT_VERSION>,
    leaf_index: u32,
) -> Result<Vec<u8>, StorageError> {
    let mut key = group_key(group_id)?;
    key.extend_from_slice(&encode("epoch and leaf index", &(epoch, leaf_index))?);
    Ok(key)
}

fn corrupt(key: &[u8], reason: impl std::fmt::Display) -> StorageError {
    StorageError::Corrupt {
        key: hex::encode(key),
        reason: reason.to_string(),
    }
}

/// A stored value, in either encoding (see the [module docs](self)).
fn decode<V: DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<V, StorageError> {
    match bytes.split_first() {
        Some((&MSGPACK, rest)) => rmp_serde::from_slice(rest).map_err(|e| corrupt(key, e)),
        _ => serde_json::from_slice(bytes).map_err(|e| corrupt(key, e)),
    }
}

fn decode_list<V: DeserializeOwned>(
    key: &[u8],
    bytes: Option<Vec<u8>>,
) -> Result<Vec<V>, StorageError> {
    match bytes {
        Some(bytes) => decode(key, &bytes),
        None => Ok(Vec::new()),
    }
}

impl StorageProvider<CURRENT_VERSION> for StagedStorage {
    type Error = StorageError;

    // --- group state: writers ---

    fn write_mls_join_config<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MlsGroupJoinConfig: traits::MlsGroupJoinConfig<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        config: &MlsGroupJoinConfig,
    ) -> Result<(), Self::Error> {
        self.put(JOIN_CONFIG, &group_key(group_id)?, config)
    }

    fn append_own_leaf_node<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNode: traits::LeafNode<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        leaf_node: &LeafNode,
    ) -> Result<(), Self::Error> {
        self.list_push(OWN_LEAF_NODES, &group_key(group_id)?, leaf_node)
    }

    fn queue_proposal<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
        QueuedProposal: traits::QueuedProposal<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        proposal_ref: &ProposalRef,
        proposal: &QueuedProposal,
    ) -> Result<(), Self::Error> {
        self.put(
            QUEUED_PROPOSAL,
            &proposal_key(group_id, proposal_ref)?,
            proposal,
        )?;
        self.list_push(PROPOSAL_QUEUE_REFS, &group_key(group_id)?, proposal_ref)
    }

    fn write_tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        tree: &TreeSync,
    ) -> Result<(), Self::Error> {
        self.put(TREE, &group_key(group_id)?, tree)
    }

    fn write_interim_transcript_hash<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        InterimTranscriptHash: traits::InterimTranscriptHash<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        interim_transcript_hash: &InterimTranscriptHash,
    ) -> Result<(), Self::Error> {
        self.put(
            INTERIM_TRANSCRIPT_HASH,
            &group_key(group_id)?,
            interim_transcript_hash,
        )
    }

    fn write_context<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupContext: traits::GroupContext<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        group_context: &GroupContext,
    ) -> Result<(), Self::Error> {
        self.put(GROUP_CONTEXT, &group_key(group_id)?, group_context)
    }

    fn write_confirmation_tag<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ConfirmationTag: traits::ConfirmationTag<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        confirmation_tag: &ConfirmationTag,
    ) -> Result<(), Self::Error> {
        self.put(CONFIRMATION_TAG, &group_key(group_id)?, confirmation_tag)
    }

    fn write_group_state<
        GroupState: traits::GroupState<CURRENT_VERSION>,
        GroupId: traits::GroupId<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        group_state: &GroupState,
    ) -> Result<(), Self::Error> {
        self.put(GROUP_STATE, &group_key(group_id)?, group_state)
    }

    fn write_message_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MessageSecrets: traits::MessageSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        message_secrets: &MessageSecrets,
    ) -> Result<(), Self::Error> {
        self.put(MESSAGE_SECRETS, &group_key(group_id)?, message_secrets)
    }

    fn write_resumption_psk_store<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ResumptionPskStore: traits::ResumptionPskStore<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        resumption_psk_store: &ResumptionPskStore,
    ) -> Result<(), Self::Error> {
        self.put(
            RESUMPTION_PSK_STORE,
            &group_key(group_id)?,
            resumption_psk_store,
        )
    }

    fn write_own_leaf_index<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNodeIndex: traits::LeafNodeIndex<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        own_leaf_index: &LeafNodeIndex,
    ) -> Result<(), Self::Error> {
        self.put(OWN_LEAF_INDEX, &group_key(group_id)?, own_leaf_index)
    }

    fn write_group_epoch_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupEpochSecrets: traits::GroupEpochSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        group_epoch_secrets: &GroupEpochSecrets,
    ) -> Result<(), Self::Error> {
        self.put(EPOCH_SECRETS, &group_key(group_id)?, group_epoch_secrets)
    }

    // --- crypto objects: writers ---

    fn write_signature_key_pair<
        SignaturePublicKey: traits::SignaturePublicKey<CURRENT_VERSION>,
        SignatureKeyPair: traits::SignatureKeyPair<CURRENT_VERSION>,
    >(
        &self,
        public_key: &SignaturePublicKey,
        signature_key_pair: &SignatureKeyPair,
    ) -> Result<(), Self::Error> {
        self.put(
            SIGNATURE_KEY_PAIR,
            &encode("signature public key", public_key)?,
            signature_key_pair,
        )
    }

    fn write_encryption_key_pair<
        EncryptionKey: traits::EncryptionKey<CURRENT_VERSION>,
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
    >(
        &self,
        public_key: &EncryptionKey,
        key_pair: &HpkeKeyPair,
    ) -> Result<(), Self::Error> {
        self.put(
            ENCRYPTION_KEY_PAIR,
            &encode("encryption key", public_key)?,
            key_pair,
        )
    }

    fn write_encryption_epoch_key_pairs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        EpochKey: traits::EpochKey<CURRENT_VERSION>,
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        epoch: &EpochKey,
        leaf_index: u32,
        key_pairs: &[HpkeKeyPair],
    ) -> Result<(), Self::Error> {
        self.put(
            EPOCH_KEY_PAIRS,
            &epoch_key_pairs_key(group_id, epoch, leaf_index)?,
            &key_pairs,
        )
    }

    fn write_key_package<
        HashReference: traits::HashReference<CURRENT_VERSION>,
        KeyPackage: traits::KeyPackage<CURRENT_VERSION>,
    >(
        &self,
        hash_ref: &HashReference,
        key_package: &KeyPackage,
    ) -> Result<(), Self::Error> {
        self.put(
            KEY_PACKAGE,
            &encode("key package ref", hash_ref)?,
            key_package,
        )
    }

    fn write_psk<
        PskId: traits::PskId<CURRENT_VERSION>,
        PskBundle: traits::PskBundle<CURRENT_VERSION>,
    >(
        &self,
        psk_id: &PskId,
        psk: &PskBundle,
    ) -> Result<(), Self::Error> {
        self.put(PSK, &encode("psk id", psk_id)?, psk)
    }

    // --- group state: readers ---

    fn mls_group_join_config<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MlsGroupJoinConfig: traits::MlsGroupJoinConfig<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<MlsGroupJoinConfig>, Self::Error> {
        self.read(JOIN_CONFIG, &group_key(group_id)?)
    }

    fn own_leaf_nodes<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNode: traits::LeafNode<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Vec<LeafNode>, Self::Error> {
        self.read_list(OWN_LEAF_NODES, &group_key(group_id)?)
    }

    fn queued_proposal_refs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Vec<ProposalRef>, Self::Error> {
        self.read_list(PROPOSAL_QUEUE_REFS, &group_key(group_id)?)
    }

    fn queued_proposals<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
        QueuedProposal: traits::QueuedProposal<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Vec<(ProposalRef, QueuedProposal)>, Self::Error> {
        let refs: Vec<ProposalRef> = self.queued_proposal_refs(group_id)?;
        let mut out = Vec::with_capacity(refs.len());
        for proposal_ref in refs {
            let key = proposal_key(group_id, &proposal_ref)?;
            match self.read(QUEUED_PROPOSAL, &key)? {
                Some(proposal) => out.push((proposal_ref, proposal)),
                None => {
                    return Err(StorageError::MissingProposal {
                        key: hex::encode(storage_key(QUEUED_PROPOSAL, &key)),
                    })
                }
            }
        }
        Ok(out)
    }

    fn tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<TreeSync>, Self::Error> {
        self.read(TREE, &group_key(group_id)?)
    }

    fn group_context<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupContext: traits::GroupContext<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<GroupContext>, Self::Error> {
        self.read(GROUP_CONTEXT, &group_key(group_id)?)
    }

    fn interim_transcript_hash<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        InterimTranscriptHash: traits::InterimTranscriptHash<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<InterimTranscriptHash>, Self::Error> {
        self.read(INTERIM_TRANSCRIPT_HASH, &group_key(group_id)?)
    }

    fn confirmation_tag<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ConfirmationTag: traits::ConfirmationTag<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<ConfirmationTag>, Self::Error> {
        self.read(CONFIRMATION_TAG, &group_key(group_id)?)
    }

    fn group_state<
        GroupState: traits::GroupState<CURRENT_VERSION>,
        GroupId: traits::GroupId<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<GroupState>, Self::Error> {
        self.read(GROUP_STATE, &group_key(group_id)?)
    }

    fn message_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MessageSecrets: traits::MessageSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<MessageSecrets>, Self::Error> {
        self.read(MESSAGE_SECRETS, &group_key(group_id)?)
    }

    fn resumption_psk_store<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ResumptionPskStore: traits::ResumptionPskStore<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<ResumptionPskStore>, Self::Error> {
        self.read(RESUMPTION_PSK_STORE, &group_key(group_id)?)
    }

    fn own_leaf_index<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNodeIndex: traits::LeafNodeIndex<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<LeafNodeIndex>, Self::Error> {
        self.read(OWN_LEAF_INDEX, &group_key(group_id)?)
    }

    fn group_epoch_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupEpochSecrets: traits::GroupEpochSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<GroupEpochSecrets>, Self::Error> {
        self.read(EPOCH_SECRETS, &group_key(group_id)?)
    }

    // --- crypto objects: readers ---

    fn signature_key_pair<
        SignaturePublicKey: traits::SignaturePublicKey<CURRENT_VERSION>,
        SignatureKeyPair: traits::SignatureKeyPair<CURRENT_VERSION>,
    >(
        &self,
        public_key: &SignaturePublicKey,
    ) -> Result<Option<SignatureKeyPair>, Self::Error> {
        self.read(
            SIGNATURE_KEY_PAIR,
            &encode("signature public key", public_key)?,
        )
    }

    fn encryption_key_pair<
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
        EncryptionKey: traits::EncryptionKey<CURRENT_VERSION>,
    >(
        &self,
        public_key: &EncryptionKey,
    ) -> Result<Option<HpkeKeyPair>, Self::Error> {
        self.read(ENCRYPTION_KEY_PAIR, &encode("encryption key", public_key)?)
    }

    fn encryption_epoch_key_pairs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        EpochKey: traits::EpochKey<CURRENT_VERSION>,
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        epoch: &EpochKey,
        leaf_index: u32,
    ) -> Result<Vec<HpkeKeyPair>, Self::Error> {
        self.read_list(
            EPOCH_KEY_PAIRS,
            &epoch_key_pairs_key(group_id, epoch, leaf_index)?,
        )
    }

    fn key_package<
        KeyPackageRef: traits::HashReference<CURRENT_VERSION>,
        KeyPackage: traits::KeyPackage<CURRENT_VERSION>,
    >(
        &self,
        hash_ref: &KeyPackageRef,
    ) -> Result<Option<KeyPackage>, Self::Error> {
        self.read(KEY_PACKAGE, &encode("key package ref", hash_ref)?)
    }

    fn psk<PskBundle: traits::PskBundle<CURRENT_VERSION>, PskId: traits::PskId<CURRENT_VERSION>>(
        &self,
        psk_id: &PskId,
    ) -> Result<Option<PskBundle>, Self::Error> {
        self.read(PSK, &encode("psk id", psk_id)?)
    }

    // --- group state: deleters ---

    fn remove_proposal<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        proposal_ref: &ProposalRef,
    ) -> Result<(), Self::Error> {
        self.list_remove(PROPOSAL_QUEUE_REFS, &group_key(group_id)?, proposal_ref)?;
        self.delete(QUEUED_PROPOSAL, &proposal_key(group_id, proposal_ref)?)
    }

    fn delete_own_leaf_nodes<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete_leaves_and_their_keys(&group_key(group_id)?)
            .map(|_| ())
    }

    fn delete_group_config<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(JOIN_CONFIG, &group_key(group_id)?)
    }

    fn delete_tree<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(TREE, &group_key(group_id)?)
    }

    fn delete_confirmation_tag<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(CONFIRMATION_TAG, &group_key(group_id)?)
    }

    fn delete_group_state<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(GROUP_STATE, &group_key(group_id)?)
    }

    fn delete_context<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(GROUP_CONTEXT, &group_key(group_id)?)
    }

    fn delete_interim_transcript_hash<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(INTERIM_TRANSCRIPT_HASH, &group_key(group_id)?)
    }

    fn delete_message_secrets<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(MESSAGE_SECRETS, &group_key(group_id)?)
    }

    fn delete_all_resumption_psk_secrets<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(RESUMPTION_PSK_STORE, &group_key(group_id)?)
    }

    fn delete_own_leaf_index<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(OWN_LEAF_INDEX, &group_key(group_id)?)
    }

    fn delete_group_epoch_secrets<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(EPOCH_SECRETS, &group_key(group_id)?)
    }

    fn clear_proposal_queue<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        let gid = group_key(group_id)?;
        // Sweep the group's whole proposal prefix rather than only the listed
        // refs, so a body whose ref was lost is deleted too.
        let mut prefix = label_prefix(QUEUED_PROPOSAL);
        prefix.extend_from_slice(&gid);
        let doomed = self.live_keys(&prefix)?;
        let mut overlay = self.lock();
        for key in doomed {
            overlay.insert(key, None);
        }
        overlay.insert(storage_key(PROPOSAL_QUEUE_REFS, &gid), None);
        Ok(())
    }

    // --- crypto objects: deleters ---

    fn delete_signature_key_pair<
        SignaturePublicKey: traits::SignaturePublicKey<CURRENT_VERSION>,
    >(
        &self,
        public_key: &SignaturePublicKey,
    ) -> Result<(), Self::Error> {
        self.delete(
            SIGNATURE_KEY_PAIR,
            &encode("signature public key", public_key)?,
        )
    }

    fn delete_encryption_key_pair<EncryptionKey: traits::EncryptionKey<CURRENT_VERSION>>(
        &self,
        public_key: &EncryptionKey,
    ) -> Result<(), Self::Error> {
        self.delete(ENCRYPTION_KEY_PAIR, &encode("encryption key", public_key)?)
    }

    fn delete_encryption_epoch_key_pairs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        EpochKey: traits::EpochKey<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        epoch: &EpochKey,
        leaf_index: u32,
    ) -> Result<(), Self::Error> {
        self.delete(
            EPOCH_KEY_PAIRS,
            &epoch_key_pairs_key(group_id, epoch, leaf_index)?,
        )
    }

    fn delete_key_package<KeyPackageRef: traits::HashReference<CURRENT_VERSION>>(
        &self,
        hash_ref: &KeyPackageRef,
    ) -> Result<(), Self::Error> {
        self.delete(KEY_PACKAGE, &encode("key package ref", hash_ref)?)
    }

    fn delete_psk<PskKey: traits::PskId<CURRENT_VERSION>>(
        &self,
        psk_id: &PskKey,
    ) -> Result<(), Self::Error> {
        self.delete(PSK, &encode("psk id", psk_id)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{MemKv, SledKv};
    use openmls_traits::storage::{Entity, Key};
    use serde::Deserialize;
    use std::path::Path;

    /// A group id whose encoding can be a byte-prefix of another's raw bytes.
    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    struct Gid(Vec<u8>);
    impl Key<CURRENT_VERSION> for Gid {}
    impl traits::GroupId<CURRENT_VERSION> for Gid {}

    /// Any other key (public keys, references, psk ids).
    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    struct K(String);
    impl Key<CURRENT_VERSION> for K {}
    impl traits::SignaturePublicKey<CURRENT_VERSION> for K {}
    impl traits::HashReference<CURRENT_VERSION> for K {}
    impl traits::PskId<CURRENT_VERSION> for K {}
    impl traits::EncryptionKey<CURRENT_VERSION> for K {}

    /// An epoch serialized as a bare number, like OpenMLS's `GroupEpoch`.
    #[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
    struct Epoch(u64);
    impl Key<CURRENT_VERSION> for Epoch {}
    impl traits::EpochKey<CURRENT_VERSION> for Epoch {}

    /// A proposal reference: both key and value.
    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    struct PRef(u32);
    impl Key<CURRENT_VERSION> for PRef {}
    impl Entity<CURRENT_VERSION> for PRef {}
    impl traits::ProposalRef<CURRENT_VERSION> for PRef {}

    /// Any stored value.
    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    struct V(String);
    impl Entity<CURRENT_VERSION> for V {}
    macro_rules! entity {
        ($($t:ident),*) => { $(impl traits::$t<CURRENT_VERSION> for V {})* };
    }
    entity!(
        QueuedProposal,
        TreeSync,
        GroupContext,
        InterimTranscriptHash,
        ConfirmationTag,
        SignatureKeyPair,
        PskBundle,
        HpkeKeyPair,
        GroupState,
        GroupEpochSecrets,
        LeafNodeIndex,
        MessageSecrets,
        ResumptionPskStore,
        KeyPackage,
        MlsGroupJoinConfig,
        LeafNode
    );

    fn v(tag: &str, g: &Gid) -> V {
        V(format!("{tag}:{:?}", g.0))
    }

    fn open(dir: &Path) -> Arc<dyn KvStore> {
        Arc::new(SledKv::open_waiting(dir, crate::testkit::SLED_LOCK_PATIENCE).unwrap())
    }

    fn commit(kv: &Arc<dyn KvStore>, s: StagedStorage) {
        kv.apply(&s.into_batch()).unwrap();
        kv.flush().unwrap();
    }

    /// Every writer of the trait, with values tagged by group.
    fn write_all(s: &StagedStorage, g: &Gid) {
        s.write_mls_join_config(g, &v("join", g)).unwrap();
        s.append_own_leaf_node(g, &v("leaf1", g)).unwrap();
        s.append_own_leaf_node(g, &v("leaf2", g)).unwrap();
        s.queue_proposal(g, &PRef(1), &v("prop1", g)).unwrap();
        s.queue_proposal(g, &PRef(2), &v("prop2", g)).unwrap();
        s.write_tree(g, &v("tree", g)).unwrap();
        s.write_interim_transcript_hash(g, &v("ith", g)).unwrap();
        s.write_context(g, &v("ctx", g)).unwrap();
        s.write_confirmation_tag(g, &v("tag", g)).unwrap();
        s.write_group_state(g, &v("state", g)).unwrap();
        s.write_message_secrets(g, &v("msgsec", g)).unwrap();
        s.write_resumption_psk_store(g, &v("rpsk", g)).unwrap();
        s.write_own_leaf_index(g, &v("idx", g)).unwrap();
        s.write_group_epoch_secrets(g, &v("epsec", g)).unwrap();
        s.write_encryption_epoch_key_pairs(g, &Epoch(5), 10, &[v("ekp1", g), v("ekp2", g)])
            .unwrap();
        s.write_encryption_epoch_key_pairs(g, &Epoch(51), 0, &[v("ekp3", g)])
            .unwrap();
    }

    /// Every writer of the trait that is not group-scoped.
    fn write_crypto(s: &StagedStorage) {
        s.write_signature_key_pair(&K("sig".into()), &V("sigkp".into()))
            .unwrap();
        s.write_encryption_key_pair(&K("enc".into()), &V("enckp".into()))
            .unwrap();
        s.write_key_package(&K("kp".into()), &V("kpv".into()))
            .unwrap();
        s.write_psk(&K("psk".into()), &V("pskv".into())).unwrap();
    }

    /// Every group-scoped reader, expecting `write_all`'s values or nothing.
    fn check_group(s: &StagedStorage, g: &Gid, present: bool) {
        let some = |tag: &str| present.then(|| v(tag, g));
        let list = |tags: &[&str]| -> Vec<V> {
            if present {
                tags.iter().map(|t| v(t, g)).collect()
            } else {
                Vec::new()
            }
        };
        assert_eq!(s.mls_group_join_config(g).unwrap(), some("join"));
        assert_eq!(
            s.own_leaf_nodes::<_, V>(g).unwrap(),
            list(&["leaf1", "leaf2"])
        );
        let refs: Vec<PRef> = s.queued_proposal_refs(g).unwrap();
        let props: Vec<(PRef, V)> = s.queued_proposals(g).unwrap();
        if present {
            assert_eq!(refs, vec![PRef(1), PRef(2)]);
            assert_eq!(
                props,
                vec![(PRef(1), v("prop1", g)), (PRef(2), v("prop2", g))]
            );
        } else {
            assert!(refs.is_empty() && props.is_empty());
        }
        assert_eq!(s.tree(g).unwrap(), some("tree"));
        assert_eq!(s.interim_transcript_hash(g).unwrap(), some("ith"));
        assert_eq!(s.group_context(g).unwrap(), some("ctx"));
        assert_eq!(s.confirmation_tag(g).unwrap(), some("tag"));
        assert_eq!(s.group_state(g).unwrap(), some("state"));
        assert_eq!(s.message_secrets(g).unwrap(), some("msgsec"));
        assert_eq!(s.resumption_psk_store(g).unwrap(), some("rpsk"));
        assert_eq!(s.own_leaf_index(g).unwrap(), some("idx"));
        assert_eq!(s.group_epoch_secrets(g).unwrap(), some("epsec"));
        let e5: Vec<V> = s.encryption_epoch_key_pairs(g, &Epoch(5), 10).unwrap();
        let e51: Vec<V> = s.encryption_epoch_key_pairs(g, &Epoch(51), 0).unwrap();
        assert_eq!(e5, list(&["ekp1", "ekp2"]));
        assert_eq!(e51, list(&["ekp3"]));
    }

    fn check_crypto(s: &StagedStorage, present: bool) {
        let some = |x: &str| present.then(|| V(x.into()));
        assert_eq!(
            s.signature_key_pair(&K("sig".into())).unwrap(),
            some("sigkp")
        );
        assert_eq!(
            s.encryption_key_pair(&K("enc".into())).unwrap(),
            some("enckp")
        );
        assert_eq!(s.key_package(&K("kp".into())).unwrap(), some("kpv"));
        assert_eq!(s.psk(&K("psk".into())).unwrap(), some("pskv"));
    }

    /// Every deleter of the trait for group `g` and the crypto objects.
    fn delete_all(s: &StagedStorage, g: &Gid) {
        s.delete_group_config(g).unwrap();
        s.delete_own_leaf_nodes(g).unwrap();
        s.remove_proposal(g, &PRef(1)).unwrap();
        s.clear_proposal_queue::<_, PRef>(g).unwrap();
        s.delete_tree(g).unwrap();
        s.delete_interim_transcript_hash(g).unwrap();
        s.delete_context(g).unwrap();
        s.delete_confirmation_tag(g).unwrap();
        s.delete_group_state(g).unwrap();
        s.delete_message_secrets(g).unwrap();
        s.delete_all_resumption_psk_secrets(g).unwrap();
        s.delete_own_leaf_index(g).unwrap();
        s.delete_group_epoch_secrets(g).unwrap();
        s.delete_encryption_epoch_key_pairs(g, &Epoch(5), 10)
            .unwrap();
        s.delete_encryption_epoch_key_pairs(g, &Epoch(51), 0)
            .unwrap();
        s.delete_signature_key_pair(&K("sig".into())).unwrap();
        s.delete_encryption_key_pair(&K("enc".into())).unwrap();
        s.delete_key_package(&K("kp".into())).unwrap();
        s.delete_psk(&K("psk".into())).unwrap();
    }

    fn mls_keys(kv: &Arc<dyn KvStore>) -> Vec<Vec<u8>> {
        kv.scan_prefix(MLS_KEY_PREFIX, usize::MAX)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    }

    #[test]
    fn every_method_round_trips_across_a_sled_reopen_and_deletes_really_delete() {
        let dir = tempfile::tempdir().unwrap();
        // Raw bytes of g1 are a prefix of g2's: their keys must not overlap.
        let (g1, g2) = (Gid(vec![1]), Gid(vec![1, 2]));
        {
            let kv = open(dir.path());
            let s = DeviceStorage::new(kv.clone()).staged();
            write_all(&s, &g1);
            write_all(&s, &g2);
            write_crypto(&s);
            // Reads see the overlay; the store has nothing yet.
            check_group(&s, &g1, true);
            check_crypto(&s, true);
            assert!(mls_keys(&kv).is_empty());
            commit(&kv, s);
        }
        {
            let kv = open(dir.path());
            let s = DeviceStorage::new(kv.clone()).staged();
            check_group(&s, &g1, true);
            check_group(&s, &g2, true);
            check_crypto(&s, true);
            delete_all(&s, &g1);
            check_group(&s, &g1, false);
            check_crypto(&s, false);
            commit(&kv, s);
        }
        let kv = open(dir.path());
        let s = DeviceStorage::new(kv.clone()).staged();
        check_group(&s, &g1, false);
        check_crypto(&s, false);
        check_group(&s, &g2, true);
        // What is left in the store is g2's and nothing else.
        let g2_json = serde_json::to_vec(&g2).unwrap();
        let left = mls_keys(&kv);
        assert_eq!(left.len(), 16);
        for key in left {
            assert!(key.windows(g2_json.len()).any(|w| w == g2_json.as_slice()));
        }
    }

    #[test]
    fn missing_values_are_none_and_missing_lists_are_empty() {
        let s = DeviceStorage::new(Arc::new(MemKv::new())).staged();
        let g = Gid(vec![7]);
        check_group(&s, &g, false);
        check_crypto(&s, false);
        assert!(!s.contains_group(&GroupId::from_slice(b"none")).unwrap());
        assert!(s.group_ids().unwrap().is_empty());
    }

    #[test]
    fn staged_list_changes_are_seen_before_apply() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let g = Gid(vec![3]);
        let s = StagedStorage::new(kv.clone());
        s.queue_proposal(&g, &PRef(1), &V("a".into())).unwrap();
        commit(&kv, s);

        let s = StagedStorage::new(kv.clone());
        s.queue_proposal(&g, &PRef(2), &V("b".into())).unwrap();
        // Queuing the same ref twice must not list it twice.
        s.queue_proposal(&g, &PRef(2), &V("b".into())).unwrap();
        let refs: Vec<PRef> = s.queued_proposal_refs(&g).unwrap();
        assert_eq!(refs, vec![PRef(1), PRef(2)]);
        s.remove_proposal(&g, &PRef(1)).unwrap();
        let props: Vec<(PRef, V)> = s.queued_proposals(&g).unwrap();
        assert_eq!(props, vec![(PRef(2), V("b".into()))]);
        s.remove_proposal(&g, &PRef(2)).unwrap();
        let refs: Vec<PRef> = s.queued_proposal_refs(&g).unwrap();
        assert!(refs.is_empty());
        // The store still holds the committed state only.
        let fresh = StagedStorage::new(kv.clone());
        let refs: Vec<PRef> = fresh.queued_proposal_refs(&g).unwrap();
        assert_eq!(refs, vec![PRef(1)]);
        // An emptied list is a delete, not an empty value.
        commit(&kv, s);
        assert!(mls_keys(&kv).is_empty());
    }

    #[test]
    fn clear_proposal_queue_deletes_every_proposal_and_the_queue() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let (g, other) = (Gid(vec![4]), Gid(vec![5]));
        let s = StagedStorage::new(kv.clone());
        for i in 0..3 {
            s.queue_proposal(&g, &PRef(i), &V(format!("p{i}"))).unwrap();
        }
        s.queue_proposal(&other, &PRef(9), &V("keep".into()))
            .unwrap();
        commit(&kv, s);
        // A body whose ref was lost (written by an older bug) goes too.
        let s = StagedStorage::new(kv.clone());
        s.put(
            QUEUED_PROPOSAL,
            &proposal_key(&g, &PRef(77)).unwrap(),
            &V("orphan".into()),
        )
        .unwrap();
        commit(&kv, s);

        let s = StagedStorage::new(kv.clone());
        s.clear_proposal_queue::<_, PRef>(&g).unwrap();
        assert!(s.queued_proposals::<_, PRef, V>(&g).unwrap().is_empty());
        commit(&kv, s);

        let mut gone = label_prefix(QUEUED_PROPOSAL);
        gone.extend_from_slice(&group_key(&g).unwrap());
        assert!(kv.scan_prefix(&gone, usize::MAX).unwrap().is_empty());
        let refs = storage_key(PROPOSAL_QUEUE_REFS, &group_key(&g).unwrap());
        assert_eq!(kv.get(&refs).unwrap(), None);
        let s = StagedStorage::new(kv.clone());
        let kept: Vec<(PRef, V)> = s.queued_proposals(&other).unwrap();
        assert_eq!(kept, vec![(PRef(9), V("keep".into()))]);
        assert_eq!(mls_keys(&kv).len(), 2);
    }

    #[test]
    fn dropping_the_overlay_discards_the_operation() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let g = Gid(vec![6]);
        let s = StagedStorage::new(kv.clone());
        write_all(&s, &g);
        assert!(s.staged_len() > 0);
        drop(s);
        assert!(mls_keys(&kv).is_empty());
        check_group(&StagedStorage::new(kv), &g, false);
    }

    #[test]
    fn take_batch_empties_the_overlay() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let g = Gid(vec![8]);
        let s = StagedStorage::new(kv.clone());
        write_all(&s, &g);
        let batch = s.take_batch();
        assert!(s.is_empty());
        // Until the batch is applied the writes are invisible.
        check_group(&s, &g, false);
        kv.apply(&batch).unwrap();
        check_group(&s, &g, true);
    }

    #[test]
    fn epoch_and_leaf_index_never_collide() {
        let s = StagedStorage::new(Arc::new(MemKv::new()));
        let g = Gid(vec![1]);
        s.write_encryption_epoch_key_pairs(&g, &Epoch(5), 10, &[V("a".into())])
            .unwrap();
        let other: Vec<V> = s.encryption_epoch_key_pairs(&g, &Epoch(51), 0).unwrap();
        assert!(other.is_empty());
    }

    #[test]
    fn purge_group_sweeps_every_epoch_and_leaf_of_that_group_only() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let (g, other) = (Gid(vec![1]), Gid(vec![1, 2]));
        let s = StagedStorage::new(kv.clone());
        write_all(&s, &g);
        write_all(&s, &other);
        // Leftovers `MlsGroup::delete` would not name: other epochs and leaves.
        for e in 0..4 {
            s.write_encryption_epoch_key_pairs(&g, &Epoch(e), e as u32, &[V("old".into())])
                .unwrap();
        }
        write_crypto(&s);
        commit(&kv, s);

        let s = StagedStorage::new(kv.clone());
        // 16 keys from write_all plus 4 epochs; the fake leaves hold no keys.
        assert_eq!(s.purge_group(&g).unwrap(), 20);
        commit(&kv, s);
        let s = StagedStorage::new(kv.clone());
        check_group(&s, &g, false);
        check_group(&s, &other, true);
        check_crypto(&s, true);
        let gone: Vec<V> = s.encryption_epoch_key_pairs(&g, &Epoch(2), 2).unwrap();
        assert!(gone.is_empty());
        assert_eq!(mls_keys(&kv).len(), 16 + 4);
    }

    /// A store whose `apply` always fails.
    struct Broken(MemKv);
    impl KvStore for Broken {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
            self.0.get(key)
        }
        fn range(
            &self,
            start: &[u8],
            end: Option<&[u8]>,
            limit: usize,
        ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, KvError> {
            self.0.range(start, end, limit)
        }
        fn apply(&self, _: &WriteBatch) -> Result<(), KvError> {
            Err(KvError::Engine("disk full".into()))
        }
        fn flush(&self) -> Result<(), KvError> {
            Ok(())
        }
    }

    #[test]
    fn apply_with_keeps_the_overlay_when_the_store_refuses() {
        let s = StagedStorage::new(Arc::new(Broken(MemKv::new())));
        let g = Gid(vec![2]);
        write_all(&s, &g);
        let before = s.staged_len();
        let err = s.apply_with(WriteBatch::new()).unwrap_err();
        assert_eq!(err, StorageError::Kv(KvError::Engine("disk full".into())));
        assert_eq!(s.staged_len(), before);
        check_group(&s, &g, true);
    }

    #[test]
    fn apply_with_applies_overlay_and_engine_changes_together() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let g = Gid(vec![2]);
        let s = StagedStorage::new(kv.clone());
        write_all(&s, &g);
        let mut extra = WriteBatch::new();
        extra.put(b"engine/cursor".to_vec(), b"42".to_vec());
        s.apply_with(extra).unwrap();
        assert!(s.is_empty());
        assert_eq!(kv.get(b"engine/cursor").unwrap(), Some(b"42".to_vec()));
        check_group(&StagedStorage::new(kv), &g, true);
    }

    #[test]
    fn values_and_lists_written_in_json_are_read_and_rewritten_in_messagepack() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let g = Gid(vec![6]);
        let s = StagedStorage::new(kv.clone());
        WRITE_JSON.set(true);
        write_all(&s, &g);
        write_crypto(&s);
        WRITE_JSON.set(false);
        commit(&kv, s);
        let leaves = storage_key(OWN_LEAF_NODES, &group_key(&g).unwrap());
        let json = kv.get(&leaves).unwrap().unwrap();
        assert_eq!(json.first(), Some(&b'['), "the old version wrote JSON");

        let s = StagedStorage::new(kv.clone());
        check_group(&s, &g, true);
        check_crypto(&s, true);
        // A list of the old version takes a new item (and knows its equal
        // by its bytes, whichever encoding it was stored in) ...
        s.append_own_leaf_node(&g, &v("leaf2", &g)).unwrap();
        s.append_own_leaf_node(&g, &v("leaf3", &g)).unwrap();
        s.write_tree(&g, &v("tree2", &g)).unwrap();
        commit(&kv, s);
        // ... and is written back in MessagePack, like every new value.
        for key in [leaves.clone(), storage_key(TREE, &group_key(&g).unwrap())] {
            assert_eq!(kv.get(&key).unwrap().unwrap().first(), Some(&MSGPACK));
        }
        let s = StagedStorage::new(kv.clone());
        let got: Vec<V> = s.own_leaf_nodes(&g).unwrap();
        assert_eq!(got, vec![v("leaf1", &g), v("leaf2", &g), v("leaf3", &g)]);
        assert_eq!(s.tree::<_, V>(&g).unwrap(), Some(v("tree2", &g)));
        // What was not written again is still the old JSON, still readable.
        let ctx = storage_key(GROUP_CONTEXT, &group_key(&g).unwrap());
        assert_eq!(kv.get(&ctx).unwrap().unwrap().first(), Some(&b'"'));
        assert_eq!(s.group_context::<_, V>(&g).unwrap(), Some(v("ctx", &g)));
        s.remove_proposal(&g, &PRef(1)).unwrap();
        let refs: Vec<PRef> = s.queued_proposal_refs(&g).unwrap();
        assert_eq!(refs, vec![PRef(2)]);
    }

    #[test]
    fn corrupt_values_are_errors_not_panics() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let g = Gid(vec![9]);
        let mut b = WriteBatch::new();
        b.put(
            storage_key(TREE, &group_key(&g).unwrap()),
            b"{not json".to_vec(),
        );
        b.put(
            storage_key(OWN_LEAF_NODES, &group_key(&g).unwrap()),
            b"7".to_vec(),
        );
        // 0xc1 is no MessagePack type.
        b.put(
            storage_key(GROUP_CONTEXT, &group_key(&g).unwrap()),
            vec![MSGPACK, 0xc1],
        );
        kv.apply(&b).unwrap();
        let s = StagedStorage::new(kv);
        assert!(matches!(
            s.tree::<_, V>(&g),
            Err(StorageError::Corrupt { .. })
        ));
        assert!(matches!(
            s.group_context::<_, V>(&g),
            Err(StorageError::Corrupt { .. })
        ));
        assert!(matches!(
            s.own_leaf_nodes::<_, V>(&g),
            Err(StorageError::Corrupt { .. })
        ));
        // Deleting an unreadable list still works.
        s.delete_own_leaf_nodes(&g).unwrap();
        assert!(s.own_leaf_nodes::<_, V>(&g).unwrap().is_empty());
    }
}
