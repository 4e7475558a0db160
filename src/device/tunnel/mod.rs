//! Tunnels: directed, ordered, flow-controlled sessions between two current
//! members of a group, over the group's tunnel hub, encrypted end to end
//! between the two devices (docs/protocol.md section 28).
//!
//! A device that serves procedures ([`GroupPeerManager::serve`]) answers
//! tunnels from its co-members; another member opens one
//! ([`GroupPeerManager::open_tunnel`]) and calls the procedures over it
//! ([`Tunnel::call`], [`Tunnel::call_stream`]). The tunnel rides the group's
//! first bound hub ([`GroupPeerManager::tunnel_hub`]): a handshake in the
//! devices' own mailboxes ([`handshake`]), then one writer-bound mailbox
//! topic per direction. [`session`] orders, paces and resends its frames,
//! so a hub restart or a dropped connection loses and repeats nothing.
//!
//! Who may do what: only a device in the answering device's tree gets an
//! answer (anyone else is not answered at all, and counted as dropped);
//! the keys need the group's exporter secret of the opener's epoch and
//! the HPKE secret only the two devices share, so neither the hub, another
//! member nor a removed member reads or writes a tunnel. A tunnel follows
//! the roster ([`GroupPeerManager::reconcile_tunnel_listeners`], run on
//! every roster change): when either device leaves the group, it closes.

pub mod handshake;
pub mod history;
pub mod session;

use self::handshake::{Accept, Handshake, Open, Refuse, RefuseReason, TunnelId, TunnelKeys};
use self::session::{Frame, Session};
use super::error::DeviceError;
use super::frames::{digest, publish_id};
use super::link::HubLink;
use super::manager::{lock, GroupPeerManager};
use super::records::GroupId;
use super::topics;
use crate::wire::{Delivery, DeviceId, ExpectedHead, Publish, RetentionClass};
use futures::future::BoxFuture;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::OpenMlsProvider;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch, Notify};

/// How long an open waits for the other device's answer.
pub const OPEN_DEADLINE: Duration = Duration::from_secs(10);

/// Most tunnels one device holds at once, both ways; an open past it is
/// refused ([`RefuseReason::Busy`]).
pub const MAX_TUNNELS: usize = 256;

/// Procedure calls one tunnel runs at once on the serving side; a call
/// past it waits for one to end.
pub const MAX_CALLS: usize = 16;

/// Retention of a tunnel's frames (and handshakes) on the hub.
const FRAME_RETENTION_SECS: u64 = 3600;

/// Whole messages waiting between a tunnel's frames and its procedures.
const INBOUND_QUEUE: usize = 8;

/// Items of one call waiting for the caller to read them.
const CALL_QUEUE: usize = 16;

/// How long a tunnel holds its sending after a failed publish.
const SEND_RETRY_MS: u64 = 250;

/// How often an idle tunnel looks at its idle timeout.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Why a tunnel closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CloseReason {
    /// This side closed it ([`Tunnel::close`], or the handle was dropped).
    #[error("closed")]
    Closed,
    /// The other device closed it, saying why.
    #[error("the other device closed the tunnel: {0}")]
    Remote(String),
    /// Nothing came from the other side and no new data went to it for
    /// the idle timeout
    /// ([`super::ManagerConfig::tunnel_idle_timeout`]).
    #[error("idle")]
    Idle,
    /// The other device is no longer a member of the group.
    #[error("the other device left the group")]
    PeerLeft,
    /// This device is no longer a member of the group (removed, left,
    /// forgotten, or stranded).
    #[error("this device left the group")]
    Left,
    /// The device stopped.
    #[error("the device stopped")]
    Stopped,
    /// The other side broke the protocol (a message past the bound).
    #[error("broken: {0}")]
    Broken(String),
}

/// Why a tunnel or a call failed.
#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    /// The device asked is not a member of the group as this device sees
    /// it (or is this device). Nothing was sent.
    #[error("{device} is not another member of group {group}")]
    NotAMember {
        /// The group.
        group: GroupId,
        /// The device.
        device: DeviceId,
    },
    /// This device is stranded in the group: it cannot derive the keys of
    /// the group's epoch. Heal it first (`rejoin_group`).
    #[error("this device is stranded in group {0}")]
    Stranded(GroupId),
    /// The group has no hub a tunnel could ride (it is bound to none).
    #[error("group {0} has no hub for tunnels")]
    NoHub(GroupId),
    /// The other device declined, saying why.
    #[error("the other device declined: {0}")]
    Refused(RefuseReason),
    /// No answer before [`OPEN_DEADLINE`]: the other device is offline,
    /// serves nothing, or does not count this device as a member.
    #[error("no answer from the other device")]
    NoAnswer,
    /// The tunnel closed (before or during the call).
    #[error("tunnel closed: {0}")]
    Closed(CloseReason),
    /// The other device has no procedure of that name.
    #[error("no procedure {0:?}")]
    NoSuchProcedure(String),
    /// The procedure failed on the other device, saying why.
    #[error("the procedure failed: {0}")]
    Failed(String),
    /// A message too large for a tunnel ([`session::MAX_MESSAGE`]).
    #[error("a message of {len} bytes is larger than a tunnel carries")]
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// This device failed (its store, its MLS state, a hub refusing).
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Who is calling a procedure: a current member of `group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The group the tunnel is in.
    pub group: GroupId,
    /// The calling device.
    pub device: DeviceId,
}

type Unary =
    Arc<dyn Fn(Caller, Vec<u8>) -> BoxFuture<'static, Result<Vec<u8>, String>> + Send + Sync>;
type Streamed = Arc<
    dyn Fn(Caller, Vec<u8>, ResponseSink) -> BoxFuture<'static, Result<(), String>> + Send + Sync,
>;

#[derive(Clone)]
enum Handler {
    Unary(Unary),
    Streamed(Streamed),
}

/// The procedures a device serves to its co-members over tunnels, by name.
/// A device that serves none answers no tunnel.
#[derive(Clone, Default)]
pub struct Procedures {
    map: BTreeMap<String, Handler>,
}

impl std::fmt::Debug for Procedures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.map.keys()).finish()
    }
}

impl Procedures {
    /// None yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Serve `name` as one request, one response: `f` answers the body or
    /// an error text the caller gets as [`TunnelError::Failed`].
    pub fn unary<F, Fut>(mut self, name: &str, f: F) -> Self
    where
        F: Fn(Caller, Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<u8>, String>> + Send + 'static,
    {
        let f = Arc::new(f);
        self.map.insert(
            name.to_string(),
            Handler::Unary(Arc::new(move |c, b| {
                let f = f.clone();
                Box::pin(async move { f(c, b).await })
            })),
        );
        self
    }

    /// Serve `name` as one request, a stream of responses: `f` sends each
    /// through the [`ResponseSink`] (which waits while the tunnel's window
    /// is full) and ends the stream by returning.
    pub fn streamed<F, Fut>(mut self, name: &str, f: F) -> Self
    where
        F: Fn(Caller, Vec<u8>, ResponseSink) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        let f = Arc::new(f);
        self.map.insert(
            name.to_string(),
            Handler::Streamed(Arc::new(move |c, b, s| {
                let f = f.clone();
                Box::pin(async move { f(c, b, s).await })
            })),
        );
        self
    }
}

/// The messages of the procedure layer, one per tunnel message.
#[derive(Debug, Serialize, Deserialize)]
enum Rpc {
    Call {
        id: u64,
        method: String,
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
    },
    Item {
        id: u64,
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
    },
    End {
        id: u64,
        failure: Option<RpcFailure>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
enum RpcFailure {
    NoSuchProcedure(String),
    Failed(String),
}

/// An opened tunnel message read as the RPC layer reads it (the fuzzing
/// target `tunnel_handshake`): what decodes must encode back to itself.
pub(crate) fn fuzz_rpc(data: &[u8]) {
    if let Ok(rpc) = postcard::from_bytes::<Rpc>(data) {
        let again = postcard::to_allocvec(&rpc).unwrap_or_default();
        let back = postcard::from_bytes::<Rpc>(&again).ok();
        assert_eq!(
            back.map(|b| format!("{b:?}")),
            Some(format!("{rpc:?}")),
            "an RPC message does not round-trip"
        );
    }
    let _ = postcard::from_bytes::<history::Item>(data);
}

/// Seeds of the RPC part of `tunnel_handshake`: a call, an item, an end.
pub(crate) fn fuzz_rpc_seeds() -> Vec<(&'static str, Vec<u8>)> {
    [
        (
            "rpc-call",
            Rpc::Call {
                id: 1,
                method: "history".into(),
                body: vec![1, 2],
            },
        ),
        (
            "rpc-item",
            Rpc::Item {
                id: 1,
                body: vec![3],
            },
        ),
        (
            "rpc-end",
            Rpc::End {
                id: 1,
                failure: Some(RpcFailure::NoSuchProcedure("x".into())),
            },
        ),
    ]
    .into_iter()
    .map(|(name, rpc)| (name, postcard::to_allocvec(&rpc).unwrap_or_default()))
    .collect()
}

/// Where a streamed procedure sends its responses.
pub struct ResponseSink {
    live: Arc<Live>,
    id: u64,
}

impl ResponseSink {
    /// Send one response, waiting while the tunnel's window is full.
    ///
    /// # Errors
    /// `Closed` when the tunnel closed (stop producing), `TooLarge`.
    pub async fn send(&self, body: Vec<u8>) -> Result<(), TunnelError> {
        self.live.send(&Rpc::Item { id: self.id, body }).await
    }
}

/// An open of this device waiting for its answer: the open's digest, the
/// device asked, and where the answer goes.
type Opening = ([u8; 32], DeviceId, oneshot::Sender<Handshake>);

/// Where a call's responses go.
type CallSender = mpsc::Sender<Result<Vec<u8>, TunnelError>>;

/// The device-wide tunnel state.
#[derive(Default)]
pub(super) struct Tunnels {
    live: Mutex<BTreeMap<TunnelId, Arc<Live>>>,
    /// Opens of this device waiting for their answer.
    opening: Mutex<BTreeMap<TunnelId, Opening>>,
    procedures: Mutex<Option<Arc<Procedures>>>,
}

/// One open tunnel.
struct Live {
    id: TunnelId,
    group: GroupId,
    peer: DeviceId,
    hub: String,
    keys: TunnelKeys,
    session: Mutex<Session>,
    counter: AtomicU64,
    /// Something to transmit.
    wake: Notify,
    /// The window has room, or the tunnel closed.
    room: Notify,
    closed: watch::Sender<Option<CloseReason>>,
    /// The responder's accept, posted again for a repeated open.
    accept: Option<Vec<u8>>,
    /// Caller side: the calls waiting for items.
    calls: Mutex<BTreeMap<u64, CallSender>>,
    next_call: AtomicU64,
    clock: crate::clock::Clock,
}

impl Live {
    fn close(&self, reason: CloseReason) {
        // The driver sends the close frame (if this side closed first) on
        // its way out.
        lock(&self.session).close(&reason.to_string());
        self.closed.send_if_modified(|c| {
            if c.is_none() {
                *c = Some(reason.clone());
                true
            } else {
                false
            }
        });
        self.wake.notify_one();
        self.room.notify_waiters();
    }

    fn closed_reason(&self) -> Option<CloseReason> {
        self.closed.borrow().clone()
    }

    /// Queue one procedure-layer message, waiting for room in the window.
    async fn send(&self, rpc: &Rpc) -> Result<(), TunnelError> {
        let bytes = postcard::to_allocvec(rpc)
            .map_err(|e| TunnelError::Device(DeviceError::Mls(e.to_string())))?;
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if let Some(r) = self.closed_reason() {
                return Err(TunnelError::Closed(r));
            }
            {
                let mut s = lock(&self.session);
                if s.has_room() {
                    return match s.queue(&bytes) {
                        Ok(()) => {
                            drop(s);
                            self.wake.notify_one();
                            Ok(())
                        }
                        Err(session::QueueError::TooLarge { len, .. }) => {
                            Err(TunnelError::TooLarge { len })
                        }
                        Err(session::QueueError::Closed) => Err(TunnelError::Closed(
                            self.closed_reason().unwrap_or(CloseReason::Closed),
                        )),
                    };
                }
            }
            room.await;
        }
    }
}

/// An open tunnel to a co-member, for calling its procedures. Dropping the
/// last clone closes it.
#[derive(Clone)]
pub struct Tunnel {
    live: Arc<Live>,
    _closer: Arc<Closer>,
}

struct Closer(Arc<Live>);

impl Drop for Closer {
    fn drop(&mut self) {
        self.0.close(CloseReason::Closed);
    }
}

impl std::fmt::Debug for Tunnel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tunnel")
            .field("id", &hex::encode(self.live.id))
            .field("group", &self.live.group)
            .field("peer", &self.live.peer)
            .finish()
    }
}

/// The responses of a streamed call, in order.
pub struct CallStream {
    rx: mpsc::Receiver<Result<Vec<u8>, TunnelError>>,
}

impl CallStream {
    /// The next response; `None` once the procedure ended. A failure ends
    /// the stream.
    pub async fn next(&mut self) -> Option<Result<Vec<u8>, TunnelError>> {
        self.rx.recv().await
    }
}

impl Tunnel {
    /// The group the tunnel is in.
    pub fn group(&self) -> GroupId {
        self.live.group
    }

    /// The device at the other end.
    pub fn peer(&self) -> DeviceId {
        self.live.peer
    }

    /// The hub the tunnel rides.
    pub fn hub(&self) -> &str {
        &self.live.hub
    }

    /// Why the tunnel closed, once it has.
    pub fn closed(&self) -> Option<CloseReason> {
        self.live.closed_reason()
    }

    /// Wait until the tunnel closes, and say why.
    pub async fn wait_closed(&self) -> CloseReason {
        let mut rx = self.live.closed.subscribe();
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return r;
            }
            if rx.changed().await.is_err() {
                return CloseReason::Stopped;
            }
        }
    }

    /// Close the tunnel (the other device is told).
    pub fn close(&self) {
        self.live.close(CloseReason::Closed);
    }

    /// Call `method` with `body` and wait for its one response.
    ///
    /// # Errors
    /// `NoSuchProcedure`, `Failed` (the procedure's error), `Closed`,
    /// `TooLarge`; a streamed procedure's responses after the first are
    /// dropped.
    pub async fn call(&self, method: &str, body: Vec<u8>) -> Result<Vec<u8>, TunnelError> {
        let mut s = self.call_stream(method, body).await?;
        let first = match s.next().await {
            Some(r) => r?,
            None => return Err(TunnelError::Failed("no response".into())),
        };
        // Read the stream to its end, so a failure after the response is
        // not lost and the call's slot is freed.
        while let Some(r) = s.next().await {
            r?;
        }
        Ok(first)
    }

    /// Call `method` with `body` and read its responses as they come.
    ///
    /// # Errors
    /// `Closed`, `TooLarge`.
    pub async fn call_stream(
        &self,
        method: &str,
        body: Vec<u8>,
    ) -> Result<CallStream, TunnelError> {
        let id = self.live.next_call.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(CALL_QUEUE);
        lock(&self.live.calls).insert(id, tx);
        let sent = self
            .live
            .send(&Rpc::Call {
                id,
                method: method.to_string(),
                body,
            })
            .await;
        if let Err(e) = sent {
            lock(&self.live.calls).remove(&id);
            return Err(e);
        }
        Ok(CallStream { rx })
    }
}

impl GroupPeerManager {
    /// Serve `procedures` to co-members over tunnels, replacing what was
    /// served before. Until called, this device answers no tunnel.
    pub fn serve(&self, procedures: Procedures) {
        *lock(&self.shared.tunnels.procedures) = Some(Arc::new(procedures));
    }

    /// The hub a tunnel in `group` rides: the group's first bound hub, the
    /// same for every member. `None` when the group is bound to none.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn tunnel_hub(&self, group: GroupId) -> Result<Option<String>, DeviceError> {
        let rec = self.record(group)?;
        Ok(rec.hubs.first().map(|h| self.hub_url(h)))
    }

    /// The URL a bound hub's name stands for (the loopback sentinel is this
    /// device's loopback hub).
    fn hub_url(&self, h: &str) -> String {
        if h == super::lane::LOOPBACK_HUB {
            self.shared.loopback_url.clone()
        } else {
            h.to_string()
        }
    }

    /// The tunnels this device holds now in `group`, by the device at the
    /// other end.
    pub fn tunnels(&self, group: GroupId) -> Vec<DeviceId> {
        lock(&self.shared.tunnels.live)
            .values()
            .filter(|l| l.group == group && l.closed_reason().is_none())
            .map(|l| l.peer)
            .collect()
    }

    /// Make the group's tunnels follow its roster: close every tunnel whose
    /// other device is no longer a member (and all of them when this device
    /// is not, or is stranded). Runs on its own after every roster change
    /// of a group; an app calls it only to be sure it has run.
    pub async fn reconcile_tunnel_listeners(&self, group: GroupId) {
        let members = match self.record(group) {
            Ok(rec) if !rec.stranded => {
                let mut guard = self.shared.registry.lock(group).await;
                self.member_set(&mut guard).ok()
            }
            _ => None,
        };
        let me = self.shared.identity.id();
        let live: Vec<Arc<Live>> = lock(&self.shared.tunnels.live)
            .values()
            .filter(|l| l.group == group)
            .cloned()
            .collect();
        for l in live {
            match &members {
                Some(m) if m.contains(&me) && m.contains(&l.peer) => {}
                Some(m) if m.contains(&me) => l.close(CloseReason::PeerLeft),
                _ => l.close(CloseReason::Left),
            }
        }
    }

    /// Reconcile in the background after an event that may change a
    /// group's roster (called from `emit`, often with the group locked).
    pub(super) fn tunnels_follow(&self, e: &super::events::Event) {
        use super::events::Event;
        let group = match e {
            Event::MembersChanged { group, .. }
            | Event::Removed { group }
            | Event::Forgotten { group, .. }
            | Event::Stranded { group }
            | Event::Rejoined { group, .. } => *group,
            _ => return,
        };
        let any = lock(&self.shared.tunnels.live)
            .values()
            .any(|l| l.group == group);
        if !any {
            return;
        }
        let me = self.clone();
        self.shared
            .tasks
            .spawn(async move { me.reconcile_tunnel_listeners(group).await });
    }

    /// Open a tunnel to `device`, a co-member in `group` that serves
    /// procedures.
    ///
    /// # Errors
    /// `NotAMember`, `Stranded`, `NoHub` (nothing sent); `Refused`,
    /// `NoAnswer`; `Device` for this device's own failures.
    pub async fn open_tunnel(
        &self,
        group: GroupId,
        device: DeviceId,
    ) -> Result<Tunnel, TunnelError> {
        let me = self.shared.identity.id();
        let hub = self.tunnel_hub(group)?.ok_or(TunnelError::NoHub(group))?;
        let mut last = TunnelError::NoAnswer;
        // An epoch refusal is met by catching up (or waiting for the other
        // device to), then asking again.
        for _ in 0..4 {
            let (open, private, exporter) = self.make_open(group, device, me).await?;
            let digest = open.digest();
            let (tx, rx) = oneshot::channel();
            lock(&self.shared.tunnels.opening).insert(open.tunnel, (digest, device, tx));
            let posted = self
                .post_handshake(&hub, &device, &Handshake::Open(open.clone()))
                .await;
            let answer = match posted {
                Ok(()) => tokio::time::timeout(OPEN_DEADLINE, rx).await,
                Err(e) => {
                    lock(&self.shared.tunnels.opening).remove(&open.tunnel);
                    return Err(e.into());
                }
            };
            lock(&self.shared.tunnels.opening).remove(&open.tunnel);
            match answer {
                Ok(Ok(Handshake::Accept(a))) => {
                    let crypto = self.shared.registry.provider().crypto();
                    let secret = handshake::decapsulate(crypto, &open, &private, &a.kem_output)
                        .map_err(|e| DeviceError::Mls(e.to_string()))?;
                    let keys = handshake::derive_keys(crypto, &exporter, &secret, &open, true)
                        .map_err(|e| DeviceError::Mls(e.to_string()))?;
                    let live = self.start_live(&open, device, &hub, keys, None).await?;
                    return Ok(Tunnel {
                        _closer: Arc::new(Closer(live.clone())),
                        live,
                    });
                }
                Ok(Ok(Handshake::Refuse(r))) => match r.reason {
                    RefuseReason::Epoch { mine } if mine > open.epoch => {
                        let _ = self.pull(group).await;
                        last = TunnelError::Refused(r.reason);
                    }
                    RefuseReason::Epoch { .. } => {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        last = TunnelError::Refused(r.reason);
                    }
                    other => return Err(TunnelError::Refused(other)),
                },
                Ok(Ok(Handshake::Open(_))) | Ok(Err(_)) | Err(_) => {
                    return Err(TunnelError::NoAnswer)
                }
            }
        }
        Err(last)
    }

    /// A signed open to `device`, its HPKE private key and the exporter
    /// secret of this device's epoch.
    async fn make_open(
        &self,
        group: GroupId,
        device: DeviceId,
        me: DeviceId,
    ) -> Result<(Open, Vec<u8>, Vec<u8>), TunnelError> {
        let mut guard = self.shared.registry.lock(group).await;
        let rec = self.record(group)?;
        if rec.stranded {
            return Err(TunnelError::Stranded(group));
        }
        if device == me || !self.member_set(&mut guard)?.contains(&device) {
            return Err(TunnelError::NotAMember { group, device });
        }
        let crypto = self.shared.registry.provider().crypto();
        let mut tunnel = [0u8; 16];
        self.shared.rng.fill(&mut tunnel);
        let ctx = handshake::exporter_context(&tunnel, &me, &device);
        let (epoch, exporter) = guard
            .read(|g| {
                (
                    g.epoch().as_u64(),
                    g.export_secret(crypto, handshake::EXPORTER_LABEL, &ctx, 32),
                )
            })
            .map_err(DeviceError::from)?;
        let exporter = exporter.map_err(|e| DeviceError::Mls(e.to_string()))?;
        drop(guard);
        let mut ikm = [0u8; 32];
        self.shared.rng.fill(&mut ikm);
        let pair = crypto
            .derive_hpke_keypair(super::mls::CIPHERSUITE.hpke_config(), &ikm)
            .map_err(|e| DeviceError::Mls(format!("HPKE key pair: {e:?}")))?;
        let mut open = Open {
            group,
            tunnel,
            from: me,
            to: device,
            epoch,
            hpke_public: pair.public.clone(),
            signature: Vec::new(),
        };
        open.signature = self.shared.identity.signature_over(&open.signed_bytes());
        Ok((open, pair.private.to_vec(), exporter))
    }

    /// Post a handshake frame to `to`'s own mailbox on `hub`.
    async fn post_handshake(
        &self,
        hub: &str,
        to: &DeviceId,
        h: &Handshake,
    ) -> Result<(), DeviceError> {
        self.post_mailbox(hub, to, h.encode()).await
    }

    async fn post_mailbox(
        &self,
        hub: &str,
        to: &DeviceId,
        payload: Vec<u8>,
    ) -> Result<(), DeviceError> {
        let topic = topics::welcome_topic(to);
        let p = Publish {
            publish_id: publish_id(&digest(&payload), &topic),
            topic,
            class: RetentionClass::Mailbox,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: Some(FRAME_RETENTION_SECS),
            payload,
            writer: None,
        };
        self.hub_link(hub)
            .publish(p)
            .await
            .map(|_| ())
            .map_err(|e| DeviceError::Hub {
                url: hub.to_string(),
                reason: format!("posting a tunnel handshake: {e}"),
            })
    }

    /// A handshake frame arrived in this device's own mailbox on `hub`.
    pub(super) fn on_tunnel_handshake(&self, hub: &str, payload: &[u8]) {
        let Some(h) = Handshake::decode(payload) else {
            self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match h {
            Handshake::Open(o) => {
                if o.to != self.shared.identity.id() || !o.verify() {
                    self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let hub = hub.to_string();
                let (group, from) = (o.group, o.from);
                self.handle_request(group, from, "tunnel open", move |this| async move {
                    this.answer_open(&hub, o).await
                });
            }
            Handshake::Accept(Accept { tunnel, from, .. })
            | Handshake::Refuse(Refuse { tunnel, from, .. }) => {
                let mut opening = lock(&self.shared.tunnels.opening);
                let Some((digest, asked, _)) = opening.get(&tunnel) else {
                    // A late or repeated answer.
                    return;
                };
                let genuine = *asked == from
                    && match &h {
                        Handshake::Accept(a) => a.verify(digest),
                        Handshake::Refuse(r) => r.verify(digest),
                        Handshake::Open(_) => false,
                    };
                if !genuine {
                    drop(opening);
                    self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if let Some((_, _, tx)) = opening.remove(&tunnel) {
                    let _ = tx.send(h);
                }
            }
        }
    }

    /// Answer a verified open addressed to this device.
    async fn answer_open(&self, hub: &str, o: Open) -> Result<(), DeviceError> {
        let me = self.shared.identity.id();
        let existing = lock(&self.shared.tunnels.live).get(&o.tunnel).cloned();
        if let Some(l) = existing {
            // The open came again (redelivered, or the opener missed the
            // accept): the same accept again, never a second tunnel.
            if l.peer == o.from {
                if let Some(a) = &l.accept {
                    return self.post_mailbox(hub, &o.from, a.clone()).await;
                }
            }
            return Ok(());
        }
        let refuse = |reason: RefuseReason| {
            let mut r = Refuse {
                tunnel: o.tunnel,
                from: me,
                reason,
                signature: Vec::new(),
            };
            r.signature = self
                .shared
                .identity
                .signature_over(&r.signed_bytes(&o.digest()));
            Handshake::Refuse(r)
        };
        let mut pulled = false;
        let (exporter, epoch) = loop {
            let Ok(rec) = self.record(o.group) else {
                // Not a group of ours: say nothing.
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            };
            let mut guard = self.shared.registry.lock(o.group).await;
            let members = self.member_set(&mut guard)?;
            if rec.stranded || !members.contains(&me) || !members.contains(&o.from) {
                // A stranger, or a former member: no answer at all.
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            let epoch = guard.read(|g| g.epoch().as_u64())?;
            if o.epoch > epoch && !pulled {
                drop(guard);
                pulled = true;
                let _ = self.pull(o.group).await;
                continue;
            }
            let serves_apps = lock(&self.shared.tunnels.procedures).is_some();
            if !serves_apps && self.history_allowed(o.group)? == 0 {
                drop(guard);
                return self
                    .post_handshake(hub, &o.from, &refuse(RefuseReason::NoService))
                    .await;
            }
            if o.epoch != epoch {
                drop(guard);
                return self
                    .post_handshake(hub, &o.from, &refuse(RefuseReason::Epoch { mine: epoch }))
                    .await;
            }
            if lock(&self.shared.tunnels.live).len() >= MAX_TUNNELS {
                drop(guard);
                return self
                    .post_handshake(hub, &o.from, &refuse(RefuseReason::Busy))
                    .await;
            }
            let crypto = self.shared.registry.provider().crypto();
            let ctx = handshake::exporter_context(&o.tunnel, &o.from, &me);
            let exporter = guard
                .read(|g| g.export_secret(crypto, handshake::EXPORTER_LABEL, &ctx, 32))?
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            break (exporter, epoch);
        };
        let _ = epoch;
        let crypto = self.shared.registry.provider().crypto();
        let (kem_output, secret) =
            handshake::encapsulate(crypto, &o).map_err(|e| DeviceError::Mls(e.to_string()))?;
        let keys = handshake::derive_keys(crypto, &exporter, &secret, &o, false)
            .map_err(|e| DeviceError::Mls(e.to_string()))?;
        let mut a = Accept {
            tunnel: o.tunnel,
            from: me,
            kem_output,
            signature: Vec::new(),
        };
        a.signature = self
            .shared
            .identity
            .signature_over(&a.signed_bytes(&o.digest()));
        let accept = Handshake::Accept(a).encode();
        // Listen before answering: the opener's first frame may follow the
        // accept at once, and a mailbox keeps a frame only for subscribers.
        self.start_live(&o, o.from, hub, keys, Some(accept.clone()))
            .await?;
        self.post_mailbox(hub, &o.from, accept).await
    }

    /// Subscribe to the tunnel's inbound topic and start its tasks.
    async fn start_live(
        &self,
        open: &Open,
        peer: DeviceId,
        hub: &str,
        keys: TunnelKeys,
        accept: Option<Vec<u8>>,
    ) -> Result<Arc<Live>, DeviceError> {
        let link = self.hub_link(hub);
        let rx = link.subscribe(keys.inbound.topic.clone(), Some(FRAME_RETENTION_SECS));
        if let Err(e) = link.flush_subscriptions().await {
            link.unsubscribe(&keys.inbound.topic).await;
            return Err(DeviceError::Hub {
                url: hub.to_string(),
                reason: format!("subscribing to a tunnel: {e}"),
            });
        }
        let now = self.shared.clock.now_ms();
        let live = Arc::new(Live {
            id: open.tunnel,
            group: open.group,
            peer,
            hub: hub.to_string(),
            keys,
            session: Mutex::new(Session::new(now)),
            counter: AtomicU64::new(0),
            wake: Notify::new(),
            room: Notify::new(),
            closed: watch::Sender::new(None),
            accept,
            calls: Mutex::new(BTreeMap::new()),
            next_call: AtomicU64::new(0),
            clock: self.shared.clock.clone(),
        });
        lock(&self.shared.tunnels.live).insert(open.tunnel, live.clone());
        let (in_tx, in_rx) = mpsc::channel(INBOUND_QUEUE);
        let serving = live.accept.is_some();
        let me = self.clone();
        let l = live.clone();
        self.shared
            .tasks
            .spawn(async move { me.drive(l, link, rx, in_tx).await });
        let me = self.clone();
        let l = live.clone();
        if serving {
            self.shared
                .tasks
                .spawn(async move { me.serve_calls(l, in_rx).await });
        } else {
            self.shared
                .tasks
                .spawn(async move { me.read_responses(l, in_rx).await });
        }
        Ok(live)
    }

    /// Move one tunnel's frames until it closes.
    async fn drive(
        &self,
        live: Arc<Live>,
        link: HubLink,
        mut rx: mpsc::Receiver<Delivery>,
        to_app: mpsc::Sender<Vec<u8>>,
    ) {
        let idle = self.shared.config.tunnel_idle_timeout;
        let stop = self.shared.shutdown.clone();
        let mut closed = live.closed.subscribe();
        // After a failed publish (the hub down, or its rate limit), nothing
        // is sent until then: the hub is not asked again at once.
        let mut hold_until = 0u64;
        loop {
            let now = live.clock.now_ms();
            let frames = if now >= hold_until {
                lock(&live.session).transmit(now)
            } else {
                Vec::new()
            };
            for f in frames {
                if let Err(e) = self.send_frame(&live, &link, &f).await {
                    tracing::debug!(error = %e, "a tunnel frame was not sent; it is sent again");
                    hold_until = now + retry_after_ms(&e);
                    lock(&live.session).resend_soon(hold_until);
                    break;
                }
            }
            if lock(&live.session).has_room() {
                live.room.notify_waiters();
            }
            if live.closed_reason().is_some() {
                break;
            }
            let (due, idle_for) = {
                let s = lock(&live.session);
                (s.resend_due_ms(), s.idle_ms(now))
            };
            if idle_for >= idle.as_millis() as u64 {
                live.close(CloseReason::Idle);
                continue;
            }
            let wait = due
                .map(|d| d.max(hold_until))
                .map(|d| Duration::from_millis(d.saturating_sub(now)))
                .unwrap_or(IDLE_CHECK)
                .min(IDLE_CHECK);
            tokio::select! {
                _ = stop.cancelled() => {
                    live.close(CloseReason::Stopped);
                    break;
                }
                _ = closed.changed() => {}
                _ = live.wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
                d = rx.recv() => {
                    let Some(d) = d else {
                        live.close(CloseReason::Stopped);
                        continue;
                    };
                    let mut batch = vec![d];
                    while let Ok(d) = rx.try_recv() {
                        batch.push(d);
                    }
                    for d in batch {
                        let frame_ref = d.frame_ref();
                        self.take_frame(&live, &d.payload, &to_app, &stop).await;
                        link.ack(vec![frame_ref]).await;
                    }
                }
            }
        }
        // The close frame, best effort: the other side's idle timeout or
        // roster check closes it otherwise.
        let last = lock(&live.session).transmit_close();
        if let Some(f) = last {
            let _ = self.send_frame(&live, &link, &f).await;
        }
        lock(&self.shared.tunnels.live).remove(&live.id);
        link.unsubscribe(&live.keys.inbound.topic).await;
        let reason = live.closed_reason().unwrap_or(CloseReason::Stopped);
        let calls = std::mem::take(&mut *lock(&live.calls));
        for (_, tx) in calls {
            let _ = tx.try_send(Err(TunnelError::Closed(reason.clone())));
        }
        live.room.notify_waiters();
    }

    /// One delivery of the tunnel's inbound topic.
    async fn take_frame(
        &self,
        live: &Live,
        payload: &[u8],
        to_app: &mpsc::Sender<Vec<u8>>,
        stop: &tokio_util::sync::CancellationToken,
    ) {
        let crypto = self.shared.registry.provider().crypto();
        let Ok(frame) = handshake::unseal(crypto, &live.keys.inbound, payload) else {
            self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let now = live.clock.now_ms();
        let got = lock(&live.session).receive(frame, now);
        match got {
            Ok(r) => {
                for m in r.messages {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        sent = to_app.send(m) => if sent.is_err() { return },
                    }
                }
                if let Some(reason) = r.closed {
                    live.close(CloseReason::Remote(reason));
                }
            }
            Err(e) => live.close(CloseReason::Broken(e.to_string())),
        }
    }

    async fn send_frame(&self, live: &Live, link: &HubLink, f: &Frame) -> Result<(), SendError> {
        let crypto = self.shared.registry.provider().crypto();
        let counter = live.counter.fetch_add(1, Ordering::Relaxed);
        let lose = self
            .shared
            .faults
            .lose_tunnel_frames
            .load(Ordering::Relaxed);
        if lose > 0 && counter % lose == lose - 1 {
            return Ok(());
        }
        let payload = handshake::seal(crypto, &live.keys.out, counter, f)
            .map_err(|e| SendError::Seal(e.to_string()))?;
        let topic = live.keys.out.topic.clone();
        let mut p = Publish {
            publish_id: publish_id(&digest(&payload), &topic),
            topic,
            class: RetentionClass::Mailbox,
            expected_head: ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: Some(FRAME_RETENTION_SECS),
            payload,
            writer: None,
        };
        live.keys.out.sign(&mut p);
        link.publish(p).await.map(|_| ()).map_err(SendError::Link)
    }

    /// The serving side's procedure layer: run each call, at most
    /// [`MAX_CALLS`] at once, and send what it answers.
    async fn serve_calls(&self, live: Arc<Live>, mut from_peer: mpsc::Receiver<Vec<u8>>) {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CALLS));
        let caller = Caller {
            group: live.group,
            device: live.peer,
        };
        while let Some(m) = from_peer.recv().await {
            let Ok(Rpc::Call { id, method, body }) = postcard::from_bytes::<Rpc>(&m) else {
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let handler = if method == history::PROCEDURE {
                // The engine's own: served whatever the app registered.
                let me = self.clone();
                let f: Streamed = Arc::new(move |c, _, sink| {
                    let me = me.clone();
                    Box::pin(async move { me.serve_history(c, sink).await })
                });
                Some(Handler::Streamed(f))
            } else {
                lock(&self.shared.tunnels.procedures)
                    .as_ref()
                    .and_then(|p| p.map.get(&method).cloned())
            };
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let live = live.clone();
            self.shared.tasks.spawn(async move {
                let _slot = slot;
                let failure = match handler {
                    None => Some(RpcFailure::NoSuchProcedure(method)),
                    Some(Handler::Unary(f)) => match f(caller, body).await {
                        Ok(body) => live
                            .send(&Rpc::Item { id, body })
                            .await
                            .err()
                            .map(|e| RpcFailure::Failed(e.to_string())),
                        Err(e) => Some(RpcFailure::Failed(e)),
                    },
                    Some(Handler::Streamed(f)) => {
                        let sink = ResponseSink {
                            live: live.clone(),
                            id,
                        };
                        f(caller, body, sink).await.err().map(RpcFailure::Failed)
                    }
                };
                // A closed tunnel takes no end: nobody is waiting for it.
                let _ = live.send(&Rpc::End { id, failure }).await;
            });
        }
    }
}

/// How long to hold a tunnel's sending after a failed publish: what a
/// rate-limited hub asked for, else [`SEND_RETRY_MS`].
fn retry_after_ms(e: &SendError) -> u64 {
    match e {
        SendError::Link(super::link::LinkError::Client(crate::client::ClientError::Hub(
            crate::wire::HubError::RateLimited { retry_after_ms, .. },
        ))) => (*retry_after_ms).max(SEND_RETRY_MS),
        _ => SEND_RETRY_MS,
    }
}

/// Why a tunnel frame was not sent.
#[derive(Debug, thiserror::Error)]
enum SendError {
    /// It could not be sealed.
    #[error("sealing a tunnel frame: {0}")]
    Seal(String),
    /// The hub did not take it.
    #[error("publishing a tunnel frame: {0}")]
    Link(super::link::LinkError),
}

impl GroupPeerManager {
    /// The calling side's procedure layer: hand each response to its call.
    async fn read_responses(&self, live: Arc<Live>, mut from_peer: mpsc::Receiver<Vec<u8>>) {
        while let Some(m) = from_peer.recv().await {
            let (id, item, end) = match postcard::from_bytes::<Rpc>(&m) {
                Ok(Rpc::Item { id, body }) => (id, Some(Ok(body)), false),
                Ok(Rpc::End { id, failure }) => (
                    id,
                    failure.map(|f| {
                        Err(match f {
                            RpcFailure::NoSuchProcedure(n) => TunnelError::NoSuchProcedure(n),
                            RpcFailure::Failed(why) => TunnelError::Failed(why),
                        })
                    }),
                    true,
                ),
                // The serving side sends no calls; anything else is dropped,
                // and counted.
                Ok(Rpc::Call { .. }) | Err(_) => {
                    self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let tx = if end {
                lock(&live.calls).remove(&id)
            } else {
                lock(&live.calls).get(&id).cloned()
            };
            if let (Some(tx), Some(item)) = (tx, item) {
                // A caller that dropped its stream gets nothing more.
                let _ = tx.send(item).await;
            }
        }
    }
}
