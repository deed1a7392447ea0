//! What outlives a job's run: deletion on completion, the outbox and the send queues,
//! bulk enqueue, and the catalog.

use super::*;

pub(crate) async fn delete_on_completion_leaves_no_keys_behind(backend: Backend) {
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

pub(crate) async fn finished_jobs_that_asked_for_notice_wait_in_the_outbox_until_acknowledged(
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

pub(crate) async fn bulk_enqueue_accepts_or_refuses_each_job_on_its_own(backend: Backend) {
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

pub(crate) async fn the_catalog_keeps_entries_per_owner_and_pages_newest_first(backend: Backend) {
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

pub(crate) async fn a_catalog_swap_writes_only_over_the_body_it_expects(backend: Backend) {
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

pub(crate) async fn a_tenants_backlog_of_sends_cannot_hide_another_tenants(backend: Backend) {
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
