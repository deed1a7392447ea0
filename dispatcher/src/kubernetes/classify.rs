//! How an attempt stands, read from its Job and pods as the API server reports them.
//!
//! [`classify`] walks one table, first match wins (the research note's §B.7, with the
//! launch contract's exit codes):
//!
//! | # | observation | [`AttemptEnd`] |
//! |---|---|---|
//! | 1 | Job `Complete` (or `SuccessCriteriaMet`) | `Succeeded` |
//! | 2 | Job `Failed`/`FailureTarget`, reason `DeadlineExceeded` | `DeadlineExceeded` |
//! | 3 | … reason `PodFailurePolicy`, `… matching FailJob rule at index 0` | `Preempted` |
//! | 4 | … reason `PodFailurePolicy`, `… at index 1` | `Diverged` if the trainer exited 43, else `BadInput` |
//! | 5 | Job `Suspended=True` (Kueue) | `Suspended` |
//! | 6 | a failed pod with `DisruptionTarget=True`, or failed as `Evicted`, `Terminated` by a node shutdown, `NodeShutdown`, `UnexpectedAdmissionError`, `OutOf…` | `Preempted` |
//! | 7 | the trainer exited 42 (43) | `BadInput` (`Diverged`) |
//! | 8 | the trainer was `OOMKilled` | `OutOfMemory` |
//! | 9 | the trainer exited 75 or 143 (SIGTERM) | `Preempted` |
//! | 10 | the trainer exited 76 | `Superseded` |
//! | 11 | the trainer exited otherwise non-zero | `Crashed` |
//! | 12 | the trainer exited 0 | `Succeeded` |
//! | 13 | Job failed otherwise (`BackoffLimitExceeded`, pods gone) | `Crashed` |
//! | 14 | a pod still deleting [`NODE_LOST_AFTER`] past its deletion time, or phase `Unknown` | `NodeLost` |
//! | 15 | the trainer waits on `InvalidImageName`, or on `ErrImagePull`, `ImagePullBackOff`, `CreateContainerConfigError`, `CreateContainerError` past the platform timeout | `PlatformError` |
//! | 16 | a pod `Unschedulable` past the placement timeout | `NoCapacity` |
//! | 17 | no pod past the platform timeout (quota, admission) | `PlatformError` |
//! | 18 | otherwise: a pod pending, or none yet | `Pending` |
//! | 19 | otherwise | `Running` |
//!
//! Job-level reasons come before pod-level ones because a deadline or a suspension also
//! ends the trainer with SIGTERM, which alone would read as a preemption.

use super::{CONTAINER, RULE_BAD_INPUT, RULE_DISRUPTION};
use k8s_openapi::api::batch::v1::{Job, JobCondition};
use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStateWaiting, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;
use tuneq_openapi::launch::TrainerExit;

/// How long a pod may stay past its deletion time, still not terminal, before its node
/// counts as lost (the kubelet that should finish it is gone).
pub const NODE_LOST_AFTER: Duration = Duration::from_secs(60);

/// How long a trainer may wait on its image or its configuration before the attempt is
/// ended as a platform error, when the caller has no better figure.
pub const DEFAULT_PLATFORM_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// The suffix of a Job's `PodFailurePolicy` failure message, before the rule's index.
const RULE_MATCH: &str = "matching FailJob rule at index ";

/// Where an attempt stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptEnd {
    /// The trainer runs.
    Running,
    /// Not running yet: waiting for a node, the image or the pod.
    Pending {
        /// What it waits for (the scheduler's or kubelet's reason and message).
        reason: String,
    },
    /// The trainer finished: the adapter is committed.
    Succeeded,
    /// Taken away from outside (spot preemption, eviction, drain, node shutdown, SIGTERM):
    /// the next attempt resumes; not a failure of the job.
    Preempted {
        /// The disruption's reason (`TerminationByKubelet`, `Evicted`, …).
        reason: String,
        /// The node it ran on, when known.
        node: Option<String>,
    },
    /// The input can never train (exit 42): the job fails for good.
    BadInput {
        /// The trainer's termination message, or the Job's.
        message: String,
    },
    /// The run diverged (exit 43): the job fails for good.
    Diverged {
        /// The trainer's termination message.
        message: String,
    },
    /// The trainer was killed for using more memory than the pool gives an attempt.
    OutOfMemory {
        /// What happened, with the pool's memory when known.
        message: String,
    },
    /// The trainer was told its attempt is no longer live (exit 76): nothing to report.
    Superseded,
    /// The trainer died otherwise: retried from the last checkpoint within a budget.
    Crashed {
        /// The trainer's exit code, when a pod still said it.
        exit_code: Option<i32>,
        /// The termination message or reason.
        message: String,
    },
    /// The attempt ran out of its wall-clock budget (`activeDeadlineSeconds`).
    DeadlineExceeded,
    /// The cluster cannot start the trainer: its image cannot be pulled, its Secret or
    /// ServiceAccount is missing, or no pod is created. Retrying will not help until an
    /// operator acts.
    PlatformError {
        /// The kubelet's or the Job's reason (`ImagePullBackOff`, …).
        reason: String,
        /// Its message.
        message: String,
    },
    /// No node took the pod within the placement timeout: the next pool of the job's
    /// list should get the next attempt; not a failure.
    NoCapacity {
        /// The scheduler's last message.
        message: String,
    },
    /// The pod is stuck on a node that no longer answers: no next attempt may start until
    /// the pod is terminal or gone (the double-run guard).
    NodeLost {
        /// The node, when known.
        node: Option<String>,
    },
    /// The Job was suspended (by Kueue): waiting, not failing.
    Suspended,
}

impl AttemptEnd {
    /// Whether the attempt is over, so its Job can be deleted and the outcome recorded.
    /// `NoCapacity` and `PlatformError` are over by the dispatcher's decision (the Job
    /// itself would wait forever).
    pub fn is_over(&self) -> bool {
        !matches!(
            self,
            Self::Running | Self::Pending { .. } | Self::NodeLost { .. } | Self::Suspended
        )
    }
}

/// The figures [`classify`] compares against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// How long a pod may stay unschedulable (the pool's `placement_timeout`).
    pub placement_timeout: Duration,
    /// How long the trainer may wait on its image or configuration.
    pub platform_timeout: Duration,
    /// The pool's memory per attempt as written (`32Gi`), for the out-of-memory message.
    pub memory: Option<String>,
}

impl Limits {
    /// The limits of a Kubernetes pool.
    pub fn for_pool(pool: &tuneq_pools::Pool, k: &tuneq_pools::KubernetesPool) -> Self {
        Self {
            placement_timeout: k.placement_timeout,
            platform_timeout: k.platform_timeout,
            memory: pool.memory.as_ref().map(|m| m.0.as_str().to_string()),
        }
    }
}

/// Where the attempt whose Job is `job` stands, from the Job and its `pods`, at `now`.
/// See the module's table: the first row group that says something wins.
pub fn classify(job: &Job, pods: &[Pod], now: Timestamp, limits: &Limits) -> AttemptEnd {
    let failure = job_condition(job, "Failed").or_else(|| job_condition(job, "FailureTarget"));
    job_end(job, failure, pods)
        .or_else(|| pods_end(pods, limits))
        .or_else(|| {
            // Row 13: failed otherwise.
            failure.map(|failed| AttemptEnd::Crashed {
                exit_code: None,
                message: condition_text(failed),
            })
        })
        .or_else(|| lost_node(pods, now))
        .or_else(|| platform_gave_up(pods, now, limits))
        .or_else(|| unschedulable(pods, now, limits))
        .unwrap_or_else(|| not_over(job, pods, now, limits))
}

/// Rows 1–5: what the Job itself says (done, failed by a deadline or by one of its
/// failure rules, suspended).
fn job_end(job: &Job, failure: Option<&JobCondition>, pods: &[Pod]) -> Option<AttemptEnd> {
    if job_condition(job, "Complete").is_some()
        || job_condition(job, "SuccessCriteriaMet").is_some()
    {
        return Some(AttemptEnd::Succeeded);
    }
    if let Some(failed) = failure {
        match failed.reason.as_deref() {
            Some("DeadlineExceeded") => return Some(AttemptEnd::DeadlineExceeded),
            Some("PodFailurePolicy") => match failed.message.as_deref().and_then(rule_index) {
                Some(RULE_DISRUPTION) => {
                    let disrupted = pods
                        .iter()
                        .find_map(|p| disruption(p).map(|reason| (reason.to_string(), node(p))));
                    let (reason, node) =
                        disrupted.unwrap_or_else(|| ("DisruptionTarget".to_string(), None));
                    return Some(AttemptEnd::Preempted { reason, node });
                }
                Some(RULE_BAD_INPUT) => return Some(refused_input(failed, pods)),
                _ => {}
            },
            _ => {}
        }
    }
    job_condition(job, "Suspended").map(|_| AttemptEnd::Suspended)
}

/// Row 4: the Job failed by its bad-input rule: a diverged run when a pod exited 43,
/// else bad input with the trainer's message (or the Job's).
fn refused_input(failed: &JobCondition, pods: &[Pod]) -> AttemptEnd {
    let ended: Vec<&ContainerStateTerminated> =
        pods.iter().filter_map(trainer_terminated).collect();
    let exited = |code| ended.iter().find(|t| t.exit_code == code);
    if let Some(t) = exited(tuneq_openapi::launch::EXIT_DIVERGED) {
        let message = termination_message(t).unwrap_or_default();
        return AttemptEnd::Diverged { message };
    }
    let message = exited(tuneq_openapi::launch::EXIT_BAD_INPUT)
        .and_then(|t| termination_message(t))
        .or_else(|| failed.message.clone())
        .unwrap_or_default();
    AttemptEnd::BadInput { message }
}

/// Rows 6–12: what the pods say about how the trainer ended. Only a failed pod counts
/// as disrupted: one that succeeded while being disrupted has finished its work.
fn pods_end(pods: &[Pod], limits: &Limits) -> Option<AttemptEnd> {
    if let Some(end) = pods.iter().find_map(|p| {
        (phase(p) == Some("Failed"))
            .then(|| {
                disruption(p).map(|reason| AttemptEnd::Preempted {
                    reason: reason.to_string(),
                    node: node(p),
                })
            })
            .flatten()
            .or_else(|| failed_by_node(p))
    }) {
        return Some(end);
    }
    let ended: Vec<(&Pod, &ContainerStateTerminated)> = pods
        .iter()
        .filter_map(|p| trainer_terminated(p).map(|t| (p, t)))
        .collect();
    trainer_end(&ended, limits)
}

/// Row 14: a pod still deleting well past its deletion time, or in phase `Unknown`.
fn lost_node(pods: &[Pod], now: Timestamp) -> Option<AttemptEnd> {
    pods.iter().find_map(|p| {
        let deleting_for = p
            .metadata
            .deletion_timestamp
            .as_ref()
            .and_then(|t| elapsed(now, t));
        (!pod_is_terminal(p)
            && (deleting_for.is_some_and(|d| d > NODE_LOST_AFTER) || phase(p) == Some("Unknown")))
        .then(|| AttemptEnd::NodeLost { node: node(p) })
    })
}

/// Row 15: the trainer waits on its image or configuration past the platform timeout.
fn platform_gave_up(pods: &[Pod], now: Timestamp, limits: &Limits) -> Option<AttemptEnd> {
    pods.iter().find_map(|p| {
        let waiting = trainer_waiting(p)?;
        let reason = waiting.reason.as_deref().unwrap_or_default();
        let waited = started(p).and_then(|t| elapsed(now, t));
        let gives_up = match reason {
            "InvalidImageName" => true,
            "ErrImagePull"
            | "ImagePullBackOff"
            | "CreateContainerConfigError"
            | "CreateContainerError" => waited.is_some_and(|d| d > limits.platform_timeout),
            _ => false,
        };
        gives_up.then(|| AttemptEnd::PlatformError {
            reason: reason.to_string(),
            message: waiting.message.clone().unwrap_or_default(),
        })
    })
}

/// Row 16: a pod the scheduler cannot place: no capacity past the placement timeout,
/// pending before it.
fn unschedulable(pods: &[Pod], now: Timestamp, limits: &Limits) -> Option<AttemptEnd> {
    pods.iter().find_map(|p| {
        let c = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .find(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })?;
        let since = c
            .last_transition_time
            .as_ref()
            .or(p.metadata.creation_timestamp.as_ref());
        let message = c.message.clone().unwrap_or_default();
        Some(
            if since
                .and_then(|t| elapsed(now, t))
                .is_some_and(|d| d > limits.placement_timeout)
            {
                AttemptEnd::NoCapacity { message }
            } else {
                AttemptEnd::Pending {
                    reason: format!("Unschedulable: {message}"),
                }
            },
        )
    })
}

/// Rows 17–19: no pod past the platform timeout, else pending or running.
fn not_over(job: &Job, pods: &[Pod], now: Timestamp, limits: &Limits) -> AttemptEnd {
    let live: Vec<&Pod> = non_terminal_pods(pods);
    if live.is_empty() {
        let waited = job
            .metadata
            .creation_timestamp
            .as_ref()
            .and_then(|t| elapsed(now, t));
        if pods.is_empty() && waited.is_some_and(|d| d > limits.platform_timeout) {
            return AttemptEnd::PlatformError {
                reason: "NoPod".to_string(),
                message: "the Job controller created no pod (a quota, a LimitRange or an admission webhook may refuse it; see the Job's events)".to_string(),
            };
        }
        return AttemptEnd::Pending {
            reason: "no pod yet".to_string(),
        };
    }
    for p in &live {
        if phase(p) == Some("Pending") {
            let reason = trainer_waiting(p)
                .and_then(|w| w.reason.clone())
                .unwrap_or_else(|| {
                    if node(p).is_some() {
                        "ContainerCreating".to_string()
                    } else {
                        "Scheduling".to_string()
                    }
                });
            return AttemptEnd::Pending { reason };
        }
    }
    AttemptEnd::Running
}

/// Rows 7–12: the trainer's exit, read by the launch contract.
fn trainer_end(ended: &[(&Pod, &ContainerStateTerminated)], limits: &Limits) -> Option<AttemptEnd> {
    let exit = |t: &ContainerStateTerminated| TrainerExit::from_status(Some(t.exit_code), t.signal);
    if let Some((_, t)) = ended.iter().find(|(_, t)| exit(t) == TrainerExit::Diverged) {
        return Some(AttemptEnd::Diverged {
            message: termination_message(t).unwrap_or_else(|| "the training loss diverged".into()),
        });
    }
    if let Some((_, t)) = ended.iter().find(|(_, t)| exit(t) == TrainerExit::BadInput) {
        return Some(AttemptEnd::BadInput {
            message: termination_message(t)
                .unwrap_or_else(|| "the trainer refused its input".into()),
        });
    }
    if let Some((_, t)) = ended
        .iter()
        .find(|(_, t)| t.reason.as_deref() == Some("OOMKilled"))
    {
        let limit = limits
            .memory
            .as_deref()
            .map(|m| format!(" of {m}"))
            .unwrap_or_default();
        return Some(AttemptEnd::OutOfMemory {
            message: format!(
                "the trainer was killed for using more than the pool's memory limit{limit} (exit {}); lower batch_size, max_seq_len or lora.r, or use a pool with more memory",
                t.exit_code
            ),
        });
    }
    if let Some((p, t)) = ended
        .iter()
        .find(|(_, t)| exit(t) == TrainerExit::Interrupted)
    {
        return Some(AttemptEnd::Preempted {
            reason: format!("Interrupted (exit {})", t.exit_code),
            node: node(p),
        });
    }
    if ended
        .iter()
        .any(|(_, t)| exit(t) == TrainerExit::Superseded)
    {
        return Some(AttemptEnd::Superseded);
    }
    if let Some((_, t)) = ended
        .iter()
        .find(|(_, t)| matches!(exit(t), TrainerExit::Crashed { .. }))
    {
        let message = termination_message(t)
            .or_else(|| t.reason.clone())
            .unwrap_or_else(|| "Error".to_string());
        return Some(AttemptEnd::Crashed {
            exit_code: Some(t.exit_code),
            message,
        });
    }
    if ended.iter().any(|(_, t)| exit(t) == TrainerExit::Finished) {
        return Some(AttemptEnd::Succeeded);
    }
    None
}

/// Whether a pod has ended for good (phase `Succeeded` or `Failed`): its containers have
/// stopped, whatever its node does next.
pub fn pod_is_terminal(pod: &Pod) -> bool {
    matches!(phase(pod), Some("Succeeded" | "Failed"))
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref()?.phase.as_deref()
}

/// The pods that may still run a trainer (pending, running, terminating, unknown): while
/// one of a job's exists, its next attempt must not start (two trainers would write the
/// same checkpoints).
pub fn non_terminal_pods(pods: &[Pod]) -> Vec<&Pod> {
    pods.iter().filter(|p| !pod_is_terminal(p)).collect()
}

/// The Job's condition of type `type_` with status `True`.
fn job_condition<'a>(job: &'a Job, type_: &str) -> Option<&'a JobCondition> {
    job.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_ && c.status == "True")
}

/// The rule index at the end of a `PodFailurePolicy` failure message:
/// `Pod ns/p has condition DisruptionTarget matching FailJob rule at index 0` → 0.
fn rule_index(message: &str) -> Option<usize> {
    let (_, index) = message.rsplit_once(RULE_MATCH)?;
    index.trim().parse().ok()
}

/// The reason of a pod's `DisruptionTarget=True` condition.
fn disruption(pod: &Pod) -> Option<&str> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")
        .map(|c| c.reason.as_deref().unwrap_or("DisruptionTarget"))
}

/// A pod the node failed rather than the trainer: evicted for node pressure, terminated by
/// a node shutdown, refused at admission (the GPU plugin not ready on a re-created node).
fn failed_by_node(pod: &Pod) -> Option<AttemptEnd> {
    if phase(pod) != Some("Failed") {
        return None;
    }
    let status = pod.status.as_ref()?;
    let reason = status.reason.as_deref()?;
    let message = status.message.as_deref().unwrap_or_default();
    let by_node = match reason {
        "Evicted" | "NodeShutdown" | "Shutdown" | "UnexpectedAdmissionError" | "NodeAffinity" => {
            true
        }
        "Terminated" => message.contains("node shutdown"),
        other => other.starts_with("OutOf"),
    };
    by_node.then(|| AttemptEnd::Preempted {
        reason: if message.is_empty() {
            reason.to_string()
        } else {
            format!("{reason}: {message}")
        },
        node: node(pod),
    })
}

/// The trainer container's terminated state.
fn trainer_terminated(pod: &Pod) -> Option<&ContainerStateTerminated> {
    trainer_state(pod)?.terminated.as_ref()
}

/// The trainer container's waiting state.
fn trainer_waiting(pod: &Pod) -> Option<&ContainerStateWaiting> {
    trainer_state(pod)?.waiting.as_ref()
}

fn trainer_state(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerState> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == CONTAINER)?
        .state
        .as_ref()
}

/// The termination message, trimmed, when there is one.
fn termination_message(t: &ContainerStateTerminated) -> Option<String> {
    t.message
        .as_deref()
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(str::to_string)
}

fn condition_text(c: &JobCondition) -> String {
    match (c.reason.as_deref(), c.message.as_deref()) {
        (Some(r), Some(m)) => format!("{r}: {m}"),
        (Some(r), None) => r.to_string(),
        (None, Some(m)) => m.to_string(),
        (None, None) => format!("Job condition {}", c.type_),
    }
}

fn node(pod: &Pod) -> Option<String> {
    pod.spec.as_ref()?.node_name.clone()
}

/// When the pod's wait for its containers started: the kubelet's start time, else its
/// creation.
fn started(pod: &Pod) -> Option<&Time> {
    pod.status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .or(pod.metadata.creation_timestamp.as_ref())
}

/// Time from `since` to `now` (None when `since` is in the future).
fn elapsed(now: Timestamp, since: &Time) -> Option<Duration> {
    let millis = now.as_millisecond().checked_sub(since.0.as_millisecond())?;
    u64::try_from(millis).ok().map(Duration::from_millis)
}

#[cfg(test)]
#[path = "classify_tests.rs"]
mod tests;
