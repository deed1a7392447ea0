//! The scheduler, the kubelet and the disruptions of a spot cluster, as simulators a test
//! steps. Each writes the pod shapes the real component writes (`docs/kubernetes.md`): the
//! conditions, `status.reason`/`message`, container states and exit codes that tuneq's
//! classifier reads.
//!
//! A pod is named by `name` (searched in every namespace) or `namespace/name`.

use crate::store::{DeleteOptions, Key, Kind, State, pod_terminal, random_hex};
use crate::{Error, FakeCluster, Result};
use serde_json::{Value, json};

/// The kubelet's message on a pod it terminates for a graceful node shutdown.
pub const NODE_SHUTDOWN_MESSAGE: &str = "Pod was terminated in response to imminent node shutdown.";
/// The eviction API's `DisruptionTarget` message.
pub const EVICTION_MESSAGE: &str = "Eviction API: evicting";
/// PodGC's `DisruptionTarget` message.
pub const PODGC_MESSAGE: &str = "PodGC: node no longer exists";

/// Sets the pod condition `type_` (replacing one of the same type; the transition time
/// stays when the status does not change).
fn set_condition(
    pod: &mut Value,
    type_: &str,
    status: &str,
    reason: Option<&str>,
    message: Option<&str>,
    now: &str,
) {
    if !pod.get("status").is_some_and(Value::is_object) {
        pod["status"] = json!({});
    }
    let mut c = json!({"type": type_, "status": status, "lastProbeTime": null,
                       "lastTransitionTime": now});
    if let Some(r) = reason {
        c["reason"] = json!(r);
    }
    if let Some(m) = message {
        c["message"] = json!(m);
    }
    let conditions = pod["status"]
        .as_object_mut()
        .map(|s| s.entry("conditions").or_insert_with(|| json!([])));
    let Some(Value::Array(cs)) = conditions else {
        return;
    };
    if let Some(old) = cs.iter_mut().find(|x| x["type"] == type_) {
        if old["status"] == status {
            c["lastTransitionTime"] = old["lastTransitionTime"].clone();
        }
        *old = c;
    } else {
        cs.push(c);
    }
}

/// The pod's container statuses, each in `state` (a `ContainerState` object built from the
/// container's own status so far).
fn set_containers(pod: &mut Value, ready: bool, state: impl Fn(&Value, Option<&Value>) -> Value) {
    let containers: Vec<Value> = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let old: Vec<Value> = pod
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let statuses: Vec<Value> = containers
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap_or_default();
            let image = c["image"].as_str().unwrap_or_default();
            let prev = old.iter().find(|o| o["name"] == name);
            let st = state(c, prev);
            let waiting = st.get("waiting").is_some();
            let mut status = json!({
                "name": name,
                "image": image,
                "imageID": if waiting { String::new() } else {
                    prev.and_then(|p| p["imageID"].as_str()).filter(|i| !i.is_empty())
                        .map(str::to_string)
                        .unwrap_or_else(|| format!("{image}@sha256:{}", random_hex(64)))
                },
                "ready": ready,
                "restartCount": 0,
                "started": st.get("running").is_some(),
                "state": st,
            });
            if !waiting {
                status["containerID"] = prev
                    .and_then(|p| p.get("containerID").cloned())
                    .unwrap_or_else(|| json!(format!("containerd://{}", random_hex(64))));
            }
            status
        })
        .collect();
    pod["status"]["containerStatuses"] = json!(statuses);
}

fn pod_key(s: &State, pod: &str) -> Result<Key> {
    s.find(Kind::Pod, pod).ok_or_else(|| Error::NotFound {
        kind: Kind::Pod,
        name: pod.to_string(),
    })
}

fn node_of(pod: &Value) -> Option<String> {
    pod.pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
}

/// Ends the pod's containers with `code` (`reason`, `message`): phase `Succeeded` when
/// every container exited 0, `Failed` otherwise.
fn terminate(pod: &mut Value, code: i32, reason: &str, message: Option<&str>, now: &str) {
    set_containers(pod, false, |_, prev| {
        let started = prev
            .and_then(|p| p.pointer("/state/running/startedAt"))
            .cloned()
            .unwrap_or(json!(now));
        let mut t = json!({"exitCode": code, "reason": reason, "startedAt": started,
                           "finishedAt": now});
        if let Some(m) = message {
            t["message"] = json!(m);
        }
        json!({"terminated": t})
    });
    let phase = if code == 0 { "Succeeded" } else { "Failed" };
    pod["status"]["phase"] = json!(phase);
    let why = if code == 0 {
        "PodCompleted"
    } else {
        "PodFailed"
    };
    for type_ in ["Ready", "ContainersReady"] {
        set_condition(pod, type_, "False", Some(why), None, now);
    }
}

/// The eviction API on the pod at `key`: `DisruptionTarget` (`EvictionByEvictionAPI`), then
/// a graceful delete; the pod runs on until the kubelet ends it.
pub(crate) fn evict_in(s: &mut State, key: &Key) -> Result<(), crate::store::ApiError> {
    disrupt_in(s, key, "EvictionByEvictionAPI", EVICTION_MESSAGE)?;
    s.delete(key, &DeleteOptions::default())?;
    Ok(())
}

fn disrupt_in(
    s: &mut State,
    key: &Key,
    reason: &str,
    message: &str,
) -> Result<Value, crate::store::ApiError> {
    s.update(key, |p, st| {
        let now = st.now_string();
        set_condition(
            p,
            "DisruptionTarget",
            "True",
            Some(reason),
            Some(message),
            &now,
        );
    })
}

impl FakeCluster {
    fn pod_update(&self, pod: &str, f: impl FnOnce(&mut Value, &State, &str)) -> Result<Value> {
        self.with_state(|s| {
            let key = pod_key(s, pod)?;
            s.update(&key, |p, st| {
                let now = st.now_string();
                f(p, st, &now);
            })
            .map_err(|_| Error::NotFound {
                kind: Kind::Pod,
                name: pod.to_string(),
            })
        })
    }

    /// The scheduler binds `pod` to `node` (creating the Node, Ready, if it is new):
    /// `spec.nodeName` and `PodScheduled=True`, and a `Scheduled` event.
    pub fn schedule(&self, pod: &str, node: &str) -> Result<()> {
        self.with_state(|s| {
            let key = pod_key(s, pod)?;
            let node_key = (Kind::Node, String::new(), node.to_string());
            if !s.objects.contains_key(&node_key) {
                let now = s.now_string();
                let n = json!({
                    "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                    "status": {"conditions": [{"type": "Ready", "status": "True",
                        "reason": "KubeletReady", "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]},
                });
                let _ = s.create(&node_key, n, false);
            }
            let p = s
                .update(&key, |p, st| {
                    let now = st.now_string();
                    p["spec"]["nodeName"] = json!(node);
                    set_condition(p, "PodScheduled", "True", None, None, &now);
                })
                .map_err(|_| Error::NotFound {
                    kind: Kind::Pod,
                    name: pod.to_string(),
                })?;
            let message = format!("Successfully assigned {}/{} to {node}", key.1, key.2);
            s.record_event(&p, "Normal", "Scheduled", &message, "default-scheduler");
            Ok(())
        })
    }

    /// The scheduler finds no node: `PodScheduled=False`, reason `Unschedulable`, and a
    /// `FailedScheduling` event with `message`.
    pub fn unschedulable(&self, pod: &str, message: &str) -> Result<()> {
        let p = self.pod_update(pod, |p, _, now| {
            set_condition(
                p,
                "PodScheduled",
                "False",
                Some("Unschedulable"),
                Some(message),
                now,
            );
        })?;
        self.with_state(|s| {
            s.record_event(
                &p,
                "Warning",
                "FailedScheduling",
                message,
                "default-scheduler",
            );
        });
        Ok(())
    }

    /// An event about `pod` from `component` (the cluster autoscaler's
    /// `TriggeredScaleUp`, `NotTriggerScaleUp`, `FailedScaleUp`, …).
    pub fn pod_event(
        &self,
        pod: &str,
        type_: &str,
        reason: &str,
        message: &str,
        component: &str,
    ) -> Result<()> {
        self.with_state(|s| {
            let key = pod_key(s, pod)?;
            let p = s.objects.get(&key).cloned().unwrap_or_default();
            s.record_event(&p, type_, reason, message, component);
            Ok(())
        })
    }

    /// The kubelet starts the pod's containers: phase `Running`, `startTime`, every
    /// container running and ready. The pod must be scheduled.
    pub fn run(&self, pod: &str) -> Result<()> {
        let mut unscheduled = false;
        self.pod_update(pod, |p, _, now| {
            if node_of(p).is_none() {
                unscheduled = true;
                return;
            }
            p["status"]["phase"] = json!("Running");
            if p.pointer("/status/startTime").is_none() {
                p["status"]["startTime"] = json!(now);
            }
            p["status"]["hostIP"] = json!("10.128.0.7");
            p["status"]["podIP"] = json!("10.4.0.12");
            for type_ in [
                "PodReadyToStartContainers",
                "Initialized",
                "Ready",
                "ContainersReady",
                "PodScheduled",
            ] {
                set_condition(p, type_, "True", None, None, now);
            }
            let now = now.to_string();
            set_containers(p, true, |_, _| json!({"running": {"startedAt": now}}));
        })?;
        if unscheduled {
            return Err(Error::InvalidState(format!(
                "pod {pod} is not scheduled: call schedule first"
            )));
        }
        Ok(())
    }

    /// The containers exit with `code`, `reason` (`Completed`, `Error`, `OOMKilled`) and
    /// termination `message`: phase `Succeeded` for 0, `Failed` otherwise. A pod being
    /// deleted is then gone (once the Job controller has released it).
    pub fn exit(&self, pod: &str, code: i32, reason: &str, message: Option<&str>) -> Result<()> {
        self.pod_update(pod, |p, _, now| terminate(p, code, reason, message, now))?;
        Ok(())
    }

    /// The kernel's OOM killer ends the trainer: exit 137, reason `OOMKilled`.
    pub fn oom_kill(&self, pod: &str) -> Result<()> {
        self.exit(pod, 137, "OOMKilled", None)
    }

    fn waiting(&self, pod: &str, reason: &str, message: impl Fn(&Value) -> String) -> Result<()> {
        self.pod_update(pod, |p, _, now| {
            p["status"]["phase"] = json!("Pending");
            if p.pointer("/status/startTime").is_none() {
                p["status"]["startTime"] = json!(now);
            }
            let names: Vec<String> = p
                .pointer("/spec/containers")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|c| c["name"].as_str().map(str::to_string))
                .collect();
            let unready = format!("containers with unready status: [{}]", names.join(" "));
            set_condition(p, "PodReadyToStartContainers", "True", None, None, now);
            set_condition(p, "Initialized", "True", None, None, now);
            for type_ in ["Ready", "ContainersReady"] {
                set_condition(
                    p,
                    type_,
                    "False",
                    Some("ContainersNotReady"),
                    Some(&unready),
                    now,
                );
            }
            let msg = message(p);
            set_containers(
                p,
                false,
                |_, _| json!({"waiting": {"reason": reason, "message": msg}}),
            );
        })?;
        Ok(())
    }

    /// The image cannot be pulled: the containers wait with `ImagePullBackOff`.
    pub fn image_pull_backoff(&self, pod: &str) -> Result<()> {
        self.waiting(pod, "ImagePullBackOff", |p| {
            let image = p
                .pointer("/spec/containers/0/image")
                .and_then(Value::as_str)
                .unwrap_or_default();
            format!("Back-off pulling image \"{image}\"")
        })
    }

    /// A Secret the pod needs is missing: the containers wait with
    /// `CreateContainerConfigError`, naming the first referenced Secret not stored.
    pub fn config_error(&self, pod: &str) -> Result<()> {
        let missing = self.with_state(|s| {
            let key = pod_key(s, pod)?;
            let p = s.objects.get(&key).cloned().unwrap_or_default();
            let mut names: Vec<String> = Vec::new();
            for c in p
                .pointer("/spec/containers")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                for e in c["env"].as_array().into_iter().flatten() {
                    if let Some(n) = e
                        .pointer("/valueFrom/secretKeyRef/name")
                        .and_then(Value::as_str)
                    {
                        names.push(n.to_string());
                    }
                }
            }
            for v in p
                .pointer("/spec/volumes")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(n) = v.pointer("/secret/secretName").and_then(Value::as_str) {
                    names.push(n.to_string());
                }
            }
            Ok::<_, Error>(
                names
                    .into_iter()
                    .find(|n| {
                        !s.objects
                            .contains_key(&(Kind::Secret, key.1.clone(), n.clone()))
                    })
                    .unwrap_or_else(|| "missing".to_string()),
            )
        })?;
        self.waiting(pod, "CreateContainerConfigError", |_| {
            format!("secret \"{missing}\" not found")
        })
    }

    /// A spot preemption: the kubelet's graceful node shutdown. First `DisruptionTarget=True`
    /// (`TerminationByKubelet`), then phase `Failed`, reason `Terminated`, the kubelet's
    /// message, and the containers ended with `exit_code` (143, SIGTERM, when `None`).
    ///
    /// A pod that a [`ProcessKubelet`](crate::process::ProcessKubelet) runs gets the
    /// condition now and its process SIGTERM; the rest is written when the process exits,
    /// with its own exit code (`exit_code` is then unused).
    pub fn preempt_node_shutdown(&self, pod: &str, exit_code: Option<i32>) -> Result<()> {
        self.node_shutdown_target(pod)?;
        if self.signal_node_shutdown(pod)? {
            return Ok(());
        }
        self.node_shutdown_end(pod, exit_code.unwrap_or(143))
    }

    /// The first half of a node shutdown: `DisruptionTarget=True` (`TerminationByKubelet`).
    pub(crate) fn node_shutdown_target(&self, pod: &str) -> Result<()> {
        self.pod_update(pod, |p, _, now| {
            set_condition(
                p,
                "DisruptionTarget",
                "True",
                Some("TerminationByKubelet"),
                Some(NODE_SHUTDOWN_MESSAGE),
                now,
            );
        })?;
        Ok(())
    }

    /// The second half of a node shutdown: the containers ended with `code`, phase
    /// `Failed`, reason `Terminated`, the kubelet's message.
    pub(crate) fn node_shutdown_end(&self, pod: &str, code: i32) -> Result<()> {
        self.pod_update(pod, |p, _, now| {
            terminate(p, code, "Error", None, now);
            p["status"]["phase"] = json!("Failed");
            p["status"]["reason"] = json!("Terminated");
            p["status"]["message"] = json!(NODE_SHUTDOWN_MESSAGE);
        })?;
        Ok(())
    }

    /// A drain through the eviction API: `DisruptionTarget=True` (`EvictionByEvictionAPI`),
    /// then a graceful delete. The pod keeps running until [`FakeCluster::exit`].
    pub fn evict(&self, pod: &str) -> Result<()> {
        self.with_state(|s| {
            let key = pod_key(s, pod)?;
            evict_in(s, &key).map_err(|e| Error::InvalidState(e.message))
        })
    }

    /// Another disruption (`DeletionByTaintManager`, `PreemptionByScheduler`, …):
    /// `DisruptionTarget=True` with `reason` and `message`, then a graceful delete.
    pub fn disrupt(&self, pod: &str, reason: &str, message: &str) -> Result<()> {
        self.with_state(|s| {
            let key = pod_key(s, pod)?;
            disrupt_in(s, &key, reason, message)
                .and_then(|_| s.delete(&key, &DeleteOptions::default()))
                .map(|_| ())
                .map_err(|e| Error::InvalidState(e.message))
        })
    }

    /// The node's VM is gone: the Node object is deleted; its pods stay as they were
    /// (`Running`) until [`FakeCluster::podgc`].
    pub fn delete_node(&self, node: &str) -> Result<()> {
        self.with_state(|s| {
            let key = (Kind::Node, String::new(), node.to_string());
            s.delete(&key, &DeleteOptions::default())
                .map(|_| ())
                .map_err(|_| Error::NotFound {
                    kind: Kind::Node,
                    name: node.to_string(),
                })
        })
    }

    /// PodGC on a pod whose node is gone: `DisruptionTarget=True` (`DeletionByPodGC`),
    /// phase `Failed`, the containers that had not ended marked ended (137,
    /// `ContainerStatusUnknown`), then a delete with grace 0.
    pub fn podgc(&self, pod: &str) -> Result<()> {
        self.with_state(|s| {
            let key = pod_key(s, pod)?;
            let p = s.objects.get(&key).cloned().unwrap_or_default();
            if let Some(node) = node_of(&p)
                && s.objects.contains_key(&(Kind::Node, String::new(), node.clone())) {
                    return Err(Error::InvalidState(format!("node {node} of pod {pod} still exists")));
                }
            s.update(&key, |p, st| {
                let now = st.now_string();
                set_condition(p, "DisruptionTarget", "True", Some("DeletionByPodGC"), Some(PODGC_MESSAGE), &now);
                if !pod_terminal(p) {
                    set_containers(p, false, |_, prev| match prev.and_then(|x| x.pointer("/state/terminated")) {
                        Some(t) => json!({"terminated": t}),
                        None => json!({"terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown",
                            "message": "The container could not be located when the pod was terminated",
                            "startedAt": prev.and_then(|x| x.pointer("/state/running/startedAt")).cloned().unwrap_or(json!(now)),
                            "finishedAt": now}}),
                    });
                    p["status"]["phase"] = json!("Failed");
                    for type_ in ["Ready", "ContainersReady"] {
                        set_condition(p, type_, "False", Some("PodFailed"), None, &now);
                    }
                }
            })
            .and_then(|_| {
                s.delete(&key, &DeleteOptions { grace: Some(0), ..Default::default() })
            })
            .map(|_| ())
            .map_err(|e| Error::InvalidState(e.message))
        })
    }
}
