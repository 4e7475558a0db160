//! Several hub processes on one PostgreSQL database: here two hubs in one
//! test process, each with its own connections and its own listener for
//! the other's announcements, as two `hubsync hub --store` processes have.
//! A device may be connected to either; what one accepts, the other pushes.

mod common;

use common::*;
use hubsync::client::{HubClient, Push};
use hubsync::hub::Limits;
use hubsync::testkit::{signing_key, TestHub, TestPostgres, TestStore};
use hubsync::wire::{ExpectedHead, PublishOutcome, TopicId};
use std::time::Duration;

fn unthrottled(c: &mut hubsync::hub::HubConfig) {
    c.limits = Limits::unthrottled();
}

async fn two_hubs() -> (TestHub, TestHub) {
    let a = TestHub::start_on(TestStore::Postgres, unthrottled)
        .await
        .unwrap();
    let b = TestHub::start_beside(&a, unthrottled).await.unwrap();
    assert_eq!(
        a.hub().store_id(),
        b.hub().store_id(),
        "the store's identity, not the process's"
    );
    (a, b)
}

/// The payloads of the next `n` deliveries (each within 5 s).
async fn deliveries(rx: &mut tokio::sync::mpsc::Receiver<Push>, n: usize) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    while got.len() < n {
        match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
            Ok(Some(Push::Delivery(d))) => got.push(d.payload),
            Ok(Some(_)) => {}
            other => panic!("after {} of {n} deliveries: {other:?}", got.len()),
        }
    }
    got
}

async fn receiver(
    hub: &TestHub,
    n: u64,
    topic: &str,
) -> (HubClient, tokio::sync::mpsc::Receiver<Push>) {
    let c = hub.client(&signing_key(n)).await.unwrap();
    c.subscribe(&TopicId::from(topic), None).await.unwrap();
    let rx = c.take_pushes().unwrap();
    c.receive().await.unwrap();
    (c, rx)
}

#[tokio::test]
async fn what_one_hub_accepts_the_other_pushes_at_once() {
    let (a, b) = two_hubs().await;
    let (_sub, mut rx) = receiver(&b, 1, "t").await;
    let publisher = a.client(&signing_key(2)).await.unwrap();
    for i in 0..20u8 {
        publisher
            .publish(log("t", u64::from(i), ExpectedHead::Unconditional, &[i]))
            .await
            .unwrap();
    }
    let want: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i]).collect();
    assert_eq!(deliveries(&mut rx, 20).await, want);

    // A mailbox frame for a device connected to the other hub.
    let mailbox = TopicId::mailbox(&device_of(&signing_key(1)));
    let mut p = common::mailbox("unused", 99, b"for you");
    p.topic = mailbox;
    publisher.publish(p).await.unwrap();
    assert_eq!(deliveries(&mut rx, 1).await, vec![b"for you".to_vec()]);
}

#[tokio::test]
async fn racers_on_two_hubs_have_exactly_one_winner() {
    let (a, b) = two_hubs().await;
    let seed = a.client(&signing_key(100)).await.unwrap();
    seed.publish(log("race", 0, ExpectedHead::Empty, b"genesis"))
        .await
        .unwrap();
    let mut clients = Vec::new();
    for i in 1..=16u64 {
        let hub = if i % 2 == 0 { &a } else { &b };
        clients.push(hub.client(&signing_key(i)).await.unwrap());
    }
    let answers = futures::future::join_all(clients.iter().enumerate().map(|(i, c)| {
        c.publish(log(
            "race",
            1 + i as u64,
            ExpectedHead::Seq(1),
            format!("c{i}").as_bytes(),
        ))
    }))
    .await;
    let mut accepted = 0;
    for answer in answers {
        match answer.unwrap() {
            PublishOutcome::Accepted { seq, .. } => {
                assert_eq!(seq, 2);
                accepted += 1;
            }
            PublishOutcome::HeadMismatch { current } => assert_eq!(current, Some(2)),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(accepted, 1, "exactly one compare-and-set wins across hubs");
}

/// The listener's connection is cut while frames are accepted by the other
/// hub: their announcements are lost, and still every frame arrives once
/// the listener is back (it says what it may have missed, and the hub reads
/// every followed topic's head again).
#[tokio::test]
async fn frames_announced_while_the_listener_was_away_still_arrive() {
    let (a, b) = two_hubs().await;
    let (_sub, mut rx) = receiver(&b, 1, "t").await;
    let publisher = a.client(&signing_key(2)).await.unwrap();
    publisher
        .publish(log("t", 0, ExpectedHead::Unconditional, b"before"))
        .await
        .unwrap();
    assert_eq!(deliveries(&mut rx, 1).await, vec![b"before".to_vec()]);

    // Cut every listening connection (both hubs'), then publish at once.
    let server = TestPostgres::shared().unwrap();
    let (admin, conn) = tokio_postgres::connect(&server.url("postgres"), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let cut = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE query = 'LISTEN hubsync_frames'",
            &[],
        )
        .await
        .unwrap();
    assert!(!cut.is_empty(), "the hubs listen");
    for i in 1..=5u8 {
        publisher
            .publish(log("t", u64::from(i), ExpectedHead::Unconditional, &[i]))
            .await
            .unwrap();
    }
    let want: Vec<Vec<u8>> = (1..=5u8).map(|i| vec![i]).collect();
    assert_eq!(deliveries(&mut rx, 5).await, want);
}
