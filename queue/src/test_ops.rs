//! Operations only tests need (behind the `testing` feature): moving the queue's clock
//! instead of waiting for real time to pass.

use crate::Result;
use crate::scripted::Queue;

impl Queue {
    /// Moves the queue clock forward by `ms` (tests use it to expire leases and age jobs).
    pub async fn advance_clock(&self, ms: u64) -> Result<()> {
        let mut cmd = redis::cmd("HINCRBY");
        cmd.arg(self.domain.meta()).arg("clock_offset").arg(ms);
        self.domain.query(&cmd).await
    }
}
