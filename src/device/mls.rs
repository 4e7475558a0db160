//! The MLS settings every hubsync group uses.

use super::ledger::{GroupExt, EXTENSION_TYPE};
use openmls::prelude::*;
use std::time::Duration;

/// The ciphersuite of every group.
pub const CIPHERSUITE: Ciphersuite = Ciphersuite::MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519;

/// Past epochs whose message keys are kept, so a message that raced a
/// commit, or was sent by a member cut off from the commit hub while the
/// others moved on, is still readable. A message more than this many epochs
/// behind its readers cannot be decrypted (MLS forward secrecy); the window
/// trades that against how long old message keys live.
pub const MAX_PAST_EPOCHS: usize = 10;

/// Label of the exporter secret the app topic derives from.
pub use super::topics::APP_TOPIC_LABEL;

/// Leaf capabilities: basic credentials, and the hubsync GroupContext
/// extension (every leaf must declare it, the creator's and every key
/// package's, or adding a member fails).
pub fn capabilities() -> Capabilities {
    Capabilities::builder()
        .credentials(vec![CredentialType::Basic])
        .extensions(vec![
            ExtensionType::Unknown(EXTENSION_TYPE),
            // A last-resort key package marks itself with this extension;
            // a leaf must declare every extension it carries.
            ExtensionType::LastResort,
        ])
        .build()
}

/// The GroupContext extensions of a new group: RequiredCapabilities naming
/// the hubsync extension (so a joiner that cannot carry it is refused by
/// MLS itself), and the extension with the genesis ledger head and the
/// topic seed.
///
/// # Errors
/// Never for these two distinct extensions; the type says why it could.
pub fn group_extensions(ext: GroupExt) -> Result<Extensions<GroupContext>, InvalidExtensionError> {
    let required = Extension::RequiredCapabilities(RequiredCapabilitiesExtension::new(
        &[ExtensionType::Unknown(EXTENSION_TYPE)],
        &[],
        &[CredentialType::Basic],
    ));
    Extensions::from_vec(vec![required, ext.to_extension()])
}

/// The default lifetime of a key package: OpenMLS's default, 84 days.
pub const KEY_PACKAGE_LIFETIME: Duration = Duration::from_secs(84 * 24 * 60 * 60);

/// How far into the past a lifetime starts, for receivers whose clocks run
/// behind ours (OpenMLS's margin).
pub const LIFETIME_MARGIN: Duration = Duration::from_secs(60 * 60);

/// The MLS lifetime of a key package made at `now_ms` (Unix milliseconds)
/// that stays valid for `length`.
///
/// Why not OpenMLS's default: it reads the system clock, so the bytes of a
/// key package, and with them the tree hash and every epoch secret of the
/// group it joins, changed with the second it was made. From the device's
/// clock they replay in a simulation.
pub fn lifetime(now_ms: u64, length: Duration) -> Lifetime {
    let now = now_ms / 1000;
    Lifetime::init(
        now.saturating_sub(LIFETIME_MARGIN.as_secs()),
        now.saturating_add(length.as_secs()),
    )
}

/// The configuration a group is created with, its creator's leaf valid for
/// `lifetime`. The ratchet tree travels in the Welcome, so a joiner needs
/// nothing else.
///
/// # Errors
/// As [`group_extensions`].
pub fn create_config(
    ext: GroupExt,
    lifetime: Lifetime,
) -> Result<MlsGroupCreateConfig, InvalidExtensionError> {
    Ok(MlsGroupCreateConfig::builder()
        .ciphersuite(CIPHERSUITE)
        .lifetime(lifetime)
        .capabilities(capabilities())
        .max_past_epochs(MAX_PAST_EPOCHS)
        .use_ratchet_tree_extension(true)
        .wire_format_policy(WIRE_FORMAT_POLICY)
        .with_group_context_extensions(group_extensions(ext)?)
        .build())
}

/// What we send and accept: we always encrypt our own handshake messages,
/// and accept a member's commit sent as a PublicMessage too, which is what
/// a standard client may send by default (refusing it would let such a
/// commit win the compare-and-set and then fork that client off).
pub const WIRE_FORMAT_POLICY: WireFormatPolicy = MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY;

/// The configuration a group is joined with.
pub fn join_config() -> MlsGroupJoinConfig {
    MlsGroupJoinConfig::builder()
        .wire_format_policy(WIRE_FORMAT_POLICY)
        .max_past_epochs(MAX_PAST_EPOCHS)
        .use_ratchet_tree_extension(true)
        .build()
}
