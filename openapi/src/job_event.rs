//! The vocabulary of a job's event log, declared once: what happened ([`EventKind`]) and,
//! for an attempt that stopped, who stopped it ([`StopCause`]).
//!
//! The queue's Lua scripts store these codes (the library they run is built with a
//! table generated from [`EventKind::ALL`] and [`StopCause::ALL`], and a test holds
//! every script's use against it), the dispatcher and the API match them exhaustively,
//! and an event's message is rendering only: rewording it changes no behaviour.

use serde::{Deserialize, Serialize};

/// What an event of a job's log says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The job was accepted.
    Queued,
    /// A dispatcher claimed it for a pool (the event's `pool`).
    Leased,
    /// Its attempt started.
    Started,
    /// Its attempt stopped before the end (the event's `stop` says who stopped it); the
    /// job is back in its place in line.
    Preempted,
    /// Its attempt found no node within the pool's placement timeout; back in line.
    Unplaced,
    /// It may from now on run only on some of its pools.
    Moved,
    /// Its attempt stopped renewing its lease.
    LeaseExpired,
    /// That attempt reported in again.
    LeaseRecovered,
    /// A dispatcher found that attempt alive and kept it.
    Adopted,
    /// That attempt was gone; the job is back in line.
    Requeued,
    /// An attempt failed (the event's `failure`); another one is due later.
    RetryScheduled,
    /// The job failed for good (the event's `failure`).
    Failed,
    /// The tenant cancelled while an attempt runs.
    CancelRequested,
    /// The job was cancelled.
    Cancelled,
    /// The tenant asked for a pause while an attempt runs: it is being stopped after a
    /// checkpoint.
    PauseRequested,
    /// The job was paused: it holds no machine until resumed.
    Paused,
    /// The tenant resumed the paused job: it is back in line, and its next attempt
    /// starts from its last checkpoint.
    Unpaused,
    /// The job succeeded.
    Succeeded,
    /// A trainer's report: the attempt loaded its data and model (the event's `data`).
    TrainingStarted,
    /// A trainer's report: it resumed from a checkpoint.
    Resumed,
    /// A trainer's report: a sample of the training metrics.
    Metrics,
    /// A trainer's report: a validation loss.
    Eval,
    /// A trainer's report: a checkpoint was written.
    Checkpoint,
    /// A trainer's report: early stopping kept the best validated step's adapter.
    EarlyStopped,
    /// A trainer's warning (the message).
    Warning,
}

impl EventKind {
    /// Every kind, in the order declared.
    pub const ALL: &'static [Self] = &[
        Self::Queued,
        Self::Leased,
        Self::Started,
        Self::Preempted,
        Self::Unplaced,
        Self::Moved,
        Self::LeaseExpired,
        Self::LeaseRecovered,
        Self::Adopted,
        Self::Requeued,
        Self::RetryScheduled,
        Self::Failed,
        Self::CancelRequested,
        Self::Cancelled,
        Self::PauseRequested,
        Self::Paused,
        Self::Unpaused,
        Self::Succeeded,
        Self::TrainingStarted,
        Self::Resumed,
        Self::Metrics,
        Self::Eval,
        Self::Checkpoint,
        Self::EarlyStopped,
        Self::Warning,
    ];

    /// Its stable code, as the log stores it.
    pub fn code(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Leased => "leased",
            Self::Started => "started",
            Self::Preempted => "preempted",
            Self::Unplaced => "unplaced",
            Self::Moved => "moved",
            Self::LeaseExpired => "lease_expired",
            Self::LeaseRecovered => "lease_recovered",
            Self::Adopted => "adopted",
            Self::Requeued => "requeued",
            Self::RetryScheduled => "retry_scheduled",
            Self::Failed => "failed",
            Self::CancelRequested => "cancel_requested",
            Self::Cancelled => "cancelled",
            Self::PauseRequested => "pause_requested",
            Self::Paused => "paused",
            Self::Unpaused => "unpaused",
            Self::Succeeded => "succeeded",
            Self::TrainingStarted => "training_started",
            Self::Resumed => "resumed",
            Self::Metrics => "metrics",
            Self::Eval => "eval",
            Self::Checkpoint => "checkpoint",
            Self::EarlyStopped => "early_stopped",
            Self::Warning => "warning",
        }
    }

    /// The kind with this code (None: a code this build does not know).
    pub fn parse(code: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|k| k.code() == code)
    }

    /// Whether the queue's scripts write it (the rest come from trainers' reports).
    pub fn is_written_by_queue(self) -> bool {
        !matches!(
            self,
            Self::TrainingStarted
                | Self::Resumed
                | Self::Metrics
                | Self::Eval
                | Self::Checkpoint
                | Self::EarlyStopped
                | Self::Warning
        )
    }
}

/// Who stopped an attempt that ended in a `preempted` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopCause {
    /// The platform took its machine away or stopped it from outside (a spot reclaim, a
    /// drain, an eviction, SIGTERM from anyone but this service).
    Preemption,
    /// This service's own shutdown stopped it.
    Shutdown,
    /// A restarted dispatcher found it left over and stopped it.
    Restart,
    /// Its tenant paused the job (the queue pauses it rather than requeue it).
    Pause,
}

impl StopCause {
    /// Every cause, in the order declared.
    pub const ALL: &'static [Self] =
        &[Self::Preemption, Self::Shutdown, Self::Restart, Self::Pause];

    /// Its stable code, as the log stores it.
    pub fn code(self) -> &'static str {
        match self {
            Self::Preemption => "preemption",
            Self::Shutdown => "shutdown",
            Self::Restart => "restart",
            Self::Pause => "pause",
        }
    }

    /// The cause with this code.
    pub fn parse(code: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.code() == code)
    }

    /// Whether it says something about the pool's capacity: only the platform's own
    /// preemptions count towards moving a job on to its other pools.
    pub fn is_the_platforms(self) -> bool {
        matches!(self, Self::Preemption)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_serde() {
        for kind in EventKind::ALL {
            assert_eq!(EventKind::parse(kind.code()), Some(*kind));
            assert_eq!(
                serde_json::to_value(kind).ok(),
                Some(serde_json::Value::String(kind.code().into()))
            );
        }
        for cause in StopCause::ALL {
            assert_eq!(StopCause::parse(cause.code()), Some(*cause));
            assert_eq!(
                serde_json::to_value(cause).ok(),
                Some(serde_json::Value::String(cause.code().into()))
            );
        }
        assert_eq!(EventKind::parse("Queued"), None);
    }
}
