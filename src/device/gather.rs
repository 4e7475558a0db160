//! Ledger catch-up ("gather"): the cheap remedy for a member whose ledger is
//! incomplete (the Welcome's snapshot did not reproduce the head MLS
//! authenticates, say). Such a member reads and sends in the group, but
//! cannot commit: it cannot judge entries against a ledger it lacks.
//!
//! The requester sends a **ledger request** to the group: an MLS application
//! message (so only a current member can send one, and every member knows
//! which member asks) whose authenticated data is
//! [`CONTROL_AAD`](super::control_msg::CONTROL_AAD) and whose
//! content is a [`Control::LedgerRequest`] with a fresh nonce and a fresh
//! HPKE public key. Every member whose own ledger is complete answers with
//! its whole ledger in enactment order, HPKE-sealed to that key, in a
//! [`Control::LedgerAnswer`] sent the same way. The requester opens each
//! answer and folds it from genesis: the first whose head equals the head
//! MLS authenticates in the group's current epoch is installed; every other
//! answer is dropped, never merged, and reported in the
//! [`LedgerCatchupSummary`] with why.
//!
//! Who may do what: only a current member can ask or answer (MLS
//! authenticates both); a member that lies (a reordered, truncated or forged
//! ledger) is refused, because nothing but the authenticated head decides;
//! a removed member sees neither requests nor answers (it has no epoch
//! secrets), and answers are sealed to the requester alone.

use super::control_msg::Control;
use super::error::DeviceError;
use super::ledger::{self, Entry, GroupExt, LedgerError, LedgerState};
use super::manager::GroupPeerManager;
use super::records::GroupId;
use super::Event;
use crate::kv::WriteBatch;
use crate::wire::DeviceId;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::types::HpkeCiphertext;
use openmls_traits::OpenMlsProvider;

use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc;

/// The HPKE `info` of a sealed ledger answer.
const ANSWER_INFO: &[u8] = b"hubsync ledger answer v1";

/// Answers one request can queue before the requester reads them; more are
/// dropped (and the requester, reading none of them, reports no answer).
const ANSWER_QUEUE: usize = 64;

/// What a ledger catch-up did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerCatchupSummary {
    /// The ledger was complete already: nothing was asked.
    pub already_complete: bool,
    /// The member whose ledger was installed, if one was.
    pub installed_from: Option<DeviceId>,
    /// How many entries the installed ledger holds.
    pub entries: usize,
    /// Every member that answered, in the order the answers were read.
    pub answered: Vec<DeviceId>,
    /// Answers refused, with why (they were dropped, never merged).
    pub refused: Vec<(DeviceId, String)>,
}

impl LedgerCatchupSummary {
    /// Why the catch-up did not leave the ledger complete (`None`: it is
    /// complete, installed now or already).
    pub fn failure(&self) -> Option<String> {
        if self.installed_from.is_some() || self.already_complete {
            None
        } else if self.answered.is_empty() {
            Some("no member answered".to_string())
        } else {
            Some(format!("every answer was refused: {:?}", self.refused))
        }
    }
}

/// What a policy catch-up did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyCatchupSummary {
    /// Settings (group-wide and members' own) that hold a newer value now
    /// than before the catch-up, or that are new.
    pub landed: usize,
    /// Why the group's commit log could not be read to its end (settings
    /// enacted there may still be missing), if it could not.
    pub log_unread: Option<String>,
    /// The ledger gather it ran (`already_complete` when none was needed).
    pub ledger: LedgerCatchupSummary,
}

/// One answer as the requester receives it.
pub(super) struct Answer {
    pub from: DeviceId,
    pub kem_output: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// A ledger request waiting for answers.
pub(super) struct Pending {
    pub tx: mpsc::Sender<Answer>,
}

fn answer_aad(group: &GroupId, nonce: &[u8; 16]) -> Vec<u8> {
    let mut aad = group.0.to_vec();
    aad.extend_from_slice(nonce);
    aad
}

/// Fold `entries` from genesis and accept them only if they reproduce
/// `head`: what a Welcome's snapshot and a gathered ledger must both pass.
///
/// # Errors
/// The fold's error (a bad signature, an entry its author may not write, a
/// duplicate), or [`LedgerError::HeadMismatch`].
pub(super) fn verify_ledger(
    group: GroupId,
    plain: &[u8],
    head: &[u8; 32],
) -> Result<(Vec<Entry>, LedgerState), LedgerError> {
    let entries = ledger::decode_list(plain)?;
    let state = LedgerState::fold_to(group, &entries, head)?;
    Ok((entries, state))
}

impl GroupPeerManager {
    /// Ask the group's members for the whole ledger and install the first
    /// answer that reproduces the head MLS authenticates now; give up at
    /// `deadline` (answers go on arriving until then only if none fit).
    /// The request goes to every hub the group is bound to, through the
    /// outbox, like a message.
    ///
    /// # Errors
    /// `UnknownGroup`, MLS or store errors. No answer, or none that fits,
    /// is not an error: the summary says who answered and why each was
    /// refused, and the ledger stays incomplete.
    pub async fn request_ledger_catchup(
        &self,
        group: GroupId,
        deadline: Duration,
    ) -> Result<LedgerCatchupSummary, DeviceError> {
        self.gather(group, deadline, false).await
    }

    /// Bring this device's view of the group's settings up to what the
    /// group enacted, and answer how many landed. Settings are ledger
    /// entries: a value counts only once a commit enacted it, so members
    /// restate theirs the one way a restatement can be checked, as the
    /// whole ledger reproducing the head MLS authenticates. A member that
    /// restated single settings could replay one its author has since
    /// overwritten, or one whose author has lost the right to write it,
    /// and nothing could tell. So: a stranded device rejoins first; then
    /// the commit log is read to its end (what was enacted there lands
    /// through the normal path); then, if the ledger is still incomplete,
    /// the members are asked for it as in
    /// [`request_ledger_catchup`](Self::request_ledger_catchup).
    ///
    /// # Errors
    /// `UnknownGroup`, `Stranded` when the rejoin did not help, MLS or store
    /// errors. An unreadable commit log or no fitting answer is not an
    /// error: the summary says so.
    pub async fn request_policy_catchup(
        &self,
        group: GroupId,
        deadline: Duration,
    ) -> Result<PolicyCatchupSummary, DeviceError> {
        self.rejoin_if_stranded(group).await?;
        let before = self.settings(group)?;
        let log_unread = match self.pull(group).await {
            Ok(()) => None,
            Err(super::lane::PullError::UnknownGroup(g)) => {
                return Err(DeviceError::UnknownGroup(g))
            }
            Err(e) => Some(e.to_string()),
        };
        let ledger = self.gather(group, deadline, false).await?;
        let after = self.settings(group)?;
        let newer = |old: Option<&super::ledger::Setting>, new: &super::ledger::Setting| {
            old.is_none_or(|o| (new.ord, new.id) > (o.ord, o.id))
        };
        let landed = after
            .group
            .iter()
            .filter(|(k, v)| newer(before.group.get(*k), v))
            .count()
            + after
                .members
                .iter()
                .filter(|(k, v)| newer(before.members.get(*k), v))
                .count();
        Ok(PolicyCatchupSummary {
            landed,
            log_unread,
            ledger,
        })
    }

    /// [`request_ledger_catchup`](Self::request_ledger_catchup); with
    /// `ask_anyway`, the members are asked even when the ledger is
    /// complete (after a rejoin, an answer is a member that read this
    /// device in the new epoch: the summary's `answered`).
    pub(super) async fn gather(
        &self,
        group: GroupId,
        deadline: Duration,
        ask_anyway: bool,
    ) -> Result<LedgerCatchupSummary, DeviceError> {
        let rec = self.record(group)?;
        if rec.ledger_complete && !ask_anyway {
            return Ok(LedgerCatchupSummary {
                already_complete: true,
                ..LedgerCatchupSummary::default()
            });
        }
        let crypto = self.shared.registry.provider().crypto();
        let mut guard = self.shared.registry.lock(group).await;
        let suite = guard.read(|g| g.ciphersuite())?;
        drop(guard);
        let mut ikm = [0u8; 32];
        self.shared.rng.fill(&mut ikm);
        let keys = crypto
            .derive_hpke_keypair(suite.hpke_config(), &ikm)
            .map_err(|e| DeviceError::Mls(format!("HPKE key pair: {e:?}")))?;
        let mut nonce = [0u8; 16];
        self.shared.rng.fill(&mut nonce);
        let (tx, mut rx) = mpsc::channel(ANSWER_QUEUE);
        super::manager::lock(&self.shared.gathers).insert((group, nonce), Pending { tx });
        let result = async {
            let request = Control::LedgerRequest {
                nonce,
                hpke_public: keys.public.clone(),
            };
            self.send_control(group, &request).await?;
            let mut summary = LedgerCatchupSummary::default();
            let until = tokio::time::Instant::now() + deadline;
            while let Ok(Some(a)) = tokio::time::timeout_at(until, rx.recv()).await {
                summary.answered.push(a.from);
                let input = HpkeCiphertext {
                    kem_output: a.kem_output.into(),
                    ciphertext: a.ciphertext.into(),
                };
                let plain = match crypto.hpke_open(
                    suite.hpke_config(),
                    &input,
                    keys.private.as_ref(),
                    ANSWER_INFO,
                    &answer_aad(&group, &nonce),
                ) {
                    Ok(p) => p,
                    Err(e) => {
                        summary
                            .refused
                            .push((a.from, format!("does not open: {e:?}")));
                        continue;
                    }
                };
                match self.install_gathered(group, &plain).await {
                    Ok(Some(n)) => {
                        self.emit(Event::LedgerGathered {
                            group,
                            from: a.from,
                            entries: n,
                        });
                        summary.installed_from = Some(a.from);
                        summary.entries = n;
                        break;
                    }
                    // Completed meanwhile (another request's answer).
                    Ok(None) => {
                        summary.already_complete = true;
                        break;
                    }
                    Err(GatherRefusal::Ledger(e)) => {
                        summary.refused.push((a.from, e.to_string()));
                    }
                    Err(GatherRefusal::Device(e)) => return Err(e),
                }
            }
            Ok(summary)
        }
        .await;
        super::manager::lock(&self.shared.gathers).remove(&(group, nonce));
        result
    }

    /// Install a gathered ledger (`plain`, an encoded entry list) if it
    /// reproduces the group's authenticated head now. Answers how many
    /// entries it holds, or `None` when the ledger was complete already.
    async fn install_gathered(
        &self,
        group: GroupId,
        plain: &[u8],
    ) -> Result<Option<usize>, GatherRefusal> {
        let mut guard = self.shared.registry.lock(group).await;
        let mut rec = self.record(group)?;
        if rec.ledger_complete {
            return Ok(None);
        }
        let head = guard
            .read(|g| GroupExt::from_extensions(g.extensions()))
            .map_err(DeviceError::from)?
            .ok()
            .flatten()
            .map(|ext| ext.ledger_head)
            .ok_or_else(|| DeviceError::Mls("the group has no valid hubsync extension".into()))?;
        let (entries, state) = verify_ledger(group, plain, &head).map_err(GatherRefusal::Ledger)?;
        rec.ledger_complete = true;
        self.follow_ledger(&mut rec, &state, &entries);
        let mut b = WriteBatch::new();
        let encoded: Vec<Vec<u8>> = entries.iter().map(Entry::encode).collect();
        self.shared
            .records
            .replace_ledger(&mut b, &group, &encoded)
            .map_err(DeviceError::from)?;
        self.shared.records.put_group(&mut b, &rec);
        guard.finish(b).map_err(DeviceError::from)?;
        drop(guard);
        self.emit(Event::LedgerChanged { group });
        self.sync_peers(&rec);
        Ok(Some(entries.len()))
    }

    /// Answer `requester`'s ledger request with our whole ledger, sealed to
    /// its key, if our ledger is complete.
    pub(super) async fn answer_ledger(
        &self,
        group: GroupId,
        requester: DeviceId,
        nonce: [u8; 16],
        hpke_public: Vec<u8>,
    ) -> Result<(), DeviceError> {
        let rec = self.record(group)?;
        if !rec.ledger_complete {
            return Ok(());
        }
        let delay = self.shared.faults.answer_delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let mut entries = self.ledger_entries(group)?;
        match self.shared.faults.lying_ledger.load(Ordering::Relaxed) {
            1 if entries.len() > 1 => entries.swap(0, 1),
            2 => {
                entries.pop();
            }
            _ => {}
        }
        let plain = ledger::encode_list(&entries);
        let crypto = self.shared.registry.provider().crypto();
        let mut guard = self.shared.registry.lock(group).await;
        let suite = guard.read(|g| g.ciphersuite())?;
        drop(guard);
        let sealed = crypto
            .hpke_seal(
                suite.hpke_config(),
                &hpke_public,
                ANSWER_INFO,
                &answer_aad(&group, &nonce),
                &plain,
            )
            .map_err(|e| DeviceError::Mls(format!("HPKE seal: {e:?}")))?;
        let answer = Control::LedgerAnswer {
            nonce,
            to: requester,
            kem_output: sealed.kem_output.as_slice().to_vec(),
            ciphertext: sealed.ciphertext.as_slice().to_vec(),
        };
        self.send_control(group, &answer).await
    }
}

/// Why a gathered ledger was not installed.
enum GatherRefusal {
    /// It does not fold, or not to the authenticated head: the answer is
    /// refused.
    Ledger(LedgerError),
    /// This device failed (store, MLS): the catch-up stops with it.
    Device(DeviceError),
}

impl From<DeviceError> for GatherRefusal {
    fn from(e: DeviceError) -> Self {
        GatherRefusal::Device(e)
    }
}
