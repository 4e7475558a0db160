//! The per-device usage records checked against the store itself: after any
//! mix of subscribes, publishes (log and mailbox, some into a full device
//! mailbox), reads, cursor saves, depth trims, retention purges and
//! crashes, each device's `mailbox_frames` is the number of frames its own
//! mailbox holds and its `stored_bytes` the payload bytes of the frames it
//! published that are still stored.

use super::core::HubCore;
use super::layout::{self as l, StoredFrame};
use super::limits::Limits;
use super::store::{HubStore, KvHubStore};
use crate::clock::Clock;
use crate::kv::{KvStore, MemKv};
use crate::wire::{DeviceId, ExpectedHead, HubError, Publish, PublishId, RetentionClass, TopicId};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

const DEVICES: u8 = 4;
const MAILBOX: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    Subscribe {
        device: u8,
        topic: u8,
    },
    Publish {
        device: u8,
        topic: u8,
        mailbox: bool,
        len: u8,
        short: bool,
    },
    /// A post to another device's own mailbox.
    Post {
        device: u8,
        to: u8,
        len: u8,
        short: bool,
    },
    Read {
        device: u8,
    },
    AckAll {
        device: u8,
    },
    Advance(u64),
    Purge,
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..DEVICES, 0u8..3).prop_map(|(device, topic)| Op::Subscribe { device, topic }),
        6 => (0..DEVICES, 0u8..3, any::<bool>(), 0u8..20, any::<bool>()).prop_map(
            |(device, topic, mailbox, len, short)| Op::Publish { device, topic, mailbox, len, short }
        ),
        3 => (0..DEVICES, 0..DEVICES, 0u8..20, any::<bool>()).prop_map(
            |(device, to, len, short)| Op::Post { device, to, len, short }
        ),
        1 => (0..DEVICES).prop_map(|device| Op::Read { device }),
        2 => (0..DEVICES).prop_map(|device| Op::AckAll { device }),
        1 => (1u64..3).prop_map(Op::Advance),
        1 => Just(Op::Purge),
        1 => Just(Op::Crash),
    ]
}

fn dev(n: u8) -> DeviceId {
    DeviceId([n + 1; 32])
}

fn open(kv: &MemKv, origin: u64) -> (Arc<HubCore>, tokio::task::JoinHandle<()>) {
    let limits = Limits {
        max_log_depth: 4,
        max_mailbox_frames: MAILBOX,
        max_stored_bytes: 60,
        ..Limits::unthrottled()
    };
    let rng = crate::rng::SharedRng::seeded(origin);
    let store = KvHubStore::open(Arc::new(kv.clone()), &rng).expect("a MemKv store opens");
    let flusher = tokio::spawn(store.background());
    let core = HubCore::open(store, limits, Clock::tokio(origin));
    (core, flusher)
}

/// What the store holds, counted from its records: frames in each
/// device's own mailbox, and bytes stored per sender.
fn counted(kv: &MemKv) -> (HashMap<DeviceId, u64>, HashMap<DeviceId, u64>) {
    let mut mailbox = HashMap::new();
    let mut bytes = HashMap::new();
    for prefix in l::frame_prefixes() {
        for (k, v) in kv.scan_prefix(&prefix, usize::MAX).unwrap() {
            let f: StoredFrame = l::decode(&k, &v).unwrap();
            *bytes.entry(f.sender).or_insert(0) += f.payload.len() as u64;
            if let Some(owner) = l::parse_frame_key(&k).and_then(|(t, _)| t.mailbox_owner()) {
                *mailbox.entry(owner).or_insert(0) += 1;
            }
        }
    }
    (mailbox, bytes)
}

/// Read `device`'s stream through the store: every frame after each
/// cursor, as a pump would. Answers the cursors reading moved to.
async fn read_stream(core: &HubCore, device: DeviceId) -> Vec<(TopicId, u64)> {
    let mut moved = Vec::new();
    for start in core.stream_start(device).await.unwrap() {
        let mut after = start.cursor;
        while after < start.durable_through {
            let page = core
                .stream_page(
                    device,
                    &start.topic,
                    after,
                    start.durable_through,
                    start.max_age_ms,
                    2,
                )
                .await
                .unwrap();
            assert!(page.scanned_through > after, "a page always moves on");
            after = page.scanned_through;
        }
        moved.push((start.topic, after));
    }
    moved
}

fn run(ops: Vec<Op>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let kv = MemKv::new();
        let origin = 1_000_000;
        let mut offset = 0;
        let (mut core, mut flusher) = open(&kv, origin);
        for (i, op) in ops.into_iter().enumerate() {
            match op.clone() {
                Op::Subscribe { device, topic } => {
                    let _ = core
                        .subscribe(dev(device), &TopicId(vec![topic]), None)
                        .await;
                }
                Op::Publish {
                    device,
                    topic,
                    mailbox,
                    len,
                    short,
                } => {
                    let _ = core
                        .publish(
                            dev(device),
                            Publish {
                                topic: TopicId(vec![topic]),
                                publish_id: PublishId([i as u8; 32]),
                                class: if mailbox {
                                    RetentionClass::Mailbox
                                } else {
                                    RetentionClass::Log
                                },
                                expected_head: ExpectedHead::Unconditional,
                                replay_only: false,
                                retention_secs: Some(if short { 1 } else { 3600 }),
                                payload: vec![7; len as usize],
                                writer: None,
                            },
                        )
                        .await;
                }
                Op::Post {
                    device,
                    to,
                    len,
                    short,
                } => {
                    let _ = core
                        .publish(
                            dev(device),
                            Publish {
                                topic: TopicId::mailbox(&dev(to)),
                                publish_id: PublishId([i as u8; 32]),
                                class: RetentionClass::Mailbox,
                                expected_head: ExpectedHead::Unconditional,
                                replay_only: false,
                                retention_secs: Some(if short { 1 } else { 3600 }),
                                payload: vec![7; len as usize],
                                writer: None,
                            },
                        )
                        .await;
                }
                Op::Read { device } => {
                    read_stream(&core, dev(device)).await;
                }
                Op::AckAll { device } => {
                    let moved = read_stream(&core, dev(device)).await;
                    core.save_cursors(dev(device), &moved).await.unwrap();
                }
                Op::Advance(secs) => {
                    tokio::time::advance(Duration::from_secs(secs)).await;
                    offset += secs * 1000;
                }
                Op::Purge => {
                    core.purge(None).await.unwrap();
                }
                Op::Crash => {
                    flusher.abort();
                    kv.crash();
                    (core, flusher) = open(&kv, origin + offset);
                    tokio::time::advance(Duration::ZERO).await;
                }
            }
            let (mailbox, bytes) = counted(&kv);
            for n in 0..DEVICES {
                let u = core.usage(dev(n)).await.unwrap();
                assert_eq!(
                    u.mailbox_frames,
                    mailbox.get(&dev(n)).copied().unwrap_or(0),
                    "mailbox frames of {n} after {op:?}"
                );
                assert!(
                    u.mailbox_frames <= MAILBOX,
                    "over the mailbox quota after {op:?}"
                );
                assert_eq!(
                    u.stored_bytes,
                    bytes.get(&dev(n)).copied().unwrap_or(0),
                    "stored bytes of {n} after {op:?}"
                );
            }
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]
    #[test]
    fn usage_matches_what_the_store_holds(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops);
    }
}

/// A device that never reads its mailbox holds exactly its quota there;
/// posts past it are refused with `MailboxFull` and store nothing, and the
/// mailbox takes posts again once the owner's cursor passed what it read.
#[test]
fn a_full_mailbox_refuses_posts_until_its_owner_reads() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let kv = MemKv::new();
        let (core, _flusher) = open(&kv, 1_000_000);
        let mailbox = TopicId::mailbox(&dev(1));
        let post = |i: u8| Publish {
            topic: mailbox.clone(),
            publish_id: PublishId([i; 32]),
            class: RetentionClass::Mailbox,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: None,
            payload: vec![1],
            writer: None,
        };
        for i in 0..MAILBOX as u8 {
            let p = core.publish(dev(0), post(i)).await.unwrap();
            assert_eq!(p.value.recipients, vec![dev(1)]);
        }
        for i in MAILBOX as u8..MAILBOX as u8 + 2 {
            assert_eq!(
                core.publish(dev(0), post(i)).await.unwrap_err(),
                HubError::MailboxFull { max: MAILBOX }
            );
        }
        assert_eq!(
            counted(&kv).1[&dev(0)],
            MAILBOX,
            "refused posts stored nothing"
        );
        // The owner reads its mailbox without ever subscribing to it.
        let starts = core.stream_start(dev(1)).await.unwrap();
        assert_eq!(starts.len(), 1);
        assert_eq!(
            (starts[0].topic.clone(), starts[0].cursor),
            (mailbox.clone(), 0)
        );
        let page = core
            .stream_page(
                dev(1),
                &mailbox,
                0,
                starts[0].durable_through,
                u64::MAX,
                100,
            )
            .await
            .unwrap();
        assert_eq!(page.frames.len() as u64, MAILBOX);
        core.save_cursors(dev(1), &[(mailbox.clone(), page.scanned_through)])
            .await
            .unwrap();
        assert_eq!(core.usage(dev(1)).await.unwrap().mailbox_frames, 0);
        assert_eq!(core.usage(dev(0)).await.unwrap().stored_bytes, 0);
        let again = core.publish(dev(0), post(100)).await.unwrap();
        assert_eq!(again.value.recipients, vec![dev(1)]);
        // A stranger cannot move the owner's cursor by saving its own.
        core.save_cursors(dev(2), &[(mailbox.clone(), 1000)])
            .await
            .unwrap();
        assert_eq!(core.usage(dev(1)).await.unwrap().mailbox_frames, 1);
    });
}
