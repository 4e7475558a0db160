//! The device side end to end: real hubs over loopback, real devices in
//! temporary directories.

use hubsync::device::{Event, EventStream, GroupId};
use hubsync::testkit::{TestDevice, TestHub};
use hubsync::wire::DeviceId;
use std::collections::HashMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

/// Collects a device's message events as they come.
struct Inbox {
    rx: EventStream,
    got: HashMap<[u8; 16], (DeviceId, Vec<u8>, u32)>,
    events: Vec<Event>,
}

impl Inbox {
    fn new(d: &TestDevice) -> Self {
        Self {
            rx: d.events(),
            got: HashMap::new(),
            events: Vec::new(),
        }
    }

    fn take(&mut self, e: Event) {
        if let Event::MessageReceived {
            sender, id, body, ..
        } = &e
        {
            self.got
                .entry(*id)
                .and_modify(|(_, _, n)| *n += 1)
                .or_insert((*sender, body.clone(), 1));
        }
        self.events.push(e);
    }

    /// Wait until `pred` holds over what arrived, or fail after `WAIT`.
    async fn until(&mut self, what: &str, pred: impl Fn(&Inbox) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !pred(self) {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(Ok(e))) => self.take(e),
                Ok(Some(Err(lag))) => panic!("{lag}"),
                Ok(None) => panic!("event channel closed"),
                Err(_) => panic!(
                    "timed out waiting for {what}; have {} messages",
                    self.got.len()
                ),
            }
        }
    }

    /// Drain what arrives in the next `d`.
    async fn settle(&mut self, d: Duration) {
        let deadline = tokio::time::Instant::now() + d;
        while let Ok(Some(Ok(e))) = tokio::time::timeout_at(deadline, self.rx.recv()).await {
            self.take(e);
        }
    }

    fn joined(&self, g: GroupId) -> bool {
        self.events
            .iter()
            .any(|e| matches!(e, Event::GroupJoined { group, .. } if *group == g))
    }

    fn has(&self, body: &[u8]) -> bool {
        self.got.values().any(|(_, b, _)| b == body)
    }
}

async fn hubs(n: usize) -> Vec<TestHub> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(TestHub::start().await.unwrap());
    }
    v
}

/// A hub over a directory of its own, and its address, so a test can stop
/// it and start it again where devices expect it.
async fn restartable_hub() -> (tempfile::TempDir, TestHub, String) {
    let dir = tempfile::tempdir().unwrap();
    let hub = TestHub::start_at(dir.path(), "127.0.0.1:0", |_| {})
        .await
        .unwrap();
    let addr = hub.addr().to_string();
    (dir, hub, addr)
}

fn urls(h: &[TestHub]) -> Vec<String> {
    h.iter().map(|h| h.url().to_string()).collect()
}

/// Create a group on `creator` and bring every other device in.
async fn group_of(
    creator: &TestDevice,
    others: &mut [(&TestDevice, &mut Inbox)],
    hubs: &[String],
) -> GroupId {
    let g = creator.create_group(hubs).await.unwrap();
    for (d, inbox) in others.iter_mut() {
        creator
            .invite_when_ready(g, d.id(), WAIT)
            .await
            .expect("invite");
        inbox.until("the welcome", |i| i.joined(g)).await;
    }
    g
}

async fn converge(devices: &[&TestDevice], g: GroupId) -> (u64, Vec<u8>) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut states = Vec::new();
        for d in devices {
            states.push((
                d.epoch(g).await.unwrap(),
                d.epoch_authenticator(g).await.unwrap(),
            ));
        }
        if states.windows(2).all(|w| w[0] == w[1]) {
            return states.remove(0);
        }
        if tokio::time::Instant::now() > deadline {
            panic!(
                "no convergence: {:?}",
                states.iter().map(|s| s.0).collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_devices_on_two_hubs_get_every_message_once() {
    let hubs = hubs(2).await;
    let u = urls(&hubs);
    let (a, b, c) = (
        TestDevice::open(&u).await.unwrap(),
        TestDevice::open(&u).await.unwrap(),
        TestDevice::open(&u).await.unwrap(),
    );
    let (mut ia, mut ib, mut ic) = (Inbox::new(&a), Inbox::new(&b), Inbox::new(&c));
    let g = group_of(&a, &mut [(&b, &mut ib), (&c, &mut ic)], &u).await;
    assert_eq!(a.members(g).await.unwrap().len(), 3);
    converge(&[&a, &b, &c], g).await;
    for (i, d) in [&a, &b, &c].iter().enumerate() {
        for n in 0..5 {
            d.send(g, format!("from {i} #{n}").as_bytes())
                .await
                .unwrap();
        }
    }
    for (inbox, me) in [(&mut ia, 0), (&mut ib, 1), (&mut ic, 2)] {
        inbox.until("10 messages", |i| i.got.len() >= 10).await;
        inbox.settle(Duration::from_millis(300)).await;
        assert_eq!(inbox.got.len(), 10, "device {me}");
        assert!(
            inbox.got.values().all(|(_, _, n)| *n == 1),
            "a message was delivered twice"
        );
        assert!(
            !inbox.has(format!("from {me} #0").as_bytes()),
            "own message delivered back"
        );
    }
    // What an app exports for its metrics system says the same.
    let text = b.stats().prometheus_text();
    assert!(
        text.contains("hubsync_device_delivered_total 10\n"),
        "{text}"
    );
    // Each message travelled through both hubs; the second copy was dropped.
    let dups: u64 = [&a, &b, &c].iter().map(|d| d.stats().duplicates).sum();
    assert!(
        dups >= 20,
        "expected the second hub's copies to be suppressed, got {dups}"
    );
    // The durable inbox holds each message once too: positions 1 to 10.
    for d in [&a, &b, &c] {
        let positions: Vec<u64> = d
            .messages(g, 0, 100)
            .unwrap()
            .iter()
            .map(|m| m.position)
            .collect();
        assert_eq!(positions, (1..=10).collect::<Vec<u64>>());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_converge_on_one_epoch() {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let mut devs = Vec::new();
    for _ in 0..4 {
        devs.push(TestDevice::open(&u).await.unwrap());
    }
    let mut inboxes: Vec<Inbox> = devs.iter().map(Inbox::new).collect();
    let (first, rest) = devs.split_at(1);
    let (_, rest_inboxes) = inboxes.split_at_mut(1);
    let mut others: Vec<(&TestDevice, &mut Inbox)> =
        rest.iter().zip(rest_inboxes.iter_mut()).collect();
    let g = group_of(&first[0], &mut others, &u).await;
    let all: Vec<&TestDevice> = devs.iter().collect();
    let (before, _) = converge(&all, g).await;
    let results = futures::future::join_all(devs.iter().map(|d| d.rotate_keys(g))).await;
    for r in &results {
        r.as_ref().unwrap();
    }
    let (epoch, _) = converge(&all, g).await;
    assert_eq!(
        epoch,
        before + 4,
        "each of the four commits landed in its own epoch"
    );
    let lost: u64 = devs.iter().map(|d| d.stats().lost_races).sum();
    assert!(
        lost > 0
            || results
                .iter()
                .all(|r| r.as_ref().unwrap().outcome.attempts == 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_reopened_from_its_directory_resumes_without_loss_or_repeats() {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let mut b = TestDevice::open(&u).await.unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    converge(&[&a, &b], g).await;
    for n in 0..3 {
        a.send(g, format!("before {n}").as_bytes()).await.unwrap();
    }
    ib.until("3 messages", |i| i.got.len() >= 3).await;
    b.close().await;
    for n in 0..3 {
        a.send(g, format!("while closed {n}").as_bytes())
            .await
            .unwrap();
    }
    a.rotate_keys(g).await.unwrap();
    a.send(g, b"after rotate").await.unwrap();
    b.reopen().await.unwrap();
    // Read from the device's event log since it opened: the device may
    // deliver before a subscriber made after `reopen` would be listening.
    let since_open = b.event_log();
    let received = || -> Vec<(Vec<u8>, [u8; 16])> {
        since_open
            .snapshot()
            .into_iter()
            .filter_map(|e| match e {
                Event::MessageReceived { body, id, .. } => Some((body, id)),
                _ => None,
            })
            .collect()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while received().len() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for 4 new messages; have {:?}",
            received()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = received();
    let ids: std::collections::BTreeSet<[u8; 16]> = got.iter().map(|(_, id)| *id).collect();
    assert_eq!(
        (got.len(), ids.len()),
        (4, 4),
        "nothing repeated from before the restart: {got:?}"
    );
    assert!(got.iter().any(|(b, _)| b == b"after rotate"));
    converge(&[&a, &b], g).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_wait_in_the_outbox_while_the_hub_is_down() {
    let (dir, hub, addr) = restartable_hub().await;
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    converge(&[&a, &b], g).await;
    hub.stop().await;
    for n in 0..3 {
        a.send(g, format!("queued {n}").as_bytes()).await.unwrap();
    }
    assert_eq!(a.manager().outbox().pending().unwrap(), 3);
    let hub = TestHub::start_at(dir.path(), &addr, |_| {}).await.unwrap();
    ib.until("3 queued messages", |i| i.got.len() >= 3).await;
    ib.settle(Duration::from_millis(300)).await;
    assert_eq!(ib.got.len(), 3);
    assert!(ib.got.values().all(|(_, _, n)| *n == 1));
    let deadline = tokio::time::Instant::now() + WAIT;
    while !a.manager().outbox().is_drained().unwrap() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "outbox never drained"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    hub.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_outbox_holds_sends_back_until_the_hub_takes_them() {
    let (dir, hub, addr) = restartable_hub().await;
    let u = vec![hub.url().to_string()];
    let mut options = hubsync::testkit::device_options(&u);
    options.outbox.max_owed = 3;
    let a = TestDevice::open_with(options).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    converge(&[&a, &b], g).await;
    // Whatever the group's setup still owed is delivered first, so the
    // bound below counts only these sends.
    while a.manager().outbox().owed() > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    hub.stop().await;
    for n in 0..3 {
        a.send(g, format!("queued {n}").as_bytes()).await.unwrap();
    }
    // Full: try_send says so and sends nothing; send waits.
    match a.try_send(g, b"refused").await {
        Err(hubsync::device::DeviceError::OutboxFull { owed: 3, max: 3 }) => {}
        other => panic!("expected OutboxFull, got {other:?}"),
    }
    let waited = tokio::time::timeout(Duration::from_millis(300), a.send(g, b"waited")).await;
    assert!(waited.is_err(), "send returned while the outbox was full");
    assert_eq!(a.manager().outbox().pending().unwrap(), 3);

    let hub = TestHub::start_at(dir.path(), &addr, |_| {}).await.unwrap();
    // Room comes back as the hub takes what is owed; this send then goes.
    a.send(g, b"after").await.unwrap();
    ib.until("4 messages", |i| i.got.len() >= 4).await;
    ib.settle(Duration::from_millis(300)).await;
    assert_eq!(ib.got.len(), 4);
    assert!(ib.has(b"after"));
    assert!(!ib.has(b"refused") && !ib.has(b"waited"));
    assert!(ib.got.values().all(|(_, _, n)| *n == 1));
    hub.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_restarted_mid_stream_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h1 = TestHub::start_at(dir.path(), "127.0.0.1:0", |_| {})
        .await
        .unwrap();
    let addr = h1.addr().to_string();
    let u = vec![h1.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    converge(&[&a, &b], g).await;
    for n in 0..10 {
        a.send(g, format!("m{n}").as_bytes()).await.unwrap();
        if n == 4 {
            h1.hub().shutdown().await;
        }
    }
    drop(h1);
    let h1 = TestHub::start_at(dir.path(), &addr, |_| {}).await.unwrap();
    ib.until("10 messages", |i| i.got.len() >= 10).await;
    ib.settle(Duration::from_millis(300)).await;
    assert_eq!(ib.got.len(), 10);
    assert!(ib.got.values().all(|(_, _, n)| *n == 1));
    h1.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_member_reads_nothing_sent_after_its_removal() {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let c = TestDevice::open(&u).await.unwrap();
    let (mut ib, mut ic) = (Inbox::new(&b), Inbox::new(&c));
    let g = group_of(&a, &mut [(&b, &mut ib), (&c, &mut ic)], &u).await;
    converge(&[&a, &b, &c], g).await;
    a.send(g, b"everyone").await.unwrap();
    ic.until("the first message", |i| i.has(b"everyone")).await;
    a.remove(g, c.id()).await.unwrap();
    ic.until("removal", |i| {
        i.events.iter().any(|e| matches!(e, Event::Removed { .. }))
    })
    .await;
    assert!(
        c.epoch(g).await.is_err(),
        "the removed device keeps no state of the group"
    );
    a.send(g, b"secret").await.unwrap();
    b.send(g, b"secret too").await.unwrap();
    ib.until("the secret", |i| i.has(b"secret")).await;
    ic.settle(Duration::from_millis(500)).await;
    assert!(!ic.has(b"secret") && !ic.has(b"secret too"));
    assert_eq!(a.members(g).await.unwrap().len(), 2);
}

/// A connector that cannot reach some hubs, as a partition would.
struct Partitioned {
    blocked: Vec<String>,
}

impl hubsync::transport::Connector for Partitioned {
    fn connect(
        &self,
        url: &str,
    ) -> futures::future::BoxFuture<'static, std::io::Result<hubsync::transport::BoxStream>> {
        if self.blocked.iter().any(|b| b == url) {
            return Box::pin(async {
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "partitioned",
                ))
            });
        }
        hubsync::transport::TcpConnector.connect(url)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_carries_messages_across_a_partition() {
    let hubs = hubs(2).await;
    let u = urls(&hubs);
    let mut oa = hubsync::testkit::device_options(&u[..1]);
    oa.connector = std::sync::Arc::new(Partitioned {
        blocked: vec![u[1].clone()],
    });
    let mut ob = hubsync::testkit::device_options(&u);
    ob.manager.forwarding = true;
    let mut oc = hubsync::testkit::device_options(&u[1..]);
    oc.connector = std::sync::Arc::new(Partitioned {
        blocked: vec![u[0].clone()],
    });
    let a = TestDevice::open_with(oa).await.unwrap();
    let b = TestDevice::open_with(ob).await.unwrap();
    let c = TestDevice::open_with(oc).await.unwrap();
    let (mut ia, mut ib, mut ic) = (Inbox::new(&a), Inbox::new(&b), Inbox::new(&c));
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    // Only b reaches c's hub to claim its key package: b must be an admin.
    a.grant_admin(g, b.id()).await.unwrap();
    converge(&[&a, &b], g).await;
    b.invite_when_ready(g, c.id(), WAIT).await.expect("invite");
    ic.until("c to join", |i| i.joined(g)).await;
    converge(&[&a, &b, &c], g).await;

    a.send(g, b"from a, only on hub 1").await.unwrap();
    c.send(g, b"from c, only on hub 2").await.unwrap();
    ic.until("a's message via b", |i| i.has(b"from a, only on hub 1"))
        .await;
    ia.until("c's message via b", |i| i.has(b"from c, only on hub 2"))
        .await;
    ib.until("both", |i| i.got.len() >= 2).await;
    for inbox in [&mut ia, &mut ib, &mut ic] {
        inbox.settle(Duration::from_millis(300)).await;
        assert!(inbox.got.values().all(|(_, _, n)| *n == 1));
    }
}

/// A connector that can be cut and restored.
#[derive(Clone, Default)]
struct Switch {
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl hubsync::transport::Connector for Switch {
    fn connect(
        &self,
        url: &str,
    ) -> futures::future::BoxFuture<'static, std::io::Result<hubsync::transport::BoxStream>> {
        if self.cut.load(std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(async {
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "cut",
                ))
            });
        }
        hubsync::transport::TcpConnector.connect(url)
    }
}

/// A group of a and b on one hub, b connecting through a `Switch`; b is
/// closed and cut off from the hub (reopened, it cannot connect until the
/// switch is restored).
struct CutOff {
    hubs: Vec<TestHub>,
    a: TestDevice,
    b: TestDevice,
    switch: Switch,
    g: GroupId,
}

async fn member_cut_off(configure: impl FnOnce(&mut hubsync::device::DeviceOptions)) -> CutOff {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let switch = Switch::default();
    let mut ob = hubsync::testkit::device_options(&u);
    ob.connector = std::sync::Arc::new(switch.clone());
    configure(&mut ob);
    let mut b = TestDevice::open_with(ob).await.unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    converge(&[&a, &b], g).await;
    b.close().await;
    switch.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    CutOff {
        hubs,
        a,
        b,
        switch,
        g,
    }
}

/// Frames handled together under one flush (a burst a peer found waiting)
/// are delivered as one at a time would be: in order, each once, a frame
/// repeated within the run counted as a duplicate, not delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_frames_under_one_flush_delivers_each_once_in_order() {
    let CutOff {
        hubs,
        a,
        mut b,
        switch,
        g,
        ..
    } = member_cut_off(|_| {}).await;
    for body in [&b"one"[..], b"two", b"three"] {
        a.send(g, body).await.unwrap();
    }
    let reader = hubs[0]
        .client(&hubsync::testkit::signing_key(78))
        .await
        .unwrap();
    let topic = a.manager().record(g).unwrap().app_topics[0].clone();
    let deadline = tokio::time::Instant::now() + WAIT;
    let frames = loop {
        let f = reader.fetch(&topic, 0, 10).await.unwrap();
        if f.messages.len() == 3 {
            break f
                .messages
                .into_iter()
                .map(|m| m.payload)
                .collect::<Vec<_>>();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a's sends on the hub"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    b.reopen().await.unwrap();
    let before = b.stats().duplicates;
    let run: Vec<(&[u8], _)> = [0, 0, 1, 2, 1]
        .iter()
        .map(|&i| (frames[i].as_slice(), None))
        .collect();
    b.manager().receive_apps(g, &run).await.unwrap();
    let got = b.messages(g, 0, 10).unwrap();
    let bodies: Vec<&[u8]> = got.iter().map(|m| m.body.as_slice()).collect();
    assert_eq!(bodies, vec![&b"one"[..], b"two", b"three"]);
    assert_eq!(
        got.iter().map(|m| m.position).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(
        b.stats().duplicates - before,
        2,
        "the repeats are duplicates"
    );

    // The same frames reach b again from the hub: nothing new.
    switch.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    b.manager().retry_hubs(WAIT).await;
    converge(&[&a, &b], g).await;
    a.send(g, b"four").await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while b.messages(g, 0, 10).unwrap().len() < 4 {
        assert!(tokio::time::Instant::now() < deadline, "b reads on");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bodies: Vec<Vec<u8>> = b
        .messages(g, 0, 10)
        .unwrap()
        .into_iter()
        .map(|m| m.body)
        .collect();
    assert_eq!(
        bodies,
        vec![
            b"one".to_vec(),
            b"two".to_vec(),
            b"three".to_vec(),
            b"four".to_vec()
        ]
    );
}

/// b sees a's message from the next epoch before the commit that opens it.
async fn future_frame_case(mode: hubsync::device::FutureFrames) -> (Inbox, TestDevice) {
    let CutOff {
        hubs,
        a,
        mut b,
        switch,
        g,
    } = member_cut_off(|o| o.manager.future_frames = mode).await;
    a.rotate_keys(g).await.unwrap();
    a.send(g, b"from the future").await.unwrap();
    // Read the frame off the hub as any client could.
    let reader = hubs[0]
        .client(&hubsync::testkit::signing_key(77))
        .await
        .unwrap();
    let topic = a.manager().record(g).unwrap().app_topics[0].clone();
    let deadline = tokio::time::Instant::now() + WAIT;
    let frame = loop {
        let f = reader.fetch(&topic, 0, 10).await.unwrap();
        if let Some(m) = f.messages.last() {
            break m.payload.clone();
        }
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    b.reopen().await.unwrap();
    let mut ib = Inbox::new(&b);
    b.manager().receive_app(g, &frame, None).await.unwrap();
    ib.settle(Duration::from_millis(200)).await;
    assert!(
        !ib.has(b"from the future"),
        "readable only after the commit"
    );
    switch.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    b.manager().retry_hubs(WAIT).await;
    converge(&[&a, &b], g).await;
    ib.settle(Duration::from_millis(500)).await;
    (ib, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_future_epoch_frame_is_kept_and_read_after_the_commit() {
    let (ib, b) = future_frame_case(hubsync::device::FutureFrames::Persist).await;
    assert!(ib.has(b"from the future"));
    assert!(ib.got.values().all(|(_, _, n)| *n == 1));
    assert_eq!(b.stats().dropped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_future_epoch_frame_is_dropped_and_counted_in_drop_mode() {
    let (ib, b) = future_frame_case(hubsync::device::FutureFrames::Drop).await;
    assert!(!ib.has(b"from the future"));
    assert!(b.stats().dropped >= 1);
}

/// A device that dies mid-commit, at either side of the publish, settles the
/// commit from its journal when it comes back: nothing lost, nothing doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_killed_mid_commit_settles_it_from_the_journal() {
    use std::sync::atomic::Ordering::SeqCst;
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let mut a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    let (e0, _) = converge(&[&a, &b], g).await;

    // Killed after the journal, before the publish: the commit never landed.
    a.manager().faults().halt_after_journal.store(true, SeqCst);
    assert!(a.rotate_keys(g).await.is_err());
    a.reopen().await.unwrap();
    let (e1, _) = converge(&[&a, &b], g).await;
    assert_eq!(e1, e0, "a commit that never left the device is dropped");

    // Killed after the hub accepted, before the merge: the commit landed and
    // b applied it; a adopts it from the journal instead of forking.
    a.manager().faults().halt_after_accept.store(true, SeqCst);
    assert!(a.rotate_keys(g).await.is_err());
    a.reopen().await.unwrap();
    let (e2, _) = converge(&[&a, &b], g).await;
    assert_eq!(e2, e0 + 1, "the accepted commit is adopted exactly once");

    // And the group carries on.
    a.rotate_keys(g).await.unwrap();
    a.send(g, b"still in sync").await.unwrap();
    ib.until("the message", |i| i.has(b"still in sync")).await;
    let (e3, _) = converge(&[&a, &b], g).await;
    assert_eq!(e3, e0 + 2);
}

/// An app that stops after its device took messages from the hub (and acked
/// them there) but before it processed them finds them in the device's
/// durable inbox when it opens the device again, at the positions their
/// events named, once each; what it marked processed is not offered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_that_stops_before_processing_reads_its_messages_after_reopening() {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let mut b = TestDevice::open(&u).await.unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    for n in 0..4 {
        a.send(g, format!("m{n}").as_bytes()).await.unwrap();
    }
    ib.until("4 messages", |i| i.got.len() >= 4).await;
    // The events and the inbox agree on positions.
    let announced: Vec<(u64, Vec<u8>)> = ib
        .events
        .iter()
        .filter_map(|e| match e {
            Event::MessageReceived { position, body, .. } => Some((*position, body.clone())),
            _ => None,
        })
        .collect();
    let stored: Vec<(u64, Vec<u8>)> = b
        .messages(g, 0, 100)
        .unwrap()
        .into_iter()
        .map(|m| (m.position, m.body))
        .collect();
    assert_eq!(announced, stored);
    assert_eq!(
        stored.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    // The app processed the first message only, then stopped.
    assert_eq!(b.mark_processed(g, 1).unwrap(), 1);
    b.close().await;
    a.send(g, b"while stopped").await.unwrap();
    b.reopen().await.unwrap();
    let mut ib = Inbox::new(&b);
    ib.until("the message sent while stopped", |i| {
        i.has(b"while stopped")
    })
    .await;
    let status = b.inbox_status(g).unwrap();
    assert_eq!(status.processed, 1);
    let unprocessed: Vec<(u64, Vec<u8>)> = b
        .messages(g, status.processed, 100)
        .unwrap()
        .into_iter()
        .map(|m| (m.position, m.body))
        .collect();
    assert_eq!(
        unprocessed,
        vec![
            (2, b"m1".to_vec()),
            (3, b"m2".to_vec()),
            (4, b"m3".to_vec()),
            (5, b"while stopped".to_vec()),
        ],
        "every unprocessed message, once, in order"
    );
    // Processed ones are gone, and a mark never goes back.
    assert!(b.messages(g, 0, 1).unwrap()[0].position > 1);
    assert_eq!(b.mark_processed(g, 0).unwrap(), 1);
    assert_eq!(b.stats().inbox_trimmed, 0);
}

/// A device can be awaited until it is invitable (then the first invite
/// lands with no retry); one whose hub is unreachable is told which hub is
/// missing and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_is_awaited_until_it_can_be_invited() {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    b.ready_for_invites(WAIT).await.unwrap();
    let g = a.create_group(&u).await.unwrap();
    a.invite(g, b.id()).await.unwrap();

    // Nothing listens on a port just released.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("ws://{}", l.local_addr().unwrap())
    };
    let c = TestDevice::open(std::slice::from_ref(&dead)).await.unwrap();
    match c.ready_for_invites(Duration::from_millis(500)).await {
        Err(hubsync::device::DeviceError::NotReady { missing }) => {
            assert_eq!(missing.len(), 1);
            assert_eq!(missing[0].0, dead);
        }
        other => panic!("expected NotReady, got {other:?}"),
    }
}

/// A device forgets a group on its own: its state there is gone (and stays
/// gone after a reopen), it no longer hears the group, its inbox stays
/// readable, and the others carry on unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_group_is_gone_here_only() {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let mut b = TestDevice::open(&u).await.unwrap();
    let c = TestDevice::open(&u).await.unwrap();
    let (mut ib, mut ic) = (Inbox::new(&b), Inbox::new(&c));
    let g = group_of(&a, &mut [(&b, &mut ib), (&c, &mut ic)], &u).await;
    a.send(g, b"before").await.unwrap();
    ib.until("the first message", |i| i.has(b"before")).await;

    b.forget_group(g).await.unwrap();
    ib.until("the forget announced", |i| {
        i.events
            .iter()
            .any(|e| matches!(e, Event::Forgotten { group } if *group == g))
    })
    .await;
    assert!(matches!(
        b.members(g).await,
        Err(hubsync::device::DeviceError::UnknownGroup(x)) if x == g
    ));
    assert!(b.groups().unwrap().is_empty());
    assert!(matches!(
        b.forget_group(g).await,
        Err(hubsync::device::DeviceError::UnknownGroup(_))
    ));
    assert_eq!(b.messages(g, 0, 10).unwrap()[0].body, b"before".to_vec());

    a.send(g, b"after").await.unwrap();
    ic.until("the others carry on", |i| i.has(b"after")).await;
    ib.settle(Duration::from_millis(300)).await;
    assert!(!ib.has(b"after"), "a forgotten group is not heard");
    b.reopen().await.unwrap();
    assert!(
        b.groups().unwrap().is_empty(),
        "still forgotten after a reopen"
    );
}

/// Every subscription gets every event from the moment it subscribed, as a
/// `Stream`; none is special (the first no more than a later one), and
/// none holds events from before it was made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_subscription_gets_the_same_events_from_when_it_subscribed() {
    use futures::StreamExt;
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let mut b = TestDevice::open(&u).await.unwrap();
    let mut first = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut first)], &u).await;
    // Subscribed after the Welcome: it must not see the join.
    let mut second = b.events();
    let mut third = b.events();
    a.send(g, b"after both subscribed").await.unwrap();
    first
        .until("the message", |i| {
            i.got
                .values()
                .any(|(_, body, _)| body == b"after both subscribed")
        })
        .await;
    let mut later = Vec::new();
    for stream in [&mut second, &mut third] {
        let mut seen = Vec::new();
        loop {
            let e = tokio::time::timeout(WAIT, stream.next())
                .await
                .expect("an event in time")
                .expect("the device is open")
                .expect("no lag");
            let done = matches!(&e, Event::MessageReceived { body, .. } if body == b"after both subscribed");
            seen.push(e);
            if done {
                break;
            }
        }
        later.push(seen);
    }
    assert_eq!(later[0], later[1], "two later subscriptions differ");
    for seen in &later {
        assert!(
            !seen.iter().any(|e| matches!(e, Event::GroupJoined { .. })),
            "a later subscription saw an event from before it: {seen:?}"
        );
        // What the later ones saw, the first saw too, in the same order.
        let tail = &first.events[first.events.len() - seen.len()..];
        assert_eq!(tail, &seen[..]);
    }
    // The stream ends when the device closes.
    b.close().await;
    let end = tokio::time::timeout(WAIT, async { while second.next().await.is_some() {} }).await;
    assert!(end.is_ok(), "the stream did not end with the device");
}

/// A pull that fails (here: the hub unreachable) is counted where the app
/// sees it, not only logged: most pulls run in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pull_is_counted_in_the_device_stats() {
    let CutOff { mut b, g, .. } = member_cut_off(|_| {}).await;
    b.reopen().await.unwrap();
    let before = b.stats().pull_failures;
    let r = b.manager().pull(g).await;
    assert!(r.is_err(), "the hub is out of reach: {r:?}");
    assert!(b.stats().pull_failures > before);
}

/// A pushed message a member's store cannot take is counted, left unacked,
/// and read again from the log once the store works, with no reconnect in
/// between; a later message of the same sender, pushed while the first
/// waited, reaches the app after it, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_message_the_store_refused_is_read_again_in_order() {
    let hubs = hubs(1).await;
    let u = urls(&hubs);
    let a = TestDevice::open(&u).await.unwrap();
    let faulty = hubsync::testkit::FaultyKv::switch();
    let b = TestDevice::open_with_store(hubsync::testkit::device_options(&u), faulty.store_wrap())
        .await
        .unwrap();
    let mut ib = Inbox::new(&b);
    let g = group_of(&a, &mut [(&b, &mut ib)], &u).await;
    converge(&[&a, &b], g).await;
    a.send(g, b"warm up").await.unwrap();
    ib.until("the first message", |i| i.has(b"warm up")).await;
    let before = b.stats().receive_failures;

    faulty.fail(true);
    a.send(g, b"refused").await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while b.stats().receive_failures == before {
        assert!(tokio::time::Instant::now() < deadline, "no failure counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.send(g, b"after it").await.unwrap();
    ib.settle(Duration::from_millis(300)).await;
    assert!(!ib.has(b"refused") && !ib.has(b"after it"));

    faulty.fail(false);
    ib.until("both messages", |i| i.has(b"refused") && i.has(b"after it"))
        .await;
    let order: Vec<&[u8]> = ib
        .events
        .iter()
        .filter_map(|e| match e {
            Event::MessageReceived { body, .. } => Some(body.as_slice()),
            _ => None,
        })
        .collect();
    assert_eq!(order, vec![&b"warm up"[..], b"refused", b"after it"]);
    ib.settle(Duration::from_millis(300)).await;
    assert!(ib.got.values().all(|(_, _, n)| *n == 1), "nothing twice");
    assert!(b.stats().receive_failures > before);
}

/// A subscription the hub refuses (here: past its limit of subscriptions
/// per device) reaches the app as an event naming the hub, the group and
/// the hub's answer, and is counted; it is never only a log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_the_hub_refuses_reaches_the_app() {
    let hub = TestHub::start_with(|c| c.limits.max_subscriptions = 3)
        .await
        .unwrap();
    let u = urls(std::slice::from_ref(&hub));
    let d = TestDevice::open(&u).await.unwrap();
    let mut events = d.events();
    // Each group takes several subscriptions: three pass the limit.
    let mut groups = Vec::new();
    for _ in 0..3 {
        groups.push(d.create_group(&u).await.unwrap());
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(Ok(Event::SubscriptionRefused {
                hub: url,
                group,
                error,
                ..
            }))) => {
                assert_eq!(url, hub.url());
                assert_eq!(
                    error,
                    hubsync::wire::HubError::TooManySubscriptions { max: 3 }
                );
                let g = group.expect("the refused topic is a group's");
                assert!(groups.contains(&g));
                break;
            }
            Ok(Some(_)) => {}
            other => panic!("no refusal reported: {other:?}"),
        }
    }
    assert!(d.stats().subscriptions_refused >= 1);
    assert!(d
        .stats()
        .prometheus_text()
        .contains("hubsync_device_subscriptions_refused_total "));
}
