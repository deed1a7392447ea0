//! The dispatcher's control loop against the embedded queue, with a stand-in trainer (a
//! shell script that ends the way the launch contract says a real one can), so every
//! exit the contract names is driven on purpose: interrupted (75) is a preemption that
//! spends no retry and, repeated on one pool, moves the job on; SIGKILL is a crash that
//! spends one; bad input (42) fails the job for good.
use crate::as_written;
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
    queue_with(
        dir,
        QueueConfig {
            retry_base_ms: 50,
            retry_max_ms: 100,
            ..QueueConfig::default()
        },
    )
    .await
}

/// A queue (see [`queue`]) in a fresh temporary folder, with `capacity` in `pool`; the
/// folder and the queue.
async fn queue_with_pool(pool: &str, capacity: u32) -> (tempfile::TempDir, Queue) {
    let dir = tempfile::tempdir().unwrap();
    let q = queue(dir.path()).await;
    q.set_pool(pool, capacity).await.unwrap();
    (dir, q)
}

async fn queue_with(dir: &Path, config: QueueConfig) -> Queue {
    crate::support::embedded_queue(dir, config).await
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
    dispatch_with(queue, dir, exe, pool, |config| {
        config.metrics = metrics.clone()
    })
}

/// The settings of a local runtime running `exe`, its files under `work`.
fn local_settings(exe: &Path, work: &Path) -> LocalSettings {
    LocalSettings {
        exe: exe.to_path_buf(),
        work_dir: work.join("attempts"),
        report_base_url: "http://127.0.0.1:9".into(),
        device: Default::default(),
        cache_dir: work.join("cache"),
        memory_limit_bytes: None,
        accelerator_memory_bytes: None,
    }
}

/// [`dispatch`], `tune` adjusting the dispatcher's settings.
fn dispatch_with(
    queue: &Queue,
    dir: &Path,
    exe: &Path,
    pool: &str,
    tune: impl FnOnce(&mut DispatcherConfig),
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>,
) {
    let work = dir.join(pool);
    std::fs::create_dir_all(&work).unwrap();
    let mut config = DispatcherConfig::new(pool, pool);
    config.tick = Duration::from_millis(50);
    config.placement.preemptions_before_fallback = 2;
    tune(&mut config);
    let runtime = LocalRuntime::new(local_settings(exe, &work), work.join("attempts.json"));
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
        let mut record = queue.get(id).await.unwrap().unwrap();
        if done(&record) {
            // Its reason as written (see `as_written`), for the assertions on its words.
            record.error = record.error.as_deref().map(as_written);
            return record;
        }
        assert!(
            Instant::now() < deadline,
            "timed out; the job is {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The job's events once one of them is of `kind`.
async fn wait_for_event(queue: &Queue, id: &str, kind: &str) -> Vec<(String, String)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let events = kinds_and_messages(queue, id).await;
        if events.iter().any(|(k, _)| k == kind) {
            return events;
        }
        assert!(Instant::now() < deadline, "no {kind} event: {events:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The job's events as (kind, message), each message as it was written: under
/// `TUNEQ_TEST_REWORD_MESSAGES=1` the queue stores every message reworded (the
/// dispatcher must not care), and this undoes it for the assertions on the words.
async fn kinds_and_messages(queue: &Queue, id: &str) -> Vec<(String, String)> {
    queue
        .events(id, None, 100, false)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.kind.code().to_string(), as_written(&e.message)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemptions_spend_no_retry_and_repeated_ones_move_the_job_to_its_next_pool() {
    let (dir, q) = queue_with_pool("spot", 1).await;
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
    assert_eq!(
        done.failure,
        Some(tuneq_openapi::FailureClass::InvalidTrainingInput)
    );
    let typed = q.events(&id, None, 100, false).await.unwrap();
    let leased: Vec<&str> = typed
        .iter()
        .filter(|e| e.kind == tuneq_openapi::EventKind::Leased)
        .filter_map(|e| e.pool.as_deref())
        .collect();
    assert_eq!(leased, ["spot", "spot", "on-demand"], "{typed:?}");
    let events = kinds_and_messages(&q, &id).await;
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
    let (dir, q) = queue_with_pool("local", 1).await;
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

/// A runtime driven by the test: it records every call and ends attempts when told to.
/// Its attempts outlive the dispatcher (as Kubernetes Jobs do) when `outlives` is set.
#[derive(Clone, Default)]
struct Fake(std::sync::Arc<std::sync::Mutex<Platform>>);

#[derive(Default)]
struct Platform {
    outlives: bool,
    /// Attempts on the platform: (job, token) → how they stand.
    attempts: std::collections::BTreeMap<(String, u64), tuneq_dispatcher::runtime::State>,
    starts: Vec<(String, u64)>,
    /// The queue state of each started attempt's job when the runtime was asked to start it.
    states_at_start: Vec<JobState>,
    polls: std::collections::BTreeMap<(String, u64), usize>,
    kills: Vec<(String, u64)>,
    /// Lists of leftovers still to fail (a platform not answering yet).
    failing_lists: usize,
    /// Set: the queue the dispatcher uses; the state of each job is read at its start.
    queue: Option<Queue>,
    /// Jobs cancelled while the runtime is starting their attempt (a slow platform).
    cancel_while_starting: bool,
}

impl Fake {
    /// Attempts that keep running when the dispatcher stops.
    fn outliving() -> Self {
        let fake = Self::default();
        fake.0.lock().unwrap().outlives = true;
        fake
    }

    fn with<R>(&self, f: impl FnOnce(&mut Platform) -> R) -> R {
        f(&mut self.0.lock().unwrap())
    }
}

#[async_trait::async_trait]
impl tuneq_dispatcher::runtime::Runtime for Fake {
    fn kind(&self) -> &'static str {
        "fake"
    }
    fn attempts_outlive_dispatcher(&self) -> bool {
        self.with(|p| p.outlives)
    }
    async fn start(
        &mut self,
        launch: &tuneq_dispatcher::runtime::Launch<'_>,
    ) -> Result<(), tuneq_dispatcher::DispatchError> {
        let (queue, cancel) = self.with(|p| (p.queue.clone(), p.cancel_while_starting));
        if let Some(queue) = queue {
            let state = queue.get(launch.job).await.unwrap().unwrap().state;
            self.with(|p| p.states_at_start.push(state));
            if cancel {
                queue.cancel(launch.job).await.unwrap();
            }
        }
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
        let mut p = self.0.lock().unwrap();
        let key = (job.to_string(), token);
        *p.polls.entry(key.clone()).or_default() += 1;
        Ok(p.attempts
            .get(&key)
            .cloned()
            .unwrap_or(tuneq_dispatcher::runtime::State::Ended(
                tuneq_dispatcher::runtime::End::Crashed("gone".into()),
            )))
    }
    /// Obeyed: the attempt checkpoints and ends as interrupted.
    async fn stop(&mut self, job: &str, token: u64) -> Result<(), tuneq_dispatcher::DispatchError> {
        use tuneq_dispatcher::runtime::{End, State};
        let mut p = self.0.lock().unwrap();
        if let Some(state) = p.attempts.get_mut(&(job.to_string(), token)) {
            *state = State::Ended(End::Interrupted("stopped".into()));
        }
        Ok(())
    }
    async fn kill(&mut self, job: &str, token: u64) -> Result<(), tuneq_dispatcher::DispatchError> {
        use tuneq_dispatcher::runtime::{End, State};
        let mut p = self.0.lock().unwrap();
        let key = (job.to_string(), token);
        p.kills.push(key.clone());
        if let Some(state) = p.attempts.get_mut(&key) {
            *state = State::Ended(End::Crashed("killed".into()));
        }
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
            return Err(tuneq_dispatcher::DispatchError::PlatformUnavailable {
                what: "list the attempts",
            });
        }
        Ok(p.attempts.keys().cloned().collect())
    }
}

/// Starts a dispatcher for pool `k8s` (2 slots) on `runtime`, `tune` adjusting its settings.
fn fake_dispatcher(
    queue: &Queue,
    runtime: &Fake,
    tune: impl FnOnce(&mut DispatcherConfig),
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>,
) {
    let mut config = DispatcherConfig::new("k8s", "k8s");
    config.tick = Duration::from_millis(50);
    config.slots = 2;
    tune(&mut config);
    let dispatcher = Dispatcher::new(
        queue.clone(),
        config,
        Box::new(runtime.clone()),
        AttemptSigner::new(vec![7; 32]),
    );
    let (stop, rx) = tokio::sync::watch::channel(false);
    (stop, tokio::spawn(dispatcher.run(rx)))
}

fn outliving_dispatcher(
    queue: &Queue,
    runtime: &Fake,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>,
) {
    fake_dispatcher(queue, runtime, |_| {})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_that_outlive_the_dispatcher_are_adopted_never_started_twice() {
    use tuneq_dispatcher::runtime::{End, State};
    let (_dir, q) = queue_with_pool("k8s", 2).await;
    let platform = Fake::outliving();
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
    let (_dir, q) = queue_with_pool("k8s", 2).await;
    q.set_pool("other", 1).await.unwrap();
    let platform = Fake::outliving();
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
    let (_dir, q) = queue_with_pool("k8s", 2).await;
    let platform = Fake::outliving();
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

/// Stops a dispatcher and waits for its loop to end (failing, not hanging, if it never does).
async fn shut_down(
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>,
) {
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the dispatcher never finished stopping")
        .unwrap()
        .unwrap();
}

/// Lines in the file the stand-in trainers append to on every run.
fn runs(counter: &Path) -> usize {
    std::fs::read_to_string(counter).map_or(0, |t| t.lines().count())
}

fn count(events: &[(String, String)], kind: &str) -> usize {
    events.iter().filter(|(k, _)| k == kind).count()
}

/// Checks that the job's events hold `retries` scheduled retries.
async fn assert_retries_scheduled(queue: &Queue, id: &str, retries: usize) {
    let events = kinds_and_messages(queue, id).await;
    assert_eq!(count(&events, "retry_scheduled"), retries, "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_that_exits_0_without_delivering_its_result_fails_its_attempt() {
    let (dir, q) = queue_with_pool("local", 1).await;
    // It exits 0 but never reports: the job is not complete.
    let exe = trainer(dir.path(), "exit 0");
    let id = q.enqueue(&job(&["local"])).await.unwrap().id;
    let metrics = tuneq_dispatcher::metrics::Metrics::default();
    let (stop, task) = dispatch(&q, dir.path(), &exe, "local", &metrics);
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    assert_eq!(
        (done.state, done.attempts, done.error.as_deref()),
        (
            JobState::Failed,
            3,
            Some("the trainer ended without delivering its result")
        ),
        "every attempt is a failure that is retried within the budget"
    );
    assert_retries_scheduled(&q, &id, 2).await;
    assert!(
        metrics.render().lines().any(
            |l| l == "tuneq_dispatcher_attempts_ended_total{pool=\"local\",end=\"finished\"} 3"
        )
    );
    shut_down(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_fails_the_job_at_once_without_a_retry() {
    let (dir, q) = queue_with_pool("local", 1).await;
    let counter = dir.path().join("runs");
    let exe = trainer(
        dir.path(),
        &format!(
            "echo x >> {}\necho 'error: line 3 of t.jsonl is not JSON' >&2\nexit 42",
            counter.display()
        ),
    );
    let id = q.enqueue(&job(&["local"])).await.unwrap().id;
    let (stop, task) = dispatch(&q, dir.path(), &exe, "local", &Default::default());
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    assert_eq!(
        (done.state, done.attempts, done.error.as_deref()),
        (
            JobState::Failed,
            1,
            Some("invalid input: error: line 3 of t.jsonl is not JSON")
        ),
        "the budget allows 3 attempts, but bad input never trains"
    );
    assert_eq!(runs(&counter), 1);
    assert_retries_scheduled(&q, &id, 0).await;
    shut_down(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_attempt_is_retried_after_a_doubling_back_off_until_its_3_attempts_are_spent() {
    let dir = tempfile::tempdir().unwrap();
    // Back-off long enough that a retry waits for the test to move the queue's clock.
    let q = queue_with(
        dir.path(),
        QueueConfig {
            retry_base_ms: 60_000,
            retry_max_ms: 600_000,
            ..QueueConfig::default()
        },
    )
    .await;
    q.set_pool("local", 1).await.unwrap();
    let counter = dir.path().join("runs");
    let exe = trainer(
        dir.path(),
        &format!(
            "echo x >> {}\necho 'out of coffee' >&2\nexit 3",
            counter.display()
        ),
    );
    let id = q.enqueue(&job(&["local"])).await.unwrap().id;
    let (stop, task) = dispatch(&q, dir.path(), &exe, "local", &Default::default());
    for (failed, base) in [(1, 60_000), (2, 120_000)] {
        let delayed = wait_until(&q, &id, |r| {
            r.state == JobState::Delayed && r.attempts == failed
        })
        .await;
        let events = q.events(&id, None, 100, false).await.unwrap();
        let scheduled = events
            .iter()
            .filter(|e| e.kind == tuneq_openapi::EventKind::RetryScheduled)
            .nth(failed as usize - 1)
            .unwrap();
        assert_eq!(
            as_written(&scheduled.message),
            "trainer exited with status 3: out of coffee"
        );
        // The base delay doubles per failed attempt, plus up to a quarter of jitter.
        let delay = delayed.due_ms.unwrap() - scheduled.at_ms;
        assert!(
            (base..=base + base / 4).contains(&delay),
            "retry {failed} waits {delay} ms"
        );
        assert_eq!(runs(&counter), failed as usize);
        q.advance_clock(delay).await.unwrap();
    }
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    assert_eq!(
        (done.state, done.attempts, done.error.as_deref()),
        (
            JobState::Failed,
            3,
            Some("trainer exited with status 3: out of coffee")
        )
    );
    assert_eq!(runs(&counter), 3);
    shut_down(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_attempt_still_running_is_adopted_and_one_nobody_runs_is_requeued() {
    let (_dir, q) = queue_with_pool("k8s", 2).await;
    // Another dispatcher of the pool claimed this job, started it and died.
    let lost = q.enqueue(&job(&["k8s"])).await.unwrap().id;
    let dead = q.claim("k8s", "dead", "dead-1").await.unwrap().unwrap();
    q.start(&dead.id, dead.token).await.unwrap();
    let id = q.enqueue(&job(&["k8s"])).await.unwrap().id;
    let platform = Fake::default();
    // Heartbeats so rare that the leases run out.
    let (stop, task) = fake_dispatcher(&q, &platform, |config| {
        config.heartbeat = Duration::from_secs(3600);
    });
    let running = wait_until(&q, &id, |r| r.state == JobState::Running).await;
    // Two polls: a whole tick, with its first heartbeat, has passed since the start.
    let deadline = Instant::now() + Duration::from_secs(30);
    while platform.with(|p| p.polls.get(&(id.clone(), running.epoch)).copied()) < Some(2) {
        assert!(Instant::now() < deadline, "the attempt is never polled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    q.advance_clock(QueueConfig::default().lease_ms + 1)
        .await
        .unwrap();
    // Its lease ran out, but it runs here: adopted, the same attempt goes on.
    let events = wait_for_event(&q, &id, "adopted").await;
    let lapsed: Vec<&str> = events
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| ["lease_expired", "adopted", "requeued"].contains(k))
        .collect();
    assert_eq!(lapsed, ["lease_expired", "adopted"], "{events:?}");
    let adopted = q.get(&id).await.unwrap().unwrap();
    assert_eq!((adopted.epoch, adopted.stalls), (running.epoch, 0));
    // The dead dispatcher's attempt runs nowhere: requeued, and this one runs it anew.
    let rerun = wait_until(&q, &lost, |r| {
        r.state == JobState::Running && r.epoch > dead.token
    })
    .await;
    assert_eq!(rerun.stalls, 1);
    let events = kinds_and_messages(&q, &lost).await;
    assert!(events.iter().any(|(k, _)| k == "requeued"), "{events:?}");
    platform.with(|p| {
        assert_eq!(
            p.starts,
            [(id.clone(), running.epoch), (lost.clone(), rerun.epoch)]
        );
        assert!(p.kills.is_empty(), "{:?}", p.kills);
    });
    shut_down(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_is_started_only_once_the_queue_has_confirmed_its_lease() {
    let (_dir, q) = queue_with_pool("k8s", 2).await;
    let platform = Fake::default();
    platform.with(|p| p.queue = Some(q.clone()));
    let id = q.enqueue(&job(&["k8s"])).await.unwrap().id;
    let (stop, task) = fake_dispatcher(&q, &platform, |_| {});
    wait_until(&q, &id, |r| r.state == JobState::Running).await;
    // Leased is not enough: a lease lost between the claim and the start (a cancel,
    // an expiry) would have left an attempt running that no lease backs.
    platform.with(|p| assert_eq!(p.states_at_start, [JobState::Running]));
    shut_down(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_whose_lease_is_lost_while_it_starts_is_killed_at_once() {
    let (_dir, q) = queue_with_pool("k8s", 2).await;
    let platform = Fake::default();
    platform.with(|p| {
        p.queue = Some(q.clone());
        p.cancel_while_starting = true;
    });
    let id = q.enqueue(&job(&["k8s"])).await.unwrap().id;
    // Its first heartbeat is its only one: the next would be an hour later.
    let (stop, task) = fake_dispatcher(&q, &platform, |config| {
        config.heartbeat = Duration::from_secs(3600);
    });
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    assert_eq!(done.state, JobState::Cancelled);
    platform.with(|p| {
        assert_eq!(p.starts.len(), 1);
        assert_eq!(p.kills, p.starts, "killed, not asked to checkpoint");
    });
    shut_down(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_that_cannot_be_spawned_is_a_failed_attempt_retried_within_its_budget() {
    let (dir, q) = queue_with_pool("local", 1).await;
    let missing = dir.path().join("no-such-tuneq");
    let id = q.enqueue(&job(&["local"])).await.unwrap().id;
    let (stop, task) = dispatch(&q, dir.path(), &missing, "local", &Default::default());
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    assert_eq!(
        (done.state, done.attempts),
        (JobState::Failed, 3),
        "{done:?}"
    );
    let error = done.error.unwrap();
    assert!(
        error.contains(&missing.display().to_string()) && error.contains("No such file"),
        "{error}"
    );
    assert_retries_scheduled(&q, &id, 2).await;
    shut_down(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_that_ignores_a_stop_is_killed_after_the_grace_and_its_job_keeps_its_place() {
    let (dir, q) = queue_with_pool("local", 1).await;
    let ready = dir.path().join("ready");
    // A trainer deaf to SIGTERM: only SIGKILL ends it.
    let exe = trainer(
        dir.path(),
        &format!(
            "trap '' TERM\ntouch {}\nwhile :; do sleep 0.05; done",
            ready.display()
        ),
    );
    let id = q.enqueue(&job(&["local"])).await.unwrap().id;
    let metrics = tuneq_dispatcher::metrics::Metrics::default();
    let (stop, task) = dispatch_with(&q, dir.path(), &exe, "local", |config| {
        config.stop_grace = Duration::from_millis(200);
        config.metrics = metrics.clone();
    });
    wait_until(&q, &id, |r| r.state == JobState::Running).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the trainer never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The shutdown asks it to checkpoint and stop; it does not, so it is killed.
    shut_down(stop, task).await;
    assert!(
        metrics
            .render()
            .lines()
            .any(|l| l == "tuneq_dispatcher_attempts_ended_total{pool=\"local\",end=\"crashed\"} 1"),
        "{}",
        metrics.render()
    );
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.preemptions, record.attempts),
        (JobState::Queued, 1, 0),
        "a shutdown spends no retry"
    );
    let events = q.events(&id, None, 100, false).await.unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == tuneq_openapi::EventKind::Preempted
                && e.stop == Some(tuneq_openapi::StopCause::Shutdown)),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_job_stops_its_trainer_gracefully_and_runs_again_only_once_resumed() {
    let (dir, q) = queue_with_pool("local", 1).await;
    let (counter, ready, stopped) = (
        dir.path().join("runs"),
        dir.path().join("ready"),
        dir.path().join("stopped"),
    );
    // First run: trains until SIGTERM, which it answers as a trainer does (checkpoint,
    // exit 75). Second run: ends the job (bad input), so the test has an end to wait for.
    let exe = trainer(
        dir.path(),
        &format!(
            r#"echo x >> {counter}; [ "$(wc -l < {counter})" -gt 1 ] && exit 42
trap 'touch {stopped}; exit 75' TERM
touch {ready}; while :; do sleep 0.05; done"#,
            counter = counter.display(),
            ready = ready.display(),
            stopped = stopped.display()
        ),
    );
    let id = q.enqueue(&job(&["local"])).await.unwrap().id;
    let (stop, task) = dispatch_with(&q, dir.path(), &exe, "local", |config| {
        config.heartbeat = Duration::from_millis(100);
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the trainer never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(q.pause(&id).await.unwrap(), JobState::Running);
    let paused = wait_until(&q, &id, |r| r.state == JobState::Paused).await;
    assert!(
        stopped.exists(),
        "the trainer was asked to checkpoint (SIGTERM), not killed"
    );
    assert_eq!((paused.preemptions, paused.attempts), (0, 0), "{paused:?}");
    let events = kinds_and_messages(&q, &id).await;
    let tail: Vec<&str> = events
        .iter()
        .rev()
        .take(2)
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(tail, ["paused", "pause_requested"], "{events:?}");

    // Paused, it holds nothing and is not run again until resumed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(runs(&counter), 1);
    assert_eq!(q.pool_usage("local").await.unwrap().used, 0);
    assert_eq!(q.resume(&id).await.unwrap(), JobState::Queued);
    let done = wait_until(&q, &id, |r| r.state.is_terminal()).await;
    assert_eq!((done.state, runs(&counter)), (JobState::Failed, 2));
    shut_down(stop, task).await;
}
