//! Several hub processes on one PostgreSQL database: here two hubs in one
//! test process, each with its own connections and its own listener for
//! the other's announcements, as two `hubsync hub --store` processes have.
//! A device may be connected to either; what one accepts, the other pushes.
//! The last test runs two real `hubsync hub` processes behind one URL and
//! kills one with SIGKILL.

mod common;

use common::*;
use hubsync::client::{HubClient, Push};
use hubsync::device::{GroupId, InboxMessage};
use hubsync::hub::{Announce, Limits, PgOptions};
use hubsync::testkit::{signing_key, TestDevice, TestHub, TestPostgres};
use hubsync::wire::{DeviceId, ExpectedHead, TopicId};
use std::collections::HashSet;
use std::time::Duration;

fn unthrottled(c: &mut hubsync::hub::HubConfig) {
    c.limits = Limits::unthrottled();
}

/// Two hubs on one fresh database, announcing to each other as `announce`
/// says.
async fn two_hubs(announce: Announce) -> (TestHub, TestHub) {
    let url = TestPostgres::shared().unwrap().database().await.unwrap();
    let options = PgOptions {
        pool_size: 4,
        announce,
    };
    let a = TestHub::start_on_database(&url, &options, unthrottled)
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

const POLL: Announce = Announce::Poll {
    interval: Duration::from_millis(20),
};

/// One test body, run with each way of announcing.
macro_rules! with_each_announce {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn listen() {
                super::$name(hubsync::hub::Announce::Listen).await
            }
            #[tokio::test]
            async fn poll() {
                super::$name(super::POLL).await
            }
        }
    )*};
}

with_each_announce!(
    what_one_hub_accepts_the_other_pushes_at_once,
    racers_on_two_hubs_have_exactly_one_winner,
    frames_announced_while_the_other_hub_was_not_hearing_still_arrive,
);

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

async fn what_one_hub_accepts_the_other_pushes_at_once(announce: Announce) {
    let (a, b) = two_hubs(announce).await;
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

async fn racers_on_two_hubs_have_exactly_one_winner(announce: Announce) {
    let (a, b) = two_hubs(announce).await;
    let seed = a.client(&signing_key(100)).await.unwrap();
    seed.publish(log("race", 0, ExpectedHead::Empty, b"genesis"))
        .await
        .unwrap();
    let mut clients = Vec::new();
    for i in 1..=16u64 {
        let hub = if i % 2 == 0 { &a } else { &b };
        clients.push(hub.client(&signing_key(i)).await.unwrap());
    }
    let winners = race_on_head_one(&clients).await;
    assert_eq!(
        winners,
        vec![2],
        "exactly one compare-and-set wins across hubs"
    );
}

/// The connection that hears the other hub (listening, or polling) is cut
/// while frames are accepted by the other hub: their announcements are
/// lost (listen) or unread (poll), and still every frame arrives once the
/// connection is back (it says what it may have missed, and the hub reads
/// every followed topic's head again). Text in the announcement table that
/// is no announcement is counted and ignored.
async fn frames_announced_while_the_other_hub_was_not_hearing_still_arrive(announce: Announce) {
    let (a, b) = two_hubs(announce).await;
    let (_sub, mut rx) = receiver(&b, 1, "t").await;
    let publisher = a.client(&signing_key(2)).await.unwrap();
    publisher
        .publish(log("t", 0, ExpectedHead::Unconditional, b"before"))
        .await
        .unwrap();
    assert_eq!(deliveries(&mut rx, 1).await, vec![b"before".to_vec()]);
    let gaps = b.hub().metrics().announcement_gaps;

    // Cut every connection that hears the other hub (both hubs'), then
    // publish at once.
    let server = TestPostgres::shared().unwrap();
    let (admin, conn) = tokio_postgres::connect(&server.url("postgres"), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let hearing = match announce {
        Announce::Listen => "query = 'LISTEN hubsync_frames'",
        Announce::Poll { .. } => "query LIKE '%FROM hub_announce%'",
    };
    let cut = admin
        .query(
            &format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {hearing} \
                 AND pid <> pg_backend_pid()"
            ),
            &[],
        )
        .await
        .unwrap();
    assert!(!cut.is_empty(), "the hubs hear each other");
    for i in 1..=5u8 {
        publisher
            .publish(log("t", u64::from(i), ExpectedHead::Unconditional, &[i]))
            .await
            .unwrap();
    }
    let want: Vec<Vec<u8>> = (1..=5u8).map(|i| vec![i]).collect();
    assert_eq!(deliveries(&mut rx, 5).await, want);
    assert!(b.hub().metrics().announcement_gaps > gaps);

    if let Announce::Poll { .. } = announce {
        // Nobody listens when the hubs poll: this works on databases
        // without LISTEN/NOTIFY.
        let listening = admin
            .query(
                "SELECT 1 FROM pg_stat_activity WHERE query = 'LISTEN hubsync_frames'",
                &[],
            )
            .await
            .unwrap();
        assert!(listening.is_empty());
        // Something else with access to the database writes a row that is
        // no announcement: counted, ignored, and the hubs go on.
        let (db, conn) = tokio_postgres::connect(&a.database_url().unwrap(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        db.execute(
            "INSERT INTO hub_announce (id, at, n) VALUES ('\\x00', \
             (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::BIGINT, 'not an announcement')",
            &[],
        )
        .await
        .unwrap();
        publisher
            .publish(log("t", 6, ExpectedHead::Unconditional, b"after"))
            .await
            .unwrap();
        assert_eq!(deliveries(&mut rx, 1).await, vec![b"after".to_vec()]);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while b.hub().metrics().bad_announcements == 0 {
            assert!(tokio::time::Instant::now() < deadline, "counted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A load balancer in miniature on the address of `url`: each new
/// connection goes to the next backend in turn, skipping one that refuses.
async fn balancer_at(url: &str, backends: Vec<String>) -> String {
    let addr = url.trim_start_matches("ws://").to_string();
    let listener = tokio::net::TcpListener::bind(&addr).await.unwrap();
    tokio::spawn(async move {
        let mut next = 0usize;
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            let mut outbound = None;
            for i in 0..backends.len() {
                let backend = &backends[(next + i) % backends.len()];
                if let Ok(s) = tokio::net::TcpStream::connect(backend).await {
                    outbound = Some(s);
                    next = (next + i + 1) % backends.len();
                    break;
                }
            }
            if let Some(mut outbound) = outbound {
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        }
    });
    url.to_string()
}

/// Every message in `d`'s inbox of `g`, once `want` have arrived (within
/// 30 s); fails on any message held twice.
async fn inbox_of(d: &TestDevice, g: GroupId, want: usize) -> Vec<InboxMessage> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let got = d.messages(g, 0, 10_000).unwrap();
        let ids: HashSet<(DeviceId, [u8; 16])> = got.iter().map(|m| (m.sender, m.id)).collect();
        assert_eq!(ids.len(), got.len(), "a message held twice");
        if got.len() >= want {
            return got;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {want} messages arrived",
            got.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two `hubsync hub` processes on one database behind one URL; devices'
/// connections are spread over both, so one group spans both. One process
/// is killed with SIGKILL while every member sends; the devices that were
/// on it reconnect through the same URL to the other, and every member
/// receives every message exactly once; a commit afterwards lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_on_two_processes_lose_nothing_when_one_is_killed() {
    let store = TestPostgres::shared().unwrap().database().await.unwrap();
    let lb = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let public = format!("ws://{}", lb.local_addr().unwrap());
    drop(lb);
    let mut first = HubProcess::spawn(&["--store", &store, "--public-url", &public]);
    let mut second = HubProcess::spawn(&["--store", &store, "--public-url", &public]);
    // The balancer takes the public address now free again.
    let url = balancer_at(&public, vec![first.addr.clone(), second.addr.clone()]).await;
    let u = vec![url];
    let devices = [
        TestDevice::open(&u).await.unwrap(),
        TestDevice::open(&u).await.unwrap(),
        TestDevice::open(&u).await.unwrap(),
    ];
    for d in &devices {
        d.ready_for_invites(Duration::from_secs(20)).await.unwrap();
    }
    let g = devices[0].create_group(&u).await.unwrap();
    for d in &devices[1..] {
        devices[0].invite(g, d.id()).await.unwrap();
    }
    for d in &devices[1..] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while d.members(g).await.map(|m| m.len()).unwrap_or(0) < 3 {
            assert!(tokio::time::Instant::now() < deadline, "no welcome");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    const EACH: usize = 10;
    let sending = devices.iter().enumerate().map(|(i, d)| async move {
        for n in 0..EACH {
            d.send(g, format!("from {i} #{n}").as_bytes())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let killing = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        // SIGKILL: nothing of the process's own shutdown runs.
        first.kill();
    };
    futures::join!(futures::future::join_all(sending), killing);

    for (i, d) in devices.iter().enumerate() {
        let got = inbox_of(d, g, 2 * EACH).await;
        let mut bodies: Vec<String> = got
            .iter()
            .map(|m| String::from_utf8(m.body.clone()).unwrap())
            .collect();
        bodies.sort();
        let mut want: Vec<String> = (0..3)
            .filter(|s| *s != i)
            .flat_map(|s| (0..EACH).map(move |n| format!("from {s} #{n}")))
            .collect();
        want.sort();
        assert_eq!(bodies, want, "device {i}");
    }
    // The group still commits, through the surviving process.
    devices[1].rotate_keys(g).await.unwrap();
    second.kill();
}
