//! An attempt's life: its reports, a vanished attempt, idle tenants, retry back-off.

use super::*;

/// Instantiates each conformance test once per backend, as `redis::name`,
/// `cluster::name` and `embedded::name`.
pub(crate) async fn attempt_reports_append_events_once_and_stale_reports_change_nothing(
    backend: Backend,
) {
    let q = queue_with_pool(backend, "report", "cpu", 1).await;
    let id = q.enqueue(&job("acme", 5)).await.unwrap().id;
    let lease = q.claim_started("cpu", "d1", "").await.unwrap().unwrap();
    let step_fields = serde_json::json!({"step": 1});
    let step = [
        event(EventKind::Metrics, "", Some(&step_fields)),
        event(EventKind::Checkpoint, "step 1", None),
    ];
    let first = q
        .report(&id, lease.token, 1, Some(r#"{"step":1}"#), &step)
        .await
        .unwrap();
    assert!(first.recorded);
    // The same report again (as after a lost reply) records nothing twice, and says so.
    let again = q
        .report(&id, lease.token, 1, Some(r#"{"step":99}"#), &step)
        .await
        .unwrap();
    assert!(!again.recorded, "a repeated report is not recorded again");
    q.report(
        &id,
        lease.token,
        2,
        Some(r#"{"step":2}"#),
        &[event(EventKind::Warning, "a \"quoted\" word", None)],
    )
    .await
    .unwrap();
    let events = q.events(&id, None, 100, false).await.unwrap();
    let seen: Vec<(&str, &str)> = events
        .iter()
        .map(|e| (e.kind.code(), e.message.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            ("queued", ""),
            ("leased", ""),
            ("started", ""),
            ("metrics", ""),
            ("checkpoint", "step 1"),
            ("warning", "a \"quoted\" word"),
        ]
    );
    assert_eq!(events[1].pool.as_deref(), Some("cpu"));
    assert_eq!(events[3].data.as_ref(), Some(&step_fields));
    assert_eq!(events[4].data, None);
    assert!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(record.progress.as_deref(), Some(r#"{"step":2}"#));

    // A newer attempt makes the old one's reports stale: refused, nothing recorded.
    reclaim(&q, &id, lease.token).await;
    let second = q.claim_started("cpu", "d1", "").await.unwrap().unwrap();
    let stale = q
        .report(
            &id,
            lease.token,
            3,
            Some(r#"{"step":50}"#),
            &[event(EventKind::Metrics, "late", None)],
        )
        .await;
    assert!(matches!(stale, Err(QueueError::StaleToken(_))), "{stale:?}");
    // The new attempt numbers its reports from 1 again.
    let third = serde_json::json!({"step": 3});
    q.report(
        &id,
        second.token,
        1,
        None,
        &[event(EventKind::Metrics, "", Some(&third))],
    )
    .await
    .unwrap();
    let events = q.events(&id, None, 100, false).await.unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == EventKind::Metrics)
            .count(),
        2
    );
    assert!(!events.iter().any(|e| e.message == "late"));
    assert_eq!(
        q.get(&id).await.unwrap().unwrap().progress.as_deref(),
        Some(r#"{"step":2}"#)
    );
    check_and_destroy(q, &["cpu"]).await;
}

/// README: "a job that vanished 3 times fails". Each time its lease runs out and the
/// dispatcher finds the attempt gone, the job goes back in line, until the third.
pub(crate) async fn a_job_whose_attempt_vanished_three_times_fails(backend: Backend) {
    let config = QueueConfig {
        lease_ms: 1_000,
        ..QueueConfig::default()
    };
    assert_eq!(config.max_stalls, 3, "the promise is about the default");
    let q = queue(backend, "stalls", config).await;
    q.set_pool("gpu", 1).await.unwrap();
    let id = q.enqueue(&job("t", 5)).await.unwrap().id;
    for vanished in 1..=3 {
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        assert_eq!(lease.id, id);
        q.start(&id, lease.token).await.unwrap();
        assert!(
            q.expire_leases(10).await.unwrap().is_empty(),
            "the lease has not run out yet"
        );
        q.advance_clock(1_001).await.unwrap();
        assert_eq!(q.expire_leases(10).await.unwrap(), vec![id.clone()]);
        let verdict = q
            .resolve_suspect(&id, lease.token, SuspectVerdict::Requeue)
            .await
            .unwrap();
        let record = q.get(&id).await.unwrap().unwrap();
        assert_eq!(record.stalls, vanished);
        assert_eq!(record.attempts, 0, "a vanished attempt spends no retry");
        if vanished < 3 {
            assert_eq!(verdict, JobState::Queued, "vanished {vanished} times");
            assert_eq!(record.state, JobState::Queued);
        } else {
            assert_eq!(verdict, JobState::Failed, "vanished 3 times");
            assert_eq!(record.state, JobState::Failed);
            assert_eq!(record.failure, Some(tuneq_openapi::FailureClass::JobLost));
        }
    }
    assert!(
        q.claim("gpu", "d", "").await.unwrap().is_none(),
        "a failed job is never dispatched again"
    );
    check_and_destroy(q, &["gpu"]).await;
}

/// Claims and completes `n` jobs on `pool`; how many each tenant got.
async fn serve(q: &Queue, pool: &str, n: usize) -> HashMap<String, usize> {
    let mut served = HashMap::new();
    for _ in 0..n {
        let lease = q.claim(pool, "d", "").await.unwrap().unwrap();
        *served.entry(lease.tenant.clone()).or_default() += 1;
        q.complete(&lease.id, lease.token, "{}").await.unwrap();
    }
    served
}

/// README: "idle tenants bank no credit". A tenant that was away while another kept the
/// pool busy comes back level with it, not with a burst of turns for the time it was
/// away: from then on they take turns.
pub(crate) async fn an_idle_tenant_banks_no_credit_while_away(backend: Backend) {
    let q = queue_with_pool(backend, "credit", "gpu", 1).await;
    q.enqueue(&job("away", 5)).await.unwrap();
    assert_eq!(serve(&q, "gpu", 1).await["away"], 1);
    // While "away" has nothing waiting, "busy" has the pool to itself for 30 jobs.
    for _ in 0..40 {
        q.enqueue(&job("busy", 5)).await.unwrap();
    }
    assert_eq!(serve(&q, "gpu", 30).await["busy"], 30);
    // "away" returns with as much work as "busy" still has waiting.
    for _ in 0..10 {
        q.enqueue(&job("away", 5)).await.unwrap();
    }
    let served = serve(&q, "gpu", 10).await;
    let away = served.get("away").copied().unwrap_or(0);
    assert!(
        (4..=6).contains(&away),
        "the returning tenant takes turns, no burst for the time it was away: {served:?}"
    );
    check_and_destroy(q, &["gpu"]).await;
}

/// README: "retries back off exponentially with jitter". The delay before each retry
/// is the base doubled per failed attempt, capped, plus up to a quarter of jitter; the
/// job is not claimable a moment before it and is at once after.
pub(crate) async fn retries_back_off_exponentially_with_bounded_jitter(backend: Backend) {
    let q = queue_with(backend, "backoff", |c| {
        c.retry_base_ms = 1_000;
        c.retry_max_ms = 10_000;
    })
    .await;
    q.set_pool("gpu", 1).await.unwrap();
    let id = q
        .enqueue(&NewJob {
            max_attempts: 7,
            ..job("t", 5)
        })
        .await
        .unwrap()
        .id;
    let mut jittered = 0;
    for (attempt, base) in [1_000u64, 2_000, 4_000, 8_000, 10_000, 10_000]
        .into_iter()
        .enumerate()
    {
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        assert_eq!(lease.id, id);
        let due = training_failed(&q, &id, lease.token, "OOM", true)
            .await
            .unwrap()
            .expect("retries left");
        let scheduled = q.events(&id, None, 1, true).await.unwrap();
        assert_eq!(scheduled[0].kind, EventKind::RetryScheduled);
        assert_eq!(
            scheduled[0].failure,
            Some(tuneq_openapi::FailureClass::TrainingFailed)
        );
        let delay = due - scheduled[0].at_ms;
        assert!(
            (base..=base + base / 4).contains(&delay),
            "retry {}: {delay} ms, want {base} ms plus at most a quarter",
            attempt + 1
        );
        if delay > base {
            jittered += 1;
        }
        q.advance_clock(delay - 1).await.unwrap();
        assert!(
            q.claim("gpu", "d", "").await.unwrap().is_none(),
            "retry {}: not before its time",
            attempt + 1
        );
        q.advance_clock(1).await.unwrap();
    }
    assert!(jittered > 0, "no retry was jittered");
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(
        training_failed(&q, &id, lease.token, "OOM", true)
            .await
            .unwrap(),
        None,
        "the seventh failure spends the last attempt"
    );
    check_and_destroy(q, &["gpu"]).await;
}
