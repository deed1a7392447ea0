//! Every `error.code` a failed job can show, from the queue's typed failure to what the
//! tenant reads: a job failed as each [`FailureClass`] shows that class's code whatever
//! its reason says, and a job whose attempts vanish fails as `job_lost`. (The trainer's
//! side — exit codes to classes — runs end to end in `tests/clients/test_failure_codes.py`.)

use crate::support;
use tuneq_openapi::{EventKind, FailureClass};
use tuneq_queue::{JobQueue, QueueConfig, SuspectVerdict};

/// Creates a fine-tune for `acme` and returns its id and its queue job.
async fn create_job(s: &support::Server) -> (String, String) {
    let file = support::upload(s, &s.acme, &support::examples(8)).await;
    let (status, created) = support::create(s, &file, serde_json::json!({})).await;
    assert_eq!(status, 200, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let (lease, _) = support::claim(s).await;
    (id, lease.id)
}

#[tokio::test]
async fn each_failure_class_is_the_code_the_tenant_reads_whatever_the_reason_says() {
    let s = support::start(|_| {}).await;
    for class in FailureClass::ALL {
        let (id, job) = create_job(&s).await;
        let token = s.queue.get(&job).await.unwrap().unwrap().epoch;
        // The same words for every class: only the type may decide the code.
        let reason = "invalid input: loss became NaN";
        s.queue
            .fail(&job, token, *class, reason, false)
            .await
            .unwrap();
        let view = support::get_json(&s, &format!("/v1/fine_tuning/jobs/{id}")).await;
        assert_eq!(view["status"], "failed", "{view}");
        assert_eq!(view["error"]["code"], class.code(), "{view}");
        let events = s.queue.events(&job, None, 1, true).await.unwrap();
        assert_eq!(events[0].kind, EventKind::Failed);
        assert_eq!(events[0].failure, Some(*class));
    }
}

#[tokio::test]
async fn a_job_whose_attempts_vanish_too_often_fails_as_lost() {
    let s = support::start(|_| {}).await;
    s.queue.freeze_clock().await.unwrap();
    let (id, job) = create_job(&s).await;
    let config = QueueConfig::default();
    for stall in 1..=config.max_stalls {
        if stall > 1 {
            s.queue
                .claim_started("local", "test", "")
                .await
                .unwrap()
                .unwrap();
        }
        // The attempt stops renewing its lease; no dispatcher knows it: requeued.
        s.queue.advance_clock(config.lease_ms + 1).await.unwrap();
        assert_eq!(
            s.queue.expire_leases(10).await.unwrap(),
            std::slice::from_ref(&job)
        );
        let epoch = s.queue.get(&job).await.unwrap().unwrap().epoch;
        s.queue
            .resolve_suspect(&job, epoch, SuspectVerdict::Requeue)
            .await
            .unwrap();
    }
    let view = support::get_json(&s, &format!("/v1/fine_tuning/jobs/{id}")).await;
    assert_eq!(view["status"], "failed", "{view}");
    assert_eq!(view["error"]["code"], "job_lost", "{view}");
    let events = support::get_json(&s, &format!("/v1/fine_tuning/jobs/{id}/events")).await;
    let first = &events["data"][0];
    assert_eq!(first["level"], "error", "{events}");
    assert!(
        first["message"].as_str().unwrap().contains("job_lost"),
        "{events}"
    );
}
