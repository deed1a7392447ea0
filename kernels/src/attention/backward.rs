//! The backward task: one (batch row, kv head) of
//! [`attention_backward`](super::attention_backward).

use crate::gemm::{Mat, MatMut, gemm};

use super::{AttentionShape, QUERY_BLOCK, Scratch, exp, key_range, transposed};
use crate::tanh::soft_cap;

/// `Σ aᵢbᵢ` in 16 interleaved partial sums, so that it vectorises; the order is fixed.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let (a_main, a_rest) = a.split_at(a.len() / LANES * LANES);
    let (b_main, b_rest) = b.split_at(a_main.len());
    for (x, y) in a_main.chunks_exact(LANES).zip(b_main.chunks_exact(LANES)) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// A backward task's pieces of `d_qkv`, one slice per token row of its batch row.
pub(super) struct TaskGrads<'a> {
    /// Its query heads' columns, `group·head_dim` wide.
    pub(super) dq: Vec<&'a mut [f32]>,
    /// Its kv head's key columns.
    pub(super) dk: Vec<&'a mut [f32]>,
    /// Its kv head's value columns.
    pub(super) dv: Vec<&'a mut [f32]>,
}

/// What every backward task reads.
pub(super) struct Inputs<'a> {
    pub(super) shape: &'a AttentionShape,
    pub(super) qkv: &'a [f32],
    pub(super) starts: &'a [u32],
    pub(super) lse: &'a [f32],
    pub(super) d_out: &'a [f32],
}

crate::simd::wide_twin!(
    /// Backward for batch row `b`, kv head `g`: all its query heads, then dk and dv.
    pub(super) fn backward_task(
        inputs: &Inputs<'_>,
        b: usize,
        g: usize,
        grads: &mut TaskGrads<'_>,
        scratch: &mut Scratch,
    ) {
        let shape = inputs.shape;
        let (seq, d, width, ow) = (
            shape.seq,
            shape.head_dim,
            shape.qkv_width(),
            shape.out_width(),
        );
        let (group, scale) = (shape.group(), shape.scale);
        let starts = &inputs.starts[b * seq..(b + 1) * seq];
        let qkv = &inputs.qkv[b * seq * width..(b + 1) * seq * width];
        let d_out = &inputs.d_out[b * seq * ow..(b + 1) * seq * ow];
        let k_col = (shape.heads + g) * d;
        let v_col = (shape.heads + shape.kv_heads + g) * d;
        let Scratch {
            kt,
            vt,
            p,
            ds,
            block: dq,
            dk,
            dv,
            slopes,
        } = scratch;
        // Kᵀ and Vᵀ are the right-hand operands of S and dP for every block: transposed once
        // so the library packs them by runs (see `transposed`).
        transposed(qkv, seq, width, k_col, d, kt);
        transposed(qkv, seq, width, v_col, d, vt);
        dk.fill(0.0);
        dv.fill(0.0);
        for hl in 0..group {
            let h = g * group + hl;
            let q_col = h * d;
            let lse = &inputs.lse[(b * shape.heads + h) * seq..][..seq];
            for first in (0..seq).step_by(QUERY_BLOCK) {
                let end = (first + QUERY_BLOCK).min(seq);
                let m = end - first;
                let lo = key_range(starts, first, end);
                let n = end - lo;
                let q = Mat::strided(&qkv[first * width + q_col..], m, d, width, 1);
                let k = Mat::strided(&qkv[lo * width + k_col..], n, d, width, 1);
                let kt = Mat::strided(&kt[lo..], d, n, seq, 1);
                let vt = Mat::strided(&vt[lo..], d, n, seq, 1);
                let d_o = Mat::strided(&d_out[first * ow + q_col..], m, d, ow, 1);
                let p = &mut p[..m * n];
                let ds = &mut ds[..m * n];

                // P = exp(S − lse) on the visible keys, 0 elsewhere (S soft-capped
                // where the model caps it, keeping the cap's slopes for dS).
                gemm(scale, q, kt, 0.0, MatMut::new(p, m, n));
                let slopes = shape.softcap.map(|cap| {
                    let slopes = &mut slopes[..m * n];
                    soft_cap(p, cap, Some(&mut *slopes));
                    &*slopes
                });
                probabilities(p, n, first, lo, starts, lse);
                // dV += Pᵀ·dO
                gemm(
                    1.0,
                    Mat::new(p, m, n).t(),
                    d_o,
                    1.0,
                    MatMut::new(&mut dv[lo * d..end * d], n, d),
                );
                // dP = dO·Vᵀ, then dS = P∘(dP − rowsum(P∘dP)) in place. Not rowsum(dO∘O),
                // which equals it in exact arithmetic: the recomputed P's rows do not sum to
                // exactly one, and O was rounded; with P's own sum each dS row sums to
                // δ·(1 − ΣP), and dQ, which is small wherever dS's terms cancel, keeps its
                // digits (on the tiny preset a q_proj gradient went from 9.8e-5 to 4.0e-5 of
                // its maximum against float64, PyTorch float32 3.3e-5).
                gemm(1.0, d_o, vt, 0.0, MatMut::new(ds, m, n));
                score_gradients(ds, p, n, slopes);
                // dQ = dS·K/√d, complete for this block: copy it out.
                gemm(
                    scale,
                    Mat::new(ds, m, n),
                    k,
                    0.0,
                    MatMut::new(&mut dq[..m * d], m, d),
                );
                copy_out(&mut grads.dq[first..], hl * d, &dq[..m * d], d);
                // dK += dSᵀ·Q/√d
                gemm(
                    scale,
                    Mat::new(ds, m, n).t(),
                    q,
                    1.0,
                    MatMut::new(&mut dk[lo * d..end * d], n, d),
                );
            }
        }
        copy_out(&mut grads.dk, 0, dk, d);
        copy_out(&mut grads.dv, 0, dv, d);
    }
);

/// `P = exp(S − lse)` in place on a block's `p` (rows of `n` keys from `lo`, queries
/// from `first`): each row's visible keys (from its segment start to itself) take
/// their probability, the others 0.
#[inline(always)]
fn probabilities(p: &mut [f32], n: usize, first: usize, lo: usize, starts: &[u32], lse: &[f32]) {
    for (i, row) in p.chunks_exact_mut(n).enumerate() {
        let t = first + i;
        let (a, z) = (starts[t] as usize - lo, t - lo + 1);
        for x in &mut row[a..z] {
            *x = exp(*x - lse[t]);
        }
        row[..a].fill(0.0);
        row[z..].fill(0.0);
    }
}

/// `dS = P∘(dP − rowsum(P∘dP))` in place on `ds` (holding dP), rows of `n`; times a
/// soft-cap's `slopes` (laid out as `ds`) when the scores were capped.
#[inline(always)]
fn score_gradients(ds: &mut [f32], p: &[f32], n: usize, slopes: Option<&[f32]>) {
    for (ds_row, p_row) in ds.chunks_exact_mut(n).zip(p.chunks_exact(n)) {
        let delta = dot(p_row, ds_row);
        for (x, &pv) in ds_row.iter_mut().zip(p_row) {
            *x = pv * (*x - delta);
        }
    }
    if let Some(slopes) = slopes {
        ds.iter_mut().zip(slopes).for_each(|(x, &s)| *x *= s);
    }
}

/// Copies the rows of `src` (`d` wide) into the token rows of `dst`, at column `col`.
#[inline(always)]
fn copy_out(dst: &mut [&mut [f32]], col: usize, src: &[f32], d: usize) {
    for (row, src) in dst.iter_mut().zip(src.chunks_exact(d)) {
        row[col..col + d].copy_from_slice(src);
    }
}
