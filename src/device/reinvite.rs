//! A member the roster lists but that never joined: asking to be invited
//! again, and answering.
//!
//! A hub restored from a backup hands out key packages that were claimed
//! and used since (the device replaces its pool there once it is back on
//! that hub, but an invite can come first). A Welcome built on such a
//! package can never be read: the joiner deleted the package's private key
//! when it used it. The commit that added the joiner has landed, so the
//! roster lists a member that holds nothing of the group.
//!
//! The joiner, seeing that its Welcome names a package it holds no keys
//! for, first makes sure its own hubs hold only packages it has keys for
//! (replacing the pool where a restore brought dead ones back), then posts
//! a [`ReinviteRequest`] signed with its device key to the inviter's
//! Welcome mailbox on the group's hubs. The inviter acts on a request only
//! when it names the very Welcome the inviter keeps for that joiner (one
//! per member, kept while the joiner is a member), so a stranger cannot
//! forge one (the joiner's signature), a replay does nothing once the
//! joiner was invited again (another Welcome is kept), and only the joiner
//! can have its own leaf replaced. The inviter then removes the dead leaf
//! and invites the joiner again, each as a commit with the remedies.

use super::error::DeviceError;
use super::frames::{digest, ReinviteRequest, WelcomeEnvelope};
use super::lane::{CommitError, LaneResult};
use super::manager::GroupPeerManager;
use super::records::GroupId;
use super::topics;
use crate::wire::{DeviceId, ExpectedHead, Publish, RetentionClass};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long an inviter keeps trying to invite a joiner again when the
/// joiner's hubs hold no key package of it yet.
const REINVITE_PATIENCE: Duration = Duration::from_secs(60);

/// Pause between those tries.
const REINVITE_RETRY: Duration = Duration::from_secs(1);

impl GroupPeerManager {
    /// As the joiner: ask `inviter` to invite this device into `group`
    /// again, on a task of its own ([`Self::ask_reinvite`]).
    pub(super) fn ask_reinvite_in_background(
        &self,
        group: GroupId,
        inviter: DeviceId,
        welcome_digest: [u8; 32],
        hubs: Vec<String>,
    ) {
        let me = self.clone();
        self.shared.tasks.spawn(async move {
            if let Err(e) = me.ask_reinvite(group, inviter, welcome_digest, &hubs).await {
                tracing::warn!(%group, error = %e, "asking to be invited again failed");
            }
        });
    }

    /// As the joiner: replace dead key packages on this device's own hubs,
    /// then owe `inviter` a signed request on each of `hubs` (the group's,
    /// as the Welcome named them). Counted in `reinvites_asked`.
    ///
    /// # Errors
    /// The outbox's, when the request could not be made durable.
    pub(super) async fn ask_reinvite(
        &self,
        group: GroupId,
        inviter: DeviceId,
        welcome_digest: [u8; 32],
        hubs: &[String],
    ) -> Result<(), DeviceError> {
        let own: Vec<String> = super::manager::lock(&self.shared.own_hubs).clone();
        for hub in own.iter().filter(|h| !super::lane::is_loopback(h)) {
            // Best effort: a hub not reached now replaces its pool when the
            // link comes back; the inviter's next try may then find one.
            if let Err(e) = self.restock_key_packages(&self.hub_link(hub)).await {
                tracing::debug!(hub, error = %e, "key packages not checked before asking to be invited again");
            }
        }
        let me = &self.shared.identity;
        let request = ReinviteRequest {
            group,
            joiner: me.id(),
            inviter,
            welcome_digest,
            signature: Vec::new(),
        }
        .sign(me.signing_key());
        let topic = topics::welcome_topic(&inviter);
        let mut op = b"reinvite".to_vec();
        op.extend_from_slice(&group.0);
        op.extend_from_slice(&welcome_digest);
        let publish = Publish {
            topic: topic.clone(),
            publish_id: super::frames::publish_id(&op, &topic),
            class: RetentionClass::Mailbox,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: None,
            payload: request.encode(),
            writer: None,
        };
        for hub in hubs.iter().filter(|h| !super::lane::is_loopback(h)) {
            self.shared
                .outbox
                .enqueue(hub, publish.clone())
                .map_err(|e| DeviceError::Store(e.to_string()))?;
        }
        self.shared
            .counters
            .reinvites_asked
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(%group, "a Welcome named a key package this device no longer holds: asked the inviter to invite it again");
        Ok(())
    }

    /// As the inviter: answer a request from the Welcome mailbox on a task
    /// of its own ([`Self::answer_reinvite`]); a refusal is counted in
    /// `reinvites_refused`.
    pub(super) fn answer_reinvite_in_background(&self, payload: Vec<u8>) {
        let me = self.clone();
        self.shared.tasks.spawn(async move {
            match me.answer_reinvite(&payload).await {
                Ok(_) => {
                    me.shared
                        .counters
                        .reinvites_answered
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(reason) => {
                    me.shared
                        .counters
                        .reinvites_refused
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%reason, "a request to invite a device again was refused");
                }
            }
        });
    }

    /// As the inviter: check a request (the joiner's signature, addressed
    /// to this device, naming the Welcome this device keeps for that
    /// joiner in that group), then remove the joiner's leaf and invite it
    /// again. Answers the invite's result.
    ///
    /// # Errors
    /// Why the request was refused or could not be carried out.
    pub(super) async fn answer_reinvite(&self, payload: &[u8]) -> Result<LaneResult, String> {
        let req = ReinviteRequest::open(payload).map_err(|e| e.to_string())?;
        if req.inviter != self.shared.identity.id() {
            return Err("addressed to another inviter".into());
        }
        let group = req.group;
        let kept = self
            .shared
            .records
            .invited_welcomes(&group)
            .map_err(|e| e.to_string())?;
        let ours = kept.iter().any(|(joiner, publish)| {
            *joiner == req.joiner
                && WelcomeEnvelope::open(&publish.payload)
                    .is_ok_and(|env| digest(&env.welcome) == req.welcome_digest)
        });
        if !ours {
            return Err(format!(
                "names no Welcome this device keeps for {:?} in group {group}",
                req.joiner
            ));
        }
        // Each try's future owns a handle of the manager, so the whole
        // answer can run on a task of its own.
        let joiner = req.joiner;
        let remove = || {
            let me = self.clone();
            async move { me.remove(group, joiner).await }
        };
        match self.commit_with_recovery(group, remove).await {
            Ok(_) => {}
            // Someone else removed it meanwhile: invite it all the same.
            Err(CommitError::NotAMember { .. }) => {}
            Err(e) => return Err(format!("removing the dead leaf: {e}")),
        }
        let until = tokio::time::Instant::now() + REINVITE_PATIENCE;
        loop {
            let invite = || {
                let me = self.clone();
                async move { me.invite(group, joiner).await }
            };
            match self.commit_with_recovery(group, invite).await {
                Ok(r) => return Ok(r),
                Err(CommitError::NoKeyPackage(_)) if tokio::time::Instant::now() < until => {
                    tokio::time::sleep(REINVITE_RETRY).await;
                }
                Err(e) => return Err(format!("inviting again: {e}")),
            }
        }
    }
}
