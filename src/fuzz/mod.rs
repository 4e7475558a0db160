//! Fuzzing targets: one plain function per decoder that reads bytes from
//! outside (a hub, a member, another device, the disk).
//!
//! Each function feeds its bytes to the engine's real decoders and, where
//! it is cheap, checks that what decoded encodes back to the same value.
//! None may panic on any input: a panic is the bug. The `fuzz/` crate
//! (nightly, cargo-fuzz) runs each under libFuzzer; `tests/fuzz_corpus.rs`
//! replays the kept corpus through the same functions on stable, so every
//! input fuzzing ever found stays a test. See `docs/testing.md`.
//!
//! Some checks sign on the fuzzer's behalf with fixed keys (a Welcome
//! envelope, ledger entries): without that, every input would stop at the
//! signature check and the decoding behind it would never be reached.

use crate::wire::{ClientFrame, ServerFrame};

/// One fuzzing target: its name (the directory of its corpus and the
/// libFuzzer binary's name) and what it runs.
#[derive(Clone, Copy)]
pub struct Target {
    /// The target's name, as `scripts/fuzz` and `fuzz/corpus/` know it.
    pub name: &'static str,
    /// What the decoders read: where the bytes come from.
    pub covers: &'static str,
    /// Feed one input; never panics.
    pub run: fn(&[u8]),
}

/// Every target, in the order `docs/testing.md` lists them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "wire_client_frame",
        covers: "a device's WebSocket frame as the hub decodes it",
        run: wire_client_frame,
    },
    Target {
        name: "wire_server_frame",
        covers: "a hub's WebSocket frame as the device decodes it",
        run: wire_server_frame,
    },
    Target {
        name: "auth_exchange",
        covers: "the challenge a device answers, the answer a hub checks",
        run: auth_exchange,
    },
    Target {
        name: "welcome_envelope",
        covers: "a Welcome envelope or reinvite request from the Welcome mailbox",
        run: crate::device::fuzzing::welcome_envelope,
    },
    Target {
        name: "app_message",
        covers: "an app message and control message inside MLS",
        run: crate::device::fuzzing::app_message,
    },
    Target {
        name: "mls_message",
        covers: "an MLSMessage from a hub (app frame, key package, GroupInfo)",
        run: crate::device::fuzzing::mls_message,
    },
    Target {
        name: "commit_frame",
        covers: "a commit-topic frame and its enacted-entries AAD",
        run: crate::device::fuzzing::commit_frame,
    },
    Target {
        name: "ledger_entry",
        covers: "a ledger entry, entry list, group extension and seal",
        run: crate::device::fuzzing::ledger_entry,
    },
    Target {
        name: "ledger_fold",
        covers: "a ledger list re-signed and folded under the authority rules",
        run: crate::device::fuzzing::ledger_fold,
    },
    Target {
        name: "rendezvous",
        covers: "a rendezvous mailbox frame (rejoin, probe, presence) and a grant",
        run: crate::device::fuzzing::rendezvous,
    },
    Target {
        name: "tunnel_handshake",
        covers: "a tunnel handshake, sealed frame and RPC message",
        run: crate::device::fuzzing::tunnel_handshake,
    },
    Target {
        name: "tunnel_session",
        covers: "a run of opened tunnel frames fed to a session",
        run: crate::device::fuzzing::tunnel_session,
    },
    Target {
        name: "device_records",
        covers: "a device's stored records read back from its store",
        run: crate::device::fuzzing::device_records,
    },
    Target {
        name: "hub_records",
        covers: "a hub's stored records and keys, and store announcements",
        run: crate::hub::fuzzing::hub_records,
    },
];

/// The target called `name`, if there is one.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// The largest frame the targets decode: the hub's default frame limit is
/// well under it, and a larger input only slows the fuzzer.
const MAX_FRAME: usize = 1 << 20;

/// A device's frame as the hub reads it: decode, and what decodes must
/// encode and decode back to itself. A request's publish is also put
/// through the hub's writer-proof check, which reads its fields.
pub fn wire_client_frame(data: &[u8]) {
    let Ok(frame) = ClientFrame::decode(data, MAX_FRAME) else {
        // The refusal is what the hub sends back: it must format.
        if let Err(e) = ClientFrame::decode(data, MAX_FRAME) {
            let _ = crate::wire::HubError::from(e).to_string();
        }
        return;
    };
    assert_eq!(
        ClientFrame::decode(&frame.encode(), usize::MAX).as_ref(),
        Ok(&frame),
        "a client frame does not round-trip"
    );
    if let ClientFrame::Request {
        op: crate::wire::Request::Publish(p),
        ..
    } = &frame
    {
        let _ = p.check_writer();
        let _ = p.topic.mailbox_owner();
    }
}

/// A hub's frame as the device reads it: decode, round trip, and the
/// text a device logs of an error.
pub fn wire_server_frame(data: &[u8]) {
    let Ok(frame) = ServerFrame::decode(data, MAX_FRAME) else {
        return;
    };
    assert_eq!(
        ServerFrame::decode(&frame.encode(), usize::MAX).as_ref(),
        Ok(&frame),
        "a server frame does not round-trip"
    );
    match &frame {
        ServerFrame::Error(e) | ServerFrame::ReceiveEnded(e) => {
            let _ = e.to_string();
        }
        ServerFrame::Response { result: Err(e), .. } => {
            let _ = e.to_string();
        }
        _ => {}
    }
}

/// The URL the `auth_exchange` target's hub has, and its device signs for.
pub const AUTH_HUB_URL: &str = "wss://hub.example";
/// The challenge nonce the `auth_exchange` target's hub issued.
pub const AUTH_NONCE: [u8; 32] = [7; 32];
/// The expiry of that challenge (ms); the hub checks at one ms before.
pub const AUTH_EXPIRES_AT_MS: u64 = 1_700_000_000_000;
/// The seed of the device key the `auth_exchange` target signs with.
pub const AUTH_DEVICE_SEED: [u8; 32] = [0x11; 32];

/// Both halves of the authentication exchange. A first byte that is even
/// makes the rest a device's frame, checked as the hub checks an answer to
/// the challenge ([`AUTH_NONCE`], [`AUTH_EXPIRES_AT_MS`], [`AUTH_HUB_URL`]);
/// odd makes it a hub's frame, and a challenge in it is answered as the
/// device answers one. Any answer the device gives must pass the hub's
/// checks (when it is not expired): the two halves agree on the version
/// range and what is signed.
pub fn auth_exchange(data: &[u8]) {
    let Some((&side, rest)) = data.split_first() else {
        return;
    };
    if side % 2 == 0 {
        if let Ok(ClientFrame::Auth(auth)) = ClientFrame::decode(rest, MAX_FRAME) {
            let _ = crate::hub::fuzzing::check_answer(
                &auth,
                &AUTH_NONCE,
                AUTH_EXPIRES_AT_MS,
                AUTH_EXPIRES_AT_MS - 1,
                AUTH_HUB_URL,
            );
        }
        return;
    }
    let Ok(ServerFrame::Challenge(challenge)) = ServerFrame::decode(rest, MAX_FRAME) else {
        return;
    };
    let key = ed25519_dalek::SigningKey::from_bytes(&AUTH_DEVICE_SEED);
    let Ok(auth) = crate::client::answer_challenge(&challenge, AUTH_HUB_URL, &key) else {
        return;
    };
    assert_eq!(
        crate::hub::fuzzing::check_answer(
            &auth,
            &challenge.nonce,
            challenge.expires_at_ms,
            challenge.expires_at_ms,
            AUTH_HUB_URL,
        ),
        Ok(auth.version),
        "the hub refuses the device's own answer"
    );
}

/// One seed input: a real encoding of what its target decodes.
#[derive(Clone, Debug)]
pub struct Seed {
    /// The target it is for.
    pub target: &'static str,
    /// Its file name in the target's corpus (`seed-` and this).
    pub name: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// Real encodings for every target, built with the engine's own encoders
/// (and a real MLS group for the MLS bytes): the corpus starts from these
/// (`tests/fuzz_corpus.rs`, `write_seeds`).
pub fn seeds() -> Vec<Seed> {
    let mut out = Vec::new();
    wire_seeds(&mut out);
    crate::device::fuzzing::seeds(&mut out);
    crate::hub::fuzzing::seeds(&mut out);
    out
}

fn wire_seeds(out: &mut Vec<Seed>) {
    use crate::wire::*;
    use ed25519_dalek::Signer as _;
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        out.push(Seed {
            target,
            name: name.to_string(),
            bytes,
        })
    };
    let key = ed25519_dalek::SigningKey::from_bytes(&AUTH_DEVICE_SEED);
    let device = DeviceId(key.verifying_key().to_bytes());
    let signature = key
        .sign(&auth_message(&AUTH_NONCE, AUTH_HUB_URL, AUTH_EXPIRES_AT_MS))
        .to_bytes()
        .to_vec();
    let auth = ClientFrame::Auth(Auth {
        version: PROTOCOL_VERSION,
        device,
        nonce: AUTH_NONCE,
        hub_url: AUTH_HUB_URL.to_string(),
        expires_at_ms: AUTH_EXPIRES_AT_MS,
        signature,
    });
    let topic = TopicId::from("topic");
    let mut publish = Publish {
        topic: TopicId::writer_bound(&key.verifying_key().to_bytes()),
        publish_id: PublishId([3; 32]),
        class: RetentionClass::Log,
        expected_head: ExpectedHead::Seq(4),
        replay_only: false,
        retention_secs: Some(60),
        payload: vec![1, 2, 3],
        writer: None,
    };
    publish.sign_writer(&key);
    let requests = [
        ("publish", Request::Publish(publish)),
        (
            "fetch",
            Request::Fetch {
                topic: topic.clone(),
                after: 2,
                limit: 100,
            },
        ),
        (
            "subscribe",
            Request::Subscribe {
                topic: TopicId::mailbox(&device),
                retention_secs: None,
            },
        ),
        (
            "ack",
            Request::Ack {
                frames: vec![FrameRef {
                    topic: topic.clone(),
                    seq: 9,
                }],
            },
        ),
        (
            "upload",
            Request::UploadKeyPackages {
                packages: vec![vec![1; 40]],
                last_resort: Some(vec![2; 40]),
            },
        ),
        (
            "subscriptions",
            Request::Subscriptions {
                changes: vec![
                    SubscriptionChange::Subscribe {
                        topic: topic.clone(),
                        retention_secs: Some(5),
                    },
                    SubscriptionChange::Unsubscribe {
                        topic: topic.clone(),
                    },
                ],
            },
        ),
        ("claim", Request::ClaimKeyPackage { device }),
        ("receive", Request::Receive),
    ];
    add("wire_client_frame", "auth", auth.encode());
    add(
        "auth_exchange",
        "answer",
        [&[0][..], &auth.encode()].concat(),
    );
    for (name, op) in requests {
        add(
            "wire_client_frame",
            name,
            ClientFrame::Request { id: 7, op }.encode(),
        );
    }
    let challenge = ServerFrame::Challenge(Challenge {
        min_version: MIN_PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        nonce: AUTH_NONCE,
        hub_url: AUTH_HUB_URL.to_string(),
        expires_at_ms: AUTH_EXPIRES_AT_MS,
    });
    add(
        "auth_exchange",
        "challenge",
        [&[1][..], &challenge.encode()].concat(),
    );
    let delivery = Delivery {
        topic: topic.clone(),
        seq: 4,
        class: RetentionClass::Mailbox,
        sender: device,
        publish_id: PublishId([5; 32]),
        published_at_ms: 17,
        payload: vec![9; 20],
    };
    let frames = [
        ("challenge", challenge),
        (
            "auth-ok",
            ServerFrame::AuthOk(AuthOk {
                device,
                version: PROTOCOL_VERSION,
                server_time_ms: 5,
                max_payload: 1 << 20,
                store_id: StoreId([1; 16]),
            }),
        ),
        (
            "published",
            ServerFrame::Response {
                id: 7,
                result: Ok(Response::Published(PublishOutcome::Accepted {
                    seq: 3,
                    head: Some(3),
                })),
            },
        ),
        (
            "fetched",
            ServerFrame::Response {
                id: 8,
                result: Ok(Response::Fetched(FetchResult {
                    messages: vec![LogFrame {
                        seq: 1,
                        sender: device,
                        publish_id: PublishId([6; 32]),
                        published_at_ms: 3,
                        payload: vec![1, 2],
                    }],
                    head: Some(1),
                    oldest: Some(1),
                    gap: false,
                })),
            },
        ),
        (
            "changed",
            ServerFrame::Response {
                id: 9,
                result: Ok(Response::SubscriptionsChanged {
                    outcomes: vec![
                        ChangeOutcome::Subscribed,
                        ChangeOutcome::Refused(HubError::NotAuthorized),
                    ],
                }),
            },
        ),
        (
            "rate-limited",
            ServerFrame::Response {
                id: 10,
                result: Err(HubError::RateLimited {
                    scope: "device".into(),
                    retry_after_ms: 30,
                }),
            },
        ),
        ("deliver", ServerFrame::Deliver(delivery)),
        (
            "missed",
            ServerFrame::Error(HubError::FramesMissed {
                topic,
                after_seq: 1,
                through_seq: 4,
            }),
        ),
        (
            "replaced",
            ServerFrame::ReceiveEnded(HubError::ReceiveReplaced),
        ),
    ];
    for (name, f) in frames {
        add("wire_server_frame", name, f.encode());
    }
}
