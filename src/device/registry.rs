//! The single access point to a device's MLS group handles.
//!
//! Two live copies of one group corrupt it, so every use goes through
//! [`Registry::lock`], which hands out the group's one cached `MlsGroup`
//! under that group's async lock. Writes made through the guard are staged
//! in one overlay and land with the engine's own changes as one atomic batch
//! ([`GroupGuard::finish`]); a failed operation is discarded whole and the
//! handle reloaded from the store ([`GroupGuard::discard`]).

use super::provider::DeviceProvider;
use super::records::GroupId;
use super::storage::{StagedStorage, StorageError};
use crate::kv::{KvError, WriteBatch};
use openmls::prelude::MlsGroup;
use openmls_traits::OpenMlsProvider;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// What went wrong reaching a group's MLS state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// No MLS state is stored for the group.
    #[error("group {0} has no MLS state on this device")]
    UnknownGroup(GroupId),
    /// The store failed.
    #[error("device store failed: {0}")]
    Store(String),
    /// A merge left the epoch authenticator unchanged: applying it would
    /// mean two states claim one epoch, so it is refused.
    #[error("merge in group {0} left the epoch authenticator unchanged; refused")]
    MergeDidNotAdvance(GroupId),
}

impl From<StorageError> for RegistryError {
    fn from(e: StorageError) -> Self {
        RegistryError::Store(e.to_string())
    }
}

impl From<KvError> for RegistryError {
    fn from(e: KvError) -> Self {
        RegistryError::Store(e.to_string())
    }
}

/// An OpenMLS provider for one operation that owns its overlay, so it can be
/// held across awaits inside a [`GroupGuard`].
pub struct OpProvider {
    base: Arc<DeviceProvider>,
    storage: StagedStorage,
}

impl OpProvider {
    /// A provider with a fresh overlay over `base`'s store.
    pub fn new(base: Arc<DeviceProvider>) -> Self {
        let storage = base.device_storage().staged();
        Self { base, storage }
    }

    /// The staged writes so far, as one batch (the overlay is emptied).
    pub fn take_batch(&self) -> WriteBatch {
        self.storage.take_batch()
    }
}

impl OpenMlsProvider for OpProvider {
    type CryptoProvider = super::crypto::DeviceCrypto;
    type RandProvider = super::provider::DeviceRand;
    type StorageProvider = StagedStorage;

    fn storage(&self) -> &Self::StorageProvider {
        &self.storage
    }

    fn crypto(&self) -> &Self::CryptoProvider {
        self.base.crypto()
    }

    fn rand(&self) -> &Self::RandProvider {
        self.base.rand()
    }
}

#[derive(Default)]
struct Slot {
    group: Option<MlsGroup>,
}

/// The device's MLS groups, one lock each.
pub struct Registry {
    provider: Arc<DeviceProvider>,
    slots: Mutex<BTreeMap<GroupId, Arc<AsyncMutex<Slot>>>>,
}

impl Registry {
    /// A registry over the device's provider.
    pub fn new(provider: Arc<DeviceProvider>) -> Self {
        Self {
            provider,
            slots: Mutex::new(BTreeMap::new()),
        }
    }

    /// The provider (crypto, randomness, store).
    pub fn provider(&self) -> &Arc<DeviceProvider> {
        &self.provider
    }

    /// Take `group`'s lock. The handle is loaded on first use. Slots are
    /// never removed, even after the group is left: a waiter may still hold
    /// the old slot, and a second slot for the same group would be a second
    /// live copy of it.
    ///
    /// # Cancel safety
    /// Cancel safe: waiting for the lock can be abandoned.
    pub async fn lock(&self, group: GroupId) -> GroupGuard {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.entry(group).or_default().clone()
        };
        GroupGuard {
            id: group,
            slot: slot.lock_owned().await,
            provider: self.provider.clone(),
            op: None,
            deferring: false,
            unflushed: false,
        }
    }
}

/// Exclusive access to one group's handle for one operation.
pub struct GroupGuard {
    id: GroupId,
    slot: OwnedMutexGuard<Slot>,
    provider: Arc<DeviceProvider>,
    op: Option<OpProvider>,
    /// [`GroupGuard::finish`] applies without flushing until
    /// [`GroupGuard::flush`].
    deferring: bool,
    /// A batch was applied and no flush has covered it yet.
    unflushed: bool,
}

impl GroupGuard {
    /// The group this guard holds.
    pub fn id(&self) -> GroupId {
        self.id
    }

    /// Whether MLS state exists for the group (loaded or stored).
    ///
    /// # Errors
    /// The store's error.
    pub fn exists(&mut self) -> Result<bool, RegistryError> {
        match self.load() {
            Ok(_) => Ok(true),
            Err(RegistryError::UnknownGroup(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn load(&mut self) -> Result<(), RegistryError> {
        if self.slot.group.is_none() {
            let op = self
                .op
                .get_or_insert_with(|| OpProvider::new(self.provider.clone()));
            let g = MlsGroup::load(op.storage(), &self.id.to_mls())
                .map_err(|e| RegistryError::Store(e.to_string()))?
                .ok_or(RegistryError::UnknownGroup(self.id))?;
            self.slot.group = Some(g);
        }
        Ok(())
    }

    /// Read the group without changing it.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's error.
    pub fn read<T>(&mut self, f: impl FnOnce(&MlsGroup) -> T) -> Result<T, RegistryError> {
        self.load()?;
        match self.slot.group.as_ref() {
            Some(g) => Ok(f(g)),
            None => Err(RegistryError::UnknownGroup(self.id)),
        }
    }

    /// Run `f` on the group with this operation's provider. Writes are
    /// staged until [`finish`](Self::finish).
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's error; `f`'s own result is returned
    /// inside `Ok`.
    pub fn with<T>(
        &mut self,
        f: impl FnOnce(&mut MlsGroup, &OpProvider) -> T,
    ) -> Result<T, RegistryError> {
        self.load()?;
        let op = self
            .op
            .get_or_insert_with(|| OpProvider::new(self.provider.clone()));
        match self.slot.group.as_mut() {
            Some(g) => Ok(f(g, op)),
            None => Err(RegistryError::UnknownGroup(self.id)),
        }
    }

    /// Install a group created or joined in this operation (its writes are
    /// in this guard's overlay when built with [`GroupGuard::provider`]).
    pub fn install(&mut self, group: MlsGroup) {
        self.slot.group = Some(group);
    }

    /// This operation's provider (creating the overlay if needed).
    pub fn provider(&mut self) -> &OpProvider {
        self.op
            .get_or_insert_with(|| OpProvider::new(self.provider.clone()))
    }

    /// Merge the pending commit and check that the epoch moved on.
    ///
    /// # Errors
    /// `MergeDidNotAdvance`, or the merge's error as `Store`.
    pub fn merge_pending(&mut self) -> Result<(), RegistryError> {
        let id = self.id;
        let before = self.read(|g| g.epoch_authenticator().as_slice().to_vec())?;
        let after = self.with(|g, p| {
            g.merge_pending_commit(p)
                .map(|()| g.epoch_authenticator().as_slice().to_vec())
                .map_err(|e| RegistryError::Store(e.to_string()))
        })??;
        if after == before {
            return Err(RegistryError::MergeDidNotAdvance(id));
        }
        Ok(())
    }

    /// Apply every staged MLS write plus `extra` as one atomic batch and
    /// flush it (after [`GroupGuard::defer_flush`], only apply it: the
    /// flush comes with [`GroupGuard::flush`] or
    /// [`GroupGuard::end_deferral`]). On failure everything staged is
    /// discarded and the handle is reloaded from the store next time.
    ///
    /// # Errors
    /// The store's error.
    pub fn finish(&mut self, extra: WriteBatch) -> Result<(), RegistryError> {
        let mut batch = match self.op.take() {
            Some(op) => op.take_batch(),
            None => WriteBatch::new(),
        };
        batch.extend(extra);
        if batch.is_empty() {
            return Ok(());
        }
        let kv = self.provider.kv();
        if let Err(e) = kv.apply(&batch) {
            self.slot.group = None;
            return Err(e.into());
        }
        self.unflushed = true;
        if self.deferring {
            return Ok(());
        }
        self.flush()
    }

    /// From now on, [`GroupGuard::finish`] applies without flushing, until
    /// [`GroupGuard::end_deferral`] or the guard's drop. For a run of operations
    /// that nothing outside the device hears of until it ends (a page of
    /// commits read from the log): a crash before the flush loses them
    /// whole, as a crash before they began would, and they are read again.
    /// Reads of the store see them at once. Whoever makes anything leave
    /// the device flushes first: a flush covers every batch applied before
    /// it (the [`KvStore`](crate::kv::KvStore) promise), so anything sent
    /// later from this state, by any task, comes after it is durable.
    pub fn defer_flush(&mut self) {
        self.deferring = true;
    }

    /// Stop deferring, and make every batch this guard applied durable.
    ///
    /// # Errors
    /// The store's error; the handle is reloaded from the store next time.
    pub fn end_deferral(&mut self) -> Result<(), RegistryError> {
        self.deferring = false;
        self.flush()
    }

    /// Make every batch this guard applied durable now (deferring or not):
    /// before anything of them leaves the device.
    ///
    /// # Errors
    /// The store's error; the handle is reloaded from the store next time.
    pub fn flush(&mut self) -> Result<(), RegistryError> {
        if !self.unflushed {
            return Ok(());
        }
        if let Err(e) = self.provider.kv().flush() {
            self.slot.group = None;
            return Err(e.into());
        }
        self.unflushed = false;
        Ok(())
    }

    /// Drop everything staged in this operation and reload the handle from
    /// the store on next use.
    pub fn discard(&mut self) {
        self.op = None;
        self.slot.group = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        // A deferred run left early (an error, a cancelled future): what it
        // applied is consistent and is made durable now, before the lock
        // lets anyone else act on it. A failure here is the store's, and
        // the next flush (every operation's) meets it again and returns it.
        if self.unflushed {
            if let Err(e) = self.flush() {
                tracing::warn!(group = %self.id, error = %e, "flush at the end of a deferred run failed");
            }
        }
        // An operation abandoned half-way (an error, a cancelled future) must
        // not leave its in-memory changes behind for the next one.
        if self.op.as_ref().is_some_and(|op| !op.storage.is_empty()) {
            self.slot.group = None;
        }
    }
}
