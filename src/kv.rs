//! The one storage trait behind every persistent part of hubsync.
//!
//! The hub's store and the device's store are both ordered key-value maps with
//! atomic batches and an explicit flush. Keeping the trait this small is what
//! lets the simulation swap sled for [`MemKv`], whose crash semantics are
//! explicit: a simulated crash loses exactly the batches that no flush covered.
//! Sled flushes on drop and locks its files, so it cannot play that part.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Key-value pairs in key order, as range reads return them.
pub type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// A failure of the storage engine itself (disk, corruption, a poisoned lock).
///
/// Never used for "not found": a missing key is `Ok(None)`.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    /// The underlying engine reported an error; the text is its own.
    #[error("storage engine failed: {0}")]
    Engine(String),
    /// A stored value could not be decoded: the store is corrupt or was written
    /// by an incompatible version.
    #[error("stored value under {key} is unreadable: {reason}")]
    Corrupt {
        /// Hex of the key whose value failed to decode.
        key: String,
        /// What the decoder said.
        reason: String,
    },
}

impl From<sled::Error> for KvError {
    fn from(e: sled::Error) -> Self {
        KvError::Engine(e.to_string())
    }
}

/// A set of writes applied all together or not at all.
///
/// Later operations on the same key win over earlier ones.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WriteBatch {
    ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

impl WriteBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stage `key = value`.
    pub fn put(&mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        self.ops.push((key.into(), Some(value.into())));
    }

    /// Stage the removal of `key` (a real delete: the value is gone once applied).
    pub fn delete(&mut self, key: impl Into<Vec<u8>>) {
        self.ops.push((key.into(), None));
    }

    /// Append every operation of `other` after this batch's own.
    pub fn extend(&mut self, other: WriteBatch) {
        self.ops.extend(other.ops);
    }

    /// Whether the batch holds no operation.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Number of staged operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// The staged operations in order; `None` is a delete.
    pub fn ops(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        self.ops.iter().map(|(k, v)| (k.as_slice(), v.as_deref()))
    }
}

/// An ordered key-value store with atomic batches and an explicit flush.
///
/// Promises every implementation keeps:
/// - `apply` is atomic: after a crash either all of a batch is there or none.
/// - Reads see every applied batch, flushed or not.
/// - After `flush` returns `Ok`, every batch applied before the call survives a
///   crash of the process.
pub trait KvStore: Send + Sync + 'static {
    /// The value under `key`, or `None` when there is none.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError>;

    /// Up to `limit` entries with `start <= key < end` (no upper bound when
    /// `end` is `None`), in ascending key order.
    fn range(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Result<Entries, KvError>;

    /// Apply every operation of `batch` atomically (not yet durable).
    fn apply(&self, batch: &WriteBatch) -> Result<(), KvError>;

    /// Make every batch applied so far durable.
    fn flush(&self) -> Result<(), KvError>;

    /// Whether `flush` blocks on I/O, so async callers should move it to a
    /// blocking thread. The in-memory store answers `false`, which keeps the
    /// simulation on its single deterministic thread.
    fn flush_blocks(&self) -> bool {
        false
    }

    /// Up to `limit` entries whose key starts with `prefix`, in key order.
    fn scan_prefix(&self, prefix: &[u8], limit: usize) -> Result<Entries, KvError> {
        let end = prefix_end(prefix);
        self.range(prefix, end.as_deref(), limit)
    }
}

/// The smallest key greater than every key that starts with `prefix`, or
/// `None` when no such key exists (the prefix is all `0xff`).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// The production store: one sled database in one directory.
#[derive(Clone)]
pub struct SledKv {
    db: sled::Db,
}

impl SledKv {
    /// Open (or create) the sled database in `dir`.
    ///
    /// # Errors
    /// [`KvError::Engine`] when the directory cannot be opened, for example
    /// because another process holds its lock.
    pub fn open(dir: &Path) -> Result<Self, KvError> {
        let db = sled::Config::new().path(dir).open()?;
        Ok(Self { db })
    }
}

impl KvStore for SledKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.db.get(key)?.map(|v| v.to_vec()))
    }

    fn range(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Result<Entries, KvError> {
        let upper = match end {
            Some(e) => Bound::Excluded(e),
            None => Bound::Unbounded,
        };
        let mut out = Vec::new();
        for item in self
            .db
            .range::<&[u8], _>((Bound::Included(start), upper))
            .take(limit)
        {
            let (k, v) = item?;
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(out)
    }

    fn apply(&self, batch: &WriteBatch) -> Result<(), KvError> {
        let mut b = sled::Batch::default();
        for (k, v) in batch.ops() {
            match v {
                Some(v) => b.insert(k, v),
                None => b.remove(k),
            }
        }
        self.db.apply_batch(b)?;
        Ok(())
    }

    fn flush(&self) -> Result<(), KvError> {
        self.db.flush()?;
        Ok(())
    }

    fn flush_blocks(&self) -> bool {
        true
    }
}

/// An in-memory store with explicit crash semantics, for simulations and
/// fast tests.
///
/// Clones share the same data. [`MemKv::crash`] throws away every batch that
/// no flush covered, which is exactly what a killed process loses.
#[derive(Clone, Default)]
pub struct MemKv {
    inner: Arc<Mutex<MemInner>>,
}

#[derive(Default)]
struct MemInner {
    live: BTreeMap<Vec<u8>, Vec<u8>>,
    durable: BTreeMap<Vec<u8>, Vec<u8>>,
    unflushed: Vec<WriteBatch>,
}

impl MemKv {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forget every batch applied since the last flush, as a crash would.
    pub fn crash(&self) {
        let mut inner = self.lock();
        inner.live = inner.durable.clone();
        inner.unflushed.clear();
    }

    /// Number of batches applied but not yet covered by a flush.
    pub fn unflushed_batches(&self) -> usize {
        self.lock().unflushed.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemInner> {
        // A panic while holding this lock cannot leave the maps half-written
        // (each mutation is a single insert or remove), so poisoning is ignored.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn apply_to(map: &mut BTreeMap<Vec<u8>, Vec<u8>>, batch: &WriteBatch) {
    for (k, v) in batch.ops() {
        match v {
            Some(v) => {
                map.insert(k.to_vec(), v.to_vec());
            }
            None => {
                map.remove(k);
            }
        }
    }
}

impl KvStore for MemKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.lock().live.get(key).cloned())
    }

    fn range(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Result<Entries, KvError> {
        let inner = self.lock();
        let upper = match end {
            Some(e) => Bound::Excluded(e.to_vec()),
            None => Bound::Unbounded,
        };
        Ok(inner
            .live
            .range((Bound::Included(start.to_vec()), upper))
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn apply(&self, batch: &WriteBatch) -> Result<(), KvError> {
        let mut inner = self.lock();
        apply_to(&mut inner.live, batch);
        inner.unflushed.push(batch.clone());
        Ok(())
    }

    fn flush(&self) -> Result<(), KvError> {
        let mut inner = self.lock();
        let pending = std::mem::take(&mut inner.unflushed);
        for b in &pending {
            apply_to(&mut inner.durable, b);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(store: &dyn KvStore) {
        let mut b = WriteBatch::new();
        b.put(b"a/1".to_vec(), b"x".to_vec());
        b.put(b"a/2".to_vec(), b"y".to_vec());
        b.put(b"b/1".to_vec(), b"z".to_vec());
        b.delete(b"a/2".to_vec());
        store.apply(&b).unwrap();
        assert_eq!(store.get(b"a/1").unwrap(), Some(b"x".to_vec()));
        assert_eq!(store.get(b"a/2").unwrap(), None);
        let a = store.scan_prefix(b"a/", 10).unwrap();
        assert_eq!(a, vec![(b"a/1".to_vec(), b"x".to_vec())]);
        assert_eq!(store.range(b"a", None, 10).unwrap().len(), 2);
        assert_eq!(store.range(b"a", None, 1).unwrap().len(), 1);
    }

    #[test]
    fn sled_and_mem_agree_on_batches_and_ranges() {
        let dir = tempfile::tempdir().unwrap();
        exercise(&SledKv::open(dir.path()).unwrap());
        exercise(&MemKv::new());
    }

    #[test]
    fn mem_crash_loses_exactly_the_unflushed_batches() {
        let kv = MemKv::new();
        let mut b = WriteBatch::new();
        b.put(b"k1".to_vec(), b"1".to_vec());
        kv.apply(&b).unwrap();
        kv.flush().unwrap();
        let mut b = WriteBatch::new();
        b.put(b"k2".to_vec(), b"2".to_vec());
        b.delete(b"k1".to_vec());
        kv.apply(&b).unwrap();
        assert_eq!(kv.unflushed_batches(), 1);
        kv.crash();
        assert_eq!(kv.get(b"k1").unwrap(), Some(b"1".to_vec()));
        assert_eq!(kv.get(b"k2").unwrap(), None);
    }

    #[test]
    fn prefix_end_carries_over_ff() {
        assert_eq!(prefix_end(b"a"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
    }
}
