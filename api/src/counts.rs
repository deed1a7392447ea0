//! How many of something are held at once, in the whole process and per key (a tenant,
//! or a tenant and a kind): the bookkeeping behind upload slots ([`crate::upload_slots`])
//! and responses held open ([`crate::holds`]), which each add their own bounds and
//! refusals.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

/// Which bound a refused [`Counts::take`] met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// The process holds as many as it may.
    Process,
    /// The key holds as many as it may.
    Key,
}

/// What is held, in all and per key; a key holding none is not kept.
#[derive(Debug)]
pub(crate) struct Counts<K> {
    total: usize,
    by_key: HashMap<K, usize>,
}

impl<K> Default for Counts<K> {
    fn default() -> Self {
        Self {
            total: 0,
            by_key: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash> Counts<K> {
    /// How many are held in all.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// How many `key` holds.
    pub(crate) fn of<Q>(&self, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.by_key.get(key).copied().unwrap_or(0)
    }

    /// Counts one more for `key`, unless the process already holds `per_process` (checked
    /// first) or the key `per_key`.
    pub(crate) fn take(&mut self, key: K, per_process: usize, per_key: usize) -> Result<(), Full> {
        if self.total >= per_process {
            return Err(Full::Process);
        }
        let mine = self.of(&key);
        if mine >= per_key {
            return Err(Full::Key);
        }
        self.by_key.insert(key, mine + 1);
        self.total += 1;
        Ok(())
    }

    /// Counts one fewer for `key`.
    pub(crate) fn give_back<Q>(&mut self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.by_key.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_key.remove(key);
            }
        }
    }
}
