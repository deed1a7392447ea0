//! Small input-handling holes the second probe found (its L7), each shut over real HTTP:
//! a key named twice in a body, unknown fields inside `method`, control characters in
//! `Idempotency-Key`, a tenant created twice, whole inputs echoed back in errors, and
//! names that hide what they are.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::{ADMIN_KEY, create, examples, start, upload};

async fn post_raw(s: &support::Server, path: &str, key: &str, body: &str) -> (StatusCode, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", s.url))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    (response.status(), response.json().await.unwrap())
}

#[tokio::test]
async fn a_key_named_twice_in_a_body_is_refused_and_creates_nothing() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let body = format!(r#"{{"model":"base","training_file":"{file}","model":"other"}}"#);
    let (status, answer) = post_raw(&s, "/v1/fine_tuning/jobs", &s.acme, &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert_eq!(answer["error"]["code"], "invalid_json");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`model` appears twice"),
        "{answer}"
    );
    // Nested objects too.
    let body = format!(
        r#"{{"model":"base","training_file":"{file}","hyperparameters":{{"n_epochs":1,"n_epochs":50}}}}"#
    );
    let (status, _) = post_raw(&s, "/v1/fine_tuning/jobs", &s.acme, &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let jobs = support::get_json(&s, "/v1/fine_tuning/jobs").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 0, "{jobs}");
}

#[tokio::test]
async fn unknown_fields_inside_method_are_refused_naming_them() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    for (method, param) in [
        (json!({"type": "supervised", "bogus": 1}), "method.bogus"),
        (
            json!({"type": "supervised", "supervised": {"hyperparameters": {}, "extra": true}}),
            "method.supervised.extra",
        ),
    ] {
        let (status, body) = create(&s, &file, json!({"method": method})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
    }
}

#[tokio::test]
async fn an_idempotency_key_with_a_control_character_is_refused() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    for key in ["a\tb", "\t"] {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/fine_tuning/jobs", s.url))
            .bearer_auth(&s.acme)
            .header("idempotency-key", key)
            .json(&json!({"model": "base", "training_file": file}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{key:?}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["param"], "Idempotency-Key");
    }
}

#[tokio::test]
async fn creating_a_tenant_that_exists_changes_nothing_and_says_so() {
    let s = start(|_| {}).await;
    let path = "/admin/tenants";
    let (status, _) = post_raw(&s, path, ADMIN_KEY, r#"{"id":"t5","name":"Five"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    // The same again (or with no name): 200, nothing changed.
    let (status, body) = post_raw(&s, path, ADMIN_KEY, r#"{"id":"t5","name":"Five"}"#).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = post_raw(&s, path, ADMIN_KEY, r#"{"id":"t5"}"#).await;
    assert_eq!(status, StatusCode::OK);
    // Another name: 409, and the tenant keeps its own.
    let (status, body) = post_raw(&s, path, ADMIN_KEY, r#"{"id":"t5","name":"renamed"}"#).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "tenant_exists");
    let record = tuneq_api::records::tenant::get(&s.state.queue, "t5")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.name, "Five");
}

#[tokio::test]
async fn errors_repeat_a_short_piece_of_what_was_sent_never_all_of_it() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let long = "m".repeat(100_000);
    let (status, body) = create(&s, &file, json!({"model": long})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.len() < 400, "{} bytes", message.len());
    // A huge number is written as one, not as 309 digits.
    for (field, value) in [
        (
            "hyperparameters",
            json!({"learning_rate_multiplier": 1e308}),
        ),
        ("lora", json!({"alpha": 1e308})),
    ] {
        let (status, body) = create(&s, &file, json!({field: value})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("1e308"), "{message}");
        assert!(!message.contains("0000000000"), "{message}");
    }
    // An unknown file id, as long as the model id.
    let (_, body) = create(&s, &long, json!({"model": "base"})).await;
    assert!(body["error"]["message"].as_str().unwrap().len() < 400);
}

#[tokio::test]
async fn a_suffix_that_reads_as_a_path_and_a_filename_with_bidi_controls_are_cleaned() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    for suffix in ["..", ".", ".hidden"] {
        let (status, body) = create(&s, &file, json!({"suffix": suffix})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{suffix}: {body}");
        assert_eq!(body["error"]["param"], "suffix");
    }
    let response = s
        .post_body(
            &s.acme,
            "/v1/files?filename=evil%E2%80%AEtxt.exe",
            examples(8),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let uploaded: Value = response.json().await.unwrap();
    assert_eq!(uploaded["filename"], "eviltxt.exe");
}
