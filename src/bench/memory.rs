//! Pair (f): the hub's memory per idle connected device, against a raw
//! tokio-tungstenite server's per idle connection.
//!
//! Both servers run as processes of their own (this binary's `hub` and its
//! hidden `bench-raw-server`), so what is read is theirs alone: the
//! resident set (`VmRSS` in `/proc/<pid>/status`) after one connection and
//! after `n` more, divided by `n`. A hub device is idle the way a real
//! one is between messages: authenticated, subscribed to its Welcome topic,
//! with its receive stream open. A raw connection is open and has echoed
//! one frame.

use crate::client::{ClientOptions, HubClient};
use crate::process::ChildServer;
use crate::testkit::signing_key;
use crate::transport::NetConnector;
use crate::wire::TopicId;
use futures::{SinkExt, StreamExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

/// Connections opened at once while filling a server: below the hub's
/// default `max_unauthenticated` (256), so none is refused for that.
const CONNECT_AT_ONCE: usize = 128;

/// How long a server has to settle (allocator, buffers) before a reading.
const SETTLE: Duration = Duration::from_millis(500);

/// Resident bytes a server added per connection, once `n` connections
/// beyond a first are idle.
#[derive(Clone, Copy, Debug)]
pub struct PerConnection {
    /// Resident bytes added per connection beyond the first.
    pub bytes_per_connection: f64,
}

fn per_connection(base: u64, after: u64, n: usize) -> PerConnection {
    PerConnection {
        bytes_per_connection: after.saturating_sub(base) as f64 / n.max(1) as f64,
    }
}

/// This binary's `hub` over a fresh store in a temporary directory, with
/// rate limits that never trigger (the bench measures the work, not the
/// limiter). Answers the directory, the process and the store's path.
async fn start_hub(exe: &Path) -> Result<(tempfile::TempDir, ChildServer, PathBuf), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let data = dir.path().join("hub");
    let arg = data.to_string_lossy().into_owned();
    let fast = "1000000000";
    let hub = ChildServer::start(
        exe,
        &[
            "hub",
            "--listen",
            "127.0.0.1:0",
            "--data",
            &arg,
            "--device-rate",
            fast,
            "--device-burst",
            fast,
            "--topic-rate",
            fast,
            "--topic-burst",
            fast,
            "--claimer-rate",
            fast,
            "--claimer-burst",
            fast,
            "--target-rate",
            fast,
            "--target-burst",
            fast,
        ],
    )
    .await?;
    Ok((dir, hub, data))
}

/// Bytes the files under `dir` take on disk (allocated blocks, not
/// apparent lengths: sled's files are sparse).
fn disk_bytes(dir: &Path) -> Result<u64, String> {
    use std::os::unix::fs::MetadataExt as _;
    let mut total = 0u64;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let entry = entry.map_err(|e| e.to_string())?;
            let meta = entry.metadata().map_err(|e| e.to_string())?;
            if meta.is_dir() {
                todo.push(entry.path());
            } else {
                total += meta.blocks() * 512;
            }
        }
    }
    Ok(total)
}

/// What one more group costs a hub.
#[derive(Clone, Copy, Debug)]
pub struct PerGroup {
    /// Resident bytes added per group.
    pub memory_bytes: f64,
    /// Store bytes on disk added per group.
    pub disk_bytes: f64,
}

/// The hub's memory and disk per group: `members` devices on this
/// binary's `hub` form one group (the devices' own connections are then
/// counted once, before), then `groups` more, each with `messages`
/// messages sent in it; the growth of the hub's resident set and of its
/// store on disk, divided by `groups`.
///
/// # Errors
/// When the hub cannot be started or a group cannot be formed.
pub async fn hub_per_group(
    exe: &Path,
    groups: usize,
    members: usize,
    messages: usize,
) -> Result<PerGroup, String> {
    let (_dir, hub, data) = start_hub(exe).await?;
    let url = format!("ws://{}", hub.addr);
    let g = super::app::HubGroup::form_at(
        &url,
        std::sync::Arc::new(NetConnector::default()),
        members.max(2),
    )
    .await?;
    tokio::time::sleep(SETTLE).await;
    let (mem0, disk0) = (hub.rss()?, disk_bytes(&data)?);
    let body = vec![0x5au8; 256];
    for _ in 0..groups {
        let group = g.form_group().await?;
        for _ in 0..messages {
            g.sender()
                .send(group, &body)
                .await
                .map_err(|e| format!("send: {e}"))?;
        }
    }
    // What was sent is owed until the hub has it: wait for the outbox.
    while g.sender().manager().outbox().owed() > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(SETTLE).await;
    let (mem1, disk1) = (hub.rss()?, disk_bytes(&data)?);
    g.close().await;
    let n = groups.max(1) as f64;
    Ok(PerGroup {
        memory_bytes: mem1.saturating_sub(mem0) as f64 / n,
        disk_bytes: disk1.saturating_sub(disk0) as f64 / n,
    })
}

/// The hub side: this binary's `hub` with `n` idle devices connected.
///
/// # Errors
/// When the hub cannot be started or a device cannot connect.
pub async fn hub_per_device(exe: &Path, n: usize) -> Result<PerConnection, String> {
    let (_dir, hub, _) = start_hub(exe).await?;
    let url = format!("ws://{}", hub.addr);
    let connector = NetConnector::default();
    let connect = |i: u64| {
        let (url, connector) = (url.clone(), connector.clone());
        async move {
            let key = signing_key(1_000_000 + i);
            let c = HubClient::connect(&connector, &url, &key, ClientOptions::default())
                .await
                .map_err(|e| format!("device {i}: {e}"))?;
            let welcome = TopicId::mailbox(&c.device());
            c.subscribe(&welcome, None)
                .await
                .map_err(|e| format!("device {i} subscribe: {e}"))?;
            c.receive()
                .await
                .map_err(|e| format!("device {i} receive: {e}"))?;
            Ok::<_, String>(c)
        }
    };
    let first = connect(0).await?;
    tokio::time::sleep(SETTLE).await;
    let base = hub.rss()?;
    let mut devices = Vec::with_capacity(n);
    let mut next = 1u64;
    while devices.len() < n {
        let batch = (n - devices.len()).min(CONNECT_AT_ONCE);
        let opened =
            futures::future::try_join_all((0..batch as u64).map(|k| connect(next + k))).await?;
        next += batch as u64;
        devices.extend(opened);
    }
    tokio::time::sleep(SETTLE).await;
    let after = hub.rss()?;
    for d in devices.iter().chain(std::iter::once(&first)) {
        d.close();
    }
    drop(hub);
    Ok(per_connection(base, after, n))
}

/// The baseline: this binary's `bench-raw-server` with `n` idle WebSocket
/// connections, each having echoed one frame.
///
/// # Errors
/// When the server cannot be started or a connection fails.
pub async fn raw_per_connection(exe: &Path, n: usize) -> Result<PerConnection, String> {
    let server = ChildServer::start(exe, &["bench-raw-server"]).await?;
    let url = format!("ws://{}", server.addr);
    let connect = |_: usize| {
        let url = url.clone();
        async move {
            let mut ws = super::raw::dial(&url).await?;
            ws.send(Message::binary(vec![1u8; 64]))
                .await
                .map_err(|e| e.to_string())?;
            match ws.next().await {
                Some(Ok(Message::Binary(_))) => Ok(ws),
                other => Err(format!("no echo: {other:?}")),
            }
        }
    };
    let first = connect(0).await?;
    tokio::time::sleep(SETTLE).await;
    let base = server.rss()?;
    let mut sockets = Vec::with_capacity(n);
    while sockets.len() < n {
        let batch = (n - sockets.len()).min(CONNECT_AT_ONCE);
        sockets.extend(futures::future::try_join_all((0..batch).map(connect)).await?);
    }
    tokio::time::sleep(SETTLE).await;
    let after = server.rss()?;
    drop(sockets);
    drop(first);
    drop(server);
    Ok(per_connection(base, after, n))
}
