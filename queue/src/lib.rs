//! The job queue: tuneq's source of truth for accepted jobs.
//!
//! Jobs belong to tenants, wait in line by priority (with aging, so nothing starves),
//! are shared between tenants by weighted fair queueing on GPU-time, and are claimed by
//! dispatchers for a node pool whose capacity (and the tenant's quota) is reserved in
//! the same atomic step as the lease. Every lease carries a fencing token; every later
//! change for that attempt (start, heartbeat, complete, fail, preempt) must present it,
//! and a stale one changes nothing. A lease that runs out makes the job *suspect*, never
//! silently re-dispatched: the dispatcher, which can see the attempt, decides.
//!
//! Layout:
//! - [`model`]: the job record, states (and their public OpenAI names), leases, events.
//! - [`scripted`]: [`Queue`], written once: every transition is one Lua script in
//!   `queue/lua/`, run by Redis (one server or a Cluster) or by the embedded store.
//! - [`catalog`]: files, API keys, fine-tune records and models, kept beyond a job's
//!   life in the queue, on the same backend.
//! - [`embedded`]: the single-file store for `tuneq up` (an in-memory keyspace, the same
//!   scripts in an embedded Lua, and an append-only log synced per operation).
//! - [`attempt`]: signed credentials a trainer reports its attempt's progress with.
//! - [`bench`]: `tuneq bench queue`, the BullMQ kit's workload on our queue.
//!
//! The design and its invariants are in `../shared/research/queue-design.md` (B1–B7).

pub mod attempt;
mod backend;
pub mod bench;
pub mod catalog;
pub mod embedded;
#[cfg(feature = "testing")]
pub mod fault_proxy;
pub mod model;
pub mod scripted;
mod standing;
#[cfg(feature = "testing")]
pub mod testing;

pub use attempt::AttemptSigner;
pub use catalog::{Catalog, Entry, Page};
pub use scripted::{JobQueue, Queue};

pub use model::{
    Delivery, Enqueued, Inspection, JobEvent, JobId, JobRecord, JobState, Lease, NewJob, PoolUsage,
    Position, SuspectVerdict, TenantSettings,
};

/// Errors from the queue.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// No such job (or it was trimmed by retention).
    #[error("job {0} not found")]
    NotFound(JobId),
    /// The caller's fencing token is not the job's current one: a newer attempt, a
    /// cancel or a requeue superseded it. Nothing was changed; that attempt must stop.
    #[error("stale fencing token for job {0}: a newer attempt or a cancel superseded it")]
    StaleToken(JobId),
    /// The job is in a state where this transition does not apply.
    #[error("job {id} is {state}, which does not allow {operation}")]
    WrongState {
        /// The job.
        id: JobId,
        /// Its state.
        state: String,
        /// What was tried.
        operation: &'static str,
    },
    /// The tenant has too many jobs waiting.
    #[error("tenant {0} has too many jobs waiting")]
    OverQuota(String),
    /// The pool has not been configured.
    #[error("unknown node pool {0}")]
    UnknownPool(String),
    /// A request was refused before reaching the queue (bad priority, empty tenant…).
    #[error("invalid {field}: {message}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        message: String,
    },
    /// The backend could not be reached or did not answer in time. The outcome of the
    /// operation is unknown: retry with the same idempotency key or claim request id.
    #[error("queue backend unavailable: {0}")]
    Unavailable(String),
    /// The backend answered something this version does not understand.
    #[error("queue backend answered unexpectedly: {0}")]
    Protocol(String),
}

impl QueueError {
    /// Whether retrying the same call (with the same idempotency key / request id) can help.
    pub fn is_retryable(&self) -> bool {
        matches!(self, QueueError::Unavailable(_))
    }
}

/// Result alias for this crate.
pub type Result<T, E = QueueError> = std::result::Result<T, E>;

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
    /// calls that are safe to repeat; see [`JobQueue`] for which those are.
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

/// Checks what the queue cannot check for itself.
pub(crate) fn validate(job: &NewJob) -> Result<()> {
    let invalid = |field, message: &str| {
        Err(QueueError::Invalid {
            field,
            message: message.to_string(),
        })
    };
    if job.tenant.is_empty() || job.tenant.contains([':', '{', '}']) {
        return invalid("tenant", "must be non-empty without ':', '{' or '}'");
    }
    if job.priority > 9 {
        return invalid("priority", "must be 0 to 9");
    }
    if job.gpus == 0 {
        return invalid("gpus", "must be at least 1");
    }
    if job.max_attempts == 0 {
        return invalid("max_attempts", "must be at least 1");
    }
    if job.pools.iter().any(|p| p.is_empty() || p.contains(',')) {
        return invalid("pools", "names must be non-empty without ','");
    }
    Ok(())
}
