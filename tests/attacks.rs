//! Attacks on the rules of DESIGN.md section 9 ("Who may do what"), each
//! made the way an attacker would make it: from outside, over real hubs on
//! loopback, with MLS objects crafted with openmls directly (its own
//! `OpenMlsRustCrypto` provider, `SignatureKeyPair`s and `BasicCredential`s)
//! and raw frames published through an authenticated `HubClient`.
//!
//! Every test asserts two things: the attack fails (on the engine check
//! named in its comment), and the group goes on (members still commit and
//! read).

use ed25519_dalek::SigningKey;
use futures::StreamExt;
use hubsync::client::{ClientError, HubClient, Push};
use hubsync::device::frames::{AppMessage, WelcomeEnvelope};
use hubsync::device::identity::DeviceIdentity;
use hubsync::device::lane::SkipReason;
use hubsync::device::ledger::GroupExt;
use hubsync::device::mls::{
    capabilities, create_config, APP_TOPIC_LABEL, CIPHERSUITE, MAX_PAST_EPOCHS,
};
use hubsync::device::records::Records;
use hubsync::device::topics::{
    app_topic, commit_writer, welcome_topic, TopicWriter, COMMIT_SEED_LABEL,
};
use hubsync::device::{CommitError, Event, GroupId};
use hubsync::hub::Limits;
use hubsync::kv::KvStore;
use hubsync::testkit::{device_options, open_sled, signing_key, EventLog, TestDevice, TestHub};
use hubsync::wire::{
    DeviceId, ExpectedHead, HubError, Publish, PublishId, PublishOutcome, RetentionClass, TopicId,
};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::{
    BasicCredential, CredentialWithKey, KeyPackage, KeyPackageIn, LeafNodeParameters, Lifetime,
    MlsGroup, MlsGroupJoinConfig, MlsMessageBodyIn, MlsMessageIn, NewSignerBundle,
    ProcessedMessageContent, ProtocolVersion, StagedWelcome, WireFormatPolicy,
    MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY, MIXED_PLAINTEXT_WIRE_FORMAT_POLICY,
};
use openmls_basic_credential::SignatureKeyPair;
use openmls_rust_crypto::OpenMlsRustCrypto;
use openmls_traits::types::SignatureScheme;
use openmls_traits::OpenMlsProvider;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Helpers: devices, hubs, events (as in tests/lane.rs)
// ---------------------------------------------------------------------------

/// Every event of one device since it opened.
struct Watch {
    log: EventLog,
}

impl Watch {
    /// `d`'s events since its latest open (or reopen).
    fn new(d: &TestDevice) -> Self {
        Self { log: d.event_log() }
    }

    fn snapshot(&self) -> Vec<Event> {
        self.log.snapshot()
    }

    fn count(&self, pred: impl Fn(&Event) -> bool) -> usize {
        self.snapshot().iter().filter(|e| pred(e)).count()
    }

    /// Wait until `pred` holds for some event, or fail after `WAIT`.
    async fn until(&self, what: &str, pred: impl Fn(&Event) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.count(&pred) == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; events: {:?}",
                self.snapshot()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Wait until the frame at `seq` was judged: skipped (its reason) or
    /// merged (`None`: the epoch moved past `epoch`).
    async fn judged(&self, g: GroupId, seq: u64, epoch: u64) -> Option<SkipReason> {
        self.until(&format!("frame {seq} judged"), |e| match e {
            Event::FrameSkipped { group, seq: s, .. } => *group == g && *s == seq,
            Event::EpochChanged { group, epoch: n } => *group == g && *n > epoch,
            _ => false,
        })
        .await;
        self.snapshot().into_iter().find_map(|e| match e {
            Event::FrameSkipped {
                group,
                seq: s,
                reason,
                ..
            } if group == g && s == seq => Some(reason),
            _ => None,
        })
    }

    fn got(&self, g: GroupId, body: &[u8]) -> usize {
        self.count(|e| {
            matches!(e, Event::MessageReceived { group, body: b, .. } if *group == g && b == body)
        })
    }

    async fn until_message(&self, g: GroupId, body: &[u8]) {
        let what = format!("message {:?}", String::from_utf8_lossy(body));
        self.until(&what, |e| {
            matches!(e, Event::MessageReceived { group, body: b, .. } if *group == g && b == body)
        })
        .await;
    }

    fn joined(&self, g: GroupId) -> usize {
        self.count(|e| matches!(e, Event::GroupJoined { group, .. } if *group == g))
    }

    fn stranded(&self) -> usize {
        self.count(|e| matches!(e, Event::Stranded { .. }))
    }

    /// Wait for a `FrameSkipped` of `g` at `seq`, and answer its reason.
    async fn skipped_at(&self, g: GroupId, seq: u64) -> SkipReason {
        self.until(
            &format!("frame {seq} skipped"),
            |e| matches!(e, Event::FrameSkipped { group, seq: s, .. } if *group == g && *s == seq),
        )
        .await;
        self.snapshot()
            .into_iter()
            .find_map(|e| match e {
                Event::FrameSkipped {
                    group,
                    seq: s,
                    reason,
                    ..
                } if group == g && s == seq => Some(reason),
                _ => None,
            })
            .expect("just seen")
    }
}

fn unthrottled(c: &mut hubsync::hub::HubConfig) {
    c.limits = Limits::unthrottled();
}

async fn hub() -> TestHub {
    TestHub::start_with(unthrottled).await.unwrap()
}

/// Wait until the hub holds nothing more for `device` to handle: every
/// frame posted to it was delivered and acked (handled, or refused).
async fn drained(hub: &TestHub, device: DeviceId, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    let mut calm = 0;
    while calm < 3 {
        let queued = hub.hub().core().usage(device).await.unwrap().mailbox_frames;
        calm = if queued == 0 { calm + 1 } else { 0 };
        assert!(
            tokio::time::Instant::now() < deadline,
            "{queued} mailbox frames never handled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Create a group on `creator` and bring every other device in.
async fn group_of(
    creator: &TestDevice,
    others: &[(&TestDevice, &Watch)],
    hubs: &[String],
) -> GroupId {
    let g = creator.create_group(hubs).await.unwrap();
    for (d, w) in others {
        creator
            .invite_when_ready(g, d.id(), WAIT)
            .await
            .expect("invite");
        w.until(
            "the Welcome",
            |e| matches!(e, Event::GroupJoined { group, .. } if *group == g),
        )
        .await;
    }
    g
}

/// Wait until every device is at the same epoch with the same epoch
/// authenticator, none stranded; answer them.
async fn agree(devices: &[&TestDevice], g: GroupId) -> (u64, Vec<u8>) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut states = Vec::new();
        for d in devices {
            states.push((
                d.epoch(g).await.unwrap(),
                d.epoch_authenticator(g).await.unwrap(),
            ));
        }
        if states.windows(2).all(|w| w[0] == w[1]) {
            for d in devices {
                assert!(
                    !d.manager().record(g).unwrap().stranded,
                    "a device is stranded"
                );
            }
            return states.remove(0);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no convergence: epochs {:?}",
            states.iter().map(|s| s.0).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `from` sends `body`; each of `to` receives it exactly once.
async fn message_reaches(from: &TestDevice, to: &[&Watch], g: GroupId, body: &[u8]) {
    from.send(g, body).await.unwrap();
    for w in to {
        w.until_message(g, body).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    for w in to {
        assert_eq!(w.got(g, body), 1, "delivered exactly once");
    }
}

/// The group goes on: `by` commits (a key rotation), every member of `all`
/// follows it, and a message from `by` reaches each of `to` once.
async fn carry_on(by: &TestDevice, all: &[&TestDevice], to: &[&Watch], g: GroupId, body: &[u8]) {
    let (e, _) = agree(all, g).await;
    let r = by.rotate_keys(g).await.unwrap();
    assert_eq!(r.outcome.epoch, e + 1);
    let (e1, _) = agree(all, g).await;
    assert_eq!(e1, e + 1);
    message_reaches(by, to, g, body).await;
}

fn accepted_seq(o: PublishOutcome) -> u64 {
    match o {
        PublishOutcome::Accepted { seq, .. } => seq,
        other => panic!("publish not accepted: {other:?}"),
    }
}

fn fresh_publish_id() -> PublishId {
    PublishId(rand::random())
}

/// A log publish on `w`'s topic, signed with its writer key.
fn log_publish(w: &TopicWriter, expected_head: ExpectedHead, payload: Vec<u8>) -> Publish {
    let mut p = Publish {
        topic: w.topic().clone(),
        publish_id: fresh_publish_id(),
        class: RetentionClass::Log,
        expected_head,
        replay_only: false,
        retention_secs: None,
        payload,
        writer: None,
    };
    w.sign(&mut p);
    p
}

/// The writer of the commit topic a plain MLS client computes for its
/// group (docs/protocol.md Part II): from the exporter secret of the
/// epoch it joined at (a roster change).
fn commit_writer_of(group: &MlsGroup, provider: &OpenMlsRustCrypto) -> TopicWriter {
    let seed = group
        .export_secret(provider.crypto(), COMMIT_SEED_LABEL, &[], 32)
        .unwrap();
    commit_writer(&seed.try_into().unwrap())
}

fn mailbox_publish(topic: &TopicId, payload: Vec<u8>) -> Publish {
    Publish {
        topic: topic.clone(),
        publish_id: fresh_publish_id(),
        class: RetentionClass::Mailbox,
        expected_head: ExpectedHead::Unconditional,
        replay_only: false,
        retention_secs: None,
        payload,
        writer: None,
    }
}

/// Where the epoch of an MLS message sits: after the version and wire
/// format (2 bytes each) and the group id (a variable-length vector).
fn epoch_offset(mls: &[u8]) -> usize {
    let at = 4;
    let (len, prefix) = match mls[at] >> 6 {
        0 => ((mls[at] & 0x3f) as usize, 1),
        1 => (
            (u16::from_be_bytes([mls[at], mls[at + 1]]) & 0x3fff) as usize,
            2,
        ),
        _ => panic!("group id length prefix too long for a test frame"),
    };
    at + prefix + len
}

/// A copy of a bare MLS frame claiming `epoch` (it still parses).
fn with_epoch(mls: &[u8], epoch: u64) -> Vec<u8> {
    let mut out = mls.to_vec();
    let at = epoch_offset(mls);
    out[at..at + 8].copy_from_slice(&epoch.to_be_bytes());
    out
}

/// The MLS message of a commit-topic frame: the frame itself, or inside
/// the `f1 01 ‖ u32 len ‖ MLSMessage ‖ …` framing of a commit that carries
/// ledger entries (lane/build.rs).
fn inner_mls(frame: &[u8]) -> &[u8] {
    match frame.strip_prefix(&[0xf1, 0x01][..]) {
        Some(rest) => {
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            &rest[4..4 + len]
        }
        None => frame,
    }
}

/// Parse a frame as MLS and answer its group id and epoch.
fn mls_header(frame: &[u8]) -> (Vec<u8>, u64) {
    let pm = MlsMessageIn::tls_deserialize_exact(inner_mls(frame))
        .expect("well-formed MLS")
        .try_into_protocol_message()
        .expect("a protocol message");
    (pm.group_id().as_slice().to_vec(), pm.epoch().as_u64())
}

/// Open a device whose store the test keeps a handle on (to look at it
/// from outside: its key count, its records).
async fn device_with_store(hubs: &[String]) -> (TestDevice, Arc<dyn KvStore>) {
    let seen: Arc<Mutex<Option<Arc<dyn KvStore>>>> = Arc::new(Mutex::new(None));
    let keep = seen.clone();
    let d = TestDevice::open_with_store(
        device_options(hubs),
        Arc::new(move |kv: Arc<dyn KvStore>| {
            *keep.lock().unwrap() = Some(kv.clone());
            kv
        }),
    )
    .await
    .unwrap();
    let kv = seen.lock().unwrap().clone().expect("the store was opened");
    (d, kv)
}

/// Every key of a store and the total bytes of keys and values.
fn store_size(kv: &dyn KvStore) -> (Vec<Vec<u8>>, usize) {
    let all = kv.range(&[], None, usize::MAX).unwrap();
    let bytes = all.iter().map(|(k, v)| k.len() + v.len()).sum();
    (all.into_iter().map(|(k, _)| k).collect(), bytes)
}

// ---------------------------------------------------------------------------
// The attacker: a plain openmls client with a hub connection
// ---------------------------------------------------------------------------

fn signer_of(key: &SigningKey) -> SignatureKeyPair {
    SignatureKeyPair::from_raw(
        SignatureScheme::ED25519,
        key.to_bytes().to_vec(),
        key.verifying_key().to_bytes().to_vec(),
    )
}

fn id_of(key: &SigningKey) -> DeviceId {
    DeviceId(key.verifying_key().to_bytes())
}

/// A credential naming `named`, with `leaf_key` as the leaf's signature key.
fn credential(named: DeviceId, leaf_key: &[u8]) -> CredentialWithKey {
    CredentialWithKey {
        credential: BasicCredential::new(named.0.to_vec()).into(),
        signature_key: leaf_key.to_vec().into(),
    }
}

/// The configuration a standard client joins with: hubsync's past-epoch
/// window and ratchet tree, and the given wire-format policy.
fn raw_join_config(policy: WireFormatPolicy) -> MlsGroupJoinConfig {
    MlsGroupJoinConfig::builder()
        .wire_format_policy(policy)
        .max_past_epochs(MAX_PAST_EPOCHS)
        .use_ratchet_tree_extension(true)
        .build()
}

/// Someone with an ed25519 key, openmls and a hub: no hubsync engine.
struct Raw {
    key: SigningKey,
    signer: SignatureKeyPair,
    provider: OpenMlsRustCrypto,
    client: HubClient,
    pushes: Option<mpsc::Receiver<Push>>,
}

impl Raw {
    async fn connect(hub: &TestHub, n: u64) -> Raw {
        Raw::connect_as(hub, signing_key(n)).await
    }

    /// A raw client under `key`: another connection of that device.
    async fn connect_as(hub: &TestHub, key: SigningKey) -> Raw {
        let client = hub.client(&key).await.unwrap();
        Raw {
            signer: signer_of(&key),
            key,
            provider: OpenMlsRustCrypto::default(),
            client,
            pushes: None,
        }
    }

    fn id(&self) -> DeviceId {
        id_of(&self.key)
    }

    /// Its honest credential: its own id and key.
    fn honest(&self) -> CredentialWithKey {
        credential(self.id(), &self.id().0)
    }

    /// A key package with hubsync's capabilities and ciphersuite, whose
    /// leaf is `cwk`, signed by `signer` (which need not be `cwk`'s key).
    fn key_package(&self, cwk: CredentialWithKey, signer: &SignatureKeyPair) -> Vec<u8> {
        KeyPackage::builder()
            .leaf_node_capabilities(capabilities())
            .build(CIPHERSUITE, &self.provider, signer, cwk)
            .unwrap()
            .key_package()
            .tls_serialize_detached()
            .unwrap()
    }

    /// Hear this device's Welcome mailbox from now on.
    async fn listen_for_welcomes(&mut self) {
        self.client
            .subscribe(&welcome_topic(&self.id()), None)
            .await
            .unwrap();
        self.pushes = self.client.take_pushes();
        self.client.receive().await.unwrap();
    }

    /// The next Welcome envelope pushed to this device.
    async fn next_welcome(&mut self) -> WelcomeEnvelope {
        let rx = self.pushes.as_mut().expect("listening");
        loop {
            let push = tokio::time::timeout(WAIT, rx.recv())
                .await
                .expect("a Welcome in time")
                .expect("push stream open");
            if let Push::Delivery(d) = push {
                self.client.ack(vec![d.frame_ref()]).await.unwrap();
                return WelcomeEnvelope::open(&d.payload).expect("a signed envelope");
            }
        }
    }

    /// Join the group of a Welcome, as any MLS client would.
    fn join(&self, env: &WelcomeEnvelope, policy: WireFormatPolicy) -> MlsGroup {
        let MlsMessageBodyIn::Welcome(welcome) = MlsMessageIn::tls_deserialize_exact(&env.welcome)
            .unwrap()
            .extract()
        else {
            panic!("not a Welcome")
        };
        StagedWelcome::new_from_welcome(&self.provider, &raw_join_config(policy), welcome, None)
            .unwrap()
            .into_group(&self.provider)
            .unwrap()
    }

    /// A plain openmls client with key `signing_key(n)`, invited into `g`
    /// by `admin` and joined with `policy`.
    async fn invited(
        hub: &TestHub,
        n: u64,
        admin: &TestDevice,
        g: GroupId,
        policy: WireFormatPolicy,
    ) -> (Raw, MlsGroup) {
        let mut m = Raw::connect(hub, n).await;
        m.listen_for_welcomes().await;
        let kp = m.key_package(m.honest(), &m.signer);
        m.client.upload_key_packages(vec![kp], None).await.unwrap();
        admin.invite(g, m.id()).await.unwrap();
        let env = m.next_welcome().await;
        let group = m.join(&env, policy);
        (m, group)
    }

    /// Publish on a log topic, compare-and-set on its current head, as the
    /// commit lane does; answers the sequence number.
    async fn publish_at_head(&self, w: &TopicWriter, payload: Vec<u8>) -> u64 {
        let head = self.client.fetch(w.topic(), 0, 1).await.unwrap().head;
        let expected = head.map_or(ExpectedHead::Empty, ExpectedHead::Seq);
        accepted_seq(
            self.client
                .publish(log_publish(w, expected, payload))
                .await
                .unwrap(),
        )
    }

    /// Publish on a log topic whatever its head.
    async fn publish_anyway(&self, w: &TopicWriter, payload: Vec<u8>) -> u64 {
        accepted_seq(
            self.client
                .publish(log_publish(w, ExpectedHead::Unconditional, payload))
                .await
                .unwrap(),
        )
    }
}

/// A self-update commit of `group` as the raw client would build it
/// (never merged here), serialized.
fn self_update_commit(
    group: &mut MlsGroup,
    raw: &Raw,
    params: LeafNodeParameters,
    new_signer: Option<NewSignerBundle<'_, SignatureKeyPair>>,
) -> Vec<u8> {
    let p = &raw.provider;
    let builder = group
        .commit_builder()
        .force_self_update(true)
        .leaf_node_parameters(params)
        .load_psks(p.storage())
        .unwrap();
    let built = match new_signer {
        None => builder
            .build(p.rand(), p.crypto(), &raw.signer, |_| true)
            .unwrap(),
        Some(n) => builder
            .build_with_new_signer(p.rand(), p.crypto(), &raw.signer, n, |_| true)
            .unwrap(),
    };
    built
        .stage_commit(p)
        .unwrap()
        .commit()
        .tls_serialize_detached()
        .unwrap()
}

// ---------------------------------------------------------------------------
// 1. Forged key packages
// ---------------------------------------------------------------------------

/// A key package must be its device's own leaf (DESIGN.md section 9, "A
/// leaf is its device", checked in `claim_key_package`, control.rs).
///
/// The hub keeps key packages per uploading device, so a stranger can
/// place packages only under its own id; a hostile hub operator can place
/// anything under anyone's. Both are tried:
/// - (a) the attacker A uploads, under its own device, a valid package
///   whose credential names victim F (signed by A's key), then one that
///   names A but carries another key X; the admin invites A twice;
/// - (b) the operator plants under F (an honest device that uploaded
///   nothing here) a valid package naming F with A's key, one naming F with
///   F's key but signed by A (a bad signature), and a last resort naming F
///   with A's key; the admin invites F three times.
///
/// Every invite fails with `InvalidKeyPackage` having consumed a forged
/// package, reported as `KeyPackageRefused` (the pools are drained: the
/// engine saw each and refused it); once none is left, `NoKeyPackage`;
/// nothing is published on the commit topic (so no Welcome either), the
/// roster and epoch stay, and the group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_package_whose_leaf_is_not_its_device_is_never_invited() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let (wa, wb) = (Watch::new(&a), Watch::new(&b));
    let g = group_of(&a, &[(&b, &wb)], &u).await;
    let (e0, auth0) = agree(&[&a, &b], g).await;
    let topic = a
        .manager()
        .record(g)
        .unwrap()
        .commit_writer()
        .topic()
        .clone();
    let head0 = hub
        .client(&signing_key(1))
        .await
        .unwrap()
        .fetch(&topic, 0, 1)
        .await
        .unwrap()
        .head;

    let attacker = Raw::connect(&hub, 7001).await;
    let a_id = attacker.id();
    let a_key = a_id.0;
    let victim = id_of(&signing_key(7002));
    let other = signing_key(7003);
    let other_signer = signer_of(&other);

    // (a) Under the attacker's own device.
    let names_victim = attacker.key_package(credential(victim, &a_key), &attacker.signer);
    let foreign_key = attacker.key_package(credential(a_id, &id_of(&other).0), &other_signer);
    // Both are valid MLS key packages: only hubsync's rule refuses them.
    for kp in [&names_victim, &foreign_key] {
        KeyPackageIn::tls_deserialize_exact(kp.as_slice())
            .unwrap()
            .validate(attacker.provider.crypto(), ProtocolVersion::Mls10)
            .expect("a valid MLS key package");
    }
    attacker
        .client
        .upload_key_packages(vec![names_victim, foreign_key], None)
        .await
        .unwrap();
    for _ in 0..2 {
        let e = a.invite(g, a_id).await.unwrap_err();
        assert!(
            matches!(&e, CommitError::InvalidKeyPackage { device, reason, .. }
                if *device == a_id && reason.contains("not the invitee's own device")),
            "{e:?}"
        );
    }
    assert_eq!(
        a.invite(g, a_id).await.unwrap_err(),
        CommitError::NoKeyPackage(a_id),
        "none left: a different error"
    );
    wa.until(
        "both forgeries reported",
        |e| matches!(e, Event::KeyPackageRefused { device, .. } if *device == a_id),
    )
    .await;
    assert_eq!(
        wa.count(|e| matches!(e, Event::KeyPackageRefused { device, .. } if *device == a_id)),
        2
    );
    assert_eq!(
        attacker.client.key_package_status().await.unwrap(),
        (0, false),
        "both forged packages were claimed (and refused)"
    );

    // (b) Planted under the victim by the hub's operator.
    let core = hub.hub().core();
    let f_with_a_key = attacker.key_package(credential(victim, &a_key), &attacker.signer);
    let f_signed_by_a = attacker.key_package(credential(victim, &victim.0), &attacker.signer);
    let last = attacker.key_package(credential(victim, &a_key), &attacker.signer);
    core.upload_key_packages(victim, &[f_with_a_key, f_signed_by_a], Some(last))
        .await
        .unwrap();
    for _ in 0..3 {
        let e = a.invite(g, victim).await.unwrap_err();
        assert!(
            matches!(&e, CommitError::InvalidKeyPackage { device, .. } if *device == victim),
            "{e:?}"
        );
    }
    assert_eq!(
        core.key_package_status(victim).await.unwrap().value,
        (0, true),
        "the planted pool was claimed (and refused)"
    );

    // Nothing happened to the group.
    let head = hub
        .client(&signing_key(1))
        .await
        .unwrap()
        .fetch(&topic, 0, 1)
        .await
        .unwrap()
        .head;
    assert_eq!(head, head0, "nothing published on the commit topic");
    assert_eq!(agree(&[&a, &b], g).await, (e0, auth0));
    let mut want = vec![a.id(), b.id()];
    want.sort();
    for d in [&a, &b] {
        assert_eq!(d.members(g).await.unwrap(), want);
        assert!(!d.ledger_view(g).unwrap().members.contains(&victim));
        assert!(!d.ledger_view(g).unwrap().members.contains(&a_id));
    }

    // And it goes on.
    carry_on(&a, &[&a, &b], &[&wb], g, b"after the forged packages").await;
    message_reaches(&b, &[&wa], g, b"b still writes").await;
}

// ---------------------------------------------------------------------------
// 2. A member switching its credential
// ---------------------------------------------------------------------------

/// A member's new leaf keeps its identity (RFC 9420 section 5.3.1; checked
/// by `check_leaves` in lane/pull.rs).
///
/// The attacker runs two devices: M, a plain openmls client that joins the
/// group through its Welcome like any MLS client, and X, whose key package
/// the admin also added (X never runs). M then publishes, at the group's
/// epoch, two self-update commits that MLS itself accepts:
/// - (i) its update path names B (an honest member) while keeping M's key;
/// - (ii) built with X's signer, its update path is a self-consistent leaf
///   of X (X's credential and X's key): M turning into X.
///
/// Every member skips both with `ForeignLeaf`, the roster lists each device
/// once (X never twice), the epoch stays, and the group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cannot_switch_its_leaf_to_another_devices_identity() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let (wa, wb) = (Watch::new(&a), Watch::new(&b));
    let g = group_of(&a, &[(&b, &wb)], &u).await;

    let mut m = Raw::connect(&hub, 8001).await;
    let x = Raw::connect(&hub, 8002).await;
    m.listen_for_welcomes().await;
    for r in [&m, &x] {
        let kp = r.key_package(r.honest(), &r.signer);
        r.client.upload_key_packages(vec![kp], None).await.unwrap();
    }
    a.invite(g, x.id()).await.unwrap();
    a.invite(g, m.id()).await.unwrap();
    let env = m.next_welcome().await;
    assert_eq!(env.group, g);
    let mut group = m.join(&env, MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY);
    let (e, auth) = agree(&[&a, &b], g).await;
    assert_eq!(group.epoch().as_u64(), e);
    assert_eq!(group.epoch_authenticator().as_slice(), auth.as_slice());
    GroupExt::from_extensions(group.extensions())
        .unwrap()
        .expect("the hubsync extension");
    let topic = commit_writer_of(&group, &m.provider);
    let mut roster = vec![a.id(), b.id(), m.id(), x.id()];
    roster.sort();
    assert_eq!(a.members(g).await.unwrap(), roster);

    // (i) B's name on M's key.
    let params = LeafNodeParameters::builder()
        .with_credential_with_key(credential(b.id(), &m.id().0))
        .build();
    let commit = self_update_commit(&mut group, &m, params, None);
    group.clear_pending_commit(m.provider.storage()).unwrap();
    let s1 = m.publish_at_head(&topic, commit).await;
    for w in [&wa, &wb] {
        let r = w.judged(g, s1, e).await;
        assert!(
            matches!(r, Some(SkipReason::ForeignLeaf(_))),
            "judged as {r:?} (None: merged)"
        );
    }

    // (ii) X's own leaf (X's name, X's key, signed by X) in M's place.
    let commit = self_update_commit(
        &mut group,
        &m,
        LeafNodeParameters::default(),
        Some(NewSignerBundle {
            signer: &x.signer,
            credential_with_key: x.honest(),
        }),
    );
    group.clear_pending_commit(m.provider.storage()).unwrap();
    let s2 = m.publish_at_head(&topic, commit).await;
    for w in [&wa, &wb] {
        let r = w.judged(g, s2, e).await;
        assert!(
            matches!(r, Some(SkipReason::ForeignLeaf(_))),
            "judged as {r:?} (None: merged)"
        );
    }

    // Nothing merged: same epoch, every device listed once.
    assert_eq!(agree(&[&a, &b], g).await, (e, auth));
    for d in [&a, &b] {
        assert_eq!(d.members(g).await.unwrap(), roster, "each device once");
    }
    carry_on(&a, &[&a, &b], &[&wb], g, b"after the switch").await;
    message_reaches(&b, &[&wa], g, b"b still writes").await;
    assert_eq!(wa.stranded() + wb.stranded(), 0);
}

// ---------------------------------------------------------------------------
// 3. A Welcome for a group id the victim holds
// ---------------------------------------------------------------------------

/// The attacker's own MLS group with the group id `g` (for a same-id
/// Welcome, the victim's, read in the clear from any frame of its group),
/// at `epoch` or later, with the victim
/// added through one of its key packages (claimed by the attacker), sent to
/// the victim's Welcome mailbox in an envelope the attacker signs.
async fn attackers_welcome(
    attacker: &Raw,
    victim: DeviceId,
    g: GroupId,
    epoch: u64,
    url: &str,
) -> WelcomeEnvelope {
    let (bytes, _) = attacker.client.claim_key_package(victim).await.unwrap();
    let kp = validated(&attacker.provider, &bytes);
    attackers_group_welcome(attacker, g, epoch, vec![kp], url)
}

/// A key package as any MLS client validates it.
fn validated(p: &OpenMlsRustCrypto, bytes: &[u8]) -> KeyPackage {
    KeyPackageIn::tls_deserialize_exact(bytes)
        .unwrap()
        .validate(p.crypto(), ProtocolVersion::Mls10)
        .unwrap()
}

/// The attacker's own MLS group with the group id `g`, at `epoch` or
/// later, adding `adds` in one commit; its Welcome in an envelope the
/// attacker signs.
fn attackers_group_welcome(
    attacker: &Raw,
    g: GroupId,
    epoch: u64,
    adds: Vec<KeyPackage>,
    url: &str,
) -> WelcomeEnvelope {
    let p = &attacker.provider;
    let ext = GroupExt {
        ledger_head: rand::random(),
        topic_seed: rand::random(),
    };
    let mut fake = MlsGroup::new_with_group_id(
        p,
        &attacker.signer,
        &create_config(ext, Lifetime::default()).unwrap(),
        openmls::group::GroupId::from_slice(&g.0),
        attacker.honest(),
    )
    .unwrap();
    while fake.epoch().as_u64() < epoch {
        self_update_commit(&mut fake, attacker, LeafNodeParameters::default(), None);
        fake.merge_pending_commit(p).unwrap();
    }
    let bundle = fake
        .commit_builder()
        .propose_adds(adds)
        .load_psks(p.storage())
        .unwrap()
        .build(p.rand(), p.crypto(), &attacker.signer, |_| true)
        .unwrap()
        .stage_commit(p)
        .unwrap();
    let welcome = bundle
        .to_welcome_msg()
        .expect("an add has a Welcome")
        .tls_serialize_detached()
        .unwrap();
    fake.merge_pending_commit(p).unwrap();
    assert_eq!(fake.group_id().as_slice(), g.0);
    WelcomeEnvelope {
        group: g,
        hubs: vec![url.to_string()],
        commit_hub: url.to_string(),
        commit_seq: 0,
        welcome,
        ledger: vec![0xde; 48],
        inviter: attacker.id(),
        signature: Vec::new(),
    }
    .sign(&attacker.key)
}

/// A Welcome never takes a group away (DESIGN.md section 9; `join` in
/// peer.rs). The attacker sends the victim V:
/// - (b) first, the same-id Welcome in an envelope naming a fresh random
///   group id (so the "held group" test does not apply: only the check
///   that the Welcome's group is the envelope's stops it, after the
///   Welcome was staged in an overlay over V's store);
/// - (c) a Welcome to the attacker's group under yet another random id Z,
///   in an envelope naming a random id: a valid Welcome, but not for the
///   group its envelope names (only hubsync's check stops this one; (b)
///   is also stopped by openmls itself, which refuses a Welcome for a
///   group id its storage holds: `GroupAlreadyExists`);
/// - (a) then the same-id Welcome in an envelope naming the real id.
///
/// V handles them in order; (a) is kept aside as a pending Welcome (the
/// design's rule: tried only once V has seen its own removal), which shows
/// both were handled. V's real group is untouched: same epoch and epoch
/// authenticator, no second `GroupJoined`, no record for the random id; it
/// still reads its members' messages and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_welcome_with_a_held_group_id_never_replaces_the_group() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let (v, kv) = device_with_store(&u).await;
    let b = TestDevice::open(&u).await.unwrap();
    let (wa, wv, wb) = (Watch::new(&a), Watch::new(&v), Watch::new(&b));
    let g = group_of(&a, &[(&v, &wv), (&b, &wb)], &u).await;
    let (e0, auth0) = agree(&[&a, &v, &b], g).await;

    let attacker = Raw::connect(&hub, 9001).await;
    let env = attackers_welcome(&attacker, v.id(), g, e0 + 5, hub.url()).await;
    let other = GroupId(rand::random());
    let mut elsewhere = env.clone();
    elsewhere.group = other;
    let elsewhere = elsewhere.sign(&attacker.key);
    let z = GroupId(rand::random());
    let mut mismatched = attackers_welcome(&attacker, v.id(), z, 0, hub.url()).await;
    let named = GroupId(rand::random());
    mismatched.group = named;
    let mismatched = mismatched.sign(&attacker.key);
    let mailbox = welcome_topic(&v.id());
    for e in [&elsewhere, &mismatched, &env] {
        attacker
            .client
            .publish(mailbox_publish(&mailbox, e.encode()))
            .await
            .unwrap();
    }
    let records = Records::new(kv.clone());
    drained(&hub, v.id(), WAIT).await;
    // A Welcome for a group V holds is kept only from that group's admin:
    // the attacker's is refused outright, not even kept aside.
    assert!(records.pending_welcomes(&g).unwrap().is_empty());

    assert_eq!(wv.joined(g), 1, "joined once, at the real invite");
    assert_eq!(v.epoch(g).await.unwrap(), e0);
    assert_eq!(v.epoch_authenticator(g).await.unwrap(), auth0);
    assert_eq!(v.groups().unwrap(), vec![g]);
    assert!(records.group(&other).unwrap().is_none());
    assert!(records.pending_welcomes(&other).unwrap().is_empty());
    assert_eq!(wv.joined(other), 0);
    for id in [z, named] {
        assert!(records.group(&id).unwrap().is_none());
        assert_eq!(wv.joined(id), 0);
    }

    // The real group goes on, with V in it.
    message_reaches(&a, &[&wv, &wb], g, b"the real group").await;
    carry_on(&v, &[&a, &v, &b], &[&wa, &wb], g, b"v commits and writes").await;
    assert_eq!(wa.stranded() + wv.stranded() + wb.stranded(), 0);
}

/// Every leaf of a Welcome's tree must be its device (DESIGN.md section 9;
/// `join` in peer.rs checks the whole tree in an overlay before anything
/// is kept). The attacker M builds a group of its own in which one leaf
/// names device B but carries a key only the attacker holds (a package it
/// signed itself, which openmls accepts: the leaf's signature is valid,
/// its credential just lies), adds the victim V with one of V's real key packages in the same
/// commit, and sends V the Welcome in an envelope M signs. V refuses it
/// with a `WelcomeRefused` event naming the group, and holds no state for
/// it; V's real group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_welcome_whose_tree_holds_a_leaf_that_is_not_its_device_is_refused() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let (v, kv) = device_with_store(&u).await;
    let b = TestDevice::open(&u).await.unwrap();
    let (wa, wv) = (Watch::new(&a), Watch::new(&v));
    let g = group_of(&a, &[(&v, &wv)], &u).await;
    agree(&[&a, &v], g).await;

    let m = Raw::connect(&hub, 9301).await;
    let (bytes, _) = m.client.claim_key_package(v.id()).await.unwrap();
    let real = validated(&m.provider, &bytes);
    // B's name on a key only the attacker holds.
    let x_key = signing_key(9302);
    let forged = validated(
        &m.provider,
        &m.key_package(credential(b.id(), &id_of(&x_key).0), &signer_of(&x_key)),
    );
    let z = GroupId(rand::random());
    let env = attackers_group_welcome(&m, z, 0, vec![forged, real], hub.url());
    m.client
        .publish(mailbox_publish(&welcome_topic(&v.id()), env.encode()))
        .await
        .unwrap();

    wv.until(
        "the Welcome refused",
        |e| matches!(e, Event::WelcomeRefused { group: Some(x), .. } if *x == z),
    )
    .await;
    let reason = wv
        .snapshot()
        .into_iter()
        .find_map(|e| match e {
            Event::WelcomeRefused { reason, .. } => Some(reason),
            _ => None,
        })
        .unwrap();
    assert!(reason.contains("not its device"), "refused for: {reason}");
    let records = Records::new(kv.clone());
    assert!(records.group(&z).unwrap().is_none(), "no record");
    assert!(records.pending_welcomes(&z).unwrap().is_empty());
    assert_eq!(wv.joined(z), 0);
    assert_eq!(v.groups().unwrap(), vec![g]);
    carry_on(&v, &[&a, &v], &[&wa], g, b"v goes on").await;
}

/// The same same-id Welcome, sent when the victim V holds a real re-invite
/// aside: the admin removed V and invited it again while V had not yet
/// read its removal (here: V's pulls are held with the `no_pull` test
/// fault), so the real Welcome is kept for after the removal. The
/// attacker's same-id Welcome arrives after it. Once V reads its removal,
/// it must join the real group again (the admin's epoch authenticator), not
/// the attacker's group under the real id.
///
/// FAILS at the time of writing: the attack succeeds. `join` (peer.rs,
/// the `records.group(&env.group)?.is_some()` branch at its start) keeps
/// any signed envelope for a held group id in the group's single pending
/// slot, overwriting the one there, without checking who signed it (any
/// stranger can), what its Welcome is, or whether its inviter is a member
/// or admin of the held group; `leave` (peer.rs, after the purge) then
/// joins whatever the slot holds. So V ends in the attacker's group under
/// the real group id, with the attacker's hubs, and the real re-invite is
/// lost (it was acked). It should keep aside only a Welcome whose inviter
/// may invite in the group it holds (an admin of its ledger), never let a
/// stranger's Welcome displace one, and on joining it after the removal
/// check the same again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_id_welcome_never_displaces_a_real_reinvite_kept_for_after_removal() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let (v, kv) = device_with_store(&u).await;
    let wv = Watch::new(&v);
    let g = group_of(&a, &[(&v, &wv)], &u).await;
    let (e0, _) = agree(&[&a, &v], g).await;
    probe_concluded(&v, g).await;

    v.manager().faults().no_pull.store(true, SeqCst);
    a.remove(g, v.id()).await.unwrap();
    a.invite_when_ready(g, v.id(), WAIT).await.expect("invite");
    let records = Records::new(kv.clone());
    let deadline = tokio::time::Instant::now() + WAIT;
    while records.pending_welcomes(&g).unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the real re-invite never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let real = records.pending_welcomes(&g).unwrap();

    let attacker = Raw::connect(&hub, 9101).await;
    let env = attackers_welcome(&attacker, v.id(), g, e0 + 5, hub.url()).await;
    attacker
        .client
        .publish(mailbox_publish(&welcome_topic(&v.id()), env.encode()))
        .await
        .unwrap();
    // Give V the time to handle it (it is kept aside, or refused: nothing
    // to see from outside either way).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let displaced = records.pending_welcomes(&g).unwrap() != real;

    // V reads its removal, then joins what it kept.
    reads_its_removal_and_joins_again(&v, &wv, g).await;
    let (ea, auth_a) = agree(&[&a], g).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let ev = v.epoch(g).await.ok();
        let av = v.epoch_authenticator(g).await.ok();
        if ev == Some(ea) && av.as_deref() == Some(auth_a.as_slice()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline && ev.is_none_or(|e| e <= ea),
            "V rejoined a group under the real id that is not the real group \
             (epoch {ev:?}, the real one is at {ea}); the attacker's Welcome \
             displaced the real re-invite kept aside: {displaced}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !displaced,
        "the attacker's Welcome replaced the real one kept aside"
    );
    message_reaches(&a, &[&wv], g, b"back in the real group").await;
}

/// A member not yet known here as an admin may be one (its grant among
/// the commits V has yet to read): V keeps its Welcome aside, one per
/// inviter, and judges it by the ledger as it stood at V's removal
/// (simulation seed 37: V refused the real re-invite of a member granted
/// admin just before, and stayed out of the group for good).
///
/// A granted B removes V and invites it back while V's reads are held; V
/// gets B's Welcome while it still holds the group and sees B as a plain
/// member. Once V reads on, it sees the grant and its removal, and joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reinvite_from_a_member_granted_admin_unseen_is_kept_and_joined() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let (v, kv) = device_with_store(&u).await;
    let (wb, wv) = (Watch::new(&b), Watch::new(&v));
    let g = group_of(&a, &[(&b, &wb), (&v, &wv)], &u).await;
    agree(&[&a, &b, &v], g).await;
    probe_concluded(&v, g).await;
    message_reaches(&a, &[&wv], g, b"before the removal").await;
    let before = wv
        .snapshot()
        .into_iter()
        .find_map(|e| match e {
            Event::MessageReceived { id, body, .. } if body == b"before the removal" => Some(id),
            _ => None,
        })
        .expect("the message's id");

    v.manager().faults().no_pull.store(true, SeqCst);
    a.grant_admin(g, b.id()).await.unwrap();
    agree(&[&a, &b], g).await;
    b.remove(g, v.id()).await.unwrap();
    b.invite_when_ready(g, v.id(), WAIT).await.expect("invite");
    let records = Records::new(kv.clone());
    let deadline = tokio::time::Instant::now() + WAIT;
    while records.pending_welcomes(&g).unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "B's re-invite was not kept aside; events: {:?}",
            wv.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    reads_its_removal_and_joins_again(&v, &wv, g).await;
    agree(&[&a, &b, &v], g).await;
    assert!(records.pending_welcomes(&g).unwrap().is_empty());
    message_reaches(&b, &[&wv], g, b"back in").await;
    // What V delivered before its removal stays known by id: sent again
    // under that id (a member back from far behind does), it is a
    // duplicate, not a second delivery (sim seed 335).
    assert!(
        records
            .message(&hubsync::kv::WriteBatch::new(), &g, &before)
            .unwrap()
            .is_some(),
        "the message-id mark outlived the removal"
    );
}

/// A member that is not an admin cannot bring a removed member into a
/// group of its own under the real id: its Welcome is kept aside (it may
/// have been an admin by commits V had yet to read), but at V's removal
/// the ledger says it was not one, and it is refused; V holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_members_same_id_welcome_kept_aside_is_refused_at_removal() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let (m, mkv) = device_with_store(&u).await;
    let (v, kv) = device_with_store(&u).await;
    let (wm, wv) = (Watch::new(&m), Watch::new(&v));
    let g = group_of(&a, &[(&m, &wm), (&v, &wv)], &u).await;
    let (e0, _) = agree(&[&a, &m, &v], g).await;
    probe_concluded(&v, g).await;

    // M, a plain member, builds a group of its own under the real id and
    // invites V with its own signed envelope.
    let m_key = DeviceIdentity::load(&*mkv)
        .unwrap()
        .expect("M's identity")
        .signing_key()
        .clone();
    let raw_m = Raw::connect_as(&hub, m_key).await;
    assert_eq!(raw_m.id(), m.id());
    v.manager().faults().no_pull.store(true, SeqCst);
    let env = attackers_welcome(&raw_m, v.id(), g, e0 + 5, hub.url()).await;
    raw_m
        .client
        .publish(mailbox_publish(&welcome_topic(&v.id()), env.encode()))
        .await
        .unwrap();
    let records = Records::new(kv.clone());
    let deadline = tokio::time::Instant::now() + WAIT;
    while records.pending_welcomes(&g).unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "M's Welcome, from a member, was not kept aside"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.remove(g, v.id()).await.unwrap();

    reads_its_removal(&v, &wv, g).await;
    wv.until(
        "M's kept Welcome refused",
        |e| matches!(e, Event::WelcomeRefused { group: Some(x), reason } if *x == g && reason.contains("not its admin")),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(wv.joined(g), 1, "V never joined M's group");
    assert!(v.groups().unwrap().is_empty());
    assert!(records.group(&g).unwrap().is_none());
    assert!(records.pending_welcomes(&g).unwrap().is_empty());
}

/// V's reads, held by the test, go on: it sees its removal from `g`.
async fn reads_its_removal(v: &TestDevice, wv: &Watch, g: GroupId) {
    v.manager().faults().no_pull.store(false, SeqCst);
    let _ = v.manager().pull(g).await;
    wv.until(
        "V removed",
        |e| matches!(e, Event::Removed { group } if *group == g),
    )
    .await;
}

/// As [`reads_its_removal`], then V joins `g` again from a Welcome it
/// kept aside.
async fn reads_its_removal_and_joins_again(v: &TestDevice, wv: &Watch, g: GroupId) {
    reads_its_removal(v, wv, g).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while wv.joined(g) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "V never joined again; events: {:?}",
            wv.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until `d`'s probe after joining `g` concluded: told later that
/// the group moved on, a device whose reads a test holds would strand
/// rather than see what the test wants it to see.
async fn probe_concluded(d: &TestDevice, g: GroupId) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while d.manager().record(g).unwrap().probe_owed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probe after joining never concluded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------
// 4. A flood of envelopes for unknown groups
// ---------------------------------------------------------------------------

/// How many envelopes the flood sends.
const FLOOD: usize = 20_000;

/// State for an unknown group is created only after the envelope and the
/// Welcome verify (DESIGN.md section 9; `accept_welcome` in manager.rs and
/// `join` in peer.rs, which stages the Welcome in an overlay).
///
/// A stranger posts `FLOOD` envelopes to the victim V's Welcome mailbox
/// (an unthrottled hub: the per-sender rate is not what is tested), each
/// for a fresh random group id: signed envelopes holding random bytes, or
/// a real MLS Welcome addressed to another device's key package; some with
/// a broken signature; some not even an envelope. Then a marker: an
/// envelope for V's real group id, which V keeps aside (handled in mailbox
/// order, it shows V went through the whole flood).
///
/// V's store grows by a constant (the marker and bookkeeping), not with
/// the flood: no group record, no pending Welcome, no key naming any of
/// the flood's group ids; its groups are the same; and it still reads and
/// commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_envelopes_for_unknown_groups_leaves_no_state() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let (v, kv) = device_with_store(&u).await;
    let (wa, wv) = (Watch::new(&a), Watch::new(&v));
    let g = group_of(&a, &[(&v, &wv)], &u).await;
    agree(&[&a, &v], g).await;
    // Let V settle (key package restock, outbox) before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (keys0, bytes0) = store_size(&*kv);

    let attacker = Raw::connect(&hub, 9201).await;
    // A real Welcome, for a key package that is not V's.
    let foreign = {
        let bystander = Raw::connect(&hub, 9202).await;
        let kp = KeyPackageIn::tls_deserialize_exact(
            bystander
                .key_package(bystander.honest(), &bystander.signer)
                .as_slice(),
        )
        .unwrap()
        .validate(attacker.provider.crypto(), ProtocolVersion::Mls10)
        .unwrap();
        let p = &attacker.provider;
        let mut own = MlsGroup::new_with_group_id(
            p,
            &attacker.signer,
            &create_config(
                GroupExt {
                    ledger_head: [1; 32],
                    topic_seed: [2; 32],
                },
                Lifetime::default(),
            )
            .unwrap(),
            openmls::group::GroupId::from_slice(&[3; 32]),
            attacker.honest(),
        )
        .unwrap();
        own.commit_builder()
            .propose_adds([kp])
            .load_psks(p.storage())
            .unwrap()
            .build(p.rand(), p.crypto(), &attacker.signer, |_| true)
            .unwrap()
            .stage_commit(p)
            .unwrap()
            .to_welcome_msg()
            .unwrap()
            .tls_serialize_detached()
            .unwrap()
    };
    let mailbox = welcome_topic(&v.id());
    let mut ids = Vec::with_capacity(FLOOD);
    let mut payloads = Vec::with_capacity(FLOOD);
    for i in 0..FLOOD {
        let group = GroupId(rand::random());
        ids.push(group);
        if i % 50 == 7 {
            payloads.push(rand::random::<[u8; 32]>().to_vec());
            continue;
        }
        let welcome = if i % 2 == 0 {
            foreign.clone()
        } else {
            (0..64 + i % 256).map(|_| rand::random::<u8>()).collect()
        };
        let mut env = WelcomeEnvelope {
            group,
            hubs: vec![hub.url().to_string()],
            commit_hub: hub.url().to_string(),
            commit_seq: i as u64,
            welcome,
            ledger: rand::random::<[u8; 32]>().to_vec(),
            inviter: attacker.id(),
            signature: Vec::new(),
        }
        .sign(&attacker.key);
        if i % 10 == 3 {
            env.signature[0] ^= 1;
        }
        payloads.push(env.encode());
    }
    let started = std::time::Instant::now();
    let client = attacker.client.clone();
    let accepted = futures::stream::iter(payloads)
        .map(|payload| {
            let c = client.clone();
            let p = mailbox_publish(&mailbox, payload);
            async move { c.publish(p).await }
        })
        .buffer_unordered(64)
        .filter(|r| futures::future::ready(matches!(r, Ok(PublishOutcome::Accepted { .. }))))
        .count()
        .await;
    assert_eq!(accepted, FLOOD, "the hub took the whole flood");
    let published = started.elapsed();
    let records = Records::new(kv.clone());
    drained(&hub, v.id(), Duration::from_secs(600)).await;
    eprintln!(
        "flood of {FLOOD}: published in {published:?}, handled by V in {:?}",
        started.elapsed()
    );

    let (keys1, bytes1) = store_size(&*kv);
    eprintln!(
        "V's store: {} keys / {bytes0} bytes before, {} keys / {bytes1} bytes after",
        keys0.len(),
        keys1.len()
    );
    assert_eq!(v.groups().unwrap(), vec![g]);
    for id in &ids {
        assert!(records.group(id).unwrap().is_none());
        assert!(records.pending_welcomes(id).unwrap().is_empty());
    }
    let new: Vec<&Vec<u8>> = keys1.iter().filter(|k| !keys0.contains(k)).collect();
    for id in ids.iter().step_by(97) {
        let hex = hex::encode(id.0);
        for k in &new {
            assert!(
                !k.windows(32).any(|w| w == id.0) && !String::from_utf8_lossy(k).contains(&hex),
                "a key names a flood group: {}",
                String::from_utf8_lossy(k)
            );
        }
    }
    assert!(
        new.len() <= 32,
        "V's store grew by {} keys: {:?}",
        new.len(),
        new.iter()
            .map(|k| String::from_utf8_lossy(k))
            .collect::<Vec<_>>()
    );
    assert!(
        bytes1 <= bytes0 + 256 * 1024,
        "V's store grew from {bytes0} to {bytes1} bytes"
    );

    // V is fine.
    message_reaches(&a, &[&wv], g, b"after the flood").await;
    carry_on(&v, &[&a, &v], &[&wa], g, b"v commits after the flood").await;
}

// ---------------------------------------------------------------------------
// 5. A removed member writing on the commit topic
// ---------------------------------------------------------------------------

/// A frame whose publisher is not in the roster at that epoch is never
/// evidence (DESIGN.md section 9; `classify` in lane/classify.rs).
///
/// And a removed member cannot write where the group commits now: the
/// removal moved the commit log to a topic whose writer key derives from
/// the new epoch (DESIGN.md section 9, writer keys).
///
/// C builds a real commit at its last epoch and never publishes it (the
/// `halt_after_journal` fault stops it after the journal); B goes offline;
/// A removes C. C, with its own key on its own connection:
/// - on the group's new commit topic, signed with the writer key it knew,
///   is refused `NotAuthorized`, and nothing is stored;
/// - on its old commit topic (the old key still writes there) publishes
///   junk after its removal: B, back online, reads the removal there and
///   moves on to the new topic; nobody judges what came after.
///
/// Then, as if a member leaked the new writer key to C, C publishes on the
/// new topic: its real commit; copies claiming the current epoch and the
/// next one (the one that would strand a reader that took it for a
/// member's); a copy of the removal commit itself (each skipped as
/// `Stranger`); garbage (`Garbage`). A and B skip each for the same
/// reasons. Nobody is stranded and the group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_members_frames_on_the_commit_topic_strand_nobody() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let mut b = TestDevice::open(&u).await.unwrap();
    let mut c = TestDevice::open(&u).await.unwrap();
    let (wa, wb0, wc) = (Watch::new(&a), Watch::new(&b), Watch::new(&c));
    let g = group_of(&a, &[(&b, &wb0), (&c, &wc)], &u).await;
    agree(&[&a, &b, &c], g).await;

    // C's unpublished commit, its identity and its old record's seed.
    let old = c.manager().record(g).unwrap().commit_writer();
    c.manager().faults().no_pull.store(true, SeqCst);
    c.manager().faults().halt_after_journal.store(true, SeqCst);
    assert_eq!(c.rotate_keys(g).await.unwrap_err(), CommitError::Stopped);
    let cid = c.id();
    c.close().await;
    let (c_key, c_commit) = {
        let kv: Arc<dyn KvStore> = Arc::new(open_sled(c.dir()).await.unwrap());
        let id = DeviceIdentity::load(&*kv).unwrap().expect("C's identity");
        let j = Records::new(kv).journal(&g).unwrap().expect("C's journal");
        (id.signing_key().clone(), j.payload)
    };
    let (_, c_epoch) = mls_header(&c_commit);

    b.close().await;
    a.remove(g, cid).await.unwrap();
    let (e, _) = agree(&[&a], g).await;
    assert_eq!(e, c_epoch + 1);
    let new = a.manager().record(g).unwrap().commit_writer();
    assert_ne!(new.topic(), old.topic(), "the removal moved the log");
    let removed = Raw {
        signer: signer_of(&c_key),
        client: hub.client(&c_key).await.unwrap(),
        key: c_key,
        provider: OpenMlsRustCrypto::default(),
        pushes: None,
    };
    // The writer key C knew does not write the new topic.
    let head = removed.client.fetch(new.topic(), 0, 1).await.unwrap().head;
    let mut own = log_publish(&new, ExpectedHead::Unconditional, c_commit.clone());
    let mut theirs = log_publish(&old, ExpectedHead::Unconditional, c_commit.clone());
    own.writer = theirs.writer.take();
    assert_eq!(
        removed.client.publish(own).await.unwrap_err(),
        ClientError::Hub(HubError::NotAuthorized)
    );
    assert_eq!(
        removed.client.fetch(new.topic(), 0, 1).await.unwrap().head,
        head,
        "nothing stored"
    );
    // The old topic still takes the old key: junk after the removal there
    // is read by nobody.
    let log = removed.client.fetch(old.topic(), 0, 100).await.unwrap();
    let removal = log.messages.last().expect("the removal").payload.clone();
    assert_eq!(mls_header(&removal).1, c_epoch);
    removed
        .publish_anyway(&old, with_epoch(&c_commit, e + 1))
        .await;

    // B was away: it reads the removal on the old topic and moves on.
    b.reopen().await.unwrap();
    let wb = Watch::new(&b);
    assert_eq!(agree(&[&a, &b], g).await.0, e);

    // With the new key leaked to it: each frame and why it must be
    // skipped. A well-formed frame of the group is judged on its
    // publisher, who is no member; garbage is garbage before anything else.
    let frames = vec![
        (c_commit.clone(), SkipReason::Stranger),
        (with_epoch(&c_commit, e), SkipReason::Stranger),
        (with_epoch(&c_commit, e + 1), SkipReason::Stranger),
        (removal, SkipReason::Stranger),
        (b"not an MLS message".to_vec(), SkipReason::Garbage),
    ];
    let mut seqs = Vec::new();
    for (f, why) in frames {
        seqs.push((removed.publish_anyway(&new, f).await, why));
    }
    for (s, why) in &seqs {
        assert_eq!(&wa.skipped_at(g, *s).await, why, "frame {s}");
        assert_eq!(&wb.skipped_at(g, *s).await, why, "frame {s} on B");
    }
    assert_eq!(agree(&[&a, &b], g).await.0, e);
    carry_on(&a, &[&a, &b], &[&wb], g, b"after the removed member").await;
    message_reaches(&b, &[&wa], g, b"b writes too").await;
    assert_eq!(
        wa.stranded() + wb0.stranded() + wb.stranded(),
        0,
        "nobody stranded"
    );
}

/// A stranger who learned a group's commit topic name (a hub operator
/// sees it; it is in no clear field, but assume it leaked) and holds no
/// writer key: every publish there is refused `NotAuthorized` and nothing
/// is stored. Garbage, a well-formed copy of a real commit claiming a
/// far-future epoch, a proof by the stranger's own key, and a flood deeper
/// than the hub's log depth (which would trim the log and leave members
/// behind the trim with a gap) all fail; the head and the oldest frame do
/// not move, and the members' next commit wins its compare-and-set at the
/// first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_without_the_writer_key_can_neither_move_nor_trim_a_commit_topic() {
    const DEPTH: u64 = 8;
    let hub = TestHub::start_with(|c| {
        unthrottled(c);
        c.limits.max_log_depth = DEPTH;
    })
    .await
    .unwrap();
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let (wa, wb) = (Watch::new(&a), Watch::new(&b));
    let g = group_of(&a, &[(&b, &wb)], &u).await;
    a.rotate_keys(g).await.unwrap();
    let (e, _) = agree(&[&a, &b], g).await;
    let writer = a.manager().record(g).unwrap().commit_writer();
    let topic = writer.topic().clone();
    let stranger_key = signing_key(7007);
    let stranger = hub.client(&stranger_key).await.unwrap();
    let before = stranger.fetch(&topic, 0, 100).await.unwrap();
    let real = before
        .messages
        .last()
        .expect("a's rotation")
        .payload
        .clone();

    let refused = |p: Publish| {
        let stranger = &stranger;
        async move {
            assert_eq!(
                stranger.publish(p).await.unwrap_err(),
                ClientError::Hub(HubError::NotAuthorized)
            );
        }
    };
    let unsigned = |payload: Vec<u8>| {
        let mut p = log_publish(&writer, ExpectedHead::Unconditional, payload);
        p.writer = None;
        p
    };
    // A far-future copy of a real commit, and garbage.
    refused(unsigned(with_epoch(&real, e + 1000))).await;
    refused(unsigned(b"garbage".to_vec())).await;
    // A proof by the stranger's own key, on the group's topic.
    let mut own = log_publish(&writer, ExpectedHead::Unconditional, real.clone());
    let mine = commit_writer(&[0x77; 32]);
    let mut theirs = log_publish(&mine, ExpectedHead::Unconditional, real.clone());
    own.writer = theirs.writer.take();
    if let Some(proof) = own.writer.as_mut() {
        proof.key = stranger_key.verifying_key().to_bytes();
    }
    refused(own).await;
    // A flood deeper than the log.
    for i in 0..(3 * DEPTH) {
        refused(unsigned(format!("junk {i}").into_bytes())).await;
    }

    let after = stranger.fetch(&topic, 0, 100).await.unwrap();
    assert_eq!(after.head, before.head, "the head never moved");
    assert_eq!(after.oldest, before.oldest, "nothing was trimmed");
    assert!(!after.gap);
    assert_eq!(after.messages.len(), before.messages.len());

    let r = b.rotate_keys(g).await.unwrap();
    assert_eq!(r.outcome.attempts, 1, "no lost compare-and-set");
    assert_eq!(Some(r.outcome.seq), before.head.map(|h| h + 1));
    carry_on(&a, &[&a, &b], &[&wb], g, b"after the stranger").await;
    message_reaches(&b, &[&wa], g, b"and back").await;
    assert_eq!(wa.stranded() + wb.stranded(), 0);
}

// ---------------------------------------------------------------------------
// 6. A standard client's PublicMessage commit
// ---------------------------------------------------------------------------

/// Compatibility, not an attack: a member that is a plain openmls client
/// sending its handshake messages as PublicMessage (outgoing plaintext,
/// `MIXED_PLAINTEXT_WIRE_FORMAT_POLICY`) commits a self-update; the
/// hubsync members merge it (same epoch authenticator as the client's),
/// the client reads their messages and follows their next commit, and
/// they go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standard_clients_public_message_commit_is_accepted() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let (wa, wb) = (Watch::new(&a), Watch::new(&b));
    let g = group_of(&a, &[(&b, &wb)], &u).await;

    let (m, mut group) = Raw::invited(&hub, 8101, &a, g, MIXED_PLAINTEXT_WIRE_FORMAT_POLICY).await;
    let (e, _) = agree(&[&a, &b], g).await;
    assert_eq!(group.epoch().as_u64(), e);
    let topic = commit_writer_of(&group, &m.provider);
    // The app topic of the epoch of the last roster change: this one.
    let app = app_topic(
        &group
            .export_secret(m.provider.crypto(), APP_TOPIC_LABEL, &[], 32)
            .unwrap(),
    );

    let commit = self_update_commit(&mut group, &m, LeafNodeParameters::default(), None);
    let pm = MlsMessageIn::tls_deserialize_exact(commit.as_slice())
        .unwrap()
        .try_into_protocol_message()
        .unwrap();
    assert!(
        matches!(pm, openmls::prelude::ProtocolMessage::PublicMessage(_)),
        "a PublicMessage commit"
    );
    let seq = m.publish_at_head(&topic, commit).await;
    group.merge_pending_commit(&m.provider).unwrap();
    // Both must have applied it: agreeing on the old epoch is not enough.
    let deadline = tokio::time::Instant::now() + WAIT;
    while a.epoch(g).await.unwrap() <= e || b.epoch(g).await.unwrap() <= e {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the plaintext commit was never applied"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (e1, auth1) = agree(&[&a, &b], g).await;
    assert_eq!(e1, e + 1);
    assert_eq!(auth1.as_slice(), group.epoch_authenticator().as_slice());
    for w in [&wa, &wb] {
        assert_eq!(
            w.count(|ev| matches!(ev, Event::FrameSkipped { seq: s, .. } if *s == seq)),
            0,
            "the PublicMessage commit was not skipped"
        );
    }

    // The client reads a member's message, and follows a member's commit.
    message_reaches(&a, &[&wb], g, b"to everyone, m too").await;
    let frames = m.client.fetch(&app, 0, 100).await.unwrap().messages;
    let mut read = Vec::new();
    for f in frames {
        let pm = MlsMessageIn::tls_deserialize_exact(f.payload.as_slice())
            .unwrap()
            .try_into_protocol_message()
            .unwrap();
        if let ProcessedMessageContent::ApplicationMessage(am) = group
            .process_message(&m.provider, pm)
            .unwrap()
            .into_content()
        {
            let msg: AppMessage = postcard::from_bytes(&am.into_bytes()).unwrap();
            read.push(msg.body);
        }
    }
    assert_eq!(read, vec![b"to everyone, m too".to_vec()]);
    carry_on(&b, &[&a, &b], &[&wa], g, b"b commits after m").await;
    let next = m
        .client
        .fetch(topic.topic(), seq, 100)
        .await
        .unwrap()
        .messages;
    assert_eq!(next.len(), 1, "b's rotation");
    let pm = MlsMessageIn::tls_deserialize_exact(next[0].payload.as_slice())
        .unwrap()
        .try_into_protocol_message()
        .unwrap();
    let ProcessedMessageContent::StagedCommitMessage(staged) = group
        .process_message(&m.provider, pm)
        .unwrap()
        .into_content()
    else {
        panic!("b's rotation is a commit")
    };
    group.merge_staged_commit(&m.provider, *staged).unwrap();
    assert_eq!(
        group.epoch_authenticator().as_slice(),
        a.epoch_authenticator(g).await.unwrap().as_slice()
    );
    assert_eq!(wa.stranded() + wb.stranded(), 0);
}

// ---------------------------------------------------------------------------
// External commits
// ---------------------------------------------------------------------------

/// An external commit is a member rejoining in its own place
/// (docs/protocol.md section 27) and nothing else: nobody joins from
/// outside without an invite entry.
///
/// A member `m` (a plain openmls client) leaks the group's GroupInfo and
/// its commit topic's writer key to an outsider `x`, who builds an
/// external commit adding a leaf of its own. Published by `x`, the members
/// skip it as a stranger's frame; published by `m` itself (a member, so
/// past the stranger rule), they refuse it as an external commit that is
/// not a member re-adding its own leaf. Neither moves the epoch, strands
/// anyone or makes `x` a member, and the group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outsider_with_a_leaked_group_info_cannot_join_by_external_commit() {
    let hub = hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let (wa, wb) = (Watch::new(&a), Watch::new(&b));
    let g = group_of(&a, &[(&b, &wb)], &u).await;

    let (m, group) = Raw::invited(&hub, 8201, &a, g, MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY).await;
    let (e, _) = agree(&[&a, &b], g).await;
    assert_eq!(group.epoch().as_u64(), e);
    let topic = commit_writer_of(&group, &m.provider);
    let info = group
        .export_group_info(m.provider.crypto(), &m.signer, true)
        .unwrap()
        .tls_serialize_detached()
        .unwrap();

    let x = Raw::connect(&hub, 8202).await;
    let MlsMessageBodyIn::GroupInfo(vgi) = MlsMessageIn::tls_deserialize_exact(info.as_slice())
        .unwrap()
        .extract()
    else {
        panic!("not a GroupInfo")
    };
    let p = &x.provider;
    let (_joined, bundle) = MlsGroup::external_commit_builder()
        .with_config(raw_join_config(MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY))
        .build_group(p, vgi, x.honest())
        .unwrap()
        .leaf_node_parameters(
            LeafNodeParameters::builder()
                .with_capabilities(capabilities())
                .build(),
        )
        .load_psks(p.storage())
        .unwrap()
        .build(p.rand(), p.crypto(), &x.signer, |_| true)
        .unwrap()
        .finalize(p)
        .unwrap();
    let commit = bundle.commit().tls_serialize_detached().unwrap();

    let by_x = x.publish_at_head(&topic, commit.clone()).await;
    for w in [&wa, &wb] {
        assert_eq!(w.skipped_at(g, by_x).await, SkipReason::Stranger);
    }
    let by_m = m.publish_at_head(&topic, commit).await;
    for w in [&wa, &wb] {
        let why = w.skipped_at(g, by_m).await;
        assert!(
            matches!(&why, SkipReason::LedgerRefused(r) if r.contains("external commit")),
            "{why:?}"
        );
    }
    let (e1, _) = agree(&[&a, &b], g).await;
    assert_eq!(e1, e, "no external commit moved the epoch");
    assert!(!a.members(g).await.unwrap().contains(&x.id()));
    assert_eq!(wa.stranded() + wb.stranded(), 0);
    carry_on(&a, &[&a, &b], &[&wb], g, b"after the outsider").await;
}
