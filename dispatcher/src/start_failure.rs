//! How an attempt that could not be started is told to its job, and so to its tenant.
//!
//! A runtime's error may carry the platform's own words: a Kubernetes API `Status` names
//! the Job's fields, its namespace and the cluster's addresses. Those go to the
//! operator's log only. The job gets a sentence without them, a class the API shows as a
//! stable code, and whether another attempt can help.

use crate::DispatchError;
use tuneq_openapi::FailureClass;

/// What a job is told when its attempt could not be started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartFailure {
    /// The failure's class, which the API shows as the job's `error.code`.
    pub class: FailureClass,
    /// The reason the job (and its tenant) is given.
    pub reason: String,
    /// Whether another attempt can help.
    pub retryable: bool,
}

/// Whether an API server's answer `code` refuses the request as sent, so that sending
/// it again cannot help until someone changes the pool or the cluster: a 4xx other
/// than a timeout (408), a conflict (409: an object on its way out) or throttling (429).
fn refused(code: u16) -> bool {
    (400..500).contains(&code) && !matches!(code, 408 | 409 | 429)
}

impl StartFailure {
    /// How `error`, from starting an attempt on `pool`, is told to the job.
    ///
    /// A pool whose Job cannot be built, or that the API server refuses, is
    /// misconfigured. An invalid Job (400, 422) fails the job at once: only a changed
    /// pools file can help. A refusal the cluster's state may lift (401, 403, 404: a
    /// grant, a namespace) is retried within the job's budget.
    pub fn of(error: &DispatchError, pool: &str) -> Self {
        let misconfigured = |retryable| Self {
            class: FailureClass::PoolMisconfigured,
            reason: format!(
                "pool {pool} is misconfigured: the cluster refused to start the attempt; an operator must fix the pool (the dispatcher's log has the details)"
            ),
            retryable,
        };
        match error {
            DispatchError::Build(_) => misconfigured(false),
            DispatchError::Kubernetes {
                source: kube::Error::Api(status),
                ..
            } if refused(status.code) => misconfigured(!matches!(status.code, 400 | 422)),
            DispatchError::Kubernetes { .. } => Self {
                class: FailureClass::TrainingFailed,
                reason: format!(
                    "pool {pool}: the cluster could not start the attempt (the dispatcher's log has the details)"
                ),
                retryable: true,
            },
            other => Self {
                class: FailureClass::TrainingFailed,
                reason: other.to_string(),
                retryable: true,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn api(code: u16, reason: &str) -> DispatchError {
        let message = "Job.batch \"tq-j1-a1\" is invalid: spec.template.spec.nodeSelector: Invalid value: \"a/b/c\"";
        DispatchError::Kubernetes {
            what: "create the attempt's Job",
            source: kube::Error::Api(Status::failure(message, reason).with_code(code).boxed()),
        }
    }

    #[test]
    fn an_invalid_job_is_a_misconfigured_pool_told_without_the_apis_words() {
        for (code, reason, retryable) in [
            (422, "Invalid", false),
            (400, "BadRequest", false),
            (403, "Forbidden", true),
            (404, "NotFound", true),
        ] {
            let failure = StartFailure::of(&api(code, reason), "l4");
            assert_eq!(failure.class, FailureClass::PoolMisconfigured, "{code}");
            assert_eq!(failure.retryable, retryable, "{code}");
            for internal in [
                "nodeSelector",
                "tq-j1",
                "Invalid",
                "Status",
                &code.to_string(),
            ] {
                assert!(
                    !failure.reason.contains(internal),
                    "{internal}: {}",
                    failure.reason
                );
            }
            assert!(
                failure.reason.contains("pool l4 is misconfigured"),
                "{}",
                failure.reason
            );
        }
    }

    #[test]
    fn passing_refusals_and_server_errors_are_retried_without_the_apis_words() {
        for (code, reason) in [
            (429, "TooManyRequests"),
            (409, "Conflict"),
            (500, "InternalError"),
        ] {
            let failure = StartFailure::of(&api(code, reason), "l4");
            assert_eq!(failure.class, FailureClass::TrainingFailed, "{code}");
            assert!(failure.retryable, "{code}");
            assert!(
                !failure.reason.contains("nodeSelector"),
                "{}",
                failure.reason
            );
        }
    }

    #[test]
    fn a_job_that_cannot_be_built_is_a_misconfigured_pool() {
        let clash = crate::kubernetes::BuildError::VolumeClash {
            pool: "l4".into(),
            index: 0,
            volume: "scratch".into(),
            what: "mount path /tmp".into(),
        };
        let failure = StartFailure::of(&DispatchError::Build(clash), "l4");
        assert_eq!(failure.class, FailureClass::PoolMisconfigured);
        assert!(!failure.retryable);
        assert!(!failure.reason.contains("/tmp"), "{}", failure.reason);
    }
}
