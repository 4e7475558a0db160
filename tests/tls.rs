//! TLS: `wss://` hubs serve a certificate and devices verify it; plain
//! `ws://` is for loopback only; a hub's TLS accept survives clients that
//! stall or send garbage.

mod common;

use common::*;
use futures::FutureExt;
use hubsync::client::{ClientError, ClientOptions, HubClient};
use hubsync::device::{DeviceOptions, Event, GroupId};
use hubsync::testkit::{device_options, signing_key, TestCert, TestDevice, TestHub};
use hubsync::transport::{Connector, NetConnector, TcpConnector, TlsConfig};
use hubsync::wire::{ExpectedHead, PublishOutcome, TopicId};
use std::io::{self, BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(20);

/// Connect to `url` through `connector` and give back the error.
async fn refused(connector: &dyn Connector, url: &str) -> ClientError {
    match HubClient::connect(connector, url, &signing_key(9), ClientOptions::default()).await {
        Ok(_) => panic!("connecting to {url} must fail"),
        Err(e) => e,
    }
}

/// The reason of a `Connect` error, failing on any other.
fn connect_reason(e: ClientError) -> String {
    match e {
        ClientError::Connect { reason, .. } => reason,
        other => panic!("expected a connect error, got {other:?}"),
    }
}

/// Wait until `cond` holds, or fail after 5 s.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Read until the peer closes (or resets); fails after `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) {
    let mut buf = [0u8; 1024];
    let waited = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // a TLS alert, say
            }
        }
    })
    .await;
    assert!(waited.is_ok(), "the hub did not close the connection");
}

#[tokio::test]
async fn client_publishes_and_fetches_over_wss_trusting_the_generated_root() {
    let hub = TestHub::start_tls().await.unwrap();
    assert!(hub.url().starts_with("wss://127.0.0.1:"), "{}", hub.url());
    let client = hub.client(&signing_key(1)).await.unwrap();
    let topic = TopicId::from("tls/log");
    let out = client
        .publish(log("tls/log", 1, ExpectedHead::Empty, b"over tls"))
        .await
        .unwrap();
    assert!(matches!(out, PublishOutcome::Accepted { .. }), "{out:?}");
    let fetched = client.fetch(&topic, 0, 10).await.unwrap();
    assert_eq!(fetched.messages.len(), 1);
    assert_eq!(fetched.messages[0].payload, b"over tls");
    assert_eq!(hub.tls_stats().unwrap().handshakes(), 1);
    hub.stop().await;
}

#[tokio::test]
async fn client_without_the_root_refuses_the_hub_certificate() {
    let hub = TestHub::start_tls().await.unwrap();
    let reason = connect_reason(refused(&NetConnector::default(), hub.url()).await);
    assert!(reason.contains("certificate"), "{reason}");
    // The hub saw the client give up on its certificate.
    let stats = hub.tls_stats().unwrap();
    eventually("the hub counts the failed handshake", || {
        stats.failed() == 1
    })
    .await;
    assert_eq!(stats.handshakes(), 0);
    hub.stop().await;
}

#[tokio::test]
async fn a_man_in_the_middle_with_another_certificate_is_refused() {
    let real = TestHub::start_tls().await.unwrap();
    let mitm = TestHub::start_tls().await.unwrap();
    let trusting_real = real.connector();
    // The real hub is reachable with its root...
    let ok = HubClient::connect(
        &trusting_real,
        real.url(),
        &signing_key(1),
        ClientOptions::default(),
    )
    .await;
    assert!(ok.is_ok(), "{:?}", ok.err());
    // ...and a hub answering with a certificate from another authority,
    // for the very same names, is not.
    let reason = connect_reason(refused(&trusting_real, mitm.url()).await);
    assert!(reason.contains("certificate"), "{reason}");
    real.stop().await;
    mitm.stop().await;
}

#[tokio::test]
async fn plain_ws_to_a_remote_host_is_refused_before_any_connect() {
    // The production default, as a device gets it.
    let options = DeviceOptions::new(vec![]);
    for url in [
        "ws://10.255.255.1:7400",
        "ws://hub.example.invalid:7400/x",
        "ws://[fd00::1]:7400",
    ] {
        // Ready on the first poll: refused from the URL alone, with no name
        // lookup and no connect attempted.
        let first_poll = options.connector.connect(url).now_or_never();
        let err = match first_poll {
            Some(Err(e)) => e,
            Some(Ok(_)) => panic!("{url} must be refused"),
            None => panic!("{url} was not refused at once: something was dialled"),
        };
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{url}: {err}");
        assert!(err.to_string().contains("not loopback"), "{err}");
    }
    let reason = connect_reason(refused(&NetConnector::default(), "ws://10.255.255.1:7400").await);
    assert!(reason.contains("allow_plain_ws"), "{reason}");
}

#[tokio::test]
async fn plain_ws_to_a_remote_host_is_allowed_when_asked() {
    let lax = NetConnector::new(TlsConfig {
        allow_plain_ws: true,
        ..TlsConfig::default()
    })
    .unwrap();
    // Only the policy is asked: nothing is dialled.
    lax.check_url("ws://10.255.255.1:7400").unwrap();
    lax.check_url("ws://hub.example.invalid:7400").unwrap();
    let strict = NetConnector::default();
    assert!(strict.check_url("ws://10.255.255.1:7400").is_err());
}

#[tokio::test]
async fn plain_ws_to_loopback_works_with_the_default_connector() {
    let hub = TestHub::start().await.unwrap();
    let client = HubClient::connect(
        &NetConnector::default(),
        hub.url(),
        &signing_key(1),
        ClientOptions::default(),
    )
    .await
    .unwrap();
    client.ping().await.unwrap();
    hub.stop().await;
}

#[tokio::test]
async fn a_client_that_never_says_hello_does_not_block_others_and_times_out() {
    let cert = TestCert::generate().unwrap();
    let hub = TestHub::start_tls_with(&cert, Duration::from_millis(500), |_| {})
        .await
        .unwrap();
    let mut silent = TcpStream::connect(hub.addr()).await.unwrap();
    // Let the hub take the silent connection first.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let client = hub.client(&signing_key(1)).await.unwrap();
    client.ping().await.unwrap();
    let stats = hub.tls_stats().unwrap();
    assert_eq!(
        stats.timed_out(),
        0,
        "served before the silent one timed out"
    );
    closed_within(&mut silent, Duration::from_secs(5)).await;
    assert_eq!(stats.timed_out(), 1);
    assert_eq!(stats.handshakes(), 1);
    hub.stop().await;
}

#[tokio::test]
async fn garbage_instead_of_a_client_hello_does_not_panic_the_hub() {
    let hub = TestHub::start_tls().await.unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = vec![0u8; 4096];
    for b in random.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        *b = seed as u8;
    }
    let inputs: Vec<Vec<u8>> = vec![
        random,
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n".to_vec(),
        // A handshake record header announcing more than a record may hold.
        vec![0x16, 0x03, 0x01, 0xff, 0xff, 0x01, 0x00],
        // A well-formed record header with a truncated ClientHello, then EOF.
        vec![0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0x00, 0x00, 0x01],
    ];
    let n = inputs.len() as u64;
    for bytes in inputs {
        let mut s = TcpStream::connect(hub.addr()).await.unwrap();
        let _ = s.write_all(&bytes).await;
        let _ = s.shutdown().await;
        closed_within(&mut s, Duration::from_secs(15)).await;
    }
    // A plain WebSocket client to a TLS hub fails its handshake too.
    let plain = format!("ws://{}", hub.addr());
    let e = refused(&TcpConnector, &plain).await;
    assert!(matches!(e, ClientError::Handshake { .. }), "{e:?}");

    let stats = hub.tls_stats().unwrap();
    eventually("every bad handshake counted", || stats.failed() == n + 1).await;
    // The accept loop is alive: a real client is still served.
    hub.client(&signing_key(1))
        .await
        .unwrap()
        .ping()
        .await
        .unwrap();
    hub.stop().await;
}

/// Wait for an event matching `pred`.
async fn until_event(
    rx: &mut hubsync::device::EventStream,
    what: &str,
    pred: impl Fn(&Event) -> bool,
) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Ok(e))) if pred(&e) => return,
            Ok(Some(_)) => {}
            Ok(None) => panic!("event channel closed"),
            Err(_) => panic!("timed out waiting for {what}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_trusting_the_root_share_a_group_over_wss() {
    let hub = TestHub::start_tls().await.unwrap();
    let urls = vec![hub.url().to_string()];
    let options = || {
        let mut o = device_options(&urls);
        o.connector = Arc::new(hub.connector());
        o
    };
    let a = TestDevice::open_with(options()).await.unwrap();
    let b = TestDevice::open_with(options()).await.unwrap();
    let mut b_events = b.events();
    let g: GroupId = a.create_group(&urls).await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match a.invite(g, b.id()).await {
            Ok(_) => break,
            Err(hubsync::device::CommitError::NoKeyPackage(_))
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("invite failed: {e}"),
        }
    }
    until_event(
        &mut b_events,
        "the welcome",
        |e| matches!(e, Event::GroupJoined { group, .. } if *group == g),
    )
    .await;
    a.send(g, b"hello over wss").await.unwrap();
    until_event(
        &mut b_events,
        "the message",
        |e| matches!(e, Event::MessageReceived { body, .. } if body == b"hello over wss"),
    )
    .await;
    drop((a, b));
    hub.stop().await;
}

#[test]
fn hub_binary_serves_wss_from_pem_files() {
    let dir = tempfile::tempdir().unwrap();
    let cert = TestCert::generate().unwrap();
    let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_file, cert.cert_pem()).unwrap();
    std::fs::write(&key_file, cert.key_pem()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hubsync"))
        .args(["hub", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path().join("data"))
        .arg("--tls-cert")
        .arg(&cert_file)
        .arg("--tls-key")
        .arg(&key_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn hubsync hub");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "hubsync hub listening on <addr> as <url>"
    let url = line.split_whitespace().nth(6).map(str::to_string);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pinged = rt.block_on(async {
        let url = url.clone().unwrap_or_default();
        let client = HubClient::connect(
            &cert.connector().unwrap(),
            &url,
            &signing_key(1),
            ClientOptions::default(),
        )
        .await?;
        client.ping().await
    });
    let _ = child.kill();
    let _ = child.wait();
    let url = url.unwrap_or_else(|| panic!("unexpected first line: {line:?}"));
    assert!(url.starts_with("wss://127.0.0.1:"), "{line}");
    pinged.unwrap();
}

#[test]
fn hub_binary_wants_cert_and_key_together() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    std::fs::write(&cert, TestCert::generate().unwrap().cert_pem()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hubsync"))
        .args(["hub", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path().join("data"))
        .arg("--tls-cert")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--tls-key"), "{stderr}");
}

#[test]
fn hub_binary_refuses_a_key_that_is_not_the_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let (one, other) = (TestCert::generate().unwrap(), TestCert::generate().unwrap());
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, one.cert_pem()).unwrap();
    std::fs::write(&key, other.key_pem()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hubsync"))
        .args(["hub", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path().join("data"))
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("TLS"), "{stderr}");
}
