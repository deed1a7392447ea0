//! [`JobQueue`]: the queue's operations, the contract every backend meets (one
//! conformance suite, `queue/tests/conformance.rs`, checks it on each), and the rules
//! on unknown outcomes that say which calls are safe to repeat.

use crate::Result;
use crate::model::*;
use async_trait::async_trait;
use tuneq_openapi::{FailureClass, StopCause};

/// The queue's operations; every backend passes the same conformance suite.
///
/// **Unknown outcomes.** When a reply is lost (connection dropped, timeout, server
/// restarting) the call may or may not have happened. Calls that are safe to repeat are
/// retried inside the queue ([`crate::QueueConfig::unknown_outcome_retries`]): reads; enqueue
/// with an idempotency key; claim with a request id; every fenced call (a repeat of
/// complete, fail, preempt or confirm_cancelled that finds its own earlier try already
/// done counts as success; start and heartbeat are repeatable as they are); cancel and
/// the settings. Only enqueue without an idempotency key and claim without a request id
/// hand [`crate::QueueError::Unavailable`] to the caller, who cannot know whether they happened.
#[async_trait]
pub trait JobQueue: Send + Sync {
    /// Accepts a job; with an idempotency key seen before (same tenant), returns that job.
    async fn enqueue(&self, job: &NewJob) -> Result<Enqueued>;
    /// Accepts many jobs in few round trips; each is accepted or refused on its own.
    async fn enqueue_bulk(&self, jobs: &[NewJob]) -> Result<Vec<Result<Enqueued>>>;
    /// Claims the best job that fits `pool` for `owner`. `request_id` makes a repeated
    /// claim (after a lost reply) return the same lease instead of a second one.
    async fn claim(&self, pool: &str, owner: &str, request_id: &str) -> Result<Option<Lease>>;
    /// The attempt was started: leased → running.
    async fn start(&self, id: &str, token: u64) -> Result<()>;
    /// [`Self::claim`] and [`Self::start`] in one step: the attempt is running as soon
    /// as it is leased, for workers that start a job the moment they hold it.
    async fn claim_started(
        &self,
        pool: &str,
        owner: &str,
        request_id: &str,
    ) -> Result<Option<Lease>>;
    /// [`Self::complete`] and then [`Self::claim_started`] for the same worker, in one
    /// step, so a busy worker makes one call per job (BullMQ's worker fetches its next
    /// job in moveToFinished the same way). With a stale token, a wrong state or an
    /// unknown pool nothing changes, as with `complete` and `claim`. It takes no claim
    /// request id: if the reply is lost, the next job's lease runs out and the job
    /// becomes suspect, like any attempt whose worker vanished.
    async fn complete_and_claim(
        &self,
        id: &str,
        token: u64,
        result: &str,
        pool: &str,
        owner: &str,
    ) -> Result<Option<Lease>>;
    /// Renews the lease and records progress (JSON); the renewal says whether the
    /// tenant asked for a pause, which the attempt's dispatcher carries out.
    async fn heartbeat(&self, id: &str, token: u64, progress: Option<&str>) -> Result<Renewal>;
    /// [`Self::heartbeat`] that also appends `events` to the job's log (a trainer's
    /// report; the renewal tells it of a pause, which it carries out itself).
    /// Reports are numbered per attempt (`report_seq`, growing): a repeated report renews
    /// the lease but records nothing twice, so a lost reply is retried safely.
    async fn report(
        &self,
        id: &str,
        token: u64,
        report_seq: u64,
        progress: Option<&str>,
        events: &[NewEvent<'_>],
    ) -> Result<Renewal>;
    /// The attempt succeeded.
    async fn complete(&self, id: &str, token: u64, result: &str) -> Result<()>;
    /// The attempt failed as `class` (kept as [`JobRecord::failure`] beside `reason`,
    /// which is for people only); returns when it will be retried, or None if the job
    /// failed for good or, with a pause pending, was paused (resuming retries it).
    async fn fail(
        &self,
        id: &str,
        token: u64,
        class: FailureClass,
        reason: &str,
        retryable: bool,
    ) -> Result<Option<u64>>;
    /// The attempt stopped before its end (`stop` says who stopped it): requeue in
    /// place, attempts unchanged; with a pause pending, the job is paused instead.
    async fn preempt(&self, id: &str, token: u64, stop: StopCause, reason: &str) -> Result<()>;
    /// The attempt never got a node on its pool (no capacity within the placement
    /// timeout): requeue in place, no retry spent and no preemption counted (an
    /// `unplaced` event says `reason`); with `pools`, the job may from now on run only
    /// there and a `moved` event says `why`.
    async fn unplaced(
        &self,
        id: &str,
        token: u64,
        reason: &str,
        pools: Option<&[String]>,
        why: &str,
    ) -> Result<()>;
    /// Preempts, and from now on lets the job run only on `pools` (placement moved it
    /// on after repeated preemptions); a `moved` event says `why`.
    async fn preempt_and_move(
        &self,
        id: &str,
        token: u64,
        stop: StopCause,
        reason: &str,
        pools: &[String],
        why: &str,
    ) -> Result<()>;
    /// Cancels: at once when waiting, else asks the live attempt to stop.
    async fn cancel(&self, id: &str) -> Result<JobState>;
    /// The cancelled attempt is gone; its capacity is released.
    async fn confirm_cancelled(&self, id: &str) -> Result<()>;
    /// Pauses: a waiting job at once ([`JobState::Paused`]); a live attempt gets a
    /// pause request, carried out by its dispatcher (stopped after a checkpoint, then
    /// [`Self::preempt`] pauses the job). Returns the state the job is in. Repeatable;
    /// a finished job or one being cancelled is [`crate::QueueError::WrongState`].
    async fn pause(&self, id: &str) -> Result<JobState>;
    /// Puts a paused job back in its place in line; a job neither paused nor pausing is
    /// left as it is. Returns the state the job is in. A pause still being carried out,
    /// a finished job or one being cancelled is [`crate::QueueError::WrongState`].
    async fn resume(&self, id: &str) -> Result<JobState>;
    /// Marks jobs whose lease ran out as suspect; returns the ones it marked.
    async fn expire_leases(&self, batch: u32) -> Result<Vec<JobId>>;
    /// Jobs waiting for a verdict (suspect), longest waiting first: what a dispatcher
    /// settles, including any whose [`Self::expire_leases`] reply was lost.
    async fn suspects(&self, limit: u32) -> Result<Vec<JobId>>;
    /// Settles a suspect job.
    async fn resolve_suspect(
        &self,
        id: &str,
        epoch: u64,
        verdict: SuspectVerdict,
    ) -> Result<JobState>;
    /// The job, or None.
    async fn get(&self, id: &str) -> Result<Option<JobRecord>>;
    /// The job without its payload and, while it is queued, where it stands: what an API
    /// answering "how is my job doing" needs, in one round trip of plain reads when
    /// `tenant` is the job's own. The estimate's domain-wide figures (other tenants'
    /// waiting jobs, pools' run times) may be up to a second old; [`Self::position`]
    /// reads them afresh.
    async fn status(&self, id: &str, tenant: &str)
    -> Result<Option<(JobRecord, Option<Position>)>>;
    /// Events after `after` (a `seq`), oldest first, or newest first with `newest_first`.
    async fn events(
        &self,
        id: &str,
        after: Option<u64>,
        limit: usize,
        newest_first: bool,
    ) -> Result<Vec<JobEvent>>;
    /// Where a queued job stands.
    async fn position(&self, id: &str) -> Result<Position>;
    /// Creates or resizes a node pool.
    async fn set_pool(&self, pool: &str, capacity: u32) -> Result<()>;
    /// A pool's capacity and usage.
    async fn pool_usage(&self, pool: &str) -> Result<PoolUsage>;
    /// Sets a tenant's weight and quotas.
    async fn set_tenant(&self, tenant: &str, settings: &TenantSettings) -> Result<()>;
    /// Deletes up to `batch` finished jobs past retention; returns how many.
    async fn trim(&self, batch: u32) -> Result<u64>;
    /// Reads the whole domain (tests check the invariants on it; operators debug with it).
    async fn inspect(&self) -> Result<Inspection>;
    /// Up to `limit` outbox deliveries whose time has come, oldest first: finished jobs
    /// whose outcome is not filed yet (they stay until acknowledged or handed over).
    async fn due_deliveries(&self, limit: u32) -> Result<Vec<Delivery>>;
    /// The delivery's outcome is filed and its webhook is still to be sent: moves it
    /// from the outbox to its tenant's send queue, due now. False if it was not in the
    /// outbox (already handed over or acknowledged).
    async fn hand_over_delivery(&self, delivery: &Delivery) -> Result<bool>;
    /// Webhooks whose time has come: of at most `tenants` tenants (those waiting
    /// longest first), at most `per_tenant` each, oldest first. They stay in the send
    /// queue until acknowledged or retried, so a sender that stops loses none.
    async fn due_sends(&self, tenants: u32, per_tenant: u32) -> Result<Vec<Delivery>>;
    /// A delivery was made, or is not needed (from the outbox or the send queue).
    async fn ack_delivery(&self, delivery: &Delivery) -> Result<()>;
    /// A delivery failed; try again after `delay_ms` (in the outbox or the send queue,
    /// wherever it waits).
    async fn retry_delivery(&self, delivery: &Delivery, delay_ms: u64) -> Result<()>;
}
