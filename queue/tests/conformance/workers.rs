//! Workers that complete a job and claim the next in one call.

use super::*;

pub(crate) async fn a_worker_that_completes_and_claims_runs_each_job_through_every_step(
    backend: Backend,
) {
    let q = queue_with_pool(backend, "chain", "gpu", 1).await;
    let a = q.enqueue(&job("t", 5)).await.unwrap().id;
    let b = q.enqueue(&job("t", 5)).await.unwrap().id;
    let first = q.claim_started("gpu", "w", "req-1").await.unwrap().unwrap();
    assert_eq!(first.id, a);
    assert_eq!(q.get(&a).await.unwrap().unwrap().state, JobState::Running);
    assert_eq!(
        q.claim_started("gpu", "w", "req-1").await.unwrap(),
        Some(first.clone()),
        "a retried claim returns the same lease"
    );
    check_invariants(&q, &["gpu"]).await;
    let second = q
        .complete_and_claim(&a, first.token, r#"{"ok":1}"#, "gpu", "w")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.id, b);
    assert!(second.token > first.token);
    let done = q.get(&a).await.unwrap().unwrap();
    assert_eq!(done.state, JobState::Succeeded);
    assert_eq!(done.result.as_deref(), Some(r#"{"ok":1}"#));
    assert_eq!(q.get(&b).await.unwrap().unwrap().state, JobState::Running);
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 1);
    check_invariants(&q, &["gpu"]).await;
    assert!(
        q.complete_and_claim(&b, second.token, "{}", "gpu", "w")
            .await
            .unwrap()
            .is_none()
    );
    for id in [&a, &b] {
        assert_eq!(
            kinds(&q, id).await,
            ["queued", "leased", "started", "succeeded"]
        );
        let seqs: Vec<u64> = q
            .events(id, None, 10, false)
            .await
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
    }
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 0);
    check_and_destroy(q, &["gpu"]).await;
}

pub(crate) async fn complete_and_claim_with_a_stale_token_or_unknown_pool_changes_nothing(
    backend: Backend,
) {
    let q = queue_with(backend, "chainfence", |c| c.lease_ms = 1_000).await;
    q.set_pool("gpu", 2).await.unwrap();
    let id = q.enqueue(&job("t", 5)).await.unwrap().id;
    let waiting = q.enqueue(&job("t", 5)).await.unwrap().id;
    let first = q.claim_started("gpu", "w1", "").await.unwrap().unwrap();
    assert_eq!(first.id, id);
    q.advance_clock(1_500).await.unwrap();
    q.expire_leases(10).await.unwrap();
    q.resolve_suspect(&id, first.token, SuspectVerdict::Requeue)
        .await
        .unwrap();
    let second = q.claim("gpu", "w2", "").await.unwrap().unwrap();
    assert_eq!(second.id, id, "the requeued job keeps its place in line");
    let before = (q.get(&id).await.unwrap(), q.get(&waiting).await.unwrap());
    let stale = q
        .complete_and_claim(&id, first.token, "{}", "gpu", "w1")
        .await;
    assert!(matches!(stale, Err(QueueError::StaleToken(_))), "{stale:?}");
    let unknown = q
        .complete_and_claim(&id, second.token, "{}", "nowhere", "w2")
        .await;
    assert!(
        matches!(unknown, Err(QueueError::UnknownPool(_))),
        "{unknown:?}"
    );
    let after = (q.get(&id).await.unwrap(), q.get(&waiting).await.unwrap());
    assert_eq!(before, after, "refused calls changed a job");
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 1);
    check_invariants(&q, &["gpu"]).await;
    let next = q
        .complete_and_claim(&id, second.token, "{}", "gpu", "w2")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(next.id, waiting);
    let again = q
        .complete_and_claim(&id, second.token, "{}", "gpu", "w2")
        .await;
    assert!(
        matches!(again, Err(QueueError::WrongState { .. })),
        "{again:?}"
    );
    check_and_destroy(q, &["gpu"]).await;
}

pub(crate) async fn complete_and_claim_charges_capacity_and_quotas_exactly(backend: Backend) {
    let q = queue_with_pool(backend, "chaincap", "gpu", 3).await;
    set_tenant(&q, "capped", |t| t.max_running = Some(1)).await;
    let mut wide = job("wide", 9);
    wide.gpus = 3;
    // Tenant order at equal virtual time is by name: capped, then wide.
    let c1 = q.enqueue(&job("capped", 5)).await.unwrap().id;
    let c2 = q.enqueue(&job("capped", 5)).await.unwrap().id;
    let w = q.enqueue(&wide).await.unwrap().id;
    let held = q.claim_started("gpu", "other", "").await.unwrap().unwrap();
    assert_eq!(held.id, c1);
    let mut small = job("small", 5);
    small.pools = vec!["other".into()];
    q.enqueue(&small).await.unwrap();
    // While the first capped job runs, the second is over the tenant's quota and the
    // 3-GPU job does not fit beside it; the small job is pinned to another pool.
    assert!(q.claim_started("gpu", "w", "").await.unwrap().is_none());
    // Completing the capped job gives its GPU back in the same step that claims: the
    // 3-GPU job (its tenant now has the lower virtual time) fits exactly.
    let next = q
        .complete_and_claim(&c1, held.token, "{}", "gpu", "other")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(next.id, w);
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 3);
    check_invariants(&q, &["gpu"]).await;
    // The capped tenant's quota was given back too: its second job runs next.
    let last = q
        .complete_and_claim(&w, next.token, "{}", "gpu", "other")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(last.id, c2);
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 1);
    check_invariants(&q, &["gpu"]).await;
    assert!(
        q.complete_and_claim(&c2, last.token, "{}", "gpu", "other")
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 0);
    check_and_destroy(q, &["gpu"]).await;
}

pub(crate) async fn tenants_share_by_weight_when_workers_complete_and_claim(backend: Backend) {
    let q = queue_with_pool(backend, "chainfair", "gpu", 2).await;
    flood(&q).await;
    // Two workers, each handing its finished job back and taking the next in one call.
    let mut served: HashMap<String, u32> = HashMap::new();
    let mut held = vec![];
    for w in ["w1", "w2"] {
        held.push(q.claim_started("gpu", w, "").await.unwrap().unwrap());
    }
    for round in 0..200 {
        let w = ["w1", "w2"][round % 2];
        let lease = held.remove(0);
        *served.entry(lease.tenant.clone()).or_default() += 1;
        let next = q
            .complete_and_claim(&lease.id, lease.token, "{}", "gpu", w)
            .await
            .unwrap()
            .unwrap();
        held.push(next);
    }
    assert_shares_by_weight(&served);
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 2);
    check_and_destroy(q, &["gpu"]).await;
}
