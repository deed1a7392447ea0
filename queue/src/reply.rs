//! Reading what the backend answers: the values of script and command replies (numbers,
//! strings, lists), a job's hash as a [`JobRecord`], and the status codes the scripts
//! return (see `lua/prelude.lua`) as results or [`QueueError`]s. Redis and the embedded
//! store answer with the same shapes, so this is written once.

use crate::model::{Enqueued, JobRecord, JobState, Lease, NewJob};
use crate::{QueueError, Result};
use redis::{FromRedisValue, Value};
use std::collections::HashMap;

/// A reply that is a whole number (or a decimal string, cut to its whole part).
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

/// A reply that is a string (a number reads as its decimal form).
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

/// A reply that is a whole number, negative ones read as 0.
pub(crate) fn unsigned(v: Option<&Value>) -> Result<u64> {
    Ok(u64::try_from(int(v)?.max(0)).unwrap_or_default())
}

/// A reply that is a number, or nil (a missing field).
pub(crate) fn number(v: Option<&Value>) -> Result<Option<f64>> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Int(i)) => Ok(Some(*i as f64)),
        other => {
            let s = text(other)?;
            s.parse::<f64>()
                .map(Some)
                .map_err(|_| QueueError::Protocol(format!("not a number: {s:?}")))
        }
    }
}

/// A reply that is a list of strings (nil: none).
pub(crate) fn strings(v: Option<&Value>) -> Result<Vec<String>> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Array(items)) | Some(Value::Set(items)) => {
            items.iter().map(|i| text(Some(i))).collect()
        }
        other => Err(QueueError::Protocol(format!(
            "expected a list, got {other:?}"
        ))),
    }
}

/// A rank reply: None when the job is not in the line.
pub(crate) fn rank(v: Option<&Value>) -> Result<Option<u64>> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        other => Ok(Some(u64::try_from(int(other)?.max(0)).unwrap_or_default())),
    }
}

/// A whole reply as `T`.
pub(crate) fn parse<T: FromRedisValue>(value: Value) -> Result<T> {
    T::from_redis_value(value).map_err(|e| QueueError::Failed(e.into()))
}

/// Reads one job's enqueue status and id.
pub(crate) fn enqueued(
    job: &NewJob,
    status: Option<&Value>,
    id: Option<&Value>,
) -> Result<Enqueued> {
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
pub(crate) fn claimed(
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
        _ => Err(status_error(id, reply, operation)),
    }
}

/// Maps a script's failure status to an error.
pub(crate) fn status_error(id: &str, reply: &[Value], operation: &'static str) -> QueueError {
    match int(reply.first()) {
        Ok(-1) => QueueError::NotFound(id.to_string()),
        Ok(-6) => QueueError::StaleToken(id.to_string()),
        Ok(-3) | Ok(1) => QueueError::WrongState {
            id: id.to_string(),
            state: text(reply.get(1)).ok().and_then(|s| JobState::parse(&s)),
            operation,
        },
        other => QueueError::Protocol(format!("{operation}: status {other:?}")),
    }
}

/// A job state as the scripts name it.
pub(crate) fn state(v: Option<&Value>) -> Result<JobState> {
    let state = text(v)?;
    JobState::parse(&state).ok_or_else(|| QueueError::Protocol(format!("unknown state {state}")))
}

/// A job record from its hash's fields (and its payload, read apart).
pub(crate) fn job_record(
    id: &str,
    fields: &HashMap<String, String>,
    payload: String,
) -> Result<JobRecord> {
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
        pause_requested: fields.get("pause_req").is_some_and(|v| v == "1"),
        pool: opt("pool"),
        enqueued_ms: num("enq_ms").unwrap_or(0),
        finished_ms: num("finished_ms"),
        due_ms: num("due_ms"),
        progress: opt("progress"),
        result: opt("result"),
        error: opt("error"),
        // A code this build does not know reads as none: the reason still says it.
        failure: opt("failure").and_then(|c| tuneq_openapi::FailureClass::parse(&c)),
    })
}
