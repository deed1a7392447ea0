//! The Kubernetes runtime's pure parts: what an attempt's `batch/v1` Job and Secret look
//! like, and how the Job and its pods, as the API server reports them, are read back as the
//! attempt's end.
//!
//! One attempt is one Job, named from the job id and the attempt number, with
//! `restartPolicy: Never`, `backoffLimit: 0` and a `podFailurePolicy` that fails the Job at
//! once on a disruption (rule [`RULE_DISRUPTION`]) or on the trainer's "bad input" exit
//! code (rule [`RULE_BAD_INPUT`]). Retries belong to the dispatcher, which knows the
//! checkpoint, the budgets and the next pool; the Job controller never retries. The
//! attempt's spec and report credential travel in a per-attempt Secret, owned by the Job
//! so it is garbage-collected with it; the credential never appears in the Job.
//!
//! Nothing here talks to a cluster: these functions build and read `k8s-openapi` objects,
//! so they are tested on object shapes written down from the Kubernetes sources and docs.
//!
//! Layout:
//! - [`runtime`]: the [`crate::runtime::Runtime`] that creates, reads and deletes them
//!   through the API server.
//! - `observe`: the watches of the pool's Jobs and pods that the runtime reads from.
//! - [`job`]: names, labels, the attempt Job and its Secret.
//! - [`classify`](mod@classify): the first-match table from a Job and its pods to an
//!   [`AttemptEnd`], and the double-run guard's view of which pods are still alive.

pub mod classify;
pub mod job;
mod observe;
pub mod runtime;

pub use classify::{AttemptEnd, Limits, classify, non_terminal_pods, pod_is_terminal};
pub use job::{
    AttemptLaunch, BuildError, build_job, build_secret, check_pool, job_name, secret_name,
};
pub use runtime::{KubernetesRuntime, KubernetesSettings, connect};

/// Label every object tuneq creates carries: `app.kubernetes.io/managed-by=tuneq`.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The value of [`LABEL_MANAGED_BY`].
pub const MANAGED_BY: &str = "tuneq";
/// Label naming what the pod runs: `app.kubernetes.io/name=tuneq-trainer`.
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
/// The value of [`LABEL_NAME`].
pub const TRAINER_APP: &str = "tuneq-trainer";
/// Label holding the training job's id (hashed when it is no valid label value).
pub const LABEL_JOB_ID: &str = "tuneq.io/job-id";
/// Label holding the attempt number.
pub const LABEL_ATTEMPT: &str = "tuneq.io/attempt";
/// Label holding the pool's name.
pub const LABEL_POOL: &str = "tuneq.io/pool";
/// Label holding the tenant (hashed when it is no valid label value).
pub const LABEL_TENANT: &str = "tuneq.io/tenant";
/// Annotation holding the attempt's fencing token from the queue lease: a Job whose token
/// differs from the live attempt's is never adopted.
pub const ANNOTATION_ATTEMPT_UID: &str = "tuneq.io/attempt-uid";
/// Annotation holding the sha256 of the attempt's spec.
pub const ANNOTATION_SPEC_HASH: &str = "tuneq.io/spec-hash";
/// Annotation holding the job id as it is (its label may be shortened or hashed).
pub const ANNOTATION_JOB_ID: &str = "tuneq.io/job-id";
/// The label selector of every list and watch the runtime makes.
pub const MANAGED_SELECTOR: &str = "app.kubernetes.io/managed-by=tuneq";

/// The trainer container's name; rule [`RULE_BAD_INPUT`] matches on it.
pub const CONTAINER: &str = "trainer";

/// Index of the `podFailurePolicy` rule that fails the Job when a pod has the condition
/// `DisruptionTarget=True` (spot preemption, eviction, drain, node gone). The Job's
/// failure message ends in `matching FailJob rule at index 0`.
pub const RULE_DISRUPTION: usize = 0;
/// Index of the rule that fails the Job when the trainer exits with
/// [`tuneq_openapi::launch::EXIT_BAD_INPUT`] or [`tuneq_openapi::launch::EXIT_DIVERGED`]
/// (the classifier tells them apart by the pod's exit code).
pub const RULE_BAD_INPUT: usize = 1;
