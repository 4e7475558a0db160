//! The device's half of the fuzzing targets ([`crate::fuzz`]): what needs
//! the device's private modules. Each function is one target; none may
//! panic on any input.

use super::control_msg::{own_leave_entry, Control};
use super::crypto::DeviceCrypto;
use super::frames::{AppMessage, ReinviteRequest, WelcomeEnvelope};
use super::lane::{parse_enacted_aad, CommitFrame};
use super::ledger::{self, Entry, GroupExt, LedgerState};
use super::records::{AppCursor, GroupId, Records, SentMessage};
use super::rejoin::{Grant, RendezvousFrame};
use super::tunnel::handshake::{self, Handshake};
use super::tunnel::session::{Frame, Session};
use crate::kv::{KvStore, MemKv, WriteBatch};
use crate::wire::{DeviceId, TopicId};
use ed25519_dalek::SigningKey;
use openmls::prelude::tls_codec::Deserialize as _;
use openmls::prelude::{MlsMessageBodyIn, MlsMessageIn};
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::types::HpkeCiphertext;
use std::sync::{Arc, OnceLock};

/// The group every target that needs one uses.
pub const GROUP: GroupId = GroupId([0x42; 32]);
/// The AES-128-GCM key a target opens sealed ledgers with.
pub const SEAL_KEY: [u8; 16] = [0x5e; 16];
/// The seed of the HPKE key pair a target opens sealed answers with.
pub const HPKE_IKM: [u8; 32] = [0x33; 32];
/// How many fixed keys sign for the fuzzer (`ledger_fold`, envelopes).
const KEYS: u8 = 4;

/// The fixed signing key `n` (0..[`KEYS`]).
pub fn key(n: u8) -> &'static SigningKey {
    static KEYS_CELL: OnceLock<Vec<SigningKey>> = OnceLock::new();
    let keys = KEYS_CELL.get_or_init(|| {
        (0..KEYS)
            .map(|i| SigningKey::from_bytes(&[0xa0 + i; 32]))
            .collect()
    });
    &keys[usize::from(n % KEYS)]
}

/// The device id of fixed key `n`.
pub fn device(n: u8) -> DeviceId {
    DeviceId(key(n).verifying_key().to_bytes())
}

fn crypto() -> &'static DeviceCrypto {
    static CRYPTO: OnceLock<DeviceCrypto> = OnceLock::new();
    CRYPTO.get_or_init(DeviceCrypto::system)
}

/// The fixed HPKE key pair (public, private) of the group's suite.
pub fn hpke_keys() -> &'static (Vec<u8>, Vec<u8>) {
    static PAIR: OnceLock<(Vec<u8>, Vec<u8>)> = OnceLock::new();
    PAIR.get_or_init(|| {
        let pair = crypto()
            .derive_hpke_keypair(super::mls::CIPHERSUITE.hpke_config(), &HPKE_IKM)
            .unwrap_or_else(|e| unreachable!("the suite derives HPKE keys: {e:?}"));
        (pair.public, pair.private.to_vec())
    })
}

/// A Welcome mailbox payload: a reinvite request or a Welcome envelope,
/// opened as the device opens them. Then the envelope again, re-signed by
/// a fixed key so the fuzzer gets past the signature: it must open, and
/// its MLS Welcome and its sealed ledger snapshot are read as a joiner
/// reads them.
pub fn welcome_envelope(data: &[u8]) {
    if ReinviteRequest::is_one(data) {
        if let Ok(r) = ReinviteRequest::open(data) {
            assert_eq!(ReinviteRequest::open(&r.encode()), Ok(r));
        }
        return;
    }
    if let Ok(env) = WelcomeEnvelope::open(data) {
        assert_eq!(WelcomeEnvelope::open(&env.encode()), Ok(env));
    }
    let Ok(mut env) = postcard::from_bytes::<WelcomeEnvelope>(data) else {
        return;
    };
    env.inviter = device(0);
    let env = env.sign(key(0));
    let opened = WelcomeEnvelope::open(&env.encode());
    assert_eq!(opened.as_ref(), Ok(&env), "a signed envelope does not open");
    let _ = super::peer::welcome_of(&env);
    if let Ok(plain) = ledger::open(crypto(), &SEAL_KEY, &env.group.0, &env.ledger) {
        let _ = super::gather::verify_ledger(env.group, &plain, &[0; 32]);
    }
}

/// The plaintext of an MLS application message: the app-message frame,
/// and a control message's body in it (with a leave request's entry
/// checked as the device checks it).
pub fn app_message(data: &[u8]) {
    if let Ok(m) = postcard::from_bytes::<AppMessage>(data) {
        let again = postcard::to_allocvec(&m).unwrap_or_default();
        assert_eq!(postcard::from_bytes::<AppMessage>(&again).ok(), Some(m));
    }
    if let Ok(c) = postcard::from_bytes::<Control>(data) {
        let again = postcard::to_allocvec(&c).unwrap_or_default();
        assert_eq!(
            postcard::from_bytes::<Control>(&again).ok().as_ref(),
            Some(&c)
        );
        if let Control::LeaveRequest { entry } = &c {
            let _ = own_leave_entry(entry, device(0), GROUP);
        }
    }
}

/// An MLSMessage as a hub hands it over: an app topic's frame (read for
/// its group and epoch before anything is decrypted), a claimed key
/// package, a rejoin grant's GroupInfo, a Welcome.
pub fn mls_message(data: &[u8]) {
    let _ = super::control::parse_key_package(data);
    let Ok(m) = MlsMessageIn::tls_deserialize_exact(data) else {
        return;
    };
    match m.clone().extract() {
        MlsMessageBodyIn::GroupInfo(gi) => {
            let _ = gi.group_id();
        }
        MlsMessageBodyIn::Welcome(w) => {
            let _ = w.secrets().len();
        }
        _ => {}
    }
    if let Ok(pm) = m.try_into_protocol_message() {
        let _ = GroupId::from_mls(pm.group_id());
        let _ = pm.epoch().as_u64();
    }
}

/// A commit-topic frame: split into its MLS message and sealed entries
/// (round trip), the MLS message read as the pull reads it, the sealed
/// entries opened, and the bytes as a commit's authenticated data.
pub fn commit_frame(data: &[u8]) {
    if let Some(ids) = parse_enacted_aad(data) {
        assert_eq!(
            super::lane::enacted_aad(&ids),
            data,
            "enacted AAD does not round-trip"
        );
    }
    let Some(frame) = CommitFrame::parse(data) else {
        return;
    };
    assert_eq!(
        CommitFrame::encode(frame.mls, frame.sealed),
        data,
        "a commit frame does not round-trip"
    );
    let _ = super::lane::protocol_message(data);
    if let Ok(plain) = ledger::open(crypto(), &SEAL_KEY, &GROUP.0, frame.sealed) {
        let _ = ledger::decode_list(&plain);
    }
}

/// Ledger bytes: one entry and a list (each round trips; a decoded entry
/// is within the encoding's limits), the group context extension, and a
/// sealed blob.
pub fn ledger_entry(data: &[u8]) {
    if let Ok(e) = Entry::decode(data) {
        assert_eq!(e.encode(), data, "an entry does not round-trip");
        assert_eq!(e.check_limits(), Ok(()), "a decoded entry breaks a limit");
        let _ = e.verify();
        let _ = e.id();
    }
    if let Ok(list) = ledger::decode_list(data) {
        assert_eq!(
            ledger::encode_list(&list),
            data,
            "a list does not round-trip"
        );
    }
    if let Ok(ext) = GroupExt::decode(data) {
        assert_eq!(ext.encode(), data, "the extension does not round-trip");
    }
    let _ = ledger::open(crypto(), &SEAL_KEY, &GROUP.0, data);
}

/// A ledger list, every entry re-signed by one of the fixed keys (its
/// author's first byte picks which) in the fixed group, and a 32-byte
/// subject starting below 8 turned into that fixed key's device: so the
/// fuzzer reaches the authority rules. The fold's promises are checked:
/// `check` and `apply` agree, and a refused entry changes nothing.
pub fn ledger_fold(data: &[u8]) {
    let Ok(list) = ledger::decode_list(data) else {
        return;
    };
    let mut state = LedgerState::new(GROUP);
    for e in list {
        let mut subject = e.subject;
        if subject.len() == 32 && subject[0] < 8 {
            subject = device(subject[0]).0.to_vec();
        }
        let e = Entry::sign(e.kind, GROUP, subject, e.value, e.ord, key(e.author.0[0]));
        let checked = state.check(&e);
        let before = state.clone();
        let applied = state.apply(&e);
        assert_eq!(checked, applied, "check and apply disagree");
        if applied.is_err() {
            assert_eq!(state, before, "a refused entry changed the state");
        }
    }
    let _ = super::lane::select_commit_hub(&state);
}

/// A frame on a group's rendezvous mailbox, as the device takes it: each
/// kind's signature checked, a beacon taken into a presence book, an
/// answer's sealed grant opened with the fixed HPKE key (as a requester
/// opens it). Also the bytes as a grant's plaintext.
pub fn rendezvous(data: &[u8]) {
    if let Ok(g) = postcard::from_bytes::<Grant>(data) {
        if let Ok(m) = MlsMessageIn::tls_deserialize_exact(g.group_info.as_slice()) {
            let _ = m.extract();
        }
    }
    let Ok(frame) = postcard::from_bytes::<RendezvousFrame>(data) else {
        return;
    };
    let again = postcard::to_allocvec(&frame).unwrap_or_default();
    assert_eq!(
        postcard::from_bytes::<RendezvousFrame>(&again)
            .ok()
            .as_ref(),
        Some(&frame),
        "a rendezvous frame does not round-trip"
    );
    match frame {
        RendezvousFrame::Request(r) => {
            let _ = r.verify();
        }
        RendezvousFrame::Answer(a) => {
            let _ = a.verify();
            let input = HpkeCiphertext {
                kem_output: a.kem_output.into(),
                ciphertext: a.ciphertext.into(),
            };
            let (_, private) = hpke_keys();
            let aad = [&a.group.0[..], &a.nonce[..]].concat();
            if let Ok(plain) = crypto().hpke_open(
                super::mls::CIPHERSUITE.hpke_config(),
                &input,
                private,
                super::rejoin::GRANT_INFO,
                &aad,
            ) {
                let _ = postcard::from_bytes::<Grant>(&plain);
            }
        }
        RendezvousFrame::Refusal(r) => {
            let _ = r.signed_bytes();
        }
        RendezvousFrame::Probe(p) => {
            let _ = p.verify();
        }
        RendezvousFrame::Status(s) => {
            let _ = s.signed_bytes();
        }
        RendezvousFrame::Presence(b) => {
            let _ = b.verify();
            let mut book = super::presence::PresenceBook::default();
            book.beacon(&b, "wss://hub.example", 1);
            let _ = book.view(b.group, [b.device], |_| true);
        }
    }
}

/// A tunnel's bytes: a handshake frame from a device's mailbox (each
/// kind's signature checked; an open's key encapsulated to, an accept's
/// encapsulation opened with the fixed HPKE key, as the two sides do), a
/// sealed frame, and an opened frame's RPC message.
pub fn tunnel_handshake(data: &[u8]) {
    if let Some(h) = Handshake::decode(data) {
        assert_eq!(Handshake::decode(&h.encode()).as_ref(), Some(&h));
        let (public, private) = hpke_keys();
        let open = handshake::Open {
            group: GROUP,
            tunnel: [1; 16],
            from: device(0),
            to: device(1),
            epoch: 1,
            hpke_public: public.clone(),
            signature: Vec::new(),
        };
        match &h {
            Handshake::Open(o) => {
                let _ = o.verify();
                let _ = handshake::encapsulate(crypto(), o);
            }
            Handshake::Accept(a) => {
                let _ = a.verify(&open.digest());
                let _ = handshake::decapsulate(crypto(), &open, private, &a.kem_output);
            }
            Handshake::Refuse(r) => {
                let _ = r.verify(&open.digest());
            }
        }
    }
    let keys = tunnel_keys();
    let _ = handshake::unseal(crypto(), &keys.inbound, data);
    super::tunnel::fuzz_rpc(data);
}

fn tunnel_keys() -> &'static handshake::TunnelKeys {
    static KEYS_CELL: OnceLock<handshake::TunnelKeys> = OnceLock::new();
    KEYS_CELL.get_or_init(|| {
        let open = handshake::Open {
            group: GROUP,
            tunnel: [1; 16],
            from: device(0),
            to: device(1),
            epoch: 1,
            hpke_public: hpke_keys().0.clone(),
            signature: Vec::new(),
        };
        handshake::derive_keys(crypto(), &[2; 32], &[3; 32], &open, true)
            .unwrap_or_else(|e| unreachable!("fixed tunnel keys derive: {e}"))
    })
}

/// Opened tunnel frames, one after another (postcard, back to back), fed
/// to a session that has two messages of its own in flight: what the
/// other side's frames can do to ordering, acknowledgment and reassembly.
/// Every message handed over is made of chunks taken in order.
pub fn tunnel_session(data: &[u8]) {
    let mut s = Session::new(0);
    let _ = s.queue(b"first");
    let _ = s.queue(&[7; 300]);
    let _ = s.transmit(0);
    let mut rest = data;
    let mut now = 0u64;
    while let Ok((frame, tail)) = postcard::take_from_bytes::<Frame>(rest) {
        rest = tail;
        now += 500;
        let _ = s.receive(frame, now);
        let _ = s.transmit(now);
        let _ = s.resend_due_ms();
        if rest.is_empty() {
            break;
        }
    }
    let _ = s.idle_ms(now);
}

/// A device's stored record read back: a store holding one record of every
/// kind the device keeps (group, journal, ledger, cursors, sent messages,
/// key packages, inbox, hub directory, identity), with the value under one
/// of its keys (the first byte picks which) replaced by the rest of the
/// bytes. Every reader must answer a value or `Corrupt`.
pub fn device_records(data: &[u8]) {
    let Some((&pick, value)) = data.split_first() else {
        return;
    };
    let kv = Arc::new(MemKv::new());
    let records = Records::new(kv.clone());
    let hub = "wss://hub.example";
    let topic = TopicId::from("app");
    let inbox = super::inbox::Inbox::new(kv.clone(), Default::default());
    let mut b = WriteBatch::new();
    seed_records(&records, &inbox, &mut b, hub, &topic);
    if kv.apply(&b).is_err() {
        return;
    }
    let keys: Vec<Vec<u8>> = match kv.scan_prefix(b"", usize::MAX) {
        Ok(entries) => entries.into_iter().map(|(k, _)| k).collect(),
        Err(_) => return,
    };
    if keys.is_empty() {
        return;
    }
    let mut b = WriteBatch::new();
    b.put(keys[usize::from(pick) % keys.len()].clone(), value.to_vec());
    if kv.apply(&b).is_err() {
        return;
    }
    if let Ok(groups) = records.groups() {
        for g in groups {
            let _ = g.cursor();
            let _ = g.routes();
            let _ = g.commit_writer();
            for t in &g.app_topics {
                let _ = g.app_writer(t);
            }
        }
    }
    let _ = records.group(&GROUP);
    let _ = records.journal(&GROUP);
    let _ = records.ledger(&GROUP);
    let _ = records.app_cursor(&GROUP, hub, &topic);
    let _ = records.pending_welcomes(&GROUP);
    let _ = records.invited_welcomes(&GROUP);
    let _ = records.hub_store_id(hub);
    let _ = records.uploaded_key_packages(hub);
    let _ = records.sent_since(&GROUP, 0);
    let _ = records.first_sent_behind(&GROUP, u64::MAX, 0);
    let _ = records.sent_pruned_through(&GROUP);
    let _ = records.future_frames(&GROUP);
    let _ = inbox.read(&GROUP, 0, usize::MAX);
    let _ = inbox.status(&GROUP);
    let _ = super::identity::DeviceIdentity::load(&*kv);
    if let Ok(dir) = super::directory::HubDirectory::open(
        kv.clone(),
        crate::clock::Clock::System,
        std::time::Duration::from_secs(60),
    ) {
        let _ = dir.list();
    }
}

/// One record of each kind, written by the device's own writers.
fn seed_records(
    records: &Records,
    inbox: &super::inbox::Inbox,
    b: &mut WriteBatch,
    hub: &str,
    topic: &TopicId,
) {
    let rec = super::records::GroupRecord {
        id: GROUP,
        hubs: vec![hub.to_string()],
        commit_hub: hub.to_string(),
        cursors: [(hub.to_string(), 3)].into(),
        app_topics: vec![topic.clone()],
        app_secrets: vec![[1; 32]],
        stranded: false,
        poison: 0,
        commit_seed: [2; 32],
        ledger_complete: true,
        merged: vec![super::records::MergedCommit {
            epoch: 4,
            digest: [3; 32],
            hub: hub.to_string(),
            seq: Some(3),
            payload: vec![1, 2, 3],
            commit_seed: Some([2; 32]),
            writer: Some(device(0)),
        }],
        cursor_stores: Default::default(),
        cursor_digests: Default::default(),
        rendezvous_seed: Some([4; 32]),
        lost_from: None,
        lost_seeds: Vec::new(),
        lost_to: None,
        caught_up_at_ms: 0,
        probe_owed: false,
    };
    records.put_group(b, &rec);
    records.put_ledger(b, &GROUP, 0, &[vec![1, 2, 3]]);
    records.put_app_cursor(
        b,
        &GROUP,
        hub,
        topic,
        AppCursor {
            seq: 5,
            digest: Some([6; 32]),
        },
    );
    records.put_pending_welcome(b, &GROUP, &device(1), b"envelope");
    records.put_invited_welcome(
        b,
        &GROUP,
        &device(2),
        &crate::wire::Publish {
            topic: topic.clone(),
            publish_id: crate::wire::PublishId([9; 32]),
            class: crate::wire::RetentionClass::Mailbox,
            expected_head: crate::wire::ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: None,
            payload: vec![4, 5],
            writer: None,
        },
    );
    records.put_hub_store_id(b, hub, crate::wire::StoreId([7; 16]));
    records.put_sent(
        b,
        &GROUP,
        &SentMessage {
            epoch: 4,
            id: [8; 16],
            body: b"hello".to_vec(),
            at_ms: 1,
        },
    );
    let _ = inbox.stage(b, &GROUP, device(3), [9; 16], b"body");
    b.put(super::identity::IDENTITY_KEY, [0x11; 32].to_vec());
    let info = super::directory::HubInfo {
        url: hub.to_string(),
        status: super::directory::HubState::Connected,
        last_connected_ms: Some(1),
        last_seen_ms: 1,
        protocol_version: Some(crate::wire::PROTOCOL_VERSION),
        last_error: None,
    };
    let mut dir_key = super::directory::KEY_PREFIX.to_vec();
    dir_key.extend_from_slice(hub.as_bytes());
    b.put(dir_key, serde_json::to_vec(&info).unwrap_or_default());
}

/// Real MLS bytes from a two-member group: bob's key package, the commit
/// that adds him, his Welcome, a GroupInfo and an application message.
struct MlsBytes {
    key_package: Vec<u8>,
    commit: Vec<u8>,
    welcome: Vec<u8>,
    group_info: Vec<u8>,
    app: Vec<u8>,
}

fn mls_bytes() -> Option<MlsBytes> {
    use openmls::prelude::tls_codec::Serialize as _;
    use openmls::prelude::*;
    use openmls_basic_credential::SignatureKeyPair;
    use openmls_rust_crypto::OpenMlsRustCrypto;
    let cs = super::mls::CIPHERSUITE;
    let party = |name: &[u8]| {
        let provider = OpenMlsRustCrypto::default();
        let signer = SignatureKeyPair::new(cs.signature_algorithm()).ok()?;
        signer.store(provider.storage()).ok()?;
        let credential = CredentialWithKey {
            credential: BasicCredential::new(name.to_vec()).into(),
            signature_key: signer.public().into(),
        };
        Some((provider, signer, credential))
    };
    let (ap, asig, acred) = party(b"alice")?;
    let (bp, bsig, bcred) = party(b"bob")?;
    let mut group = MlsGroup::builder()
        .ciphersuite(cs)
        .use_ratchet_tree_extension(true)
        .build(&ap, &asig, acred)
        .ok()?;
    let kp = KeyPackage::builder().build(cs, &bp, &bsig, bcred).ok()?;
    let key_package = MlsMessageOut::from(kp.key_package().clone())
        .tls_serialize_detached()
        .ok()?;
    let (commit, welcome, info) = group
        .add_members(&ap, &asig, &[kp.key_package().clone()])
        .ok()?;
    group.merge_pending_commit(&ap).ok()?;
    let app = group.create_message(&ap, &asig, b"hello").ok()?;
    Some(MlsBytes {
        key_package,
        commit: commit.tls_serialize_detached().ok()?,
        welcome: welcome.tls_serialize_detached().ok()?,
        group_info: MlsMessageOut::from(info?).tls_serialize_detached().ok()?,
        app: app.tls_serialize_detached().ok()?,
    })
}

/// A ledger: the first admin, an invite, a hub bound and made the commit
/// hub, a setting; authored by fixed key 0 (as `ledger_fold` re-signs:
/// author bytes of zeros pick key 0, a subject starting with `n < 8` is
/// fixed key `n`).
fn sample_ledger(for_fold: bool) -> Vec<Entry> {
    use super::ledger::{EntryType, Hlc};
    let subject = |n: u8| {
        if for_fold {
            vec![n; 32]
        } else {
            device(n).0.to_vec()
        }
    };
    let specs = [
        (EntryType::AdminGrant, subject(0), Vec::new()),
        (EntryType::MemberInvite, subject(1), Vec::new()),
        (
            EntryType::HubBind,
            b"wss://hub.example".to_vec(),
            Vec::new(),
        ),
        (
            EntryType::HubCommit,
            b"wss://hub.example".to_vec(),
            Vec::new(),
        ),
        (EntryType::GroupSetting, b"title".to_vec(), b"ours".to_vec()),
        (EntryType::AdminGrant, subject(1), Vec::new()),
        (EntryType::MemberRemove, subject(1), Vec::new()),
    ];
    specs
        .into_iter()
        .enumerate()
        .map(|(i, (kind, subject, value))| {
            let ord = Hlc {
                wall_ms: 1_700_000_000_000 + i as u64,
                counter: 0,
            };
            let mut e = Entry::sign(kind, GROUP, subject, value, ord, key(0));
            if for_fold {
                e.author = DeviceId([0; 32]);
            }
            e
        })
        .collect()
}

/// Seeds of the device's targets.
pub(crate) fn seeds(out: &mut Vec<crate::fuzz::Seed>) {
    use super::tunnel::handshake::{Accept, Open, Refuse, RefuseReason};
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        out.push(crate::fuzz::Seed {
            target,
            name: name.to_string(),
            bytes,
        })
    };
    let seal = |aad: &[u8], plain: &[u8]| {
        ledger::seal(crypto(), &SEAL_KEY, [1; 12], aad, plain).unwrap_or_default()
    };
    let ledger_list = ledger::encode_list(&sample_ledger(false));
    let mls = mls_bytes();
    let (welcome, commit) = mls
        .as_ref()
        .map(|m| (m.welcome.clone(), m.commit.clone()))
        .unwrap_or_default();
    if let Some(m) = &mls {
        add("mls_message", "key-package", m.key_package.clone());
        add("mls_message", "commit", m.commit.clone());
        add("mls_message", "welcome", m.welcome.clone());
        add("mls_message", "group-info", m.group_info.clone());
        add("mls_message", "app", m.app.clone());
    }
    // Welcome mailbox.
    let env = WelcomeEnvelope {
        group: GROUP,
        hubs: vec!["wss://hub.example".into()],
        commit_hub: "wss://hub.example".into(),
        commit_seq: 4,
        welcome,
        ledger: seal(&GROUP.0, &ledger_list),
        inviter: device(0),
        signature: Vec::new(),
    }
    .sign(key(0));
    add("welcome_envelope", "envelope", env.encode());
    let reinvite = ReinviteRequest {
        group: GROUP,
        joiner: device(1),
        inviter: device(0),
        welcome_digest: [5; 32],
        signature: Vec::new(),
    }
    .sign(key(1));
    add("welcome_envelope", "reinvite", reinvite.encode());
    // App and control messages.
    let msg = AppMessage {
        id: [1; 16],
        body: b"hello".to_vec(),
    };
    add(
        "app_message",
        "app",
        postcard::to_allocvec(&msg).unwrap_or_default(),
    );
    let leave = Entry::sign(
        super::ledger::EntryType::MemberRemove,
        GROUP,
        device(0).0.to_vec(),
        Vec::new(),
        Default::default(),
        key(0),
    );
    let controls = [
        (
            "ledger-request",
            Control::LedgerRequest {
                nonce: [2; 16],
                hpke_public: hpke_keys().0.clone(),
            },
        ),
        (
            "ledger-answer",
            Control::LedgerAnswer {
                nonce: [2; 16],
                to: device(1),
                kem_output: vec![3; 32],
                ciphertext: vec![4; 40],
            },
        ),
        (
            "leave",
            Control::LeaveRequest {
                entry: leave.encode(),
            },
        ),
    ];
    for (name, c) in controls {
        add(
            "app_message",
            name,
            postcard::to_allocvec(&c).unwrap_or_default(),
        );
    }
    // Commit frames and the ledger.
    let entries: Vec<Vec<u8>> = sample_ledger(false).iter().map(Entry::encode).collect();
    let sealed_entries = seal(&GROUP.0, &ledger::encode_list(&sample_ledger(false)[..2]));
    add("commit_frame", "bare", commit.clone());
    add(
        "commit_frame",
        "framed",
        CommitFrame::encode(&commit, &sealed_entries),
    );
    let ids: Vec<_> = sample_ledger(false).iter().map(Entry::id).collect();
    add("commit_frame", "aad", super::lane::enacted_aad(&ids[..2]));
    add("ledger_entry", "entry", entries[0].clone());
    add("ledger_entry", "setting", entries[4].clone());
    add("ledger_entry", "list", ledger_list.clone());
    add(
        "ledger_entry",
        "extension",
        GroupExt {
            ledger_head: [1; 32],
            topic_seed: [2; 32],
        }
        .encode(),
    );
    add("ledger_entry", "sealed", seal(&GROUP.0, &ledger_list));
    add(
        "ledger_fold",
        "ledger",
        ledger::encode_list(&sample_ledger(true)),
    );
    // Rendezvous.
    let request = super::rejoin::RejoinRequest {
        group: GROUP,
        device: device(1),
        nonce: [6; 16],
        hpke_public: hpke_keys().0.clone(),
        lost: Some(super::rejoin::LostBranch {
            from: 3,
            marks: vec![[7; 32]],
            taken_by: Some(device(2)),
        }),
        signature: Vec::new(),
    };
    let request = super::rejoin::RejoinRequest {
        signature: sign(key(1), &request.signed_bytes()),
        ..request
    };
    let grant = Grant {
        group_info: mls
            .as_ref()
            .map(|m| m.group_info.clone())
            .unwrap_or_default(),
        commit_hub: "wss://hub.example".into(),
        commit_seed: [8; 32],
        head: 4,
    };
    let grant_bytes = postcard::to_allocvec(&grant).unwrap_or_default();
    add("rendezvous", "grant", grant_bytes.clone());
    let aad = [&GROUP.0[..], &[6; 16][..]].concat();
    let sealed = crypto().hpke_seal(
        super::mls::CIPHERSUITE.hpke_config(),
        &hpke_keys().0,
        super::rejoin::GRANT_INFO,
        &aad,
        &grant_bytes,
    );
    if let Ok(sealed) = sealed {
        let answer = super::rejoin::RejoinAnswer {
            group: GROUP,
            nonce: [6; 16],
            to: device(1),
            from: device(0),
            epoch: 5,
            kem_output: sealed.kem_output.into(),
            ciphertext: sealed.ciphertext.into(),
            signature: Vec::new(),
        };
        let answer = super::rejoin::RejoinAnswer {
            signature: sign(key(0), &answer.signed_bytes()),
            ..answer
        };
        add(
            "rendezvous",
            "answer",
            postcard::to_allocvec(&RendezvousFrame::Answer(answer)).unwrap_or_default(),
        );
    }
    let probe = super::probe::EpochProbe {
        group: GROUP,
        device: device(0),
        nonce: [9; 16],
        epoch: 5,
        ask: vec![device(1), device(2)],
        signature: Vec::new(),
    };
    let probe = super::probe::EpochProbe {
        signature: sign(key(0), &probe.signed_bytes()),
        ..probe
    };
    let beacon = super::presence::PresenceBeacon {
        group: GROUP,
        device: device(2),
        at_ms: 10,
        state: super::presence::PresenceState::Live,
        ask: true,
        signature: Vec::new(),
    };
    let beacon = super::presence::PresenceBeacon {
        signature: sign(key(2), &beacon.signed_bytes()),
        ..beacon
    };
    let frames = [
        ("request", RendezvousFrame::Request(request)),
        ("probe", RendezvousFrame::Probe(probe)),
        ("presence", RendezvousFrame::Presence(beacon)),
        (
            "status",
            RendezvousFrame::Status(super::probe::EpochStatus {
                group: GROUP,
                nonce: [9; 16],
                to: device(0),
                from: device(1),
                epoch: 5,
                signature: vec![1; 64],
            }),
        ),
        (
            "refusal",
            RendezvousFrame::Refusal(super::rejoin::RejoinRefusal {
                group: GROUP,
                nonce: [6; 16],
                to: device(1),
                from: device(2),
                epoch: 7,
                signature: vec![2; 64],
            }),
        ),
    ];
    for (name, f) in frames {
        add(
            "rendezvous",
            name,
            postcard::to_allocvec(&f).unwrap_or_default(),
        );
    }
    // Tunnels.
    let open = Open {
        group: GROUP,
        tunnel: [1; 16],
        from: device(0),
        to: device(1),
        epoch: 1,
        hpke_public: hpke_keys().0.clone(),
        signature: Vec::new(),
    };
    let open = Open {
        signature: sign(key(0), &open.signed_bytes()),
        ..open
    };
    let digest = open.digest();
    if let Ok((kem_output, _)) = handshake::encapsulate(crypto(), &open) {
        let accept = Accept {
            tunnel: [1; 16],
            from: device(1),
            kem_output,
            signature: Vec::new(),
        };
        let accept = Accept {
            signature: sign(key(1), &accept.signed_bytes(&digest)),
            ..accept
        };
        add(
            "tunnel_handshake",
            "accept",
            Handshake::Accept(accept).encode(),
        );
    }
    let refuse = Refuse {
        tunnel: [1; 16],
        from: device(1),
        reason: RefuseReason::Epoch { mine: 4 },
        signature: Vec::new(),
    };
    let refuse = Refuse {
        signature: sign(key(1), &refuse.signed_bytes(&digest)),
        ..refuse
    };
    add(
        "tunnel_handshake",
        "open",
        Handshake::Open(open.clone()).encode(),
    );
    add(
        "tunnel_handshake",
        "refuse",
        Handshake::Refuse(refuse).encode(),
    );
    if let Ok(other) = handshake::derive_keys(crypto(), &[2; 32], &[3; 32], &open, false) {
        let frame = Frame::Data {
            seq: 0,
            last: true,
            bytes: b"call".to_vec(),
        };
        if let Ok(sealed) = handshake::seal(crypto(), &other.out, 0, &frame) {
            add("tunnel_handshake", "sealed", sealed);
        }
    }
    for (name, bytes) in super::tunnel::fuzz_rpc_seeds() {
        add("tunnel_handshake", name, bytes);
    }
    let session_frames = [
        Frame::Ack { next: 1 },
        Frame::Data {
            seq: 0,
            last: false,
            bytes: b"hel".to_vec(),
        },
        Frame::Data {
            seq: 1,
            last: true,
            bytes: b"lo".to_vec(),
        },
        Frame::Data {
            seq: 1,
            last: true,
            bytes: b"lo".to_vec(),
        },
        Frame::Ack { next: 2 },
        Frame::Close {
            reason: "done".into(),
        },
    ];
    let run: Vec<u8> = session_frames
        .iter()
        .flat_map(|f| postcard::to_allocvec(f).unwrap_or_default())
        .collect();
    add("tunnel_session", "run", run);
    // Stored records: one seed per stored key, each the value stored there
    // (the first byte picks the key, in the store's key order).
    let kv = Arc::new(MemKv::new());
    let records = Records::new(kv.clone());
    let inbox = super::inbox::Inbox::new(kv.clone(), Default::default());
    let mut b = WriteBatch::new();
    seed_records(
        &records,
        &inbox,
        &mut b,
        "wss://hub.example",
        &TopicId::from("app"),
    );
    if kv.apply(&b).is_ok() {
        if let Ok(entries) = kv.scan_prefix(b"", usize::MAX) {
            for (i, (_, v)) in entries.into_iter().enumerate() {
                let mut bytes = vec![u8::try_from(i).unwrap_or(0)];
                bytes.extend_from_slice(&v);
                add("device_records", &format!("record-{i}"), bytes);
            }
        }
    }
}

fn sign(k: &SigningKey, message: &[u8]) -> Vec<u8> {
    use ed25519_dalek::Signer as _;
    k.sign(message).to_bytes().to_vec()
}
