//! The real WebSocket code over turmoil's simulated TCP.

use futures::future::BoxFuture;
use hubsync::transport::{host_port, BoxStream, Connector, Listener};
use std::io;

/// Reaches hubs over simulated TCP (`ws://hub0:7400` resolves in the sim).
#[derive(Clone, Copy, Debug, Default)]
pub struct SimConnector;

impl Connector for SimConnector {
    fn connect(&self, url: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let target = host_port(url);
        Box::pin(async move {
            let stream = turmoil::net::TcpStream::connect(target?).await?;
            Ok(Box::new(stream) as BoxStream)
        })
    }
}

/// Accepts hub connections over simulated TCP.
pub struct SimListener(pub turmoil::net::TcpListener);

impl Listener for SimListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        Box::pin(async move {
            let (s, peer) = self.0.accept().await?;
            Ok((Box::new(s) as BoxStream, peer.to_string()))
        })
    }
}
