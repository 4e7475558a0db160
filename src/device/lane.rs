//! The commit lane, first form: every commit of a group goes through its
//! commit hub under a compare-and-set on that hub's head, so exactly one
//! commit wins each position.
//!
//! A commit is built against the live handle (staged, no side effects),
//! published with the head the pull just reached, and merged only when the
//! hub accepted it. A lost race drops the staged commit, pulls (which
//! applies the winner) and builds again. Welcomes are queued in the same
//! batch as the merge, so a crash can neither lose them nor send one for a
//! commit that did not land.

use super::error::DeviceError;
use super::frames::{publish_id, WelcomeEnvelope};
use super::identity::{device_id_of, DeviceIdentity};
use super::manager::{hub_error, GroupPeerManager};
use super::records::{GroupId, JournalEntry};
use super::registry::OpProvider;
use super::topics;
use crate::kv::WriteBatch;
use crate::wire::{DeviceId, ExpectedHead, Publish, PublishOutcome, RetentionClass};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What a landed commit did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommitReport {
    /// The group's epoch after the commit.
    pub epoch: u64,
    /// The commit's sequence number on the commit hub's commit topic.
    pub seq: u64,
    /// Builds it took (1 when no other commit won in between).
    pub attempts: u32,
}

/// The states of one commit attempt, in order. A lost race goes from
/// `Published` back to `Idle`; only `Accepted` merges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneState {
    /// Nothing built; the next step pulls the commit topic to its end.
    Idle,
    /// Built against the live handle, staged, not yet durable.
    Built,
    /// The pending commit and its journal entry are durable together.
    Journalled,
    /// Sent with the compare-and-set; waiting for the hub's answer.
    Published,
    /// The hub accepted it: merge, queue Welcomes, persist as one batch.
    Accepted,
}

/// Builds a commit: the commit message and, for an add, the Welcome.
type Build<'a> = dyn FnMut(
        &mut MlsGroup,
        &OpProvider,
        &DeviceIdentity,
    ) -> Result<(MlsMessageOut, Option<MlsMessageOut>), DeviceError>
    + Send
    + 'a;

impl GroupPeerManager {
    /// Invite `device`: claim one of its key packages on the group's hubs,
    /// commit the add, and send it the Welcome once the commit landed.
    ///
    /// # Errors
    /// `AlreadyMember`, `NoKeyPackage`, `RecoveryRequired`, `CommitTimedOut`,
    /// hub, MLS or store errors.
    pub async fn invite(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<CommitReport, DeviceError> {
        if self.members(group).await?.contains(&device) {
            return Err(DeviceError::AlreadyMember { group, device });
        }
        let rec = self.record(group)?;
        let mut hubs = vec![rec.commit_hub.clone()];
        hubs.extend(rec.hubs.iter().filter(|h| **h != rec.commit_hub).cloned());
        let mut key_package = None;
        for hub in &hubs {
            match self.hub_link(hub).claim_key_package(device).await {
                Ok((bytes, _last_resort)) => {
                    let crypto = self.shared.registry.provider().crypto();
                    let kp = KeyPackageIn::tls_deserialize_exact(&bytes)
                        .map_err(|e| DeviceError::Mls(e.to_string()))
                        .and_then(|k| {
                            k.validate(crypto, ProtocolVersion::Mls10)
                                .map_err(|e| DeviceError::Mls(e.to_string()))
                        });
                    match kp {
                        Ok(kp) if device_id_of(kp.leaf_node().credential()) == Some(device) => {
                            key_package = Some(kp);
                            break;
                        }
                        Ok(_) => tracing::warn!(hub, "claimed key package is not the invitee's"),
                        Err(e) => tracing::warn!(hub, error = %e, "claimed key package is invalid"),
                    }
                }
                Err(e) => tracing::debug!(hub, error = %e, "no key package from this hub"),
            }
        }
        let kp = key_package.ok_or(DeviceError::NoKeyPackage(device))?;
        let mut build = move |g: &mut MlsGroup, p: &OpProvider, me: &DeviceIdentity| {
            let (commit, welcome, _info) = g
                .add_members(p, me.signature_key_pair(), std::slice::from_ref(&kp))
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            Ok((commit, Some(welcome)))
        };
        self.commit(group, true, Some(device), &mut build).await
    }

    /// Remove `device` from the group.
    ///
    /// # Errors
    /// `NotAMember`, `RecoveryRequired`, `CommitTimedOut`, hub, MLS or store
    /// errors.
    pub async fn remove(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<CommitReport, DeviceError> {
        let mut build = move |g: &mut MlsGroup, p: &OpProvider, me: &DeviceIdentity| {
            let leaf = g
                .members()
                .find(|m| device_id_of(&m.credential) == Some(device))
                .map(|m| m.index)
                .ok_or(DeviceError::NotAMember { group, device })?;
            let (commit, _welcome, _info) = g
                .remove_members(p, me.signature_key_pair(), &[leaf])
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            Ok((commit, None))
        };
        self.commit(group, true, None, &mut build).await
    }

    /// Update this device's own leaf (post-compromise security).
    ///
    /// # Errors
    /// `RecoveryRequired`, `CommitTimedOut`, hub, MLS or store errors.
    pub async fn rotate(&self, group: GroupId) -> Result<CommitReport, DeviceError> {
        let mut build = |g: &mut MlsGroup, p: &OpProvider, me: &DeviceIdentity| {
            let bundle = g
                .self_update(p, me.signature_key_pair(), LeafNodeParameters::default())
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            Ok((bundle.into_commit(), None))
        };
        self.commit(group, false, None, &mut build).await
    }

    /// Drive one commit through the group's commit hub until it lands or the
    /// deadline passes.
    async fn commit(
        &self,
        group: GroupId,
        roster: bool,
        joiner: Option<DeviceId>,
        build: &mut Build<'_>,
    ) -> Result<CommitReport, DeviceError> {
        let deadline = tokio::time::Instant::now() + self.shared.config.commit_deadline;
        let mut attempts = 0u32;
        loop {
            if tokio::time::Instant::now() >= deadline {
                return Err(DeviceError::CommitTimedOut(group));
            }
            let mut guard = self.shared.registry.lock(group).await;
            let mut rec = self.record(group)?;
            if rec.stranded {
                return Err(DeviceError::RecoveryRequired(group));
            }
            // The pull settles any journalled commit first (step 0).
            let head = match self.pull_locked(&mut guard, &mut rec).await {
                Ok(h) => h,
                Err(DeviceError::Hub { .. }) => {
                    drop(guard);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if rec.stranded {
                return Err(DeviceError::RecoveryRequired(group));
            }
            if self.shared.records.group(&group)?.is_none() {
                return Err(DeviceError::UnknownGroup(group));
            }
            attempts += 1;
            let me = &self.shared.identity;
            let built = guard.with(|g, p| build(g, p, me))?;
            let (commit, welcome) = match built {
                Ok(b) => b,
                Err(e) => {
                    guard.discard();
                    return Err(e);
                }
            };
            let state = step(LaneState::Idle, LaneState::Built);
            let payload = commit
                .tls_serialize_detached()
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            let welcome = match (joiner, welcome) {
                (Some(j), Some(w)) => Some((
                    j,
                    w.tls_serialize_detached()
                        .map_err(|e| DeviceError::Mls(e.to_string()))?,
                )),
                _ => None,
            };
            let topic = topics::commit_topic(&group.0);
            let entry = JournalEntry {
                publish_id: publish_id(&super::frames::digest(&payload), &topic),
                expected_head: head.map(ExpectedHead::Seq).unwrap_or(ExpectedHead::Empty),
                payload,
                roster,
                welcome,
            };
            // The pending commit and its journal entry become durable together
            // before anything leaves the device.
            let mut b = WriteBatch::new();
            self.shared.records.put_journal(&mut b, &group, &entry);
            guard.finish(b)?;
            let state = step(state, LaneState::Journalled);
            if self.shared.faults.halt_after_journal.load(Ordering::SeqCst) {
                return Err(DeviceError::Stopped);
            }
            let link = self.hub_link(&rec.commit_hub);
            let publish = Publish {
                topic: topic.clone(),
                publish_id: entry.publish_id,
                class: RetentionClass::Log,
                expected_head: entry.expected_head,
                replay_only: false,
                retention_secs: None,
                payload: entry.payload.clone(),
            };
            let state = step(state, LaneState::Published);
            // Resend the very same bytes until the hub answers: if an
            // earlier send landed, the hub answers Duplicate with its seq.
            let outcome = loop {
                match link.publish(publish.clone()).await {
                    Ok(o) => break o,
                    Err(e) => {
                        let transient = matches!(
                            super::manager::send_failure(e.clone()),
                            super::outbox::SendFailure::Retry { .. }
                        );
                        if !transient || tokio::time::Instant::now() >= deadline {
                            // The journal stays: the next pull settles it.
                            return Err(hub_error(&rec.commit_hub, e));
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            };
            match outcome {
                PublishOutcome::Accepted { seq, .. } | PublishOutcome::Duplicate { seq } => {
                    step(state, LaneState::Accepted);
                    if self.shared.faults.halt_after_accept.load(Ordering::SeqCst) {
                        return Err(DeviceError::Stopped);
                    }
                    self.settle_accepted(&mut guard, &mut rec, &entry, seq)?;
                    let epoch = guard.read(|g| g.epoch().as_u64())?;
                    drop(guard);
                    self.shared.counters.commits.fetch_add(1, Ordering::Relaxed);
                    return Ok(CommitReport {
                        epoch,
                        seq,
                        attempts,
                    });
                }
                PublishOutcome::HeadMismatch { current }
                    if self.shared.faults.merge_on_mismatch.load(Ordering::Relaxed) =>
                {
                    // Test fault: adopt our commit though another won.
                    self.settle_accepted(&mut guard, &mut rec, &entry, current.unwrap_or(0))?;
                    let epoch = guard.read(|g| g.epoch().as_u64())?;
                    return Ok(CommitReport {
                        epoch,
                        seq: current.unwrap_or(0),
                        attempts,
                    });
                }
                PublishOutcome::HeadMismatch { .. } | PublishOutcome::HistoryMissing => {
                    step(state, LaneState::Idle);
                    self.shared
                        .counters
                        .lost_races
                        .fetch_add(1, Ordering::Relaxed);
                    self.settle_lost(&mut guard, &group)?;
                }
            }
        }
    }

    /// The hub accepted the journalled commit at `seq`: merge it, queue the
    /// Welcome, clear the journal, all in one batch.
    fn settle_accepted(
        &self,
        guard: &mut super::registry::GroupGuard,
        rec: &mut super::records::GroupRecord,
        entry: &JournalEntry,
        seq: u64,
    ) -> Result<(), DeviceError> {
        guard.merge_pending()?;
        rec.commit_cursor = rec.commit_cursor.max(seq);
        let mut b = WriteBatch::new();
        if let Some((joiner, welcome)) = &entry.welcome {
            self.stage_welcome(&mut b, rec, seq, *joiner, welcome)?;
        }
        self.shared.records.clear_journal(&mut b, &rec.id);
        self.after_merge(guard, rec, entry.roster, b)?;
        self.shared.outbox.wake();
        Ok(())
    }

    /// The journalled commit did not land: drop the pending commit and the
    /// journal together.
    fn settle_lost(
        &self,
        guard: &mut super::registry::GroupGuard,
        group: &GroupId,
    ) -> Result<(), DeviceError> {
        guard
            .with(|g, p| g.clear_pending_commit(p.storage()))?
            .map_err(|e| DeviceError::Store(e.to_string()))?;
        let mut b = WriteBatch::new();
        self.shared.records.clear_journal(&mut b, group);
        guard.finish(b)?;
        Ok(())
    }

    /// Step 0 of every pull and commit: a journalled commit is re-published
    /// `replay_only` under its original id and head. Accepted (or duplicate):
    /// adopt it. History missing: it was lost, drop it.
    ///
    /// # Errors
    /// A hub error when the commit hub cannot answer; the journal stays.
    pub(super) async fn replay_journal(
        &self,
        guard: &mut super::registry::GroupGuard,
        rec: &mut super::records::GroupRecord,
    ) -> Result<(), DeviceError> {
        let Some(entry) = self.shared.records.journal(&rec.id)? else {
            return Ok(());
        };
        let topic = topics::commit_topic(&rec.id.0);
        let publish = Publish {
            topic,
            publish_id: entry.publish_id,
            class: RetentionClass::Log,
            expected_head: entry.expected_head,
            replay_only: true,
            retention_secs: None,
            payload: entry.payload.clone(),
        };
        let outcome = self
            .hub_link(&rec.commit_hub)
            .publish(publish)
            .await
            .map_err(|e| hub_error(&rec.commit_hub, e))?;
        match outcome {
            PublishOutcome::Accepted { seq, .. } | PublishOutcome::Duplicate { seq } => {
                tracing::info!(group = %rec.id, seq, "journalled commit had landed; adopted");
                self.settle_accepted(guard, rec, &entry, seq)
            }
            PublishOutcome::HistoryMissing | PublishOutcome::HeadMismatch { .. } => {
                tracing::warn!(group = %rec.id, "journalled commit never landed; dropped");
                self.settle_lost(guard, &rec.id)
            }
        }
    }

    fn stage_welcome(
        &self,
        b: &mut WriteBatch,
        rec: &super::records::GroupRecord,
        seq: u64,
        joiner: DeviceId,
        welcome: &[u8],
    ) -> Result<(), DeviceError> {
        let me = &self.shared.identity;
        let env = WelcomeEnvelope {
            group: rec.id,
            hubs: rec.hubs.clone(),
            commit_hub: rec.commit_hub.clone(),
            commit_seq: seq,
            welcome: welcome.to_vec(),
            inviter: me.id(),
            signature: Vec::new(),
        }
        .sign(me.signing_key());
        let topic = topics::welcome_topic(&joiner);
        let mut op = b"welcome".to_vec();
        op.extend_from_slice(&rec.id.0);
        op.extend_from_slice(&seq.to_be_bytes());
        let publish = Publish {
            topic: topic.clone(),
            publish_id: publish_id(&op, &topic),
            class: RetentionClass::Mailbox,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: None,
            payload: env.encode(),
        };
        for hub in &rec.hubs {
            self.shared
                .outbox
                .stage(b, hub, &publish)
                .map_err(|e| DeviceError::Store(e.to_string()))?;
        }
        Ok(())
    }
}

/// Record a lane transition in the trace (the order is the state machine's).
fn step(from: LaneState, to: LaneState) -> LaneState {
    tracing::trace!(?from, ?to, "commit lane");
    to
}
