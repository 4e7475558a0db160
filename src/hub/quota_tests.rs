//! The per-device usage records checked against the store itself: after any
//! mix of subscribes, publishes (log and mailbox, some into a full queue),
//! reads, acks, depth trims, retention purges and crashes, each device's
//! `queued` is the number of its delivery records and its `stored_bytes`
//! the payload bytes of the frames it published that are still stored.

use super::core::HubCore;
use super::layout::{self as l, StoredFrame};
use super::limits::Limits;
use super::store::{HubStore, KvHubStore};
use crate::clock::Clock;
use crate::kv::{KvStore, MemKv};
use crate::wire::{DeviceId, ExpectedHead, Publish, PublishId, RetentionClass, TopicId};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

const DEVICES: u8 = 4;
const QUEUE: u64 = 3;

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
        max_queued_deliveries: QUEUE,
        max_stored_bytes: 60,
        ..Limits::unthrottled()
    };
    let rng = crate::rng::SharedRng::seeded(origin);
    let store = KvHubStore::open(Arc::new(kv.clone()), &rng).expect("a MemKv store opens");
    let flusher = tokio::spawn(store.background());
    let core = HubCore::open(store, limits, Clock::tokio(origin));
    (core, flusher)
}

/// What the store holds, counted from its records.
fn counted(kv: &MemKv) -> (HashMap<DeviceId, u64>, HashMap<DeviceId, u64>) {
    let mut queued = HashMap::new();
    let mut bytes = HashMap::new();
    for n in 0..DEVICES {
        let rows = kv
            .scan_prefix(&l::delivery_prefix(&dev(n)), usize::MAX)
            .unwrap();
        queued.insert(dev(n), rows.len() as u64);
    }
    for prefix in l::frame_prefixes() {
        for (k, v) in kv.scan_prefix(&prefix, usize::MAX).unwrap() {
            let f: StoredFrame = l::decode(&k, &v).unwrap();
            *bytes.entry(f.sender).or_insert(0) += f.payload.len() as u64;
        }
    }
    (queued, bytes)
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
                Op::Read { device } => {
                    core.deliveries(dev(device), 0, 100).await.unwrap();
                }
                Op::AckAll { device } => {
                    let page = core.deliveries(dev(device), 0, 100).await.unwrap();
                    let ids: Vec<u64> = page.deliveries.iter().map(|d| d.id).collect();
                    core.ack(dev(device), &ids).await.unwrap();
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
            let (queued, bytes) = counted(&kv);
            for n in 0..DEVICES {
                let u = core.usage(dev(n)).await.unwrap();
                assert_eq!(u.queued, queued[&dev(n)], "queued of {n} after {op:?}");
                assert!(u.queued <= QUEUE, "over the queue quota after {op:?}");
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

/// A subscriber that never reads holds exactly its quota; the rest is
/// dropped, counted for the notice, and its queue takes new deliveries
/// once it acks.
#[test]
fn a_full_queue_drops_new_deliveries_until_acked() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let kv = MemKv::new();
        let (core, _flusher) = open(&kv, 1_000_000);
        let t = TopicId::from("t");
        core.subscribe(dev(1), &t, None).await.unwrap();
        for i in 0..(QUEUE + 4) {
            let p = core
                .publish(
                    dev(0),
                    Publish {
                        topic: t.clone(),
                        publish_id: PublishId([i as u8; 32]),
                        class: RetentionClass::Mailbox,
                        expected_head: ExpectedHead::Unconditional,
                        replay_only: false,
                        retention_secs: None,
                        payload: vec![1],
                        writer: None,
                    },
                )
                .await
                .unwrap();
            if i < QUEUE {
                assert_eq!(p.value.recipients, vec![dev(1)]);
            } else {
                assert_eq!(p.value.dropped_for, vec![dev(1)]);
                assert!(p.value.recipients.is_empty());
            }
        }
        // A mailbox frame nobody received was not stored.
        assert_eq!(counted(&kv).1[&dev(0)], QUEUE);
        let page = core.deliveries(dev(1), 0, 100).await.unwrap();
        assert_eq!(page.deliveries.len() as u64, QUEUE);
        assert_eq!(page.dropped, Some((QUEUE, 4)));
        core.clear_dropped(dev(1), 4).await.unwrap();
        let ids: Vec<u64> = page.deliveries.iter().map(|d| d.id).collect();
        core.ack(dev(1), &ids).await.unwrap();
        let u = core.usage(dev(1)).await.unwrap();
        assert_eq!((u.queued, u.dropped), (0, 0));
        assert_eq!(core.usage(dev(0)).await.unwrap().stored_bytes, 0);
    });
}
