//! One WebSocket connection: admission, challenge, authentication,
//! requests, and the device's receive stream.
//!
//! Admission: at most `max_unauthenticated` connections may be between
//! accept and `AuthOk` at once; one more is closed at once with 1013 and a
//! reason, without a challenge. Each admitted connection has until
//! `auth_deadline` after its accept to finish the WebSocket handshake and
//! authenticate, or it is closed (1008 `authentication timed out`).
//!
//! Each request's store change is made in frame order on the reading task;
//! only the wait for durability and the answer run on their own task, so a
//! device that pipelines publishes gets them sequenced in the order it sent
//! them, and many of them share one flush.

use super::stream::StreamState;
use super::{HubShared, Session};
use crate::transport::ws_config;
use crate::transport::BoxStream;
use crate::wire::{
    auth_message, Auth, AuthOk, Challenge, ChangeOutcome, ClientFrame, DecodeError, DeviceId,
    FrameRef, HubError, Request, Response, ServerFrame, SubscriptionChange, TopicId,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use ed25519_dalek::{Signature, VerifyingKey};
use futures::{SinkExt, StreamExt};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

/// Frames of one topic read from the store per page.
const PUMP_PAGE: usize = 256;
/// Frames a receive stream pushes before the device acknowledges them; then
/// it waits for acknowledgements.
const STREAM_WINDOW: usize = 4096;
/// How long after an acknowledgement a stream saves its cursors: acks of
/// one burst share one store write per topic. A cursor saved late only
/// means frames pushed again after a crash, which devices deduplicate.
const CURSOR_SAVE_DELAY: Duration = Duration::from_millis(100);
/// Frames queued for one connection's socket before writers wait.
const OUTBOX_FRAMES: usize = 256;
/// How long a refused connection may take to receive its close reason
/// (at most the auth deadline): refused connections hold no slot, so this
/// bounds what they cost.
const REFUSE_WITHIN: Duration = Duration::from_secs(2);
/// The close reason of a connection refused for the unauthenticated cap.
const TOO_MANY_UNAUTHENTICATED: &str = "too many unauthenticated connections";
/// The close reason at the auth deadline.
const AUTH_TIMED_OUT: &str = "authentication timed out";

/// One of the `max_unauthenticated` places of a connection that has not
/// authenticated yet; given back when dropped.
struct UnauthSlot<'a> {
    shared: &'a HubShared,
}

impl<'a> UnauthSlot<'a> {
    fn take(shared: &'a HubShared) -> Option<Self> {
        let max = shared.config.max_unauthenticated as u64;
        shared
            .counters
            .unauthenticated
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(UnauthSlot { shared })
    }
}

impl Drop for UnauthSlot<'_> {
    fn drop(&mut self) {
        self.shared
            .counters
            .unauthenticated
            .fetch_sub(1, Ordering::AcqRel);
    }
}

fn binary(frame: &ServerFrame) -> Message {
    Message::Binary(frame.encode().into())
}

fn close(code: CloseCode, reason: &str) -> Message {
    // A close reason may be at most 123 bytes; cut on a character boundary.
    let mut end = reason.len().min(120);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    Message::Close(Some(CloseFrame {
        code,
        reason: reason[..end].to_string().into(),
    }))
}

pub(crate) async fn connection(shared: Arc<HubShared>, conn: u64, stream: BoxStream, peer: String) {
    shared.counters.connections.fetch_add(1, Ordering::Relaxed);
    shared.counters.open.fetch_add(1, Ordering::Relaxed);
    use tracing::Instrument;
    let span = tracing::debug_span!("conn", conn, %peer);
    match UnauthSlot::take(&shared) {
        Some(slot) => {
            serve_connection(&shared, conn, stream, slot)
                .instrument(span)
                .await
        }
        None => refuse_connection(&shared, stream).instrument(span).await,
    }
    shared.counters.open.fetch_sub(1, Ordering::Relaxed);
    // This connection's receive stream ends with it, unless a newer one
    // already replaced it.
    let mut sessions = shared.sessions.lock().unwrap_or_else(|p| p.into_inner());
    sessions.retain(|_, s| {
        if s.conn == conn {
            s.cancel.cancel();
            false
        } else {
            true
        }
    });
}

/// Close a connection over the unauthenticated cap at once: a WebSocket
/// close with a reason when its handshake comes quickly, else just the TCP
/// connection. No challenge is drawn and no state is touched.
async fn refuse_connection(shared: &Arc<HubShared>, stream: BoxStream) {
    shared
        .counters
        .unauthenticated_refused
        .fetch_add(1, Ordering::Relaxed);
    tracing::debug!("refused: {TOO_MANY_UNAUTHENTICATED}");
    let within = REFUSE_WITHIN.min(shared.config.auth_deadline);
    let _ = tokio::time::timeout(within, async {
        let config = ws_config(shared.config.limits.max_frame());
        if let Ok(mut ws) = tokio_tungstenite::accept_async_with_config(stream, Some(config)).await
        {
            let _ = ws
                .send(close(CloseCode::Again, TOO_MANY_UNAUTHENTICATED))
                .await;
            // Let the peer answer the close, so it reads the reason rather
            // than a reset.
            while let Some(Ok(_)) = ws.next().await {}
        }
    })
    .await;
}

async fn serve_connection(
    shared: &Arc<HubShared>,
    conn: u64,
    stream: BoxStream,
    slot: UnauthSlot<'_>,
) {
    let max_frame = shared.config.limits.max_frame();
    let deadline = tokio::time::Instant::now() + shared.config.auth_deadline;
    let ws = tokio::select! {
        _ = shared.shutdown.cancelled() => return,
        r = tokio::time::timeout_at(
            deadline,
            tokio_tungstenite::accept_async_with_config(stream, Some(ws_config(max_frame))),
        ) => r,
    };
    let ws = match ws {
        Ok(Ok(ws)) => ws,
        Ok(Err(e)) => {
            tracing::debug!(conn, error = %e, "websocket handshake failed");
            return;
        }
        Err(_) => {
            // Too late for a close reason: there is no WebSocket yet.
            shared
                .counters
                .auth_timeouts
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(conn, "websocket handshake timed out");
            return;
        }
    };
    let (mut sink, mut source) = ws.split();
    let (tx, mut rx) = mpsc::channel::<Message>(OUTBOX_FRAMES);
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            let is_close = matches!(m, Message::Close(_));
            if sink.feed(m).await.is_err() {
                return;
            }
            // Batch whatever else is queued into the same flush.
            while let Ok(m) = rx.try_recv() {
                let c = matches!(m, Message::Close(_));
                if sink.feed(m).await.is_err() {
                    return;
                }
                if c {
                    let _ = sink.flush().await;
                    return;
                }
            }
            if sink.flush().await.is_err() || is_close {
                return;
            }
        }
        let _ = sink.close().await;
    });

    let Some(device) = authenticate(shared, &mut source, &tx, deadline).await else {
        drop(tx);
        let _ = writer.await;
        return;
    };
    drop(slot);
    tracing::debug!(conn, device = %device, "authenticated");

    let in_flight = Arc::new(Semaphore::new(shared.config.max_in_flight));
    let ctx = Conn {
        shared: shared.clone(),
        conn,
        device,
        tx: tx.clone(),
        in_flight: in_flight.clone(),
    };
    loop {
        let msg = tokio::select! {
            _ = shared.shutdown.cancelled() => {
                // Let answers being made durable go out before the close.
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    in_flight.acquire_many(shared.config.max_in_flight as u32),
                ).await;
                let _ = tx.send(close(CloseCode::Away, "hub shutting down")).await;
                break;
            }
            m = source.next() => m,
        };
        match msg {
            Some(Ok(Message::Binary(bytes))) => match ClientFrame::decode(&bytes, max_frame) {
                Ok(ClientFrame::Request { id, op }) => ctx.request(id, op).await,
                Ok(ClientFrame::Auth(_)) => ctx.send_error(HubError::AlreadyAuthenticated).await,
                Err(DecodeError::UnknownOperation { id, op }) => {
                    ctx.bad_frame();
                    ctx.respond(id, Err(HubError::UnknownOperation { op }))
                        .await;
                }
                Err(e) => {
                    ctx.bad_frame();
                    ctx.send_error(e.into()).await;
                }
            },
            Some(Ok(Message::Text(_))) => {
                ctx.bad_frame();
                ctx.send_error(HubError::TextFrame).await;
            }
            Some(Ok(Message::Close(_))) | None => break,
            Some(Ok(_)) => {} // ping/pong are answered by tungstenite
            Some(Err(e)) => {
                tracing::debug!(conn, error = %e, "connection read failed");
                // An oversized message makes tungstenite fail the read; say
                // why before the connection goes.
                if let tokio_tungstenite::tungstenite::Error::Capacity(c) = &e {
                    ctx.bad_frame();
                    let _ = tx
                        .send(close(CloseCode::Size, &format!("frame too large: {c}")))
                        .await;
                }
                break;
            }
        }
    }
    drop(ctx);
    drop(tx);
    let _ = writer.await;
}

/// Send a challenge and wait for a valid answer until `deadline`. Requests
/// before it are answered `NotAuthenticated`; a wrong answer closes the
/// connection, and so does the deadline.
async fn authenticate(
    shared: &Arc<HubShared>,
    source: &mut (impl futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
              + Unpin),
    tx: &mpsc::Sender<Message>,
    deadline: tokio::time::Instant,
) -> Option<DeviceId> {
    let max_frame = shared.config.limits.max_frame();
    let nonce = shared.rng.bytes32();
    let expires_at_ms = shared.clock.now_ms() + shared.config.challenge_ttl.as_millis() as u64;
    let challenge = Challenge {
        min_version: MIN_PROTOCOL_VERSION,
        max_version: PROTOCOL_VERSION,
        nonce,
        hub_url: shared.config.url.clone(),
        expires_at_ms,
    };
    tx.send(binary(&ServerFrame::Challenge(challenge)))
        .await
        .ok()?;
    // With the default challenge TTL below the auth deadline, a late
    // answer is told `ChallengeExpired` rather than cut off without a reason.
    loop {
        let msg = tokio::select! {
            _ = shared.shutdown.cancelled() => return None,
            _ = tokio::time::sleep_until(deadline) => {
                shared.counters.auth_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("{AUTH_TIMED_OUT}");
                let _ = tx.send(close(CloseCode::Policy, AUTH_TIMED_OUT)).await;
                return None;
            }
            m = source.next() => m,
        };
        let refuse = match msg {
            Some(Ok(Message::Binary(bytes))) => match ClientFrame::decode(&bytes, max_frame) {
                Ok(ClientFrame::Auth(auth)) => match verify(shared, &auth, &nonce, expires_at_ms) {
                    Ok(version) => {
                        let ok = AuthOk {
                            device: auth.device,
                            version,
                            server_time_ms: shared.clock.now_ms(),
                            max_payload: shared.config.limits.max_payload as u64,
                            store_id: shared.core.store_id(),
                        };
                        tx.send(binary(&ServerFrame::AuthOk(ok))).await.ok()?;
                        return Some(auth.device);
                    }
                    Err(e) => {
                        shared
                            .counters
                            .auth_failures
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .count(&e);
                        tracing::debug!(error = %e, "authentication refused");
                        let _ = tx.send(binary(&ServerFrame::Error(e.clone()))).await;
                        let _ = tx.send(close(CloseCode::Policy, &e.to_string())).await;
                        return None;
                    }
                },
                Ok(ClientFrame::Request { id, .. })
                | Err(DecodeError::UnknownOperation { id, .. }) => ServerFrame::Response {
                    id,
                    result: Err(HubError::NotAuthenticated),
                },
                Err(e) => ServerFrame::Error(e.into()),
            },
            Some(Ok(Message::Text(_))) => ServerFrame::Error(HubError::TextFrame),
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => continue,
        };
        shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
        tx.send(binary(&refuse)).await.ok()?;
    }
}

/// Check an answer to this connection's challenge; returns the agreed version.
fn verify(
    shared: &HubShared,
    auth: &Auth,
    nonce: &[u8; 32],
    expires_at_ms: u64,
) -> Result<u16, HubError> {
    check_version(auth)?;
    let now = shared.clock.now_ms();
    {
        let used = shared.used_nonces.lock().unwrap_or_else(|p| p.into_inner());
        if used.contains_key(&auth.nonce) {
            return Err(HubError::ChallengeReplayed);
        }
    }
    check_challenge(auth, nonce, expires_at_ms, now, &shared.config.url)?;
    // Consume the challenge. Used nonces are remembered until they expire;
    // after that the expiry check refuses them anyway.
    let mut used = shared.used_nonces.lock().unwrap_or_else(|p| p.into_inner());
    if used.len() > 4096 {
        used.retain(|_, exp| *exp >= now);
    }
    used.insert(auth.nonce, expires_at_ms);
    Ok(auth.version)
}

/// Every check of an answer that needs nothing but the challenge it
/// answers (no replay check: that needs the hub's record of used nonces).
/// Answers the agreed version; kept apart from [`verify`] so that the
/// fuzzing target `auth_exchange` runs the very checks the hub runs.
pub(crate) fn check_answer(
    auth: &Auth,
    nonce: &[u8; 32],
    expires_at_ms: u64,
    now_ms: u64,
    hub_url: &str,
) -> Result<u16, HubError> {
    check_version(auth)?;
    check_challenge(auth, nonce, expires_at_ms, now_ms, hub_url)?;
    Ok(auth.version)
}

fn check_version(auth: &Auth) -> Result<(), HubError> {
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&auth.version) {
        return Err(HubError::UnsupportedVersion {
            requested: auth.version,
            min: MIN_PROTOCOL_VERSION,
            max: PROTOCOL_VERSION,
        });
    }
    Ok(())
}

/// The challenge's nonce and expiry, the hub URL and the signature.
fn check_challenge(
    auth: &Auth,
    nonce: &[u8; 32],
    expires_at_ms: u64,
    now: u64,
    hub_url: &str,
) -> Result<(), HubError> {
    if &auth.nonce != nonce {
        return Err(HubError::UnknownChallenge);
    }
    if auth.expires_at_ms != expires_at_ms {
        // The device altered the challenge it was given.
        return Err(HubError::UnknownChallenge);
    }
    if now > expires_at_ms {
        return Err(HubError::ChallengeExpired);
    }
    if auth.hub_url.trim_end_matches('/') != hub_url {
        return Err(HubError::WrongHub {
            expected: hub_url.to_string(),
            got: auth.hub_url.clone(),
        });
    }
    let key = VerifyingKey::from_bytes(&auth.device.0).map_err(|_| HubError::BadSignature)?;
    let sig = Signature::from_slice(&auth.signature).map_err(|_| HubError::BadSignature)?;
    key.verify_strict(
        &auth_message(&auth.nonce, &auth.hub_url, auth.expires_at_ms),
        &sig,
    )
    .map_err(|_| HubError::BadSignature)
}

/// An authenticated connection's request handling.
struct Conn {
    shared: Arc<HubShared>,
    conn: u64,
    device: DeviceId,
    tx: mpsc::Sender<Message>,
    in_flight: Arc<Semaphore>,
}

impl Conn {
    fn bad_frame(&self) {
        self.shared
            .counters
            .bad_frames
            .fetch_add(1, Ordering::Relaxed);
    }

    async fn send_error(&self, e: HubError) {
        let _ = self.tx.send(binary(&ServerFrame::Error(e))).await;
    }

    async fn respond(&self, id: u64, result: Result<Response, HubError>) {
        let _ = self
            .tx
            .send(binary(&ServerFrame::Response { id, result }))
            .await;
    }

    /// Answer `id` once generation `gen` is durable, on a task of its own.
    async fn respond_when_durable(
        &self,
        id: u64,
        gen: u64,
        response: Response,
        wake: Option<(Vec<DeviceId>, TopicId, u64)>,
    ) {
        let Ok(permit) = self.in_flight.clone().acquire_owned().await else {
            return;
        };
        let shared = self.shared.clone();
        let tx = self.tx.clone();
        self.shared.tasks.spawn(async move {
            let result = shared.core.durable(gen).await.map(|()| response);
            if let (true, Some((devices, topic, seq))) = (result.is_ok(), wake) {
                shared.wake(&devices, &topic, seq);
            }
            let _ = tx.send(binary(&ServerFrame::Response { id, result })).await;
            drop(permit);
        });
    }

    /// Apply subscription changes, tell a running receive stream of this
    /// device what it now follows, and answer with `answer(outcomes)` once
    /// the changes are durable.
    async fn change_subscriptions(
        &self,
        id: u64,
        changes: Vec<SubscriptionChange>,
        answer: impl FnOnce(Vec<ChangeOutcome>) -> Result<Response, HubError>,
    ) {
        let d = self.device;
        self.shared
            .counters
            .subscription_changes
            .fetch_add(changes.len() as u64, Ordering::Relaxed);
        let r = match self.shared.core.change_subscriptions(d, &changes).await {
            Ok(r) => r,
            Err(e) => return self.respond(id, Err(e)).await,
        };
        if let Some(stream) = self.shared.stream_of(d) {
            for (change, outcome) in changes.iter().zip(&r.value) {
                match (change, outcome) {
                    // The stream learns of the topic and loads its cursor
                    // (a no-op when it follows the topic already).
                    (SubscriptionChange::Subscribe { topic, .. }, ChangeOutcome::Subscribed) => {
                        stream.woken(topic, 0)
                    }
                    (
                        SubscriptionChange::Unsubscribe { topic },
                        ChangeOutcome::Unsubscribed { .. },
                    ) if topic.mailbox_owner() != Some(d) => stream.forget(topic),
                    _ => {}
                }
            }
        }
        match answer(r.value) {
            Ok(out) => self.respond_when_durable(id, r.gen, out, None).await,
            Err(e) => self.respond(id, Err(e)).await,
        }
    }

    async fn request(&self, id: u64, op: Request) {
        let core = &self.shared.core;
        let d = self.device;
        match op {
            Request::Publish(p) => {
                let topic = p.topic.clone();
                match core.publish(d, p).await {
                    Ok(r) => {
                        let wake = match r.value.outcome {
                            crate::wire::PublishOutcome::Accepted { seq, .. }
                                if !r.value.recipients.is_empty() =>
                            {
                                Some((r.value.recipients, topic, seq))
                            }
                            _ => None,
                        };
                        let out = Response::Published(r.value.outcome);
                        self.respond_when_durable(id, r.gen, out, wake).await;
                    }
                    Err(e) => self.respond(id, Err(e)).await,
                }
            }
            Request::Fetch {
                topic,
                after,
                limit,
            } => {
                let Ok(permit) = self.in_flight.clone().acquire_owned().await else {
                    return;
                };
                let shared = self.shared.clone();
                let tx = self.tx.clone();
                self.shared.tasks.spawn(async move {
                    let result = shared
                        .core
                        .fetch(d, &topic, after, limit)
                        .await
                        .map(Response::Fetched);
                    let _ = tx.send(binary(&ServerFrame::Response { id, result })).await;
                    drop(permit);
                });
            }
            Request::Subscribe {
                topic,
                retention_secs,
            } => {
                let change = SubscriptionChange::Subscribe {
                    topic,
                    retention_secs,
                };
                self.change_subscriptions(id, vec![change], |mut outcomes| match outcomes.pop() {
                    Some(ChangeOutcome::Refused(e)) => Err(e),
                    _ => Ok(Response::Subscribed),
                })
                .await
            }
            Request::Unsubscribe { topic } => {
                let change = SubscriptionChange::Unsubscribe { topic };
                self.change_subscriptions(id, vec![change], |mut outcomes| match outcomes.pop() {
                    Some(ChangeOutcome::Refused(e)) => Err(e),
                    Some(ChangeOutcome::Unsubscribed { existed }) => {
                        Ok(Response::Unsubscribed { existed })
                    }
                    _ => Ok(Response::Unsubscribed { existed: false }),
                })
                .await
            }
            Request::Subscriptions { changes } => {
                self.change_subscriptions(id, changes, |outcomes| {
                    Ok(Response::SubscriptionsChanged { outcomes })
                })
                .await
            }
            Request::Ack { frames } => {
                let max = self.shared.config.limits.max_acks;
                let result = if frames.len() > max {
                    Err(HubError::TooManyAcks {
                        count: frames.len() as u64,
                        max: max as u64,
                    })
                } else {
                    // In memory: the stream saves the cursors the acks move
                    // a moment later, in one write per topic. An ack lost in
                    // a crash only means a frame pushed again, which devices
                    // deduplicate.
                    let removed = match self.shared.stream_of(d) {
                        Some(stream) => stream.ack(&frames),
                        None => 0,
                    };
                    self.shared
                        .counters
                        .acked
                        .fetch_add(u64::from(removed), std::sync::atomic::Ordering::Relaxed);
                    Ok(Response::Acked { removed })
                };
                self.respond(id, result).await
            }
            Request::UploadKeyPackages {
                packages,
                last_resort,
            } => match core.upload_key_packages(d, &packages, last_resort).await {
                Ok(r) => {
                    let out = Response::KeyPackagesStored { pool: r.value };
                    self.respond_when_durable(id, r.gen, out, None).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::ReplaceKeyPackages {
                packages,
                last_resort,
            } => match core.replace_key_packages(d, &packages, last_resort).await {
                Ok(r) => {
                    let out = Response::KeyPackagesStored { pool: r.value };
                    self.respond_when_durable(id, r.gen, out, None).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::ListKeyPackages => match core.key_package_digests(d).await {
                Ok(r) => {
                    let out = Response::KeyPackageDigests { digests: r.value };
                    self.respond_when_durable(id, r.gen, out, None).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::ClaimKeyPackage { device } => match core.claim_key_package(d, device).await {
                Ok(r) => {
                    let (package, last_resort) = r.value;
                    let out = Response::KeyPackage {
                        package,
                        last_resort,
                    };
                    self.respond_when_durable(id, r.gen, out, None).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::KeyPackageStatus => match core.key_package_status(d).await {
                Ok(r) => {
                    let (pool, last_resort) = r.value;
                    let out = Response::KeyPackageStatus { pool, last_resort };
                    self.respond_when_durable(id, r.gen, out, None).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::Receive => self.start_receive(id).await,
            Request::Ping => {
                let now = self.shared.clock.now_ms();
                self.respond(
                    id,
                    Ok(Response::Pong {
                        server_time_ms: now,
                    }),
                )
                .await;
            }
        }
    }

    /// Replace this device's receive stream with one on this connection.
    async fn start_receive(&self, id: u64) {
        self.shared
            .counters
            .receive_starts
            .fetch_add(1, Ordering::Relaxed);
        let stream = Arc::new(Stream::default());
        let cancel = self.shared.shutdown.child_token();
        let old = {
            let mut sessions = self
                .shared
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            sessions.insert(
                self.device,
                Session {
                    conn: self.conn,
                    stream: stream.clone(),
                    cancel: cancel.clone(),
                },
            )
        };
        if let Some(old) = old {
            old.cancel.cancel();
        }
        // The answer is queued before the pump starts, so it precedes every
        // delivery on the socket.
        self.respond(id, Ok(Response::ReceiveStarted)).await;
        let shared = self.shared.clone();
        let tx = self.tx.clone();
        let device = self.device;
        self.shared
            .tasks
            .spawn(pump(shared, device, stream, tx, cancel));
    }
}

/// A receive stream's state, shared by its pump (which reads and pushes),
/// the connection's reader (acknowledgements) and publishes (wakes).
#[derive(Default)]
pub(crate) struct Stream {
    state: std::sync::Mutex<StreamState>,
    /// Frames to read, or topics to load.
    wake: Notify,
    /// Acknowledgements came: cursors to save, room in the window.
    acked: Notify,
}

impl Stream {
    fn state(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frame `seq` of `topic` is durable (0: the device subscribed to it).
    pub(crate) fn woken(&self, topic: &TopicId, seq: u64) {
        self.state().woken(topic, seq);
        self.wake.notify_one();
    }

    /// Deliveries pushed and not acknowledged yet.
    pub(crate) fn unacked(&self) -> usize {
        self.state().unacked()
    }

    /// Whether the stream follows `topic`.
    pub(crate) fn follows(&self, topic: &TopicId) -> bool {
        self.state().follows(topic)
    }

    /// The topics the stream follows.
    pub(crate) fn followed(&self) -> Vec<TopicId> {
        self.state().followed()
    }

    /// Stop pushing `topic`.
    fn forget(&self, topic: &TopicId) {
        self.state().forget(topic);
    }

    /// The device acknowledged `frames`: answers how many were pushed on
    /// this stream and not acknowledged before.
    fn ack(&self, frames: &[FrameRef]) -> u32 {
        let removed = {
            let mut st = self.state();
            frames.iter().filter(|f| st.acked(&f.topic, f.seq)).count() as u32
        };
        if removed > 0 {
            self.acked.notify_one();
        }
        removed
    }
}

impl HubShared {
    /// The receive stream `device` has open, if any.
    fn stream_of(&self, device: DeviceId) -> Option<Arc<Stream>> {
        let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.get(&device).map(|s| s.stream.clone())
    }
}

/// Run a device's receive stream until it is replaced, its connection goes
/// or the store fails, then save its cursors. A stream starts only once the
/// one it replaces saved its own, so acknowledged frames are not pushed
/// again.
async fn pump(
    shared: Arc<HubShared>,
    device: DeviceId,
    stream: Arc<Stream>,
    tx: mpsc::Sender<Message>,
    cancel: CancellationToken,
) {
    let lock = shared.stream_lock(device);
    let ended = tokio::select! {
        running = lock.lock_owned() => {
            let ended = run_pump(&shared, device, &stream, &tx, &cancel).await;
            if let Err(e) = save_cursors(&shared, device, &stream).await {
                // Not lost: the frames behind the unsaved cursor are pushed
                // again on the next stream.
                tracing::warn!(error = %e, "receive stream: cursors not saved");
            }
            drop(running);
            ended
        }
        // Replaced before it started: it still tells its device so.
        _ = cancel.cancelled() => Ok(()),
    };
    let reason = match ended {
        Err(e) => e,
        // Tell the device why its stream ended, unless the connection is
        // going away anyway.
        Ok(()) if shared.shutdown.is_cancelled() => return,
        Ok(()) => HubError::ReceiveReplaced,
    };
    let _ = tx.send(binary(&ServerFrame::ReceiveEnded(reason))).await;
}

/// Save the cursors the device's acknowledgements moved.
async fn save_cursors(
    shared: &HubShared,
    device: DeviceId,
    stream: &Stream,
) -> Result<(), HubError> {
    let advances = stream.state().advances();
    if advances.is_empty() {
        return Ok(());
    }
    if let Err(e) = shared.core.save_cursors(device, &advances).await {
        // Counted where an operator sees it: a store that cannot save
        // cursors makes every device receive its frames again.
        shared
            .counters
            .cursor_save_failures
            .fetch_add(1, Ordering::Relaxed);
        return Err(e);
    }
    let mut st = stream.state();
    for (topic, cursor) in &advances {
        st.saved(topic, *cursor);
    }
    Ok(())
}

/// Push a device's frames as they become durable: each followed topic is
/// read from the store after the stream's position, a page at a time and
/// topic after topic, so a slow device never holds up publishers: it falls
/// behind in the store, not in memory. Returns `Ok` when cancelled or the
/// connection went, `Err` when the store failed.
async fn run_pump(
    shared: &HubShared,
    device: DeviceId,
    stream: &Stream,
    tx: &mpsc::Sender<Message>,
    cancel: &CancellationToken,
) -> Result<(), HubError> {
    let starts = tokio::select! {
        _ = cancel.cancelled() => return Ok(()),
        s = shared.core.stream_start(device) => s?,
    };
    {
        let mut st = stream.state();
        for start in starts {
            st.load(start);
        }
    }
    let mut save_at: Option<tokio::time::Instant> = None;
    loop {
        let unknown = stream.state().take_unknown();
        for topic in unknown {
            let start = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                s = shared.core.topic_start(device, &topic) => s?,
            };
            if let Some(start) = start {
                stream.state().load(start);
            }
        }
        let mut last: Option<TopicId> = None;
        loop {
            let next = {
                let st = stream.state();
                if st.unacked() >= STREAM_WINDOW {
                    break;
                }
                st.next_read(last.as_ref())
            };
            let Some(r) = next else { break };
            let page = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                p = shared.core.stream_page(device, &r.topic, r.after, r.through, r.max_age_ms, PUMP_PAGE) => p?,
            };
            if let Some((after_seq, through_seq)) = page.missed {
                let notice = ServerFrame::Error(HubError::FramesMissed {
                    topic: r.topic.clone(),
                    after_seq,
                    through_seq,
                });
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    sent = tx.send(binary(&notice)) => if sent.is_err() { return Ok(()) },
                }
            }
            for d in page.frames {
                let seq = d.seq;
                let frame = binary(&ServerFrame::Deliver(d));
                // Counted as pushed before it is sent, so that an ack racing
                // the send finds it.
                if !stream.state().follows(&r.topic) {
                    break;
                }
                stream.state().pushed(&r.topic, seq);
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    sent = tx.send(frame) => if sent.is_err() { return Ok(()) },
                }
                shared.counters.pushed.fetch_add(1, Ordering::Relaxed);
            }
            stream.state().scanned(&r.topic, page.scanned_through);
            last = Some(r.topic);
        }
        if stream.state().advances().is_empty() {
            // Nothing to save (a topic forgotten since took its advance
            // with it): no timer, or a past one would wake this loop
            // forever.
            save_at = None;
        } else {
            let due =
                *save_at.get_or_insert_with(|| tokio::time::Instant::now() + CURSOR_SAVE_DELAY);
            if tokio::time::Instant::now() >= due {
                save_cursors(shared, device, stream).await?;
                save_at = None;
            }
        }
        let more = {
            let st = stream.state();
            st.unacked() < STREAM_WINDOW && st.next_read(None).is_some()
        };
        if more {
            continue;
        }
        let sleep = async {
            match save_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stream.wake.notified() => {}
            _ = stream.acked.notified() => {}
            _ = sleep => {}
            _ = cancel.cancelled() => return Ok(()),
            _ = tx.closed() => return Ok(()),
        }
    }
}
