//! A decoder layer's forward on one group of rows, and what it saves for the backward.

use super::frozen::FrozenWork;
use super::{Batch, DOWN, Dims, GATE, K, Model, O, Projection, Q, UP, V, qk_norm};
use crate::attention::{AttentionShape, attention_forward};
use crate::gemm::{Mat, MatMut, gemm};
use crate::glu::glu_forward;
use crate::norm::rms_norm_forward;

/// What a layer's forward keeps for its backward (see the module notes). Without
/// checkpointing there is one per layer; with it, one for the whole step, refilled by
/// recomputing each layer's forward right before its backward.
pub(super) struct Saved {
    /// The layer's input, N × h.
    pub(super) x_in: Vec<f32>,
    /// 1/rms of the input norm, N.
    pub(super) inv1: Vec<f32>,
    /// q, k (after RoPE) and v, N × qkv_width.
    pub(super) qkv: Vec<f32>,
    /// Attention output, N × heads·head_dim.
    pub(super) attn: Vec<f32>,
    /// Attention log-sum-exp.
    pub(super) lse: Vec<f32>,
    /// The residual after attention, N × h.
    pub(super) x_mid: Vec<f32>,
    /// 1/rms of the post-attention norm, N.
    pub(super) inv2: Vec<f32>,
    /// `[gate | up]`, N × 2I.
    pub(super) gu: Vec<f32>,
    /// Per projection, `u = x_d·Aᵀ`: N × r for the layer's rank r in the first N·r
    /// elements (a shared `Saved` is sized for the largest rank; empty without LoRA).
    pub(super) u: [Vec<f32>; 7],
    /// Per projection, the dropout mask (N × in) when one was drawn.
    pub(super) masks: [Option<Vec<f32>>; 7],
    /// q and k before their per-head norm, N × (heads + kv_heads)·head_dim (empty
    /// without [`Dims::qk_norm`]).
    pub(super) qk_pre: Vec<f32>,
    /// Each of those heads' 1/rms, N × (heads + kv_heads) (empty without).
    pub(super) qk_inv: Vec<f32>,
    /// A Gemma's attention output before its norm (the o projection's), N × h (empty
    /// for other families).
    pub(super) o_out: Vec<f32>,
    /// Its 1/rms, N (empty for other families).
    pub(super) inv_o: Vec<f32>,
    /// A Gemma's MLP output before its norm (the down projection's), N × h (empty for
    /// other families).
    pub(super) down_out: Vec<f32>,
    /// Its 1/rms, N (empty for other families).
    pub(super) inv_down: Vec<f32>,
}

/// The lengths of [`Saved`]'s fixed buffers, in field order (`x_in` … `gu`, then
/// `qk_pre`, `qk_inv`, `o_out`, `inv_o`, `down_out` and `inv_down`). Shared by
/// [`Saved::new`] and [`super::step_bytes`], so that the count is the allocation.
pub(super) fn saved_lengths(d: &Dims, n: usize) -> [usize; 14] {
    let h = d.hidden;
    let qk = if d.qk_norm { n } else { 0 };
    let gemma = if d.gemma.is_some() { n } else { 0 };
    [
        n * h,
        n,
        n * d.qkv_width(),
        n * d.heads * d.head_dim,
        n * d.heads,
        n * h,
        n,
        n * 2 * d.intermediate,
        qk * qk_norm::qk_width(d),
        qk * (d.heads + d.kv_heads),
        gemma * h,
        gemma,
        gemma * h,
        gemma,
    ]
}

impl Saved {
    /// Buffers for `n` tokens and, per projection, LoRA rank `ranks[p]` (0: none).
    pub(super) fn new(d: &Dims, n: usize, ranks: &[usize; 7]) -> Self {
        let [
            x_in,
            inv1,
            qkv,
            attn,
            lse,
            x_mid,
            inv2,
            gu,
            qk_pre,
            qk_inv,
            o_out,
            inv_o,
            down_out,
            inv_down,
        ] = saved_lengths(d, n).map(|len| vec![0.0; len]);
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
            qk_pre,
            qk_inv,
            o_out,
            inv_o,
            down_out,
            inv_down,
        }
    }
}

/// Forward scratch, reused by every layer.
pub(super) struct ForwardWork {
    /// A normed input, N × h.
    pub(super) hn: Vec<f32>,
    /// The gated activation's output, N × I.
    pub(super) act: Vec<f32>,
    /// A masked LoRA input, N × max in.
    pub(super) xd: Vec<f32>,
    /// The frozen products' scratch and compute mode.
    pub(super) frozen: FrozenWork,
}

/// The shape of the attention call.
pub(super) fn attention_shape(d: &Dims, batch: &Batch<'_>) -> AttentionShape {
    AttentionShape {
        batch: batch.rows,
        seq: batch.len,
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        scale: d.attention_scale(),
        softcap: d.gemma.and_then(|g| g.attention_softcap),
    }
}

/// `out = β·out + input·Wᵀ (+ bias)`, plus `scale·(input∘mask)·Aᵀ·Bᵀ` with LoRA,
/// saving `u = (input∘mask)·Aᵀ`. `out` starts at the output's first element, rows
/// `stride` apart. The frozen product runs in `frozen`'s compute mode.
#[allow(clippy::too_many_arguments)]
pub(super) fn projection_forward(
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
    frozen: &mut FrozenWork,
) {
    let (i, o) = d.projection_shape(p);
    let stride = d.output_stride(p);
    let x = Mat::new(&input[..n * i], n, i);
    frozen.product(
        x,
        proj.weight,
        (o, i),
        true,
        beta,
        MatMut::strided(out, n, o, stride),
    );
    if let Some(bias) = proj.bias {
        for row in out.chunks_mut(stride).take(n) {
            for (y, b) in row[..o].iter_mut().zip(bias) {
                *y += b;
            }
        }
    }
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

/// A half's output projection `p` (o or down) of `input`, added into `residual`; with a
/// Gemma's `norm` (its weight, where the product is kept, where its 1/rms goes), the
/// product is kept, normalised into the scratch `hn` and then added.
#[allow(clippy::too_many_arguments)]
fn half_output(
    d: &Dims,
    (p, proj): (usize, &Projection<'_>),
    n: usize,
    input: &[f32],
    residual: &mut [f32],
    norm: Option<(&[f32], &mut [f32], &mut [f32])>,
    (mask, u): (Option<&[f32]>, &mut [f32]),
    (hn, xd, frozen): (&mut Vec<f32>, &mut Vec<f32>, &mut FrozenWork),
) {
    let Some((weight, kept, inv)) = norm else {
        projection_forward(d, p, proj, n, input, 1.0, residual, mask, u, xd, frozen);
        return;
    };
    projection_forward(d, p, proj, n, input, 0.0, kept, mask, u, xd, frozen);
    rms_norm_forward(kept, weight, d.rms_eps, hn, inv);
    super::add(residual, hn);
}

/// One decoder layer forward: `x` (N × h) goes in as the layer's input and comes out as
/// its output; `saved` receives what backward needs. The dropout masks are the ones
/// already in `saved.masks` (see [`super::groups`]: drawn for the whole batch, or kept
/// for a checkpointed layer's recomputation).
pub(super) fn layer_forward(
    model: &Model<'_>,
    l: usize,
    batch: &Batch<'_>,
    x: &mut [f32],
    saved: &mut Saved,
    work: &mut ForwardWork,
) {
    attention_block(model, l, batch, x, saved, work);
    mlp_block(model, l, batch, x, saved, work);
}

/// The attention half of layer `l`: the input norm, q/k/v, RoPE, attention and the o
/// projection, whose output is added into a copy of the residual (`saved.x_mid`); a
/// Gemma's is normalised first (the o projection's output kept in `saved.o_out`).
#[inline]
fn attention_block(
    model: &Model<'_>,
    l: usize,
    batch: &Batch<'_>,
    x: &[f32],
    saved: &mut Saved,
    work: &mut ForwardWork,
) {
    let layer = &model.layers[l];
    let d = &model.dims;
    let n = batch.rows * batch.len;
    let eps = d.rms_eps;
    saved.x_in.copy_from_slice(x);
    rms_norm_forward(x, layer.input_norm, eps, &mut work.hn, &mut saved.inv1);
    for p in [Q, K, V] {
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
            &mut work.frozen,
        );
    }
    if let Some(norm) = layer.qk_norm {
        qk_norm::forward(
            d,
            norm,
            n,
            &mut saved.qkv,
            &mut saved.qk_pre,
            &mut saved.qk_inv,
        );
    }
    d.rotate_qk(&mut saved.qkv, batch.positions, model.rope_of(l), false);
    let shape = attention_shape(d, batch);
    attention_forward(
        &shape,
        &saved.qkv,
        batch.starts_of(layer),
        &mut saved.attn,
        &mut saved.lse,
    );
    saved.x_mid.copy_from_slice(x);
    let norm = layer.gemma.map(|g| {
        (
            g.after_attention,
            &mut saved.o_out[..],
            &mut saved.inv_o[..],
        )
    });
    let ForwardWork { hn, xd, frozen, .. } = work;
    half_output(
        d,
        (O, &layer.proj[O]),
        n,
        &saved.attn,
        &mut saved.x_mid,
        norm,
        (saved.masks[O].as_deref(), &mut saved.u[O]),
        (hn, xd, frozen),
    );
}

/// The MLP half of layer `l`: the post-attention norm, gate and up, the gated
/// activation and the down projection, whose output is added into the residual, written
/// to `x`; a Gemma's is normalised first (the down projection's output kept in
/// `saved.down_out`).
#[inline]
fn mlp_block(
    model: &Model<'_>,
    l: usize,
    batch: &Batch<'_>,
    x: &mut [f32],
    saved: &mut Saved,
    work: &mut ForwardWork,
) {
    let layer = &model.layers[l];
    let d = &model.dims;
    let n = batch.rows * batch.len;
    let eps = d.rms_eps;
    rms_norm_forward(
        &saved.x_mid,
        layer.post_norm,
        eps,
        &mut work.hn,
        &mut saved.inv2,
    );
    for p in [GATE, UP] {
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
            &mut work.frozen,
        );
    }
    glu_forward(&saved.gu, d.intermediate, d.gate(), &mut work.act);
    x.copy_from_slice(&saved.x_mid);
    let norm = layer.gemma.map(|g| {
        (
            g.after_mlp,
            &mut saved.down_out[..],
            &mut saved.inv_down[..],
        )
    });
    let ForwardWork {
        hn,
        act,
        xd,
        frozen,
    } = work;
    half_output(
        d,
        (DOWN, &layer.proj[DOWN]),
        n,
        act,
        x,
        norm,
        (saved.masks[DOWN].as_deref(), &mut saved.u[DOWN]),
        (hn, xd, frozen),
    );
}

/// The embedding rows of `ids`, N × h (widened row by row when the embedding is bf16),
/// scaled by a Gemma's `√hidden`.
pub(super) fn embed(model: &Model<'_>, ids: &[u32]) -> Vec<f32> {
    let h = model.dims.hidden;
    let mut x = vec![0f32; ids.len() * h];
    for (row, &id) in x.chunks_mut(h).zip(ids) {
        model.embed.copy_to(id as usize * h, row);
    }
    if let Some(g) = model.dims.gemma {
        x.iter_mut().for_each(|v| *v *= g.embed_scale);
    }
    x
}
