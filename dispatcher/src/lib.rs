//! The dispatcher: the control loop between the queue and a runtime.
//!
//! One dispatcher loop serves one node pool through one [`runtime::Runtime`]; a
//! `tuneq dispatcher` process runs one loop per pool. Each tick it
//! 1. reaps attempts that ended and reports how (completed by the trainer's own report,
//!    failed — retried with back-off or not, preempted when its machine was taken or it
//!    was stopped for a shutdown, moved on when no node was found, confirmed cancelled);
//! 2. heartbeats live attempts; a refused heartbeat means the attempt was cancelled
//!    (stop it, then confirm) or superseded (kill it at once: another attempt owns the
//!    job's output now);
//! 3. marks expired leases suspect and settles suspects of its pool: an attempt it is
//!    still running is adopted, anything else is requeued;
//! 4. claims jobs while it has free slots and starts their attempts.
//!
//! After a restart (or a crash) it asks the runtime what an earlier run left. Attempts
//! that end with their dispatcher (the local runtime) are killed and preempted, so their
//! jobs go back to their place in line at once and resume from their last checkpoint,
//! instead of waiting for their leases to run out. Attempts that outlive it (Kubernetes
//! Jobs) are adopted when the queue still backs them, and removed when it does not.
//!
//! Layout: `control` is the loop ([`Dispatcher`]) and where a stopped job goes next;
//! [`runtime`] is the interface; [`local`] runs attempts as `tuneq train` child
//! processes, with [`journal`] keeping them on disk; [`kubernetes`] builds an attempt's
//! Job and Secret and reads its Job and pods back as the attempt's end (the pure parts of
//! the Kubernetes runtime; its client comes next); [`start_failure`] says what a job is
//! told when its attempt could not be started (never the platform's own words).

mod control;
pub mod journal;
pub mod kubernetes;
pub mod local;
pub mod metrics;
pub mod runtime;
pub mod start_failure;

pub use control::Dispatcher;
use std::time::Duration;
use tuneq_queue::QueueError;

/// Errors of the dispatcher.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// The queue failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The Kubernetes runtime was given a pool without a `[pool.kubernetes]` table.
    #[error("runtime: pool {pool} has no [pool.kubernetes] table")]
    NotAKubernetesPool {
        /// The pool.
        pool: String,
    },
    /// A Job of another attempt holds this attempt's name; it is not adopted.
    #[error("runtime: a Job {name} of another attempt exists; it is not adopted")]
    NameTaken {
        /// The Job's name.
        name: String,
    },
    /// The platform did not answer `what` was asked (the runtime tries again later).
    #[error("runtime: the platform did not answer: {what}")]
    PlatformUnavailable {
        /// What was asked.
        what: &'static str,
    },
    /// The Kubernetes API failed a request (`what` says which).
    #[error("kubernetes: {what}: {source}")]
    Kubernetes {
        /// What was asked.
        what: &'static str,
        /// The API's error.
        #[source]
        source: kube::Error,
    },
    /// A file or process of an attempt (`path` says which).
    #[error("runtime: {path}: {source}")]
    Io {
        /// The file, folder or program.
        path: std::path::PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The pool's Job could not be built (a setting Kubernetes would refuse).
    #[error("runtime: {0}")]
    Build(#[from] kubernetes::BuildError),
    /// The attempt's spec could not be encoded.
    #[error("runtime: cannot encode the attempt's spec: {0}")]
    Encode(#[from] serde_json::Error),
    /// The journal could not be read or written.
    #[error("journal: {path}: {source}")]
    Journal {
        /// The journal file.
        path: std::path::PathBuf,
        /// Why: the file could not be read or written, or held no journal.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl DispatchError {
    /// An I/O error on `path`.
    pub(crate) fn io(path: impl Into<std::path::PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}

/// Settings of one dispatcher.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    /// The node pool it serves (created with `slots` capacity).
    pub pool: String,
    /// Attempts it runs at once.
    pub slots: u32,
    /// Its name as a lease owner (unique among dispatchers).
    pub owner: String,
    /// How often it looks at the queue and its attempts.
    pub tick: Duration,
    /// How often a live attempt's lease is renewed.
    pub heartbeat: Duration,
    /// How long a stopping attempt gets to checkpoint before it is killed.
    pub stop_grace: Duration,
    /// When a job preempted on this pool moves on to the rest of its pools.
    pub placement: tuneq_pools::file::PlacementSettings,
    /// Where it counts what it does (shared by the loops of one process).
    pub metrics: metrics::Metrics,
}

impl DispatcherConfig {
    /// Defaults for `pool`: one slot, a tick of half a second, heartbeats every 5 s.
    pub fn new(pool: &str, owner: &str) -> Self {
        Self {
            pool: pool.to_string(),
            slots: 1,
            owner: owner.to_string(),
            tick: Duration::from_millis(500),
            heartbeat: Duration::from_secs(5),
            stop_grace: Duration::from_secs(60),
            placement: Default::default(),
            metrics: Default::default(),
        }
    }
}
