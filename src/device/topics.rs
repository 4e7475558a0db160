//! The hub topics of a group, unguessable to anyone outside it
//! (DESIGN.md section 9).
//!
//! The commit and rendezvous topics come from the group's 32-byte secret
//! topic seed, chosen at creation and carried only inside MLS (the group's
//! GroupContext extension, beside the ledger head), so a Welcome or a sealed
//! GroupInfo delivers it and a member stranded at any epoch can still find
//! them; never from the group id, which travels in clear. The app topic
//! comes from the MLS exporter secret of the epoch of the last roster
//! change, so it rotates when membership changes and a removed member
//! cannot compute the next one.

use crate::wire::{DeviceId, TopicId};
use sha2::{Digest, Sha256};

/// Exporter label of the app topic secret.
pub const APP_TOPIC_LABEL: &str = "hubsync app topic v1";

fn derive(domain: &[u8], input: &[u8]) -> TopicId {
    let mut h = Sha256::new();
    h.update(b"hubsync/topic/v1/");
    h.update(domain);
    h.update([0]);
    h.update(input);
    TopicId(h.finalize().to_vec())
}

/// The group's commit log (never rotates), from its topic seed.
pub fn commit_topic(seed: &[u8; 32]) -> TopicId {
    derive(b"commit", seed)
}

/// The group's rendezvous mailbox (never rotates), from its topic seed.
pub fn rendezvous_topic(seed: &[u8; 32]) -> TopicId {
    derive(b"rendezvous", seed)
}

/// The app topic for an exporter secret drawn at a roster change.
pub fn app_topic(exporter_secret: &[u8]) -> TopicId {
    derive(b"app", exporter_secret)
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

    #[test]
    fn topics_are_distinct_and_stable() {
        let g = [7u8; 32];
        assert_ne!(commit_topic(&g), rendezvous_topic(&g));
        assert_eq!(commit_topic(&g), commit_topic(&g));
        assert_ne!(commit_topic(&g), commit_topic(&[8u8; 32]));
        assert_eq!(commit_topic(&g).0.len(), 32);
    }

    #[test]
    fn welcome_topic_is_the_hubs_reserved_mailbox_of_the_device() {
        let d = DeviceId([7; 32]);
        let t = welcome_topic(&d);
        assert_eq!(t.0.len(), 33);
        assert_eq!(t.0[0], crate::wire::MAILBOX_TOPIC_TAG);
        assert_eq!(t.mailbox_owner(), Some(d));
        // No group topic can take that form: they are 32-byte hashes.
        assert_eq!(commit_topic(&[7; 32]).mailbox_owner(), None);
    }
}
