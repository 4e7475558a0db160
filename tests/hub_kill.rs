//! Durability: the real `hubsync hub` binary is killed with SIGKILL during a
//! storm of publishes, restarted on the same store (a sled directory, or a
//! PostgreSQL database), and every publish it had answered `accepted` is
//! there, in order, under its sequence number.

mod common;

use common::*;
use hubsync::client::{ClientOptions, HubClient};
use hubsync::testkit::{signing_key, TestPostgres, TestStore};
use hubsync::transport::TcpConnector;
use hubsync::wire::{ExpectedHead, PublishOutcome, TopicId};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where the hub process keeps its data.
enum Store {
    Dir(tempfile::TempDir),
    Postgres(String),
}

impl Store {
    async fn new(kind: TestStore) -> Store {
        match kind {
            TestStore::Sled => Store::Dir(tempfile::tempdir().unwrap()),
            TestStore::Postgres => {
                Store::Postgres(TestPostgres::shared().unwrap().database().await.unwrap())
            }
        }
    }
}

impl Store {
    /// `hubsync hub` on this store.
    fn spawn_hub(&self) -> HubProcess {
        match self {
            Store::Dir(dir) => HubProcess::spawn(&["--data", &dir.path().to_string_lossy()]),
            Store::Postgres(url) => HubProcess::spawn(&["--store", url]),
        }
    }
}

type Accepted = Arc<Mutex<BTreeMap<(String, u64), Vec<u8>>>>;

async fn accepted_publishes_survive_sigkill(kind: TestStore) {
    let store = Store::new(kind).await;
    let mut hub = store.spawn_hub();
    let url = hub.url();
    let accepted: Accepted = Arc::default();
    let mut workers = Vec::new();
    for w in 0..4u64 {
        let client = HubClient::connect(
            &TcpConnector,
            &url,
            &signing_key(w + 1),
            ClientOptions::default(),
        )
        .await
        .unwrap();
        // Each worker keeps 8 publishes in flight: half to its own topic
        // under a compare-and-set chain, half to a shared topic.
        for lane in 0..8u64 {
            let client = client.clone();
            let accepted = accepted.clone();
            workers.push(tokio::spawn(async move {
                for i in 0.. {
                    let n = (w << 40) | (lane << 32) | i;
                    let topic = if lane % 2 == 0 {
                        "shared".to_string()
                    } else {
                        format!("own-{w}-{lane}")
                    };
                    let payload = n.to_be_bytes().to_vec();
                    let p = log(&topic, n, ExpectedHead::Unconditional, &payload);
                    match client.publish(p).await {
                        Ok(PublishOutcome::Accepted { seq, .. }) => {
                            accepted.lock().unwrap().insert((topic, seq), payload);
                        }
                        Ok(other) => panic!("unexpected {other:?}"),
                        Err(_) => break, // the hub died
                    }
                }
            }));
        }
    }
    // Let the storm run, then kill the hub mid-flight.
    tokio::time::sleep(Duration::from_millis(700)).await;
    hub.kill();
    for w in workers {
        w.await.unwrap();
    }
    let accepted = accepted.lock().unwrap().clone();
    assert!(
        accepted.len() > 100,
        "the storm was too small to mean anything: {}",
        accepted.len()
    );
    eprintln!("accepted before SIGKILL: {}", accepted.len());

    let mut hub = store.spawn_hub();
    let url = hub.url();
    let reader = HubClient::connect(
        &TcpConnector,
        &url,
        &signing_key(50),
        ClientOptions::default(),
    )
    .await
    .unwrap();
    let mut topics: Vec<String> = accepted.keys().map(|(t, _)| t.clone()).collect();
    topics.dedup();
    for topic in topics {
        let mut stored = BTreeMap::new();
        let mut after = 0;
        let head = loop {
            let f = reader
                .fetch(&TopicId::from(topic.as_str()), after, 500)
                .await
                .unwrap();
            assert!(!f.gap);
            for m in &f.messages {
                stored.insert(m.seq, m.payload.clone());
                after = m.seq;
            }
            if f.messages.is_empty() {
                break f.head;
            }
        };
        let head = head.expect("a topic with accepted publishes has a head");
        // No holes: the log is 1..=head.
        assert_eq!(stored.len() as u64, head, "holes in {topic}");
        for ((t, seq), payload) in accepted.range((topic.clone(), 0)..=(topic.clone(), u64::MAX)) {
            assert_eq!(t, &topic);
            assert_eq!(
                stored.get(seq),
                Some(payload),
                "accepted {topic}#{seq} lost or changed"
            );
            assert!(head >= *seq, "the head went back in {topic}");
        }
    }
    // The head keeps moving from where it was.
    let f = reader.fetch(&TopicId::from("shared"), 0, 1).await.unwrap();
    let head = f.head.unwrap();
    assert_eq!(
        reader
            .publish(log("shared", 1 << 60, ExpectedHead::Seq(head), b"after"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: head + 1,
            head: Some(head + 1)
        }
    );
    // SIGTERM stops it cleanly with exit code 0.
    let status = hub.terminate();
    assert!(status.success(), "hub exit status {status:?}");
}

mod accepted_publishes_survive_sigkill {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sled() {
        accepted_publishes_survive_sigkill(TestStore::Sled).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        accepted_publishes_survive_sigkill(TestStore::Postgres).await
    }
}
