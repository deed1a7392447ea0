//! The gated MLP activations, `h = act(g)·u`, forward and backward in one pass each:
//! SwiGLU (`act = silu`, Llama's and most families') and GeGLU with tanh-approximated
//! GELU (Gemma's `gelu_pytorch_tanh`).
//!
//! The fused step computes gate and up with one GEMM against `[W_gate; W_up]`, so each
//! token row of its output is `[g (I) | u (I)]`. The forward reads that buffer and
//! writes `h`; `h` is not kept, because backward recomputes the activation anyway. The
//! backward writes `[dg | du]` in the same layout, which is what the single dX GEMM
//! against `[W_gate; W_up]` reads. candle's composed version keeps `silu(g)` and `h`
//! and makes about 25 passes over N × I; this makes 2 forward and 5 backward.
//!
//! SiLU, with `s = σ(g) = 1/(1 + e^(−g))`: `silu(g) = g·s`,
//! `d silu/dg = s·(1 + g·(1 − s))`. GELU's tanh form, with `k = √(2/π)` and
//! `t = tanh(k·(g + 0.044715·g³))`: `gelu(g) = g/2·(1 + t)`,
//! `d gelu/dg = (1 + t)/2 + g/2·(1 − t²)·k·(1 + 3·0.044715·g²)`. The exp and tanh are
//! the crate's ([`crate::exp::exp`], [`crate::tanh::tanh`]), so the loops vectorise.
//! Rows are independent; rayon runs fixed blocks of [`ROWS`] rows.

use crate::exp::exp;
use crate::tanh::tanh;
use rayon::prelude::*;

/// Rows (tokens) per parallel task.
pub const ROWS: usize = 16;

/// `√(2/π)`, GELU's tanh-approximation constant.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term's coefficient in GELU's tanh approximation.
const GELU_CUBIC: f32 = 0.044_715;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// `silu(g) = g·σ(g)`: SwiGLU.
    Silu,
    /// GELU in its tanh approximation (PyTorch's `gelu(approximate="tanh")`): GeGLU.
    GeluTanh,
}

/// `σ(g)`; saturates to exactly 0 and 1 far out, never NaN for finite `g`.
#[inline(always)]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + exp(-g))
}

/// `tanh(k·(g + 0.044715·g³))`, the tanh of GELU's approximation.
#[inline(always)]
fn gelu_tanh_of(g: f32) -> f32 {
    tanh(SQRT_2_OVER_PI * (g + GELU_CUBIC * g * g * g))
}

/// `out = act(g)·u` for each row `[g | u]` of `gu` (rows of `2·inter`); `out` holds the
/// same number of rows of `inter`.
///
/// # Panics
/// If `inter` is 0 or the lengths do not agree.
pub fn glu_forward(gu: &[f32], inter: usize, gate: Gate, out: &mut [f32]) {
    let rows = check_rows(gu.len(), inter);
    assert_eq!(out.len(), rows * inter, "out is not {rows} rows of {inter}");
    gu.par_chunks(ROWS * 2 * inter)
        .zip(out.par_chunks_mut(ROWS * inter))
        .for_each(|(gu, out)| forward_rows(gu, inter, gate, out));
}

crate::simd::wide_twin!(
    /// [`glu_forward`] on some rows.
    fn forward_rows(gu: &[f32], inter: usize, gate: Gate, out: &mut [f32]) {
        for (gu, out) in gu.chunks(2 * inter).zip(out.chunks_mut(inter)) {
            let (g, u) = gu.split_at(inter);
            let lanes = out.iter_mut().zip(g).zip(u);
            match gate {
                Gate::Silu => lanes.for_each(|((o, &g), &u)| *o = g * sigmoid(g) * u),
                Gate::GeluTanh => lanes.for_each(|((o, &g), &u)| {
                    *o = 0.5 * g * (1.0 + gelu_tanh_of(g)) * u;
                }),
            }
        }
    }
);

/// The gradients of [`glu_forward`] with respect to `g` and `u`, given `d_out`, the
/// gradient of its output: writes each row of `d_gu` as `[dg | du]` with
/// `dg = dh·u·act'(g)` and `du = dh·act(g)` (see the module notes for `act'`).
///
/// # Panics
/// If `inter` is 0 or the lengths do not agree: `d_gu` is shaped like `gu`, `d_out`
/// like the forward's `out`.
pub fn glu_backward(gu: &[f32], inter: usize, gate: Gate, d_out: &[f32], d_gu: &mut [f32]) {
    let rows = check_rows(gu.len(), inter);
    assert_eq!(
        d_out.len(),
        rows * inter,
        "d_out is not {rows} rows of {inter}"
    );
    assert_eq!(d_gu.len(), gu.len(), "d_gu and gu differ in length");
    gu.par_chunks(ROWS * 2 * inter)
        .zip(d_out.par_chunks(ROWS * inter))
        .zip(d_gu.par_chunks_mut(ROWS * 2 * inter))
        .for_each(|((gu, d_out), d_gu)| backward_rows(gu, inter, gate, d_out, d_gu));
}

crate::simd::wide_twin!(
    /// [`glu_backward`] on some rows.
    fn backward_rows(gu: &[f32], inter: usize, gate: Gate, d_out: &[f32], d_gu: &mut [f32]) {
        let rows = gu.chunks(2 * inter).zip(d_out.chunks(inter));
        for ((gu, dh), d_gu) in rows.zip(d_gu.chunks_mut(2 * inter)) {
            let (g, u) = gu.split_at(inter);
            let (dg, du) = d_gu.split_at_mut(inter);
            let lanes = g.iter().zip(u).zip(dh).zip(dg.iter_mut().zip(du));
            match gate {
                Gate::Silu => lanes.for_each(|(((&g, &u), &dh), (dg, du))| {
                    let s = sigmoid(g);
                    *dg = dh * u * s * (1.0 + g * (1.0 - s));
                    *du = dh * (g * s);
                }),
                Gate::GeluTanh => lanes.for_each(|(((&g, &u), &dh), (dg, du))| {
                    let t = gelu_tanh_of(g);
                    let inner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * g * g);
                    let slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * inner;
                    *dg = dh * u * slope;
                    *du = dh * (0.5 * g * (1.0 + t));
                }),
            }
        }
    }
);

/// The number of `[g | u]` rows in a buffer of `len`.
fn check_rows(len: usize, inter: usize) -> usize {
    assert!(inter > 0, "a gated MLP over an intermediate width of 0");
    assert_eq!(
        len % (2 * inter),
        0,
        "{len} elements are not rows of [gate | up] of 2·{inter}"
    );
    len / (2 * inter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_on_any_thread_count, bits, random};

    fn sigmoid64(g: f64) -> f64 {
        1.0 / (1.0 + (-g).exp())
    }

    /// Gate values spread over [−12, 12] plus saturating and exact ones.
    fn gates_and_ups(rows: usize, inter: usize, seed: u64) -> Vec<f32> {
        let mut gu = random(rows * 2 * inter, seed, 1.0);
        let special = [0.0, -0.0, 100.0, -100.0, 88.0, -88.0, -1.278, 30.0, -30.0];
        for (r, row) in gu.chunks_mut(2 * inter).enumerate() {
            for (j, g) in row[..inter].iter_mut().enumerate() {
                *g = match (r * inter + j) % 13 {
                    k if k < special.len() => special[k],
                    _ => *g * 12.0,
                };
            }
        }
        gu
    }

    #[test]
    fn matches_the_f64_reference() {
        for (rows, inter) in [(1, 1), (5, 7), (37, 64)] {
            let gu = gates_and_ups(rows, inter, 1);
            let dh = random(rows * inter, 2, 1.0);
            let mut out = vec![f32::NAN; rows * inter];
            glu_forward(&gu, inter, Gate::Silu, &mut out);
            let mut d_gu = vec![f32::NAN; rows * 2 * inter];
            glu_backward(&gu, inter, Gate::Silu, &dh, &mut d_gu);
            for r in 0..rows {
                for j in 0..inter {
                    let g = gu[r * 2 * inter + j] as f64;
                    let u = gu[r * 2 * inter + inter + j] as f64;
                    let d = dh[r * inter + j] as f64;
                    let s = sigmoid64(g);
                    let at = format!("{rows}×{inter} ({r}, {j}) g = {g}");
                    // Products and one sigmoid: relative to the value itself, plus the
                    // f32 underflow level: for g ≤ −88, e^(−g) overflows and σ(g) is 0
                    // (as in PyTorch's f32 SiLU), where the exact value is ~1e-42.
                    let close = |got: f32, want: f64, size: f64| {
                        assert!(
                            (got as f64 - want).abs() <= 1e-5 * size + f32::MIN_POSITIVE as f64,
                            "{at}: {got} vs {want}"
                        );
                    };
                    close(out[r * inter + j], g * s * u, (g * s * u).abs());
                    close(
                        d_gu[r * 2 * inter + inter + j],
                        d * g * s,
                        (d * g * s).abs(),
                    );
                    // dg's factor 1 + g·(1 − s) cancels near g ≈ −1.28: bound the error by
                    // the size of its terms instead.
                    let dg = d * u * s * (1.0 + g * (1.0 - s));
                    let size = (d * u * s).abs() * (1.0 + (g * (1.0 - s)).abs());
                    close(d_gu[r * 2 * inter + j], dg, size);
                }
            }
        }
    }

    /// The reference's derivative formula itself, against central differences of
    /// silu(g)·u in f64.
    #[test]
    fn the_gradient_formula_agrees_with_finite_differences() {
        let f = |g: f64, u: f64| g * sigmoid64(g) * u;
        for (g, u) in [(0.3, -0.7), (-1.278, 2.0), (-5.0, 1.0), (7.0, 0.5)] {
            let (gf, uf) = (g as f32, u as f32);
            let mut d = [0f32; 2];
            glu_backward(&[gf, uf], 1, Gate::Silu, &[1.0], &mut d);
            let (g, u) = (gf as f64, uf as f64);
            let eps = 1e-6;
            let fd_g = (f(g + eps, u) - f(g - eps, u)) / (2.0 * eps);
            let fd_u = (f(g, u + eps) - f(g, u - eps)) / (2.0 * eps);
            assert!(
                (d[0] as f64 - fd_g).abs() <= 1e-5 * (1.0 + fd_g.abs()),
                "dg at {g}"
            );
            assert!(
                (d[1] as f64 - fd_u).abs() <= 1e-5 * (1.0 + fd_u.abs()),
                "du at {g}"
            );
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (rows, inter) = (67, 48);
        let gu = gates_and_ups(rows, inter, 3);
        let dh = random(rows * inter, 4, 1.0);
        assert_same_on_any_thread_count(|| {
            let mut out = vec![0f32; rows * inter];
            glu_forward(&gu, inter, Gate::Silu, &mut out);
            let mut d_gu = vec![0f32; rows * 2 * inter];
            glu_backward(&gu, inter, Gate::Silu, &dh, &mut d_gu);
            (bits(&out), bits(&d_gu))
        });
    }

    #[test]
    #[should_panic(expected = "not rows of [gate | up]")]
    fn a_ragged_buffer_is_refused() {
        let mut out = [0f32; 2];
        glu_forward(&[0.0; 9], 2, Gate::Silu, &mut out);
    }

    fn gelu64(g: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * g * (1.0 + (k * (g + 0.044715 * g * g * g)).tanh())
    }

    #[test]
    fn geglu_matches_the_f64_reference_and_finite_differences() {
        let (rows, inter) = (37, 64);
        let gu = gates_and_ups(rows, inter, 5);
        let dh = random(rows * inter, 6, 1.0);
        let mut out = vec![f32::NAN; rows * inter];
        glu_forward(&gu, inter, Gate::GeluTanh, &mut out);
        let mut d_gu = vec![f32::NAN; rows * 2 * inter];
        glu_backward(&gu, inter, Gate::GeluTanh, &dh, &mut d_gu);
        for r in 0..rows {
            for j in 0..inter {
                let g = gu[r * 2 * inter + j] as f64;
                let u = gu[r * 2 * inter + inter + j] as f64;
                let d = dh[r * inter + j] as f64;
                let at = format!("({r}, {j}) g = {g}");
                let eps = 1e-6 * (1.0 + g.abs());
                let slope = (gelu64(g + eps) - gelu64(g - eps)) / (2.0 * eps);
                let checks = [
                    (out[r * inter + j], gelu64(g) * u, (g * u).abs()),
                    (
                        d_gu[r * 2 * inter + inter + j],
                        d * gelu64(g),
                        (d * g).abs(),
                    ),
                    (d_gu[r * 2 * inter + j], d * u * slope, (d * u).abs()),
                ];
                for (got, want, size) in checks {
                    assert!(
                        (got as f64 - want).abs() <= 2e-6 * size + 1e-30,
                        "{at}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn geglu_does_not_depend_on_the_thread_count() {
        let (rows, inter) = (67, 48);
        let gu = gates_and_ups(rows, inter, 7);
        let dh = random(rows * inter, 8, 1.0);
        assert_same_on_any_thread_count(|| {
            let mut out = vec![0f32; rows * inter];
            glu_forward(&gu, inter, Gate::GeluTanh, &mut out);
            let mut d_gu = vec![0f32; rows * 2 * inter];
            glu_backward(&gu, inter, Gate::GeluTanh, &dh, &mut d_gu);
            (bits(&out), bits(&d_gu))
        });
    }
}
