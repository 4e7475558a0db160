//! Tunnels between co-members, end to end: real hubs over loopback, real
//! devices in temporary directories.

use hubsync::device::{CloseReason, GroupId, Procedures, TunnelError};
use hubsync::hub::Limits;
use hubsync::testkit::{device_options, TestDevice, TestHub};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

/// 10 MiB as 160 responses of 64 KiB, each filled from its index.
const CHUNKS: usize = 160;
const CHUNK: usize = 64 * 1024;

fn chunk(i: usize) -> Vec<u8> {
    (0..CHUNK).map(|j| (i * 31 + j * 7) as u8).collect()
}

async fn until_joined(d: &TestDevice, g: GroupId) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while d.epoch(g).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "no welcome");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An unthrottled hub.
async fn unthrottled_hub() -> TestHub {
    TestHub::start_with(|c| c.limits = Limits::unthrottled())
        .await
        .unwrap()
}

/// `by` invites `d` into `g` (retrying while `d` has no key package up
/// yet), and `d` joins.
async fn invite(by: &TestDevice, g: GroupId, d: &TestDevice) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match by.invite(g, d.id()).await {
            Ok(_) => break,
            Err(hubsync::device::CommitError::NoKeyPackage(_))
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("invite failed: {e}"),
        }
    }
    until_joined(d, g).await;
}

/// `creator`'s group with every other device in it, all at one epoch.
async fn group_of(creator: &TestDevice, others: &[&TestDevice], hubs: &[String]) -> GroupId {
    let g = creator.create_group(hubs).await.unwrap();
    for d in others {
        invite(creator, g, d).await;
    }
    in_step(creator, others, g).await;
    g
}

/// Wait until every device is at `creator`'s epoch of `g`.
async fn in_step(creator: &TestDevice, others: &[&TestDevice], g: GroupId) {
    let deadline = tokio::time::Instant::now() + WAIT;
    let e = creator.epoch(g).await.unwrap();
    for d in others {
        while d.epoch(g).await.ok() != Some(e) {
            assert!(tokio::time::Instant::now() < deadline, "not in step");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn procedures() -> Procedures {
    Procedures::new()
        .unary("echo", |caller, body| async move {
            let mut out = caller.device.0[..4].to_vec();
            out.extend_from_slice(&body);
            Ok(out)
        })
        .unary("fail", |_, _| async move { Err("on purpose".to_string()) })
        .streamed("blob", |_, _, sink| async move {
            for i in 0..CHUNKS {
                sink.send(chunk(i)).await.map_err(|e| e.to_string())?;
            }
            Ok(())
        })
}

/// Call the streamed "blob" procedure and check that all of it arrives,
/// once and in order.
async fn read_blob(t: &hubsync::device::Tunnel) {
    let mut s = t.call_stream("blob", Vec::new()).await.unwrap();
    let mut got = 0;
    while let Some(r) = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("the stream stalled")
    {
        assert!(
            r.unwrap() == chunk(got),
            "response {got} out of order or bent"
        );
        got += 1;
    }
    assert_eq!(got, CHUNKS, "every response once");
}

/// A hub over a directory of its own, and its address, so the test can
/// stop it and start it again where the devices expect it.
async fn restartable_hub() -> (tempfile::TempDir, TestHub, String) {
    let dir = tempfile::tempdir().unwrap();
    let hub = TestHub::start_at(dir.path(), "127.0.0.1:0", |c| {
        c.limits = Limits::unthrottled()
    })
    .await
    .unwrap();
    let addr = hub.addr().to_string();
    (dir, hub, addr)
}

/// A member calls another's procedures over a tunnel: a response, a
/// procedure's own failure and a name nobody serves each come back as
/// such, and 10 MiB of streamed responses arrive in order, exactly once,
/// across a hub restart in the middle of the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_carries_ten_mib_in_order_across_a_hub_restart() {
    let (dir, hub, addr) = restartable_hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b], &u).await;
    b.serve(procedures());
    assert_eq!(a.tunnel_hub(g).unwrap().as_deref(), Some(u[0].as_str()));

    let t = a.open_tunnel(g, b.id()).await.unwrap();
    assert_eq!(t.peer(), b.id());
    let echoed = t.call("echo", b"hello".to_vec()).await.unwrap();
    assert_eq!(&echoed[..4], &a.id().0[..4], "b sees a as the caller");
    assert_eq!(&echoed[4..], b"hello");
    match t.call("fail", Vec::new()).await {
        Err(TunnelError::Failed(why)) => assert_eq!(why, "on purpose"),
        other => panic!("{other:?}"),
    }
    match t.call("nothing", Vec::new()).await {
        Err(TunnelError::NoSuchProcedure(n)) => assert_eq!(n, "nothing"),
        other => panic!("{other:?}"),
    }

    let mut s = t.call_stream("blob", Vec::new()).await.unwrap();
    let mut got = 0;
    let mut hub = Some(hub);
    while let Some(r) = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("the stream stalled")
    {
        let body = r.unwrap();
        assert!(got < CHUNKS, "more responses than sent");
        assert!(body == chunk(got), "response {got} out of order or bent");
        got += 1;
        if got == 20 {
            // The hub goes down mid-stream and comes back on its store.
            hub.take().unwrap().stop().await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            hub = Some(
                TestHub::start_at(dir.path(), &addr, |c| c.limits = Limits::unthrottled())
                    .await
                    .unwrap(),
            );
        }
    }
    assert_eq!(got, CHUNKS, "every response once");

    // Frames lost after the hub took them (as a rewound hub loses them):
    // the chunks after a gap wait, the lost ones are sent again, and the
    // stream still arrives whole, in order, once.
    b.manager()
        .faults()
        .lose_tunnel_frames
        .store(40, std::sync::atomic::Ordering::SeqCst);
    read_blob(&t).await;
    b.manager()
        .faults()
        .lose_tunnel_frames
        .store(0, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        t.call("echo", b"after".to_vec()).await.unwrap()[4..],
        *b"after"
    );
    assert!(t.closed().is_none());
    t.close();
    assert_eq!(t.wait_closed().await, CloseReason::Closed);
    let deadline = tokio::time::Instant::now() + WAIT;
    while !b.manager().tunnels(g).is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "b was told");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(hub);
}

/// A member removed from the group loses its tunnel at once (the serving
/// device closes it on the roster change) and cannot open another: the
/// device that served it no longer answers it. A device that serves
/// nothing declines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_members_tunnel_closes_and_cannot_be_reopened() {
    let hub = unthrottled_hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let c = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b, &c], &u).await;

    match c.open_tunnel(g, b.id()).await {
        Err(TunnelError::Refused(r)) => {
            assert_eq!(
                r,
                hubsync::device::tunnel::handshake::RefuseReason::NoService
            )
        }
        other => panic!("b serves nothing yet: {other:?}"),
    }
    b.serve(procedures());
    let t = c.open_tunnel(g, b.id()).await.unwrap();
    assert_eq!(t.call("echo", b"x".to_vec()).await.unwrap()[4..], *b"x");

    a.remove(g, c.id()).await.unwrap();
    let reason = tokio::time::timeout(WAIT, t.wait_closed())
        .await
        .expect("the tunnel closed");
    assert!(
        matches!(reason, CloseReason::Remote(_) | CloseReason::Left),
        "{reason:?}"
    );
    assert!(matches!(
        t.call("echo", Vec::new()).await,
        Err(TunnelError::Closed(_))
    ));
    in_step(&a, &[&b], g).await;
    // b closes its end when it reads the removal (or when c's close comes).
    let deadline = tokio::time::Instant::now() + WAIT;
    while !b.manager().tunnels(g).is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b holds no tunnel to c"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match c.open_tunnel(g, b.id()).await {
        Err(TunnelError::NoAnswer) | Err(TunnelError::Device(_)) => {}
        Ok(_) => panic!("a removed member opened a tunnel"),
        Err(e) => {
            // c may still hold the group (it read its removal or not): it
            // is refused locally or gets no answer, never a tunnel.
            let text = e.to_string();
            assert!(
                matches!(e, TunnelError::NotAMember { .. } | TunnelError::Stranded(_)),
                "{text}"
            );
        }
    }
    // a still opens one.
    let ta = a.open_tunnel(g, b.id()).await.unwrap();
    assert_eq!(ta.call("echo", b"y".to_vec()).await.unwrap()[4..], *b"y");
}

/// A stranger who learned a member's device id and the group id (it may
/// sign an open in its own name, and post it to the member's mailbox like
/// anyone) gets no answer, and its open changes nothing; a member cannot
/// open a tunnel to a device outside the group, and a device outside the
/// group cannot open one in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_open_a_tunnel() {
    let hub = unthrottled_hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let outsider = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b], &u).await;
    b.serve(procedures());

    assert!(matches!(
        outsider.open_tunnel(g, b.id()).await,
        Err(TunnelError::Device(
            hubsync::device::DeviceError::UnknownGroup(_)
        ))
    ));
    match a.open_tunnel(g, outsider.id()).await {
        Err(TunnelError::NotAMember { device, .. }) => assert_eq!(device, outsider.id()),
        other => panic!("{other:?}"),
    }

    let key = hubsync::testkit::signing_key(77);
    let stranger = hubsync::wire::DeviceId(key.verifying_key().to_bytes());
    let dropped = b.stats().dropped;
    let client = hubsync::client::HubClient::connect(
        &hubsync::transport::TcpConnector,
        &u[0],
        &key,
        Default::default(),
    )
    .await
    .unwrap();
    let mut pushes = client.take_pushes().unwrap();
    client.receive().await.unwrap();
    client
        .subscribe(&hubsync::device::topics::welcome_topic(&stranger), None)
        .await
        .unwrap();
    let open = forged_open(&key, stranger, g, b.id(), a.epoch(g).await.unwrap());
    post_to_mailbox(
        &client,
        hubsync::device::topics::welcome_topic(&b.id()),
        9,
        open,
    )
    .await;
    dropped_reaches(&b, dropped + 1).await;
    assert!(
        b.manager().tunnels(g).is_empty(),
        "no tunnel for a stranger"
    );
    // Nothing came back to the stranger's mailbox.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(pushes.try_recv().is_err(), "the stranger was answered");
    // b still answers a member.
    let t = a.open_tunnel(g, b.id()).await.unwrap();
    assert_eq!(t.call("echo", b"z".to_vec()).await.unwrap()[4..], *b"z");
}

/// An open signed by the stranger's own key, naming the group and its
/// current epoch.
fn forged_open(
    key: &ed25519_dalek::SigningKey,
    from: hubsync::wire::DeviceId,
    g: GroupId,
    to: hubsync::wire::DeviceId,
    epoch: u64,
) -> Vec<u8> {
    use ed25519_dalek::Signer as _;
    use hubsync::device::tunnel::handshake::{Handshake, Open};
    let mut o = Open {
        group: g,
        tunnel: [5; 16],
        from,
        to,
        epoch,
        hpke_public: vec![7; 32],
        signature: Vec::new(),
    };
    o.signature = key.sign(&o.signed_bytes()).to_bytes().to_vec();
    Handshake::Open(o).encode()
}

/// A tunnel nobody uses closes after the idle timeout, on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tunnel_closes() {
    let hub = unthrottled_hub().await;
    let u = vec![hub.url().to_string()];
    let mut oa = device_options(&u);
    oa.manager.tunnel_idle_timeout = Duration::from_secs(2);
    let a = TestDevice::open_with(oa).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b], &u).await;
    b.serve(procedures());
    let t = a.open_tunnel(g, b.id()).await.unwrap();
    t.call("echo", Vec::new()).await.unwrap();
    let reason = tokio::time::timeout(WAIT, t.wait_closed()).await.unwrap();
    assert_eq!(reason, CloseReason::Idle);
    let deadline = tokio::time::Instant::now() + WAIT;
    while !b.manager().tunnels(g).is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "b was told");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Under the hub's default rate (20 publishes a second per device) with a
/// burst of 10, below the tunnel's window of 16 chunks, 20 MiB of
/// responses run into the rate limit: the sender holds its frames for the
/// time the hub asks and sends them again, and every response still
/// arrives once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_paced_by_the_hubs_rate_limit_loses_nothing() {
    let hub = TestHub::start_with(|c| {
        c.limits.device_rate = hubsync::hub::Rate {
            per_sec: 20.0,
            burst: 10.0,
        }
    })
    .await
    .unwrap();
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b], &u).await;
    b.serve(procedures());
    let t = a.open_tunnel(g, b.id()).await.unwrap();
    for _ in 0..2 {
        read_blob(&t).await;
    }
    let refused = hub.hub().metrics().rate_limited.device;
    assert!(refused > 0, "the hub's rate limit was met");
}

/// A late joiner fetches the group's history from a co-member: with the
/// group's setting off (the default) nothing; with it at 3, exactly the
/// last 3 messages, once, in order, into its inbox; asking again brings
/// nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_sync_delivers_exactly_the_allowed_messages_once() {
    let hub = unthrottled_hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let s = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b, &s], &u).await;
    // s says five things, and leaves: a's and b's inboxes hold the same
    // five messages in the same order.
    let mut ids = Vec::new();
    for i in 0..5u8 {
        ids.push(s.send(g, &[b'm', i]).await.unwrap().id);
    }
    for d in [&a, &b] {
        let deadline = tokio::time::Instant::now() + WAIT;
        while d.messages(g, 0, 100).unwrap().len() < 5 {
            assert!(tokio::time::Instant::now() < deadline, "messages");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    a.remove(g, s.id()).await.unwrap();

    let c = TestDevice::open(&u).await.unwrap();
    invite(&a, g, &c).await;
    in_step(&a, &[&b, &c], g).await;

    let off = c.sync_history(g).await.unwrap();
    assert_eq!((off.allowed, off.received), (0, 0), "off by default");
    assert!(c.messages(g, 0, 100).unwrap().is_empty());

    a.set_setting(g, hubsync::device::tunnel::history::SETTING, b"3")
        .await
        .unwrap();
    in_step(&a, &[&b, &c], g).await;
    let got = c.sync_history(g).await.unwrap();
    assert_eq!(got.allowed, 3);
    assert_eq!(got.received, 3, "{got:?}");
    let inbox = c.messages(g, 0, 100).unwrap();
    let bodies: Vec<Vec<u8>> = inbox.iter().map(|m| m.body.clone()).collect();
    assert_eq!(bodies, vec![vec![b'm', 2], vec![b'm', 3], vec![b'm', 4]]);
    assert_eq!(
        inbox.iter().map(|m| m.id).collect::<Vec<_>>(),
        ids[2..].to_vec()
    );
    assert!(inbox.iter().all(|m| m.sender == s.id()));

    let again = c.sync_history(g).await.unwrap();
    assert_eq!((again.received, again.duplicates), (0, 3));
    assert_eq!(c.messages(g, 0, 100).unwrap().len(), 3, "nothing twice");
}

/// Wait until `d`'s presence view of `g` satisfies `ok`.
async fn presence_until(
    d: &TestDevice,
    g: GroupId,
    what: &str,
    ok: impl Fn(&[hubsync::device::presence::MemberPresence]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let p = d.presence(g).await.unwrap();
        if ok(&p) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn live(p: &[hubsync::device::presence::MemberPresence], d: hubsync::wire::DeviceId) -> bool {
    p.iter().any(|m| m.device == d && m.live)
}

/// Presence answers who is live, and on which hub: members learn of each
/// other as they join, a device that stops says so, one that starts again
/// asks who is there and is seen again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_answers_who_is_live() {
    let hub = unthrottled_hub().await;
    let u = vec![hub.url().to_string()];
    let mut a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let mut c = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b, &c], &u).await;
    let (bid, cid) = (b.id(), c.id());
    presence_until(&a, g, "a sees b and c", |p| live(p, bid) && live(p, cid)).await;
    let p = a.presence(g).await.unwrap();
    assert_eq!(p.len(), 2, "the others, not a itself");
    assert!(p
        .iter()
        .all(|m| m.hubs[0].0 == u[0] && m.last_seen_ms.is_some()));
    presence_until(&c, g, "c sees a and b", |p| live(p, a.id()) && live(p, bid)).await;

    c.close().await;
    presence_until(&a, g, "a sees c away", |p| live(p, bid) && !live(p, cid)).await;
    let p = a.presence(g).await.unwrap();
    assert_eq!(p[0].device, bid, "live first");
    assert!(p[1].last_seen_ms.is_some(), "c was seen, and when");

    // a starts again knowing nobody, and asks.
    a.close().await;
    a.reopen().await.unwrap();
    presence_until(&a, g, "a restarted sees b", |p| live(p, bid)).await;
    let p = a.presence(g).await.unwrap();
    assert_eq!(p[1].device, cid);
    assert_eq!(p[1].last_seen_ms, None, "not seen since a started");

    c.reopen().await.unwrap();
    presence_until(&a, g, "a sees c back", |p| live(p, bid) && live(p, cid)).await;
}

/// Only a member's own signed beacon counts: a stranger's beacon in its
/// own name, and one in a member's name that the stranger signed, are
/// dropped and counted, and the member that stopped stays away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_beacon_makes_nobody_live() {
    use ed25519_dalek::Signer;
    use hubsync::device::presence::{PresenceBeacon, PresenceState};
    use hubsync::device::rejoin::RendezvousFrame;
    let hub = unthrottled_hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let mut b = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b], &u).await;
    let bid = b.id();
    presence_until(&a, g, "a sees b", |p| live(p, bid)).await;
    let seed = a
        .manager()
        .record(g)
        .unwrap()
        .rendezvous_seed
        .expect("a seed");
    b.close().await;
    presence_until(&a, g, "a sees b away", |p| !live(p, bid)).await;

    let key = hubsync::testkit::signing_key(78);
    let stranger = hubsync::wire::DeviceId(key.verifying_key().to_bytes());
    let client = hub.client(&key).await.unwrap();
    let dropped = a.stats().dropped;
    for (n, device) in [stranger, bid].into_iter().enumerate() {
        let mut beacon = PresenceBeacon {
            group: g,
            device,
            at_ms: u64::MAX - 1,
            state: PresenceState::Live,
            ask: true,
            signature: Vec::new(),
        };
        beacon.signature = key.sign(&beacon.signed_bytes()).to_bytes().to_vec();
        let frame = postcard::to_stdvec(&RendezvousFrame::Presence(beacon)).unwrap();
        post_to_mailbox(
            &client,
            hubsync::device::topics::rendezvous_topic(&seed),
            n as u8 + 1,
            frame,
        )
        .await;
    }
    dropped_reaches(&a, dropped + 2).await;
    let p = a.presence(g).await.unwrap();
    assert_eq!(p.len(), 1, "members only");
    assert!(!p[0].live, "b stays away: {p:?}");
}

/// History sync asks live members first: the member whose id comes first
/// is away, and the joiner gets the history from the other at once,
/// without waiting out a tunnel to the absent one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_sync_asks_a_live_member_first() {
    let hub = unthrottled_hub().await;
    let u = vec![hub.url().to_string()];
    let mut a = TestDevice::open(&u).await.unwrap();
    let mut b = TestDevice::open(&u).await.unwrap();
    let c = TestDevice::open(&u).await.unwrap();
    let g = group_of(&a, &[&b, &c], &u).await;
    a.set_setting(g, hubsync::device::tunnel::history::SETTING, b"5")
        .await
        .unwrap();
    for i in 0..2u8 {
        c.send(g, &[b'h', i]).await.unwrap();
    }
    for d in [&a, &b] {
        let deadline = tokio::time::Instant::now() + WAIT;
        while d.messages(g, 0, 100).unwrap().len() < 2 {
            assert!(tokio::time::Instant::now() < deadline, "messages");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    a.remove(g, c.id()).await.unwrap();
    in_step(&a, &[&b], g).await;
    // The away member is the one an id-ordered ask would try first.
    let a_away = a.id() < b.id();
    let (away_id, here_id) = if a_away {
        (a.id(), b.id())
    } else {
        (b.id(), a.id())
    };
    let d = TestDevice::open(&u).await.unwrap();
    invite(&a, g, &d).await;
    in_step(&a, &[&b, &d], g).await;
    if a_away {
        a.close().await;
    } else {
        b.close().await;
    }
    presence_until(&d, g, "d sees who is live", |p| {
        live(p, here_id) && !live(p, away_id)
    })
    .await;
    let got = d.sync_history(g).await.unwrap();
    assert_eq!(got.from, Some(here_id));
    assert!(got.failed.is_empty(), "nobody absent was asked: {got:?}");
    assert_eq!(got.received, 2);
}

/// Post `payload` on the mailbox `topic` as `client`, and check the hub
/// took it (`id` makes its publish id).
async fn post_to_mailbox(
    client: &hubsync::client::HubClient,
    topic: hubsync::wire::TopicId,
    id: u8,
    payload: Vec<u8>,
) {
    let out = client
        .publish(hubsync::wire::Publish {
            publish_id: hubsync::wire::PublishId([id; 32]),
            topic,
            class: hubsync::wire::RetentionClass::Mailbox,
            expected_head: hubsync::wire::ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: Some(60),
            payload,
            writer: None,
        })
        .await
        .unwrap();
    assert!(matches!(
        out,
        hubsync::wire::PublishOutcome::Accepted { .. }
    ));
}

/// Wait until `d` counted at least `n` frames dropped.
async fn dropped_reaches(d: &TestDevice, n: u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while d.stats().dropped < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the frames never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
