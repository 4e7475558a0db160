//! Group control: invites, removes, key rotation and ledger entries, each a
//! commit through the lane. Who may do what is the ledger's to say
//! (DESIGN.md section 4): the creator is the first admin; only admins
//! invite, remove, grant, revoke, bind and move the commit hub; any member
//! rotates its own keys and sets its own (`self.`) settings. Each operation
//! checks its entries against the ledger before anything is built, so a
//! refusal is a named error and nothing is published; every member checks
//! them again when the commit arrives, so a device that skips the local
//! check only forks itself off.

use super::events::Event;
use super::frames::{publish_id, WelcomeEnvelope};
use super::identity::{credential_matches_key, device_id_of};
use super::lane::{CommitError, CommitKind, LaneResult, Plan};
use super::ledger::{self, Entry, EntryType, LedgerState, Setting};
use super::manager::GroupPeerManager;
use super::records::{GroupId, GroupRecord};
use super::registry::GroupGuard;
use super::topics;
use crate::kv::WriteBatch;
use crate::wire::{DeviceId, ExpectedHead, Publish, RetentionClass};
use futures::{StreamExt as _, TryStreamExt as _};
use openmls::prelude::tls_codec::Deserialize as _;
use openmls::prelude::*;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

/// Key package claims of one `invite_many` in flight at once.
const CLAIMS_IN_FLIGHT: usize = 32;

/// A key package as a hub holds it: bare, or in its standard MLSMessage
/// form (what other MLS implementations upload).
pub(super) fn parse_key_package(bytes: &[u8]) -> Result<KeyPackageIn, String> {
    if let Ok(kp) = KeyPackageIn::tls_deserialize_exact(bytes) {
        return Ok(kp);
    }
    match MlsMessageIn::tls_deserialize_exact(bytes)
        .map_err(|e| e.to_string())?
        .extract()
    {
        MlsMessageBodyIn::KeyPackage(kp) => Ok(kp),
        _ => Err("an MLSMessage that holds no key package".into()),
    }
}

/// A group's settings as its ledger holds them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// Group-wide settings (written by admins), by name.
    pub group: BTreeMap<String, Setting>,
    /// Each member's own `self.` settings, by (member, name).
    pub members: BTreeMap<(DeviceId, String), Setting>,
}

/// How long the members other than the designated one wait before they
/// commit a leave themselves.
pub const LEAVE_FALLBACK: std::time::Duration = std::time::Duration::from_secs(2);

/// How [`GroupPeerManager::leave_group`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaveOutcome {
    /// A member committed this device's removal; its state there is gone.
    Removed,
    /// This device was the group's only member: it forgot the group.
    Forgotten,
}

impl GroupPeerManager {
    /// Sign a ledger entry as this device, ordered by the device's hybrid
    /// logical clock on the injected clock.
    pub(crate) fn sign_entry(
        &self,
        kind: EntryType,
        group: GroupId,
        subject: Vec<u8>,
        value: Vec<u8>,
    ) -> Entry {
        // After a restart the clock starts fresh: our next entry must still
        // order after every one the group's ledger holds.
        if let Ok(entries) = self.ledger_entries(group) {
            if let Some(max) = entries.iter().map(|e| e.ord).max() {
                self.shared.hlc.observe(max);
            }
        }
        let ord = self.shared.hlc.tick(self.shared.clock.now_ms());
        Entry::sign(
            kind,
            group,
            subject,
            value,
            ord,
            self.shared.identity.signing_key(),
        )
    }

    fn op_id(&self) -> [u8; 16] {
        self.next_message_id()
    }

    /// The record and ledger of a group, and the entries checked against
    /// the ledger in order (nothing is built when one is refused).
    fn check_entries(
        &self,
        group: GroupId,
        entries: &[Entry],
    ) -> Result<(GroupRecord, LedgerState), CommitError> {
        let rec = self.record(group)?;
        if !rec.ledger_complete {
            return Err(CommitError::RecoveryRequired(group));
        }
        let ledger = self.ledger_state(&rec)?;
        let mut next = ledger.clone();
        for e in entries {
            next.apply(e).map_err(CommitError::Ledger)?;
        }
        Ok((rec, ledger))
    }

    async fn commit_plan(&self, group: GroupId, plan: Plan) -> Result<LaneResult, CommitError> {
        self.run_lane(group, Some(plan))
            .await?
            .ok_or(CommitError::Stopped)
    }

    /// Invite `device`: its `member.invite` entry (this device must be an
    /// admin) and the MLS add in one commit, with a key package claimed on
    /// the group's hubs whose leaf is the invitee's own device; the Welcome
    /// goes out once the commit landed.
    ///
    /// # Errors
    /// `Ledger` (not an admin, already a member), `AlreadyMember`,
    /// `NoHubs`, `NoKeyPackage`, and the lane's errors.
    pub async fn invite(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        self.invite_many(group, &[device]).await
    }

    /// Invite every device of `devices` in one commit: a `member.invite`
    /// entry for each (this device must be an admin), one MLS commit adding
    /// them all, and one Welcome, posted to each joiner's Welcome topic once
    /// the commit landed. Forming a group of N this way costs one commit
    /// instead of N-1, and the other members process one commit, not N-1.
    ///
    /// All or nothing: when any device cannot be added, nobody is. A device
    /// named twice is invited once. Key packages are claimed on all of them
    /// at once before the commit is built; those claimed for a call that
    /// then fails are used up (each device keeps a stock, and a last-resort
    /// one).
    ///
    /// # Errors
    /// `NoInvitees` for an empty list, `AlreadyMember` for the first device
    /// already in the group, `NoKeyPackage` for the first device without a
    /// valid key package, and as [`GroupPeerManager::invite`].
    pub async fn invite_many(
        &self,
        group: GroupId,
        devices: &[DeviceId],
    ) -> Result<LaneResult, CommitError> {
        let mut unique: Vec<DeviceId> = Vec::with_capacity(devices.len());
        for d in devices {
            if !unique.contains(d) {
                unique.push(*d);
            }
        }
        if unique.is_empty() {
            return Err(CommitError::NoInvitees(group));
        }
        if unique.len() > super::lane::MAX_INVITEES {
            return Err(CommitError::TooManyInvitees {
                count: unique.len(),
                max: super::lane::MAX_INVITEES,
            });
        }
        let members = self.members(group).await?;
        if let Some(device) = unique.iter().find(|d| members.contains(d)) {
            return Err(CommitError::AlreadyMember {
                group,
                device: *device,
            });
        }
        let entries: Vec<Entry> = unique
            .iter()
            .map(|d| self.sign_entry(EntryType::MemberInvite, group, d.0.to_vec(), Vec::new()))
            .collect();
        let (rec, _) = self.check_entries(group, &entries)?;
        if rec.hubs.is_empty() {
            return Err(CommitError::NoHubs(group));
        }
        // Claimed many at once (the requests share the links, so they are
        // answered in a few round trips' time, not one per invitee), but
        // not all at once: a thousand claims in flight would only queue at
        // the hub's rate limits.
        let kps: Vec<KeyPackage> = futures::stream::iter(
            unique
                .iter()
                .copied()
                .map(|d| self.claim_key_package(&rec, d)),
        )
        .buffered(CLAIMS_IN_FLIGHT)
        .try_collect()
        .await?;
        self.commit_plan(
            group,
            Plan {
                kind: CommitKind::Invite,
                op: self.op_id(),
                entries,
                add: unique.into_iter().zip(kps).collect(),
                remove: None,
                redriven: false,
            },
        )
        .await
    }

    /// Claim one key package of `device` on the group's hubs (commit hub
    /// first): valid, and whose leaf is `device` itself (credential
    /// identity and signature key both its ed25519 key).
    async fn claim_key_package(
        &self,
        rec: &GroupRecord,
        device: DeviceId,
    ) -> Result<KeyPackage, CommitError> {
        let mut hubs = vec![rec.commit_hub.clone()];
        hubs.extend(rec.hubs.iter().filter(|h| **h != rec.commit_hub).cloned());
        let mut invalid = None;
        for hub in &hubs {
            if super::lane::is_loopback(hub) {
                continue;
            }
            let bytes = match self.hub_link(hub).claim_key_package(device).await {
                Ok((bytes, _last_resort)) => bytes,
                Err(e) => {
                    tracing::debug!(hub, error = %e, "no key package from this hub");
                    continue;
                }
            };
            let crypto = self.shared.registry.provider().crypto();
            let kp = parse_key_package(&bytes).and_then(|k| {
                k.validate(crypto, ProtocolVersion::Mls10)
                    .map_err(|e| e.to_string())
            });
            let reason = match kp {
                Ok(kp) => {
                    let leaf = kp.leaf_node();
                    if device_id_of(leaf.credential()) == Some(device)
                        && credential_matches_key(
                            leaf.credential(),
                            leaf.signature_key().as_slice(),
                        )
                    {
                        return Ok(kp);
                    }
                    "its leaf is not the invitee's own device".to_string()
                }
                Err(e) => format!("not a valid MLS key package: {e}"),
            };
            self.emit(Event::KeyPackageRefused {
                device,
                hub: hub.clone(),
                reason: reason.clone(),
            });
            invalid.get_or_insert(CommitError::InvalidKeyPackage {
                device,
                hub: hub.clone(),
                reason,
            });
        }
        Err(invalid.unwrap_or(CommitError::NoKeyPackage(device)))
    }

    /// Remove `device`: its `member.remove` entry (this device must be an
    /// admin) and the MLS remove in one commit.
    ///
    /// # Errors
    /// `Ledger` (not an admin, not a member, the last admin), `NotAMember`,
    /// and the lane's errors.
    pub async fn remove(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        if !self.members(group).await?.contains(&device) {
            return Err(CommitError::NotAMember { group, device });
        }
        let entry = self.sign_entry(
            EntryType::MemberRemove,
            group,
            device.0.to_vec(),
            Vec::new(),
        );
        self.commit_removal(group, device, entry).await
    }

    /// Check `entry` (the `member.remove` of `device`) and commit it with
    /// the MLS remove of `device`'s leaf.
    async fn commit_removal(
        &self,
        group: GroupId,
        device: DeviceId,
        entry: Entry,
    ) -> Result<LaneResult, CommitError> {
        self.check_entries(group, std::slice::from_ref(&entry))?;
        self.commit_plan(
            group,
            Plan {
                kind: CommitKind::Remove,
                op: self.op_id(),
                entries: vec![entry],
                add: Vec::new(),
                remove: Some(device),
                redriven: false,
            },
        )
        .await
    }

    /// Leave `group`: this device signs its own `member.remove` entry and
    /// asks the members, in a control message, to commit it (MLS lets no
    /// member commit its own removal); it returns once it has seen its
    /// removal ([`LeaveOutcome::Removed`]: its state there is gone, the
    /// inbox stays). Alone in the group, it forgets the group instead
    /// ([`LeaveOutcome::Forgotten`]).
    ///
    /// Who commits: the remaining member with the lowest device id at
    /// once; every other member after [`LEAVE_FALLBACK`], if the leaver is
    /// still there (so one offline member does not hold a leave up).
    ///
    /// # Errors
    /// `UnknownGroup`; `Ledger(LastAdmin)` for the last admin (grant
    /// another first); `RecoveryRequired` when this device's ledger is
    /// incomplete; `TimedOut` when no removal was seen within the commit
    /// deadline (the request stays out: a member may still commit it; or
    /// call `forget_group`).
    pub async fn leave_group(&self, group: GroupId) -> Result<LeaveOutcome, CommitError> {
        let me = self.shared.identity.id();
        let members = self.members(group).await?;
        if members.iter().all(|d| *d == me) {
            self.forget_group(group).await?;
            return Ok(LeaveOutcome::Forgotten);
        }
        let entry = self.sign_entry(EntryType::MemberRemove, group, me.0.to_vec(), Vec::new());
        self.check_entries(group, std::slice::from_ref(&entry))?;
        self.send_control(
            group,
            &super::control_msg::Control::LeaveRequest {
                entry: entry.encode(),
            },
        )
        .await?;
        let until = tokio::time::Instant::now() + self.shared.config.commit_deadline;
        loop {
            match self.record(group) {
                Err(super::DeviceError::UnknownGroup(_)) => return Ok(LeaveOutcome::Removed),
                Err(e) => return Err(e.into()),
                Ok(_) if tokio::time::Instant::now() >= until => {
                    return Err(CommitError::TimedOut(group))
                }
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
    }

    /// Commit `leaver`'s own removal (`entry`, checked by the caller to be
    /// its self-signed `member.remove`), as [`GroupPeerManager::leave_group`]
    /// describes. A removal someone else committed first is no error.
    pub(super) async fn commit_leave(
        &self,
        group: GroupId,
        leaver: DeviceId,
        entry: Entry,
    ) -> Result<(), CommitError> {
        let me = self.shared.identity.id();
        let members = self.members(group).await?;
        if !members.contains(&leaver) {
            return Ok(());
        }
        if members.iter().filter(|d| **d != leaver).min() != Some(&me) {
            tokio::time::sleep(LEAVE_FALLBACK).await;
            if !self.members(group).await?.contains(&leaver) {
                return Ok(());
            }
        }
        match self.commit_removal(group, leaver, entry).await {
            Ok(_) => Ok(()),
            // Another member committed it first.
            Err(CommitError::NotAMember { .. })
            | Err(CommitError::Ledger(ledger::LedgerError::Duplicate(_)))
            | Err(CommitError::Ledger(ledger::LedgerError::NotAMember(_))) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Update this device's own leaf (post-compromise security). Any member
    /// may.
    ///
    /// # Errors
    /// The lane's errors.
    pub async fn rotate(&self, group: GroupId) -> Result<LaneResult, CommitError> {
        self.commit_plan(
            group,
            Plan {
                kind: CommitKind::Rotate,
                op: self.op_id(),
                entries: Vec::new(),
                add: Vec::new(),
                remove: None,
                redriven: false,
            },
        )
        .await
    }

    /// Enact ledger entries of this device in one `ledger` commit.
    ///
    /// # Errors
    /// `Ledger` when the ledger refuses one (nothing is published), and
    /// the lane's errors.
    pub(crate) async fn enact(
        &self,
        group: GroupId,
        entries: Vec<(EntryType, Vec<u8>, Vec<u8>)>,
    ) -> Result<LaneResult, CommitError> {
        let entries: Vec<Entry> = entries
            .into_iter()
            .map(|(k, s, v)| self.sign_entry(k, group, s, v))
            .collect();
        self.check_entries(group, &entries)?;
        self.commit_plan(
            group,
            Plan {
                kind: CommitKind::Ledger,
                op: self.op_id(),
                entries,
                add: Vec::new(),
                remove: None,
                redriven: false,
            },
        )
        .await
    }

    /// Make `device` (a member) an admin. Admins only.
    ///
    /// # Errors
    /// As [`enact`](Self::enact).
    pub async fn grant_admin(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        self.enact(
            group,
            vec![(EntryType::AdminGrant, device.0.to_vec(), Vec::new())],
        )
        .await
    }

    /// Take admin rights from `device` (never the last admin). Admins only.
    ///
    /// # Errors
    /// As [`enact`](Self::enact).
    pub async fn revoke_admin(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<LaneResult, CommitError> {
        self.enact(
            group,
            vec![(EntryType::AdminRevoke, device.0.to_vec(), Vec::new())],
        )
        .await
    }

    /// Bind the group to another hub: every member adds a peer for it.
    /// Admins only.
    ///
    /// # Errors
    /// As [`enact`](Self::enact).
    pub async fn bind_hub(&self, group: GroupId, url: &str) -> Result<LaneResult, CommitError> {
        let url = url.trim_end_matches('/');
        self.enact(
            group,
            vec![(EntryType::HubBind, url.as_bytes().to_vec(), Vec::new())],
        )
        .await
    }

    /// Unbind the group from a hub (never the commit hub): every member
    /// drops that peer. Admins only.
    ///
    /// # Errors
    /// As [`enact`](Self::enact).
    pub async fn unbind_hub(&self, group: GroupId, url: &str) -> Result<LaneResult, CommitError> {
        let url = url.trim_end_matches('/');
        self.enact(
            group,
            vec![(EntryType::HubUnbind, url.as_bytes().to_vec(), Vec::new())],
        )
        .await
    }

    /// Move every member's commits to `url` (a bound hub). Admins only.
    ///
    /// # Errors
    /// As [`enact`](Self::enact).
    pub async fn set_commit_hub(
        &self,
        group: GroupId,
        url: &str,
    ) -> Result<LaneResult, CommitError> {
        let url = url.trim_end_matches('/');
        self.enact(
            group,
            vec![(EntryType::HubCommit, url.as_bytes().to_vec(), Vec::new())],
        )
        .await
    }

    /// Set a setting: a name starting with `self.` is this device's own
    /// (any member); any other name is group-wide (admins only). The value
    /// with the latest clock wins on every member.
    ///
    /// # Errors
    /// As [`enact`](Self::enact).
    pub async fn set_setting(
        &self,
        group: GroupId,
        name: &str,
        value: &[u8],
    ) -> Result<LaneResult, CommitError> {
        self.enact(
            group,
            vec![(
                EntryType::GroupSetting,
                name.as_bytes().to_vec(),
                value.to_vec(),
            )],
        )
        .await
    }

    /// The group's settings as this device's ledger holds them.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn settings(&self, group: GroupId) -> Result<Settings, CommitError> {
        let state = self.ledger_state(&self.record(group)?)?;
        Ok(Settings {
            group: state.settings,
            members: state.member_settings,
        })
    }

    /// The group's ledger as this device holds it, in enactment order.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn ledger(&self, group: GroupId) -> Result<Vec<Entry>, CommitError> {
        self.record(group)?;
        Ok(self.ledger_entries(group)?)
    }

    /// The group's ledger folded: admins, members, hubs, commit hub.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn ledger_view(&self, group: GroupId) -> Result<LedgerState, CommitError> {
        Ok(self.ledger_state(&self.record(group)?)?)
    }

    /// Queue the Welcome of a landed invite for every hub of the group, in
    /// the caller's batch (with the merge), and keep the publish while the
    /// joiner is a member ([`Records::put_invited_welcome`]), to post again
    /// to a hub that loses it. The envelope carries the inviter's whole
    /// ledger (`ledger_entries`, including this commit's) sealed under the
    /// joiner's first epoch, which the guard's group has just reached.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn stage_welcome(
        &self,
        guard: &mut GroupGuard,
        b: &mut WriteBatch,
        rec: &GroupRecord,
        seq: u64,
        joiner: DeviceId,
        welcome: &[u8],
        ledger_entries: &[Entry],
    ) -> Result<(), CommitError> {
        let me = &self.shared.identity;
        let crypto = self.shared.registry.provider().crypto();
        let key = guard
            .read(|g| g.export_secret(crypto, ledger::SNAPSHOT_KEY_LABEL, &[], 16))?
            .map_err(|e| CommitError::Mls(e.to_string()))?;
        let mut nonce = [0u8; 12];
        self.shared.rng.fill(&mut nonce);
        let faults = &self.shared.faults;
        let short_by = faults.welcome_ledger_short_by.load(Ordering::Relaxed);
        let kept = ledger_entries.len().saturating_sub(short_by);
        let list = ledger::encode_list(&ledger_entries[..kept]);
        let sealed =
            ledger::seal(crypto, &key, nonce, &rec.id.0, &list).map_err(CommitError::Ledger)?;
        let env = WelcomeEnvelope {
            group: rec.id,
            hubs: rec.hubs.clone(),
            commit_hub: rec.commit_hub.clone(),
            commit_seq: seq,
            welcome: welcome.to_vec(),
            ledger: sealed,
            inviter: me.id(),
            signature: Vec::new(),
        }
        .sign(me.signing_key());
        let topic = topics::welcome_topic(&joiner);
        // One id per Welcome (retries reuse the staged publish): positions
        // repeat, since every roster change starts a new commit topic.
        let mut op = b"welcome".to_vec();
        op.extend_from_slice(&rec.id.0);
        op.extend_from_slice(&crate::device::frames::digest(welcome));
        let publish = Publish {
            topic: topic.clone(),
            publish_id: publish_id(&op, &topic),
            class: RetentionClass::Mailbox,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: None,
            payload: env.encode(),
            writer: None,
        };
        for hub in rec.hubs.iter().filter(|h| !super::lane::is_loopback(h)) {
            self.shared.outbox.stage(b, hub, &publish).map_err(|e| {
                CommitError::Store(super::registry::RegistryError::Store(e.to_string()))
            })?;
        }
        // Checked at each invite too, so the records of a group with churn
        // stay bounded by its roster.
        self.kept_welcomes(guard, b, rec.id)
            .map_err(|e| CommitError::Mls(e.to_string()))?;
        self.shared
            .records
            .put_invited_welcome(b, &rec.id, &joiner, &publish);
        Ok(())
    }

    /// The Welcomes this device keeps for `group`'s current members; those
    /// kept for members gone since are forgotten in `b`. At most one per
    /// member ([`Records::put_invited_welcome`]).
    pub(crate) fn kept_welcomes(
        &self,
        guard: &mut GroupGuard,
        b: &mut WriteBatch,
        group: GroupId,
    ) -> Result<Vec<Publish>, super::DeviceError> {
        let members = self.members_of(guard)?;
        let mut kept = Vec::new();
        for (joiner, w) in self.shared.records.invited_welcomes(&group)? {
            if members.contains(&joiner) {
                kept.push(w);
            } else {
                self.shared
                    .records
                    .delete_invited_welcome(b, &group, &joiner);
            }
        }
        Ok(kept)
    }
}
