//! Times the whole LoRA step ([`forward_backward`]) and the evaluation loss on the
//! benchmark presets: batch 4 × 256, LoRA r = 8 on all seven projections, every token
//! labelled, random weights (f32, or bf16 with `--bf16`).
//!
//! `cargo run -p tuneq-kernels --example llama_step [iterations] [tiny|small]
//! [--checkpoint] [--bf16]`; set `RAYON_NUM_THREADS` to choose the pool. `--checkpoint`
//! runs the step with per-layer activation checkpointing
//! ([`StepOptions::checkpoint_layers`]); `--bf16` stores the frozen weights (embedding,
//! projections, head) as bf16, widened to f32 where they are used ([`Frozen`]).
//! Prints the median seconds per call, the step's [`step_bytes`] and the process's peak
//! resident memory (`VmHWM`, which includes the model's weights).

use std::time::Instant;

use half::bf16;
use rand::{Rng, SeedableRng};
use tuneq_kernels::llama::{
    Batch, Compute, Dims, Frozen, Layer, Lora, Model, OwnedBatch, Projection, StepOptions,
    forward_backward_with, loss, step_bytes,
};

/// A frozen matrix as the example stores it.
enum Stored {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Stored {
    /// `w` as f32, or rounded to bf16 (the f32 copy is dropped, so that the peak RSS is
    /// that of the bf16 storage).
    fn new(w: Vec<f32>, as_bf16: bool) -> Self {
        if as_bf16 {
            Self::Bf16(w.into_iter().map(bf16::from_f32).collect())
        } else {
            Self::F32(w)
        }
    }

    fn view(&self) -> Frozen<'_> {
        match self {
            Self::F32(w) => Frozen::F32(w),
            Self::Bf16(w) => Frozen::Bf16(w),
        }
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Peak resident set size in MiB, from `/proc/self/status` (Linux).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The command line: `[iterations] [tiny|small] [--checkpoint] [--bf16] [--bf16-compute]`.
struct Args {
    iterations: usize,
    preset: String,
    checkpoint_layers: bool,
    frozen_bf16: bool,
    compute: Compute,
}

impl Args {
    fn parse() -> Self {
        let flag = |name: &str| std::env::args().any(|a| a == name);
        let args: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with("--"))
            .collect();
        Self {
            iterations: args.first().and_then(|s| s.parse().ok()).unwrap_or(5),
            preset: args.get(1).cloned().unwrap_or_else(|| "tiny".into()),
            checkpoint_layers: flag("--checkpoint"),
            frozen_bf16: flag("--bf16"),
            compute: if flag("--bf16-compute") {
                Compute::Bf16
            } else {
                Compute::F32
            },
        }
    }
}

/// The architecture of a preset (`small`, else tiny).
fn preset_dims(preset: &str) -> Dims {
    match preset {
        "small" => Dims {
            vocab: 32000,
            hidden: 768,
            intermediate: 2048,
            layers: 12,
            heads: 12,
            kv_heads: 12,
            head_dim: 64,
            rotary_dim: 64,
            rms_eps: 1e-5,
            qk_norm: false,
            gemma: None,
        },
        _ => Dims {
            vocab: 4096,
            hidden: 256,
            intermediate: 688,
            layers: 4,
            heads: 8,
            kv_heads: 4,
            head_dim: 32,
            rotary_dim: 32,
            rms_eps: 1e-5,
            qk_norm: false,
            gemma: None,
        },
    }
}

/// `n` values drawn uniformly from `(-bound, bound)`.
fn random(rng: &mut rand_chacha::ChaCha8Rng, n: usize, bound: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-bound..bound)).collect()
}

/// The model's tensors: random weights and LoRA factors of rank `r`, unit norms, and
/// RoPE tables for `len` positions.
struct Tensors {
    embed: Stored,
    lm_head: Stored,
    ones: Vec<f32>,
    /// Per layer and projection.
    weights: Vec<Vec<Stored>>,
    /// Per layer and projection: A, B.
    factors: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    r: usize,
}

impl Tensors {
    /// Draws the tensors of `dims` from `rng`, the frozen ones stored as bf16 when
    /// `frozen_bf16`.
    fn random(
        dims: &Dims,
        r: usize,
        len: usize,
        frozen_bf16: bool,
        rng: &mut rand_chacha::ChaCha8Rng,
    ) -> Self {
        let (v, h) = (dims.vocab, dims.hidden);
        let embed = Stored::new(random(rng, v * h, 1.0), frozen_bf16);
        let lm_head = Stored::new(random(rng, v * h, 1.0 / (h as f32).sqrt()), frozen_bf16);
        let shapes: Vec<(usize, usize)> = (0..7).map(|p| dims.projection_shape(p)).collect();
        let weights: Vec<Vec<Stored>> = (0..dims.layers)
            .map(|_| {
                shapes
                    .iter()
                    .map(|&(i, o)| {
                        Stored::new(random(rng, o * i, 1.0 / (i as f32).sqrt()), frozen_bf16)
                    })
                    .collect()
            })
            .collect();
        let factors: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..dims.layers)
            .map(|_| {
                shapes
                    .iter()
                    .map(|&(i, o)| {
                        let a = random(rng, r * i, 1.0 / (i as f32).sqrt());
                        (a, random(rng, o * r, 0.01))
                    })
                    .collect()
            })
            .collect();
        let half = dims.head_dim / 2;
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..len * half)
            .map(|k| {
                let (p, i) = (k / half, k % half);
                let angle = p as f64 / 10_000f64.powf(2.0 * i as f64 / dims.head_dim as f64);
                (angle.cos() as f32, angle.sin() as f32)
            })
            .unzip();
        Self {
            embed,
            lm_head,
            ones: vec![1f32; h],
            weights,
            factors,
            cos,
            sin,
            r,
        }
    }

    /// The model as views of these tensors, LoRA (scale 2) on every projection.
    fn model(&self, dims: Dims, compute: Compute) -> Model<'_> {
        let layers = (0..dims.layers)
            .map(|l| Layer {
                qk_norm: None,
                gemma: None,
                input_norm: &self.ones,
                post_norm: &self.ones,
                proj: std::array::from_fn(|p| Projection {
                    bias: None,
                    weight: self.weights[l][p].view(),
                    lora: Some(Lora {
                        a: &self.factors[l][p].0,
                        b: &self.factors[l][p].1,
                        r: self.r,
                        scale: 2.0,
                    }),
                }),
            })
            .collect();
        Model {
            dims,
            embed: self.embed.view(),
            layers,
            norm: &self.ones,
            lm_head: self.lm_head.view(),
            cos: &self.cos,
            sin: &self.sin,
            local_rope: None,
            compute,
        }
    }
}

/// Runs the step and the evaluation loss `iterations + 1` times (the first a warm-up)
/// and returns each timed call's seconds and the last loss.
fn time_calls(
    model: &Model<'_>,
    batch: &Batch<'_>,
    iterations: usize,
    options: StepOptions,
) -> (Vec<f64>, Vec<f64>, f64) {
    let mut grads: Vec<Vec<f32>> = model
        .lora_lengths()
        .into_iter()
        .map(|len| vec![0f32; len])
        .collect();
    let scale = 1.0 / (batch.rows * batch.len) as f32;
    let (mut step, mut eval) = (Vec::new(), Vec::new());
    let mut last = 0.0;
    for i in 0..iterations + 1 {
        let t0 = Instant::now();
        last = forward_backward_with(model, batch, scale, None, &mut grads, options)
            .expect("a step")
            .loss;
        let t1 = Instant::now();
        let l = loss(model, batch, scale).expect("a loss");
        let t2 = Instant::now();
        assert_eq!(l.to_bits(), last.to_bits());
        if i >= 1 {
            step.push((t1 - t0).as_secs_f64());
            eval.push((t2 - t1).as_secs_f64());
        }
    }
    (step, eval, last)
}

fn main() {
    let args = Args::parse();
    let (iterations, preset) = (args.iterations, &args.preset);
    let (checkpoint_layers, frozen_bf16, compute) =
        (args.checkpoint_layers, args.frozen_bf16, args.compute);
    let options = StepOptions { checkpoint_layers };
    let dims = preset_dims(preset);
    let (rows, len, r) = (4, 256, 8);
    println!(
        "{preset}: rayon threads {}, {iterations} iterations, checkpointing {checkpoint_layers}, \
         bf16 weights {frozen_bf16}",
        rayon::current_num_threads()
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let tensors = Tensors::random(&dims, r, len, frozen_bf16, &mut rng);
    let model = tensors.model(dims, compute);
    let v = dims.vocab;
    let n = rows * len;
    let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    let targets: Vec<i64> = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
    let owned = OwnedBatch::unpacked(ids, targets, rows, len);
    let batch = owned.view();
    let (step, eval, last) = time_calls(&model, &batch, iterations, options);
    let held = step_bytes(
        &dims,
        n,
        &model.lora_ranks(),
        false,
        checkpoint_layers,
        frozen_bf16,
        compute,
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "loss {last:.4}; forward_backward {:.3} s, loss only {:.3} s (median); step_bytes {:.0} MiB; \
         frozen weights {:.0} MiB; peak RSS {:.0} MiB",
        median(step),
        median(eval),
        mib(held),
        mib(model.frozen_bytes()),
        peak_rss_mib().unwrap_or(f64::NAN)
    );
}
