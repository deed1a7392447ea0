//! The queue's tunables, the same for every backend.

/// Tunables shared by every backend.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    /// How long a waiting job takes to climb one priority level (ms).
    pub aging_horizon_ms: u64,
    /// Lease length; attempts renew it by heartbeat (ms).
    pub lease_ms: u64,
    /// How long an idempotency key keeps answering with its job (ms).
    pub idempotency_ttl_ms: u64,
    /// Tenants a claim looks at, lowest virtual time first.
    pub scan_tenants: u32,
    /// Head jobs per tenant a claim looks at (1 = strict FIFO within a tenant).
    pub scan_depth: u32,
    /// Cost charged for fairness when a job has no time estimate (seconds).
    pub quantum_seconds: u64,
    /// First retry delay; doubles per failed attempt (ms).
    pub retry_base_ms: u64,
    /// Longest retry delay (ms).
    pub retry_max_ms: u64,
    /// Lost attempts before a job fails as a poison pill.
    pub max_stalls: u32,
    /// Finished jobs are deleted after this long (ms)…
    pub retention_ms: u64,
    /// …or when more than this many are kept.
    pub retention_count: u64,
    /// Events kept per job (the oldest go first).
    pub max_events_per_job: u32,
    /// How long to wait for Redis's answer before the outcome counts as unknown (ms).
    pub response_timeout_ms: u64,
    /// Retries of a call whose outcome is unknown (a lost reply, a timeout), for the
    /// calls that are safe to repeat; see [`crate::JobQueue`] for which those are.
    pub unknown_outcome_retries: u32,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            aging_horizon_ms: 2 * 3600 * 1000,
            lease_ms: 60_000,
            idempotency_ttl_ms: 24 * 3600 * 1000,
            scan_tenants: 16,
            scan_depth: 8,
            quantum_seconds: 3600,
            retry_base_ms: 10_000,
            retry_max_ms: 600_000,
            max_stalls: 3,
            retention_ms: 7 * 24 * 3600 * 1000,
            retention_count: 100_000,
            max_events_per_job: 200,
            response_timeout_ms: 10_000,
            unknown_outcome_retries: 4,
        }
    }
}
