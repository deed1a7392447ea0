//! The Kubernetes runtime against the fake API server: the requests it sends (a 409
//! adopted only for the same attempt, Background deletes, label selectors, no PUT), how
//! it reads each way an attempt ends, what it finds after a restart, and the double-run
//! guard (an attempt is over only when no pod of it is alive).

use crate::as_written;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde_json::json;
use std::path::Path;
use std::time::Duration;
use tuneq_dispatcher::kubernetes::{KubernetesRuntime, KubernetesSettings, job_name};
use tuneq_dispatcher::runtime::{End, Launch, Runtime, State};
use tuneq_kube_fake::{FakeCluster, Kind};
use tuneq_openapi::TrainSpec;
use tuneq_pools::{Pool, PoolsFile};

/// The example Xeon pool (namespace `tuneq`), or another pool of the same shape.
fn xeon(name: &str) -> Pool {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/pools/xeon.toml");
    let mut pool = PoolsFile::load(&file).unwrap().pools.remove(0);
    pool.name = name.to_string();
    pool
}

/// [`xeon`], its Kubernetes settings changed by `change`.
fn xeon_with(change: impl FnOnce(&mut tuneq_pools::KubernetesPool)) -> Pool {
    let mut pool = xeon("xeon");
    if let Some(k) = pool.kubernetes.as_mut() {
        change(k);
    }
    pool
}

/// A runtime for `pool` that has started attempt 1 of job `j1`, and the attempt's pod.
async fn started(cluster: &FakeCluster, pool: Pool) -> (KubernetesRuntime, String) {
    let mut rt = runtime(cluster, pool);
    start(&mut rt, "j1", 1).await.unwrap();
    cluster.sync_jobs();
    let pod = cluster
        .live_pod_of(&format!("tuneq/{}", job_name("j1", 1)))
        .unwrap();
    (rt, pod)
}

fn runtime(cluster: &FakeCluster, pool: Pool) -> KubernetesRuntime {
    let mut settings = KubernetesSettings::new(pool, "http://tuneq-api.tuneq.svc:8080".into());
    settings.node_check_every = Duration::ZERO;
    KubernetesRuntime::new(cluster.client(), settings).unwrap()
}

fn spec() -> TrainSpec {
    serde_json::from_value(
        json!({"model": "m", "training_files": ["s3://b/t.jsonl"], "output": "s3://b/o"}),
    )
    .unwrap()
}

async fn start(
    runtime: &mut KubernetesRuntime,
    job: &str,
    token: u64,
) -> Result<(), tuneq_dispatcher::DispatchError> {
    let spec = spec();
    runtime
        .start(&Launch {
            job,
            token,
            tenant: "acme",
            spec: &spec,
            credential: "attempt-credential-never-inline",
        })
        .await
}

/// Polls the attempt as the dispatcher's loop does each tick, until `wanted` holds or
/// five seconds pass: the runtime learns of changes through its watches, a moment after
/// they happen. Returns the last state read.
async fn poll_until(
    runtime: &mut KubernetesRuntime,
    job: &str,
    token: u64,
    wanted: impl Fn(&State) -> bool,
) -> State {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let state = runtime.poll(job, token).await.unwrap();
        if wanted(&state) || tokio::time::Instant::now() > deadline {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`poll_until`] the attempt has ended.
async fn poll_until_ended(runtime: &mut KubernetesRuntime, job: &str, token: u64) -> State {
    poll_until(runtime, job, token, |s| matches!(s, State::Ended(_))).await
}

/// The attempt's only live pod, scheduled onto `node` and running.
fn run_on(cluster: &FakeCluster, job: &str, token: u64, node: &str) -> String {
    cluster.sync_jobs();
    let pod = cluster
        .live_pod_of(&format!("tuneq/{}", job_name(job, token)))
        .expect("the Job controller made a pod");
    cluster.schedule(&pod, node).unwrap();
    cluster.run(&pod).unwrap();
    pod
}

#[tokio::test]
async fn an_attempt_runs_as_a_job_and_its_end_is_read_back() {
    let cluster = FakeCluster::new();
    let mut rt = runtime(&cluster, xeon("xeon"));
    start(&mut rt, "j000000000001", 3).await.unwrap();
    // A retried start (its answer lost) adopts the same attempt's Job.
    start(&mut rt, "j000000000001", 3).await.unwrap();
    let name = job_name("j000000000001", 3);
    let jobs: Api<Job> = Api::namespaced(cluster.client(), "tuneq");
    let job = jobs.get(&name).await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(cluster.client(), "tuneq");
    let secret = secrets
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .remove(0);
    let owner = &secret.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), &owner.uid),
        ("Job", job.metadata.uid.as_ref().unwrap())
    );
    assert!(
        !serde_json::to_string(&job)
            .unwrap()
            .contains("attempt-credential-never-inline")
    );

    // No pod has run yet: pending.
    assert_eq!(rt.poll("j000000000001", 3).await.unwrap(), State::Pending);
    let pod = run_on(&cluster, "j000000000001", 3, "node-1");
    assert_eq!(
        poll_until(&mut rt, "j000000000001", 3, |s| *s != State::Pending).await,
        State::Running
    );
    cluster.exit(&pod, 0, "Completed", None).unwrap();
    cluster.sync_jobs();
    assert_eq!(
        poll_until_ended(&mut rt, "j000000000001", 3).await,
        State::Ended(End::Finished)
    );
    rt.release("j000000000001", 3).await.unwrap();
    assert!(cluster.get(Kind::Job, &format!("tuneq/{name}")).is_none());

    let requests = cluster.requests();
    assert!(
        !requests.iter().any(|r| r.method == "PUT"),
        "nothing is ever replaced"
    );
    for r in requests.iter().filter(|r| r.method == "DELETE") {
        assert_eq!(
            r.param("propagationPolicy").as_deref(),
            Some("Background"),
            "{r:?}"
        );
    }
    for r in requests
        .iter()
        .filter(|r| r.method == "GET" && (r.path.ends_with("/pods") || r.path.ends_with("/jobs")))
    {
        assert!(
            r.param("labelSelector").is_some(),
            "an unfiltered list: {r:?}"
        );
    }
}

#[tokio::test]
async fn preemption_bad_input_and_crashes_are_told_apart() {
    let cluster = FakeCluster::new();
    let mut rt = runtime(&cluster, xeon("xeon"));
    // Preempted as GKE does it: SIGTERM, the trainer checkpoints and exits 75.
    start(&mut rt, "j1", 1).await.unwrap();
    let pod = run_on(&cluster, "j1", 1, "node-1");
    cluster.preempt_node_shutdown(&pod, Some(75)).unwrap();
    cluster.sync_jobs();
    let State::Ended(End::Interrupted(why)) = poll_until_ended(&mut rt, "j1", 1).await else {
        panic!("a preemption must read as interrupted");
    };
    assert!(why.contains("node-1"), "{why}");
    // Bad input (the trainer's exit 42): the job fails for good, with its message.
    start(&mut rt, "j2", 2).await.unwrap();
    let pod = run_on(&cluster, "j2", 2, "node-1");
    cluster
        .exit(&pod, 42, "Error", Some("line 3: messages: missing"))
        .unwrap();
    cluster.sync_jobs();
    let State::Ended(End::BadInput(message)) = poll_until_ended(&mut rt, "j2", 2).await else {
        panic!("exit 42 must read as bad input");
    };
    assert!(message.contains("line 3"), "{message}");
    // Any other exit is a crash.
    start(&mut rt, "j3", 3).await.unwrap();
    let pod = run_on(&cluster, "j3", 3, "node-1");
    cluster.exit(&pod, 1, "Error", Some("panicked")).unwrap();
    cluster.sync_jobs();
    assert!(matches!(
        poll_until_ended(&mut rt, "j3", 3).await,
        State::Ended(End::Crashed(_))
    ));
}

#[tokio::test]
async fn a_job_of_another_attempt_is_never_adopted_and_leftovers_are_the_pools_own() {
    let cluster = FakeCluster::new();
    let mut rt = runtime(&cluster, xeon("xeon"));
    // A Job with this attempt's name but another fencing token (tampered or stale).
    let name = job_name("j1", 4);
    cluster
        .create(
            Kind::Job,
            json!({
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": "tuneq",
                             "annotations": {"tuneq.io/attempt-uid": "99", "tuneq.io/job-id": "j1"}},
                "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "trainer", "image": "x:1"}]}}}
            }),
        )
        .unwrap();
    let refused = start(&mut rt, "j1", 4).await.unwrap_err();
    assert!(refused.to_string().contains("not adopted"), "{refused}");

    start(&mut rt, "j2", 5).await.unwrap();
    start(&mut rt, "j3", 6).await.unwrap();
    let mut other = runtime(&cluster, xeon("xeon-big"));
    start(&mut other, "j4", 7).await.unwrap();
    let mut found = rt.leftovers().await.unwrap();
    found.sort();
    assert_eq!(found, [("j2".to_string(), 5), ("j3".to_string(), 6)]);
    assert_eq!(other.leftovers().await.unwrap(), [("j4".to_string(), 7)]);
}

#[tokio::test]
async fn a_vanished_node_is_noticed_its_pod_force_deleted_and_the_attempt_preempted() {
    let cluster = FakeCluster::new();
    let mut rt = runtime(&cluster, xeon("xeon"));
    start(&mut rt, "j1", 1).await.unwrap();
    let pod = run_on(&cluster, "j1", 1, "node-1");
    // The VM is gone: the Node object with it, the pod left Running in the API.
    cluster.delete_node("node-1").unwrap();
    let state = poll_until_ended(&mut rt, "j1", 1).await;
    let forced = cluster
        .requests()
        .into_iter()
        .find(|r| r.method == "DELETE" && r.path.ends_with(&format!("/pods/{pod}")))
        .expect("the pod on the vanished node is force-deleted");
    assert_eq!(forced.param("gracePeriodSeconds").as_deref(), Some("0"));
    // It can no longer run anywhere: the attempt is over, a preemption.
    let State::Ended(End::Interrupted(why)) = state else {
        panic!("a lost node is a preemption: {state:?}");
    };
    assert!(why.contains("node node-1 is gone"), "{why}");
}

#[tokio::test]
async fn a_killed_attempt_ends_only_once_its_pods_are_gone() {
    let cluster = FakeCluster::new();
    let mut rt = runtime(&cluster, xeon("xeon"));
    start(&mut rt, "j1", 1).await.unwrap();
    let pod = run_on(&cluster, "j1", 1, "node-1");
    rt.kill("j1", 1).await.unwrap();
    // Never a force delete (grace 0), which would drop the pod object without its
    // kubelet confirming the trainer stopped.
    let delete = cluster
        .requests()
        .into_iter()
        .find(|r| r.method == "DELETE" && r.path.ends_with(&format!("/pods/{pod}")))
        .expect("the pod is deleted");
    assert_eq!(delete.param("gracePeriodSeconds").as_deref(), Some("1"));
    // Until its kubelet says the trainer stopped, the attempt is not over, so its
    // successor cannot start beside it.
    assert!(cluster.get(Kind::Pod, &format!("tuneq/{pod}")).is_some());
    cluster.sync_jobs();
    let state = rt.poll("j1", 1).await.unwrap();
    assert!(!matches!(state, State::Ended(_)), "{state:?}");
    cluster.exit(&pod, 137, "Error", None).unwrap();
    cluster.sync_jobs();
    assert!(cluster.get(Kind::Pod, &format!("tuneq/{pod}")).is_none());
    assert!(matches!(
        poll_until_ended(&mut rt, "j1", 1).await,
        State::Ended(End::Interrupted(_))
    ));
}

#[tokio::test]
async fn a_pod_with_no_node_past_the_placement_timeout_ends_as_no_capacity_and_is_removed() {
    let cluster = FakeCluster::new();
    // Timestamps have whole seconds: two of them are the shortest timeout to test.
    let pool = xeon_with(|k| k.placement_timeout = Duration::from_secs(2));
    let (mut rt, pod) = started(&cluster, pool).await;
    cluster
        .unschedulable(&pod, "0/3 nodes are available: 3 Insufficient cpu.")
        .unwrap();
    // Within the timeout it waits for a node.
    assert_eq!(rt.poll("j1", 1).await.unwrap(), State::Pending);
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let State::Ended(End::NoCapacity(message)) = poll_until_ended(&mut rt, "j1", 1).await else {
        panic!("past the placement timeout it must end as no capacity");
    };
    assert!(message.contains("Insufficient cpu"), "{message}");
    // The pod never ran a trainer; it is removed at once.
    assert!(
        cluster
            .requests()
            .iter()
            .any(|r| r.method == "DELETE" && r.path.ends_with(&format!("/pods/{pod}")))
    );
}

/// The requests the runtime has sent so far, its watches' own left out.
fn reads_and_writes(cluster: &FakeCluster) -> usize {
    cluster.requests().iter().filter(|r| !r.is_watch()).count()
}

#[tokio::test]
async fn running_attempts_are_followed_through_watches_that_survive_expiry_and_restarts() {
    let cluster = FakeCluster::new();
    let settings = KubernetesSettings::new(xeon("xeon"), "http://tuneq-api.tuneq.svc:8080".into());
    let mut rt = KubernetesRuntime::new(cluster.client(), settings).unwrap();
    start(&mut rt, "j1", 1).await.unwrap();
    run_on(&cluster, "j1", 1, "node-1");
    assert_eq!(
        poll_until(&mut rt, "j1", 1, |s| *s == State::Running).await,
        State::Running
    );
    // Once the watches have caught up, following the attempt costs no request per tick.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let before = reads_and_writes(&cluster);
        assert_eq!(rt.poll("j1", 1).await.unwrap(), State::Running);
        if reads_and_writes(&cluster) == before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the watches never caught up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = reads_and_writes(&cluster);
    for _ in 0..20 {
        assert_eq!(rt.poll("j1", 1).await.unwrap(), State::Running);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        reads_and_writes(&cluster),
        before,
        "polls went to the API server"
    );

    // The API server restarts its watches and has compacted its history: the watches
    // relist and carry on, and the attempt's end is still seen.
    cluster.expire_next_watches(2);
    cluster.close_watches();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pod = cluster
        .live_pod_of(&format!("tuneq/{}", job_name("j1", 1)))
        .unwrap();
    cluster.preempt_node_shutdown(&pod, Some(75)).unwrap();
    cluster.sync_jobs();
    let State::Ended(End::Interrupted(why)) = poll_until_ended(&mut rt, "j1", 1).await else {
        panic!("the preemption must be seen after the watches relisted");
    };
    assert!(why.contains("node-1"), "{why}");
    let relists = cluster
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && !r.is_watch() && r.path.ends_with("/pods"))
        .count();
    assert!(
        relists >= 2,
        "the pod watch must have relisted after 410: {relists} lists"
    );
}

#[tokio::test]
async fn an_image_that_cannot_be_pulled_ends_the_attempt_after_the_pools_platform_timeout() {
    let cluster = FakeCluster::new();
    let pool = xeon_with(|k| k.platform_timeout = Duration::from_secs(2));
    let (mut rt, pod) = started(&cluster, pool).await;
    cluster.schedule(&pod, "node-1").unwrap();
    cluster.image_pull_backoff(&pod).unwrap();
    // Within the pool's timeout the pull may still succeed: pending.
    assert_eq!(
        poll_until(&mut rt, "j1", 1, |s| *s == State::Pending).await,
        State::Pending
    );
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let State::Ended(End::Platform(why)) = poll_until_ended(&mut rt, "j1", 1).await else {
        panic!("past the platform timeout the attempt must end as a platform error");
    };
    assert!(why.contains("ImagePullBackOff"), "{why}");
}

/// What a real API server answers a Job whose nodeSelector key is no qualified name.
const INVALID_JOB: &str = "Job.batch \"tq-j1-a1\" is invalid: spec.template.spec.nodeSelector: Invalid value: \"a/b/c\": prefix part a DNS-1123 subdomain must consist of lower case alphanumeric characters";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_the_api_server_refuses_fails_as_a_misconfigured_pool_without_the_apis_words() {
    use tuneq_queue::{AttemptSigner, JobQueue, JobState, NewJob, QueueConfig};
    let dir = tempfile::tempdir().unwrap();
    let queue = crate::support::embedded_queue(dir.path(), QueueConfig::default()).await;
    queue.set_pool("xeon", 1).await.unwrap();
    let id = queue
        .enqueue(&NewJob {
            tenant: "acme".into(),
            priority: 5,
            pools: vec!["xeon".into()],
            gpus: 1,
            estimated_seconds: 0,
            max_attempts: 3,
            payload: json!({"finetune": "ftjob-1", "spec": spec()}).to_string(),
            idempotency_key: None,
            notify: false,
        })
        .await
        .unwrap()
        .id;
    let cluster = FakeCluster::new();
    cluster.refuse_creates(Kind::Job, 422, "Invalid", INVALID_JOB);
    let mut config = tuneq_dispatcher::DispatcherConfig::new("xeon", "xeon@test");
    config.tick = Duration::from_millis(20);
    let dispatcher = tuneq_dispatcher::Dispatcher::new(
        queue.clone(),
        config,
        Box::new(runtime(&cluster, xeon("xeon"))),
        AttemptSigner::new(vec![7; 32]),
    );
    let (stop, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(dispatcher.run(rx));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let record = loop {
        let record = queue.get(&id).await.unwrap().unwrap();
        if record.state.is_terminal() {
            break record;
        }
        assert!(tokio::time::Instant::now() < deadline, "{record:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();

    // Failed at once (an invalid Job is invalid at every try), with a class the API
    // shows as a stable code, and nothing of what the API server said.
    assert_eq!(
        (record.state, record.attempts),
        (JobState::Failed, 1),
        "{record:?}"
    );
    assert_eq!(
        record.failure,
        Some(tuneq_openapi::FailureClass::PoolMisconfigured)
    );
    let mut told: Vec<String> = record.error.iter().map(|e| as_written(e)).collect();
    told.extend(
        queue
            .events(&id, None, 100, false)
            .await
            .unwrap()
            .into_iter()
            .map(|e| as_written(&e.message)),
    );
    for text in &told {
        for internal in ["422", "Invalid", "nodeSelector", "a/b/c", "tq-j1", "Status"] {
            assert!(!text.contains(internal), "{internal} shown: {text}");
        }
    }
    assert!(
        as_written(record.error.as_deref().unwrap()).contains("pool xeon is misconfigured"),
        "{record:?}"
    );
}
