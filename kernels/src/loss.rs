//! The language-model head fused with masked cross-entropy, its gradient computed in the
//! forward pass (as in Liger-Kernel and Apple's "Cut Your Losses").
//!
//! candle's path materialises the N × V logits (125 MiB on small), composes log-softmax
//! from 6 ops, and recomputes softmax in backward: ~26 passes over N × V and two scalar
//! exps per logit. Here only rows with a target are computed, [`chunk_rows`] at a time:
//! their hidden states are gathered into a small buffer, `L = H_c·Wᵀ` (about 16 MiB of
//! logits, 128 × V at V = 32000, so it stays in L3) comes from [`gemm`], and each row
//! is turned in place into `exp(l − max)` (one vectorised exp per logit), its sum, its
//! loss, and then the gradient of the logits `G = (softmax − onehot)·scale`. `dH_c = G·W` goes straight back
//! to the rows of `d_hidden`. Nothing of size N × V ever exists, and the loss op's
//! backward only has to scale `d_hidden` by the upstream gradient.
//!
//! Determinism: the GEMM splits in fixed blocks, the per-row work is independent (rayon
//! over rows), and row losses are added in row order in `f64`.

use crate::exp::exp;
use crate::gemm::{Mat, MatMut, gemm};
use crate::reduce::{max, sum};
use rayon::prelude::*;

/// The logits a chunk holds, at most (unless that is fewer than [`MIN_CHUNK_ROWS`] rows):
/// 16 MiB, which stays in L3.
const CHUNK_LOGITS: usize = 1 << 22;

/// The fewest labelled rows per chunk: 128 rows make a GEMM tall enough to run near
/// full speed.
pub const MIN_CHUNK_ROWS: usize = 128;

/// The most labelled rows per chunk: a taller GEMM is no faster.
const MAX_CHUNK_ROWS: usize = 1024;

/// Labelled rows per chunk for a head of `vocab` rows: as many as keep the chunk's
/// logits within 4 Mi floats (16 MiB), in multiples of 64, from [`MIN_CHUNK_ROWS`] to
/// 1024. A small vocabulary takes many rows at once: each chunk packs the
/// whole head for both of its products, so on the tiny preset (V = 4096) chunks of 1024
/// rows instead of 128 cut a step's packing from 11 % to 8.5 % of its time.
pub fn chunk_rows(vocab: usize) -> usize {
    (CHUNK_LOGITS / vocab.max(1) / 64 * 64).clamp(MIN_CHUNK_ROWS, MAX_CHUNK_ROWS)
}

/// Rows per chunk and the lengths of the chunk buffers [`linear_cross_entropy`] allocates
/// for `labelled` labelled rows: the hidden rows, the logits, and (with `grad`) the
/// hidden-state gradient rows.
fn chunk_lengths(
    hidden_dim: usize,
    vocab: usize,
    labelled: usize,
    grad: bool,
) -> (usize, [usize; 3]) {
    let rows = chunk_rows(vocab).min(labelled);
    let dh = if grad { rows * hidden_dim } else { 0 };
    (rows, [rows * hidden_dim, rows * vocab, dh])
}

/// The bytes [`linear_cross_entropy`] allocates for a call with `labelled` labelled rows
/// (`grad`: with `d_hidden`): the index of labelled rows, the chunk buffers and the
/// per-row losses. For sizing a step (`llama::step_bytes`).
pub fn scratch_bytes(hidden_dim: usize, vocab: usize, labelled: usize, grad: bool) -> u64 {
    let (rows, lengths) = chunk_lengths(hidden_dim, vocab, labelled, grad);
    let floats: usize = lengths.iter().sum();
    (4 * floats + 8 * rows + std::mem::size_of::<usize>() * labelled) as u64
}

/// Why [`linear_cross_entropy`] refused its inputs; nothing was written when it did.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LossError {
    /// A target id is not a row of the head.
    #[error("target {target} of row {row} is outside the vocabulary of {vocab}")]
    TargetOutOfVocabulary {
        /// The row (position) whose target it is.
        row: usize,
        /// The target id.
        target: i64,
        /// The head's number of rows.
        vocab: usize,
    },
    /// A buffer's length does not match the others.
    #[error("{buffer} holds {len} elements where {expected} were expected")]
    Length {
        /// Which argument.
        buffer: &'static str,
        /// Its length.
        len: usize,
        /// The length the other arguments imply.
        expected: usize,
    },
}

/// `scale · Σ (logsumexp(hᵣ·Wᵀ) − hᵣ·W[tᵣ])` over the rows `r` of `hidden` whose target
/// `tᵣ ≥ 0`, where `hidden` is N × `hidden_dim` (N = `targets.len()`), `lm_head` is
/// `vocab` × `hidden_dim`, both row-major, and `scale` is 1/denominator. Accumulated in
/// `f64`. This is `trainer::ops::masked_cross_entropy` applied to `hidden · lm_headᵀ`.
///
/// With `d_hidden`, also writes the loss's gradient with respect to `hidden` there
/// (N × `hidden_dim`): `(softmax(hᵣ·Wᵀ) − onehot(tᵣ))·scale·W` for labelled rows and
/// zeros for the others. With `None` (evaluation) no gradient work is done. The head is
/// frozen, so it gets no gradient.
///
/// Memory: one block of [`chunk_rows`] × `vocab` logits and two of [`chunk_rows`] ×
/// `hidden_dim`, allocated per call.
///
/// # Errors
/// [`LossError::Length`] if `hidden`, `lm_head` or `d_hidden` do not have the lengths
/// above; [`LossError::TargetOutOfVocabulary`] for a target ≥ `vocab`. Both are checked
/// before anything is computed or written.
pub fn linear_cross_entropy(
    hidden: &[f32],
    hidden_dim: usize,
    lm_head: &[f32],
    vocab: usize,
    targets: &[i64],
    scale: f32,
    d_hidden: Option<&mut [f32]>,
) -> Result<f64, LossError> {
    let head = Head::F32(lm_head);
    let outputs = LossOutputs {
        d_hidden,
        row_losses: None,
        correct: None,
    };
    let weights = RowWeights::Uniform(scale);
    let logits = Logits {
        head,
        vocab,
        softcap: None,
    };
    linear_cross_entropy_with(hidden, hidden_dim, logits, targets, weights, outputs)
}

/// The logits a loss reads: `H·Wᵀ` through `head` (`vocab` rows), soft-capped to
/// `c·tanh(l/c)` where the model caps them (Gemma 2's `final_logit_softcapping`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Logits<'a> {
    /// The head and how its products take their operands.
    pub head: Head<'a>,
    /// Its rows.
    pub vocab: usize,
    /// The soft-cap `c`, if any.
    pub softcap: Option<f32>,
}

/// How [`linear_cross_entropy_with`] weighs each labelled row's loss and its gradient.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowWeights<'a> {
    /// Every row by the same factor (1/the labelled-token count of a step: the mean).
    Uniform(f32),
    /// Row `r` by `w[r]`, one factor per row of `hidden`: a sequence-level loss's
    /// gradient with respect to each token's log-probability (a preference loss).
    PerRow(&'a [f32]),
}

impl RowWeights<'_> {
    #[inline]
    fn of(&self, row: usize) -> f32 {
        match *self {
            Self::Uniform(scale) => scale,
            Self::PerRow(w) => w[row],
        }
    }

    /// How many weights there are, when one per row.
    fn len(&self) -> Option<usize> {
        match self {
            Self::Uniform(_) => None,
            Self::PerRow(w) => Some(w.len()),
        }
    }

    /// The losses of the rows `rows` (`losses[i]` is row `rows[i]`'s), summed as the
    /// result adds them: plain for a uniform weight (applied to the whole sum at the
    /// end), weighted row by row otherwise.
    fn sum(&self, rows: &[usize], losses: &[f64]) -> f64 {
        match self {
            Self::Uniform(_) => losses.iter().sum(),
            Self::PerRow(w) => rows
                .iter()
                .zip(losses)
                .map(|(&r, &loss)| w[r] as f64 * loss)
                .sum(),
        }
    }
}

/// What [`linear_cross_entropy_with`] writes besides its sum: the hidden state's
/// gradient, each row's unweighted loss (`−log p(target)`, 0 for unlabelled rows), and
/// how many labelled rows rank their target first (token accuracy's numerator: the
/// target's logit is the row's largest).
#[derive(Debug, Default)]
pub(crate) struct LossOutputs<'a> {
    /// N × hidden; see [`linear_cross_entropy`].
    pub d_hidden: Option<&'a mut [f32]>,
    /// N: each row's loss before weighting.
    pub row_losses: Option<&'a mut [f64]>,
    /// The labelled rows whose target has the largest logit.
    pub correct: Option<&'a mut u64>,
}

/// The head, and how its two products (`H·Wᵀ` for the logits, `G·W` for the hidden
/// state's gradient) take their operands.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Head<'a> {
    /// f32 operands.
    F32(&'a [f32]),
    /// bf16 operands and f32 sums, as bf16 compute (and PyTorch's bf16 autocast) takes
    /// a linear layer's: each hidden row and each row of logit gradients is rounded to
    /// bf16 before its product; the head holds bf16 values (widened, or rounded, to f32).
    /// The softmax and the loss stay f32.
    Bf16Values(&'a [f32]),
    /// The same products on the own bf16 kernels, which read the head as stored and the
    /// rows as bf16 pairs, paired where they lie (only where
    /// [`own_bf16_kernels`](crate::gemm::own_bf16_kernels)).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Bf16(&'a [half::bf16]),
}

impl Head<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(w) | Self::Bf16Values(w) => w.len(),
            Self::Bf16(w) => w.len(),
        }
    }

    /// Writes `src` (a hidden row) into `dst` (as long) as this head's products take
    /// it: as is, rounded, or rounded and paired into its first half.
    fn gather(&self, src: &[f32], dst: &mut [f32]) {
        match self {
            Self::F32(_) => dst.copy_from_slice(src),
            Self::Bf16Values(_) => {
                dst.copy_from_slice(src);
                crate::bf16::round_in_place(dst);
            }
            Self::Bf16(_) => crate::bf16::pair_row(src, &mut dst[..src.len().div_ceil(2)]),
        }
    }

    /// Turns a row of logit gradients into the operand of `G·W`, in place: unchanged,
    /// rounded, or paired into its first half.
    fn prepare_gradient(&self, row: &mut [f32]) {
        match self {
            Self::F32(_) => {}
            Self::Bf16Values(_) => crate::bf16::round_in_place(row),
            Self::Bf16(_) => crate::bf16::pair_in_place(row),
        }
    }

    /// `C = A·op(W)` (`op(W) = Wᵀ` when `transposed`): `a` holds its `m` rows of `k`
    /// operands as [`gather`](Self::gather) or
    /// [`prepare_gradient`](Self::prepare_gradient) left them, `row_stride` apart.
    fn product(
        &self,
        a: &[f32],
        (m, k, row_stride): (usize, usize, usize),
        (vocab, h): (usize, usize),
        transposed: bool,
        c: MatMut<'_>,
    ) {
        match *self {
            Self::F32(w) | Self::Bf16Values(w) => {
                let w = Mat::new(w, vocab, h);
                let b = if transposed { w.t() } else { w };
                gemm(1.0, Mat::strided(a, m, k, row_stride, 1), b, 0.0, c);
            }
            #[cfg(target_arch = "x86_64")]
            Self::Bf16(w) => {
                let a = Mat::strided(a, m, k.div_ceil(2), row_stride, 1);
                crate::gemm::gemm_bf16_pairs(a, w, (vocab, h), transposed, 0.0, c);
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::Bf16(_) => unreachable!("no bf16 kernels off x86-64"),
        }
    }
}

/// [`linear_cross_entropy`] with the head's products as `logits.head` takes them, on
/// logits soft-capped where `logits.softcap` says (the gradient then carries the cap's
/// `1 − tanh²`; each rayon job holds one row of those slopes, `4·vocab` bytes).
pub(crate) fn linear_cross_entropy_with(
    hidden: &[f32],
    hidden_dim: usize,
    logits: Logits<'_>,
    targets: &[i64],
    weights: RowWeights<'_>,
    outputs: LossOutputs<'_>,
) -> Result<f64, LossError> {
    let h = hidden_dim;
    let n = targets.len();
    let Logits {
        head,
        vocab,
        softcap,
    } = logits;
    let LossOutputs {
        d_hidden,
        mut row_losses,
        mut correct,
    } = outputs;
    if let Some(c) = correct.as_deref_mut() {
        *c = 0;
    }
    let given = [
        ("hidden", Some(hidden.len()), n * h),
        ("lm_head", Some(head.len()), vocab * h),
        ("d_hidden", d_hidden.as_ref().map(|d| d.len()), n * h),
        ("row_losses", row_losses.as_ref().map(|r| r.len()), n),
        ("weights", weights.len(), n),
    ];
    for (buffer, len, expected) in given {
        if let Some(len) = len {
            expect_len(buffer, len, expected)?;
        }
    }
    if let Some((row, &target)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t >= 0 && t as u64 >= vocab as u64)
    {
        return Err(LossError::TargetOutOfVocabulary { row, target, vocab });
    }

    // Sized exactly, so that [`scratch_bytes`] is what this holds.
    let mut labelled = Vec::with_capacity(targets.iter().filter(|&&t| t >= 0).count());
    labelled.extend((0..n).filter(|&r| targets[r] >= 0));
    let mut d_hidden = d_hidden;
    if let Some(d) = d_hidden.as_deref_mut() {
        for (row, &t) in d.chunks_mut(h.max(1)).zip(targets) {
            if t < 0 {
                row.fill(0.0);
            }
        }
    }
    if let Some(out) = row_losses.as_deref_mut() {
        out.fill(0.0);
    }
    if labelled.is_empty() {
        return Ok(0.0);
    }

    let rows = Rows {
        hidden,
        h,
        head,
        vocab,
        softcap,
        targets,
    };
    let total = rows.over_chunks(&labelled, weights, (d_hidden, row_losses, correct));
    Ok(match weights {
        RowWeights::Uniform(scale) => total * scale as f64,
        RowWeights::PerRow(_) => total,
    })
}

/// The rows [`linear_cross_entropy_with`] takes, checked.
struct Rows<'a> {
    hidden: &'a [f32],
    h: usize,
    head: Head<'a>,
    vocab: usize,
    softcap: Option<f32>,
    targets: &'a [i64],
}

/// Where [`Rows::over_chunks`] writes: the hidden state's gradient, each row's loss, the
/// rows ranked right.
type Written<'o> = (
    Option<&'o mut [f32]>,
    Option<&'o mut [f64]>,
    Option<&'o mut u64>,
);

impl Rows<'_> {
    /// The weighted sum of the `labelled` rows' losses (the uniform weight not yet
    /// applied), [`chunk_rows`] rows at a time, writing what `written` asks for.
    fn over_chunks(
        &self,
        labelled: &[usize],
        weights: RowWeights<'_>,
        written: Written<'_>,
    ) -> f64 {
        let Self {
            hidden,
            h,
            head,
            vocab,
            softcap,
            targets,
        } = *self;
        let (mut d_hidden, mut row_losses, mut correct) = written;
        let grad = d_hidden.is_some();
        let (rows, [h_c, logits, dh_c]) = chunk_lengths(h, vocab, labelled.len(), grad);
        let mut h_c = vec![0f32; h_c];
        let mut logits = vec![0f32; logits];
        let mut dh_c = vec![0f32; dh_c];
        let mut row_loss = vec![0f64; rows];
        let mut row_hit = vec![false; rows];
        let mut total = 0f64;
        for chunk in labelled.chunks(rows) {
            let m = chunk.len();
            for (dst, &r) in h_c.chunks_mut(h.max(1)).zip(chunk) {
                head.gather(&hidden[r * h..(r + 1) * h], dst);
            }
            let logits = &mut logits[..m * vocab];
            head.product(
                &h_c,
                (m, h, h),
                (vocab, h),
                true,
                MatMut::new(logits, m, vocab),
            );
            let slopes_len = if grad && softcap.is_some() { vocab } else { 0 };
            logits
                .par_chunks_mut(vocab)
                .zip(chunk.par_iter())
                .zip(row_loss[..m].par_iter_mut())
                .zip(row_hit[..m].par_iter_mut())
                .for_each_init(
                    || vec![0f32; slopes_len],
                    |slopes, (((l, &r), loss), hit)| {
                        // The check above makes every labelled target a valid index.
                        let t = targets[r] as usize;
                        let cap = softcap.map(|c| (c, &mut slopes[..]));
                        (*loss, *hit) = softmax_row(l, t, grad.then(|| weights.of(r)), cap);
                        if grad {
                            head.prepare_gradient(l);
                        }
                    },
                );
            total += weights.sum(chunk, &row_loss[..m]);
            if let Some(out) = row_losses.as_deref_mut() {
                for (&r, &loss) in chunk.iter().zip(&row_loss[..m]) {
                    out[r] = loss;
                }
            }
            if let Some(c) = correct.as_deref_mut() {
                *c += row_hit[..m].iter().filter(|&&hit| hit).count() as u64;
            }
            if let Some(d) = d_hidden.as_deref_mut() {
                let dh_c = &mut dh_c[..m * h];
                head.product(
                    logits,
                    (m, vocab, vocab),
                    (vocab, h),
                    false,
                    MatMut::new(dh_c, m, h),
                );
                for (src, &r) in dh_c.chunks(h.max(1)).zip(chunk) {
                    d[r * h..(r + 1) * h].copy_from_slice(src);
                }
            }
        }
        total
    }
}

crate::simd::wide_twin!(
    /// One row of logits `l` with target `t`: returns `logsumexp(l) − l[t]` in `f64` and
    /// whether `l[t]` is the row's largest logit, and leaves in `l` the logit gradient
    /// `(softmax(l) − onehot(t))·scale` when a scale is given (`exp(l − max)` otherwise).
    /// With `cap = Some((c, slopes))` the logits are first soft-capped to `c·tanh(l/c)`,
    /// and the gradient is taken back through the cap with the slopes `1 − tanh²` it
    /// keeps in `slopes` (a row as long as `l` when a scale is given).
    fn softmax_row(
        l: &mut [f32],
        t: usize,
        scale: Option<f32>,
        cap: Option<(f32, &mut [f32])>,
    ) -> (f64, bool) {
        let mut slopes = None;
        if let Some((c, keep)) = cap {
            // The slopes only matter to the gradient.
            crate::tanh::soft_cap(l, c, scale.map(|_| &mut *keep));
            slopes = scale.map(|_| &*keep);
        }
        let target = l[t];
        let m = max(l);
        for x in l.iter_mut() {
            *x = exp(*x - m);
        }
        let s = sum(l);
        let loss = (s as f64).ln() + m as f64 - target as f64;
        if let Some(scale) = scale {
            let k = scale / s;
            for x in l.iter_mut() {
                *x *= k;
            }
            l[t] -= scale;
            if let Some(slopes) = slopes {
                l.iter_mut().zip(slopes).for_each(|(x, &d)| *x *= d);
            }
        }
        (loss, target >= m)
    }
);

fn expect_len(buffer: &'static str, len: usize, expected: usize) -> Result<(), LossError> {
    if len == expected {
        Ok(())
    } else {
        Err(LossError::Length {
            buffer,
            len,
            expected,
        })
    }
}

#[cfg(test)]
#[path = "loss_tests.rs"]
mod tests;
