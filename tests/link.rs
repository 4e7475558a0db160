//! `HubLink` and `HubDirectory` against real hubs over loopback: routing,
//! reconnection across hub restarts, backoff, timeouts and stop.

mod common;

use common::*;
use hubsync::client::{ClientError, ClientOptions};
use hubsync::clock::Clock;
use hubsync::device::directory::{HubDirectory, HubInfo, HubState};
use hubsync::device::link::{HubLink, LinkConfig, LinkError, LinkStatus};
use hubsync::hub::{HubConfig, Limits};
use hubsync::kv::{KvStore, MemKv};
use hubsync::rng::SharedRng;
use hubsync::testkit::{signing_key, TestHub};
use hubsync::transport::TcpConnector;
use hubsync::wire::{
    Delivery, ExpectedHead, FrameRef, HubError, PublishOutcome, StoreId, TopicId, PROTOCOL_VERSION,
};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::Receiver;

const WAIT: Duration = Duration::from_secs(10);

fn unthrottled(c: &mut HubConfig) {
    c.limits = Limits::unthrottled();
}

/// Quick retries, so tests spend little time waiting.
fn fast() -> LinkConfig {
    LinkConfig {
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_millis(500),
        jitter: 0.5,
        stable_after: Duration::from_secs(5),
        client: ClientOptions {
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(3),
            ..ClientOptions::default()
        },
    }
}

fn link(url: &str, device: u64, config: LinkConfig) -> HubLink {
    HubLink::start(
        url,
        signing_key(device),
        Arc::new(TcpConnector),
        config,
        SharedRng::seeded(device),
    )
}

async fn hub_at(dir: &Path, addr: &str) -> TestHub {
    // The port was just released by the previous hub: retry a little.
    let mut tries = 0;
    loop {
        match TestHub::start_at(dir, addr, unthrottled).await {
            Ok(h) => return h,
            Err(e) if tries < 50 => {
                tries += 1;
                tracing::debug!(error = %e, "hub restart retry");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("hub restart on {addr}: {e}"),
        }
    }
}

async fn recv(rx: &mut Receiver<Delivery>) -> Delivery {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("a delivery in time")
        .expect("receiver open")
}

async fn nothing(rx: &mut Receiver<Delivery>) {
    let r = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await;
    assert!(r.is_err(), "expected no delivery, got {r:?}");
}

/// Wait until the link's status satisfies `pred`.
async fn status_until(link: &HubLink, pred: impl Fn(&LinkStatus) -> bool) -> LinkStatus {
    let mut rx = link.status();
    let s = tokio::time::timeout(WAIT, rx.wait_for(|s| pred(s)))
        .await
        .expect("status in time")
        .expect("status channel open")
        .clone();
    s
}

/// Record every status the link publishes from now on.
fn record(link: &HubLink) -> Arc<Mutex<Vec<LinkStatus>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut rx = link.status();
    let out = seen.clone();
    tokio::spawn(async move {
        loop {
            let s = rx.borrow_and_update().clone();
            let stop = s == LinkStatus::Stopped;
            out.lock().unwrap().push(s);
            if stop || rx.changed().await.is_err() {
                return;
            }
        }
    });
    seen
}

/// Poll the directory until `url`'s entry satisfies `pred`.
async fn dir_until(
    dir: &HubDirectory,
    url: &str,
    pred: impl Fn(&HubInfo, bool) -> bool,
) -> HubInfo {
    for _ in 0..200 {
        if let Some((info, fresh)) = dir.info(url) {
            if pred(&info, fresh) {
                return info;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "directory entry of {url} never matched: {:?}",
        dir.info(url)
    );
}

fn payloads(ds: &[Delivery]) -> Vec<Vec<u8>> {
    ds.iter().map(|d| d.payload.clone()).collect()
}

#[tokio::test]
async fn link_connects_publishes_fetches_and_handles_key_packages() {
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    let a = link(hub.url(), 1, fast());
    let b = link(&format!("{}/", hub.url()), 2, fast());
    assert_eq!(b.url(), hub.url(), "a trailing slash is dropped");
    assert!(a.wait_connected(WAIT).await);
    assert!(a.is_connected());
    assert_eq!(*a.status().borrow(), LinkStatus::Connected);

    let t = TopicId::from("log");
    assert_eq!(
        a.publish(log("log", 1, ExpectedHead::Empty, b"one"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 1,
            head: Some(1)
        }
    );
    // A retry with the same publish id is recognised.
    assert_eq!(
        a.publish(log("log", 1, ExpectedHead::Empty, b"one"))
            .await
            .unwrap(),
        PublishOutcome::Duplicate { seq: 1 }
    );
    assert_eq!(
        b.publish(log("log", 2, ExpectedHead::Seq(1), b"two"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 2,
            head: Some(2)
        }
    );
    let f = a.fetch(&t, 0, 10).await.unwrap();
    assert_eq!(f.head, Some(2));
    assert_eq!(
        f.messages
            .iter()
            .map(|m| m.payload.clone())
            .collect::<Vec<_>>(),
        vec![b"one".to_vec(), b"two".to_vec()]
    );

    assert_eq!(
        a.upload_key_packages(vec![b"kp1".to_vec()], Some(b"last".to_vec()))
            .await
            .unwrap(),
        1
    );
    assert_eq!(a.key_package_status().await.unwrap(), (1, true));
    let dev_a = device_of(&signing_key(1));
    assert_eq!(
        b.claim_key_package(dev_a).await.unwrap(),
        (b"kp1".to_vec(), false)
    );
    assert_eq!(
        b.claim_key_package(dev_a).await.unwrap(),
        (b"last".to_vec(), true)
    );
    // A hub refusal comes back as itself.
    let refused = a
        .publish(log(
            "log",
            3,
            ExpectedHead::Unconditional,
            &vec![0u8; (1 << 20) + 1],
        ))
        .await;
    assert!(
        matches!(
            refused,
            Err(LinkError::Client(ClientError::Hub(
                HubError::PayloadTooLarge { .. }
            )))
        ),
        "{refused:?}"
    );

    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn deliveries_are_routed_by_topic_to_their_receivers() {
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    let l = link(hub.url(), 1, fast());
    let mut one = l.subscribe(TopicId::from("one"), None);
    let mut two = l.subscribe(TopicId::from("two"), None);
    assert!(l.wait_connected(WAIT).await);
    l.flush_subscriptions().await.unwrap();

    let publisher = hub.client(&signing_key(9)).await.unwrap();
    publisher.publish(mailbox("one", 1, b"1a")).await.unwrap();
    publisher.publish(mailbox("two", 2, b"2a")).await.unwrap();
    publisher
        .publish(log("one", 3, ExpectedHead::Unconditional, b"1b"))
        .await
        .unwrap();
    publisher.publish(mailbox("two", 4, b"2b")).await.unwrap();

    let got_one = vec![recv(&mut one).await, recv(&mut one).await];
    let got_two = vec![recv(&mut two).await, recv(&mut two).await];
    assert_eq!(payloads(&got_one), vec![b"1a".to_vec(), b"1b".to_vec()]);
    assert_eq!(payloads(&got_two), vec![b"2a".to_vec(), b"2b".to_vec()]);
    assert!(got_one.iter().all(|d| d.topic == TopicId::from("one")));
    assert!(got_two.iter().all(|d| d.topic == TopicId::from("two")));
    nothing(&mut one).await;
    nothing(&mut two).await;

    // A second subscribe replaces the receiver; the first one ends.
    let mut one_again = l.subscribe(TopicId::from("one"), None);
    assert!(one.recv().await.is_none(), "replaced receiver ends");
    publisher.publish(mailbox("one", 5, b"1c")).await.unwrap();
    assert_eq!(recv(&mut one_again).await.payload, b"1c".to_vec());

    // After unsubscribe, the topic's receiver ends and nothing more comes.
    l.unsubscribe(&TopicId::from("two")).await;
    assert!(two.recv().await.is_none());
    publisher.publish(mailbox("two", 6, b"2c")).await.unwrap();
    publisher.publish(mailbox("one", 7, b"1d")).await.unwrap();
    assert_eq!(recv(&mut one_again).await.payload, b"1d".to_vec());
    l.stop().await;
}

/// Many subscriptions at once go in batches; a hub whose subscription
/// bucket runs dry paces them, and every one is in place in the end, on the
/// same connection.
#[tokio::test]
async fn a_rate_limited_burst_of_subscriptions_is_paced_and_completes() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.subscription_rate = hubsync::hub::Rate {
            per_sec: 20.0,
            burst: 2.0,
        };
    })
    .await
    .unwrap();
    let l = link(hub.url(), 1, fast());
    assert!(l.wait_connected(WAIT).await);
    let _first = l.subscribe(TopicId::from("first"), None);
    l.flush_subscriptions().await.unwrap();
    let mut receivers: Vec<_> = (0..1500)
        .map(|i| l.subscribe(TopicId::from(format!("t{i}").as_str()), None))
        .collect();
    tokio::time::timeout(WAIT, l.flush_subscriptions())
        .await
        .expect("paced, not stuck")
        .unwrap();
    assert!(hub.hub().metrics().rate_limited.subscriptions >= 1);
    assert_eq!(*l.connections().borrow(), 1, "no reconnect");
    let publisher = hub.client(&signing_key(9)).await.unwrap();
    for i in [0, 999, 1000, 1499] {
        publisher
            .publish(mailbox(&format!("t{i}"), i, b"x"))
            .await
            .unwrap();
        assert_eq!(recv(&mut receivers[i as usize]).await.seq, 1);
    }
    l.stop().await;
}

/// Frames trimmed from a log (here by depth) before the receive stream
/// pushed them are reported on the link, not only logged: the pushes after
/// them move on, so the device must hear of the gap.
#[tokio::test]
async fn frames_trimmed_before_they_were_pushed_are_reported() {
    let hub = TestHub::start_with(|c| {
        c.limits = Limits::unthrottled();
        c.limits.max_log_depth = 2;
    })
    .await
    .unwrap();
    let first = link(hub.url(), 1, fast());
    let mut rx = first.subscribe(TopicId::from("t"), None);
    assert!(first.wait_connected(WAIT).await);
    first.flush_subscriptions().await.unwrap();
    let publisher = hub.client(&signing_key(9)).await.unwrap();
    let p = |i: u64| log("t", i, ExpectedHead::Unconditional, &[i as u8]);
    publisher.publish(p(1)).await.unwrap();
    let d = recv(&mut rx).await;
    first.ack(vec![d.frame_ref()]).await;
    // The hub saves the cursor a moment after the ack.
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.stop().await;

    // Five more while the device is away: the log keeps the last two.
    for i in 2..=6 {
        publisher.publish(p(i)).await.unwrap();
    }
    let again = link(hub.url(), 1, fast());
    let mut missed = again.frames_missed();
    let mut rx = again.subscribe(TopicId::from("t"), None);
    assert_eq!(recv(&mut rx).await.seq, 5);
    assert_eq!(recv(&mut rx).await.seq, 6);
    let log = tokio::time::timeout(WAIT, missed.wait_for(|l| l.total >= 1))
        .await
        .expect("reported in time")
        .unwrap()
        .clone();
    assert_eq!(
        log.recent.back(),
        Some(&(
            TopicId::from("t"),
            HubError::FramesMissed {
                topic: TopicId::from("t"),
                after_seq: 1,
                through_seq: 4
            }
        ))
    );
    again.stop().await;
}

/// Device 1 subscribed to `topic` at the hub in an earlier connection (say,
/// before a restart), and no consumer has asked for it on a link yet.
async fn subscribed_earlier(hub: &TestHub, topic: &str) {
    let same_device = hub.client(&signing_key(1)).await.unwrap();
    same_device
        .subscribe(&TopicId::from(topic), None)
        .await
        .unwrap();
    same_device.close();
}

#[tokio::test]
async fn deliveries_for_an_unrouted_topic_wait_for_its_subscriber() {
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    // The device subscribed at the hub earlier (say, before a restart) but
    // no consumer has asked for the topic on this link yet.
    subscribed_earlier(&hub, "later").await;

    let l = link(hub.url(), 1, fast());
    let mut now = l.subscribe(TopicId::from("now"), None);
    assert!(l.wait_connected(WAIT).await);
    let publisher = hub.client(&signing_key(9)).await.unwrap();
    publisher
        .publish(mailbox("later", 1, b"early-1"))
        .await
        .unwrap();
    publisher
        .publish(mailbox("later", 2, b"early-2"))
        .await
        .unwrap();
    publisher
        .publish(mailbox("now", 3, b"marker"))
        .await
        .unwrap();
    // The marker was pushed after the two early ones, so they are buffered.
    assert_eq!(recv(&mut now).await.payload, b"marker".to_vec());

    let mut later = l.subscribe(TopicId::from("later"), None);
    let first = recv(&mut later).await;
    let second = recv(&mut later).await;
    assert_eq!(
        payloads(&[first, second]),
        vec![b"early-1".to_vec(), b"early-2".to_vec()]
    );
    publisher
        .publish(mailbox("later", 4, b"live"))
        .await
        .unwrap();
    assert_eq!(recv(&mut later).await.payload, b"live".to_vec());
    l.stop().await;
}

#[tokio::test]
async fn hub_restart_on_the_same_store_reconnects_resumes_and_skips_acked() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_at(dir.path(), "127.0.0.1:0").await;
    let addr = hub.addr().to_string();
    let url = hub.url().to_string();
    let l = link(&url, 1, fast());
    let statuses = record(&l);
    let mut rx = l.subscribe(TopicId::from("t"), None);
    assert!(l.wait_connected(WAIT).await);

    let publisher = hub.client(&signing_key(9)).await.unwrap();
    for (i, p) in [b"m1", b"m2", b"m3"].iter().enumerate() {
        publisher
            .publish(mailbox("t", i as u64 + 1, *p))
            .await
            .unwrap();
    }
    let m1 = recv(&mut rx).await;
    let m2 = recv(&mut rx).await;
    let m3 = recv(&mut rx).await;
    assert_eq!(
        payloads(&[m1.clone(), m2.clone(), m3.clone()]),
        vec![b"m1".to_vec(), b"m2".to_vec(), b"m3".to_vec()]
    );
    // m1 and m2 are acked (the hub has them before `ack` returns, and saves
    // them at the latest when it stops); m3 is not.
    l.ack(vec![m1.frame_ref(), m2.frame_ref()]).await;

    publisher.close();
    hub.stop().await;
    status_until(&l, |s| matches!(s, LinkStatus::Reconnecting { .. })).await;
    let hub = hub_at(dir.path(), &addr).await;
    assert_eq!(hub.url(), url);

    // By itself, without retry_now.
    assert!(l.wait_connected(WAIT).await);
    let publisher = hub.client(&signing_key(9)).await.unwrap();
    publisher.publish(mailbox("t", 4, b"m4")).await.unwrap();
    let mut after = Vec::new();
    loop {
        let d = recv(&mut rx).await;
        let last = d.payload == b"m4";
        after.push(d);
        if last {
            break;
        }
    }
    assert_eq!(
        payloads(&after),
        vec![b"m3".to_vec(), b"m4".to_vec()],
        "unacked m3 comes again, acked m1 and m2 do not"
    );
    assert_eq!(after[0].frame_ref(), m3.frame_ref());
    l.ack(after.iter().map(|d| d.frame_ref()).collect()).await;
    nothing(&mut rx).await;

    let seen = statuses.lock().unwrap().clone();
    let lost = seen
        .iter()
        .position(|s| matches!(s, LinkStatus::Reconnecting { .. }))
        .expect("went Reconnecting");
    assert!(
        seen[lost..].contains(&LinkStatus::Connected),
        "then Connected: {seen:?}"
    );
    assert_eq!(seen[0], LinkStatus::Connecting);
    l.stop().await;
}

#[tokio::test]
async fn hub_restart_on_a_fresh_store_gets_the_subscriptions_again() {
    // A hub that lost its store knows no subscription: only the link's
    // re-subscription makes a later publish reach the receiver.
    let first = tempfile::tempdir().unwrap();
    let hub = hub_at(first.path(), "127.0.0.1:0").await;
    let addr = hub.addr().to_string();
    let l = link(hub.url(), 1, fast());
    let mut rx = l.subscribe(TopicId::from("t"), None);
    assert!(l.wait_connected(WAIT).await);
    hub.stop().await;
    status_until(&l, |s| matches!(s, LinkStatus::Reconnecting { .. })).await;

    let second = tempfile::tempdir().unwrap();
    let hub = hub_at(second.path(), &addr).await;
    assert!(l.wait_connected(WAIT).await);
    let publisher = hub.client(&signing_key(9)).await.unwrap();
    publisher.publish(mailbox("t", 1, b"after")).await.unwrap();
    assert_eq!(recv(&mut rx).await.payload, b"after".to_vec());
    l.stop().await;
}

#[tokio::test]
async fn retry_now_skips_a_long_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_at(dir.path(), "127.0.0.1:0").await;
    let addr = hub.addr().to_string();
    let config = LinkConfig {
        backoff_base: Duration::from_secs(10),
        backoff_max: Duration::from_secs(60),
        jitter: 0.0,
        ..fast()
    };
    let l = link(hub.url(), 1, config);
    assert!(l.wait_connected(WAIT).await);
    hub.stop().await;
    let s = status_until(&l, |s| matches!(s, LinkStatus::Reconnecting { .. })).await;
    match s {
        LinkStatus::Reconnecting {
            attempt, retry_in, ..
        } => {
            assert_eq!(attempt, 1);
            assert_eq!(retry_in, Duration::from_secs(10));
        }
        other => panic!("{other:?}"),
    }
    let _hub = hub_at(dir.path(), &addr).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!l.is_connected(), "still waiting out the 10 s backoff");
    l.retry_now();
    assert!(
        l.wait_connected(Duration::from_secs(3)).await,
        "retry_now connects well before the 10 s backoff ends"
    );
    l.stop().await;
}

#[tokio::test]
async fn requests_fail_not_connected_while_the_hub_is_down() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("ws://127.0.0.1:{port}");
    let timeout = Duration::from_millis(300);
    let mut config = fast();
    config.client.request_timeout = timeout;
    let l = link(&url, 1, config);

    let started = tokio::time::Instant::now();
    let r = l.publish(mailbox("t", 1, b"x")).await;
    assert_eq!(r, Err(LinkError::NotConnected { url: url.clone() }));
    assert!(started.elapsed() >= timeout, "waited the request timeout");
    assert!(started.elapsed() < WAIT);
    assert_eq!(
        l.fetch(&TopicId::from("t"), 0, 10).await,
        Err(LinkError::NotConnected { url: url.clone() })
    );
    assert_eq!(
        l.key_package_status().await,
        Err(LinkError::NotConnected { url: url.clone() })
    );
    let s = status_until(&l, |s| matches!(s, LinkStatus::Reconnecting { .. })).await;
    match s {
        LinkStatus::Reconnecting { last_error, .. } => {
            assert!(last_error.contains("cannot reach"), "{last_error}")
        }
        other => panic!("{other:?}"),
    }
    // An ack while disconnected is dropped without error or wait.
    l.ack(vec![FrameRef {
        topic: TopicId::from("t"),
        seq: 1,
    }])
    .await;
    l.stop().await;
}

#[tokio::test]
async fn stop_ends_with_status_stopped() {
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    let l = link(hub.url(), 1, fast());
    let mut rx = l.subscribe(TopicId::from("t"), None);
    assert!(l.wait_connected(WAIT).await);
    let other = l.clone();
    l.stop().await;
    assert_eq!(*other.status().borrow(), LinkStatus::Stopped);
    assert!(!other.is_connected());
    assert!(rx.recv().await.is_none(), "receivers end");
    assert_eq!(
        other.publish(mailbox("t", 1, b"x")).await,
        Err(LinkError::Stopped)
    );
    let mut late = other.subscribe(TopicId::from("u"), None);
    assert!(
        late.recv().await.is_none(),
        "a subscribe after stop is closed"
    );
    assert!(!other.wait_connected(Duration::from_millis(100)).await);
    other.stop().await; // idempotent

    // A link that never connected stops just as well.
    let never = link("ws://127.0.0.1:1", 2, fast());
    tokio::time::timeout(WAIT, never.stop()).await.unwrap();
    assert_eq!(*never.status().borrow(), LinkStatus::Stopped);
}

#[tokio::test]
async fn same_device_twice_backs_off_instead_of_hammering() {
    // Two links of one device replace each other's receive stream: each
    // connection is cut right after it came up. Short connections never
    // reset the backoff, so the attempts slow down.
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    let config = LinkConfig {
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(400),
        jitter: 0.0,
        ..fast()
    };
    let a = link(hub.url(), 1, config.clone());
    let seen = record(&a);
    let b = link(hub.url(), 1, config);
    tokio::time::sleep(Duration::from_secs(3)).await;
    a.stop().await;
    b.stop().await;
    let seen = seen.lock().unwrap().clone();
    let ended: Vec<&LinkStatus> = seen
        .iter()
        .filter(|s| matches!(s, LinkStatus::Reconnecting { last_error, .. } if last_error.contains("receive stream ended")))
        .collect();
    assert!(
        !ended.is_empty(),
        "the other stream replaced ours: {seen:?}"
    );
    let max_attempt = seen
        .iter()
        .filter_map(|s| match s {
            LinkStatus::Reconnecting { attempt, .. } => Some(*attempt),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    assert!(max_attempt >= 3, "backoff kept growing: {seen:?}");
    let connects = seen.iter().filter(|s| **s == LinkStatus::Connected).count();
    // 3 s at 20, 40, ... 400 ms is at most a dozen attempts.
    assert!(connects <= 15, "{connects} connects in 3 s: hammering");
}

#[tokio::test]
async fn directory_keeps_a_lost_hub_marks_it_stale_and_reloads_it() {
    let hub_dir = tempfile::tempdir().unwrap();
    let hub = hub_at(hub_dir.path(), "127.0.0.1:0").await;
    let url = hub.url().to_string();
    let kv = MemKv::new();
    let store: Arc<dyn KvStore> = Arc::new(kv.clone());
    let ttl = Duration::from_secs(2);
    let dir = HubDirectory::open(store.clone(), Clock::System, ttl).unwrap();
    let l = link(&url, 1, fast());
    dir.track(&l);
    assert!(l.wait_connected(WAIT).await);

    dir_until(&dir, &url, |i, fresh| {
        i.status == HubState::Connected && fresh
    })
    .await;
    // Connected for longer than the TTL: still fresh (refreshed while up).
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    let (info, fresh) = dir.info(&url).unwrap();
    assert!(fresh, "a connected hub stays fresh: {info:?}");
    assert_eq!(info.protocol_version, Some(PROTOCOL_VERSION));
    let connected_at = info.last_connected_ms.expect("connected at");

    hub.stop().await;
    let gone = dir_until(&dir, &url, |_, fresh| !fresh).await;
    assert!(
        matches!(gone.status, HubState::Reconnecting { .. }),
        "{gone:?}"
    );
    assert_eq!(gone.last_connected_ms, Some(connected_at));
    assert!(gone.last_error.is_some());
    assert_eq!(dir.list().len(), 1, "kept although unreachable");

    // Reload after a crash: the flushed entry is all there.
    l.stop().await;
    dir.stop().await;
    kv.crash();
    let again = HubDirectory::open(store, Clock::System, ttl).unwrap();
    let (reloaded, fresh) = again.info(&url).expect("reloaded");
    assert!(!fresh);
    assert_eq!(reloaded.url, url);
    assert_eq!(reloaded.last_connected_ms, Some(connected_at));
    assert_eq!(reloaded.protocol_version, Some(PROTOCOL_VERSION));
    assert_eq!(reloaded.status, HubState::Stopped, "the link's last status");
    assert!(reloaded.last_error.is_some());
}

/// A hub over an in-memory store whose `crash` loses what was not flushed.
async fn mem_hub(kv: &MemKv, addr: &str) -> (hubsync::hub::Hub, String) {
    let mut tries = 0;
    let listener = loop {
        match hubsync::transport::TcpAcceptor::bind(addr).await {
            Ok(l) => break l,
            Err(e) if tries < 50 => {
                tries += 1;
                tracing::debug!(error = %e, "rebind retry");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("bind {addr}: {e}"),
        }
    };
    let addr = listener.local_addr().unwrap().to_string();
    let url = format!("ws://{addr}");
    let mut config = HubConfig::new(url.clone());
    unthrottled(&mut config);
    let store: Arc<dyn KvStore> = Arc::new(kv.clone());
    let hub = hubsync::hub::Hub::start(store, config, Clock::System, SharedRng::seeded(5)).unwrap();
    hub.serve(listener);
    (hub, addr)
}

#[tokio::test]
async fn an_ack_answered_before_a_hub_crash_is_kept() {
    // The hub answers an ack before it saves the cursor (a moment later, or
    // when the stream ends); a crash of the store right after the answer,
    // followed by the hub's shutdown, still keeps it: the stream's last save
    // lands after the crash. (A crash of the whole process before that save
    // pushes the frame again: delivery is at least once.)
    let kv = MemKv::new();
    let (hub, addr) = mem_hub(&kv, "127.0.0.1:0").await;
    let url = format!("ws://{addr}");
    let l = link(&url, 1, fast());
    let mut rx = l.subscribe(TopicId::from("t"), None);
    assert!(l.wait_connected(WAIT).await);
    l.flush_subscriptions().await.unwrap();
    let publisher = hubsync::client::HubClient::connect(
        &TcpConnector,
        &url,
        &signing_key(9),
        ClientOptions::default(),
    )
    .await
    .unwrap();
    publisher.publish(mailbox("t", 1, b"m1")).await.unwrap();
    let m1 = recv(&mut rx).await;
    l.ack(vec![m1.frame_ref()]).await;
    kv.crash();
    publisher.close();
    hub.shutdown().await;
    drop(hub);

    let (hub, _) = mem_hub(&kv, &addr).await;
    assert!(l.wait_connected(WAIT).await);
    let publisher = hubsync::client::HubClient::connect(
        &TcpConnector,
        &url,
        &signing_key(9),
        ClientOptions::default(),
    )
    .await
    .unwrap();
    publisher.publish(mailbox("t", 2, b"m2")).await.unwrap();
    let next = recv(&mut rx).await;
    assert_eq!(next.payload, b"m2".to_vec(), "m1 was acked: not again");
    l.ack(vec![next.frame_ref()]).await;
    nothing(&mut rx).await;
    l.stop().await;
    hub.shutdown().await;
}

#[tokio::test]
async fn deliveries_beyond_the_buffer_come_back_by_a_resync() {
    // More deliveries for a topic without a route than the link buffers:
    // the overflow is dropped unacked and fetched again once the topic is
    // subscribed, by a reconnect. Nothing failed, so that reconnect does not
    // wait out a backoff: with a minute's backoff, everything still arrives
    // within the test's wait.
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    subscribed_earlier(&hub, "late").await;
    let config = LinkConfig {
        backoff_base: Duration::from_secs(60),
        backoff_max: Duration::from_secs(60),
        ..fast()
    };
    let l = link(hub.url(), 1, config);
    let statuses = record(&l);
    let mut marker = l.subscribe(TopicId::from("marker"), None);
    assert!(l.wait_connected(WAIT).await);

    let n = hubsync::device::link::BUFFER_CAPACITY as u64 + 100;
    let publisher = hub.client(&signing_key(9)).await.unwrap();
    let publishes = (0..n).map(|i| {
        let p = publisher.clone();
        async move { p.publish(mailbox("late", i + 1, &i.to_be_bytes())).await }
    });
    for r in futures::future::join_all(publishes).await {
        assert!(matches!(r, Ok(PublishOutcome::Accepted { .. })), "{r:?}");
    }
    publisher
        .publish(mailbox("marker", n + 1, b"marker"))
        .await
        .unwrap();
    assert_eq!(recv(&mut marker).await.payload, b"marker".to_vec());

    let mut late = l.subscribe(TopicId::from("late"), None);
    let mut distinct = std::collections::BTreeSet::new();
    while (distinct.len() as u64) < n {
        let d = recv(&mut late).await;
        l.ack(vec![d.frame_ref()]).await;
        distinct.insert(d.payload);
    }
    let seen = statuses.lock().unwrap().clone();
    assert!(
        seen.iter().any(|s| matches!(s, LinkStatus::Reconnecting { last_error, retry_in, .. } if last_error.contains("resynchronising") && retry_in.is_zero())),
        "{seen:?}"
    );
    l.stop().await;
}

/// Wait until the link's store identity satisfies `pred`.
async fn store_id_until(
    link: &HubLink,
    pred: impl Fn(&Option<StoreId>) -> bool,
) -> Option<StoreId> {
    let mut rx = link.store_id();
    let id = *tokio::time::timeout(WAIT, rx.wait_for(|id| pred(id)))
        .await
        .expect("store id in time")
        .expect("store id channel open");
    id
}

/// Receive until the delivery with `payload`, acking everything on the way
/// (earlier unacked deliveries may come again first).
async fn recv_until(l: &HubLink, rx: &mut Receiver<Delivery>, payload: &[u8]) -> Delivery {
    loop {
        let d = recv(rx).await;
        l.ack(vec![d.frame_ref()]).await;
        if d.payload == payload {
            return d;
        }
    }
}

/// Publish `payloads` on mailbox topic `t` as device 9, receive and ack them
/// all on `l`; answers the highest sequence number.
async fn deliver_and_ack(
    url: &str,
    l: &HubLink,
    rx: &mut Receiver<Delivery>,
    first_pid: u64,
    payloads: &[&[u8]],
) -> u64 {
    let publisher = hubsync::client::HubClient::connect(
        &TcpConnector,
        url,
        &signing_key(9),
        ClientOptions::default(),
    )
    .await
    .unwrap();
    for (i, p) in payloads.iter().enumerate() {
        publisher
            .publish(mailbox("t", first_pid + i as u64, p))
            .await
            .unwrap();
    }
    let mut last = 0;
    let mut frames = Vec::new();
    for p in payloads {
        let d = recv(rx).await;
        assert_eq!(d.payload, p.to_vec());
        last = d.seq;
        frames.push(d.frame_ref());
    }
    l.ack(frames).await;
    publisher.close();
    last
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Stop `hub` and wait until its sled directory is free again.
async fn stop_and_release(hub: TestHub, dir: &Path) {
    hub.stop().await;
    let kv = hubsync::testkit::open_sled(dir).await.unwrap();
    kv.flush().unwrap();
    drop(kv);
}

#[tokio::test]
async fn hub_restart_on_an_empty_store_is_noticed_and_delivers_what_it_gets() {
    // A hub that comes back on an empty store has a new identity, which the
    // link publishes; its topics start again at 1, and the link, which
    // keeps no position of its own, receives them.
    let first = tempfile::tempdir().unwrap();
    let hub = hub_at(first.path(), "127.0.0.1:0").await;
    let addr = hub.addr().to_string();
    let url = hub.url().to_string();
    let l = link(&url, 1, fast());
    assert_eq!(*l.store_id().borrow(), None, "unknown before a connection");
    let mut rx = l.subscribe(TopicId::from("t"), None);
    assert!(l.wait_connected(WAIT).await);
    l.flush_subscriptions().await.unwrap();
    let old = store_id_until(&l, |id| id.is_some()).await;
    assert_eq!(old, Some(hub.hub().store_id()));

    let last = deliver_and_ack(&url, &l, &mut rx, 1, &[b"m1", b"m2", b"m3", b"m4", b"m5"]).await;
    assert_eq!(last, 5);
    hub.stop().await;
    status_until(&l, |s| matches!(s, LinkStatus::Reconnecting { .. })).await;

    let second = tempfile::tempdir().unwrap();
    let hub = hub_at(second.path(), &addr).await;
    let new = store_id_until(&l, |id| *id != old).await;
    assert_eq!(
        new,
        Some(hub.hub().store_id()),
        "the watch shows the new store"
    );
    l.flush_subscriptions().await.unwrap();

    let publisher = hub.client(&signing_key(9)).await.unwrap();
    publisher.publish(mailbox("t", 6, b"after")).await.unwrap();
    let d = recv(&mut rx).await;
    assert_eq!(d.payload, b"after".to_vec());
    assert_eq!(d.seq, 1, "the new store's first frame");
    l.stop().await;
}

#[tokio::test]
async fn hub_restored_from_an_older_copy_delivers_what_it_gets_after_it() {
    // The same store identity, but the store went back: the cursors and
    // topics of the copy. Frames published after the restore reach the
    // link although their sequence numbers were used before.
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_at(dir.path(), "127.0.0.1:0").await;
    let addr = hub.addr().to_string();
    let url = hub.url().to_string();
    let id = hub.hub().store_id();
    let l = link(&url, 1, fast());
    let mut rx = l.subscribe(TopicId::from("t"), None);
    assert!(l.wait_connected(WAIT).await);
    l.flush_subscriptions().await.unwrap();
    assert_eq!(
        deliver_and_ack(&url, &l, &mut rx, 1, &[b"m1", b"m2"]).await,
        2
    );

    // The operator's backup, taken while the hub is stopped.
    stop_and_release(hub, dir.path()).await;
    let backup = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), backup.path());
    status_until(&l, |s| matches!(s, LinkStatus::Reconnecting { .. })).await;

    let hub = hub_at(dir.path(), &addr).await;
    assert!(l.wait_connected(WAIT).await);
    let last = deliver_and_ack(&url, &l, &mut rx, 3, &[b"m3", b"m4", b"m5"]).await;
    assert_eq!(last, 5);

    // Restored from the backup: the topic ends at 2 again.
    stop_and_release(hub, dir.path()).await;
    std::fs::remove_dir_all(dir.path()).unwrap();
    copy_dir(backup.path(), dir.path());
    let hub = hub_at(dir.path(), &addr).await;
    assert_eq!(
        hub.hub().store_id(),
        id,
        "a restored copy keeps its identity"
    );

    assert!(l.wait_connected(WAIT).await);
    let publisher = hub.client(&signing_key(9)).await.unwrap();
    publisher.publish(mailbox("t", 6, b"after")).await.unwrap();
    let d = recv_until(&l, &mut rx, b"after").await;
    assert_eq!(d.seq, 3, "a sequence number the link saw before");
    assert_eq!(
        *l.store_id().borrow(),
        Some(id),
        "the identity did not change"
    );
    l.stop().await;
}
