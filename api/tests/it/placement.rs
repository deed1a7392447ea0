//! Placement at create, through the API: the pools file decides which pools a job may
//! use and in which order, what it is expected to cost, and refuses — naming the field
//! and the figures — a job that no pool can run or afford.
#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;
use support::{Server, create, examples, get_json, start, upload};
use tuneq_queue::JobQueue;

const POOLS: &str = r#"
[[pool]]
name = "cpu-spot"
runtime = "local"
hardware = "cpu"
spot = true
cpu = 2
memory = "4Gi"
price_per_hour = 3.6
tokens_per_second = 10

[[pool]]
name = "cpu-cheap"
runtime = "local"
hardware = "cpu"
cpu = 2
memory = "4Gi"
price_per_hour = 0.36
tokens_per_second = 10

[[pool]]
name = "cpu-tiny"
runtime = "local"
hardware = "cpu"
cpu = 1
memory = "1Mi"
"#;

/// Claims the next job of the spot pool as a dispatcher would.
async fn claim_spot(s: &Server) -> tuneq_queue::Lease {
    s.state
        .queue
        .claim_started("cpu-spot", "test", "")
        .await
        .unwrap()
        .unwrap()
}

/// The message of an error answer.
fn error_message(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap()
}

/// A server with the pools of [`POOLS`], a slot in each, and a dataset of `acme`'s (its id).
async fn start_with_pools() -> (Server, String) {
    let pools = tuneq_pools::PoolsFile::parse(POOLS, "pools.toml").unwrap();
    let s = start(|c| c.pools = Arc::new(pools.clone())).await;
    for pool in &pools.pools {
        s.state.queue.set_pool(&pool.name, 1).await.unwrap();
    }
    let file = upload(&s, &s.acme, &examples(8)).await;
    (s, file)
}

#[tokio::test]
async fn a_job_lists_the_pools_that_fit_spot_first_with_its_estimate_and_max_cost_is_kept() {
    let (s, file) = start_with_pools().await;

    let (status, job) = create(&s, &file, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    let estimate = &job["estimate"];
    // cpu-tiny cannot hold the attempt; spot comes first.
    assert_eq!(estimate["pools"], json!(["cpu-spot", "cpu-cheap"]), "{job}");
    assert_eq!(estimate["pool"], "cpu-spot");
    let seconds = estimate["seconds"].as_f64().unwrap();
    let cost = estimate["cost"].as_f64().unwrap();
    assert!(seconds > 0.0, "{estimate}");
    assert!((cost - seconds / 3600.0 * 3.6).abs() < 1e-9, "{estimate}");
    // Retrieved later, the job still shows it.
    let id = job["id"].as_str().unwrap();
    let got = get_json(&s, &format!("/v1/fine_tuning/jobs/{id}")).await;
    assert_eq!(got["estimate"], *estimate);

    // A budget the spot pool exceeds but the cheap one meets narrows the list.
    let (status, job) = create(&s, &file, json!({"max_cost": cost / 5.0})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    assert_eq!(job["estimate"]["pools"], json!(["cpu-cheap"]));

    // A budget no pool meets is refused with the cheapest figure, and nothing is queued.
    let before = s.state.queue.inspect().await.unwrap().jobs.len();
    let (status, body) = create(&s, &file, json!({"max_cost": cost / 100.0})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "max_cost");
    assert_eq!(body["error"]["code"], "over_budget");
    assert!(error_message(&body).contains("on cpu-cheap"), "{body}");
    assert_eq!(s.state.queue.inspect().await.unwrap().jobs.len(), before);

    for bad in [json!(-1.0), json!(0)] {
        let (status, body) = create(&s, &file, json!({"max_cost": bad})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["param"], "max_cost");
    }
    let (status, body) = create(&s, &file, json!({"hardware": "gpu"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "no_pool_fits");
    assert!(
        error_message(&body).ends_with("this service has: cpu, spot-cpu."),
        "{body}"
    );

    // The weights' dtype is the job's to choose; an unknown one is refused with the
    // values that exist.
    for dtype in ["f32", "bf16", "auto"] {
        let (status, job) = create(&s, &file, json!({"dtype": dtype})).await;
        assert_eq!(status, StatusCode::OK, "{dtype}: {job}");
        // The job says what it runs with; the defaults are shown as such.
        assert_eq!(job["dtype"], dtype, "{job}");
        assert_eq!(job["activation_checkpointing"], "auto", "{job}");
        assert_eq!(job["compute"], "f32", "{job}");
    }
    let (status, body) = create(&s, &file, json!({"dtype": "fp8"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "dtype", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("fp8") && message.contains("bf16"),
        "{body}"
    );
    for setting in ["auto", "on", "off"] {
        let (status, job) = create(&s, &file, json!({"activation_checkpointing": setting})).await;
        assert_eq!(status, StatusCode::OK, "{setting}: {job}");
        assert_eq!(job["activation_checkpointing"], setting, "{job}");
    }
    let (status, body) = create(&s, &file, json!({"activation_checkpointing": "maybe"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "activation_checkpointing", "{body}");

    // bf16 compute multiplies bf16 weights: with `auto` (or bf16) weights it is taken,
    // with f32 weights refused naming `compute`, and nothing is queued.
    for body in [
        json!({"compute": "bf16"}),
        json!({"compute": "bf16", "dtype": "bf16"}),
    ] {
        let (status, job) = create(&s, &file, body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{body}: {job}");
        assert_eq!(job["compute"], "bf16", "{job}");
        let id = job["id"].as_str().unwrap();
        let got = get_json(&s, &format!("/v1/fine_tuning/jobs/{id}")).await;
        assert_eq!(got["compute"], "bf16", "{got}");
    }
    let before = s.state.queue.inspect().await.unwrap().jobs.len();
    let (status, body) = create(&s, &file, json!({"compute": "bf16", "dtype": "f32"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "compute", "{body}");
    assert!(error_message(&body).contains("dtype"), "{body}");
    assert_eq!(s.state.queue.inspect().await.unwrap().jobs.len(), before);
    let (status, body) = create(&s, &file, json!({"compute": "fp8"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "compute", "{body}");
}

/// One trainer report on attempt `token` of `job`.
async fn report(s: &support::Server, job: &str, token: u64, events: Value) -> StatusCode {
    let credential = s.state.config.attempt_signer.sign(job, token);
    s.post_json(
        &credential,
        &format!("/internal/attempts/{job}/report"),
        &json!({"seq": token * 100, "events": events}),
    )
    .await
    .status()
}

fn step(step: u64, tokens_per_s: f64) -> Value {
    json!({"event": "step", "step": step, "total_steps": 10, "epoch": 0, "loss": 1.0,
        "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": tokens_per_s, "elapsed_s": 1.0,
        "eta_s": 5.0, "tokens_seen": step * 100})
}

#[tokio::test]
async fn estimates_use_the_speed_trainers_report_and_lost_steps_are_counted_per_pool() {
    let (s, file) = start_with_pools().await;
    let (_, job) = create(&s, &file, json!({})).await;
    let from_file = job["estimate"]["seconds"].as_f64().unwrap();

    // Its first attempt on the spot pool trains at 100 times the file's figure, gets
    // to step 3 and is preempted; the next resumes from the checkpoint at step 1.
    let first = claim_spot(&s).await;
    let started = json!({"event": "started", "total_steps": 10, "start_step": 0,
        "train_examples": 8, "validation_examples": 0, "trainable_params": 10,
        "dataset_format": "prompt_completion"});
    let events = json!([started, step(1, 1000.0), step(2, 1000.0), step(3, 1000.0)]);
    assert_eq!(
        report(&s, &first.id, first.token, events).await,
        StatusCode::OK
    );
    support::reclaim(&s, &first).await;
    let second = claim_spot(&s).await;
    assert_eq!(second.id, first.id);
    let resumed = json!([{"event": "resumed", "step": 1, "checkpoint": "file:///c/step-1"}]);
    assert_eq!(
        report(&s, &second.id, second.token, resumed).await,
        StatusCode::OK
    );

    // Its events say where it was placed and why.
    let events: Value = s
        .json_as(
            &s.acme,
            &format!(
                "/v1/fine_tuning/jobs/{}/events",
                job["id"].as_str().unwrap()
            ),
        )
        .await;
    let placed = events["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["message"].as_str())
        .find(|m| m.starts_with("Placed on node pool"))
        .unwrap_or_else(|| panic!("no placement event in {events}"));
    assert!(
        placed.starts_with(
            "Placed on node pool cpu-spot: the first of the job's pools (cpu-spot, cpu-cheap;"
        ),
        "{placed}"
    );

    let (_, job) = create(&s, &file, json!({})).await;
    let measured = job["estimate"]["seconds"].as_f64().unwrap();
    assert!(
        (measured * 100.0 - from_file).abs() < from_file * 1e-9,
        "the estimate must follow the measured speed: {measured} s vs {from_file} s from the file"
    );
    let metrics = s.get_without_key("/metrics").await.text().await.unwrap();
    for line in [
        "tuneq_pool_tokens_per_second{pool=\"cpu-spot\"} 1000",
        "tuneq_lost_steps_total{pool=\"cpu-spot\"} 2",
        "tuneq_lost_steps_total{pool=\"cpu-cheap\"} 0",
        // The second job waits in line; the first runs.
        "tuneq_queue_waiting_jobs 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in:\n{metrics}"
        );
    }
}
