//! `y = x·Wᵀ` for a few rows of `x`: the products of a decoding step, where each of a
//! few answers in flight adds one token.
//!
//! Such a product reads the whole weight for a handful of rows, so it is bound by memory
//! bandwidth, not arithmetic; what matters is reading each weight row once, in order.
//! Here each weight row is streamed once against all the rows of `x` (at most
//! [`MAX_ROWS`], kept in L1): `rows` dot products in 8 lanes each, summed across the
//! lanes at the end. Measured on SmolLM2-135M's shapes with 2 threads (a 2-core AMD
//! EPYC, all seven projections of its 30 layers and the head), 8 rows: 30 ms a pass
//! against 37 ms for [`gemm`](crate::gemm()) as `W·xᵀ` (whose tile reads 12 weight rows
//! at once) and 61 ms as `x·Wᵀ` (which packs the weight).
//!
//! The arithmetic is its own (lane-wise fused multiply-adds, then the lanes in a fixed
//! order), not the GEMM's, so its bits differ from [`gemm`](crate::gemm())'s for the
//! same product; they do not depend on the thread count or split. CPUs without AVX2 and
//! FMA run the same order with `f32::mul_add`, so they get the same bits (slowly).
//!
//! `unsafe` here: the AVX2 kernel's intrinsics and raw reads, within asserted lengths.

#![allow(unsafe_code)]

use rayon::prelude::*;

use crate::gemm::{Mat, to_row_major};

/// The most rows of `x` one call takes.
pub const MAX_ROWS: usize = 8;

/// Weight rows per parallel task at least: enough work to hide rayon's overhead.
const MIN_WEIGHT_ROWS_PER_TASK: usize = 32;

/// `x·Wᵀ` (`rows × out`, row-major) for `x` (`rows × k`, row-major, `1 ≤ rows ≤
/// MAX_ROWS`) and `w` (`out × k`, row-major).
///
/// # Panics
/// If `rows` is 0 or above [`MAX_ROWS`], or the lengths do not agree.
pub fn few_rows_times_weight(x: &[f32], rows: usize, w: &[f32], out: usize) -> Vec<f32> {
    assert!(
        (1..=MAX_ROWS).contains(&rows),
        "{rows} rows: this product takes 1 to {MAX_ROWS}"
    );
    let k = x.len() / rows;
    assert_eq!(
        x.len(),
        rows * k,
        "x holds {} values, not {rows} rows",
        x.len()
    );
    assert_eq!(
        w.len(),
        out * k,
        "W holds {} values, not {out} rows of {k}",
        w.len()
    );
    // yᵀ, weight row by weight row, then transposed: each task owns whole rows of yᵀ.
    // One contiguous run of weight rows per thread: each streams its part of the
    // weight in order (measured: 32-row tasks were 10 % slower at 8 rows).
    let per_task = out
        .div_ceil(rayon::current_num_threads())
        .max(MIN_WEIGHT_ROWS_PER_TASK);
    let mut by_weight = vec![0f32; out * rows];
    by_weight
        .par_chunks_mut(per_task * rows)
        .enumerate()
        .for_each(|(task, block)| {
            let first = task * per_task;
            let weights = &w[first * k..(first + block.len() / rows) * k];
            for (w_row, y) in weights
                .chunks_exact(k.max(1))
                .zip(block.chunks_exact_mut(rows))
            {
                dots(w_row, x, y);
            }
        });
    let mut y = Vec::new();
    to_row_major(Mat::new(&by_weight, out, rows).t(), &mut y);
    y
}

/// `y[j] = w_row · x_j` for each row `j` of `x` (`y.len()` rows of `w_row.len()`).
fn dots(w_row: &[f32], x: &[f32], y: &mut [f32]) {
    let k = w_row.len();
    assert!(
        x.len() >= y.len() * k,
        "x holds fewer than {} rows of {k}",
        y.len()
    );
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA; x holds `y.len()` rows of `k` (asserted).
        unsafe {
            match y.len() {
                1 => x86::dots::<1>(w_row, x, y),
                2 => x86::dots::<2>(w_row, x, y),
                3 => x86::dots::<3>(w_row, x, y),
                4 => x86::dots::<4>(w_row, x, y),
                5 => x86::dots::<5>(w_row, x, y),
                6 => x86::dots::<6>(w_row, x, y),
                7 => x86::dots::<7>(w_row, x, y),
                _ => x86::dots::<8>(w_row, x, y),
            }
        }
        return;
    }
    for (j, y) in y.iter_mut().enumerate() {
        *y = portable_dot(w_row, &x[j * k..(j + 1) * k]);
    }
}

/// One dot product in the AVX2 kernel's order: lane `l` sums `w[p]·x[p]` for `p ≡ l`
/// (mod 8) with fused multiply-adds, the lanes are added as its horizontal sum adds
/// them, then the tail in order.
fn portable_dot(w: &[f32], x: &[f32]) -> f32 {
    let full = w.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for base in (0..full).step_by(LANES) {
        for (lane, acc) in acc.iter_mut().enumerate() {
            *acc = w[base + lane].mul_add(x[base + lane], *acc);
        }
    }
    let mut sum = lanes_sum(acc);
    for (w, x) in w[full..].iter().zip(&x[full..]) {
        sum = w.mul_add(*x, sum);
    }
    sum
}

/// Lanes per sum: one AVX2 vector.
const LANES: usize = 8;

/// The lanes added as `_mm256` halves, then pairs, then the last two.
#[inline(always)]
fn lanes_sum(acc: [f32; LANES]) -> f32 {
    let (a, b) = (acc[0] + acc[4], acc[1] + acc[5]);
    let (c, d) = (acc[2] + acc[6], acc[3] + acc[7]);
    (a + c) + (b + d)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{LANES, lanes_sum};
    use std::arch::x86_64::{
        _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };

    /// [`super::dots`] for `R` rows: the weight's 8 values loaded once for all rows,
    /// one vector of sums per row.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `x` holds `R` rows of `w_row.len()`, `y` at least `R`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots<const R: usize>(w_row: &[f32], x: &[f32], y: &mut [f32]) {
        let k = w_row.len();
        let full = k / LANES * LANES;
        let mut acc = [_mm256_setzero_ps(); R];
        let (w, xs) = (w_row.as_ptr(), x.as_ptr());
        for base in (0..full).step_by(LANES) {
            // SAFETY: base + 8 ≤ full ≤ k, inside the weight row and each of the R rows
            // of x (the caller's promise).
            unsafe {
                let wv = _mm256_loadu_ps(w.add(base));
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs.add(j * k + base)), *acc);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            let mut lanes = [0f32; LANES];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *acc) };
            let mut sum = lanes_sum(lanes);
            for i in full..k {
                sum = w_row[i].mul_add(x[j * k + i], sum);
            }
            y[j] = sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::tests::{avx2_here, on_baseline, on_wide};
    use crate::testing::{assert_same_on_any_thread_count, bits, random};

    #[test]
    fn the_product_matches_f64_for_every_row_count() {
        for (rows, k, out) in [
            (1, 16, 3),
            (3, 37, 70),
            (8, 64, 33),
            (5, 7, 100),
            (8, 576, 40),
        ] {
            let (x, w) = (random(rows * k, 1, 1.0), random(out * k, 2, 1.0));
            let y = few_rows_times_weight(&x, rows, &w, out);
            for i in 0..rows {
                for o in 0..out {
                    let want: f64 = (0..k)
                        .map(|p| x[i * k + p] as f64 * w[o * k + p] as f64)
                        .sum();
                    let got = y[i * out + o] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * k as f64,
                        "{rows}×{k}·{out}: ({i}, {o})"
                    );
                }
            }
        }
    }

    #[test]
    fn the_avx2_build_gives_the_baseline_bits() {
        if !avx2_here() {
            eprintln!("skipped: this CPU lacks AVX2 or FMA, so there is no AVX2 build to compare");
            return;
        }
        let (x, w) = (random(6 * 100, 3, 1.0), random(50 * 100, 4, 1.0));
        let run = || bits(&few_rows_times_weight(&x, 6, &w, 50));
        assert!(
            on_wide(run) == on_baseline(run),
            "the AVX2 build changed the bits"
        );
    }

    #[test]
    fn the_bits_do_not_depend_on_the_thread_count() {
        let (x, w) = (random(8 * 96, 5, 1.0), random(200 * 96, 6, 1.0));
        assert_same_on_any_thread_count(|| bits(&few_rows_times_weight(&x, 8, &w, 200)));
    }

    #[test]
    #[should_panic(expected = "this product takes 1 to 8")]
    fn more_rows_than_it_takes_are_refused() {
        few_rows_times_weight(&[0.0; 9], 9, &[0.0; 2], 2);
    }
}
