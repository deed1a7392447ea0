//! The files API over real HTTP: a server on a free port with the embedded queue and a
//! local object store in a temp dir, driven with reqwest the way SDKs call it
//! (multipart), plus the raw-body form, tenant isolation, auth and limits.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::Value;
use support::{ADMIN_KEY, Server};

/// A server that accepts uploads of at most `max_upload_bytes`.
async fn start(max_upload_bytes: u64) -> Server {
    support::start(|c| c.max_upload_bytes = max_upload_bytes).await
}

fn chat_lines(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                r#"{{"messages":[{{"role":"user","content":"question {i}"}},{{"role":"assistant","content":"answer {i}"}}]}}"#
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

async fn upload(s: &Server, key: &str, name: &str, body: &str) -> reqwest::Response {
    let form = reqwest::multipart::Form::new()
        .text("purpose", "fine-tune")
        .part(
            "file",
            reqwest::multipart::Part::bytes(body.as_bytes().to_vec()).file_name(name.to_string()),
        );
    s.post_form(key, "/v1/files", form).await
}

fn stored_files(s: &Server) -> usize {
    fn count(p: &std::path::Path) -> usize {
        std::fs::read_dir(p).map_or(0, |entries| {
            entries
                .map_while(Result::ok)
                .map(|e| {
                    let p = e.path();
                    if p.is_dir() { count(&p) } else { 1 }
                })
                .sum()
        })
    }
    count(&s.dir.path().join("objects/tenants"))
}

/// Stores one valid dataset and returns the count of stored files with it: above zero,
/// which shows [`stored_files`] looks where uploads land, so "stores nothing" checks
/// that compare against it can fail.
async fn stored_witness(s: &Server) -> usize {
    let response = upload(s, &s.acme, "witness.jsonl", &chat_lines(1)).await;
    assert_eq!(response.status(), StatusCode::OK);
    let stored = stored_files(s);
    assert!(stored > 0, "an accepted upload must be seen stored");
    stored
}

#[tokio::test]
async fn a_valid_dataset_is_stored_listed_downloaded_and_deleted_by_its_tenant_only() {
    let s = start(1 << 20).await;
    let data = chat_lines(5);
    let response = upload(&s, &s.acme, "train.jsonl", &data).await;
    assert_eq!(response.status(), StatusCode::OK);
    let file: Value = response.json().await.unwrap();
    let id = file["id"].as_str().unwrap().to_string();
    assert!(stored_files(&s) > 0, "the upload must be seen stored");
    assert!(id.starts_with("file-"));
    assert_eq!(file["object"], "file");
    assert_eq!(file["bytes"], data.len());
    assert_eq!(file["filename"], "train.jsonl");
    assert_eq!(file["purpose"], "fine-tune");
    assert_eq!(file["status"], "processed");
    assert_eq!(file["validation"]["format"], "chat");
    assert_eq!(file["validation"]["examples"], 5);

    let list: Value = s.json_as(&s.acme, "/v1/files").await;
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["id"], id.as_str());
    assert_eq!(list["has_more"], false);

    let got: Value = s.json_as(&s.acme, &format!("/files/{id}")).await;
    assert_eq!(got, file, "native and OpenAI routes serve the same object");
    let content = s.get_as(&s.acme, &format!("/v1/files/{id}/content")).await;
    assert_eq!(content.status(), StatusCode::OK);
    assert_eq!(content.text().await.unwrap(), data);

    // Another tenant sees nothing of it.
    for path in [format!("/v1/files/{id}"), format!("/v1/files/{id}/content")] {
        let r = s.get_as(&s.other, &path).await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "{path}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    let theirs: Value = s.json_as(&s.other, "/v1/files").await;
    assert_eq!(theirs["data"].as_array().unwrap().len(), 0);
    let r = s.delete_as(&s.other, &format!("/v1/files/{id}")).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    let deleted: Value = s
        .delete_as(&s.acme, &format!("/v1/files/{id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], true);
    assert_eq!(stored_files(&s), 0);
    let r = s.get_as(&s.acme, &format!("/v1/files/{id}")).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_dataset_with_bad_lines_is_refused_with_every_line_and_field_named() {
    let s = start(1 << 20).await;
    let stored = stored_witness(&s).await;
    let data = [
        r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]}"#,
        r#"{"messages":[{"role":"wizard","content":"hi"}]}"#,
        r#"not json"#,
        r#"{"messages":[{"role":"user","content":"ok"},{"role":"assistant","content":"fine"}]}"#,
        r#"{"messages":[{"role":"user","content":5}]}"#,
    ]
    .join("\n");
    let r = upload(&s, &s.acme, "bad.jsonl", &data).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let body: Value = r.json().await.unwrap();
    let error = &body["error"];
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["code"], "invalid_jsonl");
    assert_eq!(error["param"], "file");
    let lines: Vec<u64> = error["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["line"].as_u64().unwrap())
        .collect();
    assert!(
        lines.contains(&2) && lines.contains(&3) && lines.contains(&5),
        "{error}"
    );
    assert!(!lines.contains(&1) && !lines.contains(&4));
    let fields: Vec<&str> = error["lines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["line"] == 2)
        .map(|l| l["field"].as_str().unwrap())
        .collect();
    assert!(fields.iter().any(|f| f.contains("role")), "{fields:?}");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("3 invalid line")
    );
    assert_eq!(stored_files(&s), stored, "a refused upload stores nothing");

    let empty = upload(&s, &s.acme, "empty.jsonl", "\n\n").await;
    assert_eq!(empty.status(), StatusCode::BAD_REQUEST);
    let body: Value = empty.json().await.unwrap();
    assert_eq!(body["error"]["code"], "empty_file");
}

#[tokio::test]
async fn keys_sizes_and_purposes_are_checked() {
    let s = start(2_000).await;
    let http = reqwest::Client::new();
    let r = s.get_without_key("/v1/files").await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "authentication_error");
    let r = s.get_as("tq_not-a-real-key-at-all", "/v1/files").await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    let stored = stored_witness(&s).await;
    let big = upload(&s, &s.acme, "big.jsonl", &chat_lines(100)).await;
    assert_eq!(big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body: Value = big.json().await.unwrap();
    assert_eq!(body["error"]["code"], "file_too_large");
    assert_eq!(stored_files(&s), stored);
    // Sent chunked, with no length declared up front: stopped once it passes the limit.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..100).map(|_| Ok(chat_lines(1).into_bytes())).collect();
    let big = s
        .post_body(
            &s.acme,
            "/files?filename=big.jsonl",
            reqwest::Body::wrap_stream(futures::stream::iter(chunks)),
        )
        .await;
    assert_eq!(big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(stored_files(&s), stored);

    let form = reqwest::multipart::Form::new()
        .text("purpose", "assistants")
        .part(
            "file",
            reqwest::multipart::Part::bytes(chat_lines(1).into_bytes()),
        );
    let r = s.post_form(&s.acme, "/v1/files", form).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "purpose");

    // The raw-body form of the native route.
    let r = http
        .post(format!("{}/files?filename=raw.jsonl", s.url))
        .bearer_auth(&s.acme)
        .header("content-type", "application/jsonl")
        .body(r#"{"text":"just text"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let file: Value = r.json().await.unwrap();
    assert_eq!(file["filename"], "raw.jsonl");
    assert_eq!(file["validation"]["format"], "text");

    let r = s.get_without_key("/nowhere").await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unknown_route");
}

#[tokio::test]
async fn operators_create_tenants_and_keys_with_the_admin_key() {
    let s = start(1 << 20).await;
    let http = reqwest::Client::new();
    let r = s
        .post_json(
            &s.acme,
            "/admin/tenants",
            &serde_json::json!({"id": "newco"}),
        )
        .await;
    assert_eq!(
        r.status(),
        StatusCode::UNAUTHORIZED,
        "a tenant key is not an admin key (401, as a wrong key is on every route)"
    );
    let r = s
        .post_json(
            ADMIN_KEY,
            "/admin/tenants",
            &serde_json::json!({"id": "NewCo!"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "id");
    let r = s
        .post_json(
            ADMIN_KEY,
            "/admin/tenants",
            &serde_json::json!({"id": "newco", "name": "New Co"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let key: Value = s
        .post_as(ADMIN_KEY, "/admin/tenants/newco/keys")
        .await
        .json()
        .await
        .unwrap();
    let new_key = key["api_key"].as_str().unwrap();
    assert!(new_key.starts_with("tq_"));
    let r = s.get_as(new_key, "/v1/files").await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = s.post_as(ADMIN_KEY, "/admin/tenants/ghost/keys").await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = http
        .post(format!("{}/admin/tenants", s.url))
        .bearer_auth(ADMIN_KEY)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_json");
}

#[tokio::test]
async fn metrics_count_answers_by_route_pattern_never_by_raw_path() {
    let s = start(1 << 20).await;
    let id = "file-0123456789abcdef01234567";
    let response = s.get_as(&s.acme, &format!("/v1/files/{id}")).await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let response = s.get_without_key("/no/such/route").await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let text = s.get_without_key("/metrics").await.text().await.unwrap();
    assert!(
        text.contains(
            r#"tuneq_http_requests_total{method="GET",route="/v1/files/{id}",status="404"}"#
        ),
        "{text}"
    );
    assert!(
        text.contains(
            r#"tuneq_http_request_duration_seconds_count{method="GET",route="/v1/files/{id}"}"#
        ),
        "{text}"
    );
    assert!(text.contains(r#"route="unmatched""#), "{text}");
    assert!(!text.contains(id), "no raw path in a label");
    assert!(!text.contains("/no/such/route"), "no raw path in a label");
}
