//! What a device tells its app.

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
    /// An app message arrived, once, however many hubs carried it.
    MessageReceived {
        /// The group.
        group: GroupId,
        /// The sending member.
        sender: DeviceId,
        /// The sender's message id.
        id: [u8; 16],
        /// The message.
        body: Vec<u8>,
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
    /// A hub connection changed status.
    HubStatus {
        /// The hub.
        url: String,
        /// Its new status.
        status: LinkStatus,
    },
}
