//! Placement at create, through the API: the pools file decides which pools a job may
//! use and in which order, what it is expected to cost, and refuses — naming the field
//! and the figures — a job that no pool can run or afford.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;
use support::{create, examples, start, upload};
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

#[tokio::test]
async fn a_job_lists_the_pools_that_fit_spot_first_with_its_estimate_and_max_cost_is_kept() {
    let pools = tuneq_pools::PoolsFile::parse(POOLS, "pools.toml").unwrap();
    let s = start(|c| c.pools = Arc::new(pools.clone())).await;
    for pool in &pools.pools {
        s.state.queue.set_pool(&pool.name, 1).await.unwrap();
    }
    let file = upload(&s, &s.acme, &examples(8)).await;

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
    let got: Value = reqwest::Client::new()
        .get(format!(
            "{}/v1/fine_tuning/jobs/{}",
            s.url,
            job["id"].as_str().unwrap()
        ))
        .bearer_auth(&s.acme)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("on cpu-cheap"),
        "{body}"
    );
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
        body["error"]["message"]
            .as_str()
            .unwrap()
            .ends_with("this service has: cpu, spot-cpu."),
        "{body}"
    );
}
