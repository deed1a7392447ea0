//! The conformance suite, run against every backend: a real redis-server started by the
//! harness, a real three-node Redis Cluster started by the harness, and the embedded
//! single-file store. Each test is written once, as `async fn name(backend: Backend)`;
//! `conformance!` at the end instantiates it per backend.
//!
//! - this file: the shared helpers and the invariants ([`check_invariants`]); the
//!   lifecycle, priorities and aging, tenant fairness, capacity and quotas, fencing,
//!   retries, preemption, cancel, events, retention, idempotency, concurrent claimers.
//! - `conformance/attempts.rs`: an attempt's reports, a vanished attempt, idle tenants,
//!   retry back-off.
//! - `conformance/keeping.rs`: deletion on completion, the outbox and send queues, bulk
//!   enqueue, the catalog.
//! - `conformance/pause.rs`: pause and resume.
//! - `conformance/random.rs`: random operation sequences with every invariant checked
//!   after each step.
//! - `conformance/workers.rs`: complete-and-claim.

#![allow(clippy::unwrap_used, missing_docs)]

#[path = "conformance/attempts.rs"]
mod attempts;
#[path = "conformance/keeping.rs"]
mod keeping;
#[path = "conformance/pause.rs"]
mod pause;
#[path = "conformance/random.rs"]
mod random;
mod support;
#[path = "conformance/workers.rs"]
mod workers;

use attempts::*;
use keeping::*;
use pause::*;
use random::*;
use std::collections::{HashMap, HashSet};
use support::{RECLAIMED, kinds, new_job, reclaim, training_failed};
use tuneq_openapi::EventKind;
use tuneq_queue::testing;
use tuneq_queue::*;
use tuneq_queue::{JobQueue, Queue};
use workers::*;

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
