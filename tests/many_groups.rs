//! Groups by the thousand: a device in a thousand groups on one hub, under
//! the hub's default subscription limits, hears every group, also after the
//! hub restarts and every device re-subscribes at once.

use futures::StreamExt;
use hubsync::device::{CommitError, Event, EventStream, GroupId};
use hubsync::hub::Limits;
use hubsync::testkit::{TestDevice, TestHub};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

const GROUPS: usize = 1000;
const WAIT: Duration = Duration::from_secs(120);

/// The subscription limits are the defaults, since they are what is
/// tested. Publishes, key-package claims and Welcome posts are not
/// throttled, only so that a thousand groups form in seconds.
fn limits() -> Limits {
    let defaults = Limits::default();
    Limits {
        max_subscriptions: defaults.max_subscriptions,
        subscription_rate: defaults.subscription_rate,
        ..Limits::unthrottled()
    }
}

/// Events until `done` says so, failing on a refused subscription, a lag or
/// the deadline.
async fn until(events: &mut EventStream, what: &str, mut done: impl FnMut(&Event) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(Ok(Event::SubscriptionRefused { error, .. }))) => {
                panic!("a subscription was refused: {error}")
            }
            Ok(Some(Ok(e))) => {
                if done(&e) {
                    return;
                }
            }
            Ok(Some(Err(lag))) => panic!("{lag}"),
            Ok(None) => panic!("event channel closed"),
            Err(_) => panic!("timed out waiting for {what}"),
        }
    }
}

/// `a` sends one message in each of `groups`; `b` must hear each once.
async fn every_group_heard(
    a: &TestDevice,
    events: &mut EventStream,
    groups: &[GroupId],
    round: &str,
) {
    futures::stream::iter(groups)
        .for_each_concurrent(16, |g| async move {
            a.send(*g, format!("{round} in {g}").as_bytes())
                .await
                .unwrap();
        })
        .await;
    let mut heard: HashMap<GroupId, usize> = HashMap::new();
    until(events, &format!("{round} messages"), |e| {
        if let Event::MessageReceived { group, body, .. } = e {
            if body.starts_with(round.as_bytes()) {
                *heard.entry(*group).or_default() += 1;
            }
        }
        heard.len() == groups.len()
    })
    .await;
    // Whatever else comes in a moment is counted too: nothing twice.
    let settle = tokio::time::Instant::now() + Duration::from_millis(500);
    while let Ok(Some(Ok(e))) = tokio::time::timeout_at(settle, events.recv()).await {
        if let Event::MessageReceived { group, body, .. } = e {
            if body.starts_with(round.as_bytes()) {
                *heard.entry(group).or_default() += 1;
            }
        }
    }
    assert!(heard.values().all(|n| *n == 1), "a message came twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_in_a_thousand_groups_hears_every_one() {
    let dir = tempfile::tempdir().unwrap();
    let hub = TestHub::start_at(dir.path(), "127.0.0.1:0", |c| c.limits = limits())
        .await
        .unwrap();
    let addr = hub.addr().to_string();
    let u = vec![hub.url().to_string()];
    let a = TestDevice::open(&u).await.unwrap();
    let b = TestDevice::open(&u).await.unwrap();
    b.ready_for_invites(WAIT).await.unwrap();
    let mut events = b.events();

    let groups: Vec<GroupId> = futures::stream::iter(0..GROUPS)
        .map(|_| async {
            let g = a.create_group(&u).await.unwrap();
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                match a.invite(g, b.id()).await {
                    Ok(_) => break,
                    // b's pool ran dry for a moment; it restocks.
                    Err(CommitError::NoKeyPackage(_)) if tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    Err(e) => panic!("invite failed: {e}"),
                }
            }
            g
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut joined = BTreeSet::new();
    until(&mut events, "every Welcome", |e| {
        if let Event::GroupJoined { group, .. } = e {
            joined.insert(*group);
        }
        joined.len() == GROUPS
    })
    .await;

    every_group_heard(&a, &mut events, &groups, "first").await;

    // The hub restarts: both devices reconnect and re-subscribe every
    // group's topics at once, in batches, without spending publish rate.
    hub.stop().await;
    let hub = TestHub::start_at(dir.path(), &addr, |c| c.limits = limits())
        .await
        .unwrap();
    every_group_heard(&a, &mut events, &groups, "second").await;

    let m = hub.hub().metrics();
    assert_eq!(m.rate_limited.subscriptions, 0, "{m:?}");
    assert_eq!(b.stats().subscriptions_refused, 0);
    assert_eq!(a.stats().subscriptions_refused, 0);
    hub.stop().await;
}
