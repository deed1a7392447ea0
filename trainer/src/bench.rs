//! `tuneq bench train`: LoRA training throughput on a random model and random tokens,
//! configured like `peer_lora_bench.py` (PyTorch + PEFT) so the two can be compared in
//! one run: same presets, batch × sequence, LoRA r=8/α=16 on all seven projections,
//! AdamW, labels = inputs.

use crate::error::Result;
use crate::init::{InitOptions, Preset, preset_config};
use crate::lora::LoraSettings;
use crate::optim::{AdamW, AdamWConfig};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::time::Instant;

/// Benchmark settings.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Model size.
    pub preset: Preset,
    /// The family (its random model has the family's biases or norms).
    pub architecture: tuneq_pools::Architecture,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed warm-up steps.
    pub warmup: usize,
    /// Learning rate.
    pub lr: f64,
    /// Seed.
    pub seed: u64,
    /// How the frozen projections are computed: `f32` (the peer comparison's), or
    /// `bf16` (weights held in bf16, bf16 operands: AVX512-BF16, or AMX with a oneMKL
    /// build).
    pub compute: tuneq_openapi::ComputeKind,
}

/// What the benchmark measured (the last line of its output, as JSON).
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// Always `tuneq_bench_train`.
    pub bench: String,
    /// `tiny` or `small`.
    pub preset: String,
    /// The family's `model_type`.
    pub architecture: String,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Compute threads.
    pub threads: usize,
    /// Timed steps.
    pub timed_steps: usize,
    /// Tokens per second over the timed steps.
    pub tokens_per_s: f64,
    /// Mean seconds per step.
    pub s_per_step: f64,
    /// Median seconds per step.
    pub s_per_step_median: f64,
    /// Fastest step.
    pub s_per_step_min: f64,
    /// Peak resident memory of the process (VmHWM).
    pub peak_rss_mib: f64,
    /// Trainable parameters.
    pub params_trainable: u64,
    /// First and last loss.
    pub loss_first: f64,
    /// Loss of the last step.
    pub loss_last: f64,
    /// Load average before and after.
    pub loadavg_1m_before_after: [f64; 2],
    /// The compute path, GEMM library and CPU features the steps ran on.
    pub compute: crate::compute::ComputeEnv,
}

/// Peak resident set size of this process in MiB (Linux; 0 elsewhere).
pub fn peak_rss_mib() -> f64 {
    status_kib("VmHWM:").map_or(0.0, |kib| kib as f64 / 1024.0)
}

/// This process's peak resident memory so far (`VmHWM`), in bytes; `None` off Linux.
pub fn peak_resident_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|kib| kib << 10)
}

/// This process's resident memory now (`VmRSS`), in bytes; `None` off Linux.
pub fn resident_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|kib| kib << 10)
}

/// A `kB` field of `/proc/self/status`, e.g. `VmRSS:`.
fn status_kib(field: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// Runs the benchmark, reporting each step through `progress`.
pub fn run(opts: &BenchOptions, mut progress: impl FnMut(&str)) -> Result<BenchResult> {
    let init = InitOptions {
        preset: opts.preset,
        seed: opts.seed,
        shards: 1,
        tie_embeddings: false,
        llama3_rope: false,
        architecture: opts.architecture,
    };
    let cfg = preset_config(&init);
    let settings = LoraSettings {
        r: 8,
        alpha: 16.0,
        dropout: 0.0,
        // Every projection of the family (Phi-3's four fused ones).
        targets: opts
            .architecture
            .projections()
            .iter()
            .map(|s| s.to_string())
            .collect(),
        rslora: false,
    };
    let mut rng = crate::batch::rng_for(opts.seed, crate::batch::streams::LORA_INIT);
    let bf16 = opts.compute == tuneq_openapi::ComputeKind::Bf16;
    let dtype = if bf16 {
        candle_core::DType::BF16
    } else {
        candle_core::DType::F32
    };
    let mut model =
        crate::init::random_model_in(cfg.clone(), opts.seed, Some((&settings, &mut rng)), dtype)?;
    model.set_cpu_compute(opts.compute);
    let vars = model.lora_vars();
    let trainable = vars.iter().map(|v| v.var.elem_count() as u64).sum();
    let mut opt = AdamW::new(
        vars,
        AdamWConfig {
            weight_decay: 0.01,
            ..Default::default()
        },
    )?;
    let mut data_rng = rand_chacha::ChaCha20Rng::seed_from_u64(opts.seed + 1);
    let (b, t) = (opts.batch, opts.seq);
    let mut times = Vec::new();
    let mut losses = Vec::new();
    let load_before = loadavg();
    let mut timed_total = 0.0;
    for i in 0..opts.warmup + opts.steps {
        let ids: Vec<u32> = (0..b * t)
            .map(|_| data_rng.random_range(0..cfg.vocab_size() as u32))
            .collect();
        let batch = crate::batch::lm_batch(ids, b, t);
        let t0 = Instant::now();
        let r = crate::train::accumulate(&model, std::slice::from_ref(&batch), None)?;
        opt.step(&r.grads, opts.lr, 1.0)?;
        let dt = t0.elapsed().as_secs_f64();
        losses.push(r.loss);
        let tag = if i < opts.warmup {
            "warmup step"
        } else {
            "step"
        };
        progress(&format!("{tag} {i}: loss {:.5}  {dt:.3}s", r.loss));
        if i >= opts.warmup {
            times.push(dt);
            timed_total += dt;
        }
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let n = times.len().max(1) as f64;
    Ok(BenchResult {
        bench: "tuneq_bench_train".into(),
        preset: match opts.preset {
            Preset::Tiny => "tiny".into(),
            Preset::Small => "small".into(),
            Preset::Smollm2 => "smollm2-135m".into(),
        },
        architecture: opts.architecture.model_type().into(),
        batch: b,
        seq: t,
        threads: candle_core::utils::get_num_threads(),
        timed_steps: times.len(),
        tokens_per_s: (b * t * times.len()) as f64 / timed_total.max(1e-9),
        s_per_step: timed_total / n,
        s_per_step_median: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
        s_per_step_min: sorted.first().copied().unwrap_or(0.0),
        peak_rss_mib: peak_rss_mib(),
        params_trainable: trainable,
        loss_first: losses.first().copied().unwrap_or(f64::NAN),
        loss_last: losses.last().copied().unwrap_or(f64::NAN),
        loadavg_1m_before_after: [load_before, loadavg()],
        compute: crate::compute::ComputeEnv::detect(&model),
    })
}
