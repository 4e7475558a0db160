//! The device side's errors.

use super::lane::CommitError;
use super::records::GroupId;
use super::registry::RegistryError;
use crate::kv::KvError;

/// What went wrong in a device operation. Each variant says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The device is not in that group (never joined, or removed).
    #[error("not a member of group {0}")]
    UnknownGroup(GroupId),
    /// A hub could not be reached or refused the request.
    #[error("hub {url}: {reason}")]
    Hub {
        /// The hub.
        url: String,
        /// What happened.
        reason: String,
    },
    /// A commit (invite, remove, rotation, ledger entries) did not land.
    #[error(transparent)]
    Commit(#[from] CommitError),
    /// MLS refused the operation.
    #[error("MLS: {0}")]
    Mls(String),
    /// The device's store failed.
    #[error("device store: {0}")]
    Store(String),
    /// This device is left behind in the group (stranded) and could not
    /// rejoin, so nothing was sent: a message encrypted in an epoch the
    /// others left could not be read by them. Send again later (with
    /// `ManagerConfig::auto_rejoin` the device keeps trying to rejoin on
    /// its own), or forget the group if members say it is not in it.
    #[error("left behind in group {group} and not rejoined: {reason}")]
    Stranded {
        /// The group.
        group: GroupId,
        /// Why the rejoin did not help.
        reason: String,
    },
    /// A Welcome named a key package this device holds no keys for (a
    /// hub restored from a backup handed out one claimed and used since),
    /// so it cannot join from it. The device asks its inviter to invite it
    /// again ([`crate::device::frames::ReinviteRequest`]); nothing to do.
    #[error("the Welcome to group {group} names a key package this device no longer holds; asked {inviter:?} to invite it again")]
    KeyPackageGone {
        /// The group.
        group: GroupId,
        /// Who sent the Welcome.
        inviter: crate::wire::DeviceId,
        /// SHA-256 of the MLS Welcome.
        welcome_digest: [u8; 32],
        /// The group's hubs, as the Welcome said.
        hubs: Vec<String>,
    },
    /// The device was stopped.
    #[error("the device is stopped")]
    Stopped,
    /// The device was not ready to be invited by the deadline: on these
    /// hubs of its own its key packages are not (yet) stocked. Each names
    /// the last restock failure there, or that the hub was not reached.
    #[error("not ready to be invited; key packages missing on {missing:?}")]
    NotReady {
        /// `(hub, why)` for each hub still missing key packages.
        missing: Vec<(String, String)>,
    },
    /// The outbox already owes its hubs as many publishes as it may hold
    /// ([`crate::device::outbox::OutboxConfig::max_owed`]); nothing was
    /// sent. Wait (or call [`crate::device::Device::send`], which waits)
    /// and send again: room comes back as hubs take what is owed.
    #[error("the outbox is full: {owed} publishes owed, at most {max}")]
    OutboxFull {
        /// Publishes owed now.
        owed: usize,
        /// The bound.
        max: usize,
    },
}

impl From<RegistryError> for DeviceError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::UnknownGroup(g) => DeviceError::UnknownGroup(g),
            other => DeviceError::Store(other.to_string()),
        }
    }
}

impl From<KvError> for DeviceError {
    fn from(e: KvError) -> Self {
        DeviceError::Store(e.to_string())
    }
}
