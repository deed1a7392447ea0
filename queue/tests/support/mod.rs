//! What the queue's test binaries share: the job they enqueue, how they take a spot
//! node away, and how they read a job's events back.

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

/// What a reclaimed spot node's preemption says.
pub const RECLAIMED: &str = "spot reclaimed";

/// Preempts the attempt `token` of `id` as a spot node taken away would.
pub async fn reclaim(q: &Queue, id: &str, token: u64) {
    q.preempt(id, token, tuneq_openapi::StopCause::Preemption, RECLAIMED)
        .await
        .unwrap();
}

/// Fails the attempt `token` of `id` as a crashed trainer does (`training_failed`):
/// the time of the retry, None when the job failed for good.
pub async fn training_failed(
    q: &Queue,
    id: &str,
    token: u64,
    reason: &str,
    retryable: bool,
) -> tuneq_queue::Result<Option<u64>> {
    let class = tuneq_openapi::FailureClass::TrainingFailed;
    q.fail(id, token, class, reason, retryable).await
}
