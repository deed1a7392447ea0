//! `tuneq bench …`: benchmarks whose last output line is one JSON object.

use anyhow::Result;
use clap::Subcommand;
use std::process::ExitCode;
use tuneq_trainer::bench::BenchOptions;
use tuneq_trainer::init::Preset;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// LoRA training throughput on a random model (compare with peer_lora_bench.py).
    Train(TrainBench),
    /// API request rate and p99 on the Redis backend, beside an actix-web hello-world
    /// in the same run (scripts/bench-api starts a redis-server for it).
    Api {
        /// The redis-server the queue uses.
        #[arg(long, env = "REDIS_URL")]
        redis: String,
        /// Seconds per phase.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Concurrent connections.
        #[arg(long, default_value_t = 32)]
        connections: usize,
        /// Server worker threads (both servers; default: the machine's cores).
        #[arg(long)]
        workers: Option<usize>,
        /// Rounds of the three phases, alternating; figures are medians over them.
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Queue throughput and memory on a redis-server, with the BullMQ kit's workload
    /// and JSON keys (the kit: docs/benchmarks.md; scripts/bench-queue runs both).
    Queue(QueueBench),
    /// Decode throughput and time to first token of concurrent answers in the serving
    /// engine (compare with scripts/bench_serve.py's transformers + PEFT peer).
    Serve(ServeBench),
}

/// What `tuneq bench serve` runs.
#[derive(clap::Args)]
pub struct ServeBench {
    /// Base model folder.
    #[arg(long)]
    model: std::path::PathBuf,
    /// PEFT adapter folder.
    #[arg(long)]
    adapter: Option<std::path::PathBuf>,
    /// A user message (repeat; answer i uses message i mod their count).
    #[arg(long = "prompt", required = true)]
    prompts: Vec<String>,
    /// Answers at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Decode each answer alone on its thread instead of together.
    #[arg(long)]
    unbatched: bool,
}

/// What `tuneq bench train` runs.
#[derive(clap::Args)]
pub struct TrainBench {
    /// Model size.
    #[arg(long, default_value = "tiny")]
    preset: Preset,
    /// The family: llama, qwen2 (q/k/v biases), qwen3 (q/k head norms), mistral, gemma2,
    /// gemma3_text or phi3 (the last three on candle's graph), the preset's shape either
    /// way.
    #[arg(long, default_value = "llama", value_parser = super::model::parse_architecture)]
    arch: tuneq_pools::Architecture,
    /// Sequences per step.
    #[arg(long, short = 'B', default_value_t = 4)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, short = 'T', default_value_t = 256)]
    seq: usize,
    /// Timed steps.
    #[arg(long, short = 'N', default_value_t = 10)]
    steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How the frozen projections are computed: `f32` (what the PyTorch peer is
    /// compared in) or `bf16` (weights in bf16, bf16 operands: the own AVX512-BF16
    /// kernels, or AMX with a oneMKL build).
    #[arg(long, value_enum, default_value = "f32")]
    compute: super::train::ComputeArg,
}

impl TrainBench {
    fn options(self) -> BenchOptions {
        BenchOptions {
            preset: self.preset,
            architecture: self.arch,
            batch: self.batch,
            seq: self.seq,
            steps: self.steps,
            warmup: self.warmup,
            lr: self.lr,
            seed: self.seed,
            compute: self.compute.into(),
        }
    }
}

/// What `tuneq bench queue` runs.
#[derive(clap::Args)]
pub struct QueueBench {
    /// The redis-server to use (the same one BullMQ is measured on).
    #[arg(long, env = "REDIS_URL")]
    redis: String,
    /// Jobs per phase.
    #[arg(long, default_value_t = 100_000)]
    n: usize,
    /// Concurrent workers for the processing phases (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    workers: Vec<usize>,
    /// Producers in flight while enqueueing.
    #[arg(long, default_value_t = 8)]
    producers: usize,
    /// Workload seed (mulberry32, as in the BullMQ kit).
    #[arg(long, default_value_t = 42)]
    seed: u32,
    /// Tenants.
    #[arg(long, default_value_t = 32)]
    tenants: u32,
    /// Payload bytes.
    #[arg(long, default_value_t = 200)]
    payload_bytes: usize,
    /// Untimed warm-up jobs.
    #[arg(long, default_value_t = 2000)]
    warmup: usize,
    /// Jobs per bulk-enqueue call.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Queue depths at which claim latency is measured (comma-separated; empty skips).
    #[arg(long, value_delimiter = ',', default_value = "1000,1000000")]
    latency_at: Vec<usize>,
}

impl QueueBench {
    fn options(self) -> tuneq_queue::bench::QueueBenchOptions {
        tuneq_queue::bench::QueueBenchOptions {
            redis_url: self.redis,
            n: self.n,
            workers: self.workers,
            producers: self.producers,
            seed: self.seed,
            tenants: self.tenants,
            payload_bytes: self.payload_bytes,
            warmup: self.warmup,
            batch: self.batch,
            latency_depths: self.latency_at,
        }
    }
}

pub fn run(cmd: BenchCommand) -> Result<ExitCode> {
    match cmd {
        BenchCommand::Train(args) => {
            let opts = args.options();
            let r = tuneq_trainer::bench::run(&opts, |line| eprintln!("{line}"))?;
            println!("{}", serde_json::to_string(&r)?);
        }
        BenchCommand::Api {
            redis,
            seconds,
            connections,
            workers,
            runs,
        } => {
            let opts = super::bench_api::ApiBenchOptions {
                runs,
                redis_url: redis,
                seconds,
                connections,
                workers: workers
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from)),
            };
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let r = runtime.block_on(super::bench_api::run(&opts, |line| eprintln!("{line}")))?;
            println!("{}", serde_json::to_string(&r)?);
        }
        BenchCommand::Serve(args) => {
            let opts = tuneq_serve::bench::ServeBenchOptions {
                model: tuneq_serve::ModelKey {
                    base: args.model,
                    adapter: args.adapter,
                    template: tuneq_openapi::ChatTemplateChoice::Model,
                },
                prompts: args.prompts,
                concurrency: args.concurrency,
                max_new_tokens: args.max_new_tokens,
                batched: !args.unbatched,
            };
            let r = tuneq_serve::bench::run(&opts)?;
            println!("{}", serde_json::to_string(&r)?);
        }
        BenchCommand::Queue(args) => {
            let opts = args.options();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let r = runtime.block_on(tuneq_queue::bench::run(&opts, |line| eprintln!("{line}")))?;
            println!("{}", serde_json::to_string(&r)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}
