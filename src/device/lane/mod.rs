//! The commit lane: every commit of a group goes through its canonical
//! commit hub under a compare-and-set on that hub's head, so exactly one
//! commit wins each position, and a commit is merged only once the hub
//! accepted it (DESIGN.md section 4).
//!
//! - [`machine`]: the I/O-free state machine of one commit run (idle,
//!   journalled, published, accepted, lost, stranded), tested with scripted
//!   outcomes.
//! - `driver`: drives the machine: builds and journals under the group lock,
//!   publishes without it, re-locks to settle.
//! - `pull`: reads the commit topic and applies it in hub order, judging
//!   each frame with [`classify`].
//! - `build`: what a commit changes ([`Plan`]) and how it becomes an MLS
//!   commit carrying ledger entries.
//!
//! The group lock is never held across a network wait, and one run at a
//! time commits per group (a lane lock, apart from the group lock, so that
//! sends and receives go on while a commit waits on its hub).

mod build;
pub mod classify;
mod driver;
pub mod machine;
mod pull;

pub use crate::device::loopback::is_loopback;
pub(crate) use build::Plan;
/// The commit frame and its authenticated data, for the fuzzing targets.
pub(crate) use build::{enacted_aad, parse_enacted_aad, CommitFrame};
pub use classify::SkipReason;
pub(crate) use pull::protocol_message;
pub use pull::{select_commit_hub, PullError, LOOPBACK_HUB};

use super::ledger::{Entry, LedgerError};
use super::link::LinkError;
use super::records::GroupId;
use super::registry::RegistryError;
use crate::kv::KvError;
use crate::wire::{DeviceId, ExpectedHead, PublishId};
use serde::{Deserialize, Serialize};

/// The most devices one commit may add (`invite_many`). The commit carries
/// every joiner's key package and the Welcome the whole ratchet tree, so
/// both grow with the count; a commit or Welcome above the hub's payload
/// limit is refused by the hub (`HubRefused`, nothing lands). The enacted
/// entry list in a commit's authenticated data counts in 16 bits, far
/// above this bound.
pub const MAX_INVITEES: usize = 1000;

/// What a commit does, for the journal and for what a lost one means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CommitKind {
    /// Ledger entries only (grant, revoke, bind, unbind, commit hub,
    /// settings). A lost one is re-driven once from its entries.
    Ledger,
    /// Adds a member (with its `member.invite` entry). A lost one is
    /// reported: its key package is spent and cannot be rebuilt.
    Invite,
    /// Removes a member (with its `member.remove` entry). A lost one is
    /// reported.
    Remove,
    /// Updates this device's own leaf (post-compromise security).
    Rotate,
}

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

/// A commit journalled by an earlier run that never landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostCommit {
    /// What it was.
    pub kind: CommitKind,
    /// The device it added or removed, for an invite or remove.
    pub subject: Option<DeviceId>,
    /// The ledger entries it carried.
    pub entries: Vec<Entry>,
    /// Whether its entries were issued again (a lost `ledger` commit is,
    /// once, minus the entries the ledger already holds).
    pub redriven: bool,
}

/// The answer of one [`commit`](crate::device::GroupPeerManager) run: the
/// caller's commit landed, and what else the run found. A result can carry
/// both a `lost` and a `reenact`; each is handled on its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneResult {
    /// The caller's commit.
    pub outcome: CommitReport,
    /// A commit journalled earlier (before a crash or a timeout) that the
    /// run found lost.
    pub lost: Option<LostCommit>,
    /// Entries of this device that the group's authenticated ledger lacks
    /// and that were issued again (filled by the remedies; empty otherwise).
    pub reenact: Vec<Entry>,
}

/// The commit in flight, written with the MLS pending commit in one batch
/// before the publish, so a crash never loses or doubles a commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// The operation's id: stable across rebuilds and the one re-drive.
    pub op: [u8; 16],
    /// What the commit does.
    pub kind: CommitKind,
    /// The hub it is published to (the commit hub when built).
    pub hub: String,
    /// The epoch it was built at.
    pub epoch: u64,
    /// The exact bytes published.
    pub payload: Vec<u8>,
    /// Their publish id (a replay must carry the same).
    pub publish_id: PublishId,
    /// The head the publish compared against.
    pub expected_head: ExpectedHead,
    /// Whether the commit changes the roster.
    pub roster: bool,
    /// The device an invite adds or a remove removes.
    pub subject: Option<DeviceId>,
    /// Who the commit adds, and the one Welcome to send each of them once
    /// it landed.
    pub welcome: Option<(Vec<DeviceId>, Vec<u8>)>,
    /// The ledger entries it enacts, encoded.
    pub entries: Vec<Vec<u8>>,
    /// Set, durably, as soon as the hub's acceptance is known and before
    /// the merge: a restart then adopts the commit with no network call.
    pub accepted: Option<u64>,
    /// This commit is the one re-drive of a lost ledger commit: if it is
    /// lost too, it is reported and not re-driven again.
    pub redriven: bool,
    /// The commit seed of the topic it is published on: the group's when
    /// it was built (a journal from before this field: the record's).
    #[serde(default)]
    pub commit_seed: Option<[u8; 32]>,
}

/// Why a commit did not land. Sources are kept typed; [`is_transient`]
/// is the one place that says what a later attempt can change.
///
/// [`is_transient`]: CommitError::is_transient
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    /// The device is not in that group.
    #[error("not a member of group {0}")]
    UnknownGroup(GroupId),
    /// The device to remove is not in the group.
    #[error("{device} is not a member of group {group}")]
    NotAMember {
        /// The group.
        group: GroupId,
        /// The device.
        device: DeviceId,
    },
    /// The device to invite is already in the group.
    #[error("{device} is already a member of group {group}")]
    AlreadyMember {
        /// The group.
        group: GroupId,
        /// The device.
        device: DeviceId,
    },
    /// No valid key package of the invitee (one whose leaf is the invitee's
    /// own device) could be claimed on the group's hubs.
    #[error("no key package for {0} on the group's hubs")]
    NoKeyPackage(DeviceId),
    /// A hub handed out a key package of the invitee that is not valid: it
    /// does not verify as MLS, or its leaf is not the invitee's own device
    /// (a forgery, by a stranger or the hub's operator). It was claimed and
    /// is spent; it was also reported as [`Event::KeyPackageRefused`].
    /// Nothing was committed. Inviting again claims the next package.
    ///
    /// [`Event::KeyPackageRefused`]: crate::device::Event::KeyPackageRefused
    #[error("the key package of {device} claimed on {hub} is invalid: {reason}")]
    InvalidKeyPackage {
        /// The invitee.
        device: DeviceId,
        /// The hub that handed it out.
        hub: String,
        /// Why it was refused.
        reason: String,
    },
    /// `invite_many` was given no device to invite.
    #[error("nobody to invite into group {0}")]
    NoInvitees(GroupId),
    /// `invite_many` was given more devices than one commit may add
    /// ([`MAX_INVITEES`]); nothing was done. Invite them in several calls.
    #[error("{count} devices to invite in one commit, at most {max}")]
    TooManyInvitees {
        /// Devices asked for (after removing repeats).
        count: usize,
        /// The bound.
        max: usize,
    },
    /// An invite needs a hub the invitee can reach: bind one first.
    #[error("group {0} has no hub bound; bind one before inviting")]
    NoHubs(GroupId),
    /// The ledger refuses the entries (for example: not an admin, the last
    /// admin, a hub not bound). Nothing was published.
    #[error("ledger: {0}")]
    Ledger(#[source] LedgerError),
    /// The group moved on without this device, or its ledger is incomplete:
    /// recover before committing.
    #[error("group {0} needs recovery before this device can commit")]
    RecoveryRequired(GroupId),
    /// The commit did not land before the deadline; a journalled commit is
    /// settled by the next pull or commit.
    #[error("commit in group {0} did not land before the deadline")]
    TimedOut(GroupId),
    /// The commit hub refused the publish itself (not a lost race).
    #[error("hub {url} refused the commit: {source}")]
    HubRefused {
        /// The hub.
        url: String,
        /// Its answer.
        #[source]
        source: LinkError,
    },
    /// MLS refused to build the commit.
    #[error("MLS refused the commit: {0}")]
    Mls(String),
    /// The device's store failed; nothing half-done was kept.
    #[error("device store: {0}")]
    Store(#[source] RegistryError),
    /// The device was stopped.
    #[error("the device is stopped")]
    Stopped,
}

impl CommitError {
    /// Whether the same commit, tried again later, can land: a timeout or a
    /// store failure can pass; every other error says something about the
    /// commit or the group that retrying does not change.
    pub fn is_transient(&self) -> bool {
        matches!(self, CommitError::TimedOut(_) | CommitError::Store(_))
    }
}

impl From<RegistryError> for CommitError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::UnknownGroup(g) => CommitError::UnknownGroup(g),
            other => CommitError::Store(other),
        }
    }
}

impl From<KvError> for CommitError {
    fn from(e: KvError) -> Self {
        CommitError::Store(RegistryError::from(e))
    }
}

impl From<crate::device::DeviceError> for CommitError {
    fn from(e: crate::device::DeviceError) -> Self {
        match e {
            crate::device::DeviceError::UnknownGroup(g) => CommitError::UnknownGroup(g),
            crate::device::DeviceError::Stopped => CommitError::Stopped,
            crate::device::DeviceError::Stranded { group, .. } => {
                CommitError::RecoveryRequired(group)
            }
            crate::device::DeviceError::Commit(c) => c,
            other => CommitError::Store(RegistryError::Store(other.to_string())),
        }
    }
}
