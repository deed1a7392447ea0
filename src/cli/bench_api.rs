//! `tuneq bench api`: the API's request rate and p99 latency on the Redis backend, beside
//! an actix-web hello-world (the framework's ceiling on this machine) in the same run.
//!
//! Both servers run in this process with the same number of workers; one load generator
//! (keep-alive HTTP/1.1 connections, each sending its next request when the answer
//! arrives) drives, in turn: the hello-world, `GET /finetunes/{id}`, and
//! `POST /finetunes` (each creates and enqueues a job). The load generator shares the
//! CPU with the servers, the same way for all three, so the ratios are comparable
//! while the absolute figures understate a dedicated server. With several runs the
//! three phases alternate, and each figure is the median over the runs (a shared
//! machine's noise moves neighbouring phases alike).

use anyhow::{Context, Result};
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to run.
pub struct ApiBenchOptions {
    /// The redis-server the queue uses.
    pub redis_url: String,
    /// Seconds per phase.
    pub seconds: f64,
    /// Concurrent connections.
    pub connections: usize,
    /// Server workers (threads) for both servers.
    pub workers: usize,
    /// Rounds of the three phases.
    pub runs: usize,
}

/// One phase's figures.
#[derive(Debug, Serialize)]
pub struct Phase {
    /// Requests answered per second.
    pub requests_per_s: f64,
    /// 99th-percentile latency (ms).
    pub p99_ms: f64,
    /// Median latency (ms).
    pub p50_ms: f64,
    /// Answers that were not the expected status.
    pub errors: u64,
}

/// All figures; the last output line.
#[derive(Debug, Serialize)]
pub struct ApiBenchResult {
    /// actix-web hello-world.
    pub hello: Phase,
    /// `GET /finetunes/{id}`.
    pub get_finetune: Phase,
    /// `POST /finetunes`.
    pub create_finetune: Phase,
    /// GET req/s over hello-world req/s (target ≥ 0.5).
    pub get_ratio: f64,
    /// POST req/s over hello-world req/s.
    pub create_ratio: f64,
    /// Median over the runs of each run's GET ratio.
    pub get_ratio_median_of_runs: f64,
    /// Connections.
    pub connections: usize,
    /// Server workers.
    pub workers: usize,
    /// Rounds of the three phases (each figure above is the median over them).
    pub runs: usize,
}

/// A request the load generator repeats.
#[derive(Clone)]
struct Target {
    method: reqwest::Method,
    url: String,
    key: Option<String>,
    body: Option<String>,
    expect: u16,
}

/// Drives `target` (named `name` in the log) from `connections` connections for
/// `seconds`.
async fn drive(
    name: &str,
    target: Target,
    connections: usize,
    seconds: f64,
    log: &impl Fn(&str),
) -> Result<Phase> {
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let target = target.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .http1_only()
                .build()
                .unwrap_or_default();
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            while Instant::now() < deadline {
                let mut request = client.request(target.method.clone(), &target.url);
                if let Some(key) = &target.key {
                    request = request.bearer_auth(key);
                }
                if let Some(body) = &target.body {
                    request = request
                        .header("content-type", "application/json")
                        .body(body.clone());
                }
                let started = Instant::now();
                match request.send().await {
                    Ok(r) => {
                        let ok = r.status().as_u16() == target.expect;
                        let _ = r.bytes().await;
                        if !ok {
                            errors += 1;
                        }
                    }
                    Err(_) => errors += 1,
                }
                latencies.push(started.elapsed());
            }
            (latencies, errors)
        }));
    }
    let started = Instant::now();
    let mut all = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (latencies, e) = task.await?;
        all.extend(latencies);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort();
    let at = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    let phase = Phase {
        requests_per_s: all.len() as f64 / elapsed,
        p99_ms: at(0.99),
        p50_ms: at(0.50),
        errors,
    };
    log(&format!(
        "{name:<18} {:>9.0} req/s  p99 {:.2} ms",
        phase.requests_per_s, phase.p99_ms
    ));
    Ok(phase)
}

/// Runs the three phases.
pub async fn run(opts: &ApiBenchOptions, log: impl Fn(&str)) -> Result<ApiBenchResult> {
    let (hello_url, hello_handle) = start_hello(opts.workers)?;
    let api = start_api(opts).await?;
    let (create_body, job_id) = create_job(&api).await?;
    log(&format!(
        "{} connections, {} server workers, {} s per phase",
        opts.connections, opts.workers, opts.seconds
    ));
    let targets = Targets {
        hello: Target {
            method: reqwest::Method::GET,
            url: hello_url,
            key: None,
            body: None,
            expect: 200,
        },
        get: Target {
            method: reqwest::Method::GET,
            url: format!("{}/finetunes/{job_id}", api.url),
            key: Some(api.key.clone()),
            body: None,
            expect: 200,
        },
        create: Target {
            method: reqwest::Method::POST,
            url: format!("{}/finetunes", api.url),
            key: Some(api.key.clone()),
            body: Some(create_body),
            expect: 200,
        },
    };
    let (hellos, gets, creates) = run_phases(opts, &targets, &log).await?;
    let run_ratios: Vec<f64> = gets
        .iter()
        .zip(&hellos)
        .map(|(g, h)| g.requests_per_s / h.requests_per_s.max(1e-9))
        .collect();
    let (hello, get, create) = (median(hellos), median(gets), median(creates));
    hello_handle.stop(true).await;
    api.handle.stop(true).await;
    if let Err(e) = api.queue.destroy().await {
        log(&format!("could not clean up the benchmark's keys: {e}"));
    }
    Ok(ApiBenchResult {
        get_ratio: get.requests_per_s / hello.requests_per_s.max(1e-9),
        create_ratio: create.requests_per_s / hello.requests_per_s.max(1e-9),
        get_ratio_median_of_runs: median_of(run_ratios),
        hello,
        get_finetune: get,
        create_finetune: create,
        connections: opts.connections,
        workers: opts.workers,
        runs: opts.runs.max(1),
    })
}

/// Starts the hello-world ceiling: a bare actix server on a free port. Returns its URL
/// and its handle.
fn start_hello(workers: usize) -> Result<(String, actix_web::dev::ServerHandle)> {
    let hello_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let hello_url = format!("http://{}/", hello_listener.local_addr()?);
    let hello = actix_web::HttpServer::new(|| {
        actix_web::App::new().route("/", actix_web::web::get().to(|| async { "Hello, world!" }))
    })
    .workers(workers)
    .disable_signals()
    .listen(hello_listener)?
    .run();
    let hello_handle = hello.handle();
    tokio::spawn(hello);
    Ok((hello_url, hello_handle))
}

/// tuneq's API under test, running on a free port.
struct Api {
    /// Holds the spool and the object store; removed when dropped.
    _dir: tempfile::TempDir,
    queue: tuneq_queue::Queue,
    url: String,
    /// The bench tenant's API key.
    key: String,
    handle: actix_web::dev::ServerHandle,
}

/// Starts tuneq's API on Redis, with one tenant and a base model, exactly as `tuneq
/// api` runs it: middleware (request span, metrics, access log) included.
async fn start_api(opts: &ApiBenchOptions) -> Result<Api> {
    let dir = tempfile::tempdir()?;
    let domain = format!("bench-api-{:08x}", rand::random::<u32>());
    let queue = tuneq_queue::Queue::connect(
        &opts.redis_url,
        &domain,
        tuneq_queue::QueueConfig::default(),
    )
    .await
    .context("cannot reach Redis")?;
    let state = tuneq_api::AppState::new(
        queue.clone(),
        Arc::new(tuneq_storage::LocalStore::new(dir.path().join("objects"))),
        tuneq_api::ApiConfig {
            spool_dir: dir.path().to_path_buf(),
            pools: Arc::new(tuneq_pools::PoolsFile::local(None)),
            ..tuneq_api::ApiConfig::default()
        },
    );
    let key = seed_tenant(&state).await?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tuneq_api::serve(listener, state.clone(), Some(opts.workers))?;
    let handle = server.handle();
    tokio::spawn(server);
    Ok(Api {
        _dir: dir,
        queue,
        url,
        key,
        handle,
    })
}

/// Creates the bench tenant and registers a base model. Returns the tenant's key.
async fn seed_tenant(state: &tuneq_api::AppState) -> Result<String> {
    let fail = |e: tuneq_api::ApiError| anyhow::anyhow!("{}", e.detail.message);
    tuneq_api::records::tenant::create_tenant(&state.queue, "bench", "Bench")
        .await
        .map_err(fail)?;
    let key = tuneq_api::records::tenant::add_key(&state.queue, "bench", None)
        .await
        .map_err(fail)?;
    tuneq_api::records::model::register(
        &state.queue,
        &tuneq_api::records::model::BaseModel::new("base", "/models/base", 2e-4),
    )
    .await
    .map_err(fail)?;
    Ok(key)
}

/// Uploads a small file and creates a job to read. Returns the create request's body
/// and the job's id.
async fn create_job(api: &Api) -> Result<(String, String)> {
    let (url, key) = (&api.url, &api.key);
    let http = reqwest::Client::new();
    let data: String = (0..64)
        .map(|i| format!("{{\"prompt\":\"question {i}\",\"completion\":\"answer {i}\"}}\n"))
        .collect();
    let file: serde_json::Value = http
        .post(format!("{url}/files?filename=bench.jsonl"))
        .bearer_auth(key)
        .body(data)
        .send()
        .await?
        .json()
        .await?;
    let create_body = serde_json::json!({"model": "base", "training_file": file["id"]}).to_string();
    let job: serde_json::Value = http
        .post(format!("{url}/finetunes"))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(create_body.clone())
        .send()
        .await?
        .json()
        .await?;
    let job_id = job["id"]
        .as_str()
        .context("the benchmark could not create its job")?
        .to_string();
    Ok((create_body, job_id))
}

/// What each phase requests.
struct Targets {
    hello: Target,
    get: Target,
    create: Target,
}

/// Every run's three phases, in order: hello-world, GET and POST.
async fn run_phases(
    opts: &ApiBenchOptions,
    targets: &Targets,
    log: &impl Fn(&str),
) -> Result<(Vec<Phase>, Vec<Phase>, Vec<Phase>)> {
    let (mut hellos, mut gets, mut creates) = (Vec::new(), Vec::new(), Vec::new());
    let phase = |name: &'static str, target: &Target| {
        drive(name, target.clone(), opts.connections, opts.seconds, log)
    };
    for run in 1..=opts.runs.max(1) {
        if opts.runs > 1 {
            log(&format!("run {run} of {}", opts.runs));
        }
        hellos.push(phase("hello-world", &targets.hello).await?);
        gets.push(phase("GET /finetunes/id", &targets.get).await?);
        creates.push(phase("POST /finetunes", &targets.create).await?);
    }
    Ok((hellos, gets, creates))
}

/// The phase with the median request rate.
fn median(mut phases: Vec<Phase>) -> Phase {
    phases.sort_by(|a, b| a.requests_per_s.total_cmp(&b.requests_per_s));
    let middle = phases.len() / 2;
    phases.swap_remove(middle)
}

/// The median of `values` (0 for none).
fn median_of(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}
