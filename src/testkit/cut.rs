//! Connections broken on demand, as a network failure breaks them.
//!
//! A [`CutConnector`] dials through any [`Connector`] and hands out streams
//! that a [`CutSwitch`] can break all at once: after [`CutSwitch::cut`],
//! every read and write of a stream opened before it fails
//! (`ConnectionReset`, `BrokenPipe`), a read waiting for bytes included, so
//! the device sees a dead connection at once, drops it (the socket closes
//! and the hub sees it go) and dials again. Streams opened after the cut
//! work. Nothing is held back or replayed: what was in flight is lost, as
//! on a real reset.

use crate::transport::{BoxStream, Connector};
use futures::future::BoxFuture;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Breaks every stream its [`CutConnector`]s opened so far.
#[derive(Default)]
pub struct CutSwitch {
    /// Bumped by every cut; a stream opened at an older one is broken.
    generation: AtomicU64,
    /// The live streams' wakers, to wake a read that waits for bytes.
    /// Entries of dropped streams are pruned at every open and every cut,
    /// so this holds about as many entries as there are live streams.
    streams: Mutex<Vec<Weak<Mutex<Option<Waker>>>>>,
}

impl CutSwitch {
    /// A switch that has cut nothing yet.
    pub fn new() -> Arc<CutSwitch> {
        Arc::new(CutSwitch::default())
    }

    /// Break every stream opened before now. Answers how many live
    /// streams there were to break.
    pub fn cut(&self) -> usize {
        self.generation.fetch_add(1, Ordering::SeqCst);
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        streams.retain(|w| w.strong_count() > 0);
        for w in streams.iter().filter_map(Weak::upgrade) {
            if let Some(waker) = w.lock().unwrap_or_else(|p| p.into_inner()).take() {
                waker.wake();
            }
        }
        streams.len()
    }

    /// How many cuts there were.
    pub fn cuts(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    fn register(&self) -> (u64, Arc<Mutex<Option<Waker>>>) {
        let slot = Arc::new(Mutex::new(None));
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(&slot));
        // Read under the lock, so a cut either sees this stream or comes
        // after its generation was taken.
        (self.generation.load(Ordering::SeqCst), slot)
    }
}

/// A connector whose streams a [`CutSwitch`] breaks.
pub struct CutConnector {
    inner: Arc<dyn Connector>,
    switch: Arc<CutSwitch>,
}

impl CutConnector {
    /// Dial through `inner`; `switch` breaks what was dialled.
    pub fn new(inner: Arc<dyn Connector>, switch: Arc<CutSwitch>) -> Self {
        Self { inner, switch }
    }
}

impl Connector for CutConnector {
    fn connect(&self, url: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let fut = self.inner.connect(url);
        let switch = self.switch.clone();
        Box::pin(async move {
            let inner = fut.await?;
            let (born, waker) = switch.register();
            Ok(Box::new(CutStream {
                inner,
                switch,
                born,
                waker,
            }) as BoxStream)
        })
    }
}

struct CutStream {
    inner: BoxStream,
    switch: Arc<CutSwitch>,
    born: u64,
    waker: Arc<Mutex<Option<Waker>>>,
}

impl CutStream {
    fn is_cut(&self) -> bool {
        self.switch.generation.load(Ordering::SeqCst) != self.born
    }
}

impl AsyncRead for CutStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.is_cut() {
            return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
        }
        *self.waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
        // Cut between the check and the registration: the cut found no
        // waker to wake, so look again.
        if self.is_cut() {
            return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CutStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.is_cut() {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.is_cut() {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A broken connection has nothing left to close politely.
        if self.is_cut() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::TcpConnector;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_cut_breaks_a_waiting_read_and_later_streams_work() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}", listener.local_addr().unwrap());
        let accept = tokio::spawn(async move {
            let mut peers = Vec::new();
            for _ in 0..2 {
                peers.push(listener.accept().await.unwrap().0);
            }
            peers
        });
        let switch = CutSwitch::new();
        let c = CutConnector::new(Arc::new(TcpConnector), switch.clone());
        let mut old = c.connect(&url).await.unwrap();
        let waiting = tokio::spawn(async move {
            let mut b = [0u8; 1];
            let r = old.read(&mut b).await;
            (r.map_err(|e| e.kind()), old)
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(switch.cut(), 1);
        let (read, mut old) = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the waiting read was not woken by the cut")
            .unwrap();
        assert_eq!(read.unwrap_err(), io::ErrorKind::ConnectionReset);
        assert!(old.write_all(b"x").await.is_err());

        let mut new = c.connect(&url).await.unwrap();
        let mut peers = accept.await.unwrap();
        peers[1].write_all(b"y").await.unwrap();
        let mut b = [0u8; 1];
        new.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"y");
        assert_eq!(switch.cuts(), 1);
        drop(old);
        // The dropped stream's entry is pruned: one live stream is cut.
        assert_eq!(switch.cut(), 1);
    }
}
