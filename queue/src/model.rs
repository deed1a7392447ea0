//! The job record, its states, and what callers pass in and get back.

use serde::{Deserialize, Serialize};
use tuneq_openapi::{EventKind, FailureClass, StopCause};

/// A job's identifier inside the queue (`j` and 12 digits: lexical order is arrival order).
pub type JobId = String;

/// Where a job is in its life. Public names (OpenAI's) come from [`JobState::public_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting in its tenant's line.
    Queued,
    /// Failed an attempt; waiting for its retry time.
    Delayed,
    /// Claimed by a dispatcher, capacity reserved; the attempt is being started.
    Leased,
    /// The attempt is running and heartbeating.
    Running,
    /// The lease ran out; the dispatcher must adopt the attempt or requeue the job.
    Suspect,
    /// Cancel was asked while an attempt lives; capacity is held until it is gone.
    CancelRequested,
    /// Set aside by its tenant: in no line and holding nothing until resumed; its next
    /// attempt resumes from its last checkpoint.
    Paused,
    /// Finished with an adapter.
    Succeeded,
    /// Out of attempts, stalled too often, or failed for a reason retrying cannot fix.
    Failed,
    /// Cancelled.
    Cancelled,
}

impl JobState {
    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => Self::Queued,
            "delayed" => Self::Delayed,
            "leased" => Self::Leased,
            "running" => Self::Running,
            "suspect" => Self::Suspect,
            "cancel_requested" => Self::CancelRequested,
            "paused" => Self::Paused,
            "succeeded" => Self::Succeeded,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            _ => return None,
        })
    }

    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Delayed => "delayed",
            Self::Leased => "leased",
            Self::Running => "running",
            Self::Suspect => "suspect",
            Self::CancelRequested => "cancel_requested",
            Self::Paused => "paused",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// OpenAI's status names. Retries, preemptions and lost leases stay internal: a job
    /// waiting for any reason is `queued`, one with a live attempt is `running`.
    pub fn public_status(self) -> tuneq_openapi::JobStatus {
        use tuneq_openapi::JobStatus;
        match self {
            Self::Queued | Self::Delayed => JobStatus::Queued,
            Self::Leased | Self::Running | Self::Suspect | Self::CancelRequested => {
                JobStatus::Running
            }
            Self::Succeeded => JobStatus::Succeeded,
            Self::Failed => JobStatus::Failed,
            Self::Cancelled => JobStatus::Cancelled,
            Self::Paused => JobStatus::Paused,
        }
    }

    /// Whether the job will never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A job to enqueue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewJob {
    /// The owning tenant (checked by the API).
    pub tenant: String,
    /// 0 (lowest) to 9 (most urgent); waiting jobs age one level per aging horizon.
    pub priority: u8,
    /// Node pools that may run it (empty: any).
    pub pools: Vec<String>,
    /// Accelerators (or CPU slots) one attempt occupies.
    pub gpus: u32,
    /// Estimated run time in seconds (0: unknown), the cost charged for fairness.
    pub estimated_seconds: u64,
    /// Attempts before the job fails for good (preemptions do not count).
    pub max_attempts: u32,
    /// What to run (opaque to the queue; the API stores a `TrainSpec` and job metadata).
    pub payload: String,
    /// A retried request with the same key (per tenant) returns the same job.
    pub idempotency_key: Option<String>,
    /// Put a delivery in the outbox when the job finishes (the API sets it for jobs
    /// with a webhook).
    pub notify: bool,
}

/// A notice waiting in the outbox: job `job_id` reached `state`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The job.
    pub job_id: JobId,
    /// The state it reached (`succeeded`, `failed`, `cancelled`).
    pub state: JobState,
    /// Its tenant.
    pub tenant: String,
    /// When it is (next) due, queue clock (ms).
    pub due_ms: u64,
}

impl Delivery {
    /// Its identity in the outbox and the send queues: job, state and tenant.
    pub fn member(&self) -> String {
        format!("{}|{}|{}", self.job_id, self.state.as_str(), self.tenant)
    }
}

/// Answer to an enqueue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enqueued {
    /// The job.
    pub id: JobId,
    /// True when the idempotency key matched an earlier job (nothing new was queued).
    pub duplicate: bool,
}

/// A claimed job: the right, fenced by `token`, to run one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The job.
    pub id: JobId,
    /// Fencing token: every later call for this attempt carries it; a newer lease or a
    /// cancel makes it stale.
    pub token: u64,
    /// The owning tenant.
    pub tenant: String,
    /// What to run.
    pub payload: String,
    /// Failed attempts so far.
    pub attempts: u32,
    /// Preemptions so far.
    pub preemptions: u32,
    /// When the lease runs out unless renewed (queue clock, ms).
    pub deadline_ms: u64,
}

/// A renewed lease: when it runs out, and whether the attempt is to stop for a pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    /// When the lease runs out unless renewed again (queue clock, ms).
    pub deadline_ms: u64,
    /// The tenant asked for a pause: stop the attempt after a checkpoint and report it
    /// stopped ([`crate::JobQueue::preempt`]), which pauses the job.
    pub pause_requested: bool,
    /// The report's progress and events were recorded by this call; false for a repeat
    /// of a report recorded before (a retry after a lost reply), which records nothing.
    pub recorded: bool,
}

/// What a lost attempt turned out to be, decided by the dispatcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuspectVerdict {
    /// The attempt is alive: keep running it.
    Adopt,
    /// The attempt is gone: put the job back in line.
    Requeue,
}

/// A job as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// The job.
    pub id: JobId,
    /// The owning tenant.
    pub tenant: String,
    /// Current state.
    pub state: JobState,
    /// 0–9.
    pub priority: u8,
    /// Allowed pools.
    pub pools: Vec<String>,
    /// Accelerators per attempt.
    pub gpus: u32,
    /// What to run.
    pub payload: String,
    /// Failed attempts.
    pub attempts: u32,
    /// Attempt budget.
    pub max_attempts: u32,
    /// Times its machine was taken away.
    pub preemptions: u32,
    /// Times its attempt vanished without a word.
    pub stalls: u32,
    /// Current fencing epoch (the live token, when an attempt holds the lease).
    pub epoch: u64,
    /// Its tenant asked for a pause while an attempt lives: the attempt is being
    /// stopped after a checkpoint, and the job is paused once it is gone.
    #[serde(default)]
    pub pause_requested: bool,
    /// Pool of the live attempt.
    pub pool: Option<String>,
    /// When it was accepted (ms).
    pub enqueued_ms: u64,
    /// When it finished (ms).
    pub finished_ms: Option<u64>,
    /// When a delayed job may run again (ms).
    pub due_ms: Option<u64>,
    /// Latest progress the attempt reported (JSON).
    pub progress: Option<String>,
    /// Result of a succeeded job (JSON).
    pub result: Option<String>,
    /// Last failure reason.
    pub error: Option<String>,
    /// The class of the last failure, when the dispatcher named one (the reason is then
    /// its rendering, never what a reader matches on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureClass>,
}

/// One entry of a job's event log. What happened is typed ([`EventKind`] and the fields
/// beside it); `message` is for people only, and rewording it changes no behaviour.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobEvent {
    /// Position in the job's log (1, 2, …): the cursor.
    pub seq: u64,
    /// Queue-clock time (ms).
    pub at_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// `leased`: the pool the job was leased on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// `preempted`: who stopped the attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopCause>,
    /// `failed`, `retry_scheduled`: the class of the failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureClass>,
    /// A trainer's report: the entry's fields (see `tuneq_openapi::LogEntry`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
    /// Details, for people.
    pub message: String,
}

/// An event a caller appends to a job's log (a trainer's report, through the API).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NewEvent<'a> {
    /// What happened.
    pub kind: EventKind,
    /// Details, for people ("" for none).
    pub message: &'a str,
    /// Its fields as a JSON object, when it has any.
    pub data: Option<&'a serde_json::Value>,
}

/// Where a queued job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Jobs of the same tenant ahead of it.
    pub ahead_in_tenant: u64,
    /// Estimated jobs ahead of it overall, given other tenants' weights.
    pub ahead: u64,
    /// When it should start (queue clock, ms), from the capacity and average run time
    /// of the pools it may use; None until a job has finished on one of them.
    pub estimated_start_ms: Option<u64>,
}

/// Per-tenant settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantSettings {
    /// Share of capacity relative to other tenants (default 1).
    pub weight: f64,
    /// Most accelerators its jobs may hold at once (None: no limit).
    pub max_running: Option<u32>,
    /// Most jobs it may have waiting (None: no limit).
    pub max_waiting: Option<u32>,
}

impl Default for TenantSettings {
    fn default() -> Self {
        Self {
            weight: 1.0,
            max_running: None,
            max_waiting: None,
        }
    }
}

/// Pool usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    /// Accelerators in the pool.
    pub capacity: u32,
    /// Accelerators held by leases (including attempts being cancelled).
    pub used: u32,
}

/// Everything a backend holds, for invariant checks in tests and for operators'
/// diagnostics. Reads the whole domain: never on a hot path.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inspection {
    /// Every stored job, with the indexes it is a member of (`ready`, `delayed`,
    /// `leases`, `suspect`, `cancelling`, `done`, `dead`).
    pub jobs: Vec<(JobRecord, Vec<&'static str>)>,
    /// Every configured pool.
    pub pools: Vec<(String, PoolUsage)>,
    /// Tenants the scheduler currently serves (those it believes have waiting jobs).
    pub active_tenants: std::collections::BTreeSet<String>,
    /// Tenants that really have a job in their waiting line.
    pub tenants_with_waiting: std::collections::BTreeSet<String>,
}
