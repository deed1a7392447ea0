//! Why a job failed, as a type: the trainer names its class in its exit code and its
//! report, the dispatcher carries it, the queue stores its code next to the reason, and
//! the API shows the code to the tenant as `error.code`. No reader ever tells a failure
//! by its sentence: the reason is rendering only.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Why a job failed: every `error.code` a failed job can show. `training_failed`: its
/// attempts crashed as often as its budget allows. `invalid_training_input`: its data,
/// settings, model or memory can never train (not retried). `training_diverged`: the
/// loss became NaN or infinite (not retried; lower the learning rate). `job_lost`: its
/// attempts vanished without a word too often, or its queue record is gone.
/// `pool_misconfigured`: the platform refused to start it as its pool describes it
/// (an operator must fix the pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// An attempt crashed (or the platform could not run it) as many times as the job's
    /// attempt budget allows.
    TrainingFailed,
    /// The job's input can never train (its data, its settings, its model, the memory
    /// it needs): failed at the first attempt, never retried.
    InvalidTrainingInput,
    /// The loss became NaN or infinite: the same data, settings and seed diverge again,
    /// so it is never retried; a lower learning rate is the cure.
    TrainingDiverged,
    /// The job's attempts vanished without a word (no report, no exit) as many times as
    /// the queue allows, or its queue record is gone.
    JobLost,
    /// The platform refused to start the attempt as the pool describes it (a Job the
    /// cluster's API server answers with 4xx, a pool whose Job cannot be built): only
    /// the operator can help, by fixing the pool. The tenant is told so, never the
    /// platform's own words, which go to the operator's log.
    PoolMisconfigured,
}

impl FailureClass {
    /// Every class, in the order declared.
    pub const ALL: &'static [Self] = &[
        Self::TrainingFailed,
        Self::InvalidTrainingInput,
        Self::TrainingDiverged,
        Self::JobLost,
        Self::PoolMisconfigured,
    ];

    /// Its stable code: stored by the queue, shown to tenants as `error.code`.
    pub fn code(self) -> &'static str {
        match self {
            Self::TrainingFailed => "training_failed",
            Self::InvalidTrainingInput => "invalid_training_input",
            Self::TrainingDiverged => "training_diverged",
            Self::JobLost => "job_lost",
            Self::PoolMisconfigured => "pool_misconfigured",
        }
    }

    /// The class with this code (None: a code this build does not know).
    pub fn parse(code: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.code() == code)
    }

    /// Whether another attempt may succeed where this one failed (within the job's
    /// budget): only a crash is worth retrying.
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::TrainingFailed)
    }
}

impl std::fmt::Display for FailureClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_serde() {
        for class in FailureClass::ALL {
            assert_eq!(FailureClass::parse(class.code()), Some(*class));
            assert_eq!(
                serde_json::to_value(class).ok(),
                Some(serde_json::Value::String(class.code().into()))
            );
        }
        assert_eq!(FailureClass::parse("invalid_training_file"), None);
    }
}
