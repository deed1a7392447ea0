//! `tuneq bench queue`: the BullMQ kit's workload (`docs/benchmarks.md`), run
//! against tuneq's Redis queue on the same server, reported under the same JSON keys.
//!
//! Same payload (200-byte JSON, `mulberry32(42)` drawing tenant then priority), same
//! tenants (32) and priorities (0–9, 9 first), same warm-up (2 000), 8 producers in
//! flight for enqueue, and 1 and 8 concurrent no-op workers for processing N jobs queued
//! beforehand. A processed job costs the whole protocol: claim (capacity, quota and
//! fair-share charged, lease and fencing token issued), start, and complete. Workers
//! run it as a synchronous runtime would: `claim_started` when idle, then
//! `complete_and_claim`, which completes a job and hands over the next one, started
//! (one script per job, as BullMQ's moveToFinished fetches the next job).

use crate::{JobQueue, Queue};
use crate::{NewJob, QueueConfig, QueueError, Result};
use serde::Serialize;
use std::time::Instant;

/// What to run.
#[derive(Debug, Clone)]
pub struct QueueBenchOptions {
    /// `redis://…` of the server (the same one the BullMQ kit uses).
    pub redis_url: String,
    /// Jobs per phase.
    pub n: usize,
    /// Concurrent workers for the processing phases.
    pub workers: Vec<usize>,
    /// Producers in flight while enqueueing.
    pub producers: usize,
    /// Workload seed.
    pub seed: u32,
    /// Tenants.
    pub tenants: u32,
    /// Payload size (bytes of JSON).
    pub payload_bytes: usize,
    /// Untimed warm-up jobs (loads the scripts).
    pub warmup: usize,
    /// Jobs per bulk-enqueue call (the kit's `addBulk` batches).
    pub batch: usize,
    /// Queue depths at which claim latency is measured (empty: skip).
    pub latency_depths: Vec<usize>,
}

/// One processing phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessFigure {
    /// Concurrent workers.
    pub worker_concurrency: usize,
    /// `remove` (delete on completion) or `keep1000`.
    pub retention: String,
    /// Jobs per second.
    pub jobs_per_s: u64,
    /// Wall time.
    pub seconds: f64,
    /// redis-server CPU per job (µs).
    pub redis_cpu_us_per_job: f64,
    /// This process's CPU per job (µs).
    pub client_cpu_us_per_job: f64,
}

/// mulberry32, exactly as the BullMQ kit defines it, so both draw the same workload.
struct Mulberry32(u32);

impl Mulberry32 {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x6d2b_79f5);
        let mut t = self.0;
        t = (t ^ (t >> 15)).wrapping_mul(t | 1);
        t ^= t.wrapping_add((t ^ (t >> 7)).wrapping_mul(t | 61));
        f64::from(t ^ (t >> 14)) / 4_294_967_296.0
    }
}

/// The kit's jobs: tenant and priority drawn in that order, payload padded to size.
pub fn workload(n: usize, seed: u32, tenants: u32, payload_bytes: usize) -> Vec<NewJob> {
    let mut rnd = Mulberry32(seed);
    (0..n)
        .map(|i| {
            let tenant = format!("tenant-{:03}", (rnd.next_f64() * f64::from(tenants)) as u32);
            let priority = (rnd.next_f64() * 10.0) as u8;
            let base =
                format!(r#"{{"tenant":"{tenant}","priority":{priority},"seq":{i},"pad":""}}"#);
            let pad = "x".repeat(payload_bytes.saturating_sub(base.len()));
            NewJob {
                payload: format!(
                    r#"{{"tenant":"{tenant}","priority":{priority},"seq":{i},"pad":"{pad}"}}"#
                ),
                tenant,
                priority,
                pools: Vec::new(),
                gpus: 1,
                estimated_seconds: 0,
                max_attempts: 3,
                idempotency_key: None,
                notify: false,
            }
        })
        .collect()
}

/// One section of redis-server's `INFO`.
async fn info(conn: &mut redis::aio::ConnectionManager, section: &str) -> Result<String> {
    redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .map_err(QueueError::from_redis)
}

/// The value of `field` in an `INFO` text.
fn info_value<'a>(text: &'a str, field: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// A numeric `INFO` field.
async fn info_number(
    conn: &mut redis::aio::ConnectionManager,
    section: &str,
    field: &str,
) -> Result<f64> {
    info_value(&info(conn, section).await?, field)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| QueueError::Protocol(format!("INFO {section} has no {field}")))
}

/// CPU seconds redis-server used so far (user + system), from one `INFO cpu`.
async fn redis_cpu_s(conn: &mut redis::aio::ConnectionManager) -> Result<f64> {
    let text = info(conn, "cpu").await?;
    let seconds = |field| {
        info_value(&text, field)
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| QueueError::Protocol(format!("INFO cpu has no {field}")))
    };
    Ok(seconds("used_cpu_user")? + seconds("used_cpu_sys")?)
}

/// CPU seconds this process used (user + system), from /proc/self/stat.
fn own_cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the command name; 100 Hz ticks.
    (ticks(11) + ticks(12)) / 100.0
}

async fn enqueue_all(queue: &Queue, jobs: &[NewJob], producers: usize) -> Result<f64> {
    let started = Instant::now();
    let chunk = jobs.len().div_ceil(producers.max(1));
    let mut tasks = Vec::new();
    for part in jobs.chunks(chunk.max(1)) {
        let queue = queue.clone();
        let part = part.to_vec();
        tasks.push(tokio::spawn(async move {
            for job in &part {
                queue.enqueue(job).await?;
            }
            Ok::<_, QueueError>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| QueueError::Failed(e.into()))??;
    }
    Ok(started.elapsed().as_secs_f64())
}

async fn drain(queue: &Queue, n: usize, workers: usize) -> Result<f64> {
    let started = Instant::now();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let queue = queue.clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let owner = format!("bench-worker-{w}");
            // The lease the last completion handed over, already started.
            let mut next = None;
            while done.load(std::sync::atomic::Ordering::Relaxed) < n {
                let lease = match next.take() {
                    Some(lease) => Some(lease),
                    None => queue.claim_started("bench", &owner, "").await?,
                };
                match lease {
                    Some(lease) => {
                        next = queue
                            .complete_and_claim(&lease.id, lease.token, "{}", "bench", &owner)
                            .await?;
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    None => tokio::task::yield_now().await,
                }
            }
            Ok::<_, QueueError>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| QueueError::Failed(e.into()))??;
    }
    Ok(started.elapsed().as_secs_f64())
}

async fn enqueue_bulk_all(queue: &Queue, jobs: &[NewJob], batch: usize) -> Result<f64> {
    let started = Instant::now();
    for chunk in jobs.chunks(batch.max(1)) {
        for r in queue.enqueue_bulk(chunk).await? {
            r?;
        }
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Claim latency with `depth` jobs queued: `samples` claims (each then completed,
/// untimed), percentiles in microseconds.
async fn claim_latency(queue: &Queue, samples: usize) -> Result<(f64, f64)> {
    let mut micros = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        let lease = queue
            .claim("bench", "latency", "")
            .await?
            .ok_or_else(|| QueueError::Protocol("queue ran dry while measuring latency".into()))?;
        micros.push(t.elapsed().as_secs_f64() * 1e6);
        queue.complete(&lease.id, lease.token, "{}").await?;
    }
    micros.sort_by(f64::total_cmp);
    let pct = |p: f64| micros[((micros.len() - 1) as f64 * p).round() as usize];
    Ok((pct(0.5), pct(0.99)))
}

fn domain(tag: &str) -> String {
    format!("bench-{tag}-{:08x}", rand::random::<u32>())
}

/// Runs every phase and returns the figures as one JSON object (the BullMQ kit's keys).
pub async fn run(opts: &QueueBenchOptions, log: impl Fn(&str)) -> Result<serde_json::Value> {
    let jobs = workload(opts.n, opts.seed, opts.tenants, opts.payload_bytes);
    let payload_avg =
        jobs.iter().map(|j| j.payload.len()).sum::<usize>() as f64 / jobs.len().max(1) as f64;
    let admin = Queue::connect(&opts.redis_url, &domain("admin"), bench_config(0)).await?;
    let Some(mut conn) = admin.redis_connection() else {
        return Err(QueueError::Invalid {
            field: "redis",
            message: "the benchmark needs a Redis server".into(),
        });
    };
    let server = info(&mut conn, "server").await?;
    let version = info_value(&server, "redis_version")
        .unwrap_or("unknown")
        .to_string();
    if opts.warmup > 0 {
        warm_up(opts).await?;
        log(&format!("warm-up done ({} jobs)", opts.warmup));
    }
    let mut out = serde_json::json!({
        "bench": "tuneq",
        "n": opts.n,
        "payload_bytes_avg": (payload_avg * 10.0).round() / 10.0,
        "producers": opts.producers,
        "worker_concurrency": opts.workers,
        "seed": opts.seed,
        "tenants": opts.tenants,
        "versions": {"tuneq": env!("CARGO_PKG_VERSION"), "redis": version},
        "host": {"cpus": std::thread::available_parallelism().map_or(1, |n| n.get())},
    });
    measure_enqueue(opts, &jobs, &mut conn, &mut out, &log).await?;
    measure_bulk_enqueue(opts, &jobs, &mut out, &log).await?;
    let figures = measure_processing(opts, &jobs, &mut conn, &mut out, &log).await?;
    // Plain numbers and strings: serialising them cannot fail.
    out["process"] = serde_json::to_value(&figures).unwrap_or_default();
    measure_claim_latency(opts, &mut out, &log).await?;
    admin.destroy().await?;
    Ok(out)
}

/// The queue settings of a benchmark queue keeping `retention_count` finished jobs.
fn bench_config(retention_count: u64) -> QueueConfig {
    QueueConfig {
        retention_count,
        ..QueueConfig::default()
    }
}

/// Runs `opts.warmup` jobs through a queue of their own, so that the measured phases
/// start on a warm server.
async fn warm_up(opts: &QueueBenchOptions) -> Result<()> {
    let q = Queue::connect(&opts.redis_url, &domain("warmup"), bench_config(0)).await?;
    q.set_pool("bench", u32::MAX).await?;
    let warm = workload(
        opts.warmup,
        opts.seed.wrapping_add(1),
        opts.tenants,
        opts.payload_bytes,
    );
    enqueue_all(&q, &warm, opts.producers).await?;
    drain(&q, opts.warmup, 1).await?;
    q.destroy().await
}

/// Enqueue, 8 in flight, and memory per waiting job.
async fn measure_enqueue(
    opts: &QueueBenchOptions,
    jobs: &[NewJob],
    conn: &mut redis::aio::ConnectionManager,
    out: &mut serde_json::Value,
    log: &impl Fn(&str),
) -> Result<()> {
    let q = Queue::connect(&opts.redis_url, &domain("add"), bench_config(0)).await?;
    let before = info_number(conn, "memory", "used_memory").await?;
    let (r0, c0) = (redis_cpu_s(conn).await?, own_cpu_s());
    let seconds = enqueue_all(&q, jobs, opts.producers).await?;
    let (r1, c1) = (redis_cpu_s(conn).await?, own_cpu_s());
    let after = info_number(conn, "memory", "used_memory").await?;
    let n = opts.n as f64;
    out["enqueue_add_jobs_per_s"] = serde_json::json!((n / seconds).round() as u64);
    out["enqueue_add_seconds"] = serde_json::json!((seconds * 1000.0).round() / 1000.0);
    out["enqueue_add_cpu_us_per_job"] = serde_json::json!({
        "redis": ((r1 - r0) * 1e6 / n).round(), "client": ((c1 - c0) * 1e6 / n).round()});
    out["mem_bytes_per_waiting_job"] = serde_json::json!(((after - before) / n).round() as i64);
    log(&format!(
        "enqueue: {} jobs/s, {} B per waiting job",
        out["enqueue_add_jobs_per_s"], out["mem_bytes_per_waiting_job"]
    ));
    q.destroy().await
}

/// Bulk enqueue, one batch in flight.
async fn measure_bulk_enqueue(
    opts: &QueueBenchOptions,
    jobs: &[NewJob],
    out: &mut serde_json::Value,
    log: &impl Fn(&str),
) -> Result<()> {
    let q = Queue::connect(&opts.redis_url, &domain("bulk"), bench_config(0)).await?;
    let seconds = enqueue_bulk_all(&q, jobs, opts.batch).await?;
    out["enqueue_addbulk_jobs_per_s"] = serde_json::json!((opts.n as f64 / seconds).round() as u64);
    log(&format!(
        "bulk enqueue: {} jobs/s",
        out["enqueue_addbulk_jobs_per_s"]
    ));
    q.destroy().await
}

/// Processing with deletion on completion and with the last 1 000 kept, at each worker
/// concurrency.
async fn measure_processing(
    opts: &QueueBenchOptions,
    jobs: &[NewJob],
    conn: &mut redis::aio::ConnectionManager,
    out: &mut serde_json::Value,
    log: &impl Fn(&str),
) -> Result<Vec<ProcessFigure>> {
    let mut figures = Vec::new();
    for (label, keep) in [("remove", 0u64), ("keep1000", 1000)] {
        for &workers in &opts.workers {
            let q = Queue::connect(&opts.redis_url, &domain("proc"), bench_config(keep)).await?;
            q.set_pool("bench", u32::MAX).await?;
            enqueue_all(&q, jobs, opts.producers).await?;
            let (r0, c0) = (redis_cpu_s(conn).await?, own_cpu_s());
            let seconds = drain(&q, opts.n, workers).await?;
            let (r1, c1) = (redis_cpu_s(conn).await?, own_cpu_s());
            let n = opts.n as f64;
            let figure = ProcessFigure {
                worker_concurrency: workers,
                retention: label.to_string(),
                jobs_per_s: (n / seconds).round() as u64,
                seconds: (seconds * 1000.0).round() / 1000.0,
                redis_cpu_us_per_job: ((r1 - r0) * 1e6 / n).round(),
                client_cpu_us_per_job: ((c1 - c0) * 1e6 / n).round(),
            };
            out[format!("process_c{workers}_{label}_jobs_per_s")] =
                serde_json::json!(figure.jobs_per_s);
            log(&format!(
                "process c={workers} {label}: {} jobs/s",
                figure.jobs_per_s
            ));
            figures.push(figure);
            q.destroy().await?;
        }
    }
    Ok(figures)
}

/// Claim latency as the queue grows: it must stay flat (sorted sets are O(log n)).
async fn measure_claim_latency(
    opts: &QueueBenchOptions,
    out: &mut serde_json::Value,
    log: &impl Fn(&str),
) -> Result<()> {
    let mut latency = Vec::new();
    for &depth in &opts.latency_depths {
        let q = Queue::connect(&opts.redis_url, &domain("latency"), bench_config(0)).await?;
        q.set_pool("bench", u32::MAX).await?;
        let samples = 2_000.min(depth.max(1));
        let fill = workload(
            depth + samples,
            opts.seed.wrapping_add(7),
            opts.tenants,
            opts.payload_bytes,
        );
        enqueue_bulk_all(&q, &fill, 1_000).await?;
        let (p50, p99) = claim_latency(&q, samples).await?;
        log(&format!(
            "claim latency at {depth} queued: p50 {p50:.0} µs, p99 {p99:.0} µs"
        ));
        latency.push(
            serde_json::json!({"queued": depth, "p50_us": p50.round(), "p99_us": p99.round()}),
        );
        q.destroy().await?;
    }
    if let (Some(first), Some(last)) = (latency.first(), latency.last()) {
        let ratio = last["p50_us"].as_f64().unwrap_or(0.0)
            / first["p50_us"].as_f64().unwrap_or(1.0).max(1.0);
        out["claim_latency_p50_ratio_deepest_vs_shallowest"] =
            serde_json::json!((ratio * 100.0).round() / 100.0);
    }
    out["claim_latency"] = serde_json::Value::Array(latency);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_matches_the_bullmq_kit() {
        // First draws of mulberry32(42), as JavaScript computes them.
        let mut r = Mulberry32(42);
        let first = r.next_f64();
        assert!((first - 0.6011037519201636).abs() < 1e-15, "{first}");
        let jobs = workload(3, 42, 32, 200);
        assert!(jobs.iter().all(|j| j.payload.len() == 200));
        assert_eq!(jobs[0].tenant, "tenant-019");
        assert_eq!(jobs[0].priority, 4);
        assert!(
            jobs[0]
                .payload
                .starts_with(r#"{"tenant":"tenant-019","priority":4,"seq":0,"#)
        );
    }
}
