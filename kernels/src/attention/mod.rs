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
//! **Products.** Every block product goes through [`gemm()`](crate::gemm()), whose kernels
//! pick AVX-512 or AVX2 at run time, while loops in this crate are compiled for baseline
//! x86-64; on a 64×256×64 score block plain loops measured 6–9 GFLOP/s against 30–40 for
//! the GEMM on this (shared) machine. The GEMM packs both operands per call, cheaply
//! when the packed direction is contiguous; matrixmultiply (the GEMM when the layouts
//! were chosen, still the one on CPUs without AVX2) gathers element by element
//! otherwise, so the layouts are chosen for it: each task transposes its K (and V, for backward) once;
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

mod backward;
mod cached;
mod forward;
#[cfg(test)]
mod tests;

use rayon::prelude::*;

pub use cached::{CachedQuery, Heads, attention_over_cache};

use backward::{Inputs, TaskGrads, backward_task};
use forward::forward_task;

/// Query rows per block: a `64 × seq` score scratch is 64 KiB at `seq = 256` and 1 MiB at
/// 4096, inside L2 either way.
pub const QUERY_BLOCK: usize = 64;

/// The shape of one attention call, and what shapes its scores besides `q·k`.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// The scores' scale: `1/√head_dim` ([`Self::head_scale`]), or a family's own
    /// (Gemma's `query_pre_attn_scalar^(−1/2)`).
    pub scale: f32,
    /// Gemma 2's soft-cap of the scaled scores, `c·tanh(s/c)`, before the mask and the
    /// softmax; `None` leaves them as they are.
    pub softcap: Option<f32>,
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

    /// The usual scale of the scores for heads of `head_dim`, `1/√head_dim`.
    pub fn head_scale(head_dim: usize) -> f32 {
        1.0 / (head_dim as f32).sqrt()
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
    /// The soft-cap's slopes of one query block (backward, with a soft-cap),
    /// `QUERY_BLOCK × seq`.
    slopes: Vec<f32>,
}

impl Scratch {
    fn new(shape: &AttentionShape, backward: bool) -> Self {
        let (seq, d) = (shape.seq, shape.head_dim);
        let block = QUERY_BLOCK.min(seq);
        let only_backward = |n: usize| vec![0f32; if backward { n } else { 0 }];
        let capped = if shape.softcap.is_some() {
            block * seq
        } else {
            0
        };
        Self {
            kt: vec![0f32; d * seq],
            vt: only_backward(d * seq),
            p: vec![0f32; block * seq],
            ds: only_backward(block * seq),
            block: vec![0f32; block * d],
            dk: only_backward(seq * d),
            dv: only_backward(seq * d),
            slopes: only_backward(capped),
        }
    }
}

/// Backward: the gradients of q, k and v given `d_out`, written over `d_qkv` (same layout
/// as `qkv`). `lse` is what [`attention_forward`] returned for these inputs.
///
/// Per query block, with `P = exp(S − lse)` recomputed (and, with a soft-cap, its slope
/// `1 − tanh²` multiplied into dS): `dV += Pᵀ·dO`, `dP = dO·Vᵀ`,
/// `dS = P∘(dP − rowsum(P∘dP))`, `dQ = dS·K/√d`, `dK += dSᵀ·Q/√d`.
///
/// # Panics
/// As [`attention_forward`], and if `lse`, `d_out` or `d_qkv` has the wrong length.
pub fn attention_backward(
    shape: &AttentionShape,
    qkv: &[f32],
    starts: &[u32],
    lse: &[f32],
    d_out: &[f32],
    d_qkv: &mut [f32],
) {
    shape.check(qkv, starts);
    assert_eq!(
        d_out.len(),
        shape.rows() * shape.out_width(),
        "d_out's length"
    );
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
