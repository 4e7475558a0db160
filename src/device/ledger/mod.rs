//! The group's control ledger, as pure functions and values: no I/O, no
//! clock reads, no randomness.
//!
//! # What the ledger is
//!
//! A group's control decisions (who is a member, who is an admin, which hubs
//! carry the group and which one orders its commits, group settings) are
//! **entries**: small tokens `{type, group, subject, value, ord}` signed with
//! the author device's ed25519 key ([`Entry`]). An entry's id is the SHA-256
//! of its canonical encoding ([`EntryId`]).
//!
//! The entries a group has enacted, in enactment order, form its ledger. The
//! ledger is summarised by a **hash chain** ([`chain`]): the head starts at a
//! genesis value derived from the group id and absorbs each entry's id with
//! the ledger's length. The current head travels in the group's MLS
//! GroupContext extension ([`GroupExt`]), so MLS itself authenticates it:
//! every member that is at an epoch agrees on the head, and a ledger handed
//! over by anyone (a hub, another member) is accepted only when replaying it
//! reaches that head.
//!
//! # Promises of the fold
//!
//! - **Full replay.** The state ([`LedgerState`]) is always the fold of the
//!   whole ledger from the genesis, in order; there is no partial merge.
//! - **Authority is judged against earlier entries.** Whether an author may
//!   write an entry depends only on the state the entries before it
//!   produced, so every member computes the same result from the same list.
//! - **Unknown types fail closed.** [`Entry::decode`] keeps an entry of a
//!   type it does not know (so it can be carried and counted), but folding
//!   refuses it: an older engine never silently ignores a rule it cannot
//!   judge.
//! - **An entry held is never appended again.** Re-appending would land it
//!   last and could undo a later write; the fold refuses it as
//!   [`LedgerError::Duplicate`].
//! - **A refused entry changes nothing.** [`LedgerState::apply`] checks
//!   everything before it mutates.
//!
//! # Layout
//!
//! - [`hlc`]: the hybrid logical clock that orders settings.
//! - [`entry`]: the entry, its wire encoding, signature and id.
//! - [`chain`]: the head hash chain.
//! - [`ext`]: the GroupContext extension carrying the head and topic seed.
//! - [`fold`]: the state and the authority rules.
//! - [`mod@seal`]: AEAD sealing of ledger bodies and snapshots with an MLS
//!   exporter key.

pub mod chain;
pub mod entry;
pub mod ext;
pub mod fold;
pub mod hlc;
pub mod seal;

pub use entry::{decode_list, encode_list, Entry, EntryId, EntryType, MAX_LIST};
pub use ext::{GroupExt, EXTENSION_TYPE};
pub use fold::{LedgerState, Setting};
pub use hlc::{Hlc, HlcClock};
pub use seal::{open, seal, SEAL_KEY_LABEL, SNAPSHOT_KEY_LABEL};

use crate::wire::DeviceId;

/// Why the ledger refused bytes, an entry or a sealed blob.
///
/// Every refusal leaves the state it was checked against unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The bytes (or an in-memory entry's fields) break the encoding's rules:
    /// wrong version, truncated, trailing bytes, a length over its limit, a
    /// subject or value of the wrong shape for the entry's type.
    #[error("malformed: {0}")]
    Malformed(String),
    /// The entry's signature does not verify under its author's key (or the
    /// author is not a valid ed25519 key).
    #[error("bad signature")]
    BadSignature,
    /// The entry names another group than the ledger's.
    #[error("entry belongs to another group")]
    WrongGroup,
    /// The entry is already in the ledger; it is never appended again.
    #[error("entry {0} is already in the ledger")]
    Duplicate(EntryId),
    /// The entry's type is not one this engine knows; folding fails closed.
    #[error("unknown entry type {0:?}")]
    UnknownType(String),
    /// The author may not write this entry given the earlier entries.
    #[error("{author} may not write {kind}")]
    NotAuthorized {
        /// The entry type's wire name.
        kind: String,
        /// The author of the refused entry.
        author: DeviceId,
    },
    /// The entry would leave the group without an admin.
    #[error("the group would be left without an admin")]
    LastAdmin,
    /// `hub.commit` names a hub that is not bound to the group.
    #[error("hub {0} is not bound to the group")]
    NotBound(String),
    /// `hub.unbind` names the current commit hub, which every commit needs.
    #[error("hub {0} is the commit hub; it cannot be unbound")]
    CommitHubUnbind(String),
    /// The subject device is not a member (remove, grant).
    #[error("{0} is not a member")]
    NotAMember(DeviceId),
    /// The subject device is already a member (invite).
    #[error("{0} is already a member")]
    AlreadyMember(DeviceId),
    /// `admin.revoke` names a device that is not an admin.
    #[error("{0} is not an admin")]
    NotAnAdmin(DeviceId),
    /// The seal key does not have the 16 bytes AES-128-GCM needs.
    #[error("seal key must be 16 bytes, got {0}")]
    SealKey(usize),
    /// The AEAD refused to seal (a crypto library failure).
    #[error("sealing failed")]
    SealFailed,
    /// A sealed blob did not open: wrong key, wrong associated data, altered
    /// or truncated bytes. Deliberately says no more.
    #[error("sealed data did not open")]
    SealOpen,
    /// Folding the entries does not reach the head it was expected to reach.
    #[error("ledger does not reach the expected head")]
    HeadMismatch,
}
