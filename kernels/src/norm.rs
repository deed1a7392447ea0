//! RMSNorm over rows, forward and backward, as in Hugging Face's `LlamaRMSNorm`:
//! `y = w · x · r` with `r = 1/√(mean(x²) + ε)`, computed in `f32`.
//!
//! candle's composed version makes 8 passes over the activations forward and about 14
//! backward; here the forward reads `x` twice and writes `y` once, saving `r` per row,
//! and the backward reads `x` and `dy` twice and writes `dx` once. The weight is frozen
//! in LoRA training, so there is no weight gradient, and the backward can add into `dx`
//! so the residual stream's gradient needs no separate pass.
//!
//! Rows are independent; rayon runs fixed blocks of [`ROWS`] rows, and every row's
//! arithmetic is the same whichever block or thread runs it.

use crate::reduce::{dot3, sum_squares};
use rayon::prelude::*;

/// Rows per parallel task: enough work per task (16·h elements) to pay for the task.
pub const ROWS: usize = 16;

/// Normalises each row of `x` (rows of width `weight.len()`) into `out`:
/// `out = (x · r) · weight` with `r = 1/√(mean(x²) + eps)`, and stores each row's `r`
/// in `inv_rms` for [`rms_norm_backward`].
///
/// The sum of squares is accumulated in `f32` over 16 lanes, like the vectorised
/// reductions of PyTorch and candle, not in `f64`.
///
/// # Panics
/// If `weight` is empty or the lengths do not agree: `x` and `out` hold `inv_rms.len()`
/// rows of `weight.len()` elements.
pub fn rms_norm_forward(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], inv_rms: &mut [f32]) {
    let h = weight.len();
    check_shapes(h, x.len(), inv_rms.len());
    assert_eq!(out.len(), x.len(), "out and x differ in length");
    x.par_chunks(ROWS * h)
        .zip(out.par_chunks_mut(ROWS * h))
        .zip(inv_rms.par_chunks_mut(ROWS))
        .for_each(|((x, out), inv_rms)| forward_rows(x, weight, eps, out, inv_rms));
}

crate::simd::wide_twin!(
    /// [`rms_norm_forward`] on some rows.
    fn forward_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], inv_rms: &mut [f32]) {
        let h = weight.len();
        for ((x, out), r) in x.chunks(h).zip(out.chunks_mut(h)).zip(inv_rms) {
            *r = 1.0 / (sum_squares(x) / h as f32 + eps).sqrt();
            let r = *r;
            for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(weight) {
                *o = xi * r * wi;
            }
        }
    }
);

/// The gradient with respect to `x` of [`rms_norm_forward`] given `dy`, the gradient of
/// its output, and the `inv_rms` it saved:
/// `dx = r · (dy·w − x · r² · mean(dy·w·x))`.
///
/// With `accumulate`, the result is added to what `dx` holds (the residual branch's
/// gradient, say); otherwise `dx` is overwritten. The weight gets no gradient (frozen).
///
/// # Panics
/// If `weight` is empty or the lengths do not agree: `x`, `dy` and `dx` hold
/// `inv_rms.len()` rows of `weight.len()` elements.
pub fn rms_norm_backward(
    x: &[f32],
    weight: &[f32],
    inv_rms: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) {
    let h = weight.len();
    check_shapes(h, x.len(), inv_rms.len());
    assert_eq!(dy.len(), x.len(), "dy and x differ in length");
    assert_eq!(dx.len(), x.len(), "dx and x differ in length");
    x.par_chunks(ROWS * h)
        .zip(dy.par_chunks(ROWS * h))
        .zip(dx.par_chunks_mut(ROWS * h))
        .zip(inv_rms.par_chunks(ROWS))
        .for_each(|(((x, dy), dx), inv_rms)| backward_rows(x, weight, inv_rms, dy, dx, accumulate));
}

crate::simd::wide_twin!(
    /// [`rms_norm_backward`] on some rows.
    fn backward_rows(
        x: &[f32],
        weight: &[f32],
        inv_rms: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        accumulate: bool,
    ) {
        let h = weight.len();
        let rows = x.chunks(h).zip(dy.chunks(h)).zip(dx.chunks_mut(h));
        for (((x, dy), dx), &r) in rows.zip(inv_rms) {
            let c = r * r * (dot3(dy, weight, x) / h as f32);
            let terms = dy.iter().zip(weight).zip(x).map(|((&g, &w), &xi)| {
                // Written as one expression for both branches so they round alike.
                r * (g * w - xi * c)
            });
            if accumulate {
                dx.iter_mut().zip(terms).for_each(|(d, t)| *d += t);
            } else {
                dx.iter_mut().zip(terms).for_each(|(d, t)| *d = t);
            }
        }
    }
);

fn check_shapes(h: usize, len: usize, rows: usize) {
    assert!(h > 0, "RMSNorm over rows of width 0");
    assert_eq!(
        len,
        rows * h,
        "{len} elements are not {rows} rows of {h} (one inv_rms per row)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_on_any_thread_count, bits, random};

    /// Forward and backward in f64, the composed formulas of `trainer::ops::rms_norm`:
    /// x̂ = x·r, y = x̂·w, dx = r·(g·w − x̂·mean(g·w·x̂)). Returns (y, r, dx, and per
    /// element the size of dx's terms, r·(|g·w| + |x̂·mean|), which bounds its rounding).
    fn reference(
        x: &[f32],
        w: &[f32],
        eps: f32,
        dy: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let h = w.len();
        let (mut y, mut rs, mut dx, mut size) = (vec![], vec![], vec![], vec![]);
        for (x, g) in x.chunks(h).zip(dy.chunks(h)) {
            let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h as f64;
            let r = 1.0 / (ms + eps as f64).sqrt();
            rs.push(r);
            let xhat: Vec<f64> = x.iter().map(|&v| v as f64 * r).collect();
            let gw: Vec<f64> = g
                .iter()
                .zip(w)
                .map(|(&g, &w)| g as f64 * w as f64)
                .collect();
            let mean: f64 = gw.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / h as f64;
            for j in 0..h {
                y.push(xhat[j] * w[j] as f64);
                dx.push(r * (gw[j] - xhat[j] * mean));
                size.push(r * (gw[j].abs() + (xhat[j] * mean).abs()));
            }
        }
        (y, rs, dx, size)
    }

    #[test]
    fn matches_the_f64_reference() {
        let eps = 1e-5;
        for (rows, h, scale) in [
            (1, 1, 1.0),
            (3, 7, 1.0),
            (37, 64, 1.0),
            (20, 100, 300.0),
            (17, 48, 1e-3),
        ] {
            let x = random(rows * h, 1, scale);
            let w = random(h, 2, 2.0);
            let dy = random(rows * h, 3, 1.0);
            let (y_ref, r_ref, dx_ref, size) = reference(&x, &w, eps, &dy);
            let mut y = vec![f32::NAN; rows * h];
            let mut r = vec![f32::NAN; rows];
            rms_norm_forward(&x, &w, eps, &mut y, &mut r);
            for (i, (&got, &want)) in r.iter().zip(&r_ref).enumerate() {
                let err = (got as f64 - want).abs() / want;
                assert!(err <= 1e-6, "{rows}×{h}: inv_rms[{i}] {got} vs {want}");
            }
            // Forward: a few roundings per element, so relative to the element itself.
            for (i, (&got, &want)) in y.iter().zip(&y_ref).enumerate() {
                let err = (got as f64 - want).abs();
                assert!(
                    err <= 1e-5 * want.abs(),
                    "{rows}×{h}: y[{i}] {got} vs {want}"
                );
            }
            // Backward: dx is a difference of two terms, so its rounding is relative to
            // their size, not to dx (which can cancel to ~0).
            let mut dx = vec![f32::NAN; rows * h];
            rms_norm_backward(&x, &w, &r, &dy, &mut dx, false);
            for i in 0..rows * h {
                let err = (dx[i] as f64 - dx_ref[i]).abs();
                assert!(
                    err <= 1e-5 * size[i],
                    "{rows}×{h}: dx[{i}] {} vs {}",
                    dx[i],
                    dx_ref[i]
                );
            }
        }
    }

    #[test]
    fn the_backward_agrees_with_finite_differences() {
        let (rows, h, eps) = (2, 5, 1e-5f32);
        let x = random(rows * h, 4, 1.0);
        let w = random(h, 5, 1.0);
        let dy = random(rows * h, 6, 1.0);
        // L(x) = Σ dy·y(x), so dL/dx = dx; central differences in f64 on the f64 forward.
        let loss = |x: &[f64]| -> f64 {
            let mut l = 0.0;
            for (row, g) in x.chunks(h).zip(dy.chunks(h)) {
                let ms: f64 = row.iter().map(|v| v * v).sum::<f64>() / h as f64;
                let r = 1.0 / (ms + eps as f64).sqrt();
                for j in 0..h {
                    l += g[j] as f64 * row[j] * r * w[j] as f64;
                }
            }
            l
        };
        let mut y = vec![0f32; rows * h];
        let mut r = vec![0f32; rows];
        rms_norm_forward(&x, &w, eps, &mut y, &mut r);
        let mut dx = vec![0f32; rows * h];
        rms_norm_backward(&x, &w, &r, &dy, &mut dx, false);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for i in 0..rows * h {
            let d = 1e-6;
            let (mut plus, mut minus) = (x64.clone(), x64.clone());
            plus[i] += d;
            minus[i] -= d;
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * d);
            assert!(
                (fd - dx[i] as f64).abs() <= 1e-5 * (1.0 + fd.abs()),
                "dx[{i}]: {} vs finite difference {fd}",
                dx[i]
            );
        }
    }

    #[test]
    fn accumulate_adds_the_gradient_to_dx() {
        let (rows, h) = (19, 24);
        let x = random(rows * h, 7, 1.0);
        let w = random(h, 8, 1.0);
        let dy = random(rows * h, 9, 1.0);
        let mut y = vec![0f32; rows * h];
        let mut r = vec![0f32; rows];
        rms_norm_forward(&x, &w, 1e-6, &mut y, &mut r);
        let mut fresh = random(rows * h, 10, 1.0);
        rms_norm_backward(&x, &w, &r, &dy, &mut fresh, false);
        let residual = random(rows * h, 11, 1.0);
        let mut summed = residual.clone();
        rms_norm_backward(&x, &w, &r, &dy, &mut summed, true);
        for i in 0..rows * h {
            assert_eq!(summed[i].to_bits(), (residual[i] + fresh[i]).to_bits());
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (rows, h) = (53, 40);
        let x = random(rows * h, 12, 1.0);
        let w = random(h, 13, 1.0);
        let dy = random(rows * h, 14, 1.0);
        assert_same_on_any_thread_count(|| {
            let mut y = vec![0f32; rows * h];
            let mut r = vec![0f32; rows];
            rms_norm_forward(&x, &w, 1e-5, &mut y, &mut r);
            let mut dx = vec![0f32; rows * h];
            rms_norm_backward(&x, &w, &r, &dy, &mut dx, false);
            (bits(&y), bits(&r), bits(&dx))
        });
    }

    #[test]
    #[should_panic(expected = "not 3 rows of 4")]
    fn a_short_buffer_is_refused() {
        let mut out = [0f32; 11];
        let mut r = [0f32; 3];
        rms_norm_forward(&[0.0; 11], &[1.0; 4], 1e-5, &mut out, &mut r);
    }
}
