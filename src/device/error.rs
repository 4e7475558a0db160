//! The device side's errors.

use super::records::GroupId;
use super::registry::RegistryError;
use crate::kv::KvError;
use crate::wire::DeviceId;

/// What went wrong in a device operation. Each variant says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The device is not in that group (never joined, or removed).
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
    /// Every commit goes through the commit hub: it cannot be unbound.
    #[error("{hub} is the commit hub of group {group}; it cannot be unbound")]
    CommitHubBinding {
        /// The group.
        group: GroupId,
        /// The hub.
        hub: String,
    },
    /// A group needs at least one hub.
    #[error("a group needs at least one hub")]
    NoHubs,
    /// A hub could not be reached or refused the request.
    #[error("hub {url}: {reason}")]
    Hub {
        /// The hub.
        url: String,
        /// What happened.
        reason: String,
    },
    /// No key package could be claimed for the invitee on any of the
    /// group's hubs: it must connect to one of them first.
    #[error("no key package for {0} on the group's hubs")]
    NoKeyPackage(DeviceId),
    /// The group moved on without this device: recover before committing.
    #[error("group {0} needs recovery before this device can commit")]
    RecoveryRequired(GroupId),
    /// The commit did not land before the deadline.
    #[error("commit in group {0} did not land before the deadline")]
    CommitTimedOut(GroupId),
    /// MLS refused the operation.
    #[error("MLS: {0}")]
    Mls(String),
    /// The device's store failed.
    #[error("device store: {0}")]
    Store(String),
    /// The device was stopped.
    #[error("the device is stopped")]
    Stopped,
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
