//! What a device tells its app.

use super::lane::{CommitError, CommitKind, SkipReason};
use super::records::GroupId;
use crate::wire::DeviceId;

/// The status of one hub connection, as events report it.
pub use super::link::LinkStatus;

/// Something that happened on a device. Events go out on a broadcast
/// channel: a receiver that falls more than its capacity behind misses the
/// oldest ones (it sees `Lagged`), and the device's state is always the
/// source of truth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// This device joined a group (created it or accepted a Welcome).
    GroupJoined {
        /// The group.
        group: GroupId,
        /// Its epoch at joining.
        epoch: u64,
    },
    /// An app message arrived, once, however many hubs carried it. It is
    /// in the group's durable inbox at `position` (see
    /// [`Device::messages`](super::Device::messages)) before this is sent.
    MessageReceived {
        /// The group.
        group: GroupId,
        /// Its position in the group's inbox.
        position: u64,
        /// The sending member.
        sender: DeviceId,
        /// The sender's message id.
        id: [u8; 16],
        /// The message.
        body: Vec<u8>,
    },
    /// The group's inbox was full ([`InboxConfig::max_unprocessed`]
    /// unprocessed messages): the unprocessed message at `position` was
    /// deleted to make room for a new one.
    ///
    /// [`InboxConfig::max_unprocessed`]: super::InboxConfig::max_unprocessed
    InboxTrimmed {
        /// The group.
        group: GroupId,
        /// The position deleted.
        position: u64,
    },
    /// The group's members changed.
    MembersChanged {
        /// The group.
        group: GroupId,
        /// Members now.
        members: Vec<DeviceId>,
    },
    /// The group moved to a new epoch.
    EpochChanged {
        /// The group.
        group: GroupId,
        /// The new epoch.
        epoch: u64,
    },
    /// This device was removed from the group; its state there is gone.
    Removed {
        /// The group.
        group: GroupId,
    },
    /// A message id arrived again with different content: reported, not
    /// delivered.
    Conflict {
        /// The group.
        group: GroupId,
        /// The message id.
        id: [u8; 16],
    },
    /// The group moved on without this device (a gap or a later epoch in the
    /// commit log); it needs recovery.
    Stranded {
        /// The group.
        group: GroupId,
    },
    /// A commit-topic frame was skipped without being applied, and why.
    FrameSkipped {
        /// The group.
        group: GroupId,
        /// The hub it was read from.
        hub: String,
        /// Its position there.
        seq: u64,
        /// Why.
        reason: SkipReason,
    },
    /// A hub holds less than this device already read from it (it lost or
    /// restored its store): its logs are read again from the start and it
    /// is never compared-and-set against a head below what we read.
    HubRewound {
        /// The hub.
        url: String,
    },
    /// The group's ledger grew (admins, hubs, commit hub or settings may
    /// have changed).
    LedgerChanged {
        /// The group.
        group: GroupId,
    },
    /// A hub trimmed `missed` frames of one of the group's app logs before
    /// this device read them (it was away longer than the hub keeps): the
    /// messages among them that no other hub of the group delivers are
    /// lost to this device.
    AppFramesMissed {
        /// The group.
        group: GroupId,
        /// The hub.
        hub: String,
        /// How many frames.
        missed: u64,
    },
    /// The group's whole ledger was gathered from a member
    /// ([`request_ledger_catchup`]) and installed: it reproduced the
    /// group's authenticated ledger head.
    ///
    /// [`request_ledger_catchup`]: super::GroupPeerManager::request_ledger_catchup
    LedgerGathered {
        /// The group.
        group: GroupId,
        /// The member whose answer was installed.
        from: DeviceId,
        /// Entries in the installed ledger.
        entries: usize,
    },
    /// A commit journalled before a crash or a timeout never landed. A lost
    /// ledger commit is re-driven once (`redriven`); a lost invite or
    /// remove must be issued again by the app.
    CommitLost {
        /// The group.
        group: GroupId,
        /// What it was.
        kind: CommitKind,
        /// The device it added or removed.
        subject: Option<DeviceId>,
        /// Whether its ledger entries were issued again.
        redriven: bool,
    },
    /// A commit the engine started on its own (a re-drive) failed.
    CommitFailed {
        /// The group.
        group: GroupId,
        /// What it was.
        kind: CommitKind,
        /// Why.
        error: CommitError,
    },
    /// This device forgot the group on its own
    /// ([`Device::forget_group`](super::Device::forget_group)): its state
    /// there is gone; the other members were not told.
    Forgotten {
        /// The group.
        group: GroupId,
    },
    /// A Welcome addressed to this device was refused (it does not verify,
    /// or it names a group this device holds and its inviter is not that
    /// group's admin). Nothing was joined or changed.
    WelcomeRefused {
        /// The group the envelope names, when it could be read.
        group: Option<GroupId>,
        /// Why.
        reason: String,
    },
    /// This device rejoined a group that had left it behind, by external
    /// commit ([`rejoin_group`]); it is at `epoch` and can commit again.
    ///
    /// [`rejoin_group`]: super::GroupPeerManager::rejoin_group
    Rejoined {
        /// The group.
        group: GroupId,
        /// The group's epoch after the rejoin.
        epoch: u64,
    },
    /// A remedy did not help (tried by [`commit_with_recovery`], whose
    /// commit then answered its original error, or called by the app).
    ///
    /// [`commit_with_recovery`]: super::GroupPeerManager::commit_with_recovery
    RecoveryFailed {
        /// The group.
        group: GroupId,
        /// The remedy.
        remedy: super::Remedy,
        /// Why it did not help.
        reason: String,
    },
    /// A claimed key package of `device` was refused (it is not valid MLS,
    /// or its leaf is not `device`'s own): someone planted it on `hub`.
    KeyPackageRefused {
        /// The device it claims to be.
        device: DeviceId,
        /// The hub that handed it out.
        hub: String,
        /// Why.
        reason: String,
    },
    /// A hub connection changed status.
    HubStatus {
        /// The hub.
        url: String,
        /// Its new status.
        status: LinkStatus,
    },
}
