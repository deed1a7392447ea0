//! The queue, written once over a [`Backend`]: Redis or the embedded single-file store.
//! Every transition is one Lua script (`queue/lua/*.lua`), a function of one Redis
//! Functions library with `prelude.lua` on top: on Redis called with FCALL (the library
//! is loaded again where it is missing), embedded run by the same Lua.
//! All keys of a scheduling domain share the hash tag `{domain}`, so the scripts run on
//! Redis Cluster. Time comes from the backend's `TIME` (plus a test offset), kept
//! monotonic by a high-water mark.
//!
//! A lost connection or a timeout is an *unknown outcome* ([`QueueError::Unavailable`]):
//! the call may or may not have happened. Enqueue with an idempotency key and claim
//! with a request id are safe to retry as they are; token-carrying calls are fenced.

use crate::backend::{Backend, Library, LuaScript, RedisLink, unavailable};
use crate::embedded::Store;
use crate::model::*;
use crate::standing::{self, DomainFigures, FiguresCache};
use crate::{QueueConfig, QueueError, Result, validate};
use async_trait::async_trait;
use redis::Value;
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// Every script: its name and its body.
const SOURCES: [(&str, &str); 16] = [
    ("enqueue", include_str!("../lua/enqueue.lua")),
    ("enqueue_bulk", include_str!("../lua/enqueue_bulk.lua")),
    ("claim", include_str!("../lua/claim.lua")),
    ("start", include_str!("../lua/start.lua")),
    ("heartbeat", include_str!("../lua/heartbeat.lua")),
    ("complete", include_str!("../lua/complete.lua")),
    (
        "complete_and_claim",
        include_str!("../lua/complete_and_claim.lua"),
    ),
    ("fail", include_str!("../lua/fail.lua")),
    ("preempt", include_str!("../lua/preempt.lua")),
    ("cancel", include_str!("../lua/cancel.lua")),
    (
        "confirm_cancelled",
        include_str!("../lua/confirm_cancelled.lua"),
    ),
    ("expire_leases", include_str!("../lua/expire_leases.lua")),
    (
        "resolve_suspect",
        include_str!("../lua/resolve_suspect.lua"),
    ),
    ("trim", include_str!("../lua/trim.lua")),
    ("outbox", include_str!("../lua/outbox.lua")),
    ("catalog", include_str!("../lua/catalog.lua")),
];

/// The scripts, each a function of one library (built once per process).
struct Scripts {
    library: Arc<Library>,
    enqueue: LuaScript,
    enqueue_bulk: LuaScript,
    claim: LuaScript,
    start: LuaScript,
    heartbeat: LuaScript,
    complete: LuaScript,
    complete_and_claim: LuaScript,
    fail: LuaScript,
    preempt: LuaScript,
    cancel: LuaScript,
    confirm_cancelled: LuaScript,
    expire_leases: LuaScript,
    resolve_suspect: LuaScript,
    trim: LuaScript,
    outbox: LuaScript,
    catalog: LuaScript,
}

impl Scripts {
    fn get() -> Arc<Self> {
        static SCRIPTS: OnceLock<Arc<Scripts>> = OnceLock::new();
        Arc::clone(SCRIPTS.get_or_init(|| {
            let library = Arc::new(Library::new(PRELUDE, &SOURCES));
            let script = |name| LuaScript::new(name, &library);
            Arc::new(Self {
                enqueue: script("enqueue"),
                enqueue_bulk: script("enqueue_bulk"),
                claim: script("claim"),
                start: script("start"),
                heartbeat: script("heartbeat"),
                complete: script("complete"),
                complete_and_claim: script("complete_and_claim"),
                fail: script("fail"),
                preempt: script("preempt"),
                cancel: script("cancel"),
                confirm_cancelled: script("confirm_cancelled"),
                expire_leases: script("expire_leases"),
                resolve_suspect: script("resolve_suspect"),
                trim: script("trim"),
                outbox: script("outbox"),
                catalog: script("catalog"),
                library,
            })
        }))
    }
}

/// The queue of one scheduling domain, on Redis (one server or one slot of a Cluster)
/// or in the embedded file.
#[derive(Clone)]
pub struct Queue {
    backend: Backend,
    /// How `backend` was reached, to open another connection like it.
    origin: Arc<Origin>,
    /// The domain's figures for position estimates, shared by this queue's clones.
    figures: Arc<FiguresCache>,
    prefix: String,
    meta: String,
    scripts: Arc<Scripts>,
    config: QueueConfig,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backend = match &self.backend {
            Backend::Redis(_) => "redis".to_string(),
            Backend::Cluster(_) => "redis cluster".to_string(),
            Backend::Embedded(store) => store.path().display().to_string(),
        };
        f.debug_struct("Queue")
            .field("backend", &backend)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

pub(crate) fn int(v: Option<&Value>) -> Result<i64> {
    match v {
        Some(Value::Int(i)) => Ok(*i),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(|f| f as i64)
            .ok_or_else(|| QueueError::Protocol(format!("not a number: {b:?}"))),
        other => Err(QueueError::Protocol(format!(
            "expected a number, got {other:?}"
        ))),
    }
}

pub(crate) fn text(v: Option<&Value>) -> Result<String> {
    match v {
        Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        Some(Value::SimpleString(s)) => Ok(s.clone()),
        Some(Value::Int(i)) => Ok(i.to_string()),
        other => Err(QueueError::Protocol(format!(
            "expected a string, got {other:?}"
        ))),
    }
}

pub(crate) fn unsigned(v: Option<&Value>) -> Result<u64> {
    Ok(u64::try_from(int(v)?.max(0)).unwrap_or_default())
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

/// Reads one job's enqueue status and id.
fn enqueued(job: &NewJob, status: Option<&Value>, id: Option<&Value>) -> Result<Enqueued> {
    match int(status)? {
        0 => Ok(Enqueued {
            id: text(id)?,
            duplicate: false,
        }),
        1 => Ok(Enqueued {
            id: text(id)?,
            duplicate: true,
        }),
        -7 => Err(QueueError::OverQuota(job.tenant.clone())),
        s => Err(QueueError::Protocol(format!("enqueue: status {s}"))),
    }
}

/// Reads a claim script's reply (claim.lua, complete_and_claim.lua): a lease, `None`
/// when nothing fits `pool`, or the error its status stands for.
fn claimed(
    reply: &[Value],
    pool: &str,
    id: &str,
    operation: &'static str,
) -> Result<Option<Lease>> {
    match int(reply.first())? {
        0 => Ok(Some(Lease {
            id: text(reply.get(1))?,
            token: unsigned(reply.get(2))?,
            tenant: text(reply.get(3))?,
            payload: text(reply.get(4))?,
            attempts: u32::try_from(unsigned(reply.get(5))?).unwrap_or(u32::MAX),
            preemptions: u32::try_from(unsigned(reply.get(6))?).unwrap_or(u32::MAX),
            deadline_ms: unsigned(reply.get(7))?,
        })),
        1 => Ok(None),
        -9 => Err(QueueError::UnknownPool(pool.to_string())),
        _ => Err(Queue::status_error(id, reply, operation)),
    }
}

/// Where a transition leaves its job, so a repeat after a lost reply can recognise
/// that its own earlier try already made it.
#[derive(Debug, Clone, Copy)]
struct Done {
    /// The states the transition ends in.
    states: &'static [JobState],
    /// Whether retention may have deleted the job at once (a finishing transition).
    or_deleted: bool,
}

/// Where a queue's backend is, and how to connect to it again.
enum Origin {
    Redis {
        url: String,
        response_timeout_ms: u64,
    },
    Cluster {
        urls: Vec<String>,
        response_timeout_ms: u64,
    },
    Embedded,
}

impl Origin {
    async fn connect(&self) -> Result<Backend> {
        match self {
            Origin::Redis {
                url,
                response_timeout_ms,
            } => {
                let client =
                    redis::Client::open(url.as_str()).map_err(|e| QueueError::Invalid {
                        field: "redis_url",
                        message: e.to_string(),
                    })?;
                let manager_config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(std::time::Duration::from_secs(5)))
                    .set_response_timeout(Some(std::time::Duration::from_millis(
                        *response_timeout_ms,
                    )));
                let link = RedisLink::connect(client, manager_config).await?;
                Ok(Backend::Redis(Arc::new(link)))
            }
            Origin::Cluster {
                urls,
                response_timeout_ms,
            } => {
                let client =
                    redis::cluster::ClusterClient::builder(urls.iter().map(String::as_str))
                        .connection_timeout(std::time::Duration::from_secs(5))
                        .response_timeout(std::time::Duration::from_millis(*response_timeout_ms))
                        .build()
                        .map_err(|e| QueueError::Invalid {
                            field: "redis_url",
                            message: e.to_string(),
                        })?;
                let conn = client.get_async_connection().await.map_err(unavailable)?;
                Ok(Backend::Cluster(conn))
            }
            Origin::Embedded => Err(QueueError::Invalid {
                field: "backend",
                message: "the embedded store has no connections to open".into(),
            }),
        }
    }
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

/// Refuses domain names that would break the key layout or the hash tag.
fn check_domain(domain: &str) -> Result<()> {
    if domain.is_empty() || domain.contains(['{', '}', ':', '*', '?', '[', ']', '\\']) {
        return Err(QueueError::Invalid {
            field: "domain",
            message: "must be non-empty without '{', '}', ':' or glob characters".into(),
        });
    }
    Ok(())
}

impl Queue {
    /// Connects to `url` (`redis://host:port/db`) for scheduling domain `domain` and
    /// stores `config`'s server-side settings (aging, retention) in the domain.
    pub async fn connect(url: &str, domain: &str, config: QueueConfig) -> Result<Self> {
        check_domain(domain)?;
        let origin = Origin::Redis {
            url: url.to_string(),
            response_timeout_ms: config.response_timeout_ms,
        };
        let backend = origin.connect().await?;
        Self::with_backend(backend, Arc::new(origin), domain, config).await
    }

    /// Connects to a Redis Cluster through any of its nodes `urls` (`redis://host:port`;
    /// the client discovers the rest) for scheduling domain `domain`, and stores `config`'s
    /// server-side settings in the domain. All of a domain's keys carry the hash tag
    /// `{domain}`, so the whole domain lives in one slot: its scripts run atomically on
    /// the node owning that slot, and domains spread over the nodes by their names.
    ///
    /// The cluster client itself re-sends a call after a redirect (MOVED, ASK), TRYAGAIN,
    /// a lost connection or a timeout, so a call may run twice even before this queue's
    /// own retries ([`JobQueue`]'s rules on unknown outcomes). Fenced calls recognise
    /// their own earlier run; only an enqueue without an idempotency key could be
    /// accepted twice, so on a Cluster always send one.
    pub async fn connect_cluster(
        urls: &[impl AsRef<str>],
        domain: &str,
        config: QueueConfig,
    ) -> Result<Self> {
        check_domain(domain)?;
        let origin = Origin::Cluster {
            urls: urls.iter().map(|u| u.as_ref().to_string()).collect(),
            response_timeout_ms: config.response_timeout_ms,
        };
        let backend = origin.connect().await?;
        Self::with_backend(backend, Arc::new(origin), domain, config).await
    }

    /// Opens (or creates) the embedded queue file at `path` for scheduling domain
    /// `domain`: no server, every acknowledged change synced to the file, and a restart
    /// replays it. Only one process may have the file open.
    pub async fn open_embedded(
        path: &std::path::Path,
        domain: &str,
        config: QueueConfig,
    ) -> Result<Self> {
        check_domain(domain)?;
        let path = path.to_path_buf();
        let store = tokio::task::spawn_blocking(move || Store::open(&path))
            .await
            .map_err(|e| QueueError::Unavailable(format!("embedded store task: {e}")))?
            .map_err(|e| QueueError::Unavailable(e.to_string()))?;
        Self::with_backend(
            Backend::Embedded(Arc::new(store)),
            Arc::new(Origin::Embedded),
            domain,
            config,
        )
        .await
    }

    async fn with_backend(
        backend: Backend,
        origin: Arc<Origin>,
        domain: &str,
        config: QueueConfig,
    ) -> Result<Self> {
        let prefix = format!("tq:{{{domain}}}:");
        if let Backend::Embedded(store) = &backend {
            // The clock's high-water mark moves on every call that reads the time;
            // alone, that is no reason to sync the file (see Store::defer_field).
            store.defer_field(format!("{prefix}meta").as_bytes(), b"clock");
        }
        let queue = Self {
            backend,
            origin,
            figures: Arc::default(),
            meta: format!("{prefix}meta"),
            prefix,
            scripts: Scripts::get(),
            config,
        };
        queue.store_settings().await?;
        queue.backend.preload(&queue.scripts.library).await?;
        Ok(queue)
    }

    /// Another scheduling domain on the same backend (same server, same Cluster, or same
    /// file).
    pub async fn domain_queue(&self, domain: &str, config: QueueConfig) -> Result<Self> {
        check_domain(domain)?;
        Self::with_backend(
            self.backend.clone(),
            Arc::clone(&self.origin),
            domain,
            config,
        )
        .await
    }

    /// The same domain over a connection of its own, driven by the async runtime this is
    /// called on. A server whose workers each run a single-threaded runtime (actix-web)
    /// gives each worker one, so no call has to wake a thread of another runtime and
    /// wait for it to answer. The embedded store is in process: it is shared as is.
    pub async fn with_own_connection(&self) -> Result<Self> {
        let backend = match &*self.origin {
            Origin::Embedded => self.backend.clone(),
            origin => origin.connect().await?,
        };
        Ok(Self {
            backend,
            ..self.clone()
        })
    }

    /// The key prefix of this domain (`tq:{domain}:`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    async fn store_settings(&self) -> Result<()> {
        let c = &self.config;
        let mut cmd = redis::cmd("HSET");
        cmd.arg(&self.meta)
            .arg("aging_horizon_ms")
            .arg(c.aging_horizon_ms)
            .arg("retention_ms")
            .arg(c.retention_ms)
            .arg("retention_count")
            .arg(c.retention_count)
            .arg("max_events_per_job")
            .arg(c.max_events_per_job);
        self.query(&cmd).await
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
                .pipeline(&standing::job_read(&self.prefix, id, &tenant))
                .await?;
            if fields.is_empty() {
                return Ok(None);
            }
            let job = job_record(id, &fields, String::new())?;
            if job.tenant != tenant {
                tenant = job.tenant;
                continue;
            }
            let position = match (job.state, standing::rank(Some(&rank))?) {
                (JobState::Queued, Some(rank)) => {
                    let weight = standing::number(Some(&weight))?.unwrap_or(1.0);
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
            .pipeline(&standing::first_read(&self.prefix, &self.meta))
            .await?;
        let first = standing::FirstRead::parse(&reply)?;
        let reply: Vec<Value> = if first.needs_second_read() {
            self.pipeline(&first.second_read(&self.prefix)).await?
        } else {
            Vec::new()
        };
        let figures = Arc::new(first.finish(&reply)?);
        self.figures.keep(Arc::clone(&figures));
        Ok(figures)
    }

    /// Runs `script` with the domain's meta key, its prefix and `args` (a status table).
    /// Repeating it is safe: a lost reply is retried.
    async fn call(&self, script: &LuaScript, args: &[String]) -> Result<Vec<Value>> {
        self.call_as(script, args).await
    }

    /// [`Self::call`] for scripts that answer something other than a status table.
    async fn call_as<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        args: &[String],
    ) -> Result<T> {
        self.run_script(script, args, true).await.0
    }

    /// Runs `script`; when `repeatable`, a lost reply is retried. Also says whether a
    /// try whose outcome is unknown came before the answer (so the caller can tell
    /// "someone else did it" from "my own lost try did it").
    async fn run_script<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        args: &[String],
        repeatable: bool,
    ) -> (Result<T>, bool) {
        let mut all: Vec<&str> = Vec::with_capacity(args.len() + 1);
        all.push(&self.prefix);
        all.extend(args.iter().map(String::as_str));
        let all = &all;
        self.retrying(script.name(), repeatable, || {
            self.backend.invoke(script, &self.meta, all)
        })
        .await
    }

    /// Runs `attempt` again while its outcome is unknown (lost reply, timeout, server
    /// restarting), up to [`QueueConfig::unknown_outcome_retries`] times with growing,
    /// jittered pauses, but only when `repeatable`: otherwise the unknown outcome goes
    /// to the caller. The flag says whether an unknown outcome came before the answer.
    async fn retrying<T, F, Fut>(
        &self,
        operation: &str,
        repeatable: bool,
        mut attempt: F,
    ) -> (Result<T>, bool)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut lost = 0u32;
        loop {
            match attempt().await {
                Err(e)
                    if repeatable
                        && e.is_retryable()
                        && lost < self.config.unknown_outcome_retries =>
                {
                    lost += 1;
                    let pause = (50u64 << lost.min(5)).min(1_000);
                    let pause = pause + rand::random_range(0..=pause / 2);
                    tracing::warn!(operation, retry = lost, error = %e, "queue call outcome unknown; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                }
                outcome => return (outcome, lost > 0),
            }
        }
    }

    /// A read or an idempotent write, retried while its outcome is unknown.
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        self.retrying("query", true, || self.backend.query(cmd))
            .await
            .0
    }

    /// [`Self::query`] for a pipeline.
    async fn pipeline<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> Result<T> {
        self.retrying("pipeline", true, || self.backend.pipeline(pipe))
            .await
            .0
    }

    /// Whether `error` only reports what an earlier try of this same call did: the job
    /// is now where `done` says with `token` still its epoch (nobody else holds that
    /// token, so the earlier try was this attempt's own, whoever repeated it: this
    /// queue, the Cluster client or the caller), or — only when this call itself retried
    /// (`retried`) — it finished and retention deleted it at once.
    async fn own_earlier_try(
        &self,
        error: &QueueError,
        id: &str,
        token: Option<u64>,
        done: Done,
        retried: bool,
    ) -> bool {
        if !matches!(
            error,
            QueueError::WrongState { .. } | QueueError::NotFound(_)
        ) {
            return false;
        }
        match self.get(id).await {
            Ok(Some(record)) => {
                done.states.contains(&record.state) && token.is_none_or(|t| record.epoch == t)
            }
            Ok(None) => retried && done.or_deleted,
            Err(_) => false,
        }
    }

    /// Maps a script's failure status to an error.
    fn status_error(id: &str, reply: &[Value], operation: &'static str) -> QueueError {
        match int(reply.first()) {
            Ok(-1) => QueueError::NotFound(id.to_string()),
            Ok(-6) => QueueError::StaleToken(id.to_string()),
            Ok(-3) | Ok(1) => QueueError::WrongState {
                id: id.to_string(),
                state: text(reply.get(1)).unwrap_or_default(),
                operation,
            },
            other => QueueError::Protocol(format!("{operation}: status {other:?}")),
        }
    }

    async fn token_call(
        &self,
        script: &LuaScript,
        id: &str,
        token: u64,
        extra: &[String],
        operation: &'static str,
    ) -> Result<Vec<Value>> {
        self.fenced_call(script, id, token, extra, operation)
            .await
            .0
    }

    /// [`Self::token_call`], also saying whether a lost try came before the answer.
    async fn fenced_call(
        &self,
        script: &LuaScript,
        id: &str,
        token: u64,
        extra: &[String],
        operation: &'static str,
    ) -> (Result<Vec<Value>>, bool) {
        let mut args = vec![id.to_string(), token.to_string()];
        args.extend_from_slice(extra);
        let (reply, retried) = self.run_script::<Vec<Value>>(script, &args, true).await;
        let outcome = reply.and_then(|reply| match int(reply.first())? {
            0 => Ok(reply),
            _ => Err(Self::status_error(id, &reply, operation)),
        });
        (outcome, retried)
    }

    /// Runs `preempt.lua` with `args` after the job and token (the reason, and for a
    /// move the new pools and why): back in line, in its place.
    async fn preempt_with(&self, id: &str, token: u64, args: &[String]) -> Result<()> {
        self.fenced_transition(
            &self.scripts.preempt,
            id,
            token,
            args,
            "preempt",
            Done {
                states: &[JobState::Queued],
                or_deleted: false,
            },
        )
        .await
    }

    /// A fenced transition that moves the job to one of `done`: a repeat after a lost
    /// reply finds it already there and counts as success.
    async fn fenced_transition(
        &self,
        script: &LuaScript,
        id: &str,
        token: u64,
        extra: &[String],
        operation: &'static str,
        done: Done,
    ) -> Result<()> {
        match self.fenced_call(script, id, token, extra, operation).await {
            (Ok(_), _) => Ok(()),
            (Err(e), retried)
                if self
                    .own_earlier_try(&e, id, Some(token), done, retried)
                    .await =>
            {
                Ok(())
            }
            (Err(e), _) => Err(e),
        }
    }

    /// Runs the catalog script (see [`crate::catalog`]).
    pub(crate) async fn catalog_script(&self, args: &[String]) -> Result<Vec<Value>> {
        self.call(&self.scripts.catalog, args).await
    }

    /// The key of one catalog entry (its parts are checked identifiers).
    pub(crate) fn catalog_key(&self, kind: &str, owner: &str, id: &str) -> String {
        format!("{}cat:{kind}:{owner}:{id}", self.prefix)
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

    /// Moves the queue clock forward by `ms` (tests use it to expire leases and age jobs).
    pub async fn advance_clock(&self, ms: u64) -> Result<()> {
        let mut cmd = redis::cmd("HINCRBY");
        cmd.arg(&self.meta).arg("clock_offset").arg(ms);
        self.query(&cmd).await
    }

    /// Every key of this domain, sorted (tests check what operations leave behind). On a
    /// Cluster it asks the node owning the domain's slot.
    pub async fn keys(&self) -> Result<Vec<String>> {
        let mut cmd = redis::cmd("KEYS");
        cmd.arg(format!("{}*", self.prefix));
        let mut keys: Vec<String> = self
            .retrying("keys", true, || self.backend.scan_query(&cmd, &self.meta))
            .await
            .0?;
        keys.sort();
        Ok(keys)
    }

    /// Deletes every key of this domain (tests; never in production).
    pub async fn destroy(&self) -> Result<()> {
        let keys = self.keys().await?;
        for chunk in keys.chunks(500) {
            let mut cmd = redis::cmd("DEL");
            cmd.arg(chunk);
            self.query::<()>(&cmd).await?;
        }
        Ok(())
    }

    /// The Redis connection (the benchmark reads server statistics); None when embedded
    /// or on a Cluster (whose statistics are per node).
    pub fn redis_connection(&self) -> Option<ConnectionManager> {
        match &self.backend {
            Backend::Redis(link) => Some(link.get().1),
            Backend::Cluster(_) | Backend::Embedded(_) => None,
        }
    }
}

/// The queue's operations; every backend passes the same conformance suite.
///
/// **Unknown outcomes.** When a reply is lost (connection dropped, timeout, server
/// restarting) the call may or may not have happened. Calls that are safe to repeat are
/// retried inside the queue ([`QueueConfig::unknown_outcome_retries`]): reads; enqueue
/// with an idempotency key; claim with a request id; every fenced call (a repeat of
/// complete, fail, preempt or confirm_cancelled that finds its own earlier try already
/// done counts as success; start and heartbeat are repeatable as they are); cancel and
/// the settings. Only enqueue without an idempotency key and claim without a request id
/// hand [`QueueError::Unavailable`] to the caller, who cannot know whether they happened.
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
    /// Renews the lease and records progress (JSON).
    async fn heartbeat(&self, id: &str, token: u64, progress: Option<&str>) -> Result<u64>;
    /// [`Self::heartbeat`] that also appends `events` (kind, message) to the job's log.
    /// Reports are numbered per attempt (`report_seq`, growing): a repeated report renews
    /// the lease but records nothing twice, so a lost reply is retried safely.
    async fn report(
        &self,
        id: &str,
        token: u64,
        report_seq: u64,
        progress: Option<&str>,
        events: &[(&str, &str)],
    ) -> Result<u64>;
    /// The attempt succeeded.
    async fn complete(&self, id: &str, token: u64, result: &str) -> Result<()>;
    /// The attempt failed; returns when it will be retried, or None if the job failed for good.
    async fn fail(
        &self,
        id: &str,
        token: u64,
        reason: &str,
        retryable: bool,
    ) -> Result<Option<u64>>;
    /// The attempt's machine was taken away: requeue in place, attempts unchanged.
    async fn preempt(&self, id: &str, token: u64, reason: &str) -> Result<()>;
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
        reason: &str,
        pools: &[String],
        why: &str,
    ) -> Result<()>;
    /// Cancels: at once when waiting, else asks the live attempt to stop.
    async fn cancel(&self, id: &str) -> Result<JobState>;
    /// The cancelled attempt is gone; its capacity is released.
    async fn confirm_cancelled(&self, id: &str) -> Result<()>;
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
    /// Outbox deliveries whose time has come (they stay until acknowledged).
    async fn due_deliveries(&self, limit: u32) -> Result<Vec<Delivery>>;
    /// A delivery was made.
    async fn ack_delivery(&self, delivery: &Delivery) -> Result<()>;
    /// A delivery failed; try again after `delay_ms`.
    async fn retry_delivery(&self, delivery: &Delivery, delay_ms: u64) -> Result<()>;
}

#[async_trait]
impl JobQueue for Queue {
    async fn enqueue(&self, job: &NewJob) -> Result<Enqueued> {
        validate(job)?;
        let mut args = vec![self.config.idempotency_ttl_ms.to_string()];
        args.extend(job_args(job));
        // Only a job with an idempotency key can be sent again without risking a twin.
        let repeatable = job.idempotency_key.is_some();
        let (reply, _) = self
            .run_script::<Vec<Value>>(&self.scripts.enqueue, &args, repeatable)
            .await;
        let reply = reply?;
        enqueued(job, reply.first(), reply.get(1))
    }

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
                self.run_script(&self.scripts.enqueue_bulk, &args, repeatable)
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

    async fn claim(&self, pool: &str, owner: &str, request_id: &str) -> Result<Option<Lease>> {
        let c = &self.config;
        let args = [
            pool.to_string(),
            owner.to_string(),
            c.lease_ms.to_string(),
            request_id.to_string(),
            c.scan_tenants.to_string(),
            c.scan_depth.to_string(),
            c.quantum_seconds.to_string(),
        ];
        // A claim request id makes a repeat return the same lease instead of a second.
        let repeatable = !request_id.is_empty();
        let reply: Vec<Value> = self
            .run_script(&self.scripts.claim, &args, repeatable)
            .await
            .0?;
        claimed(&reply, pool, "", "claim")
    }

    async fn claim_started(
        &self,
        pool: &str,
        owner: &str,
        request_id: &str,
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
            "1".to_string(),
        ];
        let repeatable = !request_id.is_empty();
        let reply: Vec<Value> = self
            .run_script(&self.scripts.claim, &args, repeatable)
            .await
            .0?;
        claimed(&reply, pool, "", "claim")
    }

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
            .run_script(&self.scripts.complete_and_claim, &args, false)
            .await
            .0?;
        claimed(&reply, pool, id, "complete_and_claim")
    }

    async fn start(&self, id: &str, token: u64) -> Result<()> {
        let lease = self.config.lease_ms.to_string();
        self.token_call(&self.scripts.start, id, token, &[lease], "start")
            .await
            .map(|_| ())
    }

    async fn heartbeat(&self, id: &str, token: u64, progress: Option<&str>) -> Result<u64> {
        let args = [
            self.config.lease_ms.to_string(),
            progress.unwrap_or_default().to_string(),
            String::new(),
        ];
        let reply = self
            .token_call(&self.scripts.heartbeat, id, token, &args, "heartbeat")
            .await?;
        unsigned(reply.get(1))
    }

    async fn report(
        &self,
        id: &str,
        token: u64,
        report_seq: u64,
        progress: Option<&str>,
        events: &[(&str, &str)],
    ) -> Result<u64> {
        let mut args = vec![
            self.config.lease_ms.to_string(),
            progress.unwrap_or_default().to_string(),
            report_seq.to_string(),
        ];
        for (kind, message) in events {
            args.push(kind.to_string());
            args.push(message.to_string());
        }
        let reply = self
            .token_call(&self.scripts.heartbeat, id, token, &args, "report")
            .await?;
        unsigned(reply.get(1))
    }

    async fn complete(&self, id: &str, token: u64, result: &str) -> Result<()> {
        self.fenced_transition(
            &self.scripts.complete,
            id,
            token,
            &[result.to_string()],
            "complete",
            Done {
                states: &[JobState::Succeeded],
                or_deleted: true,
            },
        )
        .await
    }

    async fn fail(
        &self,
        id: &str,
        token: u64,
        reason: &str,
        retryable: bool,
    ) -> Result<Option<u64>> {
        let c = &self.config;
        let jitter: f64 = rand::random::<f64>() * 0.25;
        let args = vec![
            id.to_string(),
            token.to_string(),
            reason.to_string(),
            if retryable { "1" } else { "0" }.to_string(),
            c.retry_base_ms.to_string(),
            c.retry_max_ms.to_string(),
            format!("{jitter:.4}"),
        ];
        let (reply, retried) = self
            .run_script::<Vec<Value>>(&self.scripts.fail, &args, true)
            .await;
        let reply = reply?;
        match int(reply.first())? {
            0 => Ok(Some(unsigned(reply.get(1))?)),
            1 => Ok(None),
            _ => {
                let e = Self::status_error(id, &reply, "fail");
                let done = Done {
                    states: &[JobState::Delayed, JobState::Failed],
                    or_deleted: true,
                };
                if self
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

    async fn preempt(&self, id: &str, token: u64, reason: &str) -> Result<()> {
        self.preempt_with(id, token, &[reason.to_string()]).await
    }

    async fn preempt_and_move(
        &self,
        id: &str,
        token: u64,
        reason: &str,
        pools: &[String],
        why: &str,
    ) -> Result<()> {
        check_pool_list(pools)?;
        self.preempt_with(
            id,
            token,
            &[reason.to_string(), pools.join(","), why.to_string()],
        )
        .await
    }

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
        self.preempt_with(
            id,
            token,
            &[reason.to_string(), pools, why.to_string(), "1".to_string()],
        )
        .await
    }

    async fn cancel(&self, id: &str) -> Result<JobState> {
        let reply = self.call(&self.scripts.cancel, &[id.to_string()]).await?;
        match int(reply.first())? {
            0 | 1 => {
                let state = text(reply.get(1))?;
                JobState::parse(&state)
                    .ok_or_else(|| QueueError::Protocol(format!("unknown state {state}")))
            }
            _ => Err(Self::status_error(id, &reply, "cancel")),
        }
    }

    async fn confirm_cancelled(&self, id: &str) -> Result<()> {
        let (reply, retried) = self
            .run_script::<Vec<Value>>(&self.scripts.confirm_cancelled, &[id.to_string()], true)
            .await;
        let reply = reply?;
        match int(reply.first())? {
            0 => Ok(()),
            _ => {
                let e = Self::status_error(id, &reply, "confirm_cancelled");
                let done = Done {
                    states: &[JobState::Cancelled],
                    or_deleted: true,
                };
                if self.own_earlier_try(&e, id, None, done, retried).await {
                    return Ok(());
                }
                Err(e)
            }
        }
    }

    async fn expire_leases(&self, batch: u32) -> Result<Vec<JobId>> {
        let reply = self
            .call(&self.scripts.expire_leases, &[batch.to_string()])
            .await?;
        reply.iter().map(|v| text(Some(v))).collect()
    }

    async fn suspects(&self, limit: u32) -> Result<Vec<JobId>> {
        if limit == 0 {
            return Ok(vec![]);
        }
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(format!("{}suspect", self.prefix))
            .arg(0)
            .arg(i64::from(limit) - 1);
        self.query(&cmd).await
    }

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
        let args = [
            verdict.to_string(),
            self.config.lease_ms.to_string(),
            self.config.max_stalls.to_string(),
        ];
        let reply = self
            .token_call(
                &self.scripts.resolve_suspect,
                id,
                epoch,
                &args,
                "resolve_suspect",
            )
            .await?;
        let state = text(reply.get(1))?;
        JobState::parse(&state)
            .ok_or_else(|| QueueError::Protocol(format!("unknown state {state}")))
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>> {
        let mut pipe = redis::pipe();
        pipe.cmd("HGETALL")
            .arg(format!("{}job:{id}", self.prefix))
            .cmd("GET")
            .arg(format!("{}payload:{id}", self.prefix));
        let (fields, payload): (HashMap<String, String>, Option<String>) =
            self.pipeline(&pipe).await?;
        if fields.is_empty() {
            return Ok(None);
        }
        job_record(id, &fields, payload.unwrap_or_default()).map(Some)
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
        cmd.arg(format!("{}events:{id}", self.prefix))
            .arg(0)
            .arg(-1);
        let raw: Vec<String> = self.query(&cmd).await?;
        let mut events = raw
            .iter()
            .map(|line| {
                serde_json::from_str::<JobEvent>(line)
                    .map_err(|e| QueueError::Protocol(format!("event of {id}: {e}")))
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
        cmd.arg(format!("{}job:{id}", self.prefix)).arg("tenant");
        let tenant: Option<String> = self.query(&cmd).await?;
        let tenant = tenant.ok_or_else(|| QueueError::NotFound(id.to_string()))?;
        match self
            .read_status(id, &tenant, std::time::Duration::ZERO)
            .await?
        {
            None => Err(QueueError::NotFound(id.to_string())),
            Some((_, Some(position))) => Ok(position),
            Some((job, None)) => Err(QueueError::WrongState {
                id: id.to_string(),
                state: job.state.as_str().to_string(),
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
            .arg(format!("{}pool:{pool}", self.prefix))
            .arg("capacity")
            .arg(capacity)
            .cmd("SADD")
            .arg(format!("{}pools", self.prefix))
            .arg(pool);
        self.pipeline::<()>(&pipe).await?;
        // This process's next estimate sees the new capacity at once.
        self.figures.forget();
        Ok(())
    }

    async fn pool_usage(&self, pool: &str) -> Result<PoolUsage> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(format!("{}pool:{pool}", self.prefix))
            .arg("capacity")
            .arg("used");
        let (capacity, used): (Option<u32>, Option<i64>) = self.query(&cmd).await?;
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
        let key = format!("{}tenant:{tenant}", self.prefix);
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
        self.pipeline::<()>(&pipe).await?;
        self.figures.forget();
        Ok(())
    }

    async fn inspect(&self) -> Result<Inspection> {
        let p = &self.prefix;
        let mut ids = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(format!("{p}job:*"))
                .arg("COUNT")
                .arg(1000);
            let (next, keys): (u64, Vec<String>) = self
                .retrying("scan", true, || self.backend.scan_query(&scan, &self.meta))
                .await
                .0?;
            ids.extend(keys.iter().map(|k| k[p.len() + 4..].to_string()));
            if next == 0 {
                break;
            }
            cursor = next;
        }
        let members = |key: String| {
            let backend = self.backend.clone();
            async move {
                let kind = if key.ends_with("cancelling") {
                    "SMEMBERS"
                } else {
                    "ZRANGE"
                };
                let mut cmd = redis::cmd(kind);
                cmd.arg(&key);
                if kind == "ZRANGE" {
                    cmd.arg(0).arg(-1);
                }
                backend
                    .query::<Vec<String>>(&cmd)
                    .await
                    .map(|v| v.into_iter().collect::<std::collections::HashSet<_>>())
            }
        };
        let mut indexes = Vec::new();
        for name in ["delayed", "leases", "suspect", "cancelling", "done", "dead"] {
            indexes.push((name, members(format!("{p}{name}")).await?));
        }
        let active_tenants = members(format!("{p}tenants")).await?.into_iter().collect();
        let mut ready_of = std::collections::HashMap::new();
        let mut out = Inspection {
            active_tenants,
            ..Inspection::default()
        };
        ids.sort();
        for id in ids {
            let Some(record) = self.get(&id).await? else {
                continue;
            };
            if !ready_of.contains_key(&record.tenant) {
                let ready = members(format!("{p}ready:{}", record.tenant)).await?;
                if !ready.is_empty() {
                    out.tenants_with_waiting.insert(record.tenant.clone());
                }
                ready_of.insert(record.tenant.clone(), ready);
            }
            let mut member_of = Vec::new();
            if ready_of[&record.tenant].contains(&id) {
                member_of.push("ready");
            }
            for (name, set) in &indexes {
                if set.contains(&id) {
                    member_of.push(*name);
                }
            }
            out.jobs.push((record, member_of));
        }
        let mut cmd = redis::cmd("SMEMBERS");
        cmd.arg(format!("{p}pools"));
        let pools: Vec<String> = self.query(&cmd).await?;
        for pool in pools {
            let usage = self.pool_usage(&pool).await?;
            out.pools.push((pool, usage));
        }
        out.pools.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    async fn due_deliveries(&self, limit: u32) -> Result<Vec<Delivery>> {
        let reply = self
            .call(&self.scripts.outbox, &["due".into(), limit.to_string()])
            .await?;
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
                Ok(Delivery {
                    job_id: job_id.to_string(),
                    state: state.to_string(),
                    tenant: tenant.to_string(),
                    due_ms: unsigned(pair.get(1))?,
                })
            })
            .collect()
    }

    async fn ack_delivery(&self, delivery: &Delivery) -> Result<()> {
        let args = ["ack".to_string(), delivery.member()];
        self.call_as::<i64>(&self.scripts.outbox, &args).await?;
        Ok(())
    }

    async fn retry_delivery(&self, delivery: &Delivery, delay_ms: u64) -> Result<()> {
        let args = ["retry".to_string(), delivery.member(), delay_ms.to_string()];
        self.call_as::<i64>(&self.scripts.outbox, &args).await?;
        Ok(())
    }

    async fn trim(&self, batch: u32) -> Result<u64> {
        let removed: i64 = self
            .call_as(&self.scripts.trim, &[batch.to_string()])
            .await?;
        Ok(u64::try_from(removed).unwrap_or(0))
    }
}

/// A job record from its hash's fields (and its payload, read apart).
fn job_record(id: &str, fields: &HashMap<String, String>, payload: String) -> Result<JobRecord> {
    let num = |f: &str| {
        fields
            .get(f)
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v as u64)
    };
    let opt = |f: &str| fields.get(f).filter(|v| !v.is_empty()).cloned();
    let state = fields.get("state").cloned().unwrap_or_default();
    Ok(JobRecord {
        id: id.to_string(),
        tenant: fields.get("tenant").cloned().unwrap_or_default(),
        state: JobState::parse(&state)
            .ok_or_else(|| QueueError::Protocol(format!("job {id} has unknown state {state:?}")))?,
        priority: u8::try_from(num("prio").unwrap_or(0)).unwrap_or(0),
        pools: fields
            .get("pools")
            .map(|p| {
                p.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default(),
        gpus: u32::try_from(num("gpus").unwrap_or(1)).unwrap_or(1),
        payload,
        attempts: u32::try_from(num("attempts").unwrap_or(0)).unwrap_or(0),
        max_attempts: u32::try_from(num("max_attempts").unwrap_or(1)).unwrap_or(1),
        preemptions: u32::try_from(num("preemptions").unwrap_or(0)).unwrap_or(0),
        stalls: u32::try_from(num("stalls").unwrap_or(0)).unwrap_or(0),
        epoch: num("epoch").unwrap_or(0),
        pool: opt("pool"),
        enqueued_ms: num("enq_ms").unwrap_or(0),
        finished_ms: num("finished_ms"),
        due_ms: num("due_ms"),
        progress: opt("progress"),
        result: opt("result"),
        error: opt("error"),
    })
}
