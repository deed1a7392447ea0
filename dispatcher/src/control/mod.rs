//! The control loop for one pool ([`Dispatcher`]): each tick it reaps ended attempts
//! and reports how they ended, heartbeats live ones, settles suspects and claims jobs
//! for free slots. How a job is put back in line after a stop lives in [`placement`].

mod placement;

use crate::runtime::{End, Launch, Runtime, State};
use crate::start_failure::StartFailure;
use crate::{DispatchError, DispatcherConfig};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tuneq_openapi::{FailureClass, JobPayload, StopCause, StoredJson};
use tuneq_queue::{AttemptSigner, JobQueue, JobState, Queue, QueueError, SuspectVerdict};

/// How an end is counted in the metrics.
fn end_label(end: &End) -> &'static str {
    match end {
        End::Finished => "finished",
        End::Interrupted(_) => "preempted",
        End::BadInput(_) => "bad_input",
        End::Diverged(_) => "diverged",
        End::Superseded => "superseded",
        End::Crashed(_) => "crashed",
        End::NoCapacity(_) => "no_capacity",
        End::Platform(_) => "platform_error",
    }
}

/// What a job's events say when this service's own shutdown stops its attempt.
const SHUTDOWN: &str = "the service is shutting down";
/// What they say for attempts a restarted dispatcher finds left over.
const RESTARTED: &str = "the dispatcher restarted";
/// What they say when an attempt stopped for its tenant's pause.
const PAUSED: &str = "paused by its tenant after a checkpoint";

/// Why an attempt is being stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopping {
    /// The job was cancelled: confirm once the process is gone.
    Cancel,
    /// Another attempt owns the job: nothing to report.
    Superseded,
    /// The dispatcher is shutting down: preempt, so the job resumes elsewhere.
    Shutdown,
    /// The tenant paused the job: the attempt checkpoints and stops (its lease still
    /// renewed meanwhile), then the queue pauses the job.
    Pause,
}

/// One attempt this dispatcher runs.
struct Attempt {
    token: u64,
    /// When its lease was last renewed; `None`: due at the next tick (an attempt just
    /// started or adopted, whose lease may have been lost meanwhile).
    last_heartbeat: Option<Instant>,
    stopping: Option<(Stopping, Instant)>,
    /// The stop went out as a kill already.
    killed: bool,
}

impl Attempt {
    /// Whether it still holds the job: its lease is renewed and, if it went suspect, it
    /// is adopted (running, or pausing: writing its checkpoint).
    fn keeps_lease(&self) -> bool {
        matches!(self.stopping, None | Some((Stopping::Pause, _)))
    }
}

/// The control loop for one pool.
pub struct Dispatcher {
    queue: Queue,
    config: DispatcherConfig,
    runtime: Box<dyn Runtime>,
    signer: AttemptSigner,
    attempts: HashMap<String, Attempt>,
}

impl Dispatcher {
    /// A dispatcher for `config.pool` running attempts on `runtime`.
    /// A dispatcher for `config.pool` running attempts on `runtime`.
    pub fn new(
        queue: Queue,
        config: DispatcherConfig,
        runtime: Box<dyn Runtime>,
        signer: AttemptSigner,
    ) -> Self {
        Self {
            queue,
            config,
            runtime,
            signer,
            attempts: HashMap::new(),
        }
    }

    /// Runs until `shutdown` turns true, then stops every attempt (each checkpoints and
    /// its job is preempted, keeping its place in line).
    pub async fn run(
        mut self,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), DispatchError> {
        self.config.metrics.serving(&self.config.pool);
        // The queue or the platform may not answer yet (a cluster coming up, a Redis
        // failing over): wait for them rather than exit, and start no attempt before
        // what an earlier run left is settled. `/readyz` says not ready meanwhile.
        let mut pause = Duration::from_millis(500);
        loop {
            let started = async {
                self.queue
                    .set_pool(&self.config.pool, self.config.slots)
                    .await?;
                self.recover().await
            }
            .await;
            match started {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(pool = %self.config.pool, error = &e as &dyn std::error::Error, retry_in = ?pause,
                        "cannot start the pool's loop yet; retrying");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = shutdown.changed() => {}
            }
            if *shutdown.borrow() {
                return Ok(());
            }
            pause = (pause * 2).min(Duration::from_secs(30));
        }
        tracing::info!(pool = %self.config.pool, slots = self.config.slots, "dispatcher running");
        while !*shutdown.borrow() {
            match self.tick().await {
                Ok(()) => self.config.metrics.ticked(&self.config.pool),
                Err(e) => tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "dispatcher tick failed; retrying"
                ),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.config.tick) => {}
                _ = shutdown.changed() => {}
            }
        }
        self.stop_all().await;
        Ok(())
    }

    /// Settles what an earlier run left: adopts attempts that outlive the dispatcher
    /// and are still the queue's live ones; kills the others and puts their jobs back
    /// in line.
    async fn recover(&mut self) -> Result<(), DispatchError> {
        for (job, token) in self.runtime.leftovers().await? {
            let record = self.queue.get(&job).await?;
            let live = record.as_ref().is_some_and(|r| {
                r.epoch == token
                    && matches!(
                        r.state,
                        JobState::Leased | JobState::Running | JobState::Suspect
                    )
            });
            if live && self.runtime.attempts_outlive_dispatcher() {
                tracing::info!(job = %job, token, "adopting an attempt an earlier run started");
                self.attempts.insert(
                    job,
                    Attempt {
                        token,
                        last_heartbeat: None,
                        stopping: None,
                        killed: false,
                    },
                );
                continue;
            }
            tracing::warn!(job = %job, token, "stopping an attempt left by an earlier run");
            self.runtime.kill(&job, token).await?;
            let outcome = if live {
                self.queue
                    .preempt(&job, token, StopCause::Restart, RESTARTED)
                    .await
            } else {
                Err(QueueError::StaleToken(job.clone()))
            };
            match outcome {
                Ok(()) => {
                    tracing::info!(job = %job, "attempt of an earlier run preempted; the job resumes")
                }
                // Cancelled meanwhile: its attempt is gone now, so the cancel is done.
                Err(QueueError::StaleToken(_) | QueueError::WrongState { .. }) => {
                    if self.is_cancelling(&job).await? {
                        self.queue.confirm_cancelled(&job).await?;
                    }
                }
                Err(QueueError::NotFound(_)) => {}
                Err(e) => return Err(e.into()),
            }
            self.runtime.release(&job, token).await?;
        }
        Ok(())
    }

    /// Whether `job` waits for its attempt to be confirmed gone after a cancel. A cancel
    /// revokes the attempt's token, so a refused token alone does not tell a cancel
    /// from a newer attempt; the job's state does.
    async fn is_cancelling(&self, job: &str) -> Result<bool, QueueError> {
        Ok(self
            .queue
            .get(job)
            .await?
            .is_some_and(|r| r.state == JobState::CancelRequested))
    }

    /// One pass of the loop.
    async fn tick(&mut self) -> Result<(), DispatchError> {
        self.config
            .metrics
            .running(&self.config.pool, self.attempts.len());
        self.reap().await?;
        self.heartbeat().await?;
        self.settle_suspects().await?;
        self.claim().await
    }

    /// Reports attempts that have ended; kills stopping ones past their grace.
    async fn reap(&mut self) -> Result<(), DispatchError> {
        let mut ended = Vec::new();
        let mut pending = 0;
        let live: Vec<(String, u64)> = self
            .attempts
            .iter()
            .map(|(job, a)| (job.clone(), a.token))
            .collect();
        for (job, token) in live {
            match self.runtime.poll(&job, token).await {
                Ok(State::Ended(end)) => ended.push((job, end)),
                Ok(state @ (State::Running | State::Pending)) => {
                    pending += usize::from(state == State::Pending);
                    let Some(attempt) = self.attempts.get_mut(&job) else {
                        continue;
                    };
                    if let Some((_, since)) = attempt.stopping
                        && !attempt.killed
                        && since.elapsed() > self.config.stop_grace
                    {
                        attempt.killed = true;
                        self.runtime.kill(&job, token).await?;
                    }
                }
                Err(e) => {
                    tracing::warn!(job = %job, error = &e as &dyn std::error::Error, "cannot watch an attempt")
                }
            }
        }
        self.config.metrics.pending(&self.config.pool, pending);
        for (job, end) in ended {
            let Some(attempt) = self.attempts.remove(&job) else {
                continue;
            };
            self.config
                .metrics
                .ended(&self.config.pool, end_label(&end));
            self.report_end(&job, &attempt, end).await;
            if let Err(e) = self.runtime.release(&job, attempt.token).await {
                tracing::warn!(job = %job, error = &e as &dyn std::error::Error, "cannot clean up an ended attempt");
            }
        }
        Ok(())
    }

    async fn report_end(&self, job: &str, attempt: &Attempt, end: End) {
        let token = attempt.token;
        let stopping = match (attempt.stopping.map(|(why, _)| why), &end) {
            // A pausing attempt that ended any other way (finished, bad input, diverged)
            // ends as it would have without the pause.
            (Some(Stopping::Pause), End::Interrupted(_) | End::Crashed(_)) => Some(Stopping::Pause),
            (Some(Stopping::Pause), _) => None,
            (why, _) => why,
        };
        let outcome = match (stopping, &end) {
            (Some(Stopping::Cancel), _) => self.queue.confirm_cancelled(job).await,
            // A cancel reaches the trainer as "superseded" (see is_cancelling).
            (Some(Stopping::Superseded), _) | (_, End::Superseded) => {
                match self.is_cancelling(job).await {
                    Ok(true) => self.queue.confirm_cancelled(job).await,
                    Ok(false) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            (Some(Stopping::Shutdown), _) => {
                self.queue
                    .preempt(job, token, StopCause::Shutdown, SHUTDOWN)
                    .await
            }
            // The queue pauses a job whose pause is pending instead of requeueing it.
            (Some(Stopping::Pause), _) => {
                self.queue
                    .preempt(job, token, StopCause::Pause, PAUSED)
                    .await
            }
            (None, End::Finished) => match self.queue.get(job).await {
                // The trainer's final report completed the job.
                Ok(Some(record)) if record.state.is_terminal() || record.epoch != token => Ok(()),
                Ok(_) => self
                    .queue
                    .fail(
                        job,
                        token,
                        FailureClass::TrainingFailed,
                        "the trainer ended without delivering its result",
                        true,
                    )
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            },
            // Stopped from outside (a machine shutting down) after its checkpoint: the
            // job keeps its place and resumes, no retry spent.
            (None, End::Interrupted(why)) => match self.queue.get(job).await {
                // The trainer heard of the pause first (its report's answer) and
                // stopped after a checkpoint, before this loop's heartbeat did.
                Ok(Some(record)) if record.pause_requested && record.epoch == token => {
                    self.queue
                        .preempt(job, token, StopCause::Pause, PAUSED)
                        .await
                }
                _ => self.machine_taken(job, token, why).await,
            },
            (None, End::NoCapacity(why)) => self.no_capacity(job, token, why).await,
            (None, End::Platform(why)) => {
                let reason = format!("platform error: {why}");
                self.failed(job, token, FailureClass::TrainingFailed, &reason)
                    .await
            }
            (None, End::BadInput(why)) => {
                let reason = format!("invalid input: {why}");
                self.failed(job, token, FailureClass::InvalidTrainingInput, &reason)
                    .await
            }
            (None, End::Diverged(why)) => {
                self.failed(job, token, FailureClass::TrainingDiverged, why)
                    .await
            }
            (None, End::Crashed(why)) => {
                self.failed(job, token, FailureClass::TrainingFailed, why)
                    .await
            }
        };
        match outcome {
            Ok(()) => tracing::info!(job, token, ?end, ?stopping, "attempt ended"),
            Err(QueueError::StaleToken(_) | QueueError::WrongState { .. }) => {
                tracing::info!(job, token, ?end, "attempt ended after the job moved on")
            }
            Err(e) => tracing::warn!(
                job,
                token,
                error = &e as &dyn std::error::Error,
                "cannot report an attempt's end"
            ),
        }
    }

    /// Fails the attempt as `class`: retried within the job's budget when the class is
    /// worth retrying, the job failed for good otherwise.
    async fn failed(
        &self,
        job: &str,
        token: u64,
        class: FailureClass,
        reason: &str,
    ) -> Result<(), QueueError> {
        self.queue
            .fail(job, token, class, reason, class.is_retryable())
            .await
            .map(|_| ())
    }

    /// Renews live attempts' leases; stops the ones the queue no longer backs.
    async fn heartbeat(&mut self) -> Result<(), DispatchError> {
        let due: Vec<(String, u64)> = self
            .attempts
            .iter()
            .filter(|(_, a)| {
                a.keeps_lease()
                    && a.last_heartbeat
                        .is_none_or(|at| at.elapsed() >= self.config.heartbeat)
            })
            .map(|(job, a)| (job.clone(), a.token))
            .collect();
        for (job, token) in due {
            let stop = match self.queue.heartbeat(&job, token, None).await {
                Ok(renewal) if renewal.pause_requested => Some(Stopping::Pause),
                Ok(_) => None,
                Err(QueueError::WrongState {
                    state: Some(JobState::CancelRequested),
                    ..
                }) => Some(Stopping::Cancel),
                Err(QueueError::WrongState { .. }) => None,
                Err(QueueError::StaleToken(_)) if self.is_cancelling(&job).await? => {
                    Some(Stopping::Cancel)
                }
                Err(QueueError::StaleToken(_)) => Some(Stopping::Superseded),
                Err(QueueError::NotFound(_)) => Some(Stopping::Superseded),
                Err(e) => return Err(e.into()),
            };
            let Some(attempt) = self.attempts.get_mut(&job) else {
                continue;
            };
            attempt.last_heartbeat = Some(Instant::now());
            if stop == Some(Stopping::Pause) {
                if attempt.stopping.is_none() {
                    tracing::info!(job, token, "pausing: the attempt checkpoints and stops");
                    attempt.stopping = Some((Stopping::Pause, Instant::now()));
                    self.runtime.stop(&job, token).await?;
                }
            } else if let Some(why) = stop {
                tracing::info!(job, token, ?why, "stopping an attempt");
                // Neither a cancelled nor a superseded attempt may write anything more.
                attempt.stopping = Some((why, Instant::now()));
                attempt.killed = true;
                self.runtime.kill(&job, token).await?;
            }
        }
        Ok(())
    }

    /// Marks expired leases suspect and settles this pool's suspects.
    async fn settle_suspects(&mut self) -> Result<(), DispatchError> {
        self.queue.expire_leases(100).await?;
        for job in self.queue.suspects(100).await? {
            let Some(record) = self.queue.get(&job).await? else {
                continue;
            };
            if record.state != JobState::Suspect
                || record.pool.as_deref() != Some(self.config.pool.as_str())
            {
                continue;
            }
            let alive = self
                .attempts
                .get(&job)
                .is_some_and(|a| a.token == record.epoch && a.keeps_lease());
            let verdict = if alive {
                SuspectVerdict::Adopt
            } else {
                SuspectVerdict::Requeue
            };
            match self
                .queue
                .resolve_suspect(&job, record.epoch, verdict)
                .await
            {
                Ok(state) => tracing::info!(job, ?verdict, ?state, "suspect attempt settled"),
                Err(QueueError::StaleToken(_) | QueueError::WrongState { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Claims and starts jobs while slots are free.
    async fn claim(&mut self) -> Result<(), DispatchError> {
        while self.attempts.len() < self.config.slots as usize {
            let request = format!("{}-{:016x}", self.config.owner, rand::random::<u64>());
            let Some(lease) = self
                .queue
                .claim(&self.config.pool, &self.config.owner, &request)
                .await?
            else {
                return Ok(());
            };
            let span = tracing::info_span!("attempt", job = %lease.id, token = lease.token);
            let _enter = span.enter();
            let payload = match JobPayload::decode(&lease.id, &lease.payload) {
                Ok(p) => p,
                Err(e) => {
                    tracing::error!(
                        error = &e as &dyn std::error::Error,
                        "job payload is not a fine-tune"
                    );
                    self.queue
                        .fail(
                            &lease.id,
                            lease.token,
                            FailureClass::InvalidTrainingInput,
                            &format!("unreadable job: {e}"),
                            false,
                        )
                        .await?;
                    continue;
                }
            };
            let claimed = Instant::now();
            // The queue confirms the lease before anything starts: an attempt whose
            // lease was lost (cancelled, expired) never runs, not even for a moment.
            if let Err(e) = self.queue.start(&lease.id, lease.token).await {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "the lease was lost before the attempt started; not starting it"
                );
                if self.is_cancelling(&lease.id).await? {
                    self.queue.confirm_cancelled(&lease.id).await?;
                }
                continue;
            }
            let credential = self.signer.sign(&lease.id, lease.token);
            let launch = Launch {
                job: &lease.id,
                token: lease.token,
                tenant: &lease.tenant,
                spec: &payload.spec,
                credential: &credential,
            };
            match self.runtime.start(&launch).await {
                Ok(()) => {
                    tracing::info!(finetune = %payload.finetune, runtime = self.runtime.kind(), "attempt started");
                    self.config
                        .metrics
                        .started(&self.config.pool, claimed.elapsed());
                    // Its lease is checked at the next tick, so one lost while the
                    // runtime was starting it (a slow platform) stops it at once.
                    self.attempts.insert(
                        lease.id.clone(),
                        Attempt {
                            token: lease.token,
                            last_heartbeat: None,
                            stopping: None,
                            killed: false,
                        },
                    );
                }
                Err(e) => {
                    // The runtime's own words (the API server's, for a Job it refused)
                    // stay in this log; the job gets a class and a plain reason.
                    let failure = StartFailure::of(&e, &self.config.pool);
                    tracing::error!(
                        error = &e as &dyn std::error::Error,
                        class = ?failure.class,
                        retryable = failure.retryable,
                        "cannot start the attempt"
                    );
                    self.queue
                        .fail(
                            &lease.id,
                            lease.token,
                            failure.class,
                            &failure.reason,
                            failure.retryable,
                        )
                        .await?;
                }
            }
        }
        Ok(())
    }

    /// Asks every attempt to checkpoint and stop, waits for them, and preempts their
    /// jobs. Attempts that outlive the dispatcher are left running: the next start
    /// adopts them.
    async fn stop_all(&mut self) {
        if self.runtime.attempts_outlive_dispatcher() {
            tracing::info!(
                attempts = self.attempts.len(),
                "leaving attempts running; the next start adopts them"
            );
            return;
        }
        let live: Vec<(String, u64)> = self
            .attempts
            .iter_mut()
            .filter(|(_, a)| a.stopping.is_none())
            .map(|(job, a)| {
                a.stopping = Some((Stopping::Shutdown, Instant::now()));
                (job.clone(), a.token)
            })
            .collect();
        for (job, token) in live {
            tracing::info!(job = %job, "stopping the attempt for shutdown (it checkpoints first)");
            if let Err(e) = self.runtime.stop(&job, token).await {
                tracing::warn!(job = %job, error = &e as &dyn std::error::Error, "cannot stop an attempt");
            }
        }
        while !self.attempts.is_empty() {
            if let Err(e) = self.reap().await {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "cannot report stopped attempts"
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
