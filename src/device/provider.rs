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
//! secrets, init keys, nonces, reuse guards) replays with the seed, and so do
//! the ephemeral keys of HPKE encryptions (Welcome secrets, update-path
//! secrets), which [`DeviceCrypto`] draws from a second stream of the same
//! seed: one seed gives the same bytes on the wire.

use std::sync::{Arc, Mutex};

use openmls_rust_crypto::{RandError, RustCrypto};
use openmls_traits::random::OpenMlsRand;
use openmls_traits::OpenMlsProvider;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::crypto::DeviceCrypto;
use super::storage::{DeviceStorage, StagedStorage, StorageError};
use crate::kv::{KvStore, WriteBatch};

/// A seeded ChaCha20 generator for OpenMLS: for simulations and tests only.
///
/// The same seed gives the same stream of random bytes. A device restarted
/// from its store needs a seed it has not used before (for example the next
/// draw of the simulation's run generator): reusing one would draw the
/// secrets of the previous run again.
pub struct SeededRand {
    rng: Mutex<ChaCha20Rng>,
}

impl SeededRand {
    /// A generator seeded from `seed`.
    pub fn from_seed(seed: u64) -> Self {
        Self::from_rng(ChaCha20Rng::seed_from_u64(seed))
    }

    /// Another generator from `seed` whose stream never meets
    /// [`from_seed`](Self::from_seed)'s: ChaCha20's stream number `stream`
    /// (0 is `from_seed`'s).
    pub fn from_seed_stream(seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Self::from_rng(rng)
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

/// The ChaCha20 stream of a seeded provider's HPKE ephemeral keys (stream 0
/// is OpenMLS's `rand()`).
const HPKE_STREAM: u64 = 1;

/// The device's OpenMLS provider.
///
/// Used directly as an `OpenMlsProvider`, it stages writes in its own
/// long-lived overlay, which [`take_batch`](Self::take_batch) hands over;
/// that suits read-only calls such as `MlsGroup::load` and single-threaded
/// tools. Engine code uses [`staged`](Self::staged) instead, one overlay per
/// operation, so operations on different groups never share a batch.
pub struct DeviceProvider {
    crypto: DeviceCrypto,
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
    /// simulations and tests only (see [`SeededRand`] on restarts).
    pub fn seeded(kv: Arc<dyn KvStore>, seed: u64) -> Self {
        Self::with_parts(
            kv,
            DeviceCrypto::seeded(SeededRand::from_seed_stream(seed, HPKE_STREAM)),
            DeviceRand::Seeded(SeededRand::from_seed(seed)),
        )
    }

    /// A provider over `kv` with the given random source (and RustCrypto's
    /// own HPKE ephemeral keys).
    pub fn with_rand(kv: Arc<dyn KvStore>, rand: DeviceRand) -> Self {
        Self::with_parts(kv, DeviceCrypto::system(), rand)
    }

    fn with_parts(kv: Arc<dyn KvStore>, crypto: DeviceCrypto, rand: DeviceRand) -> Self {
        let storage = DeviceStorage::new(kv);
        let own = storage.staged();
        Self {
            crypto,
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
    type CryptoProvider = DeviceCrypto;
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
    crypto: &'a DeviceCrypto,
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
    type CryptoProvider = DeviceCrypto;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::identity::DeviceIdentity;
    use crate::device::storage::MLS_KEY_PREFIX;
    use crate::kv::{MemKv, SledKv};
    use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
    use openmls::prelude::*;
    use std::path::Path;

    const CS: Ciphersuite = Ciphersuite::MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519;
    /// The ledger head's GroupContext extension (private-use range).
    const LEDGER_HEAD: u16 = 0xff00;
    const PAST_EPOCHS: usize = 3;

    fn capabilities() -> Capabilities {
        Capabilities::builder()
            .extensions(vec![ExtensionType::Unknown(LEDGER_HEAD)])
            .credentials(vec![CredentialType::Basic])
            .build()
    }

    fn create_config(head: &[u8]) -> MlsGroupCreateConfig {
        let extensions = Extensions::try_from(vec![
            Extension::RequiredCapabilities(RequiredCapabilitiesExtension::new(
                &[ExtensionType::Unknown(LEDGER_HEAD)],
                &[],
                &[CredentialType::Basic],
            )),
            Extension::Unknown(LEDGER_HEAD, UnknownExtension(head.to_vec())),
        ])
        .unwrap();
        MlsGroupCreateConfig::builder()
            .ciphersuite(CS)
            .capabilities(capabilities())
            .with_group_context_extensions(extensions)
            .max_past_epochs(PAST_EPOCHS)
            .use_ratchet_tree_extension(true)
            .build()
    }

    fn join_config() -> MlsGroupJoinConfig {
        MlsGroupJoinConfig::builder()
            .max_past_epochs(PAST_EPOCHS)
            .use_ratchet_tree_extension(true)
            .build()
    }

    /// One device: its store, identity and provider, as a restart rebuilds them.
    struct Device {
        kv: Arc<dyn KvStore>,
        me: DeviceIdentity,
        provider: DeviceProvider,
    }

    impl Device {
        /// `seed` fixes the identity on first start and the MLS randomness of
        /// this run; a restarted device must get a new seed, or it would draw
        /// the secrets of its previous run again.
        fn start(kv: Arc<dyn KvStore>, seed: u64) -> Self {
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let me = DeviceIdentity::load_or_create(&*kv, &mut rng).unwrap();
            let provider = DeviceProvider::seeded(kv.clone(), seed);
            Self { kv, me, provider }
        }

        fn sled(dir: &Path, seed: u64) -> Self {
            Self::start(
                Arc::new(SledKv::open_waiting(dir, crate::testkit::SLED_LOCK_PATIENCE).unwrap()),
                seed,
            )
        }

        /// Run one operation and make its writes durable as one batch.
        fn op<T>(&self, f: impl FnOnce(&StagedProvider<'_>) -> T) -> T {
            let p = self.provider.staged();
            let out = f(&p);
            self.kv.apply(&p.into_batch()).unwrap();
            self.kv.flush().unwrap();
            out
        }

        fn load(&self, group_id: &GroupId) -> MlsGroup {
            MlsGroup::load(self.provider.staged().storage(), group_id)
                .unwrap()
                .expect("group is stored")
        }

        fn signer(&self) -> &openmls_basic_credential::SignatureKeyPair {
            self.me.signature_key_pair()
        }

        fn key_package(&self) -> Vec<u8> {
            self.op(|p| {
                KeyPackage::builder()
                    .leaf_node_capabilities(capabilities())
                    .build(CS, p, self.signer(), self.me.credential_with_key())
                    .unwrap()
                    .key_package()
                    .tls_serialize_detached()
                    .unwrap()
            })
        }

        fn send(&self, group: &mut MlsGroup, text: &[u8]) -> Vec<u8> {
            self.op(|p| group.create_message(p, self.signer(), text).unwrap())
                .tls_serialize_detached()
                .unwrap()
        }

        fn process(&self, group: &mut MlsGroup, bytes: &[u8]) -> ProcessedMessageContent {
            let msg = MlsMessageIn::tls_deserialize_exact(bytes).unwrap();
            let msg = msg.try_into_protocol_message().unwrap();
            self.op(|p| group.process_message(p, msg).unwrap().into_content())
        }

        fn receive(&self, group: &mut MlsGroup, bytes: &[u8]) -> Vec<u8> {
            match self.process(group, bytes) {
                ProcessedMessageContent::ApplicationMessage(m) => m.into_bytes(),
                other => panic!("expected an application message, got {other:?}"),
            }
        }

        fn apply_commit(&self, group: &mut MlsGroup, bytes: &[u8]) {
            let ProcessedMessageContent::StagedCommitMessage(staged) = self.process(group, bytes)
            else {
                panic!("expected a commit");
            };
            self.op(|p| group.merge_staged_commit(p, *staged).unwrap());
        }

        fn self_update(&self, group: &mut MlsGroup) -> Vec<u8> {
            self.op(|p| {
                let bundle = group
                    .self_update(p, self.signer(), LeafNodeParameters::default())
                    .unwrap();
                group.merge_pending_commit(p).unwrap();
                bundle.into_commit()
            })
            .tls_serialize_detached()
            .unwrap()
        }

        fn mls_keys_under(&self, label: &str) -> usize {
            let mut prefix = MLS_KEY_PREFIX.to_vec();
            prefix.extend_from_slice(label.as_bytes());
            prefix.push(b'/');
            self.kv.scan_prefix(&prefix, usize::MAX).unwrap().len()
        }
    }

    fn ledger_head(group: &MlsGroup) -> Vec<u8> {
        group
            .extensions()
            .unknown(LEDGER_HEAD)
            .expect("ledger head")
            .0
            .clone()
    }

    /// A creates a group with the ledger-head extension and adds B; both
    /// groups are returned as persisted.
    fn two_member_group(a: &Device, b: &Device) -> (MlsGroup, MlsGroup) {
        let mut ga = a.op(|p| {
            MlsGroup::new(
                p,
                a.signer(),
                &create_config(b"genesis"),
                a.me.credential_with_key(),
            )
            .unwrap()
        });
        let kp = KeyPackageIn::tls_deserialize_exact(b.key_package())
            .unwrap()
            .validate(a.provider.crypto(), ProtocolVersion::Mls10)
            .unwrap();
        let welcome = a.op(|p| {
            let (_commit, welcome, _info) = ga.add_members(p, a.signer(), &[kp]).unwrap();
            ga.merge_pending_commit(p).unwrap();
            welcome.tls_serialize_detached().unwrap()
        });
        let MlsMessageBodyIn::Welcome(welcome) = MlsMessageIn::tls_deserialize_exact(&welcome)
            .unwrap()
            .extract()
        else {
            panic!("expected a welcome");
        };
        let gb = b.op(|p| {
            StagedWelcome::new_from_welcome(p, &join_config(), welcome, None)
                .unwrap()
                .into_group(p)
                .unwrap()
        });
        (ga, gb)
    }

    fn assert_in_sync(ga: &MlsGroup, gb: &MlsGroup, epoch: u64) {
        assert_eq!(ga.epoch().as_u64(), epoch);
        assert_eq!(gb.epoch().as_u64(), epoch);
        assert_eq!(
            ga.epoch_authenticator().as_slice(),
            gb.epoch_authenticator().as_slice()
        );
        assert_eq!(ledger_head(ga), b"genesis");
        assert_eq!(ledger_head(gb), b"genesis");
    }

    #[test]
    fn two_devices_keep_talking_across_restarts() {
        let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (id_a, id_b, group_id) = {
            let a = Device::sled(dir_a.path(), 1);
            let b = Device::sled(dir_b.path(), 2);
            let (mut ga, mut gb) = two_member_group(&a, &b);
            assert_in_sync(&ga, &gb, 1);
            let m = a.send(&mut ga, b"hello");
            assert_eq!(b.receive(&mut gb, &m), b"hello");
            (a.me.id(), b.me.id(), ga.group_id().clone())
        };

        // Restart: drop everything, reopen the stores, load the groups.
        {
            let a = Device::sled(dir_a.path(), 11);
            let b = Device::sled(dir_b.path(), 12);
            assert_eq!((a.me.id(), b.me.id()), (id_a, id_b));
            let (mut ga, mut gb) = (a.load(&group_id), b.load(&group_id));
            assert_in_sync(&ga, &gb, 1);
            for (group, dev) in [(&ga, &a), (&gb, &b)] {
                let ids = dev.provider.staged().storage().group_ids().unwrap();
                assert_eq!(ids, vec![group.group_id().clone()]);
            }

            let m = b.send(&mut gb, b"after restart");
            assert_eq!(a.receive(&mut ga, &m), b"after restart");

            // Messages that race the commit are read in the next epoch.
            let late_a = a.send(&mut ga, b"late from a");
            let late_b = b.send(&mut gb, b"late from b");
            let commit = a.self_update(&mut ga);
            b.apply_commit(&mut gb, &commit);
            assert_in_sync(&ga, &gb, 2);
            assert_eq!(b.receive(&mut gb, &late_a), b"late from a");
            assert_eq!(a.receive(&mut ga, &late_b), b"late from b");
        }

        let a = Device::sled(dir_a.path(), 21);
        let b = Device::sled(dir_b.path(), 22);
        let (mut ga, mut gb) = (a.load(&group_id), b.load(&group_id));
        assert_in_sync(&ga, &gb, 2);
        let m = a.send(&mut ga, b"epoch two");
        assert_eq!(b.receive(&mut gb, &m), b"epoch two");
        let commit = b.self_update(&mut gb);
        a.apply_commit(&mut ga, &commit);
        assert_in_sync(&ga, &gb, 3);
    }

    #[test]
    fn groups_stored_in_json_by_earlier_versions_load_and_go_on() {
        use crate::device::storage::WRITE_JSON;
        let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // Everything of the first run is written as versions before
        // MessagePack wrote it.
        WRITE_JSON.set(true);
        let group_id = {
            let a = Device::sled(dir_a.path(), 1);
            let b = Device::sled(dir_b.path(), 2);
            let (mut ga, mut gb) = two_member_group(&a, &b);
            let m = a.send(&mut ga, b"hello");
            assert_eq!(b.receive(&mut gb, &m), b"hello");
            ga.group_id().clone()
        };
        WRITE_JSON.set(false);
        let stored_first_bytes = |dir: &Path| {
            let kv = SledKv::open_waiting(dir, crate::testkit::SLED_LOCK_PATIENCE).unwrap();
            kv.scan_prefix(MLS_KEY_PREFIX, usize::MAX)
                .unwrap()
                .into_iter()
                .map(|(_, v)| v[0])
                .collect::<Vec<u8>>()
        };
        assert!(stored_first_bytes(dir_a.path()).iter().all(|&b| b != 0));

        let a = Device::sled(dir_a.path(), 11);
        let b = Device::sled(dir_b.path(), 12);
        let (mut ga, mut gb) = (a.load(&group_id), b.load(&group_id));
        assert_in_sync(&ga, &gb, 1);
        let m = b.send(&mut gb, b"after the upgrade");
        assert_eq!(a.receive(&mut ga, &m), b"after the upgrade");
        let commit = a.self_update(&mut ga);
        b.apply_commit(&mut gb, &commit);
        assert_in_sync(&ga, &gb, 2);
        let m = a.send(&mut ga, b"epoch two");
        assert_eq!(b.receive(&mut gb, &m), b"epoch two");
        drop((a, b));
        // The merge wrote the group's state again, in MessagePack.
        assert!(stored_first_bytes(dir_a.path()).contains(&0));

        let a = Device::sled(dir_a.path(), 21);
        let b = Device::sled(dir_b.path(), 22);
        let (mut ga, mut gb) = (a.load(&group_id), b.load(&group_id));
        assert_in_sync(&ga, &gb, 2);
        let commit = b.self_update(&mut gb);
        a.apply_commit(&mut ga, &commit);
        assert_in_sync(&ga, &gb, 3);
    }

    #[test]
    fn an_unapplied_commit_merge_leaves_the_old_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let (group_id, authenticator) = {
            let a = Device::sled(dir.path(), 1);
            let group = a.op(|p| {
                MlsGroup::new(
                    p,
                    a.signer(),
                    &create_config(b"genesis"),
                    a.me.credential_with_key(),
                )
                .unwrap()
            });
            let mut live = a.load(group.group_id());
            let p = a.provider.staged();
            live.self_update(&p, a.signer(), LeafNodeParameters::default())
                .unwrap();
            live.merge_pending_commit(&p).unwrap();
            assert_eq!(live.epoch().as_u64(), 1);
            assert!(p.storage().staged_len() > 0);
            // The operation fails before its batch is applied.
            drop(p);
            (
                group.group_id().clone(),
                group.epoch_authenticator().as_slice().to_vec(),
            )
        };
        let a = Device::sled(dir.path(), 2);
        let mut group = a.load(&group_id);
        assert_eq!(group.epoch().as_u64(), 0);
        assert_eq!(group.epoch_authenticator().as_slice(), authenticator);
        // And the old state is whole: it still commits.
        a.self_update(&mut group);
        assert_eq!(a.load(&group_id).epoch().as_u64(), 1);
    }

    #[test]
    fn a_crash_loses_an_applied_but_unflushed_batch() {
        let kv = MemKv::new();
        let a = Device::start(Arc::new(kv.clone()), 1);
        let mut group = a.op(|p| {
            MlsGroup::new(
                p,
                a.signer(),
                &create_config(b"genesis"),
                a.me.credential_with_key(),
            )
            .unwrap()
        });
        let group_id = group.group_id().clone();
        let p = a.provider.staged();
        group
            .self_update(&p, a.signer(), LeafNodeParameters::default())
            .unwrap();
        group.merge_pending_commit(&p).unwrap();
        a.kv.apply(&p.into_batch()).unwrap();
        assert_eq!(a.load(&group_id).epoch().as_u64(), 1);
        kv.crash();
        let a = Device::start(Arc::new(kv.clone()), 2);
        let mut group = a.load(&group_id);
        assert_eq!(group.epoch().as_u64(), 0);
        // A flushed batch survives the same crash.
        a.self_update(&mut group);
        kv.crash();
        assert_eq!(
            Device::start(Arc::new(kv), 3)
                .load(&group_id)
                .epoch()
                .as_u64(),
            1
        );
    }

    #[test]
    fn clearing_pending_proposals_deletes_them_from_the_store() {
        let a = Device::start(Arc::new(MemKv::new()), 1);
        let mut group = a.op(|p| {
            MlsGroup::new(
                p,
                a.signer(),
                &create_config(b"genesis"),
                a.me.credential_with_key(),
            )
            .unwrap()
        });
        a.op(|p| {
            group
                .propose_self_update(p, a.signer(), LeafNodeParameters::default())
                .unwrap()
        });
        assert_eq!(a.mls_keys_under("QueuedProposal"), 1);
        assert_eq!(a.mls_keys_under("ProposalQueueRefs"), 1);
        a.op(|p| group.clear_pending_proposals(p.storage()).unwrap());
        assert_eq!(a.mls_keys_under("QueuedProposal"), 0);
        assert_eq!(a.mls_keys_under("ProposalQueueRefs"), 0);
        assert_eq!(a.load(group.group_id()).pending_proposals().count(), 0);
    }

    #[test]
    fn update_keys_are_kept_until_their_proposal_settles_then_deleted() {
        let a = Device::start(Arc::new(MemKv::new()), 1);
        let b = Device::start(Arc::new(MemKv::new()), 2);
        let (mut ga, mut gb) = two_member_group(&a, &b);
        let (proposal, _) = a.op(|p| {
            ga.propose_self_update(p, a.signer(), LeafNodeParameters::default())
                .unwrap()
        });
        assert_eq!(a.mls_keys_under("EncryptionKeyPair"), 1);
        let ProcessedMessageContent::ProposalMessage(queued) =
            b.process(&mut gb, &proposal.tls_serialize_detached().unwrap())
        else {
            panic!("expected a proposal");
        };
        b.op(|p| gb.store_pending_proposal(p.storage(), *queued).unwrap());
        let commit = b.op(|p| {
            let (commit, _, _) = gb.commit_to_pending_proposals(p, b.signer()).unwrap();
            gb.merge_pending_commit(p).unwrap();
            commit
        });
        // A needs the update key to read B's commit, and not after it.
        a.apply_commit(&mut ga, &commit.tls_serialize_detached().unwrap());
        assert_in_sync(&ga, &gb, 2);
        assert_eq!(a.mls_keys_under("EncryptionKeyPair"), 0);
        assert_eq!(a.mls_keys_under("OwnLeafNodes"), 0);
        let m = b.send(&mut gb, b"after update");
        assert_eq!(a.receive(&mut ga, &m), b"after update");
    }

    #[test]
    fn update_keys_of_a_proposal_no_commit_took_are_deleted() {
        let a = Device::start(Arc::new(MemKv::new()), 1);
        let b = Device::start(Arc::new(MemKv::new()), 2);
        let (mut ga, mut gb) = two_member_group(&a, &b);
        // B never sees A's proposal, so B's commit settles the epoch without it.
        a.op(|p| {
            ga.propose_self_update(p, a.signer(), LeafNodeParameters::default())
                .unwrap()
        });
        assert_eq!(a.mls_keys_under("EncryptionKeyPair"), 1);
        let commit = b.self_update(&mut gb);
        a.apply_commit(&mut ga, &commit);
        assert_in_sync(&ga, &gb, 2);
        // OpenMLS 0.9 forgets this private key; the storage deletes it with
        // the leaf list.
        assert_eq!(a.mls_keys_under("OwnLeafNodes"), 0);
        assert_eq!(a.mls_keys_under("EncryptionKeyPair"), 0);
    }

    fn keys_of_group(dev: &Device, group_id: &GroupId) -> usize {
        let group_json = serde_json::to_vec(group_id).unwrap();
        dev.kv
            .scan_prefix(MLS_KEY_PREFIX, usize::MAX)
            .unwrap()
            .into_iter()
            .filter(|(k, _)| {
                k.windows(group_json.len())
                    .any(|w| w == group_json.as_slice())
            })
            .count()
    }

    #[test]
    fn a_removed_member_purges_the_secrets_delete_leaves() {
        let a = Device::start(Arc::new(MemKv::new()), 1);
        let b = Device::start(Arc::new(MemKv::new()), 2);
        let (mut ga, mut gb) = two_member_group(&a, &b);
        let group_id = ga.group_id().clone();
        let commit = a.op(|p| {
            let (commit, _, _) = ga
                .remove_members(p, a.signer(), &[gb.own_leaf_index()])
                .unwrap();
            ga.merge_pending_commit(p).unwrap();
            commit.tls_serialize_detached().unwrap()
        });
        b.apply_commit(&mut gb, &commit);
        assert!(!gb.is_active());

        b.op(|p| gb.delete(p.storage()).unwrap());
        // OpenMLS deletes the key pairs of the epoch it was removed into, but
        // the removed member's keys live under the epoch before.
        assert_eq!(b.mls_keys_under("EpochKeyPairs"), 1);
        let purged = b.op(|p| p.storage().purge_group(&group_id).unwrap());
        assert!(purged >= 1);
        assert_eq!(keys_of_group(&b, &group_id), 0);
        assert!(MlsGroup::load(b.provider.staged().storage(), &group_id)
            .unwrap()
            .is_none());
        // The remover's group is untouched by anything B did.
        assert_eq!(a.load(&group_id).epoch().as_u64(), 2);
    }

    #[test]
    fn purge_alone_removes_a_live_group_and_its_update_keys() {
        let a = Device::start(Arc::new(MemKv::new()), 1);
        let b = Device::start(Arc::new(MemKv::new()), 2);
        let (mut ga, _gb) = two_member_group(&a, &b);
        a.op(|p| {
            ga.propose_self_update(p, a.signer(), LeafNodeParameters::default())
                .unwrap()
        });
        assert_eq!(a.mls_keys_under("EncryptionKeyPair"), 1);
        let before = keys_of_group(&a, ga.group_id());
        assert!(before > 0);
        let purged = a.op(|p| p.storage().purge_group(ga.group_id()).unwrap());
        // Every group-scoped key plus the pending update's key pair.
        assert_eq!(purged, before + 1);
        assert_eq!(keys_of_group(&a, ga.group_id()), 0);
        assert_eq!(a.mls_keys_under("EncryptionKeyPair"), 0);
        assert!(!a
            .provider
            .staged()
            .storage()
            .contains_group(ga.group_id())
            .unwrap());
    }

    #[test]
    fn providers_can_move_across_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<DeviceProvider>();
        shared::<StagedProvider<'static>>();
        shared::<DeviceStorage>();
        shared::<StagedStorage>();
    }

    #[test]
    fn seeded_randomness_replays_and_differs_by_seed() {
        let draw = |seed| {
            let r = DeviceRand::Seeded(SeededRand::from_seed(seed));
            (r.random_vec(16).unwrap(), r.random_array::<8>().unwrap())
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
        let system = DeviceRand::System(RustCrypto::default());
        assert_ne!(
            system.random_vec(32).unwrap(),
            system.random_vec(32).unwrap()
        );
    }

    #[test]
    fn the_providers_own_overlay_stages_until_taken() {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let a = Device::start(kv.clone(), 1);
        let group = MlsGroup::new(
            &a.provider,
            a.signer(),
            &create_config(b"genesis"),
            a.me.credential_with_key(),
        )
        .unwrap();
        assert!(kv.scan_prefix(MLS_KEY_PREFIX, 1).unwrap().is_empty());
        kv.apply(&a.provider.take_batch()).unwrap();
        assert_eq!(a.load(group.group_id()).epoch().as_u64(), 0);
    }
}
