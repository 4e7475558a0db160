//! Power cuts: what the hub acked and what a device merged or landed
//! survives losing the machine, not only the process. Real hubs over
//! loopback TCP and real devices, each on its sled store behind a
//! [`PowerSwitch`]: a cut throws away every write no flush covered and
//! kills the store under the running hub or device; the restart or reopen
//! boots on what was flushed (docs/operations.md, "Durability").

mod common;

use common::*;
use hubsync::client::Push;
use hubsync::device::{Event, GroupId};
use hubsync::hub::{HubConfig, Limits};
use hubsync::testkit::{device_options, signing_key, PowerSwitch, TestDevice, TestHub};
use hubsync::wire::{ExpectedHead, PublishOutcome, TopicId};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

fn unthrottled(c: &mut HubConfig) {
    c.limits = Limits::unthrottled();
}

/// A hub on a store behind `power`: publish to a log topic and to a
/// subscriber's mailbox topic, cut the power once both are acked, restart
/// the hub, and check that both are there. Flushes that lie (answer `Ok`
/// and keep nothing) make this fail: the check can catch a hub that acks
/// before a real flush.
async fn acked_publishes_survive_a_power_cut_of_the_hub(lying_flushes: bool) {
    let power = PowerSwitch::new();
    let hub = TestHub::start_wrapped(power.store_wrap(), unthrottled)
        .await
        .unwrap();
    power.lie_about_flushes(lying_flushes);
    let publisher = hub.client(&signing_key(1)).await.unwrap();
    let subscriber = hub.client(&signing_key(2)).await.unwrap();
    let mailbox_topic = TopicId::from("mailbox");
    subscriber.subscribe(&mailbox_topic, None).await.unwrap();
    let log_outcome = publisher
        .publish(log("log", 1, ExpectedHead::Empty, b"acked to the log"))
        .await
        .unwrap();
    assert!(
        matches!(log_outcome, PublishOutcome::Accepted { seq: 1, .. }),
        "{log_outcome:?}"
    );
    let mailbox_outcome = publisher
        .publish(mailbox("mailbox", 2, b"acked to the mailbox"))
        .await
        .unwrap();
    assert!(
        matches!(mailbox_outcome, PublishOutcome::Accepted { .. }),
        "{mailbox_outcome:?}"
    );

    power.cut();
    drop((publisher, subscriber));
    let hub = hub.restart(unthrottled).await.unwrap();

    let reader = hub.client(&signing_key(3)).await.unwrap();
    let fetched = reader.fetch(&TopicId::from("log"), 0, 10).await.unwrap();
    let payloads: Vec<_> = fetched.messages.iter().map(|m| &m.payload[..]).collect();
    assert_eq!(
        payloads,
        [b"acked to the log"],
        "a log publish the hub acked before the power cut is gone"
    );
    // The subscriber comes back and gets the frame queued for it.
    let subscriber = hub.client(&signing_key(2)).await.unwrap();
    let mut pushes = subscriber.take_pushes().unwrap();
    subscriber.receive().await.unwrap();
    match tokio::time::timeout(Duration::from_secs(5), pushes.recv()).await {
        Ok(Some(Push::Delivery(d))) => assert_eq!(d.payload, b"acked to the mailbox"),
        other => panic!("a mailbox publish the hub acked before the power cut is gone: {other:?}"),
    }
    hub.stop().await;
}

#[tokio::test]
async fn a_publish_the_hub_acked_survives_a_power_cut() {
    acked_publishes_survive_a_power_cut_of_the_hub(false).await;
}

/// The test above, with flushes that do nothing: it must fail, or it could
/// not tell an ack after a real flush from one before.
#[tokio::test]
#[should_panic(expected = "acked before the power cut is gone")]
async fn the_power_cut_test_fails_when_the_hubs_flushes_keep_nothing() {
    acked_publishes_survive_a_power_cut_of_the_hub(true).await;
}

/// Wait until `d` has emitted an event `pred` accepts (since its latest
/// open), or fail saying `what`.
async fn until_event(d: &TestDevice, what: &str, pred: impl Fn(&Event) -> bool) {
    let log = d.event_log();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !log.snapshot().iter().any(&pred) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; events: {:?}",
            log.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `from` sends `body` and `to` receives it.
async fn message_reaches(from: &TestDevice, to: &TestDevice, g: GroupId, body: &[u8]) {
    from.send(g, body).await.unwrap();
    until_event(
        to,
        "the message",
        |e| matches!(e, Event::MessageReceived { group, body: b, .. } if *group == g && b == body),
    )
    .await;
}

/// A hub, its URLs, device a, and device b whose store is behind a power
/// switch.
async fn a_and_b_behind_a_power_switch(
) -> (TestHub, Vec<String>, TestDevice, PowerSwitch, TestDevice) {
    let hub = TestHub::start_with(unthrottled).await.unwrap();
    let urls = vec![hub.url().to_string()];
    let a = TestDevice::open(&urls).await.unwrap();
    let power = PowerSwitch::new();
    let b = TestDevice::open_with_store(device_options(&urls), power.store_wrap())
        .await
        .unwrap();
    (hub, urls, a, power, b)
}

/// Two devices in a group, b's store behind a power switch: b merges a's
/// commit and lands one of its own, the power is cut, b reopens at that
/// epoch and goes on with a. With flushes that lie from b's join on, this
/// fails: b comes back at the epoch it joined in.
async fn merged_and_landed_commits_survive_a_power_cut_of_a_device(lying_flushes: bool) {
    let (hub, urls, a, power, mut b) = a_and_b_behind_a_power_switch().await;
    let g = a.create_group(&urls).await.unwrap();
    a.invite_when_ready(g, b.id(), WAIT).await.expect("invite");
    until_event(
        &b,
        "b joining",
        |e| matches!(e, Event::GroupJoined { group, .. } if *group == g),
    )
    .await;

    power.lie_about_flushes(lying_flushes);
    // Merged: a's commit reaches b, which says so only once it is durable.
    let merged = a.rotate_keys(g).await.unwrap().outcome.epoch;
    until_event(
        &b,
        "b merging a's commit",
        |e| matches!(e, Event::EpochChanged { group, epoch } if *group == g && *epoch == merged),
    )
    .await;
    // Landed: b's own commit, answered once the hub accepted it.
    let landed = b.rotate_keys(g).await.unwrap().outcome.epoch;
    assert_eq!(landed, merged + 1);

    power.cut();
    b.reopen().await.unwrap();
    assert_eq!(
        b.epoch(g).await.unwrap(),
        landed,
        "b lost the commit it landed before the power cut"
    );

    // b goes on with a: the same epoch, messages both ways.
    let deadline = tokio::time::Instant::now() + WAIT;
    while a.epoch(g).await.unwrap() != landed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a never merged b's commit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        a.epoch_authenticator(g).await.unwrap(),
        b.epoch_authenticator(g).await.unwrap(),
        "a and b are in different groups after the power cut"
    );
    message_reaches(&b, &a, g, b"from b after the power cut").await;
    message_reaches(&a, &b, g, b"from a after the power cut").await;
    // And b can still commit.
    let after = b.rotate_keys(g).await.unwrap().outcome.epoch;
    assert_eq!(after, landed + 1);
    hub.stop().await;
}

#[tokio::test]
async fn a_commit_a_device_merged_and_one_it_landed_survive_a_power_cut() {
    merged_and_landed_commits_survive_a_power_cut_of_a_device(false).await;
}

/// The test above, with b's flushes doing nothing once it joined: it must
/// fail, or it could not tell a commit made durable from one that was not.
#[tokio::test]
#[should_panic(expected = "b lost the commit it landed before the power cut")]
async fn the_device_power_cut_test_fails_when_its_flushes_keep_nothing() {
    merged_and_landed_commits_survive_a_power_cut_of_a_device(true).await;
}

/// b's key packages are on the hub and b's power is cut with nothing
/// flushed since it put them there; while b is down, a invites it with
/// one of them. b, back, must read that Welcome: the packages' keys were
/// durable before the hub could hand the packages out. With flushes that
/// keep nothing once b opened, this fails: b comes back without the keys.
async fn key_packages_on_the_hub_survive_a_power_cut_of_their_device(lying_flushes: bool) {
    let (hub, urls, a, power, mut b) = a_and_b_behind_a_power_switch().await;
    // b's identity is durable once it opened; its key packages go to the
    // hub after that, once it is connected.
    power.lie_about_flushes(lying_flushes);
    b.ready_for_invites(WAIT)
        .await
        .expect("b's key packages on the hub");
    let id = b.id();
    // The power goes while b runs, with nothing flushed since the upload
    // but what the upload itself flushed.
    power.cut();

    let g = a.create_group(&urls).await.unwrap();
    a.invite(g, id).await.expect("a invites b while b is down");
    b.reopen().await.unwrap();
    assert_eq!(b.id(), id, "b came back as itself");
    until_event(
        &b,
        "b joining",
        |e| matches!(e, Event::GroupJoined { group, .. } if *group == g),
    )
    .await;
    // Joined from that Welcome, not from another after asking a to invite
    // it again (what a device does with a Welcome it cannot read).
    let refused: Vec<Event> = b
        .event_log()
        .snapshot()
        .into_iter()
        .filter(|e| matches!(e, Event::WelcomeRefused { .. }))
        .collect();
    assert!(
        refused.is_empty(),
        "b could not read the Welcome built on a package from before the power cut: {refused:?}"
    );
    message_reaches(&a, &b, g, b"to b after the power cut").await;
    hub.stop().await;
}

#[tokio::test]
async fn key_packages_a_device_put_on_the_hub_survive_its_power_cut() {
    key_packages_on_the_hub_survive_a_power_cut_of_their_device(false).await;
}

/// The test above with flushes that keep nothing: it must fail.
#[tokio::test]
#[should_panic(expected = "b could not read the Welcome")]
async fn the_key_package_power_cut_test_fails_when_flushes_keep_nothing() {
    key_packages_on_the_hub_survive_a_power_cut_of_their_device(true).await;
}
