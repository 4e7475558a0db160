//! Injectable transports.
//!
//! Devices reach hubs through a [`Connector`] and hubs accept through a
//! [`Listener`], both yielding any `AsyncRead + AsyncWrite` stream. Production
//! uses TCP, with TLS for `wss://` ([`NetConnector`], [`TlsListener`]); the
//! simulation hands the same WebSocket code simulated TCP; an
//! in-process hub (a device's loopback hub) is reached through
//! [`memory_transport`], with no socket at all.

use futures::future::BoxFuture;
use std::borrow::Cow;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream};
use tokio::sync::mpsc;

mod tls;

pub use tls::{
    server_config, server_config_from_pem, CertificateDer, NetConnector, ServerConfig, TlsConfig,
    TlsListener, TlsSetupError, TlsStats,
};

/// A byte stream the WebSocket layer can run over.
pub trait ByteStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> ByteStream for T {}

/// A boxed [`ByteStream`].
pub type BoxStream = Box<dyn ByteStream>;

/// Opens a byte stream to the host named by a hub URL.
pub trait Connector: Send + Sync + 'static {
    /// Connect to `url`'s host and port.
    ///
    /// # Errors
    /// The I/O error of the connection attempt, or `InvalidInput` for a URL
    /// that names no host.
    fn connect(&self, url: &str) -> BoxFuture<'static, io::Result<BoxStream>>;
}

/// Accepts incoming byte streams for a hub.
pub trait Listener: Send + 'static {
    /// The next incoming connection and a printable peer address.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the hub selects on it against shutdown.
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(BoxStream, String)>>;
}

/// `host:port` of a `ws://host:port/path` or `wss://…` URL; without a port,
/// 80 for `ws://` and 443 for `wss://`. An IPv6 host keeps its brackets.
///
/// # Errors
/// `InvalidInput` when the URL has no `ws://` or `wss://` scheme, no host,
/// or a port that is not a number.
pub fn host_port(url: &str) -> io::Result<String> {
    Endpoint::parse(url).map(|ep| ep.host_port())
}

/// What a hub URL says about where to dial.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// `wss://`.
    pub(crate) tls: bool,
    /// The host, an IPv6 address without its brackets.
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl Endpoint {
    pub(crate) fn parse(url: &str) -> io::Result<Endpoint> {
        let bad =
            |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{what}: {url}"));
        let (tls, rest) = if let Some(rest) = url.strip_prefix("wss://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("ws://") {
            (false, rest)
        } else {
            return Err(bad("not a ws:// or wss:// URL"));
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => {
                let (host, after) = v6.split_once(']').ok_or_else(|| bad("unclosed [ in URL"))?;
                match after {
                    "" => (host, None),
                    _ => match after.strip_prefix(':') {
                        Some(port) => (host, Some(port)),
                        None => return Err(bad("junk after ] in URL")),
                    },
                }
            }
            None => match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            },
        };
        if host.is_empty() {
            return Err(bad("no host in URL"));
        }
        let port = match port {
            Some(p) => p.parse::<u16>().map_err(|_| bad("bad port in URL"))?,
            None if tls => 443,
            None => 80,
        };
        Ok(Endpoint {
            tls,
            host: host.to_string(),
            port,
        })
    }

    /// `host:port`, with brackets around an IPv6 host, for dialling.
    pub(crate) fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// The scheme of an in-process hub's URL (`loopback://<device hex>`).
///
/// Such a URL names no host: it is only ever reached through an in-memory
/// transport, never dialled. [`host_port`] refuses it, so a loopback URL
/// handed to [`TcpConnector`] fails with `InvalidInput` instead of leaving
/// the process.
pub const LOOPBACK_SCHEME: &str = "loopback://";

/// The URL the WebSocket handshake request names when connecting to hub
/// `url`.
///
/// A `ws://` or `wss://` URL is used as it is. The WebSocket client accepts
/// only those schemes, so a `loopback://X` URL is handshaken as
/// `ws://loopback.invalid/X` (`.invalid` is reserved and never resolves).
/// Only the handshake sees this form: authentication still signs, and the
/// hub still checks, the `loopback://` URL itself.
pub(crate) fn handshake_url(url: &str) -> Cow<'_, str> {
    match url.strip_prefix(LOOPBACK_SCHEME) {
        Some(rest) => Cow::Owned(format!("ws://loopback.invalid/{rest}")),
        None => Cow::Borrowed(url),
    }
}

/// The read buffer of each WebSocket connection. tungstenite's default
/// (128 KiB) is allocated for every connection up front, which made it
/// most of a hub's memory per idle device (the bench's memory pair: 138
/// KiB per idle device, 135 KiB per idle raw connection). Frames larger
/// than this still arrive whole: the buffer is only the unit of each read.
pub(crate) const WS_READ_BUFFER: usize = 8 * 1024;

/// WebSocket limits shared by the hub and the client: a message may be twice
/// the protocol's frame limit, so that an oversized frame still arrives and
/// gets a named `FrameTooLarge` answer instead of a dropped connection.
pub(crate) fn ws_config(
    max_frame: usize,
) -> tokio_tungstenite::tungstenite::protocol::WebSocketConfig {
    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(max_frame * 2))
        .max_frame_size(Some(max_frame * 2))
        .read_buffer_size(WS_READ_BUFFER)
}

/// Connects over real TCP, with no TLS even for a `wss://` URL and no
/// policy on plain `ws://`: for tests and tools that reach a plain hub.
/// Devices use [`NetConnector`].
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpConnector;

impl Connector for TcpConnector {
    fn connect(&self, url: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let target = host_port(url);
        Box::pin(async move {
            let stream = tokio::net::TcpStream::connect(target?).await?;
            stream.set_nodelay(true)?;
            Ok(Box::new(stream) as BoxStream)
        })
    }
}

/// Accepts over a real TCP listener.
pub struct TcpAcceptor {
    inner: tokio::net::TcpListener,
}

impl TcpAcceptor {
    /// Bind `addr` (use port 0 for a free port).
    ///
    /// # Errors
    /// The bind error, for example when the port is taken.
    pub async fn bind(addr: &str) -> io::Result<Self> {
        Ok(Self {
            inner: tokio::net::TcpListener::bind(addr).await?,
        })
    }

    /// The bound address.
    ///
    /// # Errors
    /// The OS error when the socket has no local address.
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

impl Listener for TcpAcceptor {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        Box::pin(async move {
            let (stream, peer) = self.inner.accept().await?;
            stream.set_nodelay(true)?;
            Ok((Box::new(stream) as BoxStream, peer.to_string()))
        })
    }
}

/// Bytes buffered in each direction of one in-memory connection; a writer
/// that gets this far ahead of its reader waits, as on a full socket.
pub const MEMORY_STREAM_BUFFER: usize = 256 * 1024;

/// Connections made but not yet accepted; a further `connect` waits for the
/// listener to accept one (a listen backlog).
const MEMORY_BACKLOG: usize = 64;

/// Make an in-memory transport: every [`MemoryConnector::connect`] yields
/// one end of a fresh [`tokio::io::duplex`] pair (each direction buffering
/// [`MEMORY_STREAM_BUFFER`] bytes) and hands the other end to
/// [`MemoryListener::accept`].
///
/// The connector ignores the URL it is given: it reaches its one listener.
/// Route URLs to it with a connector that looks at them.
pub fn memory_transport() -> (MemoryConnector, MemoryListener) {
    let (tx, rx) = mpsc::channel(MEMORY_BACKLOG);
    (
        MemoryConnector {
            tx,
            next: Arc::new(AtomicU64::new(1)),
        },
        MemoryListener { rx },
    )
}

/// The dialling side of a [`memory_transport`]. Clones reach the same
/// listener.
#[derive(Clone, Debug)]
pub struct MemoryConnector {
    tx: mpsc::Sender<(DuplexStream, u64)>,
    next: Arc<AtomicU64>,
}

impl MemoryConnector {
    /// Whether the listener is gone, so every connect is refused.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl Connector for MemoryConnector {
    /// Open a connection to this transport's listener; `url` is not looked at.
    ///
    /// Waits while 64 connections (the backlog) are queued and not yet
    /// accepted. A connection queued when the listener is dropped is closed
    /// (the dialler reads end of stream).
    ///
    /// # Errors
    /// `ConnectionRefused` once the [`MemoryListener`] is dropped, also while
    /// waiting for room in the backlog.
    fn connect(&self, _url: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let tx = self.tx.clone();
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            let (ours, theirs) = tokio::io::duplex(MEMORY_STREAM_BUFFER);
            tx.send((theirs, n)).await.map_err(|_| {
                io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    "the in-memory listener is gone",
                )
            })?;
            Ok(Box::new(ours) as BoxStream)
        })
    }
}

/// The accepting side of a [`memory_transport`]. Dropping it refuses every
/// later connect.
#[derive(Debug)]
pub struct MemoryListener {
    rx: mpsc::Receiver<(DuplexStream, u64)>,
}

impl Listener for MemoryListener {
    /// The next connection, with the peer address `memory:<n>` (`n` counts
    /// connects from 1).
    ///
    /// Once every [`MemoryConnector`] is dropped no connection can come:
    /// `accept` then stays pending forever rather than failing, as a socket
    /// nobody dials would.
    ///
    /// # Cancel safety
    /// Cancel safe: a connection is taken from the queue only when returned.
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        Box::pin(async move {
            match self.rx.recv().await {
                Some((stream, n)) => Ok((Box::new(stream) as BoxStream, format!("memory:{n}"))),
                None => std::future::pending().await,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn memory_transport_carries_bytes_both_ways() {
        let (connector, mut listener) = memory_transport();
        let mut client = connector.clone().connect("anything").await.unwrap();
        let (mut server, peer) = listener.accept().await.unwrap();
        assert_eq!(peer, "memory:1");
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        server.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        server.write_all(b"pong").await.unwrap();
        client.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong");
        let _second = connector.connect("x").await.unwrap();
        assert_eq!(listener.accept().await.unwrap().1, "memory:2");
    }

    #[tokio::test]
    async fn memory_connect_after_listener_dropped_is_refused() {
        let (connector, listener) = memory_transport();
        drop(listener);
        assert!(connector.is_closed());
        let err = match connector.connect("x").await {
            Ok(_) => panic!("connect to a dropped listener must fail"),
            Err(e) => e,
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
    }

    #[tokio::test]
    async fn memory_connect_waiting_on_a_full_backlog_is_refused_when_listener_drops() {
        let (connector, listener) = memory_transport();
        let mut queued = Vec::new();
        for _ in 0..MEMORY_BACKLOG {
            queued.push(connector.connect("x").await.unwrap());
        }
        let waiting = tokio::spawn(connector.connect("x"));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "a full backlog makes connect wait");
        drop(listener);
        let err = match waiting.await.unwrap() {
            Ok(_) => panic!("the waiting connect must be refused"),
            Err(e) => e,
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        // A connection that was queued but never accepted reads end of stream.
        let mut buf = [0u8; 1];
        assert_eq!(queued[0].read(&mut buf).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn memory_accept_waits_when_every_connector_is_gone() {
        let (connector, mut listener) = memory_transport();
        drop(connector);
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(20), listener.accept()).await;
        assert!(waited.is_err(), "accept must pend, not fail or spin");
    }

    #[test]
    fn handshake_url_rewrites_only_loopback_urls() {
        assert_eq!(handshake_url("ws://127.0.0.1:7400"), "ws://127.0.0.1:7400");
        assert_eq!(handshake_url("wss://hub.example/x"), "wss://hub.example/x");
        assert_eq!(
            handshake_url("loopback://ab12"),
            "ws://loopback.invalid/ab12"
        );
        assert!(host_port("loopback://ab12").is_err());
    }

    #[test]
    fn host_port_parses_ws_urls() {
        assert_eq!(host_port("ws://127.0.0.1:7400").unwrap(), "127.0.0.1:7400");
        assert_eq!(host_port("ws://hub.example/x").unwrap(), "hub.example:80");
        assert!(host_port("http://x").is_err());
        assert!(host_port("ws:///x").is_err());
    }

    #[test]
    fn host_port_defaults_wss_to_443_and_keeps_ipv6_brackets() {
        assert_eq!(host_port("wss://hub.example").unwrap(), "hub.example:443");
        assert_eq!(
            host_port("wss://hub.example:8443/p?q").unwrap(),
            "hub.example:8443"
        );
        assert_eq!(host_port("ws://[::1]:7400/x").unwrap(), "[::1]:7400");
        assert_eq!(host_port("wss://[::1]").unwrap(), "[::1]:443");
        let ep = Endpoint::parse("wss://[::1]:9").unwrap();
        assert_eq!((ep.tls, ep.host.as_str(), ep.port), (true, "::1", 9));
        assert!(host_port("ws://[::1").is_err());
        assert!(host_port("ws://[::1]x").is_err());
        assert!(host_port("ws://host:port").is_err());
        assert!(host_port("ws://:80").is_err());
    }
}
