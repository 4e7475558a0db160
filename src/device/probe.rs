//! The epoch probe: how a member learns that its group moved on when the
//! only log that could have told it was rewound.
//!
//! A hub restored from a backup can lose commits nobody still holds to give
//! back. A member that had not read them re-reads the rewound log, finds it
//! ends at its own epoch, and has no evidence that it is behind: it would
//! wait there for ever, while the group commits on a topic it cannot
//! compute. The same holds for a device that joins from a Welcome its
//! inviter posted again after a restore, on a commit log the restore
//! emptied. So a member that finds its current commit log rewound, and a
//! device that joined from a Welcome, asks the group, on the rendezvous
//! mailbox (whose topic never rotates):
//!
//! 1. It posts an [`EpochProbe`]: its device id, its epoch, a fresh nonce
//!    and the few members of its own view it asks this round
//!    ([`ASKED_PER_ROUND`]), signed with its device key; every 2 s it asks
//!    the next few, until one answers or 10 s pass. So a probe costs a few
//!    answers whatever the group's size.
//! 2. A member it named waits a random 0-[`ANSWER_JITTER_MS`] ms, reads
//!    its commit log, and answers an [`EpochStatus`] (its epoch, signed
//!    with its device key) if it sees the prober in its tree, or the signed
//!    [`RejoinRefusal`](super::rejoin::RejoinRefusal) of a rejoin if not. A
//!    member behind the prober's epoch (its tree would be stale) or left
//!    behind itself stays silent.
//! 3. A status from a member of the prober's view at a later epoch that the
//!    prober cannot reach by reading its log, or a refusal from one,
//!    strands the prober; the background heal then rejoins it (or learns
//!    that it was removed). Statuses at its epoch or earlier change
//!    nothing. A log the prober cannot read for the whole deadline judges
//!    nothing either: a member one commit ahead may just have committed
//!    what the prober has yet to read.
//!
//! A probe is owed from its cause until one concludes, and that is kept
//! in the group's record: a probe cut short by a stop, met with silence or
//! unable to read its log runs again (with backoff while the device runs,
//! and at its next start).
//!
//! Who may do what: a probe is signed by the device it names; a status or a
//! refusal counts only signed by a member of the prober's view. A member
//! removed after the prober fell behind is still in that view and can make
//! it strand by lying; the rejoin that follows is answered by the real
//! members, so the lie costs one external commit and no state.

use super::error::DeviceError;
use super::identity::verify_by;
use super::manager::{lock, GroupPeerManager};
use super::records::GroupId;
use super::rejoin::{Incoming, RejoinRefusal, RendezvousFrame, ANSWER_JITTER_MS};
use super::topics;
use crate::wire::DeviceId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Signature domain of an [`EpochProbe`].
const PROBE_DOMAIN: &[u8] = b"hubsync epoch probe v1";

/// Signature domain of an [`EpochStatus`].
const STATUS_DOMAIN: &[u8] = b"hubsync epoch status v1";

/// How long a probe waits for statuses.
const PROBE_DEADLINE: Duration = Duration::from_secs(10);

/// How long a probe waits between reads of a log it could not read.
const PULL_RETRY: Duration = Duration::from_secs(1);

/// How long a background probe that settled nothing (nobody answered,
/// its log unreadable) waits before it asks again; doubled each time.
const RETRY_FIRST: Duration = Duration::from_secs(5);

/// The longest wait between the asks of an owed probe: a group whose other
/// members are all away costs one probe per member asked this often.
const RETRY_MAX: Duration = Duration::from_secs(600);

/// How often a probe asks the next members of its view.
const ROUND_INTERVAL: Duration = Duration::from_secs(2);

/// Members asked per round: a few, so that a probe costs a few answers
/// whatever the group's size.
pub const ASKED_PER_ROUND: usize = 3;

/// Statuses and refusals one probe queues before it reads them.
const INCOMING_QUEUE: usize = 16;

/// "I am `device` in `group`, at `epoch`: you whom I name, at which epoch
/// are you?"
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochProbe {
    /// The group.
    pub group: GroupId,
    /// The prober.
    pub device: DeviceId,
    /// Ties statuses to this probe (the same in every round of one probe).
    pub nonce: [u8; 16],
    /// The prober's epoch.
    pub epoch: u64,
    /// The members asked this round (at most [`ASKED_PER_ROUND`]), from
    /// the prober's own view; nobody else answers.
    pub ask: Vec<DeviceId>,
    /// ed25519 by `device` over [`EpochProbe::signed_bytes`].
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

impl EpochProbe {
    /// What the signature covers: the domain, then group, device, nonce,
    /// epoch (8 bytes, big-endian) and each asked member's id.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut m = PROBE_DOMAIN.to_vec();
        m.extend_from_slice(&self.group.0);
        m.extend_from_slice(&self.device.0);
        m.extend_from_slice(&self.nonce);
        m.extend_from_slice(&self.epoch.to_be_bytes());
        for d in &self.ask {
            m.extend_from_slice(&d.0);
        }
        m
    }

    /// Whether `device` signed it.
    pub fn verify(&self) -> bool {
        verify_by(&self.device, &self.signed_bytes(), &self.signature)
    }
}

/// A member's answer to a probe: the epoch it is at.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochStatus {
    /// The group.
    pub group: GroupId,
    /// The probe's nonce.
    pub nonce: [u8; 16],
    /// The prober.
    pub to: DeviceId,
    /// The answering member.
    pub from: DeviceId,
    /// The member's epoch.
    pub epoch: u64,
    /// ed25519 by `from` over [`EpochStatus::signed_bytes`].
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

impl EpochStatus {
    /// What the signature covers: the domain, then group, nonce, `to` and
    /// the epoch (8 bytes, big-endian).
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut m = STATUS_DOMAIN.to_vec();
        m.extend_from_slice(&self.group.0);
        m.extend_from_slice(&self.nonce);
        m.extend_from_slice(&self.to.0);
        m.extend_from_slice(&self.epoch.to_be_bytes());
        m
    }
}

/// What a probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// A member of this device's view is at a later epoch: the group moved
    /// on without it.
    Behind {
        /// That member.
        told_by: DeviceId,
        /// Its epoch.
        epoch: u64,
    },
    /// Members of this device's view say it is not in their tree.
    Refused {
        /// Those members.
        by: Vec<DeviceId>,
    },
    /// The members that answered are at this device's epoch or earlier.
    InStep,
    /// A member is at a later epoch, but this device could not read its
    /// own commit log to see whether that commit is there for it to apply
    /// (the hub unreachable for the whole deadline): nothing was judged,
    /// and the probe stays owed.
    LogUnreadable {
        /// The epoch the member said.
        epoch: u64,
    },
    /// Nobody of this device's view answered before the deadline (or there
    /// is nobody else to ask).
    NoAnswer,
}

impl GroupPeerManager {
    /// Ask the group's members at which epoch they are, and strand the
    /// group here when one of them is further on, or says this device is
    /// not in its tree (the background heal then rejoins it). Run when this
    /// device's current commit log was found rewound.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub async fn probe_epoch(&self, group: GroupId) -> Result<ProbeOutcome, DeviceError> {
        let rec = self.record(group)?;
        let Some(seed) = rec.rendezvous_seed else {
            // No mailbox to ask on (a record from before the seed was
            // kept): nothing a later probe could do better.
            self.settle_probe(group).await?;
            return Ok(ProbeOutcome::NoAnswer);
        };
        if rec.stranded {
            // The rejoin that heals it answers what a probe would.
            self.settle_probe(group).await?;
            return Ok(ProbeOutcome::NoAnswer);
        }
        let me = self.shared.identity.id();
        let (own, others) = {
            let mut guard = self.shared.registry.lock(group).await;
            let own = guard.read(|g| g.epoch().as_u64())?;
            let others: BTreeSet<DeviceId> = self
                .member_set(&mut guard)?
                .into_iter()
                .filter(|d| *d != me)
                .collect();
            (own, others)
        };
        if others.is_empty() {
            // Nobody can be further on than the only member.
            self.settle_probe(group).await?;
            return Ok(ProbeOutcome::NoAnswer);
        }
        let mut nonce = [0u8; 16];
        self.shared.rng.fill(&mut nonce);
        // Asked in an order of this device's choosing, a few per round.
        let mut queue: Vec<DeviceId> = others.iter().copied().collect();
        for i in (1..queue.len()).rev() {
            let j = (self.shared.rng.next_u64() % (i as u64 + 1)) as usize;
            queue.swap(i, j);
        }
        let mut queue = queue.into_iter();
        let (tx, mut rx) = mpsc::channel(INCOMING_QUEUE);
        lock(&self.shared.rejoins).insert((group, nonce), tx);
        let rendezvous = topics::rendezvous_topic(&seed);
        let routes: Vec<String> = rec
            .routes()
            .into_iter()
            .filter(|h| !super::lane::is_loopback(h))
            .collect();
        let deadline = Instant::now() + PROBE_DEADLINE;
        let mut next_round = Instant::now();
        let mut in_step = false;
        let mut refused = BTreeSet::new();
        let outcome = loop {
            if Instant::now() >= next_round {
                // A member at this epoch answered in the round that ended,
                // and none further on: in step.
                if in_step {
                    break ProbeOutcome::InStep;
                }
                let ask: Vec<DeviceId> = queue.by_ref().take(ASKED_PER_ROUND).collect();
                // Everyone asked: wait out the last round's answers.
                next_round = if ask.is_empty() {
                    deadline
                } else {
                    Instant::now() + ROUND_INTERVAL
                };
                if !ask.is_empty() {
                    // Another asked in this round may be further on: an
                    // answer at this epoch ends the probe at the round's
                    // end, not before.
                    let mut probe = EpochProbe {
                        group,
                        device: me,
                        nonce,
                        epoch: own,
                        ask,
                        signature: Vec::new(),
                    };
                    probe.signature = self
                        .shared
                        .identity
                        .sign(&probe.signed_bytes())
                        .to_bytes()
                        .to_vec();
                    let frame = postcard::to_allocvec(&RendezvousFrame::Probe(probe))
                        .map_err(|e| DeviceError::Mls(e.to_string()))?;
                    for hub in &routes {
                        if let Err(e) = self.post_rendezvous(hub, &rendezvous, &frame).await {
                            tracing::debug!(%group, hub, error = %e, "epoch probe not posted");
                        }
                    }
                }
            }
            let until = next_round.min(deadline);
            let got = match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some(got)) => got,
                Ok(None) => break ProbeOutcome::NoAnswer,
                Err(_) if Instant::now() >= deadline => {
                    break if !refused.is_empty() {
                        ProbeOutcome::Refused {
                            by: refused.into_iter().collect(),
                        }
                    } else if in_step {
                        ProbeOutcome::InStep
                    } else {
                        ProbeOutcome::NoAnswer
                    };
                }
                Err(_) => continue,
            };
            match got {
                Incoming::Status { from, epoch } if others.contains(&from) => {
                    if epoch > own {
                        break ProbeOutcome::Behind {
                            told_by: from,
                            epoch,
                        };
                    }
                    in_step = true;
                }
                // A member behind this device may not have merged the
                // commit that added it: its refusal says nothing.
                Incoming::Refusal { from, epoch } if others.contains(&from) && epoch >= own => {
                    refused.insert(from);
                }
                _ => {}
            }
        };
        lock(&self.shared.rejoins).remove(&(group, nonce));
        let outcome = match outcome {
            // A member a commit ahead may just have committed what this
            // device has yet to read: read the log before believing it.
            // A log this device cannot read now proves nothing either way
            // (a partition, a hub restarting): it is read again for a
            // while, and if it stays unreadable nothing is judged.
            ProbeOutcome::Behind { epoch, .. } => {
                let until = Instant::now() + PROBE_DEADLINE;
                let read = loop {
                    match self.pull(group).await {
                        Ok(_) => break true,
                        Err(e) if Instant::now() + PULL_RETRY < until => {
                            tracing::debug!(%group, error = %e, "pull after an epoch status failed: reading again");
                            tokio::time::sleep(PULL_RETRY).await;
                        }
                        Err(e) => {
                            tracing::debug!(%group, error = %e, "pull after an epoch status failed");
                            break false;
                        }
                    }
                };
                if !read {
                    return Ok(ProbeOutcome::LogUnreadable { epoch });
                }
                let now = {
                    let mut guard = self.shared.registry.lock(group).await;
                    guard.read(|g| g.epoch().as_u64())?
                };
                if now >= epoch || self.record(group)?.stranded {
                    ProbeOutcome::InStep
                } else {
                    outcome
                }
            }
            other => other,
        };
        if matches!(
            outcome,
            ProbeOutcome::Behind { .. } | ProbeOutcome::Refused { .. }
        ) {
            tracing::warn!(%group, ?outcome, "the group moved on without this device");
            self.strand_group(group).await?;
        }
        // Silence or an unreadable log settles nothing: the probe stays
        // owed, for the next start or rewind.
        if !matches!(
            outcome,
            ProbeOutcome::NoAnswer | ProbeOutcome::LogUnreadable { .. }
        ) {
            self.settle_probe(group).await?;
        }
        Ok(outcome)
    }

    /// A probe of `group` concluded: none is owed any more.
    async fn settle_probe(&self, group: GroupId) -> Result<(), DeviceError> {
        let mut guard = self.shared.registry.lock(group).await;
        let mut rec = self.record(group)?;
        if rec.probe_owed {
            rec.probe_owed = false;
            self.save_record(&mut guard, &rec)?;
        }
        Ok(())
    }

    /// Answer `p`, which names this device, after a random wait: this
    /// device's epoch if the prober is in its tree, a signed refusal if
    /// not; nothing while this device is behind the prober (it would judge
    /// from a stale tree) or left behind itself.
    pub(super) async fn answer_probe(
        &self,
        group: GroupId,
        hub: &str,
        p: EpochProbe,
    ) -> Result<(), DeviceError> {
        let jitter = self.shared.rng.next_u64() % (ANSWER_JITTER_MS + 1);
        tokio::time::sleep(Duration::from_millis(jitter)).await;
        self.read_before_answering(group).await;
        let me = &self.shared.identity;
        let mut guard = self.shared.registry.lock(group).await;
        let rec = self.record(group)?;
        let epoch = guard.read(|g| g.epoch().as_u64())?;
        if rec.stranded || epoch < p.epoch {
            return Ok(());
        }
        let frame = if self.member_set(&mut guard)?.contains(&p.device) {
            drop(guard);
            let mut s = EpochStatus {
                group,
                nonce: p.nonce,
                to: p.device,
                from: me.id(),
                epoch,
                signature: Vec::new(),
            };
            s.signature = me.signature_over(&s.signed_bytes());
            RendezvousFrame::Status(s)
        } else {
            drop(guard);
            let mut f = RejoinRefusal {
                group,
                nonce: p.nonce,
                to: p.device,
                from: me.id(),
                epoch,
                signature: Vec::new(),
            };
            f.signature = me.signature_over(&f.signed_bytes());
            RendezvousFrame::Refusal(f)
        };
        let Some(seed) = rec.rendezvous_seed else {
            return Ok(());
        };
        let bytes = postcard::to_allocvec(&frame).map_err(|e| DeviceError::Mls(e.to_string()))?;
        self.post_rendezvous(hub, &topics::rendezvous_topic(&seed), &bytes)
            .await
            .map_err(|e| DeviceError::Hub {
                url: hub.to_string(),
                reason: format!("posting the epoch status: {e}"),
            })
    }

    /// A status on the rendezvous mailbox: handed to this device's own
    /// waiting probe when it answers that.
    pub(super) fn on_status(&self, group: GroupId, s: EpochStatus) {
        if s.group != group {
            return;
        }
        if s.to == self.shared.identity.id() && verify_by(&s.from, &s.signed_bytes(), &s.signature)
        {
            if let Some(tx) = lock(&self.shared.rejoins).get(&(group, s.nonce)) {
                let _ = tx.try_send(Incoming::Status {
                    from: s.from,
                    epoch: s.epoch,
                });
            }
        }
    }

    /// After this device's current commit log of `group` was found
    /// rewound, after it joined from a Welcome that may be old, or when it
    /// starts with a probe owed ([`GroupRecord::probe_owed`]): read the
    /// log again (giving back what it lost), then probe, once at a time per
    /// group, in the background. Asked while a probe runs, the probe runs
    /// once more after it (the new cause may postdate what the running one
    /// read). While the probe stays owed (nobody answered, the log could
    /// not be read) it runs again after [`RETRY_FIRST`], doubling to
    /// [`RETRY_MAX`]. A probe that fails is counted; the next rewind found
    /// or the next start probes again.
    ///
    /// [`GroupRecord::probe_owed`]: super::records::GroupRecord::probe_owed
    pub(crate) fn probe_in_background(&self, group: GroupId) {
        {
            let mut probing = lock(&self.shared.probing);
            if let Some(again) = probing.get_mut(&group) {
                *again = true;
                return;
            }
            probing.insert(group, false);
        }
        let me = self.clone();
        self.shared.tasks.spawn(async move {
            let stop = me.shared.shutdown.clone();
            let mut wait = RETRY_FIRST;
            loop {
                let work = async {
                    if let Err(e) = me.pull(group).await {
                        tracing::debug!(%group, error = %e, "pull before an epoch probe failed");
                    }
                    me.probe_epoch(group).await
                };
                let result = tokio::select! {
                    _ = stop.cancelled() => break,
                    r = work => r,
                };
                if let Err(e) = &result {
                    me.shared
                        .counters
                        .control_failures
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(%group, error = %e, "epoch probe failed");
                }
                let asked = lock(&me.shared.probing)
                    .get_mut(&group)
                    .is_some_and(std::mem::take);
                if asked {
                    wait = RETRY_FIRST;
                    continue;
                }
                let owed = match me.record(group) {
                    Ok(r) => r.probe_owed,
                    // The group is gone: nothing is owed.
                    Err(DeviceError::UnknownGroup(_)) => false,
                    // Still owed in the record: the next start runs it.
                    Err(e) => {
                        me.shared
                            .counters
                            .control_failures
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(%group, error = %e, "whether a probe is still owed could not be read");
                        false
                    }
                };
                if result.is_err() || !owed {
                    break;
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(RETRY_MAX);
            }
            lock(&me.shared.probing).remove(&group);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer as _, SigningKey};

    #[test]
    fn a_probe_verifies_only_as_signed_by_the_device_it_names() {
        let k = SigningKey::from_bytes(&[5; 32]);
        let other = SigningKey::from_bytes(&[6; 32]);
        let mut p = EpochProbe {
            group: GroupId([1; 32]),
            device: DeviceId(k.verifying_key().to_bytes()),
            nonce: [2; 16],
            epoch: 3,
            ask: vec![DeviceId([8; 32])],
            signature: Vec::new(),
        };
        p.signature = k.sign(&p.signed_bytes()).to_bytes().to_vec();
        assert!(p.verify());
        let mut forged = p.clone();
        forged.signature = other.sign(&p.signed_bytes()).to_bytes().to_vec();
        assert!(!forged.verify());
        let mut changed = p.clone();
        changed.nonce = [3; 16];
        assert!(!changed.verify());
        let mut asked_more = p.clone();
        asked_more.ask.push(DeviceId([9; 32]));
        assert!(!asked_more.verify(), "the asked list is signed");
    }

    #[test]
    fn a_status_signature_covers_its_epoch() {
        let k = SigningKey::from_bytes(&[7; 32]);
        let mut s = EpochStatus {
            group: GroupId([1; 32]),
            nonce: [2; 16],
            to: DeviceId([9; 32]),
            from: DeviceId(k.verifying_key().to_bytes()),
            epoch: 4,
            signature: Vec::new(),
        };
        s.signature = k.sign(&s.signed_bytes()).to_bytes().to_vec();
        assert!(verify_by(&s.from, &s.signed_bytes(), &s.signature));
        s.epoch = 40;
        assert!(!verify_by(&s.from, &s.signed_bytes(), &s.signature));
    }
}
