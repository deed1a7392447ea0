//! The queue's errors: what failed, and whether retrying the same call can help. A
//! backend's own error is kept as the cause ([`BackendError`]), so logs and the CLI
//! show the whole chain.

use crate::embedded::StoreError;
use crate::model::{JobId, JobState};

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
    #[error("job {id} is {}, which does not allow {operation}", .state.map_or("in another state", JobState::as_str))]
    WrongState {
        /// The job.
        id: JobId,
        /// Its state, when the refusal said.
        state: Option<JobState>,
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
    #[error("queue backend unavailable")]
    Unavailable(#[source] BackendError),
    /// The backend answered with an error of its own (a Redis error reply, a script
    /// error, a reply of another type than asked for): a definite outcome that
    /// repeating the call does not change.
    #[error("queue backend call failed")]
    Failed(#[source] BackendError),
    /// The backend answered something this version does not understand.
    #[error("queue backend answered unexpectedly: {0}")]
    Protocol(String),
}

/// What a backend call failed with, kept as it came.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Redis, or the connection to it.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// A reply of another type than the one asked for.
    #[error(transparent)]
    Reply(#[from] redis::ParsingError),
    /// The embedded store.
    #[error(transparent)]
    Embedded(#[from] StoreError),
    /// A task doing the call stopped before it answered (it panicked or its runtime
    /// shut down).
    #[error("the task making the queue call stopped before it answered")]
    Task(#[from] tokio::task::JoinError),
}

impl QueueError {
    /// Whether retrying the same call (with the same idempotency key / request id) can help.
    pub fn is_retryable(&self) -> bool {
        matches!(self, QueueError::Unavailable(_))
    }

    /// A Redis error as the queue sees it: a lost connection, a timeout or a server that
    /// cannot answer yet is an unknown outcome ([`QueueError::Unavailable`], worth a
    /// retry by whoever can retry safely); anything else is a definite refusal.
    pub(crate) fn from_redis(e: redis::RedisError) -> Self {
        match e.retry_method() {
            redis::RetryMethod::NoRetry => QueueError::Failed(e.into()),
            _ => QueueError::Unavailable(e.into()),
        }
    }

    /// An embedded store error as the queue sees it: a refused command or script is a
    /// definite failure; a file that cannot be written (or failed before) leaves the
    /// outcome unknown.
    pub(crate) fn from_store(e: StoreError) -> Self {
        match e {
            StoreError::Command(_) => QueueError::Failed(e.into()),
            other => QueueError::Unavailable(other.into()),
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = QueueError> = std::result::Result<T, E>;
