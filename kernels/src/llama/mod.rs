//! A whole Llama decoder with LoRA (and the Qwen2 and Qwen3 variants of it), forward
//! and backward, on plain `f32` slices.
//!
//! This is the trainer's fused step (`trainer-speed.md` §7) built from the crate's
//! kernels: the semantics are those of `trainer::model::Llama::hidden_states` followed by
//! `trainer::ops::masked_cross_entropy`, with LoRA as in `trainer::lora`:
//! `y = x·Wᵀ + scale·(dropout(x)·Aᵀ)·Bᵀ`.
//!
//! **Forward, per layer.** `hn = rms_norm(x)` (saving `1/rms`); q, k and v are written by
//! their GEMMs straight into column blocks of one `[q heads | k heads | v heads]` buffer,
//! and each LoRA branch adds `scale·u·Bᵀ` into the same block (β = 1) after saving
//! `u = x_d·Aᵀ` (N × r). Qwen2's frozen q/k/v biases are added to their blocks after the
//! frozen product; Qwen3's per-head norms of q and k ([`QkNorm`]) normalise them in place,
//! saving the heads before the norm and their `1/rms`, and run their backward right
//! after RoPE's. RoPE rotates q and k in place, attention saves its output and
//! log-sum-exp, the o projection adds into a copy of the residual (β = 1), and the MLP
//! writes gate and up into column blocks of one `[gate | up]` buffer, then SwiGLU, then
//! the down projection adds into the residual. The final norm feeds
//! [`linear_cross_entropy`](crate::loss::linear_cross_entropy), which writes the
//! hidden-state gradient in the same pass.
//!
//! **Gemma 2 and 3** ([`Dims::gemma`], [`GemmaLayer`]): the embeddings are scaled by
//! √hidden; each half's output (the o and the down projection's) goes to a buffer of its
//! own, is RMS-normalised, and only then added into the residual, its input and `1/rms`
//! kept for the backward, which runs that norm's backward first into the normed-input
//! gradient's scratch and hands the result to the projection; the MLP's gate is GELU's
//! tanh form ([`Gate::GeluTanh`](crate::glu::Gate)); the attention scores take the
//! family's own scale and Gemma 2's soft-cap (in the attention kernel), and the loss
//! Gemma 2's soft-capped logits. A sliding layer attends with the batch's second set of
//! first keys ([`Batch::window_starts`]) and rotates with the model's local RoPE tables
//! ([`Model::local_rope`], Gemma 3's). Gemma 3's q/k norms are Qwen3's.
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
//!
//! **Layout:** `model` (the views the step takes: [`Dims`], [`Model`], [`Batch`]),
//! `validate` (the input checks, [`StepError`]), `step` (the driver:
//! [`forward_backward_with`], [`loss`]), `forward` and `backward` (one layer on one row
//! group), `groups` (the row groups), `frozen` (bf16 storage and compute), `mask` (the
//! stored dropout masks) and `memory` (the buffers' lengths, [`step_bytes`]).

mod backward;
mod forward;
mod frozen;
mod groups;
mod mask;
mod memory;
mod model;
mod qk_norm;
mod step;
#[cfg(test)]
mod tests;
mod validate;

pub use frozen::{Compute, Frozen};
pub use memory::{step_bytes, step_bytes_on_any_cpu};
pub use model::{
    Batch, Dims, Gemma, GemmaLayer, Layer, Lora, MaskSource, Model, OwnedBatch, Projection,
};
pub use qk_norm::QkNorm;
pub use step::{
    StepLoss, StepOptions, Weigh, forward_backward, forward_backward_weighted,
    forward_backward_with, loss, loss_and_correct, token_losses,
};
pub use validate::StepError;

/// Which arithmetic [`forward_backward_with`] does, for a checkpoint's record: it changes
/// whenever a change to the step can move a bit of its results for the same inputs,
/// threads and GEMM, so that a resume across such builds warns that it will not be
/// bit-identical. `2`: the layers on row groups.
pub const STEP_ARITHMETIC: &str = "2 (row groups)";

/// The seven projections of a layer, in [`Layer::proj`] order (PEFT's module names).
pub use tuneq_openapi::PROJECTIONS;

/// `dst += src`, elementwise: a residual branch, or a gradient into its sum.
fn add(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
}

/// Indices into [`PROJECTIONS`].
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const O: usize = 3;
const GATE: usize = 4;
const UP: usize = 5;
const DOWN: usize = 6;
