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
//! embeddings are frozen, so layer 0 skips q/k/v's input gradient and its input norm's
//! backward (its LoRA factors still get theirs).
//!
//! **Gradients accumulate** across calls (micro-batches): each LoRA gradient is computed
//! into a scratch and then added elementwise, so after two calls a gradient is exactly
//! the sum of what each call would give alone.
//!
//! **Determinism:** every product goes through [`gemm`] and every row kernel splits in
//! fixed blocks; the rest is sequential. Results do not depend on the thread count.

use crate::attention::{AttentionShape, attention_forward};
use crate::gemm::{Mat, MatMut, gemm};
use crate::loss::{LossError, linear_cross_entropy};
use crate::norm::rms_norm_forward;
use crate::rope::rope_in_place;
use crate::swiglu::swiglu_forward;

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

/// What a layer's forward keeps for its backward (see the module notes).
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
    /// Per projection, `u = x_d·Aᵀ` (N × r; empty without LoRA).
    u: [Vec<f32>; 7],
    /// Per projection, the dropout mask (N × in) when one was drawn.
    masks: [Option<Vec<f32>>; 7],
}

impl Saved {
    fn new(d: &Dims, n: usize, layer: &Layer<'_>) -> Self {
        let h = d.hidden;
        Self {
            x_in: vec![0.0; n * h],
            inv1: vec![0.0; n],
            qkv: vec![0.0; n * d.qkv_width()],
            attn: vec![0.0; n * d.heads * d.head_dim],
            lse: vec![0.0; n * d.heads],
            x_mid: vec![0.0; n * h],
            inv2: vec![0.0; n],
            gu: vec![0.0; n * 2 * d.intermediate],
            u: std::array::from_fn(|p| vec![0.0; layer.proj[p].lora.map_or(0, |l| n * l.r)]),
            masks: Default::default(),
        }
    }

    /// Makes `u` fit `layer`'s ranks (for a `Saved` reused across layers).
    fn fit(&mut self, n: usize, layer: &Layer<'_>) {
        for (u, p) in self.u.iter_mut().zip(&layer.proj) {
            u.resize(p.lora.map_or(0, |l| n * l.r), 0.0);
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

/// One decoder layer forward: `x` (N × h) goes in as the layer's input and comes out as
/// its output; `saved` receives what backward needs.
fn layer_forward(
    model: &Model<'_>,
    l: usize,
    batch: &Batch<'_>,
    x: &mut [f32],
    saved: &mut Saved,
    work: &mut ForwardWork,
    mut dropout: Option<&mut dyn FnMut(usize, usize) -> Vec<f32>>,
) -> Result<(), StepError> {
    let layer = &model.layers[l];
    let d = &model.dims;
    let n = batch.rows * batch.len;
    let eps = d.rms_eps;
    // Masks are drawn in forward order, before the projection that uses them.
    let mut draw = |p: usize, saved: &mut Saved| -> Result<(), StepError> {
        saved.masks[p] = None;
        if let (Some(source), true) = (dropout.as_deref_mut(), layer.proj[p].lora.is_some()) {
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
    let mut work = ForwardWork {
        hn: vec![0.0; n * d.hidden],
        act: vec![0.0; n * d.intermediate],
        xd: Vec::new(),
    };
    if let Some(first) = model.layers.first() {
        let mut saved = Saved::new(d, n, first);
        for (l, layer) in model.layers.iter().enumerate() {
            saved.fit(n, layer);
            layer_forward(model, l, batch, &mut x, &mut saved, &mut work, None)?;
        }
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
        /// Which projections carry LoRA.
        targets: [bool; 7],
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
        fn random(dims: Dims, targets: [bool; 7], r: usize, seed: u64) -> Self {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let (v, h) = (dims.vocab, dims.hidden);
            let embed = random(v * h, &mut rng, -1.0, 1.0);
            let mut norms = vec![];
            let mut weights = vec![];
            let mut lora = vec![];
            for _ in 0..dims.layers {
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
            let (cos, sin) = rope_tables(64, dims.head_dim);
            Self {
                dims,
                embed,
                norms,
                weights,
                lora,
                targets,
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
                        lora: self.targets[p].then(|| {
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
            if m.targets[p] {
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

    #[test]
    fn the_loss_matches_the_f64_reference() {
        for (targets, seed) in [
            (ALL, 1),
            ([true, false, true, false, false, false, false], 2),
        ] {
            let m = Owned::random(tiny_dims(), targets, 2, seed);
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
        let m = Owned::random(tiny_dims(), ALL, 2, 3);
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
        check(&|b| b.positions[2] = 64, "a position past the tables");
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
}
