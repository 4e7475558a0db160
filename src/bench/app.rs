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

/// How long a device far behind may take to catch up before the bench
/// gives up on the figure.
const CATCH_UP_WAIT: Duration = Duration::from_secs(600);

/// What the devices of a [`HubGroup`] told their apps, counted.
#[derive(Default)]
pub(super) struct Receipts {
    /// Message id → devices that handed it to their app.
    seen: Mutex<HashMap<[u8; 16], usize>>,
    /// Group → devices that joined it.
    joined: Mutex<HashMap<GroupId, usize>>,
    /// (group, epoch) → devices that merged into that epoch.
    merged: Mutex<HashMap<(GroupId, u64), usize>>,
    /// While `recording`: every message arrival and when it was.
    arrivals: Mutex<Vec<([u8; 16], Instant)>>,
    recording: std::sync::atomic::AtomicBool,
    changed: Notify,
}

fn bump<K: std::hash::Hash + Eq>(m: &Mutex<HashMap<K, usize>>, k: K) {
    *m.lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(k)
        .or_default() += 1;
}

fn count<K: std::hash::Hash + Eq>(m: &Mutex<HashMap<K, usize>>, k: &K) -> usize {
    m.lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(k)
        .copied()
        .unwrap_or(0)
}

/// N devices on one hub, in one group.
pub struct HubGroup {
    pub(super) devices: Vec<Device>,
    pub(super) group: GroupId,
    pub(super) receipts: Arc<Receipts>,
    hub_url: String,
    /// Each device's options and directory, to reopen it.
    opened: Vec<(DeviceOptions, tempfile::TempDir)>,
}

impl HubGroup {
    /// Open `n` devices over sled in temporary directories, create a group
    /// on the first and invite the others in one commit.
    ///
    /// # Errors
    /// When a device cannot be opened or the group cannot be formed.
    pub async fn form(hub: &TestHub, n: usize) -> Result<Self, String> {
        Self::form_at(hub.url(), Arc::new(hub.connector()), n).await
    }

    /// As [`HubGroup::form`], on the hub at `url` (any hub, a process of
    /// its own included), dialled through `connector`.
    ///
    /// # Errors
    /// When a device cannot be opened or the group cannot be formed.
    pub async fn form_at(
        url: &str,
        connector: Arc<dyn crate::transport::Connector>,
        n: usize,
    ) -> Result<Self, String> {
        let receipts = Arc::new(Receipts::default());
        let mut devices = Vec::with_capacity(n);
        let mut opened = Vec::with_capacity(n);
        for _ in 0..n {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let mut o = DeviceOptions::new(vec![url.to_string()]);
            o.connector = connector.clone();
            let r = receipts.clone();
            o.manager.observer = Some(Observer(Arc::new(move |e: &Event| {
                match e {
                    Event::MessageReceived { id, .. } => {
                        if r.recording.load(std::sync::atomic::Ordering::Relaxed) {
                            r.arrivals
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push((*id, Instant::now()));
                        }
                        bump(&r.seen, *id)
                    }
                    Event::GroupJoined { group, .. } => bump(&r.joined, *group),
                    Event::EpochChanged { group, epoch } => bump(&r.merged, (*group, *epoch)),
                    _ => return,
                }
                r.changed.notify_waiters();
            })));
            devices.push(
                Device::open(dir.path(), o.clone())
                    .await
                    .map_err(|e| format!("open device: {e}"))?,
            );
            opened.push((o, dir));
        }
        let mut me = Self {
            devices,
            group: GroupId([0; 32]),
            receipts,
            hub_url: url.to_string(),
            opened,
        };
        let deadline = Instant::now() + WAIT;
        me.group = loop {
            match me.form_group().await {
                Ok(g) => break g,
                // A just-opened device may not have uploaded key packages
                // yet.
                Err(e) if e.contains("no key package") && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        };
        Ok(me)
    }

    /// Create a new group on the first device, invite every other device in
    /// one commit, and wait until each has joined.
    ///
    /// # Errors
    /// A refused create or invite (the text names it), or a device that
    /// never joined.
    pub(super) async fn form_group(&self) -> Result<GroupId, String> {
        let (first, others) = self
            .devices
            .split_first()
            .ok_or_else(|| "a group needs a device".to_string())?;
        let group = first
            .create_group(std::slice::from_ref(&self.hub_url))
            .await
            .map_err(|e| format!("create group: {e}"))?;
        if others.is_empty() {
            return Ok(group);
        }
        let ids: Vec<_> = others.iter().map(|d| d.id()).collect();
        first.invite_many(group, &ids).await.map_err(|e| match e {
            CommitError::NoKeyPackage(d) => format!("invite: no key package for {d}"),
            e => format!("invite: {e}"),
        })?;
        // The creator's own join counts too.
        let n = self.devices.len();
        self.wait(|r| count(&r.joined, &group) >= n)
            .await
            .map_err(|_| "not every device joined".to_string())?;
        Ok(group)
    }

    /// Rotate the first device's keys (a commit through the hub) and wait
    /// until every device merged it.
    ///
    /// # Errors
    /// A refused commit, or a device that never merged it.
    pub(super) async fn rotate(&self) -> Result<(), String> {
        let r = self.devices[0]
            .rotate_keys(self.group)
            .await
            .map_err(|e| format!("rotate_keys: {e}"))?;
        let key = (self.group, r.outcome.epoch);
        let n = self.devices.len();
        self.wait(|r| count(&r.merged, &key) >= n)
            .await
            .map_err(|_| format!("not every device merged epoch {}", key.1))?;
        self.receipts
            .merged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        Ok(())
    }

    /// Close device `i` (not the first), rotate the first device's keys
    /// `epochs` times, and answer the epoch it reached.
    ///
    /// # Errors
    /// A refused commit, or `i` naming the first device or none.
    pub(super) async fn leave_behind(&mut self, i: usize, epochs: usize) -> Result<u64, String> {
        if i == 0 || i >= self.devices.len() {
            return Err(format!("device {i} cannot be left behind"));
        }
        // Out of the group's list until `catch_up` puts it back: dropped, so
        // its store is let go of and can be opened again.
        let left = self.devices.remove(i);
        left.close().await;
        drop(left);
        self.receipts
            .merged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        let mut epoch = 0;
        for _ in 0..epochs {
            epoch = self.devices[0]
                .rotate_keys(self.group)
                .await
                .map_err(|e| format!("rotate_keys: {e}"))?
                .outcome
                .epoch;
        }
        Ok(epoch)
    }

    /// Reopen device `i` (left behind by [`HubGroup::leave_behind`]) from
    /// its directory and wait until it merged `epoch`.
    ///
    /// # Errors
    /// When it cannot be opened or never gets there.
    pub(super) async fn catch_up(&mut self, i: usize, epoch: u64) -> Result<(), String> {
        let (o, dir) = self.opened.get(i).ok_or_else(|| format!("no device {i}"))?;
        // Sled lets go of a closed store's lock from a background thread:
        // open_sled waits for it.
        let kv = crate::testkit::open_sled(dir.path())
            .await
            .map_err(|e| format!("reopen device store: {e}"))?;
        let device = Device::open_store(Arc::new(kv), o.clone())
            .await
            .map_err(|e| format!("reopen device: {e}"))?;
        self.devices.insert(i.min(self.devices.len()), device);
        let key = (self.group, epoch);
        // The first device's own merge counts one. A long way behind takes
        // long: the wait is not the bench's usual one.
        self.wait_for(|r| count(&r.merged, &key) >= 2, CATCH_UP_WAIT)
            .await
            .map_err(|_| format!("device {i} never caught up to epoch {epoch}"))
    }

    /// Wait for `done`, as long as a group this size may need: every
    /// device processes its share on the same two cores, so a group of a
    /// thousand takes far longer than one of ten.
    async fn wait(&self, done: impl Fn(&Receipts) -> bool) -> Result<(), ()> {
        let per_device = Duration::from_millis(200) * self.devices.len() as u32;
        self.wait_for(done, WAIT + per_device).await
    }

    async fn wait_for(&self, done: impl Fn(&Receipts) -> bool, limit: Duration) -> Result<(), ()> {
        let deadline = tokio::time::Instant::now() + limit;
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

    /// Record every message arrival from now on (or stop, and forget what
    /// was recorded).
    pub(super) fn record_arrivals(&self, on: bool) {
        self.receipts
            .recording
            .store(on, std::sync::atomic::Ordering::Relaxed);
        if !on {
            self.take_arrivals();
        }
        self.receipts
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// The arrivals recorded since the last call.
    pub(super) fn take_arrivals(&self) -> Vec<([u8; 16], Instant)> {
        std::mem::take(
            &mut *self
                .receipts
                .arrivals
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    /// The first device, which sends.
    pub(super) fn sender(&self) -> &Device {
        &self.devices[0]
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
pub(super) struct RawMember {
    provider: OpenMlsRustCrypto,
    signer: SignatureKeyPair,
    group: MlsGroup,
}

impl RawMember {
    /// Process a commit's bytes and merge it.
    fn merge(&mut self, bytes: &[u8]) -> Result<(), String> {
        let err = |e: &dyn std::fmt::Display| e.to_string();
        let msg = MlsMessageIn::tls_deserialize_exact(bytes)
            .map_err(|e| err(&e))?
            .try_into_protocol_message()
            .map_err(|e| err(&e))?;
        let processed = self
            .group
            .process_message(&self.provider, msg)
            .map_err(|e| err(&e))?;
        let ProcessedMessageContent::StagedCommitMessage(staged) = processed.into_content() else {
            return Err("not a commit".into());
        };
        self.group
            .merge_staged_commit(&self.provider, *staged)
            .map_err(|e| err(&e))
    }
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

/// The identities and key packages of a raw group about to be formed:
/// made before the clock starts, as a hub's invitees upload theirs before
/// they are invited.
pub(super) struct RawInvitees {
    creator: (OpenMlsRustCrypto, SignatureKeyPair, CredentialWithKey),
    joiners: Vec<(OpenMlsRustCrypto, SignatureKeyPair)>,
    key_packages: Vec<KeyPackage>,
}

impl RawInvitees {
    /// A creator and `n - 1` joiners, each with one key package.
    ///
    /// # Errors
    /// When OpenMLS fails.
    pub(super) fn new(n: usize) -> Result<Self, String> {
        let creator = identity(0)?;
        let mut joiners = Vec::new();
        let mut key_packages = Vec::new();
        for i in 1..n {
            let (p, s, c) = identity(i)?;
            let kp = KeyPackage::builder()
                .build(CS, &p, &s, c)
                .map_err(|e| e.to_string())?;
            key_packages.push(kp.key_package().clone());
            joiners.push((p, s));
        }
        Ok(Self {
            creator,
            joiners,
            key_packages,
        })
    }

    /// The raw work of forming the group: create it, add every joiner in
    /// one commit and merge it, and every joiner's processing of the
    /// Welcome. Answers the members, creator first.
    ///
    /// # Errors
    /// When OpenMLS fails.
    pub(super) fn form(self) -> Result<Vec<RawMember>, String> {
        let err = |e: &dyn std::fmt::Display| e.to_string();
        let (provider, signer, credential) = self.creator;
        let config = MlsGroupCreateConfig::builder()
            .ciphersuite(CS)
            .use_ratchet_tree_extension(true)
            .build();
        let mut creator =
            MlsGroup::new(&provider, &signer, &config, credential).map_err(|e| err(&e))?;
        let mut members = Vec::with_capacity(self.joiners.len() + 1);
        let mut joined = Vec::with_capacity(self.joiners.len());
        if !self.key_packages.is_empty() {
            let (_, welcome, _) = creator
                .add_members(&provider, &signer, &self.key_packages)
                .map_err(|e| err(&e))?;
            creator
                .merge_pending_commit(&provider)
                .map_err(|e| err(&e))?;
            let bytes = welcome.tls_serialize_detached().map_err(|e| err(&e))?;
            for (p, s) in self.joiners {
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
                joined.push(RawMember {
                    provider: p,
                    signer: s,
                    group,
                });
            }
        }
        members.push(RawMember {
            provider,
            signer,
            group: creator,
        });
        members.extend(joined);
        Ok(members)
    }
}

impl RawGroup {
    /// `n` members, added in one commit.
    ///
    /// # Errors
    /// When OpenMLS or the echo server fails.
    pub async fn form(n: usize) -> Result<Self, String> {
        let members = RawInvitees::new(n)?.form()?;
        let echo = raw::EchoServer::start().await.map_err(|e| e.to_string())?;
        let socket = raw::dial(&echo.url()).await?;
        Ok(Self {
            members,
            socket,
            _echo: echo,
        })
    }

    /// The raw work of one commit: the first member updates its own leaf
    /// and merges, every other member processes the commit and merges it.
    ///
    /// # Errors
    /// When OpenMLS fails.
    pub(super) fn rotate(&mut self) -> Result<(), String> {
        let bytes = self.commit()?;
        for m in self.members.iter_mut().skip(1) {
            m.merge(&bytes)?;
        }
        Ok(())
    }

    /// The first member's self-update commit, merged: answers its bytes.
    ///
    /// # Errors
    /// When OpenMLS fails.
    pub(super) fn commit(&mut self) -> Result<Vec<u8>, String> {
        let err = |e: &dyn std::fmt::Display| e.to_string();
        let s = self
            .members
            .first_mut()
            .ok_or_else(|| "an empty group".to_string())?;
        let bundle = s
            .group
            .self_update(&s.provider, &s.signer, LeafNodeParameters::default())
            .map_err(|e| err(&e))?;
        s.group
            .merge_pending_commit(&s.provider)
            .map_err(|e| err(&e))?;
        let (commit, _, _) = bundle.into_messages();
        commit.tls_serialize_detached().map_err(|e| err(&e))
    }

    /// Member `i` processes and merges each commit of `commits`, in order.
    ///
    /// # Errors
    /// When OpenMLS fails, or `i` names no member.
    pub(super) fn merge_all(&mut self, i: usize, commits: &[Vec<u8>]) -> Result<(), String> {
        let m = self
            .members
            .get_mut(i)
            .ok_or_else(|| format!("no member {i}"))?;
        for c in commits {
            m.merge(c)?;
        }
        Ok(())
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
