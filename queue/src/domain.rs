//! One scheduling domain on its backend, and the fenced-call machinery every queue
//! operation goes through.
//!
//! All keys of a domain share the prefix `tq:{domain}:` (the hash tag puts them in one
//! Redis Cluster slot); the meta hash `tq:{domain}:meta` routes each script call.
//!
//! A lost connection or a timeout is an *unknown outcome* ([`QueueError::Unavailable`]):
//! the call may or may not have happened. Calls that are safe to repeat are retried
//! here ([`Domain::retrying`]); a fenced transition (a call carrying the attempt's
//! fencing token) that finds the job already where it would have moved it recognises
//! its own earlier try ([`Domain::fenced_transition`]) instead of reporting an error.

use crate::backend::Backend;
use crate::model::{JobRecord, JobState};
use crate::reply::{int, job_record, status_error};
use crate::scripts::LuaScript;
use crate::{QueueError, Result};
use redis::{FromRedisValue, Value};
use std::collections::HashMap;

/// Where a transition leaves its job, so a repeat after a lost reply can recognise
/// that its own earlier try already made it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Done {
    /// The states the transition ends in.
    pub(crate) states: &'static [JobState],
    /// Whether retention may have deleted the job at once (a finishing transition).
    pub(crate) or_deleted: bool,
}

/// A scheduling domain's keys on a backend, and how calls to them are made.
#[derive(Clone)]
pub(crate) struct Domain {
    /// Where the keys live.
    pub(crate) backend: Backend,
    /// `tq:{domain}:`.
    prefix: String,
    /// `tq:{domain}:meta`.
    meta: String,
    /// Retries of a repeatable call whose outcome is unknown.
    retries: u32,
}

/// Refuses domain names that would break the key layout or the hash tag.
fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains(['{', '}', ':', '*', '?', '[', ']', '\\']) {
        return Err(QueueError::Invalid {
            field: "domain",
            message: "must be non-empty without '{', '}', ':' or glob characters".into(),
        });
    }
    Ok(())
}

impl Domain {
    /// Domain `name` on `backend`; a call whose outcome is unknown is repeated up to
    /// `retries` times when that is safe.
    pub(crate) fn new(backend: Backend, name: &str, retries: u32) -> Result<Self> {
        check_name(name)?;
        let prefix = format!("tq:{{{name}}}:");
        Ok(Self {
            backend,
            meta: format!("{prefix}meta"),
            prefix,
            retries,
        })
    }

    /// Checks a domain name before anything is connected for it.
    pub(crate) fn check(name: &str) -> Result<()> {
        check_name(name)
    }

    /// The same domain over another connection to the same backend.
    pub(crate) fn on(&self, backend: Backend) -> Self {
        Self {
            backend,
            ..self.clone()
        }
    }

    /// The key prefix (`tq:{domain}:`).
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The meta hash's key.
    pub(crate) fn meta(&self) -> &str {
        &self.meta
    }

    /// The key `tq:{domain}:<suffix>`.
    pub(crate) fn key(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    /// Runs `script` with the domain's meta key, its prefix and `args` (a status table).
    /// Repeating it is safe: a lost reply is retried.
    pub(crate) async fn call(&self, script: &LuaScript, args: &[String]) -> Result<Vec<Value>> {
        self.call_as(script, args).await
    }

    /// [`Self::call`] for scripts that answer something other than a status table.
    pub(crate) async fn call_as<T: FromRedisValue>(
        &self,
        script: &LuaScript,
        args: &[String],
    ) -> Result<T> {
        self.run_script(script, args, true).await.0
    }

    /// Runs `script`; when `repeatable`, a lost reply is retried. Also says whether a
    /// try whose outcome is unknown came before the answer (so the caller can tell
    /// "someone else did it" from "my own lost try did it").
    pub(crate) async fn run_script<T: FromRedisValue>(
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
    /// restarting), up to [`crate::QueueConfig::unknown_outcome_retries`] times with
    /// growing, jittered pauses, but only when `repeatable`: otherwise the unknown
    /// outcome goes to the caller. The flag says whether an unknown outcome came before
    /// the answer.
    pub(crate) async fn retrying<T, F, Fut>(
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
                Err(e) if repeatable && e.is_retryable() && lost < self.retries => {
                    lost += 1;
                    let pause = (50u64 << lost.min(5)).min(1_000);
                    let pause = pause + rand::random_range(0..=pause / 2);
                    tracing::warn!(
                        operation,
                        retry = lost,
                        error = &e as &dyn std::error::Error,
                        "queue call outcome unknown; retrying"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                }
                outcome => return (outcome, lost > 0),
            }
        }
    }

    /// A read or an idempotent write, retried while its outcome is unknown.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        self.retrying("query", true, || self.backend.query(cmd))
            .await
            .0
    }

    /// [`Self::query`] for a pipeline.
    pub(crate) async fn pipeline<T: FromRedisValue>(&self, pipe: &redis::Pipeline) -> Result<T> {
        self.retrying("pipeline", true, || self.backend.pipeline(pipe))
            .await
            .0
    }

    /// [`Self::query`] for a command that reads the keyspace (`KEYS`, `SCAN`), sent where
    /// the domain's keys are (see [`Backend::scan_query`]).
    pub(crate) async fn scan_query<T: FromRedisValue>(
        &self,
        operation: &str,
        cmd: &redis::Cmd,
    ) -> Result<T> {
        self.retrying(operation, true, || self.backend.scan_query(cmd, &self.meta))
            .await
            .0
    }

    /// The job `id` with its payload, or None.
    pub(crate) async fn job(&self, id: &str) -> Result<Option<JobRecord>> {
        let mut pipe = redis::pipe();
        pipe.cmd("HGETALL")
            .arg(self.key(&format!("job:{id}")))
            .cmd("GET")
            .arg(self.key(&format!("payload:{id}")));
        let (fields, payload): (HashMap<String, String>, Option<String>) =
            self.pipeline(&pipe).await?;
        if fields.is_empty() {
            return Ok(None);
        }
        job_record(id, &fields, payload.unwrap_or_default()).map(Some)
    }

    /// Whether `error` only reports what an earlier try of this same call did: the job
    /// is now where `done` says with `token` still its epoch (nobody else holds that
    /// token, so the earlier try was this attempt's own, whoever repeated it: this
    /// queue, the Cluster client or the caller), or — only when this call itself retried
    /// (`retried`) — it finished and retention deleted it at once.
    pub(crate) async fn own_earlier_try(
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
        match self.job(id).await {
            Ok(Some(record)) => {
                done.states.contains(&record.state) && token.is_none_or(|t| record.epoch == t)
            }
            Ok(None) => retried && done.or_deleted,
            Err(_) => false,
        }
    }

    /// Runs a script that takes the job and its fencing token first: its reply when the
    /// status is 0, else the error the status stands for; and whether a lost try came
    /// before the answer.
    pub(crate) async fn token_call(
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
            _ => Err(status_error(id, &reply, operation)),
        });
        (outcome, retried)
    }

    /// What a fenced transition that moves the job to one of `done` came to, given the
    /// `outcome` of its [`Self::token_call`]: a repeat after a lost reply finds the job
    /// already there and counts as success.
    pub(crate) async fn settle_transition(
        &self,
        outcome: (Result<Vec<Value>>, bool),
        id: &str,
        token: u64,
        done: Done,
    ) -> Result<()> {
        match outcome {
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
}
