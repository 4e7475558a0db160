//! Micro-benchmarks of three hot steps, each through the crate's own public
//! functions (nothing here re-implements what it measures):
//!
//! - `codec`: encoding and decoding the frames a hub and a device exchange
//!   most ([`ClientFrame::encode`] / [`ServerFrame::decode`] and back, the
//!   calls `client.rs` and `hub/server.rs` make).
//! - `hub_publish`: [`HubCore::publish`] of 1 KiB compare-and-set log frames
//!   to one topic followed by 0, 10 or 100 subscribers, over `MemKv` and
//!   over sled (each through a `KvHubStore`: one transaction per publish),
//!   without the flush (and, as a separate variant on sled, with
//!   one flush per publish).
//! - `device_storage`: applying the storage batch a device writes when it
//!   merges a received MLS commit, on sled, with and without the flush.
//!
//! Run with `cargo bench --bench micro`; the figures and what they say are
//! in `docs/micro-benchmarks.md`. Setup lines on stderr (prefixed `setup:`)
//! give the sizes of what is measured.

use criterion::{
    criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use ed25519_dalek::SigningKey;
use hubsync::clock::Clock;
use hubsync::device::identity::DeviceIdentity;
use hubsync::device::ledger::GroupExt;
use hubsync::device::mls;
use hubsync::device::provider::{DeviceProvider, StagedProvider};
use hubsync::device::storage::DeviceStorage;
use hubsync::hub::{Durable, HubCore, KvHubStore, Limits, Published};
use hubsync::kv::{KvStore, MemKv, SledKv, WriteBatch};
use hubsync::rng::SharedRng;
use hubsync::wire::{
    ClientFrame, Delivery, DeviceId, ExpectedHead, Publish, PublishId, PublishOutcome, Request,
    Response, RetentionClass, ServerFrame, TopicId,
};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::{
    KeyPackage, LeafNodeParameters, Lifetime, MlsGroup, MlsMessageBodyIn, MlsMessageIn,
    ProcessedMessageContent, StagedWelcome,
};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tempfile::TempDir;

/// The payload size of every publish and delivery measured here.
const PAYLOAD: usize = 1024;

/// Members of the MLS group whose commit merge the storage bench writes: a
/// small family or team group.
const GROUP_MEMBERS: u64 = 8;

/// The publisher of every measured publish; never one of the subscribers,
/// so each subscriber gets a delivery.
const SENDER: DeviceId = DeviceId([0xEE; 32]);

fn payload() -> Vec<u8> {
    // Not all one byte, so nothing downstream can get cheaper on a
    // degenerate payload.
    (0..PAYLOAD).map(|i| (i % 251) as u8).collect()
}

/// A writer key and the writer-bound topic it owns: group commit and app
/// topics have this form, so the hub checks an ed25519 signature on every
/// publish to them.
fn writer() -> (SigningKey, TopicId) {
    let key = SigningKey::from_bytes(&[7; 32]);
    let topic = TopicId::writer_bound(&key.verifying_key().to_bytes());
    (key, topic)
}

/// The `n`-th publish of a fresh topic: a log frame whose compare-and-set
/// names the head the previous one made (none before the first), signed
/// when `key` is given.
fn log_publish(topic: &TopicId, key: Option<&SigningKey>, n: u64, body: &[u8]) -> Publish {
    let mut id = [0u8; 32];
    id[..8].copy_from_slice(&n.to_be_bytes());
    let mut p = Publish {
        topic: topic.clone(),
        publish_id: PublishId(id),
        class: RetentionClass::Log,
        expected_head: if n == 0 {
            ExpectedHead::Empty
        } else {
            ExpectedHead::Seq(n)
        },
        replay_only: false,
        retention_secs: None,
        payload: body.to_vec(),
        writer: None,
    };
    if let Some(key) = key {
        p.sign_writer(key);
    }
    p
}

// ---------------------------------------------------------------- codec

fn codec(c: &mut Criterion) {
    let (key, topic) = writer();
    // The hub and the client both bound decoding by the hub's frame limit.
    let max = Limits::default().max_frame();
    let body = payload();

    let client_publish = ClientFrame::Request {
        id: 41,
        op: Request::Publish(log_publish(&topic, Some(&key), 1_000, &body)),
    };
    let server_published = ServerFrame::Response {
        id: 41,
        result: Ok(Response::Published(PublishOutcome::Accepted {
            seq: 1_001,
            head: Some(1_001),
        })),
    };
    let server_deliver = ServerFrame::Deliver(Delivery {
        topic: topic.clone(),
        seq: 1_001,
        class: RetentionClass::Log,
        sender: SENDER,
        publish_id: PublishId([9; 32]),
        published_at_ms: 1_760_000_000_000,
        payload: body,
    });

    let mut g = c.benchmark_group("codec");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(50);

    let bytes = client_publish.encode();
    let back = ClientFrame::decode(&bytes, max).expect("a frame we encoded decodes");
    assert_eq!(back, client_publish, "the publish frame round-trips");
    eprintln!("setup: client publish frame = {} bytes", bytes.len());
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("encode/client_publish_1k", |b| {
        b.iter(|| black_box(&client_publish).encode())
    });
    g.bench_function("decode/client_publish_1k", |b| {
        b.iter(|| ClientFrame::decode(black_box(&bytes), max))
    });

    for (name, frame) in [
        ("server_published", &server_published),
        ("server_deliver_1k", &server_deliver),
    ] {
        let bytes = frame.encode();
        let back = ServerFrame::decode(&bytes, max).expect("a frame we encoded decodes");
        assert_eq!(&back, frame, "the {name} frame round-trips");
        eprintln!("setup: {name} frame = {} bytes", bytes.len());
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_function(format!("encode/{name}"), |b| {
            b.iter(|| black_box(frame).encode())
        });
        g.bench_function(format!("decode/{name}"), |b| {
            b.iter(|| ServerFrame::decode(black_box(&bytes), max))
        });
    }
    g.finish();
}

// ---------------------------------------------------------- hub publish

/// The writer-signature check alone, as the hub runs it first on every
/// publish to a writer-bound topic: what `hub_publish/mem/0` pays over
/// `hub_publish/mem_unsigned/0`, measured on its own.
fn writer_check(c: &mut Criterion) {
    let (key, topic) = writer();
    let publish = log_publish(&topic, Some(&key), 1_000, &payload());
    publish
        .check_writer()
        .expect("a publish signed by the topic's key passes");
    let mut g = c.benchmark_group("hub_checks");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(30)
        .throughput(Throughput::Elements(1));
    g.bench_function("check_writer/publish_1k", |b| {
        b.iter(|| black_box(&publish).check_writer())
    });
    g.finish();
}

#[derive(Clone, Copy)]
enum Store {
    Mem,
    Sled,
}

/// A fresh hub core over a fresh store, with `subscribers` devices on
/// `topic`. Fields drop in order: the core and store before the directory.
struct HubBed {
    core: Arc<HubCore>,
    kv: Arc<dyn KvStore>,
    _dir: Option<TempDir>,
}

fn subscriber(i: usize) -> DeviceId {
    let mut id = [0x5Au8; 32];
    id[..8].copy_from_slice(&(i as u64).to_be_bytes());
    DeviceId(id)
}

fn hub_bed(store: Store, subscribers: usize, topic: &TopicId) -> HubBed {
    let (kv, dir): (Arc<dyn KvStore>, Option<TempDir>) = match store {
        Store::Mem => (Arc::new(MemKv::new()), None),
        Store::Sled => {
            let dir = tempfile::tempdir().expect("a temporary directory for sled");
            let kv = SledKv::open(dir.path()).expect("sled opens in a fresh directory");
            (Arc::new(kv), Some(dir))
        }
    };
    // No rate or quota may refuse or slow a publish here; and the log is
    // never trimmed, so every publish costs the same whatever the sample
    // length (trimming is a cost of its own, not measured here).
    let mut limits = Limits::unthrottled();
    limits.max_log_depth = u64::MAX;
    let store = KvHubStore::open(kv.clone(), &SharedRng::seeded(1))
        .expect("a hub store opens over a fresh key-value store");
    let core = HubCore::open(store, limits, Clock::System);
    let rt = runtime();
    for i in 0..subscribers {
        rt.block_on(core.subscribe(subscriber(i), topic, None))
            .expect("subscribing under unthrottled limits succeeds");
    }
    kv.flush().expect("the setup flushes");
    HubBed {
        core,
        kv,
        _dir: dir,
    }
}

/// How one measured publish ends.
#[derive(Clone, Copy)]
enum Then {
    /// Nothing: the flush is the group-commit task's, outside the step.
    Return,
    /// Flush the store, as the group commit does for a publish that arrives
    /// while no other is in flight.
    Flush,
}

/// Time `iters` publishes to a fresh topic on a fresh bed. Each sample gets
/// its own store so that every sample publishes into a store of the same
/// size (with flat sampling); the publishes are built and signed before the
/// clock starts.
fn run_publishes(
    store: Store,
    subscribers: usize,
    signed: bool,
    then: Then,
    iters: u64,
) -> Duration {
    let (key, writer_topic) = writer();
    let (key, topic) = if signed {
        (Some(&key), writer_topic)
    } else {
        (None, TopicId::from("bench/plain-topic"))
    };
    let body = payload();
    let bed = hub_bed(store, subscribers, &topic);
    let publishes: Vec<Publish> = (0..iters)
        .map(|n| log_publish(&topic, key, n, &body))
        .collect();
    // One runtime drives the whole timed loop, as a hub connection's task
    // drives its publishes one after another.
    let rt = runtime();
    let start = Instant::now();
    rt.block_on(async {
        for p in publishes {
            let done = bed.core.publish(SENDER, p).await;
            match &done {
                Ok(Durable {
                    value:
                        Published {
                            outcome: PublishOutcome::Accepted { .. },
                            recipients,
                            ..
                        },
                    ..
                }) if recipients.len() == subscribers => {}
                other => panic!("every measured publish must be accepted and delivered: {other:?}"),
            }
            if let Then::Flush = then {
                bed.kv.flush().expect("the store flushes");
            }
            black_box(done.ok());
        }
    });
    start.elapsed()
}

/// The single-threaded runtime a measured loop runs on (the hub core's
/// calls are async; nothing in them waits on another task here).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread tokio runtime builds")
}

fn hub_publish(c: &mut Criterion) {
    let mut g = c.benchmark_group("hub_publish");
    // Flat: every sample runs the same number of publishes on its own fresh
    // store, so no sample measures a bigger store than another.
    g.sampling_mode(SamplingMode::Flat)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(15)
        .throughput(Throughput::Elements(1));

    for (name, store) in [("mem", Store::Mem), ("sled", Store::Sled)] {
        for subs in [0usize, 10, 100] {
            g.bench_function(BenchmarkId::new(name, subs), |b| {
                b.iter_custom(|iters| run_publishes(store, subs, true, Then::Return, iters))
            });
        }
    }
    // The same publish to an ordinary topic: no writer signature to check,
    // so the difference from `mem/0` is the signature check.
    g.bench_function(BenchmarkId::new("mem_unsigned", 0), |b| {
        b.iter_custom(|iters| run_publishes(Store::Mem, 0, false, Then::Return, iters))
    });
    for subs in [0usize, 100] {
        g.bench_function(BenchmarkId::new("sled_flush", subs), |b| {
            b.iter_custom(|iters| run_publishes(Store::Sled, subs, true, Then::Flush, iters))
        });
    }
    g.finish();
}

// ------------------------------------------------------- device storage

/// One device with its own in-memory store, as the engine builds it: every
/// operation stages through a fresh overlay and applies it as one batch.
struct Member {
    kv: Arc<dyn KvStore>,
    me: DeviceIdentity,
    provider: DeviceProvider,
}

impl Member {
    fn new(seed: u64) -> Self {
        let kv: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let me = DeviceIdentity::from_signing_key(SigningKey::from_bytes(&[seed as u8; 32]));
        let provider = DeviceProvider::seeded(kv.clone(), seed);
        Self { kv, me, provider }
    }

    /// Run one operation and apply its batch; returns the result and the
    /// batch.
    fn op<T>(&self, f: impl FnOnce(&StagedProvider<'_>) -> T) -> (T, WriteBatch) {
        let p = self.provider.staged();
        let out = f(&p);
        let batch = p.into_batch();
        self.kv
            .apply(&batch)
            .expect("the in-memory store takes any batch");
        (out, batch)
    }

    fn key_package(&self, lifetime: Lifetime) -> KeyPackage {
        self.op(|p| {
            KeyPackage::builder()
                .leaf_node_capabilities(mls::capabilities())
                .key_package_lifetime(lifetime)
                .build(
                    mls::CIPHERSUITE,
                    p,
                    self.me.signature_key_pair(),
                    self.me.credential_with_key(),
                )
                .expect("a key package builds")
                .key_package()
                .clone()
        })
        .0
    }
}

/// The storage batch a member writes when it processes and merges another
/// member's commit (a self-update) in a group of [`GROUP_MEMBERS`], with
/// the crate's own MLS settings: the device's most common MLS write.
fn received_commit_batch() -> WriteBatch {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .expect("the system clock is after 1970");
    let lifetime = mls::lifetime(now_ms, mls::KEY_PACKAGE_LIFETIME);
    let config = mls::create_config(
        GroupExt {
            ledger_head: [1; 32],
            topic_seed: [2; 32],
        },
        lifetime,
    )
    .expect("the crate's group extensions are valid");

    let creator = Member::new(1);
    let receiver = Member::new(2);
    let others: Vec<Member> = (3..=GROUP_MEMBERS).map(Member::new).collect();

    let (mut group, _) = creator.op(|p| {
        MlsGroup::new(
            p,
            creator.me.signature_key_pair(),
            &config,
            creator.me.credential_with_key(),
        )
        .expect("the group is created")
    });
    let packages: Vec<KeyPackage> = std::iter::once(&receiver)
        .chain(&others)
        .map(|m| m.key_package(lifetime))
        .collect();
    let (welcome, _) = creator.op(|p| {
        let (_commit, welcome, _info) = group
            .add_members(p, creator.me.signature_key_pair(), &packages)
            .expect("the members are added");
        group.merge_pending_commit(p).expect("the add merges");
        welcome
            .tls_serialize_detached()
            .expect("a welcome serializes")
    });
    let MlsMessageBodyIn::Welcome(welcome) = MlsMessageIn::tls_deserialize_exact(&welcome)
        .expect("a welcome deserializes")
        .extract()
    else {
        panic!("add_members returns a Welcome");
    };
    let (mut joined, _) = receiver.op(|p| {
        StagedWelcome::new_from_welcome(p, &mls::join_config(), welcome, None)
            .expect("the Welcome is valid")
            .into_group(p)
            .expect("the receiver joins")
    });

    let (commit, _) = creator.op(|p| {
        let bundle = group
            .self_update(
                p,
                creator.me.signature_key_pair(),
                LeafNodeParameters::default(),
            )
            .expect("the self-update commits");
        group.merge_pending_commit(p).expect("the committer merges");
        bundle
            .into_commit()
            .tls_serialize_detached()
            .expect("a commit serializes")
    });
    eprintln!("setup: self-update commit message = {} bytes", commit.len());
    let message = MlsMessageIn::tls_deserialize_exact(&commit)
        .expect("a commit deserializes")
        .try_into_protocol_message()
        .expect("a commit is a protocol message");
    let ((), batch) = receiver.op(|p| {
        let processed = joined
            .process_message(p, message)
            .expect("the receiver processes the commit");
        match processed.into_content() {
            ProcessedMessageContent::StagedCommitMessage(staged) => joined
                .merge_staged_commit(p, *staged)
                .expect("the receiver merges the commit"),
            _ => panic!("a commit processes to a staged commit"),
        }
    });
    batch
}

/// Print the batch's shape, so the document can say what was measured.
fn describe(batch: &WriteBatch) {
    let mut values: Vec<usize> = Vec::new();
    let (mut deletes, mut bytes) = (0usize, 0usize);
    for (k, v) in batch.ops() {
        bytes += k.len();
        match v {
            Some(v) => {
                values.push(v.len());
                bytes += v.len();
            }
            None => deletes += 1,
        }
    }
    values.sort_unstable();
    let at = |q: usize| values.get(values.len() * q / 100).copied().unwrap_or(0);
    eprintln!(
        "setup: commit-merge batch = {} puts, {} deletes, {bytes} bytes of keys and values; \
         value sizes min {} / median {} / max {}",
        values.len(),
        deletes,
        values.first().copied().unwrap_or(0),
        at(50),
        values.last().copied().unwrap_or(0),
    );
}

fn device_storage(c: &mut Criterion) {
    let batch = received_commit_batch();
    describe(&batch);

    // One sled store for the whole group: a device applies its merges to
    // one long-lived store, each merge overwriting the group's keys.
    let dir = tempfile::tempdir().expect("a temporary directory for sled");
    let kv: Arc<dyn KvStore> =
        Arc::new(SledKv::open(dir.path()).expect("sled opens in a fresh directory"));
    let storage = DeviceStorage::new(kv);
    let staged = storage.staged();

    let mut g = c.benchmark_group("device_storage");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(20)
        .throughput(Throughput::Elements(1));
    // The batch goes in as `apply_with`'s extra part: the overlay is empty,
    // so what is applied is exactly the merge's batch, by the same call the
    // engine's staged operations end with. Its clone is made outside the
    // measurement.
    g.bench_function("sled_apply/commit_merge", |b| {
        b.iter_batched(
            || batch.clone(),
            |batch| staged.apply_with(batch).expect("sled applies the batch"),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("sled_apply_flush/commit_merge", |b| {
        b.iter_batched(
            || batch.clone(),
            |batch| {
                staged.apply_with(batch).expect("sled applies the batch");
                storage.kv().flush().expect("sled flushes");
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
    drop(staged);
    drop(storage);
    drop(dir);
}

criterion_group!(benches, codec, writer_check, hub_publish, device_storage);
criterion_main!(benches);
