//! The MLS settings every hubsync group uses.

use openmls::prelude::*;

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

/// Leaf capabilities: basic credentials only.
pub fn capabilities() -> Capabilities {
    Capabilities::builder()
        .credentials(vec![CredentialType::Basic])
        .build()
}

/// The configuration a group is created with. The ratchet tree travels in
/// the Welcome, so a joiner needs nothing else.
pub fn create_config() -> MlsGroupCreateConfig {
    MlsGroupCreateConfig::builder()
        .ciphersuite(CIPHERSUITE)
        .capabilities(capabilities())
        .max_past_epochs(MAX_PAST_EPOCHS)
        .use_ratchet_tree_extension(true)
        .build()
}

/// The configuration a group is joined with.
pub fn join_config() -> MlsGroupJoinConfig {
    MlsGroupJoinConfig::builder()
        .max_past_epochs(MAX_PAST_EPOCHS)
        .use_ratchet_tree_extension(true)
        .build()
}
