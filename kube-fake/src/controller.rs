//! The Job controller, as a simulator a test steps: [`FakeCluster::sync_jobs`] does one
//! pass over every Job, as the real controller does on each of its syncs.
//!
//! What one pass does for a Job that has not finished:
//! - sets `status.startTime` on the first pass;
//! - counts each pod that ended since the last pass (`succeeded`/`failed`), applying the
//!   `podFailurePolicy` rules in order to a failed pod (`onPodConditions`, `onExitCodes`;
//!   first match wins; `Ignore` does not count the failure), and counts a pod that
//!   vanished before it ended as failed;
//! - decides the Job's end: a `FailJob` match (`PodFailurePolicy`, with the real message
//!   format), `failed > backoffLimit` (`BackoffLimitExceeded`), `activeDeadlineSeconds`
//!   past (`DeadlineExceeded`), or enough successes (`SuccessCriteriaMet`); it writes
//!   `FailureTarget`/`SuccessCriteriaMet` at once, deletes the pods still alive, and
//!   writes `Failed`/`Complete` only once no pod is alive;
//! - otherwise creates a pod when none is alive (with a `podFailurePolicy` or
//!   `podReplacementPolicy: Failed`, a terminating pod counts as alive);
//! - writes `active`, `ready`, `terminating`, `failed`, `succeeded`, `completionTime`;
//! - takes the `batch.kubernetes.io/job-tracking` finalizer off each pod it has counted
//!   (and off pods whose Job is gone), so deleted pods disappear only after this pass.

use crate::FakeCluster;
use crate::store::{
    DeleteOptions, JOB_TRACKING_FINALIZER, Key, Kind, State, meta_mut, meta_str, pod_terminal,
    random_suffix,
};
use serde_json::{Value, json};

/// Label with the Job's name on its pods.
pub const LABEL_JOB_NAME: &str = "batch.kubernetes.io/job-name";
/// Label with the Job's uid on its pods.
pub const LABEL_CONTROLLER_UID: &str = "batch.kubernetes.io/controller-uid";

impl FakeCluster {
    /// One pass of the Job controller over every Job (see the module doc).
    pub fn sync_jobs(&self) {
        self.with_state(|s| {
            let jobs: Vec<Key> = s
                .objects
                .keys()
                .filter(|(k, _, _)| *k == Kind::Job)
                .cloned()
                .collect();
            for key in jobs {
                sync_job(s, &key);
            }
            release_orphans(s);
        });
    }

    /// The names of the pods of the Job called `job` (`name` or `namespace/name`), in
    /// creation order.
    pub fn pods_of(&self, job: &str) -> Vec<String> {
        self.with_state(|s| {
            let Some(key) = s.find(Kind::Job, job) else {
                return Vec::new();
            };
            let uid = s
                .objects
                .get(&key)
                .and_then(|j| meta_str(j, "uid"))
                .unwrap_or_default()
                .to_string();
            let mut pods: Vec<(u64, String)> = s
                .created_pods
                .values()
                .filter(|(job_uid, ns, name, _)| {
                    *job_uid == uid
                        && s.objects
                            .contains_key(&(Kind::Pod, ns.clone(), name.clone()))
                })
                .map(|(_, _, name, rv)| (*rv, name.clone()))
                .collect();
            pods.sort();
            pods.into_iter().map(|(_, n)| n).collect()
        })
    }

    /// The newest pod of the Job `job` still alive (not terminal), if any.
    pub fn live_pod_of(&self, job: &str) -> Option<String> {
        let pods = self.pods_of(job);
        self.with_state(|s| {
            pods.into_iter().rev().find(|p| {
                s.find(Kind::Pod, p)
                    .and_then(|k| s.objects.get(&k))
                    .is_some_and(|o| !pod_terminal(o))
            })
        })
    }
}

/// The pods in `namespace` whose controller owner has `uid`.
fn owned_pods(s: &State, namespace: &str, uid: &str) -> Vec<(Key, Value)> {
    s.objects
        .iter()
        .filter(|((k, ns, _), p)| {
            *k == Kind::Pod
                && ns == namespace
                && p.pointer("/metadata/ownerReferences")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .any(|r| {
                        r.get("uid").and_then(Value::as_str) == Some(uid)
                            && r.get("controller").and_then(Value::as_bool) == Some(true)
                    })
        })
        .map(|(k, p)| (k.clone(), p.clone()))
        .collect()
}

fn condition(job: &Value, type_: &str) -> Option<(String, String)> {
    job.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_ && c["status"] == "True")
        .map(|c| {
            (
                c["reason"].as_str().unwrap_or_default().to_string(),
                c["message"].as_str().unwrap_or_default().to_string(),
            )
        })
}

fn add_condition(job: &mut Value, type_: &str, reason: &str, message: &str, now: &str) {
    if condition(job, type_).is_some() {
        return;
    }
    let c = json!({"type": type_, "status": "True", "reason": reason, "message": message,
                   "lastProbeTime": now, "lastTransitionTime": now});
    match job.pointer_mut("/status/conditions") {
        Some(Value::Array(cs)) => cs.push(c),
        _ => job["status"]["conditions"] = json!([c]),
    }
}

fn int(v: &Value, pointer: &str) -> Option<i64> {
    v.pointer(pointer).and_then(Value::as_i64)
}

/// What a `podFailurePolicy` rule makes of a failed pod.
#[derive(Debug, PartialEq)]
enum RuleMatch {
    FailJob(String),
    Ignore,
    Count,
}

/// The first `podFailurePolicy` rule of `job` that matches the failed `pod`.
fn match_rules(job: &Value, pod: &Value) -> RuleMatch {
    let ns = meta_str(pod, "namespace").unwrap_or_default();
    let name = meta_str(pod, "name").unwrap_or_default();
    let rules = job
        .pointer("/spec/podFailurePolicy/rules")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for (index, rule) in rules.iter().enumerate() {
        let action = rule["action"].as_str().unwrap_or("Count");
        let mut matched: Option<String> = None;
        for pattern in rule["onPodConditions"].as_array().into_iter().flatten() {
            let type_ = pattern["type"].as_str().unwrap_or_default();
            let status = pattern["status"].as_str().unwrap_or("True");
            let has = pod
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .any(|c| c["type"] == type_ && c["status"] == status);
            if has {
                matched = Some(format!(
                    "Pod {ns}/{name} has condition {type_} matching {action} rule at index {index}"
                ));
                break;
            }
        }
        if let (None, Some(req)) = (&matched, rule.get("onExitCodes")) {
            let container = req["containerName"].as_str();
            let values: Vec<i64> = req["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_i64)
                .collect();
            let not_in = req["operator"] == "NotIn";
            let statuses = ["/status/initContainerStatuses", "/status/containerStatuses"]
                .into_iter()
                .filter_map(|p| pod.pointer(p).and_then(Value::as_array))
                .flatten();
            for cs in statuses {
                let cname = cs["name"].as_str().unwrap_or_default();
                if container.is_some_and(|c| c != cname) {
                    continue;
                }
                let Some(code) = cs
                    .pointer("/state/terminated/exitCode")
                    .and_then(Value::as_i64)
                else {
                    continue;
                };
                if code != 0 && values.contains(&code) != not_in {
                    matched = Some(format!(
                        "Container {cname} for pod {ns}/{name} failed with exit code {code} matching {action} rule at index {index}"
                    ));
                    break;
                }
            }
        }
        if let Some(message) = matched {
            return match action {
                "FailJob" => RuleMatch::FailJob(message),
                "Ignore" => RuleMatch::Ignore,
                _ => RuleMatch::Count,
            };
        }
    }
    RuleMatch::Count
}

fn is_deleting(p: &Value) -> bool {
    p.pointer("/metadata/deletionTimestamp").is_some()
}

/// A terminal condition's reason and message.
type Verdict = Option<(String, String)>;

/// What one pass of the job controller knows of a Job's pods: the counts so far and the
/// terminal condition it has reached, if any.
struct Tally {
    /// Pods counted as failed (`status.failed`).
    failed: i64,
    /// Pods counted as succeeded (`status.succeeded`).
    succeeded: i64,
    /// The `FailureTarget` condition, once set.
    failure: Verdict,
    /// The `SuccessCriteriaMet` condition, once set.
    success: Verdict,
}

impl Tally {
    /// Whether neither terminal condition is set yet.
    fn undecided(&self) -> bool {
        self.failure.is_none() && self.success.is_none()
    }
}

/// One pass of the job controller over the Job at `key`: count its ended pods, decide
/// whether it is over, terminate or replace pods, and write its status once.
fn sync_job(s: &mut State, key: &Key) {
    let Some(mut job) = s.objects.get(key).cloned() else {
        return;
    };
    let uid = meta_str(&job, "uid").unwrap_or_default().to_string();
    let finished = condition(&job, "Complete").is_some() || condition(&job, "Failed").is_some();
    if finished || job.pointer("/spec/suspend") == Some(&json!(true)) {
        release_counted(s, &key.1, &uid);
        return;
    }
    let now = s.now_string();
    if !job.get("status").is_some_and(Value::is_object) {
        job["status"] = json!({});
    }
    if job.pointer("/status/startTime").is_none() {
        job["status"]["startTime"] = json!(now);
    }
    let mut tally = Tally {
        failed: int(&job, "/status/failed").unwrap_or(0),
        succeeded: int(&job, "/status/succeeded").unwrap_or(0),
        failure: condition(&job, "FailureTarget"),
        success: condition(&job, "SuccessCriteriaMet"),
    };
    count_ended_pods(s, &key.1, &uid, &job, &mut tally);
    tally.failed += count_vanished_pods(s, &uid);
    decide(s, &job, &mut tally);

    job["status"]["failed"] = json!(tally.failed);
    job["status"]["succeeded"] = json!(tally.succeeded);
    if let Some((reason, message)) = &tally.failure {
        add_condition(&mut job, "FailureTarget", reason, message, &now);
    }
    if let Some((reason, message)) = &tally.success {
        add_condition(&mut job, "SuccessCriteriaMet", reason, message, &now);
    }
    if tally.undecided() {
        replace_pod(s, &key.1, &uid, &job, &tally);
    } else {
        terminate_pods(s, &key.1, &uid);
    }
    write_pod_counts(s, &key.1, &uid, &mut job, &tally, &now);
    // One status write per pass, as the real controller does.
    s.write(key, job);
    release_counted(s, &key.1, &uid);
}

/// Counts the pods of `uid` that ended since the last pass, applying the Job's pod
/// failure policy to the failed ones.
fn count_ended_pods(s: &mut State, namespace: &str, uid: &str, job: &Value, tally: &mut Tally) {
    for (_, pod) in owned_pods(s, namespace, uid) {
        let pod_uid = meta_str(&pod, "uid").unwrap_or_default().to_string();
        if !pod_terminal(&pod) || s.counted_pods.contains_key(&pod_uid) {
            continue;
        }
        s.counted_pods.insert(pod_uid, uid.to_string());
        if pod.pointer("/status/phase") == Some(&json!("Succeeded")) {
            tally.succeeded += 1;
            continue;
        }
        match match_rules(job, &pod) {
            RuleMatch::FailJob(message) => {
                tally.failed += 1;
                if tally.undecided() {
                    tally.failure = Some(("PodFailurePolicy".into(), message));
                }
            }
            RuleMatch::Ignore => {}
            RuleMatch::Count => tally.failed += 1,
        }
    }
}

/// Counts (once) the pods of `uid` that vanished before they ended: each one failed.
fn count_vanished_pods(s: &mut State, uid: &str) -> i64 {
    let vanished: Vec<String> = s
        .created_pods
        .iter()
        .filter(|(pod_uid, (job_uid, ns, name, _))| {
            *job_uid == uid
                && !s.counted_pods.contains_key(*pod_uid)
                && !s
                    .objects
                    .contains_key(&(Kind::Pod, ns.clone(), name.clone()))
        })
        .map(|(pod_uid, _)| pod_uid.clone())
        .collect();
    let count = vanished.len();
    for pod_uid in vanished {
        s.counted_pods.insert(pod_uid, uid.to_string());
    }
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// Sets a terminal condition when none is set yet: completions reached, the backoff limit
/// passed, or the active deadline run out.
fn decide(s: &State, job: &Value, tally: &mut Tally) {
    if !tally.undecided() {
        return;
    }
    let completions = int(job, "/spec/completions").unwrap_or(1);
    let backoff_limit = int(job, "/spec/backoffLimit").unwrap_or(6);
    if tally.succeeded >= completions {
        tally.success = Some((
            "CompletionsReached".into(),
            "Reached expected number of succeeded pods".into(),
        ));
    } else if tally.failed > backoff_limit {
        tally.failure = Some((
            "BackoffLimitExceeded".into(),
            "Job has reached the specified backoff limit".into(),
        ));
    } else if let Some(deadline) = int(job, "/spec/activeDeadlineSeconds") {
        let started = job["status"]["startTime"]
            .as_str()
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(|t| t.as_second());
        if started.is_some_and(|t| s.now().as_second() - t >= deadline) {
            tally.failure = Some((
                "DeadlineExceeded".into(),
                "Job was active longer than specified deadline".into(),
            ));
        }
    }
}

/// The Job is over: what still runs of it is terminated.
fn terminate_pods(s: &mut State, namespace: &str, uid: &str) {
    for (pk, pod) in owned_pods(s, namespace, uid) {
        if !pod_terminal(&pod) && !is_deleting(&pod) {
            let _ = s.delete(&pk, &DeleteOptions::default());
        }
    }
}

/// The Job goes on: a new pod when none is alive and completions are missing. With a pod
/// failure policy (or `podReplacementPolicy: Failed`) a terminating pod still counts as
/// alive, so no replacement runs beside it.
fn replace_pod(s: &mut State, namespace: &str, uid: &str, job: &Value, tally: &Tally) {
    let completions = int(job, "/spec/completions").unwrap_or(1);
    let waits_for_terminating = job.pointer("/spec/podFailurePolicy").is_some()
        || job.pointer("/spec/podReplacementPolicy") == Some(&json!("Failed"));
    let alive = owned_pods(s, namespace, uid)
        .iter()
        .any(|(_, p)| !pod_terminal(p) && (waits_for_terminating || !is_deleting(p)));
    if !alive && tally.succeeded < completions {
        create_pod(s, job);
    }
}

/// The counts as the pods stand now (`active`, `ready`, `terminating`), and the terminal
/// condition (`Failed` or `Complete`) once none of them is alive.
fn write_pod_counts(
    s: &State,
    namespace: &str,
    uid: &str,
    job: &mut Value,
    tally: &Tally,
    now: &str,
) {
    let pods = owned_pods(s, namespace, uid);
    let alive: Vec<&Value> = pods
        .iter()
        .map(|(_, p)| p)
        .filter(|p| !pod_terminal(p))
        .collect();
    let active = alive.iter().filter(|p| !is_deleting(p)).count();
    let terminating = alive.len() - active;
    let ready = alive
        .iter()
        .filter(|p| {
            p.pointer("/status/conditions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
        .count();
    job["status"]["active"] = json!(active);
    job["status"]["ready"] = json!(ready);
    job["status"]["terminating"] = json!(terminating);
    job["status"]["uncountedTerminatedPods"] = json!({});
    if alive.is_empty() {
        if let Some((reason, message)) = &tally.failure {
            add_condition(job, "Failed", reason, message, now);
        } else if let Some((reason, message)) = &tally.success {
            add_condition(job, "Complete", reason, message, now);
            job["status"]["completionTime"] = json!(now);
        }
    }
}

/// Takes the tracking finalizer off the pods of `uid` already counted.
fn release_counted(s: &mut State, namespace: &str, uid: &str) {
    for (pk, pod) in owned_pods(s, namespace, uid) {
        let counted = meta_str(&pod, "uid").is_some_and(|u| s.counted_pods.contains_key(u));
        if counted {
            remove_tracking_finalizer(s, &pk);
        }
    }
}

/// Takes the tracking finalizer off pods whose Job is gone.
fn release_orphans(s: &mut State) {
    let jobs: std::collections::HashSet<String> = s
        .objects
        .iter()
        .filter(|((k, _, _), _)| *k == Kind::Job)
        .filter_map(|(_, j)| meta_str(j, "uid").map(str::to_string))
        .collect();
    let orphans: Vec<Key> = s
        .objects
        .iter()
        .filter(|((k, _, _), p)| {
            *k == Kind::Pod
                && has_tracking_finalizer(p)
                && p.pointer(&format!(
                    "/metadata/labels/{}",
                    LABEL_CONTROLLER_UID.replace('/', "~1")
                ))
                .and_then(Value::as_str)
                .is_none_or(|u| !jobs.contains(u))
        })
        .map(|(k, _)| k.clone())
        .collect();
    for k in orphans {
        remove_tracking_finalizer(s, &k);
    }
}

fn has_tracking_finalizer(p: &Value) -> bool {
    p.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| f.iter().any(|x| x == JOB_TRACKING_FINALIZER))
}

fn remove_tracking_finalizer(s: &mut State, key: &Key) {
    if !s.objects.get(key).is_some_and(has_tracking_finalizer) {
        return;
    }
    let _ = s.update(key, |p, _| {
        if let Some(Value::Array(f)) = p.pointer_mut("/metadata/finalizers") {
            f.retain(|x| x != JOB_TRACKING_FINALIZER);
        }
    });
}

/// The pod's QoS class from its containers' requests and limits.
fn qos_class(spec: &Value) -> &'static str {
    let containers: Vec<&Value> = spec["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    let any = containers.iter().any(|c| {
        c.pointer("/resources/requests").is_some() || c.pointer("/resources/limits").is_some()
    });
    let guaranteed = !containers.is_empty()
        && containers.iter().all(|c| {
            let limits = c.pointer("/resources/limits");
            let requests = c.pointer("/resources/requests").or(limits);
            ["cpu", "memory"].iter().all(|r| {
                limits
                    .and_then(|l| l.get(r))
                    .is_some_and(|l| Some(l) == requests.and_then(|q| q.get(r)))
            })
        });
    match (any, guaranteed) {
        (_, true) => "Guaranteed",
        (true, false) => "Burstable",
        _ => "BestEffort",
    }
}

/// Creates one pod from the Job's template, as the controller does.
fn create_pod(s: &mut State, job: &Value) {
    let job_name = meta_str(job, "name").unwrap_or_default().to_string();
    let namespace = meta_str(job, "namespace").unwrap_or("default").to_string();
    let uid = meta_str(job, "uid").unwrap_or_default().to_string();
    let template = job.pointer("/spec/template").cloned().unwrap_or(json!({}));
    let mut pod = json!({
        "metadata": template.get("metadata").cloned().unwrap_or(json!({})),
        "spec": template.get("spec").cloned().unwrap_or(json!({})),
    });
    let name = format!("{job_name}-{}", random_suffix());
    {
        let meta = meta_mut(&mut pod);
        meta.insert("name".into(), json!(name));
        meta.insert("namespace".into(), json!(namespace));
        let labels = meta.entry("labels").or_insert_with(|| json!({}));
        labels[LABEL_CONTROLLER_UID] = json!(uid);
        labels[LABEL_JOB_NAME] = json!(job_name);
        labels["controller-uid"] = json!(uid);
        labels["job-name"] = json!(job_name);
        let annotations = meta.entry("annotations").or_insert_with(|| json!({}));
        annotations["batch.kubernetes.io/job-tracking"] = json!("");
        meta.insert(
            "ownerReferences".into(),
            json!([{"apiVersion": "batch/v1", "kind": "Job", "name": job_name, "uid": uid,
                    "controller": true, "blockOwnerDeletion": true}]),
        );
        meta.insert("finalizers".into(), json!([JOB_TRACKING_FINALIZER]));
    }
    let spec = &mut pod["spec"];
    for (field, default) in [
        ("terminationGracePeriodSeconds", json!(30)),
        ("restartPolicy", json!("Never")),
        ("schedulerName", json!("default-scheduler")),
        ("dnsPolicy", json!("ClusterFirst")),
    ] {
        if spec.get(field).is_none() {
            spec[field] = default;
        }
    }
    let qos = qos_class(spec);
    pod["status"] = json!({"phase": "Pending", "qosClass": qos});
    let key = (Kind::Pod, namespace, name.clone());
    if let Ok(created) = s.create(&key, pod, false) {
        let pod_uid = meta_str(&created, "uid").unwrap_or_default().to_string();
        s.created_pods
            .insert(pod_uid, (uid, key.1.clone(), key.2.clone(), s.rv));
        s.record_event(
            job,
            "Normal",
            "SuccessfulCreate",
            &format!("Created pod: {name}"),
            "job-controller",
        );
    }
}
