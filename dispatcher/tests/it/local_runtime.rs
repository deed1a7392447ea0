//! The local runtime on its own: its journal (corrupt, unwritable, naming a pid that is
//! no longer a trainer) and the trainers a crashed dispatcher left running.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tuneq_dispatcher::journal::{Journal, JournalEntry};
use tuneq_dispatcher::local::{LocalRuntime, LocalSettings};
use tuneq_dispatcher::runtime::{End, Launch, Runtime, State};
use tuneq_openapi::TrainSpec;

/// A stand-in trainer that runs until killed (its command line stays the launch
/// contract's, as a real trainer's does).
fn looping_trainer(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("fake-tuneq");
    std::fs::write(&path, "#!/bin/sh\nwhile :; do sleep 0.05; done\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn settings(dir: &Path) -> LocalSettings {
    LocalSettings {
        exe: looping_trainer(dir),
        work_dir: dir.join("attempts"),
        report_base_url: "http://127.0.0.1:9".into(),
        device: Default::default(),
        cache_dir: dir.join("cache"),
        memory_limit_bytes: None,
        accelerator_memory_bytes: None,
    }
}

fn spec() -> TrainSpec {
    serde_json::from_value(serde_json::json!({
        "model": "m", "training_files": ["t.jsonl"], "output": "o"
    }))
    .unwrap()
}

async fn start(runtime: &mut LocalRuntime, job: &str, token: u64) -> Result<(), String> {
    let spec = spec();
    let launch = Launch {
        job,
        token,
        tenant: "t",
        spec: &spec,
        credential: "secret",
    };
    runtime.start(&launch).await.map_err(|e| e.to_string())
}

/// A job name no other test run uses (a trainer a failed run left cannot interfere).
fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", std::process::id())
}

/// Kills what is left of a job's trainers when a test ends, passed or not.
struct Reaper<'a>(&'a str);

impl Drop for Reaper<'_> {
    fn drop(&mut self) {
        for pid in trainers_of(self.0) {
            tuneq_dispatcher::local::signal(pid, "KILL");
        }
    }
}

/// Live processes (not zombies) whose command line names an attempt of `job`.
fn trainers_of(job: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| alive(*pid) && tuneq_dispatcher::local::is_trainer_of(*pid, job))
        .collect()
}

/// Whether process `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // The state follows the command name in parentheses.
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
}

/// Whether process `pid` lives with no signal pending: a signal sent by `kill` (which
/// waits for the kill command) is pending or has acted by the time it returns, so this
/// needs no waiting.
fn untouched(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    alive(pid)
        && status
            .lines()
            .filter(|l| l.starts_with("SigPnd:") || l.starts_with("ShdPnd:"))
            .all(|l| {
                l.split_whitespace()
                    .nth(1)
                    .is_some_and(|mask| mask.trim_start_matches('0').is_empty())
            })
}

/// Polls until the attempt is over, and says how it ended.
async fn wait_ended(runtime: &mut LocalRuntime, job: &str, token: u64) -> End {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let State::Ended(end) = runtime.poll(job, token).await.unwrap() {
            return end;
        }
        assert!(Instant::now() < deadline, "the attempt never ends");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_left_by_a_crashed_dispatcher_is_found_in_the_journal_and_killed() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("attempts.json");
    let job = &unique("jcrash");
    let _reaper = Reaper(job);
    let mut first = LocalRuntime::new(settings(dir.path()), journal.clone());
    start(&mut first, job, 4).await.unwrap();
    let pid = Journal::new(journal.clone()).read().unwrap()[0]
        .pid
        .unwrap();
    assert!(tuneq_dispatcher::local::is_trainer_of(pid, job));
    // The dispatcher dies without a word: its trainer runs on.
    drop(first);
    assert!(alive(pid));

    let mut restarted = LocalRuntime::new(settings(dir.path()), journal.clone());
    assert_eq!(restarted.leftovers().await.unwrap(), [(job.to_string(), 4)]);
    assert_eq!(restarted.poll(job, 4).await.unwrap(), State::Running);
    restarted.kill(job, 4).await.unwrap();
    wait_ended(&mut restarted, job, 4).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(pid) {
        assert!(
            Instant::now() < deadline,
            "the orphan {pid} is never killed: {:?}",
            std::fs::read_to_string(format!("/proc/{pid}/status"))
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    restarted.release(job, 4).await.unwrap();
    assert!(Journal::new(journal).read().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pid_in_the_journal_that_now_belongs_to_another_process_is_neither_killed_nor_followed() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("attempts.json");
    let job = &unique("jrecycled");
    let _reaper = Reaper(job);
    // The trainer is long gone and its pid went to an unrelated process.
    let mut stranger = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    Journal::new(journal.clone())
        .write(&[JournalEntry {
            job: job.into(),
            token: 3,
            pid: Some(stranger.id()),
        }])
        .unwrap();
    let mut runtime = LocalRuntime::new(settings(dir.path()), journal.clone());
    assert_eq!(runtime.leftovers().await.unwrap(), [(job.to_string(), 3)]);
    assert!(
        matches!(
            runtime.poll(job, 3).await.unwrap(),
            State::Ended(End::Crashed(_))
        ),
        "the stranger is not taken for the trainer"
    );
    runtime.kill(job, 3).await.unwrap();
    runtime.stop(job, 3).await.unwrap();
    assert!(
        untouched(stranger.id()),
        "the stranger was signalled: {:?}",
        std::fs::read_to_string(format!("/proc/{}/status", stranger.id()))
    );
    runtime.release(job, 3).await.unwrap();
    assert!(Journal::new(journal).read().unwrap().is_empty());
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_journal_finds_no_leftovers_and_is_replaced_by_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("attempts.json");
    let job = &unique("jcorrupt");
    let _reaper = Reaper(job);
    std::fs::write(&journal, b"[{\"job\": \"j0").unwrap();
    let mut runtime = LocalRuntime::new(settings(dir.path()), journal.clone());
    assert!(runtime.leftovers().await.unwrap().is_empty());
    start(&mut runtime, job, 1).await.unwrap();
    let entries = Journal::new(journal.clone()).read().unwrap();
    assert_eq!(
        entries
            .iter()
            .map(|e| (e.job.as_str(), e.token))
            .collect::<Vec<_>>(),
        [(job.as_str(), 1)]
    );
    assert_eq!(entries[0].pid, trainers_of(job).first().copied());
    runtime.kill(job, 1).await.unwrap();
    assert!(matches!(
        wait_ended(&mut runtime, job, 1).await,
        End::Crashed(why) if why.contains("signal 9")
    ));
    runtime.release(job, 1).await.unwrap();
    assert!(Journal::new(journal).read().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_whose_journal_cannot_be_written_fails_and_leaves_no_trainer_running() {
    let dir = tempfile::tempdir().unwrap();
    // A folder where the journal file should be: it can be neither read nor replaced.
    let journal = dir.path().join("attempts.json");
    std::fs::create_dir(&journal).unwrap();
    let job = &unique("junwritable");
    let _reaper = Reaper(job);
    let mut runtime = LocalRuntime::new(settings(dir.path()), journal.clone());
    assert!(runtime.leftovers().await.unwrap().is_empty());
    let error = start(&mut runtime, job, 1).await.unwrap_err();
    assert!(error.contains("journal"), "{error}");
    // The dispatcher retries a failed start as a new attempt: nothing of this one may
    // run beside it, unwatched.
    assert_eq!(trainers_of(job), Vec::<u32>::new());
    assert_eq!(
        runtime.poll(job, 1).await.unwrap(),
        State::Ended(End::Crashed("no such attempt here".into())),
        "the runtime forgot it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_gets_its_memory_limit_and_its_gpu_memory_in_the_environment() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // A trainer that writes its environment beside its spec (`train --spec PATH …`).
    let exe = dir.path().join("env-tuneq");
    std::fs::write(&exe, "#!/bin/sh\nenv > \"$(dirname \"$3\")/env.txt\"\n").unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let settings = LocalSettings {
        exe,
        memory_limit_bytes: Some(3 << 30),
        accelerator_memory_bytes: Some(24 << 30),
        ..settings(dir.path())
    };
    let job = &unique("jenv");
    let _reaper = Reaper(job);
    let mut runtime = LocalRuntime::new(settings, dir.path().join("attempts.json"));
    start(&mut runtime, job, 1).await.unwrap();
    wait_ended(&mut runtime, job, 1).await;
    let env = std::fs::read_to_string(
        dir.path()
            .join("attempts")
            .join(job)
            .join("attempt-1/env.txt"),
    )
    .unwrap();
    for (name, value) in [
        (tuneq_openapi::launch::ENV_MEMORY_LIMIT_BYTES, 3u64 << 30),
        (
            tuneq_openapi::launch::ENV_ACCELERATOR_MEMORY_BYTES,
            24 << 30,
        ),
    ] {
        assert!(
            env.lines().any(|l| l == format!("{name}={value}")),
            "no {name}={value} in {env}"
        );
    }
}
