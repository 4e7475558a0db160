//! The hub's store: transactions over ordered keys, each one atomic,
//! isolated from the others, and durable once its generation is.
//!
//! [`HubCore`](super::HubCore) does every change as one transaction: it
//! reads what the change depends on (for a publish, the topic's view:
//! its idempotency record and head), decides with the pure rules of
//! [`rules`](super::rules), stages the writes, and commits. The store
//! promises what makes that correct whoever else runs at the same time:
//!
//! - **Isolated.** A transaction that commits saw nothing another
//!   transaction committed after it began: either the store runs
//!   transactions one at a time, or it answers [`StoreError::Conflict`] at
//!   commit and writes nothing, and the core runs the change again on a new
//!   transaction. This is what makes the compare-and-set on a topic's head
//!   atomic: two publishes that both read head 7 cannot both commit.
//! - **Atomic.** A commit lands whole or not at all, also across a crash.
//!   Dropping a transaction without committing writes nothing.
//! - **Durable when told.** A commit answers a generation; once
//!   [`HubStore::durable`] returns for it, the commit (and every commit
//!   before it) survives a crash of the process. The hub answers nothing and
//!   pushes no delivery before that.
//! - **Reads see the store as the transaction found it**, not its own staged
//!   writes (the core never needs to read back what it wrote).
//!
//! [`KvHubStore`] keeps these promises over any [`KvStore`] (sled, or the
//! simulation's crash-semantics store) for one process: one transaction at a
//! time under an async lock, one atomic batch per commit, and group commit
//! (one flush covers every commit made while the previous flush ran). A store
//! shared by several hub processes keeps them with the database's own
//! transactions instead.

use super::announce::Remote;
use super::flush::GroupCommit;
use super::layout as l;
use crate::kv::{Entries, KvError, KvStore, WriteBatch};
use crate::rng::SharedRng;
use crate::wire::{DeviceId, StoreId, TopicId};
use futures::future::BoxFuture;
use futures::FutureExt;
use std::sync::Arc;

/// Why a store operation failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// Another transaction committed something this one read: nothing of
    /// this one was written. Run the change again on a new transaction.
    #[error("transaction conflicted with another; nothing was written")]
    Conflict,
    /// The storage engine failed; what was being done may or may not have
    /// been written (a commit never half-lands). Not worth retrying at once.
    #[error(transparent)]
    Engine(#[from] KvError),
    /// A flush covering this generation failed, so it is not known to be
    /// durable; the text is the engine's.
    #[error("store flush failed: {0}")]
    Flush(String),
}

/// A generation number: commits are numbered in order, and a generation is
/// durable once every commit up to it is.
pub type Generation = u64;

/// One transaction: reads of the store as it began, staged writes, and one
/// commit. Dropping it without committing writes nothing.
pub trait HubTxn: Send {
    /// The value under `key`, or `None`.
    ///
    /// # Errors
    /// [`StoreError::Engine`] when the engine failed.
    fn get<'a>(&'a mut self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>>;

    /// The values under each of `keys`, in the same order. The default
    /// reads them one by one; a store a round trip away reads them at once.
    ///
    /// # Errors
    /// [`StoreError::Engine`] when the engine failed.
    fn get_many<'a>(
        &'a mut self,
        keys: &'a [Vec<u8>],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
        async move {
            let mut out = Vec::with_capacity(keys.len());
            for k in keys {
                out.push(self.get(k).await?);
            }
            Ok(out)
        }
        .boxed()
    }

    /// Up to `limit` entries with `start <= key < end` (no upper bound when
    /// `end` is `None`), in ascending key order.
    ///
    /// # Errors
    /// [`StoreError::Engine`] when the engine failed.
    fn range<'a>(
        &'a mut self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>>;

    /// Stage `key = value` (a later put or delete of the same key wins).
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>);

    /// Stage the removal of `key`.
    fn delete(&mut self, key: Vec<u8>);

    /// When (and only if) this transaction commits, tell every other hub
    /// process on this store that frame `seq` of `topic` is durable for
    /// `recipients` ([`announce`](super::announce)). A store no other
    /// process shares has nobody to tell: the default does nothing.
    fn announce(&mut self, _topic: &TopicId, _seq: u64, _recipients: &[DeviceId]) {}

    /// Apply every staged write as one atomic step and answer the
    /// generation to wait for before telling anyone (a transaction that
    /// staged nothing answers the newest generation, so what it read is
    /// durable when that is).
    ///
    /// # Errors
    /// [`StoreError::Conflict`] (nothing written: run the change again) or
    /// [`StoreError::Engine`].
    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<Generation, StoreError>>;
}

/// The hub's storage: see the [module docs](self) for what every
/// implementation promises.
pub trait HubStore: Send + Sync + 'static {
    /// The store's identity, fixed when the store was first created: the
    /// same for every hub process over this store, different for another.
    fn store_id(&self) -> StoreId;

    /// Begin a transaction. It may wait for others to finish.
    ///
    /// # Errors
    /// [`StoreError::Engine`] when the store cannot start one.
    fn begin(&self) -> BoxFuture<'_, Result<Box<dyn HubTxn>, StoreError>>;

    /// Read `key` outside any transaction: what is committed now, durable
    /// or not. For bulk reads whose consistency a transaction already
    /// established (the frames below a head it read).
    ///
    /// # Errors
    /// [`StoreError::Engine`].
    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>>;

    /// [`HubStore::get`]'s range read.
    ///
    /// # Errors
    /// [`StoreError::Engine`].
    fn range<'a>(
        &'a self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>>;

    /// Wait until generation `gen` is durable.
    ///
    /// # Errors
    /// [`StoreError::Flush`] when the flush covering it failed.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future only stops waiting.
    fn durable(&self, gen: Generation) -> BoxFuture<'_, Result<(), StoreError>>;

    /// The store's own background work (for [`KvHubStore`], the group-commit
    /// flusher), which the hub runs as a task until it stops.
    fn background(&self) -> BoxFuture<'static, ()>;

    /// Make everything committed so far durable (at shutdown).
    ///
    /// # Errors
    /// [`StoreError::Flush`].
    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>>;

    /// How many flushes (or database commits) made data durable, for
    /// operators comparing it with accepted publishes.
    fn flushes(&self) -> u64;

    /// What other hub processes on this store announce
    /// ([`HubTxn::announce`]), from now on, on a bounded queue; `None` (the
    /// default) for a store no other process shares. The hub calls it once,
    /// at start, and wakes its receive streams with what arrives.
    fn announcements(&self) -> Option<tokio::sync::mpsc::Receiver<Remote>> {
        None
    }

    /// Announcements this store received that were not announcements
    /// (always 0 for a store no other process shares).
    fn bad_announcements(&self) -> u64 {
        0
    }

    /// Bytes the store's data takes, when the store can say (for
    /// operators; sampled now and then, so it may be a little old).
    ///
    /// # Errors
    /// [`StoreError::Engine`] when asking failed.
    fn size_bytes(&self) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        futures::future::ready(Ok(None)).boxed()
    }
}

/// A [`HubStore`] over a [`KvStore`], for one hub process: transactions run
/// one at a time under an async lock, each commit is one atomic batch, and a
/// flusher task makes batches durable in groups.
pub struct KvHubStore {
    kv: Arc<dyn KvStore>,
    id: StoreId,
    lock: Arc<tokio::sync::Mutex<()>>,
    commit: Arc<GroupCommit>,
}

impl KvHubStore {
    /// A hub store over `kv` (which may hold a previous run's state). Reads
    /// the store's identity, or, in a store that has none, draws one from
    /// `rng`, writes it and flushes (one blocking flush) before returning,
    /// so no answer is ever tied to an identity a crash could take back.
    ///
    /// # Errors
    /// The engine's error when the identity cannot be read, written or
    /// flushed, and [`KvError::Corrupt`] when the stored one is not 16 bytes.
    pub fn open(kv: Arc<dyn KvStore>, rng: &SharedRng) -> Result<Arc<Self>, KvError> {
        let key = l::store_id();
        let id = match kv.get(&key)? {
            Some(bytes) => {
                let id: [u8; 16] = bytes.as_slice().try_into().map_err(|_| KvError::Corrupt {
                    key: hex::encode(&key),
                    reason: format!("a store identity is 16 bytes, found {}", bytes.len()),
                })?;
                StoreId(id)
            }
            None => {
                let mut id = [0u8; 16];
                rng.fill(&mut id);
                let mut batch = WriteBatch::new();
                batch.put(key, id.to_vec());
                kv.apply(&batch)?;
                kv.flush()?;
                tracing::info!(store_id = %StoreId(id), "new hub store: identity created");
                StoreId(id)
            }
        };
        Ok(Arc::new(Self {
            kv,
            id,
            lock: Arc::new(tokio::sync::Mutex::new(())),
            commit: GroupCommit::new(),
        }))
    }
}

struct KvTxn {
    kv: Arc<dyn KvStore>,
    commit: Arc<GroupCommit>,
    batch: WriteBatch,
    // Held until the transaction commits or is dropped: no other
    // transaction reads or writes in between.
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

impl HubTxn for KvTxn {
    fn get<'a>(&'a mut self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        futures::future::ready(self.kv.get(key).map_err(StoreError::from)).boxed()
    }

    fn range<'a>(
        &'a mut self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>> {
        futures::future::ready(self.kv.range(start, end, limit).map_err(StoreError::from)).boxed()
    }

    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.batch.put(key, value);
    }

    fn delete(&mut self, key: Vec<u8>) {
        self.batch.delete(key);
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<Generation, StoreError>> {
        // The generation is taken while the turn is still held, so
        // generations follow the order the batches were applied in.
        let result = if self.batch.is_empty() {
            Ok(self.commit.current())
        } else {
            self.kv
                .apply(&self.batch)
                .map(|()| self.commit.applied())
                .map_err(StoreError::from)
        };
        futures::future::ready(result).boxed()
    }
}

impl HubStore for KvHubStore {
    fn store_id(&self) -> StoreId {
        self.id
    }

    fn begin(&self) -> BoxFuture<'_, Result<Box<dyn HubTxn>, StoreError>> {
        async move {
            let turn = self.lock.clone().lock_owned().await;
            let txn: Box<dyn HubTxn> = Box::new(KvTxn {
                kv: self.kv.clone(),
                commit: self.commit.clone(),
                batch: WriteBatch::new(),
                _turn: turn,
            });
            Ok(txn)
        }
        .boxed()
    }

    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        futures::future::ready(self.kv.get(key).map_err(StoreError::from)).boxed()
    }

    fn range<'a>(
        &'a self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>> {
        futures::future::ready(self.kv.range(start, end, limit).map_err(StoreError::from)).boxed()
    }

    fn durable(&self, gen: Generation) -> BoxFuture<'_, Result<(), StoreError>> {
        async move { self.commit.durable(gen).await.map_err(StoreError::Flush) }.boxed()
    }

    fn background(&self) -> BoxFuture<'static, ()> {
        self.commit.clone().run(self.kv.clone()).boxed()
    }

    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        async move {
            self.commit
                .flush_now(&self.kv)
                .await
                .map_err(StoreError::Flush)
        }
        .boxed()
    }

    fn flushes(&self) -> u64 {
        self.commit.flush_count()
    }

    fn size_bytes(&self) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        futures::future::ready(Ok(self.kv.size_on_disk())).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemKv;

    fn store(kv: &MemKv) -> Arc<KvHubStore> {
        KvHubStore::open(Arc::new(kv.clone()), &SharedRng::seeded(3)).expect("MemKv opens")
    }

    #[tokio::test]
    async fn a_dropped_transaction_writes_nothing_and_a_commit_writes_all() {
        let kv = MemKv::new();
        let s = store(&kv);
        let mut t = s.begin().await.unwrap();
        t.put(b"a".to_vec(), b"1".to_vec());
        drop(t);
        assert_eq!(s.get(b"a").await.unwrap(), None);
        let mut t = s.begin().await.unwrap();
        t.put(b"a".to_vec(), b"1".to_vec());
        t.put(b"b".to_vec(), b"2".to_vec());
        // Its own staged writes are not what it reads.
        assert_eq!(t.get(b"a").await.unwrap(), None);
        let gen = t.commit().await.unwrap();
        assert_eq!(s.range(b"a", None, 10).await.unwrap().len(), 2);
        let flusher = tokio::spawn(s.background());
        s.durable(gen).await.unwrap();
        assert_eq!(kv.unflushed_batches(), 0);
        flusher.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn transactions_take_turns() {
        let kv = MemKv::new();
        let s = store(&kv);
        let first = s.begin().await.unwrap();
        // A second transaction cannot begin while the first is open.
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), s.begin()).await;
        assert!(
            waiting.is_err(),
            "a second transaction began while the first was open"
        );
        first.commit().await.unwrap();
        let second = tokio::time::timeout(std::time::Duration::from_secs(5), s.begin()).await;
        assert!(second.is_ok(), "the turn was not handed on after a commit");
    }

    #[tokio::test]
    async fn the_identity_outlives_the_store_handle() {
        let kv = MemKv::new();
        let a = store(&kv).store_id();
        let other = KvHubStore::open(Arc::new(kv.clone()), &SharedRng::seeded(99)).unwrap();
        assert_eq!(other.store_id(), a);
        assert_ne!(store(&MemKv::new()).store_id(), StoreId([0; 16]));
    }
}
