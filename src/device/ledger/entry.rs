//! A ledger entry: its type, canonical encoding, signature and id.
//!
//! # Encoding (version 1)
//!
//! Big-endian integers, fields in this order, nothing else:
//!
//! | field | bytes |
//! |---|---|
//! | version | u8, `1` |
//! | type name | u16 length (1..=64), then the name (ASCII) |
//! | group id | 32 |
//! | subject | u32 length (≤ 1024), then the subject |
//! | value | u32 length (≤ 65536), then the value |
//! | ord | u64 `wall_ms`, u32 `counter` |
//! | author | 32 (ed25519 public key) |
//! | signature | 64 (ed25519) |
//!
//! The signature covers `"hubsync/ledger/entry/v1"` followed by the encoding
//! without its last 64 bytes, so it covers every field, version included. The
//! entry id is the SHA-256 of the whole encoding, signature included.
//!
//! There is exactly one encoding per entry: [`Entry::decode`] refuses
//! anything [`Entry::encode`] would not have written (wrong version,
//! truncation, trailing bytes, a length over its limit, a non-ASCII type
//! name), so ids cannot be varied by re-encoding.

use super::hlc::Hlc;
use super::LedgerError;
use crate::device::records::GroupId;
use crate::wire::DeviceId;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;

/// The encoding version written and accepted.
pub const VERSION: u8 = 1;
/// Domain prefix of the bytes an entry's signature covers.
pub const SIGN_DOMAIN: &[u8] = b"hubsync/ledger/entry/v1";
/// Longest type name, in bytes.
pub const MAX_TYPE_LEN: usize = 64;
/// Longest subject, in bytes.
pub const MAX_SUBJECT_LEN: usize = 1024;
/// Longest value, in bytes.
pub const MAX_VALUE_LEN: usize = 65536;
/// Most entries [`decode_list`] accepts.
pub const MAX_LIST: usize = 100_000;
/// Length of an ed25519 signature.
const SIG_LEN: usize = 64;
/// The shortest possible encoding: a one-byte type name, empty subject and
/// value. Bounds how many entries a byte string can hold.
const MIN_ENCODED_LEN: usize = 1 + 2 + 1 + 32 + 4 + 4 + 8 + 4 + 32 + SIG_LEN;

/// The kind of an entry. The wire carries its name ([`EntryType::as_str`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EntryType {
    /// `member.invite`: the subject device joins the group.
    MemberInvite,
    /// `member.remove`: the subject device leaves the group.
    MemberRemove,
    /// `admin.grant`: the subject member becomes an admin.
    AdminGrant,
    /// `admin.revoke`: the subject admin stops being one.
    AdminRevoke,
    /// `hub.bind`: the subject hub URL carries the group.
    HubBind,
    /// `hub.unbind`: the subject hub URL stops carrying the group.
    HubUnbind,
    /// `hub.commit`: the subject hub URL orders the group's commits.
    HubCommit,
    /// `group.setting`: the subject setting takes the value.
    GroupSetting,
    /// A name this engine does not know. Decoding keeps it so the entry can
    /// be carried and its id computed; folding refuses it (fail closed).
    Unknown(String),
}

impl EntryType {
    /// Every known type, in declaration order.
    pub const KNOWN: [EntryType; 8] = [
        EntryType::MemberInvite,
        EntryType::MemberRemove,
        EntryType::AdminGrant,
        EntryType::AdminRevoke,
        EntryType::HubBind,
        EntryType::HubUnbind,
        EntryType::HubCommit,
        EntryType::GroupSetting,
    ];

    /// The wire name (for `Unknown`, the name it was decoded with).
    pub fn as_str(&self) -> &str {
        match self {
            EntryType::MemberInvite => "member.invite",
            EntryType::MemberRemove => "member.remove",
            EntryType::AdminGrant => "admin.grant",
            EntryType::AdminRevoke => "admin.revoke",
            EntryType::HubBind => "hub.bind",
            EntryType::HubUnbind => "hub.unbind",
            EntryType::HubCommit => "hub.commit",
            EntryType::GroupSetting => "group.setting",
            EntryType::Unknown(name) => name,
        }
    }

    /// The type with that wire name; an unrecognised name is `Unknown`
    /// (never an error: refusing is the fold's job).
    pub fn parse(name: &str) -> EntryType {
        EntryType::KNOWN
            .into_iter()
            .find(|t| t.as_str() == name)
            .unwrap_or_else(|| EntryType::Unknown(name.to_owned()))
    }

    /// Whether this engine knows the type.
    pub fn is_known(&self) -> bool {
        !matches!(self, EntryType::Unknown(_))
    }
}

impl fmt::Display for EntryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An entry's id: the SHA-256 of its whole encoding, signature included.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EntryId(pub [u8; 32]);

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EntryId({})", hex::encode(self.0))
    }
}

/// One signed control entry.
///
/// Fields are public so a caller can inspect them; changing any of them
/// after signing makes [`Entry::verify`] fail. An entry built in memory may
/// break the encoding's limits: it then encodes to bytes [`Entry::decode`]
/// refuses, and the fold refuses it as [`LedgerError::Malformed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// What the entry does.
    pub kind: EntryType,
    /// The group whose ledger it belongs to.
    pub group: GroupId,
    /// What it acts on: a device id (32 bytes), a hub URL or a setting name,
    /// depending on `kind`.
    pub subject: Vec<u8>,
    /// The setting's value for `group.setting`; empty for every other type.
    pub value: Vec<u8>,
    /// When the author wrote it (orders settings, last writer wins).
    pub ord: Hlc,
    /// The author's device id (its ed25519 public key).
    pub author: DeviceId,
    /// The author's ed25519 signature over [`Entry::signed_bytes`].
    pub signature: Vec<u8>,
}

impl Entry {
    /// A new entry authored and signed by `key` (the author is `key`'s
    /// public key).
    ///
    /// Never fails: the limits are checked where bytes are accepted
    /// ([`Entry::decode`], the fold).
    pub fn sign(
        kind: EntryType,
        group: GroupId,
        subject: Vec<u8>,
        value: Vec<u8>,
        ord: Hlc,
        key: &SigningKey,
    ) -> Entry {
        let mut entry = Entry {
            kind,
            group,
            subject,
            value,
            ord,
            author: DeviceId(key.verifying_key().to_bytes()),
            signature: Vec::new(),
        };
        let signature: Signature = key.sign(&entry.signed_bytes());
        entry.signature = signature.to_bytes().to_vec();
        entry
    }

    /// The bytes the signature covers: the domain
    /// `"hubsync/ledger/entry/v1"`, then the encoding without the signature.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(SIGN_DOMAIN.len() + self.unsigned_len());
        out.extend_from_slice(SIGN_DOMAIN);
        self.encode_unsigned(&mut out);
        out
    }

    /// Checks the signature under `author` with ed25519 `verify_strict`
    /// (which refuses small-order keys and non-canonical signatures, so a
    /// signature cannot be re-shaped into another valid one).
    ///
    /// # Errors
    /// [`LedgerError::BadSignature`] when the author is not a valid key, the
    /// signature is not 64 bytes, or it does not verify.
    pub fn verify(&self) -> Result<(), LedgerError> {
        let key =
            VerifyingKey::from_bytes(&self.author.0).map_err(|_| LedgerError::BadSignature)?;
        let signature =
            Signature::from_slice(&self.signature).map_err(|_| LedgerError::BadSignature)?;
        key.verify_strict(&self.signed_bytes(), &signature)
            .map_err(|_| LedgerError::BadSignature)
    }

    /// The canonical encoding (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.unsigned_len() + self.signature.len());
        self.encode_unsigned(&mut out);
        out.extend_from_slice(&self.signature);
        out
    }

    /// Parses one entry, strictly: the whole of `bytes` must be exactly one
    /// encoding. The signature is not checked here ([`Entry::verify`]); an
    /// unknown type name is kept as [`EntryType::Unknown`].
    ///
    /// # Errors
    /// [`LedgerError::Malformed`] for a wrong version, truncation, trailing
    /// bytes, a length over its limit, or a non-ASCII or empty type name.
    pub fn decode(bytes: &[u8]) -> Result<Entry, LedgerError> {
        let mut r = Reader::new(bytes);
        let version = r.u8("version")?;
        if version != VERSION {
            return Err(malformed(format!("unknown entry version {version}")));
        }
        let type_len = usize::from(r.u16("type length")?);
        if type_len == 0 || type_len > MAX_TYPE_LEN {
            return Err(malformed(format!("type name length {type_len}")));
        }
        let type_bytes = r.take(type_len, "type name")?;
        if !type_bytes.is_ascii() {
            return Err(malformed("type name is not ASCII"));
        }
        // ASCII is valid UTF-8, so this cannot fail; map it anyway rather
        // than unwrap on input bytes.
        let name = std::str::from_utf8(type_bytes).map_err(|_| malformed("type name"))?;
        let kind = EntryType::parse(name);
        let group = GroupId(r.array("group id")?);
        let subject = r.var_u32(MAX_SUBJECT_LEN, "subject")?.to_vec();
        let value = r.var_u32(MAX_VALUE_LEN, "value")?.to_vec();
        let ord = Hlc {
            wall_ms: r.u64("ord wall_ms")?,
            counter: r.u32("ord counter")?,
        };
        let author = DeviceId(r.array("author")?);
        let signature = r.take(SIG_LEN, "signature")?.to_vec();
        r.finish()?;
        Ok(Entry {
            kind,
            group,
            subject,
            value,
            ord,
            author,
            signature,
        })
    }

    /// The entry's id: SHA-256 of [`Entry::encode`].
    pub fn id(&self) -> EntryId {
        let mut h = Sha256::new();
        h.update(self.encode());
        EntryId(h.finalize().into())
    }

    /// The subject as a device id, when it is exactly 32 bytes.
    pub fn subject_device(&self) -> Option<DeviceId> {
        Some(DeviceId(self.subject.as_slice().try_into().ok()?))
    }

    /// The subject as text, when it is valid UTF-8.
    pub fn subject_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.subject).ok()
    }

    /// Checks the limits the encoding imposes, for an entry built in memory
    /// (a decoded one always passes).
    ///
    /// # Errors
    /// [`LedgerError::Malformed`] naming the first field over its limit.
    pub fn check_limits(&self) -> Result<(), LedgerError> {
        let name = self.kind.as_str();
        if name.is_empty() || name.len() > MAX_TYPE_LEN || !name.is_ascii() {
            return Err(malformed("type name must be 1..=64 ASCII bytes"));
        }
        if self.subject.len() > MAX_SUBJECT_LEN {
            return Err(malformed("subject over 1024 bytes"));
        }
        if self.value.len() > MAX_VALUE_LEN {
            return Err(malformed("value over 65536 bytes"));
        }
        if self.signature.len() != SIG_LEN {
            return Err(malformed("signature must be 64 bytes"));
        }
        Ok(())
    }

    fn unsigned_len(&self) -> usize {
        1 + 2
            + self.kind.as_str().len()
            + 32
            + 4
            + self.subject.len()
            + 4
            + self.value.len()
            + 8
            + 4
            + 32
    }

    fn encode_unsigned(&self, out: &mut Vec<u8>) {
        let name = self.kind.as_str().as_bytes();
        out.push(VERSION);
        // A length that does not fit its field saturates: the saturated
        // value is over the limit, so decode refuses it instead of reading a
        // different entry.
        out.extend_from_slice(&u16::try_from(name.len()).unwrap_or(u16::MAX).to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&self.group.0);
        put_var_u32(out, &self.subject);
        put_var_u32(out, &self.value);
        out.extend_from_slice(&self.ord.wall_ms.to_be_bytes());
        out.extend_from_slice(&self.ord.counter.to_be_bytes());
        out.extend_from_slice(&self.author.0);
    }
}

/// Encodes entries as a list: u32 count, then per entry a u32 length and
/// its encoding.
pub fn encode_list(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(
        &u32::try_from(entries.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    for e in entries {
        put_var_u32(&mut out, &e.encode());
    }
    out
}

/// Parses a list written by [`encode_list`], strictly (each entry as
/// [`Entry::decode`], no trailing bytes).
///
/// Memory is reserved only for as many entries as the bytes can hold, never
/// from the untrusted count alone.
///
/// # Errors
/// [`LedgerError::Malformed`] for a count over [`MAX_LIST`], a count the
/// bytes do not hold, an entry length over what remains, a malformed entry,
/// or trailing bytes.
pub fn decode_list(bytes: &[u8]) -> Result<Vec<Entry>, LedgerError> {
    let mut r = Reader::new(bytes);
    let count = usize::try_from(r.u32("list count")?).map_err(|_| malformed("list count"))?;
    if count > MAX_LIST {
        return Err(malformed(format!("list of {count} entries")));
    }
    let room = r.remaining() / (4 + MIN_ENCODED_LEN);
    if count > room {
        return Err(malformed(format!(
            "list claims {count} entries, bytes hold at most {room}"
        )));
    }
    let mut entries = Vec::with_capacity(count);
    for i in 0..count {
        let len = usize::try_from(r.u32("entry length")?).map_err(|_| malformed("length"))?;
        let body = r.take(len, "entry")?;
        let entry = Entry::decode(body).map_err(|e| match e {
            LedgerError::Malformed(why) => malformed(format!("entry {i}: {why}")),
            other => other,
        })?;
        entries.push(entry);
    }
    r.finish()?;
    Ok(entries)
}

fn malformed(why: impl Into<String>) -> LedgerError {
    LedgerError::Malformed(why.into())
}

fn put_var_u32(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// A cursor over untrusted bytes: every read is bounds-checked and reports
/// which field ran short.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }

    fn remaining(&self) -> usize {
        self.rest.len()
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], LedgerError> {
        if n > self.rest.len() {
            return Err(malformed(format!("truncated {field}")));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N], LedgerError> {
        let bytes = self.take(N, field)?;
        bytes
            .try_into()
            .map_err(|_| malformed(format!("truncated {field}")))
    }

    fn u8(&mut self, field: &str) -> Result<u8, LedgerError> {
        Ok(self.array::<1>(field)?[0])
    }

    fn u16(&mut self, field: &str) -> Result<u16, LedgerError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &str) -> Result<u32, LedgerError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64, LedgerError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    /// A u32 length, checked against `max` before anything is read.
    fn var_u32(&mut self, max: usize, field: &str) -> Result<&'a [u8], LedgerError> {
        let len = usize::try_from(self.u32(field)?).map_err(|_| malformed(field.to_owned()))?;
        if len > max {
            return Err(malformed(format!("{field} of {len} bytes, limit {max}")));
        }
        self.take(len, field)
    }

    fn finish(self) -> Result<(), LedgerError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(malformed(format!("{} trailing bytes", self.rest.len())))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn key(n: u8) -> SigningKey {
        SigningKey::from_bytes(&[n; 32])
    }

    pub(crate) fn group(n: u8) -> GroupId {
        GroupId([n; 32])
    }

    fn sample() -> Entry {
        Entry::sign(
            EntryType::GroupSetting,
            group(7),
            b"self.name".to_vec(),
            b"alice's phone".to_vec(),
            Hlc {
                wall_ms: 1_700_000_000_000,
                counter: 3,
            },
            &key(1),
        )
    }

    #[test]
    fn type_names_round_trip_and_unknown_names_are_kept() {
        for t in EntryType::KNOWN {
            assert_eq!(EntryType::parse(t.as_str()), t);
            assert!(t.is_known());
        }
        let odd = EntryType::parse("member.promote");
        assert_eq!(odd, EntryType::Unknown("member.promote".into()));
        assert_eq!(odd.as_str(), "member.promote");
        assert!(!odd.is_known());
    }

    #[test]
    fn encoding_has_the_documented_layout() {
        let e = sample();
        let bytes = e.encode();
        let name = b"group.setting";
        let mut want = vec![1u8];
        want.extend_from_slice(&(name.len() as u16).to_be_bytes());
        want.extend_from_slice(name);
        want.extend_from_slice(&[7; 32]);
        want.extend_from_slice(&9u32.to_be_bytes());
        want.extend_from_slice(b"self.name");
        want.extend_from_slice(&13u32.to_be_bytes());
        want.extend_from_slice(b"alice's phone");
        want.extend_from_slice(&1_700_000_000_000u64.to_be_bytes());
        want.extend_from_slice(&3u32.to_be_bytes());
        want.extend_from_slice(&key(1).verifying_key().to_bytes());
        assert_eq!(&bytes[..bytes.len() - 64], &want[..]);
        assert_eq!(&bytes[bytes.len() - 64..], &e.signature[..]);
        let mut signed = b"hubsync/ledger/entry/v1".to_vec();
        signed.extend_from_slice(&want);
        assert_eq!(e.signed_bytes(), signed);
        let id: [u8; 32] = Sha256::digest(&bytes).into();
        assert_eq!(e.id(), EntryId(id));
    }

    #[test]
    fn encode_decode_round_trips() {
        let e = sample();
        let back = Entry::decode(&e.encode()).expect("decodes");
        assert_eq!(back, e);
        assert_eq!(back.id(), e.id());
        back.verify().expect("still verifies");

        let unknown = Entry::sign(
            EntryType::Unknown("future.thing".into()),
            group(1),
            vec![],
            vec![],
            Hlc::default(),
            &key(2),
        );
        assert_eq!(Entry::decode(&unknown.encode()), Ok(unknown));
    }

    #[test]
    fn every_truncation_fails() {
        let bytes = sample().encode();
        for len in 0..bytes.len() {
            assert!(
                matches!(Entry::decode(&bytes[..len]), Err(LedgerError::Malformed(_))),
                "truncated to {len} decoded"
            );
        }
    }

    #[test]
    fn a_trailing_byte_fails() {
        let mut bytes = sample().encode();
        bytes.push(0);
        assert!(matches!(
            Entry::decode(&bytes),
            Err(LedgerError::Malformed(_))
        ));
    }

    #[test]
    fn a_wrong_version_fails() {
        for v in [0u8, 2, 255] {
            let mut bytes = sample().encode();
            bytes[0] = v;
            assert!(matches!(
                Entry::decode(&bytes),
                Err(LedgerError::Malformed(_))
            ));
        }
    }

    #[test]
    fn over_limit_lengths_and_bad_type_names_fail() {
        let mk = |kind: EntryType, subject: usize, value: usize| {
            Entry::sign(
                kind,
                group(1),
                vec![b'a'; subject],
                vec![0; value],
                Hlc::default(),
                &key(1),
            )
        };
        // At the limits: accepted.
        let at = mk(EntryType::Unknown("x".repeat(64)), 1024, 65536);
        assert_eq!(Entry::decode(&at.encode()), Ok(at.clone()));
        at.check_limits().expect("within limits");
        // One over each limit: refused by decode and by check_limits.
        for over in [
            mk(EntryType::Unknown("x".repeat(65)), 0, 0),
            mk(EntryType::Unknown(String::new()), 0, 0),
            mk(EntryType::Unknown("é".into()), 0, 0),
            mk(EntryType::GroupSetting, 1025, 0),
            mk(EntryType::GroupSetting, 1, 65537),
        ] {
            assert!(matches!(
                Entry::decode(&over.encode()),
                Err(LedgerError::Malformed(_))
            ));
            assert!(matches!(
                over.check_limits(),
                Err(LedgerError::Malformed(_))
            ));
        }
    }

    #[test]
    fn a_non_ascii_type_name_fails() {
        let mut bytes = sample().encode();
        bytes[3] = 0xc3; // first byte of the type name
        assert!(matches!(
            Entry::decode(&bytes),
            Err(LedgerError::Malformed(_))
        ));
    }

    #[test]
    fn signature_covers_every_field() {
        let e = sample();
        e.verify().expect("fresh entry verifies");
        let other = key(9).verifying_key().to_bytes();
        let mut variants: Vec<(&str, Entry)> = Vec::new();
        let mut v = e.clone();
        v.kind = EntryType::MemberInvite;
        variants.push(("kind", v));
        let mut v = e.clone();
        v.group.0[31] ^= 1;
        variants.push(("group", v));
        let mut v = e.clone();
        v.subject.push(b'x');
        variants.push(("subject", v));
        let mut v = e.clone();
        v.value[0] ^= 1;
        variants.push(("value", v));
        let mut v = e.clone();
        v.ord.wall_ms += 1;
        variants.push(("ord.wall_ms", v));
        let mut v = e.clone();
        v.ord.counter += 1;
        variants.push(("ord.counter", v));
        let mut v = e.clone();
        v.author = DeviceId(other);
        variants.push(("author", v));
        let mut v = e.clone();
        v.signature[10] ^= 1;
        variants.push(("signature", v));
        let mut v = e.clone();
        v.signature.pop();
        variants.push(("signature length", v));
        for (field, v) in variants {
            assert_eq!(v.verify(), Err(LedgerError::BadSignature), "{field}");
        }
    }

    #[test]
    fn flipping_any_encoded_bit_breaks_the_signature_or_the_decoding() {
        let bytes = sample().encode();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            match Entry::decode(&b) {
                Ok(e) => assert_eq!(e.verify(), Err(LedgerError::BadSignature), "byte {i}"),
                Err(LedgerError::Malformed(_)) => {}
                Err(other) => panic!("byte {i}: {other:?}"),
            }
        }
    }

    #[test]
    fn id_changes_with_any_byte() {
        let e = sample();
        let bytes = e.encode();
        let id = e.id();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x80;
            if let Ok(changed) = Entry::decode(&b) {
                assert_ne!(changed.id(), id, "byte {i}");
            }
        }
        // And for fields changed in memory, including the signature.
        let mut v = e.clone();
        v.signature[63] ^= 1;
        assert_ne!(v.id(), id);
        let mut v = e.clone();
        v.ord.counter += 1;
        assert_ne!(v.id(), id);
    }

    #[test]
    fn subject_accessors() {
        let d = DeviceId([5; 32]);
        let e = Entry::sign(
            EntryType::MemberInvite,
            group(1),
            d.0.to_vec(),
            vec![],
            Hlc::default(),
            &key(1),
        );
        assert_eq!(e.subject_device(), Some(d));
        let hub = Entry::sign(
            EntryType::HubBind,
            group(1),
            b"wss://hub.example".to_vec(),
            vec![],
            Hlc::default(),
            &key(1),
        );
        assert_eq!(hub.subject_device(), None);
        assert_eq!(hub.subject_str(), Some("wss://hub.example"));
        let mut bad = hub.clone();
        bad.subject = vec![0xff, 0xfe];
        assert_eq!(bad.subject_str(), None);
    }

    #[test]
    fn list_round_trips_and_is_strict() {
        let entries: Vec<Entry> = (0..5)
            .map(|i| {
                Entry::sign(
                    EntryType::HubBind,
                    group(1),
                    format!("wss://hub{i}").into_bytes(),
                    vec![],
                    Hlc {
                        wall_ms: i,
                        counter: 0,
                    },
                    &key(1),
                )
            })
            .collect();
        let bytes = encode_list(&entries);
        assert_eq!(decode_list(&bytes), Ok(entries.clone()));
        assert_eq!(decode_list(&encode_list(&[])), Ok(vec![]));
        for len in 0..bytes.len() {
            assert!(decode_list(&bytes[..len]).is_err(), "truncated to {len}");
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(decode_list(&trailing).is_err());
    }

    #[test]
    fn list_count_is_bounded_and_not_trusted() {
        // A huge count with no bytes behind it is refused before any
        // allocation sized by it.
        let mut bytes = u32::MAX.to_be_bytes().to_vec();
        assert!(matches!(
            decode_list(&bytes),
            Err(LedgerError::Malformed(_))
        ));
        bytes = (MAX_LIST as u32).to_be_bytes().to_vec();
        assert!(matches!(
            decode_list(&bytes),
            Err(LedgerError::Malformed(_))
        ));
        bytes = ((MAX_LIST + 1) as u32).to_be_bytes().to_vec();
        bytes.extend(std::iter::repeat_n(0u8, (MAX_LIST + 1) * 200));
        assert!(matches!(
            decode_list(&bytes),
            Err(LedgerError::Malformed(_))
        ));
    }

    proptest! {
        #[test]
        fn decode_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Entry::decode(&bytes);
            let _ = decode_list(&bytes);
        }

        #[test]
        fn decode_never_panics_on_a_mutated_entry(
            pos in 0usize..400,
            byte in any::<u8>(),
            cut in 0usize..400,
        ) {
            let mut bytes = sample().encode();
            let n = bytes.len();
            bytes[pos % n] = byte;
            bytes.truncate(n - cut.min(n));
            if let Ok(e) = Entry::decode(&bytes) {
                // Whatever decodes re-encodes to the same bytes: one
                // encoding per entry.
                prop_assert_eq!(e.encode(), bytes);
            }
        }
    }
}
