//! Who may do what on a hub, each rule attacked by someone who may not:
//! private mailboxes, key-package claim rates, per-device quotas, and the
//! cap and deadline on connections that have not authenticated. All traffic
//! goes to 127.0.0.1.

mod common;

use common::*;
use hubsync::client::{ClientError, Push};
use hubsync::hub::{HubConfig, Limits, Rate};
use hubsync::testkit::{signing_key, TestHub};
use hubsync::wire::{
    ClientFrame, ExpectedHead, HubError, PublishOutcome, RetentionClass, ServerFrame, TopicId,
    MAILBOX_TOPIC_TAG,
};
use std::collections::HashSet;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// A bucket that refills too slowly to matter within a test.
fn burst(n: f64) -> Rate {
    Rate {
        per_sec: 0.001,
        burst: n,
    }
}

fn hub_error<T: std::fmt::Debug>(r: Result<T, ClientError>) -> HubError {
    match r {
        Err(ClientError::Hub(e)) => e,
        other => panic!("expected a hub error, got {other:?}"),
    }
}

fn rate_scope<T: std::fmt::Debug>(r: Result<T, ClientError>) -> String {
    match hub_error(r) {
        HubError::RateLimited { scope, .. } => scope,
        other => panic!("expected RateLimited, got {other:?}"),
    }
}

async fn next_push(rx: &mut tokio::sync::mpsc::Receiver<Push>) -> Option<Push> {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .ok()
        .flatten()
}

async fn no_push(rx: &mut tokio::sync::mpsc::Receiver<Push>) {
    let r = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await;
    assert!(r.is_err(), "expected no push, got {r:?}");
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < give_up,
            "gave up waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until `device`'s usage on `hub` satisfies `pred` (acks move
/// cursors, and free what they pass, a moment after they are answered).
async fn usage_until(
    hub: &TestHub,
    device: hubsync::wire::DeviceId,
    what: &str,
    pred: impl Fn(&hubsync::hub::DeviceUsage) -> bool,
) {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let u = hub.hub().core().usage(device).await.unwrap();
        if pred(&u) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "gave up waiting: {what} ({u:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn mailbox_post(topic: &TopicId, id: u64, payload: &[u8]) -> hubsync::wire::Publish {
    hubsync::wire::Publish {
        topic: topic.clone(),
        ..mailbox("unused", id, payload)
    }
}

#[tokio::test]
async fn a_stranger_cannot_read_a_device_mailbox_while_the_owner_gets_its_posts() {
    let hub = TestHub::start_with(|c| c.limits = Limits::unthrottled())
        .await
        .unwrap();
    let owner = hub.client(&signing_key(1)).await.unwrap();
    let stranger = hub.client(&signing_key(2)).await.unwrap();
    let inbox = TopicId::mailbox(&owner.device());
    assert_eq!(inbox.0.len(), 33);
    assert_eq!(inbox.0[0], MAILBOX_TOPIC_TAG);

    owner.subscribe(&inbox, None).await.unwrap();
    let mut owner_rx = owner.take_pushes().unwrap();
    owner.receive().await.unwrap();
    let mut stranger_rx = stranger.take_pushes().unwrap();
    stranger.receive().await.unwrap();

    // Reading someone else's mailbox: subscribe, fetch, or a log written
    // into it to fetch later. Each is refused by name and stores nothing.
    assert_eq!(
        stranger.subscribe(&inbox, None).await,
        Err(ClientError::Hub(HubError::NotAuthorized))
    );
    assert_eq!(
        stranger.fetch(&inbox, 0, 10).await.err(),
        Some(ClientError::Hub(HubError::NotAuthorized))
    );
    let mut as_log = mailbox_post(&inbox, 1, b"a log in a mailbox");
    as_log.class = RetentionClass::Log;
    assert_eq!(
        stranger.publish(as_log).await,
        Err(ClientError::Hub(HubError::NotAuthorized))
    );
    assert_eq!(hub.hub().metrics().not_authorized, 3);
    assert_eq!(
        hub.hub()
            .core()
            .usage(stranger.device())
            .await
            .unwrap()
            .stored_bytes,
        0
    );

    // Anyone may post: a Welcome-like frame reaches the owner, and only it.
    assert!(matches!(
        stranger
            .publish(mailbox_post(&inbox, 2, b"welcome"))
            .await
            .unwrap(),
        PublishOutcome::Accepted { .. }
    ));
    match next_push(&mut owner_rx).await {
        Some(Push::Delivery(d)) => {
            assert_eq!(d.payload, b"welcome");
            assert_eq!(d.sender, stranger.device());
            assert_eq!(d.topic, inbox);
        }
        other => panic!("the owner must get its post: {other:?}"),
    }
    no_push(&mut stranger_rx).await;
    // The owner may fetch its own mailbox (it holds no log frames).
    let f = owner.fetch(&inbox, 0, 10).await.unwrap();
    assert!(f.messages.is_empty());

    // The same bytes with one byte more are an ordinary topic.
    let mut longer = inbox.0.clone();
    longer.push(0);
    stranger
        .subscribe(&TopicId(longer), None)
        .await
        .expect("only the 33-byte form is reserved");
}

/// A device's mailbox holds posts for it even where it never subscribed (a
/// hub restored from a backup lost its subscription, say): a Welcome posted
/// before its owner comes reaches it when it does, and only it. The owner's
/// mailbox quota bounds what a stranger can pile up there: past it, posts
/// are refused by name and stored nowhere, until the owner has read.
#[tokio::test]
async fn a_device_mailbox_holds_posts_for_an_owner_that_never_subscribed() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.max_mailbox_frames = 2;
    })
    .await
    .unwrap();
    let stranger = hub.client(&signing_key(2)).await.unwrap();
    let owner_key = signing_key(1);
    let owner_id = hubsync::wire::DeviceId(owner_key.verifying_key().to_bytes());
    let inbox = TopicId::mailbox(&owner_id);
    for (id, body) in [(1, &b"welcome"[..]), (2, b"second")] {
        assert!(matches!(
            stranger
                .publish(mailbox_post(&inbox, id, body))
                .await
                .unwrap(),
            PublishOutcome::Accepted { .. }
        ));
    }
    assert_eq!(
        hub_error(
            stranger
                .publish(mailbox_post(&inbox, 3, b"one too many"))
                .await
        ),
        HubError::MailboxFull { max: 2 }
    );
    assert_eq!(hub.hub().metrics().mailbox_full, 1);
    let stored = hub
        .hub()
        .core()
        .usage(stranger.device())
        .await
        .unwrap()
        .stored_bytes;
    assert_eq!(stored, 13, "the two posts the mailbox took, not the third");

    // The owner connects for the first time, without subscribing.
    let owner = hub.client(&owner_key).await.unwrap();
    let mut owner_rx = owner.take_pushes().unwrap();
    owner.receive().await.unwrap();
    let mut got = Vec::new();
    while got.len() < 2 {
        match next_push(&mut owner_rx).await {
            Some(Push::Delivery(d)) => {
                assert_eq!(d.topic, inbox);
                assert_eq!(d.sender, stranger.device());
                owner.ack(vec![d.frame_ref()]).await.unwrap();
                got.push(d.payload);
            }
            other => panic!("the owner must get its posts: {other:?}"),
        }
    }
    assert_eq!(got, vec![b"welcome".to_vec(), b"second".to_vec()]);
    no_push(&mut owner_rx).await;
    // Read and acknowledged: the mailbox is empty and takes posts again.
    usage_until(&hub, owner_id, "the owner's mailbox emptied", |u| {
        u.mailbox_frames == 0
    })
    .await;
    usage_until(&hub, stranger.device(), "the posts' bytes freed", |u| {
        u.stored_bytes == 0
    })
    .await;
    stranger
        .publish(mailbox_post(&inbox, 3, b"one too many"))
        .await
        .unwrap();
    match next_push(&mut owner_rx).await {
        Some(Push::Delivery(d)) => assert_eq!(d.payload, b"one too many"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn mailbox_posts_are_rate_limited_per_sender_and_mailbox() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.mailbox_rate = burst(3.0);
    })
    .await
    .unwrap();
    let owner = hub.client(&signing_key(1)).await.unwrap();
    let other_owner = hub.client(&signing_key(4)).await.unwrap();
    let flooder = hub.client(&signing_key(2)).await.unwrap();
    let friend = hub.client(&signing_key(3)).await.unwrap();
    let inbox = TopicId::mailbox(&owner.device());
    owner.subscribe(&inbox, None).await.unwrap();
    let mut rx = owner.take_pushes().unwrap();
    owner.receive().await.unwrap();

    for i in 0..3 {
        flooder
            .publish(mailbox_post(&inbox, i, b"spam"))
            .await
            .unwrap();
    }
    assert_eq!(
        rate_scope(flooder.publish(mailbox_post(&inbox, 3, b"spam")).await),
        "mailbox"
    );
    // Another sender to the same mailbox, and the same sender to another
    // mailbox, have buckets of their own.
    friend
        .publish(mailbox_post(&inbox, 10, b"hello"))
        .await
        .unwrap();
    flooder
        .publish(mailbox_post(
            &TopicId::mailbox(&other_owner.device()),
            11,
            b"x",
        ))
        .await
        .unwrap();
    // The refused post was not stored: the owner gets exactly four.
    let mut got = Vec::new();
    for _ in 0..4 {
        match next_push(&mut rx).await {
            Some(Push::Delivery(d)) => got.push(d.payload),
            other => panic!("{other:?}"),
        }
    }
    no_push(&mut rx).await;
    assert_eq!(got.iter().filter(|p| p.as_slice() == b"spam").count(), 3);
}

#[tokio::test]
async fn a_burst_of_claims_stops_at_the_rate_limit_and_the_pool_is_not_drained() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.claimer_rate = burst(3.0);
        c.limits.target_rate = burst(5.0);
        c.limits.max_key_package_bytes = 64;
    })
    .await
    .unwrap();
    let owner = hub.client(&signing_key(1)).await.unwrap();
    let pool: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 8]).collect();
    owner
        .upload_key_packages(pool.clone(), Some(vec![0xee; 8]))
        .await
        .unwrap();
    let target = owner.device();

    // One claimer fires ten claims at once: three land, the rest are
    // refused by name, and none of them is the last resort.
    let attacker = hub.client(&signing_key(2)).await.unwrap();
    let results =
        futures::future::join_all((0..10).map(|_| attacker.claim_key_package(target))).await;
    let mut handed_out = HashSet::new();
    let mut claimer_refusals = 0;
    for r in results {
        match r {
            Ok((p, false)) => assert!(handed_out.insert(p), "a package went out twice"),
            Ok((_, true)) => panic!("the last resort while the pool holds packages"),
            Err(e) => {
                assert_eq!(rate_scope::<()>(Err(e)), "claimer");
                claimer_refusals += 1;
            }
        }
    }
    assert_eq!((handed_out.len(), claimer_refusals), (3, 7));

    // Many claimers (a Sybil with fresh keys) share the target's bucket:
    // two more land, then the target is limited, never the last resort.
    let mut target_refusals = 0;
    for n in 10..20 {
        let c = hub.client(&signing_key(n)).await.unwrap();
        match c.claim_key_package(target).await {
            Ok((p, false)) => assert!(handed_out.insert(p), "a package went out twice"),
            Ok((_, true)) => panic!("the last resort while the pool holds packages"),
            Err(e) => {
                assert_eq!(rate_scope::<()>(Err(e)), "target");
                target_refusals += 1;
            }
        }
    }
    assert_eq!((handed_out.len(), target_refusals), (5, 8));
    assert_eq!(owner.key_package_status().await.unwrap(), (15, true));
    assert!(handed_out.iter().all(|p| pool.contains(p)));
}

#[tokio::test]
async fn claims_stay_exactly_once_and_the_last_resort_comes_only_after_the_pool() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.max_key_package_bytes = 64;
    })
    .await
    .unwrap();
    let owner = hub.client(&signing_key(1)).await.unwrap();
    let pool: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 8]).collect();
    owner
        .upload_key_packages(pool.clone(), Some(vec![0xee; 8]))
        .await
        .unwrap();
    let mut claimers = Vec::new();
    for n in 2..=13 {
        claimers.push(hub.client(&signing_key(n)).await.unwrap());
    }
    let results =
        futures::future::join_all(claimers.iter().map(|c| c.claim_key_package(owner.device())))
            .await;
    let mut from_pool: Vec<_> = results
        .iter()
        .filter_map(|r| match r {
            Ok((p, false)) => Some(p.clone()),
            _ => None,
        })
        .collect();
    from_pool.sort();
    assert_eq!(from_pool, pool, "each pool package exactly once");
    let last_resorts = results
        .iter()
        .filter(|r| matches!(r, Ok((p, true)) if p == &vec![0xee; 8]))
        .count();
    assert_eq!(
        last_resorts, 6,
        "the last resort only once the pool is empty"
    );
}

/// Subscribers that never read cost the hub nothing per publish: each
/// frame is stored once, whoever follows its topic, and the log's depth
/// bounds what it holds. One that comes back is told which frames it
/// missed to the depth bound, then gets the rest in order.
#[tokio::test]
async fn throwaway_subscribers_cost_nothing_per_publish_and_a_returner_is_told_what_it_missed() {
    const THROWAWAYS: u64 = 20;
    const DEPTH: u64 = 10;
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.max_log_depth = DEPTH;
    })
    .await
    .unwrap();
    let topic = TopicId::from("hot");
    for n in 0..THROWAWAYS {
        let c = hub.client(&signing_key(100 + n)).await.unwrap();
        c.subscribe(&topic, None).await.unwrap();
        c.close();
    }
    // An honest subscriber that reads and acks as it goes.
    let honest = hub.client(&signing_key(2)).await.unwrap();
    honest.subscribe(&topic, None).await.unwrap();
    let mut honest_rx = honest.take_pushes().unwrap();
    honest.receive().await.unwrap();

    let publisher = hub.client(&signing_key(1)).await.unwrap();
    const PUBLISHES: u64 = 30;
    let mut bytes = 0;
    for i in 0..PUBLISHES {
        let p = if i % 3 == 0 {
            mailbox("hot", i, &i.to_be_bytes())
        } else {
            log("hot", i, ExpectedHead::Unconditional, &i.to_be_bytes())
        };
        bytes += 8;
        assert!(matches!(
            publisher.publish(p).await.unwrap(),
            PublishOutcome::Accepted { .. }
        ));
        match next_push(&mut honest_rx).await {
            Some(Push::Delivery(d)) => {
                assert_eq!(d.payload, i.to_be_bytes());
                honest.ack(vec![d.frame_ref()]).await.unwrap();
            }
            other => panic!("the honest subscriber missed {i}: {other:?}"),
        }
    }

    // Every frame is held once: the 10 mailbox frames (which the
    // throwaways have not passed) and the log to its depth.
    let core = hub.hub().core();
    let held = core.usage(publisher.device()).await.unwrap().stored_bytes;
    assert_eq!(held, (10 + DEPTH) * 8, "of {bytes} bytes published");

    // A throwaway that comes back is told what the log lost before it
    // read it, then gets every frame still held, in order.
    let back = hub.client(&signing_key(100)).await.unwrap();
    let mut rx = back.take_pushes().unwrap();
    back.receive().await.unwrap();
    // Log frames are the publishes with i % 3 != 0 (seq = i + 1); the
    // first ten of them went to the depth bound.
    let log_seqs: Vec<u64> = (0..PUBLISHES)
        .filter(|i| i % 3 != 0)
        .map(|i| i + 1)
        .collect();
    let trimmed_through = log_seqs[(log_seqs.len() as u64 - DEPTH) as usize - 1];
    match next_push(&mut rx).await {
        Some(Push::Error(HubError::FramesMissed {
            topic: t,
            after_seq,
            through_seq,
        })) => {
            assert_eq!(
                (t, after_seq, through_seq),
                (topic.clone(), 0, trimmed_through)
            );
        }
        other => panic!("expected the missed notice, got {other:?}"),
    }
    let want: Vec<u64> = (1..=PUBLISHES)
        .filter(|seq| (seq - 1) % 3 == 0 || *seq > trimmed_through)
        .collect();
    let mut got = Vec::new();
    while got.len() < want.len() {
        match next_push(&mut rx).await {
            Some(Push::Delivery(d)) => got.push(d.seq),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, want);
    no_push(&mut rx).await;
    assert_eq!(hub.hub().metrics().frames_missed, 1);
}

#[tokio::test]
async fn a_device_over_its_stored_bytes_quota_is_refused_and_nothing_is_stored() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.max_stored_bytes = 1000;
    })
    .await
    .unwrap();
    let hog = hub.client(&signing_key(1)).await.unwrap();
    let other = hub.client(&signing_key(2)).await.unwrap();
    let core = hub.hub().core();
    let t = TopicId::from("blob");

    let mut first = log("blob", 1, ExpectedHead::Unconditional, &[1; 600]);
    first.retention_secs = Some(0);
    hog.publish(first).await.unwrap();
    assert_eq!(core.usage(hog.device()).await.unwrap().stored_bytes, 600);
    assert_eq!(
        hub_error(
            hog.publish(log("blob", 2, ExpectedHead::Seq(1), &[2; 500]))
                .await
        ),
        HubError::StorageQuotaExceeded {
            stored: 600,
            adding: 500,
            max: 1000
        }
    );
    // Nothing of the refused publish was stored: same head, one frame, and
    // its publish id is still free.
    let f = hog.fetch(&t, 0, 10).await.unwrap();
    assert_eq!((f.head, f.messages.len()), (Some(1), 1));
    assert_eq!(core.usage(hog.device()).await.unwrap().stored_bytes, 600);
    assert_eq!(hub.hub().metrics().quota_refusals, 1);
    // The quota is per device: another publisher is not affected.
    other
        .publish(log("blob", 3, ExpectedHead::Unconditional, &[3; 900]))
        .await
        .unwrap();

    // A mailbox frame counts while a recipient holds it, and is released
    // by the last ack.
    let sub = hub.client(&signing_key(3)).await.unwrap();
    sub.subscribe(&TopicId::from("mb"), None).await.unwrap();
    hog.publish(mailbox("mb", 4, &[4; 300])).await.unwrap();
    assert_eq!(core.usage(hog.device()).await.unwrap().stored_bytes, 900);
    let mut rx = sub.take_pushes().unwrap();
    sub.receive().await.unwrap();
    let frame = match next_push(&mut rx).await {
        Some(Push::Delivery(d)) => d.frame_ref(),
        other => panic!("{other:?}"),
    };
    sub.ack(vec![frame]).await.unwrap();
    usage_until(&hub, hog.device(), "the acked mailbox frame freed", |u| {
        u.stored_bytes == 600
    })
    .await;

    // Room comes back as frames go: the first one's retention ran out.
    hub.hub().purge_now().await.unwrap();
    assert_eq!(core.usage(hog.device()).await.unwrap().stored_bytes, 0);
    assert!(matches!(
        hog.publish(log("blob", 2, ExpectedHead::Seq(2), &[2; 500]))
            .await
            .unwrap(),
        PublishOutcome::Accepted { .. }
    ));
}

fn flood_config(c: &mut HubConfig) {
    c.limits = Limits::unthrottled();
    c.max_unauthenticated = 4;
    c.auth_deadline = Duration::from_secs(3);
    c.challenge_ttl = Duration::from_secs(2);
}

#[tokio::test]
async fn an_unauthenticated_flood_is_capped_and_stale_connections_time_out() {
    let hub = TestHub::start_with(flood_config).await.unwrap();
    let metrics = || hub.hub().metrics();

    // Two bare TCP connections that never speak, and two WebSocket
    // connections that take their challenge and never answer it.
    let mut tcp = Vec::new();
    for _ in 0..2 {
        tcp.push(tokio::net::TcpStream::connect(hub.addr()).await.unwrap());
    }
    let mut idle = vec![
        RawConn::open(hub.url()).await,
        RawConn::open(hub.url()).await,
    ];
    wait_until("four unauthenticated", || metrics().unauthenticated == 4).await;

    // One more is closed at once, with a reason and no challenge.
    let (mut ws, _) = tokio_tungstenite::connect_async(hub.url()).await.unwrap();
    match next(&mut ws).await {
        Got::Close(reason) => assert_eq!(reason, "too many unauthenticated connections"),
        other => panic!("expected a close with a reason, got {other:?}"),
    }
    // So is an honest client, for now.
    assert!(hub.client(&signing_key(1)).await.is_err());
    assert!(metrics().unauthenticated_refused >= 2);
    assert_eq!(metrics().unauthenticated, 4);

    // Finishing the handshake gives the place back at once.
    let mut early = idle.pop().unwrap();
    let a = early.auth_for(&signing_key(2));
    early.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        early.recv().await,
        Got::Frame(ServerFrame::AuthOk(_))
    ));
    wait_until("a place freed", || metrics().unauthenticated == 3).await;
    idle.push(RawConn::open(hub.url()).await);

    // At the deadline every stale connection is closed: the WebSocket ones
    // with a reason, the bare TCP ones without (they have no WebSocket).
    for c in &mut idle {
        match c.recv().await {
            Got::Close(reason) => assert_eq!(reason, "authentication timed out"),
            other => panic!("expected the deadline's close, got {other:?}"),
        }
    }
    for s in &mut tcp {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("closed by the deadline")
            .unwrap_or(0);
        assert_eq!(n, 0, "a connection that never spoke is just closed");
    }
    wait_until("all stale ones gone", || metrics().unauthenticated == 0).await;
    assert_eq!(metrics().auth_timeouts, 4);

    // An honest client connects again, and the one that authenticated in
    // time was never touched.
    let c = hub.client(&signing_key(3)).await.unwrap();
    c.ping().await.unwrap();
    early.send(&request(9, hubsync::wire::Request::Ping)).await;
    assert!(matches!(
        early.recv().await,
        Got::Frame(ServerFrame::Response {
            id: 9,
            result: Ok(_)
        })
    ));
}
