//! The deep remedy: a device the group left behind (offline past the commit
//! log's depth, or the loser of a fork) rejoins by external commit
//! (DESIGN.md section 4, "recover"; docs/protocol.md section 27).
//!
//! 1. The requester posts a [`RejoinRequest`] on the group's **rendezvous
//!    mailbox** ([`topics::rendezvous_topic`], from the topic seed, which
//!    never rotates, so a member stranded at any epoch still finds it) on
//!    every hub it knows for the group: its device id, a fresh nonce and a
//!    fresh HPKE public key, signed with its device key.
//! 2. A member that still sees the requester in its tree waits a random
//!    0-[`ANSWER_JITTER_MS`] ms, then seals a [`Grant`] to that key: a
//!    GroupInfo of its current epoch with the ratchet tree, and the commit
//!    hub, commit seed and head of the commit log where that epoch's next
//!    commit goes. It posts the [`RejoinAnswer`] on the same mailbox; a
//!    member that sees another's answer to the request first drops its own.
//!    A member that does not see the requester in its tree posts a signed
//!    [`RejoinRefusal`] instead.
//! 3. The requester deletes its old state of the group and joins by
//!    external commit (which removes its own old leaf, RFC 9420 section
//!    12.4.3.2), published on that commit log under the compare-and-set on
//!    the head the member named. A lost race (or no answer from the hub)
//!    puts the old state back and asks again, until the deadline.
//! 4. Once in, it asks for the ledger in the new epoch (a member's answer is
//!    the confirmation that the rejoin was seen) and issues again, once, its
//!    own ledger entries the group's ledger lacks (`reenact`).
//!
//! Who may do what: a request is signed by the device it names, and only a
//! device in the answering member's tree gets a GroupInfo (a removed
//! device gets refusals at most); the GroupInfo is sealed to the request's
//! key, so nobody else on the mailbox (a former member, the hub) reads it;
//! members judge the external commit like any commit, and take it only
//! from a member re-adding its own leaf (`lane::pull`).

use super::error::DeviceError;
use super::events::Event;
use super::frames::{digest, publish_id};
use super::identity::verify_by;
use super::ledger::{Entry, EntryType, GroupExt, LedgerState};
use super::manager::{lock, GroupPeerManager};
use super::mls;
use super::records::{GroupId, MergedCommit};
use super::topics;
use crate::kv::WriteBatch;
use crate::wire::{DeviceId, ExpectedHead, Publish, PublishOutcome, RetentionClass, TopicId};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::types::HpkeCiphertext;
use openmls_traits::OpenMlsProvider;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The HPKE `info` of a sealed [`Grant`].
pub(super) const GRANT_INFO: &[u8] = b"hubsync rejoin answer v1";

/// What a request's signature covers, after this domain.
const REQUEST_DOMAIN: &[u8] = b"hubsync rejoin request v1";

/// What a refusal's signature covers, after this domain.
const REFUSAL_DOMAIN: &[u8] = b"hubsync rejoin refusal v1";
/// The domain of a rejoin answer's signature.
const ANSWER_DOMAIN: &[u8] = b"hubsync rejoin answer signature v1";

/// How long a rendezvous frame waits at a hub for a subscriber that is
/// away: past it the request is stale anyway.
const RENDEZVOUS_RETENTION_SECS: u64 = 60;

/// A member's answer to a rejoin request in the making: cancelled when
/// another member's answer from at least `epoch` is seen.
pub(crate) struct Answering {
    /// Cancels the answer.
    pub cancel: CancellationToken,
    /// This member's epoch when it took the request (`u64::MAX` until read).
    pub epoch: AtomicU64,
    /// The members of its tree then (set with the epoch): only their
    /// answers cancel this one.
    pub members: std::sync::OnceLock<BTreeSet<DeviceId>>,
}

/// How long a requester, holding a usable answer, waits for answers from
/// further on before it joins with the furthest.
pub const ANSWER_COLLECT: Duration = Duration::from_millis(300);

/// The longest a member waits before answering a rejoin request (a random
/// wait from 0 to this), so that usually one member answers and the others
/// see its answer and drop theirs.
pub const ANSWER_JITTER_MS: u64 = 250;

/// How often the requester asks again while nothing it could use came.
const ASK_INTERVAL: Duration = Duration::from_secs(2);

/// The first wait before a background rejoin tries again after a failed
/// one; it doubles each time, up to [`HEAL_BACKOFF_MAX`].
const HEAL_BACKOFF_MIN: Duration = Duration::from_secs(5);

/// The longest wait between background rejoin attempts.
const HEAL_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// Answers and refusals one request queues before the requester reads
/// them; more are dropped (a member's answer is one of many alike).
const INCOMING_QUEUE: usize = 16;

/// A frame on a group's rendezvous mailbox (postcard).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RendezvousFrame {
    /// A device asks to rejoin.
    Request(RejoinRequest),
    /// A member's GroupInfo for it, sealed.
    Answer(RejoinAnswer),
    /// A member does not see the requester in its tree.
    Refusal(RejoinRefusal),
    /// A member asks at which epoch the others are
    /// ([`super::probe`]).
    Probe(super::probe::EpochProbe),
    /// A member's answer to a probe.
    Status(super::probe::EpochStatus),
    /// A member says where it is ([`super::presence`]).
    Presence(super::presence::PresenceBeacon),
}

/// "I am `device`, left behind in `group`: seal me a GroupInfo to this key."
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejoinRequest {
    /// The group.
    pub group: GroupId,
    /// The requester.
    pub device: DeviceId,
    /// Ties answers to this request.
    pub nonce: [u8; 16],
    /// A fresh HPKE public key (the group's ciphersuite's KEM).
    #[serde(with = "serde_bytes")]
    pub hpke_public: Vec<u8>,
    /// The branch the requester knows it lost, if it drew commit seeds on
    /// it: members on that branch learn from it that they lost it too.
    pub lost: Option<LostBranch>,
    /// ed25519 by `device` over [`RejoinRequest::signed_bytes`].
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

/// A branch of the group its requester lost: a member's commit took the
/// place of the requester's, framed in epoch `from - 1`, on a log the
/// requester no longer read, while it (and any member it brought along)
/// went on at epochs only that branch has.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostBranch {
    /// The branch's first epoch.
    pub from: u64,
    /// [`lost_branch_mark`] of each commit seed the requester drew on the
    /// branch (at most [`MAX_LOST_MARKS`]): only a device that was in one
    /// of those epochs can match one, and neither the hub nor anyone else
    /// can learn a seed from it.
    pub marks: Vec<[u8; 32]>,
    /// The member that wrote the commit that took the requester's place,
    /// when the requester knows it: a member holding a mark that has since
    /// merged a commit of that member's framed in `from` or later knows
    /// the claim is stale (that member came over to this branch) and
    /// answers instead of stranding.
    pub taken_by: Option<DeviceId>,
}

/// The most marks a [`LostBranch`] may carry; a request with more is
/// dropped.
pub const MAX_LOST_MARKS: usize = crate::device::records::LOST_SEEDS_KEPT;

/// Domain of [`lost_branch_mark`].
const LOST_MARK_DOMAIN: &[u8] = b"hubsync lost branch v1";

/// The mark of commit seed `seed` of `group`: SHA-256 of the domain, the
/// group id and the seed.
pub fn lost_branch_mark(group: &GroupId, seed: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(LOST_MARK_DOMAIN);
    h.update(group.0);
    h.update(seed);
    h.finalize().into()
}

impl RejoinRequest {
    /// What the signature covers: the domain, then every other field
    /// (`lost` as a byte 0 when absent, else 1, `from` big-endian, the
    /// number of marks as one byte, the marks, and `taken_by` as a byte 0
    /// when absent, else 1 and the device id).
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut m = REQUEST_DOMAIN.to_vec();
        m.extend_from_slice(&self.group.0);
        m.extend_from_slice(&self.device.0);
        m.extend_from_slice(&self.nonce);
        m.extend_from_slice(&self.hpke_public);
        match &self.lost {
            None => m.push(0),
            Some(l) => {
                m.push(1);
                m.extend_from_slice(&l.from.to_be_bytes());
                m.push(u8::try_from(l.marks.len()).unwrap_or(u8::MAX));
                for mark in &l.marks {
                    m.extend_from_slice(mark);
                }
                match &l.taken_by {
                    None => m.push(0),
                    Some(d) => {
                        m.push(1);
                        m.extend_from_slice(&d.0);
                    }
                }
            }
        }
        m
    }

    /// Whether `device` signed it.
    pub fn verify(&self) -> bool {
        verify_by(&self.device, &self.signed_bytes(), &self.signature)
    }
}

/// A member's answer: a [`Grant`] HPKE-sealed to the request's key, with
/// the group id and the nonce as additional data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejoinAnswer {
    /// The group.
    pub group: GroupId,
    /// The request's nonce.
    pub nonce: [u8; 16],
    /// The requester.
    pub to: DeviceId,
    /// The answering member (what it claims: the GroupInfo's own signature
    /// is what the requester trusts).
    pub from: DeviceId,
    /// The answering member's epoch, in the clear: other members cancel
    /// their own answers only for one at least as far on, and the
    /// requester, of the answers that come within [`ANSWER_COLLECT`] of the
    /// first, joins with the furthest on (a member left on a branch the
    /// group abandoned does not know it, and would lead it there).
    pub epoch: u64,
    /// HPKE encapsulated key.
    #[serde(with = "serde_bytes")]
    pub kem_output: Vec<u8>,
    /// HPKE ciphertext of the postcard [`Grant`].
    #[serde(with = "serde_bytes")]
    pub ciphertext: Vec<u8>,
    /// `from`'s ed25519 signature over [`RejoinAnswer::signed_bytes`]: a
    /// member cancels its own answer only for one signed by a member of
    /// its tree, so nobody else who knows the mailbox can silence them.
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

impl RejoinAnswer {
    /// What the signature covers: the domain, then group, nonce, `to`,
    /// `from`, `epoch` (8 bytes big-endian), and SHA-256 of `kem_output`
    /// then of `ciphertext`.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut m = ANSWER_DOMAIN.to_vec();
        m.extend_from_slice(&self.group.0);
        m.extend_from_slice(&self.nonce);
        m.extend_from_slice(&self.to.0);
        m.extend_from_slice(&self.from.0);
        m.extend_from_slice(&self.epoch.to_be_bytes());
        m.extend_from_slice(&digest(&self.kem_output));
        m.extend_from_slice(&digest(&self.ciphertext));
        m
    }

    /// Whether `from` signed it.
    pub fn verify(&self) -> bool {
        verify_by(&self.from, &self.signed_bytes(), &self.signature)
    }
}

/// A member does not see the requester in its tree (it was removed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejoinRefusal {
    /// The group.
    pub group: GroupId,
    /// The request's nonce.
    pub nonce: [u8; 16],
    /// The requester.
    pub to: DeviceId,
    /// The refusing member.
    pub from: DeviceId,
    /// The refusing member's epoch. A member behind the requester may not
    /// have merged the commit that added it, so the requester counts a
    /// refusal only from a member at least at its own epoch.
    pub epoch: u64,
    /// ed25519 by `from` over [`RejoinRefusal::signed_bytes`].
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

impl RejoinRefusal {
    /// What the signature covers: the domain, then group, nonce, `to` and
    /// `epoch` (8 bytes big-endian).
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut m = REFUSAL_DOMAIN.to_vec();
        m.extend_from_slice(&self.group.0);
        m.extend_from_slice(&self.nonce);
        m.extend_from_slice(&self.to.0);
        m.extend_from_slice(&self.epoch.to_be_bytes());
        m
    }
}

/// What an answer seals: everything the requester needs to commit into
/// the member's current epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// An MLSMessage carrying the GroupInfo of the member's current epoch,
    /// with the ratchet tree and external public key extensions.
    #[serde(with = "serde_bytes")]
    pub group_info: Vec<u8>,
    /// The group's canonical commit hub.
    pub commit_hub: String,
    /// The seed of the commit log the next commit goes to (the writer
    /// capability of that log, [`topics::commit_writer`]).
    pub commit_seed: [u8; 32],
    /// That log's head as the member read it (0: empty): the external
    /// commit's compare-and-set.
    pub head: u64,
}

/// What [`GroupPeerManager::rejoin_group`] did. Never an error for a
/// remedy that did not work: that is an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RejoinResult {
    /// Nothing to do: the device is not left behind in the group (not
    /// stranded, its ledger complete), for example because another rejoin
    /// healed it while this one waited its turn.
    NotNeeded,
    /// The device is a member again, at `epoch`.
    Recovered {
        /// The group's epoch after the external commit.
        epoch: u64,
        /// The external commit's position on the commit log.
        seq: u64,
        /// The member whose GroupInfo it joined with.
        answered_by: DeviceId,
        /// The member whose answer in the new epoch confirmed the rejoin
        /// was seen (`None`: nobody answered before the gather deadline;
        /// the rejoin landed all the same).
        confirmed_by: Option<DeviceId>,
        /// This device's own ledger entries the group's ledger lacked,
        /// issued again (once) and landed.
        reenact: Vec<Entry>,
        /// Own entries the group's ledger lacks that could not be issued
        /// again, with why (an add or a removal that lost its fork cannot
        /// be rebuilt; an entry its author may no longer write).
        not_reenacted: Vec<(Entry, String)>,
        /// App messages this device had encrypted on a branch it lost,
        /// sent again in the group's epoch under their own ids (also
        /// announced as `Event::MessagesSentAgain`).
        sent_again: Vec<[u8; 16]>,
    },
    /// Members say this device is not in the group: they see no leaf of
    /// it (it was removed). Nothing changed on this device unless
    /// `removed`.
    NotAMember {
        /// The members of this device's view that said so (each signed its
        /// refusal); refusals signed by anyone else are not counted.
        refused_by: Vec<DeviceId>,
        /// Whether this device took it as its removal: more than half of
        /// the other members of its own (stale) view refused, and none
        /// answered, so its state of the group is gone (`Event::Removed`).
        /// Fewer refusals change nothing: a member removed after this
        /// device fell behind still looks like a member to it, and could
        /// refuse falsely, but it is one voice.
        removed: bool,
    },
    /// No usable answer before the deadline; nothing changed on this
    /// device (also reported as `Event::RecoveryFailed`).
    RecoveryFailed {
        /// Why.
        reason: String,
    },
}

/// What reaches a waiting requester.
pub(super) enum Incoming {
    Answer(RejoinAnswer),
    /// A member does not see the requester in its tree at its epoch.
    Refusal {
        from: DeviceId,
        epoch: u64,
    },
    /// A member's epoch, answering a probe.
    Status {
        from: DeviceId,
        epoch: u64,
    },
}

/// Why one external commit attempt did not land.
enum JoinFailure {
    /// Another commit took the epoch, or the hub's answer never came: the
    /// old state stays; ask again.
    Retry(String),
    /// The grant is unusable (does not parse, another group, MLS refused).
    Refused(String),
    /// This device failed.
    Device(DeviceError),
}

impl From<DeviceError> for JoinFailure {
    fn from(e: DeviceError) -> Self {
        JoinFailure::Device(e)
    }
}

impl From<crate::kv::KvError> for JoinFailure {
    fn from(e: crate::kv::KvError) -> Self {
        JoinFailure::Device(DeviceError::Store(e.to_string()))
    }
}

impl From<crate::device::registry::RegistryError> for JoinFailure {
    fn from(e: crate::device::registry::RegistryError) -> Self {
        JoinFailure::Device(e.into())
    }
}

fn grant_aad(group: &GroupId, nonce: &[u8; 16]) -> Vec<u8> {
    let mut aad = group.0.to_vec();
    aad.extend_from_slice(nonce);
    aad
}

fn mls_err(e: impl std::fmt::Debug) -> String {
    format!("{e:?}")
}

impl GroupPeerManager {
    /// When this device is stranded in `group`, rejoin it first.
    ///
    /// # Errors
    /// `Stranded` when the rejoin did not help (with why), `UnknownGroup`
    /// when the members' refusals were taken as this device's removal, or
    /// the rejoin's own errors.
    pub(super) async fn rejoin_if_stranded(&self, group: GroupId) -> Result<(), DeviceError> {
        if !self.record(group)?.stranded {
            return Ok(());
        }
        let reason = match self.rejoin_group(group).await? {
            RejoinResult::Recovered { .. } | RejoinResult::NotNeeded => return Ok(()),
            // Taken as its removal: the group is gone here.
            RejoinResult::NotAMember { removed: true, .. } => {
                return Err(DeviceError::UnknownGroup(group))
            }
            RejoinResult::NotAMember { refused_by, .. } => {
                format!("members say this device is not in the group: {refused_by:?}")
            }
            RejoinResult::RecoveryFailed { reason } => reason,
        };
        Err(DeviceError::Stranded { group, reason })
    }

    /// Rejoin `group` by external commit through a member's GroupInfo
    /// (the module docs say how), then gather the ledger and issue again
    /// this device's own entries the group lacks. Gives up at
    /// `ManagerConfig::rejoin_deadline`.
    ///
    /// Use it when commits answer `RecoveryRequired` and a ledger gather
    /// did not help; [`commit_with_recovery`](Self::commit_with_recovery)
    /// calls it for you.
    ///
    /// # Errors
    /// `UnknownGroup`, or this device's store or MLS failing. No answer, or
    /// members refusing, is an answer ([`RejoinResult`]), not an error.
    pub async fn rejoin_group(&self, group: GroupId) -> Result<RejoinResult, DeviceError> {
        let (rec, before, joined) = {
            // One commit run at a time in the group: the rejoin is one.
            let lane = self.lane_lock(group);
            let _running = lane.lock().await;
            let rec = self.record(group)?;
            if !rec.stranded && rec.ledger_complete {
                return Ok(RejoinResult::NotNeeded);
            }
            let before = self.ledger_entries(group)?;
            (rec, before, self.ask_and_join(group).await?)
        };
        let (answered_by, epoch, seq) = match joined {
            Ok(j) => j,
            Err(refused) => {
                let me = self.shared.identity.id();
                let mut guard = self.shared.registry.lock(group).await;
                let others: BTreeSet<DeviceId> = self
                    .member_set(&mut guard)?
                    .into_iter()
                    .filter(|d| *d != me)
                    .collect();
                // A refusal says something only from a member of this
                // device's view: anyone who learned the rendezvous topic
                // can sign one in its own name.
                let refused: BTreeSet<DeviceId> = refused.intersection(&others).copied().collect();
                if refused.is_empty() {
                    drop(guard);
                    let reason = "no member answered before the deadline".to_string();
                    self.emit(Event::RecoveryFailed {
                        group,
                        remedy: super::Remedy::Rejoin,
                        reason: reason.clone(),
                    });
                    return Ok(RejoinResult::RecoveryFailed { reason });
                }
                let removed = refused.len() * 2 > others.len();
                if removed {
                    tracing::info!(%group, ?refused, "most members refused the rejoin: removed");
                    self.leave(&mut guard, group).await?;
                } else {
                    self.emit(Event::RecoveryFailed {
                        group,
                        remedy: super::Remedy::Rejoin,
                        reason: format!("members say this device is not in the group: {refused:?}"),
                    });
                }
                return Ok(RejoinResult::NotAMember {
                    refused_by: refused.into_iter().collect(),
                    removed,
                });
            }
        };
        tracing::info!(%group, epoch, seq, member = %answered_by, "rejoined by external commit");
        self.emit(Event::Rejoined { group, epoch });
        // Ask for the ledger in the new epoch: an answer is a member that
        // read us there, and completes a ledger that fell behind.
        let summary = self
            .gather(group, self.shared.config.gather_deadline, true)
            .await?;
        let confirmed_by = summary
            .installed_from
            .or_else(|| summary.answered.first().copied());
        let (reenact, not_reenacted) = self.reenact(group, &rec, before).await?;
        let sent_again = self.send_lost_again(group).await?;
        if !self.record(group)?.ledger_complete {
            // Nobody answered the gather in time: go on asking.
            self.heal_in_background(group);
        }
        Ok(RejoinResult::Recovered {
            epoch,
            seq,
            answered_by,
            confirmed_by,
            reenact,
            not_reenacted,
            sent_again,
        })
    }

    /// [`Self::send_lost_again`] in a task of its own (one per group at a
    /// time); a failure is counted (`control_failures`) and left for the
    /// next caught-up pull, which tries again while the loss is noted.
    pub(crate) fn send_lost_again_in_background(&self, group: GroupId) {
        if !lock(&self.shared.resending).insert(group) {
            return;
        }
        let me = self.clone();
        self.shared.tasks.spawn(async move {
            let stop = me.shared.shutdown.clone();
            let result = tokio::select! {
                _ = stop.cancelled() => Ok(Vec::new()),
                r = me.send_lost_again(group) => r,
            };
            lock(&me.shared.resending).remove(&group);
            if let Err(e) = result {
                me.shared
                    .counters
                    .control_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(%group, error = %e, "sending lost messages again failed; tried again at the next caught-up pull");
            }
        });
    }

    /// Send again, in the current epoch and under their own ids, the app
    /// messages this device encrypted on a branch of `group` it lost
    /// ([`GroupRecord::lost_from`](super::records::GroupRecord::lost_from)),
    /// which the members on the winning branch could never read. Members
    /// that did read them (they were on that branch too) drop the second
    /// copy by its id. Then the loss is forgotten; a crash before that
    /// sends them again, which is harmless for the same reason.
    async fn send_lost_again(&self, group: GroupId) -> Result<Vec<[u8; 16]>, DeviceError> {
        let Some(from) = self.record(group)?.lost_from else {
            return Ok(Vec::new());
        };
        let records = &self.shared.records;
        let lost = records.sent_since(&group, from)?;
        let older_forgotten = records
            .sent_pruned_through(&group)?
            .is_some_and(|e| e >= from);
        let mut ids = Vec::with_capacity(lost.len());
        for m in &lost {
            self.broadcast_with(group, &m.body, &[], true, Some(m))
                .await?;
            ids.push(m.id);
        }
        {
            let mut guard = self.shared.registry.lock(group).await;
            let mut rec = self.record(group)?;
            rec.lost_from = None;
            self.save_record(&mut guard, &rec)?;
        }
        tracing::info!(%group, from, sent = ids.len(), older_forgotten, "sent again the messages of a lost branch");
        if !ids.is_empty() || older_forgotten {
            self.emit(Event::MessagesSentAgain {
                group,
                ids: ids.clone(),
                older_forgotten,
            });
        }
        Ok(ids)
    }

    /// Ask on the rendezvous mailbox until an answer's external commit
    /// lands or the deadline passes. Answers (who answered, epoch, seq),
    /// or the members that refused at this device's epoch or later (empty:
    /// nobody answered). A refusal from a member behind this device says
    /// nothing: it may not have merged the commit that added this device.
    /// When this device knows its branch was lost from an epoch on, its
    /// epochs from there are another branch's: a member at the last epoch
    /// before it, or later, that refuses has not got it in the group's
    /// branch (it was invited on the lost one, or removed).
    async fn ask_and_join(
        &self,
        group: GroupId,
    ) -> Result<Result<(DeviceId, u64, u64), BTreeSet<DeviceId>>, DeviceError> {
        let rec = self.record(group)?;
        let own = {
            let mut guard = self.shared.registry.lock(group).await;
            let epoch = guard.read(|g| g.epoch().as_u64())?;
            rec.lost_from
                .map_or(epoch, |from| epoch.min(from.saturating_sub(1)))
        };
        let Some(seed) = rec.rendezvous_seed else {
            return Ok(Err(BTreeSet::new()));
        };
        let rendezvous = topics::rendezvous_topic(&seed);
        let crypto = self.shared.registry.provider().crypto();
        let mut ikm = [0u8; 32];
        self.shared.rng.fill(&mut ikm);
        let keys = crypto
            .derive_hpke_keypair(mls::CIPHERSUITE.hpke_config(), &ikm)
            .map_err(|e| DeviceError::Mls(format!("HPKE key pair: {e:?}")))?;
        let mut nonce = [0u8; 16];
        self.shared.rng.fill(&mut nonce);
        let me = &self.shared.identity;
        let lost = rec
            .lost_from
            .filter(|_| !rec.lost_seeds.is_empty())
            .map(|from| LostBranch {
                from,
                marks: rec
                    .lost_seeds
                    .iter()
                    .map(|s| lost_branch_mark(&group, s))
                    .collect(),
                taken_by: rec.lost_to,
            });
        let mut request = RejoinRequest {
            group,
            device: me.id(),
            nonce,
            hpke_public: keys.public.clone(),
            lost,
            signature: Vec::new(),
        };
        request.signature = me.signature_over(&request.signed_bytes());
        let frame = postcard::to_allocvec(&RendezvousFrame::Request(request))
            .map_err(|e| DeviceError::Mls(e.to_string()))?;
        let (tx, mut rx) = mpsc::channel(INCOMING_QUEUE);
        lock(&self.shared.rejoins).insert((group, nonce), tx);
        let deadline = Instant::now() + self.shared.config.rejoin_deadline;
        // The group may have moved to hubs this device's stale record does
        // not name (bound while it was away): it also asks, and listens,
        // on its own hubs for as long as it asks.
        let _listening = self
            .listen_rendezvous_beyond_routes(group, &rec, &rendezvous)
            .drop_guard();
        let mut refused = BTreeSet::new();
        let mut next_ask = Instant::now();
        let outcome = loop {
            let now = Instant::now();
            if now >= deadline {
                break Ok(Err(refused));
            }
            if now >= next_ask {
                next_ask = now + ASK_INTERVAL;
                let rec = self.record(group)?;
                let mut hubs = rec.routes();
                for own in lock(&self.shared.own_hubs).iter() {
                    if !hubs.contains(own) {
                        hubs.push(own.clone());
                    }
                }
                for hub in hubs {
                    if hub == super::lane::LOOPBACK_HUB {
                        continue;
                    }
                    // A hub that is down is asked again at the next round.
                    if let Err(e) = self.post_rendezvous(&hub, &rendezvous, &frame).await {
                        tracing::debug!(%group, hub, error = %e, "rejoin request not posted");
                    }
                }
            }
            let got = match tokio::time::timeout_at(next_ask.min(deadline), rx.recv()).await {
                Err(_) => continue,
                Ok(None) => break Ok(Err(refused)),
                Ok(Some(got)) => got,
            };
            let first = match got {
                Incoming::Refusal { from, epoch } => {
                    if epoch >= own {
                        refused.insert(from);
                    }
                    continue;
                }
                // A status answers a probe, never a rejoin request.
                Incoming::Status { .. } => continue,
                Incoming::Answer(a) => a,
            };
            // Members further on may answer a little later: of what comes
            // within the window, the furthest on first. The epoch is only
            // a hint in the clear: an answer that does not open (anyone who
            // knows the mailbox can post one) passes to the next.
            let mut answers = vec![first];
            let window = Instant::now() + ANSWER_COLLECT;
            while let Ok(Some(more)) = tokio::time::timeout_at(window, rx.recv()).await {
                match more {
                    Incoming::Answer(b) => answers.push(b),
                    Incoming::Refusal { from, epoch } => {
                        if epoch >= own {
                            refused.insert(from);
                        }
                    }
                    Incoming::Status { .. } => {}
                }
            }
            answers.sort_by_key(|x| std::cmp::Reverse(x.epoch));
            let mut joined = None;
            for a in answers {
                let input = HpkeCiphertext {
                    kem_output: a.kem_output.into(),
                    ciphertext: a.ciphertext.into(),
                };
                let grant = crypto
                    .hpke_open(
                        mls::CIPHERSUITE.hpke_config(),
                        &input,
                        keys.private.as_ref(),
                        GRANT_INFO,
                        &grant_aad(&group, &nonce),
                    )
                    .map_err(mls_err)
                    .and_then(|plain| postcard::from_bytes::<Grant>(&plain).map_err(mls_err));
                let grant = match grant {
                    Ok(g) => g,
                    Err(e) => {
                        tracing::warn!(%group, from = %a.from, error = %e, "a rejoin answer does not open");
                        continue;
                    }
                };
                match self.join_external(group, seed, &grant).await {
                    Ok((epoch, seq)) => {
                        joined = Some(Ok((a.from, epoch, seq)));
                        break;
                    }
                    Err(JoinFailure::Retry(why)) => {
                        tracing::info!(%group, why, "the external commit did not land; asking again");
                        next_ask = Instant::now();
                        break;
                    }
                    Err(JoinFailure::Refused(why)) => {
                        tracing::warn!(%group, from = %a.from, why, "a rejoin answer was refused");
                    }
                    Err(JoinFailure::Device(e)) => {
                        joined = Some(Err(e));
                        break;
                    }
                }
            }
            match joined {
                Some(Ok(j)) => break Ok(Ok(j)),
                Some(Err(e)) => break Err(e),
                None => {}
            }
        };
        lock(&self.shared.rejoins).remove(&(group, nonce));
        outcome
    }

    /// Listen to `group`'s rendezvous mailbox on this device's own hubs
    /// that are not among the group's routes (whose peers listen already),
    /// until the answer token is cancelled. Answers that token.
    fn listen_rendezvous_beyond_routes(
        &self,
        group: GroupId,
        rec: &super::records::GroupRecord,
        topic: &TopicId,
    ) -> CancellationToken {
        let done = CancellationToken::new();
        let routes = rec.routes();
        let extra: Vec<String> = lock(&self.shared.own_hubs)
            .iter()
            .filter(|h| !routes.contains(h))
            .cloned()
            .collect();
        for hub in extra {
            let link = self.hub_link(&hub);
            let mut rx = link.subscribe(topic.clone(), None);
            let me = self.clone();
            let done = done.clone();
            let topic = topic.clone();
            self.shared.tasks.spawn(async move {
                loop {
                    let d = tokio::select! {
                        _ = done.cancelled() => break,
                        d = rx.recv() => match d { Some(d) => d, None => break },
                    };
                    me.on_rendezvous(group, &hub, &d.payload);
                    link.ack(vec![d.frame_ref()]).await;
                }
                // Unless the rejoin made it one of the group's hubs, whose
                // peer now holds the subscription.
                let routed = me.record(group).is_ok_and(|r| r.routes().contains(&hub));
                if !routed {
                    link.unsubscribe(&topic).await;
                }
            });
        }
        done
    }

    /// Post `frame` on the rendezvous mailbox at `hub`.
    pub(super) async fn post_rendezvous(
        &self,
        hub: &str,
        topic: &TopicId,
        frame: &[u8],
    ) -> Result<(), crate::device::link::LinkError> {
        let publish = Publish {
            topic: topic.clone(),
            publish_id: publish_id(&digest(frame), topic),
            class: RetentionClass::Mailbox,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: Some(RENDEZVOUS_RETENTION_SECS),
            payload: frame.to_vec(),
            writer: None,
        };
        self.hub_link(hub).publish(publish).await.map(|_| ())
    }

    /// Join by external commit with `grant`, replacing this device's state
    /// of the group only once the hub accepted the commit. Holds the group
    /// lock across the publish: the group is unusable until it is rejoined
    /// anyway, and the old state must not change under the attempt.
    async fn join_external(
        &self,
        group: GroupId,
        seed: [u8; 32],
        grant: &Grant,
    ) -> Result<(u64, u64), JoinFailure> {
        let message = MlsMessageIn::tls_deserialize_exact(grant.group_info.as_slice())
            .map_err(|e| JoinFailure::Refused(format!("GroupInfo: {e}")))?;
        let vgi = match message.extract() {
            MlsMessageBodyIn::GroupInfo(vgi) => vgi,
            _ => return Err(JoinFailure::Refused("not a GroupInfo".into())),
        };
        if vgi.group_id().as_slice() != group.0 {
            return Err(JoinFailure::Refused("a GroupInfo of another group".into()));
        }
        let me = &self.shared.identity;
        let mut guard = self.shared.registry.lock(group).await;
        let mut rec = self.record(group)?;
        // A member still on the branch this device lost answers from it
        // (it has not learned yet, or the request reached it unmarked).
        if rec.lost_seeds.contains(&grant.commit_seed) {
            return Err(JoinFailure::Refused(
                "the answer is from the branch this device lost".into(),
            ));
        }
        let stale_journal = self.shared.records.journal(&group)?;
        // Everything below is staged: nothing replaces the old state until
        // the hub accepted the commit.
        guard.discard();
        if guard.exists()? {
            guard
                .with(|g, p| {
                    let _ = g.delete(p.storage());
                    p.storage().purge_group(&group.to_mls())
                })?
                .map_err(|e| DeviceError::Store(e.to_string()))?;
        }
        let built = {
            let p = guard.provider();
            MlsGroup::external_commit_builder()
                .with_config(mls::join_config())
                .build_group(p, vgi, me.credential_with_key())
                .map_err(mls_err)
                .and_then(|b| {
                    b.leaf_node_parameters(
                        LeafNodeParameters::builder()
                            .with_capabilities(mls::capabilities())
                            .build(),
                    )
                    .load_psks(p.storage())
                    .map_err(mls_err)
                })
                .and_then(|b| {
                    b.build(p.rand(), p.crypto(), me.signature_key_pair(), |_| true)
                        .map_err(mls_err)
                })
                .and_then(|b| b.finalize(p).map_err(mls_err))
        };
        let (joined, bundle) = match built {
            Ok(j) => j,
            Err(e) => {
                guard.discard();
                return Err(JoinFailure::Refused(format!("MLS: {e}")));
            }
        };
        let ext = match GroupExt::from_extensions(joined.extensions()) {
            Ok(Some(ext)) if ext.topic_seed == seed => ext,
            _ => {
                guard.discard();
                return Err(JoinFailure::Refused(
                    "the GroupInfo's group has another topic seed".into(),
                ));
            }
        };
        let epoch = joined.epoch().as_u64();
        let payload = match bundle.commit().tls_serialize_detached() {
            Ok(b) => b,
            Err(e) => {
                guard.discard();
                return Err(JoinFailure::Refused(format!("encoding the commit: {e}")));
            }
        };
        guard.install(joined);
        let (app, commit_seed) = self.roster_secrets(&mut guard)?;
        let writer = topics::commit_writer(&grant.commit_seed);
        let mut publish = Publish {
            topic: writer.topic().clone(),
            publish_id: publish_id(&digest(&payload), writer.topic()),
            class: RetentionClass::Log,
            expected_head: match grant.head {
                0 => ExpectedHead::Empty,
                h => ExpectedHead::Seq(h),
            },
            replay_only: false,
            retention_secs: None,
            payload: payload.clone(),
            writer: None,
        };
        writer.sign(&mut publish);
        let seq = match self.hub_link(&grant.commit_hub).publish(publish).await {
            Ok(PublishOutcome::Accepted { seq, .. } | PublishOutcome::Duplicate { seq }) => seq,
            Ok(other) => {
                guard.discard();
                return Err(JoinFailure::Retry(format!("{other:?}")));
            }
            Err(e) => {
                // The outcome may be unknown: had the hub taken it, the
                // group holds a leaf of ours whose keys are gone, and the
                // next external commit removes it like the old one.
                guard.discard();
                return Err(JoinFailure::Retry(e.to_string()));
            }
        };
        // Accepted: the new state, and a record that starts over on the
        // log the commit moved the group to.
        rec.stranded = false;
        rec.lost_seeds.clear();
        rec.lost_to = None;
        rec.rendezvous_seed = Some(seed);
        rec.commit_hub = grant.commit_hub.clone();
        rec.merged.clear();
        rec.remember(MergedCommit {
            epoch: epoch.saturating_sub(1),
            digest: digest(&payload),
            hub: grant.commit_hub.clone(),
            seq: Some(seq),
            payload,
            commit_seed: Some(grant.commit_seed),
            writer: Some(me.id()),
        });
        rec.commit_seed = grant.commit_seed;
        rec.rotate_commit_seed(commit_seed);
        rec.rotate_app_topic(app);
        let entries = self.ledger_entries(group)?;
        match LedgerState::fold_to(group, &entries, &ext.ledger_head) {
            Ok(state) => {
                rec.ledger_complete = true;
                self.follow_ledger(&mut rec, &state, &[]);
            }
            Err(_) => {
                // Its hubs come from the ledger it lacks: at least the
                // commit hub is the group's, so the gather that follows
                // reaches the members there.
                rec.ledger_complete = false;
                if !rec.hubs.is_empty() && !rec.hubs.contains(&grant.commit_hub) {
                    rec.hubs.push(grant.commit_hub.clone());
                }
            }
        }
        let mut b = WriteBatch::new();
        self.shared.records.put_group(&mut b, &rec);
        self.shared.records.clear_journal(&mut b, &group);
        // Welcomes kept for after a removal this device never saw are for
        // the membership it holds again now: joined after a later
        // removal, one would hand it a state the group left (sim seed 896).
        self.shared.records.clear_pending_welcomes(&mut b, &group)?;
        guard.finish(b)?;
        let members = self.members_of(&mut guard)?;
        drop(guard);
        if let Some(j) = stale_journal {
            // Built on the state the rejoin replaced: it can never land.
            self.report_lost(group, &j);
        }
        self.sync_peers(&rec);
        self.emit(Event::EpochChanged { group, epoch });
        self.emit(Event::MembersChanged { group, members });
        Ok((epoch, seq))
    }

    /// Issue again, once, this device's own entries of `before` (its
    /// ledger before the rejoin) that the group's ledger lacks now.
    async fn reenact(
        &self,
        group: GroupId,
        old: &super::records::GroupRecord,
        before: Vec<Entry>,
    ) -> Result<(Vec<Entry>, Vec<(Entry, String)>), DeviceError> {
        let me = self.shared.identity.id();
        let rec = self.record(group)?;
        let mine = before.into_iter().filter(|e| e.author == me);
        if !rec.ledger_complete {
            let why = "the group's ledger could not be gathered".to_string();
            return Ok((Vec::new(), mine.map(|e| (e, why.clone())).collect()));
        }
        let now = self.ledger_state(&rec)?;
        let mut issue = Vec::new();
        let mut not = Vec::new();
        for e in mine.filter(|e| !now.contains(&e.id())) {
            match e.kind {
                EntryType::MemberInvite | EntryType::MemberRemove => not.push((
                    e,
                    "an add or a removal is enacted with its commit; it cannot be issued alone"
                        .to_string(),
                )),
                _ => issue.push(e),
            }
        }
        if issue.is_empty() {
            return Ok((Vec::new(), not));
        }
        tracing::info!(group = %old.id, count = issue.len(), "issuing again own ledger entries the group lacks");
        let mut landed = Vec::new();
        // All at once; if the ledger refuses the set, one by one, so one
        // entry its author may no longer write does not hold up the rest.
        let batches: Vec<Vec<Entry>> = match self.issue_again(group, issue.clone()).await {
            Ok(()) => {
                return Ok((issue, not));
            }
            Err(super::lane::CommitError::Ledger(_)) => {
                issue.into_iter().map(|e| vec![e]).collect()
            }
            Err(e) => {
                let why = e.to_string();
                not.extend(issue.into_iter().map(|x| (x, why.clone())));
                return Ok((landed, not));
            }
        };
        for one in batches {
            match self.issue_again(group, one.clone()).await {
                Ok(()) => landed.extend(one),
                Err(e) => {
                    let why = e.to_string();
                    not.extend(one.into_iter().map(|x| (x, why.clone())));
                }
            }
        }
        Ok((landed, not))
    }

    /// Commit `entries` as the one re-drive of entries lost with a fork.
    async fn issue_again(
        &self,
        group: GroupId,
        entries: Vec<Entry>,
    ) -> Result<(), super::lane::CommitError> {
        let mut op = [0u8; 16];
        self.shared.rng.fill(&mut op);
        self.run_lane(group, Some(super::lane::Plan::redrive(entries, op)))
            .await
            .map(|_| ())
    }

    /// Heal `group` in the background, unless
    /// [`ManagerConfig::auto_rejoin`](super::ManagerConfig::auto_rejoin) is
    /// off or a task heals it already: rejoin while it is stranded, then
    /// gather the ledger while it is incomplete (a rejoin whose gather
    /// found nobody leaves it so). A failed attempt is reported
    /// (`Event::RecoveryFailed`) and tried again after a growing wait (or
    /// as soon as any hub link connects again, which also resets the
    /// wait), as
    /// is a rejoin fewer than half of the other members refused; most of
    /// them refusing (the device was removed) ends it with the group
    /// forgotten (`Event::Removed`).
    pub(super) fn heal_in_background(&self, group: GroupId) {
        if !self.shared.config.auto_rejoin || !lock(&self.shared.healing).insert(group) {
            return;
        }
        let me = self.clone();
        let stop = self.shared.shutdown.clone();
        let mut links_up = self.shared.links_up.subscribe();
        self.shared.tasks.spawn(async move {
            let mut wait = HEAL_BACKOFF_MIN;
            while let Ok(rec) = me.record(group) {
                if rec.stranded {
                    let healed = tokio::select! {
                        _ = stop.cancelled() => break,
                        r = me.rejoin_group(group) => r,
                    };
                    match healed {
                        // Rejoined: its ledger may still lack entries.
                        Ok(RejoinResult::Recovered { .. }) => continue,
                        // Too few refusals to be a removal: the members
                        // that did not answer yet (cut off, busy healing
                        // themselves) may answer the next request, and a
                        // device on a branch the group lost is told so only
                        // once most of its view has said it.
                        Ok(
                            RejoinResult::RecoveryFailed { .. }
                            | RejoinResult::NotAMember { removed: false, .. },
                        ) => {}
                        Ok(
                            RejoinResult::NotNeeded
                            | RejoinResult::NotAMember { removed: true, .. },
                        )
                        | Err(DeviceError::UnknownGroup(_)) => break,
                        Err(e) => me.emit(Event::RecoveryFailed {
                            group,
                            remedy: super::Remedy::Rejoin,
                            reason: e.to_string(),
                        }),
                    }
                } else if !rec.ledger_complete {
                    let deadline = me.shared.config.gather_deadline;
                    let gathered = tokio::select! {
                        _ = stop.cancelled() => break,
                        r = me.request_ledger_catchup(group, deadline) => r,
                    };
                    let reason = match gathered {
                        Ok(s) => match s.failure() {
                            None => break,
                            Some(why) => why,
                        },
                        Err(DeviceError::UnknownGroup(_)) => break,
                        Err(e) => e.to_string(),
                    };
                    me.emit(Event::RecoveryFailed {
                        group,
                        remedy: super::Remedy::Gather,
                        reason,
                    });
                } else {
                    break;
                }
                links_up.mark_unchanged();
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(wait) => {
                        wait = (wait * 2).min(HEAL_BACKOFF_MAX);
                    }
                    // A hub came back: what it could not reach may be
                    // there now, so try at once, and patiently again.
                    r = links_up.changed() => {
                        if r.is_err() {
                            break;
                        }
                        wait = HEAL_BACKOFF_MIN;
                    }
                }
            }
            lock(&me.shared.healing).remove(&group);
        });
    }

    /// A frame arrived on `group`'s rendezvous mailbox at `hub`.
    pub(super) fn on_rendezvous(&self, group: GroupId, hub: &str, payload: &[u8]) {
        let me = self.shared.identity.id();
        let frame = match postcard::from_bytes::<RendezvousFrame>(payload) {
            Ok(f) => f,
            Err(_) => {
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        match frame {
            RendezvousFrame::Request(r) => {
                let too_many = r
                    .lost
                    .as_ref()
                    .is_some_and(|l| l.marks.len() > MAX_LOST_MARKS);
                if r.group != group || r.device == me || too_many || !r.verify() {
                    self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let hub = hub.to_string();
                let who = r.device;
                self.handle_request(group, who, "rejoin request", move |this| async move {
                    // Registered by the task itself: a request dropped
                    // over the bound leaves nothing behind.
                    let nonce = r.nonce;
                    let answering = Arc::new(Answering {
                        cancel: CancellationToken::new(),
                        // Not known yet: cancelled by no answer until it is.
                        epoch: AtomicU64::new(u64::MAX),
                        members: std::sync::OnceLock::new(),
                    });
                    lock(&this.shared.answering).insert((group, nonce), answering.clone());
                    let result = this.answer_rejoin(group, &hub, r, answering).await;
                    lock(&this.shared.answering).remove(&(group, nonce));
                    result
                });
            }
            RendezvousFrame::Answer(a) => {
                if a.group != group {
                    return;
                }
                // Another member answered from at least as far on: ours
                // is not needed.
                if !a.verify() {
                    self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if let Some(t) = lock(&self.shared.answering).get(&(group, a.nonce)) {
                    let by_member = t.members.get().is_some_and(|m| m.contains(&a.from));
                    if by_member && a.epoch >= t.epoch.load(Ordering::Relaxed) {
                        t.cancel.cancel();
                    }
                }
                if a.to == me {
                    if let Some(tx) = lock(&self.shared.rejoins).get(&(group, a.nonce)) {
                        let _ = tx.try_send(Incoming::Answer(a));
                    }
                }
            }
            RendezvousFrame::Probe(p) => {
                if p.group != group || p.device == me {
                    return;
                }
                // Only the members the prober named answer.
                if !p.ask.contains(&me) {
                    return;
                }
                if !p.verify() {
                    self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let hub = hub.to_string();
                let who = p.device;
                self.handle_request(group, who, "epoch probe", move |this| async move {
                    this.answer_probe(group, &hub, p).await
                });
            }
            RendezvousFrame::Status(s) => self.on_status(group, s),
            RendezvousFrame::Presence(b) => {
                if b.group != group || b.device == me || !b.verify() {
                    if b.device != me {
                        self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    return;
                }
                self.on_beacon(group, hub, b);
            }
            RendezvousFrame::Refusal(f) => {
                // Another member's refusal cancels nothing: the requester
                // takes the refusals of most of the members it knows as
                // its removal, so each member says so for itself.
                if f.group != group {
                    return;
                }
                if f.to == me && verify_by(&f.from, &f.signed_bytes(), &f.signature) {
                    if let Some(tx) = lock(&self.shared.rejoins).get(&(group, f.nonce)) {
                        let _ = tx.try_send(Incoming::Refusal {
                            from: f.from,
                            epoch: f.epoch,
                        });
                    }
                }
            }
        }
    }

    /// Answer `r` after a random wait unless another member answered
    /// first: a sealed GroupInfo if the requester is in our tree, a signed
    /// refusal if not. A member that is itself left behind stays silent.
    async fn answer_rejoin(
        &self,
        group: GroupId,
        hub: &str,
        r: RejoinRequest,
        answering: Arc<Answering>,
    ) -> Result<(), DeviceError> {
        let cancel = &answering.cancel;
        {
            let mut guard = self.shared.registry.lock(group).await;
            let epoch = guard.read(|g| g.epoch().as_u64())?;
            let members: BTreeSet<DeviceId> = self.member_set(&mut guard)?.into_iter().collect();
            let _ = answering.members.set(members);
            answering.epoch.store(epoch, Ordering::Relaxed);
        }
        let jitter = self.shared.rng.next_u64() % (ANSWER_JITTER_MS + 1);
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(jitter)) => {}
        }
        // Answer from the log's end, so the head we name is current, and
        // from the branch the group is on.
        self.read_before_answering(group).await;
        let me = &self.shared.identity;
        let crypto = self.shared.registry.provider().crypto();
        let mut guard = self.shared.registry.lock(group).await;
        let rec = self.record(group)?;
        let epoch = guard.read(|g| g.epoch().as_u64())?;
        answering.epoch.store(epoch, Ordering::Relaxed);
        if rec.stranded || cancel.is_cancelled() {
            return Ok(());
        }
        let requester_is_member = self.member_set(&mut guard)?.contains(&r.device);
        if let Some(lost) = r.lost.as_ref().filter(|_| requester_is_member) {
            let marks: BTreeSet<[u8; 32]> = lost.marks.iter().copied().collect();
            let stale = lost
                .taken_by
                .is_some_and(|w| rec.came_over(&w, lost.from.saturating_sub(1)));
            if stale {
                // The member whose commit displaced the requester's has
                // committed on our branch since: it left the branch its
                // commit began, ours goes on, and the requester (on ours)
                // is answered like any other (sim seed 1723).
                tracing::info!(%group, from = lost.from, requester = %r.device, "a lost-branch claim its displacer has since contradicted: answered");
            } else if rec.holds_any_seed(|s| marks.contains(&lost_branch_mark(&group, s))) {
                // The requester's commit lost its place on a log this
                // device never read (it joined after it, or followed it
                // on a newer topic); its branch is ours. Strand, and
                // rejoin the group where it went on.
                tracing::warn!(%group, from = lost.from, requester = %r.device, "stranded: a member says the branch this device is on was lost");
                let mut rec = rec;
                rec.note_lost_from(lost.from);
                return self
                    .strand(&mut guard, &mut rec)
                    .map_err(|e| DeviceError::Store(e.to_string()));
            }
        }
        let frame = if requester_is_member {
            let info = guard
                .read(|g| g.export_group_info(crypto, me.signature_key_pair(), true))?
                .map_err(|e| DeviceError::Mls(e.to_string()))?
                .tls_serialize_detached()
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            let grant = Grant {
                group_info: info,
                commit_hub: rec.commit_hub.clone(),
                commit_seed: rec.commit_seed,
                head: rec.cursor(),
            };
            drop(guard);
            let plain =
                postcard::to_allocvec(&grant).map_err(|e| DeviceError::Mls(e.to_string()))?;
            let sealed = crypto
                .hpke_seal(
                    mls::CIPHERSUITE.hpke_config(),
                    &r.hpke_public,
                    GRANT_INFO,
                    &grant_aad(&group, &r.nonce),
                    &plain,
                )
                .map_err(|e| DeviceError::Mls(format!("HPKE seal: {e:?}")))?;
            let mut a = RejoinAnswer {
                group,
                nonce: r.nonce,
                to: r.device,
                from: me.id(),
                epoch,
                kem_output: sealed.kem_output.as_slice().to_vec(),
                ciphertext: sealed.ciphertext.as_slice().to_vec(),
                signature: Vec::new(),
            };
            a.signature = me.signature_over(&a.signed_bytes());
            RendezvousFrame::Answer(a)
        } else {
            drop(guard);
            let mut f = RejoinRefusal {
                group,
                nonce: r.nonce,
                to: r.device,
                from: me.id(),
                epoch,
                signature: Vec::new(),
            };
            f.signature = me.signature_over(&f.signed_bytes());
            RendezvousFrame::Refusal(f)
        };
        if cancel.is_cancelled() {
            return Ok(());
        }
        let Some(seed) = rec.rendezvous_seed else {
            return Ok(());
        };
        let bytes = postcard::to_allocvec(&frame).map_err(|e| DeviceError::Mls(e.to_string()))?;
        self.post_rendezvous(hub, &topics::rendezvous_topic(&seed), &bytes)
            .await
            .map_err(|e| DeviceError::Hub {
                url: hub.to_string(),
                reason: format!("posting the rejoin answer: {e}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer as _, SigningKey};

    #[test]
    fn a_request_verifies_only_as_signed_by_the_device_it_names() {
        let k = SigningKey::from_bytes(&[3; 32]);
        let other = SigningKey::from_bytes(&[4; 32]);
        let mut r = RejoinRequest {
            group: GroupId([1; 32]),
            device: DeviceId(k.verifying_key().to_bytes()),
            nonce: [2; 16],
            hpke_public: vec![9; 32],
            lost: Some(LostBranch {
                from: 7,
                marks: vec![lost_branch_mark(&GroupId([1; 32]), &[6; 32])],
                taken_by: Some(DeviceId([9; 32])),
            }),
            signature: Vec::new(),
        };
        r.signature = k.sign(&r.signed_bytes()).to_bytes().to_vec();
        assert!(r.verify());
        // The lost branch is signed too: dropped, moved, or a mark changed.
        let mut unlost = r.clone();
        unlost.lost = None;
        assert!(!unlost.verify());
        let mut earlier = r.clone();
        earlier.lost.as_mut().unwrap().from = 6;
        assert!(!earlier.verify());
        let mut remarked = r.clone();
        remarked.lost.as_mut().unwrap().marks[0][0] ^= 1;
        assert!(!remarked.verify());
        let mut blamed = r.clone();
        blamed.lost.as_mut().unwrap().taken_by = Some(DeviceId([8; 32]));
        assert!(!blamed.verify());
        let mut unblamed = r.clone();
        unblamed.lost.as_mut().unwrap().taken_by = None;
        assert!(!unblamed.verify());
        // Another key, a changed field, a truncated signature.
        let mut forged = r.clone();
        forged.signature = other.sign(&r.signed_bytes()).to_bytes().to_vec();
        assert!(!forged.verify());
        let mut moved = r.clone();
        moved.group = GroupId([5; 32]);
        assert!(!moved.verify());
        let mut rekeyed = r.clone();
        rekeyed.hpke_public[0] ^= 1;
        assert!(!rekeyed.verify());
        let mut short = r.clone();
        short.signature.pop();
        assert!(!short.verify());
        // Round trip through the wire form.
        let bytes = postcard::to_allocvec(&RendezvousFrame::Request(r.clone())).unwrap();
        assert_eq!(
            postcard::from_bytes::<RendezvousFrame>(&bytes).unwrap(),
            RendezvousFrame::Request(r)
        );
    }
}
