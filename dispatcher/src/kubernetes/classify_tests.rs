//! Table tests for [`classify`], on Job and Pod objects shaped as the API server writes
//! them: the conditions, reasons and messages quoted in the runtime's research note (§B.2,
//! §B.3), from the kubelet, the Job controller, the scheduler and PodGC.

#![allow(clippy::unwrap_used)]

use super::*;
use serde_json::{Value, json};

const NOW: &str = "2026-12-01T12:00:00Z";
const NODE: &str = "gke-tuneq-l4-spot-3f2a9c1e-x7k2";
const POD: &str = "tq-ftjob-0a1b2c-a2-x7k2p";

fn now() -> Timestamp {
    NOW.parse().unwrap()
}

/// `secs` seconds before [`NOW`], as the API writes times.
fn ago(secs: i64) -> String {
    let t = now().as_second() - secs;
    Timestamp::from_second(t).unwrap().to_string()
}

fn limits() -> Limits {
    Limits {
        placement_timeout: Duration::from_secs(15 * 60),
        platform_timeout: DEFAULT_PLATFORM_TIMEOUT,
        memory: Some("32Gi".into()),
    }
}

/// A Job created an hour ago, with `status` (its conditions and counts).
fn job(status: Value) -> Job {
    serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "tq-ftjob-0a1b2c-a2",
            "namespace": "tuneq",
            "uid": "0b1f0f0e-6e8a-4c5e-9d3b-6a1f9c2b7d10",
            "creationTimestamp": ago(3600),
            "labels": {"app.kubernetes.io/managed-by": "tuneq"},
        },
        "spec": {"template": {"spec": {"containers": []}}},
        "status": status,
    }))
    .unwrap()
}

fn active_job() -> Job {
    job(json!({"active": 1, "startTime": ago(3600)}))
}

/// A Job condition that is `True`.
fn condition(type_: &str, reason: &str, message: &str) -> Value {
    json!({
        "type": type_,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastProbeTime": ago(5),
        "lastTransitionTime": ago(5),
    })
}

fn failed_job(reason: &str, message: &str) -> Job {
    job(json!({
        "failed": 1,
        "startTime": ago(3600),
        "conditions": [
            condition("FailureTarget", reason, message),
            condition("Failed", reason, message),
        ],
    }))
}

/// A pod of the Job on [`NODE`] with the given `status`; `meta` is merged into its
/// metadata.
fn pod(meta: Value, status: Value) -> Pod {
    let mut metadata = json!({
        "name": POD,
        "namespace": "tuneq",
        "creationTimestamp": ago(3600),
        "labels": {
            "batch.kubernetes.io/job-name": "tq-ftjob-0a1b2c-a2",
            "app.kubernetes.io/managed-by": "tuneq",
        },
    });
    if let (Some(m), Some(extra)) = (metadata.as_object_mut(), meta.as_object()) {
        m.extend(extra.clone());
    }
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"nodeName": NODE, "restartPolicy": "Never", "containers": [{"name": "trainer"}]},
        "status": status,
    }))
    .unwrap()
}

/// The trainer's terminated state.
fn terminated(exit: i32, reason: &str, message: Option<&str>) -> Value {
    let mut t = json!({
        "exitCode": exit,
        "reason": reason,
        "startedAt": ago(3000),
        "finishedAt": ago(10),
        "containerID": "containerd://4f1c",
    });
    if let Some(m) = message {
        t["message"] = json!(m);
    }
    json!([{
        "name": "trainer",
        "image": "us-docker.pkg.dev/my-project/tuneq/tuneq-cuda:0.1.0",
        "imageID": "",
        "ready": false,
        "restartCount": 0,
        "started": false,
        "state": {"terminated": t},
    }])
}

fn waiting(reason: &str, message: &str) -> Value {
    json!([{
        "name": "trainer",
        "image": "us-docker.pkg.dev/my-project/tuneq/tuneq-cuda:0.1.0",
        "imageID": "",
        "ready": false,
        "restartCount": 0,
        "state": {"waiting": {"reason": reason, "message": message}},
    }])
}

fn running() -> Value {
    json!([{
        "name": "trainer",
        "image": "us-docker.pkg.dev/my-project/tuneq/tuneq-cuda:0.1.0",
        "imageID": "us-docker.pkg.dev/my-project/tuneq/tuneq-cuda@sha256:9c1e",
        "ready": true,
        "restartCount": 0,
        "started": true,
        "state": {"running": {"startedAt": ago(3000)}},
    }])
}

/// A pod failed after a disruption: `DisruptionTarget=True` with `reason`, the trainer
/// ended with `exit`.
fn disrupted_pod(reason: &str, message: &str, exit: i32) -> Pod {
    pod(
        json!({}),
        json!({
            "phase": "Failed",
            "conditions": [
                {"type": "DisruptionTarget", "status": "True", "reason": reason,
                 "message": message, "lastTransitionTime": ago(40)},
                {"type": "Ready", "status": "False", "lastTransitionTime": ago(10)},
            ],
            "containerStatuses": terminated(exit, "Error", None),
            "startTime": ago(3600),
        }),
    )
}

/// The pod of a spot preemption: the kubelet's graceful node shutdown (GKE).
fn node_shutdown_pod() -> Pod {
    let message = "Pod was terminated in response to imminent node shutdown.";
    pod(
        json!({}),
        json!({
            "phase": "Failed",
            "reason": "Terminated",
            "message": message,
            "conditions": [
                {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                 "message": message, "lastTransitionTime": ago(30)},
                {"type": "Ready", "status": "False", "lastTransitionTime": ago(10)},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": ago(3600)},
            ],
            "containerStatuses": terminated(75, "Error", None),
            "startTime": ago(3600),
        }),
    )
}

fn unschedulable_pod(since: i64) -> Pod {
    let mut p = pod(
        json!({}),
        json!({
            "phase": "Pending",
            "conditions": [{
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod.",
                "lastProbeTime": null,
                "lastTransitionTime": ago(since),
            }],
            "qosClass": "Guaranteed",
        }),
    );
    // An unscheduled pod has no node.
    if let Some(spec) = p.spec.as_mut() {
        spec.node_name = None;
    }
    p
}

fn waiting_pod(reason: &str, message: &str, started: i64) -> Pod {
    pod(
        json!({}),
        json!({
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": ago(started)},
                {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady",
                 "message": "containers with unready status: [trainer]", "lastTransitionTime": ago(started)},
            ],
            "containerStatuses": waiting(reason, message),
            "startTime": ago(started),
        }),
    )
}

fn running_pod() -> Pod {
    pod(
        json!({}),
        json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": ago(3000)}],
            "containerStatuses": running(),
            "startTime": ago(3600),
        }),
    )
}

fn preempted(reason: &str) -> AttemptEnd {
    AttemptEnd::Preempted {
        reason: reason.into(),
        node: Some(NODE.into()),
    }
}

#[test]
fn the_table_reads_each_documented_shape() {
    let disruption_msg =
        format!("Pod tuneq/{POD} has condition DisruptionTarget matching FailJob rule at index 0");
    let bad_input_msg = format!(
        "Container trainer for pod tuneq/{POD} failed with exit code 42 matching FailJob rule at index 1"
    );
    let cases: Vec<(&str, Job, Vec<Pod>, AttemptEnd)> = vec![
        (
            "complete",
            job(json!({
                "succeeded": 1,
                "conditions": [
                    condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
                    condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods"),
                ],
            })),
            vec![pod(
                json!({}),
                json!({"phase": "Succeeded", "containerStatuses": terminated(0, "Completed", None)}),
            )],
            AttemptEnd::Succeeded,
        ),
        (
            "success criteria met, pod still finishing",
            job(json!({"conditions": [condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods")]})),
            vec![],
            AttemptEnd::Succeeded,
        ),
        (
            "spot preemption: Job failed by rule 0",
            failed_job("PodFailurePolicy", &disruption_msg),
            vec![node_shutdown_pod()],
            preempted("TerminationByKubelet"),
        ),
        (
            "spot preemption: FailureTarget only, pod already gone",
            job(json!({"conditions": [condition("FailureTarget", "PodFailurePolicy", &disruption_msg)]})),
            vec![],
            AttemptEnd::Preempted {
                reason: "DisruptionTarget".into(),
                node: None,
            },
        ),
        (
            "spot preemption seen on the pod before the Job",
            active_job(),
            vec![node_shutdown_pod()],
            preempted("TerminationByKubelet"),
        ),
        (
            "a pod that succeeded while being disrupted has finished",
            active_job(),
            vec![pod(json!({}), json!({
                "phase": "Succeeded",
                "conditions": [{"type": "DisruptionTarget", "status": "True",
                                "reason": "TerminationByKubelet", "message": "Pod was terminated in response to imminent node shutdown."}],
                "containerStatuses": terminated(0, "Completed", None),
            }))],
            AttemptEnd::Succeeded,
        ),
        (
            "drain through the eviction API",
            active_job(),
            vec![disrupted_pod("EvictionByEvictionAPI", "Eviction API: evicting", 143)],
            preempted("EvictionByEvictionAPI"),
        ),
        (
            "NoExecute taint / node not ready",
            active_job(),
            vec![disrupted_pod("DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint", 143)],
            preempted("DeletionByTaintManager"),
        ),
        (
            "node deleted: PodGC",
            active_job(),
            vec![disrupted_pod("DeletionByPodGC", "PodGC: node no longer exists", 137)],
            preempted("DeletionByPodGC"),
        ),
        (
            "scheduler preemption",
            active_job(),
            vec![disrupted_pod("PreemptionByScheduler", "kube-scheduler: preempting to accommodate a higher priority pod", 143)],
            preempted("PreemptionByScheduler"),
        ),
        (
            "node-pressure eviction without the condition (older kubelet)",
            active_job(),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "reason": "Evicted",
                "message": "The node was low on resource: memory. Threshold quantity: 100Mi, available: 51200Ki. Container trainer was using 31Gi, request is 32Gi, has larger consumption of memory.",
            }))],
            preempted("Evicted: The node was low on resource: memory. Threshold quantity: 100Mi, available: 51200Ki. Container trainer was using 31Gi, request is 32Gi, has larger consumption of memory."),
        ),
        (
            "node shutdown without the condition",
            active_job(),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "reason": "Terminated",
                "message": "Pod was terminated in response to imminent node shutdown.",
                "containerStatuses": terminated(1, "Error", None),
            }))],
            preempted("Terminated: Pod was terminated in response to imminent node shutdown."),
        ),
        (
            "GPU plugin not ready on a re-created node",
            active_job(),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "reason": "UnexpectedAdmissionError",
                "message": "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices nvidia.com/gpu, which is unexpected",
            }))],
            preempted("UnexpectedAdmissionError: Allocate failed due to no healthy devices present; cannot allocate unhealthy devices nvidia.com/gpu, which is unexpected"),
        ),
        (
            "bad input: Job failed by rule 1, trainer's message kept",
            failed_job("PodFailurePolicy", &bad_input_msg),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "containerStatuses": terminated(42, "Error", Some("error: dataset line 3 is not JSON\n")),
            }))],
            AttemptEnd::BadInput {
                message: "error: dataset line 3 is not JSON".into(),
            },
        ),
        (
            "diverged: Job failed by rule 1, the pod exited 43",
            failed_job("PodFailurePolicy", &bad_input_msg),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "containerStatuses": terminated(43, "Error", Some("error: loss became NaN at step 3; lower the learning rate\n")),
            }))],
            AttemptEnd::Diverged {
                message: "error: loss became NaN at step 3; lower the learning rate".into(),
            },
        ),
        (
            "diverged, seen on the pod before the Job",
            active_job(),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "containerStatuses": terminated(43, "Error", None),
            }))],
            AttemptEnd::Diverged {
                message: "the training loss diverged".into(),
            },
        ),
        (
            "bad input: Job failed by rule 1, pod gone",
            failed_job("PodFailurePolicy", &bad_input_msg),
            vec![],
            AttemptEnd::BadInput {
                message: bad_input_msg.clone(),
            },
        ),
        (
            "bad input seen on the pod before the Job",
            active_job(),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "containerStatuses": terminated(42, "Error", Some("error: model has no chat template")),
            }))],
            AttemptEnd::BadInput {
                message: "error: model has no chat template".into(),
            },
        ),
        (
            "out of memory",
            failed_job("BackoffLimitExceeded", "Job has reached the specified backoff limit"),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "containerStatuses": terminated(137, "OOMKilled", None),
            }))],
            AttemptEnd::OutOfMemory {
                message: "the trainer was killed for using more than the pool's memory limit of 32Gi (exit 137); lower batch_size, max_seq_len or lora.r, or use a pool with more memory".into(),
            },
        ),
        (
            "crash",
            failed_job("BackoffLimitExceeded", "Job has reached the specified backoff limit"),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "containerStatuses": terminated(101, "Error", Some("thread 'main' panicked at src/train.rs:10")),
            }))],
            AttemptEnd::Crashed {
                exit_code: Some(101),
                message: "thread 'main' panicked at src/train.rs:10".into(),
            },
        ),
        (
            "SIGKILL that is not an OOM kill is a crash",
            failed_job("BackoffLimitExceeded", "Job has reached the specified backoff limit"),
            vec![pod(json!({}), json!({
                "phase": "Failed",
                "containerStatuses": terminated(137, "Error", None),
            }))],
            AttemptEnd::Crashed {
                exit_code: Some(137),
                message: "Error".into(),
            },
        ),
        (
            "crash, pod gone",
            failed_job("BackoffLimitExceeded", "Job has reached the specified backoff limit"),
            vec![],
            AttemptEnd::Crashed {
                exit_code: None,
                message: "BackoffLimitExceeded: Job has reached the specified backoff limit".into(),
            },
        ),
        (
            "interrupted: exit 75 without a disruption condition",
            failed_job("BackoffLimitExceeded", "Job has reached the specified backoff limit"),
            vec![pod(json!({}), json!({"phase": "Failed", "containerStatuses": terminated(75, "Error", None)}))],
            preempted("Interrupted (exit 75)"),
        ),
        (
            "interrupted: died of SIGTERM",
            active_job(),
            vec![pod(json!({}), json!({"phase": "Failed", "containerStatuses": terminated(143, "Error", None)}))],
            preempted("Interrupted (exit 143)"),
        ),
        (
            "superseded",
            active_job(),
            vec![pod(json!({}), json!({"phase": "Failed", "containerStatuses": terminated(76, "Error", None)}))],
            AttemptEnd::Superseded,
        ),
        (
            "deadline: the SIGTERM it caused is not a preemption",
            failed_job("DeadlineExceeded", "Job was active longer than specified deadline"),
            vec![pod(json!({}), json!({"phase": "Failed", "containerStatuses": terminated(143, "Error", None)}))],
            AttemptEnd::DeadlineExceeded,
        ),
        (
            "suspended by Kueue: the SIGTERM it caused is not a preemption",
            job(json!({"conditions": [condition("Suspended", "JobSuspended", "Job suspended")]})),
            vec![pod(json!({}), json!({"phase": "Failed", "containerStatuses": terminated(143, "Error", None)}))],
            AttemptEnd::Suspended,
        ),
        (
            "an index the runtime never wrote falls through to the pods",
            failed_job("PodFailurePolicy", &format!("Pod tuneq/{POD} has condition Foo matching FailJob rule at index 7")),
            vec![],
            AttemptEnd::Crashed {
                exit_code: None,
                message: format!("PodFailurePolicy: Pod tuneq/{POD} has condition Foo matching FailJob rule at index 7"),
            },
        ),
        ("running", active_job(), vec![running_pod()], AttemptEnd::Running),
        (
            "terminating within its grace: still running",
            active_job(),
            vec![pod(json!({"deletionTimestamp": ago(-10), "deletionGracePeriodSeconds": 25}), json!({
                "phase": "Running",
                "containerStatuses": running(),
            }))],
            AttemptEnd::Running,
        ),
        (
            "a disruption on a pod that still runs waits for the pod",
            active_job(),
            vec![pod(json!({"deletionTimestamp": ago(-20)}), json!({
                "phase": "Running",
                "conditions": [{"type": "DisruptionTarget", "status": "True",
                                "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}],
                "containerStatuses": running(),
            }))],
            AttemptEnd::Running,
        ),
        (
            "terminating long past its deletion time: node lost",
            active_job(),
            vec![pod(json!({"deletionTimestamp": ago(300), "deletionGracePeriodSeconds": 25}), json!({
                "phase": "Running",
                "containerStatuses": running(),
            }))],
            AttemptEnd::NodeLost { node: Some(NODE.into()) },
        ),
        (
            "phase Unknown: node lost",
            active_job(),
            vec![pod(json!({}), json!({"phase": "Unknown"}))],
            AttemptEnd::NodeLost { node: Some(NODE.into()) },
        ),
        (
            "unschedulable within the placement timeout",
            active_job(),
            vec![unschedulable_pod(60)],
            AttemptEnd::Pending {
                reason: "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod.".into(),
            },
        ),
        (
            "unschedulable past the placement timeout",
            active_job(),
            vec![unschedulable_pod(16 * 60)],
            AttemptEnd::NoCapacity {
                message: "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod.".into(),
            },
        ),
        (
            "pull error past the platform timeout",
            active_job(),
            vec![waiting_pod("ErrImagePull", "failed to pull and unpack image: 403 Forbidden", 400)],
            AttemptEnd::PlatformError {
                reason: "ErrImagePull".into(),
                message: "failed to pull and unpack image: 403 Forbidden".into(),
            },
        ),
        (
            "invalid image name: no point waiting",
            active_job(),
            vec![waiting_pod("InvalidImageName", "Failed to apply default image tag \"Bad:Image\": couldn't parse image name \"Bad:Image\": invalid reference format", 5)],
            AttemptEnd::PlatformError {
                reason: "InvalidImageName".into(),
                message: "Failed to apply default image tag \"Bad:Image\": couldn't parse image name \"Bad:Image\": invalid reference format".into(),
            },
        ),
        (
            "container creating",
            active_job(),
            vec![waiting_pod("ContainerCreating", "", 20)],
            AttemptEnd::Pending { reason: "ContainerCreating".into() },
        ),
        (
            "no pod yet",
            new_job(5),
            vec![],
            AttemptEnd::Pending { reason: "no pod yet".into() },
        ),
        (
            "no pod for long: quota or admission",
            new_job(600),
            vec![],
            AttemptEnd::PlatformError {
                reason: "NoPod".into(),
                message: "the Job controller created no pod (a quota, a LimitRange or an admission webhook may refuse it; see the Job's events)".into(),
            },
        ),
    ];
    let mut failures = Vec::new();
    for (name, job, pods, expected) in &cases {
        let got = classify(job, pods, now(), &limits());
        if &got != expected {
            failures.push(format!(
                "{name}:\n  expected {expected:?}\n  got      {got:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A pod the platform keeps waiting (an image pull backing off; the attempt's Secret,
/// which the dispatcher creates after the Job, not there yet) is pending within the
/// platform timeout (300 s) and a platform error, with the platform's words, past it.
#[test]
fn a_pod_the_platform_keeps_waiting_is_pending_then_a_platform_error() {
    let image = "Back-off pulling image \"us-docker.pkg.dev/my-project/tuneq/tuneq-cuda:0.1.0\"";
    let secret = "secret \"tq-ftjob-0a1b2c-a2-cred\" not found";
    for (reason, message, within, past) in [
        ("ImagePullBackOff", image, 60, 600),
        ("CreateContainerConfigError", secret, 3, 301),
    ] {
        let at = |seconds| {
            classify(
                &active_job(),
                &[waiting_pod(reason, message, seconds)],
                now(),
                &limits(),
            )
        };
        let pending = AttemptEnd::Pending {
            reason: reason.into(),
        };
        assert_eq!(at(within), pending, "{reason} after {within} s");
        let error = AttemptEnd::PlatformError {
            reason: reason.into(),
            message: message.into(),
        };
        assert_eq!(at(past), error, "{reason} after {past} s");
    }
}

/// A Job with no status, created `secs` seconds before [`NOW`].
fn new_job(secs: i64) -> Job {
    let mut j = job(json!({}));
    j.metadata.creation_timestamp = Some(Time(ago(secs).parse().unwrap()));
    j
}

#[test]
fn the_rule_indices_are_read_from_the_end_of_the_message() {
    assert_eq!(
        rule_index("Pod tuneq/p has condition DisruptionTarget matching FailJob rule at index 0"),
        Some(0)
    );
    assert_eq!(
        rule_index(
            "Container trainer for pod tuneq/p failed with exit code 42 matching FailJob rule at index 1"
        ),
        Some(1)
    );
    assert_eq!(
        rule_index("Job has reached the specified backoff limit"),
        None
    );
    assert_eq!(rule_index("matching FailJob rule at index x"), None);
}

#[test]
fn a_failure_message_for_each_rule_of_the_built_policy_reads_back_as_its_class() {
    let policy = crate::kubernetes::job::pod_failure_policy();
    for (index, rule) in policy.rules.iter().enumerate() {
        let message = format!("Pod tuneq/{POD} matched, matching FailJob rule at index {index}");
        let end = classify(
            &failed_job("PodFailurePolicy", &message),
            &[],
            now(),
            &limits(),
        );
        if rule.on_pod_conditions.is_some() {
            assert!(
                matches!(end, AttemptEnd::Preempted { .. }),
                "rule {index}: {end:?}"
            );
        } else {
            assert!(
                matches!(end, AttemptEnd::BadInput { .. }),
                "rule {index}: {end:?}"
            );
        }
    }
}

#[test]
fn only_succeeded_and_failed_pods_are_terminal() {
    let pods = vec![
        running_pod(),
        node_shutdown_pod(),
        unschedulable_pod(10),
        pod(json!({}), json!({"phase": "Succeeded"})),
        pod(
            json!({"deletionTimestamp": ago(600)}),
            json!({"phase": "Running"}),
        ),
        pod(json!({}), json!({"phase": "Unknown"})),
        pod(json!({}), json!({})),
    ];
    let terminal: Vec<bool> = pods.iter().map(pod_is_terminal).collect();
    assert_eq!(terminal, [false, true, false, true, false, false, false]);
    assert_eq!(non_terminal_pods(&pods).len(), 5);
}

#[test]
fn over_means_the_job_can_be_deleted() {
    assert!(!AttemptEnd::Running.is_over());
    assert!(!AttemptEnd::Suspended.is_over());
    assert!(!AttemptEnd::NodeLost { node: None }.is_over());
    assert!(
        AttemptEnd::NoCapacity {
            message: String::new()
        }
        .is_over()
    );
    assert!(AttemptEnd::Succeeded.is_over());
    assert!(preempted("x").is_over());
}
