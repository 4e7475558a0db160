//! Injectable transports.
//!
//! Devices reach hubs through a [`Connector`] and hubs accept through a
//! [`Listener`], both yielding any `AsyncRead + AsyncWrite` stream. Production
//! uses TCP; the simulation hands the same WebSocket code simulated TCP.

use futures::future::BoxFuture;
use std::io;
use tokio::io::{AsyncRead, AsyncWrite};

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

/// `host:port` of a `ws://host:port/path` URL.
///
/// # Errors
/// `InvalidInput` when the URL has no `ws://` or `wss://` scheme or no host.
pub fn host_port(url: &str) -> io::Result<String> {
    let rest = url
        .strip_prefix("ws://")
        .or_else(|| url.strip_prefix("wss://"))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("not a ws:// URL: {url}"),
            )
        })?;
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("no host in URL: {url}"),
        ));
    }
    if authority.contains(':') {
        Ok(authority.to_string())
    } else {
        Ok(format!("{authority}:80"))
    }
}

/// WebSocket limits shared by the hub and the client: a message may be twice
/// the protocol's frame limit, so that an oversized frame still arrives and
/// gets a named `FrameTooLarge` answer instead of a dropped connection.
pub(crate) fn ws_config(
    max_frame: usize,
) -> tokio_tungstenite::tungstenite::protocol::WebSocketConfig {
    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(max_frame * 2))
        .max_frame_size(Some(max_frame * 2))
}

/// Connects over real TCP.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_parses_ws_urls() {
        assert_eq!(host_port("ws://127.0.0.1:7400").unwrap(), "127.0.0.1:7400");
        assert_eq!(host_port("ws://hub.example/x").unwrap(), "hub.example:80");
        assert!(host_port("http://x").is_err());
        assert!(host_port("ws:///x").is_err());
    }
}
