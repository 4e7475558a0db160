//! One WebSocket connection: challenge, authentication, requests, and the
//! device's receive stream.
//!
//! Each request's store change is made in frame order on the reading task;
//! only the wait for durability and the answer run on their own task, so a
//! device that pipelines publishes gets them sequenced in the order it sent
//! them, and many of them share one flush.

use super::{HubShared, Session};
use crate::transport::ws_config;
use crate::transport::BoxStream;
use crate::wire::{
    auth_message, Auth, AuthOk, Challenge, ClientFrame, DecodeError, DeviceId, HubError, Request,
    Response, ServerFrame, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
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

/// Deliveries read from the store per page.
const PUMP_PAGE: usize = 256;
/// Frames queued for one connection's socket before writers wait.
const OUTBOX_FRAMES: usize = 256;

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
    serve_connection(&shared, conn, stream)
        .instrument(tracing::debug_span!("conn", conn, %peer))
        .await;
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

async fn serve_connection(shared: &Arc<HubShared>, conn: u64, stream: BoxStream) {
    let max_frame = shared.config.limits.max_frame();
    let ws = match tokio::time::timeout(
        shared.config.challenge_ttl,
        tokio_tungstenite::accept_async_with_config(stream, Some(ws_config(max_frame))),
    )
    .await
    {
        Ok(Ok(ws)) => ws,
        Ok(Err(e)) => {
            tracing::debug!(conn, error = %e, "websocket handshake failed");
            return;
        }
        Err(_) => {
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

    let Some(device) = authenticate(shared, &mut source, &tx).await else {
        drop(tx);
        let _ = writer.await;
        return;
    };
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

/// Send a challenge and wait for a valid answer. Requests before it are
/// answered `NotAuthenticated`; a wrong answer closes the connection.
async fn authenticate(
    shared: &Arc<HubShared>,
    source: &mut (impl futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
              + Unpin),
    tx: &mpsc::Sender<Message>,
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
    // The connection outlives the challenge a little, so a late answer is
    // told `ChallengeExpired` rather than cut off without a reason.
    let deadline = tokio::time::Instant::now() + shared.config.challenge_ttl * 2;
    loop {
        let msg = tokio::select! {
            _ = shared.shutdown.cancelled() => return None,
            _ = tokio::time::sleep_until(deadline) => {
                let _ = tx.send(close(CloseCode::Policy, "authentication timed out")).await;
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
                            .fetch_add(1, Ordering::Relaxed);
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
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&auth.version) {
        return Err(HubError::UnsupportedVersion {
            requested: auth.version,
            min: MIN_PROTOCOL_VERSION,
            max: PROTOCOL_VERSION,
        });
    }
    let now = shared.clock.now_ms();
    {
        let used = shared.used_nonces.lock().unwrap_or_else(|p| p.into_inner());
        if used.contains_key(&auth.nonce) {
            return Err(HubError::ChallengeReplayed);
        }
    }
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
    if auth.hub_url.trim_end_matches('/') != shared.config.url {
        return Err(HubError::WrongHub {
            expected: shared.config.url.clone(),
            got: auth.hub_url.clone(),
        });
    }
    let key = VerifyingKey::from_bytes(&auth.device.0).map_err(|_| HubError::BadSignature)?;
    let sig = Signature::from_slice(&auth.signature).map_err(|_| HubError::BadSignature)?;
    key.verify_strict(
        &auth_message(&auth.nonce, &auth.hub_url, auth.expires_at_ms),
        &sig,
    )
    .map_err(|_| HubError::BadSignature)?;
    // Consume the challenge. Used nonces are remembered until they expire;
    // after that the expiry check refuses them anyway.
    let mut used = shared.used_nonces.lock().unwrap_or_else(|p| p.into_inner());
    if used.len() > 4096 {
        used.retain(|_, exp| *exp >= now);
    }
    used.insert(auth.nonce, expires_at_ms);
    Ok(auth.version)
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
        wake: Vec<DeviceId>,
    ) {
        let Ok(permit) = self.in_flight.clone().acquire_owned().await else {
            return;
        };
        let shared = self.shared.clone();
        let tx = self.tx.clone();
        self.shared.tasks.spawn(async move {
            let result = shared.core.durable(gen).await.map(|()| response);
            if result.is_ok() && !wake.is_empty() {
                shared.wake(&wake);
            }
            let _ = tx.send(binary(&ServerFrame::Response { id, result })).await;
            drop(permit);
        });
    }

    async fn request(&self, id: u64, op: Request) {
        let core = &self.shared.core;
        let d = self.device;
        match op {
            Request::Publish(p) => match core.publish(d, p) {
                Ok(r) => {
                    let out = Response::Published(r.value.outcome);
                    self.respond_when_durable(id, r.gen, out, r.value.recipients)
                        .await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
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
                        .fetch(&topic, after, limit)
                        .await
                        .map(Response::Fetched);
                    let _ = tx.send(binary(&ServerFrame::Response { id, result })).await;
                    drop(permit);
                });
            }
            Request::Subscribe {
                topic,
                retention_secs,
            } => match core.subscribe(d, &topic, retention_secs) {
                Ok(r) => {
                    self.respond_when_durable(id, r.gen, Response::Subscribed, vec![])
                        .await
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::Unsubscribe { topic } => match core.unsubscribe(d, &topic) {
                Ok(r) => {
                    let out = Response::Unsubscribed { existed: r.value };
                    self.respond_when_durable(id, r.gen, out, vec![]).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::Ack { ids } => match core.ack(d, &ids) {
                // An ack lost in a crash only means a redelivery, which
                // devices deduplicate: answer without waiting for the flush.
                Ok(r) => {
                    self.respond(id, Ok(Response::Acked { removed: r.value }))
                        .await
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::UploadKeyPackages {
                packages,
                last_resort,
            } => match core.upload_key_packages(d, &packages, last_resort) {
                Ok(r) => {
                    let out = Response::KeyPackagesStored { pool: r.value };
                    self.respond_when_durable(id, r.gen, out, vec![]).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::ClaimKeyPackage { device } => match core.claim_key_package(d, device) {
                Ok(r) => {
                    let (package, last_resort) = r.value;
                    let out = Response::KeyPackage {
                        package,
                        last_resort,
                    };
                    self.respond_when_durable(id, r.gen, out, vec![]).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::KeyPackageStatus => match core.key_package_status(d) {
                Ok(r) => {
                    let (pool, last_resort) = r.value;
                    let out = Response::KeyPackageStatus { pool, last_resort };
                    self.respond_when_durable(id, r.gen, out, vec![]).await;
                }
                Err(e) => self.respond(id, Err(e)).await,
            },
            Request::Receive { after } => self.start_receive(id, after).await,
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
    async fn start_receive(&self, id: u64, after: u64) {
        let last_id = match self.shared.core.last_delivery_id(self.device) {
            Ok(last) => last,
            Err(e) => return self.respond(id, Err(e)).await,
        };
        let wake = Arc::new(Notify::new());
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
                    wake: wake.clone(),
                    cancel: cancel.clone(),
                },
            )
        };
        if let Some(old) = old {
            old.cancel.cancel();
        }
        // The answer is queued before the pump starts, so it precedes every
        // delivery on the socket.
        self.respond(id, Ok(Response::ReceiveStarted { last_id }))
            .await;
        let shared = self.shared.clone();
        let tx = self.tx.clone();
        let device = self.device;
        self.shared
            .tasks
            .spawn(pump(shared, device, after, tx, wake, cancel));
    }
}

/// Push a device's deliveries from the store as they become durable. Reads
/// at its own pace, so a slow device never holds up publishers: it falls
/// behind in the store, not in memory.
async fn pump(
    shared: Arc<HubShared>,
    device: DeviceId,
    mut cursor: u64,
    tx: mpsc::Sender<Message>,
    wake: Arc<Notify>,
    cancel: CancellationToken,
) {
    loop {
        if cancel.is_cancelled() {
            break;
        }
        let page = tokio::select! {
            _ = cancel.cancelled() => break,
            p = shared.core.deliveries(device, cursor, PUMP_PAGE) => p,
        };
        let page = match page {
            Ok(p) => p,
            Err(e) => {
                let _ = tx.send(binary(&ServerFrame::ReceiveEnded(e))).await;
                return;
            }
        };
        for d in page.deliveries {
            let frame = binary(&ServerFrame::Deliver(d));
            tokio::select! {
                _ = cancel.cancelled() => break,
                r = tx.send(frame) => if r.is_err() { return },
            }
            shared.counters.pushed.fetch_add(1, Ordering::Relaxed);
        }
        cursor = page.scanned_through;
        if page.more {
            continue;
        }
        tokio::select! {
            _ = wake.notified() => {}
            _ = cancel.cancelled() => break,
            _ = tx.closed() => return,
        }
    }
    // Tell the device why its stream ended, unless the connection is going
    // away anyway.
    if !shared.shutdown.is_cancelled() {
        let _ = tx
            .send(binary(&ServerFrame::ReceiveEnded(
                HubError::ReceiveReplaced,
            )))
            .await;
    }
}
