//! Power cuts for tests: a store whose unflushed writes are lost when the
//! machine loses power.
//!
//! A killed process loses only what it had not handed to the kernel; a
//! power cut also loses what the kernel and the disk had not yet written.
//! Which of those a real store loses in between depends on the disk, so a
//! test assumes the worst a correct store allows: everything no flush
//! covered is gone, everything a flush covered is there. [`PowerCutKv`]
//! keeps its unflushed batches in memory, in front of the store it wraps
//! (the disk), and hands them to that store, as one batch followed by its
//! flush, only when it is flushed.
//!
//! ```no_run
//! # async fn demo(hubs: Vec<String>) {
//! use hubsync::testkit::{device_options, PowerSwitch, TestDevice};
//! let power = PowerSwitch::new();
//! let mut d = TestDevice::open_with_store(device_options(&hubs), power.store_wrap())
//!     .await
//!     .unwrap();
//! power.cut(); // `d`'s store refuses everything; what it had not flushed is gone
//! d.reopen().await.unwrap(); // boots again on what was flushed
//! # }
//! ```

use super::StoreWrap;
use crate::kv::{Entries, KvError, KvStore, WriteBatch};
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// The power of one simulated machine: every [`PowerCutKv`] made with
/// [`PowerSwitch::wrap`] belongs to the boot it was made in, and dies with
/// it at the next [`PowerSwitch::cut`]. Clones share the machine.
#[derive(Clone, Debug, Default)]
pub struct PowerSwitch {
    machine: Arc<Machine>,
}

#[derive(Debug, Default)]
struct Machine {
    /// The current boot. Every operation of a store holds it for reading,
    /// and a cut for writing, so no write of a dying store lands after the
    /// cut that ended its boot.
    boot: RwLock<u64>,
    /// Flushes answer `Ok` and make nothing durable: a disk that claims a
    /// sync it did not do.
    lying: AtomicBool,
    /// Flushes that made something durable.
    flushes: AtomicU64,
}

impl PowerSwitch {
    /// A machine with its power on.
    pub fn new() -> Self {
        Self::default()
    }

    /// `inner`, as the disk of this machine's current boot.
    pub fn wrap(&self, inner: Arc<dyn KvStore>) -> Arc<dyn KvStore> {
        Arc::new(PowerCutKv::on(self.clone(), inner))
    }

    /// [`wrap`](Self::wrap) as a [`StoreWrap`], for
    /// [`TestDevice::open_with_store`](super::TestDevice::open_with_store)
    /// and [`TestHub::start_wrapped`](super::TestHub::start_wrapped): each
    /// open or restart after a cut boots again on the flushed state.
    pub fn store_wrap(&self) -> StoreWrap {
        let me = self.clone();
        Arc::new(move |kv| me.wrap(kv))
    }

    /// Cut the power: every store of the current boot loses what it had
    /// not flushed and answers [`KvError::Engine`] to everything from now
    /// on (a process without a machine can neither read nor write). Waits
    /// for the operations already running to end; a flush among them
    /// counts as done before the cut.
    pub fn cut(&self) {
        let mut boot = self.machine.write_boot();
        *boot += 1;
    }

    /// While on, every flush answers `Ok` and makes nothing durable, as a
    /// disk that acknowledges a sync it did not do. A test that passes
    /// with this on cannot tell a flushed write from an unflushed one.
    pub fn lie_about_flushes(&self, on: bool) {
        self.machine.lying.store(on, Ordering::SeqCst);
    }

    /// How many flushes made something durable so far (to check that a
    /// test really went through a flush).
    pub fn flushes(&self) -> u64 {
        self.machine.flushes.load(Ordering::SeqCst)
    }
}

impl Machine {
    fn read_boot(&self) -> std::sync::RwLockReadGuard<'_, u64> {
        // The guarded value is one integer, whole at any panic.
        self.boot.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_boot(&self) -> std::sync::RwLockWriteGuard<'_, u64> {
        self.boot.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// A store over a disk (`inner`) whose writes reach the disk only when
/// flushed, and are lost at a power cut otherwise.
///
/// Promises, beyond [`KvStore`]'s: nothing reaches `inner` but at a flush,
/// which applies every batch applied since the last one as one batch and
/// then flushes `inner`; after its boot's [`PowerSwitch::cut`] (or
/// [`PowerCutKv::cut`]) every operation fails and `inner` is never
/// touched again through it. Reads see the unflushed batches over `inner`.
pub struct PowerCutKv {
    inner: Arc<dyn KvStore>,
    switch: PowerSwitch,
    boot: u64,
    volatile: Mutex<Volatile>,
}

/// What was applied and not yet flushed.
#[derive(Default)]
struct Volatile {
    /// Every batch since the last flush, in order, as one batch.
    pending: WriteBatch,
    /// What `pending` leaves under each key it touches (`None`: deleted).
    view: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

impl PowerCutKv {
    /// `inner` as the disk of a machine of its own, powered on.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        Self::on(PowerSwitch::new(), inner)
    }

    fn on(switch: PowerSwitch, inner: Arc<dyn KvStore>) -> Self {
        let boot = *switch.machine.read_boot();
        Self {
            inner,
            switch,
            boot,
            volatile: Mutex::new(Volatile::default()),
        }
    }

    /// The switch of this store's machine.
    pub fn switch(&self) -> &PowerSwitch {
        &self.switch
    }

    /// Cut the power ([`PowerSwitch::cut`]) and boot again: answers a
    /// store over the same disk holding exactly what was flushed.
    pub fn cut(&self) -> PowerCutKv {
        self.switch.cut();
        Self::on(self.switch.clone(), self.inner.clone())
    }

    /// Run `f` while this store's boot is the machine's, else fail.
    fn powered<T>(&self, f: impl FnOnce() -> Result<T, KvError>) -> Result<T, KvError> {
        let boot = self.switch.machine.read_boot();
        if *boot != self.boot {
            return Err(KvError::Engine(
                "the machine lost power (testkit power cut)".into(),
            ));
        }
        f()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Volatile> {
        // Each mutation below leaves both fields consistent before anything
        // can panic, so a poisoned lock still guards whole data.
        self.volatile.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl KvStore for PowerCutKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.powered(|| match self.lock().view.get(key) {
            Some(staged) => Ok(staged.clone()),
            None => self.inner.get(key),
        })
    }

    fn range(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Result<Entries, KvError> {
        self.powered(|| {
            let volatile = self.lock();
            let upper = match end {
                Some(e) => Bound::Excluded(e.to_vec()),
                None => Bound::Unbounded,
            };
            let staged: Vec<_> = volatile
                .view
                .range((Bound::Included(start.to_vec()), upper))
                .collect();
            // Each staged key hides or replaces at most one of the disk's,
            // so the disk's first `limit + staged` entries hold every one
            // of the disk's that can be among the first `limit` merged.
            let disk = self
                .inner
                .range(start, end, limit.saturating_add(staged.len()))?;
            let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = disk.into_iter().collect();
            for (k, v) in staged {
                match v {
                    Some(v) => merged.insert(k.clone(), v.clone()),
                    None => merged.remove(k),
                };
            }
            Ok(merged.into_iter().take(limit).collect())
        })
    }

    fn apply(&self, batch: &WriteBatch) -> Result<(), KvError> {
        self.powered(|| {
            let mut volatile = self.lock();
            for (k, v) in batch.ops() {
                volatile.view.insert(k.to_vec(), v.map(<[u8]>::to_vec));
            }
            volatile.pending.extend(batch.clone());
            Ok(())
        })
    }

    fn flush(&self) -> Result<(), KvError> {
        self.powered(|| {
            if self.switch.machine.lying.load(Ordering::SeqCst) {
                return Ok(());
            }
            let mut volatile = self.lock();
            if !volatile.pending.is_empty() {
                // One batch: a flush is all or nothing, and so is each
                // batch it covers.
                self.inner.apply(&volatile.pending)?;
                *volatile = Volatile::default();
            }
            self.inner.flush()?;
            self.switch.machine.flushes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    fn flush_blocks(&self) -> bool {
        self.inner.flush_blocks()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{MemKv, SledKv};

    fn put(kv: &dyn KvStore, pairs: &[(&str, &str)]) {
        let mut b = WriteBatch::new();
        for (k, v) in pairs {
            b.put(k.as_bytes(), v.as_bytes());
        }
        kv.apply(&b).unwrap();
    }

    fn get(kv: &dyn KvStore, k: &str) -> Option<String> {
        kv.get(k.as_bytes())
            .unwrap()
            .map(|v| String::from_utf8(v).unwrap())
    }

    #[test]
    fn a_write_not_flushed_is_gone_after_a_cut_and_a_flushed_one_stays() {
        let kv = PowerCutKv::new(Arc::new(MemKv::new()));
        put(&kv, &[("kept", "1")]);
        kv.flush().unwrap();
        put(&kv, &[("lost", "2")]);
        assert_eq!(get(&kv, "lost").as_deref(), Some("2"), "reads see it");
        let after = kv.cut();
        assert_eq!(get(&after, "kept").as_deref(), Some("1"));
        assert_eq!(get(&after, "lost"), None);
        assert_eq!(kv.switch().flushes(), 1);
    }

    #[test]
    fn a_batch_is_all_or_nothing() {
        let kv = PowerCutKv::new(Arc::new(MemKv::new()));
        put(&kv, &[("a", "1"), ("b", "1"), ("c", "1")]);
        kv.flush().unwrap();
        let mut b = WriteBatch::new();
        b.put(b"a".as_slice(), b"2".as_slice());
        b.delete(b"b".as_slice());
        b.put(b"d".as_slice(), b"2".as_slice());
        kv.apply(&b).unwrap();
        let after = kv.cut();
        let all = after.range(b"", None, 10).unwrap();
        let keys: Vec<_> = all.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(keys, [b"a", b"b", b"c"], "none of the unflushed batch");
        assert_eq!(get(&after, "a").as_deref(), Some("1"));
        after.apply(&b).unwrap();
        after.flush().unwrap();
        let again = after.cut();
        assert_eq!(get(&again, "a").as_deref(), Some("2"));
        assert_eq!(get(&again, "b"), None);
        assert_eq!(get(&again, "d").as_deref(), Some("2"), "all of it");
    }

    #[test]
    fn a_store_of_a_past_boot_can_neither_read_nor_write() {
        let disk = Arc::new(MemKv::new());
        let kv = PowerCutKv::new(disk.clone());
        put(&kv, &[("a", "1")]);
        let after = kv.cut();
        assert!(kv.get(b"a").is_err());
        assert!(kv.range(b"", None, 10).is_err());
        assert!(kv.apply(&WriteBatch::new()).is_err());
        assert!(kv.flush().is_err(), "its unflushed write cannot land now");
        assert_eq!(disk.get(b"a").unwrap(), None);
        put(&after, &[("b", "1")]);
        after.flush().unwrap();
        assert_eq!(disk.get(b"b").unwrap(), Some(b"1".to_vec()));
    }

    #[test]
    fn a_lying_flush_makes_nothing_durable() {
        let kv = PowerCutKv::new(Arc::new(MemKv::new()));
        kv.switch().lie_about_flushes(true);
        put(&kv, &[("a", "1")]);
        kv.flush().unwrap();
        assert_eq!(get(&kv.cut(), "a"), None);
        assert_eq!(kv.switch().flushes(), 0);
    }

    #[test]
    fn ranges_merge_the_unflushed_writes_over_the_disk() {
        let kv = PowerCutKv::new(Arc::new(MemKv::new()));
        put(&kv, &[("a", "d"), ("b", "d"), ("c", "d"), ("e", "d")]);
        kv.flush().unwrap();
        let mut b = WriteBatch::new();
        b.delete(b"a".as_slice());
        b.delete(b"b".as_slice());
        b.put(b"c".as_slice(), b"v".as_slice());
        b.put(b"d".as_slice(), b"v".as_slice());
        b.put(b"z".as_slice(), b"v".as_slice());
        kv.apply(&b).unwrap();
        let pairs = |e: Entries| -> Vec<(String, String)> {
            e.into_iter()
                .map(|(k, v)| (String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap()))
                .collect()
        };
        let two = pairs(kv.range(b"", None, 2).unwrap());
        assert_eq!(two, [("c".into(), "v".into()), ("d".into(), "v".into())]);
        let to_e = pairs(kv.range(b"a", Some(b"e"), 10).unwrap());
        assert_eq!(to_e.len(), 2);
        assert_eq!(kv.scan_prefix(b"e", 10).unwrap().len(), 1);
        assert_eq!(kv.range(b"", None, 10).unwrap().len(), 4);
    }

    #[test]
    fn over_sled_a_flush_reaches_the_directory_and_nothing_else_does() {
        let dir = tempfile::tempdir().unwrap();
        let switch = PowerSwitch::new();
        {
            let kv = switch.wrap(Arc::new(SledKv::open(dir.path()).unwrap()));
            put(&*kv, &[("kept", "1")]);
            kv.flush().unwrap();
            put(&*kv, &[("lost", "2")]);
            switch.cut();
        }
        let sled = SledKv::open_waiting(dir.path(), super::super::SLED_LOCK_PATIENCE).unwrap();
        let kv = switch.wrap(Arc::new(sled));
        assert_eq!(get(&*kv, "kept").as_deref(), Some("1"));
        assert_eq!(get(&*kv, "lost"), None);
    }
}
