//! The dispatcher's control loop against the embedded queue, with a stand-in trainer (a
//! shell script that ends the way the launch contract says a real one can), so every
//! exit the contract names is driven on purpose: interrupted (75) is a preemption that
//! spends no retry and, repeated on one pool, moves the job on; SIGKILL is a crash that
//! spends one; bad input (42) fails the job for good.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tuneq_dispatcher::local::{LocalRuntime, LocalSettings};
use tuneq_dispatcher::{Dispatcher, DispatcherConfig};
use tuneq_queue::{AttemptSigner, JobQueue, JobRecord, JobState, NewJob, Queue, QueueConfig};

/// A stand-in trainer: `script` is the body of a shell script that gets the launch
/// contract's arguments (`train --spec FILE --progress json`).
fn trainer(dir: &Path, script: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("fake-tuneq");
    std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

async fn queue(dir: &Path) -> Queue {
    let config = QueueConfig {
        retry_base_ms: 50,
        retry_max_ms: 100,
        ..QueueConfig::default()
    };
    Queue::open_embedded(&dir.join("queue.db"), "tuneq", config)
        .await
        .unwrap()
}

fn job(pools: &[&str]) -> NewJob {
    NewJob {
        tenant: "t".into(),
        priority: 5,
        pools: pools.iter().map(|p| p.to_string()).collect(),
        gpus: 1,
        estimated_seconds: 0,
        max_attempts: 3,
        payload: serde_json::json!({
            "finetune": "ftjob-test",
            "spec": {"model": "m", "training_files": ["t.jsonl"], "output": "o"}
        })
        .to_string(),
        idempotency_key: None,
        notify: false,
    }
}

/// Starts a dispatcher for `pool`; it stops when the returned sender says so.
fn dispatch(
    queue: &Queue,
    dir: &Path,
    exe: &Path,
    pool: &str,
    metrics: &tuneq_dispatcher::metrics::Metrics,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>,
) {
    let work = dir.join(pool);
    std::fs::create_dir_all(&work).unwrap();
    let settings = LocalSettings {
        exe: exe.to_path_buf(),
        work_dir: work.join("attempts"),
        report_base_url: "http://127.0.0.1:9".into(),
        device: Default::default(),
        cache_dir: work.join("cache"),
        memory_limit_bytes: None,
    };
    let mut config = DispatcherConfig::new(pool, pool);
    config.tick = Duration::from_millis(50);
    config.placement.preemptions_before_fallback = 2;
    config.metrics = metrics.clone();
    let runtime = LocalRuntime::new(settings, work.join("attempts.json"));
    let dispatcher = Dispatcher::new(
        queue.clone(),
        config,
        Box::new(runtime),
        AttemptSigner::new(vec![7; 32]),
    );
    let (stop, rx) = tokio::sync::watch::channel(false);
    (stop, tokio::spawn(dispatcher.run(rx)))
}

async fn wait_until(queue: &Queue, id: &str, done: impl Fn(&JobRecord) -> bool) -> JobRecord {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let record = queue.get(id).await.unwrap().unwrap();
        if done(&record) {
            return record;
        }
        assert!(
            Instant::now() < deadline,
            "timed out; the job is {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn kinds_and_messages(queue: &Queue, id: &str) -> Vec<(String, String)> {
    queue
        .events(id, None, 100, false)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.kind, e.message))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemptions_spend_no_retry_and_repeated_ones_move_the_job_to_its_next_pool() {
    let dir = tempfile::tempdir().unwrap();
    let q = queue(dir.path()).await;
    q.set_pool("spot", 1).await.unwrap();
    q.set_pool("on-demand", 1).await.unwrap();
    // On the spot pool the trainer is always interrupted; elsewhere its input is bad.
    let exe = trainer(
        dir.path(),
        r#"case "$3" in */spot/*) exit 75 ;; *) echo "error: no such dataset" >&2; exit 42 ;; esac"#,
    );
    let id = q.enqueue(&job(&["spot", "on-demand"])).await.unwrap().id;
    // Only the spot pool runs until the job has moved on, so nothing else can take it.
    let metrics = tuneq_dispatcher::metrics::Metrics::default();
    let (stop_spot, spot) = dispatch(&q, dir.path(), &exe, "spot", &metrics);
    let moved = wait_until(&q, &id, |r| r.pools == ["on-demand"]).await;
    assert_eq!(
        (moved.state, moved.preemptions, moved.attempts),
        (JobState::Queued, 2, 0)
    );
    let (stop_demand, demand) = dispatch(&q, dir.path(), &exe, "on-demand", &metrics);
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    assert_eq!(done.state, JobState::Failed);
    assert_eq!(done.preemptions, 2);
    assert!(
        done.error
            .as_deref()
            .unwrap()
            .contains("invalid input: error: no such dataset"),
        "{done:?}"
    );
    let events = kinds_and_messages(&q, &id).await;
    let leased: Vec<&str> = events
        .iter()
        .filter(|(k, _)| k == "leased")
        .map(|(_, m)| m.as_str())
        .collect();
    assert_eq!(leased, ["spot", "spot", "on-demand"], "{events:?}");
    let moved = events.iter().find(|(k, _)| k == "moved").unwrap();
    assert!(moved.1.contains("preempted 2 times on spot"), "{moved:?}");
    let text = metrics.render();
    for line in [
        "tuneq_dispatcher_attempts_started_total{pool=\"spot\"} 2",
        "tuneq_dispatcher_attempts_ended_total{pool=\"spot\",end=\"preempted\"} 2",
        "tuneq_dispatcher_attempts_ended_total{pool=\"on-demand\",end=\"bad_input\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    for (stop, task) in [(stop_spot, spot), (stop_demand, demand)] {
        stop.send(true).unwrap();
        task.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_trainer_is_a_preemption_and_a_killed_one_a_retried_crash() {
    let dir = tempfile::tempdir().unwrap();
    let q = queue(dir.path()).await;
    q.set_pool("local", 1).await.unwrap();
    // First run: interrupted. Second: killed outright. Third: bad input, to end it.
    let counter = dir.path().join("runs");
    let exe = trainer(
        dir.path(),
        &format!(
            r#"echo x >> {c}; n=$(wc -l < {c})
case $n in 1) exit 75 ;; 2) kill -KILL $$ ;; *) exit 42 ;; esac"#,
            c = counter.display()
        ),
    );
    let id = q.enqueue(&job(&["local"])).await.unwrap().id;
    let (stop, task) = dispatch(&q, dir.path(), &exe, "local", &Default::default());
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    // Failed attempts: the crash and the bad input; the preemption is not one.
    assert_eq!(
        (done.state, done.preemptions, done.attempts),
        (JobState::Failed, 1, 2),
        "{done:?}"
    );
    let events = kinds_and_messages(&q, &id).await;
    let retried = events.iter().find(|(k, _)| k == "retry_scheduled").unwrap();
    assert!(retried.1.contains("killed by signal 9"), "{retried:?}");
    // A single pool is never taken away from a job.
    assert!(!events.iter().any(|(k, _)| k == "moved"), "{events:?}");
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
}

/// A runtime whose attempts outlive the dispatcher (as Kubernetes Jobs do), driven by
/// the test: it records every call and ends attempts when told to.
#[derive(Clone, Default)]
struct Outliving(std::sync::Arc<std::sync::Mutex<Platform>>);

#[derive(Default)]
struct Platform {
    /// Attempts on the platform: (job, token) → how they stand.
    attempts: std::collections::BTreeMap<(String, u64), tuneq_dispatcher::runtime::State>,
    starts: Vec<(String, u64)>,
    kills: Vec<(String, u64)>,
    /// Lists of leftovers still to fail (a platform not answering yet).
    failing_lists: usize,
}

#[async_trait::async_trait]
impl tuneq_dispatcher::runtime::Runtime for Outliving {
    fn kind(&self) -> &'static str {
        "outliving"
    }
    fn attempts_outlive_dispatcher(&self) -> bool {
        true
    }
    async fn start(
        &mut self,
        launch: &tuneq_dispatcher::runtime::Launch<'_>,
    ) -> Result<(), tuneq_dispatcher::DispatchError> {
        let mut p = self.0.lock().unwrap();
        let key = (launch.job.to_string(), launch.token);
        p.starts.push(key.clone());
        p.attempts
            .entry(key)
            .or_insert(tuneq_dispatcher::runtime::State::Running);
        Ok(())
    }
    async fn poll(
        &mut self,
        job: &str,
        token: u64,
    ) -> Result<tuneq_dispatcher::runtime::State, tuneq_dispatcher::DispatchError> {
        let p = self.0.lock().unwrap();
        Ok(p.attempts
            .get(&(job.to_string(), token))
            .cloned()
            .unwrap_or(tuneq_dispatcher::runtime::State::Ended(
                tuneq_dispatcher::runtime::End::Crashed("gone".into()),
            )))
    }
    async fn stop(&mut self, _: &str, _: u64) -> Result<(), tuneq_dispatcher::DispatchError> {
        Ok(())
    }
    async fn kill(&mut self, job: &str, token: u64) -> Result<(), tuneq_dispatcher::DispatchError> {
        self.0.lock().unwrap().kills.push((job.to_string(), token));
        Ok(())
    }
    async fn release(
        &mut self,
        job: &str,
        token: u64,
    ) -> Result<(), tuneq_dispatcher::DispatchError> {
        self.0
            .lock()
            .unwrap()
            .attempts
            .remove(&(job.to_string(), token));
        Ok(())
    }
    async fn leftovers(&mut self) -> Result<Vec<(String, u64)>, tuneq_dispatcher::DispatchError> {
        let mut p = self.0.lock().unwrap();
        if p.failing_lists > 0 {
            p.failing_lists -= 1;
            return Err(tuneq_dispatcher::DispatchError::Runtime(
                "the API server is not answering".into(),
            ));
        }
        Ok(p.attempts.keys().cloned().collect())
    }
}

fn outliving_dispatcher(
    queue: &Queue,
    runtime: &Outliving,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>,
) {
    let mut config = DispatcherConfig::new("k8s", "k8s");
    config.tick = Duration::from_millis(50);
    config.slots = 2;
    let dispatcher = Dispatcher::new(
        queue.clone(),
        config,
        Box::new(runtime.clone()),
        AttemptSigner::new(vec![7; 32]),
    );
    let (stop, rx) = tokio::sync::watch::channel(false);
    (stop, tokio::spawn(dispatcher.run(rx)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_that_outlive_the_dispatcher_are_adopted_never_started_twice() {
    use tuneq_dispatcher::runtime::{End, State};
    let dir = tempfile::tempdir().unwrap();
    let q = queue(dir.path()).await;
    q.set_pool("k8s", 2).await.unwrap();
    let platform = Outliving::default();
    let id = q.enqueue(&job(&["k8s"])).await.unwrap().id;
    let stale = q.enqueue(&job(&["k8s"])).await.unwrap().id;

    let (stop, task) = outliving_dispatcher(&q, &platform);
    let running = wait_until(&q, &id, |r| r.state == JobState::Running).await;
    wait_until(&q, &stale, |r| r.state == JobState::Running).await;
    // The dispatcher stops (or dies): its attempts keep running.
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(platform.0.lock().unwrap().attempts.len(), 2);
    // Meanwhile one job is cancelled: its attempt is no longer the queue's live one.
    q.cancel(&stale).await.unwrap();

    let (stop, task) = outliving_dispatcher(&q, &platform);
    let cancelled = wait_until(&q, &stale, |r| r.state.is_terminal()).await;
    assert_eq!(cancelled.state, JobState::Cancelled);
    {
        let p = platform.0.lock().unwrap();
        assert_eq!(
            p.starts.len(),
            2,
            "an adopted attempt is never started again"
        );
        assert!(
            p.kills.iter().any(|(j, _)| *j == stale),
            "the stale attempt is removed"
        );
        assert!(
            !p.kills.iter().any(|(j, _)| *j == id),
            "the live one is kept"
        );
    }
    // The adopted attempt is heartbeated and its end is read: preempted on the platform.
    platform.0.lock().unwrap().attempts.insert(
        (id.clone(), running.epoch),
        State::Ended(End::Interrupted("node shut down".into())),
    );
    let resumed = wait_until(&q, &id, |r| {
        r.preemptions == 1 && r.state == JobState::Running
    })
    .await;
    assert_eq!(resumed.attempts, 0);
    assert!(resumed.epoch > running.epoch);
    // Its next attempt finishes: the trainer's report completes the job, then it ends.
    q.complete(&id, resumed.epoch, "{}").await.unwrap();
    platform
        .0
        .lock()
        .unwrap()
        .attempts
        .insert((id.clone(), resumed.epoch), State::Ended(End::Finished));
    wait_until(&q, &id, |r| r.state == JobState::Succeeded).await;
    // The ended attempt is read and released from the platform.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !platform.0.lock().unwrap().attempts.is_empty() {
        assert!(
            Instant::now() < deadline,
            "ended attempts are never released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(platform.0.lock().unwrap().starts.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_found_no_node_moves_the_job_on_without_a_preemption() {
    use tuneq_dispatcher::runtime::{End, State};
    let dir = tempfile::tempdir().unwrap();
    let q = queue(dir.path()).await;
    q.set_pool("k8s", 2).await.unwrap();
    q.set_pool("other", 1).await.unwrap();
    let platform = Outliving::default();
    let id = q.enqueue(&job(&["k8s", "other"])).await.unwrap().id;
    let (stop, task) = outliving_dispatcher(&q, &platform);
    let running = wait_until(&q, &id, |r| r.state == JobState::Running).await;
    platform.0.lock().unwrap().attempts.insert(
        (id.clone(), running.epoch),
        State::Ended(End::NoCapacity(
            "0/3 nodes are available: 3 Insufficient nvidia.com/gpu".into(),
        )),
    );
    let moved = wait_until(&q, &id, |r| r.pools == ["other"]).await;
    assert_eq!(
        (moved.state, moved.preemptions, moved.attempts),
        (JobState::Queued, 0, 0),
        "finding no node is neither a preemption nor a failure"
    );
    let events = kinds_and_messages(&q, &id).await;
    let unplaced = events
        .iter()
        .find(|(kind, _)| kind == "unplaced")
        .unwrap_or_else(|| panic!("no unplaced event: {events:?}"));
    assert!(
        unplaced.1.contains("Insufficient nvidia.com/gpu"),
        "{unplaced:?}"
    );
    assert!(
        events
            .iter()
            .any(|(kind, m)| kind == "moved" && m.contains("no node on k8s"))
    );
    assert!(
        !events.iter().any(|(kind, _)| kind == "preempted"),
        "{events:?}"
    );
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_platform_that_does_not_answer_at_start_is_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let q = queue(dir.path()).await;
    q.set_pool("k8s", 2).await.unwrap();
    let platform = Outliving::default();
    platform.0.lock().unwrap().failing_lists = 2;
    let id = q.enqueue(&job(&["k8s"])).await.unwrap().id;
    let (stop, task) = outliving_dispatcher(&q, &platform);
    // It retries (0.5 s, then 1 s) instead of exiting, then runs the job once.
    wait_until(&q, &id, |r| r.state == JobState::Running).await;
    {
        let p = platform.0.lock().unwrap();
        assert_eq!(p.failing_lists, 0);
        assert_eq!(p.starts.len(), 1);
    }
    assert!(!task.is_finished(), "the loop must still run");
    stop.send(true).unwrap();
    task.await.unwrap().unwrap();
}
