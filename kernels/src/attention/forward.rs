//! The forward task: one (batch row, kv head) of [`attention_forward`](super::attention_forward).

use crate::gemm::{Mat, MatMut, gemm};

use super::{AttentionShape, QUERY_BLOCK, Scratch, exp, key_range, transposed};
use crate::tanh::soft_cap;

/// Whether key position `key` may be hidden from some query of the block starting at
/// `first`, whose latest segment start is `last_start`: it lies after the block's first
/// query or before some query's segment.
fn key_partly_hidden(key: usize, first: usize, last_start: usize) -> bool {
    key > first || key < last_start
}

crate::simd::wide_twin!(
    /// Forward for kv head `g` of one batch row (`qkv` and `starts` are that row's): all
    /// its query heads.
    ///
    /// Scores are kept transposed, keys × queries (`Sᵀ = K·Qᵀ`), so that `P·V` reads P
    /// column-major, the layout the library packs by runs; the softmax then runs down the
    /// key rows with one lane per query, which vectorises.
    pub(super) fn forward_task(
        shape: &AttentionShape,
        qkv: &[f32],
        starts: &[u32],
        g: usize,
        out_rows: &mut [&mut [f32]],
        lse: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let (seq, d, width) = (shape.seq, shape.head_dim, shape.qkv_width());
        let group = shape.group();
        let v_col = (shape.heads + shape.kv_heads + g) * d;
        let Scratch {
            kt,
            p: scores,
            block: o,
            ..
        } = scratch;
        transposed(qkv, seq, width, (shape.heads + g) * d, d, kt);
        let mut max = [0f32; QUERY_BLOCK];
        let mut sum = [0f32; QUERY_BLOCK];
        for hl in 0..group {
            let q_col = (g * group + hl) * d;
            let lse = &mut lse[hl * seq..(hl + 1) * seq];
            for first in (0..seq).step_by(QUERY_BLOCK) {
                let end = (first + QUERY_BLOCK).min(seq);
                let m = end - first;
                let lo = key_range(starts, first, end);
                let last_start = starts[first..end]
                    .iter()
                    .map(|&s| s as usize)
                    .max()
                    .unwrap_or(0);
                let n = end - lo;
                let st = &mut scores[..n * m];
                let q = Mat::strided(&qkv[first * width + q_col..], m, d, width, 1);
                let k = Mat::strided(&kt[lo..], n, d, 1, seq);
                gemm(shape.scale, k, q.t(), 0.0, MatMut::new(st, n, m));
                if let Some(cap) = shape.softcap {
                    soft_cap(st, cap, None);
                }
                // Softmax down each query's column over its visible keys, unnormalised;
                // 1/Σ goes on O. Hidden keys become −∞, so exp makes them 0.
                let (max, sum) = (&mut max[..m], &mut sum[..m]);
                let block_starts = &starts[first..end];
                max.fill(f32::NEG_INFINITY);
                for (j, row) in st.chunks_exact_mut(m).enumerate() {
                    let key = lo + j;
                    if key_partly_hidden(key, first, last_start) {
                        for (i, (x, &s)) in row.iter_mut().zip(block_starts).enumerate() {
                            if key > first + i || key < s as usize {
                                *x = f32::NEG_INFINITY;
                            }
                        }
                    }
                    for (mx, &x) in max.iter_mut().zip(row.iter()) {
                        *mx = mx.max(x);
                    }
                }
                sum.fill(0.0);
                for row in st.chunks_exact_mut(m) {
                    for ((x, &mx), s) in row.iter_mut().zip(max.iter()).zip(sum.iter_mut()) {
                        *x = exp(*x - mx);
                        *s += *x;
                    }
                }
                for (i, (&mx, s)) in max.iter().zip(sum.iter_mut()).enumerate() {
                    lse[first + i] = mx + s.ln();
                    *s = 1.0 / *s;
                }
                let v = Mat::strided(&qkv[lo * width + v_col..], n, d, width, 1);
                gemm(
                    1.0,
                    Mat::new(st, n, m).t(),
                    v,
                    0.0,
                    MatMut::new(&mut o[..m * d], m, d),
                );
                for (i, src) in o[..m * d].chunks_exact(d).enumerate() {
                    let dst = &mut out_rows[first + i][hl * d..(hl + 1) * d];
                    for (y, &x) in dst.iter_mut().zip(src) {
                        *y = x * sum[i];
                    }
                }
            }
        }
    }
);
