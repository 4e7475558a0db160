//! The raw baselines: plain tokio-tungstenite servers doing the least that
//! the hub's work includes (carrying the same bytes over the same kind of
//! connection), so a hubsync figure divided by its baseline's says what the
//! hub adds.

use futures::{SinkExt, StreamExt};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;

/// A client connection to a raw server.
pub type RawSocket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// The first message a client sends a [`BroadcastServer`]: it publishes.
pub const ROLE_PUBLISHER: &[u8] = b"pub";
/// The first message a client sends a [`BroadcastServer`]: it subscribes.
pub const ROLE_SUBSCRIBER: &[u8] = b"sub";

/// Frames buffered per subscriber before the server stops reading the
/// publisher (backpressure rather than loss, as the hub does).
const SUBSCRIBER_BUFFER: usize = 1024;

/// A WebSocket server on loopback that sends every binary message back.
pub struct EchoServer {
    addr: SocketAddr,
    stop: CancellationToken,
}

impl EchoServer {
    /// Listen on a free loopback port.
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn start() -> std::io::Result<Self> {
        let (addr, stop) = accept_each(|stream, stop| async move {
            let _ = stream.set_nodelay(true);
            let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                return;
            };
            loop {
                let msg = tokio::select! {
                    _ = stop.cancelled() => return,
                    m = ws.next() => m,
                };
                match msg {
                    Some(Ok(m @ Message::Binary(_))) => {
                        if ws.send(m).await.is_err() {
                            return;
                        }
                    }
                    Some(Ok(_)) => {}
                    _ => return,
                }
            }
        })
        .await?;
        Ok(Self { addr, stop })
    }

    /// The `ws://` URL to dial.
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A WebSocket server on loopback that sends every binary message a
/// publisher sends to every subscriber connected at that time, in order,
/// waiting (not dropping) when a subscriber is behind.
pub struct BroadcastServer {
    addr: SocketAddr,
    stop: CancellationToken,
}

type Subscribers = Arc<Mutex<Vec<mpsc::Sender<Message>>>>;

impl BroadcastServer {
    /// Listen on a free loopback port.
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn start() -> std::io::Result<Self> {
        let subscribers: Subscribers = Arc::new(Mutex::new(Vec::new()));
        let (addr, stop) =
            accept_each(move |stream, stop| serve_broadcast(stream, subscribers.clone(), stop))
                .await?;
        Ok(Self { addr, stop })
    }

    /// The `ws://` URL to dial.
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }
}

impl Drop for BroadcastServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Listen on a free loopback port and run `serve` on its own task for every
/// connection, until the returned token is cancelled.
async fn accept_each<F, Fut>(serve: F) -> std::io::Result<(SocketAddr, CancellationToken)>
where
    F: Fn(TcpStream, CancellationToken) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                _ = s.cancelled() => return,
                a = listener.accept() => match a {
                    Ok((stream, _)) => stream,
                    Err(_) => continue,
                },
            };
            tokio::spawn(serve(stream, s.clone()));
        }
    });
    Ok((addr, stop))
}

async fn serve_broadcast(stream: TcpStream, subscribers: Subscribers, stop: CancellationToken) {
    let _ = stream.set_nodelay(true);
    let Ok(ws) = tokio_tungstenite::accept_async(stream).await else {
        return;
    };
    let (mut tx, mut rx) = ws.split();
    let role = match rx.next().await {
        Some(Ok(Message::Binary(b))) => b,
        _ => return,
    };
    if role.as_ref() == ROLE_SUBSCRIBER {
        let (sender, mut queue) = mpsc::channel::<Message>(SUBSCRIBER_BUFFER);
        subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(sender);
        // Tell the subscriber it is registered, so the publisher can wait.
        if tx.send(Message::binary(ROLE_SUBSCRIBER)).await.is_err() {
            return;
        }
        loop {
            let m = tokio::select! {
                _ = stop.cancelled() => return,
                m = queue.recv() => m,
            };
            match m {
                Some(m) => {
                    if tx.send(m).await.is_err() {
                        return;
                    }
                }
                None => return,
            }
        }
    }
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return,
            m = rx.next() => m,
        };
        let m = match msg {
            Some(Ok(m @ Message::Binary(_))) => m,
            Some(Ok(_)) => continue,
            _ => return,
        };
        let targets: Vec<mpsc::Sender<Message>> = subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|s| !s.is_closed())
            .cloned()
            .collect();
        for t in targets {
            let _ = t.send(m.clone()).await;
        }
    }
}

/// Dial a raw server.
///
/// # Errors
/// When the connection or the WebSocket handshake fails.
pub async fn dial(url: &str) -> Result<RawSocket, String> {
    let (ws, _) = tokio_tungstenite::connect_async(url)
        .await
        .map_err(|e| format!("dial {url}: {e}"))?;
    if let MaybeTlsStream::Plain(s) = ws.get_ref() {
        let _ = s.set_nodelay(true);
    }
    Ok(ws)
}
