//! The device's OpenMLS provider: RustCrypto for crypto, an injectable random
//! source, and the staged storage of [`super::storage`].
//!
//! `OpenMlsRustCrypto` hard-wires OpenMLS's memory storage, so the device has
//! its own provider struct. Engine code runs each MLS operation through
//! [`DeviceProvider::staged`]: a [`StagedProvider`] whose storage is a fresh
//! overlay, turned into one [`WriteBatch`] when the operation succeeds and
//! simply dropped when it fails.
//!
//! # Randomness
//!
//! Production draws MLS randomness from RustCrypto's generator (ChaCha20
//! seeded from the operating system). A simulation passes a seed instead, so
//! every secret OpenMLS draws through `rand()` (group ids, leaf and path
//! secrets, init keys, nonces, reuse guards) replays with the seed. The HPKE
//! library draws the ephemeral keys of its own encryptions (Welcome secrets,
//! update-path secrets) from the OS, so ciphertexts are not bit-for-bit
//! reproducible; the decrypted state still is.

use std::sync::{Arc, Mutex};

use openmls_rust_crypto::{RandError, RustCrypto};
use openmls_traits::random::OpenMlsRand;
use openmls_traits::OpenMlsProvider;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::storage::{DeviceStorage, StagedStorage, StorageError};
use crate::kv::{KvStore, WriteBatch};

/// A seeded ChaCha20 generator for OpenMLS: for simulations and tests only.
///
/// The same seed gives the same stream of random bytes.
pub struct SeededRand {
    rng: Mutex<ChaCha20Rng>,
}

impl SeededRand {
    /// A generator seeded from `seed`.
    pub fn from_seed(seed: u64) -> Self {
        Self::from_rng(ChaCha20Rng::seed_from_u64(seed))
    }

    /// A generator continuing `rng`'s stream (for example one forked from a
    /// simulation's run generator).
    pub fn from_rng(rng: ChaCha20Rng) -> Self {
        Self {
            rng: Mutex::new(rng),
        }
    }

    fn fill(&self, out: &mut [u8]) {
        // ChaCha20 keeps no invariant a panic could break: poisoning is ignored.
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        rng.fill_bytes(out);
    }
}

impl OpenMlsRand for SeededRand {
    type Error = RandError;

    fn random_array<const N: usize>(&self) -> Result<[u8; N], Self::Error> {
        let mut out = [0u8; N];
        self.fill(&mut out);
        Ok(out)
    }

    fn random_vec(&self, len: usize) -> Result<Vec<u8>, Self::Error> {
        let mut out = vec![0u8; len];
        self.fill(&mut out);
        Ok(out)
    }
}

/// Where a [`DeviceProvider`] draws MLS randomness from.
pub enum DeviceRand {
    /// RustCrypto's generator, seeded from the operating system: production.
    System(RustCrypto),
    /// A seeded generator: simulations and tests, never production.
    Seeded(SeededRand),
}

impl OpenMlsRand for DeviceRand {
    type Error = RandError;

    fn random_array<const N: usize>(&self) -> Result<[u8; N], Self::Error> {
        match self {
            DeviceRand::System(r) => r.random_array(),
            DeviceRand::Seeded(r) => r.random_array(),
        }
    }

    fn random_vec(&self, len: usize) -> Result<Vec<u8>, Self::Error> {
        match self {
            DeviceRand::System(r) => r.random_vec(len),
            DeviceRand::Seeded(r) => r.random_vec(len),
        }
    }
}

/// The device's OpenMLS provider.
///
/// Used directly as an `OpenMlsProvider`, it stages writes in its own
/// long-lived overlay, which [`take_batch`](Self::take_batch) hands over;
/// that suits read-only calls such as `MlsGroup::load` and single-threaded
/// tools. Engine code uses [`staged`](Self::staged) instead, one overlay per
/// operation, so operations on different groups never share a batch.
pub struct DeviceProvider {
    crypto: RustCrypto,
    rand: DeviceRand,
    storage: DeviceStorage,
    own: StagedStorage,
}

impl DeviceProvider {
    /// A production provider over `kv`, drawing randomness from the OS.
    pub fn new(kv: Arc<dyn KvStore>) -> Self {
        Self::with_rand(kv, DeviceRand::System(RustCrypto::default()))
    }

    /// A provider over `kv` whose MLS randomness replays from `seed`: for
    /// simulations and tests only.
    pub fn seeded(kv: Arc<dyn KvStore>, seed: u64) -> Self {
        Self::with_rand(kv, DeviceRand::Seeded(SeededRand::from_seed(seed)))
    }

    /// A provider over `kv` with the given random source.
    pub fn with_rand(kv: Arc<dyn KvStore>, rand: DeviceRand) -> Self {
        let storage = DeviceStorage::new(kv);
        let own = storage.staged();
        Self {
            crypto: RustCrypto::default(),
            rand,
            storage,
            own,
        }
    }

    /// The device's MLS storage handle.
    pub fn device_storage(&self) -> &DeviceStorage {
        &self.storage
    }

    /// The store underneath, for applying and flushing batches.
    pub fn kv(&self) -> &Arc<dyn KvStore> {
        self.storage.kv()
    }

    /// A provider for one operation, sharing this provider's crypto and
    /// randomness, with a fresh, empty storage overlay.
    ///
    /// Nothing it writes reaches the store until its batch is applied
    /// ([`StagedProvider::into_batch`]); it does not see writes staged in this
    /// provider's own overlay.
    pub fn staged(&self) -> StagedProvider<'_> {
        StagedProvider {
            crypto: &self.crypto,
            rand: &self.rand,
            storage: self.storage.staged(),
        }
    }

    /// Move every write staged through this provider's own storage into a
    /// batch (see [`StagedStorage::take_batch`]).
    pub fn take_batch(&self) -> WriteBatch {
        self.own.take_batch()
    }
}

impl OpenMlsProvider for DeviceProvider {
    type CryptoProvider = RustCrypto;
    type RandProvider = DeviceRand;
    type StorageProvider = StagedStorage;

    fn storage(&self) -> &Self::StorageProvider {
        &self.own
    }

    fn crypto(&self) -> &Self::CryptoProvider {
        &self.crypto
    }

    fn rand(&self) -> &Self::RandProvider {
        &self.rand
    }
}

/// An OpenMLS provider for one operation: the device's crypto and randomness
/// plus a fresh storage overlay.
///
/// When the operation succeeds, take [`into_batch`](Self::into_batch), add the
/// engine's own changes, and apply it as one batch; when it fails, drop it and
/// the store is untouched.
pub struct StagedProvider<'a> {
    crypto: &'a RustCrypto,
    rand: &'a DeviceRand,
    storage: StagedStorage,
}

impl StagedProvider<'_> {
    /// The staged writes and deletes of this operation as one batch.
    pub fn into_batch(self) -> WriteBatch {
        self.storage.into_batch()
    }

    /// Move the writes staged so far into a batch and keep the provider (see
    /// [`StagedStorage::take_batch`]).
    pub fn take_batch(&self) -> WriteBatch {
        self.storage.take_batch()
    }

    /// Apply the staged writes followed by `extra` as one atomic batch (see
    /// [`StagedStorage::apply_with`]).
    ///
    /// # Errors
    /// [`StorageError::Kv`] when the store refuses it; the overlay is kept.
    pub fn apply_with(&self, extra: WriteBatch) -> Result<(), StorageError> {
        self.storage.apply_with(extra)
    }
}

impl OpenMlsProvider for StagedProvider<'_> {
    type CryptoProvider = RustCrypto;
    type RandProvider = DeviceRand;
    type StorageProvider = StagedStorage;

    fn storage(&self) -> &Self::StorageProvider {
        &self.storage
    }

    fn crypto(&self) -> &Self::CryptoProvider {
        self.crypto
    }

    fn rand(&self) -> &Self::RandProvider {
        self.rand
    }
}
