//! `HubClient`: one authenticated connection to one hub.
//!
//! Connects through any [`Connector`], answers the hub's challenge, and then
//! offers each operation as an async method with a timeout. Pushed
//! deliveries arrive on a bounded channel taken once with
//! [`HubClient::take_pushes`]. The client does not reconnect: the device
//! side's `HubLink` owns reconnection and builds on this.

use crate::transport::{handshake_url, ws_config, Connector};
use crate::wire::{
    auth_message, Auth, Challenge, ChangeOutcome, ClientFrame, Delivery, DeviceId, FetchResult,
    FrameRef, HubError, Publish, PublishOutcome, Request, Response, ServerFrame, StoreId,
    SubscriptionChange, TopicId, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use ed25519_dalek::{Signer, SigningKey};
use futures::{SinkExt, StreamExt};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

/// How a client connects and waits.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Limit on connecting, the WebSocket handshake and authentication.
    pub connect_timeout: Duration,
    /// Limit on each request's answer.
    pub request_timeout: Duration,
    /// Largest frame accepted from the hub.
    pub max_frame: usize,
    /// Pushed frames buffered before the connection stops reading.
    pub push_buffer: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            max_frame: crate::hub::Limits::default().max_frame(),
            push_buffer: 1024,
        }
    }
}

/// What went wrong talking to a hub.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The byte stream could not be opened.
    #[error("cannot reach {url}: {reason}")]
    Connect {
        /// The hub URL.
        url: String,
        /// The I/O error.
        reason: String,
    },
    /// The WebSocket handshake failed.
    #[error("websocket handshake with {url} failed: {reason}")]
    Handshake {
        /// The hub URL.
        url: String,
        /// What failed.
        reason: String,
    },
    /// The request never left this client (the connection was closed, or
    /// the wait for room to send it ran out): it certainly took no effect
    /// at the hub, so it can be sent again on another connection without
    /// asking what became of it.
    #[error("the request was never sent: {reason}")]
    NotSent {
        /// Why.
        reason: &'static str,
    },
    /// No answer in time; the request was sent, so it may or may not have
    /// taken effect ([`ClientError::outcome_unknown`]).
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        after: Duration,
    },
    /// The connection closed; the request may or may not have taken effect
    /// (retry with the same publish id to find out).
    #[error("connection to the hub closed")]
    Disconnected,
    /// The hub answered with a named error.
    #[error("hub refused: {0}")]
    Hub(#[from] HubError),
    /// The hub sent something outside the protocol.
    #[error("protocol violation by the hub: {0}")]
    Protocol(String),
    /// The hub speaks no protocol version this client speaks.
    #[error("hub speaks protocol {min}..={max}, this client {ours}")]
    Version {
        /// Hub's oldest.
        min: u16,
        /// Hub's newest.
        max: u16,
        /// Ours.
        ours: u16,
    },
}

impl ClientError {
    /// Whether the request may have taken effect at the hub although no
    /// answer says so (`Timeout` or `Disconnected` after it was sent): a
    /// publish is then retried with the same publish id to find out. A
    /// refusal, an answer, and [`ClientError::NotSent`] are all certain.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            ClientError::Timeout { .. } | ClientError::Disconnected
        )
    }
}

/// Something the hub pushed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Push {
    /// A delivery on the receive stream.
    Delivery(Delivery),
    /// The receive stream ended (for example a newer one replaced it).
    ReceiveEnded(HubError),
    /// An error the hub sent outside any request.
    Error(HubError),
}

// A BTreeMap, not a HashMap: when the connection ends the map is dropped,
// and each dropped sender wakes its waiting request; a HashMap's order
// differs from process to process, which made simulation runs of one seed
// differ when a connection died with several requests in flight.
type Pending = Arc<Mutex<Option<BTreeMap<u64, oneshot::Sender<Result<Response, HubError>>>>>>;

/// An authenticated connection to one hub. Cheap to clone; the connection
/// closes when the last clone is dropped or [`HubClient::close`] is called.
#[derive(Clone)]
pub struct HubClient {
    inner: Arc<Inner>,
}

struct Inner {
    url: String,
    device: DeviceId,
    options: ClientOptions,
    tx: mpsc::Sender<Message>,
    pending: Pending,
    next_id: AtomicU64,
    pushes: Mutex<Option<mpsc::Receiver<Push>>>,
    max_payload: u64,
    store_id: StoreId,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl HubClient {
    /// Connect to `url` through `connector` and authenticate as `key`.
    ///
    /// # Errors
    /// `Connect`, `Handshake`, `Timeout`, `Version`, or `Hub` with the hub's
    /// reason for refusing the authentication.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped attempt leaves nothing behind.
    pub async fn connect(
        connector: &dyn Connector,
        url: &str,
        key: &SigningKey,
        options: ClientOptions,
    ) -> Result<HubClient, ClientError> {
        let limit = options.connect_timeout;
        tokio::time::timeout(limit, Self::connect_inner(connector, url, key, options))
            .await
            .map_err(|_| ClientError::Timeout {
                what: "connect",
                after: limit,
            })?
    }

    async fn connect_inner(
        connector: &dyn Connector,
        url: &str,
        key: &SigningKey,
        options: ClientOptions,
    ) -> Result<HubClient, ClientError> {
        let url = url.trim_end_matches('/').to_string();
        let stream = connector
            .connect(&url)
            .await
            .map_err(|e| ClientError::Connect {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        // The handshake names a ws:// form of the URL (the WebSocket client
        // knows no other scheme); the signature below covers `url` itself.
        let (ws, _) = tokio_tungstenite::client_async_with_config(
            handshake_url(&url).as_ref(),
            stream,
            Some(ws_config(options.max_frame)),
        )
        .await
        .map_err(|e| ClientError::Handshake {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        let (mut sink, mut source) = ws.split();
        let max = options.max_frame;
        let challenge = match next_frame(&mut source, max).await? {
            ServerFrame::Challenge(c) => c,
            other => {
                return Err(ClientError::Protocol(format!(
                    "expected a challenge, got {other:?}"
                )))
            }
        };
        let auth = answer_challenge(&challenge, &url, key)?;
        let device = auth.device;
        let auth = ClientFrame::Auth(auth);
        sink.send(Message::Binary(auth.encode().into()))
            .await
            .map_err(|_| ClientError::Disconnected)?;
        let ok = match next_frame(&mut source, max).await? {
            ServerFrame::AuthOk(ok) => ok,
            ServerFrame::Error(e) => return Err(ClientError::Hub(e)),
            other => {
                return Err(ClientError::Protocol(format!(
                    "expected auth ok, got {other:?}"
                )))
            }
        };

        let (tx, mut rx) = mpsc::channel::<Message>(256);
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                if sink.feed(m).await.is_err() {
                    return;
                }
                while let Ok(m) = rx.try_recv() {
                    if sink.feed(m).await.is_err() {
                        return;
                    }
                }
                if sink.flush().await.is_err() {
                    return;
                }
            }
            let _ = sink.close().await;
        });
        let pending: Pending = Arc::new(Mutex::new(Some(BTreeMap::new())));
        let (push_tx, push_rx) = mpsc::channel(options.push_buffer);
        let reader_pending = pending.clone();
        let reader = tokio::spawn(async move {
            loop {
                let frame = match source.next().await {
                    Some(Ok(Message::Binary(b))) => match ServerFrame::decode(&b, max) {
                        Ok(f) => f,
                        Err(e) => {
                            tracing::warn!(error = %e, "undecodable frame from hub");
                            break;
                        }
                    },
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                    Some(Ok(_)) => continue,
                };
                match frame {
                    ServerFrame::Response { id, result } => {
                        let waiter = lock(&reader_pending).as_mut().and_then(|m| m.remove(&id));
                        if let Some(w) = waiter {
                            let _ = w.send(result);
                        }
                    }
                    ServerFrame::Deliver(d) => {
                        if push_tx.send(Push::Delivery(d)).await.is_err() {
                            // Nobody listens; keep answering requests.
                        }
                    }
                    ServerFrame::ReceiveEnded(e) => {
                        let _ = push_tx.send(Push::ReceiveEnded(e)).await;
                    }
                    ServerFrame::Error(e) => {
                        let _ = push_tx.send(Push::Error(e)).await;
                    }
                    ServerFrame::Challenge(_) | ServerFrame::AuthOk(_) => {
                        tracing::warn!("hub repeated its handshake; closing");
                        break;
                    }
                }
            }
            // Fail every waiting request: dropping the senders does it.
            lock(&reader_pending).take();
        });
        Ok(HubClient {
            inner: Arc::new(Inner {
                url,
                device,
                options,
                tx,
                pending,
                next_id: AtomicU64::new(1),
                pushes: Mutex::new(Some(push_rx)),
                max_payload: ok.max_payload,
                store_id: ok.store_id,
                reader,
            }),
        })
    }

    /// The hub URL this client is connected to.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The authenticated device.
    pub fn device(&self) -> DeviceId {
        self.inner.device
    }

    /// The hub's payload limit, as it announced it.
    pub fn max_payload(&self) -> u64 {
        self.inner.max_payload
    }

    /// The identity of the hub's store, as its `AuthOk` announced it. Another
    /// identity behind the same URL means another store: its delivery ids,
    /// heads and sequence numbers have nothing to do with this one's.
    pub fn store_id(&self) -> StoreId {
        self.inner.store_id
    }

    /// Whether the connection is still open.
    pub fn is_connected(&self) -> bool {
        lock(&self.inner.pending).is_some()
    }

    /// The channel of pushed frames. Returns `Some` once; later calls `None`.
    /// Read it promptly: when it is full, the connection stops reading,
    /// answers to requests included. So never wait for a request's answer
    /// (an `ack`, say) on the task that drains this channel: with more than
    /// [`ClientOptions::push_buffer`] pushes in between, the answer can
    /// never be read. Send such requests from another task.
    pub fn take_pushes(&self) -> Option<mpsc::Receiver<Push>> {
        lock(&self.inner.pushes).take()
    }

    /// Close the connection; waiting requests fail with `Disconnected`.
    pub fn close(&self) {
        self.inner.reader.abort();
        lock(&self.inner.pending).take();
        let tx = self.inner.tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Message::Close(None)).await;
        });
    }

    /// Send one request and wait for its answer.
    ///
    /// # Errors
    /// `Hub` with the hub's named error, `Timeout`, or `Disconnected`.
    ///
    /// # Cancel safety
    /// Cancel safe for the caller, but the request may still take effect at
    /// the hub: retry publishes with the same publish id.
    pub async fn request(&self, op: Request) -> Result<Response, ClientError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (done, answer) = oneshot::channel();
        match lock(&self.inner.pending).as_mut() {
            Some(m) => {
                m.insert(id, done);
            }
            None => {
                return Err(ClientError::NotSent {
                    reason: "the connection is closed",
                })
            }
        }
        let frame = ClientFrame::Request { id, op }.encode();
        let limit = self.inner.options.request_timeout;
        // Whether the frame reached the writer: before, a failure is
        // certain to have had no effect; after, it is unknown.
        let mut sent = false;
        let result = tokio::time::timeout(limit, async {
            self.inner
                .tx
                .send(Message::Binary(frame.into()))
                .await
                .map_err(|_| ClientError::NotSent {
                    reason: "the connection is closed",
                })?;
            sent = true;
            answer.await.map_err(|_| ClientError::Disconnected)
        })
        .await;
        let forget = || {
            if let Some(m) = lock(&self.inner.pending).as_mut() {
                m.remove(&id);
            }
        };
        match result {
            Ok(Ok(r)) => r.map_err(ClientError::Hub),
            Ok(Err(e)) => {
                forget();
                Err(e)
            }
            Err(_) if !sent => {
                forget();
                Err(ClientError::NotSent {
                    reason: "no room to send it before the request timeout",
                })
            }
            Err(_) => {
                forget();
                Err(ClientError::Timeout {
                    what: "request",
                    after: limit,
                })
            }
        }
    }

    /// Publish a frame. A lost compare-and-set or a duplicate is an `Ok`
    /// outcome; `Err` is kept for refusals and failures.
    ///
    /// # Errors
    /// As [`HubClient::request`]; `Hub(Conflict)` for a reused publish id.
    pub async fn publish(&self, p: Publish) -> Result<PublishOutcome, ClientError> {
        // Refuse here what the hub would refuse: a frame over its limit
        // cannot be tied back to this request, so it would only time out.
        let len = p.payload.len() as u64;
        if len > self.inner.max_payload {
            return Err(ClientError::Hub(HubError::PayloadTooLarge {
                len,
                max: self.inner.max_payload,
            }));
        }
        match self.request(Request::Publish(p)).await? {
            Response::Published(o) => Ok(o),
            other => Err(unexpected(other)),
        }
    }

    /// Read a topic's log after `after` (0 from the start), at most `limit`.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn fetch(
        &self,
        topic: &TopicId,
        after: u64,
        limit: u32,
    ) -> Result<FetchResult, ClientError> {
        match self
            .request(Request::Fetch {
                topic: topic.clone(),
                after,
                limit,
            })
            .await?
        {
            Response::Fetched(f) => Ok(f),
            other => Err(unexpected(other)),
        }
    }

    /// The head of a topic's log now (`None`: nothing was ever appended),
    /// durable at the hub. Reads no frame.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn head(&self, topic: &TopicId) -> Result<Option<u64>, ClientError> {
        // A fetch after the last possible sequence number returns no frame,
        // only the head (docs/protocol.md section 8).
        Ok(self.fetch(topic, u64::MAX, 1).await?.head)
    }

    /// Subscribe to a topic (durably).
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn subscribe(
        &self,
        topic: &TopicId,
        retention_secs: Option<u64>,
    ) -> Result<(), ClientError> {
        match self
            .request(Request::Subscribe {
                topic: topic.clone(),
                retention_secs,
            })
            .await?
        {
            Response::Subscribed => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Drop a subscription; answers whether one existed.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn unsubscribe(&self, topic: &TopicId) -> Result<bool, ClientError> {
        match self
            .request(Request::Unsubscribe {
                topic: topic.clone(),
            })
            .await?
        {
            Response::Unsubscribed { existed } => Ok(existed),
            other => Err(unexpected(other)),
        }
    }

    /// Apply many subscription changes in one request
    /// ([`Request::Subscriptions`], at most
    /// [`MAX_SUBSCRIPTION_CHANGES`](crate::wire::MAX_SUBSCRIPTION_CHANGES));
    /// answers one outcome per change, in order. A change the hub refused
    /// is [`ChangeOutcome::Refused`], not an error: the others stand.
    ///
    /// # Errors
    /// As [`HubClient::request`]; the hub refuses the whole request with
    /// `TooManyChanges` or `RateLimited`, and nothing changed.
    pub async fn change_subscriptions(
        &self,
        changes: Vec<SubscriptionChange>,
    ) -> Result<Vec<ChangeOutcome>, ClientError> {
        let count = changes.len();
        match self.request(Request::Subscriptions { changes }).await? {
            Response::SubscriptionsChanged { outcomes } if outcomes.len() == count => Ok(outcomes),
            Response::SubscriptionsChanged { outcomes } => Err(ClientError::Protocol(format!(
                "{} outcomes for {count} subscription changes",
                outcomes.len()
            ))),
            other => Err(unexpected(other)),
        }
    }

    /// Start (or replace) this device's receive stream; deliveries arrive
    /// on [`HubClient::take_pushes`]: for each subscription, every frame
    /// after the frames this device acknowledged there, then each new one.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn receive(&self) -> Result<(), ClientError> {
        match self.request(Request::Receive).await? {
            Response::ReceiveStarted => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Acknowledge pushed frames ([`Delivery::frame_ref`]); answers how many
    /// of them were pushed on this device's current receive stream and not
    /// acknowledged before. Acknowledged frames are not pushed again (but
    /// for a hub crash within moments of the ack).
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn ack(&self, frames: Vec<FrameRef>) -> Result<u32, ClientError> {
        match self.request(Request::Ack { frames }).await? {
            Response::Acked { removed } => Ok(removed),
            other => Err(unexpected(other)),
        }
    }

    /// Upload key packages (and optionally the last resort); answers the
    /// pool size.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn upload_key_packages(
        &self,
        packages: Vec<Vec<u8>>,
        last_resort: Option<Vec<u8>>,
    ) -> Result<u32, ClientError> {
        match self
            .request(Request::UploadKeyPackages {
                packages,
                last_resort,
            })
            .await?
        {
            Response::KeyPackagesStored { pool } => Ok(pool),
            other => Err(unexpected(other)),
        }
    }

    /// The SHA-256 of each of this device's pool packages on the hub, in
    /// claim order.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn list_key_packages(&self) -> Result<Vec<[u8; 32]>, ClientError> {
        match self.request(Request::ListKeyPackages).await? {
            Response::KeyPackageDigests { digests } => Ok(digests),
            other => Err(unexpected(other)),
        }
    }

    /// Replace this device's whole key package pool on the hub (and set
    /// the last resort when given); answers the pool size.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn replace_key_packages(
        &self,
        packages: Vec<Vec<u8>>,
        last_resort: Option<Vec<u8>>,
    ) -> Result<u32, ClientError> {
        match self
            .request(Request::ReplaceKeyPackages {
                packages,
                last_resort,
            })
            .await?
        {
            Response::KeyPackagesStored { pool } => Ok(pool),
            other => Err(unexpected(other)),
        }
    }

    /// Claim one key package of `device`: `(package, is_last_resort)`.
    ///
    /// # Errors
    /// As [`HubClient::request`]; `Hub(NoKeyPackage)` when none is left.
    pub async fn claim_key_package(
        &self,
        device: DeviceId,
    ) -> Result<(Vec<u8>, bool), ClientError> {
        match self.request(Request::ClaimKeyPackage { device }).await? {
            Response::KeyPackage {
                package,
                last_resort,
            } => Ok((package, last_resort)),
            other => Err(unexpected(other)),
        }
    }

    /// This device's pool size and whether it has a last resort.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn key_package_status(&self) -> Result<(u32, bool), ClientError> {
        match self.request(Request::KeyPackageStatus).await? {
            Response::KeyPackageStatus { pool, last_resort } => Ok((pool, last_resort)),
            other => Err(unexpected(other)),
        }
    }

    /// Round trip to the hub; answers its wall clock.
    ///
    /// # Errors
    /// As [`HubClient::request`].
    pub async fn ping(&self) -> Result<u64, ClientError> {
        match self.request(Request::Ping).await? {
            Response::Pong { server_time_ms } => Ok(server_time_ms),
            other => Err(unexpected(other)),
        }
    }
}

/// The device's answer to a hub's challenge: the newest version both
/// speak, signed for `url` (the URL the device meant to reach, not the
/// one the challenge names, so a hub cannot redirect a signature).
///
/// # Errors
/// [`ClientError::Version`] when the challenge's range shares no version
/// with this build's.
pub(crate) fn answer_challenge(
    challenge: &Challenge,
    url: &str,
    key: &SigningKey,
) -> Result<Auth, ClientError> {
    let version = PROTOCOL_VERSION.min(challenge.max_version);
    if version < challenge.min_version || version < MIN_PROTOCOL_VERSION {
        return Err(ClientError::Version {
            min: challenge.min_version,
            max: challenge.max_version,
            ours: PROTOCOL_VERSION,
        });
    }
    let signature = key
        .sign(&auth_message(
            &challenge.nonce,
            url,
            challenge.expires_at_ms,
        ))
        .to_bytes()
        .to_vec();
    Ok(Auth {
        version,
        device: DeviceId(key.verifying_key().to_bytes()),
        nonce: challenge.nonce,
        hub_url: url.to_string(),
        expires_at_ms: challenge.expires_at_ms,
        signature,
    })
}

fn unexpected(r: Response) -> ClientError {
    ClientError::Protocol(format!("unexpected answer {r:?}"))
}

async fn next_frame(
    source: &mut (impl futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
              + Unpin),
    max: usize,
) -> Result<ServerFrame, ClientError> {
    loop {
        match source.next().await {
            Some(Ok(Message::Binary(b))) => {
                return ServerFrame::decode(&b, max)
                    .map_err(|e| ClientError::Protocol(e.to_string()))
            }
            Some(Ok(Message::Close(c))) => {
                return Err(match c {
                    Some(c) => ClientError::Protocol(format!("hub closed: {}", c.reason)),
                    None => ClientError::Disconnected,
                })
            }
            Some(Ok(Message::Text(_))) => return Err(ClientError::Protocol("text frame".into())),
            Some(Ok(_)) => continue,
            Some(Err(_)) | None => return Err(ClientError::Disconnected),
        }
    }
}
