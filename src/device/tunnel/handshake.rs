//! Opening a tunnel, and the keys and frames of an open one
//! (docs/protocol.md section 28).
//!
//! The opener posts a signed [`Open`] to the other device's own mailbox on
//! the group's tunnel hub: the group, a fresh tunnel id, both devices, the
//! opener's epoch and a fresh HPKE public key. The other device answers
//! only if it serves procedures, the opener is in its tree, and it is at
//! the same epoch; it encapsulates to the key (HPKE, exporting a secret)
//! and posts a signed [`Accept`] with the encapsulation, or a signed
//! [`Refuse`] saying why. A stranger (anyone not in its tree) is not
//! answered at all.
//!
//! Both sides then hold the tunnel's root: HKDF-Extract with the group's
//! MLS exporter secret of that epoch ([`EXPORTER_LABEL`], context the
//! tunnel id and both devices) as salt and the HPKE secret as input. Only
//! the two devices know the HPKE secret, and only members of that epoch
//! know the exporter secret, so a removed member, another member and the
//! hub all lack the root. From it come, per direction, an AEAD key and a
//! writer-bound mailbox topic that only the two devices can name or write.

use super::session::Frame;
use crate::device::records::GroupId;
use crate::device::topics::{self, TopicWriter};
use crate::wire::{DeviceId, TopicId};
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::types::{AeadType, HashType};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a handshake frame in a device's own mailbox starts with, so the
/// mailbox's reader tells it from a Welcome.
pub const MAGIC: &[u8] = b"hubsync/tunnel/v1\0";

/// MLS exporter label of a tunnel's salt.
pub const EXPORTER_LABEL: &str = "hubsync tunnel v1";

/// The HPKE exporter context of a tunnel's secret.
const HPKE_CONTEXT: &[u8] = b"hubsync tunnel secret v1";

const OPEN_DOMAIN: &[u8] = b"hubsync tunnel open v1";
const ACCEPT_DOMAIN: &[u8] = b"hubsync tunnel accept v1";
const REFUSE_DOMAIN: &[u8] = b"hubsync tunnel refuse v1";

/// A tunnel's id: 16 random bytes the opener draws.
pub type TunnelId = [u8; 16];

/// A handshake frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Handshake {
    /// Asks for a tunnel.
    Open(Open),
    /// Grants one.
    Accept(Accept),
    /// Declines one, saying why.
    Refuse(Refuse),
}

/// A request for a tunnel, signed by the device it names as `from`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Open {
    /// The group both devices are members of.
    pub group: GroupId,
    /// The new tunnel's id.
    pub tunnel: TunnelId,
    /// The opener.
    pub from: DeviceId,
    /// The device asked.
    pub to: DeviceId,
    /// The opener's epoch of the group: the exporter secret's epoch.
    pub epoch: u64,
    /// A fresh HPKE public key (the group's ciphersuite's KEM).
    #[serde(with = "serde_bytes")]
    pub hpke_public: Vec<u8>,
    /// ed25519 by `from` over [`Open::signed_bytes`].
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

/// A granted tunnel, signed by the device asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accept {
    /// The tunnel's id.
    pub tunnel: TunnelId,
    /// The device that was asked.
    pub from: DeviceId,
    /// The HPKE encapsulation to the open's key.
    #[serde(with = "serde_bytes")]
    pub kem_output: Vec<u8>,
    /// ed25519 by `from` over [`Accept::signed_bytes`], which also cover
    /// the digest of the [`Open`] it answers.
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

/// Why a device declined a tunnel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RefuseReason {
    /// It serves no procedures.
    #[error("the device serves no procedures")]
    NoService,
    /// It is at another epoch of the group (the opener catches up, or waits
    /// for it to, and asks again).
    #[error("the device is at epoch {mine} of the group")]
    Epoch {
        /// Its epoch.
        mine: u64,
    },
    /// It holds too many tunnels.
    #[error("the device holds too many tunnels")]
    Busy,
}

/// A declined tunnel, signed by the device asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refuse {
    /// The tunnel's id.
    pub tunnel: TunnelId,
    /// The device that was asked.
    pub from: DeviceId,
    /// Why.
    pub reason: RefuseReason,
    /// ed25519 by `from` over [`Refuse::signed_bytes`] (with the open's
    /// digest).
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

fn signed(domain: &[u8], body: &impl Serialize) -> Vec<u8> {
    let mut m = domain.to_vec();
    // postcard of plain fields cannot fail.
    m.extend_from_slice(&postcard::to_allocvec(body).unwrap_or_default());
    m
}

impl Open {
    /// What the signature covers.
    pub fn signed_bytes(&self) -> Vec<u8> {
        signed(
            OPEN_DOMAIN,
            &(
                &self.group,
                &self.tunnel,
                &self.from,
                &self.to,
                self.epoch,
                &self.hpke_public,
            ),
        )
    }

    /// Whether `from` signed it.
    pub fn verify(&self) -> bool {
        crate::device::identity::verify_by(&self.from, &self.signed_bytes(), &self.signature)
    }

    /// The digest the answers sign, and the HPKE `info`.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.signed_bytes());
        h.update(&self.signature);
        h.finalize().into()
    }
}

impl Accept {
    /// What the signature covers, for an answer to `open`.
    pub fn signed_bytes(&self, open: &[u8; 32]) -> Vec<u8> {
        signed(
            ACCEPT_DOMAIN,
            &(open, &self.tunnel, &self.from, &self.kem_output),
        )
    }

    /// Whether `from` signed it as an answer to the open of digest `open`.
    pub fn verify(&self, open: &[u8; 32]) -> bool {
        crate::device::identity::verify_by(&self.from, &self.signed_bytes(open), &self.signature)
    }
}

impl Refuse {
    /// What the signature covers, for an answer to `open`.
    pub fn signed_bytes(&self, open: &[u8; 32]) -> Vec<u8> {
        signed(
            REFUSE_DOMAIN,
            &(open, &self.tunnel, &self.from, &self.reason),
        )
    }

    /// Whether `from` signed it as an answer to the open of digest `open`.
    pub fn verify(&self, open: &[u8; 32]) -> bool {
        crate::device::identity::verify_by(&self.from, &self.signed_bytes(open), &self.signature)
    }
}

impl Handshake {
    /// Whether a mailbox payload is a handshake frame (by its prefix).
    pub fn is_one(payload: &[u8]) -> bool {
        payload.starts_with(MAGIC)
    }

    /// The mailbox payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = MAGIC.to_vec();
        p.extend_from_slice(&postcard::to_allocvec(self).unwrap_or_default());
        p
    }

    /// Read a mailbox payload; `None` when it is not a well-formed one.
    pub fn decode(payload: &[u8]) -> Option<Self> {
        postcard::from_bytes(payload.strip_prefix(MAGIC)?).ok()
    }
}

/// The MLS exporter context of a tunnel: its id and both devices.
pub fn exporter_context(tunnel: &TunnelId, opener: &DeviceId, other: &DeviceId) -> Vec<u8> {
    let mut c = tunnel.to_vec();
    c.extend_from_slice(&opener.0);
    c.extend_from_slice(&other.0);
    c
}

/// Why keys or frames could not be made or read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The crypto provider failed (an unsupported algorithm, a bad key).
    #[error("tunnel crypto: {0}")]
    Crypto(String),
    /// A frame that does not open with the tunnel's key, or does not parse.
    #[error("a frame that is not the other device's")]
    Forged,
}

/// The HPKE half of the responder: encapsulate to the open's key.
///
/// # Errors
/// `Crypto` when the key is not one of the suite's.
pub fn encapsulate(
    crypto: &impl OpenMlsCrypto,
    open: &Open,
) -> Result<(Vec<u8>, Vec<u8>), SealError> {
    let (kem, secret) = crypto
        .hpke_setup_sender_and_export(
            crate::device::mls::CIPHERSUITE.hpke_config(),
            &open.hpke_public,
            &open.digest(),
            HPKE_CONTEXT,
            32,
        )
        .map_err(|e| SealError::Crypto(format!("{e:?}")))?;
    Ok((kem, secret.to_vec()))
}

/// The HPKE half of the opener: open the accept's encapsulation.
///
/// # Errors
/// `Crypto` when the encapsulation does not open with `private`.
pub fn decapsulate(
    crypto: &impl OpenMlsCrypto,
    open: &Open,
    private: &[u8],
    kem_output: &[u8],
) -> Result<Vec<u8>, SealError> {
    let secret = crypto
        .hpke_setup_receiver_and_export(
            crate::device::mls::CIPHERSUITE.hpke_config(),
            kem_output,
            private,
            &open.digest(),
            HPKE_CONTEXT,
            32,
        )
        .map_err(|e| SealError::Crypto(format!("{e:?}")))?;
    Ok(secret.to_vec())
}

/// One direction of an open tunnel.
#[derive(Clone)]
pub struct Direction {
    key: Vec<u8>,
    /// The mailbox topic this direction's frames go to.
    pub topic: TopicId,
    writer: TopicWriter,
}

impl Direction {
    /// Sign a publish for this direction's topic.
    pub fn sign(&self, p: &mut crate::wire::Publish) {
        self.writer.sign(p);
    }
}

impl std::fmt::Debug for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Direction")
            .field("topic", &self.topic)
            .finish()
    }
}

/// The keys of an open tunnel, from one side's point of view.
#[derive(Clone, Debug)]
pub struct TunnelKeys {
    /// What this side sends.
    pub out: Direction,
    /// What this side receives.
    pub inbound: Direction,
}

/// Derive both directions from the exporter secret and the HPKE secret.
/// `opener` says which side this is.
///
/// # Errors
/// `Crypto` when the provider fails.
pub fn derive_keys(
    crypto: &impl OpenMlsCrypto,
    exporter: &[u8],
    hpke_secret: &[u8],
    open: &Open,
    opener: bool,
) -> Result<TunnelKeys, SealError> {
    let err = |e| SealError::Crypto(format!("{e:?}"));
    let root = crypto
        .hkdf_extract(HashType::Sha2_256, exporter, hpke_secret)
        .map_err(err)?;
    let digest = open.digest();
    let expand = |label: &[u8]| -> Result<Vec<u8>, SealError> {
        let mut info = label.to_vec();
        info.extend_from_slice(&digest);
        Ok(crypto
            .hkdf_expand(HashType::Sha2_256, root.as_slice(), &info, 32)
            .map_err(err)?
            .as_slice()
            .to_vec())
    };
    let direction = |name: &[u8]| -> Result<Direction, SealError> {
        let mut k = b"key ".to_vec();
        k.extend_from_slice(name);
        let mut t = b"topic ".to_vec();
        t.extend_from_slice(name);
        let writer = topics::tunnel_writer(&expand(&t)?);
        Ok(Direction {
            key: expand(&k)?,
            topic: writer.topic().clone(),
            writer,
        })
    };
    let to_other = direction(b"opener to other")?;
    let to_opener = direction(b"other to opener")?;
    Ok(if opener {
        TunnelKeys {
            out: to_other,
            inbound: to_opener,
        }
    } else {
        TunnelKeys {
            out: to_opener,
            inbound: to_other,
        }
    })
}

/// A sealed frame as it travels: the sender's frame counter (the nonce)
/// and the AEAD ciphertext.
#[derive(Serialize, Deserialize)]
struct Sealed {
    counter: u64,
    #[serde(with = "serde_bytes")]
    ciphertext: Vec<u8>,
}

fn nonce(counter: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_be_bytes());
    n
}

fn aad(topic: &TopicId, counter: u64) -> Vec<u8> {
    let mut a = topic.0.clone();
    a.extend_from_slice(&counter.to_be_bytes());
    a
}

/// Seal `frame` as frame number `counter` of direction `d`. A counter must
/// never be used twice in one direction.
///
/// # Errors
/// `Crypto` when the provider fails.
pub fn seal(
    crypto: &impl OpenMlsCrypto,
    d: &Direction,
    counter: u64,
    frame: &Frame,
) -> Result<Vec<u8>, SealError> {
    let plain = postcard::to_allocvec(frame).map_err(|e| SealError::Crypto(e.to_string()))?;
    let ciphertext = crypto
        .aead_encrypt(
            AeadType::ChaCha20Poly1305,
            &d.key,
            &plain,
            &nonce(counter),
            &aad(&d.topic, counter),
        )
        .map_err(|e| SealError::Crypto(format!("{e:?}")))?;
    postcard::to_allocvec(&Sealed {
        counter,
        ciphertext,
    })
    .map_err(|e| SealError::Crypto(e.to_string()))
}

/// Open a frame of direction `d`.
///
/// # Errors
/// `Forged` for anything the other device did not seal with this key.
pub fn unseal(
    crypto: &impl OpenMlsCrypto,
    d: &Direction,
    bytes: &[u8],
) -> Result<Frame, SealError> {
    let s: Sealed = postcard::from_bytes(bytes).map_err(|_| SealError::Forged)?;
    let plain = crypto
        .aead_decrypt(
            AeadType::ChaCha20Poly1305,
            &d.key,
            &s.ciphertext,
            &nonce(s.counter),
            &aad(&d.topic, s.counter),
        )
        .map_err(|_| SealError::Forged)?;
    postcard::from_bytes(&plain).map_err(|_| SealError::Forged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer as _, SigningKey};
    use openmls_rust_crypto::RustCrypto;

    fn open_by(k: &SigningKey, to: DeviceId, hpke_public: Vec<u8>) -> Open {
        let mut o = Open {
            group: GroupId([1; 32]),
            tunnel: [2; 16],
            from: DeviceId(k.verifying_key().to_bytes()),
            to,
            epoch: 7,
            hpke_public,
            signature: Vec::new(),
        };
        o.signature = k.sign(&o.signed_bytes()).to_bytes().to_vec();
        o
    }

    #[test]
    fn handshake_frames_verify_only_as_signed_and_answered() {
        let a = SigningKey::from_bytes(&[3; 32]);
        let b = SigningKey::from_bytes(&[4; 32]);
        let b_id = DeviceId(b.verifying_key().to_bytes());
        let o = open_by(&a, b_id, vec![5; 32]);
        assert!(o.verify());
        let mut moved = o.clone();
        moved.epoch = 8;
        assert!(!moved.verify(), "a changed field");
        let mut other = o.clone();
        other.signature = b.sign(&o.signed_bytes()).to_bytes().to_vec();
        assert!(!other.verify(), "signed by another than `from`");

        let mut acc = Accept {
            tunnel: o.tunnel,
            from: b_id,
            kem_output: vec![6; 32],
            signature: Vec::new(),
        };
        acc.signature = b.sign(&acc.signed_bytes(&o.digest())).to_bytes().to_vec();
        assert!(acc.verify(&o.digest()));
        assert!(
            !acc.verify(&moved.digest()),
            "an accept answers one open only"
        );
        let mut r = Refuse {
            tunnel: o.tunnel,
            from: b_id,
            reason: RefuseReason::Epoch { mine: 9 },
            signature: Vec::new(),
        };
        r.signature = b.sign(&r.signed_bytes(&o.digest())).to_bytes().to_vec();
        assert!(r.verify(&o.digest()));
        r.reason = RefuseReason::NoService;
        assert!(!r.verify(&o.digest()));

        let h = Handshake::Open(o.clone());
        let bytes = h.encode();
        assert!(Handshake::is_one(&bytes));
        assert_eq!(Handshake::decode(&bytes), Some(h));
        assert_eq!(Handshake::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(Handshake::decode(b"welcome bytes"), None);
    }

    #[test]
    fn both_sides_derive_mirrored_keys_and_nobody_else_reads_them() {
        let crypto = RustCrypto::default();
        let a = SigningKey::from_bytes(&[3; 32]);
        let b_id = DeviceId([4; 32]);
        let pair = crypto
            .derive_hpke_keypair(crate::device::mls::CIPHERSUITE.hpke_config(), &[9; 32])
            .unwrap();
        let o = open_by(&a, b_id, pair.public.clone());
        let exporter = [11u8; 32];
        let (kem, secret_b) = encapsulate(&crypto, &o).unwrap();
        let secret_a = decapsulate(&crypto, &o, &pair.private, &kem).unwrap();
        assert_eq!(secret_a, secret_b);
        let ka = derive_keys(&crypto, &exporter, &secret_a, &o, true).unwrap();
        let kb = derive_keys(&crypto, &exporter, &secret_b, &o, false).unwrap();
        assert_eq!(ka.out.topic, kb.inbound.topic);
        assert_eq!(ka.inbound.topic, kb.out.topic);
        assert_ne!(ka.out.topic, ka.inbound.topic);
        assert!(ka.out.topic.is_writer_bound());

        let f = Frame::Data {
            seq: 0,
            last: true,
            bytes: b"hello".to_vec(),
        };
        let sealed = seal(&crypto, &ka.out, 0, &f).unwrap();
        assert_eq!(unseal(&crypto, &kb.inbound, &sealed).unwrap(), f);
        // Not with the other direction's key, not tampered, and not with
        // keys from another exporter secret (a member of another epoch, a
        // removed member).
        assert_eq!(unseal(&crypto, &kb.out, &sealed), Err(SealError::Forged));
        let mut bent = sealed.clone();
        let last = bent.len() - 1;
        bent[last] ^= 1;
        assert_eq!(unseal(&crypto, &kb.inbound, &bent), Err(SealError::Forged));
        let stale = derive_keys(&crypto, &[12; 32], &secret_b, &o, false).unwrap();
        assert_eq!(
            unseal(&crypto, &stale.inbound, &sealed),
            Err(SealError::Forged)
        );
        assert_ne!(stale.inbound.topic, kb.inbound.topic);
    }
}
