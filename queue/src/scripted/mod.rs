//! [`Queue`]: the queue, written once over a backend (Redis, a Redis Cluster, or the
//! embedded single-file store), and its [`JobQueue`] operations. Every transition is
//! one Lua script (`crate::scripts`) called through the domain's fenced-call
//! machinery (`crate::domain`); replies are read by `crate::reply`. Time comes
//! from the backend's `TIME` (plus a test offset), kept monotonic by a high-water mark.
//! Opening a queue is in `crate::connection`.

use crate::backend::{Backend, Origin};
use crate::domain::{Domain, Done};
use crate::job_queue::JobQueue;
use crate::model::*;
use crate::prose;
use crate::reply::{self, claimed, enqueued, int, job_record, status_error, text, unsigned};
use crate::scripts::Scripts;
use crate::standing::{self, DomainFigures, FiguresCache};
use crate::{QueueConfig, QueueError, Result};
use async_trait::async_trait;
use redis::Value;
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::Arc;
use tuneq_openapi::{FailureClass, StopCause};

mod inspect;

/// The queue of one scheduling domain, on Redis (one server or one slot of a Cluster)
/// or in the embedded file.
#[derive(Clone)]
pub struct Queue {
    /// The domain's keys on their backend, and how calls to them are made.
    pub(crate) domain: Domain,
    /// How the backend was reached, to open another connection like it.
    pub(crate) origin: Arc<Origin>,
    /// The domain's figures for position estimates, shared by this queue's clones.
    pub(crate) figures: Arc<FiguresCache>,
    pub(crate) scripts: Arc<Scripts>,
    pub(crate) config: QueueConfig,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backend = match &self.domain.backend {
            Backend::Redis(_) => "redis".to_string(),
            Backend::Cluster(_) => "redis cluster".to_string(),
            Backend::Embedded(store) => store.path().display().to_string(),
        };
        f.debug_struct("Queue")
            .field("backend", &backend)
            .field("prefix", &self.domain.prefix())
            .finish_non_exhaustive()
    }
}

/// Jobs per bulk-enqueue script call.
const BULK_BATCH: usize = 500;

/// The nine per-job script arguments of enqueue and enqueue_bulk.
fn job_args(job: &NewJob) -> [String; 9] {
    [
        job.idempotency_key.clone().unwrap_or_default(),
        job.tenant.clone(),
        job.priority.to_string(),
        job.pools.join(","),
        job.gpus.to_string(),
        job.estimated_seconds.to_string(),
        job.max_attempts.to_string(),
        job.payload.clone(),
        if job.notify { "1" } else { "0" }.to_string(),
    ]
}

/// Refuses a pool list that is empty or whose names the script's comma list would split.
fn check_pool_list(pools: &[String]) -> Result<()> {
    if pools.is_empty() || pools.iter().any(|p| p.is_empty() || p.contains(',')) {
        return Err(QueueError::Invalid {
            field: "pools",
            message: format!("pools must be names without commas, not {pools:?}"),
        });
    }
    Ok(())
}

/// Records a claimed lease's job (in `field`) and tenant on the current span.
/// The heartbeat script's reply: `{0, deadline, pause, recorded}`.
fn renewal(reply: &[Value]) -> Result<Renewal> {
    Ok(Renewal {
        deadline_ms: unsigned(reply.get(1))?,
        pause_requested: text(reply.get(2))? == "1",
        recorded: text(reply.get(3))? == "1",
    })
}

fn record_lease(lease: Result<Option<Lease>>, field: &str) -> Result<Option<Lease>> {
    if let Ok(Some(lease)) = &lease {
        let span = tracing::Span::current();
        span.record(field, lease.id.as_str());
        span.record("tenant", lease.tenant.as_str());
    }
    lease
}

/// Checks what the queue cannot check for itself.
fn validate(job: &NewJob) -> Result<()> {
    let invalid = |field, message: &str| {
        Err(QueueError::Invalid {
            field,
            message: message.to_string(),
        })
    };
    if job.tenant.is_empty() || job.tenant.contains([':', '{', '}']) {
        return invalid("tenant", "must be non-empty without ':', '{' or '}'");
    }
    if job.priority > 9 {
        return invalid("priority", "must be 0 to 9");
    }
    if job.gpus == 0 {
        return invalid("gpus", "must be at least 1");
    }
    if job.max_attempts == 0 {
        return invalid("max_attempts", "must be at least 1");
    }
    if job.pools.iter().any(|p| p.is_empty() || p.contains(',')) {
        return invalid("pools", "names must be non-empty without ','");
    }
    Ok(())
}

impl Queue {
    /// The key prefix of this domain (`tq:{domain}:`).
    pub fn prefix(&self) -> &str {
        self.domain.prefix()
    }

    /// Jobs waiting in line (ready to be claimed), all tenants together, from the figures
    /// position estimates use, at most `max_age` old: the queue depth operators watch.
    pub async fn waiting_jobs(&self, max_age: std::time::Duration) -> Result<u64> {
        Ok(self.figures(max_age).await?.waiting())
    }

    /// [`JobQueue::status`], with the domain's figures at most `max_age` old.
    async fn read_status(
        &self,
        id: &str,
        tenant: &str,
        max_age: std::time::Duration,
    ) -> Result<Option<(JobRecord, Option<Position>)>> {
        let mut tenant = tenant.to_string();
        // A second pass only when the caller named another tenant than the job's.
        for _ in 0..2 {
            let (fields, rank, weight): (HashMap<String, String>, Value, Value) = self
                .domain
                .pipeline(&standing::job_read(self.domain.prefix(), id, &tenant))
                .await?;
            if fields.is_empty() {
                return Ok(None);
            }
            let job = job_record(id, &fields, String::new())?;
            if job.tenant != tenant {
                tenant = job.tenant;
                continue;
            }
            let position = match (job.state, reply::rank(Some(&rank))?) {
                (JobState::Queued, Some(rank)) => {
                    let weight = reply::number(Some(&weight))?.unwrap_or(1.0);
                    let figures = self.figures(max_age).await?;
                    Some(figures.estimate(&job.tenant, weight, rank, &job.pools))
                }
                _ => None,
            };
            return Ok(Some((job, position)));
        }
        Err(QueueError::Protocol(format!("job {id} changed tenant")))
    }

    /// The domain's figures for position estimates, read afresh when the kept ones are
    /// older than `max_age`.
    async fn figures(&self, max_age: std::time::Duration) -> Result<Arc<DomainFigures>> {
        if let Some(figures) = self.figures.fresh(max_age) {
            return Ok(figures);
        }
        let reply: Vec<Value> = self
            .domain
            .pipeline(&standing::first_read(
                self.domain.prefix(),
                self.domain.meta(),
            ))
            .await?;
        let first = standing::FirstRead::parse(&reply)?;
        let reply: Vec<Value> = if first.needs_second_read() {
            self.domain
                .pipeline(&first.second_read(self.domain.prefix()))
                .await?
        } else {
            Vec::new()
        };
        let figures = Arc::new(first.finish(&reply)?);
        self.figures.keep(Arc::clone(&figures));
        Ok(figures)
    }

    /// Runs `preempt.lua` with `args` after the job and token (the reason, and for a
    /// move the new pools and why): back in line, in its place.
    /// Runs the outbox script's `op` (`hand`, `ack`, `retry` with its delay) on one
    /// delivery; its integer reply.
    async fn outbox_on(&self, delivery: &Delivery, op: &str, delay_ms: Option<u64>) -> Result<i64> {
        let mut args = vec![op.to_string(), delivery.member(), delivery.tenant.clone()];
        args.extend(delay_ms.map(|ms| ms.to_string()));
        self.domain
            .call_as::<i64>(&self.scripts.outbox, &args)
            .await
    }

    /// Runs a tenant's command on a job (cancel, pause, resume: repeatable, so the
    /// queue retries it after a lost reply) and reads the state it left the job in.
    async fn state_call(
        &self,
        script: &crate::scripts::LuaScript,
        id: &str,
        op: &'static str,
    ) -> Result<JobState> {
        let reply = self.domain.call(script, &[id.to_string()]).await?;
        match int(reply.first())? {
            0 | 1 => reply::state(reply.get(1)),
            _ => Err(status_error(id, &reply, op)),
        }
    }

    async fn preempt_with(&self, id: &str, token: u64, args: &[String]) -> Result<()> {
        let script = &self.scripts.preempt;
        let outcome = self
            .domain
            .token_call(script, id, token, args, "preempt")
            .await;
        // Back in line, or set aside when a pause was pending.
        let back_in_line = Done {
            states: &[JobState::Queued, JobState::Paused],
            or_deleted: false,
        };
        self.domain
            .settle_transition(outcome, id, token, back_in_line)
            .await
    }

    /// The arguments a claim script takes after its own: lease length and scan settings.
    fn claim_settings(&self) -> [String; 4] {
        let c = &self.config;
        [
            c.lease_ms.to_string(),
            c.scan_tenants.to_string(),
            c.scan_depth.to_string(),
            c.quantum_seconds.to_string(),
        ]
    }

    /// Claims the next job of `pool` for `owner`; `started` marks the attempt started in
    /// the same step (callers that start nothing outside the queue). A non-empty
    /// `request_id` makes a repeat return the same lease instead of a second.
    async fn claim_with(
        &self,
        pool: &str,
        owner: &str,
        request_id: &str,
        started: bool,
    ) -> Result<Option<Lease>> {
        let [lease_ms, scan_tenants, scan_depth, quantum] = self.claim_settings();
        let args = [
            pool.to_string(),
            owner.to_string(),
            lease_ms,
            request_id.to_string(),
            scan_tenants,
            scan_depth,
            quantum,
            if started { "1" } else { "0" }.to_string(),
        ];
        let repeatable = !request_id.is_empty();
        let reply: Vec<Value> = self
            .domain
            .run_script(&self.scripts.claim, &args, repeatable)
            .await
            .0?;
        record_lease(claimed(&reply, pool, "", "claim"), "job_id")
    }

    /// Every key of this domain, sorted (tests check what operations leave behind). On a
    /// Cluster it asks the node owning the domain's slot.
    pub async fn keys(&self) -> Result<Vec<String>> {
        let mut cmd = redis::cmd("KEYS");
        cmd.arg(self.domain.key("*"));
        let mut keys: Vec<String> = self.domain.scan_query("keys", &cmd).await?;
        keys.sort();
        Ok(keys)
    }

    /// Deletes every key of this domain (tests and benchmarks; never in production).
    pub async fn destroy(&self) -> Result<()> {
        let keys = self.keys().await?;
        for chunk in keys.chunks(500) {
            let mut cmd = redis::cmd("DEL");
            cmd.arg(chunk);
            self.domain.query::<()>(&cmd).await?;
        }
        Ok(())
    }

    /// The Redis connection (the benchmark reads server statistics); None when embedded
    /// or on a Cluster (whose statistics are per node).
    pub fn redis_connection(&self) -> Option<ConnectionManager> {
        match &self.domain.backend {
            Backend::Redis(link) => Some(link.get().1),
            Backend::Cluster(_) | Backend::Embedded(_) => None,
        }
    }
}

#[async_trait]
impl JobQueue for Queue {
    #[tracing::instrument(name = "queue.enqueue", skip_all, fields(tenant = %job.tenant, priority = job.priority, job_id = tracing::field::Empty), err(level = "debug"))]
    async fn enqueue(&self, job: &NewJob) -> Result<Enqueued> {
        validate(job)?;
        let mut args = vec![self.config.idempotency_ttl_ms.to_string()];
        args.extend(job_args(job));
        // Only a job with an idempotency key can be sent again without risking a twin.
        let repeatable = job.idempotency_key.is_some();
        let (reply, _) = self
            .domain
            .run_script::<Vec<Value>>(&self.scripts.enqueue, &args, repeatable)
            .await;
        let reply = reply?;
        let enqueued = enqueued(job, reply.first(), reply.get(1))?;
        tracing::Span::current().record("job_id", enqueued.id.as_str());
        Ok(enqueued)
    }

    #[tracing::instrument(name = "queue.enqueue_bulk", skip_all, fields(jobs = jobs.len()), err(level = "debug"))]
    async fn enqueue_bulk(&self, jobs: &[NewJob]) -> Result<Vec<Result<Enqueued>>> {
        let mut out = Vec::with_capacity(jobs.len());
        // Bounded batches: a script blocks Redis while it runs.
        for batch in jobs.chunks(BULK_BATCH) {
            let mut args = vec![self.config.idempotency_ttl_ms.to_string()];
            let mut valid = Vec::new();
            let mut refused = HashMap::new();
            for (i, job) in batch.iter().enumerate() {
                match validate(job) {
                    Ok(()) => {
                        args.extend(job_args(job));
                        valid.push(i);
                    }
                    Err(e) => {
                        refused.insert(i, e);
                    }
                }
            }
            let repeatable = valid.iter().all(|&i| batch[i].idempotency_key.is_some());
            let reply = if valid.is_empty() {
                Vec::new()
            } else {
                self.domain
                    .run_script(&self.scripts.enqueue_bulk, &args, repeatable)
                    .await
                    .0?
            };
            let mut answers = reply.chunks(2);
            for (i, job) in batch.iter().enumerate() {
                match refused.remove(&i) {
                    Some(e) => out.push(Err(e)),
                    None => {
                        let pair = answers.next().unwrap_or(&[]);
                        out.push(enqueued(job, pair.first(), pair.get(1)));
                    }
                }
            }
        }
        Ok(out)
    }

    #[tracing::instrument(name = "queue.claim", skip_all, fields(pool = %pool, owner = %owner, job_id = tracing::field::Empty, tenant = tracing::field::Empty), err(level = "debug"))]
    async fn claim(&self, pool: &str, owner: &str, request_id: &str) -> Result<Option<Lease>> {
        self.claim_with(pool, owner, request_id, false).await
    }

    #[tracing::instrument(name = "queue.claim", skip_all, fields(pool = %pool, owner = %owner, job_id = tracing::field::Empty, tenant = tracing::field::Empty), err(level = "debug"))]
    async fn claim_started(
        &self,
        pool: &str,
        owner: &str,
        request_id: &str,
    ) -> Result<Option<Lease>> {
        self.claim_with(pool, owner, request_id, true).await
    }

    #[tracing::instrument(name = "queue.complete_and_claim", skip_all, fields(job_id = %id, pool = %pool, next_job_id = tracing::field::Empty, tenant = tracing::field::Empty), err(level = "debug"))]
    async fn complete_and_claim(
        &self,
        id: &str,
        token: u64,
        result: &str,
        pool: &str,
        owner: &str,
    ) -> Result<Option<Lease>> {
        let mut args = vec![
            id.to_string(),
            token.to_string(),
            result.to_string(),
            pool.to_string(),
            owner.to_string(),
        ];
        args.extend(self.claim_settings());
        // Not repeated after a lost reply: a repeat would find the job already done and
        // claim nothing, orphaning the first try's lease until it expires.
        let reply: Vec<Value> = self
            .domain
            .run_script(&self.scripts.complete_and_claim, &args, false)
            .await
            .0?;
        record_lease(
            claimed(&reply, pool, id, "complete_and_claim"),
            "next_job_id",
        )
    }

    #[tracing::instrument(name = "queue.start", skip_all, fields(job_id = %id), err(level = "debug"))]
    async fn start(&self, id: &str, token: u64) -> Result<()> {
        let lease = self.config.lease_ms.to_string();
        self.domain
            .token_call(&self.scripts.start, id, token, &[lease], "start")
            .await
            .0
            .map(|_| ())
    }

    async fn heartbeat(&self, id: &str, token: u64, progress: Option<&str>) -> Result<Renewal> {
        let args = [
            self.config.lease_ms.to_string(),
            progress.unwrap_or_default().to_string(),
            String::new(),
        ];
        let reply = self
            .domain
            .token_call(&self.scripts.heartbeat, id, token, &args, "heartbeat")
            .await
            .0?;
        renewal(&reply)
    }

    async fn report(
        &self,
        id: &str,
        token: u64,
        report_seq: u64,
        progress: Option<&str>,
        events: &[NewEvent<'_>],
    ) -> Result<Renewal> {
        let mut args = vec![
            self.config.lease_ms.to_string(),
            progress.unwrap_or_default().to_string(),
            report_seq.to_string(),
        ];
        for event in events {
            args.push(event.kind.code().to_string());
            args.push(prose::said(event.message));
            args.push(match event.data {
                Some(data @ serde_json::Value::Object(_)) => data.to_string(),
                Some(other) => {
                    return Err(QueueError::Invalid {
                        field: "data",
                        message: format!("an event's data must be a JSON object, not {other}"),
                    });
                }
                None => String::new(),
            });
        }
        let reply = self
            .domain
            .token_call(&self.scripts.heartbeat, id, token, &args, "report")
            .await
            .0?;
        renewal(&reply)
    }

    #[tracing::instrument(name = "queue.complete", skip_all, fields(job_id = %id), err(level = "debug"))]
    async fn complete(&self, id: &str, token: u64, result: &str) -> Result<()> {
        let script = &self.scripts.complete;
        let args = [result.to_string()];
        let outcome = self
            .domain
            .token_call(script, id, token, &args, "complete")
            .await;
        let succeeded = Done {
            states: &[JobState::Succeeded],
            or_deleted: true,
        };
        self.domain
            .settle_transition(outcome, id, token, succeeded)
            .await
    }

    #[tracing::instrument(name = "queue.fail", skip_all, fields(job_id = %id, retryable, class = %class), err(level = "debug"))]
    async fn fail(
        &self,
        id: &str,
        token: u64,
        class: FailureClass,
        reason: &str,
        retryable: bool,
    ) -> Result<Option<u64>> {
        let c = &self.config;
        let jitter: f64 = rand::random::<f64>() * 0.25;
        let args = vec![
            id.to_string(),
            token.to_string(),
            prose::said(reason),
            if retryable { "1" } else { "0" }.to_string(),
            c.retry_base_ms.to_string(),
            c.retry_max_ms.to_string(),
            format!("{jitter:.4}"),
            class.code().to_string(),
        ];
        let (reply, retried) = self
            .domain
            .run_script::<Vec<Value>>(&self.scripts.fail, &args, true)
            .await;
        let reply = reply?;
        match int(reply.first())? {
            0 => Ok(Some(unsigned(reply.get(1))?)),
            // 1: failed for good; 2: paused (a pause was pending).
            1 | 2 => Ok(None),
            _ => {
                let e = status_error(id, &reply, "fail");
                let done = Done {
                    states: &[JobState::Delayed, JobState::Failed, JobState::Paused],
                    or_deleted: true,
                };
                if self
                    .domain
                    .own_earlier_try(&e, id, Some(token), done, retried)
                    .await
                {
                    let record = self.get(id).await?;
                    return Ok(record.and_then(|r| r.due_ms));
                }
                Err(e)
            }
        }
    }

    #[tracing::instrument(name = "queue.preempt", skip_all, fields(job_id = %id, stop = stop.code()), err(level = "debug"))]
    async fn preempt(&self, id: &str, token: u64, stop: StopCause, reason: &str) -> Result<()> {
        self.preempt_with(id, token, &[stop.code().to_string(), prose::said(reason)])
            .await
    }

    #[tracing::instrument(name = "queue.preempt", skip_all, fields(job_id = %id, pools = ?pools), err(level = "debug"))]
    async fn preempt_and_move(
        &self,
        id: &str,
        token: u64,
        stop: StopCause,
        reason: &str,
        pools: &[String],
        why: &str,
    ) -> Result<()> {
        check_pool_list(pools)?;
        self.preempt_with(
            id,
            token,
            &[
                stop.code().to_string(),
                prose::said(reason),
                pools.join(","),
                prose::said(why),
            ],
        )
        .await
    }

    #[tracing::instrument(name = "queue.unplaced", skip_all, fields(job_id = %id, pools = ?pools), err(level = "debug"))]
    async fn unplaced(
        &self,
        id: &str,
        token: u64,
        reason: &str,
        pools: Option<&[String]>,
        why: &str,
    ) -> Result<()> {
        if let Some(pools) = pools {
            check_pool_list(pools)?;
        }
        let pools = pools.map(|p| p.join(",")).unwrap_or_default();
        // No stop cause: the attempt never got a node, which is no preemption.
        self.preempt_with(
            id,
            token,
            &[String::new(), prose::said(reason), pools, prose::said(why)],
        )
        .await
    }

    #[tracing::instrument(name = "queue.cancel", skip_all, fields(job_id = %id), err(level = "debug"))]
    async fn cancel(&self, id: &str) -> Result<JobState> {
        self.state_call(&self.scripts.cancel, id, "cancel").await
    }

    #[tracing::instrument(name = "queue.pause", skip_all, fields(job_id = %id), err(level = "debug"))]
    async fn pause(&self, id: &str) -> Result<JobState> {
        self.state_call(&self.scripts.pause, id, "pause").await
    }

    #[tracing::instrument(name = "queue.resume", skip_all, fields(job_id = %id), err(level = "debug"))]
    async fn resume(&self, id: &str) -> Result<JobState> {
        self.state_call(&self.scripts.resume, id, "resume").await
    }

    #[tracing::instrument(name = "queue.confirm_cancelled", skip_all, fields(job_id = %id), err(level = "debug"))]
    async fn confirm_cancelled(&self, id: &str) -> Result<()> {
        let (reply, retried) = self
            .domain
            .run_script::<Vec<Value>>(&self.scripts.confirm_cancelled, &[id.to_string()], true)
            .await;
        let reply = reply?;
        match int(reply.first())? {
            0 => Ok(()),
            _ => {
                let e = status_error(id, &reply, "confirm_cancelled");
                let done = Done {
                    states: &[JobState::Cancelled],
                    or_deleted: true,
                };
                if self
                    .domain
                    .own_earlier_try(&e, id, None, done, retried)
                    .await
                {
                    return Ok(());
                }
                Err(e)
            }
        }
    }

    #[tracing::instrument(name = "queue.expire_leases", skip_all, fields(batch, expired = tracing::field::Empty), err(level = "debug"))]
    async fn expire_leases(&self, batch: u32) -> Result<Vec<JobId>> {
        let reply = self
            .domain
            .call(&self.scripts.expire_leases, &[batch.to_string()])
            .await?;
        tracing::Span::current().record("expired", reply.len());
        reply.iter().map(|v| text(Some(v))).collect()
    }

    async fn suspects(&self, limit: u32) -> Result<Vec<JobId>> {
        if limit == 0 {
            return Ok(vec![]);
        }
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(self.domain.key("suspect"))
            .arg(0)
            .arg(i64::from(limit) - 1);
        self.domain.query(&cmd).await
    }

    #[tracing::instrument(name = "queue.resolve_suspect", skip_all, fields(job_id = %id, verdict = ?verdict), err(level = "debug"))]
    async fn resolve_suspect(
        &self,
        id: &str,
        epoch: u64,
        verdict: SuspectVerdict,
    ) -> Result<JobState> {
        let verdict = match verdict {
            SuspectVerdict::Adopt => "adopt",
            SuspectVerdict::Requeue => "requeue",
        };
        let stalls = self.config.max_stalls;
        let args = [
            verdict.to_string(),
            self.config.lease_ms.to_string(),
            stalls.to_string(),
            prose::said(&format!(
                "its attempt vanished without a word {stalls} times (no report, no exit)"
            )),
        ];
        let reply = self
            .domain
            .token_call(
                &self.scripts.resolve_suspect,
                id,
                epoch,
                &args,
                "resolve_suspect",
            )
            .await
            .0?;
        reply::state(reply.get(1))
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>> {
        self.domain.job(id).await
    }

    async fn status(
        &self,
        id: &str,
        tenant: &str,
    ) -> Result<Option<(JobRecord, Option<Position>)>> {
        self.read_status(id, tenant, standing::FIGURES_MAX_AGE)
            .await
    }

    async fn events(
        &self,
        id: &str,
        after: Option<u64>,
        limit: usize,
        newest_first: bool,
    ) -> Result<Vec<JobEvent>> {
        let mut cmd = redis::cmd("LRANGE");
        cmd.arg(self.domain.key(&format!("events:{id}")))
            .arg(0)
            .arg(-1);
        let raw: Vec<String> = self.domain.query(&cmd).await?;
        let mut events = raw
            .iter()
            .map(|line| {
                serde_json::from_str::<JobEvent>(line).map_err(|e| {
                    QueueError::Protocol(format!("job {id}: a stored event does not read: {e}"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if newest_first {
            events.reverse();
            events.retain(|e| after.is_none_or(|a| e.seq < a));
        } else {
            events.retain(|e| after.is_none_or(|a| e.seq > a));
        }
        events.truncate(limit);
        Ok(events)
    }

    async fn position(&self, id: &str) -> Result<Position> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(self.domain.key(&format!("job:{id}"))).arg("tenant");
        let tenant: Option<String> = self.domain.query(&cmd).await?;
        let tenant = tenant.ok_or_else(|| QueueError::NotFound(id.to_string()))?;
        match self
            .read_status(id, &tenant, std::time::Duration::ZERO)
            .await?
        {
            None => Err(QueueError::NotFound(id.to_string())),
            Some((_, Some(position))) => Ok(position),
            Some((job, None)) => Err(QueueError::WrongState {
                id: id.to_string(),
                state: Some(job.state),
                operation: "position",
            }),
        }
    }

    async fn set_pool(&self, pool: &str, capacity: u32) -> Result<()> {
        if pool.is_empty() || pool.contains(',') {
            return Err(QueueError::Invalid {
                field: "pool",
                message: "names are non-empty without ','".into(),
            });
        }
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("HSET")
            .arg(self.domain.key(&format!("pool:{pool}")))
            .arg("capacity")
            .arg(capacity)
            .cmd("SADD")
            .arg(self.domain.key("pools"))
            .arg(pool);
        self.domain.pipeline::<()>(&pipe).await?;
        // This process's next estimate sees the new capacity at once.
        self.figures.forget();
        Ok(())
    }

    async fn pool_usage(&self, pool: &str) -> Result<PoolUsage> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.domain.key(&format!("pool:{pool}")))
            .arg("capacity")
            .arg("used");
        let (capacity, used): (Option<u32>, Option<i64>) = self.domain.query(&cmd).await?;
        let capacity = capacity.ok_or_else(|| QueueError::UnknownPool(pool.to_string()))?;
        Ok(PoolUsage {
            capacity,
            used: u32::try_from(used.unwrap_or(0)).map_err(|_| {
                QueueError::Protocol(format!("pool {pool} has negative usage {used:?}"))
            })?,
        })
    }

    async fn set_tenant(&self, tenant: &str, settings: &TenantSettings) -> Result<()> {
        if !(settings.weight.is_finite() && settings.weight > 0.0) {
            return Err(QueueError::Invalid {
                field: "weight",
                message: "must be a positive number".into(),
            });
        }
        let key = self.domain.key(&format!("tenant:{tenant}"));
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("HSET")
            .arg(&key)
            .arg("weight")
            .arg(settings.weight);
        for (field, value) in [
            ("max_running", settings.max_running),
            ("max_waiting", settings.max_waiting),
        ] {
            match value {
                Some(v) => pipe.cmd("HSET").arg(&key).arg(field).arg(v),
                None => pipe.cmd("HDEL").arg(&key).arg(field),
            };
        }
        self.domain.pipeline::<()>(&pipe).await?;
        self.figures.forget();
        Ok(())
    }

    async fn inspect(&self) -> Result<Inspection> {
        self.inspect_keys().await
    }

    async fn due_deliveries(&self, limit: u32) -> Result<Vec<Delivery>> {
        let reply = self
            .domain
            .call(&self.scripts.outbox, &["due".into(), limit.to_string()])
            .await?;
        deliveries(&reply)
    }

    async fn hand_over_delivery(&self, delivery: &Delivery) -> Result<bool> {
        Ok(self.outbox_on(delivery, "hand", None).await? == 1)
    }

    async fn due_sends(&self, tenants: u32, per_tenant: u32) -> Result<Vec<Delivery>> {
        let args = [
            "sends".to_string(),
            tenants.max(1).to_string(),
            per_tenant.max(1).to_string(),
        ];
        let reply = self.domain.call(&self.scripts.outbox, &args).await?;
        deliveries(&reply)
    }

    async fn ack_delivery(&self, delivery: &Delivery) -> Result<()> {
        self.outbox_on(delivery, "ack", None).await?;
        Ok(())
    }

    async fn retry_delivery(&self, delivery: &Delivery, delay_ms: u64) -> Result<()> {
        self.outbox_on(delivery, "retry", Some(delay_ms)).await?;
        Ok(())
    }

    #[tracing::instrument(name = "queue.retention", skip_all, fields(batch, removed = tracing::field::Empty), err(level = "debug"))]
    async fn trim(&self, batch: u32) -> Result<u64> {
        let removed: i64 = self
            .domain
            .call_as(&self.scripts.trim, &[batch.to_string()])
            .await?;
        tracing::Span::current().record("removed", removed);
        Ok(u64::try_from(removed).unwrap_or(0))
    }
}

/// Outbox members with their due times (`member, score, member, score, …`) as deliveries.
fn deliveries(reply: &[Value]) -> Result<Vec<Delivery>> {
    reply
        .chunks(2)
        .map(|pair| {
            let member = text(pair.first())?;
            let mut parts = member.splitn(3, '|');
            let (Some(job_id), Some(state), Some(tenant)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return Err(QueueError::Protocol(format!("outbox entry {member:?}")));
            };
            let state = JobState::parse(state)
                .ok_or_else(|| QueueError::Protocol(format!("outbox entry {member:?}")))?;
            Ok(Delivery {
                job_id: job_id.to_string(),
                state,
                tenant: tenant.to_string(),
                due_ms: unsigned(pair.get(1))?,
            })
        })
        .collect()
}
