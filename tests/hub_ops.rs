//! Every hub operation and its errors, against the real hub over loopback.

mod common;

use common::*;
use hubsync::client::{ClientError, ClientOptions, HubClient, Push};
use hubsync::hub::{Limits, Rate};
use hubsync::testkit::{signing_key, FaultyKv, TestHub, TestStore};
use hubsync::transport::TcpConnector;
use hubsync::wire::{
    Challenge, ChangeOutcome, ClientFrame, ExpectedHead, FrameRef, HubError, PublishOutcome,
    Request, RetentionClass, ServerFrame, SubscriptionChange, TopicId, MAX_SUBSCRIPTION_CHANGES,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use std::collections::HashSet;
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

fn unthrottled(c: &mut hubsync::hub::HubConfig) {
    c.limits = Limits::unthrottled();
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

async fn auth_accepts_a_valid_signature_and_refuses_each_bad_one(store: TestStore) {
    let hub = TestHub::start_on(store, |c| c.challenge_ttl = Duration::from_millis(400))
        .await
        .unwrap();
    let key = signing_key(1);

    // Valid.
    let good = RawConn::login(hub.url(), &key).await;

    // Wrong signature: signed by another key, claiming ours.
    let mut c = RawConn::open(hub.url()).await;
    let mut a = c.auth_for(&signing_key(2));
    a.device = device_of(&key);
    c.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        c.recv().await,
        Got::Frame(ServerFrame::Error(HubError::BadSignature))
    ));

    // Replayed: the first connection's whole answer sent again elsewhere.
    let mut first = RawConn::open(hub.url()).await;
    let a = first.auth_for(&key);
    first.send(&ClientFrame::Auth(a.clone())).await;
    assert!(matches!(
        first.recv().await,
        Got::Frame(ServerFrame::AuthOk(_))
    ));
    let mut c = RawConn::open(hub.url()).await;
    c.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        c.recv().await,
        Got::Frame(ServerFrame::Error(HubError::ChallengeReplayed))
    ));

    // A nonce this connection never got.
    let mut c = RawConn::open(hub.url()).await;
    let mut a = c.auth_for(&key);
    a.nonce = [9; 32];
    c.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        c.recv().await,
        Got::Frame(ServerFrame::Error(HubError::UnknownChallenge))
    ));

    // Signed for another hub.
    let mut c = RawConn::open(hub.url()).await;
    let a = signed_auth(&key, &c.challenge, "ws://elsewhere:1");
    c.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        c.recv().await,
        Got::Frame(ServerFrame::Error(HubError::WrongHub { .. }))
    ));

    // An unsupported protocol version.
    let mut c = RawConn::open(hub.url()).await;
    let mut a = c.auth_for(&key);
    a.version = 999;
    c.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        c.recv().await,
        Got::Frame(ServerFrame::Error(HubError::UnsupportedVersion {
            requested: 999,
            ..
        }))
    ));

    // Expired.
    let mut c = RawConn::open(hub.url()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let a = c.auth_for(&key);
    c.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        c.recv().await,
        Got::Frame(ServerFrame::Error(HubError::ChallengeExpired))
    ));

    // A second auth on an authenticated connection.
    let mut good = good;
    let a = good.auth_for(&key);
    good.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        good.recv().await,
        Got::Frame(ServerFrame::Error(HubError::AlreadyAuthenticated))
    ));
    assert!(hub.hub().metrics().auth_failures >= 6);
}

async fn publish_fetch_and_cas_answers(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    let t = TopicId::from("log");

    assert_eq!(
        c.publish(log("log", 1, ExpectedHead::Seq(5), b"x"))
            .await
            .unwrap(),
        PublishOutcome::HeadMismatch { current: None }
    );
    assert_eq!(
        c.publish(log("log", 1, ExpectedHead::Empty, b"a"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 1,
            head: Some(1)
        }
    );
    assert_eq!(
        c.publish(log("log", 2, ExpectedHead::Empty, b"b"))
            .await
            .unwrap(),
        PublishOutcome::HeadMismatch { current: Some(1) }
    );
    assert_eq!(
        c.publish(log("log", 2, ExpectedHead::Seq(1), b"b"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 2,
            head: Some(2)
        }
    );
    assert_eq!(
        c.publish(log("log", 3, ExpectedHead::Unconditional, b"c"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 3,
            head: Some(3)
        }
    );
    // A mailbox publish takes a sequence number but moves no head.
    assert_eq!(
        c.publish(mailbox("log", 4, b"m")).await.unwrap(),
        PublishOutcome::Accepted {
            seq: 4,
            head: Some(3)
        }
    );
    let f = c.fetch(&t, 0, 10).await.unwrap();
    assert_eq!(f.head, Some(3));
    assert_eq!(f.oldest, Some(1));
    assert!(!f.gap);
    let got: Vec<_> = f
        .messages
        .iter()
        .map(|m| (m.seq, m.payload.clone()))
        .collect();
    assert_eq!(
        got,
        vec![(1, b"a".to_vec()), (2, b"b".to_vec()), (3, b"c".to_vec())]
    );
    assert_eq!(f.messages[0].sender, c.device());
    let f = c.fetch(&t, 1, 1).await.unwrap();
    assert_eq!(f.messages.len(), 1);
    assert_eq!(f.messages[0].seq, 2);
    let empty = c.fetch(&TopicId::from("nothing"), 0, 10).await.unwrap();
    assert_eq!(
        (empty.head, empty.oldest, empty.gap, empty.messages.len()),
        (None, None, false, 0)
    );
}

async fn duplicate_conflict_and_replay_only(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let a = hub.client(&signing_key(1)).await.unwrap();
    let b = hub.client(&signing_key(2)).await.unwrap();
    let t = TopicId::from("t");
    b.subscribe(&t, None).await.unwrap();
    let mut pushes = b.take_pushes().unwrap();
    b.receive().await.unwrap();

    assert_eq!(
        a.publish(log("t", 1, ExpectedHead::Empty, b"one"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 1,
            head: Some(1)
        }
    );
    match next_push(&mut pushes).await {
        Some(Push::Delivery(d)) => assert_eq!(d.payload, b"one"),
        other => panic!("{other:?}"),
    }
    // The retry carries a stale head: idempotency runs first.
    assert_eq!(
        a.publish(log("t", 1, ExpectedHead::Empty, b"one"))
            .await
            .unwrap(),
        PublishOutcome::Duplicate { seq: 1 }
    );
    let mut replay = log("t", 1, ExpectedHead::Empty, b"one");
    replay.replay_only = true;
    assert_eq!(
        a.publish(replay).await.unwrap(),
        PublishOutcome::Duplicate { seq: 1 }
    );
    // A duplicate fans out to nobody.
    no_push(&mut pushes).await;

    assert_eq!(
        a.publish(log("t", 1, ExpectedHead::Seq(1), b"other")).await,
        Err(ClientError::Hub(HubError::Conflict { seq: 1 }))
    );
    let mut unknown = log("t", 77, ExpectedHead::Seq(1), b"never");
    unknown.replay_only = true;
    assert_eq!(
        a.publish(unknown).await.unwrap(),
        PublishOutcome::HistoryMissing
    );
    let f = a.fetch(&t, 0, 10).await.unwrap();
    assert_eq!(f.head, Some(1));
    assert_eq!(f.messages.len(), 1);
    no_push(&mut pushes).await;
    let m = hub.hub().metrics();
    assert_eq!(
        (m.accepted, m.duplicates, m.conflicts, m.history_missing),
        (1, 2, 1, 1)
    );
}

async fn publish_limits_are_named_errors(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits.max_payload = 1000;
        c.limits.max_topic = 8;
        c.limits.device_rate = Rate {
            per_sec: 1.0,
            burst: 3.0,
        };
    })
    .await
    .unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    let err = |r: Result<PublishOutcome, ClientError>| match r {
        Err(ClientError::Hub(e)) => e,
        other => panic!("expected a hub error, got {other:?}"),
    };
    assert_eq!(
        err(c
            .publish(log("t", 1, ExpectedHead::Unconditional, &[0; 1001]))
            .await),
        HubError::PayloadTooLarge {
            len: 1001,
            max: 1000
        }
    );
    assert_eq!(
        err(c
            .publish(log("123456789", 1, ExpectedHead::Unconditional, b"x"))
            .await),
        HubError::BadTopic { len: 9, max: 8 }
    );
    assert_eq!(
        err(c
            .publish(log("", 1, ExpectedHead::Unconditional, b"x"))
            .await),
        HubError::BadTopic { len: 0, max: 8 }
    );
    let mut m = mailbox("t", 1, b"x");
    m.expected_head = ExpectedHead::Seq(1);
    assert_eq!(err(c.publish(m).await), HubError::HeadConditionOnMailbox);
    let mut long = log("t", 1, ExpectedHead::Unconditional, b"x");
    long.retention_secs = Some(31 * 24 * 3600);
    assert!(matches!(
        err(c.publish(long).await),
        HubError::RetentionTooLong { .. }
    ));
    // None of the refusals took a rate token or stored anything.
    for i in 0..3 {
        c.publish(log("t", 10 + i, ExpectedHead::Unconditional, b"ok"))
            .await
            .unwrap();
    }
    assert!(matches!(
        err(c
            .publish(log("t", 20, ExpectedHead::Unconditional, b"x"))
            .await),
        HubError::RateLimited { .. }
    ));
    assert_eq!(
        c.fetch(&TopicId::from("t"), 0, 10)
            .await
            .unwrap()
            .messages
            .len(),
        3
    );
    assert!(matches!(
        c.fetch(&TopicId::from("t"), 0, 0).await,
        Err(ClientError::Hub(HubError::BadFetchLimit {
            requested: 0,
            max: 500
        }))
    ));
    assert!(matches!(
        c.fetch(&TopicId::from("t"), 0, 501).await,
        Err(ClientError::Hub(HubError::BadFetchLimit {
            requested: 501,
            ..
        }))
    ));
}

async fn topic_rate_limit_spans_devices(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits.topic_rate = Rate {
            per_sec: 1.0,
            burst: 2.0,
        };
    })
    .await
    .unwrap();
    let a = hub.client(&signing_key(1)).await.unwrap();
    let b = hub.client(&signing_key(2)).await.unwrap();
    a.publish(log("hot", 1, ExpectedHead::Unconditional, b"1"))
        .await
        .unwrap();
    b.publish(log("hot", 2, ExpectedHead::Unconditional, b"2"))
        .await
        .unwrap();
    assert!(matches!(
        b.publish(log("hot", 3, ExpectedHead::Unconditional, b"3")).await,
        Err(ClientError::Hub(HubError::RateLimited { ref scope, .. })) if scope == "topic"
    ));
    b.publish(log("cold", 4, ExpectedHead::Unconditional, b"4"))
        .await
        .unwrap();
}

async fn subscriptions_are_limited_durable_and_never_clamped(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits = Limits::unthrottled();
        c.limits.max_subscriptions = 2;
    })
    .await
    .unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    c.subscribe(&TopicId::from("a"), None).await.unwrap();
    c.subscribe(&TopicId::from("a"), Some(60)).await.unwrap(); // update, not a second one
    c.subscribe(&TopicId::from("b"), None).await.unwrap();
    assert_eq!(
        c.subscribe(&TopicId::from("c"), None).await,
        Err(ClientError::Hub(HubError::TooManySubscriptions { max: 2 }))
    );
    assert_eq!(
        c.subscribe(&TopicId::from("c"), Some(40 * 24 * 3600)).await,
        Err(ClientError::Hub(HubError::RetentionTooLong {
            requested_secs: 40 * 24 * 3600,
            max_secs: 30 * 24 * 3600
        }))
    );
    assert!(c.unsubscribe(&TopicId::from("b")).await.unwrap());
    assert!(!c.unsubscribe(&TopicId::from("b")).await.unwrap());
    c.subscribe(&TopicId::from("c"), None).await.unwrap();

    // Subscriptions survive a restart of the hub.
    let h = TestHub::start_on(store, unthrottled).await.unwrap();
    let sub = h.client(&signing_key(5)).await.unwrap();
    sub.subscribe(&TopicId::from("x"), None).await.unwrap();
    drop(sub);
    let h = h.restart(unthrottled).await.unwrap();
    let publisher = h.client(&signing_key(6)).await.unwrap();
    publisher
        .publish(mailbox("x", 1, b"after restart"))
        .await
        .unwrap();
    let sub = h.client(&signing_key(5)).await.unwrap();
    let mut rx = sub.take_pushes().unwrap();
    sub.receive().await.unwrap();
    match next_push(&mut rx).await {
        Some(Push::Delivery(d)) => assert_eq!(d.payload, b"after restart"),
        other => panic!("{other:?}"),
    }
    h.stop().await;
}

fn sub(topic: &str, retention_secs: Option<u64>) -> SubscriptionChange {
    SubscriptionChange::Subscribe {
        topic: TopicId::from(topic),
        retention_secs,
    }
}

fn unsub(topic: &str) -> SubscriptionChange {
    SubscriptionChange::Unsubscribe {
        topic: TopicId::from(topic),
    }
}

async fn subscription_changes_in_one_request_each_stand_alone(store: TestStore) {
    let hub = TestHub::start_on(store, |_| {}).await.unwrap();
    let (ka, kb) = (signing_key(1), signing_key(2));
    let a = hub.client(&ka).await.unwrap();
    let b = hub.client(&kb).await.unwrap();
    let b_mailbox = TopicId::mailbox(&device_of(&kb));
    let outcomes = a
        .change_subscriptions(vec![
            sub("a", None),
            SubscriptionChange::Subscribe {
                topic: TopicId(vec![]),
                retention_secs: None,
            },
            // Another device's mailbox: only its owner may read it.
            SubscriptionChange::Subscribe {
                topic: b_mailbox.clone(),
                retention_secs: None,
            },
            sub("b", Some(40 * 24 * 3600)),
            sub("a", Some(60)),
            unsub("c"),
            sub("c", None),
            unsub("c"),
        ])
        .await
        .unwrap();
    assert_eq!(
        outcomes,
        vec![
            ChangeOutcome::Subscribed,
            ChangeOutcome::Refused(HubError::BadTopic { len: 0, max: 256 }),
            ChangeOutcome::Refused(HubError::NotAuthorized),
            ChangeOutcome::Refused(HubError::RetentionTooLong {
                requested_secs: 40 * 24 * 3600,
                max_secs: 30 * 24 * 3600
            }),
            ChangeOutcome::Subscribed,
            ChangeOutcome::Unsubscribed { existed: false },
            ChangeOutcome::Subscribed,
            ChangeOutcome::Unsubscribed { existed: true },
        ]
    );
    // One change too many: refused whole, nothing changed.
    let many: Vec<_> = (0..=MAX_SUBSCRIPTION_CHANGES)
        .map(|i| sub(&format!("many{i}"), None))
        .collect();
    assert_eq!(
        a.change_subscriptions(many).await,
        Err(ClientError::Hub(HubError::TooManyChanges {
            count: MAX_SUBSCRIPTION_CHANGES as u64 + 1,
            max: MAX_SUBSCRIPTION_CHANGES as u64
        }))
    );
    assert!(!a.unsubscribe(&TopicId::from("many0")).await.unwrap());

    // A follows "a" and nothing else: not "b", not "c", not B's mailbox.
    let mut rx = a.take_pushes().unwrap();
    a.receive().await.unwrap();
    for (i, t) in ["b", "c"].into_iter().enumerate() {
        b.publish(mailbox(t, i as u64 + 1, b"not for a"))
            .await
            .unwrap();
    }
    let c = hub.client(&signing_key(3)).await.unwrap();
    let mut to_b = mailbox("x", 9, b"for b only");
    to_b.topic = b_mailbox;
    c.publish(to_b).await.unwrap();
    b.publish(mailbox("a", 10, b"for a")).await.unwrap();
    match next_push(&mut rx).await {
        Some(Push::Delivery(d)) => assert_eq!(d.payload, b"for a"),
        other => panic!("{other:?}"),
    }
    no_push(&mut rx).await;
    hub.stop().await;
}

async fn subscription_changes_have_their_own_bucket(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits.subscription_rate = Rate {
            per_sec: 2.0,
            burst: 5.0,
        };
        c.limits.device_rate = Rate {
            per_sec: 1.0,
            burst: 3.0,
        };
    })
    .await
    .unwrap();
    let a = hub.client(&signing_key(1)).await.unwrap();
    let four: Vec<_> = (0..4).map(|i| sub(&format!("t{i}"), None)).collect();
    // One token for the request, one per subscription written: all five.
    a.change_subscriptions(four.clone()).await.unwrap();
    let limited = a.change_subscriptions(four.clone()).await;
    assert!(
        matches!(
            limited,
            Err(ClientError::Hub(HubError::RateLimited { ref scope, .. })) if scope == "subscriptions"
        ),
        "{limited:?}"
    );
    // Publishing spends the device's own bucket, untouched by the above.
    for i in 0..3 {
        a.publish(mailbox("elsewhere", i, b"x")).await.unwrap();
    }
    // Subscribing again to what is held writes nothing: once the bucket
    // holds a token, the four cost that one token.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let again = a.change_subscriptions(four.clone()).await.unwrap();
    assert!(again.iter().all(|o| *o == ChangeOutcome::Subscribed));
    let changed = a.change_subscriptions(vec![sub("t0", Some(60))]).await;
    assert!(
        matches!(
            changed,
            Err(ClientError::Hub(HubError::RateLimited { ref scope, .. })) if scope == "subscriptions"
        ),
        "{changed:?}"
    );
    hub.stop().await;
}

async fn a_device_follows_thirteen_thousand_topics(store: TestStore) {
    // A device in 1,000 groups, each right after ten roster changes in a
    // row (13 topics), under the default limits.
    const TOPICS: usize = 13_000;
    let hub = TestHub::start_on(store, |_| {}).await.unwrap();
    let key = signing_key(1);
    let topics: Vec<String> = (0..TOPICS).map(|i| format!("group-topic-{i}")).collect();
    let subscribe_all = |c: HubClient| {
        let topics = topics.clone();
        async move {
            for chunk in topics.chunks(MAX_SUBSCRIPTION_CHANGES) {
                let outcomes = c
                    .change_subscriptions(chunk.iter().map(|t| sub(t, None)).collect())
                    .await
                    .unwrap();
                assert!(outcomes.iter().all(|o| *o == ChangeOutcome::Subscribed));
            }
            c
        }
    };
    let a = subscribe_all(hub.client(&key).await.unwrap()).await;
    drop(a);
    // A reconnect subscribes everything again: 13 requests, nothing
    // written, nothing refused.
    let a = subscribe_all(hub.client(&key).await.unwrap()).await;
    let mut rx = a.take_pushes().unwrap();
    a.receive().await.unwrap();
    let b = hub.client(&signing_key(2)).await.unwrap();
    let last = &topics[TOPICS - 1];
    b.publish(mailbox(&topics[0], 1, b"first")).await.unwrap();
    b.publish(mailbox(last, 2, b"last")).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        match next_push(&mut rx).await {
            Some(Push::Delivery(d)) => got.push(d.payload),
            other => panic!("{other:?}"),
        }
    }
    got.sort();
    assert_eq!(got, vec![b"first".to_vec(), b"last".to_vec()]);
    hub.stop().await;
}

async fn mailbox_reaches_every_subscriber_but_the_sender_until_acked(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let keys: Vec<_> = (1..=3).map(signing_key).collect();
    let clients: Vec<_> = futures::future::join_all(keys.iter().map(|k| hub.client(k)))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let t = TopicId::from("mb");
    for c in &clients {
        c.subscribe(&t, None).await.unwrap();
    }
    let mut rxs: Vec<_> = clients.iter().map(|c| c.take_pushes().unwrap()).collect();
    for c in &clients {
        c.receive().await.unwrap();
    }
    clients[0]
        .publish(mailbox("mb", 1, b"hello"))
        .await
        .unwrap();
    no_push(&mut rxs[0]).await;
    let mut ids = Vec::new();
    for (i, rx) in rxs.iter_mut().enumerate().skip(1) {
        match next_push(rx).await {
            Some(Push::Delivery(d)) => {
                assert_eq!(d.payload, b"hello");
                assert_eq!(d.class, RetentionClass::Mailbox);
                assert_eq!(d.sender, clients[0].device());
                ids.push((i, d.frame_ref()));
            }
            other => panic!("{other:?}"),
        }
    }
    // Mailbox frames are not in the log.
    assert!(clients[1]
        .fetch(&t, 0, 10)
        .await
        .unwrap()
        .messages
        .is_empty());
    // Acked by one: the other still gets it again after reconnecting.
    let never_pushed = FrameRef {
        topic: t.clone(),
        seq: 999,
    };
    assert_eq!(
        clients[1]
            .ack(vec![ids[0].1.clone(), never_pushed])
            .await
            .unwrap(),
        1
    );
    assert_eq!(clients[1].ack(vec![ids[0].1.clone()]).await.unwrap(), 0);
    let too_many = (0..1001)
        .map(|seq| FrameRef {
            topic: t.clone(),
            seq,
        })
        .collect();
    assert!(matches!(
        clients[1].ack(too_many).await,
        Err(ClientError::Hub(HubError::TooManyAcks {
            count: 1001,
            max: 1000
        }))
    ));
    let again = hub.client(&keys[2]).await.unwrap();
    let mut rx = again.take_pushes().unwrap();
    again.receive().await.unwrap();
    match next_push(&mut rx).await {
        Some(Push::Delivery(d)) => assert_eq!(d.frame_ref(), ids[1].1),
        other => panic!("{other:?}"),
    }
    // The old stream of that device was replaced.
    match next_push(&mut rxs[2]).await {
        Some(Push::ReceiveEnded(HubError::ReceiveReplaced)) => {}
        other => panic!("{other:?}"),
    }
    let again1 = hub.client(&keys[1]).await.unwrap();
    let mut rx1 = again1.take_pushes().unwrap();
    again1.receive().await.unwrap();
    no_push(&mut rx1).await;
}

async fn receive_stream_cut_and_resumed_loses_nothing_and_repeats_nothing_acked(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let pubr = hub.client(&signing_key(1)).await.unwrap();
    let key = signing_key(2);
    let sub = hub.client(&key).await.unwrap();
    let t = TopicId::from("stream");
    sub.subscribe(&t, None).await.unwrap();
    let mut rx = sub.take_pushes().unwrap();
    sub.receive().await.unwrap();
    let publisher = tokio::spawn({
        let pubr = pubr.clone();
        async move {
            for i in 0..200u64 {
                let p = if i % 2 == 0 {
                    log("stream", i, ExpectedHead::Unconditional, &i.to_be_bytes())
                } else {
                    mailbox("stream", i, &i.to_be_bytes())
                };
                pubr.publish(p).await.unwrap();
            }
        }
    });
    // Take 60 deliveries, ack the first 50, then cut the connection.
    let mut acked = HashSet::new();
    let mut seen_ids = Vec::new();
    for _ in 0..60 {
        match next_push(&mut rx).await {
            Some(Push::Delivery(d)) => seen_ids.push((d.frame_ref(), d.payload.clone())),
            other => panic!("{other:?}"),
        }
    }
    let to_ack: Vec<FrameRef> = seen_ids[..50].iter().map(|(f, _)| f.clone()).collect();
    sub.ack(to_ack.clone()).await.unwrap();
    acked.extend(seen_ids[..50].iter().map(|(_, p)| p.clone()));
    sub.close();
    publisher.await.unwrap();

    let sub = hub.client(&key).await.unwrap();
    let mut rx = sub.take_pushes().unwrap();
    sub.receive().await.unwrap();
    let mut got = HashSet::new();
    while got.len() + acked.len() < 200 {
        match next_push(&mut rx).await {
            Some(Push::Delivery(d)) => {
                assert!(!acked.contains(&d.payload), "an acked frame came again");
                assert!(got.insert(d.payload), "a frame came twice in one stream");
            }
            other => panic!("stream stopped early at {}: {other:?}", got.len()),
        }
    }
    no_push(&mut rx).await;
    let all: HashSet<Vec<u8>> = (0..200u64).map(|i| i.to_be_bytes().to_vec()).collect();
    let union: HashSet<Vec<u8>> = got.union(&acked).cloned().collect();
    assert_eq!(union, all);
}

async fn cas_race_has_exactly_one_winner(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let seed = hub.client(&signing_key(100)).await.unwrap();
    seed.publish(log("race", 0, ExpectedHead::Empty, b"genesis"))
        .await
        .unwrap();
    let clients: Vec<_> = futures::future::join_all((1..=24).map(|i| hub.client_owned(i))).await;
    let winners = race_on_head_one(&clients).await;
    assert_eq!(winners, vec![2]);
    let f = seed.fetch(&TopicId::from("race"), 0, 10).await.unwrap();
    assert_eq!(f.head, Some(2));
    assert_eq!(f.messages.len(), 2);
}

trait ClientOwned {
    async fn client_owned(&self, n: u64) -> hubsync::client::HubClient;
}

impl ClientOwned for TestHub {
    async fn client_owned(&self, n: u64) -> hubsync::client::HubClient {
        self.client(&signing_key(n)).await.unwrap()
    }
}

async fn log_trim_by_depth_reports_gap(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits = Limits::unthrottled();
        c.limits.max_log_depth = 5;
    })
    .await
    .unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    let t = TopicId::from("deep");
    for i in 1..=12u64 {
        c.publish(log("deep", i, ExpectedHead::Unconditional, &[i as u8]))
            .await
            .unwrap();
    }
    let f = c.fetch(&t, 0, 100).await.unwrap();
    assert!(f.gap);
    assert_eq!(f.oldest, Some(8));
    assert_eq!(f.head, Some(12));
    assert_eq!(
        f.messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
        vec![8, 9, 10, 11, 12]
    );
    let f = c.fetch(&t, 7, 100).await.unwrap();
    assert!(!f.gap);
    assert_eq!(f.messages.len(), 5);
    let f = c.fetch(&t, 6, 100).await.unwrap();
    assert!(f.gap, "frame 7 after cursor 6 was trimmed");
    // The head survives trims and never decreases.
    assert_eq!(
        c.publish(log("deep", 99, ExpectedHead::Seq(12), b"next"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 13,
            head: Some(13)
        }
    );
}

async fn log_trim_by_retention_removes_only_a_prefix(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    let t = TopicId::from("aging");
    let mut p = log("aging", 1, ExpectedHead::Unconditional, b"long-lived");
    p.retention_secs = Some(3600);
    c.publish(p).await.unwrap();
    for i in 2..=4u64 {
        let mut p = log("aging", i, ExpectedHead::Unconditional, b"short");
        p.retention_secs = Some(1);
        c.publish(p).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Frames 2..4 expired, but frame 1 before them did not: nothing goes.
    let report = hub.hub().purge_now().await.unwrap();
    assert_eq!(report.log_frames, 0);
    assert_eq!(c.fetch(&t, 0, 10).await.unwrap().messages.len(), 4);

    let t2 = TopicId::from("aging2");
    for i in 1..=3u64 {
        let mut p = log("aging2", 10 + i, ExpectedHead::Unconditional, b"short");
        p.retention_secs = Some(if i == 3 { 3600 } else { 1 });
        c.publish(p).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = hub.hub().purge_now().await.unwrap();
    assert_eq!(report.log_frames, 2);
    let f = c.fetch(&t2, 0, 10).await.unwrap();
    assert!(f.gap);
    assert_eq!(f.oldest, Some(3));
    assert_eq!(f.head, Some(3));
}

async fn key_packages_claimed_exactly_once_under_concurrency(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits = Limits::unthrottled();
        c.limits.max_key_packages = 10;
        c.limits.max_key_package_bytes = 64;
    })
    .await
    .unwrap();
    let owner = hub.client(&signing_key(1)).await.unwrap();
    let pkgs: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 8]).collect();
    assert_eq!(
        owner.upload_key_packages(pkgs.clone(), None).await.unwrap(),
        10
    );
    assert_eq!(
        owner.upload_key_packages(vec![vec![1; 8]], None).await,
        Err(ClientError::Hub(HubError::KeyPackagePoolFull {
            pool: 10,
            adding: 1,
            max: 10
        }))
    );
    assert!(matches!(
        owner.upload_key_packages(vec![vec![1; 65]], None).await,
        Err(ClientError::Hub(HubError::BadKeyPackage {
            len: 65,
            max: 64
        }))
    ));
    assert!(matches!(
        owner.upload_key_packages(vec![vec![]], None).await,
        Err(ClientError::Hub(HubError::BadKeyPackage { len: 0, .. }))
    ));
    assert_eq!(owner.key_package_status().await.unwrap(), (10, false));

    let claimers: Vec<_> = futures::future::join_all((2..=16).map(|i| hub.client_owned(i))).await;
    let dev = owner.device();
    let results =
        futures::future::join_all(claimers.iter().map(|c| c.claim_key_package(dev))).await;
    let mut got = Vec::new();
    let mut none = 0;
    for r in results {
        match r {
            Ok((p, false)) => got.push(p),
            Err(ClientError::Hub(HubError::NoKeyPackage)) => none += 1,
            other => panic!("{other:?}"),
        }
    }
    got.sort();
    assert_eq!(got, pkgs, "each package handed out exactly once");
    assert_eq!(none, 5);
    assert_eq!(owner.key_package_status().await.unwrap(), (0, false));

    owner
        .upload_key_packages(vec![], Some(vec![42; 8]))
        .await
        .unwrap();
    for c in claimers.iter().take(3) {
        assert_eq!(c.claim_key_package(dev).await.unwrap(), (vec![42; 8], true));
    }
    assert_eq!(owner.key_package_status().await.unwrap(), (0, true));
}

async fn ping_and_requests_before_auth(store: TestStore) {
    let hub = TestHub::start_on(store, |_| {}).await.unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    assert!(c.ping().await.unwrap() > 1_600_000_000_000);
    let mut raw = RawConn::open(hub.url()).await;
    raw.send(&request(5, Request::Ping)).await;
    assert!(matches!(
        raw.recv().await,
        Got::Frame(ServerFrame::Response {
            id: 5,
            result: Err(HubError::NotAuthenticated)
        })
    ));
}

#[tokio::test]
async fn group_commit_shares_flushes_between_concurrent_publishes() {
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    let clients: Vec<_> = futures::future::join_all((1..=8).map(|i| hub.client_owned(i))).await;
    let before = hub.hub().metrics();
    let publishes = clients.iter().enumerate().flat_map(|(c, client)| {
        (0..50u64).map(move |i| {
            client.publish(log(
                &format!("gc-{c}"),
                i,
                ExpectedHead::Unconditional,
                b"x",
            ))
        })
    });
    for r in futures::future::join_all(publishes).await {
        assert!(matches!(r.unwrap(), PublishOutcome::Accepted { .. }));
    }
    let after = hub.hub().metrics();
    let accepted = after.accepted - before.accepted;
    let flushes = after.flushes - before.flushes;
    assert_eq!(accepted, 400);
    assert!(
        flushes < accepted,
        "{flushes} flushes for {accepted} publishes"
    );
}

/// A new stream pushes what the device did not acknowledge, from the
/// lowest unacknowledged frame on: frames acknowledged above it come again
/// (the cursor is one number per subscription), frames below it never do.
async fn receive_resumes_after_what_was_acknowledged(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let a = hub.client(&signing_key(1)).await.unwrap();
    let key = signing_key(2);
    let b = hub.client(&key).await.unwrap();
    b.subscribe(&TopicId::from("c"), None).await.unwrap();
    for i in 0..10u64 {
        a.publish(log("c", i, ExpectedHead::Unconditional, &[i as u8]))
            .await
            .unwrap();
    }
    let mut rx = b.take_pushes().unwrap();
    b.receive().await.unwrap();
    let mut frames = Vec::new();
    for _ in 0..10 {
        match next_push(&mut rx).await {
            Some(Push::Delivery(d)) => frames.push(d.frame_ref()),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        frames.iter().map(|f| f.seq).collect::<Vec<_>>(),
        (1..=10).collect::<Vec<_>>()
    );
    // The first six and the ninth acknowledged: a new stream pushes from
    // the seventh.
    let mut acked = frames[..6].to_vec();
    acked.push(frames[8].clone());
    assert_eq!(b.ack(acked).await.unwrap(), 7);
    let b2 = hub.client(&key).await.unwrap();
    let mut rx2 = b2.take_pushes().unwrap();
    b2.receive().await.unwrap();
    let mut resumed = Vec::new();
    for _ in 0..4 {
        match next_push(&mut rx2).await {
            Some(Push::Delivery(d)) => resumed.push(d.seq),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(resumed, vec![7, 8, 9, 10]);
    no_push(&mut rx2).await;
}

#[tokio::test]
async fn a_cursor_the_store_cannot_save_is_counted_and_its_frames_come_again() {
    // The device acknowledges while the hub's store refuses writes: the
    // stream ends with a named error, the failed saves are counted for the
    // operator, and once the store writes again a new stream pushes the
    // acknowledged frames again (nothing lost; devices deduplicate).
    let faulty = FaultyKv::switch();
    let hub = TestHub::start_wrapped(faulty.store_wrap(), unthrottled)
        .await
        .unwrap();
    let a = hub.client(&signing_key(1)).await.unwrap();
    let key = signing_key(2);
    let b = hub.client(&key).await.unwrap();
    b.subscribe(&TopicId::from("c"), None).await.unwrap();
    for i in 0..3u64 {
        a.publish(log("c", i, ExpectedHead::Unconditional, &[i as u8]))
            .await
            .unwrap();
    }
    let mut rx = b.take_pushes().unwrap();
    b.receive().await.unwrap();
    let mut frames = Vec::new();
    for _ in 0..3 {
        match next_push(&mut rx).await {
            Some(Push::Delivery(d)) => frames.push(d.frame_ref()),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(hub.hub().metrics().cursor_save_failures, 0);
    faulty.fail(true);
    assert_eq!(b.ack(frames).await.unwrap(), 3);
    match next_push(&mut rx).await {
        Some(Push::ReceiveEnded(HubError::Internal { .. })) => {}
        other => panic!("expected the stream to end on the store failure: {other:?}"),
    }
    assert!(faulty.refused() > 0);
    assert!(hub.hub().metrics().cursor_save_failures >= 1);

    faulty.fail(false);
    let b2 = hub.client(&key).await.unwrap();
    let mut rx2 = b2.take_pushes().unwrap();
    b2.receive().await.unwrap();
    let mut again = Vec::new();
    for _ in 0..3 {
        match next_push(&mut rx2).await {
            Some(Push::Delivery(d)) => again.push(d.seq),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(again, vec![1, 2, 3]);
}

async fn fetch_answers_fit_in_one_frame(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits = Limits::unthrottled();
        c.limits.max_payload = 10_000;
    })
    .await
    .unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    for i in 0..5u64 {
        c.publish(log("big", i, ExpectedHead::Unconditional, &[i as u8; 4000]))
            .await
            .unwrap();
    }
    let f = c.fetch(&TopicId::from("big"), 0, 500).await.unwrap();
    assert_eq!(
        f.messages.len(),
        2,
        "two 4000-byte frames fit under 10000, three do not"
    );
    let f = c.fetch(&TopicId::from("big"), 2, 500).await.unwrap();
    assert_eq!(
        f.messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
        vec![3, 4]
    );
}

async fn retries_of_accepted_publishes_are_not_rate_limited(store: TestStore) {
    let hub = TestHub::start_on(store, |c| {
        c.limits.device_rate = Rate {
            per_sec: 0.001,
            burst: 1.0,
        };
    })
    .await
    .unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    let p = log("once", 1, ExpectedHead::Empty, b"x");
    c.publish(p.clone()).await.unwrap();
    for _ in 0..3 {
        assert_eq!(
            c.publish(p.clone()).await.unwrap(),
            PublishOutcome::Duplicate { seq: 1 }
        );
    }
}

async fn an_oversized_publish_is_refused_by_name_not_by_timeout(store: TestStore) {
    let hub = TestHub::start_on(store, |c| c.limits.max_payload = 1000)
        .await
        .unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    let started = std::time::Instant::now();
    assert_eq!(
        c.publish(log("t", 1, ExpectedHead::Unconditional, &vec![0; 1 << 20]))
            .await,
        Err(ClientError::Hub(HubError::PayloadTooLarge {
            len: 1 << 20,
            max: 1000
        }))
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered, not timed out"
    );
    c.ping().await.unwrap();
}

async fn store_id_is_kept_across_a_restart_and_new_for_a_new_store(store: TestStore) {
    let h = TestHub::start_on(store, unthrottled).await.unwrap();
    let first = h.hub().store_id();
    let c = h.client(&signing_key(1)).await.unwrap();
    assert_eq!(c.store_id(), first, "the client learns it from AuthOk");
    c.close();
    let h = h.restart(unthrottled).await.unwrap();
    assert_eq!(h.hub().store_id(), first, "read back, not drawn again");
    let c = h.client(&signing_key(1)).await.unwrap();
    assert_eq!(c.store_id(), first);
    c.close();
    h.stop().await;

    let h = TestHub::start_on(store, unthrottled).await.unwrap();
    assert_ne!(h.hub().store_id(), first, "a new store, a new identity");
    let c = h.client(&signing_key(1)).await.unwrap();
    assert_eq!(c.store_id(), h.hub().store_id());
    h.stop().await;
}

async fn auth_ok_carries_the_store_id_and_the_agreed_version(store: TestStore) {
    let hub = TestHub::start_on(store, |_| {}).await.unwrap();
    let key = signing_key(1);
    let mut c = RawConn::open(hub.url()).await;
    assert_eq!(
        (c.challenge.min_version, c.challenge.max_version),
        (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
    );
    let a = c.auth_for(&key);
    c.send(&ClientFrame::Auth(a)).await;
    match c.recv().await {
        Got::Frame(ServerFrame::AuthOk(ok)) => {
            assert_eq!(ok.store_id, hub.hub().store_id());
            assert_eq!(ok.version, PROTOCOL_VERSION);
            assert_eq!(ok.device, device_of(&key));
        }
        other => panic!("expected auth ok, got {other:?}"),
    }
}

async fn an_older_device_is_refused_by_name(store: TestStore) {
    // Version 1 had no store id in AuthOk, version 2 no writer proof in
    // Publish, version 3 delivery ids, version 4 no batched subscriptions
    // (its devices could not follow a thousand groups): an older device
    // must hear `UnsupportedVersion`, not get (or send) a frame the other
    // side cannot decode.
    for old in [1, 2, 3, 4] {
        let hub = TestHub::start_on(store, |_| {}).await.unwrap();
        let mut c = RawConn::open(hub.url()).await;
        let mut a = c.auth_for(&signing_key(1));
        a.version = old;
        c.send(&ClientFrame::Auth(a)).await;
        let got = c.recv().await;
        assert!(
            matches!(
                got,
                Got::Frame(ServerFrame::Error(HubError::UnsupportedVersion {
                    requested,
                    min: 5,
                    max: 5,
                })) if requested == old
            ),
            "version {old}: {got:?}"
        );
    }
}

#[tokio::test]
async fn a_version_1_hub_is_refused_by_name() {
    // A hub that speaks only version 1 would send an AuthOk without a store
    // id; the client refuses before authenticating.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}", listener.local_addr().unwrap());
    let hub_url = url.clone();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
        let challenge = ServerFrame::Challenge(Challenge {
            min_version: 1,
            max_version: 1,
            nonce: [7; 32],
            hub_url,
            expires_at_ms: u64::MAX,
        });
        use futures::SinkExt;
        ws.send(Message::Binary(challenge.encode().into()))
            .await
            .unwrap();
        // Hold the connection until the client gives up.
        use futures::StreamExt;
        while let Some(Ok(_)) = ws.next().await {}
    });
    let r = HubClient::connect(
        &TcpConnector,
        &url,
        &signing_key(1),
        ClientOptions::default(),
    )
    .await;
    assert_eq!(
        r.err(),
        Some(ClientError::Version {
            min: 1,
            max: 1,
            ours: PROTOCOL_VERSION
        })
    );
}

/// A client asks a topic's head without reading a frame; another device's
/// mailbox head is refused like its frames; and a request made on a closed
/// client is told apart from one whose outcome is unknown.
async fn head_is_asked_alone_and_a_request_that_never_left_says_so(store: TestStore) {
    let hub = TestHub::start_on(store, unthrottled).await.unwrap();
    let c = hub.client(&signing_key(1)).await.unwrap();
    let other = hub.client(&signing_key(2)).await.unwrap();
    let t = TopicId::from("heads");
    assert_eq!(c.head(&t).await.unwrap(), None);
    for n in 1..=3 {
        c.publish(log("heads", n, ExpectedHead::Unconditional, b"x"))
            .await
            .unwrap();
    }
    assert_eq!(c.head(&t).await.unwrap(), Some(3));
    assert_eq!(other.head(&t).await.unwrap(), Some(3));
    let theirs = TopicId::mailbox(&c.device());
    assert_eq!(
        other.head(&theirs).await,
        Err(ClientError::Hub(HubError::NotAuthorized))
    );

    c.close();
    let e = c
        .publish(log("heads", 9, ExpectedHead::Unconditional, b"y"))
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::NotSent { .. }), "{e:?}");
    assert!(!e.outcome_unknown());
    assert!(ClientError::Disconnected.outcome_unknown());
    assert_eq!(other.head(&t).await.unwrap(), Some(3), "nothing was sent");
}

/// GET `path` from the metrics endpoint at `addr`, sending `request`
/// as-is when given; answers the whole response.
async fn http(addr: std::net::SocketAddr, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8(out).unwrap()
}

#[tokio::test]
async fn the_metrics_endpoint_counts_publishes_and_refusals_and_shrugs_off_garbage() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.topic_rate = Rate {
            per_sec: 0.001,
            burst: 1.0,
        };
    })
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    hub.hub().serve_metrics(listener);
    let c = hub.client(&signing_key(1)).await.unwrap();
    c.publish(log("m", 1, ExpectedHead::Unconditional, b"one"))
        .await
        .unwrap();
    let limited = c
        .publish(log("m", 2, ExpectedHead::Unconditional, b"two"))
        .await;
    assert!(
        matches!(limited, Err(ClientError::Hub(HubError::RateLimited { .. }))),
        "{limited:?}"
    );
    // A delivery pushed and acknowledged.
    let sub = hub.client(&signing_key(2)).await.unwrap();
    sub.subscribe(&TopicId::from("m2"), None).await.unwrap();
    let mut rx = sub.take_pushes().unwrap();
    sub.receive().await.unwrap();
    c.publish(mailbox("m2", 3, b"three")).await.unwrap();
    let Some(Push::Delivery(d)) = next_push(&mut rx).await else {
        panic!("no delivery")
    };
    assert_eq!(sub.ack(vec![d.frame_ref()]).await.unwrap(), 1);

    // A stranger's garbage, a wrong path and a request that never ends
    // are answered (or cut) without effect on the endpoint.
    assert!(http(addr, b"\x00\x01garbage\r\n\r\n")
        .await
        .starts_with("HTTP/1.1 400"));
    assert!(http(addr, b"GET /admin HTTP/1.1\r\n\r\n")
        .await
        .starts_with("HTTP/1.1 404"));
    let endless = vec![b'a'; 64 * 1024];
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(&endless).await;
    })
    .await;

    // An answer signed for another hub is refused, and counted by reason.
    let mut raw = RawConn::open(hub.url()).await;
    let wrong = signed_auth(
        &signing_key(9),
        &raw.challenge.clone(),
        "ws://elsewhere.example",
    );
    raw.send(&ClientFrame::Auth(wrong)).await;
    assert!(matches!(
        raw.recv().await,
        Got::Frame(ServerFrame::Error(HubError::WrongHub { .. }))
    ));

    let text = http(addr, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(
        text.contains("hubsync_hub_publishes_total{outcome=\"accepted\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("hubsync_hub_rate_limited_total{scope=\"topic\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("hubsync_hub_auth_failures_total{reason=\"wrong_hub\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("hubsync_hub_open_connections "), "{text}");
    // Every accepted publish committed once and waited for durability once.
    let count = |name: &str| -> u64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name}: {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(count("hubsync_hub_store_commit_seconds_count ") >= 1);
    assert!(count("hubsync_hub_store_bytes ") > 0, "sled says its size");
    assert_eq!(count("hubsync_hub_receive_streams "), 1);
    assert_eq!(count("hubsync_hub_deliveries_pushed_total "), 1);
    assert_eq!(count("hubsync_hub_deliveries_acked_total "), 1);
    assert!(count("hubsync_hub_store_durable_wait_seconds_count ") >= 1);
    hub.stop().await;
}

on_both_stores!(
    auth_accepts_a_valid_signature_and_refuses_each_bad_one,
    publish_fetch_and_cas_answers,
    duplicate_conflict_and_replay_only,
    publish_limits_are_named_errors,
    topic_rate_limit_spans_devices,
    subscriptions_are_limited_durable_and_never_clamped,
    subscription_changes_in_one_request_each_stand_alone,
    subscription_changes_have_their_own_bucket,
    a_device_follows_thirteen_thousand_topics,
    mailbox_reaches_every_subscriber_but_the_sender_until_acked,
    receive_stream_cut_and_resumed_loses_nothing_and_repeats_nothing_acked,
    cas_race_has_exactly_one_winner,
    log_trim_by_depth_reports_gap,
    log_trim_by_retention_removes_only_a_prefix,
    key_packages_claimed_exactly_once_under_concurrency,
    ping_and_requests_before_auth,
    receive_resumes_after_what_was_acknowledged,
    fetch_answers_fit_in_one_frame,
    retries_of_accepted_publishes_are_not_rate_limited,
    an_oversized_publish_is_refused_by_name_not_by_timeout,
    store_id_is_kept_across_a_restart_and_new_for_a_new_store,
    auth_ok_carries_the_store_id_and_the_agreed_version,
    an_older_device_is_refused_by_name,
    head_is_asked_alone_and_a_request_that_never_left_says_so,
);
