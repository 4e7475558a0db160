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

/// A device's own mailbox for Welcomes.
pub fn welcome_topic(device: &DeviceId) -> TopicId {
    derive(b"welcome", device.as_bytes())
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
}
