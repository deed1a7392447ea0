//! What the queue's test binaries share: the job they enqueue, and how they read a job's
//! events back.

#![allow(dead_code)]

use tuneq_queue::{JobQueue, NewJob, Queue};

/// A job of `tenant` at `priority` carrying `payload`: one GPU on any pool, three
/// attempts, no estimate, no idempotency key, no webhook.
pub fn new_job(tenant: impl Into<String>, priority: u8, payload: impl Into<String>) -> NewJob {
    NewJob {
        tenant: tenant.into(),
        priority,
        pools: vec![],
        gpus: 1,
        estimated_seconds: 0,
        max_attempts: 3,
        payload: payload.into(),
        idempotency_key: None,
        notify: false,
    }
}

/// The kinds of the job's events, oldest first (at most 100).
pub async fn kinds(q: &Queue, id: &str) -> Vec<String> {
    q.events(id, None, 100, false)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind.code().to_string())
        .collect()
}
