//! A decoder layer's backward on one group of rows: the residual gradient through
//! attention and the MLP, and the LoRA factors' gradients.

use super::forward::{Saved, attention_shape};
use super::frozen::FrozenWork;
use super::{Batch, DOWN, Dims, GATE, K, Model, O, Projection, Q, UP, V, add, qk_norm};
use crate::attention::attention_backward;
use crate::gemm::{Mat, MatMut, gemm};
use crate::glu::{glu_backward, glu_forward};
use crate::norm::{rms_norm_backward, rms_norm_forward};

/// Scratch of the LoRA backward, sized for the largest rank and projection.
pub(super) struct LoraWork {
    /// `du = scale·dY·B`, N × r.
    pub(super) du: Vec<f32>,
    /// The masked input `x_d`, N × in (with dropout); the forward's, handed on.
    pub(super) xd: Vec<f32>,
    /// `du·A` before the mask, N × in (with dropout).
    pub(super) tmp: Vec<f32>,
    /// One gradient before it is added, `r × in` or `out × r`.
    pub(super) grad: Vec<f32>,
}

/// Backward scratch, reused by every layer.
pub(super) struct BackwardWork {
    /// A normed input, recomputed, N × h.
    pub(super) hn: Vec<f32>,
    /// Its 1/rms, recomputed (equal to the saved one), N.
    pub(super) inv: Vec<f32>,
    /// The gated activation's output, recomputed, N × I.
    pub(super) act: Vec<f32>,
    /// Its gradient, N × I.
    pub(super) d_act: Vec<f32>,
    /// `[dg | du]`, N × 2I.
    pub(super) d_gu: Vec<f32>,
    /// The gradient of a normed input (or, for a Gemma, first of a half's output
    /// before its norm), N × h.
    pub(super) d_hn: Vec<f32>,
    /// The gradient of the attention output, N × heads·head_dim.
    pub(super) d_attn: Vec<f32>,
    /// `[dq | dk | dv]`, N × qkv_width.
    pub(super) d_qkv: Vec<f32>,
    /// The LoRA branches'.
    pub(super) lora: LoraWork,
    /// The forward's frozen-product scratch, handed on.
    pub(super) frozen: FrozenWork,
}

/// `dst += srcᵀ`, for `src` `rows × cols` and `dst` `cols × rows`, both row-major.
fn add_transposed(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    for (i, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (j, &s) in row.iter().enumerate() {
            dst[j * rows + i] += s;
        }
    }
}

/// The backward of [`projection_forward`](super::forward::projection_forward) given
/// `dy` (N × out): adds `dA = duᵀ·x_d` and `dB = scale·dYᵀ·u` into `grads` (A's at
/// `slot`, B's right after) and, with `dx = Some((dx, β))`, writes `dx = β·dx + dY·W + (du·A)∘mask` (N × in), where
/// `du = scale·dY·B` and `x_d = input∘mask`. `dY·W` runs in `frozen`'s compute mode.
#[allow(clippy::too_many_arguments)]
pub(super) fn projection_backward(
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
    frozen: &mut FrozenWork,
) {
    let (i, o) = d.projection_shape(p);
    if let Some((dx, beta)) = dx.as_mut() {
        frozen.product(
            dy,
            proj.weight,
            (o, i),
            false,
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
    // dAᵀ = x_dᵀ·du, whose A operand the GEMM reads in place (a product one panel of B
    // wide): computed as `duᵀ·x_d`, it packed all of x_d (N × in) for an r-row result,
    // most of a tiny step's packing. Each element is the same chain of FMAs over the
    // tokens with its two factors swapped, so the bits are the same.
    let g = &mut grad[..r * i];
    gemm(1.0, x.t(), Mat::new(du, n, r), 0.0, MatMut::new(g, i, r));
    add_transposed(&mut grads[slot][..r * i], g, i, r);
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

/// The gradient of a half's output projection given `dx`, the residual's: `dx` itself,
/// or with a Gemma's `norm` of that output (its weight, the product it normalised, its
/// 1/rms) the norm's backward, written into `scratch`.
fn through_output_norm<'a>(
    norm: Option<(&[f32], &[f32], &[f32])>,
    dx: &'a [f32],
    scratch: &'a mut [f32],
) -> &'a [f32] {
    let Some((weight, x, inv)) = norm else {
        return dx;
    };
    rms_norm_backward(x, weight, inv, dx, scratch, false);
    scratch
}

/// One decoder layer backward: `dx` goes in as the gradient of the layer's output and
/// comes out as that of its input, unless `bottom` (no layer below needs it: q, k and v
/// then skip their input gradient and the input norm its backward). LoRA gradients are
/// added into `grads` at the layer's `slots`.
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_backward(
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
    mlp_backward(model, l, batch, saved, dx, work, grads, slots);
    attention_backward_block(model, l, batch, saved, dx, work, grads, bottom, slots);
}

/// The MLP half of layer `l` backward: a Gemma's norm of its output, down, the gated
/// activation, gate and up, then the post-attention norm's backward into `dx`.
#[inline]
#[allow(clippy::too_many_arguments)]
fn mlp_backward(
    model: &Model<'_>,
    l: usize,
    batch: &Batch<'_>,
    saved: &Saved,
    dx: &mut [f32],
    work: &mut BackwardWork,
    grads: &mut [Vec<f32>],
    slots: &[Option<usize>; 7],
) {
    let layer = &model.layers[l];
    let d = &model.dims;
    let n = batch.rows * batch.len;
    let (h, inter) = (d.hidden, d.intermediate);
    let eps = d.rms_eps;
    // MLP: (a Gemma's output norm,) down, the activation, gate and up, then the
    // post-attention norm into dx.
    glu_forward(&saved.gu, inter, d.gate(), &mut work.act);
    let norm = layer
        .gemma
        .map(|g| (g.after_mlp, &saved.down_out[..], &saved.inv_down[..]));
    let d_down = through_output_norm(norm, dx, &mut work.d_hn);
    projection_backward(
        d,
        DOWN,
        &layer.proj[DOWN],
        n,
        Mat::new(d_down, n, h),
        &work.act,
        saved.masks[DOWN].as_deref(),
        &saved.u[DOWN],
        grads,
        slots[DOWN],
        Some((&mut work.d_act, 0.0)),
        &mut work.lora,
        &mut work.frozen,
    );
    glu_backward(&saved.gu, inter, d.gate(), &work.d_act, &mut work.d_gu);
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
            &mut work.frozen,
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
}

/// The attention half of layer `l` backward: a Gemma's norm of its output, o,
/// attention, inverse RoPE, q/k/v, then the input norm's backward into `dx` (both
/// skipped for the input when `bottom`).
#[inline]
#[allow(clippy::too_many_arguments)]
fn attention_backward_block(
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
    let (h, eps) = (d.hidden, d.rms_eps);
    // Attention: (a Gemma's output norm,) o, attention, inverse RoPE, the q/k norms
    // (Qwen3, Gemma 3), q/k/v, then the input norm into dx.
    let norm = layer
        .gemma
        .map(|g| (g.after_attention, &saved.o_out[..], &saved.inv_o[..]));
    let d_o = through_output_norm(norm, dx, &mut work.d_hn);
    projection_backward(
        d,
        O,
        &layer.proj[O],
        n,
        Mat::new(d_o, n, h),
        &saved.attn,
        saved.masks[O].as_deref(),
        &saved.u[O],
        grads,
        slots[O],
        Some((&mut work.d_attn, 0.0)),
        &mut work.lora,
        &mut work.frozen,
    );
    let shape = attention_shape(d, batch);
    attention_backward(
        &shape,
        &saved.qkv,
        batch.starts_of(layer),
        &saved.lse,
        &work.d_attn,
        &mut work.d_qkv,
    );
    d.rotate_qk(&mut work.d_qkv, batch.positions, model.rope_of(l), true);
    if let Some(norm) = layer.qk_norm {
        qk_norm::backward(d, norm, n, &mut work.d_qkv, &saved.qk_pre, &saved.qk_inv);
    }
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
            &mut work.frozen,
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
