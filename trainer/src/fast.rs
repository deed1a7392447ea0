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
    /// compute; every family the trainer takes), unless `TUNEQ_CPU_PATH=graph` asks for
    /// the graph (which then computes in the model's dtype).
    pub fn for_model(model: &Llama) -> Self {
        let forced_graph = std::env::var("TUNEQ_CPU_PATH").is_ok_and(|v| v == "graph");
        let fused_dtype = matches!(model.dtype(), DType::F32 | DType::BF16);
        if model.device().is_cpu() && fused_dtype && !forced_graph {
            Self::CpuFused
        } else {
            Self::Graph
        }
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

    /// Holds RoPE tables (cosines, sines) as f32, when there are some.
    fn hold_tables(&mut self, tables: Option<&'t (Tensor, Tensor)>) -> Result<Option<[HeldAt; 2]>> {
        match tables {
            Some((cos, sin)) => Ok(Some([self.hold_f32(cos)?, self.hold_f32(sin)?])),
            None => Ok(None),
        }
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
    /// Qwen3's and Gemma 3's q and k head norms.
    qk_norm: Option<[HeldAt; 2]>,
    /// A Gemma's norms of its attention's and MLP's outputs, and whether it slides.
    gemma: Option<([HeldAt; 2], bool)>,
    /// Each projection's weight, bias and LoRA.
    proj: Vec<(HeldAt, Option<HeldAt>, Option<LoraIdx>)>,
}

impl LayerIdx {
    /// The layer as the kernels take it, lent from `held`.
    fn view<'h>(&self, held: &'h Held<'_>) -> Result<llama::Layer<'h>> {
        let proj: Vec<llama::Projection<'_>> = self
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
            input_norm: held.slice(self.norms[0]),
            post_norm: held.slice(self.norms[1]),
            qk_norm: self.qk_norm.map(|[q, k]| llama::QkNorm {
                q: held.slice(q),
                k: held.slice(k),
            }),
            gemma: self.gemma.map(
                |([after_attention, after_mlp], sliding)| llama::GemmaLayer {
                    after_attention: held.slice(after_attention),
                    after_mlp: held.slice(after_mlp),
                    sliding,
                },
            ),
            proj,
        })
    }
}

/// The architecture as the kernels take it.
fn dims_of(cfg: &crate::config::LlamaConfig) -> llama::Dims {
    llama::Dims {
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
        gemma: gemma_of(cfg),
    }
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
        let gemma = match model.gemma_layer(l) {
            Some((after_attention, after_mlp, sliding)) => Some((
                [held.hold_f32(after_attention)?, held.hold_f32(after_mlp)?],
                sliding,
            )),
            None => None,
        };
        layers.push(LayerIdx {
            norms,
            qk_norm,
            gemma,
            proj,
        });
    }
    let long = held.hold_tables(model.long_rope_f32())?;
    let local = held.hold_tables(model.local_rope_f32())?;
    let layers = layers
        .iter()
        .map(|l| l.view(&held))
        .collect::<Result<Vec<_>>>()?;
    let kernels = llama::Model {
        dims: dims_of(cfg),
        embed: held.frozen(top[0]),
        layers,
        norm: held.slice(top[1]),
        lm_head: held.frozen(top[2]),
        cos: held.slice(top[3]),
        sin: held.slice(top[4]),
        local_rope: local.map(|[cos, sin]| (held.slice(cos), held.slice(sin))),
        compute: model.cpu_compute,
    };
    let long = long.map(|[cos, sin]| (held.slice(cos), held.slice(sin)));
    f(&Kernels {
        model: kernels,
        long,
        cfg,
    })
}

/// What a Gemma computes beyond a Llama, as the kernels take it; None for the other
/// families.
fn gemma_of(cfg: &crate::config::LlamaConfig) -> Option<llama::Gemma> {
    Some(llama::Gemma {
        embed_scale: cfg.embedding_scale()?,
        attention_scale: cfg.attention_scale() as f32,
        attention_softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
        logit_softcap: cfg.final_logit_softcapping.map(|c| c as f32),
    })
}

/// The kernels' view of a model, with LongRoPE's tables past its pretraining context.
struct Kernels<'m> {
    model: llama::Model<'m>,
    /// LongRoPE's long cosines and sines.
    long: Option<(&'m [f32], &'m [f32])>,
    /// The model's config, which says when a batch takes them.
    cfg: &'m crate::config::LlamaConfig,
}

impl<'m> Kernels<'m> {
    /// The model a batch at `positions` runs on: with LongRoPE's long tables where its
    /// last position is past the pretraining context (as [`Llama::rope_for`] decides).
    fn at(&self, positions: &[u32]) -> Cow<'_, llama::Model<'m>> {
        let end = positions.iter().max().map_or(0, |&p| p as usize + 1);
        match self.long {
            Some((cos, sin)) if self.cfg.long_rope_at(end) => Cow::Owned(llama::Model {
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
///
/// A sliding window is each token's first visible key moved up to the window's edge:
/// the kernels hide every key before a token's start, so a token at column `c` sees
/// columns `c + 1 − window ..= c` of its segment, as transformers' sliding-window mask.
/// A window every layer shares (Mistral's, Phi-3's) replaces the starts; a Gemma's,
/// which only its sliding layers have, is kept beside them.
struct BatchView<'b> {
    positions: Cow<'b, [u32]>,
    starts: Cow<'b, [u32]>,
    window_starts: Option<Vec<u32>>,
}

impl<'b> BatchView<'b> {
    fn new(b: &'b Batch, model: &Llama) -> Self {
        let mut view = match &b.packing {
            Some(p) => Self {
                positions: Cow::Borrowed(&p.positions),
                starts: Cow::Borrowed(&p.starts),
                window_starts: None,
            },
            None => Self {
                positions: (0..b.rows * b.len).map(|k| (k % b.len) as u32).collect(),
                starts: vec![0; b.rows * b.len].into(),
                window_starts: None,
            },
        };
        let cfg = &model.cfg;
        let Some(window) = (0..cfg.num_hidden_layers()).find_map(|l| cfg.layer_window(l)) else {
            return view;
        };
        let windowed = view.starts.iter().enumerate().map(|(k, &start)| {
            let edge = ((k % b.len) + 1).saturating_sub(window) as u32;
            start.max(edge)
        });
        match cfg.architecture().gemma() {
            true => view.window_starts = Some(windowed.collect()),
            false => view.starts = Cow::Owned(windowed.collect()),
        }
        view
    }

    fn of<'a>(&'a self, b: &'a Batch) -> llama::Batch<'a> {
        llama::Batch {
            ids: &b.ids,
            rows: b.rows,
            len: b.len,
            targets: &b.targets,
            positions: &self.positions,
            starts: &self.starts,
            window_starts: self.window_starts.as_deref(),
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
    let scale = (1.0 / crate::batch::labelled_denominator(batches)) as f32;
    let vars = model.lora_vars();
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
            let view = BatchView::new(b, model);
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
    let view = BatchView::new(batch, model);
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
    let view = BatchView::new(batch, model);
    with_model(model, |kernels| {
        let scale = (1.0 / denominator) as f32;
        let measured =
            llama::loss_and_correct(&kernels.at(&view.positions), &view.of(batch), scale)
                .map_err(kernel_error)?;
        Ok((measured.loss, measured.correct))
    })
}

#[cfg(test)]
mod tests;
