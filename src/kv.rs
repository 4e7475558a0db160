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

    /// What this batch would leave under `key`: `None` when it stages
    /// nothing for it, `Some(None)` when its last operation there is a
    /// delete, `Some(Some(value))` for a put.
    pub fn staged(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.ops
            .iter()
            .rev()
            .find(|(k, _)| k.as_slice() == key)
            .map(|(_, v)| v.as_deref())
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
///   crash of the process and a power cut of the machine.
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

    /// Bytes the store takes on disk, when it can say (for operators).
    fn size_on_disk(&self) -> Option<u64> {
        None
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

/// A view of another store confined to the keys under a fixed prefix, so two
/// users can share one store without seeing each other's keys.
///
/// Every key goes in with the prefix prepended and comes out with it
/// stripped: `get`, `range`, `scan_prefix` and `apply` all work on the
/// unprefixed keys, and a range (even one with no upper bound) never reaches
/// past the prefix's last key. `flush` and `flush_blocks` are the inner
/// store's: a flush makes the whole inner store durable, not just this view.
/// Each promise of [`KvStore`] holds because the inner store keeps it for the
/// prefixed batch.
#[derive(Clone)]
pub struct PrefixKv {
    inner: Arc<dyn KvStore>,
    prefix: Vec<u8>,
    /// The first key after every key under `prefix`; `None` when there is
    /// none (the prefix is all `0xff`), so ranges run to the store's end.
    end: Option<Vec<u8>>,
}

impl PrefixKv {
    /// The keys of `inner` that start with `prefix`, seen without it.
    pub fn new(inner: Arc<dyn KvStore>, prefix: impl Into<Vec<u8>>) -> Self {
        let prefix = prefix.into();
        let end = prefix_end(&prefix);
        Self { inner, prefix, end }
    }

    /// The prefix every key of this view carries in the inner store.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    fn inner_key(&self, key: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + key.len());
        k.extend_from_slice(&self.prefix);
        k.extend_from_slice(key);
        k
    }

    /// Strip the prefix from inner entries, dropping any outside it (a
    /// correct inner store returns none, as every range asked is inside).
    fn outer(&self, entries: Entries) -> Entries {
        entries
            .into_iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(self.prefix.as_slice())?.to_vec(), v)))
            .collect()
    }
}

impl KvStore for PrefixKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.inner.get(&self.inner_key(key))
    }

    fn range(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Result<Entries, KvError> {
        let start = self.inner_key(start);
        // Any prefixed `end` is at most `self.end`; no `end` stops there.
        let end = match end {
            Some(e) => Some(self.inner_key(e)),
            None => self.end.clone(),
        };
        let entries = self.inner.range(&start, end.as_deref(), limit)?;
        Ok(self.outer(entries))
    }

    fn apply(&self, batch: &WriteBatch) -> Result<(), KvError> {
        let mut prefixed = WriteBatch::new();
        for (k, v) in batch.ops() {
            match v {
                Some(v) => prefixed.put(self.inner_key(k), v),
                None => prefixed.delete(self.inner_key(k)),
            }
        }
        self.inner.apply(&prefixed)
    }

    fn flush(&self) -> Result<(), KvError> {
        self.inner.flush()
    }

    fn flush_blocks(&self) -> bool {
        self.inner.flush_blocks()
    }

    fn scan_prefix(&self, prefix: &[u8], limit: usize) -> Result<Entries, KvError> {
        let entries = self.inner.scan_prefix(&self.inner_key(prefix), limit)?;
        Ok(self.outer(entries))
    }
}

/// The production store: one sled database in one directory.
///
/// Its [`KvStore::flush`] survives a power cut, not only a crash of the
/// process: sled 0.34's own flush does not (see [`SledKv::flush`]'s
/// comment and docs/operations.md, "Durability").
#[derive(Clone)]
pub struct SledKv {
    db: sled::Db,
    disk: Arc<DiskSync>,
}

/// The fsyncs sled 0.34 leaves out of its flush, done by hand.
///
/// sled 0.34.7 (`src/pagecache/iobuf.rs`, `write_to_log`) ends a log write
/// on Linux with `sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`, not
/// `fsync`: that neither writes the file's metadata (its length, as the log
/// grows) nor flushes the disk's write cache (sync_file_range(2); sled
/// issues #1452 and #1351). Values over about 128 KiB go to files under
/// `blobs/` that sled never syncs (`src/pagecache/blob_io.rs`,
/// `write_blob`), nor their directory. Only its background thread calls
/// `sync_all`, every `flush_every_ms` (500 ms by default,
/// `src/flusher.rs`). So without this, a power cut could undo writes that
/// `Db::flush` had returned for.
struct DiskSync {
    /// sled's log file (`DIR/db`), opened when the store opens: fsync
    /// syncs the file, whichever descriptor wrote it, and a descriptor
    /// open before a write-back error is told of it.
    log: std::fs::File,
    /// sled's blob directory (`DIR/blobs`).
    blobs: std::path::PathBuf,
    /// The names of the blob files already synced (only those still there).
    synced_blobs: Mutex<std::collections::HashSet<std::ffi::OsString>>,
}

impl DiskSync {
    /// Sync what sled wrote on opening `dir` (its files and their
    /// directory entries, which sled never syncs; the entry of `dir` itself
    /// when sled `created` it), and keep the log file open.
    fn open(dir: &Path, created: bool) -> Result<Self, KvError> {
        let io = |what: &str, e: std::io::Error| KvError::Engine(format!("{what}: {e}"));
        // Written, not only read, so that the sync is allowed everywhere
        // (Windows wants write access); nothing is ever written through it.
        let log = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("db"))
            .map_err(|e| io("open sled's log file", e))?;
        let disk = Self {
            log,
            blobs: dir.join("blobs"),
            synced_blobs: Mutex::new(Default::default()),
        };
        let conf = std::fs::File::open(dir.join("conf")).map_err(|e| io("open sled's conf", e))?;
        conf.sync_all().map_err(|e| io("sync sled's conf", e))?;
        disk.sync()?;
        sync_dir(dir)?;
        if let Some(parent) = dir
            .parent()
            .filter(|p| created && !p.as_os_str().is_empty())
        {
            sync_dir(parent)?;
        }
        Ok(disk)
    }

    /// Sync every blob file not yet synced and the blob directory, then the
    /// log: the log's pointers to blobs become durable after the blobs.
    fn sync(&self) -> Result<(), KvError> {
        let io = |what: &str, e: std::io::Error| KvError::Engine(format!("{what}: {e}"));
        let mut synced = self.synced_blobs.lock().unwrap_or_else(|p| p.into_inner());
        let mut present = std::collections::HashSet::new();
        let mut new = false;
        let listing = match std::fs::read_dir(&self.blobs) {
            Ok(listing) => Some(listing),
            // No blob directory: nothing to sync there (a directory copied
            // without it, say a hub restored from a backup of its files).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io("list sled's blobs", e)),
        };
        for entry in listing.into_iter().flatten() {
            let name = entry.map_err(|e| io("list sled's blobs", e))?.file_name();
            if !synced.contains(&name) {
                match std::fs::File::open(self.blobs.join(&name)) {
                    Ok(f) => f.sync_all().map_err(|e| io("sync a sled blob", e))?,
                    // Removed since the listing: sled no longer needs it.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io("open a sled blob", e)),
                }
                new = true;
            }
            present.insert(name);
        }
        if new {
            sync_dir(&self.blobs)?;
        }
        *synced = present;
        self.log
            .sync_all()
            .map_err(|e| io("sync sled's log file", e))
    }
}

/// Make the entries of directory `dir` durable (a no-op where a directory
/// cannot be opened to sync it).
fn sync_dir(dir: &Path) -> Result<(), KvError> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| KvError::Engine(format!("sync directory {}: {e}", dir.display())))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

impl SledKv {
    /// Open (or create) the sled database in `dir`.
    ///
    /// # Errors
    /// [`KvError::Engine`] when the directory cannot be opened, for example
    /// because another process holds its lock.
    pub fn open(dir: &Path) -> Result<Self, KvError> {
        let created = !dir.exists();
        let db = sled::Config::new().path(dir).open()?;
        let disk = Arc::new(DiskSync::open(dir, created)?);
        Ok(Self { db, disk })
    }

    /// Open the database in `dir` like [`SledKv::open`], but while its lock
    /// is held, try again for up to `patience`. Sled lets go of a dropped
    /// database's lock from its background flusher a moment after the drop,
    /// so reopening a directory in the same process (a device closed and
    /// opened again) must wait for it. Blocks the calling thread.
    ///
    /// # Errors
    /// [`KvError::Engine`] when the directory cannot be opened, or is still
    /// locked after `patience` (another process holds it).
    pub fn open_waiting(dir: &Path, patience: std::time::Duration) -> Result<Self, KvError> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            match Self::open(dir) {
                Err(KvError::Engine(e))
                    if e.contains("acquire lock") && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }
}

impl KvStore for SledKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.db.get(key)?.map(|v| v.to_vec()))
    }

    fn size_on_disk(&self) -> Option<u64> {
        self.db.size_on_disk().ok()
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

    /// sled's flush writes every buffered batch to the log file; the fsyncs
    /// after it make that survive a power cut (see [`DiskSync`]).
    fn flush(&self) -> Result<(), KvError> {
        self.db.flush()?;
        self.disk.sync()
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

    /// A store with keys just inside and just outside `prefix` on both sides.
    fn neighbours(prefix: &[u8]) -> Arc<dyn KvStore> {
        let kv = MemKv::new();
        let mut b = WriteBatch::new();
        let mut before = prefix.to_vec();
        before.pop();
        b.put(before, b"before".to_vec());
        if let Some(end) = prefix_end(prefix) {
            b.put(end.clone(), b"after".to_vec());
            let mut after = end;
            after.push(0);
            b.put(after, b"after".to_vec());
        }
        kv.apply(&b).unwrap();
        Arc::new(kv)
    }

    #[test]
    fn prefix_kv_passes_the_shared_exercise() {
        for prefix in [&b"p/"[..], b"", &[b'p', 0xff], &[0xff, 0xff]] {
            exercise(&PrefixKv::new(neighbours(prefix), prefix));
        }
    }

    #[test]
    fn prefix_kv_maps_keys_in_and_out() {
        let inner: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let view = PrefixKv::new(inner.clone(), b"p/".to_vec());
        let mut b = WriteBatch::new();
        b.put(b"k".to_vec(), b"1".to_vec());
        b.put(b"gone".to_vec(), b"2".to_vec());
        b.delete(b"gone".to_vec());
        view.apply(&b).unwrap();
        assert_eq!(inner.get(b"p/k").unwrap(), Some(b"1".to_vec()));
        assert_eq!(inner.get(b"k").unwrap(), None);
        assert_eq!(inner.get(b"p/gone").unwrap(), None);
        assert_eq!(view.get(b"k").unwrap(), Some(b"1".to_vec()));
        assert_eq!(
            view.range(b"", None, 10).unwrap(),
            vec![(b"k".to_vec(), b"1".to_vec())]
        );
        assert_eq!(view.prefix(), b"p/");
    }

    #[test]
    fn prefix_kv_ranges_stop_at_the_prefix_upper_edge() {
        // "p/" ends at "p0": keys "p0" and "p0\0" lie just past the view.
        let prefix = b"p/";
        let inner = neighbours(prefix);
        let view = PrefixKv::new(inner.clone(), prefix.to_vec());
        let mut b = WriteBatch::new();
        b.put(vec![0xff], b"last".to_vec());
        b.put(vec![0xff, 0xff], b"very last".to_vec());
        b.put(b"a".to_vec(), b"first".to_vec());
        view.apply(&b).unwrap();
        let all = view.range(b"", None, 100).unwrap();
        let keys: Vec<_> = all.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(keys, vec![b"a".to_vec(), vec![0xff], vec![0xff, 0xff]]);
        // A range starting at the view's last key, unbounded or bounded
        // beyond it, still sees only keys of the view.
        assert_eq!(view.range(&[0xff], None, 100).unwrap().len(), 2);
        assert_eq!(view.range(&[0xff, 0xff], None, 100).unwrap().len(), 1);
        assert_eq!(
            view.range(&[0xff], Some(&[0xff, 0xff, 0xff]), 100)
                .unwrap()
                .len(),
            2
        );
        assert_eq!(view.scan_prefix(&[0xff], 100).unwrap().len(), 2);
        assert_eq!(view.scan_prefix(&[0xff, 0xff], 100).unwrap().len(), 1);
        // The neighbours are still there in the inner store.
        assert_eq!(inner.get(b"p0").unwrap(), Some(b"after".to_vec()));
        assert_eq!(inner.get(b"p").unwrap(), Some(b"before".to_vec()));
    }

    /// The bounds of one range read.
    type Bounds = (Vec<u8>, Option<Vec<u8>>);

    /// A store that records the bounds of every range asked of it.
    struct Spy {
        inner: MemKv,
        asked: Mutex<Vec<Bounds>>,
    }

    impl KvStore for Spy {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
            self.inner.get(key)
        }
        fn range(
            &self,
            start: &[u8],
            end: Option<&[u8]>,
            limit: usize,
        ) -> Result<Entries, KvError> {
            let mut asked = self.asked.lock().unwrap();
            asked.push((start.to_vec(), end.map(<[u8]>::to_vec)));
            self.inner.range(start, end, limit)
        }
        fn apply(&self, batch: &WriteBatch) -> Result<(), KvError> {
            self.inner.apply(batch)
        }
        fn flush(&self) -> Result<(), KvError> {
            self.inner.flush()
        }
    }

    #[test]
    fn prefix_kv_never_asks_the_inner_store_past_its_prefix() {
        let spy = Arc::new(Spy {
            inner: MemKv::new(),
            asked: Mutex::new(Vec::new()),
        });
        let view = PrefixKv::new(spy.clone(), b"p/".to_vec());
        view.range(b"", None, 10).unwrap();
        view.range(b"a", Some(b"b"), 10).unwrap();
        view.scan_prefix(&[0xff], 10).unwrap();
        let asked = spy.asked.lock().unwrap().clone();
        assert_eq!(
            asked,
            vec![
                (b"p/".to_vec(), Some(b"p0".to_vec())),
                (b"p/a".to_vec(), Some(b"p/b".to_vec())),
                (vec![b'p', b'/', 0xff], Some(b"p0".to_vec())),
            ]
        );
    }

    #[test]
    fn prefix_kv_with_an_all_ff_prefix_runs_to_the_store_end() {
        let inner: Arc<dyn KvStore> = Arc::new(MemKv::new());
        let mut b = WriteBatch::new();
        b.put(vec![0xfe, 0xff], b"outside".to_vec());
        inner.apply(&b).unwrap();
        let view = PrefixKv::new(inner, vec![0xff]);
        let mut b = WriteBatch::new();
        b.put(vec![0xff], b"in".to_vec());
        view.apply(&b).unwrap();
        assert_eq!(
            view.range(b"", None, 10).unwrap(),
            vec![(vec![0xff], b"in".to_vec())]
        );
    }

    #[test]
    fn prefix_kv_flush_makes_the_inner_store_durable() {
        let mem = MemKv::new();
        let view = PrefixKv::new(Arc::new(mem.clone()), b"p/".to_vec());
        let mut b = WriteBatch::new();
        b.put(b"k".to_vec(), b"1".to_vec());
        view.apply(&b).unwrap();
        assert_eq!(mem.unflushed_batches(), 1);
        assert!(!view.flush_blocks());
        view.flush().unwrap();
        mem.crash();
        assert_eq!(view.get(b"k").unwrap(), Some(b"1".to_vec()));
    }

    #[test]
    fn prefix_kv_over_sled_sees_only_its_keys() {
        let dir = tempfile::tempdir().unwrap();
        let sled: Arc<dyn KvStore> = Arc::new(SledKv::open(dir.path()).unwrap());
        let mut b = WriteBatch::new();
        b.put(b"p0".to_vec(), b"outside".to_vec());
        b.put(b"o".to_vec(), b"outside".to_vec());
        sled.apply(&b).unwrap();
        let view = PrefixKv::new(sled, b"p/".to_vec());
        assert!(view.flush_blocks());
        exercise(&view);
        assert_eq!(view.range(b"", None, 100).unwrap().len(), 2);
    }

    #[test]
    fn sled_flush_syncs_the_blob_files_sled_itself_never_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let kv = SledKv::open(dir.path()).unwrap();
        // Over sled's inline limit (a quarter of a 512 KiB segment): a blob.
        let big = vec![7u8; 300 * 1024];
        let mut b = WriteBatch::new();
        b.put(b"big".to_vec(), big.clone());
        kv.apply(&b).unwrap();
        kv.flush().unwrap();
        let synced = kv.disk.synced_blobs.lock().unwrap().len();
        assert!(synced >= 1, "no blob file was synced");
        assert_eq!(kv.get(b"big").unwrap(), Some(big));
    }

    #[test]
    fn sled_flush_goes_on_without_a_blob_directory() {
        // A store whose directory was copied without `blobs/`, or removed
        // under it (a test's temporary directory): its flush still syncs
        // the log, and says nothing failed that did not.
        let dir = tempfile::tempdir().unwrap();
        let kv = SledKv::open(dir.path()).unwrap();
        let _ = std::fs::remove_dir_all(dir.path().join("blobs"));
        let mut b = WriteBatch::new();
        b.put(b"k".to_vec(), b"v".to_vec());
        kv.apply(&b).unwrap();
        kv.flush().unwrap();
        assert_eq!(kv.get(b"k").unwrap(), Some(b"v".to_vec()));
    }

    #[test]
    fn prefix_end_carries_over_ff() {
        assert_eq!(prefix_end(b"a"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
    }
}
