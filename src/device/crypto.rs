//! The device's OpenMLS crypto: RustCrypto, with the ephemeral keys of HPKE
//! encryptions drawn from the device's seeded generator when it has one.
//!
//! Why: a simulation replays a seed, and everything it sends must replay
//! with it. OpenMLS draws its own secrets through `rand()`, which the device
//! already seeds, but RustCrypto's HPKE draws the ephemeral key of every
//! encryption (Welcome secrets, update-path secrets, external inits) from the
//! operating system inside the HPKE library. The commit bytes then differ from
//! run to run, and with them the transcript hash, every later epoch secret,
//! and every topic derived from the exporter; one seed gave different runs.
//!
//! With a seeded generator, [`DeviceCrypto`] performs the same RFC 9180
//! base-mode encapsulation itself (DHKEM(X25519, HKDF-SHA256), section 4.1)
//! from an ephemeral key derived (`DeriveKeyPair`, section 7.1.3) from the
//! generator's bytes, and hands the key schedule, sealing and export to the
//! HPKE library. The output is ordinary HPKE: any receiver opens it (the unit
//! tests open it with RustCrypto's own `hpke_open`). Production devices have
//! no seeded generator and use RustCrypto unchanged.

use hpke_rs::hpke_types::{AeadAlgorithm, KdfAlgorithm, KemAlgorithm};
use hpke_rs::{Hpke, Mode};
use hpke_rs_crypto::HpkeCrypto;
use hpke_rs_rust_crypto::HpkeRustCrypto;
use openmls_rust_crypto::RustCrypto;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::random::OpenMlsRand;
use openmls_traits::types::{
    AeadType, Ciphersuite, CryptoError, ExporterSecret, HashType, HpkeAeadType, HpkeCiphertext,
    HpkeConfig, HpkeKdfType, HpkeKemType, HpkeKeyPair, KemOutput, SignatureScheme,
};

use super::provider::SeededRand;

/// RFC 9180's version label, prefixed to every labeled KDF input.
const HPKE_V1: &[u8] = b"HPKE-v1";
/// The KEM's suite id: "KEM" followed by the KEM id of DHKEM(X25519).
const X25519_KEM_SUITE: &[u8] = &[b'K', b'E', b'M', 0x00, 0x20];
/// Nsecret of DHKEM(X25519, HKDF-SHA256).
const X25519_SECRET_LEN: usize = 32;
/// Nsk of X25519: the length of `DeriveKeyPair`'s input we draw.
const X25519_IKM_LEN: usize = 32;

/// RustCrypto, plus an optional seeded generator for HPKE ephemeral keys.
///
/// Every operation but HPKE encapsulation is RustCrypto's. With a generator
/// (simulations and tests only), `hpke_seal` and
/// `hpke_setup_sender_and_export` draw their ephemeral key from it, so the
/// same seed gives the same ciphertexts; the ciphersuites they then support
/// are those with DHKEM(X25519), the KEM of every hubsync group, and any
/// other answers `UnsupportedCiphersuite` rather than draw from the OS.
pub struct DeviceCrypto {
    inner: RustCrypto,
    ephemeral: Option<SeededRand>,
}

impl DeviceCrypto {
    /// RustCrypto as it is: production.
    pub fn system() -> Self {
        Self {
            inner: RustCrypto::default(),
            ephemeral: None,
        }
    }

    /// RustCrypto whose HPKE ephemeral keys replay from `ephemeral`: for
    /// simulations and tests only (a generator's stream must never be
    /// replayed against the same receivers in production).
    pub fn seeded(ephemeral: SeededRand) -> Self {
        Self {
            inner: RustCrypto::default(),
            ephemeral: Some(ephemeral),
        }
    }

    /// Encapsulate to `pk_r` with an ephemeral key from `rand`: the KEM
    /// output (the ephemeral public key) and the base-mode key schedule's
    /// context for `info` (RFC 9180 sections 4.1 and 5.1).
    fn seeded_context(
        &self,
        rand: &SeededRand,
        config: HpkeConfig,
        pk_r: &[u8],
        info: &[u8],
    ) -> Result<(Vec<u8>, hpke_rs::Context<HpkeRustCrypto>), CryptoError> {
        let HpkeConfig(kem, kdf_type, aead_type) = config;
        if kem != HpkeKemType::DhKem25519 {
            return Err(CryptoError::UnsupportedCiphersuite);
        }
        let ikm = rand
            .random_vec(X25519_IKM_LEN)
            .map_err(|_| CryptoError::InsufficientRandomness)?;
        let eph = self
            .inner
            .derive_hpke_keypair(HpkeConfig(kem, kdf_type, aead_type), &ikm)?;
        let dh = HpkeRustCrypto::dh(KemAlgorithm::DhKem25519, pk_r, &eph.private)
            .map_err(|_| CryptoError::InvalidPublicKey)?;
        let enc = eph.public;
        let kem_context = [enc.as_slice(), pk_r].concat();
        let shared_secret = extract_and_expand(&dh, &kem_context)?;
        let context = Hpke::<HpkeRustCrypto>::new(
            Mode::Base,
            KemAlgorithm::DhKem25519,
            kdf(kdf_type),
            aead(aead_type),
        )
        .key_schedule(&shared_secret, info, &[], &[])
        .map_err(|_| CryptoError::SenderSetupError)?;
        Ok((enc, context))
    }
}

/// DHKEM's `ExtractAndExpand(dh, kem_context)` for X25519 (RFC 9180
/// section 4.1): `LabeledExtract("", "eae_prk", dh)`, then
/// `LabeledExpand(prk, "shared_secret", kem_context, Nsecret)`.
fn extract_and_expand(dh: &[u8], kem_context: &[u8]) -> Result<Vec<u8>, CryptoError> {
    let alg = KdfAlgorithm::HkdfSha256;
    let labeled_ikm = [HPKE_V1, X25519_KEM_SUITE, b"eae_prk", dh].concat();
    let prk = HpkeRustCrypto::kdf_extract(alg, &[], &labeled_ikm)
        .map_err(|_| CryptoError::CryptoLibraryError)?;
    let len = (X25519_SECRET_LEN as u16).to_be_bytes();
    let labeled_info = [
        &len[..],
        HPKE_V1,
        X25519_KEM_SUITE,
        b"shared_secret",
        kem_context,
    ]
    .concat();
    HpkeRustCrypto::kdf_expand(alg, &prk, &labeled_info, X25519_SECRET_LEN)
        .map_err(|_| CryptoError::CryptoLibraryError)
}

fn kdf(k: HpkeKdfType) -> KdfAlgorithm {
    match k {
        HpkeKdfType::HkdfSha256 => KdfAlgorithm::HkdfSha256,
        HpkeKdfType::HkdfSha384 => KdfAlgorithm::HkdfSha384,
        HpkeKdfType::HkdfSha512 => KdfAlgorithm::HkdfSha512,
    }
}

fn aead(a: HpkeAeadType) -> AeadAlgorithm {
    match a {
        HpkeAeadType::AesGcm128 => AeadAlgorithm::Aes128Gcm,
        HpkeAeadType::AesGcm256 => AeadAlgorithm::Aes256Gcm,
        HpkeAeadType::ChaCha20Poly1305 => AeadAlgorithm::ChaCha20Poly1305,
        HpkeAeadType::Export => AeadAlgorithm::HpkeExport,
    }
}

impl OpenMlsCrypto for DeviceCrypto {
    fn supports(&self, ciphersuite: Ciphersuite) -> Result<(), CryptoError> {
        self.inner.supports(ciphersuite)
    }

    fn supported_ciphersuites(&self) -> Vec<Ciphersuite> {
        self.inner.supported_ciphersuites()
    }

    fn hkdf_extract(
        &self,
        hash_type: HashType,
        salt: &[u8],
        ikm: &[u8],
    ) -> Result<openmls::prelude::tls_codec::SecretVLBytes, CryptoError> {
        self.inner.hkdf_extract(hash_type, salt, ikm)
    }

    fn hmac(
        &self,
        hash_type: HashType,
        key: &[u8],
        message: &[u8],
    ) -> Result<openmls::prelude::tls_codec::SecretVLBytes, CryptoError> {
        self.inner.hmac(hash_type, key, message)
    }

    fn hkdf_expand(
        &self,
        hash_type: HashType,
        prk: &[u8],
        info: &[u8],
        okm_len: usize,
    ) -> Result<openmls::prelude::tls_codec::SecretVLBytes, CryptoError> {
        self.inner.hkdf_expand(hash_type, prk, info, okm_len)
    }

    fn hash(&self, hash_type: HashType, data: &[u8]) -> Result<Vec<u8>, CryptoError> {
        self.inner.hash(hash_type, data)
    }

    fn aead_encrypt(
        &self,
        alg: AeadType,
        key: &[u8],
        data: &[u8],
        nonce: &[u8],
        aad: &[u8],
    ) -> Result<Vec<u8>, CryptoError> {
        self.inner.aead_encrypt(alg, key, data, nonce, aad)
    }

    fn aead_decrypt(
        &self,
        alg: AeadType,
        key: &[u8],
        ct_tag: &[u8],
        nonce: &[u8],
        aad: &[u8],
    ) -> Result<Vec<u8>, CryptoError> {
        self.inner.aead_decrypt(alg, key, ct_tag, nonce, aad)
    }

    fn signature_key_gen(&self, alg: SignatureScheme) -> Result<(Vec<u8>, Vec<u8>), CryptoError> {
        self.inner.signature_key_gen(alg)
    }

    fn verify_signature(
        &self,
        alg: SignatureScheme,
        data: &[u8],
        pk: &[u8],
        signature: &[u8],
    ) -> Result<(), CryptoError> {
        self.inner.verify_signature(alg, data, pk, signature)
    }

    fn sign(&self, alg: SignatureScheme, data: &[u8], key: &[u8]) -> Result<Vec<u8>, CryptoError> {
        self.inner.sign(alg, data, key)
    }

    fn hpke_seal(
        &self,
        config: HpkeConfig,
        pk_r: &[u8],
        info: &[u8],
        aad: &[u8],
        ptxt: &[u8],
    ) -> Result<HpkeCiphertext, CryptoError> {
        let Some(rand) = &self.ephemeral else {
            return self.inner.hpke_seal(config, pk_r, info, aad, ptxt);
        };
        let (enc, mut context) = self.seeded_context(rand, config, pk_r, info)?;
        let ciphertext = context
            .seal(aad, ptxt)
            .map_err(|_| CryptoError::HpkeEncryptionError)?;
        Ok(HpkeCiphertext {
            kem_output: enc.into(),
            ciphertext: ciphertext.into(),
        })
    }

    fn hpke_open(
        &self,
        config: HpkeConfig,
        input: &HpkeCiphertext,
        sk_r: &[u8],
        info: &[u8],
        aad: &[u8],
    ) -> Result<Vec<u8>, CryptoError> {
        self.inner.hpke_open(config, input, sk_r, info, aad)
    }

    fn hpke_setup_sender_and_export(
        &self,
        config: HpkeConfig,
        pk_r: &[u8],
        info: &[u8],
        exporter_context: &[u8],
        exporter_length: usize,
    ) -> Result<(KemOutput, ExporterSecret), CryptoError> {
        let Some(rand) = &self.ephemeral else {
            return self.inner.hpke_setup_sender_and_export(
                config,
                pk_r,
                info,
                exporter_context,
                exporter_length,
            );
        };
        let (enc, context) = self.seeded_context(rand, config, pk_r, info)?;
        let secret = context
            .export(exporter_context, exporter_length)
            .map_err(|_| CryptoError::ExporterError)?;
        Ok((enc, secret.into()))
    }

    fn hpke_setup_receiver_and_export(
        &self,
        config: HpkeConfig,
        enc: &[u8],
        sk_r: &[u8],
        info: &[u8],
        exporter_context: &[u8],
        exporter_length: usize,
    ) -> Result<ExporterSecret, CryptoError> {
        self.inner.hpke_setup_receiver_and_export(
            config,
            enc,
            sk_r,
            info,
            exporter_context,
            exporter_length,
        )
    }

    fn derive_hpke_keypair(
        &self,
        config: HpkeConfig,
        ikm: &[u8],
    ) -> Result<HpkeKeyPair, CryptoError> {
        self.inner.derive_hpke_keypair(config, ikm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: HpkeConfig = HpkeConfig(
        HpkeKemType::DhKem25519,
        HpkeKdfType::HkdfSha256,
        HpkeAeadType::AesGcm128,
    );

    fn receiver() -> HpkeKeyPair {
        RustCrypto::default()
            .derive_hpke_keypair(CONFIG, &[3; 32])
            .expect("key pair")
    }

    #[test]
    fn a_seeded_seal_opens_with_rustcrypto() {
        let r = receiver();
        let c = DeviceCrypto::seeded(SeededRand::from_seed(1));
        for len in [0, 1, 31, 1000] {
            let ptxt = vec![7u8; len];
            let ct = c
                .hpke_seal(CONFIG, r.public.as_slice(), b"info", b"aad", &ptxt)
                .expect("seals");
            let opened = RustCrypto::default()
                .hpke_open(CONFIG, &ct, &r.private, b"info", b"aad")
                .expect("opens");
            assert_eq!(opened, ptxt);
            // Another info or aad does not open it: they are bound.
            assert!(RustCrypto::default()
                .hpke_open(CONFIG, &ct, &r.private, b"other", b"aad")
                .is_err());
            assert!(RustCrypto::default()
                .hpke_open(CONFIG, &ct, &r.private, b"info", b"other")
                .is_err());
        }
    }

    #[test]
    fn a_seeded_export_matches_the_receivers() {
        let r = receiver();
        let c = DeviceCrypto::seeded(SeededRand::from_seed(2));
        let (enc, secret) = c
            .hpke_setup_sender_and_export(CONFIG, r.public.as_slice(), b"info", b"ctx", 32)
            .expect("exports");
        let theirs = RustCrypto::default()
            .hpke_setup_receiver_and_export(CONFIG, &enc, &r.private, b"info", b"ctx", 32)
            .expect("receiver exports");
        assert_eq!(&*secret, &*theirs);
    }

    #[test]
    fn the_same_seed_seals_the_same_bytes_and_another_does_not() {
        let r = receiver();
        let seal = |seed| {
            let c = DeviceCrypto::seeded(SeededRand::from_seed(seed));
            let a = c
                .hpke_seal(CONFIG, r.public.as_slice(), b"", b"", b"secret")
                .expect("seals");
            let b = c
                .hpke_seal(CONFIG, r.public.as_slice(), b"", b"", b"secret")
                .expect("seals");
            // Each encryption draws a fresh ephemeral key.
            assert_ne!(a.kem_output, b.kem_output);
            (a, b)
        };
        assert_eq!(seal(5), seal(5));
        assert_ne!(seal(5).0.kem_output, seal(6).0.kem_output);
    }

    #[test]
    fn without_a_seed_it_is_rustcrypto() {
        let r = receiver();
        let c = DeviceCrypto::system();
        let a = c
            .hpke_seal(CONFIG, r.public.as_slice(), b"", b"", b"x")
            .expect("seals");
        let b = c
            .hpke_seal(CONFIG, r.public.as_slice(), b"", b"", b"x")
            .expect("seals");
        assert_ne!(a.kem_output, b.kem_output);
        let opened = c
            .hpke_open(CONFIG, &a, &r.private, b"", b"")
            .expect("opens");
        assert_eq!(opened, b"x");
    }

    #[test]
    fn a_seeded_seal_to_a_bad_key_or_another_kem_is_an_error() {
        let c = DeviceCrypto::seeded(SeededRand::from_seed(3));
        assert!(c.hpke_seal(CONFIG, &[0; 31], b"", b"", b"x").is_err());
        // The all-zero point gives an all-zero DH output, which RFC 9180
        // says to refuse.
        assert!(c.hpke_seal(CONFIG, &[0; 32], b"", b"", b"x").is_err());
        let p256 = HpkeConfig(
            HpkeKemType::DhKemP256,
            HpkeKdfType::HkdfSha256,
            HpkeAeadType::AesGcm128,
        );
        assert_eq!(
            c.hpke_seal(p256, &[4; 65], b"", b"", b"x"),
            Err(CryptoError::UnsupportedCiphersuite)
        );
    }
}
