//! The runtime interface: where an attempt runs and how the dispatcher starts, watches
//! and stops it. The control loop ([`crate::Dispatcher`]) decides; a runtime only does.
//!
//! Two runtimes implement it: [`crate::local::LocalRuntime`] (a `tuneq train` child
//! process; its attempts end with the dispatcher) and the Kubernetes runtime (a
//! `batch/v1` Job; its attempts outlive the dispatcher, which adopts them when it comes
//! back). Both read an attempt's end by the launch contract
//! ([`tuneq_openapi::launch`]) plus what their platform adds.

use crate::DispatchError;
use tuneq_openapi::TrainSpec;

/// What an attempt needs to start.
#[derive(Debug, Clone, Copy)]
pub struct Launch<'a> {
    /// The queue job.
    pub job: &'a str,
    /// The attempt's fencing token (its number: later attempts have larger ones).
    pub token: u64,
    /// The tenant the job belongs to.
    pub tenant: &'a str,
    /// What to train.
    pub spec: &'a TrainSpec,
    /// The attempt's report credential (never logged).
    pub credential: &'a str,
}

/// How an attempt stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Placed, its trainer not started yet (waiting for a node, an image, a volume).
    Pending,
    /// Its trainer runs (or the runtime cannot tell it from pending).
    Running,
    /// Over.
    Ended(End),
}

/// How an attempt ended, as the control loop acts on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Finished: the trainer's last report completed the job.
    Finished,
    /// Its machine was taken away, or it was stopped from outside after a checkpoint:
    /// requeue in place, no retry spent.
    Interrupted(String),
    /// Input that can never train: fail the job, no retry.
    BadInput(String),
    /// The run diverged (its loss became NaN or infinite): fail the job, no retry.
    Diverged(String),
    /// The trainer was told its attempt is no longer live: nothing to report.
    Superseded,
    /// A crash: retry from the last checkpoint within the job's budget.
    Crashed(String),
    /// No node was found within the pool's placement timeout: the job's next attempt
    /// goes to the next pool of its list; not a failure.
    NoCapacity(String),
    /// The platform could not run the attempt (an image that cannot be pulled, a
    /// missing Secret): fail the attempt with the reason, retried within the budget.
    Platform(String),
}

/// Where attempts run.
#[async_trait::async_trait]
pub trait Runtime: Send + Sync {
    /// Its name in logs (`local`, `kubernetes`).
    fn kind(&self) -> &'static str;

    /// Whether attempts keep running when the dispatcher stops: then a stopping
    /// dispatcher leaves them be, and a starting one adopts them.
    fn attempts_outlive_dispatcher(&self) -> bool;

    /// Starts an attempt. Starting the same attempt twice starts it once.
    async fn start(&mut self, launch: &Launch<'_>) -> Result<(), DispatchError>;

    /// How attempt `token` of `job` stands now.
    async fn poll(&mut self, job: &str, token: u64) -> Result<State, DispatchError>;

    /// Asks the attempt to checkpoint and stop (SIGTERM; a pod deleted with its grace).
    async fn stop(&mut self, job: &str, token: u64) -> Result<(), DispatchError>;

    /// Ends the attempt at once, writing nothing more.
    async fn kill(&mut self, job: &str, token: u64) -> Result<(), DispatchError>;

    /// Forgets an ended attempt (and removes what it left on the platform).
    async fn release(&mut self, job: &str, token: u64) -> Result<(), DispatchError>;

    /// Attempts an earlier run of this dispatcher left behind: `(job, token)`.
    async fn leftovers(&mut self) -> Result<Vec<(String, u64)>, DispatchError>;
}
