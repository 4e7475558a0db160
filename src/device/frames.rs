//! What devices put inside hub payloads: app messages (inside MLS) and
//! Welcome envelopes (beside MLS, signed by the inviter).

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
}
