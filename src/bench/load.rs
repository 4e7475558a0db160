//! The measured work, one function per side of each pair. Each runs for
//! one slice of time and answers what it did in it; the runner alternates
//! the two sides of a pair so both see the same machine.

use super::raw::{self, RawSocket, ROLE_SUBSCRIBER};
use crate::client::{HubClient, Push};
use crate::wire::{ExpectedHead, Publish, PublishId, PublishOutcome, RetentionClass, TopicId};
use futures::{SinkExt, StreamExt};
use rand::RngCore;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::Message;

/// Publishes one fan-out publisher keeps waiting for the hub's answer.
const PUBLISH_WINDOW: usize = 64;
/// The longest a slice waits for its subscribers to catch up afterwards.
const DRAIN_LIMIT: Duration = Duration::from_secs(20);

/// What one side did in one slice.
#[derive(Clone, Debug, Default)]
pub struct Slice {
    /// Operations completed inside the slice.
    pub ops: u64,
    /// The slice's length in seconds.
    pub secs: f64,
    /// The latency of each completed operation, in microseconds (empty
    /// where the work has none).
    pub latencies_us: Vec<u64>,
}

/// A fresh ordinary topic (neither a mailbox nor writer-bound).
fn fresh_topic() -> TopicId {
    let mut t = vec![0u8; 32];
    rand::thread_rng().fill_bytes(&mut t);
    t[0] = 0x03;
    TopicId(t)
}

fn fresh_id() -> PublishId {
    let mut id = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut id);
    PublishId(id)
}

fn log_publish(topic: &TopicId, expected_head: ExpectedHead, payload: &[u8]) -> Publish {
    Publish {
        topic: topic.clone(),
        publish_id: fresh_id(),
        class: RetentionClass::Log,
        expected_head,
        replay_only: false,
        retention_secs: None,
        payload: payload.to_vec(),
        writer: None,
    }
}

/// Compare-and-set publishes: each client appends to its own fresh topic,
/// one publish at a time, each naming the head its previous one made, for
/// `len`. Latency is publish to `Accepted` (which the hub sends only once
/// the frame is durable).
///
/// # Errors
/// Any refusal or lost compare-and-set (nobody else writes these topics).
pub async fn cas_publishes(
    clients: &[HubClient],
    payload: usize,
    len: Duration,
) -> Result<Slice, String> {
    let body = vec![0x5a; payload];
    let start = Instant::now();
    let deadline = start + len;
    let mut tasks = JoinSet::new();
    for c in clients {
        let c = c.clone();
        let body = body.clone();
        tasks.spawn(async move {
            let topic = fresh_topic();
            let mut head = ExpectedHead::Empty;
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let t0 = Instant::now();
                match c.publish(log_publish(&topic, head, &body)).await {
                    Ok(PublishOutcome::Accepted { seq, .. }) => head = ExpectedHead::Seq(seq),
                    Ok(other) => return Err(format!("publish answered {other:?}")),
                    Err(e) => return Err(format!("publish failed: {e}")),
                }
                lat.push(t0.elapsed().as_micros() as u64);
            }
            Ok(lat)
        });
    }
    let mut slice = Slice::default();
    while let Some(r) = tasks.join_next().await {
        let lat = r.map_err(|e| e.to_string())??;
        slice.ops += lat.len() as u64;
        slice.latencies_us.extend(lat);
    }
    slice.secs = start.elapsed().as_secs_f64();
    Ok(slice)
}

/// The baseline of [`cas_publishes`]: each socket sends `payload` bytes to
/// an echo server and waits for them back, one at a time, for `len`.
///
/// # Errors
/// When a socket fails.
pub async fn echo_round_trips(
    sockets: &mut [RawSocket],
    payload: usize,
    len: Duration,
) -> Result<Slice, String> {
    let body = vec![0x5a; payload];
    let start = Instant::now();
    let deadline = start + len;
    let runs = sockets.iter_mut().map(|ws| {
        let body = body.clone();
        async move {
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let t0 = Instant::now();
                ws.send(Message::binary(body.clone()))
                    .await
                    .map_err(|e| e.to_string())?;
                loop {
                    match ws.next().await {
                        Some(Ok(Message::Binary(_))) => break,
                        Some(Ok(_)) => continue,
                        Some(Err(e)) => return Err(e.to_string()),
                        None => return Err("echo server closed".to_string()),
                    }
                }
                lat.push(t0.elapsed().as_micros() as u64);
            }
            Ok::<_, String>(lat)
        }
    });
    let mut slice = Slice::default();
    for lat in futures::future::join_all(runs).await {
        let lat = lat?;
        slice.ops += lat.len() as u64;
        slice.latencies_us.extend(lat);
    }
    slice.secs = start.elapsed().as_secs_f64();
    Ok(slice)
}

/// Hub subscribers that count what they are delivered on the current
/// slice's topic and acknowledge everything.
pub struct HubSubscribers {
    clients: Vec<HubClient>,
    state: Arc<Counting>,
    tasks: JoinSet<()>,
}

/// Delivery ids waiting for their ack.
#[derive(Default)]
struct PendingAcks {
    ids: Mutex<Vec<crate::wire::FrameRef>>,
    ready: tokio::sync::Notify,
}

/// Ids per ack request (the hub's default limit is 1,000).
const ACK_BATCH: usize = 500;

#[derive(Default)]
struct Counting {
    topic: Mutex<Option<TopicId>>,
    delivered: AtomicU64,
}

impl HubSubscribers {
    /// Start a receive stream on each client and count its deliveries.
    ///
    /// # Errors
    /// When a receive stream cannot be started.
    pub async fn start(clients: Vec<HubClient>) -> Result<Self, String> {
        let state = Arc::new(Counting::default());
        let mut tasks = JoinSet::new();
        for c in &clients {
            let mut pushes = c
                .take_pushes()
                .ok_or_else(|| "pushes already taken".to_string())?;
            c.receive().await.map_err(|e| e.to_string())?;
            // Acks go from their own task: the client stops reading its
            // connection (answers included) while its push buffer is full,
            // so a reader that waited for an ack's answer before draining
            // more pushes could wait forever.
            let acks = Arc::new(PendingAcks::default());
            let (c2, a2) = (c.clone(), acks.clone());
            tasks.spawn(async move {
                loop {
                    a2.ready.notified().await;
                    loop {
                        let batch: Vec<crate::wire::FrameRef> = {
                            let mut ids = a2.ids.lock().unwrap_or_else(|p| p.into_inner());
                            let n = ids.len().min(ACK_BATCH);
                            ids.drain(..n).collect()
                        };
                        if batch.is_empty() {
                            break;
                        }
                        if c2.ack(batch).await.is_err() {
                            return;
                        }
                    }
                }
            });
            let state = state.clone();
            tasks.spawn(async move {
                while let Some(p) = pushes.recv().await {
                    if let Push::Delivery(d) = p {
                        let current = state
                            .topic
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .as_ref()
                            == Some(&d.topic);
                        if current {
                            state.delivered.fetch_add(1, Ordering::Relaxed);
                        }
                        acks.ids
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(d.frame_ref());
                        acks.ready.notify_one();
                    }
                }
            });
        }
        Ok(Self {
            clients,
            state,
            tasks,
        })
    }

    /// Move every subscriber to a fresh topic and reset the count.
    async fn follow(&self, topic: &TopicId) -> Result<(), String> {
        let old = self
            .state
            .topic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(topic.clone());
        for c in &self.clients {
            if let Some(old) = &old {
                c.unsubscribe(old).await.map_err(|e| e.to_string())?;
            }
            c.subscribe(topic, None).await.map_err(|e| e.to_string())?;
        }
        self.state.delivered.store(0, Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for HubSubscribers {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

/// Fan-out through the hub: `publisher` publishes `payload`-byte frames
/// unconditionally on a fresh topic every subscriber follows, keeping
/// [`PUBLISH_WINDOW`] publishes outstanding, for `len`; counts deliveries
/// the subscribers received inside the slice, then waits for the rest so
/// the next slice starts clean.
///
/// # Errors
/// A refused publish, or subscribers that never catch up.
pub async fn hub_fanout(
    publisher: &HubClient,
    subs: &HubSubscribers,
    payload: usize,
    len: Duration,
) -> Result<Slice, String> {
    let topic = fresh_topic();
    subs.follow(&topic).await?;
    let body = vec![0x5a; payload];
    let start = Instant::now();
    let deadline = start + len;
    let mut inflight = JoinSet::new();
    let mut published = 0u64;
    while Instant::now() < deadline {
        while inflight.len() < PUBLISH_WINDOW {
            let c = publisher.clone();
            let p = log_publish(&topic, ExpectedHead::Unconditional, &body);
            inflight.spawn(async move { c.publish(p).await });
        }
        if let Some(r) = inflight.join_next().await {
            match r.map_err(|e| e.to_string())? {
                Ok(PublishOutcome::Accepted { .. }) => published += 1,
                Ok(other) => return Err(format!("publish answered {other:?}")),
                Err(e) => return Err(format!("publish failed: {e}")),
            }
        }
    }
    let ops = subs.state.delivered.load(Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    while let Some(r) = inflight.join_next().await {
        if let Ok(Ok(PublishOutcome::Accepted { .. })) = r {
            published += 1;
        }
    }
    let want = published * subs.clients.len() as u64;
    let drained = Instant::now();
    while subs.state.delivered.load(Ordering::Relaxed) < want {
        if drained.elapsed() > DRAIN_LIMIT {
            return Err(format!(
                "subscribers received {} of {want} deliveries",
                subs.state.delivered.load(Ordering::Relaxed)
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Slice {
        ops,
        secs,
        latencies_us: Vec::new(),
    })
}

/// Raw subscribers of a [`raw::BroadcastServer`] that count what they get.
pub struct RawSubscribers {
    delivered: Arc<AtomicU64>,
    count: usize,
    tasks: JoinSet<()>,
}

impl RawSubscribers {
    /// Dial `n` subscribers and wait until the server has registered each.
    ///
    /// # Errors
    /// When a subscriber cannot connect.
    pub async fn start(url: &str, n: usize) -> Result<Self, String> {
        let delivered = Arc::new(AtomicU64::new(0));
        let mut tasks = JoinSet::new();
        for _ in 0..n {
            let mut ws = raw::dial(url).await?;
            ws.send(Message::binary(ROLE_SUBSCRIBER))
                .await
                .map_err(|e| e.to_string())?;
            match ws.next().await {
                Some(Ok(Message::Binary(_))) => {}
                other => return Err(format!("subscriber not registered: {other:?}")),
            }
            let d = delivered.clone();
            tasks.spawn(async move {
                while let Some(Ok(m)) = ws.next().await {
                    if matches!(m, Message::Binary(_)) {
                        d.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        Ok(Self {
            delivered,
            count: n,
            tasks,
        })
    }
}

impl Drop for RawSubscribers {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

/// The baseline of [`hub_fanout`]: `publisher` streams `payload`-byte frames
/// to a broadcast server for `len`; counts the subscribers' receipts inside
/// the slice, then waits for the rest.
///
/// # Errors
/// When a socket fails or subscribers never catch up.
pub async fn raw_fanout(
    publisher: &mut RawSocket,
    subs: &RawSubscribers,
    payload: usize,
    len: Duration,
) -> Result<Slice, String> {
    let body = vec![0x5a; payload];
    let base = subs.delivered.load(Ordering::Relaxed);
    let start = Instant::now();
    let deadline = start + len;
    let mut sent = 0u64;
    while Instant::now() < deadline {
        publisher
            .send(Message::binary(body.clone()))
            .await
            .map_err(|e| e.to_string())?;
        sent += 1;
    }
    let ops = subs.delivered.load(Ordering::Relaxed) - base;
    let secs = start.elapsed().as_secs_f64();
    let want = base + sent * subs.count as u64;
    let drained = Instant::now();
    while subs.delivered.load(Ordering::Relaxed) < want {
        if drained.elapsed() > DRAIN_LIMIT {
            return Err("raw subscribers never caught up".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Slice {
        ops,
        secs,
        latencies_us: Vec::new(),
    })
}
