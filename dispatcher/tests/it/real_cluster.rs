//! The Kubernetes runtime against a real kube-apiserver, with the real Job controller and
//! garbage collector: what the fake API server can only imitate (validation and
//! defaulting, admission, RBAC, the Job controller's `podFailurePolicy` and pod
//! replacement, ownerReference garbage collection).
//!
//! Ignored by default, because no API server runs in the test command (the research note
//! `k8s-runtime.md` §A.8 builds one by hand). Run them with two kubeconfigs:
//!
//! ```sh
//! TUNEQ_REAL_KUBECONFIG=dispatcher.kubeconfig TUNEQ_REAL_ADMIN_KUBECONFIG=admin.kubeconfig \
//!   cargo test -p tuneq-dispatcher --test it real_cluster -- --ignored
//! ```
//!
//! - `TUNEQ_REAL_KUBECONFIG` is the dispatcher's: a ServiceAccount bound in the namespace
//!   `tuneq` to the Role of the README's "Running on Kubernetes" (`watch` on jobs and
//!   pods included, for the runtime's watchers), and nothing more, so a
//!   request the Role does not grant fails the test. The optional Node reader is left out
//!   on purpose: the runtime must cope with its 403.
//! - `TUNEQ_REAL_ADMIN_KUBECONFIG` stands in for the kubelet (it binds pods and writes
//!   their status) and arranges what the dispatcher's Role may not: the namespace, the
//!   ServiceAccounts its pods need (`default`, `tuneq-trainer`) and a Node object.
//!
//! No scheduler or kubelet need run: a test binds the attempt's pod to that Node and
//! writes the pod's status the way the kubelet (or GKE's node shutdown) would. Tests share
//! the namespace and run in parallel, each with its own job ids and pool name. The runtime
//! is driven only through [`Runtime`] and the public constructors.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::de::DeserializeOwned;
use serde_json::json;
use std::fmt::Debug;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tuneq_dispatcher::kubernetes::{
    KubernetesRuntime, KubernetesSettings, MANAGED_SELECTOR, job_name, secret_name,
};
use tuneq_dispatcher::runtime::{End, Launch, Runtime, State};
use tuneq_openapi::TrainSpec;
use tuneq_pools::{Pool, PoolsFile};

/// The namespace of the example Xeon pool, where the dispatcher's Role is bound.
const NAMESPACE: &str = "tuneq";

/// The Node object attempts' pods are bound to (no kubelet behind it).
const NODE: &str = "tuneq-real-cluster-node";

/// How long the Job controller and the garbage collector may take to act.
const SETTLE: Duration = Duration::from_secs(60);

/// The report credential given to every attempt: it must never appear in a Job.
const CREDENTIAL: &str = "attempt-credential-never-inline";

/// A client from the kubeconfig file named by `var`. Panics, never skips, when the
/// variable is unset: an ignored test that is run on purpose must not pass vacuously.
async fn client(var: &str) -> kube::Client {
    let path = std::env::var_os(var).unwrap_or_else(|| {
        panic!("{var} is not set: these tests need a real kube-apiserver (research note k8s-runtime.md §A.8)")
    });
    let kubeconfig = Kubeconfig::read_from(&path)
        .unwrap_or_else(|e| panic!("cannot read {var}={}: {e}", path.to_string_lossy()));
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// The two identities a test acts as.
struct Cluster {
    /// The dispatcher's ServiceAccount: the runtime runs as it.
    dispatcher: kube::Client,
    /// The kubelet's stand-in, and the test's eyes.
    admin: kube::Client,
}

impl Cluster {
    /// Connects both, and makes sure the namespace, the trainers' ServiceAccount (the
    /// pods are refused without it) and the Node exist.
    async fn connect() -> Self {
        let cluster = Self {
            dispatcher: client("TUNEQ_REAL_KUBECONFIG").await,
            admin: client("TUNEQ_REAL_ADMIN_KUBECONFIG").await,
        };
        let pp = PostParams::default();
        let ns: Api<Namespace> = Api::all(cluster.admin.clone());
        exists(
            ns.create(&pp, &object(json!({"metadata": {"name": NAMESPACE}})))
                .await,
        );
        let sas: Api<ServiceAccount> = Api::namespaced(cluster.admin.clone(), NAMESPACE);
        for name in ["default", "tuneq-trainer"] {
            exists(
                sas.create(&pp, &object(json!({"metadata": {"name": name}})))
                    .await,
            );
        }
        let nodes: Api<Node> = Api::all(cluster.admin.clone());
        exists(
            nodes
                .create(&pp, &object(json!({"metadata": {"name": NODE}})))
                .await,
        );
        cluster
    }

    fn jobs(&self) -> Api<Job> {
        Api::namespaced(self.admin.clone(), NAMESPACE)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), NAMESPACE)
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.admin.clone(), NAMESPACE)
    }

    /// A runtime for a pool of the example Xeon pool's shape, named `pool`, acting as the
    /// dispatcher's ServiceAccount.
    fn runtime(&self, pool: &str) -> KubernetesRuntime {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/pools/xeon.toml");
        let mut xeon: Pool = PoolsFile::load(&file).unwrap().pools.remove(0);
        assert_eq!(xeon.kubernetes.as_ref().unwrap().namespace, NAMESPACE);
        xeon.name = pool.to_string();
        let mut settings = KubernetesSettings::new(xeon, "http://tuneq-api.tuneq.svc:8080".into());
        settings.node_check_every = Duration::ZERO;
        KubernetesRuntime::new(self.dispatcher.clone(), settings).unwrap()
    }

    /// The pod the Job controller made for attempt `token` of `job`, once it has.
    async fn pod_of(&self, job: &str, token: u64) -> Pod {
        let selector = &format!("batch.kubernetes.io/job-name={}", job_name(job, token));
        let pods = &self.pods();
        eventually("the Job controller makes a pod", move || async move {
            let mut found = pods
                .list(&ListParams::default().labels(selector))
                .await
                .unwrap();
            found.items.pop()
        })
        .await
    }

    /// Binds `pod` to [`NODE`] and writes its status as the kubelet would: `status` is
    /// merged into the pod's status (lists replaced).
    async fn kubelet(&self, pod: &Pod, status: serde_json::Value) -> Pod {
        let name = pod.metadata.name.clone().unwrap();
        let pods = self.pods();
        if pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none()
        {
            let binding = json!({"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name}, "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}});
            pods.create_subresource::<_, serde_json::Value>(
                "binding",
                &name,
                &PostParams::default(),
                &binding,
            )
            .await
            .unwrap();
        }
        pods.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status})),
        )
        .await
        .unwrap()
    }

    /// Runs `pod`'s trainer: phase `Running`, its container started.
    async fn run(&self, pod: &Pod) -> Pod {
        let now = timestamp();
        self.kubelet(
            pod,
            json!({
                "phase": "Running", "startTime": now,
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
                "containerStatuses": [container(json!({"running": {"startedAt": now}}), true)],
            }),
        )
        .await
    }

    /// Ends `pod`'s trainer with `exit_code` (and its termination `message`), the pod
    /// `Failed` (or `Succeeded` on 0); the fields of `extra` replace the status's own.
    async fn exit(&self, pod: &Pod, exit_code: i32, message: &str, extra: serde_json::Value) {
        let now = timestamp();
        let mut status = json!({
            "phase": if exit_code == 0 { "Succeeded" } else { "Failed" },
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
            "containerStatuses": [container(json!({"terminated": {
                "exitCode": exit_code, "reason": if exit_code == 0 { "Completed" } else { "Error" },
                "message": message, "startedAt": now, "finishedAt": now}}), false)],
        });
        if let (Some(status), Some(extra)) = (status.as_object_mut(), extra.as_object()) {
            status.extend(extra.clone());
        }
        self.kubelet(pod, status).await;
    }

    /// The Job's condition `type_` once the Job controller has set it.
    async fn job_condition(&self, job: &str, token: u64, type_: &str) -> (String, String) {
        let jobs = &self.jobs();
        let name = &job_name(job, token);
        eventually(
            &format!("Job {name} gets condition {type_}"),
            move || async move {
                let job = jobs.get(name).await.unwrap();
                job.status?.conditions?.into_iter().find_map(|c| {
                    (c.type_ == type_ && c.status == "True")
                        .then(|| (c.reason.unwrap_or_default(), c.message.unwrap_or_default()))
                })
            },
        )
        .await
    }

    /// Waits until the pod `pod` and the Secret `secret` are gone.
    async fn collected(&self, pod: &str, secret: &str) {
        let (pods, secrets) = (&self.pods(), &self.secrets());
        eventually(
            &format!("pod {pod} and Secret {secret} are collected"),
            move || async move {
                let pod_gone = pods.get_opt(pod).await.unwrap().is_none();
                let secret_gone = secrets.get_opt(secret).await.unwrap().is_none();
                (pod_gone && secret_gone).then_some(())
            },
        )
        .await;
    }
}

/// An object of type `T` from its JSON.
fn object<T: DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).unwrap()
}

/// A create's result, `AlreadyExists` counting as created.
fn exists<T: Debug>(result: kube::Result<T>) {
    match result {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
        Err(e) => panic!("cannot create: {e}"),
    }
}

/// The trainer's container status in `state`.
fn container(state: serde_json::Value, ready: bool) -> serde_json::Value {
    json!({"name": "trainer", "state": state, "ready": ready, "restartCount": 0,
           "image": "registry.example.com/tuneq/tuneq:0.1.0", "imageID": "", "started": ready})
}

/// Now, as the API writes times.
fn timestamp() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap()
        .to_string()
}

/// A job id no other test, nor an earlier run, uses: `rk<time><n>`.
fn job_id(n: u32) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("rk{:x}{n}", nanos % (1 << 48))
}

/// What `f` returns once it returns something, within [`SETTLE`].
async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + SETTLE;
    loop {
        if let Some(t) = f().await {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn start(rt: &mut KubernetesRuntime, job: &str, token: u64) -> Result<(), String> {
    let spec: TrainSpec =
        object(json!({"model": "m", "training_files": ["s3://b/t.jsonl"], "output": "s3://b/o"}));
    rt.start(&Launch {
        job,
        token,
        tenant: "acme",
        spec: &spec,
        credential: CREDENTIAL,
    })
    .await
    .map_err(|e| e.to_string())
}

/// Waits until the runtime sees the attempt's trainer running (it learns through its
/// watches, a moment after the API server).
async fn seen_running(rt: &mut KubernetesRuntime, job: &str, token: u64) {
    let deadline = Instant::now() + SETTLE;
    loop {
        match rt.poll(job, token).await.unwrap() {
            State::Running => return,
            State::Pending => {
                assert!(Instant::now() < deadline, "attempt {job}/{token} never ran");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            State::Ended(end) => panic!("attempt {job}/{token} ended: {end:?}"),
        }
    }
}

/// How the attempt ends, once the runtime says it has.
async fn ended(rt: &mut KubernetesRuntime, job: &str, token: u64) -> End {
    let deadline = Instant::now() + SETTLE;
    loop {
        match rt.poll(job, token).await.unwrap() {
            State::Ended(end) => return end,
            State::Running | State::Pending => {
                assert!(
                    Instant::now() < deadline,
                    "attempt {job}/{token} never ended"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn an_attempt_is_a_job_its_secret_and_a_pod_and_release_removes_them() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-a");
    let job = job_id(1);
    start(&mut rt, &job, 3).await.unwrap();
    // A retried start (its answer lost) adopts the same attempt's Job: the 409 path.
    start(&mut rt, &job, 3).await.unwrap();

    let created = k.jobs().get(&job_name(&job, 3)).await.unwrap();
    let secret = k.secrets().get(&secret_name(&job, 3)).await.unwrap();
    let owner = &secret.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), Some(&owner.uid)),
        ("Job", created.metadata.uid.as_ref())
    );
    assert!(
        !serde_json::to_string(&created)
            .unwrap()
            .contains(CREDENTIAL)
    );
    // The Job controller accepts the Job and makes its pod; with no kubelet it waits.
    let pod = k.pod_of(&job, 3).await;
    assert_eq!(pod.status.unwrap().phase.as_deref(), Some("Pending"));
    assert_eq!(rt.poll(&job, 3).await.unwrap(), State::Pending);

    // The Job goes at once; its pod follows by the garbage collector.
    rt.release(&job, 3).await.unwrap();
    k.collected(&pod.metadata.name.unwrap(), &secret_name(&job, 3))
        .await;
    assert!(
        k.jobs()
            .get_opt(&job_name(&job, 3))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn a_job_of_another_attempt_under_the_same_name_is_not_adopted() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-b");
    let job = job_id(2);
    let stale: Job = object(json!({
        "metadata": {"name": job_name(&job, 4),
                     "annotations": {"tuneq.io/attempt-uid": "99", "tuneq.io/job-id": &job}},
        "spec": {"suspend": true, "template": {"spec": {"restartPolicy": "Never",
                 "containers": [{"name": "trainer", "image": "registry.example.com/x:1"}]}}},
    }));
    k.jobs()
        .create(&PostParams::default(), &stale)
        .await
        .unwrap();
    let refused = start(&mut rt, &job, 4).await.unwrap_err();
    assert!(refused.contains("not adopted"), "{refused}");
    rt.release(&job, 4).await.unwrap();
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn a_node_shutdown_fails_the_job_by_its_pod_failure_policy_and_reads_as_interrupted() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-c");
    let job = job_id(3);
    start(&mut rt, &job, 1).await.unwrap();
    let pod = k.run(&k.pod_of(&job, 1).await).await;
    seen_running(&mut rt, &job, 1).await;
    // GKE's graceful node shutdown: DisruptionTarget, then the trainer's checkpoint and
    // exit 75, the pod Failed with reason Terminated (research note §B.1).
    let now = timestamp();
    k.exit(
        &pod,
        75,
        "checkpoint written",
        json!({
            "reason": "Terminated",
            "message": "Pod was terminated in response to imminent node shutdown.",
            "conditions": [
                {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                 "message": "Pod was terminated in response to imminent node shutdown.",
                 "lastTransitionTime": now},
                {"type": "Ready", "status": "False", "lastTransitionTime": now},
            ],
        }),
    )
    .await;
    let (reason, message) = k.job_condition(&job, 1, "Failed").await;
    assert_eq!(reason, "PodFailurePolicy");
    assert!(
        message.ends_with("has condition DisruptionTarget matching FailJob rule at index 0"),
        "{message}"
    );
    let End::Interrupted(why) = ended(&mut rt, &job, 1).await else {
        panic!("a node shutdown must read as interrupted");
    };
    assert!(
        why.contains(NODE) && why.contains("TerminationByKubelet"),
        "{why}"
    );
    rt.release(&job, 1).await.unwrap();
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn exit_codes_read_as_bad_input_a_crash_and_finished() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-d");
    let job = job_id(4);
    for token in 1..=3 {
        start(&mut rt, &job, token).await.unwrap();
    }
    let pods = [
        k.run(&k.pod_of(&job, 1).await).await,
        k.run(&k.pod_of(&job, 2).await).await,
        k.run(&k.pod_of(&job, 3).await).await,
    ];
    k.exit(&pods[0], 42, "line 3: messages: missing", json!({}))
        .await;
    k.exit(&pods[1], 1, "panicked", json!({})).await;
    k.exit(&pods[2], 0, "", json!({})).await;

    let (reason, message) = k.job_condition(&job, 1, "Failed").await;
    assert_eq!(reason, "PodFailurePolicy");
    assert!(
        message.ends_with("matching FailJob rule at index 1"),
        "{message}"
    );
    let End::BadInput(message) = ended(&mut rt, &job, 1).await else {
        panic!("exit 42 must read as bad input");
    };
    assert!(message.contains("line 3"), "{message}");

    // No rule matches exit 1: the pod counts against backoffLimit 0.
    assert_eq!(
        k.job_condition(&job, 2, "Failed").await.0,
        "BackoffLimitExceeded"
    );
    let End::Crashed(message) = ended(&mut rt, &job, 2).await else {
        panic!("exit 1 must read as a crash");
    };
    assert!(message.contains("panicked"), "{message}");

    k.job_condition(&job, 3, "Complete").await;
    assert_eq!(ended(&mut rt, &job, 3).await, End::Finished);
    for token in 1..=3 {
        rt.release(&job, token).await.unwrap();
    }
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn a_stopped_attempt_checkpoints_exits_75_and_reads_as_interrupted_with_no_second_pod() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-h");
    let job = job_id(7);
    start(&mut rt, &job, 1).await.unwrap();
    let pod = k.run(&k.pod_of(&job, 1).await).await;
    rt.stop(&job, 1).await.unwrap();
    // The pod is deleted with the pool's grace; until its kubelet says the trainer
    // stopped, it is alive and the attempt runs.
    let name = pod.metadata.name.clone().unwrap();
    let deleting = k.pods().get(&name).await.unwrap();
    assert_eq!(deleting.metadata.deletion_grace_period_seconds, Some(90));
    seen_running(&mut rt, &job, 1).await;
    // The trainer writes its checkpoint on SIGTERM and exits 75: no rule matches, the
    // failure counts against backoffLimit 0 and `podReplacementPolicy: Failed` (the
    // default with a podFailurePolicy) made no replacement while the pod terminated.
    k.exit(&pod, 75, "checkpoint written", json!({})).await;
    assert_eq!(
        k.job_condition(&job, 1, "Failed").await.0,
        "BackoffLimitExceeded"
    );
    let End::Interrupted(why) = ended(&mut rt, &job, 1).await else {
        panic!("exit 75 after a stop must read as interrupted");
    };
    assert!(why.contains("exit 75"), "{why}");
    let selector = format!("batch.kubernetes.io/job-name={}", job_name(&job, 1));
    let pods = k
        .pods()
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap();
    assert_eq!(pods.items.len(), 1, "the Job controller made a second pod");
    rt.release(&job, 1).await.unwrap();
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn a_killed_attempt_ends_once_its_kubelet_confirms_and_its_secret_goes_with_the_job() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-e");
    let job = job_id(5);
    start(&mut rt, &job, 1).await.unwrap();
    let pod = k.run(&k.pod_of(&job, 1).await).await;
    let name = pod.metadata.name.clone().unwrap();
    rt.kill(&job, 1).await.unwrap();
    // A grace of one second, never zero: a force delete would drop the pod object (the
    // Job controller lets its tracking finalizer go) without the kubelet's word that the
    // trainer stopped, and the double-run guard would have nothing left to wait for.
    let deleting = k.pods().get(&name).await.unwrap();
    assert_eq!(deleting.metadata.deletion_grace_period_seconds, Some(1));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let state = rt.poll(&job, 1).await.unwrap();
    assert!(
        !matches!(state, State::Ended(_)),
        "no kubelet confirmed the trainer stopped: {state:?}"
    );
    // The kubelet SIGKILLs the trainer, reports it, and removes the pod (grace 0 is
    // its own last word).
    k.exit(&pod, 137, "killed", json!({})).await;
    k.pods()
        .delete(&name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let End::Interrupted(why) = ended(&mut rt, &job, 1).await else {
        panic!("a killed attempt reads as interrupted");
    };
    assert!(why.contains("is gone"), "{why}");
    // `kill` leaves the Secret to the garbage collector (its owner is the Job).
    k.collected(&name, &secret_name(&job, 1)).await;
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn leftovers_are_the_pools_own_jobs_found_by_label() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-f");
    let mut other = k.runtime("rk-xeon-g");
    let job = job_id(6);
    start(&mut rt, &job, 5).await.unwrap();
    start(&mut rt, &job, 6).await.unwrap();
    start(&mut other, &job, 7).await.unwrap();
    let mut found = rt.leftovers().await.unwrap();
    found.retain(|(j, _)| *j == job);
    found.sort();
    assert_eq!(found, [(job.clone(), 5), (job.clone(), 6)]);
    let mut theirs = other.leftovers().await.unwrap();
    theirs.retain(|(j, _)| *j == job);
    assert_eq!(theirs, [(job.clone(), 7)]);
    for token in [5, 6] {
        rt.release(&job, token).await.unwrap();
    }
    other.release(&job, 7).await.unwrap();
}

#[tokio::test]
#[ignore = "needs a real kube-apiserver: set TUNEQ_REAL_KUBECONFIG"]
async fn the_dispatchers_role_lets_it_watch_its_jobs_and_pods() {
    let k = Cluster::connect().await;
    let mut rt = k.runtime("rk-xeon-i");
    let job = job_id(8);
    // Watches as kube's watcher makes them after its list: from the list's
    // resourceVersion, by label, with bookmarks; each ends after its timeout.
    let mut watches = Vec::new();
    for path in [
        format!("/apis/batch/v1/namespaces/{NAMESPACE}/jobs"),
        format!("/api/v1/namespaces/{NAMESPACE}/pods"),
    ] {
        let list = kube::core::Request::new(&path)
            .list(&ListParams::default().labels(MANAGED_SELECTOR))
            .unwrap();
        let listed: serde_json::Value = k.dispatcher.request(list).await.unwrap();
        let rv = listed["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        let params = WatchParams::default().labels(MANAGED_SELECTOR).timeout(3);
        let watch = kube::core::Request::new(&path).watch(&params, &rv).unwrap();
        let client = k.dispatcher.clone();
        watches.push(tokio::spawn(
            async move { client.request_text(watch).await },
        ));
    }
    start(&mut rt, &job, 1).await.unwrap();
    let pod = k.pod_of(&job, 1).await.metadata.name.unwrap();
    for (watch, name) in watches.into_iter().zip([job_name(&job, 1), pod]) {
        let events = watch.await.unwrap().unwrap();
        assert!(
            events
                .lines()
                .any(|l| l.contains(r#""type":"ADDED""#) && l.contains(&name)),
            "no ADDED event for {name}: {events}"
        );
    }
    rt.release(&job, 1).await.unwrap();
}
