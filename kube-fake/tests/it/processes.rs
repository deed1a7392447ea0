//! The process kubelet with a stand-in trainer (a shell script): the Job tuneq builds is
//! run as a local process, with its spec file from the attempt's Secret, its credential
//! from a `secretKeyRef`, its exit codes, SIGTERM on a delete and on a node shutdown, a
//! crash, and a vanished node.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tuneq_dispatcher::kubernetes::{AttemptLaunch, build_job, build_secret};
use tuneq_kube_fake::process::ProcessKubelet;
use tuneq_kube_fake::{FakeCluster, Kind};
use tuneq_pools::PoolsFile;

const NS: &str = "tuneq";

/// The stand-in trainer: its credential says how it behaves.
const TRAINER: &str = r#"#!/bin/sh
[ "$1" = train ] && [ "$2" = --spec ] && [ "$4" = --progress ] || exit 9
cat "$3" > spec-copy.json || exit 8
printf '%s' "$TUNEQ_REPORT_CREDENTIAL" > credential
printf '%s' "$TUNEQ_CACHE_DIR" > cache-dir
case "$TUNEQ_REPORT_CREDENTIAL" in
  exit-*) echo "bad input: the data is broken"; exit "${TUNEQ_REPORT_CREDENTIAL#exit-}";;
  wait) trap 'echo checkpoint; exit 75' TERM; touch started; while true; do sleep 0.05; done;;
  stubborn) trap '' TERM; touch started; while true; do sleep 0.05; done;;
esac
exit 7
"#;

struct Run {
    cluster: FakeCluster,
    kubelet: ProcessKubelet,
    dir: tempfile::TempDir,
    spec_json: String,
    launch: AttemptLaunch,
    job_uid: String,
    pod: String,
}

impl Run {
    /// The attempt Job of the example spot pool with `credential`, its pod made and
    /// scheduled; the Secret created only when `secret`.
    async fn start(credential: &str, secret: bool) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("fake-tuneq");
        std::fs::write(&exe, TRAINER).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();

        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/pools/gke-spot-l4.toml");
        let pool = PoolsFile::load(&file)
            .unwrap()
            .pools
            .into_iter()
            .find(|p| p.name == "l4-spot")
            .unwrap();
        let k = pool.kubernetes.clone().unwrap();
        let spec_json = json!({"model": "tiny", "training_file": "file-1"}).to_string();
        let launch = AttemptLaunch {
            job_id: "ftjob-proc".into(),
            attempt: 1,
            tenant: "acme".into(),
            pool: pool.name.clone(),
            spec_hash: AttemptLaunch::hash_spec(&spec_json),
            spec_json: spec_json.clone(),
            report_url: "http://127.0.0.1:1/report".into(),
            credential: credential.into(),
        };
        let cluster = FakeCluster::new();
        let kubelet = cluster.run_pods_as_processes(exe, dir.path().join("pods"));
        let jobs: Api<Job> = Api::namespaced(cluster.client(), NS);
        let created = jobs
            .create(
                &PostParams::default(),
                &build_job(&launch, &pool, &k).unwrap(),
            )
            .await
            .unwrap();
        let job_uid = created.metadata.uid.clone().unwrap();
        let name = created.metadata.name.unwrap();
        let mut run = Self {
            cluster,
            kubelet,
            dir,
            spec_json,
            launch,
            job_uid,
            pod: String::new(),
        };
        if secret {
            run.create_secret().await;
        }
        run.cluster.sync_jobs();
        run.pod = run.cluster.live_pod_of(&name).unwrap();
        run.cluster.schedule(&run.pod, "node-1").unwrap();
        run
    }

    async fn create_secret(&self) {
        let secrets: Api<Secret> = Api::namespaced(self.cluster.client(), NS);
        let secret = build_secret(&self.launch, NS, Some(&self.job_uid));
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }

    fn pod_dir(&self) -> PathBuf {
        self.dir.path().join("pods").join(&self.pod)
    }

    fn pod(&self) -> Option<Value> {
        self.cluster.get(Kind::Pod, &self.pod)
    }

    fn at(&self, pointer: &str) -> Value {
        self.pod()
            .and_then(|p| p.pointer(pointer).cloned())
            .unwrap_or(Value::Null)
    }

    async fn until(&self, what: &str, ok: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ok(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {:#?}",
                self.pod()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn started(&self) {
        self.until("the trainer to start", |r| {
            r.pod_dir().join("started").exists()
        })
        .await;
        assert_eq!(self.at("/status/phase"), "Running");
    }

    async fn ended(&self) {
        self.until("the pod to end", |r| {
            matches!(r.at("/status/phase").as_str(), Some("Succeeded" | "Failed"))
        })
        .await;
    }
}

const EXIT_CODE: &str = "/status/containerStatuses/0/state/terminated/exitCode";

#[tokio::test]
async fn a_scheduled_pod_runs_with_its_spec_file_and_credential_and_ends_with_its_code() {
    let r = Run::start("exit-42", true).await;
    r.ended().await;
    assert_eq!(r.at("/status/phase"), "Failed");
    assert_eq!(r.at(EXIT_CODE), 42);
    let message = r.at("/status/containerStatuses/0/state/terminated/message");
    assert_eq!(
        message, "bad input: the data is broken",
        "FallbackToLogsOnError"
    );
    let dir = r.pod_dir();
    assert_eq!(
        std::fs::read_to_string(dir.join("spec-copy.json")).unwrap(),
        r.spec_json
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("credential")).unwrap(),
        "exit-42"
    );
    let cache = std::fs::read_to_string(dir.join("cache-dir")).unwrap();
    assert!(cache.starts_with(dir.to_str().unwrap()), "{cache}");
    assert!(Path::new(&cache).is_dir(), "{cache}");
    assert!(
        !dir.join("attempt/credential").exists(),
        "only the Secret's items are files"
    );
}

#[tokio::test]
async fn a_missing_secret_keeps_the_pod_pending_until_it_exists() {
    let r = Run::start("exit-0", false).await;
    r.until("CreateContainerConfigError", |r| {
        r.at("/status/containerStatuses/0/state/waiting/reason") == "CreateContainerConfigError"
    })
    .await;
    assert_eq!(r.at("/status/phase"), "Pending");
    r.create_secret().await;
    r.ended().await;
    assert_eq!(r.at("/status/phase"), "Succeeded");
    assert_eq!(r.at(EXIT_CODE), 0);
    assert_eq!(
        r.at("/status/containerStatuses/0/state/terminated/reason"),
        "Completed"
    );
}

#[tokio::test]
async fn a_graceful_delete_sends_sigterm_and_the_exit_is_written() {
    let r = Run::start("wait", true).await;
    r.started().await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(r.cluster.client(), NS);
    pods.delete(&r.pod, &DeleteParams::background().grace_period(10))
        .await
        .unwrap();
    r.ended().await;
    assert_eq!(r.at(EXIT_CODE), 75, "the trap ran: SIGTERM, not SIGKILL");
    r.cluster.sync_jobs();
    assert!(r.pod().is_none(), "gone once terminal and released");
}

#[tokio::test]
async fn a_trainer_that_ignores_sigterm_is_killed_after_its_grace() {
    let r = Run::start("stubborn", true).await;
    r.started().await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(r.cluster.client(), NS);
    pods.delete(&r.pod, &DeleteParams::background().grace_period(1))
        .await
        .unwrap();
    let t = Instant::now();
    r.ended().await;
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(r.at(EXIT_CODE), 137);
}

#[tokio::test]
async fn a_node_shutdown_terminates_the_process_and_writes_its_exit_code() {
    let r = Run::start("wait", true).await;
    r.started().await;
    r.cluster.preempt_node_shutdown(&r.pod, None).unwrap();
    assert_eq!(
        r.at("/status/conditions")
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "DisruptionTarget")
            .unwrap()["reason"],
        "TerminationByKubelet"
    );
    r.ended().await;
    assert_eq!(r.at("/status/phase"), "Failed");
    assert_eq!(r.at("/status/reason"), "Terminated");
    assert_eq!(r.at(EXIT_CODE), 75, "the trainer's own code shows");
}

#[tokio::test]
async fn a_killed_process_is_a_crash_and_a_lost_node_leaves_its_pod_running() {
    let r = Run::start("wait", true).await;
    r.started().await;
    let pid = r.kubelet.pid(&r.pod).unwrap();
    r.cluster.kill_process(&r.pod).unwrap();
    r.ended().await;
    assert_eq!(r.at(EXIT_CODE), 137);
    assert_eq!(r.at("/status/phase"), "Failed");
    assert!(r.kubelet.running().is_empty());
    assert!(!Path::new(&format!("/proc/{pid}")).exists() || pid == 0);

    let r = Run::start("wait", true).await;
    r.started().await;
    let pid = r.kubelet.pid(&r.pod).unwrap();
    r.cluster.lose_node("node-1").unwrap();
    r.until("the process to die", |r| r.kubelet.running().is_empty())
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(r.cluster.get(Kind::Node, "node-1").is_none());
    assert_eq!(r.at("/status/phase"), "Running", "nobody reports for it");
    assert!(!Path::new(&format!("/proc/{pid}/cmdline")).exists());
}

#[tokio::test]
async fn dropping_the_kubelet_kills_its_processes() {
    let r = Run::start("stubborn", true).await;
    r.started().await;
    let pid = r.kubelet.pid(&r.pod).unwrap();
    let Run { kubelet, .. } = r;
    kubelet.stop();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Path::new(&format!("/proc/{pid}/cmdline")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
    {
        assert!(Instant::now() < deadline, "process {pid} still alive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
