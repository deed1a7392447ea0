//! Fused causal attention, forward and backward, flash-attention style on the CPU.
//!
//! The input is the qkv projection's output as it comes out of its GEMM: `batch·seq`
//! token rows, each holding the query heads, then the key heads, then the value heads
//! (RoPE already applied to q and k). Query head `h` reads kv head `h / (heads /
//! kv_heads)` by index, so grouped-query attention needs no `repeat_kv` copies.
//!
//! **Blocking.** Queries go in blocks of [`QUERY_BLOCK`] rows. For one block the scores
//! against every key it may see (from the earliest segment start in the block up to its
//! last query) land in a `QUERY_BLOCK × seq` scratch that stays in L2. Keys after the
//! block's last query or before its earliest segment start are never multiplied, so
//! only the diagonal block computes masked entries: the FLOPs tend to half of a full
//! `T × T` product as `T` grows (5/8 at four blocks). Nothing of size
//! `batch × heads × T × T` is ever made: forward saves only the log-sum-exp of each
//! query's scaled scores, and backward recomputes the probabilities from it.
//!
//! **Products.** Every block product goes through [`gemm()`](crate::gemm()): matrixmultiply picks
//! its AVX-512 kernel at run time, while loops in this crate are compiled for baseline
//! x86-64; on a 64×256×64 score block plain loops measured 6–9 GFLOP/s against 30–40 for
//! the GEMM on this (shared) machine. The library packs both operands per call, cheaply
//! when the packed direction is contiguous and element by element otherwise, so the
//! layouts are chosen for it: each task transposes its K (and V, for backward) once;
//! forward keeps the scores as keys × queries (`Sᵀ = K·Qᵀ`) so that `P·V` reads P
//! column-major, and the softmax runs down key rows with one lane per query; backward
//! keeps queries × keys, which suits `dV += Pᵀ·dO`, `dP = dO·Vᵀ` and `dK += dSᵀ·Q`, and
//! lets only `dQ = dS·K` (and the small Q and dO blocks) be gathered.
//!
//! **Parallel split.** One rayon task per (batch row, kv head). The task owns every query
//! head of its kv group, so the key and value gradients of that kv head are summed inside
//! one task in a fixed order (heads, then query blocks): deterministic and independent
//! of the thread count, with no atomics. Inside a task, `gemm` may split a product into
//! its own tile-aligned row or column blocks; each element's arithmetic is the same
//! whichever thread runs it. Scratch buffers are made once per rayon job (see
//! `Scratch`), never per block.
//!
//! **Disjoint writes without `unsafe`.** A task's outputs are strided columns of shared
//! buffers: its query heads' columns of `out`, its dq/dk/dv columns of `d_qkv`. Before
//! the parallel loop each row of those buffers is cut with `chunks_mut`/`split_at_mut`
//! into per-task pieces, and each task receives the list of its pieces (one short slice
//! per token row). The borrow checker then sees disjoint `&mut` slices; a task computes a
//! block into a small contiguous scratch (in L1) and copies it into its pieces. The cost
//! is one `Vec` of slice handles per task and an L1 copy per block, both negligible next
//! to the `T²·d` arithmetic. The log-sum-exp, `(batch, heads, seq)`, is already
//! contiguous per task.

use rayon::prelude::*;

use crate::gemm::{Mat, MatMut, gemm};

/// Query rows per block: a `64 × seq` score scratch is 64 KiB at `seq = 256` and 1 MiB at
/// 4096, inside L2 either way.
pub const QUERY_BLOCK: usize = 64;

/// The shape of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequence rows in the micro-batch.
    pub batch: usize,
    /// Tokens per sequence row (padded or packed).
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; `heads` must be a multiple of it.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Token rows, `batch·seq`.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// Width of one row of the qkv buffer, `(heads + 2·kv_heads)·head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Width of one row of the output, `heads·head_dim`.
    pub fn out_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Length of the log-sum-exp buffer, `batch·heads·seq`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    /// Query heads per kv head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The softmax scale, `1/√head_dim`.
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    fn check(&self, qkv: &[f32], starts: &[u32]) {
        assert!(
            self.head_dim > 0 && self.heads > 0,
            "{self:?} has no query heads or heads of width 0"
        );
        assert!(
            self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads),
            "{} query heads cannot be grouped over {} kv heads",
            self.heads,
            self.kv_heads
        );
        assert_eq!(
            qkv.len(),
            self.rows() * self.qkv_width(),
            "qkv holds {} values, {self:?} needs {}",
            qkv.len(),
            self.rows() * self.qkv_width()
        );
        assert_eq!(starts.len(), self.rows(), "one segment start per token row");
        if self.seq > 0 {
            for (r, &s) in starts.iter().enumerate() {
                assert!(
                    s as usize <= r % self.seq,
                    "row {r} (position {}) starts its segment at {s}, after itself",
                    r % self.seq
                );
            }
        }
    }
}

/// The crate's vectorisable exp (≤ 2 ulp; exactly 0 for −∞, which forward relies on to
/// hide masked keys).
fn exp(x: f32) -> f32 {
    crate::exp::exp(x)
}

/// The first key a query block may see: the earliest segment start among its rows
/// `first..end`.
fn key_range(starts: &[u32], first: usize, end: usize) -> usize {
    starts[first..end]
        .iter()
        .map(|&s| s as usize)
        .min()
        .unwrap_or(first)
}

/// Forward: `out = softmax(q·kᵀ/√d + mask)·v` per query head, and the log-sum-exp of each
/// query's scaled scores (`lse[(b·heads + h)·seq + t]`), which backward needs.
///
/// `starts[r]` (one per token row) is the position within its sequence row of the first
/// token of row `r`'s segment: query `i` sees key `j` iff `starts[i] ≤ j ≤ i`. All zeros
/// is ordinary causal attention; several examples packed end to end in one row each get
/// their own causal block.
///
/// # Panics
/// If a buffer has the wrong length, `heads` is not a multiple of `kv_heads`, or a
/// segment starts after its own row.
pub fn attention_forward(
    shape: &AttentionShape,
    qkv: &[f32],
    starts: &[u32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    shape.check(qkv, starts);
    assert_eq!(out.len(), shape.rows() * shape.out_width(), "out's length");
    assert_eq!(lse.len(), shape.lse_len(), "lse's length");
    if out.is_empty() {
        return;
    }
    let (seq, kv, d) = (shape.seq, shape.kv_heads, shape.head_dim);
    let group = shape.group();

    // Cut every output row into its kv groups' pieces.
    let mut pieces: Vec<Vec<&mut [f32]>> = (0..shape.batch * kv)
        .map(|_| Vec::with_capacity(seq))
        .collect();
    for (r, row) in out.chunks_mut(shape.out_width()).enumerate() {
        let b = r / seq;
        for (g, piece) in row.chunks_mut(group * d).enumerate() {
            pieces[b * kv + g].push(piece);
        }
    }
    pieces
        .into_par_iter()
        .zip(lse.par_chunks_mut(group * seq))
        .enumerate()
        .for_each_init(
            || Scratch::new(shape, false),
            |scratch, (task, (mut out_rows, lse))| {
                let (b, g) = (task / kv, task % kv);
                let (width, row) = (shape.qkv_width(), b * seq..(b + 1) * seq);
                let qkv = &qkv[row.start * width..row.end * width];
                forward_task(shape, qkv, &starts[row], g, &mut out_rows, lse, scratch);
            },
        );
}

/// A kv head's column of one batch row, transposed: `head_dim × seq`, row-major.
///
/// The GEMM library packs each operand into panels; it copies whole runs when the
/// panel's direction is contiguous and gathers one element at a time otherwise. K and V
/// are packed again for every query block of every head, so they are transposed once per
/// task into the layout that packs by runs.
///
/// In tiles of 16 tokens, so that the rows read and the runs written both stay in L1 (a
/// plain scatter with a stride of `seq` floats thrashes a few cache sets).
fn transposed(qkv: &[f32], seq: usize, width: usize, col: usize, d: usize, into: &mut [f32]) {
    const TILE: usize = 16;
    for first in (0..seq).step_by(TILE) {
        let rows = &qkv[first * width..(first + TILE).min(seq) * width];
        for c in 0..d {
            let run = &mut into[c * seq + first..][..rows.len() / width];
            for (y, row) in run.iter_mut().zip(rows.chunks_exact(width)) {
                *y = row[col + c];
            }
        }
    }
}

/// A task's buffers, made once per rayon job rather than per task or block. Every task
/// writes what it reads before reading it, so which tasks share a scratch cannot change
/// a result.
struct Scratch {
    /// Kᵀ, `head_dim × seq`.
    kt: Vec<f32>,
    /// Vᵀ (backward), `head_dim × seq`.
    vt: Vec<f32>,
    /// Scores or probabilities of one query block, `QUERY_BLOCK × seq`.
    p: Vec<f32>,
    /// dP then dS of one query block (backward), `QUERY_BLOCK × seq`.
    ds: Vec<f32>,
    /// O or dQ of one query block, `QUERY_BLOCK × head_dim`.
    block: Vec<f32>,
    /// dK of the kv head (backward), `seq × head_dim`.
    dk: Vec<f32>,
    /// dV of the kv head (backward), `seq × head_dim`.
    dv: Vec<f32>,
}

impl Scratch {
    fn new(shape: &AttentionShape, backward: bool) -> Self {
        let (seq, d) = (shape.seq, shape.head_dim);
        let block = QUERY_BLOCK.min(seq);
        let only_backward = |n: usize| vec![0f32; if backward { n } else { 0 }];
        Self {
            kt: vec![0f32; d * seq],
            vt: only_backward(d * seq),
            p: vec![0f32; block * seq],
            ds: only_backward(block * seq),
            block: vec![0f32; block * d],
            dk: only_backward(seq * d),
            dv: only_backward(seq * d),
        }
    }
}

/// `Σ aᵢbᵢ` in 16 interleaved partial sums, so that it vectorises; the order is fixed.
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

/// Whether key position `key` may be hidden from some query of the block starting at
/// `first`, whose latest segment start is `last_start`: it lies after the block's first
/// query or before some query's segment.
fn key_partly_hidden(key: usize, first: usize, last_start: usize) -> bool {
    key > first || key < last_start
}

/// Forward for kv head `g` of one batch row (`qkv` and `starts` are that row's): all
/// its query heads.
///
/// Scores are kept transposed, keys × queries (`Sᵀ = K·Qᵀ`), so that `P·V` reads P
/// column-major, the layout the library packs by runs; the softmax then runs down the
/// key rows with one lane per query, which vectorises.
fn forward_task(
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
            gemm(shape.scale(), k, q.t(), 0.0, MatMut::new(st, n, m));
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

/// Backward: the gradients of q, k and v given `d_out`, written over `d_qkv` (same layout
/// as `qkv`). `out` and `lse` are what [`attention_forward`] returned for these inputs.
///
/// Per query block, with `P = exp(S − lse)` recomputed: `dV += Pᵀ·dO`, `dP = dO·Vᵀ`,
/// `dS = P∘(dP − rowsum(dO∘O))`, `dQ = dS·K/√d`, `dK += dSᵀ·Q/√d`.
///
/// # Panics
/// As [`attention_forward`], and if `out`, `lse`, `d_out` or `d_qkv` has the wrong length.
pub fn attention_backward(
    shape: &AttentionShape,
    qkv: &[f32],
    starts: &[u32],
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    d_qkv: &mut [f32],
) {
    shape.check(qkv, starts);
    assert_eq!(out.len(), shape.rows() * shape.out_width(), "out's length");
    assert_eq!(d_out.len(), out.len(), "d_out's length");
    assert_eq!(lse.len(), shape.lse_len(), "lse's length");
    assert_eq!(d_qkv.len(), qkv.len(), "d_qkv's length");
    if d_qkv.is_empty() {
        return;
    }
    let (seq, kv, d) = (shape.seq, shape.kv_heads, shape.head_dim);
    let group = shape.group();

    // Cut every gradient row into its kv groups' dq, dk and dv pieces.
    let mut pieces: Vec<TaskGrads<'_>> = (0..shape.batch * kv)
        .map(|_| TaskGrads {
            dq: Vec::with_capacity(seq),
            dk: Vec::with_capacity(seq),
            dv: Vec::with_capacity(seq),
        })
        .collect();
    for (r, row) in d_qkv.chunks_mut(shape.qkv_width()).enumerate() {
        let b = r / seq;
        let (dq, rest) = row.split_at_mut(shape.heads * d);
        let (dk, dv) = rest.split_at_mut(kv * d);
        for (g, ((dq, dk), dv)) in dq
            .chunks_mut(group * d)
            .zip(dk.chunks_mut(d))
            .zip(dv.chunks_mut(d))
            .enumerate()
        {
            let task = &mut pieces[b * kv + g];
            task.dq.push(dq);
            task.dk.push(dk);
            task.dv.push(dv);
        }
    }
    let inputs = Inputs {
        shape,
        qkv,
        starts,
        out,
        lse,
        d_out,
    };
    pieces.into_par_iter().enumerate().for_each_init(
        || Scratch::new(shape, true),
        |scratch, (task, mut grads)| {
            backward_task(&inputs, task / kv, task % kv, &mut grads, scratch);
        },
    );
}

/// A backward task's pieces of `d_qkv`, one slice per token row of its batch row.
struct TaskGrads<'a> {
    /// Its query heads' columns, `group·head_dim` wide.
    dq: Vec<&'a mut [f32]>,
    /// Its kv head's key columns.
    dk: Vec<&'a mut [f32]>,
    /// Its kv head's value columns.
    dv: Vec<&'a mut [f32]>,
}

/// What every backward task reads.
struct Inputs<'a> {
    shape: &'a AttentionShape,
    qkv: &'a [f32],
    starts: &'a [u32],
    out: &'a [f32],
    lse: &'a [f32],
    d_out: &'a [f32],
}

/// Backward for batch row `b`, kv head `g`: all its query heads, then dk and dv.
fn backward_task(
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
    let (group, scale) = (shape.group(), shape.scale());
    let starts = &inputs.starts[b * seq..(b + 1) * seq];
    let qkv = &inputs.qkv[b * seq * width..(b + 1) * seq * width];
    let out = &inputs.out[b * seq * ow..(b + 1) * seq * ow];
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

            // P = exp(S − lse) on the visible keys, 0 elsewhere.
            gemm(scale, q, kt, 0.0, MatMut::new(p, m, n));
            for (i, row) in p.chunks_exact_mut(n).enumerate() {
                let t = first + i;
                let (a, z) = (starts[t] as usize - lo, t - lo + 1);
                for x in &mut row[a..z] {
                    *x = exp(*x - lse[t]);
                }
                row[..a].fill(0.0);
                row[z..].fill(0.0);
            }
            // dV += Pᵀ·dO
            gemm(
                1.0,
                Mat::new(p, m, n).t(),
                d_o,
                1.0,
                MatMut::new(&mut dv[lo * d..end * d], n, d),
            );
            // dP = dO·Vᵀ, then dS = P∘(dP − rowsum(dO∘O)) in place.
            gemm(1.0, d_o, vt, 0.0, MatMut::new(ds, m, n));
            for (i, (ds_row, p_row)) in ds.chunks_exact_mut(n).zip(p.chunks_exact(n)).enumerate() {
                let t = first + i;
                let o_row = &out[t * ow + q_col..][..d];
                let do_row = &d_out[t * ow + q_col..][..d];
                let delta = dot(o_row, do_row);
                for (x, &pv) in ds_row.iter_mut().zip(p_row) {
                    *x = pv * (*x - delta);
                }
            }
            // dQ = dS·K/√d, complete for this block: copy it out.
            gemm(
                scale,
                Mat::new(ds, m, n),
                k,
                0.0,
                MatMut::new(&mut dq[..m * d], m, d),
            );
            for (i, src) in dq[..m * d].chunks_exact(d).enumerate() {
                grads.dq[first + i][hl * d..(hl + 1) * d].copy_from_slice(src);
            }
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
    for (t, (dk_row, dv_row)) in grads.dk.iter_mut().zip(grads.dv.iter_mut()).enumerate() {
        dk_row.copy_from_slice(&dk[t * d..(t + 1) * d]);
        dv_row.copy_from_slice(&dv[t * d..(t + 1) * d]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64, range: f32) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-range..range)).collect()
    }

    fn shape(batch: usize, seq: usize, heads: usize, kv_heads: usize, d: usize) -> AttentionShape {
        AttentionShape {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim: d,
        }
    }

    /// Segment starts for rows packed with segments of these lengths, one list per batch
    /// row (each list sums to `seq`).
    fn packed_starts(rows: &[&[usize]]) -> Vec<u32> {
        let mut starts = Vec::new();
        for segments in rows {
            let mut first = 0;
            for &len in *segments {
                starts.extend(std::iter::repeat_n(first as u32, len));
                first += len;
            }
        }
        starts
    }

    struct Reference {
        out: Vec<f64>,
        lse: Vec<f64>,
        d_qkv: Vec<f64>,
    }

    /// Attention in f64 with explicit loops, and its gradients given `d_out`, derived by
    /// hand: with `s_j = q·k_j/√d`, `p = softmax(s)` over the visible keys and
    /// `o = Σ_j p_j v_j`,
    /// - `dv_j += p_j dO`, `dp_j = dO·v_j`;
    /// - `ds_j = p_j (dp_j − Σ_l p_l dp_l)` (the softmax Jacobian);
    /// - `dq = Σ_j ds_j k_j/√d`, `dk_j += ds_j q/√d`.
    fn reference(shape: &AttentionShape, qkv: &[f64], starts: &[u32], d_out: &[f64]) -> Reference {
        let (seq, nh, kv, d) = (shape.seq, shape.heads, shape.kv_heads, shape.head_dim);
        let (w, ow) = (shape.qkv_width(), shape.out_width());
        let scale = 1.0 / (d as f64).sqrt();
        let q = |t: usize, h: usize, c: usize| qkv[t * w + h * d + c];
        let k = |t: usize, g: usize, c: usize| qkv[t * w + (nh + g) * d + c];
        let v = |t: usize, g: usize, c: usize| qkv[t * w + (nh + kv + g) * d + c];
        let mut out = vec![0f64; shape.rows() * ow];
        let mut lse = vec![0f64; shape.lse_len()];
        let mut d_qkv = vec![0f64; qkv.len()];
        for b in 0..shape.batch {
            for h in 0..nh {
                let g = h / (nh / kv);
                for i in 0..seq {
                    let t = b * seq + i;
                    let keys: Vec<usize> = (starts[t] as usize..=i).map(|j| b * seq + j).collect();
                    let s: Vec<f64> = keys
                        .iter()
                        .map(|&u| (0..d).map(|c| q(t, h, c) * k(u, g, c)).sum::<f64>() * scale)
                        .collect();
                    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
                    let p: Vec<f64> = s.iter().map(|x| (x - max).exp() / sum).collect();
                    lse[(b * nh + h) * seq + i] = max + sum.ln();
                    for c in 0..d {
                        out[t * ow + h * d + c] =
                            keys.iter().zip(&p).map(|(&u, pj)| pj * v(u, g, c)).sum();
                    }
                    let d_o = &d_out[t * ow + h * d..][..d];
                    let dp: Vec<f64> = keys
                        .iter()
                        .map(|&u| (0..d).map(|c| d_o[c] * v(u, g, c)).sum())
                        .collect();
                    let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for (j, &u) in keys.iter().enumerate() {
                        let ds = p[j] * (dp[j] - delta);
                        for c in 0..d {
                            d_qkv[t * w + h * d + c] += ds * k(u, g, c) * scale;
                            d_qkv[u * w + (nh + g) * d + c] += ds * q(t, h, c) * scale;
                            d_qkv[u * w + (nh + kv + g) * d + c] += p[j] * d_o[c];
                        }
                    }
                }
            }
        }
        Reference { out, lse, d_qkv }
    }

    fn widen(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    fn largest(x: &[f64]) -> f64 {
        x.iter().fold(0f64, |m, v| m.max(v.abs()))
    }

    /// The largest difference, relative to the largest magnitude of `want` (or to
    /// `floor`, if larger: a part whose exact value is 0 is judged against its whole).
    fn relative_error_above(got: &[f32], want: &[f64], floor: f64) -> f64 {
        assert_eq!(got.len(), want.len());
        let scale = largest(want).max(floor).max(f64::MIN_POSITIVE);
        got.iter()
            .zip(want)
            .map(|(&g, w)| (g as f64 - w).abs())
            .fold(0f64, |m, e| {
                if e.is_nan() || m.is_nan() {
                    f64::NAN
                } else {
                    m.max(e)
                }
            })
            / scale
    }

    /// The largest difference, relative to the largest magnitude of `want`.
    fn relative_error(got: &[f32], want: &[f64]) -> f64 {
        relative_error_above(got, want, 0.0)
    }

    /// Forward and backward of the kernel, with `out`, `lse` and `d_qkv` starting as NaN
    /// so that anything left unwritten shows.
    fn run(
        shape: &AttentionShape,
        qkv: &[f32],
        starts: &[u32],
        d_out: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; shape.rows() * shape.out_width()];
        let mut lse = vec![f32::NAN; shape.lse_len()];
        attention_forward(shape, qkv, starts, &mut out, &mut lse);
        let mut d_qkv = vec![f32::NAN; qkv.len()];
        attention_backward(shape, qkv, starts, &out, &lse, d_out, &mut d_qkv);
        (out, lse, d_qkv)
    }

    fn inputs(shape: &AttentionShape, seed: u64) -> (Vec<f32>, Vec<f32>) {
        // Wide enough for peaked softmax rows, not only near-uniform ones.
        let qkv = random(shape.rows() * shape.qkv_width(), seed, 2.0);
        let d_out = random(shape.rows() * shape.out_width(), seed + 1, 1.0);
        (qkv, d_out)
    }

    /// Tolerance for forward and backward against f64, relative to the largest value.
    const TOLERANCE: f64 = 1e-5;

    /// Checks the kernel against [`reference`], in the default pool and on one thread (where
    /// one scratch serves every task in turn).
    fn check_against_reference(shape: AttentionShape, starts: &[u32], seed: u64) {
        let (qkv, d_out) = inputs(&shape, seed);
        let want = reference(&shape, &widen(&qkv), starts, &widen(&d_out));
        let one_thread = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a pool");
        check_run(&shape, &want, run(&shape, &qkv, starts, &d_out));
        check_run(
            &shape,
            &want,
            one_thread.install(|| run(&shape, &qkv, starts, &d_out)),
        );
    }

    fn check_run(shape: &AttentionShape, want: &Reference, got: (Vec<f32>, Vec<f32>, Vec<f32>)) {
        let (out, lse, d_qkv) = got;
        for (what, got, want) in [
            ("out", &out, &want.out),
            ("lse", &lse, &want.lse),
            ("d_qkv", &d_qkv, &want.d_qkv),
        ] {
            let err = relative_error(got, want);
            assert!(err <= TOLERANCE, "{shape:?}: {what} off by {err:e}");
        }
        // Each part of d_qkv on its own, so a small part cannot hide under a large one
        // (a part that is exactly 0, as dq is with one visible key, against the whole).
        let whole = largest(&want.d_qkv);
        let (nh, kv, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        for (what, cols) in [
            ("dq", 0..nh * d),
            ("dk", nh * d..(nh + kv) * d),
            ("dv", (nh + kv) * d..(nh + 2 * kv) * d),
        ] {
            let pick = |x: &[f32]| -> Vec<f32> {
                x.chunks(shape.qkv_width())
                    .flat_map(|row| row[cols.clone()].to_vec())
                    .collect()
            };
            let want: Vec<f64> = want
                .d_qkv
                .chunks(shape.qkv_width())
                .flat_map(|row| row[cols.clone()].to_vec())
                .collect();
            let floor = if largest(&want) == 0.0 { whole } else { 0.0 };
            let err = relative_error_above(&pick(&d_qkv), &want, floor);
            assert!(err <= TOLERANCE, "{shape:?}: {what} off by {err:e}");
        }
    }

    #[test]
    fn forward_and_backward_match_the_naive_reference() {
        for (n, s) in [
            shape(2, 100, 4, 4, 16), // MHA
            shape(1, 130, 8, 4, 64), // GQA 8/4
            shape(2, 100, 4, 1, 64), // GQA 4/1
            shape(1, 130, 2, 2, 16),
            shape(1, 64, 2, 1, 16), // exactly one block
            shape(3, 1, 2, 1, 8),   // one token
        ]
        .into_iter()
        .enumerate()
        {
            check_against_reference(s, &vec![0; s.rows()], n as u64 * 10);
        }
    }

    #[test]
    fn packed_rows_match_the_naive_reference() {
        let s = shape(2, 130, 4, 2, 32);
        let starts = packed_starts(&[&[50, 30, 50], &[1, 128, 1]]);
        check_against_reference(s, &starts, 7);
    }

    /// The mask is defined per query: any `starts[i] ≤ i` works, not only the
    /// non-decreasing starts that packing gives.
    #[test]
    fn arbitrary_starts_match_the_naive_reference() {
        let s = shape(2, 150, 4, 2, 16);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let starts: Vec<u32> = (0..s.rows())
            .map(|r| rng.random_range(0..=(r % s.seq) as u32))
            .collect();
        check_against_reference(s, &starts, 13);
    }

    /// The hand-derived gradients of the reference against central differences of its own
    /// f64 forward, and the kernel's against central differences of the kernel.
    #[test]
    fn gradients_match_finite_differences() {
        let s = shape(1, 7, 2, 1, 3);
        let starts = packed_starts(&[&[4, 3]]);
        let (qkv, d_out) = inputs(&s, 3);
        let (qkv64, d_out64) = (widen(&qkv), widen(&d_out));
        let loss64 = |x: &[f64]| -> f64 {
            let r = reference(&s, x, &starts, &d_out64);
            r.out.iter().zip(&d_out64).map(|(a, b)| a * b).sum()
        };
        let loss32 = |x: &[f32]| -> f64 {
            let mut out = vec![0f32; s.rows() * s.out_width()];
            let mut lse = vec![0f32; s.lse_len()];
            attention_forward(&s, x, &starts, &mut out, &mut lse);
            out.iter().zip(&d_out64).map(|(&a, b)| a as f64 * b).sum()
        };
        let want = reference(&s, &qkv64, &starts, &d_out64).d_qkv;
        let (_, _, got) = run(&s, &qkv, &starts, &d_out);
        let largest = largest(&want);
        for e in 0..qkv.len() {
            let h = 1e-6;
            let (mut up, mut down) = (qkv64.clone(), qkv64.clone());
            up[e] += h;
            down[e] -= h;
            let fd = (loss64(&up) - loss64(&down)) / (2.0 * h);
            assert!(
                (fd - want[e]).abs() <= 1e-7 * largest,
                "reference d_qkv[{e}] = {} but finite differences give {fd}",
                want[e]
            );
            // In f32 the step has to be large enough to beat rounding.
            let h = 1e-2f32;
            let (mut up, mut down) = (qkv.clone(), qkv.clone());
            up[e] += h;
            down[e] -= h;
            let fd = (loss32(&up) - loss32(&down)) / (2.0 * h as f64);
            assert!(
                (fd - got[e] as f64).abs() <= 1e-3 * largest,
                "kernel d_qkv[{e}] = {} but finite differences give {fd}",
                got[e]
            );
        }
    }

    /// Copies token rows `first..first + len` of batch row `b` of a per-row buffer.
    fn rows_of(
        x: &[f32],
        width: usize,
        seq: usize,
        b: usize,
        first: usize,
        len: usize,
    ) -> Vec<f32> {
        x[(b * seq + first) * width..(b * seq + first + len) * width].to_vec()
    }

    #[test]
    fn a_packed_row_equals_its_sequences_run_alone() {
        let (nh, kv, d, seq) = (4, 2, 16, 130);
        let layout: [&[usize]; 2] = [&[37, 93], &[50, 30, 50]];
        let s = shape(2, seq, nh, kv, d);
        let starts = packed_starts(&layout);
        let (qkv, d_out) = inputs(&s, 11);
        let (out, lse, d_qkv) = run(&s, &qkv, &starts, &d_out);
        for (b, segments) in layout.iter().enumerate() {
            let mut first = 0;
            for &len in *segments {
                let alone = shape(1, len, nh, kv, d);
                let w = s.qkv_width();
                let ow = s.out_width();
                let (a_out, a_lse, a_dqkv) = run(
                    &alone,
                    &rows_of(&qkv, w, seq, b, first, len),
                    &vec![0; len],
                    &rows_of(&d_out, ow, seq, b, first, len),
                );
                let packed_lse: Vec<f32> = (0..nh)
                    .flat_map(|h| lse[(b * nh + h) * seq + first..][..len].to_vec())
                    .collect();
                for (what, packed, alone) in [
                    ("out", rows_of(&out, ow, seq, b, first, len), a_out),
                    ("lse", packed_lse, a_lse),
                    ("d_qkv", rows_of(&d_qkv, w, seq, b, first, len), a_dqkv),
                ] {
                    let err = relative_error(&packed, &widen(&alone));
                    assert!(
                        err <= 1e-6,
                        "row {b}, segment at {first} (+{len}): {what} differs by {err:e}"
                    );
                }
                first += len;
            }
        }
    }

    #[test]
    fn the_result_does_not_depend_on_the_thread_count() {
        let s = shape(2, 200, 8, 4, 32);
        let starts = packed_starts(&[&[200], &[70, 100, 30]]);
        let (qkv, d_out) = inputs(&s, 5);
        let in_pool = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool")
                .install(|| run(&s, &qkv, &starts, &d_out))
        };
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (out, lse, d_qkv) = in_pool(1);
        for threads in [2, 3] {
            let (o, l, g) = in_pool(threads);
            assert!(bits(&o) == bits(&out), "out with {threads} threads");
            assert!(bits(&l) == bits(&lse), "lse with {threads} threads");
            assert!(bits(&g) == bits(&d_qkv), "d_qkv with {threads} threads");
        }
    }

    #[test]
    fn empty_batches_and_rows_do_nothing() {
        for s in [shape(0, 5, 4, 2, 8), shape(3, 0, 4, 2, 8)] {
            let (out, lse, d_qkv) = run(&s, &[], &[], &[]);
            assert!(out.is_empty() && lse.is_empty() && d_qkv.is_empty());
        }
    }

    #[test]
    #[should_panic(expected = "after itself")]
    fn a_segment_starting_after_its_row_is_refused() {
        let s = shape(1, 4, 1, 1, 2);
        let qkv = vec![0f32; s.rows() * s.qkv_width()];
        let mut out = vec![0f32; s.rows() * s.out_width()];
        let mut lse = vec![0f32; s.lse_len()];
        attention_forward(&s, &qkv, &[0, 0, 3, 2], &mut out, &mut lse);
    }

    #[test]
    #[should_panic(expected = "cannot be grouped")]
    fn heads_not_a_multiple_of_kv_heads_are_refused() {
        let s = shape(1, 2, 3, 2, 2);
        let qkv = vec![0f32; s.rows() * s.qkv_width()];
        let mut out = vec![0f32; s.rows() * s.out_width()];
        let mut lse = vec![0f32; s.lse_len()];
        attention_forward(&s, &qkv, &[0, 0], &mut out, &mut lse);
    }
}
