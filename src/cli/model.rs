//! `tuneq model …`: model utilities.

use anyhow::Result;
use clap::Subcommand;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tuneq_trainer::init::{InitOptions, Preset};

#[derive(Subcommand)]
pub enum ModelCommand {
    /// Write a Hugging Face–layout Llama with random weights and a real BPE tokenizer.
    Init {
        /// Size: tiny (≈5 M parameters), small (≈134 M) or smollm2-135m (SmolLM2-135M's
        /// shape, tied embeddings).
        #[arg(long, default_value = "tiny")]
        preset: Preset,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Split the weights into this many safetensors shards (with an index).
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Share the embedding matrix with lm_head (no lm_head.weight).
        #[arg(long)]
        tie_embeddings: bool,
        /// Add a Llama 3 rope_scaling block to the config.
        #[arg(long)]
        llama3_rope: bool,
        /// The family (its `model_type`): llama, qwen2 (the same shapes with q/k/v
        /// biases), qwen3 (with q/k head norms), mistral (Llama's maths, no window),
        /// gemma2, gemma3_text or phi3 (fused projections, Phi-4-mini's partial RoPE
        /// and LongRoPE).
        #[arg(long, default_value = "llama", value_parser = parse_architecture)]
        arch: tuneq_pools::Architecture,
    },
    /// The memory a fine-tune of a local model needs, by part (the estimate placement
    /// compares with a pool's memory), on the CPU and on a GPU.
    Estimate(EstimateArgs),
}

/// What `tuneq model estimate` is asked about.
#[derive(clap::Args)]
pub struct EstimateArgs {
    /// A model folder (config.json is enough).
    #[arg(long)]
    model: PathBuf,
    /// Examples per micro-batch.
    #[arg(long, default_value_t = 4)]
    batch_size: u64,
    /// Tokens per example.
    #[arg(long, default_value_t = 512)]
    max_seq_len: u64,
    /// LoRA rank (on all seven projections).
    #[arg(long, default_value_t = 8)]
    lora_r: u32,
    /// The dtype the frozen weights are held in [default: f32, or bf16 with
    /// `--compute bf16`].
    #[arg(long, value_enum)]
    dtype: Option<super::train::DtypeArg>,
    /// Activation checkpointing.
    #[arg(long, value_enum, default_value = "auto")]
    activation_checkpointing: super::train::CheckpointingArg,
    /// How the CPU computes the frozen projections (bf16 makes `auto` weights bf16).
    #[arg(long, value_enum, default_value = "f32")]
    compute: super::train::ComputeArg,
    /// A pool's memory per attempt (`32Gi`): with `auto`, layers are recomputed
    /// only when they would not fit in it otherwise.
    #[arg(long)]
    memory: Option<String>,
    /// One GPU's memory (`24G` for an L4): with `auto`, candle's graph recomputes
    /// layers only when they would not fit in it otherwise.
    #[arg(long)]
    accelerator_memory: Option<String>,
}

pub fn run(cmd: ModelCommand) -> Result<ExitCode> {
    match cmd {
        ModelCommand::Init {
            preset,
            seed,
            out,
            shards,
            tie_embeddings,
            llama3_rope,
            arch,
        } => {
            let opts = InitOptions {
                preset,
                seed,
                shards,
                tie_embeddings,
                llama3_rope,
                architecture: arch,
            };
            init(&opts, &out)
        }
        ModelCommand::Estimate(args) => estimate(args),
    }
}

/// A family by its `model_type`.
pub(crate) fn parse_architecture(
    name: &str,
) -> std::result::Result<tuneq_pools::Architecture, String> {
    tuneq_pools::Architecture::from_model_type(name).ok_or_else(|| {
        format!(
            "unknown architecture {name:?}; use one of {}",
            tuneq_pools::architecture::supported()
        )
    })
}

/// `tuneq model init`: writes the model and prints its shape as JSON.
fn init(opts: &InitOptions, out: &Path) -> Result<ExitCode> {
    let cfg = tuneq_trainer::init::write_model(opts, out)?;
    println!(
        "{}",
        serde_json::json!({
            "model": out.display().to_string(),
            "vocab_size": cfg.vocab_size(),
            "hidden_size": cfg.hidden_size(),
            "num_hidden_layers": cfg.num_hidden_layers(),
            "shards": opts.shards,
            "tie_word_embeddings": cfg.tie_word_embeddings(),
        })
    );
    Ok(ExitCode::SUCCESS)
}

/// `tuneq model estimate`: prints the memory a fine-tune needs on the CPU and on a GPU,
/// by part, and whether it fits the given memory.
fn estimate(args: EstimateArgs) -> Result<ExitCode> {
    let shape = match tuneq_pools::ModelShape::read(&args.model) {
        Some(Ok(shape)) => shape,
        Some(Err(refusal)) => {
            anyhow::bail!(super::BadInput(format!(
                "{}: {refusal}",
                args.model.display()
            )))
        }
        None => anyhow::bail!(super::BadInput(format!(
            "{}: no readable config.json",
            args.model.display()
        ))),
    };
    let limit = memory_flag("memory", args.memory)?;
    let accelerator_limit = memory_flag("accelerator-memory", args.accelerator_memory)?;
    let threads = compute_threads();
    if !(1..=4096).contains(&args.batch_size)
        || !(1..=1 << 20).contains(&args.max_seq_len)
        || !(1..=256).contains(&args.lora_r)
    {
        anyhow::bail!(super::BadInput(
            "--batch-size must be 1–4096, --max-seq-len 1–1048576 and --lora-r 1–256".into()
        ));
    }
    let lora = tuneq_openapi::LoraSpec {
        r: args.lora_r,
        ..tuneq_openapi::LoraSpec::default()
    };
    let compute = tuneq_openapi::ComputeKind::from(args.compute);
    let dtype = args.dtype;
    if compute == tuneq_openapi::ComputeKind::Bf16
        && dtype.is_some_and(|d| tuneq_openapi::DtypeKind::from(d) == tuneq_openapi::DtypeKind::F32)
    {
        return Err(super::BadInput(
            "--compute bf16 multiplies bf16 weights: use --dtype bf16 or auto".into(),
        )
        .into());
    }
    let default_dtype = match compute {
        tuneq_openapi::ComputeKind::Bf16 => tuneq_openapi::DtypeKind::Bf16,
        tuneq_openapi::ComputeKind::F32 => tuneq_openapi::DtypeKind::F32,
    };
    let ask = tuneq_pools::Ask {
        lora: &lora,
        max_seq_len: args.max_seq_len,
        batch_size: args.batch_size,
        dtype: dtype.map_or(default_dtype, Into::into),
        compute,
        checkpointing: args.activation_checkpointing.into(),
        dataset_tokens: 0,
    };
    let thread_scratch = tuneq_pools::thread_scratch_bytes(threads);
    let mut cpu = tuneq_pools::cpu_memory(
        &shape,
        &ask,
        limit.map(|l| l.saturating_sub(thread_scratch)),
    );
    cpu.scratch += thread_scratch;
    let gpu = tuneq_pools::graph_memory(&shape, &ask, true, accelerator_limit);
    let mib = |b: u64| b >> 20;
    let cpu = serde_json::json!({
        "path": "cpu-fused",
        "total_mib": mib(cpu.total()),
        "checkpointing": cpu.checkpointing,
        "runtime_mib": mib(cpu.runtime),
        "weights_mib": mib(cpu.weights),
        "loading_mib": mib(cpu.loading),
        "lora_state_mib": mib(cpu.lora_state),
        "step_mib": mib(cpu.step),
        "scratch_mib": mib(cpu.scratch),
        "threads": threads,
        "fits": limit.map(|l| cpu.total() <= l),
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "parameters": shape.parameters(),
            "cpu": cpu,
            "gpu": {
                "total_mib": mib(gpu.bytes),
                "checkpointing": gpu.checkpointing,
                "fits": accelerator_limit.map(|l| gpu.bytes <= l),
            },
        }))?
    );
    Ok(ExitCode::SUCCESS)
}

/// The bytes of memory flag `--flag` (`32Gi`, `24G`), when given.
fn memory_flag(flag: &str, text: Option<String>) -> Result<Option<u64>> {
    match text {
        Some(text) => Ok(Some(
            tuneq_pools::quantity::Quantity::memory(&text)
                .map_err(|e| super::BadInput(format!("--{flag} {text:?}: {e}")))?
                .value(),
        )),
        None => Ok(None),
    }
}

/// The compute threads a trainer would run with: the global `--threads` (a pool's
/// cores), else this machine's. Each adds some scratch.
fn compute_threads() -> u64 {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64))
}
