//! The trainers' report endpoint over real HTTP, with the queue's fencing behind it: a
//! fine-tune is created through the API, claimed as a dispatcher would, and reported on
//! with its attempt's credential — progress, events, completion — while forged
//! credentials, another attempt's reports and another tenant's reads are refused.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;
use support::{Server, claim};
use tuneq_storage::layout::{Id, job_output};
use tuneq_storage::{ObjectStore, PutMode};

async fn start() -> Server {
    start_with_store(None).await
}

/// A server whose objects live in `store` (default: a folder in its temp dir).
async fn start_with_store(store: Option<Arc<dyn ObjectStore>>) -> Server {
    support::start_with_store(store, |_| {}).await
}

async fn create_job(s: &Server) -> Value {
    let data = (0..8)
        .map(|i| format!(r#"{{"prompt":"p{i}","completion":"c{i}"}}"#))
        .collect::<Vec<_>>()
        .join("\n");
    let uploaded = s.post_body(&s.acme, "/files?filename=d.jsonl", data).await;
    let status = uploaded.status();
    let file: Value = uploaded.json().await.unwrap();
    assert_eq!(status, StatusCode::OK, "upload: {file}");
    let response = s.post_json(&s.acme, "/finetunes", &json!({"model": "base", "training_file": file["id"], "hyperparameters": {"n_epochs": 2}})).await;
    let status = response.status();
    let created: Value = response.json().await.unwrap();
    assert_eq!(status, StatusCode::OK, "create: {created}");
    created
}

/// Reports `body` for `job` with `credential`, which the server must answer with `want`;
/// the answer's body.
async fn report(s: &Server, job: &str, credential: &str, body: Value, want: StatusCode) -> Value {
    let path = format!("/internal/attempts/{job}/report");
    let response = s.post_json(credential, &path, &body).await;
    assert_eq!(response.status(), want, "report {body}");
    response.json().await.unwrap_or(Value::Null)
}

/// Posts `action` (`pause`, `resume`, `cancel`) on fine-tune `id` as acme, which the
/// server must answer with `want`; the answer's body.
async fn act(s: &Server, id: &str, action: &str, want: StatusCode) -> Value {
    let response = s
        .post_json(&s.acme, &format!("/finetunes/{id}/{action}"), &json!({}))
        .await;
    assert_eq!(response.status(), want, "{action} {id}");
    response.json().await.unwrap()
}

/// The messages of a page of events.
fn messages_of(events: &Value) -> Vec<&str> {
    events["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["message"].as_str().unwrap())
        .collect()
}

fn step(step: u64, total: u64, loss: f64) -> Value {
    json!({"event": "step", "step": step, "total_steps": total, "epoch": 0, "loss": loss,
        "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "elapsed_s": 1.0,
        "eta_s": 5.0, "tokens_seen": step * 100})
}

async fn get(s: &Server, key: &str, path: &str) -> (StatusCode, Value) {
    let response = s.get_as(key, path).await;
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn reports_move_a_job_to_succeeded_and_stale_or_forged_ones_change_nothing() {
    let s = start().await;
    let created = create_job(&s).await;
    let id = created["id"].as_str().unwrap();
    assert_eq!(created["status"], "queued");
    assert_eq!(created["hyperparameters"]["n_epochs"], 2);

    // A dispatcher claims it; the first attempt's credential is refused once preempted.
    let (first, first_credential) = claim(&s).await;
    support::reclaim(&s, &first).await;
    let (lease, credential) = claim(&s).await;

    let started = json!({"seq": 1, "events": [
        {"event": "started", "total_steps": 4, "start_step": 0, "train_examples": 8,
         "validation_examples": 0, "trainable_params": 10, "dataset_format": "prompt_completion"},
        step(1, 4, 2.0), step(2, 4, 1.5),
        {"event": "checkpoint", "step": 2, "location": "file:///out/checkpoints/step-00000002"}]});
    report(&s, &lease.id, &credential, started.clone(), StatusCode::OK).await;
    // The same report again (a retry after a lost reply) records nothing twice.
    report(&s, &lease.id, &credential, started, StatusCode::OK).await;
    // The superseded attempt is told to stop (410) and changes nothing.
    let late = json!({"seq": 9, "events": [step(3, 4, 9.0)]});
    report(&s, &lease.id, &first_credential, late, StatusCode::GONE).await;
    // A forged or foreign credential is not a credential.
    let forged = format!("{}.{}.{}", lease.id, lease.token, "00".repeat(32));
    let body = json!({"seq": 2, "events": []});
    report(
        &s,
        &lease.id,
        &forged,
        body.clone(),
        StatusCode::UNAUTHORIZED,
    )
    .await;
    report(
        &s,
        "j000000000999",
        &credential,
        body,
        StatusCode::UNAUTHORIZED,
    )
    .await;

    let (status, job) = get(&s, &s.acme, &format!("/finetunes/{id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(job["status"], "running");
    assert_eq!(job["preemptions"], 1);
    assert_eq!(job["progress"]["step"], 2);
    assert_eq!(job["progress"]["total_steps"], 4);
    assert_eq!(job["progress"]["percent"], 50.0);
    assert_eq!(job["progress"]["loss"], 1.5);
    assert_eq!(job["progress"]["checkpoint_step"], 2);
    let checkpoints = s
        .json_as(&s.acme, &format!("/finetunes/{id}/checkpoints"))
        .await;
    assert_eq!(checkpoints["data"].as_array().unwrap().len(), 1);
    assert_eq!(checkpoints["data"][0]["step_number"], 2);
    assert_eq!(checkpoints["data"][0]["metrics"]["train_loss"], 1.5);
    // The log entries the report left, rendered from their typed form.
    let events = s
        .json_as(&s.acme, &format!("/finetunes/{id}/events?limit=100"))
        .await;
    let events = events["data"].as_array().unwrap();
    let find = |message: &str| {
        events
            .iter()
            .find(|e| e["message"] == message)
            .unwrap_or_else(|| panic!("no event `{message}` in {events:?}"))
    };
    let started = find("Training started");
    assert_eq!(started["data"]["dataset_format"], "prompt_completion");
    assert_eq!(started["data"]["total_steps"], 4);
    let metrics = find("Step 1/4: training loss=2.0000");
    assert_eq!(metrics["type"], "metrics");
    assert_eq!(metrics["data"]["train_loss"], 2.0);
    let saved = find("Checkpoint saved at step 2");
    assert_eq!(saved["type"], "message");
    assert_eq!(saved["data"]["step"], 2);
    assert_eq!(
        saved["data"]["location"], "step-00000002",
        "a location outside the tenant's prefix shows only its last segment"
    );

    let finished = json!({"seq": 2, "events": [step(3, 4, 1.2), step(4, 4, 1.0),
        {"event": "finished", "step": 4, "adapter": "file:///out", "train_loss": 1.0,
         "validation_loss": null, "trained_tokens": 400}]});
    report(&s, &lease.id, &credential, finished, StatusCode::OK).await;
    let job = s
        .json_as(&s.acme, &format!("/v1/fine_tuning/jobs/{id}"))
        .await;
    assert_eq!(job["status"], "succeeded");
    assert_eq!(job["trained_tokens"], 400);
    assert!(
        job["fine_tuned_model"]
            .as_str()
            .unwrap()
            .starts_with("ft:base:acme::")
    );
    // After the end, the attempt's credential is refused too.
    let after = json!({"seq": 3, "events": [step(5, 4, 0.1)]});
    report(&s, &lease.id, &credential, after, StatusCode::GONE).await;

    let events = s
        .json_as(
            &s.acme,
            &format!("/v1/fine_tuning/jobs/{id}/events?limit=100"),
        )
        .await;
    let messages = messages_of(&events);
    assert_eq!(
        messages.first(),
        Some(&"The job has successfully completed")
    );
    assert_eq!(
        messages.last().copied(),
        Some(format!("Created fine-tuning job: {id}").as_str())
    );
    assert_eq!(
        messages.iter().filter(|m| m.starts_with("Step ")).count(),
        4,
        "every step of a 4-step run is a metrics event, and each once: {messages:?}"
    );
    assert!(!messages.iter().any(|m| m.contains("9.0")));

    // A local folder cannot presign: the tar download is the way there.
    let (status, body) = get(&s, &s.acme, &format!("/finetunes/{id}/adapter/urls")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["code"], "presign_unsupported");

    // Another tenant sees nothing of it.
    for path in [
        format!("/finetunes/{id}"),
        format!("/finetunes/{id}/events"),
        format!("/finetunes/{id}/checkpoints"),
        format!("/finetunes/{id}/adapter"),
        format!("/finetunes/{id}/adapter/urls"),
    ] {
        let (status, body) = get(&s, &s.other, &path).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
    }
    let list = s.json_as(&s.other, "/v1/fine_tuning/jobs").await;
    assert_eq!(list["data"].as_array().unwrap().len(), 0);
}

/// On S3 (SeaweedFS, which checks SigV4 signatures), a succeeded job's adapter is handed
/// out as presigned URLs that any HTTP client can fetch without an API key.
#[tokio::test]
async fn a_succeeded_adapter_is_handed_out_as_presigned_urls_where_the_store_signs() {
    use tuneq_storage::testing;
    let store: Arc<dyn ObjectStore> = Arc::new(
        tuneq_storage::s3::S3Store::connect(
            &testing::s3_config(testing::seaweedfs()),
            testing::TEST_BUCKET,
            &testing::unique_prefix("api-adapter-urls"),
        )
        .await
        .unwrap(),
    );
    let s = start_with_store(Some(Arc::clone(&store))).await;
    let created = create_job(&s).await;
    let id = created["id"].as_str().unwrap();
    let (status, body) = get(&s, &s.acme, &format!("/finetunes/{id}/adapter/urls")).await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "not before it has succeeded"
    );
    assert_eq!(body["error"]["code"], "adapter_not_ready");

    let (lease, credential) = claim(&s).await;
    // What the trainer writes, then its last report.
    let output = job_output(&Id::parse("acme").unwrap(), &Id::parse(id).unwrap());
    let files: [(&str, &[u8]); 2] = [
        ("adapter_config.json", br#"{"r": 8, "peft_type": "LORA"}"#),
        ("adapter_model.safetensors", b"not really weights"),
    ];
    for (name, bytes) in files {
        store
            .put(
                &output.join(name).unwrap(),
                bytes::Bytes::from_static(bytes),
                PutMode::Overwrite,
            )
            .await
            .unwrap();
    }
    let finished = json!({"seq": 1, "events": [
        {"event": "finished", "step": 4, "adapter": "s3://tuneq-test/out", "train_loss": 1.0,
         "validation_loss": null, "trained_tokens": 400}]});
    report(&s, &lease.id, &credential, finished, StatusCode::OK).await;

    let (status, urls) = get(
        &s,
        &s.acme,
        &format!("/v1/fine_tuning/jobs/{id}/adapter/urls"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{urls}");
    let listed = urls["data"].as_array().unwrap();
    assert_eq!(listed.len(), 2);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let expires = urls["expires_at"].as_u64().unwrap();
    assert!(
        (now + 3000..=now + 3700).contains(&expires),
        "about an hour"
    );
    for ((name, bytes), entry) in files.iter().zip(listed) {
        assert_eq!(entry["name"], *name);
        let fetched = reqwest::get(entry["url"].as_str().unwrap()).await.unwrap();
        assert_eq!(fetched.status(), StatusCode::OK, "{name}");
        assert_eq!(fetched.bytes().await.unwrap().as_ref(), *bytes);
    }
    let (status, _) = get(&s, &s.other, &format!("/finetunes/{id}/adapter/urls")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_pause_reaches_the_trainer_in_a_reports_answer_and_its_stop_pauses_the_job() {
    let s = start().await;
    let created = create_job(&s).await;
    let id = created["id"].as_str().unwrap();
    let (lease, credential) = claim(&s).await;
    let first = json!({"seq": 1, "events": [step(1, 4, 2.0)]});
    let answer = report(&s, &lease.id, &credential, first, StatusCode::OK).await;
    assert_eq!(answer, json!({"checkpoint_and_stop": false}));

    let pausing = act(&s, id, "pause", StatusCode::OK).await;
    assert_eq!(
        (&pausing["status"], &pausing["pause_requested"]),
        (&json!("running"), &json!(true))
    );
    let early = act(&s, id, "resume", StatusCode::BAD_REQUEST).await;
    assert_eq!(early["error"]["code"], "job_not_paused");
    // Another tenant can neither pause nor resume it.
    for action in ["pause", "resume"] {
        let path = format!("/finetunes/{id}/{action}");
        assert_eq!(
            s.post_json(&s.other, &path, &json!({})).await.status(),
            StatusCode::NOT_FOUND
        );
    }

    let second = json!({"seq": 2, "events": [step(2, 4, 1.5)]});
    let answer = report(&s, &lease.id, &credential, second, StatusCode::OK).await;
    assert_eq!(
        answer,
        json!({"checkpoint_and_stop": true}),
        "the trainer is asked to stop"
    );
    // It checkpoints and exits; its dispatcher reports the stop, which pauses the job.
    support::stop_attempt(&s, &lease, tuneq_openapi::StopCause::Pause, "paused").await;
    let (status, paused) = get(&s, &s.acme, &format!("/finetunes/{id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (&paused["status"], &paused["pause_requested"]),
        (&json!("paused"), &json!(false))
    );
    assert_eq!(paused["preemptions"], 0, "a pause is no preemption");
    let (_, events) = get(&s, &s.acme, &format!("/finetunes/{id}/events?limit=50")).await;
    let messages = messages_of(&events);
    assert!(
        messages.contains(&"Pausing: the running attempt writes a checkpoint and stops"),
        "{messages:?}"
    );
    assert!(
        messages.iter().any(|m| m.starts_with("The job was paused")),
        "{messages:?}"
    );

    let resumed = act(&s, id, "resume", StatusCode::OK).await;
    assert_eq!(resumed["status"], "queued");
    act(&s, id, "cancel", StatusCode::OK).await;
    let late = act(&s, id, "pause", StatusCode::BAD_REQUEST).await;
    assert_eq!(
        (&late["error"]["code"], &late["error"]["param"]),
        (&json!("job_already_finished"), &json!("id"))
    );
}
