//! Sealing ledger bodies and ledger snapshots with a key exported from an
//! MLS epoch.
//!
//! The caller draws a 16-byte key with the MLS exporter
//! (`MlsGroup::export_secret(crypto, label, context, 16)`) under
//! [`SEAL_KEY_LABEL`] (entry bodies beside a commit) or
//! [`SNAPSHOT_KEY_LABEL`] (a whole ledger for catch-up), so only members of
//! that epoch can open what is sealed, and passes a nonce it never reuses
//! under that key. The AEAD is AES-128-GCM through OpenMLS's crypto trait,
//! so no second AES implementation is linked in.
//!
//! Sealed form: `nonce (12) ‖ ciphertext ‖ tag (16)`.

use super::LedgerError;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::types::AeadType;

/// Exporter label of the key that seals ledger entry bodies.
pub const SEAL_KEY_LABEL: &str = "hubsync ledger seal v1";
/// Exporter label of the key that seals ledger snapshots.
pub const SNAPSHOT_KEY_LABEL: &str = "hubsync ledger snapshot v1";
/// Key length of AES-128-GCM.
pub const KEY_LEN: usize = 16;
/// Nonce length of AES-128-GCM.
pub const NONCE_LEN: usize = 12;
/// Tag length of AES-128-GCM.
pub const TAG_LEN: usize = 16;

/// Encrypts and authenticates `plaintext` (and `aad`, which is not stored)
/// under `key` with `nonce`. Returns `nonce ‖ ciphertext ‖ tag`.
///
/// The nonce must never repeat under one key: AES-GCM loses both secrecy and
/// integrity if it does. A random nonce per seal is safe for far more seals
/// than one epoch's key sees.
///
/// # Errors
/// [`LedgerError::SealKey`] when `key` is not 16 bytes;
/// [`LedgerError::SealFailed`] if the crypto provider fails.
pub fn seal(
    crypto: &impl OpenMlsCrypto,
    key: &[u8],
    nonce: [u8; NONCE_LEN],
    aad: &[u8],
    plaintext: &[u8],
) -> Result<Vec<u8>, LedgerError> {
    if key.len() != KEY_LEN {
        return Err(LedgerError::SealKey(key.len()));
    }
    let ciphertext = crypto
        .aead_encrypt(AeadType::Aes128Gcm, key, plaintext, &nonce, aad)
        .map_err(|_| LedgerError::SealFailed)?;
    let mut out = Vec::with_capacity(NONCE_LEN + ciphertext.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&ciphertext);
    Ok(out)
}

/// Opens what [`seal`] produced under the same `key` and `aad`.
///
/// # Errors
/// [`LedgerError::SealOpen`] on any failure (wrong key or key length, wrong
/// `aad`, altered or truncated bytes), without saying which: an oracle that
/// tells them apart helps an attacker.
pub fn open(
    crypto: &impl OpenMlsCrypto,
    key: &[u8],
    aad: &[u8],
    sealed: &[u8],
) -> Result<Vec<u8>, LedgerError> {
    // Check the lengths here: the provider converts the nonce slice into a
    // fixed-size array and must only ever see exactly 12 bytes.
    if key.len() != KEY_LEN || sealed.len() < NONCE_LEN + TAG_LEN {
        return Err(LedgerError::SealOpen);
    }
    let (nonce, ciphertext) = sealed.split_at(NONCE_LEN);
    crypto
        .aead_decrypt(AeadType::Aes128Gcm, key, ciphertext, nonce, aad)
        .map_err(|_| LedgerError::SealOpen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use openmls_rust_crypto::RustCrypto;

    const KEY: [u8; 16] = [7; 16];
    const NONCE: [u8; 12] = [9; 12];

    #[test]
    fn seal_open_round_trips() {
        let c = RustCrypto::default();
        let sealed = seal(&c, &KEY, NONCE, b"aad", b"ledger body").expect("seals");
        assert_eq!(&sealed[..12], &NONCE);
        assert_eq!(sealed.len(), 12 + 11 + 16);
        assert_eq!(open(&c, &KEY, b"aad", &sealed), Ok(b"ledger body".to_vec()));
        let empty = seal(&c, &KEY, NONCE, b"", b"").expect("seals");
        assert_eq!(open(&c, &KEY, b"", &empty), Ok(vec![]));
    }

    #[test]
    fn wrong_key_fails_to_open() {
        let c = RustCrypto::default();
        let sealed = seal(&c, &KEY, NONCE, b"aad", b"body").expect("seals");
        assert_eq!(
            open(&c, &[8; 16], b"aad", &sealed),
            Err(LedgerError::SealOpen)
        );
        assert_eq!(
            open(&c, &[7; 15], b"aad", &sealed),
            Err(LedgerError::SealOpen)
        );
    }

    #[test]
    fn any_altered_byte_fails_to_open() {
        let c = RustCrypto::default();
        let sealed = seal(&c, &KEY, NONCE, b"aad", b"body").expect("seals");
        for i in 0..sealed.len() {
            let mut s = sealed.clone();
            s[i] ^= 1;
            assert_eq!(
                open(&c, &KEY, b"aad", &s),
                Err(LedgerError::SealOpen),
                "byte {i}"
            );
        }
        for len in 0..sealed.len() {
            assert_eq!(
                open(&c, &KEY, b"aad", &sealed[..len]),
                Err(LedgerError::SealOpen),
                "truncated to {len}"
            );
        }
    }

    #[test]
    fn wrong_aad_fails_to_open() {
        let c = RustCrypto::default();
        let sealed = seal(&c, &KEY, NONCE, b"group 1 epoch 4", b"body").expect("seals");
        assert_eq!(
            open(&c, &KEY, b"group 1 epoch 5", &sealed),
            Err(LedgerError::SealOpen)
        );
    }

    #[test]
    fn seal_refuses_a_key_of_the_wrong_length() {
        let c = RustCrypto::default();
        assert_eq!(
            seal(&c, &[0; 32], NONCE, b"", b"x"),
            Err(LedgerError::SealKey(32))
        );
    }
}
