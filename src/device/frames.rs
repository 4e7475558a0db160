//! What devices put inside hub payloads: app messages (inside MLS),
//! Welcome envelopes (beside MLS, signed by the inviter), and a joiner's
//! request to be invited again (beside MLS, signed by the joiner).

use super::records::GroupId;
use crate::wire::DeviceId;
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The plaintext of an app message inside MLS.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppMessage {
    /// The sender's message id: what deduplication and conflicts key on.
    pub id: [u8; 16],
    /// The app's bytes.
    pub body: Vec<u8>,
}

/// A Welcome with what the joiner needs to find the group on its hubs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WelcomeEnvelope {
    /// The group.
    pub group: GroupId,
    /// Hubs the group is bound to.
    pub hubs: Vec<String>,
    /// The hub commits go through.
    pub commit_hub: String,
    /// Sequence number of the commit that added the joiner on the commit
    /// hub's commit topic: the joiner applies commits after it.
    pub commit_seq: u64,
    /// The serialized MLS Welcome message.
    pub welcome: Vec<u8>,
    /// The inviter's whole ledger in enactment order, sealed under the
    /// joiner's first epoch (exporter label "hubsync ledger snapshot v1",
    /// the group id as additional data): the joiner installs it only if it
    /// reproduces the head MLS authenticates.
    pub ledger: Vec<u8>,
    /// Who invited.
    pub inviter: DeviceId,
    /// The inviter's ed25519 signature over [`WelcomeEnvelope::signed_bytes`].
    pub signature: Vec<u8>,
}

/// Why an envelope was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Not decodable.
    #[error("undecodable envelope: {0}")]
    Malformed(String),
    /// The signature does not verify under the claimed inviter.
    #[error("welcome envelope signature does not verify")]
    BadSignature,
}

impl WelcomeEnvelope {
    /// The bytes the inviter signs: everything but the signature.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut h = Sha256::new();
        h.update(b"hubsync/welcome/v1");
        h.update(self.group.0);
        h.update((self.hubs.len() as u32).to_be_bytes());
        for hub in &self.hubs {
            h.update((hub.len() as u32).to_be_bytes());
            h.update(hub.as_bytes());
        }
        h.update((self.commit_hub.len() as u32).to_be_bytes());
        h.update(self.commit_hub.as_bytes());
        h.update(self.commit_seq.to_be_bytes());
        h.update(Sha256::digest(&self.welcome));
        h.update(Sha256::digest(&self.ledger));
        h.update(self.inviter.0);
        h.finalize().to_vec()
    }

    /// Sign as `key` (which must be `inviter`'s).
    pub fn sign(mut self, key: &SigningKey) -> Self {
        self.signature = key.sign(&self.signed_bytes()).to_bytes().to_vec();
        self
    }

    /// Decode and check the signature.
    ///
    /// # Errors
    /// [`EnvelopeError`] naming what is wrong.
    pub fn open(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let env: WelcomeEnvelope =
            postcard::from_bytes(bytes).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        let key =
            VerifyingKey::from_bytes(&env.inviter.0).map_err(|_| EnvelopeError::BadSignature)?;
        let sig = Signature::from_slice(&env.signature).map_err(|_| EnvelopeError::BadSignature)?;
        key.verify(&env.signed_bytes(), &sig)
            .map_err(|_| EnvelopeError::BadSignature)?;
        Ok(env)
    }

    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }
}

/// The first bytes of a [`ReinviteRequest`] in a device's Welcome mailbox,
/// where everything else is a [`WelcomeEnvelope`].
pub const REINVITE_MAGIC: &[u8] = b"hubsync/reinvite/v1\0";

/// A joiner's request to its inviter: "the Welcome you sent me names a key
/// package I hold no keys for; invite me again". A hub restored from a
/// backup hands out key packages that were claimed and used since; a
/// Welcome built on one can never be read, while the group's roster lists
/// its member. Posted to the inviter's Welcome mailbox, signed by the
/// joiner's device key; the inviter acts on it only for the very Welcome
/// it keeps for that joiner (docs/protocol.md section 26).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReinviteRequest {
    /// The group the Welcome was for.
    pub group: GroupId,
    /// Who asks: the device the Welcome was for.
    pub joiner: DeviceId,
    /// Whom it asks: the Welcome's inviter.
    pub inviter: DeviceId,
    /// SHA-256 of the MLS Welcome it could not read.
    pub welcome_digest: [u8; 32],
    /// The joiner's ed25519 signature over [`ReinviteRequest::signed_bytes`].
    pub signature: Vec<u8>,
}

impl ReinviteRequest {
    /// The bytes the joiner signs: everything but the signature.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut h = Sha256::new();
        h.update(REINVITE_MAGIC);
        h.update(self.group.0);
        h.update(self.joiner.0);
        h.update(self.inviter.0);
        h.update(self.welcome_digest);
        h.finalize().to_vec()
    }

    /// Sign as `key` (which must be `joiner`'s).
    pub fn sign(mut self, key: &SigningKey) -> Self {
        self.signature = key.sign(&self.signed_bytes()).to_bytes().to_vec();
        self
    }

    /// Whether `bytes` are a request rather than a Welcome envelope.
    pub fn is_one(bytes: &[u8]) -> bool {
        bytes.starts_with(REINVITE_MAGIC)
    }

    /// Decode and check the joiner's signature.
    ///
    /// # Errors
    /// [`EnvelopeError`] naming what is wrong.
    pub fn open(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let body = bytes
            .strip_prefix(REINVITE_MAGIC)
            .ok_or_else(|| EnvelopeError::Malformed("not a reinvite request".into()))?;
        let req: ReinviteRequest =
            postcard::from_bytes(body).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        let key =
            VerifyingKey::from_bytes(&req.joiner.0).map_err(|_| EnvelopeError::BadSignature)?;
        let sig = Signature::from_slice(&req.signature).map_err(|_| EnvelopeError::BadSignature)?;
        key.verify(&req.signed_bytes(), &sig)
            .map_err(|_| EnvelopeError::BadSignature)?;
        Ok(req)
    }

    /// Encode: [`REINVITE_MAGIC`], then the request.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = REINVITE_MAGIC.to_vec();
        out.extend(postcard::to_allocvec(self).unwrap_or_default());
        out
    }
}

/// SHA-256 of `bytes`.
pub fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// A publish id derived from an operation id and a topic, so a retried
/// operation is recognised by the hub as a duplicate.
pub fn publish_id(operation: &[u8], topic: &crate::wire::TopicId) -> crate::wire::PublishId {
    let mut h = Sha256::new();
    h.update(b"hubsync/publish-id/v1");
    h.update((operation.len() as u32).to_be_bytes());
    h.update(operation);
    h.update(&topic.0);
    crate::wire::PublishId(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_signature_covers_every_field() {
        let key = SigningKey::from_bytes(&[4; 32]);
        let env = WelcomeEnvelope {
            group: GroupId([1; 32]),
            hubs: vec!["ws://a".into(), "ws://b".into()],
            commit_hub: "ws://a".into(),
            commit_seq: 9,
            welcome: vec![1, 2, 3],
            ledger: vec![4, 5],
            inviter: DeviceId(key.verifying_key().to_bytes()),
            signature: vec![],
        }
        .sign(&key);
        assert_eq!(WelcomeEnvelope::open(&env.encode()).unwrap(), env);
        let mut forged = env.clone();
        forged.hubs.push("ws://evil".into());
        assert_eq!(
            WelcomeEnvelope::open(&forged.encode()),
            Err(EnvelopeError::BadSignature)
        );
        let mut forged = env.clone();
        forged.ledger.push(6);
        assert_eq!(
            WelcomeEnvelope::open(&forged.encode()),
            Err(EnvelopeError::BadSignature)
        );
        assert!(matches!(
            WelcomeEnvelope::open(&[1, 2]),
            Err(EnvelopeError::Malformed(_))
        ));
    }

    #[test]
    fn a_reinvite_request_is_the_joiners_and_names_one_welcome() {
        let joiner = SigningKey::from_bytes(&[5; 32]);
        let other = SigningKey::from_bytes(&[6; 32]);
        let req = ReinviteRequest {
            group: GroupId([1; 32]),
            joiner: DeviceId(joiner.verifying_key().to_bytes()),
            inviter: DeviceId([7; 32]),
            welcome_digest: [8; 32],
            signature: vec![],
        }
        .sign(&joiner);
        let bytes = req.encode();
        assert!(ReinviteRequest::is_one(&bytes));
        assert_eq!(ReinviteRequest::open(&bytes).unwrap(), req);
        // Signed by anyone but the joiner it names: refused.
        let forged = ReinviteRequest {
            signature: vec![],
            ..req.clone()
        }
        .sign(&other);
        assert_eq!(
            ReinviteRequest::open(&forged.encode()),
            Err(EnvelopeError::BadSignature)
        );
        let mut moved = req.clone();
        moved.welcome_digest = [9; 32];
        assert_eq!(
            ReinviteRequest::open(&moved.encode()),
            Err(EnvelopeError::BadSignature)
        );
        // A Welcome envelope is not one.
        assert!(!ReinviteRequest::is_one(&[1, 2, 3]));
        assert!(matches!(
            ReinviteRequest::open(&[1, 2, 3]),
            Err(EnvelopeError::Malformed(_))
        ));
    }
}
