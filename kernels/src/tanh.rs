//! `tanh` for `f32` that the compiler can vectorise: Gemma's soft-caps (`c·tanh(x/c)` on
//! attention scores and final logits) and the tanh approximation of GELU in its MLP run
//! it once per score, logit or MLP activation, where the standard library's `f32::tanh`
//! (one libm call per element) would keep each loop scalar.
//!
//! Method (Cephes `tanhf`): for `|x| < 0.625` an odd minimax polynomial
//! `x + x³·P(x²)`, which keeps full relative precision near 0 where `1 − e^(−2|x|)`
//! would cancel; above, `1 − 2/(e^(2|x|) + 1)` with the crate's [`exp`](crate::exp::exp),
//! the sign put back. Both branches are computed and one selected, so there is no
//! branch in a loop. Within 3 ulp of the exact value (the tests sweep it); ±1 past
//! `|x| ≈ 9`, NaN for NaN.

use crate::exp::exp;

/// Below this magnitude the polynomial is used.
const SMALL: f32 = 0.625;

/// Cephes' minimax coefficients of `(tanh(x) − x)/x³` in `z = x²`, highest first.
const P: [f32; 5] = [
    -5.704_988_7e-3,
    2.063_909e-2,
    -5.373_971_6e-2,
    1.333_144_2e-1,
    -3.333_328e-1,
];

/// `tanh(x)` within 3 ulp; see the module notes.
///
/// `#[inline(always)]` so that loops calling it vectorise.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut p = P[0];
    p = p * z + P[1];
    p = p * z + P[2];
    p = p * z + P[3];
    p = p * z + P[4];
    // copysign keeps −0's sign, which `x + (−0)·…` would round away.
    let small = (p * z * x + x).copysign(x);
    // exp saturates to +∞ past 89, where 2/(∞ + 1) is 0 and the result exactly 1.
    let large = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    let large = if x < 0.0 { -large } else { large };
    if a < SMALL { small } else { large }
}

/// Gemma 2's soft-cap in place, `x ← c·tanh(x/c)` (divide, tanh, multiply, as
/// transformers computes it), of attention scores or final logits; with `slopes` (as
/// long as `values`), also each value's derivative `1 − tanh²` there, the backward's
/// factor.
#[inline(always)]
pub(crate) fn soft_cap(values: &mut [f32], cap: f32, slopes: Option<&mut [f32]>) {
    match slopes {
        None => values.iter_mut().for_each(|x| *x = tanh(*x / cap) * cap),
        Some(slopes) => values.iter_mut().zip(slopes).for_each(|(x, d)| {
            let t = tanh(*x / cap);
            *x = t * cap;
            *d = 1.0 - t * t;
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Error of `tanh(x)` in ulp of the exact value (the spacing of f32 at it).
    fn ulp_error(x: f32) -> f64 {
        let want = (x as f64).tanh();
        let spacing = if want.abs() < f32::MIN_POSITIVE as f64 {
            2f64.powi(-149)
        } else {
            2f64.powi(want.abs().log2().floor() as i32 - 23)
        };
        (tanh(x) as f64 - want).abs() / spacing
    }

    #[test]
    fn within_three_ulp_over_the_range_that_matters() {
        let mut worst = (0.0, 0.0f32);
        let mut check = |x: f32| {
            let e = ulp_error(x);
            if e > worst.0 {
                worst = (e, x);
            }
        };
        let steps = 1 << 20;
        for i in 0..=steps {
            check(-12.0 + 24.0 * i as f32 / steps as f32);
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        for _ in 0..500_000 {
            check(rng.random_range(-1.0f32..1.0));
        }
        // Tiny magnitudes of both signs, where tanh(x) is x to the last bit.
        for i in 0..100_000u32 {
            check(f32::from_bits(0x3c00_0000 - i * 4099));
            check(-f32::from_bits(0x3c00_0000 - i * 4099));
        }
        assert!(worst.0 <= 3.0, "{} ulp at x = {:e}", worst.0, worst.1);
    }

    #[test]
    fn edges_saturate_and_keep_nan_and_zero() {
        assert_eq!(tanh(0.0).to_bits(), 0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0f32).to_bits());
        assert_eq!(tanh(20.0), 1.0);
        assert_eq!(tanh(-20.0), -1.0);
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(1e30), 1.0);
        assert!(tanh(f32::NAN).is_nan());
        // Odd, bit for bit.
        for x in [0.1f32, 0.624, 0.626, 1.5, 7.0] {
            assert_eq!(tanh(-x).to_bits(), (-tanh(x)).to_bits(), "x = {x}");
        }
    }
}
