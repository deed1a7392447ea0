//! What validating an upload costs: template work linear in a record's messages, a cap
//! on messages per record, and validation that stops when the client hangs up (the
//! probe of 2026-12-04, H2). Work is counted (messages rendered, validations held),
//! never timed.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::Value;
use std::time::Duration;
use support::Server;

/// Registers base model `id` whose folder also holds a tokenizer and the ChatML chat
/// template (as `tuneq model init` writes them), so uploads get token statistics;
/// returns its folder.
async fn model_with_tokenizer(s: &Server, id: &str) -> std::path::PathBuf {
    support::register_model(&s.state, s.dir.path(), id, 1e-3, support::small_shape(512)).await;
    let dir = s.dir.path().join("models").join(id);
    tuneq_dataset::write_tokenizer_files(&dir, 512, 1024).unwrap();
    dir
}

/// One chat record of `pairs` user/assistant turns, as a JSONL line.
fn chat_line(pairs: usize) -> String {
    let mut messages = Vec::with_capacity(2 * pairs);
    for i in 0..pairs {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {i}")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {i}")}));
    }
    serde_json::json!({ "messages": messages }).to_string() + "\n"
}

async fn upload(s: &Server, key: &str, model: &str, body: String) -> reqwest::Response {
    let form = reqwest::multipart::Form::new()
        .text("purpose", "fine-tune")
        .text("model", model.to_string())
        .part(
            "file",
            reqwest::multipart::Part::bytes(body.into_bytes()).file_name("turns.jsonl"),
        );
    s.post_form(key, "/v1/files", form).await
}

#[tokio::test]
async fn a_record_with_many_turns_costs_template_work_linear_in_its_turns() {
    let s = support::start(|_| {}).await;
    let dir = model_with_tokenizer(&s, "chatml-many-turns").await;
    let messages = tuneq_dataset::MAX_MESSAGES as u64 - 2;
    let before = tuneq_api::files::template_work(&dir);
    let response = upload(
        &s,
        &s.acme,
        "chatml-many-turns",
        chat_line(messages as usize / 2),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["validation"]["examples"], 1, "{body}");
    assert_eq!(body["validation"]["tokens"]["truncated"], 1, "{body}");
    assert!(
        body["validation"]["tokens"]["trained_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let work = tuneq_api::files::template_work(&dir) - before;
    // Rendering every prefix of the conversation costs messages²/2 (about 2 million);
    // a message at a time, a few times the messages.
    assert!(work <= 4 * messages + 16, "{work} messages rendered");
}

#[tokio::test]
async fn a_record_past_the_message_cap_is_refused_naming_line_and_field() {
    let s = support::start(|_| {}).await;
    model_with_tokenizer(&s, "chatml-cap").await;
    // The probe's 50 000 turn pairs: 3.6 MB on one line.
    let body = format!("{}{}", chat_line(1), chat_line(50_000));
    let response = upload(&s, &s.acme, "chatml-cap", body).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.unwrap();
    let line = &body["error"]["lines"][0];
    assert_eq!(line["line"], 2, "{body}");
    assert_eq!(line["field"], "messages", "{body}");
    assert!(
        line["message"].as_str().unwrap().contains("at most 2048"),
        "{body}"
    );
}

/// Polls `done` every 10 ms for at most a minute (a bound on waiting, not a timing
/// claim: the states it waits for come within milliseconds).
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..6000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: not within a minute");
}

#[tokio::test]
async fn a_client_that_hangs_up_stops_its_validation_and_frees_its_slot() {
    use tokio::io::AsyncWriteExt;
    let s = support::start(|_| {}).await;
    let dir = model_with_tokenizer(&s, "chatml-hang-up").await;
    // A tenant of its own: the counts below are per tenant and per process.
    let tenant = "hangs-up";
    tuneq_api::records::tenant::create_tenant(&s.state.queue, tenant, "Hangs up")
        .await
        .unwrap();
    let key = tuneq_api::records::tenant::add_key(&s.state.queue, tenant, None)
        .await
        .unwrap();
    // Lines of a thousand messages, each costing about three thousand messages rendered
    // to measure: seconds of work in all.
    let lines = 400;
    let body = chat_line(500).repeat(lines);
    let full_work = lines as u64 * 3000;
    let before = tuneq_api::files::template_work(&dir);
    let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    stream
        .write_all(
            format!(
                "POST /v1/files?filename=a.jsonl&model=chatml-hang-up HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    wait_until("the validation starts", || {
        tuneq_api::files::template_work(&dir) > before
    })
    .await;
    assert_eq!(tuneq_api::files::validations(tenant), 1);
    assert_eq!(s.state.upload_slots.held(tenant), 1);
    drop(stream);
    wait_until("the validation stops", || {
        tuneq_api::files::validations(tenant) == 0
    })
    .await;
    wait_until("the upload slot is free", || {
        s.state.upload_slots.held(tenant) == 0
    })
    .await;
    let work = tuneq_api::files::template_work(&dir) - before;
    assert!(
        work < full_work / 2,
        "the work went on after the client left: {work} of {full_work} messages rendered"
    );
    // Nothing was stored, and the tenant uploads again at once.
    let response = upload(&s, &key, "chatml-hang-up", chat_line(2)).await;
    assert_eq!(response.status(), StatusCode::OK);
}
