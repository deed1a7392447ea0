//! README's "Limits and defences": a JSON request body is bounded at 1 MiB and one
//! past it is answered 413 `body_too_large`, whether its size is declared up front or
//! it simply keeps coming (chunked), while a body just under the bound is read.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::Value;
use support::start;

/// The bound README states.
const ONE_MIB: usize = 1 << 20;

/// A create request of exactly `size` bytes: valid JSON whose padding is a `suffix`
/// far too long to be accepted, so a body the server reads is refused as invalid (400)
/// and only one it does not read is refused for its size.
fn create_body(size: usize) -> Vec<u8> {
    let head = r#"{"model":"base","training_file":"file-x","suffix":""#;
    let tail = r#""}"#;
    let mut body = head.as_bytes().to_vec();
    body.resize(size - tail.len(), b'a');
    body.extend_from_slice(tail.as_bytes());
    assert_eq!(body.len(), size);
    body
}

async fn post(s: &support::Server, body: reqwest::Body) -> (StatusCode, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/fine_tuning/jobs", s.url))
        .bearer_auth(&s.acme)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test]
async fn json_bodies_past_one_mib_are_refused_with_413_body_too_large() {
    let s = start(|_| {}).await;

    // Just under the bound: read, parsed, and refused for what it says.
    let (status, body) = post(&s, create_body(ONE_MIB - 16).into()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_ne!(body["error"]["code"], "body_too_large", "{body}");

    // Just over it, with its length declared: refused for its size.
    let (status, body) = post(&s, create_body(ONE_MIB + 1).into()).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_eq!(body["error"]["code"], "body_too_large", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");

    // Over it without a length (chunked): refused once it has grown past the bound.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = create_body(2 * ONE_MIB)
        .chunks(64 << 10)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let (status, body) = post(
        &s,
        reqwest::Body::wrap_stream(futures::stream::iter(chunks)),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_eq!(body["error"]["code"], "body_too_large", "{body}");

    // Nothing was created by any of them.
    let jobs: Value = s.json_as(&s.acme, "/v1/fine_tuning/jobs").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 0, "{jobs}");
}

/// The server's default limits (the probe's M2: new tenants had none, so one could fill
/// the disk with queued jobs): a tenant with no limits of its own gets them, one whose
/// operator set its own keeps those, and a tenant made before the defaults gets them
/// when the server starts.
#[tokio::test]
async fn tenants_without_limits_of_their_own_get_the_servers_defaults() {
    use serde_json::json;
    let s = start(|config| {
        config.default_limits = tuneq_api::records::tenant::TenantLimits {
            max_queued: Some(2),
            max_files: Some(2),
            ..Default::default()
        };
    })
    .await;
    let admin = |method: reqwest::Method, path: &str| {
        reqwest::Client::new()
            .request(method, format!("{}{path}", s.url))
            .bearer_auth(support::ADMIN_KEY)
    };
    let made = admin(reqwest::Method::POST, "/admin/tenants")
        .json(&json!({"id": "fresh"}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), StatusCode::CREATED);
    let key: Value =
        support::json_of(admin(reqwest::Method::POST, "/admin/tenants/fresh/keys")).await;
    let key = key["api_key"].as_str().unwrap().to_string();
    // Files: two, then 429.
    let file = support::upload(&s, &key, &support::examples(8)).await;
    support::upload(&s, &key, &support::examples(9)).await;
    let third = s
        .post_body(&key, "/v1/files?filename=d.jsonl", support::examples(10))
        .await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    // Jobs waiting: two, then 429.
    let create = || {
        reqwest::Client::new()
            .post(format!("{}/v1/fine_tuning/jobs", s.url))
            .bearer_auth(&key)
            .json(&json!({"model": "base", "training_file": file}))
            .send()
    };
    assert_eq!(create().await.unwrap().status(), StatusCode::OK);
    assert_eq!(create().await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        create().await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Its own limit, set by an operator, replaces the default.
    let set = admin(reqwest::Method::PUT, "/admin/tenants/fresh/limits")
        .json(&json!({"max_queued": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(set.status(), StatusCode::OK);
    assert_eq!(create().await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        create().await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // A tenant made before the defaults (the test kit's `acme`, made straight in the
    // catalog) gets them when the server applies them at start.
    assert_eq!(
        tuneq_api::admin::apply_default_limits(&s.state)
            .await
            .unwrap(),
        3
    );
    let acme_file = support::upload(&s, &s.acme, &support::examples(8)).await;
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let (status, body) = support::create(&s, &acme_file, json!({})).await;
        assert_eq!(status, expected, "{body}");
    }
}

/// The probe's L1: with `max_files: 2`, four uploads at once left three files, because
/// each was checked before any was recorded. The quota is checked again in the tenant's
/// commit turn, so uploads at once never pass it.
#[tokio::test]
async fn uploads_at_once_cannot_pass_the_storage_quota_together() {
    use serde_json::json;
    let s = start(|_| {}).await;
    let set = s
        .put_json(
            support::ADMIN_KEY,
            "/admin/tenants/acme/limits",
            &json!({"max_files": 2}),
        )
        .await;
    assert_eq!(set.status(), StatusCode::OK);
    for round in 0..3 {
        let uploads = (0..4).map(|i| {
            reqwest::Client::new()
                .post(format!("{}/v1/files?filename=d.jsonl", s.url))
                .bearer_auth(&s.acme)
                .body(support::examples(8 + i))
                .send()
        });
        let statuses: Vec<StatusCode> = futures::future::join_all(uploads)
            .await
            .into_iter()
            .map(|r| r.unwrap().status())
            .collect();
        let files = support::get_json(&s, "/v1/files").await;
        let kept = files["data"].as_array().unwrap().len();
        assert!(kept <= 2, "round {round}: {kept} files kept: {statuses:?}");
        assert!(
            statuses
                .iter()
                .all(|s| *s == StatusCode::OK || *s == StatusCode::TOO_MANY_REQUESTS),
            "{statuses:?}"
        );
    }
}
