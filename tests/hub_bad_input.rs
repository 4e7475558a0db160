//! Bad input from a raw WebSocket client: each gets a named error (or a close
//! with a reason), changes no state, and other clients carry on.

mod common;

use common::*;
use futures::SinkExt;
use hubsync::hub::Limits;
use hubsync::testkit::{signing_key, TestHub, TestStore};
use hubsync::wire::{
    ClientFrame, ExpectedHead, HubError, PublishOutcome, Request, ServerFrame, TopicId,
};
use proptest::prelude::*;
use tokio_tungstenite::tungstenite::Message;

async fn hub(store: TestStore) -> TestHub {
    TestHub::start_on(store, |c| {
        c.limits = Limits::unthrottled();
        c.limits.max_payload = 64 * 1024;
    })
    .await
    .unwrap()
}

/// The state every bad frame must leave alone.
async fn snapshot(hub: &TestHub) -> (Option<u64>, usize, u64) {
    let c = hub.client(&signing_key(99)).await.unwrap();
    let f = c.fetch(&TopicId::from("shared"), 0, 500).await.unwrap();
    (f.head, f.messages.len(), hub.hub().metrics().accepted)
}

fn expect_error(got: Got) -> HubError {
    match got {
        Got::Frame(ServerFrame::Error(e)) => e,
        Got::Frame(ServerFrame::Response { result: Err(e), .. }) => e,
        other => panic!("expected a named error, got {other:?}"),
    }
}

async fn malformed_frames_get_named_errors_and_change_nothing(store: TestStore) {
    let hub = hub(store).await;
    let good = hub.client(&signing_key(1)).await.unwrap();
    good.publish(log("shared", 1, ExpectedHead::Empty, b"before"))
        .await
        .unwrap();
    let before = snapshot(&hub).await;

    let mut raw = RawConn::login(hub.url(), &signing_key(2)).await;
    // Empty frame.
    raw.send_bytes(vec![]).await;
    assert!(matches!(
        expect_error(raw.recv().await),
        HubError::Malformed { .. }
    ));
    // Unknown frame kind.
    raw.send_bytes(vec![0xee, 1, 2, 3]).await;
    assert_eq!(
        expect_error(raw.recv().await),
        HubError::UnknownFrameKind { kind: 0xee }
    );
    // Unknown operation, answered on its request id.
    raw.send_bytes(vec![2, 42, 99]).await;
    match raw.recv().await {
        Got::Frame(ServerFrame::Response {
            id: 42,
            result: Err(HubError::UnknownOperation { op: 99 }),
        }) => {}
        other => panic!("{other:?}"),
    }
    // A truncated publish.
    let full = request(
        7,
        Request::Publish(log("shared", 2, ExpectedHead::Unconditional, &[5; 100])),
    )
    .encode();
    raw.send_bytes(full[..full.len() - 10].to_vec()).await;
    assert!(matches!(
        expect_error(raw.recv().await),
        HubError::Malformed { .. }
    ));
    // Trailing garbage.
    let mut long = full.clone();
    long.extend_from_slice(&[0, 0, 0]);
    raw.send_bytes(long).await;
    assert!(matches!(
        expect_error(raw.recv().await),
        HubError::Malformed { .. }
    ));
    // A text frame.
    raw.ws.send(Message::Text("hello".into())).await.unwrap();
    assert_eq!(expect_error(raw.recv().await), HubError::TextFrame);
    // Oversized, but within what the socket reads: a named error.
    let max = Limits {
        max_payload: 64 * 1024,
        ..Limits::default()
    }
    .max_frame();
    raw.send_bytes(vec![2; max + 1]).await;
    assert_eq!(
        expect_error(raw.recv().await),
        HubError::FrameTooLarge {
            len: max as u64 + 1,
            max: max as u64
        }
    );
    // The connection still works after all of that.
    raw.send(&request(8, Request::Ping)).await;
    assert!(matches!(
        raw.recv().await,
        Got::Frame(ServerFrame::Response {
            id: 8,
            result: Ok(_)
        })
    ));
    assert_eq!(snapshot(&hub).await, before);

    // Far over the limit: the socket refuses it and closes with a reason.
    raw.send_bytes(vec![2; max * 2 + 10]).await;
    match raw.recv().await {
        Got::Close(reason) => assert!(reason.contains("too large"), "{reason}"),
        other => panic!("expected a close with a reason, got {other:?}"),
    }
    // Others are unaffected.
    assert_eq!(
        good.publish(log("shared", 3, ExpectedHead::Seq(1), b"after"))
            .await
            .unwrap(),
        PublishOutcome::Accepted {
            seq: 2,
            head: Some(2)
        }
    );
    assert!(hub.hub().metrics().bad_frames >= 8);
}

async fn frames_before_auth_are_refused_without_effect(store: TestStore) {
    let hub = hub(store).await;
    let before = snapshot(&hub).await;
    let mut raw = RawConn::open(hub.url()).await;
    raw.send(&request(
        1,
        Request::Publish(log("shared", 1, ExpectedHead::Unconditional, b"x")),
    ))
    .await;
    assert!(matches!(
        raw.recv().await,
        Got::Frame(ServerFrame::Response {
            id: 1,
            result: Err(HubError::NotAuthenticated)
        })
    ));
    raw.send(&request(
        2,
        Request::Subscribe {
            topic: TopicId::from("shared"),
            retention_secs: None,
        },
    ))
    .await;
    assert_eq!(expect_error(raw.recv().await), HubError::NotAuthenticated);
    raw.send_bytes(vec![77]).await;
    assert_eq!(
        expect_error(raw.recv().await),
        HubError::UnknownFrameKind { kind: 77 }
    );
    raw.ws.send(Message::Text("{}".into())).await.unwrap();
    assert_eq!(expect_error(raw.recv().await), HubError::TextFrame);
    // Authentication still works on the same connection afterwards.
    let a = raw.auth_for(&signing_key(3));
    raw.send(&ClientFrame::Auth(a)).await;
    assert!(matches!(
        raw.recv().await,
        Got::Frame(ServerFrame::AuthOk(_))
    ));
    assert_eq!(snapshot(&hub).await, before);
}

#[test]
fn random_bytes_never_hurt_the_hub() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let hub = rt.block_on(hub(TestStore::Sled));
    let url = hub.url().to_string();
    let conns = std::cell::RefCell::new(rt.block_on(async {
        (
            RawConn::login(&url, &signing_key(4)).await,
            RawConn::open(&url).await,
        )
    }));
    let good = rt.block_on(hub.client(&signing_key(5))).unwrap();
    let before = rt.block_on(snapshot(&hub));
    let config = ProptestConfig {
        cases: 200,
        ..ProptestConfig::default()
    };
    proptest!(config, |(bytes in proptest::collection::vec(any::<u8>(), 0..200))| {
        // A random frame that happens to decode as a valid request could
        // change state legitimately; only probe the ones that do not.
        prop_assume!(ClientFrame::decode(&bytes, MAX).is_err());
        let mut conns = conns.borrow_mut();
        let (authed, fresh) = &mut *conns;
        rt.block_on(async {
            authed.send_bytes(bytes.clone()).await;
            assert!(matches!(authed.recv().await, Got::Frame(ServerFrame::Error(_)) | Got::Frame(ServerFrame::Response { result: Err(_), .. })));
            fresh.send_bytes(bytes.clone()).await;
            assert!(matches!(fresh.recv().await, Got::Frame(ServerFrame::Error(_)) | Got::Frame(ServerFrame::Response { result: Err(_), .. })));
        });
    });
    rt.block_on(async {
        assert_eq!(snapshot(&hub).await, before);
        good.ping().await.unwrap();
        good.publish(log("shared", 1, ExpectedHead::Unconditional, b"still fine"))
            .await
            .unwrap();
    });
}

on_both_stores!(
    malformed_frames_get_named_errors_and_change_nothing,
    frames_before_auth_are_refused_without_effect,
);
