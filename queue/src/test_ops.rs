//! Operations only tests need (behind the `testing` feature): a queue clock that tests
//! move themselves, instead of waiting for real time to pass, and the embedded store's
//! compaction hooks.

use crate::Result;
use crate::backend::Backend;
use crate::embedded::Store;
use crate::scripted::Queue;
use std::sync::Arc;

impl Queue {
    /// Moves the queue clock forward by `ms` (tests use it to expire leases and age jobs).
    pub async fn advance_clock(&self, ms: u64) -> Result<()> {
        let mut cmd = redis::cmd("HINCRBY");
        cmd.arg(self.domain.meta()).arg("clock_offset").arg(ms);
        self.domain.query(&cmd).await
    }

    /// The embedded store under this queue (None on Redis), for its test hooks
    /// ([`Store::compact_now`], [`Store::crash_next_compaction`]).
    pub fn embedded_store(&self) -> Option<Arc<Store>> {
        match &self.domain.backend {
            Backend::Embedded(store) => Some(Arc::clone(store)),
            Backend::Redis(_) | Backend::Cluster(_) => None,
        }
    }

    /// Pins the queue clock where it is now: from then on it moves only by
    /// [`Self::advance_clock`], so what a test expects of time (a retry's due time, an
    /// estimated start, a lease's deadline) cannot be upset by a slow machine.
    pub async fn freeze_clock(&self) -> Result<()> {
        let (seconds, micros): (u64, u64) = self.domain.query(&redis::cmd("TIME")).await?;
        let mut cmd = redis::cmd("HSET");
        cmd.arg(self.domain.meta())
            .arg("clock_pinned")
            .arg(seconds * 1000 + micros / 1000);
        self.domain.query(&cmd).await
    }
}
