//! The CPU fast path: a whole LoRA step through `tuneq-kernels`, reading the model's
//! own tensors in place.
//!
//! candle's autograd moves about six times the bytes a LoRA step needs on the CPU (see
//! `docs/trainer-speed.md`); the fused kernels do the same arithmetic
//! without the graph. The candle graph stays the CUDA path, the bf16 path, and the
//! oracle this path is tested against (`fast_path_matches_the_graph`): loss and every
//! LoRA gradient within 1e-5.
//!
//! Which path runs is [`ComputePath::for_model`]: this one for f32 on the CPU unless
//! `TUNEQ_CPU_PATH=graph` asks for the graph (to compare, or to rule the fast path out).

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::model::Llama;
use crate::step::{Objective, StepDropout, StepResult, Tally};
use candle_core::{DType, Device, Storage, StorageRef, Tensor};
use std::borrow::Cow;
use tuneq_kernels::llama;

mod split;

/// How a step is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputePath {
    /// candle's autograd graph (any device and dtype).
    Graph,
    /// The fused CPU kernels (f32 compute on the CPU; frozen weights f32 or bf16).
    CpuFused,
}

impl ComputePath {
    /// The path for `model`: fused on a CPU model (f32, or bf16 weights with f32
    /// compute) the kernels take ([`tuneq_pools::ModelShape::trains_fused`]: a family
    /// they implement, without a window that binds), unless `TUNEQ_CPU_PATH=graph` asks
    /// for the graph (which then computes in the model's dtype).
    pub fn for_model(model: &Llama) -> Self {
        let forced_graph = std::env::var("TUNEQ_CPU_PATH").is_ok_and(|v| v == "graph");
        let fused_dtype = matches!(model.dtype(), DType::F32 | DType::BF16);
        let fused_model = model.cfg.shape.trains_fused();
        if model.device().is_cpu() && fused_dtype && fused_model && !forced_graph {
            Self::CpuFused
        } else {
            Self::Graph
        }
    }

    /// What a run on the CPU says when the fused kernels do not take `model` (its family,
    /// or a sliding window that binds), so the job's events tell why it is slower; None
    /// otherwise.
    pub fn graph_fallback(model: &Llama) -> Option<String> {
        let (shape, architecture) = (&model.cfg.shape, model.cfg.architecture());
        if !model.device().is_cpu() || shape.trains_fused() {
            return None;
        }
        let why = match (architecture.fused(), shape.binding_window()) {
            (true, Some(window)) => format!(
                "the fused CPU kernels do not implement sliding windows, and its window of {window} positions is shorter than its context"
            ),
            _ => "the fused CPU kernels do not implement this family yet".to_string(),
        };
        Some(format!(
            "this {} model trains on candle's graph on the CPU ({why}), so steps take several times longer than on the fused kernels",
            architecture.model_type()
        ))
    }

    /// Its name in checkpoints and benchmark reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Graph => "candle-graph",
            Self::CpuFused => "cpu-fused",
        }
    }
}

/// Read guards on the model's tensors, so their CPU slices can be lent to the kernels,
/// and f32 copies of the few small bf16 tensors the kernels take only in f32 (norms).
struct Held<'t> {
    guards: Vec<(StorageRef<'t>, usize, usize)>,
    widened: Vec<Vec<f32>>,
}

/// Where a held tensor is: lent in place, or widened into [`Held::widened`].
#[derive(Clone, Copy)]
enum HeldAt {
    Guard(usize),
    Widened(usize),
}

impl<'t> Held<'t> {
    /// Holds `t`, a contiguous f32 or bf16 CPU tensor, in place.
    fn hold(&mut self, t: &'t Tensor) -> Result<HeldAt> {
        let (storage, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(not_fused("a model tensor is not contiguous"));
        };
        if !matches!(&*storage, Storage::Cpu(_)) || !matches!(t.dtype(), DType::F32 | DType::BF16) {
            return Err(not_fused("a model tensor is not f32 or bf16 on the CPU"));
        }
        self.guards.push((storage, start, end));
        Ok(HeldAt::Guard(self.guards.len() - 1))
    }

    /// Holds rows `rows` of `t` (a contiguous matrix, or a vector: rows of one) in place,
    /// or all of it.
    fn hold_rows(&mut self, t: &'t Tensor, rows: Option<std::ops::Range<usize>>) -> Result<HeldAt> {
        let at = self.hold(t)?;
        let (Some(rows), HeldAt::Guard(i)) = (rows, at) else {
            return Ok(at);
        };
        let width = t.elem_count() / t.dim(0)?.max(1);
        let (_, start, end) = &mut self.guards[i];
        let (from, to) = (*start + rows.start * width, *start + rows.end * width);
        if to > *end || from > to {
            return Err(not_fused("a fused projection's part is outside its matrix"));
        }
        (*start, *end) = (from, to);
        Ok(at)
    }

    /// Holds `t` as f32: in place when it is f32, else as an exact f32 copy (for the
    /// small tensors the kernels only take in f32).
    fn hold_f32(&mut self, t: &'t Tensor) -> Result<HeldAt> {
        if t.dtype() == DType::F32 {
            return self.hold(t);
        }
        let widened = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        self.widened.push(widened);
        Ok(HeldAt::Widened(self.widened.len() - 1))
    }

    /// An f32 tensor held by [`Self::hold_f32`] (or [`Self::hold`] of an f32 tensor).
    fn slice(&self, at: HeldAt) -> &[f32] {
        match at {
            HeldAt::Widened(i) => &self.widened[i],
            HeldAt::Guard(_) => match self.frozen(at) {
                llama::Frozen::F32(s) => s,
                // Only f32 tensors are held in place where f32 is needed; an empty
                // view makes the kernels refuse the model by its lengths.
                llama::Frozen::Bf16(_) => &[],
            },
        }
    }

    /// A frozen matrix held by [`Self::hold`], as stored.
    fn frozen(&self, at: HeldAt) -> llama::Frozen<'_> {
        let HeldAt::Guard(i) = at else {
            return llama::Frozen::F32(self.slice(at));
        };
        let (storage, start, end) = &self.guards[i];
        match &**storage {
            Storage::Cpu(cpu) => match cpu.as_slice::<f32>() {
                Ok(s) => llama::Frozen::F32(&s[*start..*end]),
                Err(_) => llama::Frozen::Bf16(
                    cpu.as_slice::<half::bf16>()
                        .map_or(&[][..], |s| &s[*start..*end]),
                ),
            },
            // `hold` refuses every other storage; an empty view makes the kernels
            // refuse the model by its lengths rather than panic.
            _ => llama::Frozen::F32(&[]),
        }
    }
}

fn not_fused(message: &str) -> Error {
    Error::Model {
        path: "cpu fast path".into(),
        message: message.into(),
    }
}

fn kernel_error(e: llama::StepError) -> Error {
    Error::Model {
        path: "cpu fast path".into(),
        message: e.to_string(),
    }
}

/// Where a LoRA branch's factors are in [`Held`], with its rank and scale.
#[derive(Clone, Copy)]
struct LoraIdx {
    a: HeldAt,
    b: HeldAt,
    r: usize,
    scale: f32,
}

/// Where one layer's tensors are in [`Held`].
struct LayerIdx {
    norms: [HeldAt; 2],
    /// Qwen3's q and k head norms.
    qk_norm: Option<[HeldAt; 2]>,
    /// Each projection's weight, bias and LoRA.
    proj: Vec<(HeldAt, Option<HeldAt>, Option<LoraIdx>)>,
}

/// Runs `f` with the kernels' view of `model`.
fn with_model<T>(model: &Llama, f: impl FnOnce(&Kernels<'_>) -> Result<T>) -> Result<T> {
    let cfg = &model.cfg;
    let mut held = Held {
        guards: Vec::new(),
        widened: Vec::new(),
    };
    let (top, layer_norms) = model.frozen_parts();
    // embed, norm, lm_head, cos, sin: the two matrices as stored, the rest in f32.
    let top: Vec<HeldAt> = top
        .into_iter()
        .enumerate()
        .map(|(i, t)| match i {
            0 | 2 => held.hold(t),
            _ => held.hold_f32(t),
        })
        .collect::<Result<_>>()?;
    let mut layers = Vec::with_capacity(model.layers.len());
    for (l, (layer, norms)) in model.layers.iter().zip(&layer_norms).enumerate() {
        let norms = [held.hold_f32(norms[0])?, held.hold_f32(norms[1])?];
        let qk_norm = match model.qk_norm(l) {
            Some((q, k)) => Some([held.hold_f32(q)?, held.hold_f32(k)?]),
            None => None,
        };
        let widths = (
            cfg.num_attention_heads() * cfg.head_dim(),
            cfg.num_kv_heads() * cfg.head_dim(),
        );
        let proj = split::kernel_projections(&mut held, layer, widths)?;
        layers.push(LayerIdx {
            norms,
            qk_norm,
            proj,
        });
    }
    let long = match (model.cfg.longrope_context(), model.rope_f32_for(usize::MAX)) {
        (Some(context), (cos, sin)) => Some((held.hold_f32(cos)?, held.hold_f32(sin)?, context)),
        (None, _) => None,
    };
    let layers = layers
        .iter()
        .map(|l| {
            let proj: Vec<llama::Projection<'_>> = l
                .proj
                .iter()
                .map(|&(w, bias, lora)| llama::Projection {
                    weight: held.frozen(w),
                    bias: bias.map(|b| held.slice(b)),
                    lora: lora.map(|l| llama::Lora {
                        a: held.slice(l.a),
                        b: held.slice(l.b),
                        r: l.r,
                        scale: l.scale,
                    }),
                })
                .collect();
            let proj: [llama::Projection<'_>; 7] = proj
                .try_into()
                .map_err(|_| not_fused("a layer without seven projections"))?;
            Ok(llama::Layer {
                input_norm: held.slice(l.norms[0]),
                post_norm: held.slice(l.norms[1]),
                qk_norm: l.qk_norm.map(|[q, k]| llama::QkNorm {
                    q: held.slice(q),
                    k: held.slice(k),
                }),
                proj,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let kernels = llama::Model {
        dims: llama::Dims {
            vocab: cfg.vocab_size(),
            hidden: cfg.hidden_size(),
            intermediate: cfg.intermediate_size(),
            layers: cfg.num_hidden_layers(),
            heads: cfg.num_attention_heads(),
            kv_heads: cfg.num_kv_heads(),
            head_dim: cfg.head_dim(),
            rotary_dim: cfg.rotary_dim(),
            rms_eps: cfg.rms_norm_eps as f32,
            qk_norm: cfg.architecture().qk_norm(),
        },
        embed: held.frozen(top[0]),
        layers,
        norm: held.slice(top[1]),
        lm_head: held.frozen(top[2]),
        cos: held.slice(top[3]),
        sin: held.slice(top[4]),
        compute: model.cpu_compute,
    };
    let long = long.map(|(cos, sin, context)| (held.slice(cos), held.slice(sin), context));
    f(&Kernels {
        model: kernels,
        long,
    })
}

/// The kernels' view of a model, with LongRoPE's tables past its pretraining context.
struct Kernels<'m> {
    model: llama::Model<'m>,
    /// LongRoPE's long cosines and sines, and the positions the usual ones cover.
    long: Option<(&'m [f32], &'m [f32], usize)>,
}

impl<'m> Kernels<'m> {
    /// The model a batch at `positions` runs on: with LongRoPE's long tables where its
    /// last position is past the pretraining context (as [`Llama::rope_for`] decides).
    fn at(&self, positions: &[u32]) -> Cow<'_, llama::Model<'m>> {
        let end = positions.iter().max().map_or(0, |&p| p as usize + 1);
        match self.long {
            Some((cos, sin, context)) if end > context => Cow::Owned(llama::Model {
                cos,
                sin,
                ..self.model.clone()
            }),
            _ => Cow::Borrowed(&self.model),
        }
    }
}

/// The kernels' view of a micro-batch: a packed batch's own layout, or positions from 0
/// in every row with every token seeing its row from the start (ordinary causal
/// attention).
struct BatchView<'b> {
    positions: Cow<'b, [u32]>,
    starts: Cow<'b, [u32]>,
}

impl<'b> BatchView<'b> {
    fn new(b: &'b Batch) -> Self {
        match &b.packing {
            Some(p) => Self {
                positions: Cow::Borrowed(&p.positions),
                starts: Cow::Borrowed(&p.starts),
            },
            None => Self {
                positions: (0..b.rows * b.len).map(|k| (k % b.len) as u32).collect(),
                starts: vec![0; b.rows * b.len].into(),
            },
        }
    }

    fn of<'a>(&'a self, b: &'a Batch) -> llama::Batch<'a> {
        llama::Batch {
            ids: &b.ids,
            rows: b.rows,
            len: b.len,
            targets: &b.targets,
            positions: &self.positions,
            starts: &self.starts,
        }
    }
}

/// [`crate::train::accumulate_for`] on the fused kernels: the same loss, gradients and
/// dropout masks (drawn from the same stream in the same order), for `objective`: the
/// mean cross-entropy, or DPO, whose micro-batches run the weighted step
/// (`llama::forward_backward_weighted`).
pub fn accumulate(
    model: &Llama,
    batches: &[Batch],
    mut dropout: Option<StepDropout<'_>>,
    objective: Objective<'_>,
) -> Result<StepResult> {
    let vars = model.lora_vars();
    let denom = batches.iter().map(|b| b.labelled).sum::<usize>().max(1) as f64;
    let scale = (1.0 / denom) as f32;
    let mut grads: Vec<Vec<f32>> = vars.iter().map(|v| vec![0.0; v.var.elem_count()]).collect();
    let mut tally = Tally::default();
    let options = llama::StepOptions {
        checkpoint_layers: model.checkpoint_layers,
    };
    let mut dpo = objective.dpo();
    // A fused projection's parts are the kernels' own projections: their gradients are
    // kept apart and folded into the model's after the micro-batches (`split`).
    let fused = model.cfg.architecture().fuses_projections();
    let repeated = &split::repeated_masks(&model.layers)?;
    let mut kernel_grads: Vec<Vec<f32>> = Vec::new();
    with_model(model, |whole| {
        if fused {
            kernel_grads = whole
                .model
                .lora_lengths()
                .into_iter()
                .map(|n| vec![0.0; n])
                .collect();
        }
        for (m, b) in batches.iter().enumerate() {
            let view = BatchView::new(b);
            let kernels = whole.at(&view.positions);
            let kernels = kernels.as_ref();
            let mut asked = 0;
            let mut last: Vec<f32> = Vec::new();
            let mut draw = dropout.as_mut().filter(|d| d.p > 0.0).map(|d| {
                move |rows: usize, width: usize| -> Vec<f32> {
                    let again = repeated.get(asked).copied().unwrap_or(false);
                    asked += 1;
                    if again && last.len() == rows * width {
                        return last.clone();
                    }
                    let mask = crate::lora::draw_mask(d.rng, d.p, rows * width);
                    if let Some(record) = d.record.as_deref_mut()
                        && let Ok(t) = Tensor::from_vec(mask.clone(), (rows, width), &Device::Cpu)
                    {
                        record.push(t);
                    }
                    last.clone_from(&mask);
                    mask
                }
            });
            let masks = draw
                .as_mut()
                .map(|f| f as &mut dyn FnMut(usize, usize) -> Vec<f32>);
            let batch = view.of(b);
            let into = match fused {
                true => &mut kernel_grads,
                false => &mut grads,
            };
            let l = match dpo.as_mut() {
                Some((step, reference)) => {
                    let mut weigh = |losses: &[f64]| step.weigh(losses, b.len, &reference[m]);
                    llama::forward_backward_weighted(
                        kernels, &batch, &mut weigh, masks, into, options,
                    )
                }
                None => llama::forward_backward_with(kernels, &batch, scale, masks, into, options),
            }
            .map_err(kernel_error)?;
            // Summed as the graph path sums its per-micro-batch f32 losses.
            tally.loss += l.loss as f32 as f64;
            tally.correct += l.correct;
            tally.tokens += b.tokens;
            tally.labelled += b.labelled;
        }
        Ok(())
    })?;
    if fused {
        let targets = split::gradient_targets(&model.layers)?;
        for (part, (var, offset)) in kernel_grads.iter().zip(targets) {
            let into = &mut grads[var][offset..offset + part.len()];
            into.iter_mut().zip(part).for_each(|(g, p)| *g += p);
        }
    }
    let grads = grads
        .into_iter()
        .zip(&vars)
        .map(|(g, v)| Tensor::from_vec(g, v.var.shape(), &Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(StepResult::new(tally, grads, dpo.map(|(step, _)| step)))
}

/// Every position's loss `−log p(target)` of `batch` (0 where it has no target),
/// without gradients or dropout.
pub fn token_losses(model: &Llama, batch: &Batch) -> Result<Vec<f64>> {
    let view = BatchView::new(batch);
    with_model(model, |kernels| {
        llama::token_losses(&kernels.at(&view.positions), &view.of(batch)).map_err(kernel_error)
    })
}

/// The bytes one micro-batch of `tokens` positions holds on the fused path besides the
/// model and the gradients (see `tuneq_kernels::llama::step_bytes`).
pub fn step_bytes(
    model: &Llama,
    tokens: usize,
    dropout: bool,
    checkpoint_layers: bool,
) -> Result<u64> {
    with_model(model, |whole| {
        let kernels = &whole.model;
        Ok(llama::step_bytes(
            &kernels.dims,
            tokens,
            &kernels.lora_ranks(),
            dropout,
            checkpoint_layers,
            model.dtype() == DType::BF16,
            kernels.compute,
        ))
    })
}

/// The summed loss of `batch` divided by `denominator`, without gradients or dropout,
/// and the labelled tokens whose target has the largest logit.
pub fn loss(model: &Llama, batch: &Batch, denominator: f64) -> Result<(f64, u64)> {
    let view = BatchView::new(batch);
    with_model(model, |kernels| {
        let scale = (1.0 / denominator) as f32;
        let measured =
            llama::loss_and_correct(&kernels.at(&view.positions), &view.of(batch), scale)
                .map_err(kernel_error)?;
        Ok((measured.loss, measured.correct))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{InitOptions, Preset, preset_config};
    use crate::lora::LoraSettings;
    use rand::{Rng, SeedableRng};

    /// A tiny-preset model with LoRA on `targets` and every B drawn non-zero, so every
    /// gradient depends on the whole adapter.
    fn model(targets: &[&str], tie: bool, llama3_rope: bool, kv_heads: usize) -> Llama {
        build(LLAMA, targets, tie, llama3_rope, kv_heads, None)
    }

    const LLAMA: tuneq_pools::Architecture = tuneq_pools::Architecture::Llama;

    /// [`model`] of another family.
    fn model_of(architecture: tuneq_pools::Architecture, targets: &[&str]) -> Llama {
        build(architecture, targets, false, false, 4, None)
    }

    /// [`model`] of `architecture`, or with `bf16_held_as`, the same model with every
    /// frozen tensor rounded to bf16 and held in that dtype (bf16 itself, or its exact
    /// f32 widening).
    fn build(
        architecture: tuneq_pools::Architecture,
        targets: &[&str],
        tie: bool,
        llama3_rope: bool,
        kv_heads: usize,
        bf16_held_as: Option<DType>,
    ) -> Llama {
        let opts = InitOptions {
            preset: Preset::Tiny,
            seed: 3,
            shards: 1,
            tie_embeddings: tie,
            llama3_rope,
            architecture,
        };
        let mut cfg = preset_config(&opts);
        cfg.shape.num_key_value_heads = Some(kv_heads as u64);
        let settings = LoraSettings {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            rslora: false,
        };
        let mut weights = crate::init::random_weights(&cfg, 3).expect("weights");
        let dtype = bf16_held_as.unwrap_or(DType::F32);
        if bf16_held_as.is_some() {
            for (_, t) in &mut weights {
                *t = t
                    .to_dtype(DType::BF16)
                    .and_then(|b| b.to_dtype(dtype))
                    .expect("rounded");
            }
        }
        let mut map = crate::weights::WeightMap::from_tensors(weights, "random");
        let mut rng = crate::batch::rng_for(5, 0);
        let m = Llama::from_weights(
            cfg,
            &mut map,
            dtype,
            &Device::Cpu,
            Some((&settings, &mut rng)),
        )
        .expect("model");
        fill_b(&m);
        m
    }

    /// Draws every LoRA B non-zero (the same values for models of the same shape).
    fn fill_b(m: &Llama) {
        let mut fill = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for v in m
            .lora_vars()
            .iter()
            .filter(|v| v.name.ends_with("lora_B.weight"))
        {
            let values: Vec<f32> = (0..v.var.elem_count())
                .map(|_| fill.random_range(-0.05..0.05))
                .collect();
            v.var
                .set(&Tensor::from_vec(values, v.var.shape(), &Device::Cpu).expect("B"))
                .expect("set B");
        }
    }

    /// Two micro-batches: right-padded rows with unlabelled prompts.
    /// Two micro-batches of two padded rows, of the examples' lengths in pairs.
    fn batches(vocab: u32, lens: [usize; 4]) -> Vec<Batch> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let mut examples = Vec::new();
        for len in lens {
            let ids: Vec<u32> = (0..len).map(|_| rng.random_range(1..vocab)).collect();
            let prompt = len / 3;
            let labels = ids
                .iter()
                .enumerate()
                .map(|(i, &t)| if i < prompt { -100 } else { t as i64 })
                .collect();
            examples.push(crate::data::Example {
                input_ids: ids,
                labels,
            });
        }
        examples
            .chunks(2)
            .map(|pair| crate::batch::make_batch(&pair.iter().collect::<Vec<_>>(), 0))
            .collect()
    }

    /// Short rows: the step runs its layers batch-wide.
    const SHORT: [usize; 4] = [40, 23, 31, 17];

    /// Rows of 260 and 256 tokens: two row groups per micro-batch (see
    /// `tuneq_kernels::llama`'s row groups).
    const GROUPED: [usize; 4] = [260, 200, 150, 256];

    fn compare(name: &str, m: &Llama, dropout: f64, lens: [usize; 4]) {
        let data = batches(m.cfg.vocab_size() as u32, lens);
        let run = |fused: bool| {
            let mut rng = crate::batch::rng_for(7, crate::batch::streams::DROPOUT);
            let mut masks = Vec::new();
            let d = Some(StepDropout {
                p: dropout,
                rng: &mut rng,
                record: Some(&mut masks),
            });
            let r = if fused {
                accumulate(m, &data, d, Objective::CrossEntropy)
            } else {
                crate::train::accumulate_on_graph(m, &data, d)
            };
            (r.expect("a step"), masks)
        };
        let ((fast, fast_masks), (graph, graph_masks)) = (run(true), run(false));
        assert_eq!(fast_masks.len(), graph_masks.len(), "{name}: masks drawn");
        for (a, b) in fast_masks.iter().zip(&graph_masks) {
            let diff = (a - b)
                .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
                .expect("diff");
            assert_eq!(diff, 0.0, "{name}: the paths drew different dropout masks");
        }
        let loss_err = (fast.loss - graph.loss).abs() / graph.loss.abs();
        assert!(
            loss_err <= 1e-5,
            "{name}: loss {} vs graph {} ({loss_err:.1e})",
            fast.loss,
            graph.loss
        );
        let mut worst = 0f64;
        for (v, (f, g)) in m
            .lora_vars()
            .iter()
            .zip(fast.grads.iter().zip(&graph.grads))
        {
            let (err, scale) = max_error_and_scale(f, g);
            assert!(
                scale > 0.0,
                "{name}: {} has a zero gradient; the check would be vacuous",
                v.name
            );
            let rel = err / scale;
            worst = worst.max(rel);
            assert!(
                rel <= 1e-5,
                "{name}: {} differs from the graph by {rel:.1e} of its largest entry",
                v.name
            );
        }
        eprintln!("{name}: loss rel {loss_err:.1e}, worst gradient rel {worst:.1e}");
    }

    /// `max |got − want|` and `max |want|`.
    fn max_error_and_scale(got: &Tensor, want: &Tensor) -> (f64, f64) {
        let max_abs = |t: candle_core::Result<Tensor>| {
            t.and_then(|t| t.abs()?.max_all()?.to_scalar::<f32>())
                .expect("max") as f64
        };
        (max_abs(got - want), max_abs(Ok(want.clone())))
    }

    #[test]
    fn fast_path_matches_the_graph() {
        let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
        compare(
            "all seven, GQA 8/4",
            &model(&all, false, false, 4),
            0.0,
            SHORT,
        );
        compare(
            "q and v, MHA, tied, llama3 rope",
            &model(&["q_proj", "v_proj"], true, true, 8),
            0.0,
            SHORT,
        );
        compare(
            "Qwen2 (q/k/v biases), all seven",
            &model_of(tuneq_pools::Architecture::Qwen2, &all),
            0.0,
            SHORT,
        );
        compare(
            "Qwen3 (q/k head norms), all seven, row groups",
            &model_of(tuneq_pools::Architecture::Qwen3, &all),
            0.0,
            GROUPED,
        );
        // Phi-3: fused qkv and gate_up as the kernels' parts, three quarters of each
        // head rotated, LongRoPE's short tables for one micro-batch (31 positions) and
        // its long ones for the other (40, past its context of 32).
        let phi3 = tuneq_pools::Architecture::Phi3;
        compare(
            "Phi-3 (fused projections, partial RoPE, LongRoPE), all four",
            &model_of(phi3, &tuneq_openapi::FUSED_PROJECTIONS),
            0.0,
            SHORT,
        );
        compare(
            "Phi-3 qkv and down, dropout 0.1 (one mask per fused projection), row groups",
            &model_of(phi3, &["qkv_proj", "down_proj"]),
            0.1,
            GROUPED,
        );
        let dropping = model(&all, false, false, 2);
        compare("all seven, dropout 0.1", &dropping, 0.1, SHORT);
        compare(
            "all seven, dropout 0.1, row groups",
            &dropping,
            0.1,
            GROUPED,
        );
    }

    #[test]
    fn a_packed_micro_batch_gives_the_padded_batch_s_loss_and_gradients() {
        let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
        let m = model(&all, false, false, 4);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let examples: Vec<crate::data::Example> = [48usize, 9, 20, 13, 30, 6]
            .iter()
            .map(|&len| {
                let ids: Vec<u32> = (0..len).map(|_| rng.random_range(1..4096)).collect();
                let labels = ids
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| if i < 2 { -100 } else { t as i64 })
                    .collect();
                crate::data::Example {
                    input_ids: ids,
                    labels,
                }
            })
            .collect();
        let refs: Vec<_> = examples.iter().collect();
        let padded = crate::batch::make_batch(&refs, 0);
        let packed = crate::batch::pack_batch(&refs, 0);
        assert!(
            packed.rows * packed.len < padded.rows * padded.len,
            "packing saved nothing"
        );
        let step = |batch: &Batch| {
            accumulate(
                &m,
                std::slice::from_ref(batch),
                None,
                Objective::CrossEntropy,
            )
            .expect("a step")
        };
        let (a, b) = (step(&padded), step(&packed));
        assert!(
            (a.loss - b.loss).abs() <= 1e-6 * a.loss.abs(),
            "{} vs {}",
            a.loss,
            b.loss
        );
        for (v, (x, y)) in m.lora_vars().iter().zip(a.grads.iter().zip(&b.grads)) {
            let (err, scale) = max_error_and_scale(y, x);
            assert!(
                err <= 1e-5 * scale,
                "{}: packed differs by {err} (max {scale})",
                v.name
            );
        }
        let graph = crate::train::accumulate_on_graph(&m, std::slice::from_ref(&packed), None);
        assert!(graph.is_err(), "the graph must refuse a packed batch");
    }

    #[test]
    fn checkpointing_layers_changes_no_bit() {
        let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
        let mut m = model(&all, false, false, 4);
        let data = batches(m.cfg.vocab_size() as u32, SHORT);
        let run = |m: &Llama| {
            let mut rng = crate::batch::rng_for(7, crate::batch::streams::DROPOUT);
            let d = Some(StepDropout {
                p: 0.1,
                rng: &mut rng,
                record: None,
            });
            accumulate(m, &data, d, Objective::CrossEntropy).expect("a step")
        };
        let kept = run(&m);
        m.checkpoint_layers = true;
        let recomputed = run(&m);
        assert_eq!(kept.loss.to_bits(), recomputed.loss.to_bits());
        for (a, b) in kept.grads.iter().zip(&recomputed.grads) {
            let (a, b) = (
                a.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("a"),
                b.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("b"),
            );
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "a gradient changed"
            );
        }
        let (without, with) = (
            step_bytes(&m, 512, true, false).expect("bytes"),
            step_bytes(&m, 512, true, true).expect("bytes"),
        );
        assert!(
            with < without / 2,
            "checkpointing should hold far less: {with} vs {without}"
        );
    }

    /// The evaluation loss, and the tokens ranked right, of the fused path and the graph;
    /// every other labelled token's target is made the model's own first choice, so
    /// that a count of none would show.
    #[test]
    fn evaluation_loss_and_token_accuracy_match_the_graph() {
        let m = model(&["q_proj", "down_proj"], false, false, 4);
        let mut hits = 0;
        for mut b in batches(m.cfg.vocab_size() as u32, SHORT) {
            let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), &Device::Cpu).expect("ids");
            let hidden = m.hidden_states(&ids, None).expect("hidden");
            let logits = m.logits(&hidden).expect("logits");
            let first: Vec<u32> = logits
                .argmax(candle_core::D::Minus1)
                .and_then(|t| t.to_vec1())
                .expect("argmax");
            let mut chosen = 0;
            for (r, t) in b.targets.iter_mut().enumerate() {
                if *t >= 0 && r % 2 == 0 {
                    *t = i64::from(first[r]);
                    chosen += 1;
                }
            }
            let (fast, correct) = loss(&m, &b, 57.0).expect("fast loss");
            let graph = crate::ops::masked_cross_entropy(&logits, &b.targets, 57.0)
                .and_then(|l| l.to_scalar::<f32>())
                .expect("graph loss") as f64;
            assert!(
                (fast - graph).abs() <= 1e-5 * graph.abs(),
                "{fast} vs {graph}"
            );
            let on_graph = crate::ops::top1_hits(&logits, &b.targets).expect("hits");
            assert_eq!(correct, on_graph);
            assert!(correct >= chosen && correct <= b.labelled as u64);
            hits += correct;
        }
        assert!(hits > 0);
    }

    #[test]
    fn bf16_weights_train_bit_for_bit_as_their_f32_widening() {
        let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
        for tie in [false, true] {
            let wide = build(LLAMA, &all, tie, false, 4, Some(DType::F32));
            let narrow = build(LLAMA, &all, tie, false, 4, Some(DType::BF16));
            assert_eq!(ComputePath::for_model(&narrow), ComputePath::CpuFused);
            let data = batches(wide.cfg.vocab_size() as u32, SHORT);
            let (a, b) = (
                accumulate(&wide, &data, None, Objective::CrossEntropy).expect("f32 step"),
                accumulate(&narrow, &data, None, Objective::CrossEntropy).expect("bf16 step"),
            );
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "tie {tie}: loss");
            for (x, y) in a.grads.iter().zip(&b.grads) {
                let (x, y) = (
                    x.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("x"),
                    y.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("y"),
                );
                assert!(x.iter().any(|v| *v != 0.0), "tie {tie}: a zero gradient");
                let same = x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "tie {tie}: bf16 storage changed a gradient");
            }
            let (la, lb) = (
                loss(&wide, &data[0], 9.0).expect("f32 loss"),
                loss(&narrow, &data[0], 9.0).expect("bf16 loss"),
            );
            assert_eq!(la.0.to_bits(), lb.0.to_bits(), "tie {tie}: evaluation loss");
            assert_eq!(la.1, lb.1, "tie {tie}: tokens ranked right");
            let bytes = |m: &Llama| step_bytes(m, 512, false, false).expect("bytes");
            assert!(
                bytes(&narrow) > bytes(&wide),
                "the widening buffer is counted"
            );
        }
    }

    #[test]
    fn checkpointing_on_the_graph_gives_the_graph_s_gradients_and_masks() {
        let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
        let mut m = model(&all, false, false, 4);
        let data = batches(m.cfg.vocab_size() as u32, SHORT);
        let mut run = |checkpoint: bool| {
            m.checkpoint_layers = checkpoint;
            let mut rng = crate::batch::rng_for(7, crate::batch::streams::DROPOUT);
            let mut masks = Vec::new();
            let d = Some(StepDropout {
                p: 0.1,
                rng: &mut rng,
                record: Some(&mut masks),
            });
            let r = crate::train::accumulate_on_graph(&m, &data, d).expect("a step");
            (r, masks)
        };
        let ((kept, kept_masks), (recomputed, recomputed_masks)) = (run(false), run(true));
        assert_eq!(kept_masks.len(), recomputed_masks.len());
        assert!(!kept_masks.is_empty());
        for (a, b) in kept_masks.iter().zip(&recomputed_masks) {
            let diff = (a - b)
                .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
                .expect("diff");
            assert_eq!(diff, 0.0, "checkpointing drew different masks");
        }
        assert!(
            (kept.loss - recomputed.loss).abs() <= 1e-7 * kept.loss.abs(),
            "{} vs {}",
            kept.loss,
            recomputed.loss
        );
        for (v, (a, b)) in m
            .lora_vars()
            .iter()
            .zip(kept.grads.iter().zip(&recomputed.grads))
        {
            let (err, scale) = max_error_and_scale(b, a);
            assert!(scale > 0.0, "{}: a zero gradient", v.name);
            assert!(
                err <= 1e-6 * scale,
                "{}: recomputing moved the gradient by {:.1e} of its largest entry",
                v.name,
                err / scale
            );
        }
    }
}
