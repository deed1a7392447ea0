//! A whole Llama decoder with LoRA, forward and backward, on plain `f32` slices.
//!
//! This is the trainer's fused step (`trainer-speed.md` §7) built from the crate's
//! kernels: the semantics are those of `trainer::model::Llama::hidden_states` followed by
//! `trainer::ops::masked_cross_entropy`, with LoRA as in `trainer::lora`:
//! `y = x·Wᵀ + scale·(dropout(x)·Aᵀ)·Bᵀ`.
//!
//! **Forward, per layer.** `hn = rms_norm(x)` (saving `1/rms`); q, k and v are written by
//! their GEMMs straight into column blocks of one `[q heads | k heads | v heads]` buffer,
//! and each LoRA branch adds `scale·u·Bᵀ` into the same block (β = 1) after saving
//! `u = x_d·Aᵀ` (N × r). RoPE rotates q and k in place, attention saves its output and
//! log-sum-exp, the o projection adds into a copy of the residual (β = 1), and the MLP
//! writes gate and up into column blocks of one `[gate | up]` buffer, then SwiGLU, then
//! the down projection adds into the residual. The final norm feeds
//! [`linear_cross_entropy`](crate::loss::linear_cross_entropy), which writes the
//! hidden-state gradient in the same pass.
//!
//! **Saved per layer:** the layer's input, `x_mid` (after attention), both norms' `1/rms`,
//! qkv after RoPE, attention output and log-sum-exp, `[gate | up]`, each LoRA branch's
//! `u`, and the dropout masks when there are any. The normed inputs and the SwiGLU output
//! are recomputed in backward by the same code, so they are bit-identical to the
//! forward's.
//!
//! **Backward, per layer in reverse,** with one set of scratch buffers for every layer.
//! A projection's backward is `dX = dY·W` (β = 0 for the first term into a buffer, 1
//! after) plus, for LoRA, `du = scale·dY·B`, `dB = scale·dYᵀ·u`, `dA = duᵀ·x_d` and
//! `dX += (du·A)∘mask`. The norms' backward adds into the residual gradient. The
//! embeddings are frozen, so layers below the lowest one with LoRA get no backward at
//! all, and that layer (layer 0 when every layer is adapted) skips q/k/v's input
//! gradient and its input norm's backward; its LoRA factors still get theirs.
//!
//! **Checkpointing** ([`StepOptions::checkpoint_layers`], through
//! [`forward_backward_with`]): the saved state above is ~186 KB per token per layer at
//! 7B (hidden 4096, intermediate 11008), 12 GiB for 2048 tokens over 32 layers, more than
//! the model itself. With checkpointing the forward runs every layer into one shared
//! `Saved` and keeps, for each layer from the lowest adapted one up, only its input
//! (N × hidden) and the dropout masks it drew: the mask source is a random stream that
//! cannot be asked again, so they are stored, one bit per element when they hold only
//! `0` and one keep value (kept whole otherwise, so replaying is exact). The backward,
//! per layer in reverse, first reruns that layer's forward from the stored input with
//! the stored masks into the shared `Saved` (borrowing the backward's scratch as the
//! forward's), then runs the layer's backward as without checkpointing. Same code, same
//! inputs: the loss and gradients are bit-identical either way. It costs one more
//! forward of the adapted layers, without the head: about +25 % per step on the
//! `llama_step` small preset and +40 % on tiny (measured on a loaded 2-core machine),
//! and brings 7B at 2048 tokens from 12.0 to 1.9 GiB (20.8 to 2.7 GiB with dropout),
//! the layer inputs (1 GiB) being most of what is left. [`step_bytes`] gives the
//! figure for any shape, from the same length helpers the allocation sites use.
//!
//! **bf16 frozen weights** ([`Frozen`]): the embedding, the head and each projection's
//! weight may be stored as bf16, which halves what the frozen model holds (a 7B
//! Llama's ~27 GiB of f32 weights become ~13 GiB). Compute, norms, LoRA factors and
//! gradients stay f32: before each frozen product the step widens the bf16 matrix into
//! one f32 scratch (in parallel over fixed chunks) and runs the same
//! [`gemm`](crate::gemm::gemm) as on f32 weights; the embedding widens only the rows it
//! gathers, and the head is widened whole for
//! [`linear_cross_entropy`](crate::loss::linear_cross_entropy). A bf16 value is the top
//! half of an f32, so widening is exact and a step on bf16 storage gives the
//! bits of the same step on the f32 widening of those values, for any thread count,
//! when that step runs as one row group (a batch of under 512 tokens or of one row;
//! see below): a widening step always does, so that its scratch is not repeated.
//! The scratch is allocated once per call and sized for the largest bf16 matrix it
//! widens, the head's `vocab × hidden` when it is bf16 (0.5 GiB at 7B, counted by
//! [`step_bytes`]); with every frozen matrix in f32 there is none. Widening costs a
//! pass over the weights per use (the forward, the backward's `dX`, and the
//! recomputation when checkpointing): under 1 % of the samples on the `llama_step`
//! small preset, whose step time is unchanged within the noise of a loaded 2-core
//! machine, while its peak RSS drops from 1000 to 842 MiB (256 MiB of weights saved,
//! 94 MiB of head scratch added).
//!
//! **bf16 compute** ([`Model::compute`] = [`Compute::Bf16`], opt-in): the frozen
//! projections' products (`x·Wᵀ` forward, `dY·W` backward) take bf16 operands, the
//! activation or gradient rounded to bf16 (to nearest even) and the weight as stored
//! (or rounded), with f32 products and sums: on a oneMKL build with every projection
//! stored as bf16 through `cblas_gemm_bf16bf16f32` (AMX on Sapphire Rapids and later),
//! on a CPU with AVX512-BF16 through the crate's own `vdpbf16ps` kernels (the weights
//! read as stored, twice the products per instruction of f32), elsewhere by widening
//! both operands for the f32 GEMM. The head's two products (`H·Wᵀ`, `G·W`) round their
//! operands too, as PyTorch's autocast does: on the own kernels with the head as stored
//! (so it is not widened) and the rows paired where they lie, elsewhere on the head's
//! bf16 values widened. LoRA, the softmax and loss and everything else stay f32.
//! Outside the f32 parity guarantee; deterministic like the rest, and unchanged by
//! checkpointing. [`step_bytes`] counts the rounded operand.
//!
//! **Gradients accumulate** across calls (micro-batches): each LoRA gradient is computed
//! into a scratch and then added elementwise, so after two calls a gradient is exactly
//! the sum of what each call would give alone.
//!
//! **Row groups:** the decoder layers run on groups of whole rows, one parallel task
//! per group, so that the pool joins twice a layer rather than once per product and
//! row kernel (the private `groups` module has the why and the figures). The grouping
//! follows the batch's shape: at most four groups of at least 256 tokens each.
//!
//! **Determinism:** every product goes through [`gemm`](crate::gemm::gemm) and every
//! row kernel splits in fixed blocks; the groups' gradients are added in group order;
//! the rest is sequential. Results do not depend on the thread count.

use crate::loss::{LossError, linear_cross_entropy_with};
use crate::norm::{rms_norm_backward, rms_norm_forward};

mod backward;
mod forward;
mod frozen;
mod groups;
mod memory;
#[cfg(test)]
mod tests;

use backward::{BackwardWork, LoraWork, layer_backward};
use forward::{ForwardWork, Saved, embed, layer_forward};
use frozen::FrozenWork;
pub use frozen::{Compute, Frozen};
use memory::{backward_lengths, forward_work_lengths, max_ranks, widening_len, widest_side};
pub use memory::{step_bytes, step_bytes_on_any_cpu};

/// Which arithmetic [`forward_backward_with`] does, for a checkpoint's record: it changes
/// whenever a change to the step can move a bit of its results for the same inputs,
/// threads and GEMM, so that a resume across such builds warns that it will not be
/// bit-identical. `2`: the layers on row groups.
pub const STEP_ARITHMETIC: &str = "2 (row groups)";

/// The seven projections of a layer, in [`Layer::proj`] order (PEFT's module names).
pub use tuneq_openapi::PROJECTIONS;

/// Indices into [`PROJECTIONS`].
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const O: usize = 3;
const GATE: usize = 4;
const UP: usize = 5;
const DOWN: usize = 6;

/// The architecture.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Rows of the embedding and of the head.
    pub vocab: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the MLP.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; `heads` must be a multiple of it.
    pub kv_heads: usize,
    /// Width of one head (even).
    pub head_dim: usize,
    /// RMSNorm's ε.
    pub rms_eps: f32,
}

impl Dims {
    /// `(in, out)` of projection `p` ([`PROJECTIONS`] order).
    pub fn projection_shape(&self, p: usize) -> (usize, usize) {
        let (h, q, kv, i) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        );
        match p {
            Q => (h, q),
            K | V => (h, kv),
            O => (q, h),
            GATE | UP => (h, i),
            _ => (i, h),
        }
    }

    /// Width of a row of the qkv buffer, `(heads + 2·kv_heads)·head_dim`.
    fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The first column of projection `p`'s output inside the buffer it writes (the qkv
    /// buffer, the `[gate | up]` buffer, or a buffer of its own).
    fn output_column(&self, p: usize) -> usize {
        match p {
            K => self.heads * self.head_dim,
            V => (self.heads + self.kv_heads) * self.head_dim,
            UP => self.intermediate,
            _ => 0,
        }
    }

    /// Row stride of the buffer projection `p` writes.
    fn output_stride(&self, p: usize) -> usize {
        match p {
            Q | K | V => self.qkv_width(),
            GATE | UP => 2 * self.intermediate,
            _ => self.projection_shape(p).1,
        }
    }
}

/// A LoRA update of a projection: `y += scale·(x_d·Aᵀ)·Bᵀ`.
#[derive(Debug, Clone, Copy)]
pub struct Lora<'a> {
    /// A, `r × in`, row-major.
    pub a: &'a [f32],
    /// B, `out × r`, row-major.
    pub b: &'a [f32],
    /// Rank.
    pub r: usize,
    /// Scale of the branch (alpha/r or alpha/√r).
    pub scale: f32,
}

/// A frozen linear layer with an optional LoRA update.
#[derive(Debug, Clone, Copy)]
pub struct Projection<'a> {
    /// `out × in`, row-major, frozen (f32 or bf16).
    pub weight: Frozen<'a>,
    /// The trainable update, when this projection is a target.
    pub lora: Option<Lora<'a>>,
}

/// One decoder layer.
#[derive(Debug, Clone, Copy)]
pub struct Layer<'a> {
    /// RMSNorm weight before attention, `hidden`.
    pub input_norm: &'a [f32],
    /// RMSNorm weight before the MLP, `hidden`.
    pub post_norm: &'a [f32],
    /// q, k, v, o, gate, up, down ([`PROJECTIONS`] order).
    pub proj: [Projection<'a>; 7],
}

/// A Llama causal LM with LoRA, as views of its tensors.
#[derive(Debug, Clone)]
pub struct Model<'a> {
    /// Architecture.
    pub dims: Dims,
    /// Token embeddings, `vocab × hidden` (frozen; f32 or bf16).
    pub embed: Frozen<'a>,
    /// Decoder layers, `dims.layers` of them.
    pub layers: Vec<Layer<'a>>,
    /// Final RMSNorm weight, `hidden`.
    pub norm: &'a [f32],
    /// Language-model head, `vocab × hidden` (frozen; f32 or bf16; may be the
    /// embedding itself).
    pub lm_head: Frozen<'a>,
    /// RoPE cosines, `(max_pos, head_dim/2)`.
    pub cos: &'a [f32],
    /// RoPE sines, like `cos`.
    pub sin: &'a [f32],
    /// How the projections' frozen products are computed (f32 by default).
    pub compute: Compute,
}

impl Model<'_> {
    /// The LoRA tensors' lengths, in gradient order: layer, projection, A then B.
    pub fn lora_lengths(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for layer in &self.layers {
            for (p, proj) in layer.proj.iter().enumerate() {
                if let Some(l) = &proj.lora {
                    let (i, o) = self.dims.projection_shape(p);
                    out.push(l.r * i);
                    out.push(o * l.r);
                }
            }
        }
        out
    }

    /// Resident bytes of the frozen matrices (embedding, head, projections) as stored:
    /// 2 per element for bf16, 4 for f32; a head that is the embedding's storage counts
    /// once. Norms, RoPE tables and LoRA factors are not included.
    pub fn frozen_bytes(&self) -> u64 {
        let head = if self.lm_head.same_storage(&self.embed) {
            0
        } else {
            self.lm_head.bytes()
        };
        let layers: u64 = self
            .layers
            .iter()
            .flat_map(|l| l.proj.iter().map(|p| p.weight.bytes()))
            .sum();
        self.embed.bytes() + head + layers
    }

    /// Whether the step widens the head whole for the loss: a bf16 head in f32 compute,
    /// and in bf16 compute any head the own bf16 kernels do not take as stored.
    fn head_widened(&self) -> bool {
        match self.compute {
            Compute::F32 => self.lm_head.is_bf16(),
            Compute::Bf16 => !frozen::head_as_stored(self.compute, self.lm_head.is_bf16()),
        }
    }

    /// How the step groups the batch's rows (see [`groups`]): by its shape, unless the
    /// step widens bf16 weights, whose scratch is not repeated per group.
    fn row_groups(&self, batch: &Batch<'_>) -> Vec<std::ops::Range<usize>> {
        groups::row_groups(batch.rows, batch.len, self.widening_len() > 0)
    }

    /// Whether a bf16 GEMM (oneMKL's or the own kernels) takes the projections as
    /// stored, in bf16 compute.
    fn projections_bf16_gemm(&self) -> bool {
        let all_bf16 = self
            .layers
            .iter()
            .all(|l| l.proj.iter().all(|p| p.weight.is_bf16()));
        frozen::uses_bf16_gemm(self.compute, all_bf16)
    }

    /// The length of the scratch the step widens frozen matrices into: the largest
    /// matrix it widens whole (the head, see [`head_widened`](Self::head_widened); each
    /// bf16 projection in f32 compute; in bf16 compute, every projection unless a bf16
    /// GEMM takes them as stored). 0 with f32 weights in f32 compute.
    fn widening_len(&self) -> usize {
        let bf16_gemm = self.projections_bf16_gemm();
        let widened = self.layers.iter().flat_map(|l| {
            (0..7).filter(move |&p| match self.compute {
                Compute::F32 => l.proj[p].weight.is_bf16(),
                Compute::Bf16 => !bf16_gemm,
            })
        });
        widening_len(&self.dims, self.head_widened(), widened)
    }

    /// A layer forward's scratch for `n` tokens, with room for masked inputs when the
    /// step draws dropout masks.
    fn forward_work(&self, n: usize, dropout: bool) -> ForwardWork {
        let [hn, act, xd] = forward_work_lengths(&self.dims, n, dropout).map(|len| vec![0.0; len]);
        ForwardWork {
            hn,
            act,
            xd,
            frozen: self.frozen_work(n),
        }
    }

    /// The frozen products' scratch for `n` tokens: the widening scratch
    /// ([`widening_len`](Self::widening_len)) and, in bf16 compute, the rounded
    /// activation operand.
    fn frozen_work(&self, n: usize) -> FrozenWork {
        FrozenWork::new(
            self.compute,
            self.widening_len(),
            (n, widest_side(&self.dims)),
            self.projections_bf16_gemm(),
        )
    }
}

/// One micro-batch: `rows` sequences of `len` tokens, flattened row-major.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// Token ids, `rows·len`.
    pub ids: &'a [u32],
    /// Sequence rows.
    pub rows: usize,
    /// Tokens per row (padded or packed).
    pub len: usize,
    /// Per token, the id it must predict; negative for no loss.
    pub targets: &'a [i64],
    /// Per token, its RoPE position.
    pub positions: &'a [u32],
    /// Per token, the position within its row of the first token of its segment (see
    /// [`attention_forward`](crate::attention::attention_forward)): all zeros is plain
    /// causal attention.
    pub starts: &'a [u32],
}

/// Draws the dropout mask (`rows·len × in`, values 0 or 1/(1−p)) for the next adapted
/// projection. Called in forward order: layer by layer, q, k, v, o, gate, up, down, only
/// for projections with LoRA. The arguments are the number of token rows and `in`.
pub type MaskSource<'m> = &'m mut dyn FnMut(usize, usize) -> Vec<f32>;

/// Why a step refused its inputs. Nothing is added to the gradients when it does.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    /// The architecture is inconsistent.
    #[error("invalid dimensions: {0}")]
    Dims(String),
    /// A buffer's length does not match the dimensions.
    #[error("{what} holds {len} elements where {expected} were expected")]
    Length {
        /// Which buffer.
        what: String,
        /// Its length.
        len: usize,
        /// The length the dimensions imply.
        expected: usize,
    },
    /// A token id is not a row of the embedding.
    #[error("token {id} at index {index} is outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary {
        /// Index in the flattened batch.
        index: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A target id is not a row of the head.
    #[error("target {target} at index {index} is outside the vocabulary of {vocab}")]
    TargetOutOfVocabulary {
        /// Index in the flattened batch.
        index: usize,
        /// The target.
        target: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A position is past the RoPE tables.
    #[error("position {position} at index {index} is past the RoPE tables' {max_pos} positions")]
    PositionOutOfRange {
        /// Index in the flattened batch.
        index: usize,
        /// The position.
        position: u32,
        /// Positions in the tables.
        max_pos: usize,
    },
    /// A token's segment starts after the token.
    #[error("token {index} (column {column} of its row) starts its segment at {start}")]
    SegmentStart {
        /// Index in the flattened batch.
        index: usize,
        /// Its column in its row.
        column: usize,
        /// The start given.
        start: u32,
    },
    /// The gradient list does not hold one buffer per LoRA tensor.
    #[error("{got} gradient buffers for {expected} LoRA tensors")]
    GradientCount {
        /// Buffers given.
        got: usize,
        /// LoRA tensors in the model.
        expected: usize,
    },
    /// The loss refused its inputs (not expected after the checks above).
    #[error(transparent)]
    Loss(#[from] LossError),
}

fn expect_len(what: impl FnOnce() -> String, len: usize, expected: usize) -> Result<(), StepError> {
    if len == expected {
        Ok(())
    } else {
        Err(StepError::Length {
            what: what(),
            len,
            expected,
        })
    }
}

/// Checks the model's and the batch's shapes and contents.
fn validate(model: &Model<'_>, batch: &Batch<'_>) -> Result<(), StepError> {
    let d = &model.dims;
    let bad = |m: String| Err(StepError::Dims(m));
    if d.vocab == 0 || d.hidden == 0 || d.intermediate == 0 {
        return bad(format!(
            "{d:?} has an empty vocabulary, hidden or intermediate width"
        ));
    }
    if d.heads == 0 || d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) {
        return bad(format!(
            "{} query heads cannot be grouped over {} kv heads",
            d.heads, d.kv_heads
        ));
    }
    if d.head_dim == 0 || !d.head_dim.is_multiple_of(2) {
        return bad(format!("head_dim {} must be even and positive", d.head_dim));
    }
    let (v, h) = (d.vocab, d.hidden);
    expect_len(|| "embed".into(), model.embed.len(), v * h)?;
    expect_len(|| "lm_head".into(), model.lm_head.len(), v * h)?;
    expect_len(|| "norm".into(), model.norm.len(), h)?;
    expect_len(|| "layers".into(), model.layers.len(), d.layers)?;
    for (l, layer) in model.layers.iter().enumerate() {
        expect_len(
            || format!("layer {l} input_norm"),
            layer.input_norm.len(),
            h,
        )?;
        expect_len(|| format!("layer {l} post_norm"), layer.post_norm.len(), h)?;
        for (p, proj) in layer.proj.iter().enumerate() {
            let (i, o) = d.projection_shape(p);
            let name = PROJECTIONS[p];
            expect_len(
                || format!("layer {l} {name} weight"),
                proj.weight.len(),
                o * i,
            )?;
            if let Some(lora) = &proj.lora {
                expect_len(
                    || format!("layer {l} {name} lora A (rank {})", lora.r),
                    lora.a.len(),
                    lora.r * i,
                )?;
                expect_len(
                    || format!("layer {l} {name} lora B (rank {})", lora.r),
                    lora.b.len(),
                    o * lora.r,
                )?;
            }
        }
    }
    let half = d.head_dim / 2;
    expect_len(|| "sin".into(), model.sin.len(), model.cos.len())?;
    if !model.cos.len().is_multiple_of(half) {
        return bad(format!(
            "RoPE tables of {} are not rows of head_dim/2 = {half}",
            model.cos.len()
        ));
    }
    let max_pos = model.cos.len() / half;

    let n = batch.rows * batch.len;
    expect_len(|| "ids".into(), batch.ids.len(), n)?;
    expect_len(|| "targets".into(), batch.targets.len(), n)?;
    expect_len(|| "positions".into(), batch.positions.len(), n)?;
    expect_len(|| "starts".into(), batch.starts.len(), n)?;
    if let Some((index, &id)) = batch
        .ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= v)
    {
        return Err(StepError::TokenOutOfVocabulary {
            index,
            id,
            vocab: v,
        });
    }
    if let Some((index, &target)) = batch
        .targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t >= 0 && t as u64 >= v as u64)
    {
        return Err(StepError::TargetOutOfVocabulary {
            index,
            target,
            vocab: v,
        });
    }
    if let Some((index, &position)) = batch
        .positions
        .iter()
        .enumerate()
        .find(|&(_, &p)| p as usize >= max_pos)
    {
        return Err(StepError::PositionOutOfRange {
            index,
            position,
            max_pos,
        });
    }
    if let Some((index, &start)) = batch
        .starts
        .iter()
        .enumerate()
        .find(|&(i, &s)| s as usize > i % batch.len)
    {
        return Err(StepError::SegmentStart {
            index,
            column: index % batch.len,
            start,
        });
    }
    Ok(())
}

/// The index of each LoRA projection's A gradient in the gradient list (B follows it),
/// after checking the list against the model.
fn gradient_slots(
    model: &Model<'_>,
    grads: &[Vec<f32>],
) -> Result<Vec<[Option<usize>; 7]>, StepError> {
    let lengths = model.lora_lengths();
    if grads.len() != lengths.len() {
        return Err(StepError::GradientCount {
            got: grads.len(),
            expected: lengths.len(),
        });
    }
    let mut slots = Vec::with_capacity(model.layers.len());
    let mut next = 0;
    for (l, layer) in model.layers.iter().enumerate() {
        let mut s = [None; 7];
        for (p, proj) in layer.proj.iter().enumerate() {
            if proj.lora.is_some() {
                for (k, ab) in ["A", "B"].iter().enumerate() {
                    expect_len(
                        || format!("gradient of layer {l} {} lora {ab}", PROJECTIONS[p]),
                        grads[next + k].len(),
                        lengths[next + k],
                    )?;
                }
                s[p] = Some(next);
                next += 2;
            }
        }
        slots.push(s);
    }
    Ok(slots)
}

/// How a step trades memory for time. The default is the fastest: every layer's forward
/// state is kept for its backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// Activation checkpointing per layer: the forward keeps only each layer's input
    /// (N × hidden) and its dropout masks, and the backward recomputes the layer's
    /// forward state into one shared set of buffers right before the layer's backward.
    /// One more forward of the layers with a backward (about a third more compute) for
    /// a saved state of `layers × N × hidden` instead of every layer's (see
    /// [`step_bytes`]). Results are bit-identical either way: the recomputation runs
    /// the same code on the same inputs and masks.
    pub checkpoint_layers: bool,
}

impl Model<'_> {
    /// Per layer, each projection's LoRA rank (0 without LoRA), for [`step_bytes`].
    pub fn lora_ranks(&self) -> Vec<[usize; 7]> {
        self.layers
            .iter()
            .map(|layer| std::array::from_fn(|p| layer.proj[p].lora.map_or(0, |l| l.r)))
            .collect()
    }
}

/// Forward and backward of one micro-batch with the default [`StepOptions`] (every
/// layer's state kept); see [`forward_backward_with`].
///
/// # Errors
/// As [`forward_backward_with`].
pub fn forward_backward(
    model: &Model<'_>,
    batch: &Batch<'_>,
    scale: f32,
    dropout: Option<MaskSource<'_>>,
    grads: &mut [Vec<f32>],
) -> Result<f64, StepError> {
    forward_backward_with(model, batch, scale, dropout, grads, StepOptions::default())
}

/// Forward and backward of one micro-batch: returns `scale·Σ CE` over the labelled
/// tokens (`scale` is 1/the labelled-token count of the whole optimiser step) and ADDS
/// each LoRA gradient into `grads`, one buffer per LoRA tensor in the order layer,
/// projection (q … down), A then B, only for projections with LoRA (see
/// [`Model::lora_lengths`]), so that micro-batches accumulate.
///
/// With `dropout`, a mask is drawn for every adapted projection in forward order (see
/// [`MaskSource`]) and applied to the LoRA branch's input, as `trainer::lora` does.
///
/// Memory: see [`step_bytes`]; `options.checkpoint_layers` trades a second forward of
/// the adapted layers for keeping one layer's state instead of all of them. The loss
/// and the gradients' bits do not depend on it.
///
/// # Errors
/// [`StepError`] when the model, the batch, the gradient buffers or a drawn mask do not
/// fit together, or an id, target, position or segment start is out of range. Nothing is
/// added to `grads` then.
pub fn forward_backward_with(
    model: &Model<'_>,
    batch: &Batch<'_>,
    scale: f32,
    dropout: Option<MaskSource<'_>>,
    grads: &mut [Vec<f32>],
    options: StepOptions,
) -> Result<f64, StepError> {
    validate(model, batch)?;
    let slots = gradient_slots(model, grads)?;
    let d = &model.dims;
    let (n, h, len) = (batch.rows * batch.len, d.hidden, batch.len);
    if n == 0 {
        return Ok(0.0);
    }
    let ranks = model.lora_ranks();
    let with_dropout = dropout.is_some();
    let mut dropout = dropout;
    // Layers below the lowest one with LoRA need no backward at all.
    let lowest = slots.iter().position(|s| s.iter().any(Option::is_some));
    let checkpoint = options.checkpoint_layers;
    let keep_from = lowest.unwrap_or(model.layers.len());
    let rows = model.row_groups(batch);
    let batches: Vec<Batch<'_>> = rows.iter().map(|r| groups::sub_batch(batch, r)).collect();
    let mut x = embed(model, batch.ids);
    // Per group: the forward scratch and, without checkpointing, one `Saved` per layer;
    // with it, one shared by all layers, and per layer from `lowest` up its input
    // (batch-wide) and its masks.
    let (mut works, mut saved): (Vec<ForwardWork>, Vec<Vec<Saved>>) = batches
        .iter()
        .map(|b| {
            let tokens = b.rows * len;
            let saved = if checkpoint {
                vec![Saved::new(d, tokens, &max_ranks(&ranks))]
            } else {
                ranks.iter().map(|r| Saved::new(d, tokens, r)).collect()
            };
            (model.forward_work(tokens, with_dropout), saved)
        })
        .unzip();
    let layer_slot = |l: usize| if checkpoint { 0 } else { l };
    let mut inputs: Vec<Vec<f32>> = Vec::new();
    let mut kept: Vec<Vec<groups::KeptMasks>> = Vec::new();
    for l in 0..model.layers.len() {
        if checkpoint && l >= keep_from {
            inputs.push(x.clone());
        }
        let mut layer_saved: Vec<&mut Saved> =
            saved.iter_mut().map(|s| &mut s[layer_slot(l)]).collect();
        groups::draw_layer_masks(model, l, n, &mut dropout, &rows, len, &mut layer_saved)?;
        groups::layer_forward(model, l, &batches, &rows, &mut x, layer_saved, &mut works);
        if checkpoint && l >= keep_from {
            kept.push(saved.iter().map(|s| groups::keep_masks(&s[0])).collect());
        }
    }
    let (hn, inv) = final_norm(model, &x, &mut works);
    let mut d_hidden = vec![0f32; n * h];
    let loss = linear_cross_entropy_with(
        &hn,
        h,
        frozen::loss_head(model.lm_head, model.compute, &mut works[0].frozen.widened),
        d.vocab,
        batch.targets,
        scale,
        Some(&mut d_hidden),
    )?;
    let Some(lowest) = lowest else {
        return Ok(loss);
    };
    if batch.targets.iter().all(|&t| t < 0) {
        return Ok(loss);
    }
    let mut dx = vec![0f32; n * h];
    rms_norm_backward(&x, model.norm, &inv, &d_hidden, &mut dx, false);
    // One group takes over the batch-wide buffers, as an ungrouped step does; with more,
    // they are freed before the groups' own are made.
    let (mut hn, mut d_hidden, mut inv) = (Some(hn), Some(d_hidden), Some(inv));
    if works.len() > 1 {
        (hn, d_hidden, inv) = (None, None, None);
    }
    let mut backs: Vec<BackwardWork> = works
        .into_iter()
        .zip(&batches)
        .map(|(work, b)| {
            let tokens = b.rows * len;
            let [_, d_act, d_gu, d_attn, d_qkv, du, tmp, grad] =
                backward_lengths(d, tokens, &ranks, with_dropout).map(|len| vec![0f32; len]);
            BackwardWork {
                hn: hn.take().unwrap_or_else(|| vec![0f32; tokens * h]),
                inv: inv.take().unwrap_or_else(|| vec![0f32; tokens]),
                act: work.act,
                d_act,
                d_gu,
                d_hn: d_hidden.take().unwrap_or_else(|| vec![0f32; tokens * h]),
                d_attn,
                d_qkv,
                lora: LoraWork {
                    du,
                    xd: work.xd,
                    tmp,
                    grad,
                },
                frozen: work.frozen,
            }
        })
        .collect();
    // Every group after the first sums a layer's gradients from zero into buffers of its
    // own, added into the caller's in group order once the layer is done.
    let mut later_grads: Vec<Vec<Vec<f32>>> = (1..batches.len())
        .map(|_| vec![Vec::new(); grads.len()])
        .collect();
    for l in (lowest..model.layers.len()).rev() {
        let mut input = if checkpoint { inputs.pop() } else { None };
        let layer_kept = if checkpoint { kept.pop() } else { None };
        let layer_gradients = groups::layer_gradients(&slots[l]);
        for later in &mut later_grads {
            for s in layer_gradients.clone() {
                later[s] = vec![0f32; grads[s].len()];
            }
        }
        let group_grads =
            std::iter::once(&mut *grads).chain(later_grads.iter_mut().map(Vec::as_mut_slice));
        let inputs_of = input
            .as_mut()
            .map(|input| groups::split_rows(input, &rows, len, h));
        let mut inputs_of = inputs_of.map(Vec::into_iter);
        let items: Vec<_> = batches
            .iter()
            .enumerate()
            .zip(groups::split_rows(&mut dx, &rows, len, h))
            .zip(saved.iter_mut())
            .zip(backs.iter_mut())
            .zip(group_grads)
            .map(|(((((g, b), dx), s), work), grads)| {
                let input = inputs_of.as_mut().and_then(Iterator::next);
                (g, b, dx, &mut s[layer_slot(l)], work, grads, input)
            })
            .collect();
        let slots = &slots[l];
        let layer_kept = layer_kept.as_deref();
        groups::for_each(items, |(g, b, dx, s, work, grads, input)| {
            if let (Some(input), Some(kept)) = (input, layer_kept) {
                // Recompute the layer's forward state from its input and its masks, with
                // the backward's buffers lent as the forward's scratch (the backward
                // recomputes what it needs of them itself).
                groups::restore_masks(&kept[g], s);
                let mut lent = ForwardWork {
                    hn: std::mem::take(&mut work.hn),
                    act: std::mem::take(&mut work.act),
                    xd: std::mem::take(&mut work.lora.xd),
                    frozen: std::mem::take(&mut work.frozen),
                };
                layer_forward(model, l, b, input, s, &mut lent);
                (work.hn, work.act, work.lora.xd) = (lent.hn, lent.act, lent.xd);
                work.frozen = lent.frozen;
            }
            layer_backward(model, l, b, s, dx, work, grads, l == lowest, slots);
        });
        for later in &mut later_grads {
            for s in layer_gradients.clone() {
                backward::add(&mut grads[s], &std::mem::take(&mut later[s]));
            }
        }
    }
    Ok(loss)
}

/// The final norm of the hidden state `x` (N × hidden), batch-wide, and its 1/rms. With
/// one row group its normed-input scratch is lent (it holds N rows), as an ungrouped step
/// does; with more, the normed input has a buffer of its own.
fn final_norm(model: &Model<'_>, x: &[f32], works: &mut [ForwardWork]) -> (Vec<f32>, Vec<f32>) {
    let h = model.dims.hidden;
    let mut inv = vec![0f32; x.len() / h];
    let mut hn = match works {
        [only] => std::mem::take(&mut only.hn),
        _ => vec![0f32; x.len()],
    };
    rms_norm_forward(x, model.norm, model.dims.rms_eps, &mut hn, &mut inv);
    (hn, inv)
}

/// The loss only, for evaluation: `scale·Σ CE` over the labelled tokens, without dropout
/// and without any gradient work. Layers reuse one set of buffers per row group.
///
/// # Errors
/// [`StepError`] when the model or batch is inconsistent; see [`forward_backward`].
pub fn loss(model: &Model<'_>, batch: &Batch<'_>, scale: f32) -> Result<f64, StepError> {
    validate(model, batch)?;
    let d = &model.dims;
    let (n, h, len) = (batch.rows * batch.len, d.hidden, batch.len);
    if n == 0 {
        return Ok(0.0);
    }
    let rows = model.row_groups(batch);
    let batches: Vec<Batch<'_>> = rows.iter().map(|r| groups::sub_batch(batch, r)).collect();
    let mut x = embed(model, batch.ids);
    let ranks = max_ranks(&model.lora_ranks());
    let (mut works, mut saved): (Vec<ForwardWork>, Vec<Saved>) = batches
        .iter()
        .map(|b| {
            let tokens = b.rows * len;
            (
                model.forward_work(tokens, false),
                Saved::new(d, tokens, &ranks),
            )
        })
        .unzip();
    for l in 0..model.layers.len() {
        let layer_saved = saved.iter_mut().collect();
        groups::layer_forward(model, l, &batches, &rows, &mut x, layer_saved, &mut works);
    }
    let (hn, _) = final_norm(model, &x, &mut works);
    Ok(linear_cross_entropy_with(
        &hn,
        h,
        frozen::loss_head(model.lm_head, model.compute, &mut works[0].frozen.widened),
        d.vocab,
        batch.targets,
        scale,
        None,
    )?)
}
