//! Sums and maxima over slices in a fixed order that vectorises.
//!
//! A plain `iter().sum()` is one serial chain of adds: LLVM may not reorder float
//! additions, so it stays scalar. Here each of 16 lanes accumulates every 16th element,
//! then the lanes are added pairwise. The order depends only on the length, never on
//! threads or alignment, so results are reproducible.

/// Accumulator lanes: one AVX-512 vector or two AVX2 ones.
const LANES: usize = 16;

/// Adds the 16 lane sums pairwise, then the tail's sum.
#[inline(always)]
fn finish(mut acc: [f32; LANES], tail: f32) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// `Σ f(i)` over `0..n` in the lane order above, where `f` reads element `i` of the
/// caller's slices (so one helper serves sums, dots and three-way products).
#[inline(always)]
fn lane_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let full = n / LANES * LANES;
    for base in (0..full).step_by(LANES) {
        for (lane, a) in acc.iter_mut().enumerate() {
            *a += f(base + lane);
        }
    }
    let mut tail = 0.0;
    for i in full..n {
        tail += f(i);
    }
    finish(acc, tail)
}

/// `Σ xᵢ`.
#[inline(always)]
pub(crate) fn sum(xs: &[f32]) -> f32 {
    lane_sum(xs.len(), |i| xs[i])
}

/// `Σ xᵢ²`.
#[inline(always)]
pub(crate) fn sum_squares(xs: &[f32]) -> f32 {
    lane_sum(xs.len(), |i| xs[i] * xs[i])
}

/// `Σ aᵢ·bᵢ` over slices of one length.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let b = &b[..n];
    lane_sum(n, |i| a[i] * b[i])
}

/// `Σ aᵢ·bᵢ·cᵢ` over slices of one length.
#[inline(always)]
pub(crate) fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let n = a.len();
    let (b, c) = (&b[..n], &c[..n]);
    lane_sum(n, |i| a[i] * b[i] * c[i])
}

/// The largest element (−∞ for an empty slice; NaN if any element is NaN).
#[inline]
pub(crate) fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    let mut nan = false;
    for chunk in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            nan |= x.is_nan();
            *a = if x > *a { x } else { *a };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in chunks.remainder().iter().chain(&acc) {
        nan |= x.is_nan();
        m = if x > m { x } else { m };
    }
    if nan { f32::NAN } else { m }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_match_f64_at_every_length() {
        for n in [0usize, 1, 15, 16, 17, 100, 1001] {
            let a: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 11 % 13) as f32 - 6.0) / 3.0).collect();
            let c: Vec<f32> = (0..n).map(|i| ((i * 5 % 7) as f32 - 3.0) / 2.0).collect();
            let f = |x: &f32| *x as f64;
            let close = |got: f32, want: f64, size: f64| {
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * size.max(1.0),
                    "n = {n}: {got} vs {want}"
                )
            };
            let abs: f64 = a.iter().map(|x| f(x).abs()).sum();
            close(sum(&a), a.iter().map(f).sum(), abs);
            let sq: f64 = a.iter().map(|x| f(x) * f(x)).sum();
            close(sum_squares(&a), sq, sq);
            let d2 = |i: usize| f(&a[i]) * f(&b[i]);
            close(
                dot(&a, &b),
                (0..n).map(d2).sum(),
                (0..n).map(|i| d2(i).abs()).sum(),
            );
            let d3 = |i: usize| f(&a[i]) * f(&b[i]) * f(&c[i]);
            close(
                dot3(&a, &b, &c),
                (0..n).map(d3).sum(),
                (0..n).map(|i| d3(i).abs()).sum(),
            );
            let want = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&a), want);
        }
    }

    #[test]
    fn max_sees_nan_and_infinity() {
        let mut xs = vec![1.0f32; 40];
        xs[33] = f32::INFINITY;
        assert_eq!(max(&xs), f32::INFINITY);
        xs[3] = f32::NAN;
        assert!(max(&xs).is_nan());
        xs[3] = 0.0;
        xs[39] = f32::NAN; // in the remainder
        assert!(max(&xs).is_nan());
    }
}
