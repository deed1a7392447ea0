//! A bounded, process-local copy of catalog records that are read far more often than
//! they change: a job's status page is polled every few seconds by every client.
//!
//! Only records whose change is visible elsewhere belong here. A fine-tune record
//! changes once, when its outcome is filed: a copy with an outcome is final, and a copy
//! without one is only ever used together with the job's live state from the queue
//! (see `finetunes::view`), so several API processes never disagree for long.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Records by (owner, id), at most `capacity` of them.
pub(crate) struct RecordCache<T> {
    entries: Mutex<HashMap<(String, String), Arc<T>>>,
    capacity: usize,
}

impl<T> RecordCache<T> {
    /// An empty cache holding at most `capacity` records.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    /// The copy of (owner, id), if one is kept.
    pub(crate) fn get(&self, owner: &str, id: &str) -> Option<Arc<T>> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.get(&(owner.to_string(), id.to_string())).cloned()
    }

    /// Keeps `record` as the copy of (owner, id). A full cache starts over: simpler than
    /// an LRU and, for records a client polls, refilled within one polling interval.
    pub(crate) fn put(&self, owner: &str, id: &str, record: Arc<T>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= self.capacity {
            entries.clear();
        }
        entries.insert((owner.to_string(), id.to_string()), record);
    }

    fn len(&self) -> usize {
        self.entries.lock().map_or(0, |e| e.len())
    }
}

impl<T> std::fmt::Debug for RecordCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordCache")
            .field("len", &self.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_records_per_owner_and_starts_over_when_full() {
        let cache = RecordCache::new(2);
        cache.put("a", "1", Arc::new(10));
        cache.put("b", "1", Arc::new(20));
        assert_eq!(cache.get("a", "1").as_deref(), Some(&10));
        assert_eq!(cache.get("b", "1").as_deref(), Some(&20));
        assert_eq!(
            cache.get("a", "2"),
            None,
            "another owner's id is another record"
        );
        cache.put("a", "3", Arc::new(30));
        assert_eq!(cache.get("a", "1"), None, "a full cache starts over");
        assert_eq!(cache.get("a", "3").as_deref(), Some(&30));
    }
}
