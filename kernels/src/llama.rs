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
//! [`linear_cross_entropy`], which writes the hidden-state gradient in the same pass.
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
//! **Gradients accumulate** across calls (micro-batches): each LoRA gradient is computed
//! into a scratch and then added elementwise, so after two calls a gradient is exactly
//! the sum of what each call would give alone.
//!
//! **Determinism:** every product goes through [`gemm`] and every row kernel splits in
//! fixed blocks; the rest is sequential. Results do not depend on the thread count.

use crate::attention::{AttentionShape, attention_backward, attention_forward};
use crate::gemm::{Mat, MatMut, gemm};
use crate::loss::{LossError, linear_cross_entropy};
use crate::norm::{rms_norm_backward, rms_norm_forward};
use crate::rope::rope_in_place;
use crate::swiglu::{swiglu_backward, swiglu_forward};

/// The seven projections of a layer, in [`Layer::proj`] order (PEFT's module names).
pub const PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

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
    /// `out × in`, row-major, frozen.
    pub weight: &'a [f32],
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
    /// Token embeddings, `vocab × hidden` (frozen).
    pub embed: &'a [f32],
    /// Decoder layers, `dims.layers` of them.
    pub layers: Vec<Layer<'a>>,
    /// Final RMSNorm weight, `hidden`.
    pub norm: &'a [f32],
    /// Language-model head, `vocab × hidden` (may be the embedding itself).
    pub lm_head: &'a [f32],
    /// RoPE cosines, `(max_pos, head_dim/2)`.
    pub cos: &'a [f32],
    /// RoPE sines, like `cos`.
    pub sin: &'a [f32],
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
    /// [`attention_forward`]): all zeros is plain causal attention.
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

/// What a layer's forward keeps for its backward (see the module notes). Without
/// checkpointing there is one per layer; with it, one for the whole step, refilled by
/// recomputing each layer's forward right before its backward.
struct Saved {
    /// The layer's input, N × h.
    x_in: Vec<f32>,
    /// 1/rms of the input norm, N.
    inv1: Vec<f32>,
    /// q, k (after RoPE) and v, N × qkv_width.
    qkv: Vec<f32>,
    /// Attention output, N × heads·head_dim.
    attn: Vec<f32>,
    /// Attention log-sum-exp.
    lse: Vec<f32>,
    /// The residual after attention, N × h.
    x_mid: Vec<f32>,
    /// 1/rms of the post-attention norm, N.
    inv2: Vec<f32>,
    /// `[gate | up]`, N × 2I.
    gu: Vec<f32>,
    /// Per projection, `u = x_d·Aᵀ`: N × r for the layer's rank r in the first N·r
    /// elements (a shared `Saved` is sized for the largest rank; empty without LoRA).
    u: [Vec<f32>; 7],
    /// Per projection, the dropout mask (N × in) when one was drawn.
    masks: [Option<Vec<f32>>; 7],
}

/// The lengths of [`Saved`]'s fixed buffers, in field order (`x_in` … `gu`). Shared by
/// [`Saved::new`] and [`step_bytes`], so that the count is the allocation.
fn saved_lengths(d: &Dims, n: usize) -> [usize; 8] {
    let h = d.hidden;
    [
        n * h,
        n,
        n * d.qkv_width(),
        n * d.heads * d.head_dim,
        n * d.heads,
        n * h,
        n,
        n * 2 * d.intermediate,
    ]
}

impl Saved {
    /// Buffers for `n` tokens and, per projection, LoRA rank `ranks[p]` (0: none).
    fn new(d: &Dims, n: usize, ranks: &[usize; 7]) -> Self {
        let [x_in, inv1, qkv, attn, lse, x_mid, inv2, gu] =
            saved_lengths(d, n).map(|len| vec![0.0; len]);
        Self {
            x_in,
            inv1,
            qkv,
            attn,
            lse,
            x_mid,
            inv2,
            gu,
            u: std::array::from_fn(|p| vec![0.0; n * ranks[p]]),
            masks: Default::default(),
        }
    }
}

/// Forward scratch, reused by every layer.
struct ForwardWork {
    /// A normed input, N × h.
    hn: Vec<f32>,
    /// SwiGLU output, N × I.
    act: Vec<f32>,
    /// A masked LoRA input, N × max in.
    xd: Vec<f32>,
}

/// The shape of the attention call.
fn attention_shape(d: &Dims, batch: &Batch<'_>) -> AttentionShape {
    AttentionShape {
        batch: batch.rows,
        seq: batch.len,
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
    }
}

/// `out = β·out + input·Wᵀ`, plus `scale·(input∘mask)·Aᵀ·Bᵀ` with LoRA, saving
/// `u = (input∘mask)·Aᵀ`. `out` starts at the output's first element, rows `stride` apart.
#[allow(clippy::too_many_arguments)]
fn projection_forward(
    d: &Dims,
    p: usize,
    proj: &Projection<'_>,
    n: usize,
    input: &[f32],
    beta: f32,
    out: &mut [f32],
    mask: Option<&[f32]>,
    u: &mut [f32],
    xd: &mut [f32],
) {
    let (i, o) = d.projection_shape(p);
    let stride = d.output_stride(p);
    let x = Mat::new(&input[..n * i], n, i);
    gemm(
        1.0,
        x,
        Mat::new(proj.weight, o, i).t(),
        beta,
        MatMut::strided(out, n, o, stride),
    );
    let Some(lora) = &proj.lora else { return };
    let u = &mut u[..n * lora.r];
    let x = match mask {
        Some(mask) => {
            let xd = &mut xd[..n * i];
            for ((y, &a), &m) in xd.iter_mut().zip(&input[..n * i]).zip(mask) {
                *y = a * m;
            }
            Mat::new(xd, n, i)
        }
        None => x,
    };
    gemm(
        1.0,
        x,
        Mat::new(lora.a, lora.r, i).t(),
        0.0,
        MatMut::new(u, n, lora.r),
    );
    gemm(
        lora.scale,
        Mat::new(u, n, lora.r),
        Mat::new(lora.b, o, lora.r).t(),
        1.0,
        MatMut::strided(out, n, o, stride),
    );
}

/// Where a layer's forward gets its dropout masks.
enum Masks<'a, 'm> {
    /// No dropout.
    Off,
    /// Drawn from the source, in forward order.
    Draw(&'a mut (dyn FnMut(usize, usize) -> Vec<f32> + 'm)),
    /// Already in `Saved::masks`, put there from what the first forward drew (a
    /// checkpointed layer's recomputation).
    Replay,
}

/// One decoder layer forward: `x` (N × h) goes in as the layer's input and comes out as
/// its output; `saved` receives what backward needs.
fn layer_forward(
    model: &Model<'_>,
    l: usize,
    batch: &Batch<'_>,
    x: &mut [f32],
    saved: &mut Saved,
    work: &mut ForwardWork,
    mut masks: Masks<'_, '_>,
) -> Result<(), StepError> {
    let layer = &model.layers[l];
    let d = &model.dims;
    let n = batch.rows * batch.len;
    let eps = d.rms_eps;
    // Masks are drawn in forward order, before the projection that uses them.
    let mut draw = |p: usize, saved: &mut Saved| -> Result<(), StepError> {
        let source = match &mut masks {
            Masks::Replay => return Ok(()),
            Masks::Off => None,
            Masks::Draw(source) => Some(source),
        };
        saved.masks[p] = None;
        if let (Some(source), true) = (source, layer.proj[p].lora.is_some()) {
            let i = d.projection_shape(p).0;
            let mask = source(n, i);
            expect_len(
                || format!("dropout mask of layer {l} {}", PROJECTIONS[p]),
                mask.len(),
                n * i,
            )?;
            saved.masks[p] = Some(mask);
        }
        Ok(())
    };

    saved.x_in.copy_from_slice(x);
    rms_norm_forward(x, layer.input_norm, eps, &mut work.hn, &mut saved.inv1);
    for p in [Q, K, V] {
        draw(p, saved)?;
        let col = d.output_column(p);
        projection_forward(
            d,
            p,
            &layer.proj[p],
            n,
            &work.hn,
            0.0,
            &mut saved.qkv[col..],
            saved.masks[p].as_deref(),
            &mut saved.u[p],
            &mut work.xd,
        );
    }
    // q and k are adjacent: one call rotates both.
    rope_in_place(
        &mut saved.qkv,
        d.qkv_width(),
        0,
        d.heads + d.kv_heads,
        d.head_dim,
        batch.positions,
        model.cos,
        model.sin,
        false,
    );
    let shape = attention_shape(d, batch);
    attention_forward(
        &shape,
        &saved.qkv,
        batch.starts,
        &mut saved.attn,
        &mut saved.lse,
    );
    draw(O, saved)?;
    saved.x_mid.copy_from_slice(x);
    projection_forward(
        d,
        O,
        &layer.proj[O],
        n,
        &saved.attn,
        1.0,
        &mut saved.x_mid,
        saved.masks[O].as_deref(),
        &mut saved.u[O],
        &mut work.xd,
    );
    rms_norm_forward(
        &saved.x_mid,
        layer.post_norm,
        eps,
        &mut work.hn,
        &mut saved.inv2,
    );
    for p in [GATE, UP] {
        draw(p, saved)?;
        let col = d.output_column(p);
        projection_forward(
            d,
            p,
            &layer.proj[p],
            n,
            &work.hn,
            0.0,
            &mut saved.gu[col..],
            saved.masks[p].as_deref(),
            &mut saved.u[p],
            &mut work.xd,
        );
    }
    swiglu_forward(&saved.gu, d.intermediate, &mut work.act);
    draw(DOWN, saved)?;
    x.copy_from_slice(&saved.x_mid);
    projection_forward(
        d,
        DOWN,
        &layer.proj[DOWN],
        n,
        &work.act,
        1.0,
        x,
        saved.masks[DOWN].as_deref(),
        &mut saved.u[DOWN],
        &mut work.xd,
    );
    Ok(())
}

/// The embedding rows of `ids`, N × h.
fn embed(model: &Model<'_>, ids: &[u32]) -> Vec<f32> {
    let h = model.dims.hidden;
    let mut x = vec![0f32; ids.len() * h];
    for (row, &id) in x.chunks_mut(h).zip(ids) {
        row.copy_from_slice(&model.embed[id as usize * h..][..h]);
    }
    x
}

/// The widest projection input, for the masked-input scratch.
fn widest_input(d: &Dims) -> usize {
    (0..7).map(|p| d.projection_shape(p).0).max().unwrap_or(0)
}

/// Scratch of the LoRA backward, sized for the largest rank and projection.
struct LoraWork {
    /// `du = scale·dY·B`, N × r.
    du: Vec<f32>,
    /// The masked input `x_d`, N × in (with dropout); the forward's, handed on.
    xd: Vec<f32>,
    /// `du·A` before the mask, N × in (with dropout).
    tmp: Vec<f32>,
    /// One gradient before it is added, `r × in` or `out × r`.
    grad: Vec<f32>,
}

/// The lengths of the forward scratch ([`ForwardWork`]'s `hn`, `act`, `xd`).
fn forward_work_lengths(d: &Dims, n: usize, dropout: bool) -> [usize; 3] {
    let masked = if dropout { n * widest_input(d) } else { 0 };
    [n * d.hidden, n * d.intermediate, masked]
}

/// The lengths of the buffers only the backward allocates: `dx`, then
/// [`BackwardWork`]'s `d_act`, `d_gu`, `d_attn`, `d_qkv`, then [`LoraWork`]'s `du`,
/// `tmp` and `grad` (its `xd` is the forward's). `ranks`: per layer and projection.
fn backward_lengths(d: &Dims, n: usize, ranks: &[[usize; 7]], dropout: bool) -> [usize; 8] {
    let (mut rank, mut grad) = (0, 0);
    for layer in ranks {
        for (p, &r) in layer.iter().enumerate() {
            if r > 0 {
                let (i, o) = d.projection_shape(p);
                rank = rank.max(r);
                grad = grad.max(r * i.max(o));
            }
        }
    }
    let masked = if dropout { n * widest_input(d) } else { 0 };
    [
        n * d.hidden,
        n * d.intermediate,
        n * 2 * d.intermediate,
        n * d.heads * d.head_dim,
        n * d.qkv_width(),
        n * rank,
        masked,
        grad,
    ]
}

/// Backward scratch, reused by every layer.
struct BackwardWork {
    /// A normed input, recomputed, N × h.
    hn: Vec<f32>,
    /// Its 1/rms, recomputed (equal to the saved one), N.
    inv: Vec<f32>,
    /// SwiGLU output, recomputed, N × I.
    act: Vec<f32>,
    /// Its gradient, N × I.
    d_act: Vec<f32>,
    /// `[dg | du]`, N × 2I.
    d_gu: Vec<f32>,
    /// The gradient of a normed input, N × h.
    d_hn: Vec<f32>,
    /// The gradient of the attention output, N × heads·head_dim.
    d_attn: Vec<f32>,
    /// `[dq | dk | dv]`, N × qkv_width.
    d_qkv: Vec<f32>,
    /// The LoRA branches'.
    lora: LoraWork,
}

/// `dst += src`, elementwise.
fn add(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
}

/// The backward of [`projection_forward`] given `dy` (N × out): adds `dA = duᵀ·x_d` and
/// `dB = scale·dYᵀ·u` into `grads` (A's at `slot`, B's right after) and, with
/// `dx = Some((dx, β))`, writes `dx = β·dx + dY·W + (du·A)∘mask` (N × in), where
/// `du = scale·dY·B` and `x_d = input∘mask`.
#[allow(clippy::too_many_arguments)]
fn projection_backward(
    d: &Dims,
    p: usize,
    proj: &Projection<'_>,
    n: usize,
    dy: Mat<'_>,
    input: &[f32],
    mask: Option<&[f32]>,
    u: &[f32],
    grads: &mut [Vec<f32>],
    slot: Option<usize>,
    mut dx: Option<(&mut [f32], f32)>,
    work: &mut LoraWork,
) {
    let (i, o) = d.projection_shape(p);
    if let Some((dx, beta)) = dx.as_mut() {
        gemm(
            1.0,
            dy,
            Mat::new(proj.weight, o, i),
            *beta,
            MatMut::new(&mut dx[..n * i], n, i),
        );
    }
    let (Some(lora), Some(slot)) = (&proj.lora, slot) else {
        return;
    };
    let r = lora.r;
    let LoraWork { du, xd, tmp, grad } = work;
    let du = &mut du[..n * r];
    gemm(
        lora.scale,
        dy,
        Mat::new(lora.b, o, r),
        0.0,
        MatMut::new(du, n, r),
    );
    let g = &mut grad[..o * r];
    gemm(
        lora.scale,
        dy.t(),
        Mat::new(&u[..n * r], n, r),
        0.0,
        MatMut::new(g, o, r),
    );
    add(&mut grads[slot + 1], g);
    let x = match mask {
        Some(mask) => {
            let xd = &mut xd[..n * i];
            for ((y, &a), &m) in xd.iter_mut().zip(&input[..n * i]).zip(mask) {
                *y = a * m;
            }
            Mat::new(xd, n, i)
        }
        None => Mat::new(&input[..n * i], n, i),
    };
    let g = &mut grad[..r * i];
    gemm(1.0, Mat::new(du, n, r).t(), x, 0.0, MatMut::new(g, r, i));
    add(&mut grads[slot], g);
    let Some((dx, _)) = dx else { return };
    let dx = &mut dx[..n * i];
    match mask {
        None => gemm(
            1.0,
            Mat::new(du, n, r),
            Mat::new(lora.a, r, i),
            1.0,
            MatMut::new(dx, n, i),
        ),
        Some(mask) => {
            let tmp = &mut tmp[..n * i];
            gemm(
                1.0,
                Mat::new(du, n, r),
                Mat::new(lora.a, r, i),
                0.0,
                MatMut::new(tmp, n, i),
            );
            for ((y, &t), &m) in dx.iter_mut().zip(tmp.iter()).zip(mask) {
                *y += t * m;
            }
        }
    }
}

/// One decoder layer backward: `dx` goes in as the gradient of the layer's output and
/// comes out as that of its input, unless `bottom` (no layer below needs it: q, k and v
/// then skip their input gradient and the input norm its backward). LoRA gradients are
/// added into `grads` at the layer's `slots`.
#[allow(clippy::too_many_arguments)]
fn layer_backward(
    model: &Model<'_>,
    l: usize,
    batch: &Batch<'_>,
    saved: &Saved,
    dx: &mut [f32],
    work: &mut BackwardWork,
    grads: &mut [Vec<f32>],
    bottom: bool,
    slots: &[Option<usize>; 7],
) {
    let layer = &model.layers[l];
    let d = &model.dims;
    let n = batch.rows * batch.len;
    let (h, inter) = (d.hidden, d.intermediate);
    let eps = d.rms_eps;

    // MLP: down, SwiGLU, gate and up, then the post-attention norm into dx.
    swiglu_forward(&saved.gu, inter, &mut work.act);
    projection_backward(
        d,
        DOWN,
        &layer.proj[DOWN],
        n,
        Mat::new(dx, n, h),
        &work.act,
        saved.masks[DOWN].as_deref(),
        &saved.u[DOWN],
        grads,
        slots[DOWN],
        Some((&mut work.d_act, 0.0)),
        &mut work.lora,
    );
    swiglu_backward(&saved.gu, inter, &work.d_act, &mut work.d_gu);
    rms_norm_forward(
        &saved.x_mid,
        layer.post_norm,
        eps,
        &mut work.hn,
        &mut work.inv,
    );
    for (p, beta) in [(GATE, 0.0), (UP, 1.0)] {
        projection_backward(
            d,
            p,
            &layer.proj[p],
            n,
            Mat::strided(&work.d_gu[d.output_column(p)..], n, inter, 2 * inter, 1),
            &work.hn,
            saved.masks[p].as_deref(),
            &saved.u[p],
            grads,
            slots[p],
            Some((&mut work.d_hn, beta)),
            &mut work.lora,
        );
    }
    rms_norm_backward(
        &saved.x_mid,
        layer.post_norm,
        &saved.inv2,
        &work.d_hn,
        dx,
        true,
    );

    // Attention: o, attention, inverse RoPE, q/k/v, then the input norm into dx.
    projection_backward(
        d,
        O,
        &layer.proj[O],
        n,
        Mat::new(dx, n, h),
        &saved.attn,
        saved.masks[O].as_deref(),
        &saved.u[O],
        grads,
        slots[O],
        Some((&mut work.d_attn, 0.0)),
        &mut work.lora,
    );
    let shape = attention_shape(d, batch);
    attention_backward(
        &shape,
        &saved.qkv,
        batch.starts,
        &saved.attn,
        &saved.lse,
        &work.d_attn,
        &mut work.d_qkv,
    );
    rope_in_place(
        &mut work.d_qkv,
        d.qkv_width(),
        0,
        d.heads + d.kv_heads,
        d.head_dim,
        batch.positions,
        model.cos,
        model.sin,
        true,
    );
    rms_norm_forward(
        &saved.x_in,
        layer.input_norm,
        eps,
        &mut work.hn,
        &mut work.inv,
    );
    for p in [Q, K, V] {
        let out = d.projection_shape(p).1;
        let beta = if p == Q { 0.0 } else { 1.0 };
        projection_backward(
            d,
            p,
            &layer.proj[p],
            n,
            Mat::strided(&work.d_qkv[d.output_column(p)..], n, out, d.qkv_width(), 1),
            &work.hn,
            saved.masks[p].as_deref(),
            &saved.u[p],
            grads,
            slots[p],
            (!bottom).then_some((&mut work.d_hn[..], beta)),
            &mut work.lora,
        );
    }
    if !bottom {
        rms_norm_backward(
            &saved.x_in,
            layer.input_norm,
            &saved.inv1,
            &work.d_hn,
            dx,
            true,
        );
    }
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

/// A dropout mask kept through a checkpointed forward until its layer is recomputed.
/// The source cannot be asked again (it is a random stream), so the masks are stored;
/// packed to a bit each when, as dropout draws them, every element is `+0.0` or one
/// keep value, which makes them 32 times smaller than the layer input they sit beside.
#[derive(Debug, Clone, PartialEq)]
enum StoredMask {
    /// Bit `i` set: element `i` is `keep`, else `+0.0`.
    Bits {
        /// The kept elements' value, `1/(1 − p)`.
        keep: f32,
        /// One bit per element, 64 to a word.
        bits: Vec<u64>,
        /// Elements.
        len: usize,
    },
    /// Any other mask, as drawn.
    Full(Vec<f32>),
}

impl StoredMask {
    /// Packs `mask` when it is two-valued (compared by bits, so that unpacking is
    /// exact: a `-0.0` or a second non-zero value keeps the mask whole).
    fn pack(mask: &[f32]) -> Self {
        let keep = mask
            .iter()
            .copied()
            .find(|v| v.to_bits() != 0)
            .unwrap_or(1.0);
        if !mask
            .iter()
            .all(|v| v.to_bits() == 0 || v.to_bits() == keep.to_bits())
        {
            return Self::Full(mask.to_vec());
        }
        let mut bits = vec![0u64; mask.len().div_ceil(64)];
        for (word, chunk) in bits.iter_mut().zip(mask.chunks(64)) {
            for (i, v) in chunk.iter().enumerate() {
                *word |= u64::from(v.to_bits() != 0) << i;
            }
        }
        Self::Bits {
            keep,
            bits,
            len: mask.len(),
        }
    }

    /// Writes the mask as drawn into `out`, replacing its contents.
    fn unpack_into(&self, out: &mut Vec<f32>) {
        out.clear();
        match self {
            Self::Full(mask) => out.extend_from_slice(mask),
            Self::Bits { keep, bits, len } => {
                out.reserve_exact(*len);
                out.extend((0..*len).map(|i| {
                    if bits[i / 64] >> (i % 64) & 1 == 1 {
                        *keep
                    } else {
                        0.0
                    }
                }));
            }
        }
    }
}

/// The bytes a two-valued mask of `len` elements takes packed ([`StoredMask::Bits`]).
fn packed_mask_bytes(len: usize) -> u64 {
    8 * len.div_ceil(64) as u64
}

/// Per projection, the largest rank over the layers (a shared [`Saved`]'s `u` sizes).
fn max_ranks(ranks: &[[usize; 7]]) -> [usize; 7] {
    let mut top = [0; 7];
    for layer in ranks {
        for (t, &r) in top.iter_mut().zip(layer) {
            *t = (*t).max(r);
        }
    }
    top
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

/// The most bytes [`forward_backward_with`] holds at once for a micro-batch of `tokens`
/// tokens (rows × len), every one labelled (fewer labels only shrink the loss's chunk
/// buffers), with LoRA ranks `ranks` (per layer, per projection in [`PROJECTIONS`]
/// order, 0 for none; see [`Model::lora_ranks`]), with or without dropout and
/// checkpointing. For choosing checkpointing and a micro-batch size against the memory
/// of a node.
///
/// Counted: the hidden state, the saved forward state (every layer's, or with
/// checkpointing the layer inputs, the packed masks and one layer's state), the
/// forward scratch, the final norm's state and the hidden-state gradient, and then the
/// larger of the loss's chunk buffers and the backward scratch (the two are never
/// alive together), all from the same length helpers the step allocates with. Not
/// counted: the model and the gradients (the caller's), and the kernels' transient
/// buffers: attention's task lists (48 bytes per token and kv head in the backward),
/// its scratch of about `(4·head_dim + 128)·seq` floats per running thread, and the GEMM
/// library's packing (1–3 % of the total in `tests/step_bytes.rs`; more with long rows
/// on many threads). With dropout, masks the source draws as anything but `0` and one
/// keep value are kept whole rather than packed, and are not counted that way here.
/// With checkpointing and layers of different LoRA shapes, the one-layer terms take
/// the largest layer's, so the figure is then an upper bound.
pub fn step_bytes(
    dims: &Dims,
    tokens: usize,
    ranks: &[[usize; 7]],
    dropout: bool,
    checkpoint_layers: bool,
) -> u64 {
    let (d, n) = (dims, tokens);
    if n == 0 {
        return 0;
    }
    let f32s = |len: usize| 4 * len as u64;
    let mask_len = |p: usize| n * d.projection_shape(p).0;
    let masks = |layer: &[usize; 7]| -> usize {
        (0..7)
            .filter(|&p| dropout && layer[p] > 0)
            .map(mask_len)
            .sum()
    };
    let saved = |r: &[usize; 7]| -> usize {
        saved_lengths(d, n).iter().sum::<usize>() + r.iter().map(|r| n * r).sum::<usize>()
    };
    let lowest = ranks.iter().position(|r| r.iter().any(|&r| r > 0));
    let state = if checkpoint_layers {
        let kept = &ranks[lowest.unwrap_or(ranks.len())..];
        let one_layer = saved(&max_ranks(ranks)) + ranks.iter().map(masks).max().unwrap_or(0);
        let packed: u64 = kept
            .iter()
            .flat_map(|layer| (0..7).filter(|&p| dropout && layer[p] > 0))
            .map(|p| packed_mask_bytes(mask_len(p)))
            .sum();
        f32s(one_layer + kept.len() * n * d.hidden) + packed
    } else {
        ranks.iter().map(|r| f32s(saved(r) + masks(r))).sum()
    };
    // x, the forward scratch, the final norm's 1/rms and the hidden-state gradient.
    let forward: usize = forward_work_lengths(d, n, dropout).iter().sum();
    let common = state + f32s(n * d.hidden + forward + n + n * d.hidden);
    let ce = crate::loss::scratch_bytes(d.hidden, d.vocab, n, true);
    let backward = match lowest {
        Some(_) => f32s(backward_lengths(d, n, ranks, dropout).iter().sum()),
        None => 0,
    };
    common + ce.max(backward)
}

/// The [`Masks`] of a forward that draws from `dropout`, if any.
fn drawn<'a, 'm>(dropout: &'a mut Option<MaskSource<'m>>) -> Masks<'a, 'm> {
    match dropout {
        Some(source) => Masks::Draw(&mut **source),
        None => Masks::Off,
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
    let (n, h) = (batch.rows * batch.len, d.hidden);
    if n == 0 {
        return Ok(0.0);
    }
    let ranks = model.lora_ranks();
    let with_dropout = dropout.is_some();
    let mut dropout = dropout;
    // Layers below the lowest one with LoRA need no backward at all.
    let lowest = slots.iter().position(|s| s.iter().any(Option::is_some));
    let checkpoint = options.checkpoint_layers;
    let mut x = embed(model, batch.ids);
    let [hn, act, xd] = forward_work_lengths(d, n, with_dropout).map(|len| vec![0.0; len]);
    let mut work = ForwardWork { hn, act, xd };
    // Without checkpointing, one `Saved` per layer; with it, one shared by all, and
    // per layer from `lowest` up its input and its masks.
    let mut saved: Vec<Saved>;
    let mut inputs: Vec<Vec<f32>> = Vec::new();
    let mut masks: Vec<[Option<StoredMask>; 7]> = Vec::new();
    if checkpoint {
        saved = vec![Saved::new(d, n, &max_ranks(&ranks))];
        let keep_from = lowest.unwrap_or(model.layers.len());
        for l in 0..model.layers.len() {
            if l >= keep_from {
                inputs.push(x.clone());
            }
            let s = &mut saved[0];
            layer_forward(model, l, batch, &mut x, s, &mut work, drawn(&mut dropout))?;
            if l >= keep_from {
                masks.push(std::array::from_fn(|p| {
                    s.masks[p].as_deref().map(StoredMask::pack)
                }));
            }
        }
    } else {
        saved = ranks.iter().map(|r| Saved::new(d, n, r)).collect();
        for (l, s) in saved.iter_mut().enumerate() {
            layer_forward(model, l, batch, &mut x, s, &mut work, drawn(&mut dropout))?;
        }
    }
    let mut inv = vec![0f32; n];
    rms_norm_forward(&x, model.norm, d.rms_eps, &mut work.hn, &mut inv);
    let mut d_hidden = vec![0f32; n * h];
    let loss = linear_cross_entropy(
        &work.hn,
        h,
        model.lm_head,
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
    let [dx, d_act, d_gu, d_attn, d_qkv, du, tmp, grad] =
        backward_lengths(d, n, &ranks, with_dropout).map(|len| vec![0f32; len]);
    let mut dx = dx;
    rms_norm_backward(&x, model.norm, &inv, &d_hidden, &mut dx, false);
    let mut work = BackwardWork {
        hn: work.hn,
        inv,
        act: work.act,
        d_act,
        d_gu,
        d_hn: d_hidden,
        d_attn,
        d_qkv,
        lora: LoraWork {
            du,
            xd: work.xd,
            tmp,
            grad,
        },
    };
    for l in (lowest..model.layers.len()).rev() {
        let s = if checkpoint {
            // Recompute the layer's forward state from its input and its masks, with the
            // backward's buffers lent as the forward's scratch (the backward recomputes
            // what it needs of them itself).
            let (Some(mut input), Some(stored)) = (inputs.pop(), masks.pop()) else {
                unreachable!("an input and masks were kept for every layer from the lowest");
            };
            let s = &mut saved[0];
            for (p, stored) in stored.iter().enumerate() {
                s.masks[p] = stored.as_ref().map(|m| {
                    let mut buf = s.masks[p].take().unwrap_or_default();
                    m.unpack_into(&mut buf);
                    buf
                });
            }
            let mut lent = ForwardWork {
                hn: std::mem::take(&mut work.hn),
                act: std::mem::take(&mut work.act),
                xd: std::mem::take(&mut work.lora.xd),
            };
            // Replaying draws nothing, so this cannot fail (and add half a step).
            layer_forward(model, l, batch, &mut input, s, &mut lent, Masks::Replay)?;
            (work.hn, work.act, work.lora.xd) = (lent.hn, lent.act, lent.xd);
            &saved[0]
        } else {
            &saved[l]
        };
        layer_backward(
            model,
            l,
            batch,
            s,
            &mut dx,
            &mut work,
            grads,
            l == lowest,
            &slots[l],
        );
    }
    Ok(loss)
}

/// The loss only, for evaluation: `scale·Σ CE` over the labelled tokens, without dropout
/// and without any gradient work. Layers reuse one set of buffers.
///
/// # Errors
/// [`StepError`] when the model or batch is inconsistent; see [`forward_backward`].
pub fn loss(model: &Model<'_>, batch: &Batch<'_>, scale: f32) -> Result<f64, StepError> {
    validate(model, batch)?;
    let d = &model.dims;
    let n = batch.rows * batch.len;
    if n == 0 {
        return Ok(0.0);
    }
    let mut x = embed(model, batch.ids);
    let [hn, act, xd] = forward_work_lengths(d, n, false).map(|len| vec![0.0; len]);
    let mut work = ForwardWork { hn, act, xd };
    let mut saved = Saved::new(d, n, &max_ranks(&model.lora_ranks()));
    for l in 0..model.layers.len() {
        layer_forward(model, l, batch, &mut x, &mut saved, &mut work, Masks::Off)?;
    }
    let mut inv = vec![0f32; n];
    rms_norm_forward(&x, model.norm, d.rms_eps, &mut work.hn, &mut inv);
    Ok(linear_cross_entropy(
        &work.hn,
        d.hidden,
        model.lm_head,
        d.vocab,
        batch.targets,
        scale,
        None,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut rand_chacha::ChaCha8Rng, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    }

    /// A model's tensors, owned; [`Owned::view`] lends them as a [`Model`].
    struct Owned {
        dims: Dims,
        embed: Vec<f32>,
        norms: Vec<[Vec<f32>; 2]>,
        weights: Vec<[Vec<f32>; 7]>,
        /// LoRA tensors in gradient order (layer, projection, A then B).
        lora: Vec<Vec<f32>>,
        /// Per layer, which projections carry LoRA.
        targets: Vec<[bool; 7]>,
        r: usize,
        lora_scale: f32,
        norm: Vec<f32>,
        lm_head: Vec<f32>,
        cos: Vec<f32>,
        sin: Vec<f32>,
    }

    fn tiny_dims() -> Dims {
        Dims {
            vocab: 61,
            hidden: 16,
            intermediate: 24,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            rms_eps: 1e-5,
        }
    }

    /// HF's rotate-half tables, angle(p, i) = p / 10000^(2i/d).
    fn rope_tables(max_pos: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
        let half = head_dim / 2;
        let (mut cos, mut sin) = (vec![], vec![]);
        for p in 0..max_pos {
            for i in 0..half {
                let angle = p as f64 / 10_000f64.powf(2.0 * i as f64 / head_dim as f64);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        (cos, sin)
    }

    impl Owned {
        fn random(dims: Dims, targets: &[[bool; 7]], r: usize, seed: u64) -> Self {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let (v, h) = (dims.vocab, dims.hidden);
            let embed = random(v * h, &mut rng, -1.0, 1.0);
            let mut norms = vec![];
            let mut weights = vec![];
            let mut lora = vec![];
            for targets in targets.iter().cycle().take(dims.layers) {
                norms.push([random(h, &mut rng, 0.5, 1.5), random(h, &mut rng, 0.5, 1.5)]);
                let w: [Vec<f32>; 7] = std::array::from_fn(|p| {
                    let (i, o) = dims.projection_shape(p);
                    let bound = 1.0 / (i as f32).sqrt();
                    random(o * i, &mut rng, -bound, bound)
                });
                weights.push(w);
                for (p, &t) in targets.iter().enumerate() {
                    if t {
                        let (i, o) = dims.projection_shape(p);
                        let bound = 1.0 / (i as f32).sqrt();
                        lora.push(random(r * i, &mut rng, -bound, bound));
                        // B non-zero, so that A gets a gradient too.
                        lora.push(random(o * r, &mut rng, -0.3, 0.3));
                    }
                }
            }
            let norm = random(h, &mut rng, 0.5, 1.5);
            let bound = 1.0 / (h as f32).sqrt();
            let lm_head = random(v * h, &mut rng, -4.0 * bound, 4.0 * bound);
            let (cos, sin) = rope_tables(128, dims.head_dim);
            Self {
                dims,
                embed,
                norms,
                weights,
                lora,
                targets: targets.iter().cycle().take(dims.layers).copied().collect(),
                r,
                lora_scale: 1.5,
                norm,
                lm_head,
                cos,
                sin,
            }
        }

        fn view(&self) -> Model<'_> {
            let mut next = 0;
            let layers = (0..self.dims.layers)
                .map(|l| Layer {
                    input_norm: &self.norms[l][0],
                    post_norm: &self.norms[l][1],
                    proj: std::array::from_fn(|p| Projection {
                        weight: &self.weights[l][p],
                        lora: self.targets[l][p].then(|| {
                            next += 2;
                            Lora {
                                a: &self.lora[next - 2],
                                b: &self.lora[next - 1],
                                r: self.r,
                                scale: self.lora_scale,
                            }
                        }),
                    }),
                })
                .collect();
            Model {
                dims: self.dims,
                embed: &self.embed,
                layers,
                norm: &self.norm,
                lm_head: &self.lm_head,
                cos: &self.cos,
                sin: &self.sin,
            }
        }

        fn zero_grads(&self) -> Vec<Vec<f32>> {
            self.lora.iter().map(|t| vec![0.0; t.len()]).collect()
        }

        fn lora64(&self) -> Vec<Vec<f64>> {
            self.lora.iter().map(|t| widen(t)).collect()
        }
    }

    fn widen(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    /// A batch's buffers, owned.
    struct OwnedBatch {
        ids: Vec<u32>,
        rows: usize,
        len: usize,
        targets: Vec<i64>,
        positions: Vec<u32>,
        starts: Vec<u32>,
    }

    impl OwnedBatch {
        fn view(&self) -> Batch<'_> {
            Batch {
                ids: &self.ids,
                rows: self.rows,
                len: self.len,
                targets: &self.targets,
                positions: &self.positions,
                starts: &self.starts,
            }
        }

        fn labelled(&self) -> usize {
            self.targets.iter().filter(|&&t| t >= 0).count()
        }
    }

    /// Two rows of 9: row 0 packs two examples (4 and 5 tokens; positions restart, the
    /// second segment starts at column 4), row 1 holds 6 tokens right-padded with 3 pads
    /// (id 0, no target). A few real tokens are unlabelled too (the prompt, say).
    fn tiny_batch(vocab: usize, seed: u64) -> OwnedBatch {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (rows, len) = (2, 9);
        let ids: Vec<u32> = (0..rows * len)
            .map(|i| {
                if i >= len + 6 {
                    0
                } else {
                    rng.random_range(0..vocab as u32)
                }
            })
            .collect();
        let mut targets: Vec<i64> = (0..rows * len)
            .map(|_| rng.random_range(0..vocab as i64))
            .collect();
        for i in [0, 3, 4, len, len + 5, len + 6, len + 7, len + 8] {
            targets[i] = -100;
        }
        let positions = [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8].to_vec();
        let starts = [0, 0, 0, 0, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0].to_vec();
        OwnedBatch {
            ids,
            rows,
            len,
            targets,
            positions,
            starts,
        }
    }

    /// The model in f64 with plain loops, from the definitions (HF's Llama with PEFT's
    /// LoRA): `lora` replaces the model's LoRA tensors (gradient order), `masks` are the
    /// dropout masks in forward order (empty: no dropout).
    fn reference_loss(
        m: &Owned,
        lora: &[Vec<f64>],
        batch: &OwnedBatch,
        scale: f64,
        masks: &[Vec<f32>],
    ) -> f64 {
        let d = m.dims;
        let (h, n, hd) = (d.hidden, batch.rows * batch.len, d.head_dim);
        let (nh, nkv) = (d.heads, d.kv_heads);
        let eps = d.rms_eps as f64;
        let rms_norm = |x: &[f64], w: &[f32]| -> Vec<f64> {
            let mut y = vec![0.0; x.len()];
            for (row, out) in x.chunks(h).zip(y.chunks_mut(h)) {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / h as f64;
                let r = 1.0 / (ms + eps).sqrt();
                for j in 0..h {
                    out[j] = row[j] * r * w[j] as f64;
                }
            }
            y
        };
        let mut next_lora = 0;
        let mut next_mask = 0;
        // x (n × in) → n × out, with W, and LoRA when the projection has it.
        let mut linear = |x: &[f64], l: usize, p: usize| -> Vec<f64> {
            let (i, o) = d.projection_shape(p);
            let w = &m.weights[l][p];
            let mut y = vec![0.0; n * o];
            for t in 0..n {
                for c in 0..o {
                    y[t * o + c] = (0..i).map(|k| x[t * i + k] * w[c * i + k] as f64).sum();
                }
            }
            if m.targets[l][p] {
                let (a, b) = (&lora[next_lora], &lora[next_lora + 1]);
                next_lora += 2;
                let mut xd = x.to_vec();
                if !masks.is_empty() {
                    for (v, &k) in xd.iter_mut().zip(&masks[next_mask]) {
                        *v *= k as f64;
                    }
                    next_mask += 1;
                }
                let r = m.r;
                for t in 0..n {
                    let u: Vec<f64> = (0..r)
                        .map(|q| (0..i).map(|k| xd[t * i + k] * a[q * i + k]).sum())
                        .collect();
                    for c in 0..o {
                        let delta: f64 = (0..r).map(|q| u[q] * b[c * r + q]).sum();
                        y[t * o + c] += m.lora_scale as f64 * delta;
                    }
                }
            }
            y
        };
        let rope = |x: &mut [f64], heads: usize| {
            let half = hd / 2;
            for t in 0..n {
                let pos = batch.positions[t] as usize;
                for head in 0..heads {
                    let v = &mut x[(t * heads + head) * hd..][..hd];
                    let old = v.to_vec();
                    for j in 0..hd {
                        let c = m.cos[pos * half + j % half] as f64;
                        let s = m.sin[pos * half + j % half] as f64;
                        let rotated = if j < half {
                            -old[j + half]
                        } else {
                            old[j - half]
                        };
                        v[j] = old[j] * c + rotated * s;
                    }
                }
            }
        };
        let mut x: Vec<f64> = batch
            .ids
            .iter()
            .flat_map(|&id| widen(&m.embed[id as usize * h..][..h]))
            .collect();
        for l in 0..d.layers {
            let hn = rms_norm(&x, &m.norms[l][0]);
            let mut q = linear(&hn, l, Q);
            let mut k = linear(&hn, l, K);
            let v = linear(&hn, l, V);
            rope(&mut q, nh);
            rope(&mut k, nkv);
            let mut attn = vec![0.0; n * nh * hd];
            for t in 0..n {
                let (row, col) = (t / batch.len, t % batch.len);
                for head in 0..nh {
                    let g = head / (nh / nkv);
                    let keys: Vec<usize> = (batch.starts[t] as usize..=col)
                        .map(|j| row * batch.len + j)
                        .collect();
                    let s: Vec<f64> = keys
                        .iter()
                        .map(|&u| {
                            (0..hd)
                                .map(|c| q[(t * nh + head) * hd + c] * k[(u * nkv + g) * hd + c])
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
                    for c in 0..hd {
                        attn[(t * nh + head) * hd + c] = keys
                            .iter()
                            .zip(&s)
                            .map(|(&u, x)| (x - max).exp() / sum * v[(u * nkv + g) * hd + c])
                            .sum();
                    }
                }
            }
            let o = linear(&attn, l, O);
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let hn = rms_norm(&x, &m.norms[l][1]);
            let gate = linear(&hn, l, GATE);
            let up = linear(&hn, l, UP);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = linear(&act, l, DOWN);
            x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
        }
        let hf = rms_norm(&x, &m.norm);
        let mut total = 0.0;
        for t in 0..n {
            let Ok(target) = usize::try_from(batch.targets[t]) else {
                continue;
            };
            let logits: Vec<f64> = (0..d.vocab)
                .map(|v| {
                    (0..h)
                        .map(|j| hf[t * h + j] * m.lm_head[v * h + j] as f64)
                        .sum()
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            total += lse - logits[target];
        }
        total * scale
    }

    const ALL: [bool; 7] = [true; 7];
    const QV: [bool; 7] = [true, false, true, false, false, false, false];
    const NONE: [bool; 7] = [false; 7];

    /// Central differences of the f64 reference loss for every LoRA parameter, in
    /// gradient order.
    fn finite_differences(
        m: &Owned,
        b: &OwnedBatch,
        scale: f64,
        masks: &[Vec<f32>],
    ) -> Vec<Vec<f64>> {
        let base = m.lora64();
        let step = 1e-5;
        (0..base.len())
            .map(|t| {
                (0..base[t].len())
                    .map(|e| {
                        let mut lora = base.clone();
                        lora[t][e] = base[t][e] + step;
                        let plus = reference_loss(m, &lora, b, scale, masks);
                        lora[t][e] = base[t][e] - step;
                        let minus = reference_loss(m, &lora, b, scale, masks);
                        (plus - minus) / (2.0 * step)
                    })
                    .collect()
            })
            .collect()
    }

    /// Checks the step's loss against the reference and every gradient tensor against
    /// finite differences, within 1e-4 of the tensor's largest |gradient|; returns the
    /// worst loss and gradient errors.
    fn check_gradients(m: &Owned, b: &OwnedBatch, masks: &[Vec<f32>]) -> (f64, f64) {
        let scale = 1.0 / b.labelled() as f32;
        let mut grads = m.zero_grads();
        let mut queue = masks.iter().cloned();
        let mut source = |rows: usize, inputs: usize| {
            let mask = queue.next().expect("a mask for every adapted projection");
            assert_eq!(mask.len(), rows * inputs);
            mask
        };
        let dropout: Option<MaskSource<'_>> = if masks.is_empty() {
            None
        } else {
            Some(&mut source)
        };
        let got =
            forward_backward(&m.view(), &b.view(), scale, dropout, &mut grads).expect("a step");
        let want = reference_loss(m, &m.lora64(), b, scale as f64, masks);
        let loss_err = (got - want).abs() / want.abs();
        assert!(loss_err <= 1e-5, "loss {got} vs {want}");
        let fd = finite_differences(m, b, scale as f64, masks);
        let mut worst = 0f64;
        for (t, (g, f)) in grads.iter().zip(&fd).enumerate() {
            let size = f.iter().fold(0f64, |a, v| a.max(v.abs()));
            assert!(size > 0.0, "tensor {t} has no gradient");
            for (e, (&g, &f)) in g.iter().zip(f).enumerate() {
                let err = (g as f64 - f).abs() / size;
                worst = worst.max(err);
                assert!(err <= 1e-4, "tensor {t}[{e}]: {g} vs finite difference {f}");
            }
        }
        (loss_err, worst)
    }

    #[test]
    fn gradients_match_finite_differences_with_lora_on_all_seven() {
        let m = Owned::random(tiny_dims(), &[ALL], 2, 5);
        let b = tiny_batch(m.dims.vocab, 6);
        let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
        eprintln!("all seven: loss {loss_err:e}, gradients {grad_err:e} of their max");
    }

    #[test]
    fn gradients_match_finite_differences_with_lora_on_q_and_v() {
        let m = Owned::random(tiny_dims(), &[QV], 2, 7);
        let b = tiny_batch(m.dims.vocab, 8);
        let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
        eprintln!("q and v: loss {loss_err:e}, gradients {grad_err:e} of their max");
    }

    /// LoRA only above layer 0 (the layers below get no backward at all), and a rank
    /// of 3 on a third layer.
    #[test]
    fn gradients_match_finite_differences_with_lora_only_in_upper_layers() {
        let dims = Dims {
            layers: 3,
            ..tiny_dims()
        };
        let m = Owned::random(
            dims,
            &[NONE, [false, true, false, true, false, false, true], ALL],
            3,
            9,
        );
        let b = tiny_batch(m.dims.vocab, 10);
        let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
        eprintln!("upper layers: loss {loss_err:e}, gradients {grad_err:e} of their max");
    }

    /// Dropout masks (0 or 1/(1 − p)) for every adapted projection of `m`, in forward
    /// order, each `n × in`.
    fn dropout_masks(m: &Owned, n: usize, p: f64, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let keep = (1.0 / (1.0 - p)) as f32;
        let mut masks = vec![];
        for targets in &m.targets {
            for (proj, _) in targets.iter().enumerate().filter(|&(_, &t)| t) {
                let i = m.dims.projection_shape(proj).0;
                masks.push(
                    (0..n * i)
                        .map(|_| if rng.random::<f64>() < p { 0.0 } else { keep })
                        .collect(),
                );
            }
        }
        masks
    }

    #[test]
    fn gradients_match_finite_differences_with_dropout() {
        for (targets, seed) in [(ALL, 20), (QV, 21)] {
            let m = Owned::random(tiny_dims(), &[targets], 2, seed);
            let b = tiny_batch(m.dims.vocab, seed + 10);
            let masks = dropout_masks(&m, b.rows * b.len, 0.3, seed + 20);
            let (loss_err, grad_err) = check_gradients(&m, &b, &masks);
            eprintln!("dropout: loss {loss_err:e}, gradients {grad_err:e} of their max");
            // The masks matter: without them the loss is another.
            let plain = reference_loss(&m, &m.lora64(), &b, 1.0, &[]);
            let masked = reference_loss(&m, &m.lora64(), &b, 1.0, &masks);
            assert!((plain - masked).abs() > 1e-3 * plain.abs());
        }
    }

    /// One draw per adapted projection, in forward order, with its shape, with and
    /// without checkpointing; a mask of the wrong length is an error and nothing is
    /// added.
    #[test]
    fn masks_are_drawn_in_forward_order() {
        let dims = Dims {
            layers: 3,
            ..tiny_dims()
        };
        let layers = [ALL, NONE, [false, false, false, true, false, true, true]];
        let m = Owned::random(dims, &layers, 2, 22);
        let b = tiny_batch(m.dims.vocab, 23);
        let n = b.rows * b.len;
        let (h, q, i) = (16, 16, 24);
        let want = [
            (n, h),
            (n, h),
            (n, h),
            (n, q),
            (n, h),
            (n, h),
            (n, i),
            (n, q),
            (n, h),
            (n, i),
        ];
        for checkpoint_layers in [false, true] {
            let options = StepOptions { checkpoint_layers };
            let step = |dropout: Option<MaskSource<'_>>, grads: &mut [Vec<f32>]| {
                forward_backward_with(&m.view(), &b.view(), 0.1, dropout, grads, options)
            };
            // Checkpointing replays the stored masks: nothing is drawn twice.
            let mut calls = vec![];
            let mut source = |rows: usize, inputs: usize| {
                calls.push((rows, inputs));
                vec![1.0; rows * inputs]
            };
            let mut grads = m.zero_grads();
            let with_ones = step(Some(&mut source), &mut grads).expect("a step");
            assert_eq!(calls, want);
            // Masks of ones change nothing.
            let mut plain = m.zero_grads();
            let without = step(None, &mut plain).expect("a step");
            assert_eq!(with_ones, without);
            assert_eq!(grads, plain);

            for bad in [5, 10] {
                let mut count = 0;
                let mut short = |rows: usize, inputs: usize| {
                    count += 1;
                    vec![1.0; rows * inputs - usize::from(count == bad)]
                };
                let mut grads: Vec<Vec<f32>> = m
                    .zero_grads()
                    .into_iter()
                    .map(|g| vec![7.0; g.len()])
                    .collect();
                let err = step(Some(&mut short), &mut grads).expect_err("a short mask");
                eprintln!("{err}");
                assert!(grads.iter().flatten().all(|&v| v == 7.0));
            }
        }
    }

    /// A batch without labels or without tokens: a zero loss, and nothing added.
    #[test]
    fn empty_and_unlabelled_batches_add_nothing() {
        let m = Owned::random(tiny_dims(), &[ALL], 2, 24);
        let mut b = tiny_batch(m.dims.vocab, 25);
        b.targets.fill(-100);
        let mut grads: Vec<Vec<f32>> = m
            .zero_grads()
            .into_iter()
            .map(|g| vec![0.5; g.len()])
            .collect();
        let l = forward_backward(&m.view(), &b.view(), 1.0, None, &mut grads).expect("a step");
        assert_eq!(l, 0.0);
        assert_eq!(loss(&m.view(), &b.view(), 1.0), Ok(0.0));
        let empty = OwnedBatch {
            ids: vec![],
            rows: 0,
            len: 9,
            targets: vec![],
            positions: vec![],
            starts: vec![],
        };
        let l = forward_backward(&m.view(), &empty.view(), 1.0, None, &mut grads).expect("a step");
        assert_eq!(l, 0.0);
        assert_eq!(loss(&m.view(), &empty.view(), 1.0), Ok(0.0));
        assert!(grads.iter().flatten().all(|&v| v == 0.5));
    }

    #[test]
    fn micro_batches_accumulate() {
        let m = Owned::random(tiny_dims(), &[ALL], 2, 11);
        let (b1, b2) = (tiny_batch(m.dims.vocab, 12), tiny_batch(m.dims.vocab, 13));
        let scale = 1.0 / (b1.labelled() + b2.labelled()) as f32;
        let run = |batches: &[&OwnedBatch]| {
            let mut grads = m.zero_grads();
            let losses: Vec<f64> = batches
                .iter()
                .map(|b| {
                    forward_backward(&m.view(), &b.view(), scale, None, &mut grads).expect("a step")
                })
                .collect();
            (losses, grads)
        };
        let (one, g1) = run(&[&b1]);
        let (two, g2) = run(&[&b2]);
        let (both, g) = run(&[&b1, &b2]);
        assert_eq!(both, [one[0], two[0]]);
        for (t, ((g, g1), g2)) in g.iter().zip(&g1).zip(&g2).enumerate() {
            for (e, ((&g, &a), &b)) in g.iter().zip(g1).zip(g2).enumerate() {
                assert_eq!(g.to_bits(), (a + b).to_bits(), "tensor {t}[{e}]");
            }
        }
        assert!(g1.iter().flatten().any(|&v| v != 0.0));
    }

    /// A larger model and batch, so that GEMMs split into several blocks and attention
    /// into several query blocks.
    fn larger_case() -> (Owned, OwnedBatch) {
        let dims = Dims {
            vocab: 200,
            hidden: 32,
            intermediate: 144,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            rms_eps: 1e-6,
        };
        let m = Owned::random(dims, &[ALL], 4, 14);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
        let (rows, len) = (3, 70);
        let b = OwnedBatch {
            ids: (0..rows * len).map(|_| rng.random_range(0..200)).collect(),
            rows,
            len,
            targets: (0..rows * len)
                .map(|i| {
                    if i % 5 == 0 {
                        -100
                    } else {
                        rng.random_range(0..200)
                    }
                })
                .collect(),
            positions: (0..rows * len).map(|i| (i % len) as u32).collect(),
            starts: vec![0; rows * len],
        };
        (m, b)
    }

    /// The same bits on 1 and 2 threads.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (m, b) = larger_case();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            pool.install(|| {
                let mut grads = m.zero_grads();
                let loss =
                    forward_backward(&m.view(), &b.view(), 0.01, None, &mut grads).expect("a step");
                let eval = loss_only(&m, &b);
                let bits: Vec<Vec<u32>> = grads
                    .iter()
                    .map(|g| g.iter().map(|v| v.to_bits()).collect())
                    .collect();
                (loss.to_bits(), eval.to_bits(), bits)
            })
        };
        let one = run(1);
        assert_eq!(
            one.0, one.1,
            "the evaluation loss differs from the training one"
        );
        assert_eq!(one, run(2));
    }

    fn loss_only(m: &Owned, b: &OwnedBatch) -> f64 {
        loss(&m.view(), &b.view(), 0.01).expect("a loss")
    }

    #[test]
    fn bad_gradient_buffers_are_errors_and_nothing_is_added() {
        let m = Owned::random(tiny_dims(), &[QV], 2, 16);
        let b = tiny_batch(m.dims.vocab, 17);
        let model = m.view();
        let mut grads = m.zero_grads();
        grads.pop();
        let err = forward_backward(&model, &b.view(), 1.0, None, &mut grads)
            .expect_err("a missing gradient");
        eprintln!("{err}");
        let mut grads = m.zero_grads();
        grads[2].push(0.0);
        let err = forward_backward(&model, &b.view(), 1.0, None, &mut grads)
            .expect_err("a long gradient");
        eprintln!("{err}");
        // A bad batch: the gradients are left as they were.
        let mut grads: Vec<Vec<f32>> = m
            .zero_grads()
            .into_iter()
            .map(|g| vec![7.0; g.len()])
            .collect();
        let mut bad = tiny_batch(m.dims.vocab, 17);
        bad.targets[3] = 1000;
        assert!(forward_backward(&model, &bad.view(), 1.0, None, &mut grads).is_err());
        assert!(grads.iter().flatten().all(|&v| v == 7.0));
    }

    #[test]
    fn the_loss_matches_the_f64_reference() {
        for (targets, seed) in [
            (ALL, 1),
            ([true, false, true, false, false, false, false], 2),
        ] {
            let m = Owned::random(tiny_dims(), &[targets], 2, seed);
            let b = tiny_batch(m.dims.vocab, seed + 10);
            let scale = 1.0 / b.labelled() as f32;
            let got = loss(&m.view(), &b.view(), scale).expect("a loss");
            let want = reference_loss(&m, &m.lora64(), &b, scale as f64, &[]);
            let err = (got - want).abs() / want.abs();
            eprintln!("loss {got} vs {want}: relative error {err:e}");
            assert!(err <= 1e-5, "loss {got} vs {want}: {err:e}");
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let m = Owned::random(tiny_dims(), &[ALL], 2, 3);
        let model = m.view();
        let good = tiny_batch(m.dims.vocab, 4);
        assert!(loss(&model, &good.view(), 1.0).is_ok());
        let check = |change: &dyn Fn(&mut OwnedBatch), what: &str| {
            let mut b = tiny_batch(m.dims.vocab, 4);
            change(&mut b);
            let err = loss(&model, &b.view(), 1.0).expect_err(what);
            eprintln!("{what}: {err}");
        };
        check(&|b| b.ids[5] = 61, "a token past the vocabulary");
        check(&|b| b.targets[7] = 61, "a target past the vocabulary");
        check(&|b| b.positions[2] = 128, "a position past the tables");
        check(&|b| b.starts[10] = 2, "a segment starting after its token");
        check(&|b| b.ids.pop().map_or((), drop), "too few ids");
        check(&|b| b.targets.push(0), "too many targets");
        check(&|b| b.rows = 3, "rows that the buffers do not hold");

        let bad_model = |change: &dyn Fn(&mut Model<'_>), what: &str| {
            let mut model = m.view();
            change(&mut model);
            let err = loss(&model, &good.view(), 1.0).expect_err(what);
            eprintln!("{what}: {err}");
        };
        bad_model(&|m| m.dims.layers = 3, "a missing layer");
        bad_model(&|m| m.dims.kv_heads = 3, "heads not a multiple of kv heads");
        bad_model(&|m| m.dims.head_dim = 3, "an odd head_dim");
        bad_model(&|m| m.embed = &m.embed[1..], "a short embedding");
        bad_model(&|m| m.sin = &m.sin[2..], "tables of different lengths");
        bad_model(
            &|m| m.layers[1].proj[5].weight = &m.layers[1].proj[5].weight[1..],
            "a short weight",
        );
        bad_model(
            &|m| {
                if let Some(l) = m.layers[0].proj[2].lora.as_mut() {
                    l.r = 3;
                }
            },
            "a LoRA rank its factors do not have",
        );
    }
    /// Two accumulating micro-batches on a pool of `threads`, with `masks[k]` the dropout
    /// masks of micro-batch `k` in forward order (none: no dropout): the losses' and the
    /// gradients' bits.
    fn step_bits(
        m: &Owned,
        batches: &[&OwnedBatch],
        masks: &[Vec<Vec<f32>>],
        threads: usize,
        checkpoint_layers: bool,
    ) -> (Vec<u64>, Vec<Vec<u32>>) {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        let scale = 1.0 / batches.iter().map(|b| b.labelled()).sum::<usize>() as f32;
        pool.install(|| {
            let mut grads = m.zero_grads();
            let mut losses = vec![];
            for (k, b) in batches.iter().enumerate() {
                let mut queue = masks.get(k).into_iter().flatten().cloned();
                let mut source = |rows: usize, inputs: usize| {
                    let mask = queue.next().expect("a mask for every adapted projection");
                    assert_eq!(mask.len(), rows * inputs);
                    mask
                };
                let dropout: Option<MaskSource<'_>> = if masks.is_empty() {
                    None
                } else {
                    Some(&mut source)
                };
                let options = StepOptions { checkpoint_layers };
                let loss = forward_backward_with(
                    &m.view(),
                    &b.view(),
                    scale,
                    dropout,
                    &mut grads,
                    options,
                )
                .expect("a step");
                losses.push(loss.to_bits());
            }
            assert!(grads.iter().flatten().any(|&v| v != 0.0));
            let bits = grads
                .iter()
                .map(|g| g.iter().map(|v| v.to_bits()).collect())
                .collect();
            (losses, bits)
        })
    }

    /// Masks that are not two-valued (0, −0, and two keep values), which a checkpointed
    /// step must keep whole.
    fn odd_masks(m: &Owned, n: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        dropout_masks(m, n, 0.3, seed)
            .into_iter()
            .map(|mask| {
                mask.into_iter()
                    .map(|v| match rng.random_range(0..10) {
                        0 => -0.0,
                        1 => 1.25,
                        _ => v,
                    })
                    .collect()
            })
            .collect()
    }

    /// Checkpointing recomputes each layer's forward with the same code, inputs and masks,
    /// so the losses and the accumulated gradients are the same bits as without it: on
    /// the oracle-checked models (GQA; LoRA on all seven, on q and v, and only above
    /// layer 0 with a gap), without dropout, with two-valued (packed) masks and with odd
    /// (kept whole) masks, over two micro-batches, on 1 and 2 threads; and on a model
    /// large enough that the kernels split into several blocks.
    #[test]
    fn checkpointing_gives_the_same_bits() {
        let three = Dims {
            layers: 3,
            ..tiny_dims()
        };
        let upper = [NONE, [false, true, false, true, false, false, true], ALL];
        let models = [
            Owned::random(tiny_dims(), &[ALL], 2, 30),
            Owned::random(tiny_dims(), &[QV], 2, 31),
            Owned::random(three, &upper, 3, 32),
        ];
        for (k, m) in models.iter().enumerate() {
            let seed = 40 + 10 * k as u64;
            let (b1, b2) = (
                tiny_batch(m.dims.vocab, seed),
                tiny_batch(m.dims.vocab, seed + 1),
            );
            let n = b1.rows * b1.len;
            let drawn = [
                dropout_masks(m, n, 0.3, seed + 2),
                dropout_masks(m, n, 0.3, seed + 3),
            ];
            let odd = [odd_masks(m, n, seed + 4), odd_masks(m, n, seed + 5)];
            for masks in [&[][..], &drawn[..], &odd[..]] {
                let plain = step_bits(m, &[&b1, &b2], masks, 1, false);
                for threads in [1, 2] {
                    let checkpointed = step_bits(m, &[&b1, &b2], masks, threads, true);
                    assert!(
                        plain == checkpointed,
                        "model {k}, {} masks, {threads} threads: checkpointing changed the bits",
                        masks.len()
                    );
                }
            }
        }
        let (m, b) = larger_case();
        let masks = [dropout_masks(&m, b.rows * b.len, 0.1, 33)];
        for masks in [&[][..], &masks[..]] {
            let plain = step_bits(&m, &[&b], masks, 2, false);
            assert!(plain == step_bits(&m, &[&b], masks, 2, true));
            assert!(plain == step_bits(&m, &[&b], masks, 1, true));
        }
    }

    /// A stored mask unpacks to the bits drawn: two-valued masks pack to a bit each
    /// (any length, all zeros too), anything else is kept whole.
    #[test]
    fn stored_masks_unpack_to_the_drawn_bits() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let keep = 1.0 / 0.9f32;
        let two: Vec<f32> = (0..131)
            .map(|i| if i % 3 == 0 { 0.0 } else { keep })
            .collect();
        let cases = [
            (two.clone(), true),
            (vec![0.0; 70], true),
            (vec![keep; 64], true),
            (vec![], true),
            ([&two[..5], &[-0.0], &two[6..]].concat(), false),
            ([&two[..5], &[2.0], &two[6..]].concat(), false),
        ];
        let mut out = vec![9.0; 3];
        for (mask, packed) in cases {
            let stored = StoredMask::pack(&mask);
            assert_eq!(
                matches!(stored, StoredMask::Bits { .. }),
                packed,
                "{mask:?}"
            );
            stored.unpack_into(&mut out);
            assert_eq!(bits(&out), bits(&mask));
        }
    }

    /// What the step holds, by [`step_bytes`]: checkpointing keeps one layer's state and
    /// the layer inputs; the 7B figures for the module notes.
    #[test]
    fn step_bytes_shrinks_with_checkpointing() {
        let llama7b = Dims {
            vocab: 32000,
            hidden: 4096,
            intermediate: 11008,
            layers: 32,
            heads: 32,
            kv_heads: 32,
            head_dim: 128,
            rms_eps: 1e-5,
        };
        let ranks = vec![[8; 7]; 32];
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        for dropout in [false, true] {
            let full = step_bytes(&llama7b, 2048, &ranks, dropout, false);
            let ckpt = step_bytes(&llama7b, 2048, &ranks, dropout, true);
            eprintln!(
                "7B, 2048 tokens, r = 8 on all seven, dropout {dropout}: {:.2} GiB, checkpointed {:.2} GiB",
                gib(full),
                gib(ckpt)
            );
            assert!(ckpt * 4 < full);
        }
        // The layer inputs dominate what a checkpointed step keeps per layer.
        let d = tiny_dims();
        let ranks = vec![ALL.map(|t| 2 * usize::from(t)); d.layers];
        let one = step_bytes(&d, 100, &ranks, true, true);
        let more = step_bytes(&Dims { layers: 3, ..d }, 100, &[ranks[0]; 3], true, true);
        let packed: u64 = (0..7)
            .map(|p| packed_mask_bytes(100 * d.projection_shape(p).0))
            .sum();
        assert_eq!(more - one, 4 * 100 * d.hidden as u64 + packed);
        assert_eq!(step_bytes(&d, 0, &ranks, true, true), 0);
        // No LoRA: no backward, no inputs kept.
        let none = vec![[0; 7]; d.layers];
        assert!(step_bytes(&d, 100, &none, false, true) < step_bytes(&d, 100, &none, false, false));
    }
}
