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
    let jobs: Value = reqwest::Client::new()
        .get(format!("{}/v1/fine_tuning/jobs", s.url))
        .bearer_auth(&s.acme)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(jobs["data"].as_array().unwrap().len(), 0, "{jobs}");
}
