//! Pause and resume in the conformance suite: a waiting job is set aside at once, a
//! running one is stopped by its dispatcher (the queue only carries the request), and a
//! resumed job takes its place in line again.

use super::*;
use tuneq_openapi::{FailureClass, StopCause};

/// What the dispatcher's stop of a pausing attempt says.
const PAUSED: &str = "paused by its tenant";

async fn kinds_after(q: &Queue, id: &str, skip: usize) -> Vec<String> {
    kinds(q, id).await.into_iter().skip(skip).collect()
}

pub(crate) async fn a_paused_waiting_job_is_never_dispatched_until_resumed(backend: Backend) {
    let q = queue_with_pool(backend, "pause-waiting", "gpu", 1).await;
    let paused = q.enqueue(&job("t", 5)).await.unwrap().id;
    let other = q.enqueue(&job("t", 5)).await.unwrap().id;
    assert_eq!(q.pause(&paused).await.unwrap(), JobState::Paused);
    assert_eq!(
        q.pause(&paused).await.unwrap(),
        JobState::Paused,
        "repeatable"
    );
    check_invariants(&q, &["gpu"]).await;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(lease.id, other, "a paused job is never dispatched");
    q.complete(&other, lease.token, "{}").await.unwrap();
    assert!(q.claim("gpu", "d", "").await.unwrap().is_none());
    assert_eq!(q.resume(&paused).await.unwrap(), JobState::Queued);
    assert_eq!(
        q.resume(&paused).await.unwrap(),
        JobState::Queued,
        "repeatable"
    );
    check_invariants(&q, &["gpu"]).await;
    assert_eq!(q.claim("gpu", "d", "").await.unwrap().unwrap().id, paused);
    assert_eq!(
        kinds(&q, &paused).await,
        ["queued", "paused", "unpaused", "leased"]
    );

    // A job waiting for its retry is paused too, and resuming it puts it in line at once.
    let retried = q.get(&paused).await.unwrap().unwrap().epoch;
    assert!(
        training_failed(&q, &paused, retried, "crashed", true)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(q.pause(&paused).await.unwrap(), JobState::Paused);
    let record = q.get(&paused).await.unwrap().unwrap();
    assert_eq!((record.due_ms, record.attempts), (None, 1));
    check_invariants(&q, &["gpu"]).await;
    assert_eq!(q.resume(&paused).await.unwrap(), JobState::Queued);
    assert_eq!(q.claim("gpu", "d", "").await.unwrap().unwrap().id, paused);
    assert!(matches!(
        q.pause("j999999999999").await,
        Err(QueueError::NotFound(_))
    ));
    check_and_destroy(q, &["gpu"]).await;
}

pub(crate) async fn paused_jobs_count_against_the_waiting_quota_until_resumed_or_cancelled(
    backend: Backend,
) {
    let q = queue_with_pool(backend, "pause-quota", "gpu", 1).await;
    set_tenant(&q, "capped", |t| t.max_waiting = Some(1)).await;
    let first = q.enqueue(&job("capped", 5)).await.unwrap().id;
    q.pause(&first).await.unwrap();
    assert!(
        matches!(
            q.enqueue(&job("capped", 5)).await,
            Err(QueueError::OverQuota(_))
        ),
        "pausing a job does not free its place in the quota"
    );
    assert_eq!(q.cancel(&first).await.unwrap(), JobState::Cancelled);
    assert!(
        matches!(q.resume(&first).await, Err(QueueError::WrongState { .. })),
        "a cancelled job cannot be resumed"
    );
    q.enqueue(&job("capped", 5)).await.unwrap();
    check_and_destroy(q, &["gpu"]).await;
}

pub(crate) async fn pausing_a_running_job_holds_its_capacity_until_its_attempt_stops(
    backend: Backend,
) {
    let q = queue_with_pool(backend, "pause-running", "gpu", 1).await;
    let id = q.enqueue(&job("t", 5)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.start(&id, lease.token).await.unwrap();
    let renewal = q.heartbeat(&id, lease.token, None).await.unwrap();
    assert!(!renewal.pause_requested);
    let before = kinds(&q, &id).await.len();

    assert_eq!(q.pause(&id).await.unwrap(), JobState::Running);
    assert_eq!(q.pause(&id).await.unwrap(), JobState::Running, "repeatable");
    let renewal = q.heartbeat(&id, lease.token, None).await.unwrap();
    assert!(
        renewal.pause_requested,
        "the dispatcher learns of the pause"
    );
    assert!(q.get(&id).await.unwrap().unwrap().pause_requested);
    assert!(
        matches!(
            q.resume(&id).await,
            Err(QueueError::WrongState {
                state: Some(JobState::Running),
                ..
            })
        ),
        "a pause in progress cannot be resumed yet"
    );
    q.enqueue(&job("t", 5)).await.unwrap();
    assert!(
        q.claim("gpu", "d", "").await.unwrap().is_none(),
        "capacity held until the attempt stops"
    );
    check_invariants(&q, &["gpu"]).await;

    q.preempt(&id, lease.token, StopCause::Pause, PAUSED)
        .await
        .unwrap();
    let paused = q.get(&id).await.unwrap().unwrap();
    assert_eq!(paused.state, JobState::Paused);
    assert_eq!((paused.preemptions, paused.attempts), (0, 0));
    assert!(!paused.pause_requested);
    assert_eq!(
        kinds_after(&q, &id, before).await,
        ["pause_requested", "paused"]
    );
    check_invariants(&q, &["gpu"]).await;
    let other = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_ne!(
        other.id, id,
        "the paused job's capacity went to the next job"
    );
    q.complete(&other.id, other.token, "{}").await.unwrap();

    assert_eq!(q.resume(&id).await.unwrap(), JobState::Queued);
    let again = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(again.id, id);
    q.start(&id, again.token).await.unwrap();
    let renewal = q.heartbeat(&id, again.token, None).await.unwrap();
    assert!(!renewal.pause_requested, "the next attempt runs on");
    q.complete(&id, again.token, "{}").await.unwrap();
    assert!(matches!(
        q.pause(&id).await,
        Err(QueueError::WrongState {
            state: Some(JobState::Succeeded),
            ..
        })
    ));
    check_and_destroy(q, &["gpu"]).await;
}

pub(crate) async fn an_attempt_that_fails_or_vanishes_while_pausing_leaves_its_job_paused(
    backend: Backend,
) {
    let q = queue_with_pool(backend, "pause-ends", "gpu", 1).await;
    // It crashed on its way down: the attempt is counted, and the job waits paused.
    let crashed = q.enqueue(&job("t", 5)).await.unwrap().id;
    let lease = q.claim_started("gpu", "d", "").await.unwrap().unwrap();
    q.pause(&crashed).await.unwrap();
    let class = FailureClass::TrainingFailed;
    assert_eq!(
        q.fail(&crashed, lease.token, class, "crashed", true)
            .await
            .unwrap(),
        None
    );
    let record = q.get(&crashed).await.unwrap().unwrap();
    assert_eq!((record.state, record.attempts), (JobState::Paused, 1));
    check_invariants(&q, &["gpu"]).await;
    q.resume(&crashed).await.unwrap();

    // Its lease ran out and the dispatcher found it gone: paused as well.
    let lease = q.claim_started("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(lease.id, crashed);
    q.pause(&crashed).await.unwrap();
    q.advance_clock(QueueConfig::default().lease_ms + 1)
        .await
        .unwrap();
    assert_eq!(
        q.expire_leases(10).await.unwrap(),
        std::slice::from_ref(&crashed)
    );
    assert_eq!(
        q.resolve_suspect(&crashed, lease.token, SuspectVerdict::Requeue)
            .await
            .unwrap(),
        JobState::Paused
    );
    check_invariants(&q, &["gpu"]).await;

    // Cancelling while a pause is pending cancels.
    q.resume(&crashed).await.unwrap();
    let lease = q.claim_started("gpu", "d", "").await.unwrap().unwrap();
    q.pause(&crashed).await.unwrap();
    assert_eq!(q.cancel(&crashed).await.unwrap(), JobState::CancelRequested);
    assert!(matches!(
        q.pause(&crashed).await,
        Err(QueueError::WrongState { .. })
    ));
    assert!(matches!(
        q.heartbeat(&crashed, lease.token, None).await,
        Err(QueueError::StaleToken(_))
    ));
    q.confirm_cancelled(&crashed).await.unwrap();
    check_and_destroy(q, &["gpu"]).await;
}
