//! Qwen3's per-head RMSNorm of the queries and keys, between their projections and RoPE:
//! every head of q is normalised over its `head_dim` values and scaled by the layer's q
//! norm weight, every head of k by its k norm weight (transformers' `q_norm`/`k_norm`).
//!
//! q and k of a row lie side by side at the start of its qkv row (`heads + kv_heads`
//! heads of `head_dim`), so both are normalised in one sweep of each row. The forward
//! keeps each head before the norm and its 1/rms for the backward, which turns the
//! gradient of the normed heads into the gradient of the projections' output in place.

use super::Dims;
use rayon::prelude::*;

/// A layer's q and k norm weights, `head_dim` each.
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    /// The queries' weight.
    pub q: &'a [f32],
    /// The keys'.
    pub k: &'a [f32],
}

impl QkNorm<'_> {
    /// The weight of head `j` of a row's `heads + kv_heads` q and k heads.
    fn weight(&self, d: &Dims, j: usize) -> &[f32] {
        match j < d.heads {
            true => self.q,
            false => self.k,
        }
    }
}

/// Width of a row's q and k together, `(heads + kv_heads)·head_dim`.
pub(super) fn qk_width(d: &Dims) -> usize {
    (d.heads + d.kv_heads) * d.head_dim
}

/// Normalises in place the q and k heads of the first `n` rows of `qkv` (rows
/// `qkv_width` apart), writing each row's heads before the norm to `pre` (n × qk width)
/// and each head's 1/rms to `inv` (n × (heads + kv_heads)).
pub(super) fn forward(
    d: &Dims,
    norm: QkNorm<'_>,
    n: usize,
    qkv: &mut [f32],
    pre: &mut [f32],
    inv: &mut [f32],
) {
    let (width, hd, eps) = (qk_width(d), d.head_dim, d.rms_eps);
    qkv.par_chunks_mut(d.qkv_width())
        .zip(pre.par_chunks_mut(width))
        .zip(inv.par_chunks_mut(d.heads + d.kv_heads))
        .take(n)
        .for_each(|((row, pre), inv)| {
            pre.copy_from_slice(&row[..width]);
            for (j, (head, r)) in row[..width].chunks_exact_mut(hd).zip(inv).enumerate() {
                let w = norm.weight(d, j);
                let mean = head.iter().map(|x| x * x).sum::<f32>() / hd as f32;
                *r = 1.0 / (mean + eps).sqrt();
                for (x, &w) in head.iter_mut().zip(w) {
                    *x = *x * *r * w;
                }
            }
        });
}

/// Turns in place the gradient of the normed q and k heads of the first `n` rows of
/// `d_qkv` (rows `qkv_width` apart) into the gradient of the heads before the norm, from
/// what [`forward`] kept: with x̂ = x·r and g = dy·w, dx = r·(g − x̂·mean(g·x̂)).
pub(super) fn backward(
    d: &Dims,
    norm: QkNorm<'_>,
    n: usize,
    d_qkv: &mut [f32],
    pre: &[f32],
    inv: &[f32],
) {
    let (width, hd) = (qk_width(d), d.head_dim);
    d_qkv
        .par_chunks_mut(d.qkv_width())
        .zip(pre.par_chunks(width))
        .zip(inv.par_chunks(d.heads + d.kv_heads))
        .take(n)
        .for_each(|((row, pre), inv)| {
            let heads = row[..width].chunks_exact_mut(hd).zip(pre.chunks_exact(hd));
            for (j, ((dy, x), &r)) in heads.zip(inv).enumerate() {
                let w = norm.weight(d, j);
                let dot = dy
                    .iter()
                    .zip(x)
                    .zip(w)
                    .map(|((g, x), w)| g * w * x * r)
                    .sum::<f32>()
                    / hd as f32;
                for ((g, &x), &w) in dy.iter_mut().zip(x).zip(w) {
                    *g = r * (*g * w - x * r * dot);
                }
            }
        });
}
