//! Shared helpers for the integration tests: a raw WebSocket client that can
//! send anything, and small builders.
#![allow(dead_code)]

use ed25519_dalek::{Signer, SigningKey};
use futures::{SinkExt, StreamExt};
use hubsync::wire::{
    auth_message, Auth, Challenge, ClientFrame, DeviceId, ExpectedHead, Publish, PublishId,
    Request, RetentionClass, ServerFrame, TopicId, PROTOCOL_VERSION,
};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Run each named test body, an `async fn(TestStore)`, on both hub stores:
/// as `<name>::sled` and `<name>::postgres` (the PostgreSQL one on this
/// test process's own server, `hubsync::testkit::TestPostgres`).
#[macro_export]
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn sled() {
                super::$name(hubsync::testkit::TestStore::Sled).await
            }
            #[tokio::test]
            async fn postgres() {
                super::$name(hubsync::testkit::TestStore::Postgres).await
            }
        }
    )*};
}

pub const MAX: usize = 4 << 20;

/// What a raw connection read.
#[derive(Debug)]
pub enum Got {
    Frame(ServerFrame),
    Close(String),
    Closed,
    Timeout,
}

/// A WebSocket connection that sends whatever a test tells it to.
pub struct RawConn {
    pub ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    pub challenge: Challenge,
}

impl RawConn {
    pub async fn open(url: &str) -> RawConn {
        let (mut ws, _) = tokio_tungstenite::connect_async(url)
            .await
            .expect("connect");
        let challenge = match next(&mut ws).await {
            Got::Frame(ServerFrame::Challenge(c)) => c,
            other => panic!("expected challenge, got {other:?}"),
        };
        RawConn { ws, challenge }
    }

    pub fn auth_for(&self, key: &SigningKey) -> Auth {
        signed_auth(key, &self.challenge, &self.challenge.hub_url)
    }

    pub async fn send_bytes(&mut self, b: Vec<u8>) {
        self.ws.send(Message::Binary(b.into())).await.expect("send");
    }

    pub async fn send(&mut self, f: &ClientFrame) {
        self.send_bytes(f.encode()).await;
    }

    pub async fn recv(&mut self) -> Got {
        next(&mut self.ws).await
    }

    /// Authenticate as `key` and expect success.
    pub async fn login(url: &str, key: &SigningKey) -> RawConn {
        let mut c = RawConn::open(url).await;
        let a = c.auth_for(key);
        c.send(&ClientFrame::Auth(a)).await;
        match c.recv().await {
            Got::Frame(ServerFrame::AuthOk(_)) => c,
            other => panic!("expected auth ok, got {other:?}"),
        }
    }
}

pub fn signed_auth(key: &SigningKey, c: &Challenge, url: &str) -> Auth {
    let sig = key.sign(&auth_message(&c.nonce, url, c.expires_at_ms));
    Auth {
        version: PROTOCOL_VERSION,
        device: DeviceId(key.verifying_key().to_bytes()),
        nonce: c.nonce,
        hub_url: url.to_string(),
        expires_at_ms: c.expires_at_ms,
        signature: sig.to_bytes().to_vec(),
    }
}

pub async fn next(ws: &mut WebSocketStream<MaybeTlsStream<TcpStream>>) -> Got {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), ws.next()).await {
            Err(_) => return Got::Timeout,
            Ok(Some(Ok(Message::Binary(b)))) => {
                return Got::Frame(ServerFrame::decode(&b, MAX).expect("hub frames decode"))
            }
            Ok(Some(Ok(Message::Close(c)))) => {
                return Got::Close(c.map(|c| c.reason.to_string()).unwrap_or_default())
            }
            Ok(Some(Ok(_))) => continue,
            Ok(Some(Err(_))) | Ok(None) => return Got::Closed,
        }
    }
}

pub fn pid(n: u64) -> PublishId {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&n.to_be_bytes());
    PublishId(b)
}

pub fn log(topic: &str, id: u64, expected: ExpectedHead, payload: &[u8]) -> Publish {
    Publish {
        topic: TopicId::from(topic),
        publish_id: pid(id),
        class: RetentionClass::Log,
        expected_head: expected,
        replay_only: false,
        retention_secs: None,
        payload: payload.to_vec(),
        writer: None,
    }
}

pub fn mailbox(topic: &str, id: u64, payload: &[u8]) -> Publish {
    Publish {
        class: RetentionClass::Mailbox,
        ..log(topic, id, ExpectedHead::Unconditional, payload)
    }
}

pub fn request(id: u64, op: Request) -> ClientFrame {
    ClientFrame::Request { id, op }
}

pub fn device_of(key: &SigningKey) -> DeviceId {
    DeviceId(key.verifying_key().to_bytes())
}

/// Every client of `clients` publishes at once on topic `race`, whose head
/// is 1 (the caller published its first frame), each expecting head 1.
/// Answers the sequence numbers accepted, after checking that every other
/// answer is the head they lost to (2). Exactly one must win.
pub async fn race_on_head_one(clients: &[hubsync::client::HubClient]) -> Vec<u64> {
    let answers = futures::future::join_all(clients.iter().enumerate().map(|(i, c)| {
        c.publish(log(
            "race",
            1 + i as u64,
            ExpectedHead::Seq(1),
            format!("c{i}").as_bytes(),
        ))
    }))
    .await;
    let mut winners = Vec::new();
    for answer in answers {
        match answer.unwrap() {
            hubsync::wire::PublishOutcome::Accepted { seq, .. } => winners.push(seq),
            hubsync::wire::PublishOutcome::HeadMismatch { current } => {
                assert_eq!(current, Some(2))
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    winners
}

/// A real `hubsync hub` process, killed when dropped (also when a test
/// fails).
pub struct HubProcess {
    child: std::process::Child,
    /// The address it listens on, from its first line on stdout.
    pub addr: String,
}

impl HubProcess {
    /// Start `hubsync hub --listen 127.0.0.1:0` with `args` (its store, its
    /// public URL), with publish and claim rates too high to matter, and
    /// wait for the line that says where it listens.
    pub fn spawn(args: &[&str]) -> HubProcess {
        use std::io::{BufRead, BufReader};
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hubsync"))
            .args(["hub", "--listen", "127.0.0.1:0"])
            .args(args)
            .args(["--device-rate", "1000000", "--device-burst", "1000000"])
            .args(["--topic-rate", "1000000", "--topic-burst", "1000000"])
            .args(["--claimer-rate", "1000000", "--claimer-burst", "1000000"])
            .args(["--target-rate", "1000000", "--target-burst", "1000000"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn hubsync hub");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the listening line");
        let addr = line
            .split_whitespace()
            .nth(4)
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
            .to_string();
        HubProcess { child, addr }
    }

    /// `ws://` and the address it listens on.
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// SIGKILL, and wait for it to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and its exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill -TERM");
        self.child.wait().expect("the hub's exit status")
    }
}

impl Drop for HubProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
