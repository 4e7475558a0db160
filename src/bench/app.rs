//! Pair (b): an application message end to end, from `Device::send` until
//! every other member's device has handed it to its app, against the raw
//! work of the same message: OpenMLS encryption, every receiver's
//! decryption, and a WebSocket round trip of the ciphertext.

use super::load::Slice;
use super::raw::{self, RawSocket};
use crate::device::events::Event;
use crate::device::manager::Observer;
use crate::device::records::GroupId;
use crate::device::{CommitError, Device, DeviceOptions};
use crate::testkit::TestHub;
use futures::{SinkExt, StreamExt};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use openmls_basic_credential::SignatureKeyPair;
use openmls_rust_crypto::OpenMlsRustCrypto;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::Message;

/// How long forming the group and each delivery may take before the bench
/// gives up on the figure.
const WAIT: Duration = Duration::from_secs(30);

/// Message ids and how many devices have handed each to their app.
#[derive(Default)]
struct Receipts {
    seen: Mutex<HashMap<[u8; 16], usize>>,
    joined: Mutex<usize>,
    changed: Notify,
}

/// N devices on one hub, in one group.
pub struct HubGroup {
    devices: Vec<Device>,
    group: GroupId,
    receipts: Arc<Receipts>,
    _dirs: Vec<tempfile::TempDir>,
}

impl HubGroup {
    /// Open `n` devices over sled in temporary directories, create a group
    /// on the first and invite the others one by one.
    ///
    /// # Errors
    /// When a device cannot be opened or the group cannot be formed.
    pub async fn form(hub: &TestHub, n: usize) -> Result<Self, String> {
        let receipts = Arc::new(Receipts::default());
        let mut devices = Vec::with_capacity(n);
        let mut dirs = Vec::with_capacity(n);
        for _ in 0..n {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let mut o = DeviceOptions::new(vec![hub.url().to_string()]);
            o.connector = Arc::new(hub.connector());
            let r = receipts.clone();
            o.manager.observer = Some(Observer(Arc::new(move |e: &Event| match e {
                Event::MessageReceived { id, .. } => {
                    *r.seen
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(*id)
                        .or_default() += 1;
                    r.changed.notify_waiters();
                }
                Event::GroupJoined { .. } => {
                    *r.joined.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                    r.changed.notify_waiters();
                }
                _ => {}
            })));
            devices.push(
                Device::open(dir.path(), o)
                    .await
                    .map_err(|e| format!("open device: {e}"))?,
            );
            dirs.push(dir);
        }
        let group = devices[0]
            .create_group(&[hub.url().to_string()])
            .await
            .map_err(|e| format!("create group: {e}"))?;
        for d in &devices[1..] {
            let deadline = Instant::now() + WAIT;
            loop {
                match devices[0].invite(group, d.id()).await {
                    Ok(_) => break,
                    // A just-opened device may not have uploaded key
                    // packages yet.
                    Err(CommitError::NoKeyPackage(_)) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => return Err(format!("invite: {e}")),
                }
            }
        }
        let me = Self {
            devices,
            group,
            receipts,
            _dirs: dirs,
        };
        me.wait(|r| *r.joined.lock().unwrap_or_else(|p| p.into_inner()) >= n - 1)
            .await
            .map_err(|_| "not every device joined".to_string())?;
        Ok(me)
    }

    async fn wait(&self, done: impl Fn(&Receipts) -> bool) -> Result<(), ()> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let changed = self.receipts.changed.notified();
            if done(&self.receipts) {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(());
            }
        }
    }

    /// Close every device.
    pub async fn close(self) {
        for d in &self.devices {
            d.close().await;
        }
    }
}

/// Send `payload`-byte messages from the first device one at a time, each
/// timed until every other device has handed it to its app, for `len`.
///
/// # Errors
/// A refused send, or a message some device never delivers.
pub async fn hub_messages(g: &HubGroup, payload: usize, len: Duration) -> Result<Slice, String> {
    let others = g.devices.len() - 1;
    let body = vec![0x5a; payload];
    let start = Instant::now();
    let mut slice = Slice::default();
    while start.elapsed() < len {
        let t0 = Instant::now();
        let sent = g.devices[0]
            .send(g.group, &body)
            .await
            .map_err(|e| format!("send: {e}"))?;
        g.wait(|r| {
            r.seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&sent.id)
                .copied()
                .unwrap_or(0)
                >= others
        })
        .await
        .map_err(|_| "a message never reached every member".to_string())?;
        g.receipts
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&sent.id);
        slice.ops += 1;
        slice.latencies_us.push(t0.elapsed().as_micros() as u64);
    }
    slice.secs = start.elapsed().as_secs_f64();
    Ok(slice)
}

/// One raw OpenMLS member.
struct RawMember {
    provider: OpenMlsRustCrypto,
    signer: SignatureKeyPair,
    group: MlsGroup,
}

/// The same group in raw OpenMLS, and a socket to an echo server.
pub struct RawGroup {
    members: Vec<RawMember>,
    socket: RawSocket,
    _echo: raw::EchoServer,
}

const CS: Ciphersuite = crate::device::mls::CIPHERSUITE;

fn identity(n: usize) -> Result<(OpenMlsRustCrypto, SignatureKeyPair, CredentialWithKey), String> {
    let provider = OpenMlsRustCrypto::default();
    let signer = SignatureKeyPair::new(CS.signature_algorithm()).map_err(|e| e.to_string())?;
    signer
        .store(provider.storage())
        .map_err(|e| e.to_string())?;
    let credential = CredentialWithKey {
        credential: BasicCredential::new(format!("raw-{n}").into_bytes()).into(),
        signature_key: signer.public().into(),
    };
    Ok((provider, signer, credential))
}

impl RawGroup {
    /// `n` members, added in one commit.
    ///
    /// # Errors
    /// When OpenMLS or the echo server fails.
    pub async fn form(n: usize) -> Result<Self, String> {
        let err = |e: &dyn std::fmt::Display| e.to_string();
        let (provider, signer, credential) = identity(0)?;
        let config = MlsGroupCreateConfig::builder()
            .ciphersuite(CS)
            .use_ratchet_tree_extension(true)
            .build();
        let mut creator =
            MlsGroup::new(&provider, &signer, &config, credential).map_err(|e| err(&e))?;
        let mut joiners = Vec::new();
        let mut kps = Vec::new();
        for i in 1..n {
            let (p, s, c) = identity(i)?;
            let kp = KeyPackage::builder()
                .build(CS, &p, &s, c)
                .map_err(|e| err(&e))?;
            kps.push(kp.key_package().clone());
            joiners.push((p, s));
        }
        let mut members = Vec::with_capacity(n);
        if !kps.is_empty() {
            let (_, welcome, _) = creator
                .add_members(&provider, &signer, &kps)
                .map_err(|e| err(&e))?;
            creator
                .merge_pending_commit(&provider)
                .map_err(|e| err(&e))?;
            let bytes = welcome.tls_serialize_detached().map_err(|e| err(&e))?;
            for (p, s) in joiners {
                let msg = MlsMessageIn::tls_deserialize_exact(&bytes).map_err(|e| err(&e))?;
                let MlsMessageBodyIn::Welcome(w) = msg.extract() else {
                    return Err("not a welcome".into());
                };
                let group = StagedWelcome::new_from_welcome(
                    &p,
                    &MlsGroupJoinConfig::builder()
                        .use_ratchet_tree_extension(true)
                        .build(),
                    w,
                    None,
                )
                .map_err(|e| err(&e))?
                .into_group(&p)
                .map_err(|e| err(&e))?;
                members.push(RawMember {
                    provider: p,
                    signer: s,
                    group,
                });
            }
        }
        members.insert(
            0,
            RawMember {
                provider,
                signer,
                group: creator,
            },
        );
        let echo = raw::EchoServer::start().await.map_err(|e| err(&e))?;
        let socket = raw::dial(&echo.url()).await?;
        Ok(Self {
            members,
            socket,
            _echo: echo,
        })
    }
}

/// The baseline of [`hub_messages`]: the first member encrypts, the bytes
/// make a WebSocket round trip, every other member decrypts, one message at
/// a time, for `len`.
///
/// # Errors
/// When OpenMLS or the socket fails.
pub async fn raw_messages(
    g: &mut RawGroup,
    payload: usize,
    len: Duration,
) -> Result<Slice, String> {
    let body = vec![0x5a; payload];
    let start = Instant::now();
    let mut slice = Slice::default();
    while start.elapsed() < len {
        let t0 = Instant::now();
        let (sender, rest) = g.members.split_at_mut(1);
        let s = &mut sender[0];
        let out = s
            .group
            .create_message(&s.provider, &s.signer, &body)
            .map_err(|e| e.to_string())?;
        let bytes = out.tls_serialize_detached().map_err(|e| e.to_string())?;
        g.socket
            .send(Message::binary(bytes))
            .await
            .map_err(|e| e.to_string())?;
        let echoed = loop {
            match g.socket.next().await {
                Some(Ok(Message::Binary(b))) => break b,
                Some(Ok(_)) => continue,
                other => return Err(format!("echo failed: {other:?}")),
            }
        };
        for m in rest.iter_mut() {
            let msg = MlsMessageIn::tls_deserialize_exact(echoed.as_ref())
                .map_err(|e| e.to_string())?
                .try_into_protocol_message()
                .map_err(|e| e.to_string())?;
            let processed = m
                .group
                .process_message(&m.provider, msg)
                .map_err(|e| e.to_string())?;
            if !matches!(
                processed.into_content(),
                ProcessedMessageContent::ApplicationMessage(_)
            ) {
                return Err("not an application message".into());
            }
        }
        slice.ops += 1;
        slice.latencies_us.push(t0.elapsed().as_micros() as u64);
    }
    slice.secs = start.elapsed().as_secs_f64();
    Ok(slice)
}
