//! The device side: identity, MLS storage, hub links, group peers, the
//! commit lane, the outbox, and the [`Device`] facade apps use.

mod api;
mod control;
pub mod control_msg;
pub mod crypto;
pub mod directory;
pub mod error;
pub mod events;
pub mod frames;
pub(crate) mod fuzzing;
pub mod gather;
pub mod identity;
pub mod inbox;
pub mod lane;
pub mod ledger;
pub mod link;
pub mod loopback;
pub mod manager;
pub mod mls;
pub mod outbox;
mod peer;
pub mod presence;
pub mod probe;
pub mod provider;
pub mod records;
pub mod recovery;
pub mod registry;
mod reinvite;
pub mod rejoin;
pub mod storage;
pub mod topics;
pub mod tunnel;

pub use api::{Device, DeviceOptions};
pub use control::{LeaveOutcome, Settings};
pub use error::DeviceError;
pub use events::{Event, EventStream, EventsLagged};
pub use gather::{LedgerCatchupSummary, PolicyCatchupSummary};
pub use inbox::{InboxConfig, InboxMessage, InboxStatus};
pub use lane::{CommitError, CommitKind, CommitReport, LaneResult, LostCommit};
pub use manager::{
    DeviceStats, FutureFrames, GroupPeer, GroupPeerManager, ManagerConfig, Observer,
};
pub use peer::Sent;
pub use records::GroupId;
pub use recovery::Remedy;
pub use rejoin::RejoinResult;
pub use tunnel::{CallStream, Caller, CloseReason, Procedures, ResponseSink, Tunnel, TunnelError};
