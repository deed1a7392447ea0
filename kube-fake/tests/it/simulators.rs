//! Each simulator's shapes, read back by tuneq's classifier: the Job tuneq builds is
//! created through kube-rs, the Job controller makes its pod, the scheduler, kubelet and
//! disruptions move it, and `classify` must name the end the README's "Running on
//! Kubernetes" table gives it.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use std::path::Path;
use std::time::Duration;
use tuneq_dispatcher::kubernetes::{AttemptEnd, AttemptLaunch, Limits, build_job, classify};
use tuneq_kube_fake::FakeCluster;
use tuneq_pools::PoolsFile;

const NS: &str = "tuneq";
const NODE: &str = "gke-tuneq-l4-spot-3f2a9c1e-x7k2";

/// A cluster with the attempt Job of the example spot pool, its first pod made.
struct Attempt {
    cluster: FakeCluster,
    jobs: Api<Job>,
    pods: Api<Pod>,
    name: String,
    pod: String,
    limits: Limits,
}

impl Attempt {
    async fn start() -> Self {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/pools/gke-spot-l4.toml");
        let pools = PoolsFile::load(&file).unwrap();
        let pool = pools
            .pools
            .into_iter()
            .find(|p| p.name == "l4-spot")
            .unwrap();
        let k = pool.kubernetes.clone().unwrap();
        let spec_json = json!({"model": "tiny-llama", "training_file": "file-1"}).to_string();
        let launch = AttemptLaunch {
            job_id: "ftjob-0a1b2c".into(),
            attempt: 2,
            tenant: "acme".into(),
            pool: pool.name.clone(),
            spec_hash: AttemptLaunch::hash_spec(&spec_json),
            spec_json,
            report_url: "http://tuneq-api.tuneq.svc:8080/report".into(),
            credential: "secret".into(),
        };
        let job = build_job(&launch, &pool, &k).unwrap();
        let cluster = FakeCluster::new();
        let client = cluster.client();
        let jobs: Api<Job> = Api::namespaced(client.clone(), NS);
        let pods: Api<Pod> = Api::namespaced(client, NS);
        let created = jobs.create(&PostParams::default(), &job).await.unwrap();
        let name = created.metadata.name.unwrap();
        cluster.sync_jobs();
        let pod = cluster.live_pod_of(&name).unwrap();
        let limits = Limits::for_pool(&pool, &k);
        Self {
            cluster,
            jobs,
            pods,
            name,
            pod,
            limits,
        }
    }

    async fn classify(&self) -> AttemptEnd {
        let job = self.jobs.get(&self.name).await.unwrap();
        let selector = format!("batch.kubernetes.io/job-name={}", self.name);
        let pods = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap()
            .items;
        classify(&job, &pods, self.cluster.now(), &self.limits)
    }

    async fn running(&self) {
        self.cluster.schedule(&self.pod, NODE).unwrap();
        self.cluster.run(&self.pod).unwrap();
        self.cluster.sync_jobs();
        assert_eq!(self.classify().await, AttemptEnd::Running);
    }

    async fn job_condition(&self, type_: &str) -> Option<(String, String)> {
        let job = self.jobs.get(&self.name).await.unwrap();
        job.status?
            .conditions?
            .into_iter()
            .find(|c| c.type_ == type_ && c.status == "True")
            .map(|c| (c.reason.unwrap_or_default(), c.message.unwrap_or_default()))
    }
}

fn preempted(reason: &str) -> AttemptEnd {
    AttemptEnd::Preempted {
        reason: reason.into(),
        node: Some(NODE.into()),
    }
}

#[tokio::test]
async fn the_job_controller_makes_one_labelled_owned_pod() {
    let a = Attempt::start().await;
    let pod = a.pods.get(&a.pod).await.unwrap();
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(labels["batch.kubernetes.io/job-name"], a.name);
    assert_eq!(labels["app.kubernetes.io/managed-by"], "tuneq");
    let job = a.jobs.get(&a.name).await.unwrap();
    assert_eq!(
        labels["batch.kubernetes.io/controller-uid"],
        job.metadata.uid.clone().unwrap()
    );
    let owner = &pod.metadata.owner_references.unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.controller), ("Job", Some(true)));
    assert!(a.pod.starts_with(&format!("{}-", a.name)) && a.pod.len() == a.name.len() + 6);
    assert_eq!(pod.status.unwrap().phase.as_deref(), Some("Pending"));
    a.cluster.sync_jobs();
    assert_eq!(
        a.cluster.pods_of(&a.name).len(),
        1,
        "no second pod while one lives"
    );
    assert_eq!(
        a.classify().await,
        AttemptEnd::Pending {
            reason: "Scheduling".into()
        }
    );
}

#[tokio::test]
async fn success_completes_the_job() {
    let a = Attempt::start().await;
    a.running().await;
    a.cluster.exit(&a.pod, 0, "Completed", None).unwrap();
    a.cluster.sync_jobs();
    assert!(a.job_condition("SuccessCriteriaMet").await.is_some());
    assert_eq!(
        a.job_condition("Complete").await.unwrap().0,
        "CompletionsReached"
    );
    let status = a.jobs.get(&a.name).await.unwrap().status.unwrap();
    assert_eq!((status.succeeded, status.active), (Some(1), Some(0)));
    assert!(status.completion_time.is_some());
    assert_eq!(a.classify().await, AttemptEnd::Succeeded);
}

#[tokio::test]
async fn a_node_shutdown_fails_the_job_by_rule_0() {
    let a = Attempt::start().await;
    a.running().await;
    a.cluster.preempt_node_shutdown(&a.pod, Some(75)).unwrap();
    assert_eq!(
        a.classify().await,
        preempted("TerminationByKubelet"),
        "seen on the pod first"
    );
    a.cluster.sync_jobs();
    let message = format!(
        "Pod {NS}/{} has condition DisruptionTarget matching FailJob rule at index 0",
        a.pod
    );
    assert_eq!(
        a.job_condition("FailureTarget").await,
        Some(("PodFailurePolicy".into(), message.clone()))
    );
    assert_eq!(
        a.job_condition("Failed").await,
        Some(("PodFailurePolicy".into(), message))
    );
    let pod = a.pods.get(&a.pod).await.unwrap().status.unwrap();
    assert_eq!(pod.reason.as_deref(), Some("Terminated"));
    assert_eq!(
        pod.message.as_deref(),
        Some("Pod was terminated in response to imminent node shutdown.")
    );
    assert_eq!(a.classify().await, preempted("TerminationByKubelet"));
    a.cluster.sync_jobs();
    assert_eq!(a.cluster.pods_of(&a.name).len(), 1, "no replacement pod");
}

#[tokio::test]
async fn exit_42_fails_the_job_by_rule_1_with_the_trainers_message() {
    let a = Attempt::start().await;
    a.running().await;
    a.cluster
        .exit(
            &a.pod,
            42,
            "Error",
            Some("error: dataset line 3 is not JSON\n"),
        )
        .unwrap();
    a.cluster.sync_jobs();
    let message = format!(
        "Container trainer for pod {NS}/{} failed with exit code 42 matching FailJob rule at index 1",
        a.pod
    );
    assert_eq!(
        a.job_condition("Failed").await,
        Some(("PodFailurePolicy".into(), message))
    );
    assert_eq!(
        a.classify().await,
        AttemptEnd::BadInput {
            message: "error: dataset line 3 is not JSON".into()
        }
    );
}

#[tokio::test]
async fn an_oom_kill_and_a_crash_exceed_the_backoff_limit() {
    let a = Attempt::start().await;
    a.running().await;
    a.cluster.oom_kill(&a.pod).unwrap();
    a.cluster.sync_jobs();
    assert_eq!(
        a.job_condition("Failed").await.unwrap().0,
        "BackoffLimitExceeded"
    );
    assert!(
        matches!(a.classify().await, AttemptEnd::OutOfMemory { message } if message.contains("32Gi"))
    );

    let b = Attempt::start().await;
    b.running().await;
    b.cluster
        .exit(&b.pod, 101, "Error", Some("thread 'main' panicked"))
        .unwrap();
    b.cluster.sync_jobs();
    assert_eq!(
        b.classify().await,
        AttemptEnd::Crashed {
            exit_code: Some(101),
            message: "thread 'main' panicked".into()
        }
    );
}

#[tokio::test]
async fn an_eviction_waits_for_the_pod_then_fails_the_job_by_rule_0() {
    let a = Attempt::start().await;
    a.running().await;
    a.cluster.evict(&a.pod).unwrap();
    let pod = a.pods.get(&a.pod).await.unwrap();
    assert!(pod.metadata.deletion_timestamp.is_some());
    assert_eq!(
        a.classify().await,
        AttemptEnd::Running,
        "the disrupted pod still runs"
    );
    a.cluster.sync_jobs();
    assert_eq!(
        a.cluster.pods_of(&a.name).len(),
        1,
        "no replacement while it terminates"
    );
    let status = a.jobs.get(&a.name).await.unwrap().status.unwrap();
    assert_eq!((status.active, status.terminating), (Some(0), Some(1)));
    a.cluster.exit(&a.pod, 143, "Error", None).unwrap();
    assert_eq!(a.classify().await, preempted("EvictionByEvictionAPI"));
    a.cluster.sync_jobs();
    assert!(
        a.job_condition("Failed")
            .await
            .unwrap()
            .1
            .ends_with("matching FailJob rule at index 0")
    );
    assert!(
        a.pods.get_opt(&a.pod).await.unwrap().is_none(),
        "released and gone"
    );
}

#[tokio::test]
async fn a_vanished_node_leaves_the_pod_running_until_podgc() {
    let a = Attempt::start().await;
    a.running().await;
    a.cluster.delete_node(NODE).unwrap();
    a.cluster.sync_jobs();
    assert_eq!(a.classify().await, AttemptEnd::Running);
    a.cluster.podgc(&a.pod).unwrap();
    assert_eq!(a.classify().await, preempted("DeletionByPodGC"));
    a.cluster.sync_jobs();
    assert!(
        a.job_condition("Failed")
            .await
            .unwrap()
            .1
            .ends_with("rule at index 0")
    );
    assert_eq!(
        a.classify().await,
        AttemptEnd::Preempted {
            reason: "DisruptionTarget".into(),
            node: None
        },
        "the pod is gone: only the Job's message is left"
    );
}

#[tokio::test]
async fn waiting_pods_turn_into_no_capacity_and_platform_errors_past_their_timeouts() {
    let a = Attempt::start().await;
    let msg = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.";
    a.cluster.unschedulable(&a.pod, msg).unwrap();
    assert_eq!(
        a.classify().await,
        AttemptEnd::Pending {
            reason: format!("Unschedulable: {msg}")
        }
    );
    a.cluster.advance(Duration::from_secs(16 * 60));
    assert_eq!(
        a.classify().await,
        AttemptEnd::NoCapacity {
            message: msg.into()
        }
    );

    let b = Attempt::start().await;
    b.cluster.schedule(&b.pod, NODE).unwrap();
    b.cluster.image_pull_backoff(&b.pod).unwrap();
    assert_eq!(
        b.classify().await,
        AttemptEnd::Pending {
            reason: "ImagePullBackOff".into()
        }
    );
    b.cluster.advance(Duration::from_secs(6 * 60));
    assert!(
        matches!(b.classify().await, AttemptEnd::PlatformError { reason, .. } if reason == "ImagePullBackOff")
    );

    let c = Attempt::start().await;
    c.cluster.schedule(&c.pod, NODE).unwrap();
    c.cluster.config_error(&c.pod).unwrap();
    c.cluster.advance(Duration::from_secs(6 * 60));
    assert_eq!(
        c.classify().await,
        AttemptEnd::PlatformError {
            reason: "CreateContainerConfigError".into(),
            message: "secret \"tq-ftjob-0a1b2c-a2-cred\" not found".into(),
        }
    );
}

#[tokio::test]
async fn the_active_deadline_fails_the_job_and_terminates_its_pod() {
    let a = Attempt::start().await;
    a.running().await;
    a.cluster.advance(Duration::from_secs(25 * 3600));
    a.cluster.sync_jobs();
    assert_eq!(
        a.job_condition("FailureTarget").await.unwrap().0,
        "DeadlineExceeded"
    );
    assert!(
        a.job_condition("Failed").await.is_none(),
        "not before the pod has ended"
    );
    assert_eq!(a.classify().await, AttemptEnd::DeadlineExceeded);
    a.cluster.exit(&a.pod, 143, "Error", None).unwrap();
    a.cluster.sync_jobs();
    assert_eq!(
        a.job_condition("Failed").await.unwrap().0,
        "DeadlineExceeded"
    );
    assert_eq!(a.classify().await, AttemptEnd::DeadlineExceeded);
}
