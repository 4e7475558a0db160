//! `HubDirectory`: the device's view of every hub it knows.
//!
//! One [`HubInfo`] per hub URL: the link's last status, when the hub was
//! last connected and last seen alive, the protocol version spoken, and the
//! last connection error. Entries are kept up to date by watching each
//! link's status ([`HubDirectory::track`]), persisted in a [`KvStore`] under
//! the `dir/` prefix (serde_json values) so they survive a restart, and
//! served from memory with a freshness flag: an answer is **fresh** when the
//! hub was seen alive within the TTL. A stale answer is still served: the
//! directory never forgets a hub because it went away.
//!
//! "Seen alive" means connected: the watcher refreshes `last_seen_ms` every
//! half TTL while the link stays connected, and stops when it drops. A hub
//! never reached counts as seen when it was first recorded.
//!
//! Status transitions are flushed to the store; the periodic refreshes of
//! `last_seen_ms` are applied without a flush (losing one to a crash only
//! makes the entry look older).
//!
//! Time comes from the injected [`Clock`]; the refresh timer is tokio's.

use crate::clock::Clock;
use crate::device::link::{HubLink, LinkStatus};
use crate::kv::{KvError, KvStore, WriteBatch};
use crate::wire::PROTOCOL_VERSION;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Key prefix of the directory's entries in the store.
pub const KEY_PREFIX: &[u8] = b"dir/";
/// Shortest refresh interval of a connected hub's `last_seen_ms`.
const MIN_REFRESH: Duration = Duration::from_millis(50);

/// A hub's link status as the directory keeps it (a serializable
/// [`LinkStatus`] without the per-attempt details).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HubState {
    /// The first connection attempt was under way.
    Connecting,
    /// Connected.
    Connected,
    /// Connection lost or failing; `attempt` was the next attempt's number.
    Reconnecting {
        /// The attempt number the link reported.
        attempt: u32,
    },
    /// The link was stopped (the device closed it); says nothing about the
    /// hub itself.
    Stopped,
}

impl From<&LinkStatus> for HubState {
    fn from(s: &LinkStatus) -> Self {
        match s {
            LinkStatus::Connecting => HubState::Connecting,
            LinkStatus::Connected => HubState::Connected,
            LinkStatus::Reconnecting { attempt, .. } => {
                HubState::Reconnecting { attempt: *attempt }
            }
            LinkStatus::Stopped => HubState::Stopped,
        }
    }
}

/// What the device knows about one hub.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HubInfo {
    /// The hub URL (without a trailing `/`).
    pub url: String,
    /// The link's last observed status. After a restart this is the status
    /// before the restart: check freshness before trusting it.
    pub status: HubState,
    /// Wall-clock ms when the most recent connection was established.
    pub last_connected_ms: Option<u64>,
    /// Wall-clock ms when the hub was last seen alive (connected), or when
    /// the directory first learned of it if it was never reached.
    pub last_seen_ms: u64,
    /// The protocol version of the last successful connection. The client
    /// does not report the version the hub agreed to, so this is this
    /// build's [`PROTOCOL_VERSION`], recorded on each successful connection
    /// (the client refuses a hub that cannot speak a version it speaks).
    pub protocol_version: Option<u16>,
    /// The most recent connection error, kept after a later success
    /// (`status` says whether it is current).
    pub last_error: Option<String>,
}

/// The device's directory of hubs. Cheap to clone; clones share one view.
#[derive(Clone)]
pub struct HubDirectory {
    inner: Arc<DirInner>,
}

struct DirInner {
    store: Arc<dyn KvStore>,
    clock: Clock,
    ttl: Duration,
    cache: Mutex<BTreeMap<String, HubInfo>>,
    watchers: Mutex<BTreeMap<String, CancellationToken>>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl Drop for DirInner {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each critical section is a single map operation: nothing half-done.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn key(url: &str) -> Vec<u8> {
    let mut k = KEY_PREFIX.to_vec();
    k.extend_from_slice(url.as_bytes());
    k
}

fn normalize(url: &str) -> &str {
    url.trim_end_matches('/')
}

impl std::fmt::Debug for HubDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubDirectory")
            .field("ttl", &self.inner.ttl)
            .field("hubs", &lock(&self.inner.cache).len())
            .finish()
    }
}

impl HubDirectory {
    /// Open the directory over `store`, loading every entry saved under
    /// [`KEY_PREFIX`]. An entry that does not decode is skipped with a
    /// warning (the directory is a cache; the next observation rewrites
    /// it). `ttl` is how long a hub counts as fresh after it was last seen
    /// alive.
    ///
    /// # Errors
    /// The store's error when it cannot be read.
    pub fn open(store: Arc<dyn KvStore>, clock: Clock, ttl: Duration) -> Result<Self, KvError> {
        let mut cache = BTreeMap::new();
        for (k, v) in store.scan_prefix(KEY_PREFIX, usize::MAX)? {
            match serde_json::from_slice::<HubInfo>(&v) {
                Ok(info) => {
                    cache.insert(info.url.clone(), info);
                }
                Err(e) => tracing::warn!(
                    key = %String::from_utf8_lossy(&k),
                    error = %e,
                    "skipping an unreadable hub directory entry"
                ),
            }
        }
        Ok(Self {
            inner: Arc::new(DirInner {
                store,
                clock,
                ttl,
                cache: Mutex::new(cache),
                watchers: Mutex::new(BTreeMap::new()),
                cancel: CancellationToken::new(),
                tasks: TaskTracker::new(),
            }),
        })
    }

    /// How long an entry stays fresh after its hub was last seen alive.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// The last known info of `url` and whether it is fresh (the hub was
    /// seen alive within the TTL). Served even when stale or when the hub
    /// is unreachable; `None` only for a hub never recorded.
    pub fn info(&self, url: &str) -> Option<(HubInfo, bool)> {
        let info = lock(&self.inner.cache).get(normalize(url)).cloned()?;
        let fresh = self.is_fresh(&info);
        Some((info, fresh))
    }

    /// Every known hub, in URL order.
    pub fn list(&self) -> Vec<HubInfo> {
        lock(&self.inner.cache).values().cloned().collect()
    }

    fn is_fresh(&self, info: &HubInfo) -> bool {
        let age = self.inner.clock.now_ms().saturating_sub(info.last_seen_ms);
        u128::from(age) <= self.inner.ttl.as_millis()
    }

    /// Record that `url`'s link reported `status`, persist the entry and
    /// flush the store. Answers the updated entry.
    ///
    /// On `Connected`: `last_seen_ms` is now, `last_connected_ms` too if the
    /// link was not connected before, and the protocol version is recorded.
    /// On leaving `Connected`: `last_seen_ms` is now (alive until then). On
    /// `Reconnecting`: its error becomes `last_error`.
    ///
    /// # Errors
    /// The store's error; the in-memory entry is updated regardless.
    pub fn observe(&self, url: &str, status: &LinkStatus) -> Result<HubInfo, KvError> {
        let (info, _) = self.update(url, status)?;
        self.inner.store.flush()?;
        Ok(info)
    }

    /// Apply an observation: update the cache and write the entry (not
    /// flushed). Answers the entry and whether the status changed.
    fn update(&self, url: &str, status: &LinkStatus) -> Result<(HubInfo, bool), KvError> {
        let url = normalize(url);
        let now = self.inner.clock.now_ms();
        let mut cache = lock(&self.inner.cache);
        let info = cache.entry(url.to_string()).or_insert_with(|| HubInfo {
            url: url.to_string(),
            status: HubState::from(status),
            last_connected_ms: None,
            last_seen_ms: now,
            protocol_version: None,
            last_error: None,
        });
        let was_connected = info.status == HubState::Connected;
        let new_state = HubState::from(status);
        let changed = info.status != new_state;
        match status {
            LinkStatus::Connected => {
                if !was_connected || info.last_connected_ms.is_none() {
                    info.last_connected_ms = Some(now);
                }
                info.last_seen_ms = now;
                info.protocol_version = Some(PROTOCOL_VERSION);
            }
            LinkStatus::Reconnecting { last_error, .. } => {
                if was_connected {
                    info.last_seen_ms = now;
                }
                info.last_error = Some(last_error.clone());
            }
            LinkStatus::Connecting | LinkStatus::Stopped => {
                if was_connected {
                    info.last_seen_ms = now;
                }
            }
        }
        info.status = new_state;
        let info = info.clone();
        // Written under the cache lock, so the store sees updates in the
        // order the cache does.
        let mut batch = WriteBatch::new();
        let value = serde_json::to_vec(&info).map_err(|e| KvError::Engine(e.to_string()))?;
        batch.put(key(url), value);
        self.inner.store.apply(&batch)?;
        drop(cache);
        Ok((info, changed))
    }

    /// Observe from the watcher: transitions are flushed (on a blocking
    /// thread when the store's flush blocks), refreshes only applied.
    async fn observe_async(&self, url: &str, status: &LinkStatus) {
        match self.update(url, status) {
            Ok((_, true)) => {
                let store = self.inner.store.clone();
                let flushed = if store.flush_blocks() {
                    tokio::task::spawn_blocking(move || store.flush())
                        .await
                        .unwrap_or_else(|e| Err(KvError::Engine(e.to_string())))
                } else {
                    store.flush()
                };
                if let Err(e) = flushed {
                    tracing::warn!(url, error = %e, "hub directory flush failed");
                }
            }
            Ok((_, false)) => {}
            Err(e) => tracing::warn!(url, error = %e, "hub directory write failed"),
        }
    }

    /// Keep `link`'s entry up to date: spawns a watcher that records every
    /// status change and refreshes `last_seen_ms` every half TTL while
    /// connected, until the link stops, [`HubDirectory::stop`] is called,
    /// or the directory is dropped. Tracking a URL again replaces its
    /// previous watcher.
    ///
    /// Must be called inside a tokio runtime.
    pub fn track(&self, link: &HubLink) {
        let url = link.url().to_string();
        let mut rx = link.status();
        let token = self.inner.cancel.child_token();
        if let Some(old) = lock(&self.inner.watchers).insert(url.clone(), token.clone()) {
            old.cancel();
        }
        let weak: Weak<DirInner> = Arc::downgrade(&self.inner);
        let refresh = (self.inner.ttl / 2).max(MIN_REFRESH);
        self.inner.tasks.spawn(async move {
            loop {
                let status = rx.borrow_and_update().clone();
                {
                    let Some(inner) = weak.upgrade() else {
                        return;
                    };
                    HubDirectory { inner }.observe_async(&url, &status).await;
                }
                if status == LinkStatus::Stopped {
                    return;
                }
                let connected = status == LinkStatus::Connected;
                tokio::select! {
                    _ = token.cancelled() => return,
                    r = rx.changed() => if r.is_err() { return },
                    _ = tokio::time::sleep(refresh), if connected => {}
                }
            }
        });
    }

    /// Forget `url`: stop watching it and delete its entry. Answers whether
    /// there was one.
    ///
    /// # Errors
    /// The store's error.
    pub fn forget(&self, url: &str) -> Result<bool, KvError> {
        let url = normalize(url);
        if let Some(t) = lock(&self.inner.watchers).remove(url) {
            t.cancel();
        }
        let mut cache = lock(&self.inner.cache);
        let existed = cache.remove(url).is_some();
        let mut batch = WriteBatch::new();
        batch.delete(key(url));
        self.inner.store.apply(&batch)?;
        drop(cache);
        self.inner.store.flush()?;
        Ok(existed)
    }

    /// End every watcher and wait for them. Entries stay readable.
    ///
    /// # Cancel safety
    /// Cancel safe: the watchers end regardless; only the join is
    /// abandoned.
    pub async fn stop(&self) {
        self.inner.cancel.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemKv;

    fn reconnecting(err: &str) -> LinkStatus {
        LinkStatus::Reconnecting {
            attempt: 1,
            retry_in: Duration::from_millis(250),
            last_error: err.to_string(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn keeps_a_lost_hub_marks_it_stale_and_reloads_it() {
        let kv = MemKv::new();
        let store: Arc<dyn KvStore> = Arc::new(kv.clone());
        let clock = Clock::tokio(1_000_000);
        let dir =
            HubDirectory::open(store.clone(), clock.clone(), Duration::from_secs(60)).unwrap();
        let url = "ws://hub.example:7400";

        dir.observe(url, &LinkStatus::Connecting).unwrap();
        let (info, fresh) = dir.info(url).unwrap();
        assert!(fresh);
        assert_eq!(info.last_connected_ms, None);
        assert_eq!(info.protocol_version, None);

        tokio::time::advance(Duration::from_secs(1)).await;
        dir.observe(&format!("{url}/"), &LinkStatus::Connected)
            .unwrap();
        let (info, _) = dir.info(url).unwrap();
        assert_eq!(info.status, HubState::Connected);
        assert_eq!(info.last_connected_ms, Some(1_001_000));
        assert_eq!(info.protocol_version, Some(PROTOCOL_VERSION));

        tokio::time::advance(Duration::from_secs(10)).await;
        dir.observe(url, &reconnecting("connection refused"))
            .unwrap();
        let (info, fresh) = dir.info(url).unwrap();
        assert!(fresh);
        assert_eq!(info.last_seen_ms, 1_011_000, "alive until it dropped");
        assert_eq!(info.last_connected_ms, Some(1_001_000));
        assert_eq!(info.last_error.as_deref(), Some("connection refused"));

        // Retries that keep failing do not make it look alive.
        tokio::time::advance(Duration::from_secs(59)).await;
        dir.observe(url, &reconnecting("still refused")).unwrap();
        assert!(dir.info(url).unwrap().1, "60 s since last seen");
        tokio::time::advance(Duration::from_secs(2)).await;
        let (stale, fresh) = dir.info(url).unwrap();
        assert!(!fresh, "stale after the TTL, still served");
        assert_eq!(stale.last_error.as_deref(), Some("still refused"));

        // Survives a crash (transitions are flushed) and a reload.
        kv.crash();
        let again = HubDirectory::open(store, clock, Duration::from_secs(60)).unwrap();
        assert_eq!(again.info(url), Some((stale.clone(), false)));
        assert_eq!(again.list(), vec![stale]);
        assert_eq!(again.info("ws://other:1"), None);
    }

    #[tokio::test]
    async fn skips_unreadable_entries_and_forgets() {
        let kv = MemKv::new();
        let mut b = WriteBatch::new();
        b.put(key("ws://bad:1"), b"not json".to_vec());
        kv.apply(&b).unwrap();
        let store: Arc<dyn KvStore> = Arc::new(kv.clone());
        let dir =
            HubDirectory::open(store.clone(), Clock::tokio(0), Duration::from_secs(1)).unwrap();
        assert!(dir.list().is_empty());
        dir.observe("ws://good:1", &LinkStatus::Connected).unwrap();
        assert_eq!(dir.list().len(), 1);
        assert!(dir.forget("ws://good:1").unwrap());
        assert!(!dir.forget("ws://good:1").unwrap());
        let again = HubDirectory::open(store, Clock::tokio(0), Duration::from_secs(1)).unwrap();
        assert!(again.list().is_empty());
    }
}
