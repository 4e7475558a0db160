//! The hub's log checked against a plain model: publish (with idempotency,
//! compare-and-set, depth trims, the publisher's stored-bytes quota and
//! another device's mailbox), retention purges, fetches, flushes and
//! crashes, in random orders.

use super::core::HubCore;
use super::limits::Limits;
use super::store::{Generation, HubStore, HubTxn, KvHubStore, StoreError};
use crate::clock::Clock;
use crate::kv::{Entries, KvStore, MemKv};
use crate::wire::{
    DeviceId, ExpectedHead, FetchResult, HubError, Publish, PublishId, PublishOutcome,
    RetentionClass, TopicId,
};
use futures::future::BoxFuture;
use futures::FutureExt;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const DEPTH: u64 = 6;
/// The publisher's stored-bytes quota: about ten of the model's frames, so
/// the three log topics (18 frames deep in all) run into it.
const QUOTA: u64 = 20;
/// Topic index 3 is the mailbox of another device.
const MAILBOX: u8 = 3;
const OWNER: DeviceId = DeviceId([2; 32]);

fn topic_id(topic: u8) -> TopicId {
    if topic == MAILBOX {
        TopicId::mailbox(&OWNER)
    } else {
        TopicId(vec![b't', topic])
    }
}

/// (frames as (seq, payload), head, oldest, gap)
type FetchView = (Vec<(u64, Vec<u8>)>, Option<u64>, Option<u64>, bool);

#[derive(Clone, Debug)]
enum Op {
    Publish {
        topic: u8,
        pid: u8,
        payload: u8,
        cond: u8,
        cond_seq: u64,
        replay: bool,
        mailbox: bool,
        retention: Option<u64>,
    },
    Advance(u64),
    Purge,
    Fetch {
        topic: u8,
        after: u64,
        limit: u32,
    },
    Flush,
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 0u8..16, 0u8..3, 0u8..4, 0u64..20, prop::bool::weighted(0.1), prop::bool::weighted(0.15), prop::option::of(1u64..4))
            .prop_map(|(topic, pid, payload, cond, cond_seq, replay, mailbox, retention)| Op::Publish {
                topic, pid, payload, cond, cond_seq, replay, mailbox, retention
            }),
        1 => (0u64..3).prop_map(Op::Advance),
        1 => Just(Op::Purge),
        2 => (0u8..4, 0u64..20, 1u32..8).prop_map(|(topic, after, limit)| Op::Fetch { topic, after, limit }),
        1 => Just(Op::Flush),
        1 => Just(Op::Crash),
    ]
}

#[derive(Clone, Debug, Default)]
struct TopicModel {
    last_seq: u64,
    head: Option<u64>,
    frames: BTreeMap<u64, (Vec<u8>, u64)>,
    removed_through: u64,
    /// Mailbox frames held for the mailbox's owner (who never reads here),
    /// with their expiry.
    held: BTreeMap<u64, (Vec<u8>, u64)>,
}

#[derive(Clone, Debug, Default)]
struct Model {
    topics: HashMap<u8, TopicModel>,
    records: HashMap<(u8, u8), (u64, bool, Vec<u8>)>,
}

impl Model {
    #[allow(clippy::too_many_arguments)]
    fn publish(
        &mut self,
        topic: u8,
        pid: u8,
        payload: Vec<u8>,
        expected: ExpectedHead,
        replay: bool,
        mailbox: bool,
        expires: u64,
    ) -> Result<PublishOutcome, HubError> {
        if topic == MAILBOX && !mailbox {
            return Err(HubError::NotAuthorized);
        }
        if let Some((seq, mb, p)) = self.records.get(&(topic, pid)) {
            if *mb == mailbox && *p == payload {
                return Ok(PublishOutcome::Duplicate { seq: *seq });
            }
            return Err(HubError::Conflict { seq: *seq });
        }
        if replay {
            return Ok(PublishOutcome::HistoryMissing);
        }
        let t = self.topics.entry(topic).or_default();
        let ok = match expected {
            ExpectedHead::Unconditional => true,
            ExpectedHead::Empty => t.head.is_none(),
            ExpectedHead::Seq(s) => t.head == Some(s),
        };
        if !ok {
            return Ok(PublishOutcome::HeadMismatch { current: t.head });
        }
        // A log frame is kept, and a post into a device's mailbox is held
        // for its owner (nobody subscribes to the other topics here); the
        // quota is checked before this publish's own depth trim.
        let kept = !mailbox || topic == MAILBOX;
        let stored = self.stored_bytes();
        let adding = payload.len() as u64;
        if kept && stored + adding > QUOTA {
            return Err(HubError::StorageQuotaExceeded {
                stored,
                adding,
                max: QUOTA,
            });
        }
        let t = self.topics.entry(topic).or_default();
        t.last_seq += 1;
        let seq = t.last_seq;
        self.records
            .insert((topic, pid), (seq, mailbox, payload.clone()));
        if mailbox && kept {
            t.held.insert(seq, (payload, expires));
        } else if !mailbox {
            t.frames.insert(seq, (payload, expires));
            t.head = Some(seq);
            while t.frames.len() as u64 > DEPTH {
                if let Some((s, _)) = t.frames.pop_first() {
                    t.removed_through = s;
                }
            }
        }
        Ok(PublishOutcome::Accepted { seq, head: t.head })
    }

    fn purge(&mut self, now: u64) {
        for t in self.topics.values_mut() {
            while let Some((&s, (_, exp))) = t.frames.first_key_value() {
                if *exp > now {
                    break;
                }
                t.frames.remove(&s);
                t.removed_through = s;
            }
            t.held.retain(|_, (_, exp)| *exp > now);
        }
    }

    /// Payload bytes of the frames kept: the publisher's stored bytes.
    fn stored_bytes(&self) -> u64 {
        self.topics
            .values()
            .flat_map(|t| t.frames.values().chain(t.held.values()))
            .map(|(p, _)| p.len() as u64)
            .sum()
    }

    fn fetch(&self, topic: u8, after: u64, limit: u32) -> Result<FetchView, HubError> {
        if topic == MAILBOX {
            return Err(HubError::NotAuthorized);
        }
        let t = self.topics.get(&topic).cloned().unwrap_or_default();
        let msgs = t
            .frames
            .range(after + 1..)
            .take(limit as usize)
            .map(|(s, (p, _))| (*s, p.clone()))
            .collect();
        Ok((
            msgs,
            t.head,
            t.frames.keys().next().copied(),
            t.removed_through > after,
        ))
    }
}

fn view(f: &FetchResult) -> FetchView {
    (
        f.messages
            .iter()
            .map(|m| (m.seq, m.payload.clone()))
            .collect(),
        f.head,
        f.oldest,
        f.gap,
    )
}

/// A store whose every third transaction loses at commit (writing nothing),
/// as transactions on a store shared by several hub processes may: the core
/// must run the call again and answer exactly as if it had not conflicted.
struct Conflicting {
    inner: Arc<KvHubStore>,
    begun: AtomicU64,
    /// Every transaction conflicts (the retries run out).
    always: bool,
}

struct ConflictingTxn {
    inner: Box<dyn HubTxn>,
    conflict: bool,
}

impl HubTxn for ConflictingTxn {
    fn get<'a>(&'a mut self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        self.inner.get(key)
    }
    fn get_many<'a>(
        &'a mut self,
        keys: &'a [Vec<u8>],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
        self.inner.get_many(keys)
    }
    fn range<'a>(
        &'a mut self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>> {
        self.inner.range(start, end, limit)
    }
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.inner.put(key, value)
    }
    fn delete(&mut self, key: Vec<u8>) {
        self.inner.delete(key)
    }
    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<Generation, StoreError>> {
        if self.conflict {
            // Dropped uncommitted: nothing of it is written.
            drop(self.inner);
            return futures::future::ready(Err(StoreError::Conflict)).boxed();
        }
        self.inner.commit()
    }
}

impl HubStore for Conflicting {
    fn store_id(&self) -> crate::wire::StoreId {
        self.inner.store_id()
    }
    fn begin(&self) -> BoxFuture<'_, Result<Box<dyn HubTxn>, StoreError>> {
        async move {
            let inner = self.inner.begin().await?;
            let n = self.begun.fetch_add(1, Ordering::Relaxed);
            let txn: Box<dyn HubTxn> = Box::new(ConflictingTxn {
                inner,
                conflict: self.always || n.is_multiple_of(3),
            });
            Ok(txn)
        }
        .boxed()
    }
    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        self.inner.get(key)
    }
    fn range<'a>(
        &'a self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>> {
        self.inner.range(start, end, limit)
    }
    fn durable(&self, gen: Generation) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.durable(gen)
    }
    fn background(&self) -> BoxFuture<'static, ()> {
        self.inner.background()
    }
    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.close()
    }
    fn flushes(&self) -> u64 {
        self.inner.flushes()
    }
}

/// A core over `kv` whose clock starts at `origin`, over a [`Conflicting`]
/// store when `conflicts` says so (`Some(always)`).
fn new_core_on(
    kv: &MemKv,
    origin: u64,
    conflicts: Option<bool>,
) -> (Arc<HubCore>, tokio::task::JoinHandle<()>) {
    let limits = model_limits();
    let rng = crate::rng::SharedRng::seeded(origin);
    let store = KvHubStore::open(Arc::new(kv.clone()), &rng).expect("a MemKv store opens");
    let flusher = tokio::spawn(store.background());
    let store: Arc<dyn HubStore> = match conflicts {
        None => store,
        Some(always) => Arc::new(Conflicting {
            inner: store,
            begun: AtomicU64::new(0),
            always,
        }),
    };
    let core = HubCore::open(store, limits, Clock::tokio(origin));
    (core, flusher)
}

/// The limits of every model run: a shallow log and a small quota, so
/// trims and refusals happen.
fn model_limits() -> Limits {
    Limits {
        max_log_depth: DEPTH,
        max_stored_bytes: QUOTA,
        ..Limits::unthrottled()
    }
}

/// Where a model run keeps the hub's data.
enum Backing {
    /// In memory with crash semantics (a crash loses what was not
    /// flushed); `Some(always)` puts a [`Conflicting`] store in between.
    Mem(MemKv, Option<bool>),
    /// A PostgreSQL database: every commit is durable when it answers, so
    /// a crash (dropping the core and opening the store again) loses
    /// nothing.
    Postgres(String),
}

/// A core over `backing` whose clock starts at `origin`, and its store's
/// flusher task, if it has one.
async fn core_over(
    backing: &Backing,
    origin: u64,
) -> (Arc<HubCore>, Option<tokio::task::JoinHandle<()>>) {
    match backing {
        Backing::Mem(kv, conflicts) => {
            let (core, flusher) = new_core_on(kv, origin, *conflicts);
            (core, Some(flusher))
        }
        Backing::Postgres(url) => {
            let rng = crate::rng::SharedRng::seeded(origin);
            let options = super::PgOptions {
                pool_size: 2,
                ..Default::default()
            };
            let store = super::PgHubStore::open(url, &options, &rng)
                .await
                .expect("the test database opens");
            let core = HubCore::open(store, model_limits(), Clock::tokio(origin));
            (core, None)
        }
    }
}

fn run(ops: Vec<Op>) {
    run_on(ops, Backing::Mem(MemKv::new(), None))
}

/// [`run`] over another store: one that conflicts, or PostgreSQL.
fn run_on(ops: Vec<Op>, backing: Backing) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let origin = 1_000_000;
        let (mut core, mut flusher) = core_over(&backing, origin).await;
        let always_durable = matches!(backing, Backing::Postgres(_));
        let store_id = core.store_id();
        let mut clock_offset = 0u64; // ms advanced since the core's origin
        let mut model = Model::default();
        let mut durable = model.clone();
        let sender = DeviceId([1; 32]);
        for op in ops {
            let op_name = format!("{op:?}");
            match op {
                Op::Publish {
                    topic,
                    pid,
                    payload,
                    cond,
                    cond_seq,
                    replay,
                    mailbox,
                    retention,
                } => {
                    let head = model.topics.get(&topic).and_then(|t| t.head);
                    let expected = if mailbox {
                        ExpectedHead::Unconditional
                    } else {
                        match cond {
                            0 => ExpectedHead::Unconditional,
                            1 => ExpectedHead::Empty,
                            2 => head.map(ExpectedHead::Seq).unwrap_or(ExpectedHead::Empty),
                            _ => ExpectedHead::Seq(cond_seq),
                        }
                    };
                    // 1 to 3 bytes, so the quota sees different sizes.
                    let payload = vec![payload; payload as usize + 1];
                    let now = core.now_ms();
                    let ret_ms = retention.map(|s| s * 1000).unwrap_or(7 * 24 * 3600 * 1000);
                    let want = model.publish(
                        topic,
                        pid,
                        payload.clone(),
                        expected,
                        replay,
                        mailbox,
                        now + ret_ms,
                    );
                    let got = core
                        .publish(
                            sender,
                            Publish {
                                topic: topic_id(topic),
                                publish_id: PublishId([pid; 32]),
                                class: if mailbox {
                                    RetentionClass::Mailbox
                                } else {
                                    RetentionClass::Log
                                },
                                expected_head: expected,
                                replay_only: replay,
                                retention_secs: retention,
                                payload,
                                writer: None,
                            },
                        )
                        .await
                        .map(|d| d.value.outcome);
                    assert_eq!(got, want);
                }
                Op::Advance(secs) => {
                    tokio::time::advance(Duration::from_secs(secs)).await;
                    clock_offset += secs * 1000;
                }
                Op::Purge => {
                    let now = core.now_ms();
                    model.purge(now);
                    core.purge(None).await.unwrap();
                }
                Op::Fetch {
                    topic,
                    after,
                    limit,
                } => {
                    let got = core.fetch(sender, &topic_id(topic), after, limit).await;
                    assert_eq!(
                        got.as_ref().map(view).map_err(Clone::clone),
                        model.fetch(topic, after, limit),
                        "fetch t{topic} after {after}"
                    );
                    // A read waits until everything applied before it is
                    // durable; a refused one reads nothing and waits for nothing.
                    if got.is_ok() {
                        durable = model.clone();
                    }
                }
                Op::Flush => {
                    core.store().close().await.expect("MemKv flushes");
                    durable = model.clone();
                }
                Op::Crash => {
                    if let Some(f) = flusher.take() {
                        f.abort();
                    }
                    if let Backing::Mem(kv, _) = &backing {
                        kv.crash();
                    }
                    // The restarted hub's clock carries on where it was.
                    (core, flusher) = core_over(&backing, origin + clock_offset).await;
                    // Read back, not drawn again from the (other) seed.
                    assert_eq!(core.store_id(), store_id, "a crash keeps the identity");
                    tokio::time::advance(Duration::ZERO).await;
                    model = durable.clone();
                }
            }
            if always_durable {
                durable = model.clone();
            }
            // The usage record moves in the same batches as the frames.
            assert_eq!(
                core.usage(sender).await.unwrap().stored_bytes,
                model.stored_bytes(),
                "stored bytes after {op_name}"
            );
        }
        // Fetch resolved every read durably, so the store holds no batch the
        // model does not know about.
        if let Backing::Mem(kv, _) = &backing {
            let _ = kv.unflushed_batches();
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn hub_log_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops);
    }

    /// Every third transaction conflicts: each call runs again, and the hub
    /// still answers exactly what the model says (nothing doubled, nothing
    /// half-written).
    #[test]
    fn hub_log_matches_model_when_transactions_conflict(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        run_on(ops, Backing::Mem(MemKv::new(), Some(false)));
    }
}

proptest! {
    // Each case is a fresh database on the test process's own PostgreSQL
    // server: fewer cases than in memory, each one real.
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// The same model, over the PostgreSQL store: what it answers, keeps,
    /// trims and refuses is what the model says, across crashes (a crash
    /// is a new core on the same database).
    #[test]
    fn hub_log_on_postgres_matches_model(ops in proptest::collection::vec(op(), 1..60)) {
        let url = tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(async {
                crate::testkit::TestPostgres::shared()
                    .expect("the test PostgreSQL starts")
                    .database()
                    .await
            })
            .expect("a test database");
        run_on(ops, Backing::Postgres(url));
    }
}

/// A store on which every transaction conflicts: after its retries the call
/// is refused as `Internal`, and nothing was written.
#[test]
fn conflicts_without_end_are_refused_and_write_nothing() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let kv = MemKv::new();
        let (core, flusher) = new_core_on(&kv, 1_000_000, Some(true));
        let before = kv.range(&[], None, usize::MAX).unwrap();
        let got = core
            .publish(
                DeviceId([1; 32]),
                Publish {
                    topic: topic_id(0),
                    publish_id: PublishId([7; 32]),
                    payload: vec![1],
                    class: RetentionClass::Log,
                    expected_head: ExpectedHead::Empty,
                    replay_only: false,
                    retention_secs: None,
                    writer: None,
                },
            )
            .await;
        assert!(
            matches!(got, Err(HubError::Internal { .. })),
            "an endless conflict is refused: {got:?}"
        );
        assert_eq!(kv.range(&[], None, usize::MAX).unwrap(), before);
        assert_eq!(
            core.counters.conflict_retries.load(Ordering::Relaxed),
            u64::from(super::core::MAX_CONFLICT_RETRIES)
        );
        flusher.abort();
    });
}

/// Sixteen devices, spread over `cores` (hub processes over one store),
/// publish at once on an empty topic, each expecting it empty; answers how
/// many were accepted (checking every other answer is the head they lost
/// to). The store's isolation must make it exactly one.
pub(super) async fn race_compare_and_set(cores: &[Arc<HubCore>]) -> usize {
    let mut racers = Vec::new();
    for i in 0..16u8 {
        let core = cores[usize::from(i) % cores.len()].clone();
        racers.push(tokio::spawn(async move {
            let p = Publish {
                topic: topic_id(0),
                publish_id: PublishId([i; 32]),
                payload: vec![i],
                class: RetentionClass::Log,
                expected_head: ExpectedHead::Empty,
                replay_only: false,
                retention_secs: None,
                writer: None,
            };
            let d = core.publish(DeviceId([i + 1; 32]), p).await.unwrap();
            core.durable(d.gen).await.unwrap();
            d.value.outcome
        }));
    }
    let mut accepted = 0;
    for r in racers {
        match r.await.unwrap() {
            PublishOutcome::Accepted { seq, .. } => {
                assert_eq!(seq, 1);
                accepted += 1;
            }
            PublishOutcome::HeadMismatch { current } => assert_eq!(current, Some(1)),
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    accepted
}

/// Two cores over one store (two hub processes over one database, in
/// miniature) race a compare-and-set on the same head: the store's
/// isolation lets exactly one win.
#[test]
fn two_cores_over_one_store_let_exactly_one_compare_and_set_win() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let kv = MemKv::new();
        let store = KvHubStore::open(Arc::new(kv.clone()), &crate::rng::SharedRng::seeded(5))
            .expect("a MemKv store opens");
        let flusher = tokio::spawn(store.background());
        let cores: Vec<Arc<HubCore>> = (0..2)
            .map(|_| HubCore::open(store.clone(), Limits::unthrottled(), Clock::System))
            .collect();
        let accepted = race_compare_and_set(&cores).await;
        assert_eq!(accepted, 1, "exactly one compare-and-set wins");
        flusher.abort();
    });
}

#[test]
fn store_is_only_touched_through_the_trait() {
    // A reminder the model test relies on: MemKv is a KvStore.
    fn takes(_: &dyn KvStore) {}
    takes(&MemKv::new());
}

fn publish(pid: u8, retention: Option<u64>) -> Op {
    Op::Publish {
        topic: 0,
        pid,
        payload: 0,
        cond: 0,
        cond_seq: 0,
        replay: false,
        mailbox: false,
        retention,
    }
}

/// Shrunk from a model failure: a read makes every earlier write durable, so
/// a crash after it must not forget an accepted publish.
#[test]
fn regression_read_then_crash_keeps_what_was_read() {
    run(vec![
        publish(0, None),
        Op::Fetch {
            topic: 0,
            after: 0,
            limit: 1,
        },
        Op::Crash,
        publish(0, None),
    ]);
}

/// Shrunk from a model failure: an expired frame held back by an older
/// long-lived one must go at the first purge after a depth trim removes
/// that older frame.
#[test]
fn regression_expired_frame_behind_a_depth_trim_is_purged() {
    let mut ops = vec![
        publish(0, None),
        publish(3, Some(1)),
        Op::Advance(1),
        Op::Purge,
    ];
    ops.extend((4..9).map(|p| publish(p, None)));
    ops.push(Op::Purge);
    ops.push(Op::Fetch {
        topic: 0,
        after: 0,
        limit: 7,
    });
    run(ops);
}

/// Shrunk from a model failure: a fetch refused as `NotAuthorized` (another
/// device's mailbox) reads nothing, so it makes nothing durable, and a crash
/// after it takes back the publish before it.
#[test]
fn regression_a_refused_fetch_makes_nothing_durable() {
    run(vec![
        publish(0, None),
        Op::Fetch {
            topic: MAILBOX,
            after: 0,
            limit: 1,
        },
        Op::Crash,
    ]);
}

fn sized(topic: u8, pid: u8, retention: Option<u64>) -> Op {
    Op::Publish {
        topic,
        pid,
        payload: 2, // 3 bytes
        cond: 0,
        cond_seq: 0,
        replay: false,
        mailbox: false,
        retention,
    }
}

/// The publisher reaches its stored-bytes quota (6 frames of 3 bytes under
/// 20), is refused on a topic whose log is not even deep, and has room again
/// once a purge removes its expired frames; a post into another device's
/// mailbox is held for its owner (and counts against the poster's quota:
/// `run` compares the stored bytes after every step), and a log publish
/// there is refused.
#[test]
fn quota_refuses_until_frames_go_and_a_mailbox_takes_no_log() {
    let mut ops: Vec<Op> = (0..6).map(|i| sized(i % 2, i, Some(1))).collect();
    ops.push(sized(2, 6, None)); // 21 > 20: refused
    ops.push(Op::Advance(1));
    ops.push(Op::Purge);
    ops.push(sized(2, 6, None)); // accepted now
    ops.push(sized(MAILBOX, 7, None)); // a log on a mailbox: refused
    let mut post = sized(MAILBOX, 8, None);
    if let Op::Publish { mailbox, .. } = &mut post {
        *mailbox = true;
    }
    ops.push(post);
    ops.push(Op::Flush);
    ops.push(Op::Crash);
    let mut model = Model::default();
    let mut refusals = Vec::new();
    for op in &ops {
        if let Op::Publish {
            topic,
            pid,
            payload,
            mailbox,
            retention,
            ..
        } = op
        {
            if let Err(e) = model.publish(
                *topic,
                *pid,
                vec![*payload; *payload as usize + 1],
                ExpectedHead::Unconditional,
                false,
                *mailbox,
                if retention.is_some() { 1 } else { u64::MAX },
            ) {
                refusals.push(e);
            }
        }
        if let Op::Purge = op {
            model.purge(1);
        }
    }
    // The scenario does what its name says (the model agrees with the hub
    // in `run`, which checks every answer).
    assert_eq!(
        refusals,
        vec![
            HubError::StorageQuotaExceeded {
                stored: 18,
                adding: 3,
                max: QUOTA
            },
            HubError::NotAuthorized
        ]
    );
    run(ops);
}
