//! Lost replies and timeouts against a real redis-server, through a proxy that lets the
//! command run and then loses (or stalls) its reply. Calls that are safe to repeat are
//! retried inside the queue and take effect exactly once; the two that are not (enqueue
//! without an idempotency key, claim without a request id) report the unknown outcome.

#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::time::Duration;
use support::{kinds, new_job, reclaim, training_failed};
use tuneq_queue::fault_proxy::FaultProxy;
use tuneq_queue::*;

async fn through_proxy(name: &str, config: QueueConfig) -> (FaultProxy, Queue) {
    let proxy = FaultProxy::start(testing::shared()).await;
    let config = QueueConfig {
        response_timeout_ms: 500,
        ..config
    };
    let q = Queue::connect(&proxy.url, &testing::unique_domain(name), config)
        .await
        .unwrap();
    q.set_pool("gpu", 1).await.unwrap();
    (proxy, q)
}

fn job(key: Option<&str>) -> NewJob {
    NewJob {
        idempotency_key: key.map(str::to_string),
        ..new_job("acme", 5, "{}")
    }
}

async fn job_count(q: &Queue) -> usize {
    q.inspect().await.unwrap().jobs.len()
}

#[tokio::test]
async fn an_enqueue_with_a_key_whose_reply_is_lost_becomes_exactly_one_job() {
    let (proxy, q) = through_proxy("lost-enqueue", QueueConfig::default()).await;
    proxy.lose_next_reply();
    let accepted = q.enqueue(&job(Some("req-1"))).await.unwrap();
    assert!(!proxy.fault_pending(), "the reply was really lost");
    assert_eq!(job_count(&q).await, 1);
    assert!(q.get(&accepted.id).await.unwrap().is_some());
    assert_eq!(kinds(&q, &accepted.id).await, ["queued"]);
    q.destroy().await.unwrap();
}

#[tokio::test]
async fn an_enqueue_without_a_key_reports_the_unknown_outcome() {
    let (proxy, q) = through_proxy("lost-enqueue-nokey", QueueConfig::default()).await;
    proxy.lose_next_reply();
    let e = q.enqueue(&job(None)).await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert_eq!(
        job_count(&q).await,
        1,
        "it did happen, which is why callers should send idempotency keys"
    );
    q.destroy().await.unwrap();
}

#[tokio::test]
async fn a_claim_whose_reply_is_lost_returns_one_lease_charged_once() {
    let (proxy, q) = through_proxy("lost-claim", QueueConfig::default()).await;
    q.set_pool("gpu", 2).await.unwrap();
    q.enqueue(&job(None)).await.unwrap();
    q.enqueue(&job(None)).await.unwrap();
    proxy.lose_next_reply();
    let lease = q.claim("gpu", "d1", "claim-1").await.unwrap().unwrap();
    assert!(!proxy.fault_pending());
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 1, "charged once");
    assert_eq!(q.get(&lease.id).await.unwrap().unwrap().epoch, lease.token);
    assert_eq!(kinds(&q, &lease.id).await, ["queued", "leased"]);
    q.destroy().await.unwrap();
}

#[tokio::test]
async fn fenced_calls_whose_replies_are_lost_take_effect_once() {
    let (proxy, q) = through_proxy("lost-fenced", QueueConfig::default()).await;

    // start, heartbeat, complete: each reply lost once.
    let id = q.enqueue(&job(None)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    proxy.lose_next_reply();
    q.start(&id, lease.token).await.unwrap();
    proxy.lose_next_reply();
    q.heartbeat(&id, lease.token, Some(r#"{"step":1}"#))
        .await
        .unwrap();
    proxy.lose_next_reply();
    q.complete(&id, lease.token, "{}").await.unwrap();
    assert!(!proxy.fault_pending());
    assert_eq!(
        q.get(&id).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    assert_eq!(
        kinds(&q, &id).await,
        ["queued", "leased", "started", "succeeded"]
    );

    // fail: one attempt counted, not two.
    let id = q.enqueue(&job(None)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    proxy.lose_next_reply();
    let due = training_failed(&q, &id, lease.token, "oom", true)
        .await
        .unwrap();
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(record.attempts, 1);
    assert_eq!(record.state, JobState::Delayed);
    assert_eq!(due, record.due_ms);
    q.cancel(&id).await.unwrap();

    // preempt: one preemption counted, back in line.
    let id = q.enqueue(&job(None)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    proxy.lose_next_reply();
    reclaim(&q, &id, lease.token).await;
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!((record.state, record.preemptions), (JobState::Queued, 1));

    // cancel of a live attempt, then its confirmation.
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    proxy.lose_next_reply();
    assert_eq!(q.cancel(&id).await.unwrap(), JobState::CancelRequested);
    proxy.lose_next_reply();
    q.confirm_cancelled(&id).await.unwrap();
    assert_eq!(
        q.get(&id).await.unwrap().unwrap().state,
        JobState::Cancelled
    );
    assert!(matches!(
        q.complete(&id, lease.token, "{}").await,
        Err(QueueError::StaleToken(_))
    ));
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 0);
    q.destroy().await.unwrap();
}

#[tokio::test]
async fn a_lost_complete_of_a_job_deleted_at_completion_still_succeeds() {
    let config = QueueConfig {
        retention_count: 0,
        ..QueueConfig::default()
    };
    let (proxy, q) = through_proxy("lost-complete-removed", config).await;
    let id = q.enqueue(&job(None)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    proxy.lose_next_reply();
    q.complete(&id, lease.token, "{}").await.unwrap();
    assert!(q.get(&id).await.unwrap().is_none());
    q.destroy().await.unwrap();
}

#[tokio::test]
async fn a_reply_slower_than_the_timeout_is_an_unknown_outcome_and_is_retried() {
    let (proxy, q) = through_proxy("stalled", QueueConfig::default()).await;
    let id = q.enqueue(&job(None)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    // Held far past the client's 500 ms timeout and every retry, on a connection that
    // stays open: the call times out, the queue opens a new connection in its place,
    // and the retry there answers.
    proxy.stall_next_reply(Duration::from_secs(60));
    let connections = proxy.connections();
    let started = std::time::Instant::now();
    q.complete(&id, lease.token, "{}").await.unwrap();
    let took = started.elapsed();
    assert!(!proxy.fault_pending(), "the reply was never stalled");
    assert!(
        proxy.connections() > connections,
        "the call was not retried on a new connection"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(30),
        "complete took {took:?}: not one timeout and a retry on a new connection"
    );
    assert_eq!(
        q.get(&id).await.unwrap().unwrap().state,
        JobState::Succeeded
    );
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 0);
    q.destroy().await.unwrap();
}

#[tokio::test]
async fn leases_whose_expiry_reply_was_lost_are_still_listed_as_suspects() {
    let config = QueueConfig {
        lease_ms: 1_000,
        ..QueueConfig::default()
    };
    let (proxy, q) = through_proxy("lost-expiry", config).await;
    let id = q.enqueue(&job(None)).await.unwrap().id;
    q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.advance_clock(5_000).await.unwrap();
    proxy.lose_next_reply();
    let marked = q.expire_leases(10).await.unwrap();
    assert!(!proxy.fault_pending());
    assert!(
        marked.is_empty(),
        "the repeat found nothing new to mark: {marked:?}"
    );
    assert_eq!(q.suspects(10).await.unwrap(), std::slice::from_ref(&id));
    assert_eq!(q.get(&id).await.unwrap().unwrap().state, JobState::Suspect);
    q.destroy().await.unwrap();
}
