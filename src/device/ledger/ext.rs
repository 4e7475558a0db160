//! The group's own GroupContext extension: the ledger head and the topic
//! seed, authenticated by MLS.
//!
//! Every member at an epoch holds the same GroupContext, so it agrees on the
//! head (and the ledger a member installs must fold to it) and on the topic
//! seed (which never travels outside MLS, see DESIGN §9). A commit that
//! enacts entries carries a GroupContextExtensions proposal with the new head
//! ([`GroupExt::replace_in`]), so the head moves in the same step as the
//! epoch.
//!
//! # OpenMLS requirements (checked by the tests below)
//!
//! - The extension type ([`EXTENSION_TYPE`], private-use range) must be in
//!   the leaf capabilities of every member: the creator's
//!   (`MlsGroupBuilder::with_capabilities`) and every KeyPackage's
//!   (`KeyPackageBuilder::leaf_node_capabilities`); listing it in a
//!   RequiredCapabilities extension ([`required_capabilities_extension`])
//!   makes OpenMLS refuse a KeyPackage that lacks it up front.
//! - A GroupContextExtensions proposal replaces the *whole* list: build it
//!   with [`GroupExt::replace_in`], which keeps the other extensions (the
//!   RequiredCapabilities above), or they are dropped.
//!
//! # Encoding
//!
//! `u8 version = 1 ‖ ledger_head (32) ‖ topic_seed (32)`: 65 bytes, nothing
//! else accepted.

use super::LedgerError;
use openmls::prelude::{
    Extension, ExtensionType, Extensions, GroupContext, RequiredCapabilitiesExtension,
    UnknownExtension,
};

/// The extension's type id (private-use range of RFC 9420 §17.3).
pub const EXTENSION_TYPE: u16 = 0xf101;
/// The encoding version written and accepted.
pub const VERSION: u8 = 1;
/// Length of the encoding.
pub const ENCODED_LEN: usize = 1 + 32 + 32;

/// The contents of the group's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupExt {
    /// The ledger head after the entries enacted up to this epoch.
    pub ledger_head: [u8; 32],
    /// The secret every topic of the group derives from; rotated by the
    /// caller when a member is removed.
    pub topic_seed: [u8; 32],
}

impl GroupExt {
    /// The 65-byte encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_LEN);
        out.push(VERSION);
        out.extend_from_slice(&self.ledger_head);
        out.extend_from_slice(&self.topic_seed);
        out
    }

    /// Parses the encoding, strictly.
    ///
    /// # Errors
    /// [`LedgerError::Malformed`] unless `bytes` is exactly 65 bytes starting
    /// with version 1.
    pub fn decode(bytes: &[u8]) -> Result<GroupExt, LedgerError> {
        if bytes.len() != ENCODED_LEN {
            return Err(LedgerError::Malformed(format!(
                "group extension of {} bytes, expected {ENCODED_LEN}",
                bytes.len()
            )));
        }
        let (version, rest) = bytes
            .split_first()
            .ok_or_else(|| LedgerError::Malformed("empty group extension".into()))?;
        if *version != VERSION {
            return Err(LedgerError::Malformed(format!(
                "unknown group extension version {version}"
            )));
        }
        let (head, seed) = rest.split_at(32);
        let array = |b: &[u8]| -> Result<[u8; 32], LedgerError> {
            b.try_into()
                .map_err(|_| LedgerError::Malformed("group extension field".into()))
        };
        Ok(GroupExt {
            ledger_head: array(head)?,
            topic_seed: array(seed)?,
        })
    }

    /// As an OpenMLS extension: `Extension::Unknown(EXTENSION_TYPE, ..)`.
    pub fn to_extension(&self) -> Extension {
        Extension::Unknown(EXTENSION_TYPE, UnknownExtension(self.encode()))
    }

    /// Reads the extension from a group context's extensions (for example
    /// `MlsGroup::extensions()` or `StagedCommit::group_context().extensions()`).
    ///
    /// # Errors
    /// `Ok(None)` when absent; [`LedgerError::Malformed`] when present but
    /// undecodable.
    pub fn from_extensions(
        ext: &Extensions<GroupContext>,
    ) -> Result<Option<GroupExt>, LedgerError> {
        ext.unknown(EXTENSION_TYPE)
            .map(|u| GroupExt::decode(&u.0))
            .transpose()
    }

    /// The same extension with another ledger head (the topic seed kept).
    pub fn with_head(self, head: [u8; 32]) -> Self {
        GroupExt {
            ledger_head: head,
            ..self
        }
    }

    /// `current` with this extension added or replaced and every other
    /// extension kept: the list for a GroupContextExtensions proposal, which
    /// replaces the whole list.
    ///
    /// # Errors
    /// [`LedgerError::Malformed`] if OpenMLS refuses the list (it cannot for
    /// an unknown-type extension in a group context).
    pub fn replace_in(
        &self,
        current: &Extensions<GroupContext>,
    ) -> Result<Extensions<GroupContext>, LedgerError> {
        let mut next = current.clone();
        next.add_or_replace(self.to_extension())
            .map_err(|e| LedgerError::Malformed(format!("group context extensions: {e}")))?;
        Ok(next)
    }
}

/// The extension type to list in leaf capabilities (the creator's and every
/// KeyPackage's).
pub fn capabilities_extension_type() -> ExtensionType {
    ExtensionType::Unknown(EXTENSION_TYPE)
}

/// A RequiredCapabilities extension naming only this extension type, for the
/// group context at creation: OpenMLS then refuses to add a member whose
/// KeyPackage does not declare it.
pub fn required_capabilities_extension() -> Extension {
    Extension::RequiredCapabilities(RequiredCapabilitiesExtension::new(
        &[capabilities_extension_type()],
        &[],
        &[],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
    use openmls::prelude::*;
    use openmls_basic_credential::SignatureKeyPair;
    use openmls_rust_crypto::OpenMlsRustCrypto;

    const CS: Ciphersuite = Ciphersuite::MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519;

    fn sample() -> GroupExt {
        GroupExt {
            ledger_head: [0xaa; 32],
            topic_seed: [0x55; 32],
        }
    }

    #[test]
    fn encode_decode_round_trips() {
        let e = sample();
        let bytes = e.encode();
        assert_eq!(bytes.len(), 65);
        assert_eq!(bytes[0], 1);
        assert_eq!(&bytes[1..33], &[0xaa; 32]);
        assert_eq!(&bytes[33..], &[0x55; 32]);
        assert_eq!(GroupExt::decode(&bytes), Ok(e));
    }

    #[test]
    fn decode_is_strict() {
        let bytes = sample().encode();
        for len in 0..bytes.len() {
            assert!(GroupExt::decode(&bytes[..len]).is_err(), "truncated {len}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(GroupExt::decode(&long).is_err());
        let mut v2 = bytes;
        v2[0] = 2;
        assert!(GroupExt::decode(&v2).is_err());
    }

    #[test]
    fn with_head_keeps_the_seed() {
        let e = sample().with_head([1; 32]);
        assert_eq!(e.ledger_head, [1; 32]);
        assert_eq!(e.topic_seed, [0x55; 32]);
    }

    #[test]
    fn from_extensions_reads_absent_present_and_malformed() {
        let none = Extensions::<GroupContext>::empty();
        assert_eq!(GroupExt::from_extensions(&none), Ok(None));
        let some = Extensions::<GroupContext>::single(sample().to_extension()).expect("valid");
        assert_eq!(GroupExt::from_extensions(&some), Ok(Some(sample())));
        let bad = Extensions::<GroupContext>::single(Extension::Unknown(
            EXTENSION_TYPE,
            UnknownExtension(vec![1, 2, 3]),
        ))
        .expect("valid");
        assert!(matches!(
            GroupExt::from_extensions(&bad),
            Err(LedgerError::Malformed(_))
        ));
    }

    #[test]
    fn replace_in_keeps_other_extensions() {
        let current = Extensions::<GroupContext>::from_vec(vec![
            required_capabilities_extension(),
            sample().to_extension(),
        ])
        .expect("valid");
        let next = sample()
            .with_head([7; 32])
            .replace_in(&current)
            .expect("valid");
        assert!(next.required_capabilities().is_some());
        assert_eq!(
            GroupExt::from_extensions(&next),
            Ok(Some(sample().with_head([7; 32])))
        );
        assert_eq!(next.iter().count(), 2);
    }

    /// A device for the OpenMLS test: provider, signer and credential.
    struct Party {
        provider: OpenMlsRustCrypto,
        signer: SignatureKeyPair,
        credential: CredentialWithKey,
    }

    impl Party {
        fn new(name: &[u8]) -> Self {
            let provider = OpenMlsRustCrypto::default();
            let signer = SignatureKeyPair::new(CS.signature_algorithm()).expect("keys");
            signer.store(provider.storage()).expect("store keys");
            let credential = CredentialWithKey {
                credential: BasicCredential::new(name.to_vec()).into(),
                signature_key: signer.public().into(),
            };
            Party {
                provider,
                signer,
                credential,
            }
        }
    }

    fn capabilities() -> Capabilities {
        Capabilities::builder()
            .extensions(vec![capabilities_extension_type()])
            .credentials(vec![CredentialType::Basic])
            .build()
    }

    fn reserialize(msg: &MlsMessageOut) -> MlsMessageIn {
        let bytes = msg.tls_serialize_detached().expect("serializes");
        MlsMessageIn::tls_deserialize_exact(bytes).expect("deserializes")
    }

    /// The proof that the extension plan works in OpenMLS 0.9: a group is
    /// created with the extension, a second member that declares the
    /// capability joins by Welcome and reads it, and a commit moving the
    /// head is seen by the other member in its staged commit, before merge.
    #[test]
    fn openmls_group_carries_the_extension_through_welcome_and_commit() {
        let alice = Party::new(b"alice");
        let bob = Party::new(b"bob");
        let genesis = sample();

        let context_ext = Extensions::<GroupContext>::from_vec(vec![
            required_capabilities_extension(),
            genesis.to_extension(),
        ])
        .expect("valid group context extensions");
        let mut group_a = MlsGroup::builder()
            .ciphersuite(CS)
            .with_capabilities(capabilities())
            .with_group_context_extensions(context_ext)
            .use_ratchet_tree_extension(true)
            .build(&alice.provider, &alice.signer, alice.credential.clone())
            .expect("group with the extension is created");
        assert_eq!(
            GroupExt::from_extensions(group_a.extensions()),
            Ok(Some(genesis))
        );

        // Bob declares the capability in his KeyPackage and is added.
        let bob_kp = KeyPackage::builder()
            .leaf_node_capabilities(capabilities())
            .build(CS, &bob.provider, &bob.signer, bob.credential.clone())
            .expect("key package");
        let (_commit, welcome, _info) = group_a
            .add_members(
                &alice.provider,
                &alice.signer,
                &[bob_kp.key_package().clone()],
            )
            .expect("bob is added");
        group_a
            .merge_pending_commit(&alice.provider)
            .expect("merge add");
        let MlsMessageBodyIn::Welcome(welcome) = reserialize(&welcome).extract() else {
            panic!("expected a Welcome");
        };
        let join = MlsGroupJoinConfig::builder()
            .use_ratchet_tree_extension(true)
            .build();
        let mut group_b = StagedWelcome::new_from_welcome(&bob.provider, &join, welcome, None)
            .expect("welcome stages")
            .into_group(&bob.provider)
            .expect("bob joins");
        assert_eq!(
            GroupExt::from_extensions(group_b.extensions()),
            Ok(Some(genesis))
        );

        // Alice commits a new head with a GroupContextExtensions proposal.
        let moved = genesis.with_head([0x42; 32]);
        let proposal_ext = moved
            .replace_in(group_a.extensions())
            .expect("extension list");
        let bundle = group_a
            .commit_builder()
            .propose_group_context_extensions(proposal_ext)
            .expect("proposal")
            .load_psks(alice.provider.storage())
            .expect("psks")
            .build(
                alice.provider.rand(),
                alice.provider.crypto(),
                &alice.signer,
                |_| true,
            )
            .expect("commit builds")
            .stage_commit(&alice.provider)
            .expect("commit stages");
        let commit = reserialize(bundle.commit())
            .try_into_protocol_message()
            .expect("a protocol message");

        // Bob sees the new head in the staged commit, before merging it.
        let processed = group_b
            .process_message(&bob.provider, commit)
            .expect("bob processes the commit");
        let ProcessedMessageContent::StagedCommitMessage(staged) = processed.into_content() else {
            panic!("expected a staged commit");
        };
        assert_eq!(
            GroupExt::from_extensions(staged.group_context().extensions()),
            Ok(Some(moved))
        );
        assert_eq!(
            GroupExt::from_extensions(group_b.extensions()),
            Ok(Some(genesis)),
            "not merged yet"
        );
        group_b
            .merge_staged_commit(&bob.provider, *staged)
            .expect("bob merges");
        group_a
            .merge_pending_commit(&alice.provider)
            .expect("alice merges");
        for g in [&group_a, &group_b] {
            assert_eq!(GroupExt::from_extensions(g.extensions()), Ok(Some(moved)));
            assert!(g.extensions().required_capabilities().is_some());
        }
        assert_eq!(
            group_a.epoch_authenticator().as_slice(),
            group_b.epoch_authenticator().as_slice()
        );
    }

    /// The negative half: a KeyPackage that does not declare the capability
    /// cannot be added, because the group requires it.
    #[test]
    fn openmls_refuses_a_member_without_the_capability() {
        let alice = Party::new(b"alice");
        let carol = Party::new(b"carol");
        let context_ext = Extensions::<GroupContext>::from_vec(vec![
            required_capabilities_extension(),
            sample().to_extension(),
        ])
        .expect("valid");
        let mut group_a = MlsGroup::builder()
            .ciphersuite(CS)
            .with_capabilities(capabilities())
            .with_group_context_extensions(context_ext)
            .build(&alice.provider, &alice.signer, alice.credential.clone())
            .expect("group");
        let carol_kp = KeyPackage::builder()
            .build(CS, &carol.provider, &carol.signer, carol.credential.clone())
            .expect("key package without the capability");
        let r = group_a.add_members(
            &alice.provider,
            &alice.signer,
            &[carol_kp.key_package().clone()],
        );
        assert!(
            matches!(
                r,
                Err(AddMembersError::CreateCommitError(
                    CreateCommitError::ProposalValidationError(
                        ProposalValidationError::InsufficientCapabilities
                    )
                ))
            ),
            "{:?}",
            r.err()
        );
    }
}
