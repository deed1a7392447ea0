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
    linear_cross_entropy_with(hidden, hidden_dim, head, vocab, targets, weights, outputs)
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

/// [`linear_cross_entropy`] with the head's products as `head` takes them.
pub(crate) fn linear_cross_entropy_with(
    hidden: &[f32],
    hidden_dim: usize,
    head: Head<'_>,
    vocab: usize,
    targets: &[i64],
    weights: RowWeights<'_>,
    outputs: LossOutputs<'_>,
) -> Result<f64, LossError> {
    let h = hidden_dim;
    let n = targets.len();
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
            logits
                .par_chunks_mut(vocab)
                .zip(chunk.par_iter())
                .zip(row_loss[..m].par_iter_mut())
                .zip(row_hit[..m].par_iter_mut())
                .for_each(|(((l, &r), loss), hit)| {
                    // The check above makes every labelled target a valid index.
                    let t = targets[r] as usize;
                    (*loss, *hit) = softmax_row(l, t, grad.then(|| weights.of(r)));
                    if grad {
                        head.prepare_gradient(l);
                    }
                });
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
    fn softmax_row(l: &mut [f32], t: usize, scale: Option<f32>) -> (f64, bool) {
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
mod tests {
    use super::*;
    use crate::testing::random;
    use rand::{Rng, SeedableRng};

    /// The naive computation in f64: logits, log-softmax, the scaled loss, and
    /// dH = Σ_v (p_v − [v = t])·scale·W_v. Also, per element of dH, the size of its
    /// terms Σ_v |G_v·W_vj|, which bounds the rounding of the f32 sum; and per labelled
    /// row, |logsumexp| + |l_t|, which bounds the rounding of its loss.
    struct Reference {
        /// Labelled rows whose target has the largest logit.
        hits: u64,
        loss: f64,
        loss_size: f64,
        dh: Vec<f64>,
        dh_size: Vec<f64>,
    }

    fn reference(
        hidden: &[f32],
        h: usize,
        w: &[f32],
        vocab: usize,
        targets: &[i64],
        scale_of: impl Fn(usize) -> f32,
    ) -> Reference {
        let mut out = Reference {
            hits: 0,
            loss: 0.0,
            loss_size: 0.0,
            dh: vec![0.0; targets.len() * h],
            dh_size: vec![0.0; targets.len() * h],
        };
        for (r, &t) in targets.iter().enumerate() {
            if t < 0 {
                continue;
            }
            let t = t as usize;
            let scale = scale_of(r) as f64;
            let x = &hidden[r * h..(r + 1) * h];
            let logits: Vec<f64> = (0..vocab)
                .map(|v| {
                    (0..h)
                        .map(|j| x[j] as f64 * w[v * h + j] as f64)
                        .sum::<f64>()
                })
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
            out.hits += u64::from(logits[t] >= m);
            let log_softmax: Vec<f64> = logits.iter().map(|l| l - lse).collect();
            out.loss -= scale * log_softmax[t];
            out.loss_size += (scale * (lse.abs() + logits[t].abs())).abs();
            for (v, lsm) in log_softmax.iter().enumerate() {
                let g = (lsm.exp() - if v == t { 1.0 } else { 0.0 }) * scale;
                for j in 0..h {
                    out.dh[r * h + j] += g * w[v * h + j] as f64;
                    out.dh_size[r * h + j] += (g * w[v * h + j] as f64).abs();
                }
            }
        }
        out
    }

    /// Targets for `n` rows: every `gap`-th row unlabelled (none if `gap` is 0), the
    /// others cycling through the vocabulary including its first and last ids.
    fn targets(n: usize, vocab: usize, gap: usize) -> Vec<i64> {
        (0..n)
            .map(|r| {
                if gap > 0 && r % gap == gap - 1 {
                    -100
                } else {
                    ((r * 7919) % vocab) as i64
                }
            })
            .collect()
    }

    fn check(n: usize, h: usize, vocab: usize, gap: usize, spread: f32) {
        let hidden = random(n * h, 1, spread);
        let w = random(vocab * h, 2, 0.5);
        let t = targets(n, vocab, gap);
        let scale = 1.0 / 37.0;
        let want = reference(&hidden, h, &w, vocab, &t, |_| scale);
        let mut dh = vec![f32::NAN; n * h];
        let got = linear_cross_entropy(&hidden, h, &w, vocab, &t, scale, Some(&mut dh))
            .expect("valid inputs");
        let at = format!("{n} rows, h {h}, vocab {vocab}, gap {gap}, spread {spread}");
        // Each row's loss is lse − l_t from f32 logits: relative to the size of those
        // terms, not to the (possibly small) difference. Measured ≤ 1e-8 of it; 1e-6
        // still catches a 1e-5 relative slip in either term.
        assert!(
            (got - want.loss).abs() <= 1e-6 * want.loss_size,
            "{at}: loss {got} vs {}",
            want.loss
        );
        // dH is a sum over the vocabulary with cancelling terms: relative to Σ|terms|.
        // Measured ≤ 7e-7 of it for logits of order 1, 4e-6 for logits in the hundreds
        // (where f32 logits carry absolute errors ~1e-5 into the softmax).
        for i in 0..n * h {
            assert!(
                (dh[i] as f64 - want.dh[i]).abs() <= 1e-5 * want.dh_size[i],
                "{at}: dH[{i}] (row {}) {} vs {}",
                i / h,
                dh[i],
                want.dh[i]
            );
            if t[i / h] < 0 {
                assert_eq!(
                    dh[i].to_bits(),
                    0,
                    "{at}: unlabelled row {} not zero",
                    i / h
                );
            }
        }
        // Evaluation gives the same loss, bit for bit, and needs no gradient buffer.
        let eval = linear_cross_entropy(&hidden, h, &w, vocab, &t, scale, None).expect("valid");
        assert_eq!(eval.to_bits(), got.to_bits(), "{at}: evaluation loss");
    }

    /// The row softmax runs 8 lanes wide where the CPU has AVX2 (`crate::simd`); the
    /// baseline build gives the same loss and gradient bits.
    /// Weights per row (a preference loss's, of either sign): the sum is Σ wᵣ·CEᵣ, each
    /// row's gradient is scaled by its own weight, and every row's unweighted loss is
    /// written out (0 for unlabelled rows), against the f64 reference.
    #[test]
    fn rows_weighted_apart_give_each_row_its_own_scale() {
        let (n, h, vocab) = (300, 24, 97);
        let hidden = random(n * h, 3, 2.0);
        let w = random(vocab * h, 4, 0.5);
        let t = targets(n, vocab, 5);
        let weights: Vec<f32> = (0..n).map(|r| (r as f32 - 150.0) / 900.0).collect();
        let want = reference(&hidden, h, &w, vocab, &t, |r| weights[r]);
        let mut dh = vec![f32::NAN; n * h];
        let mut losses = vec![f64::NAN; n];
        let mut hits = u64::MAX;
        let outputs = LossOutputs {
            d_hidden: Some(&mut dh),
            row_losses: Some(&mut losses),
            correct: Some(&mut hits),
        };
        let head = Head::F32(&w);
        let got = linear_cross_entropy_with(
            &hidden,
            h,
            head,
            vocab,
            &t,
            RowWeights::PerRow(&weights),
            outputs,
        )
        .expect("valid inputs");
        assert!(
            (got - want.loss).abs() <= 1e-6 * want.loss_size,
            "weighted loss {got} vs {}",
            want.loss
        );
        for (i, (&got, (&want, &size))) in
            dh.iter().zip(want.dh.iter().zip(&want.dh_size)).enumerate()
        {
            assert!(
                (got as f64 - want).abs() <= 1e-5 * size + 1e-12,
                "dH[{i}] {got} vs {want}"
            );
        }
        assert_eq!(hits, want.hits, "tokens ranked right");
        assert!(hits > 0 && hits < t.iter().filter(|&&t| t >= 0).count() as u64);
        let unit = reference(&hidden, h, &w, vocab, &t, |_| 1.0);
        let mut sum = 0.0;
        for (r, (&loss, &target)) in losses.iter().zip(&t).enumerate() {
            if target < 0 {
                assert_eq!(loss, 0.0, "unlabelled row {r}");
            }
            sum += loss;
        }
        assert!(
            (sum - unit.loss).abs() <= 1e-6 * unit.loss_size,
            "{sum} vs {}",
            unit.loss
        );
        let short = [0f32; 3];
        let refused = linear_cross_entropy_with(
            &hidden,
            h,
            head,
            vocab,
            &t,
            RowWeights::PerRow(&short),
            LossOutputs::default(),
        );
        assert!(matches!(
            refused,
            Err(LossError::Length {
                buffer: "weights",
                ..
            })
        ));
    }

    #[test]
    fn the_avx2_build_of_the_row_softmax_gives_the_baseline_bits() {
        use crate::simd::tests::{avx2_here, on_baseline, on_wide};
        if !avx2_here() {
            eprintln!(
                "skipped: this CPU lacks AVX2 or FMA, so only the baseline build runs here and \
                 there is no AVX2 build to compare (the loss's other tests check the baseline)"
            );
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(31);
        let (n, h, vocab) = (40, 24, 301);
        let hidden: Vec<f32> = (0..n * h).map(|_| rng.random_range(-2.0..2.0)).collect();
        let w: Vec<f32> = (0..vocab * h)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let targets: Vec<i64> = (0..n as i64).map(|i| (i * 7) % vocab as i64 - 3).collect();
        let run = || {
            let mut d = vec![0f32; n * h];
            let loss = linear_cross_entropy(&hidden, h, &w, vocab, &targets, 0.1, Some(&mut d))
                .expect("valid");
            (
                loss.to_bits(),
                d.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            )
        };
        let wide = on_wide(run);
        assert!(wide == on_baseline(run), "the AVX2 build changed the bits");
    }

    /// bf16 compute's head rounds both operands of both products: the hidden rows
    /// before `H·Wᵀ` and the logit gradients before `G·W`. With a permutation for the
    /// head (V = h, odd, so the pairs end in a lone element; not symmetric, so a
    /// transposed product would show) every product has one non-zero term and is exact,
    /// so the bf16 paths must give the f32 path's loss on the rounded hidden rows, and
    /// its hidden-state gradient rounded, bit for bit (in one chunk: so small a head takes
    /// 1024 rows at once).
    #[test]
    fn the_bf16_head_rounds_the_hidden_rows_and_the_logit_gradients() {
        let (n, h) = (150, 37);
        let vocab = h;
        let permutation = |v: usize| (5 * v + 3) % vocab;
        let mut head = vec![0f32; vocab * h];
        for v in 0..vocab {
            head[v * h + permutation(v)] = 1.0;
        }
        let hidden = random(n * h, 9, 3.0);
        let rounded: Vec<f32> = hidden.iter().map(|&x| crate::bf16::rounded(x)).collect();
        assert_ne!(hidden, rounded);
        let t = targets(n, vocab, 4);
        let scale = 1.0 / 113.0;
        let run = |head: Head<'_>, hidden: &[f32]| {
            let mut dh = vec![f32::NAN; n * h];
            let weights = RowWeights::Uniform(scale);
            let outputs = LossOutputs {
                d_hidden: Some(&mut dh),
                row_losses: None,
                correct: None,
            };
            let loss = linear_cross_entropy_with(hidden, h, head, vocab, &t, weights, outputs)
                .expect("valid inputs");
            let outputs = LossOutputs::default();
            let eval = linear_cross_entropy_with(hidden, h, head, vocab, &t, weights, outputs)
                .expect("valid inputs");
            assert_eq!(loss.to_bits(), eval.to_bits(), "evaluation loss");
            (
                loss.to_bits(),
                dh.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            )
        };
        let (loss, dh) = run(Head::F32(&head), &rounded);
        let dh_rounded: Vec<u32> = dh
            .iter()
            .map(|&b| crate::bf16::rounded_bits(f32::from_bits(b)))
            .collect();
        assert_ne!(dh, dh_rounded, "the gradient was already bf16");
        let want = (loss, dh_rounded);
        assert!(
            run(Head::Bf16Values(&head), &hidden) == want,
            "widened bf16 head"
        );
        if crate::gemm::own_bf16_kernels() {
            let stored: Vec<half::bf16> = head.iter().map(|&x| half::bf16::from_f32(x)).collect();
            assert!(
                run(Head::Bf16(&stored), &hidden) == want,
                "bf16 kernels' head"
            );
        }
    }

    #[test]
    fn matches_the_f64_reference_with_and_without_labels() {
        check(7, 16, 50, 3, 1.0);
        check(1, 1, 1, 0, 1.0);
        check(5, 8, 33, 2, 1.0);
    }

    #[test]
    fn chunks_hold_about_16_mib_of_logits_in_64_row_steps() {
        assert_eq!(chunk_rows(4096), 1024);
        assert_eq!(chunk_rows(32000), 128);
        assert_eq!(chunk_rows(128_256), MIN_CHUNK_ROWS);
        assert_eq!(chunk_rows(10_000), 384);
        assert_eq!(chunk_rows(1), MAX_CHUNK_ROWS);
        assert_eq!(chunk_rows(0), MAX_CHUNK_ROWS);
    }

    #[test]
    fn matches_the_f64_reference_across_chunk_boundaries() {
        // The largest vocabulary with the fewest rows per chunk (128).
        let vocab = CHUNK_LOGITS / MIN_CHUNK_ROWS;
        assert_eq!(chunk_rows(vocab), 128);
        // 300 labelled rows: chunks of 128, 128, 44. Then 240 labelled (128 + 112).
        check(300, 8, vocab, 0, 1.0);
        check(300, 8, vocab, 5, 1.0);
        // 129 labelled rows: a chunk of one.
        check(129, 4, vocab, 0, 1.0);
        // Chunks of 1024 rows (a small vocabulary): 1100 rows, 1024 + 76.
        assert_eq!(chunk_rows(200), 1024);
        check(1100, 16, 200, 0, 1.0);
    }

    #[test]
    fn large_logits_neither_overflow_nor_lose_the_gradient() {
        // Logits in the hundreds: exp without the max shift would overflow.
        check(20, 16, 64, 4, 100.0);
    }

    #[test]
    fn all_rows_unlabelled_give_zero_loss_and_zero_gradient() {
        let (n, h, vocab) = (10, 6, 9);
        let hidden = random(n * h, 3, 1.0);
        let w = random(vocab * h, 4, 1.0);
        let mut dh = vec![f32::NAN; n * h];
        let loss = linear_cross_entropy(&hidden, h, &w, vocab, &[-100; 10], 0.5, Some(&mut dh))
            .expect("valid inputs");
        assert_eq!(loss, 0.0);
        assert!(dh.iter().all(|x| x.to_bits() == 0), "{dh:?}");
    }

    #[test]
    fn the_gradient_agrees_with_finite_differences() {
        let (n, h, vocab) = (3, 4, 6);
        let hidden = random(n * h, 5, 1.0);
        let w = random(vocab * h, 6, 1.0);
        let t = [2i64, -1, 5];
        let scale = 0.5;
        let loss = |x: &[f32]| {
            linear_cross_entropy(x, h, &w, vocab, &t, scale, None).expect("valid inputs")
        };
        let mut dh = vec![0f32; n * h];
        linear_cross_entropy(&hidden, h, &w, vocab, &t, scale, Some(&mut dh)).expect("valid");
        // Central differences of the kernel's own f32 loss, step 1e-2: truncation error
        // ~1e-5 here, f32 rounding of the loss ~1e-7/1e-2, so 1e-4 is a fair bound.
        let eps = 1e-2f32;
        for i in 0..n * h {
            let (mut plus, mut minus) = (hidden.clone(), hidden.clone());
            plus[i] += eps;
            minus[i] -= eps;
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * eps as f64);
            assert!(
                (fd - dh[i] as f64).abs() <= 1e-4,
                "dH[{i}]: {} vs finite difference {fd}",
                dh[i]
            );
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (n, h, vocab) = (300, 40, 300);
        let hidden = random(n * h, 7, 1.0);
        let w = random(vocab * h, 8, 0.5);
        let t = targets(n, vocab, 7);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            let mut dh = vec![0f32; n * h];
            let loss = pool
                .install(|| linear_cross_entropy(&hidden, h, &w, vocab, &t, 0.01, Some(&mut dh)))
                .expect("valid inputs");
            (
                loss.to_bits(),
                dh.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            )
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }

    #[test]
    fn bad_inputs_are_refused_before_anything_is_written() {
        let (h, vocab) = (2, 3);
        let hidden = [0.5f32; 6];
        let w = [0.1f32; 6];
        let mut dh = [7f32; 6];
        let err = linear_cross_entropy(&hidden, h, &w, vocab, &[0, -100, 3], 1.0, Some(&mut dh));
        assert_eq!(
            err,
            Err(LossError::TargetOutOfVocabulary {
                row: 2,
                target: 3,
                vocab: 3
            })
        );
        assert_eq!(dh, [7.0; 6], "d_hidden was written");
        let err = linear_cross_entropy(&hidden, h, &w, vocab, &[0, 1], 1.0, None);
        assert!(
            matches!(
                err,
                Err(LossError::Length {
                    buffer: "hidden",
                    ..
                })
            ),
            "{err:?}"
        );
        let err = linear_cross_entropy(&hidden, h, &w[..5], vocab, &[0, 1, 2], 1.0, None);
        assert!(
            matches!(
                err,
                Err(LossError::Length {
                    buffer: "lm_head",
                    ..
                })
            ),
            "{err:?}"
        );
        let err = linear_cross_entropy(&hidden, h, &w, vocab, &[0, 1, 2], 1.0, Some(&mut dh[..4]));
        assert!(
            matches!(
                err,
                Err(LossError::Length {
                    buffer: "d_hidden",
                    ..
                })
            ),
            "{err:?}"
        );
    }
}
