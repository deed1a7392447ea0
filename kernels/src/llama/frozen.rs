//! Frozen matrices as they are stored (`f32`, or `bf16` widened to `f32` where used),
//! and the products the step takes with them, in f32 or in bf16 ([`Compute`]).
//!
//! A bf16 value is the top half of an f32, so widening is a shift (exact, no rounding)
//! and a step on bf16-stored weights computes the same bits as one on their f32
//! widening: the widened matrix goes through the same [`gemm`](crate::gemm::gemm).
//!
//! In bf16 compute the activation operand is rounded to bf16 too (to nearest, ties to
//! even, as PyTorch rounds), and the product of two bf16 values is exact in f32, so the
//! result is that of bf16 operands with f32 accumulation whichever way it is computed:
//! on a oneMKL build with bf16-stored weights through `cblas_gemm_bf16bf16f32` (AMX
//! tiles on Sapphire Rapids and later), on a CPU with AVX512-BF16 (and bf16-stored
//! weights) through the crate's own `vdpbf16ps` kernels, which read the weights as
//! stored and the activation as bf16 pairs, elsewhere by widening both operands and
//! running the f32 GEMM (the same values, only the order of the sums may differ).

use crate::bf16::{pair, pair_row, rounded};
use crate::gemm::{Mat, MatMut, gemm};
use crate::loss::Head;
use half::bf16;
use rayon::prelude::*;

/// How the frozen projections' products (`x·Wᵀ` forward, `dY·W` backward) and the
/// head's (`H·Wᵀ`, `G·W`) are computed. LoRA's products, the norms, attention, the
/// softmax and the loss stay f32 either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Compute {
    /// f32 operands: bf16-stored weights are widened exactly, so results are those of
    /// the f32 model (the PEFT parity guarantee).
    #[default]
    F32,
    /// bf16 operands, f32 accumulation: the activation (or its gradient) is rounded to
    /// bf16 and multiplied with the bf16 weight (an f32-stored weight is rounded too).
    /// What PyTorch's bf16 autocast does to a linear layer's inputs, and what AMX tiles
    /// compute; outside the f32 parity guarantee.
    Bf16,
}

/// The scratch the frozen products need, and the [`Compute`] mode they run in.
#[derive(Default)]
pub(super) struct FrozenWork {
    pub(super) compute: Compute,
    /// Where a frozen matrix is widened (or, in bf16 compute, rounded and widened) to
    /// f32 before its product: sized for the largest one it holds, empty when none is.
    pub(super) widened: Vec<f32>,
    /// In bf16 compute, the rounded activation operand: N × the widest projection side
    /// (empty in f32 compute, and when oneMKL takes it as bf16).
    rounded: Vec<f32>,
    /// The same as bf16, for oneMKL's bf16 GEMM: allocated (and that GEMM used) when
    /// every projection is stored as bf16.
    #[cfg(tuneq_blas_mkl)]
    rounded_bf16: Vec<bf16>,
    /// The same as bf16 pairs (see [`pair_rows`]), for the own bf16 kernels: allocated
    /// (and those kernels used) when every projection is stored as bf16 and the CPU has
    /// them.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pairs: Vec<f32>,
}

impl FrozenWork {
    /// Scratch for `compute`: `widened` elements for the weights and, in bf16 compute,
    /// room for the activation operand of `tokens` rows at most `widest` wide: as bf16
    /// when `bf16_gemm` (see [`uses_bf16_gemm`]), else as f32.
    pub(super) fn new(
        compute: Compute,
        widened: usize,
        (tokens, widest): (usize, usize),
        bf16_gemm: bool,
    ) -> Self {
        let bf16_gemm = bf16_gemm && compute == Compute::Bf16;
        let mkl = bf16_gemm && cfg!(tuneq_blas_mkl);
        let own = bf16_gemm && !mkl && crate::gemm::own_bf16_kernels();
        let rounded = if compute == Compute::Bf16 && !mkl && !own {
            tokens * widest
        } else {
            0
        };
        Self {
            compute,
            widened: vec![0.0; widened],
            #[cfg(tuneq_blas_mkl)]
            rounded_bf16: vec![bf16::ZERO; if mkl { tokens * widest } else { 0 }],
            rounded: vec![0.0; rounded],
            pairs: vec![0.0; if own { tokens * widest.div_ceil(2) } else { 0 }],
        }
    }

    /// `C = A·op(W) + β·C` for a frozen `W` of `rows × cols` (row-major), used
    /// transposed (`A·Wᵀ`, the forward) when `transposed`, in this scratch's
    /// [`Compute`] mode.
    pub(super) fn product(
        &mut self,
        a: Mat<'_>,
        w: Frozen<'_>,
        (rows, cols): (usize, usize),
        transposed: bool,
        beta: f32,
        c: MatMut<'_>,
    ) {
        match self.compute {
            Compute::F32 => {
                let w = Mat::new(w.as_f32(&mut self.widened), rows, cols);
                gemm(1.0, a, oriented(w, transposed), beta, c);
            }
            Compute::Bf16 => {
                #[cfg(test)]
                ROUNDED_OPERANDS.with_borrow_mut(|log| log.push((transposed, a.rows(), a.cols())));
                #[cfg(tuneq_blas_mkl)]
                if let (Frozen::Bf16(w), false) = (w, self.rounded_bf16.is_empty()) {
                    let a = round_rows(a, &mut self.rounded_bf16, |x| {
                        bf16::from_bits((crate::bf16::rounded_bits(x) >> 16) as u16)
                    });
                    crate::gemm::gemm_bf16(a, w, (rows, cols), transposed, beta, c);
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if let (Frozen::Bf16(w), false) = (w, self.pairs.is_empty()) {
                    let (m, k) = (a.rows(), a.cols());
                    let a = Mat::new(pair_rows(a, &mut self.pairs), m, k.div_ceil(2));
                    crate::gemm::gemm_bf16_pairs(a, w, (rows, cols), transposed, beta, c);
                    return;
                }
                let (m, k) = (a.rows(), a.cols());
                let a = round_rows(a, &mut self.rounded, rounded);
                let w = Mat::new(w.as_bf16_values(&mut self.widened), rows, cols);
                gemm(1.0, Mat::new(a, m, k), oriented(w, transposed), beta, c);
            }
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Test-only record of this thread's bf16-compute products, in order: (`transposed`,
    /// rows, columns) of each activation operand rounded, so a test can check that every
    /// frozen product of a step went through the rounding.
    pub(super) static ROUNDED_OPERANDS: std::cell::RefCell<Vec<(bool, usize, usize)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether bf16 compute hands the products to oneMKL's bf16 GEMM: on a oneMKL build,
/// when every projection is stored as bf16 (`projections_bf16`).
pub(super) fn uses_mkl_bf16(compute: Compute, projections_bf16: bool) -> bool {
    compute == Compute::Bf16 && projections_bf16 && cfg!(tuneq_blas_mkl)
}

/// Whether bf16 compute hands the products to a GEMM that takes the weights as stored
/// (bf16, `projections_bf16`): oneMKL's ([`uses_mkl_bf16`]) or, on a CPU with
/// AVX512-BF16, the crate's own bf16 kernels.
pub(super) fn uses_bf16_gemm(compute: Compute, projections_bf16: bool) -> bool {
    uses_mkl_bf16(compute, projections_bf16)
        || (compute == Compute::Bf16 && projections_bf16 && crate::gemm::own_bf16_kernels())
}

/// Whether bf16 compute hands the head's products to the own bf16 kernels with the head
/// as stored (bf16, `head_bf16`), on a CPU with AVX512-BF16; otherwise the head is
/// widened (or rounded) to its bf16 values in f32 for them, which the step's widening
/// scratch holds. oneMKL builds take this second way (no own kernels there).
pub(super) fn head_as_stored(compute: Compute, head_bf16: bool) -> bool {
    compute == Compute::Bf16 && head_bf16 && crate::gemm::own_bf16_kernels()
}

/// The head as the loss multiplies it in `compute`: f32 operands (a bf16 head widened
/// into `scratch`), or bf16 operands, with the head as stored where
/// [`head_as_stored`], else its bf16 values in `scratch`.
pub(super) fn loss_head<'s, 'a: 's>(
    lm_head: Frozen<'a>,
    compute: Compute,
    scratch: &'s mut [f32],
) -> Head<'s> {
    match (compute, lm_head) {
        (Compute::F32, _) => Head::F32(lm_head.as_f32(scratch)),
        (Compute::Bf16, Frozen::Bf16(w)) if head_as_stored(compute, true) => Head::Bf16(w),
        (Compute::Bf16, _) => Head::Bf16Values(lm_head.as_bf16_values(scratch)),
    }
}

/// `w`, or its transpose when `transposed`.
fn oriented(w: Mat<'_>, transposed: bool) -> Mat<'_> {
    if transposed { w.t() } else { w }
}

/// Rows of the operand at a time per parallel job when rounding it.
const ROUND_ROWS: usize = 64;

/// Writes `f(a[i][j])` into `out` row-major (`a.rows() × a.cols()`) and returns that
/// part of it. Elementwise, in parallel over fixed blocks of rows.
fn round_rows<'o, T: Send>(a: Mat<'_>, out: &'o mut [T], f: impl Fn(f32) -> T + Sync) -> &'o [T] {
    fill_rows(a.rows(), a.cols(), out, |i, row| match a.row(i) {
        Some(src) => row.iter_mut().zip(src).for_each(|(o, &x)| *o = f(x)),
        None => row
            .iter_mut()
            .enumerate()
            .for_each(|(j, o)| *o = f(a.at(i, j))),
    })
}

/// Fills the first `rows × width` elements of `out` row-major, row `i` by
/// `fill(i, row)`, in parallel over fixed blocks of [`ROUND_ROWS`] rows, and returns
/// that part of it.
fn fill_rows<T: Send>(
    rows: usize,
    width: usize,
    out: &mut [T],
    fill: impl Fn(usize, &mut [T]) + Sync,
) -> &[T] {
    let out = &mut out[..rows * width];
    if width == 0 {
        return out;
    }
    out.par_chunks_mut(ROUND_ROWS * width)
        .enumerate()
        .for_each(|(block, chunk)| {
            for (r, row) in chunk.chunks_mut(width).enumerate() {
                fill(block * ROUND_ROWS + r, row);
            }
        });
    out
}

/// Writes `a`'s rows (`m × k`) into `out` rounded to bf16 and paired, `m × ⌈k/2⌉`
/// row-major (see [`pair_row`]), as the own bf16 kernels read them. Returns that part of
/// `out`; in parallel over fixed blocks of rows.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn pair_rows<'o>(a: Mat<'_>, out: &'o mut [f32]) -> &'o [f32] {
    let k = a.cols();
    let pairs = k.div_ceil(2);
    fill_rows(a.rows(), pairs, out, |i, row| match a.row(i) {
        Some(src) => pair_row(src, row),
        None => row.iter_mut().enumerate().for_each(|(p, o)| {
            let odd = if 2 * p + 1 < k {
                a.at(i, 2 * p + 1)
            } else {
                0.0
            };
            *o = pair(a.at(i, 2 * p), odd);
        }),
    })
}

/// A frozen matrix as stored: f32, or bf16 widened to f32 where it is used.
///
/// bf16 halves the resident size of the weights (a 7B Llama's frozen weights take
/// ~13 GiB instead of ~27 GiB); the step widens each bf16 matrix into one reusable f32
/// scratch right before its product (see [`step_bytes`](super::step_bytes)), so compute,
/// LoRA factors and gradients stay f32 and the results are those of the f32 widening,
/// bit for bit.
#[derive(Debug, Clone, Copy)]
pub enum Frozen<'a> {
    /// Stored as f32, used as is.
    F32(&'a [f32]),
    /// Stored as bf16, widened exactly to f32 where it is used.
    Bf16(&'a [bf16]),
}

impl<'a> Frozen<'a> {
    /// Elements (not bytes).
    pub fn len(&self) -> usize {
        match self {
            Self::F32(w) => w.len(),
            Self::Bf16(w) => w.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it is stored as bf16 (and so needs the widening scratch).
    pub fn is_bf16(&self) -> bool {
        matches!(self, Self::Bf16(_))
    }

    /// Resident bytes of the storage: 4 per element as f32, 2 as bf16.
    pub fn bytes(&self) -> u64 {
        match self {
            Self::F32(w) => std::mem::size_of_val(*w) as u64,
            Self::Bf16(w) => std::mem::size_of_val(*w) as u64,
        }
    }

    /// Whether `self` and `other` are the same storage (tied embeddings), so that its
    /// bytes are counted once.
    pub(super) fn same_storage(&self, other: &Frozen<'_>) -> bool {
        match (self, other) {
            (Self::F32(a), Frozen::F32(b)) => std::ptr::eq(*a, *b),
            (Self::Bf16(a), Frozen::Bf16(b)) => std::ptr::eq(*a, *b),
            _ => false,
        }
    }

    /// The whole matrix as f32: the stored slice itself, or, for bf16, widened into
    /// the first `len()` elements of `scratch` (which the step sizes for the largest
    /// bf16 matrix it widens, see `memory::widening_len`).
    pub(super) fn as_f32<'s>(&self, scratch: &'s mut [f32]) -> &'s [f32]
    where
        'a: 's,
    {
        match *self {
            Self::F32(w) => w,
            Self::Bf16(w) => {
                let out = &mut scratch[..w.len()];
                widen(w, out);
                out
            }
        }
    }

    /// The whole matrix as f32 values that are bf16 values: bf16 storage widened, f32
    /// storage rounded to bf16 first, into the first `len()` elements of `scratch`.
    pub(super) fn as_bf16_values<'s>(&self, scratch: &'s mut [f32]) -> &'s [f32]
    where
        'a: 's,
    {
        match *self {
            Self::Bf16(_) => self.as_f32(scratch),
            Self::F32(w) => {
                let out = &mut scratch[..w.len()];
                out.par_chunks_mut(WIDEN_CHUNK)
                    .zip(w.par_chunks(WIDEN_CHUNK))
                    .for_each(|(o, s)| {
                        for (o, &x) in o.iter_mut().zip(s) {
                            *o = rounded(x);
                        }
                    });
                out
            }
        }
    }

    /// Copies elements `start..start + out.len()` into `out`, widened (one embedding
    /// row: sequential, it is short).
    pub(super) fn copy_to(&self, start: usize, out: &mut [f32]) {
        match *self {
            Self::F32(w) => out.copy_from_slice(&w[start..][..out.len()]),
            Self::Bf16(w) => widen_sequential(&w[start..][..out.len()], out),
        }
    }
}

impl<'a> From<&'a [f32]> for Frozen<'a> {
    fn from(w: &'a [f32]) -> Self {
        Self::F32(w)
    }
}

impl<'a> From<&'a [bf16]> for Frozen<'a> {
    fn from(w: &'a [bf16]) -> Self {
        Self::Bf16(w)
    }
}

/// Elements per parallel widening job: 256 KiB of f32 written, large enough that
/// rayon's per-job cost vanishes against the memory traffic.
const WIDEN_CHUNK: usize = 1 << 16;

/// One bf16 as the f32 it is the top half of: exact for every bit pattern, NaN payloads
/// and the sign of zero included. (`half::bf16::to_f32` gives the same value except
/// that it sets the quiet bit of a signalling NaN; a shift keeps the bits and
/// vectorises.)
#[inline]
pub(super) fn widen_one(b: bf16) -> f32 {
    f32::from_bits(u32::from(b.to_bits()) << 16)
}

/// `out[i] = widen_one(src[i])` on the calling thread.
fn widen_sequential(src: &[bf16], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(src) {
        *o = widen_one(b);
    }
}

/// `out[i] = widen_one(src[i])` for every `i < out.len()` (the lengths are equal at
/// every call site), split over rayon in fixed chunks. Elementwise, so the result does
/// not depend on the split or the thread count.
pub(super) fn widen(src: &[bf16], out: &mut [f32]) {
    out.par_chunks_mut(WIDEN_CHUNK)
        .zip(src.par_chunks(WIDEN_CHUNK))
        .for_each(|(o, s)| widen_sequential(s, o));
}
