//! Where a job goes after its attempt stopped: back in its place in line, and — after
//! repeated preemptions on this pool, or no node within its placement timeout — on to
//! the rest of its pools. Placement reads the job's typed events (who stopped each
//! attempt, on which pool), never their messages.

use super::Dispatcher;
use tuneq_openapi::{EventKind, StopCause};
use tuneq_queue::{JobQueue, QueueError};

impl Dispatcher {
    /// Requeues a job whose machine was taken away, in its place and with no retry spent;
    /// after `preemptions_before_fallback` such preemptions on this pool within the
    /// window, the job may from now on run only on the rest of its pools, and its events
    /// say why.
    pub(super) async fn machine_taken(
        &self,
        job: &str,
        token: u64,
        reason: &str,
    ) -> Result<(), QueueError> {
        let pool = &self.config.pool;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut setbacks = self.setbacks(job).await?;
        setbacks.push(tuneq_pools::Setback::Preempted {
            pool: pool.clone(),
            at_ms: now_ms,
        });
        let placement = &self.config.placement;
        self.requeue(job, token, reason, &setbacks, now_ms, false, |usable| {
            format!(
                "preempted {} times on {pool} within {}; its next attempts run on {}",
                placement.preemptions_before_fallback,
                humantime::format_duration(placement.preemption_window),
                usable.join(", ")
            )
        })
        .await
    }

    /// Puts back in line a job whose attempt found no node on this pool within the
    /// placement timeout; when the job may run elsewhere, its next attempts go to the
    /// rest of its pools.
    pub(super) async fn no_capacity(
        &self,
        job: &str,
        token: u64,
        why: &str,
    ) -> Result<(), QueueError> {
        let pool = &self.config.pool;
        let setbacks = [tuneq_pools::Setback::NoCapacity { pool: pool.clone() }];
        let reason = format!("no node on {pool}: {why}");
        self.requeue(job, token, &reason, &setbacks, 0, true, |usable| {
            format!(
                "no node on {pool} within its placement timeout; its next attempts run on {}",
                usable.join(", ")
            )
        })
        .await
    }

    /// Puts `job` back in line: preempted, or `unplaced` (its attempt never got a node,
    /// which is no preemption); when `setbacks` take pools away from its list, it may
    /// from now on run only on the rest, and a `moved` event says `moved(rest)`.
    #[allow(clippy::too_many_arguments)]
    async fn requeue(
        &self,
        job: &str,
        token: u64,
        reason: &str,
        setbacks: &[tuneq_pools::Setback],
        now_ms: u64,
        unplaced: bool,
        moved: impl FnOnce(&[String]) -> String,
    ) -> Result<(), QueueError> {
        let Some(record) = self.queue.get(job).await? else {
            return Err(QueueError::NotFound(job.to_string()));
        };
        let usable = tuneq_pools::usable(&record.pools, setbacks, &self.config.placement, now_ms);
        let stays = record.pools.is_empty() || usable == record.pools;
        let why = if stays { String::new() } else { moved(&usable) };
        if !stays {
            tracing::warn!(job, %why, "moving a job on");
        }
        match (unplaced, stays) {
            (false, true) => {
                self.queue
                    .preempt(job, token, StopCause::Preemption, reason)
                    .await
            }
            (false, false) => {
                self.queue
                    .preempt_and_move(job, token, StopCause::Preemption, reason, &usable, &why)
                    .await
            }
            (true, true) => self.queue.unplaced(job, token, reason, None, "").await,
            (true, false) => {
                self.queue
                    .unplaced(job, token, reason, Some(&usable), &why)
                    .await
            }
        }
    }

    /// The preemptions of `job` its queue events record, each on the pool that had
    /// leased the attempt; stops the dispatchers made themselves do not count.
    async fn setbacks(&self, job: &str) -> Result<Vec<tuneq_pools::Setback>, QueueError> {
        let events = self.queue.events(job, None, 1000, false).await?;
        Ok(preemptions_by_pool(&events))
    }
}

/// The preemptions a job's events record, each on the pool that had leased the attempt.
/// Only the platform's own stops count ([`StopCause::is_the_platforms`]): a shutdown
/// or a restart of this service says nothing about a pool's capacity.
fn preemptions_by_pool(events: &[tuneq_queue::JobEvent]) -> Vec<tuneq_pools::Setback> {
    let mut pool = String::new();
    let mut setbacks = Vec::new();
    for event in events {
        match event.kind {
            EventKind::Leased => pool = event.pool.clone().unwrap_or_default(),
            EventKind::Preempted if event.stop.is_none_or(StopCause::is_the_platforms) => {
                setbacks.push(tuneq_pools::Setback::Preempted {
                    pool: pool.clone(),
                    at_ms: event.at_ms,
                });
            }
            EventKind::Queued
            | EventKind::Started
            | EventKind::Preempted
            | EventKind::Unplaced
            | EventKind::Moved
            | EventKind::LeaseExpired
            | EventKind::LeaseRecovered
            | EventKind::Adopted
            | EventKind::Requeued
            | EventKind::RetryScheduled
            | EventKind::Failed
            | EventKind::CancelRequested
            | EventKind::Cancelled
            | EventKind::PauseRequested
            | EventKind::Paused
            | EventKind::Unpaused
            | EventKind::Succeeded
            | EventKind::TrainingStarted
            | EventKind::Resumed
            | EventKind::Metrics
            | EventKind::EarlyStopped
            | EventKind::Eval
            | EventKind::Checkpoint
            | EventKind::Warning => {}
        }
    }
    setbacks
}
