//! The launch contract between a dispatcher and the trainer it starts — written once,
//! followed by the local runtime (a child process), the Kubernetes runtime (a Job's
//! container) and `tuneq train` itself.
//!
//! A trainer is started as `tuneq train --spec <file> --progress json` ([`trainer_args`])
//! with the environment named below, and ends with one of these exit codes:
//!
//! | code | meaning | the dispatcher |
//! |---|---|---|
//! | 0 ([`EXIT_FINISHED`]) | finished; the adapter is committed and reported | nothing: the trainer's final report already completed the job (the API's report route); without that report, fails it (retried) |
//! | 75 ([`EXIT_INTERRUPTED`]) | stopped from outside (SIGTERM: a preemption notice, a shutdown) after a checkpoint | requeues the job in place, no retry spent; the next attempt resumes |
//! | 42 ([`EXIT_BAD_INPUT`]) | the input can never train (data, spec, model, memory) | fails the job (`invalid_training_input`), never retried |
//! | 43 ([`EXIT_DIVERGED`]) | the loss became NaN or infinite | fails the job (`training_diverged`), never retried |
//! | 76 ([`EXIT_SUPERSEDED`]) | the control plane said this attempt is no longer live | nothing: another attempt owns the job |
//! | anything else, or killed by a signal other than SIGTERM | a crash | retries from the last checkpoint, within the job's budget (then `training_failed`) |
//!
//! The exit code is the failure's class ([`TrainerExit::failure`]); with `--progress
//! json` the trainer also prints it as the `failure` field of its last line (`{"error":
//! {…}}`), for people and log collectors. Nobody reads the class from stderr's prose.
//!
//! A trainer never exits 0 after SIGTERM: Kubernetes would mark its Job Complete.

use crate::FailureClass;

/// Finished: the adapter is written and the final report delivered.
pub const EXIT_FINISHED: i32 = 0;
/// Stopped from outside after a checkpoint (`EX_TEMPFAIL`): a preemption, never a failure.
pub const EXIT_INTERRUPTED: i32 = 75;
/// The input can never train: not retried. Kubernetes pools match it in the Job's
/// `podFailurePolicy`.
pub const EXIT_BAD_INPUT: i32 = 42;
/// The loss became NaN or infinite: not retried (the same run diverges again).
/// Kubernetes pools match it in the Job's `podFailurePolicy` too.
pub const EXIT_DIVERGED: i32 = 43;
/// The attempt was superseded or cancelled: it stopped without writing anything more.
pub const EXIT_SUPERSEDED: i32 = 76;
/// What a shell reports for a process killed by SIGTERM (128 + 15); a container runtime
/// reports the same for a trainer that died of the signal before it could checkpoint.
pub const EXIT_KILLED_BY_SIGTERM: i32 = 143;

/// Where the trainer posts its progress reports (`…/internal/attempts/{job}/report`).
pub const ENV_REPORT_URL: &str = "TUNEQ_REPORT_URL";
/// The attempt's credential for those reports (a bearer token scoped to the attempt).
pub const ENV_REPORT_CREDENTIAL: &str = "TUNEQ_REPORT_CREDENTIAL";
/// Cache of remote models and datasets.
pub const ENV_CACHE_DIR: &str = "TUNEQ_CACHE_DIR";
/// The process that started the trainer (local runtime): when it dies the trainer
/// checkpoints and stops.
pub const ENV_PARENT_PID: &str = "TUNEQ_PARENT_PID";
/// Memory the attempt may use, in bytes: past it the trainer stops as bad input, with
/// the figures.
pub const ENV_MEMORY_LIMIT_BYTES: &str = "TUNEQ_MEMORY_LIMIT_BYTES";
/// Memory of the one accelerator the attempt trains on, in bytes (GPU pools): with
/// `activation_checkpointing: auto`, the trainer recomputes layers when keeping them
/// would not fit in it.
pub const ENV_ACCELERATOR_MEMORY_BYTES: &str = "TUNEQ_ACCELERATOR_MEMORY_BYTES";
/// The object store's settings file (endpoints, path style), when not the default.
pub const ENV_STORAGE_CONFIG: &str = "TUNEQ_STORAGE_CONFIG";

/// The `tuneq` arguments that start a trainer on the spec at `spec_path`.
pub fn trainer_args(spec_path: &str) -> Vec<String> {
    ["train", "--spec", spec_path, "--progress", "json"]
        .map(String::from)
        .to_vec()
}

/// How a trainer ended, by the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainerExit {
    /// Exit 0.
    Finished,
    /// Exit 75, or death by SIGTERM: stopped from outside; requeue in place.
    Interrupted,
    /// Exit 42: fail the job for good.
    BadInput,
    /// Exit 43: the run diverged; fail the job for good.
    Diverged,
    /// Exit 76: nothing to report.
    Superseded,
    /// Anything else: retry from the last checkpoint. The exit code, or the signal.
    Crashed {
        /// The exit code, when it exited.
        code: Option<i32>,
        /// The signal that killed it, when one did.
        signal: Option<i32>,
    },
}

/// SIGTERM's number on Linux.
const SIGTERM: i32 = 15;

impl TrainerExit {
    /// Reads an exit code (a container's, or a process's) or the signal that killed it.
    pub fn from_status(code: Option<i32>, signal: Option<i32>) -> Self {
        match (code, signal) {
            (Some(EXIT_FINISHED), _) => Self::Finished,
            (Some(EXIT_INTERRUPTED | EXIT_KILLED_BY_SIGTERM), _) | (None, Some(SIGTERM)) => {
                Self::Interrupted
            }
            (Some(EXIT_BAD_INPUT), _) => Self::BadInput,
            (Some(EXIT_DIVERGED), _) => Self::Diverged,
            (Some(EXIT_SUPERSEDED), _) => Self::Superseded,
            (code, signal) => Self::Crashed { code, signal },
        }
    }
}

impl TrainerExit {
    /// The exit code a trainer that failed as `class` exits with (None: a class a
    /// trainer never reports, or a crash, which exits 1).
    pub fn code_for(class: FailureClass) -> Option<i32> {
        match class {
            FailureClass::InvalidTrainingInput => Some(EXIT_BAD_INPUT),
            FailureClass::TrainingDiverged => Some(EXIT_DIVERGED),
            FailureClass::TrainingFailed
            | FailureClass::JobLost
            | FailureClass::PoolMisconfigured => None,
        }
    }

    /// The failure this end is (None: not a failure).
    pub fn failure(self) -> Option<FailureClass> {
        match self {
            Self::Finished | Self::Interrupted | Self::Superseded => None,
            Self::BadInput => Some(FailureClass::InvalidTrainingInput),
            Self::Diverged => Some(FailureClass::TrainingDiverged),
            Self::Crashed { .. } => Some(FailureClass::TrainingFailed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_read_as_the_contract_says() {
        let table = [
            ((Some(0), None), TrainerExit::Finished),
            ((Some(75), None), TrainerExit::Interrupted),
            ((Some(143), None), TrainerExit::Interrupted),
            ((None, Some(15)), TrainerExit::Interrupted),
            ((Some(42), None), TrainerExit::BadInput),
            ((Some(43), None), TrainerExit::Diverged),
            ((Some(76), None), TrainerExit::Superseded),
            (
                (Some(1), None),
                TrainerExit::Crashed {
                    code: Some(1),
                    signal: None,
                },
            ),
            (
                (Some(137), None),
                TrainerExit::Crashed {
                    code: Some(137),
                    signal: None,
                },
            ),
            (
                (None, Some(9)),
                TrainerExit::Crashed {
                    code: None,
                    signal: Some(9),
                },
            ),
        ];
        for ((code, signal), expected) in table {
            assert_eq!(
                TrainerExit::from_status(code, signal),
                expected,
                "{code:?} {signal:?}"
            );
        }
    }

    #[test]
    fn a_failure_class_round_trips_through_the_exit_code() {
        for class in FailureClass::ALL {
            if let Some(code) = TrainerExit::code_for(*class) {
                assert_eq!(
                    TrainerExit::from_status(Some(code), None).failure(),
                    Some(*class)
                );
            }
        }
    }
}
