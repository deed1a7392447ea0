//! The conformance suite, run against every backend: a real redis-server started by the
//! harness, a real three-node Redis Cluster started by the harness, and the embedded
//! single-file store. Lifecycle, priorities and aging, tenant
//! fairness, capacity and quotas, fencing, retries, preemption, cancel, pause and
//! resume (`conformance/pause.rs`), events,
//! retention, idempotency, concurrent claimers, and randomised sequences with the
//! invariants checked after every step. Each test is written once, as
//! `async fn name(backend: Backend)`; `conformance!` at the end instantiates it per
//! backend.

#![allow(clippy::unwrap_used, missing_docs)]

#[path = "conformance/pause.rs"]
mod pause;
mod support;

use pause::*;
use std::collections::{HashMap, HashSet};
use support::{RECLAIMED, kinds, new_job, reclaim, training_failed};
use tuneq_openapi::EventKind;
use tuneq_queue::testing;
use tuneq_queue::*;
use tuneq_queue::{JobQueue, Queue};

#[derive(Debug, Clone, Copy)]
enum Backend {
    Redis,
    Cluster,
    Embedded,
}

/// A fresh domain on `backend`: on the shared redis-server, on the shared Redis Cluster
/// (the random domain name picks the slot, so the tests spread over the three nodes), or
/// in its own file. Its clock is frozen: it moves only when the test advances it, so no
/// expectation about time depends on how fast the machine runs the test.
async fn queue(backend: Backend, name: &str, config: QueueConfig) -> Queue {
    let domain = testing::unique_domain(name);
    let q = match backend {
        Backend::Redis => Queue::connect(testing::shared(), &domain, config).await,
        Backend::Cluster => {
            Queue::connect_cluster(&testing::shared_cluster().urls, &domain, config).await
        }
        Backend::Embedded => {
            let file = testing::scratch_dir().join("queue.db");
            Queue::open_embedded(&file, &domain, config).await
        }
    }
    .unwrap();
    q.freeze_clock().await.unwrap();
    q
}

/// A fresh domain on `backend` (see [`queue`]) with the default configuration changed
/// by `change`.
async fn queue_with(backend: Backend, name: &str, change: impl FnOnce(&mut QueueConfig)) -> Queue {
    let mut config = QueueConfig::default();
    change(&mut config);
    queue(backend, name, config).await
}

/// A fresh domain on `backend` (see [`queue`]) with the default configuration and
/// `capacity` GPUs in `pool`.
async fn queue_with_pool(backend: Backend, name: &str, pool: &str, capacity: u32) -> Queue {
    let q = queue(backend, name, QueueConfig::default()).await;
    q.set_pool(pool, capacity).await.unwrap();
    q
}

/// Checks the invariants (see [`check_invariants`]) one last time, then removes the domain.
async fn check_and_destroy(q: Queue, pools: &[&str]) {
    check_invariants(&q, pools).await;
    q.destroy().await.unwrap();
}

/// Tenant `big` (weight 2) enqueues 300 jobs, then `small-a` and `small-b` (weight 1)
/// 100 each.
async fn flood(q: &Queue) {
    set_tenant(q, "big", |t| t.weight = 2.0).await;
    for _ in 0..300 {
        q.enqueue(&job("big", 5)).await.unwrap();
    }
    for t in ["small-a", "small-b"] {
        for _ in 0..100 {
            q.enqueue(&job(t, 5)).await.unwrap();
        }
    }
}

/// An event a report appends.
fn event<'a>(
    kind: EventKind,
    message: &'a str,
    data: Option<&'a serde_json::Value>,
) -> tuneq_queue::NewEvent<'a> {
    tuneq_queue::NewEvent {
        kind,
        message,
        data,
    }
}

/// The first 200 dispatches after a [`flood`], `served` per tenant, follow the weights
/// 2:1:1: 100, 50, 50, each within ±10%.
fn assert_shares_by_weight(served: &HashMap<String, u32>) {
    for (tenant, want) in [("big", 100.0), ("small-a", 50.0), ("small-b", 50.0)] {
        let got = f64::from(served[tenant]);
        assert!(
            (got - want).abs() <= want * 0.1,
            "{tenant}: {got} of 200, want {want}: {served:?}"
        );
    }
}

/// Sets `tenant`'s settings: the defaults, changed by `change`.
async fn set_tenant(q: &Queue, tenant: &str, change: impl FnOnce(&mut TenantSettings)) {
    let mut settings = TenantSettings::default();
    change(&mut settings);
    q.set_tenant(tenant, &settings).await.unwrap();
}

/// Enqueues a job of tenant `t` that may run on `spot`, then on `on-demand`; its id.
async fn enqueue_spot_first(q: &Queue) -> String {
    let spot_first = NewJob {
        pools: vec!["spot".into(), "on-demand".into()],
        ..job("t", 5)
    };
    q.enqueue(&spot_first).await.unwrap().id
}

fn job(tenant: &str, priority: u8) -> NewJob {
    new_job(tenant, priority, format!("{{\"tenant\":\"{tenant}\"}}"))
}

/// Checks the invariants of queue-design.md B7 that can be seen from what a backend
/// holds ([`JobQueue::inspect`], so the check works for every backend): each job's
/// state matches the one index it is in, pool usage equals what live attempts hold and
/// never exceeds capacity, and active tenants are exactly those with waiting jobs.
async fn check_invariants(q: &dyn JobQueue, pools: &[&str]) {
    let seen = q.inspect().await.unwrap();
    let mut used: HashMap<String, u64> = HashMap::new();
    for (record, member_of) in &seen.jobs {
        let expected: &[&str] = match record.state {
            JobState::Queued => &["ready"],
            JobState::Delayed => &["delayed"],
            JobState::Leased | JobState::Running => &["leases"],
            JobState::Suspect => &["suspect"],
            JobState::CancelRequested => &["cancelling"],
            // Set aside: in no line and holding nothing until resumed.
            JobState::Paused => &[],
            JobState::Succeeded | JobState::Cancelled => &["done"],
            JobState::Failed => &["dead"],
        };
        assert_eq!(
            member_of.as_slice(),
            expected,
            "job {} in state {:?}",
            record.id,
            record.state
        );
        if matches!(
            record.state,
            JobState::Leased | JobState::Running | JobState::Suspect | JobState::CancelRequested
        ) {
            *used.entry(record.pool.clone().unwrap()).or_default() += u64::from(record.gpus);
        } else {
            assert!(
                record.pool.is_none(),
                "job {} {:?} holds a pool",
                record.id,
                record.state
            );
        }
    }
    for pool in pools {
        let (_, usage) = seen.pools.iter().find(|(p, _)| p == pool).unwrap();
        assert_eq!(
            u64::from(usage.used),
            used.get(*pool).copied().unwrap_or(0),
            "pool {pool} usage"
        );
        assert!(usage.used <= usage.capacity, "pool {pool} over capacity");
    }
    assert_eq!(
        seen.active_tenants, seen.tenants_with_waiting,
        "active tenants are exactly those with waiting jobs"
    );
}

async fn a_job_goes_from_queued_to_succeeded(backend: Backend) {
    let q = queue_with_pool(backend, "life", "cpu", 1).await;
    let id = q.enqueue(&job("acme", 5)).await.unwrap().id;
    assert_eq!(
        q.get(&id).await.unwrap().unwrap().state.public_status(),
        tuneq_openapi::JobStatus::Queued
    );
    let lease = q.claim("cpu", "d1", "").await.unwrap().unwrap();
    assert_eq!(lease.id, id);
    assert_eq!(lease.tenant, "acme");
    check_invariants(&q, &["cpu"]).await;
    q.start(&id, lease.token).await.unwrap();
    q.heartbeat(&id, lease.token, Some(r#"{"step":3}"#))
        .await
        .unwrap();
    let running = q.get(&id).await.unwrap().unwrap();
    assert_eq!(running.state, JobState::Running);
    assert_eq!(running.progress.as_deref(), Some(r#"{"step":3}"#));
    q.complete(&id, lease.token, r#"{"adapter":"s3://b/a"}"#)
        .await
        .unwrap();
    let done = q.get(&id).await.unwrap().unwrap();
    assert_eq!(done.state, JobState::Succeeded);
    assert_eq!(done.result.as_deref(), Some(r#"{"adapter":"s3://b/a"}"#));
    assert_eq!(q.pool_usage("cpu").await.unwrap().used, 0);
    assert_eq!(
        kinds(&q, &id).await,
        ["queued", "leased", "started", "succeeded"]
    );
    check_and_destroy(q, &["cpu"]).await;
}

async fn idempotency_keys_return_the_same_job_per_tenant(backend: Backend) {
    let q = queue(backend, "idem", QueueConfig::default()).await;
    let mut a = job("acme", 5);
    a.idempotency_key = Some("req-1".into());
    let first = q.enqueue(&a).await.unwrap();
    let again = q.enqueue(&a).await.unwrap();
    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(first.id, again.id);
    let mut other_tenant = a.clone();
    other_tenant.tenant = "globex".into();
    assert_ne!(q.enqueue(&other_tenant).await.unwrap().id, first.id);
    q.destroy().await.unwrap();
}

async fn priority_then_fifo_within_a_tenant_and_aging_prevents_starvation(backend: Backend) {
    let q = queue_with(backend, "prio", |c| c.aging_horizon_ms = 1_000).await;
    q.set_pool("cpu", 100).await.unwrap();
    let a = q.enqueue(&job("t", 5)).await.unwrap().id;
    let b = q.enqueue(&job("t", 5)).await.unwrap().id;
    let urgent = q.enqueue(&job("t", 9)).await.unwrap().id;
    let mut order = vec![];
    for _ in 0..3 {
        order.push(q.claim("cpu", "d", "").await.unwrap().unwrap().id);
    }
    assert_eq!(order, [urgent, a, b]);
    // A priority-0 job that waited 9 horizons ties with a fresh priority-9 job and,
    // being older, goes first.
    let old_low = q.enqueue(&job("t", 0)).await.unwrap().id;
    q.advance_clock(9_500).await.unwrap();
    let fresh_high = q.enqueue(&job("t", 9)).await.unwrap().id;
    assert_eq!(q.claim("cpu", "d", "").await.unwrap().unwrap().id, old_low);
    assert_eq!(
        q.claim("cpu", "d", "").await.unwrap().unwrap().id,
        fresh_high
    );
    q.destroy().await.unwrap();
}

async fn backlogged_tenants_share_by_weight_and_a_flood_cannot_starve_others(backend: Backend) {
    let q = queue_with_pool(backend, "fair", "gpu", 1).await;
    // The flooding tenant arrives first with far more work.
    flood(&q).await;
    let mut served: HashMap<String, u32> = HashMap::new();
    for _ in 0..200 {
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        *served.entry(lease.tenant.clone()).or_default() += 1;
        q.complete(&lease.id, lease.token, "{}").await.unwrap();
    }
    assert_shares_by_weight(&served);
    check_and_destroy(q, &["gpu"]).await;
}

async fn capacity_and_tenant_quotas_are_reserved_with_the_lease(backend: Backend) {
    let q = queue_with_pool(backend, "capacity", "gpu", 3).await;
    set_tenant(&q, "capped", |t| t.max_running = Some(1)).await;
    let mut two = job("wide", 5);
    two.gpus = 2;
    q.enqueue(&two).await.unwrap();
    q.enqueue(&two).await.unwrap();
    q.enqueue(&job("capped", 5)).await.unwrap();
    q.enqueue(&job("capped", 5)).await.unwrap();
    let mut pinned = job("wide", 9);
    pinned.pools = vec!["other".into()];
    q.enqueue(&pinned).await.unwrap();
    let l1 = q.claim("gpu", "d", "").await.unwrap().unwrap();
    let l2 = q.claim("gpu", "d", "").await.unwrap().unwrap();
    // 3 GPUs: one 2-GPU job and one capped job fit; the capped tenant's second job
    // exceeds its quota, the other 2-GPU job exceeds the pool.
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 3);
    assert!(q.claim("gpu", "d", "").await.unwrap().is_none());
    check_invariants(&q, &["gpu"]).await;
    let capped = if l1.tenant == "capped" { &l1 } else { &l2 };
    q.complete(&capped.id, capped.token, "{}").await.unwrap();
    let l3 = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(l3.tenant, "capped");
    assert!(matches!(
        q.claim("nowhere", "d", "").await,
        Err(QueueError::UnknownPool(_))
    ));
    check_and_destroy(q, &["gpu"]).await;
}

async fn an_expired_lease_is_suspect_and_stale_tokens_change_nothing(backend: Backend) {
    let q = queue_with(backend, "fence", |c| c.lease_ms = 1_000).await;
    q.set_pool("gpu", 1).await.unwrap();
    let id = q.enqueue(&job("t", 5)).await.unwrap().id;
    let first = q.claim("gpu", "d1", "").await.unwrap().unwrap();
    q.start(&id, first.token).await.unwrap();
    q.advance_clock(1_500).await.unwrap();
    assert_eq!(q.expire_leases(100).await.unwrap(), vec![id.clone()]);
    assert_eq!(q.get(&id).await.unwrap().unwrap().state, JobState::Suspect);
    // Never re-dispatched on its own.
    assert!(q.claim("gpu", "d2", "").await.unwrap().is_none());
    check_invariants(&q, &["gpu"]).await;
    // The dispatcher finds the attempt gone and requeues it; the new attempt gets a new token.
    assert_eq!(
        q.resolve_suspect(&id, first.token, SuspectVerdict::Requeue)
            .await
            .unwrap(),
        JobState::Queued
    );
    let second = q.claim("gpu", "d2", "").await.unwrap().unwrap();
    assert!(second.token > first.token);
    let before = q.get(&id).await.unwrap().unwrap();
    for stale in [
        q.complete(&id, first.token, "{}").await,
        q.heartbeat(&id, first.token, None).await.map(|_| ()),
        q.preempt(&id, first.token, tuneq_openapi::StopCause::Preemption, "x")
            .await,
        training_failed(&q, &id, first.token, "x", true)
            .await
            .map(|_| ()),
        q.start(&id, first.token).await,
    ] {
        assert!(matches!(stale, Err(QueueError::StaleToken(_))), "{stale:?}");
    }
    let after = q.get(&id).await.unwrap().unwrap();
    assert_eq!(before, after, "stale calls changed the job");
    assert_eq!(after.stalls, 1);
    q.complete(&id, second.token, "{}").await.unwrap();
    check_and_destroy(q, &["gpu"]).await;
}

async fn a_suspect_attempt_that_is_alive_is_adopted(backend: Backend) {
    let q = queue_with(backend, "adopt", |c| c.lease_ms = 1_000).await;
    q.set_pool("gpu", 1).await.unwrap();
    let id = q.enqueue(&job("t", 5)).await.unwrap().id;
    let lease = q.claim("gpu", "d1", "").await.unwrap().unwrap();
    q.advance_clock(2_000).await.unwrap();
    q.expire_leases(10).await.unwrap();
    assert_eq!(
        q.resolve_suspect(&id, lease.token, SuspectVerdict::Adopt)
            .await
            .unwrap(),
        JobState::Running
    );
    q.complete(&id, lease.token, "{}").await.unwrap();
    check_and_destroy(q, &["gpu"]).await;
}

async fn failures_retry_with_backoff_then_fail_for_good(backend: Backend) {
    let q = queue_with(backend, "retry", |c| {
        c.retry_base_ms = 1_000;
        c.retry_max_ms = 60_000;
    })
    .await;
    q.set_pool("gpu", 1).await.unwrap();
    let mut j = job("t", 5);
    j.max_attempts = 2;
    let id = q.enqueue(&j).await.unwrap().id;
    let first = q.claim("gpu", "d", "").await.unwrap().unwrap();
    let due = training_failed(&q, &id, first.token, "OOM", true)
        .await
        .unwrap()
        .unwrap();
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(record.state, JobState::Delayed);
    assert_eq!(
        record.state.public_status(),
        tuneq_openapi::JobStatus::Queued
    );
    assert_eq!(record.attempts, 1);
    assert!(
        due >= record.enqueued_ms + 1_000,
        "backoff of at least the base"
    );
    assert!(
        q.claim("gpu", "d", "").await.unwrap().is_none(),
        "not before its time"
    );
    q.advance_clock(1_300).await.unwrap();
    let second = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(second.attempts, 1);
    assert_eq!(
        training_failed(&q, &id, second.token, "OOM again", true)
            .await
            .unwrap(),
        None
    );
    let failed = q.get(&id).await.unwrap().unwrap();
    assert_eq!(failed.state, JobState::Failed);
    assert_eq!(failed.error.as_deref(), Some("OOM again"));
    // A non-retryable failure ends at once.
    let other = q.enqueue(&job("t", 5)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(
        training_failed(&q, &other, lease.token, "bad dataset", false)
            .await
            .unwrap(),
        None
    );
    check_and_destroy(q, &["gpu"]).await;
}

async fn preemption_keeps_the_place_in_line_and_the_retry_budget(backend: Backend) {
    let q = queue_with_pool(backend, "preempt", "spot", 1).await;
    let first = q.enqueue(&job("t", 5)).await.unwrap().id;
    let second = q.enqueue(&job("t", 5)).await.unwrap().id;
    let lease = q.claim("spot", "d", "").await.unwrap().unwrap();
    assert_eq!(lease.id, first);
    q.start(&first, lease.token).await.unwrap();
    reclaim(&q, &first, lease.token).await;
    let record = q.get(&first).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.preemptions, record.attempts),
        (JobState::Queued, 1, 0)
    );
    let again = q.claim("spot", "d", "").await.unwrap().unwrap();
    assert_eq!(
        again.id, first,
        "the preempted job goes before later arrivals"
    );
    assert_eq!(again.preemptions, 1);
    q.complete(&first, again.token, "{}").await.unwrap();
    assert_eq!(q.claim("spot", "d", "").await.unwrap().unwrap().id, second);
    check_and_destroy(q, &["spot"]).await;
}

async fn a_job_moved_on_after_preemptions_runs_only_on_its_new_pools(backend: Backend) {
    let q = queue_with_pool(backend, "move", "spot", 1).await;
    q.set_pool("on-demand", 1).await.unwrap();
    let id = enqueue_spot_first(&q).await;
    let lease = q.claim("spot", "d", "").await.unwrap().unwrap();
    q.start(&id, lease.token).await.unwrap();
    // A bad pool list changes nothing.
    for bad in [vec![], vec!["a,b".to_string()]] {
        assert!(matches!(
            q.preempt_and_move(
                &id,
                lease.token,
                tuneq_openapi::StopCause::Preemption,
                "x",
                &bad,
                "y"
            )
            .await,
            Err(QueueError::Invalid { .. })
        ));
    }
    q.preempt_and_move(
        &id,
        lease.token,
        tuneq_openapi::StopCause::Preemption,
        "spot node reclaimed",
        &["on-demand".to_string()],
        "preempted 3 times on spot within 1h",
    )
    .await
    .unwrap();
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (
            record.state,
            record.preemptions,
            record.attempts,
            record.pools.clone()
        ),
        (JobState::Queued, 1, 0, vec!["on-demand".to_string()])
    );
    assert!(
        q.claim("spot", "d", "").await.unwrap().is_none(),
        "spot no longer takes it"
    );
    let again = q.claim("on-demand", "d", "").await.unwrap().unwrap();
    assert_eq!(again.id, id);
    let kinds = kinds(&q, &id).await;
    let preempted = kinds.iter().position(|k| k == "preempted").unwrap();
    assert_eq!(kinds[preempted + 1], "moved", "{kinds:?}");
    // A stale token moves nothing.
    assert!(
        q.preempt_and_move(
            &id,
            lease.token,
            tuneq_openapi::StopCause::Preemption,
            "x",
            &["spot".to_string()],
            "y"
        )
        .await
        .is_err()
    );
    assert_eq!(q.get(&id).await.unwrap().unwrap().pools, ["on-demand"]);
    check_and_destroy(q, &["spot", "on-demand"]).await;
}

async fn an_attempt_that_found_no_node_is_back_in_line_without_a_preemption(backend: Backend) {
    let q = queue_with_pool(backend, "unplaced", "spot", 1).await;
    q.set_pool("on-demand", 1).await.unwrap();
    let id = enqueue_spot_first(&q).await;
    // No node on its only pool for now: back in line where it was, nothing counted.
    let lease = q.claim("spot", "d", "").await.unwrap().unwrap();
    q.start(&id, lease.token).await.unwrap();
    q.unplaced(&id, lease.token, "no node on spot", None, "")
        .await
        .unwrap();
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.preemptions, record.attempts),
        (JobState::Queued, 0, 0)
    );
    assert_eq!(record.pools, ["spot", "on-demand"]);
    // Again, now moved on to the rest of its pools.
    let lease = q.claim("spot", "d", "").await.unwrap().unwrap();
    q.unplaced(
        &id,
        lease.token,
        "no node on spot",
        Some(&["on-demand".to_string()]),
        "no node on spot within its placement timeout",
    )
    .await
    .unwrap();
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (record.preemptions, record.attempts, record.pools.clone()),
        (0, 0, vec!["on-demand".to_string()])
    );
    let kinds = kinds(&q, &id).await;
    assert!(!kinds.iter().any(|k| k == "preempted"), "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| *k == "unplaced").count(),
        2,
        "{kinds:?}"
    );
    let unplaced = kinds.iter().rposition(|k| k == "unplaced").unwrap();
    assert_eq!(kinds[unplaced + 1], "moved", "{kinds:?}");
    assert!(matches!(
        q.unplaced(&id, lease.token, "x", Some(&[]), "y").await,
        Err(QueueError::Invalid { .. })
    ));
    assert_eq!(q.claim("on-demand", "d", "").await.unwrap().unwrap().id, id);
    check_and_destroy(q, &["spot", "on-demand"]).await;
}

async fn cancel_is_immediate_when_waiting_and_holds_capacity_until_the_attempt_is_gone(
    backend: Backend,
) {
    let q = queue_with_pool(backend, "cancel", "gpu", 1).await;
    let waiting = q.enqueue(&job("t", 9)).await.unwrap().id;
    assert_eq!(q.cancel(&waiting).await.unwrap(), JobState::Cancelled);
    let running = q.enqueue(&job("t", 5)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(lease.id, running, "a cancelled job is never dispatched");
    assert_eq!(q.cancel(&running).await.unwrap(), JobState::CancelRequested);
    assert!(matches!(
        q.heartbeat(&running, lease.token, None).await,
        Err(QueueError::StaleToken(_))
    ));
    q.enqueue(&job("t", 5)).await.unwrap();
    assert!(
        q.claim("gpu", "d", "").await.unwrap().is_none(),
        "capacity still held"
    );
    check_invariants(&q, &["gpu"]).await;
    q.confirm_cancelled(&running).await.unwrap();
    assert_eq!(
        q.get(&running).await.unwrap().unwrap().state,
        JobState::Cancelled
    );
    assert!(q.claim("gpu", "d", "").await.unwrap().is_some());
    assert_eq!(
        q.cancel(&waiting).await.unwrap(),
        JobState::Cancelled,
        "idempotent"
    );
    assert!(matches!(
        q.cancel("j999999999999").await,
        Err(QueueError::NotFound(_))
    ));
    check_and_destroy(q, &["gpu"]).await;
}

async fn events_page_by_cursor_both_ways_and_positions_count_who_is_ahead(backend: Backend) {
    let q = queue_with_pool(backend, "events", "gpu", 1).await;
    let id = q.enqueue(&job("t", 5)).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.start(&id, lease.token).await.unwrap();
    reclaim(&q, &id, lease.token).await;
    let all = q.events(&id, None, 10, false).await.unwrap();
    assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(all[3].message, RECLAIMED);
    let page = q.events(&id, Some(2), 1, false).await.unwrap();
    assert_eq!(page[0].seq, 3);
    let newest = q.events(&id, None, 2, true).await.unwrap();
    assert_eq!(newest.iter().map(|e| e.seq).collect::<Vec<_>>(), [4, 3]);
    let older = q.events(&id, Some(3), 10, true).await.unwrap();
    assert_eq!(older.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 1]);

    let second = q.enqueue(&job("t", 5)).await.unwrap().id;
    for _ in 0..3 {
        q.enqueue(&job("other", 5)).await.unwrap();
    }
    let pos = q.position(&second).await.unwrap();
    assert_eq!(pos.ahead_in_tenant, 1, "the preempted job is ahead");
    assert_eq!(
        pos.ahead,
        1 + 2,
        "and, at equal weights, two of the other tenant's"
    );
    assert_eq!(pos.estimated_start_ms, None, "no run time known yet");
    // The other tenant's job runs for 10 s on the 1-slot pool (fair share: tenant "t"
    // already had a turn); still 1 + 2 ahead, at 10 s each.
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.start(&lease.id, lease.token).await.unwrap();
    q.advance_clock(10_000).await.unwrap();
    q.complete(&lease.id, lease.token, "{}").await.unwrap();
    let pos = q.position(&second).await.unwrap();
    assert_eq!(lease.tenant, "other");
    assert_eq!(pos.ahead, 3);
    let now = q.get(&second).await.unwrap().unwrap().enqueued_ms + 10_000;
    let wait = pos.estimated_start_ms.unwrap() - now;
    assert_eq!(wait, 30_000, "three runs of 10 s ahead");

    // status reads the same record (less the payload) and the same standing in one call;
    // naming another tenant than the job's costs a second read, not a wrong answer.
    let (record, standing) = q.status(&second, "t").await.unwrap().unwrap();
    let (_, misnamed) = q.status(&second, "other").await.unwrap().unwrap();
    let same_place = |p: Option<Position>| p.map(|p| (p.ahead_in_tenant, p.ahead));
    assert_eq!(same_place(misnamed), same_place(standing));
    let mut full = q.get(&second).await.unwrap().unwrap();
    assert!(!full.payload.is_empty());
    full.payload.clear();
    assert_eq!(record, full);
    let standing = standing.expect("a queued job stands somewhere");
    assert_eq!(
        (standing.ahead_in_tenant, standing.ahead),
        (pos.ahead_in_tenant, pos.ahead)
    );
    assert_eq!(
        standing.estimated_start_ms, pos.estimated_start_ms,
        "the same estimate, read a moment later"
    );
    // A pool resized through this queue counts at once, though the domain's figures are
    // otherwise kept for a second: three runs ahead on three slots is one wave of 10 s.
    q.set_pool("gpu", 3).await.unwrap();
    let (_, resized) = q.status(&second, "t").await.unwrap().unwrap();
    let sooner = pos.estimated_start_ms.unwrap() - resized.unwrap().estimated_start_ms.unwrap();
    assert_eq!(sooner, 20_000, "two waves sooner");
    q.set_pool("gpu", 1).await.unwrap();
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.start(&lease.id, lease.token).await.unwrap();
    let (running, standing) = q.status(&lease.id, &lease.tenant).await.unwrap().unwrap();
    assert_eq!(running.state, JobState::Running);
    assert_eq!(running.pool.as_deref(), Some("gpu"));
    assert_eq!(standing, None, "only a queued job has a place in the queue");
    assert_eq!(q.status("j999999999999", "t").await.unwrap(), None);
    q.destroy().await.unwrap();
}

async fn retention_bounds_finished_jobs(backend: Backend) {
    let q = queue_with(backend, "retention", |c| c.retention_count = 5).await;
    q.set_pool("gpu", 1).await.unwrap();
    let mut ids = vec![];
    for _ in 0..30 {
        let id = q.enqueue(&job("t", 5)).await.unwrap().id;
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        q.complete(&id, lease.token, "{}").await.unwrap();
        ids.push(id);
    }
    q.trim(100).await.unwrap();
    let kept: Vec<String> = q
        .keys()
        .await
        .unwrap()
        .into_iter()
        .filter(|k| k.contains(":job:"))
        .collect();
    assert_eq!(kept.len(), 5);
    assert!(
        q.get(&ids[0]).await.unwrap().is_none(),
        "the oldest went first"
    );
    assert!(q.get(&ids[29]).await.unwrap().is_some());
    q.destroy().await.unwrap();
}

/// README: finished jobs are kept "by age and count": with room to spare by count, a
/// finished job goes once it is older than `retention_ms`, and not a moment before.
async fn retention_removes_finished_jobs_past_their_age(backend: Backend) {
    let q = queue_with(backend, "retention-age", |c| {
        c.retention_ms = 60_000;
        c.retention_count = 1_000;
    })
    .await;
    q.set_pool("gpu", 1).await.unwrap();
    let finish = |q: Queue| async move {
        let id = q.enqueue(&job("t", 5)).await.unwrap().id;
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        q.complete(&id, lease.token, "{}").await.unwrap();
        id
    };
    let mut old = vec![];
    for _ in 0..3 {
        old.push(finish(q.clone()).await);
    }
    q.advance_clock(30_000).await.unwrap();
    let mut young = vec![];
    for _ in 0..2 {
        young.push(finish(q.clone()).await);
    }
    assert_eq!(q.trim(100).await.unwrap(), 0, "none is past its age yet");
    for id in old.iter().chain(&young) {
        assert!(q.get(id).await.unwrap().is_some(), "{id} went too early");
    }
    // The first three are now past 60 s, the last two at about half of it.
    q.advance_clock(30_001).await.unwrap();
    assert_eq!(q.trim(100).await.unwrap(), 3);
    for id in &old {
        assert!(q.get(id).await.unwrap().is_none(), "{id} outlived its age");
    }
    for id in &young {
        assert!(q.get(id).await.unwrap().is_some(), "{id} went too early");
    }
    q.destroy().await.unwrap();
}

async fn a_retried_claim_returns_the_same_lease(backend: Backend) {
    let q = queue_with_pool(backend, "claimreq", "gpu", 2).await;
    q.enqueue(&job("t", 5)).await.unwrap();
    q.enqueue(&job("t", 5)).await.unwrap();
    let first = q.claim("gpu", "d1", "req-7").await.unwrap().unwrap();
    let retried = q.claim("gpu", "d1", "req-7").await.unwrap().unwrap();
    assert_eq!(first, retried);
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 1, "charged once");
    q.destroy().await.unwrap();
}

async fn concurrent_claimers_never_double_lease(backend: Backend) {
    let q = queue_with_pool(backend, "race", "gpu", 4).await;
    for i in 0..400 {
        q.enqueue(&job(&format!("t{}", i % 5), (i % 10) as u8))
            .await
            .unwrap();
    }
    let mut tasks = vec![];
    for w in 0..8 {
        let q = q.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = vec![];
            loop {
                match q.claim("gpu", &format!("w{w}"), "").await.unwrap() {
                    Some(lease) => {
                        q.start(&lease.id, lease.token).await.unwrap();
                        q.complete(&lease.id, lease.token, "{}").await.unwrap();
                        mine.push(lease.id);
                    }
                    None if q.pool_usage("gpu").await.unwrap().used == 0 => {
                        let left = q.claim("gpu", "probe", "").await.unwrap();
                        if let Some(l) = left {
                            q.complete(&l.id, l.token, "{}").await.unwrap();
                            mine.push(l.id);
                            continue;
                        }
                        return mine;
                    }
                    None => tokio::task::yield_now().await,
                }
            }
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        for id in t.await.unwrap() {
            assert!(seen.insert(id.clone()), "{id} was leased twice");
        }
    }
    assert_eq!(seen.len(), 400);
    check_and_destroy(q, &["gpu"]).await;
}

/// One step of a random run (see [`random_sequences_keep_every_invariant`]).
#[derive(Debug, Clone)]
enum Op {
    /// A job for tenant x/y/z, pinned to no pool, pool a or pool b, maybe with one of
    /// a few idempotency keys (so repeats happen).
    Enqueue {
        tenant: usize,
        priority: u8,
        pools: usize,
        key: Option<u8>,
    },
    Claim {
        pool_a: bool,
    },
    /// Ends a live attempt: complete, fail (retryable), preempt, or complete and
    /// claim the next job in one step.
    Finish {
        pick: usize,
        how: u8,
    },
    Heartbeat {
        pick: usize,
    },
    Cancel {
        pick: usize,
    },
    /// Pauses a job (or resumes it, with `resume`); the dispatcher's stop of a pausing
    /// attempt is a `Finish` that preempts.
    Pause {
        pick: usize,
        resume: bool,
    },
    /// Moves the clock; expired leases are settled, adopted or requeued.
    Expire {
        advance_ms: u64,
        adopt: bool,
    },
    /// Replays a token that has been superseded.
    Stale {
        pick: usize,
    },
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0..3usize, 0..10u8, 0..3usize, proptest::option::of(0..4u8)).prop_map(
            |(tenant, priority, pools, key)| Op::Enqueue { tenant, priority, pools, key }
        ),
        3 => any::<bool>().prop_map(|pool_a| Op::Claim { pool_a }),
        2 => (any::<usize>(), 0..4u8).prop_map(|(pick, how)| Op::Finish { pick, how }),
        1 => any::<usize>().prop_map(|pick| Op::Heartbeat { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, resume)| Op::Pause { pick, resume }),
        1 => (0..2_500u64, any::<bool>()).prop_map(|(advance_ms, adopt)| Op::Expire { advance_ms, adopt }),
        1 => any::<usize>().prop_map(|pick| Op::Stale { pick }),
    ]
}

/// What the test knows the queue must hold.
#[derive(Default)]
struct Model {
    /// Every accepted job, in acceptance order.
    ids: Vec<String>,
    /// job -> its live token.
    live: HashMap<String, u64>,
    /// Superseded (job, token) pairs.
    stale: Vec<(String, u64)>,
    cancelled: HashSet<String>,
    /// (tenant, idempotency key) -> job.
    keyed: HashMap<(usize, u8), String>,
}

fn pick<T: Clone>(items: &[T], n: usize) -> Option<T> {
    (!items.is_empty()).then(|| items[n % items.len()].clone())
}

/// Runs `ops` on a fresh domain, checking after every step: the storage invariants
/// ([`check_invariants`]), no acknowledged job lost, at most one live token per job,
/// stale tokens refused and changing nothing, cancelled jobs never dispatched,
/// idempotency keys answering with their job, and FIFO among equals: a claim never
/// passes over an older never-dispatched job of the same tenant, priority and pools.
async fn run_ops(backend: Backend, ops: Vec<Op>) {
    let q = queue_with(backend, "random", |c| c.lease_ms = 1_000).await;
    q.set_pool("a", 2).await.unwrap();
    q.set_pool("b", 1).await.unwrap();
    let mut m = Model::default();
    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        match op.clone() {
            Op::Enqueue {
                tenant,
                priority,
                pools,
                key,
            } => {
                let mut j = job(["x", "y", "z"][tenant], priority);
                j.pools = match pools {
                    0 => vec![],
                    1 => vec!["a".into()],
                    _ => vec!["b".into()],
                };
                j.idempotency_key = key.map(|k| format!("key-{k}"));
                let accepted = q.enqueue(&j).await.unwrap();
                match key.and_then(|k| m.keyed.get(&(tenant, k))) {
                    Some(first) => {
                        assert!(accepted.duplicate, "{ctx}: a repeated key made a new job");
                        assert_eq!(
                            &accepted.id, first,
                            "{ctx}: a repeated key answered another job"
                        );
                    }
                    None => {
                        assert!(!accepted.duplicate, "{ctx}");
                        if let Some(k) = key {
                            m.keyed.insert((tenant, k), accepted.id.clone());
                        }
                        m.ids.push(accepted.id);
                    }
                }
            }
            Op::Claim { pool_a } => {
                let pool = if pool_a { "a" } else { "b" };
                let before = q.inspect().await.unwrap();
                if let Some(lease) = q.claim(pool, "d", "").await.unwrap() {
                    assert!(
                        !m.cancelled.contains(&lease.id),
                        "{ctx}: cancelled job dispatched"
                    );
                    assert!(!m.live.contains_key(&lease.id), "{ctx}: second live lease");
                    let fresh =
                        |r: &JobRecord| r.attempts == 0 && r.preemptions == 0 && r.stalls == 0;
                    let (claimed, _) = before.jobs.iter().find(|(r, _)| r.id == lease.id).unwrap();
                    assert_eq!(
                        claimed.state,
                        JobState::Queued,
                        "{ctx}: claimed a job not in line"
                    );
                    if fresh(claimed) {
                        for (other, _) in &before.jobs {
                            let equal = other.tenant == claimed.tenant
                                && other.priority == claimed.priority
                                && other.pools == claimed.pools;
                            assert!(
                                !(equal
                                    && other.state == JobState::Queued
                                    && fresh(other)
                                    && other.id < claimed.id),
                                "{ctx}: {} claimed before the older equal {}",
                                claimed.id,
                                other.id
                            );
                        }
                    }
                    m.live.insert(lease.id, lease.token);
                }
            }
            Op::Finish { pick: n, how } => {
                let live: Vec<(String, u64)> = sorted(&m.live);
                if let Some((id, token)) = pick(&live, n) {
                    m.live.remove(&id);
                    m.stale.push((id.clone(), token));
                    match how {
                        0 => q.complete(&id, token, "{}").await.unwrap(),
                        1 => {
                            training_failed(&q, &id, token, "x", true).await.unwrap();
                        }
                        2 => q
                            .preempt(&id, token, tuneq_openapi::StopCause::Preemption, "spot")
                            .await
                            .unwrap(),
                        _ => {
                            let pool = if n % 2 == 0 { "a" } else { "b" };
                            let next = q.complete_and_claim(&id, token, "{}", pool, "d");
                            if let Some(lease) = next.await.unwrap() {
                                assert!(
                                    !m.cancelled.contains(&lease.id),
                                    "{ctx}: cancelled job dispatched"
                                );
                                assert!(
                                    !m.live.contains_key(&lease.id),
                                    "{ctx}: second live lease"
                                );
                                m.live.insert(lease.id, lease.token);
                            }
                        }
                    }
                }
            }
            Op::Heartbeat { pick: n } => {
                if let Some((id, token)) = pick(&sorted(&m.live), n) {
                    q.heartbeat(&id, token, Some("{}")).await.unwrap();
                }
            }
            Op::Cancel { pick: n } => {
                if let Some(id) = pick(&m.ids, n) {
                    let state = q.cancel(&id).await.unwrap();
                    if let Some(t) = m.live.remove(&id) {
                        m.stale.push((id.clone(), t));
                    }
                    if state == JobState::CancelRequested {
                        q.confirm_cancelled(&id).await.unwrap();
                    }
                    if q.get(&id).await.unwrap().unwrap().state == JobState::Cancelled {
                        m.cancelled.insert(id);
                    }
                }
            }
            Op::Pause { pick: n, resume } => {
                if let Some(id) = pick(&m.ids, n) {
                    let before = q.get(&id).await.unwrap().unwrap();
                    let outcome = if resume {
                        q.resume(&id).await
                    } else {
                        q.pause(&id).await
                    };
                    let after = q.get(&id).await.unwrap().unwrap();
                    match outcome {
                        Ok(state) => assert_eq!(state, after.state, "{ctx}"),
                        Err(QueueError::WrongState { .. }) => {
                            assert_eq!(before, after, "{ctx}: a refused call changed the job")
                        }
                        Err(e) => panic!("{ctx}: {e}"),
                    }
                    assert!(
                        !(after.state == JobState::Paused && after.pause_requested),
                        "{ctx}: a paused job still waits for a pause"
                    );
                }
            }
            Op::Expire { advance_ms, adopt } => {
                q.advance_clock(advance_ms).await.unwrap();
                q.expire_leases(50).await.unwrap();
                for id in q.suspects(50).await.unwrap() {
                    let token = m.live.remove(&id).unwrap();
                    let verdict = if adopt {
                        SuspectVerdict::Adopt
                    } else {
                        SuspectVerdict::Requeue
                    };
                    if q.resolve_suspect(&id, token, verdict).await.unwrap() == JobState::Running {
                        m.live.insert(id, token);
                    } else {
                        m.stale.push((id, token));
                    }
                }
            }
            Op::Stale { pick: n } => {
                if let Some((id, token)) = pick(&m.stale, n) {
                    let before = q.get(&id).await.unwrap();
                    let outcome = q.complete(&id, token, "{}").await;
                    // The one success: repeating the completion this very attempt made
                    // (idempotent, so a lost reply is safe); it changes nothing either.
                    let own_repeat = before
                        .as_ref()
                        .is_some_and(|r| r.state == JobState::Succeeded && r.epoch == token);
                    assert!(
                        matches!(
                            outcome,
                            Err(QueueError::StaleToken(_)) | Err(QueueError::WrongState { .. })
                        ) || (own_repeat && outcome.is_ok()),
                        "{ctx}: stale token accepted: {outcome:?}"
                    );
                    assert_eq!(
                        before,
                        q.get(&id).await.unwrap(),
                        "{ctx}: stale call changed the job"
                    );
                }
            }
        }
        check_invariants(&q, &["a", "b"]).await;
        let seen = q.inspect().await.unwrap();
        let present: HashSet<&str> = seen.jobs.iter().map(|(r, _)| r.id.as_str()).collect();
        for id in &m.ids {
            assert!(present.contains(id.as_str()), "{ctx}: job {id} lost");
        }
        for (record, _) in &seen.jobs {
            let live = matches!(record.state, JobState::Leased | JobState::Running);
            assert_eq!(
                live,
                m.live.contains_key(&record.id),
                "{ctx}: live leases of {}",
                record.id
            );
            if let Some(token) = m.live.get(&record.id) {
                assert_eq!(record.epoch, *token, "{ctx}: one live token per job");
            }
        }
    }
    q.destroy().await.unwrap();
}

fn sorted(live: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = live.iter().map(|(i, t)| (i.clone(), *t)).collect();
    v.sort();
    v
}

/// A proptest state machine over [`Op`]: random operation sequences from several
/// dispatchers, shrunk to the shortest failing one when an invariant breaks.
async fn random_sequences_keep_every_invariant(backend: Backend) {
    use proptest::test_runner::{Config, TestRunner};
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut runner = TestRunner::new(Config {
            cases: 24,
            failure_persistence: None,
            ..Config::default()
        });
        let outcome = runner.run(&proptest::collection::vec(op(), 1..90), |ops| {
            handle.block_on(run_ops(backend, ops));
            Ok(())
        });
        if let Err(e) = outcome {
            panic!("{e}");
        }
    })
    .await
    .unwrap();
}

async fn delete_on_completion_leaves_no_keys_behind(backend: Backend) {
    let q = queue_with(backend, "remove", |c| c.retention_count = 0).await;
    q.set_pool("gpu", 1).await.unwrap();
    for _ in 0..10 {
        let id = q.enqueue(&job("t", 5)).await.unwrap().id;
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        q.complete(&id, lease.token, "{}").await.unwrap();
        assert!(q.get(&id).await.unwrap().is_none());
    }
    let left = q.keys().await.unwrap();
    let per_job: Vec<&String> = left
        .iter()
        .filter(|k| k.contains(":job:") || k.contains(":payload:") || k.contains(":events:"))
        .collect();
    assert!(per_job.is_empty(), "{per_job:?}");
    q.destroy().await.unwrap();
}

async fn finished_jobs_that_asked_for_notice_wait_in_the_outbox_until_acknowledged(
    backend: Backend,
) {
    let q = queue_with(backend, "outbox", |c| c.retention_count = 0).await;
    q.set_pool("gpu", 1).await.unwrap();
    let mut noisy = job("acme", 5);
    noisy.notify = true;
    let done = q.enqueue(&noisy).await.unwrap().id;
    let quiet = q.enqueue(&job("acme", 5)).await.unwrap().id;
    let cancelled = q.enqueue(&noisy).await.unwrap().id;
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(lease.id, done);
    q.complete(&done, lease.token, "{}").await.unwrap();
    q.cancel(&cancelled).await.unwrap();
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.complete(&quiet, lease.token, "{}").await.unwrap();

    // Deleted at completion (retention 0), yet the notices carry what they need.
    let due = q.due_deliveries(10).await.unwrap();
    let seen: Vec<(&str, &str, &str)> = due
        .iter()
        .map(|d| (d.job_id.as_str(), d.state.as_str(), d.tenant.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (done.as_str(), "succeeded", "acme"),
            (cancelled.as_str(), "cancelled", "acme")
        ]
    );
    q.retry_delivery(&due[0], 5_000).await.unwrap();
    q.ack_delivery(&due[1]).await.unwrap();
    assert!(
        q.due_deliveries(10).await.unwrap().is_empty(),
        "not before its retry time"
    );
    q.advance_clock(5_001).await.unwrap();
    let again = q.due_deliveries(10).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].job_id, done);
    q.ack_delivery(&again[0]).await.unwrap();
    q.advance_clock(60_000).await.unwrap();
    assert!(q.due_deliveries(10).await.unwrap().is_empty());
    q.destroy().await.unwrap();
}

async fn bulk_enqueue_accepts_or_refuses_each_job_on_its_own(backend: Backend) {
    let q = queue_with_pool(backend, "bulk", "gpu", 1).await;
    set_tenant(&q, "capped", |t| t.max_waiting = Some(2)).await;
    let mut jobs: Vec<NewJob> = (0..1200)
        .map(|i| job(&format!("t{}", i % 7), (i % 10) as u8))
        .collect();
    jobs[10].priority = 12; // invalid
    jobs[20].idempotency_key = Some("k".into());
    jobs[30].idempotency_key = Some("k".into());
    jobs[30].tenant = jobs[20].tenant.clone();
    for i in [600, 601, 602] {
        jobs[i].tenant = "capped".into();
    }
    let out = q.enqueue_bulk(&jobs).await.unwrap();
    assert_eq!(out.len(), 1200);
    assert!(matches!(
        out[10],
        Err(QueueError::Invalid {
            field: "priority",
            ..
        })
    ));
    let first = out[20].as_ref().unwrap();
    let dup = out[30].as_ref().unwrap();
    assert!(!first.duplicate && dup.duplicate && first.id == dup.id);
    assert!(out[600].is_ok() && out[601].is_ok());
    assert!(matches!(out[602], Err(QueueError::OverQuota(_))));
    assert_eq!(
        out.iter()
            .filter(|r| r.as_ref().is_ok_and(|e| !e.duplicate))
            .count(),
        1200 - 3
    );
    // Bulk-enqueued jobs are served like any others: tenants by fair share (all at zero
    // virtual time, so by name: "capped" first), then by priority within the tenant.
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(lease.tenant, "capped");
    assert_eq!(q.get(&lease.id).await.unwrap().unwrap().priority, 1);
    check_and_destroy(q, &["gpu"]).await;
}

async fn the_catalog_keeps_entries_per_owner_and_pages_newest_first(backend: Backend) {
    let q = queue(backend, "catalog", QueueConfig::default()).await;
    for i in 0..7 {
        let created = q
            .create_entry(
                "file",
                "acme",
                &format!("file-{i}"),
                &format!("{{\"n\":{i}}}"),
            )
            .await
            .unwrap();
        assert!(created);
    }
    assert!(
        !q.create_entry("file", "acme", "file-3", "{}")
            .await
            .unwrap(),
        "ids are unique"
    );
    q.create_entry("file", "other", "file-9", "{}")
        .await
        .unwrap();
    assert_eq!(q.count_entries("file", "acme").await.unwrap(), 7);

    let first = q.list_entries("file", "acme", None, 3).await.unwrap();
    let ids: Vec<&str> = first.entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["file-6", "file-5", "file-4"]);
    assert!(first.has_more);
    let mut all = ids.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut after = first.entries.last().map(|e| e.id.clone());
    loop {
        let page = q
            .list_entries("file", "acme", after.as_deref(), 3)
            .await
            .unwrap();
        all.extend(page.entries.iter().map(|e| e.id.clone()));
        after = page.entries.last().map(|e| e.id.clone());
        if !page.has_more {
            break;
        }
    }
    assert_eq!(
        all,
        (0..7)
            .rev()
            .map(|i| format!("file-{i}"))
            .collect::<Vec<_>>()
    );
    assert!(
        !all.contains(&"file-9".to_string()),
        "another owner's entries never show"
    );

    let entry = q
        .get_entry("file", "acme", "file-2")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(entry.body, r#"{"n":2}"#);
    assert!(entry.created_ms > 0);
    assert!(
        q.get_entry("file", "other", "file-2")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        q.update_entry("file", "acme", "file-2", "{}")
            .await
            .unwrap()
    );
    assert_eq!(
        q.get_entry("file", "acme", "file-2")
            .await
            .unwrap()
            .unwrap()
            .body,
        "{}"
    );
    assert!(!q.update_entry("file", "acme", "nope", "{}").await.unwrap());
    assert!(q.delete_entry("file", "acme", "file-2").await.unwrap());
    assert!(!q.delete_entry("file", "acme", "file-2").await.unwrap());
    assert_eq!(q.count_entries("file", "acme").await.unwrap(), 6);
    assert!(matches!(
        q.list_entries("file", "acme", Some("file-2"), 3).await,
        Err(QueueError::Invalid { field: "after", .. })
    ));
    assert!(matches!(
        q.create_entry("file", "acme:x", "f", "{}").await,
        Err(QueueError::Invalid { field: "owner", .. })
    ));
    q.destroy().await.unwrap();
}

async fn a_catalog_swap_writes_only_over_the_body_it_expects(backend: Backend) {
    let q = queue(backend, "swap", QueueConfig::default()).await;
    q.create_entry("secret", "acme", "current", "v1")
        .await
        .unwrap();
    assert_eq!(
        q.swap_entry("secret", "acme", "current", "v1", "v2")
            .await
            .unwrap(),
        Swap::Swapped
    );
    // A writer that read v1 before the swap landed changes nothing.
    assert_eq!(
        q.swap_entry("secret", "acme", "current", "v1", "v3")
            .await
            .unwrap(),
        Swap::Changed
    );
    // A repeat of the swap that landed (its reply lost) reports it.
    assert_eq!(
        q.swap_entry("secret", "acme", "current", "v1", "v2")
            .await
            .unwrap(),
        Swap::Swapped
    );
    let body = q.get_entry("secret", "acme", "current").await.unwrap();
    assert_eq!(body.unwrap().body, "v2");
    assert_eq!(
        q.swap_entry("secret", "acme", "nope", "v1", "v2")
            .await
            .unwrap(),
        Swap::Missing
    );
    // Many writers at once, each reading and swapping until its change lands: every
    // change is kept (each appends its mark to the body).
    let writers = (0..8).map(|w| {
        let q = q.clone();
        async move {
            loop {
                let read = q.get_entry("secret", "acme", "current").await.unwrap();
                let read = read.unwrap().body;
                let changed = format!("{read},w{w}");
                let swap = q.swap_entry("secret", "acme", "current", &read, &changed);
                if swap.await.unwrap() == Swap::Swapped {
                    break;
                }
            }
        }
    });
    futures::future::join_all(writers).await;
    let body = q.get_entry("secret", "acme", "current").await.unwrap();
    let body = body.unwrap().body;
    for w in 0..8 {
        assert!(body.contains(&format!(",w{w}")), "w{w} was lost: {body}");
    }
    q.destroy().await.unwrap();
}

/// Finished jobs of `tenant` that asked for notice, cancelled at once: their deliveries.
async fn notices(q: &Queue, tenant: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let mut asked = job(tenant, 5);
        asked.notify = true;
        let id = q.enqueue(&asked).await.unwrap().id;
        q.cancel(&id).await.unwrap();
        ids.push(id);
    }
    ids
}

async fn a_tenants_backlog_of_sends_cannot_hide_another_tenants(backend: Backend) {
    let q = queue(backend, "sends", QueueConfig::default()).await;
    let flood = notices(&q, "flood", 30).await;
    q.advance_clock(1_000).await.unwrap();
    let quiet = notices(&q, "quiet", 1).await;
    // Outcomes are filed in order; each is handed to its tenant's send queue.
    let due = q.due_deliveries(100).await.unwrap();
    assert_eq!(due.len(), 31);
    for delivery in &due {
        assert!(q.hand_over_delivery(delivery).await.unwrap());
        assert!(
            !q.hand_over_delivery(delivery).await.unwrap(),
            "handed over twice"
        );
    }
    assert!(q.due_deliveries(100).await.unwrap().is_empty());

    // Two tenants' worth, two per tenant: the flood's oldest two and the quiet one's.
    let sends = q.due_sends(2, 2).await.unwrap();
    let seen: Vec<&str> = sends.iter().map(|d| d.tenant.as_str()).collect();
    assert_eq!(seen, ["flood", "flood", "quiet"]);
    assert!(flood.contains(&sends[0].job_id) && flood.contains(&sends[1].job_id));
    assert_eq!(sends[2].job_id, quiet[0]);
    // A failed try waits for its retry; an acknowledged one is gone; the rest stay.
    q.retry_delivery(&sends[0], 5_000).await.unwrap();
    q.ack_delivery(&sends[2]).await.unwrap();
    let retried = sends[0].job_id.clone();
    let sends = q.due_sends(10, 100).await.unwrap();
    assert_eq!(sends.len(), 29);
    assert!(sends.iter().all(|d| d.tenant == "flood"));
    assert!(!sends.iter().any(|d| d.job_id == retried));
    q.advance_clock(5_001).await.unwrap();
    let sends = q.due_sends(10, 100).await.unwrap();
    assert_eq!(sends.len(), 30, "the retried one is due again");
    for delivery in &sends {
        q.ack_delivery(delivery).await.unwrap();
    }
    assert!(q.due_sends(10, 100).await.unwrap().is_empty());
    q.advance_clock(60_000).await.unwrap();
    assert!(q.due_sends(10, 100).await.unwrap().is_empty());
    assert!(q.due_deliveries(10).await.unwrap().is_empty());
    q.destroy().await.unwrap();
}

async fn a_worker_that_completes_and_claims_runs_each_job_through_every_step(backend: Backend) {
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

async fn complete_and_claim_with_a_stale_token_or_unknown_pool_changes_nothing(backend: Backend) {
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

async fn complete_and_claim_charges_capacity_and_quotas_exactly(backend: Backend) {
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

async fn tenants_share_by_weight_when_workers_complete_and_claim(backend: Backend) {
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

/// Instantiates each conformance test once per backend, as `redis::name`,
/// `cluster::name` and `embedded::name`.
async fn attempt_reports_append_events_once_and_stale_reports_change_nothing(backend: Backend) {
    let q = queue_with_pool(backend, "report", "cpu", 1).await;
    let id = q.enqueue(&job("acme", 5)).await.unwrap().id;
    let lease = q.claim_started("cpu", "d1", "").await.unwrap().unwrap();
    let step_fields = serde_json::json!({"step": 1});
    let step = [
        event(EventKind::Metrics, "", Some(&step_fields)),
        event(EventKind::Checkpoint, "step 1", None),
    ];
    q.report(&id, lease.token, 1, Some(r#"{"step":1}"#), &step)
        .await
        .unwrap();
    // The same report again (as after a lost reply) records nothing twice.
    q.report(&id, lease.token, 1, Some(r#"{"step":99}"#), &step)
        .await
        .unwrap();
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
async fn a_job_whose_attempt_vanished_three_times_fails(backend: Backend) {
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
async fn an_idle_tenant_banks_no_credit_while_away(backend: Backend) {
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
async fn retries_back_off_exponentially_with_bounded_jitter(backend: Backend) {
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

macro_rules! conformance {
    ($($(#[$attr:meta])* $name:ident),* $(,)?) => {
        mod redis {
            $( $(#[$attr])* async fn $name() { super::$name(super::Backend::Redis).await } )*
        }
        mod cluster {
            $( $(#[$attr])* async fn $name() { super::$name(super::Backend::Cluster).await } )*
        }
        mod embedded {
            $( $(#[$attr])* async fn $name() { super::$name(super::Backend::Embedded).await } )*
        }
    };
}

conformance! {
    #[tokio::test] a_worker_that_completes_and_claims_runs_each_job_through_every_step,
    #[tokio::test] complete_and_claim_with_a_stale_token_or_unknown_pool_changes_nothing,
    #[tokio::test] complete_and_claim_charges_capacity_and_quotas_exactly,
    #[tokio::test] tenants_share_by_weight_when_workers_complete_and_claim,
    #[tokio::test] the_catalog_keeps_entries_per_owner_and_pages_newest_first,
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)] a_catalog_swap_writes_only_over_the_body_it_expects,
    #[tokio::test] a_tenants_backlog_of_sends_cannot_hide_another_tenants,
    #[tokio::test] a_job_goes_from_queued_to_succeeded,
    #[tokio::test] attempt_reports_append_events_once_and_stale_reports_change_nothing,
    #[tokio::test] idempotency_keys_return_the_same_job_per_tenant,
    #[tokio::test] priority_then_fifo_within_a_tenant_and_aging_prevents_starvation,
    #[tokio::test] backlogged_tenants_share_by_weight_and_a_flood_cannot_starve_others,
    #[tokio::test] capacity_and_tenant_quotas_are_reserved_with_the_lease,
    #[tokio::test] an_expired_lease_is_suspect_and_stale_tokens_change_nothing,
    #[tokio::test] a_suspect_attempt_that_is_alive_is_adopted,
    #[tokio::test] failures_retry_with_backoff_then_fail_for_good,
    #[tokio::test] preemption_keeps_the_place_in_line_and_the_retry_budget,
    #[tokio::test] a_job_moved_on_after_preemptions_runs_only_on_its_new_pools,
    #[tokio::test] an_attempt_that_found_no_node_is_back_in_line_without_a_preemption,
    #[tokio::test] cancel_is_immediate_when_waiting_and_holds_capacity_until_the_attempt_is_gone,
    #[tokio::test] events_page_by_cursor_both_ways_and_positions_count_who_is_ahead,
    #[tokio::test] retention_bounds_finished_jobs,
    #[tokio::test] retention_removes_finished_jobs_past_their_age,
    #[tokio::test] a_retried_claim_returns_the_same_lease,
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)] concurrent_claimers_never_double_lease,
    #[tokio::test] random_sequences_keep_every_invariant,
    #[tokio::test] delete_on_completion_leaves_no_keys_behind,
    #[tokio::test] finished_jobs_that_asked_for_notice_wait_in_the_outbox_until_acknowledged,
    #[tokio::test] bulk_enqueue_accepts_or_refuses_each_job_on_its_own,
    #[tokio::test] a_job_whose_attempt_vanished_three_times_fails,
    #[tokio::test] an_idle_tenant_banks_no_credit_while_away,
    #[tokio::test] retries_back_off_exponentially_with_bounded_jitter,
    #[tokio::test] a_paused_waiting_job_is_never_dispatched_until_resumed,
    #[tokio::test] paused_jobs_count_against_the_waiting_quota_until_resumed_or_cancelled,
    #[tokio::test] pausing_a_running_job_holds_its_capacity_until_its_attempt_stops,
    #[tokio::test] an_attempt_that_fails_or_vanishes_while_pausing_leaves_its_job_paused,
}
