//! The device's long-term identity: one ed25519 signing key.
//!
//! The key is created once, from an injected RNG (so a simulation's seed fixes
//! it), persisted in the device's [`KvStore`], and loaded on every later start.
//! Its public key is the device id: the hub authenticates the device with it,
//! and it is the identity of the device's MLS `BasicCredential`, so every
//! member can map an MLS leaf back to a device id.

use std::fmt;

use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use openmls::prelude::{BasicCredential, Credential, CredentialType, CredentialWithKey};
use openmls_basic_credential::SignatureKeyPair;
use openmls_traits::types::SignatureScheme;
use rand::{CryptoRng, RngCore};

use crate::kv::{KvError, KvStore, WriteBatch};

pub use crate::wire::DeviceId;

/// Whether `signature` is `device`'s ed25519 signature over `message`
/// (`verify_strict`): false for a key that is not a curve point or a
/// signature that is not 64 bytes, never a panic. Every message a device
/// signs with its identity key (rejoin requests and answers, probes,
/// presence beacons, tunnel handshakes) is checked with this.
pub fn verify_by(device: &DeviceId, message: &[u8], signature: &[u8]) -> bool {
    let Ok(key) = VerifyingKey::from_bytes(&device.0) else {
        return false;
    };
    let Ok(sig) = Signature::from_slice(signature) else {
        return false;
    };
    key.verify_strict(message, &sig).is_ok()
}

/// Where the identity's secret key lives in the device store. Versioned so a
/// later format can live beside it.
pub const IDENTITY_KEY: &[u8] = b"device/identity/v1";

/// A failure to load or create the device identity.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    /// The store failed to read, apply or flush.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The stored key is not 32 bytes: the store is corrupt or was written by
    /// something else. Never replaced silently, since a new key is a new device.
    #[error("stored device key has {len} bytes, expected 32")]
    Corrupt {
        /// Length of the value found.
        len: usize,
    },
}

/// The device's signing key, its id, and the MLS views of both.
///
/// The secret key never leaves this struct except through
/// [`signing_key`](Self::signing_key) and the MLS signer; `Debug` prints only
/// the id.
pub struct DeviceIdentity {
    key: SigningKey,
    id: DeviceId,
    mls_signer: SignatureKeyPair,
}

impl DeviceIdentity {
    /// Load the identity stored in `kv`, or create one from `rng` and store it.
    ///
    /// A created key is applied and flushed before this returns, so the
    /// device never signs anything with a key it could lose in a crash.
    ///
    /// # Errors
    /// [`IdentityError::Kv`] when the store fails; [`IdentityError::Corrupt`]
    /// when a stored key exists but is malformed (it is left in place).
    pub fn load_or_create(
        kv: &dyn KvStore,
        rng: &mut (impl RngCore + CryptoRng),
    ) -> Result<Self, IdentityError> {
        if let Some(identity) = Self::load(kv)? {
            return Ok(identity);
        }
        let key = SigningKey::generate(rng);
        let mut batch = WriteBatch::new();
        batch.put(IDENTITY_KEY, key.to_bytes().to_vec());
        kv.apply(&batch)?;
        kv.flush()?;
        Ok(Self::from_signing_key(key))
    }

    /// The identity stored in `kv`, or `None` when the device has none yet.
    ///
    /// # Errors
    /// [`IdentityError::Kv`] when the store fails; [`IdentityError::Corrupt`]
    /// when the stored key is malformed.
    pub fn load(kv: &dyn KvStore) -> Result<Option<Self>, IdentityError> {
        let Some(bytes) = kv.get(IDENTITY_KEY)? else {
            return Ok(None);
        };
        let seed: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| IdentityError::Corrupt { len: bytes.len() })?;
        Ok(Some(Self::from_signing_key(SigningKey::from_bytes(&seed))))
    }

    /// An identity around `key`, not persisted (for tests and tools).
    pub fn from_signing_key(key: SigningKey) -> Self {
        let public = key.verifying_key().to_bytes();
        let mls_signer = SignatureKeyPair::from_raw(
            SignatureScheme::ED25519,
            key.to_bytes().to_vec(),
            public.to_vec(),
        );
        Self {
            key,
            id: DeviceId(public),
            mls_signer,
        }
    }

    /// The device id: the 32-byte ed25519 public key.
    pub fn id(&self) -> DeviceId {
        self.id
    }

    /// This device's ed25519 signature over `message`, as the 64 bytes a
    /// signed frame carries (rejoin requests and answers, probes, presence
    /// beacons, tunnel handshakes); [`verify_by`] checks it.
    pub fn signature_over(&self, message: &[u8]) -> Vec<u8> {
        self.sign(message).to_bytes().to_vec()
    }

    /// The ed25519 signing key.
    pub fn signing_key(&self) -> &SigningKey {
        &self.key
    }

    /// The ed25519 public key.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }

    /// An ed25519 signature of `message` (deterministic, RFC 8032).
    pub fn sign(&self, message: &[u8]) -> Signature {
        self.key.sign(message)
    }

    /// The same key as an OpenMLS signer (`openmls_traits::signatures::Signer`),
    /// for creating groups, key packages, commits and messages.
    pub fn signature_key_pair(&self) -> &SignatureKeyPair {
        &self.mls_signer
    }

    /// The device's MLS credential: a `BasicCredential` whose identity is the
    /// device id, with the same public key as signature key.
    pub fn credential_with_key(&self) -> CredentialWithKey {
        CredentialWithKey {
            credential: BasicCredential::new(self.id.0.to_vec()).into(),
            signature_key: self.id.0.to_vec().into(),
        }
    }
}

impl fmt::Debug for DeviceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceIdentity")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// The device id named by an MLS credential, or `None` when the credential
/// is not a basic credential holding exactly 32 bytes.
///
/// This only reads the claim: whether the leaf's signature key matches it is
/// for the caller to check (see [`credential_matches_key`]).
pub fn device_id_of(credential: &Credential) -> Option<DeviceId> {
    if credential.credential_type() != CredentialType::Basic {
        return None;
    }
    let basic = BasicCredential::try_from(credential.clone()).ok()?;
    Some(DeviceId(basic.identity().try_into().ok()?))
}

/// Whether `credential` names exactly the device whose ed25519 public key is
/// `signature_key`, as every hubsync leaf must.
pub fn credential_matches_key(credential: &Credential, signature_key: &[u8]) -> bool {
    device_id_of(credential).is_some_and(|id| id.0.as_slice() == signature_key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{MemKv, SledKv};
    use ed25519_dalek::Verifier as _;
    use openmls_traits::signatures::Signer as MlsSigner;
    use rand::SeedableRng;
    use rand_chacha::ChaCha20Rng;

    #[test]
    fn identity_is_created_once_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(7);
        let first = {
            let kv = SledKv::open_waiting(dir.path(), crate::testkit::SLED_LOCK_PATIENCE).unwrap();
            DeviceIdentity::load_or_create(&kv, &mut rng).unwrap().id()
        };
        let kv = SledKv::open_waiting(dir.path(), crate::testkit::SLED_LOCK_PATIENCE).unwrap();
        // A different RNG proves the key was loaded, not regenerated.
        let mut other = ChaCha20Rng::seed_from_u64(8);
        let again = DeviceIdentity::load_or_create(&kv, &mut other).unwrap();
        assert_eq!(again.id(), first);
        assert_eq!(DeviceIdentity::load(&kv).unwrap().unwrap().id(), first);
    }

    #[test]
    fn created_identity_is_flushed_before_use() {
        let kv = MemKv::new();
        let id = DeviceIdentity::load_or_create(&kv, &mut ChaCha20Rng::seed_from_u64(1))
            .unwrap()
            .id();
        kv.crash();
        assert_eq!(DeviceIdentity::load(&kv).unwrap().unwrap().id(), id);
    }

    #[test]
    fn seed_fixes_the_identity_and_missing_is_none() {
        let a = DeviceIdentity::load_or_create(&MemKv::new(), &mut ChaCha20Rng::seed_from_u64(3));
        let b = DeviceIdentity::load_or_create(&MemKv::new(), &mut ChaCha20Rng::seed_from_u64(3));
        assert_eq!(a.unwrap().id(), b.unwrap().id());
        assert!(DeviceIdentity::load(&MemKv::new()).unwrap().is_none());
    }

    #[test]
    fn corrupt_key_is_reported_not_replaced() {
        let kv = MemKv::new();
        let mut batch = WriteBatch::new();
        batch.put(IDENTITY_KEY, vec![1u8; 5]);
        kv.apply(&batch).unwrap();
        let err =
            DeviceIdentity::load_or_create(&kv, &mut ChaCha20Rng::seed_from_u64(3)).unwrap_err();
        assert_eq!(err, IdentityError::Corrupt { len: 5 });
        assert_eq!(kv.get(IDENTITY_KEY).unwrap(), Some(vec![1u8; 5]));
    }

    #[test]
    fn mls_views_carry_the_same_key() {
        let identity = DeviceIdentity::from_signing_key(SigningKey::from_bytes(&[9u8; 32]));
        let id = identity.id();
        assert_eq!(
            id.to_string(),
            hex::encode(identity.verifying_key().to_bytes())
        );
        assert_eq!(identity.signature_key_pair().public(), id.as_bytes());
        assert_eq!(
            identity.signature_key_pair().signature_scheme(),
            SignatureScheme::ED25519
        );

        let cwk = identity.credential_with_key();
        assert_eq!(device_id_of(&cwk.credential), Some(id));
        assert_eq!(cwk.signature_key.as_slice(), id.as_bytes());
        assert!(credential_matches_key(&cwk.credential, id.as_bytes()));
        assert!(!credential_matches_key(&cwk.credential, &[0u8; 32]));

        // The MLS signer and the dalek key produce interchangeable signatures.
        let msg = b"hubsync";
        let mls_sig = MlsSigner::sign(identity.signature_key_pair(), msg).unwrap();
        let sig = Signature::from_slice(&mls_sig).unwrap();
        assert!(identity.verifying_key().verify(msg, &sig).is_ok());
        assert_eq!(identity.sign(msg), sig);

        // The frame signature checks under this device's id only, over
        // this message only, and a malformed signature or key is a no.
        let bytes = identity.signature_over(msg);
        assert!(verify_by(&id, msg, &bytes));
        assert!(!verify_by(&id, b"hubsynd", &bytes));
        assert!(!verify_by(&DeviceId([7; 32]), msg, &bytes));
        assert!(!verify_by(&id, msg, &bytes[..63]));
    }

    #[test]
    fn foreign_credentials_name_no_device() {
        let short: Credential = BasicCredential::new(vec![1, 2, 3]).into();
        assert_eq!(device_id_of(&short), None);
        let other: Credential = Credential::new(CredentialType::X509, vec![0u8; 32]);
        assert_eq!(device_id_of(&other), None);
    }
}
