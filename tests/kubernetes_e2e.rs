//! End to end on a fake Kubernetes cluster: the real `tuneq api` and `tuneq dispatcher`
//! (a `runtime = "kubernetes"` pool, `KUBECONFIG` pointing at `tuneq-kube-fake` over
//! loopback HTTP) on a real redis-server, with the fake's process kubelet running each
//! attempt's pod as a real `tuneq train` process. The test plays the scheduler and the
//! disruptions: a spot node shutdown, a vanished node (its pod left Running), a pause
//! and a resume by the tenant, a crash, and a SIGKILLed dispatcher that must adopt the
//! running Job. The job must end as an
//! undisturbed run of the same seed does, byte for byte, and no two pods of one job may
//! ever be alive at once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tuneq_kube_fake::{FakeCluster, Kind};
use tuneq_queue::testing::RedisServer;

const TUNEQ: &str = env!("CARGO_BIN_EXE_tuneq");
const SECRET: &str = "e2e-attempt-secret-0123456789abcdef0123456789";
const ADMIN: &str = "tq_admin_e2e0123456789abcdef0123456789abcdef";
const LABEL_JOB_ID: &str = "tuneq.io/job-id";

/// A `tuneq` child process, killed when dropped; its output goes to `log`.
struct Service {
    child: Child,
}

impl Service {
    /// Starts `tuneq args…` and waits for a stdout line starting with `ready`; returns it.
    fn start(args: &[String], env: &[(&str, &Path)], log: PathBuf, ready: &str) -> (Self, String) {
        let err = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(TUNEQ);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start tuneq");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.starts_with(ready) => {
                    return (Self { child }, line);
                }
                Ok(_) => {}
                Err(_) => panic!(
                    "tuneq {} did not print {ready:?}; log:\n{}",
                    args[0],
                    std::fs::read_to_string(&log).unwrap_or_default()
                ),
            }
        }
    }

    /// SIGKILL: no shutdown, no checkpoint.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The API as a client sees it.
struct Api {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl Api {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: &str,
        body: Option<Value>,
    ) -> Value {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert!(status.is_success(), "{path}: {status} {text}");
        serde_json::from_str(&text).unwrap()
    }

    async fn upload(&self, data: &[u8]) -> String {
        let boundary = "tuneq-e2e-boundary";
        let mut body = Vec::new();
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n\
                 --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"train.jsonl\"\r\n\
                 Content-Type: application/jsonl\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let resp = self
            .http
            .post(format!("{}/v1/files", self.url))
            .bearer_auth(&self.key)
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let v: Value = resp.json().await.unwrap();
        assert!(status.is_success(), "upload: {status} {v}");
        v["id"].as_str().unwrap().to_string()
    }

    async fn job(&self, id: &str) -> Value {
        self.call(
            reqwest::Method::GET,
            &format!("/v1/fine_tuning/jobs/{id}"),
            &self.key,
            None,
        )
        .await
    }

    async fn create(&self, file: &str) -> String {
        let body = json!({"model": "tiny", "training_file": file, "seed": 7,
            "hyperparameters": {"n_epochs": 3, "batch_size": 8}});
        let v = self
            .call(
                reqwest::Method::POST,
                "/v1/fine_tuning/jobs",
                &self.key,
                Some(body),
            )
            .await;
        v["id"].as_str().unwrap().to_string()
    }

    /// `adapter_model.safetensors` from the adapter's tar.
    async fn adapter(&self, id: &str) -> Vec<u8> {
        let resp = self
            .http
            .get(format!("{}/v1/fine_tuning/jobs/{id}/adapter", self.url))
            .bearer_auth(&self.key)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "adapter: {}", resp.status());
        let tar = resp.bytes().await.unwrap();
        tar_entry(&tar, "adapter_model.safetensors").expect("adapter_model.safetensors in the tar")
    }
}

/// The bytes of the entry whose name ends with `name` in a ustar archive.
fn tar_entry(tar: &[u8], name: &str) -> Option<Vec<u8>> {
    let mut at = 0;
    while at + 512 <= tar.len() {
        let header = &tar[at..at + 512];
        if header.iter().all(|b| *b == 0) {
            return None;
        }
        let field = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&header[r])
                .trim_end_matches('\0')
                .trim()
                .to_string()
        };
        let entry = field(0..100);
        let size = usize::from_str_radix(&field(124..136), 8).unwrap_or(0);
        let data = at + 512;
        if entry.ends_with(name) {
            return Some(tar[data..data + size].to_vec());
        }
        at = data + size.div_ceil(512) * 512;
    }
    None
}

/// The test's view of the cluster: it schedules new pods on `node`, runs the Job
/// controller, and checks the double-run invariant on every step.
struct Driver {
    cluster: FakeCluster,
    node: String,
    max_alive: usize,
}

impl Driver {
    fn step(&mut self) {
        self.cluster.sync_jobs();
        let mut alive: HashMap<String, Vec<String>> = HashMap::new();
        for pod in self.cluster.list(Kind::Pod) {
            let name = pod["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let phase = pod.pointer("/status/phase").and_then(Value::as_str);
            let terminal = matches!(phase, Some("Succeeded" | "Failed"));
            if terminal {
                continue;
            }
            if let Some(job) = pod
                .pointer("/metadata/labels")
                .and_then(|l| l.get(LABEL_JOB_ID))
            {
                alive
                    .entry(job.as_str().unwrap_or_default().to_string())
                    .or_default()
                    .push(name.clone());
            }
            let unscheduled = pod
                .pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .is_none();
            let deleting = pod.pointer("/metadata/deletionTimestamp").is_some();
            if unscheduled && !deleting {
                self.cluster.schedule(&name, &self.node).unwrap();
            }
        }
        for (job, pods) in alive {
            self.max_alive = self.max_alive.max(pods.len());
            assert!(pods.len() <= 1, "double run of {job}: {pods:?}");
        }
    }

    /// The running pod (phase `Running`, not being deleted) and its node. One job runs at
    /// a time here (one slot), so it is that job's.
    fn running_pod(&self) -> Option<(String, String)> {
        self.cluster.list(Kind::Pod).into_iter().find_map(|p| {
            (p.pointer("/status/phase").and_then(Value::as_str) == Some("Running")
                && p.pointer("/metadata/deletionTimestamp").is_none())
            .then(|| {
                (
                    p["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    p["spec"]["nodeName"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )
            })
        })
    }
}

/// Steps the driver until `done` says so (or fails after `within`).
async fn until<T>(
    d: &mut Driver,
    api: &Api,
    id: &str,
    what: &str,
    within: Duration,
    mut done: impl FnMut(&Driver, &Value) -> Option<T>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        d.step();
        let job = api.job(id).await;
        if let Some(t) = done(d, &job) {
            return t;
        }
        assert!(
            job["status"] != "failed" && job["status"] != "cancelled",
            "job ended while waiting for {what}: {job:#}"
        );
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {job:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

fn step_of(job: &Value) -> u64 {
    job.pointer("/progress/step")
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_survives_preemption_a_lost_node_a_crash_and_a_dispatcher_kill_on_kubernetes() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let redis = RedisServer::start(&dir.join("redis"), false);

    let model = dir.join("models/tiny");
    let init = Command::new(TUNEQ)
        .args(["model", "init", "--preset", "tiny", "--seed", "0", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );

    let cluster = FakeCluster::new();
    let (addr, _server) = cluster.serve().await.unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, tuneq_kube_fake::kubeconfig(addr)).unwrap();
    let _kubelet = cluster.run_pods_as_processes(PathBuf::from(TUNEQ), dir.join("pods"));

    let pools = dir.join("pools.toml");
    std::fs::write(
        &pools,
        r#"[placement]
preemptions_before_fallback = 10

[[pool]]
name = "k8s-cpu"
runtime = "kubernetes"
hardware = "cpu"
cpu = "2"
memory = "4Gi"
slots = 1

[pool.kubernetes]
namespace = "tuneq"
image = "example.invalid/tuneq:0.1.0"
termination_grace = "20s"
"#,
    )
    .unwrap();
    let s = |p: &Path| p.display().to_string();
    let api_args = strings(&[
        "api",
        "--redis",
        &redis.url,
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--store",
        &format!("file://{}", s(&dir.join("objects"))),
        "--pools",
        &s(&pools),
        "--model",
        &format!("tiny={}", s(&model)),
        "--attempt-secret",
        SECRET,
        "--admin-key",
        ADMIN,
        "--spool-dir",
        &s(&dir.join("spool")),
    ]);
    let (_api, line) = Service::start(&api_args, &[], dir.join("api.log"), "tuneq api is up at ");
    let url = line
        .trim_start_matches("tuneq api is up at ")
        .trim()
        .to_string();
    let dispatcher_args = strings(&[
        "dispatcher",
        "--redis",
        &redis.url,
        "--api-url",
        &url,
        "--attempt-secret",
        SECRET,
        "--pools",
        &s(&pools),
        "--work-dir",
        &s(&dir.join("work")),
    ]);
    let kube_env = [("KUBECONFIG", kubeconfig.as_path())];
    let start_dispatcher = |n: u32| {
        Service::start(
            &dispatcher_args,
            &kube_env,
            dir.join(format!("dispatcher-{n}.log")),
            "tuneq dispatcher serves",
        )
        .0
    };
    let mut dispatcher = start_dispatcher(0);

    let http = reqwest::Client::new();
    let mut api = Api {
        http,
        url,
        key: ADMIN.to_string(),
    };
    api.call(
        reqwest::Method::POST,
        "/admin/tenants",
        ADMIN,
        Some(json!({"id": "acme"})),
    )
    .await;
    let key = api
        .call(
            reqwest::Method::POST,
            "/admin/tenants/acme/keys",
            ADMIN,
            Some(json!({})),
        )
        .await;
    api.key = key["api_key"].as_str().unwrap().to_string();
    let data = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/tiny-task-train.jsonl"),
    )
    .unwrap();
    let file = api.upload(&data).await;
    let mut d = Driver {
        cluster: cluster.clone(),
        node: "node-0".into(),
        max_alive: 0,
    };
    let long = Duration::from_secs(600);

    // The reference: the same job, undisturbed.
    let reference = api.create(&file).await;
    until(
        &mut d,
        &api,
        &reference,
        "the reference run",
        long,
        |_, j| (j["status"] == "succeeded").then_some(()),
    )
    .await;
    let reference_adapter = api.adapter(&reference).await;
    let reference_took = started.elapsed();

    let id = api.create(&file).await;
    let short = Duration::from_secs(180);

    // A spot node shutdown: SIGTERM, the trainer checkpoints and exits 75.
    d.node = "node-1".into();
    let (pod1, _) = until(&mut d, &api, &id, "progress on node-1", short, |d, j| {
        d.running_pod().filter(|_| step_of(j) >= 20)
    })
    .await;
    cluster.preempt_node_shutdown(&pod1, None).unwrap();
    d.node = "node-2".into();
    let at_preemption = step_of(&api.job(&id).await);
    let (pod2, _) = until(
        &mut d,
        &api,
        &id,
        "the next attempt to progress",
        short,
        |d, j| {
            d.running_pod()
                .filter(|(p, _)| *p != pod1 && step_of(j) > at_preemption + 10)
        },
    )
    .await;

    // The dispatcher is SIGKILLed and restarted: it adopts the running Job.
    dispatcher.kill();
    for _ in 0..10 {
        d.step();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    dispatcher = start_dispatcher(1);
    let before = step_of(&api.job(&id).await);
    until(
        &mut d,
        &api,
        &id,
        "progress under the new dispatcher",
        short,
        |d, j| {
            d.running_pod()
                .filter(|(p, _)| *p == pod2 && step_of(j) > before + 10)
        },
    )
    .await;

    // node-2's VM vanishes: its pod stays Running in the API; the dispatcher sees the
    // Node object gone, force-deletes the pod and starts the next attempt.
    d.node = "node-3".into();
    cluster.lose_node("node-2").unwrap();
    until(&mut d, &api, &id, "an attempt on node-3", short, |d, _| {
        d.running_pod().filter(|(p, n)| *p != pod2 && n == "node-3")
    })
    .await;
    let now = step_of(&api.job(&id).await);
    until(&mut d, &api, &id, "progress on node-3", short, |_, j| {
        (step_of(j) > now + 5).then_some(())
    })
    .await;

    // The tenant pauses it: the trainer hears of it in its report's answer, checkpoints
    // and exits; its pod is gone and the job waits paused, holding no node. Resumed, it
    // continues from that checkpoint on the next node.
    let post = |action: &str| format!("/v1/fine_tuning/jobs/{id}/{action}");
    api.call(reqwest::Method::POST, &post("pause"), &api.key, None)
        .await;
    until(&mut d, &api, &id, "the job to pause", short, |d, j| {
        (j["status"] == "paused" && d.running_pod().is_none()).then_some(())
    })
    .await;
    let paused_at = step_of(&api.job(&id).await);
    d.node = "node-4".into();
    let resumed = api
        .call(reqwest::Method::POST, &post("resume"), &api.key, None)
        .await;
    assert_eq!(resumed["status"], "queued", "{resumed:#}");
    let (pod4, _) = until(
        &mut d,
        &api,
        &id,
        "progress after the resume",
        short,
        |d, j| {
            d.running_pod()
                .filter(|(_, n)| n == "node-4" && step_of(j) > paused_at + 5)
        },
    )
    .await;

    // A crash: retried from the last checkpoint, one retry spent.
    cluster.kill_process(&pod4).unwrap();
    d.node = "node-5".into();
    let done = until(&mut d, &api, &id, "the job to succeed", long, |_, j| {
        (j["status"] == "succeeded").then(|| j.clone())
    })
    .await;
    assert_eq!(done["preemptions"], 2, "a pause is no preemption: {done:#}");
    assert_eq!(done["attempts"], 1, "{done:#}");
    let adapter = api.adapter(&id).await;
    assert!(
        adapter == reference_adapter,
        "the adapter differs from the undisturbed run"
    );
    assert_eq!(d.max_alive, 1);
    drop(dispatcher);
    eprintln!(
        "e2e: reference run {:?}, whole test {:?}",
        reference_took,
        started.elapsed()
    );
}
