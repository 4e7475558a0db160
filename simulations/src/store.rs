//! A hub's store that can be snapshotted and rewound.
//!
//! It is the crate's `MemKv` (crash semantics unchanged) with a shadow copy
//! of what has been flushed, so the simulation can copy a hub's durable
//! contents at any moment (an operator's backup) and later restart the hub
//! from that copy (a restore from backup) or from nothing (a lost data
//! directory).

use hubsync::kv::{Entries, KvError, KvStore, MemKv, WriteBatch};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The durable contents of a store at one moment.
pub type Snapshot = BTreeMap<Vec<u8>, Vec<u8>>;

/// A `MemKv` whose durable contents can be copied and restored.
#[derive(Clone, Default)]
pub struct HubDisk {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    kv: MemKv,
    durable: Snapshot,
    unflushed: Vec<WriteBatch>,
}

impl HubDisk {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lose every batch no flush covered, as a killed process would.
    pub fn crash(&self) {
        let mut i = self.lock();
        i.kv.crash();
        i.unflushed.clear();
    }

    /// A copy of what has been flushed so far.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().durable.clone()
    }

    /// Replace everything with `snap` (flushed): the hub restarts on it.
    /// An empty snapshot is a new, empty store (a new store identity).
    pub fn restore(&self, snap: &Snapshot) {
        let kv = MemKv::new();
        let mut b = WriteBatch::new();
        for (k, v) in snap {
            b.put(k.clone(), v.clone());
        }
        if !b.is_empty() {
            let _ = kv.apply(&b);
        }
        let _ = kv.flush();
        let mut i = self.lock();
        i.kv = kv;
        i.durable = snap.clone();
        i.unflushed.clear();
    }
}

impl KvStore for HubDisk {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.lock().kv.get(key)
    }

    fn range(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Result<Entries, KvError> {
        self.lock().kv.range(start, end, limit)
    }

    fn apply(&self, batch: &WriteBatch) -> Result<(), KvError> {
        let mut i = self.lock();
        i.kv.apply(batch)?;
        i.unflushed.push(batch.clone());
        Ok(())
    }

    fn flush(&self) -> Result<(), KvError> {
        let mut i = self.lock();
        i.kv.flush()?;
        let pending = std::mem::take(&mut i.unflushed);
        for b in &pending {
            for (k, v) in b.ops() {
                match v {
                    Some(v) => {
                        i.durable.insert(k.to_vec(), v.to_vec());
                    }
                    None => {
                        i.durable.remove(k);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(s: &HubDisk, k: &str, v: &str) {
        let mut b = WriteBatch::new();
        b.put(k.as_bytes().to_vec(), v.as_bytes().to_vec());
        s.apply(&b).unwrap();
    }

    #[test]
    fn a_snapshot_holds_exactly_the_flushed_contents_and_restores() {
        let s = HubDisk::new();
        put(&s, "a", "1");
        s.flush().unwrap();
        put(&s, "b", "2");
        let snap = s.snapshot();
        assert_eq!(snap.len(), 1);
        s.flush().unwrap();
        put(&s, "c", "3");
        s.crash();
        assert_eq!(s.get(b"b").unwrap(), Some(b"2".to_vec()));
        assert_eq!(s.get(b"c").unwrap(), None);
        s.restore(&snap);
        assert_eq!(s.get(b"a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(s.get(b"b").unwrap(), None);
        s.crash();
        assert_eq!(s.get(b"a").unwrap(), Some(b"1".to_vec()));
        s.restore(&Snapshot::new());
        assert_eq!(s.get(b"a").unwrap(), None);
    }
}
