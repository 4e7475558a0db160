//! Group commit: one flush covers every write applied while the previous
//! flush ran.
//!
//! Every batch the hub applies gets a generation number. A caller that must
//! not answer before its batch is durable waits for its generation; the
//! flusher task flushes whenever someone waits, and each flush covers every
//! generation applied before it started. So a hub under load flushes as often
//! as the disk allows, not once per publish.

use crate::kv::KvStore;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{watch, Notify};

/// What the flusher has made durable so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FlushState {
    /// Every generation up to this is durable.
    durable: u64,
    /// Generations up to this were covered by a failed flush.
    failed_through: u64,
    /// The last failure.
    error: Option<String>,
}

/// The group-commit coordinator of one store.
pub(crate) struct GroupCommit {
    applied: AtomicU64,
    wake: Notify,
    state: watch::Sender<FlushState>,
    flushes: AtomicU64,
}

impl GroupCommit {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            applied: AtomicU64::new(0),
            wake: Notify::new(),
            state: watch::Sender::new(FlushState::default()),
            flushes: AtomicU64::new(0),
        })
    }

    /// Record one more applied batch and return its generation. Call it
    /// under the same lock that orders the batches.
    pub(crate) fn applied(&self) -> u64 {
        self.applied.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The newest generation applied.
    pub(crate) fn current(&self) -> u64 {
        self.applied.load(Ordering::SeqCst)
    }

    /// How many flushes ran.
    pub(crate) fn flush_count(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    /// Wait until generation `gen` is durable.
    ///
    /// # Errors
    /// The store's error text when the flush covering `gen` failed.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future only stops waiting.
    pub(crate) async fn durable(&self, gen: u64) -> Result<(), String> {
        let mut rx = self.state.subscribe();
        loop {
            {
                let s = rx.borrow_and_update();
                if s.durable >= gen {
                    return Ok(());
                }
                if s.failed_through >= gen {
                    return Err(s.error.clone().unwrap_or_default());
                }
            }
            // Notify keeps one permit, so a wake sent while the flusher is
            // busy makes it run once more: no wake-up is lost.
            self.wake.notify_one();
            if rx.changed().await.is_err() {
                return Err("hub stopped".into());
            }
        }
    }

    /// Flush until nothing applied is left unflushed, then return. Runs on the
    /// caller's task (used at shutdown and by the flusher loop).
    ///
    /// # Errors
    /// The engine's error text when the flush failed (also recorded for
    /// every waiter it covered).
    pub(crate) async fn flush_now(&self, store: &Arc<dyn KvStore>) -> Result<(), String> {
        let target = self.current();
        if self.state.borrow().durable >= target {
            return Ok(());
        }
        let result = if store.flush_blocks() {
            let s = store.clone();
            match tokio::task::spawn_blocking(move || s.flush()).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(e) => Err(format!("flush task failed: {e}")),
            }
        } else {
            store.flush().map_err(|e| e.to_string())
        };
        self.flushes.fetch_add(1, Ordering::Relaxed);
        self.state.send_modify(|s| match &result {
            Ok(()) => s.durable = s.durable.max(target),
            Err(e) => {
                tracing::error!(error = %e, "store flush failed");
                s.failed_through = s.failed_through.max(target);
                s.error = Some(e.clone());
            }
        });
        result
    }

    /// The flusher loop: flush whenever a waiter asks. Runs until cancelled.
    pub(crate) async fn run(self: Arc<Self>, store: Arc<dyn KvStore>) {
        loop {
            self.wake.notified().await;
            // A failure reaches every waiter the flush covered; the next
            // wait tries again.
            let _ = self.flush_now(&store).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{MemKv, WriteBatch};

    #[tokio::test]
    async fn one_flush_covers_many_waiters() {
        let kv = MemKv::new();
        let store: Arc<dyn KvStore> = Arc::new(kv.clone());
        let gc = GroupCommit::new();
        let mut gens = Vec::new();
        for i in 0..10u8 {
            let mut b = WriteBatch::new();
            b.put(vec![i], vec![i]);
            store.apply(&b).unwrap();
            gens.push(gc.applied());
        }
        let task = tokio::spawn(gc.clone().run(store.clone()));
        let waits: Vec<_> = gens.iter().map(|g| gc.durable(*g)).collect();
        for r in futures::future::join_all(waits).await {
            r.unwrap();
        }
        assert_eq!(kv.unflushed_batches(), 0);
        assert!(gc.flush_count() <= 2, "flushes: {}", gc.flush_count());
        task.abort();
    }
}
