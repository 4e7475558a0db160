//! Control messages: the engine's own messages between the members of a
//! group (ledger catch-up, leaving), never handed to the app.
//!
//! A control message is an MLS application message whose authenticated
//! data is [`CONTROL_AAD`]; its content is the usual app-message frame
//! (id and body, so it is deduplicated like any message) whose body is a
//! postcard [`Control`]. MLS authenticates its sender as a current member,
//! and only current members can read it (docs/protocol.md section 23).

use super::error::DeviceError;
use super::ledger::{Entry, EntryType};
use super::manager::GroupPeerManager;
use super::records::GroupId;
use crate::wire::DeviceId;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;

/// Members' control requests one device handles at once, at most: each
/// may send a whole ledger, so a member that floods requests is answered
/// this many times at a time, and the rest are dropped (and counted).
pub const MAX_CONTROL_TASKS: u64 = 16;

/// The authenticated data that marks an MLS application message as an
/// engine control message (its content a postcard [`Control`] inside the
/// usual app-message frame), never handed to the app.
pub const CONTROL_AAD: &[u8] = b"hubsync control v1";

/// An engine control message between members.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// "Send me your whole ledger, sealed to this key."
    LedgerRequest {
        /// Ties answers to this request.
        nonce: [u8; 16],
        /// A fresh HPKE public key (the group's ciphersuite's KEM).
        #[serde(with = "serde_bytes")]
        hpke_public: Vec<u8>,
    },
    /// One member's whole ledger, in enactment order, sealed to the
    /// request's key.
    LedgerAnswer {
        /// The request's nonce.
        nonce: [u8; 16],
        /// The requester (only it can open the answer; the others ignore it).
        to: DeviceId,
        /// HPKE encapsulated key.
        #[serde(with = "serde_bytes")]
        kem_output: Vec<u8>,
        /// HPKE ciphertext of the encoded entry list, with the group id and
        /// the nonce as additional data.
        #[serde(with = "serde_bytes")]
        ciphertext: Vec<u8>,
    },
    /// "Remove me": the sender's own `member.remove` entry (encoded), for
    /// another member to commit (a member cannot commit its own removal).
    LeaveRequest {
        /// The entry, authored by the sender about itself.
        #[serde(with = "serde_bytes")]
        entry: Vec<u8>,
    },
}

/// The entry of a leave request from `sender` in `group`, if it is what a
/// leave request may carry: `sender`'s own `member.remove` about itself, in
/// this group, signed by `sender`. Anything else (another member's removal,
/// another's signature, another group) is refused.
pub(super) fn own_leave_entry(bytes: &[u8], sender: DeviceId, group: GroupId) -> Option<Entry> {
    Entry::decode(bytes).ok().filter(|e| {
        e.kind == EntryType::MemberRemove
            && e.author == sender
            && e.subject_device() == Some(sender)
            && e.group == group
            && e.verify().is_ok()
    })
}

impl GroupPeerManager {
    /// Encrypt `control` for the group and queue it for every hub of the
    /// group, like a message (waiting for room in the outbox).
    pub(super) async fn send_control(
        &self,
        group: GroupId,
        control: &Control,
    ) -> Result<(), DeviceError> {
        let body = postcard::to_allocvec(control).map_err(|e| DeviceError::Mls(e.to_string()))?;
        self.broadcast_with(group, &body, CONTROL_AAD, true, None)
            .await?;
        Ok(())
    }

    /// Handle `sender`'s request on a task of its own, unless
    /// [`MAX_CONTROL_TASKS`] are running already (then this one is dropped
    /// and counted in `DeviceStats::dropped`: its sender asks again if it
    /// still needs to). A failure is counted in
    /// `DeviceStats::control_failures`.
    pub(super) fn handle_request<F, Fut>(
        &self,
        group: GroupId,
        sender: DeviceId,
        what: &'static str,
        work: F,
    ) where
        F: FnOnce(GroupPeerManager) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(), DeviceError>> + Send + 'static,
    {
        let running = &self.shared.control_tasks;
        if running.fetch_add(1, Ordering::AcqRel) >= MAX_CONTROL_TASKS {
            running.fetch_sub(1, Ordering::AcqRel);
            self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let this = self.clone();
        self.shared.tasks.spawn(async move {
            let result = work(this.clone()).await;
            this.shared.control_tasks.fetch_sub(1, Ordering::AcqRel);
            if let Err(e) = result {
                this.shared
                    .counters
                    .control_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%group, member = %sender, error = %e, "{what} not handled");
            }
        });
    }

    /// A control message from `sender` arrived in `group` (called with the
    /// group's lock held: it only looks, and leaves any answer to a task).
    pub(super) fn on_control(&self, group: GroupId, sender: DeviceId, body: &[u8]) {
        let Ok(control) = postcard::from_bytes::<Control>(body) else {
            self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match control {
            Control::LedgerRequest { nonce, hpke_public } => {
                self.handle_request(group, sender, "ledger request", move |this| async move {
                    this.answer_ledger(group, sender, nonce, hpke_public).await
                });
            }
            Control::LedgerAnswer {
                nonce,
                to,
                kem_output,
                ciphertext,
            } => {
                if to != self.shared.identity.id() {
                    return;
                }
                let pending = super::manager::lock(&self.shared.gathers);
                if let Some(p) = pending.get(&(group, nonce)) {
                    // Full: the requester has 64 unread answers already.
                    let _ = p.tx.try_send(super::gather::Answer {
                        from: sender,
                        kem_output,
                        ciphertext,
                    });
                }
            }
            Control::LeaveRequest { entry } => {
                // Only the sender's own removal, signed by itself: nobody
                // asks another member's removal this way.
                let Some(entry) = own_leave_entry(&entry, sender, group) else {
                    self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                self.handle_request(group, sender, "leave request", move |this| async move {
                    this.commit_leave(group, sender, entry)
                        .await
                        .map_err(DeviceError::from)
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ledger::Hlc;
    use ed25519_dalek::SigningKey;

    fn dev(n: u8) -> (SigningKey, DeviceId) {
        let k = SigningKey::from_bytes(&[n; 32]);
        let id = DeviceId(k.verifying_key().to_bytes());
        (k, id)
    }

    #[test]
    fn a_leave_request_carries_only_the_senders_own_removal() {
        let g = GroupId([7; 32]);
        let (kb, b) = dev(2);
        let (kc, c) = dev(3);
        let entry = |kind, subject: DeviceId, group, key: &SigningKey| {
            Entry::sign(
                kind,
                group,
                subject.0.to_vec(),
                Vec::new(),
                Hlc::default(),
                key,
            )
            .encode()
        };
        let honest = entry(EntryType::MemberRemove, b, g, &kb);
        assert!(own_leave_entry(&honest, b, g).is_some());
        // b asking c's removal; c's entry replayed by b; another group;
        // another kind; a forged signature; garbage.
        for (bytes, why) in [
            (entry(EntryType::MemberRemove, c, g, &kb), "another member"),
            (
                entry(EntryType::MemberRemove, c, g, &kc),
                "someone else's entry",
            ),
            (
                entry(EntryType::MemberRemove, b, GroupId([8; 32]), &kb),
                "another group",
            ),
            (entry(EntryType::AdminGrant, b, g, &kb), "another kind"),
        ] {
            assert!(own_leave_entry(&bytes, b, g).is_none(), "{why}");
        }
        let mut forged = honest.clone();
        if let Some(last) = forged.last_mut() {
            *last ^= 1;
        }
        assert!(own_leave_entry(&forged, b, g).is_none(), "bad signature");
        assert!(own_leave_entry(b"junk", b, g).is_none());
    }
}
