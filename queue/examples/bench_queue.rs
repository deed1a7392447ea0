//! The queue benchmark (`tuneq bench queue`) without building the whole service: the
//! same `tuneq_queue::bench::run`, the same defaults, the same last-line JSON. Handy when
//! working on the queue alone (`scripts/bench-queue --example` runs it).
//!
//! Usage: bench_queue --redis URL [--n 100000] [--workers 1,8] [--producers 8]
//!        [--seed 42] [--tenants 32] [--payload-bytes 200] [--warmup 2000]
//!        [--batch 1000] [--latency-at 1000,1000000]   (REDIS_URL is read too)

use std::process::ExitCode;
use tuneq_queue::bench::{QueueBenchOptions, run};

/// A comma-separated list of whole numbers ('' is the empty list).
fn numbers(flag: &str, value: &str) -> Result<Vec<usize>, String> {
    value
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|_| format!("{flag}: '{s}' is not a whole number"))
        })
        .collect()
}

fn options() -> Result<QueueBenchOptions, String> {
    let mut opts = QueueBenchOptions {
        redis_url: std::env::var("REDIS_URL").unwrap_or_default(),
        n: 100_000,
        workers: vec![1, 8],
        producers: 8,
        seed: 42,
        tenants: 32,
        payload_bytes: 200,
        warmup: 2_000,
        batch: 1_000,
        latency_depths: vec![1_000, 1_000_000],
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let one = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{flag}: '{v}' is not a whole number"))
        };
        match flag.as_str() {
            "--redis" => opts.redis_url = value,
            "--n" => opts.n = one(&value)?,
            "--workers" => opts.workers = numbers(&flag, &value)?,
            "--producers" => opts.producers = one(&value)?,
            "--seed" => opts.seed = value.parse().map_err(|_| format!("--seed: '{value}'"))?,
            "--tenants" => {
                opts.tenants = value.parse().map_err(|_| format!("--tenants: '{value}'"))?;
            }
            "--payload-bytes" => opts.payload_bytes = one(&value)?,
            "--warmup" => opts.warmup = one(&value)?,
            "--batch" => opts.batch = one(&value)?,
            "--latency-at" => opts.latency_depths = numbers(&flag, &value)?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if opts.redis_url.is_empty() {
        return Err("--redis URL (or REDIS_URL) is required".into());
    }
    Ok(opts)
}

fn main() -> ExitCode {
    let opts = match options() {
        Ok(opts) => opts,
        Err(e) => {
            eprintln!("bench_queue: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench_queue: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&opts, |line| eprintln!("{line}"))) {
        Ok(r) => {
            println!("{r}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench_queue: {e}");
            ExitCode::FAILURE
        }
    }
}
