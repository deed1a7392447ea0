//! The local runtime: each attempt is a `tuneq train` child process on this machine.
//!
//! The child gets the job's [`TrainSpec`] in a file, the report URL and its attempt's
//! credential in its environment, and writes its own output to the job's output
//! location (where the next attempt resumes from the last checkpoint). Its stdout
//! (JSON progress lines) and stderr go to files in the attempt's folder; the tail of
//! stderr becomes the failure reason when it exits badly.
//!
//! Its attempts end with the dispatcher (a trainer asks the kernel to stop it when its
//! parent dies). A journal ([`crate::journal`]) keeps their process ids, so a restarted
//! dispatcher finds and kills what a crashed one left.

use crate::DispatchError;
use crate::journal::{Journal, JournalEntry};
use crate::runtime::{End, Launch, Runtime, State};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use tuneq_openapi::launch::{self, TrainerExit};
use tuneq_openapi::{DeviceKind, TrainSpec};

/// How attempts are started.
#[derive(Debug, Clone)]
pub struct LocalSettings {
    /// The `tuneq` binary.
    pub exe: PathBuf,
    /// Attempt folders go under it.
    pub work_dir: PathBuf,
    /// Where trainers post progress (`…/internal/attempts/{job}/report` is appended).
    pub report_base_url: String,
    /// Device the trainers use.
    pub device: DeviceKind,
    /// Cache of remote models and datasets, shared by attempts.
    pub cache_dir: PathBuf,
    /// Memory one attempt may use, in bytes: a trainer past it stops as bad input
    /// (see [`MEMORY_LIMIT_ENV`]). None: no limit.
    pub memory_limit_bytes: Option<u64>,
    /// Memory of the accelerator a trainer uses, in bytes (GPU pools), for
    /// `activation_checkpointing: auto` (see [`launch::ENV_ACCELERATOR_MEMORY_BYTES`]).
    pub accelerator_memory_bytes: Option<u64>,
}

/// The environment variable that gives a trainer its memory limit in bytes: past it,
/// the trainer stops as bad input and says how much it used, instead of pushing the
/// machine into swap or the kernel's OOM killer (and being retried).
pub const MEMORY_LIMIT_ENV: &str = launch::ENV_MEMORY_LIMIT_BYTES;

/// A started attempt's process.
#[derive(Debug)]
pub struct Process {
    /// The child.
    pub child: tokio::process::Child,
    /// Its folder (spec, stdout, stderr).
    pub dir: PathBuf,
}

/// An attempt this runtime knows of.
#[derive(Debug)]
enum Tracked {
    /// Started by this run.
    Child { token: u64, process: Process },
    /// Left by an earlier run (from the journal): only its process id is known.
    Orphan { token: u64, pid: Option<u32> },
}

impl Tracked {
    fn token(&self) -> u64 {
        match self {
            Self::Child { token, .. } | Self::Orphan { token, .. } => *token,
        }
    }

    fn pid(&self) -> Option<u32> {
        match self {
            Self::Child { process, .. } => process.child.id(),
            Self::Orphan { pid, .. } => *pid,
        }
    }
}

/// The local runtime: its settings, its attempts, its journal.
#[derive(Debug)]
pub struct LocalRuntime {
    settings: LocalSettings,
    journal: Journal,
    attempts: HashMap<String, Tracked>,
}

impl LocalRuntime {
    /// A runtime starting attempts as `settings` says; `journal` is the file that keeps
    /// its live attempts.
    pub fn new(settings: LocalSettings, journal: PathBuf) -> Self {
        Self {
            settings,
            journal: Journal::new(journal),
            attempts: HashMap::new(),
        }
    }

    fn save_journal(&self) -> Result<(), DispatchError> {
        let entries: Vec<JournalEntry> = self
            .attempts
            .iter()
            .map(|(job, a)| JournalEntry {
                job: job.clone(),
                token: a.token(),
                pid: a.pid(),
            })
            .collect();
        self.journal.write(&entries)
    }

    fn tracked(&mut self, job: &str, token: u64) -> Option<&mut Tracked> {
        self.attempts.get_mut(job).filter(|a| a.token() == token)
    }
}

#[async_trait::async_trait]
impl Runtime for LocalRuntime {
    fn kind(&self) -> &'static str {
        "local"
    }

    fn attempts_outlive_dispatcher(&self) -> bool {
        false
    }

    async fn start(&mut self, launch: &Launch<'_>) -> Result<(), DispatchError> {
        if self.tracked(launch.job, launch.token).is_some() {
            return Ok(());
        }
        let process = self
            .settings
            .spawn(launch.job, launch.token, launch.spec, launch.credential)
            .await?;
        tracing::info!(job = launch.job, pid = ?process.child.id(), "trainer process started");
        // Journaled before anything else can fail, so the process is never left
        // running unwatched.
        self.attempts.insert(
            launch.job.to_string(),
            Tracked::Child {
                token: launch.token,
                process,
            },
        );
        if let Err(e) = self.save_journal() {
            // A start that fails is retried as a new attempt: this one must not run on
            // beside it, unjournaled. Killed and reaped before the error is returned.
            if let Some(Tracked::Child { mut process, .. }) = self.attempts.remove(launch.job) {
                let _ = process.child.kill().await;
            }
            return Err(e);
        }
        Ok(())
    }

    async fn poll(&mut self, job: &str, token: u64) -> Result<State, DispatchError> {
        match self.tracked(job, token) {
            Some(Tracked::Child { process, .. }) => match process.child.try_wait() {
                Ok(Some(status)) => Ok(State::Ended(classify(status, &process.dir))),
                Ok(None) => Ok(State::Running),
                Err(e) => Err(DispatchError::io(&process.dir)(e)),
            },
            Some(Tracked::Orphan { pid, .. }) => {
                if pid.is_some_and(|pid| is_trainer_of(pid, job)) {
                    Ok(State::Running)
                } else {
                    Ok(State::Ended(End::Crashed(
                        "the trainer ended while the dispatcher was away".into(),
                    )))
                }
            }
            None => Ok(State::Ended(End::Crashed("no such attempt here".into()))),
        }
    }

    async fn stop(&mut self, job: &str, token: u64) -> Result<(), DispatchError> {
        match self.tracked(job, token) {
            Some(Tracked::Child { process, .. }) => {
                if let Some(pid) = process.child.id() {
                    signal(pid, "TERM");
                }
            }
            // As with `kill`: a recycled pid is never signalled by mistake.
            Some(Tracked::Orphan { pid: Some(pid), .. }) if is_trainer_of(*pid, job) => {
                signal(*pid, "TERM");
            }
            _ => {}
        }
        Ok(())
    }

    async fn kill(&mut self, job: &str, token: u64) -> Result<(), DispatchError> {
        match self.tracked(job, token) {
            Some(Tracked::Child { process, .. }) => {
                let _ = process.child.start_kill();
            }
            // A recycled pid is never killed by mistake.
            Some(Tracked::Orphan { pid: Some(pid), .. }) if is_trainer_of(*pid, job) => {
                signal(*pid, "KILL");
            }
            _ => {}
        }
        Ok(())
    }

    async fn release(&mut self, job: &str, token: u64) -> Result<(), DispatchError> {
        if self.tracked(job, token).is_some() {
            self.attempts.remove(job);
            self.save_journal()?;
        }
        Ok(())
    }

    async fn leftovers(&mut self) -> Result<Vec<(String, u64)>, DispatchError> {
        let entries = self.journal.read().unwrap_or_else(|e| {
            tracing::warn!(
                error = &e as &dyn std::error::Error,
                "unreadable journal; leftover attempts will be found when their leases run out"
            );
            Vec::new()
        });
        let mut found = Vec::new();
        for entry in entries {
            found.push((entry.job.clone(), entry.token));
            self.attempts.entry(entry.job).or_insert(Tracked::Orphan {
                token: entry.token,
                pid: entry.pid,
            });
        }
        Ok(found)
    }
}

impl LocalSettings {
    /// Starts attempt `token` of `job` running `spec`.
    async fn spawn(
        &self,
        job: &str,
        token: u64,
        spec: &TrainSpec,
        credential: &str,
    ) -> Result<Process, DispatchError> {
        let dir = self.work_dir.join(job).join(format!("attempt-{token}"));
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(DispatchError::io(&dir))?;
        let mut spec = spec.clone();
        spec.device = self.device;
        let spec_path = dir.join("spec.json");
        let text = serde_json::to_vec_pretty(&spec)?;
        tokio::fs::write(&spec_path, text)
            .await
            .map_err(DispatchError::io(&spec_path))?;
        let open = |name: &str| {
            std::fs::File::create(dir.join(name)).map_err(DispatchError::io(dir.join(name)))
        };
        let mut command = tokio::process::Command::new(&self.exe);
        if let Some(limit) = self.memory_limit_bytes {
            command.env(MEMORY_LIMIT_ENV, limit.to_string());
        }
        if let Some(bytes) = self.accelerator_memory_bytes {
            command.env(launch::ENV_ACCELERATOR_MEMORY_BYTES, bytes.to_string());
        }
        let child = command
            .args(launch::trainer_args(&spec_path.to_string_lossy()))
            .env(
                launch::ENV_REPORT_URL,
                format!(
                    "{}/internal/attempts/{job}/report",
                    self.report_base_url.trim_end_matches('/')
                ),
            )
            .env(launch::ENV_REPORT_CREDENTIAL, credential)
            .env(launch::ENV_CACHE_DIR, &self.cache_dir)
            // The trainer asks to be stopped (SIGTERM: checkpoint, exit) when this
            // process dies, so a killed `tuneq up` leaves no trainer running.
            .env(PARENT_PID_ENV, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(open("stdout.jsonl")?)
            .stderr(open("stderr.log")?)
            .spawn()
            .map_err(DispatchError::io(&self.exe))?;
        Ok(Process { child, dir })
    }
}

/// The environment variable that tells a trainer which process started it.
pub const PARENT_PID_ENV: &str = launch::ENV_PARENT_PID;

/// What a finished child's status means, by the launch contract.
pub fn classify(status: std::process::ExitStatus, dir: &Path) -> End {
    use std::os::unix::process::ExitStatusExt;
    match TrainerExit::from_status(status.code(), status.signal()) {
        TrainerExit::Finished => End::Finished,
        TrainerExit::Interrupted => End::Interrupted(
            "the trainer was stopped from outside (SIGTERM) after a checkpoint".into(),
        ),
        TrainerExit::Superseded => End::Superseded,
        TrainerExit::BadInput => End::BadInput(stderr_tail(dir)),
        TrainerExit::Diverged => End::Diverged(stderr_tail(dir)),
        TrainerExit::Crashed {
            code: Some(code), ..
        } => End::Crashed(format!(
            "trainer exited with status {code}: {}",
            stderr_tail(dir)
        )),
        TrainerExit::Crashed { signal, .. } => End::Crashed(format!(
            "trainer was killed by signal {}",
            signal.map_or("?".into(), |s| s.to_string())
        )),
    }
}

/// The last lines of an attempt's stderr (its error message), at most 1 000 bytes. Only
/// the file's last 64 KiB are read: a trainer that wrote gigabytes of log costs nothing.
fn stderr_tail(dir: &Path) -> String {
    let text = read_tail(&dir.join("stderr.log"), 64 << 10).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("tuneq-report:"))
        .collect();
    let mut tail = lines[lines.len().saturating_sub(6)..].join(" | ");
    while tail.len() > 1000 {
        tail.remove(0);
    }
    if tail.is_empty() {
        "no error output".into()
    } else {
        tail
    }
}

/// The last `max` bytes of the file at `path`, as text (a character cut at the start is
/// replaced).
fn read_tail(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(max)))?;
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Sends `signal` (`TERM`, `KILL`) to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Whether process `pid` is a trainer of `job` (its command line names the job's
/// attempt folder), so a recycled pid is never killed by mistake.
pub fn is_trainer_of(pid: u32, job: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|cmdline| {
            let text = String::from_utf8_lossy(&cmdline);
            text.contains("train") && text.contains(&format!("/{job}/attempt-"))
        })
        .unwrap_or(false)
}
