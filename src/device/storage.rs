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
//! bytes, big endian); every value is serde_json, as OpenMLS 0.9 requires.
//! A group id is always encoded by the same function and always comes first
//! in group-scoped keys, so one prefix scan finds all of a group's state
//! ([`StagedStorage::purge_group`]). JSON objects and arrays are
//! self-delimiting, so no group's encoding is a prefix of another's, and the
//! (epoch, leaf index) pair of an epoch key pair is encoded as one JSON array
//! so that `epoch 5, leaf 10` and `epoch 51, leaf 0` cannot collide.
//!
//! Lists (own leaf nodes, the proposal queue) are one JSON array per key,
//! read-modify-written through the overlay so that a staged append is seen by
//! the next read of the same operation. An emptied list is deleted.

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
        /// What serde_json said.
        reason: String,
    },
    /// A stored value could not be decoded: the store is corrupt or was
    /// written by an incompatible version.
    #[error("stored value under {key} is unreadable: {reason}")]
    Corrupt {
        /// Hex of the full storage key.
        key: String,
        /// What serde_json said.
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
    /// `MlsGroup::delete` removes the current epoch's state but leaves, for
    /// example, the key pairs of earlier epochs and the private keys of
    /// pending update leaf nodes: secrets that forward secrecy wants gone.
    /// This deletes every group-scoped key of the group (all epochs, all leaf
    /// indices) and the encryption key pairs of the group's own leaf nodes,
    /// whether they are stored or only staged. Call it after (or instead of
    /// the storage part of) `MlsGroup::delete`, in the same operation; the
    /// group's in-memory handle must not be used afterwards.
    ///
    /// Signature keys are not touched: the device identity keeps its key
    /// outside MLS storage and shares it across groups.
    ///
    /// Returns how many existing keys were staged for deletion.
    ///
    /// # Errors
    /// [`StorageError`] when the store fails or a leaf node is unreadable.
    pub fn purge_group<G: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &G,
    ) -> Result<usize, StorageError> {
        let gid = group_key(group_id)?;
        let leaves_key = storage_key(OWN_LEAF_NODES, &gid);
        // `MlsGroup::delete` may already have staged the deletion of the leaf
        // list, so look at the stored copy too.
        let mut leaves: Vec<LeafNode> = self.read_list_at(&leaves_key)?;
        leaves.extend(decode_list::<LeafNode>(&leaves_key, self.kv.get(&leaves_key)?)?);
        let mut doomed = BTreeSet::new();
        for leaf in &leaves {
            let key = storage_key(
                ENCRYPTION_KEY_PAIR,
                &encode("encryption key", leaf.encryption_key())?,
            );
            if self.get_raw(&key)?.is_some() {
                doomed.insert(key);
            }
        }
        for label in GROUP_SCOPED {
            let mut prefix = label_prefix(label);
            prefix.extend_from_slice(&gid);
            doomed.extend(self.live_keys(&prefix)?);
        }
        let mut overlay = self.lock();
        for key in &doomed {
            overlay.insert(key.clone(), None);
        }
        Ok(doomed.len())
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
        let value = encode("value", value)?;
        self.lock().insert(storage_key(label, key), Some(value));
        Ok(())
    }

    fn delete(&self, label: &[u8], key: &[u8]) -> Result<(), StorageError> {
        self.lock().insert(storage_key(label, key), None);
        Ok(())
    }

    fn read<V: DeserializeOwned>(&self, label: &[u8], key: &[u8]) -> Result<Option<V>, StorageError> {
        let key = storage_key(label, key);
        match self.get_raw(&key)? {
            Some(bytes) => decode(&key, &bytes).map(Some),
            None => Ok(None),
        }
    }

    fn read_list<V: DeserializeOwned>(&self, label: &[u8], key: &[u8]) -> Result<Vec<V>, StorageError> {
        self.read_list_at(&storage_key(label, key))
    }

    fn read_list_at<V: DeserializeOwned>(&self, key: &[u8]) -> Result<Vec<V>, StorageError> {
        decode_list(key, self.get_raw(key)?)
    }

    /// Append `item` to the list under (`label`, `key`) unless an equal item
    /// is already there.
    fn list_push(&self, label: &[u8], key: &[u8], item: &impl Serialize) -> Result<(), StorageError> {
        let key = storage_key(label, key);
        let item = to_json_value(item)?;
        let mut overlay = self.lock();
        let mut list: Vec<serde_json::Value> = decode_list(&key, self.get_in(&overlay, &key)?)?;
        if !list.contains(&item) {
            list.push(item);
        }
        let bytes = encode("list", &list)?;
        overlay.insert(key, Some(bytes));
        Ok(())
    }

    /// Remove every item equal to `item` from the list under (`label`,
    /// `key`); an emptied list is deleted.
    fn list_remove(&self, label: &[u8], key: &[u8], item: &impl Serialize) -> Result<(), StorageError> {
        let key = storage_key(label, key);
        let item = to_json_value(item)?;
        let mut overlay = self.lock();
        let mut list: Vec<serde_json::Value> = decode_list(&key, self.get_in(&overlay, &key)?)?;
        list.retain(|v| v != &item);
        let value = if list.is_empty() {
            None
        } else {
            Some(encode("list", &list)?)
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

fn encode<T: Serialize + ?Sized>(what: &'static str, v: &T) -> Result<Vec<u8>, StorageError> {
    serde_json::to_vec(v).map_err(|e| StorageError::Encode {
        what,
        reason: e.to_string(),
    })
}

fn to_json_value<T: Serialize + ?Sized>(v: &T) -> Result<serde_json::Value, StorageError> {
    serde_json::to_value(v).map_err(|e| StorageError::Encode {
        what: "list item",
        reason: e.to_string(),
    })
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

fn decode<V: DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<V, StorageError> {
    serde_json::from_slice(bytes).map_err(|e| StorageError::Corrupt {
        key: hex::encode(key),
        reason: e.to_string(),
    })
}

fn decode_list<V: DeserializeOwned>(key: &[u8], bytes: Option<Vec<u8>>) -> Result<Vec<V>, StorageError> {
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
        self.put(QUEUED_PROPOSAL, &proposal_key(group_id, proposal_ref)?, proposal)?;
        self.list_push(PROPOSAL_QUEUE_REFS, &group_key(group_id)?, proposal_ref)
    }

    fn write_tree<GroupId: traits::GroupId<CURRENT_VERSION>, TreeSync: traits::TreeSync<CURRENT_VERSION>>(
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
        self.put(INTERIM_TRANSCRIPT_HASH, &group_key(group_id)?, interim_transcript_hash)
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
        self.put(RESUMPTION_PSK_STORE, &group_key(group_id)?, resumption_psk_store)
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
        self.put(ENCRYPTION_KEY_PAIR, &encode("encryption key", public_key)?, key_pair)
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
        self.put(KEY_PACKAGE, &encode("key package ref", hash_ref)?, key_package)
    }

    fn write_psk<PskId: traits::PskId<CURRENT_VERSION>, PskBundle: traits::PskBundle<CURRENT_VERSION>>(
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

    fn own_leaf_nodes<GroupId: traits::GroupId<CURRENT_VERSION>, LeafNode: traits::LeafNode<CURRENT_VERSION>>(
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

    fn tree<GroupId: traits::GroupId<CURRENT_VERSION>, TreeSync: traits::TreeSync<CURRENT_VERSION>>(
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

    fn group_state<GroupState: traits::GroupState<CURRENT_VERSION>, GroupId: traits::GroupId<CURRENT_VERSION>>(
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
        self.read(SIGNATURE_KEY_PAIR, &encode("signature public key", public_key)?)
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
        self.read_list(EPOCH_KEY_PAIRS, &epoch_key_pairs_key(group_id, epoch, leaf_index)?)
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
        self.delete(OWN_LEAF_NODES, &group_key(group_id)?)
    }

    fn delete_group_config<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.delete(JOIN_CONFIG, &group_key(group_id)?)
    }

    fn delete_tree<GroupId: traits::GroupId<CURRENT_VERSION>>(&self, group_id: &GroupId) -> Result<(), Self::Error> {
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

    fn delete_context<GroupId: traits::GroupId<CURRENT_VERSION>>(&self, group_id: &GroupId) -> Result<(), Self::Error> {
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

    fn delete_signature_key_pair<SignaturePublicKey: traits::SignaturePublicKey<CURRENT_VERSION>>(
        &self,
        public_key: &SignaturePublicKey,
    ) -> Result<(), Self::Error> {
        self.delete(SIGNATURE_KEY_PAIR, &encode("signature public key", public_key)?)
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
        self.delete(EPOCH_KEY_PAIRS, &epoch_key_pairs_key(group_id, epoch, leaf_index)?)
    }

    fn delete_key_package<KeyPackageRef: traits::HashReference<CURRENT_VERSION>>(
        &self,
        hash_ref: &KeyPackageRef,
    ) -> Result<(), Self::Error> {
        self.delete(KEY_PACKAGE, &encode("key package ref", hash_ref)?)
    }

    fn delete_psk<PskKey: traits::PskId<CURRENT_VERSION>>(&self, psk_id: &PskKey) -> Result<(), Self::Error> {
        self.delete(PSK, &encode("psk id", psk_id)?)
    }
}
