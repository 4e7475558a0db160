//! The hub topics of a group, unguessable to anyone outside it and
//! writable only by its members (DESIGN.md section 9).
//!
//! Every log topic of a group is **writer-bound**
//! ([`TopicId::writer_bound`]): its name is a hash of an ed25519 public key
//! whose secret half derives from a group secret, and the hub takes a
//! publish on it only when that key signed it. So the name is unguessable
//! and the write needs the secret, while the hub stays group-blind and
//! keeps no writer state that a restart, a rewound store or a first
//! squatter could get wrong.
//!
//! Which secret:
//! - **the commit topic** from the group's *commit seed*: the MLS exporter
//!   secret ([`COMMIT_SEED_LABEL`]) of the epoch of the group's last roster
//!   change, its creation counting as one. Every add or remove moves the
//!   commit log to a new topic that a removed member cannot compute, and a
//!   joiner computes it from the epoch its Welcome gives it.
//! - **the app topic** from the exporter secret ([`APP_TOPIC_LABEL`]) of the
//!   same epoch, so it rotates with the commit topic.
//! - **the rendezvous topic** (a mailbox, not a log) from the 32-byte topic
//!   seed in the group's GroupContext extension, which never rotates, so a
//!   member stranded at any epoch can still find it.

use crate::wire::{DeviceId, Publish, TopicId};
use ed25519_dalek::SigningKey;
use sha2::{Digest, Sha256};

/// Exporter label of the app topic secret.
pub const APP_TOPIC_LABEL: &str = "hubsync app topic v1";

/// Exporter label of the commit seed, drawn at each roster change.
pub const COMMIT_SEED_LABEL: &str = "hubsync commit seed v1";

fn derive(domain: &[u8], input: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"hubsync/topic/v1/");
    h.update(domain);
    h.update([0]);
    h.update(input);
    h.finalize().into()
}

/// A writer-bound topic of a group and the key that may write it. Anyone
/// who holds the secret it was derived from can rebuild both.
#[derive(Clone)]
pub struct TopicWriter {
    topic: TopicId,
    key: SigningKey,
}

impl TopicWriter {
    fn from_secret(domain: &[u8], secret: &[u8]) -> Self {
        let key = SigningKey::from_bytes(&derive(domain, secret));
        let topic = TopicId::writer_bound(&key.verifying_key().to_bytes());
        Self { topic, key }
    }

    /// The topic's name.
    pub fn topic(&self) -> &TopicId {
        &self.topic
    }

    /// Sign `publish` for this topic ([`Publish::sign_writer`]); call it
    /// after every other field is set.
    pub fn sign(&self, publish: &mut Publish) {
        publish.sign_writer(&self.key);
    }
}

impl std::fmt::Debug for TopicWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("TopicWriter")
            .field("topic", &self.topic)
            .finish()
    }
}

/// The group's commit log and its writer, from the commit seed.
pub fn commit_writer(commit_seed: &[u8; 32]) -> TopicWriter {
    TopicWriter::from_secret(b"commit", commit_seed)
}

/// The group's commit log, from the commit seed.
pub fn commit_topic(commit_seed: &[u8; 32]) -> TopicId {
    commit_writer(commit_seed).topic
}

/// The app topic and its writer, for an exporter secret drawn at a roster
/// change.
pub fn app_writer(exporter_secret: &[u8]) -> TopicWriter {
    TopicWriter::from_secret(b"app", exporter_secret)
}

/// The app topic for an exporter secret drawn at a roster change.
pub fn app_topic(exporter_secret: &[u8]) -> TopicId {
    app_writer(exporter_secret).topic
}

/// One direction of a tunnel (a mailbox, writer-bound) and its writer,
/// from a secret only the tunnel's two devices hold
/// ([`crate::device::tunnel`]).
pub fn tunnel_writer(secret: &[u8]) -> TopicWriter {
    TopicWriter::from_secret(b"tunnel", secret)
}

/// The group's rendezvous mailbox (never rotates), from the topic seed of
/// its GroupContext extension.
pub fn rendezvous_topic(seed: &[u8; 32]) -> TopicId {
    TopicId(derive(b"rendezvous", seed).to_vec())
}

/// A device's own mailbox for Welcomes: the hub's reserved mailbox form
/// ([`TopicId::mailbox`]: `0x01` followed by the 32 bytes of the device id),
/// so the hub lets only that device subscribe to it or fetch it, while
/// anyone may post to it within a per-sender rate. Unlike the group's
/// topics it is not secret: it names its owner.
pub fn welcome_topic(device: &DeviceId) -> TopicId {
    TopicId::mailbox(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{ExpectedHead, PublishId, RetentionClass, WriterError};

    #[test]
    fn topics_are_distinct_and_stable() {
        let g = [7u8; 32];
        assert_ne!(commit_topic(&g), rendezvous_topic(&g));
        assert_ne!(commit_topic(&g), app_topic(&g));
        assert_eq!(commit_topic(&g), commit_topic(&g));
        assert_ne!(commit_topic(&g), commit_topic(&[8u8; 32]));
        assert!(commit_topic(&g).is_writer_bound());
        assert!(app_topic(&g).is_writer_bound());
        assert_eq!(rendezvous_topic(&g).0.len(), 32);
    }

    /// The worked bytes of docs/protocol.md sections 18 and 26.
    #[test]
    fn worked_topics_match_the_protocol_document() {
        let hexed = |t: TopicId| hex::encode(t.0);
        assert_eq!(
            hexed(commit_topic(&[0x22; 32])),
            "0236f5b0f26905a0ab84c027feea9d6cacf923699519a150490a9439f08b3b615f"
        );
        assert_eq!(
            hexed(commit_topic(&[0x07; 32])),
            "024a9b8ce9b6f9c2f1d35601bc5491fede6c615d3892680a8c64c5ded20841d4fd"
        );
        assert_eq!(
            hexed(rendezvous_topic(&[0x22; 32])),
            "b52c31be37fee6e5ccff4947ca02d1e91ecb3e9731610af4b2eaaf6f570d8a83"
        );
        let app = app_topic(&[0x33; 32]);
        assert_eq!(
            hexed(app.clone()),
            "028a19ab8ef4eccdf192c2402a28a0267964f530e4c9e2e6eaf287f3c04bdaea17"
        );
        assert_eq!(
            hex::encode(crate::device::frames::publish_id(&[0xaa; 16], &app).0),
            "b864e9a28d70df35150a7ff53fb1f49de12254b3b5a582458353e58b06750e80"
        );
    }

    #[test]
    fn welcome_topic_is_the_hubs_reserved_mailbox_of_the_device() {
        let d = DeviceId([7; 32]);
        let t = welcome_topic(&d);
        assert_eq!(t.0.len(), 33);
        assert_eq!(t.0[0], crate::wire::MAILBOX_TOPIC_TAG);
        assert_eq!(t.mailbox_owner(), Some(d));
        // No group topic can take that form.
        assert_eq!(commit_topic(&[7; 32]).mailbox_owner(), None);
        assert_eq!(rendezvous_topic(&[7; 32]).mailbox_owner(), None);
    }

    fn publish(topic: &TopicId) -> Publish {
        Publish {
            topic: topic.clone(),
            publish_id: PublishId([1; 32]),
            class: RetentionClass::Log,
            expected_head: ExpectedHead::Seq(3),
            replay_only: false,
            retention_secs: None,
            payload: b"frame".to_vec(),
            writer: None,
        }
    }

    #[test]
    fn only_the_topics_writer_can_sign_for_it() {
        let w = commit_writer(&[7; 32]);
        let mut p = publish(w.topic());
        assert_eq!(p.check_writer(), Err(WriterError::Missing));
        w.sign(&mut p);
        assert_eq!(p.check_writer(), Ok(()));
        // The compare-and-set head is not signed: a retry under another
        // head is the same publish.
        p.expected_head = ExpectedHead::Seq(9);
        assert_eq!(p.check_writer(), Ok(()));
        // Another payload under the same proof does not verify.
        let mut q = p.clone();
        q.payload = b"other".to_vec();
        assert_eq!(q.check_writer(), Err(WriterError::BadSignature));
        // A key of another topic (an old commit seed) is not this topic's.
        let mut r = publish(w.topic());
        commit_writer(&[8; 32]).sign(&mut r);
        assert_eq!(r.check_writer(), Err(WriterError::WrongKey));
        // A proof is ignored on an ordinary topic.
        let mut o = publish(&TopicId::from("open"));
        assert_eq!(o.check_writer(), Ok(()));
        w.sign(&mut o);
        assert_eq!(o.check_writer(), Ok(()));
    }
}
