//! `exp` for `f32` that the compiler can vectorise.
//!
//! The standard library's `f32::exp` calls libm once per element, which keeps every loop
//! around it scalar: the cross-entropy's exps were 7.8 % of the tiny model's step. This
//! one is branch-free arithmetic (comparisons become selects), so a plain loop over a
//! slice compiles to SIMD on whatever the build targets.
//!
//! Method (Cephes `expf`): write `x = n·ln 2 + r` with `n` the nearest integer to
//! `x/ln 2` and `|r| ≤ ln 2 / 2`, take `e^r` from a degree-7 polynomial and multiply by
//! `2^n`, built from the exponent bits in two halves so that `n` may run from −151
//! (subnormal results) to 128 (overflow to +∞) without a branch. `ln 2` is split into
//! a short part whose product with `n` is exact and a correction, so `r` carries no
//! cancellation error. Error ≤ 2 ulp against the exact value on the normal range (the
//! tests sweep it); PEFT parity leaves no room for a cheaper approximation.

/// Above this, `exp` overflows to +∞ (ln f32::MAX ≈ 88.7228); arguments are clamped
/// here so that +∞ keeps its meaning through the arithmetic below.
const HI: f32 = 89.0;
/// Below this, `exp` rounds to 0 (ln 2⁻¹⁵⁰ ≈ −103.97); −∞ is clamped here.
const LO: f32 = -105.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `1.5·2²³`: adding and subtracting it rounds an `f32` of magnitude < 2²² to the
/// nearest integer (ties to even) without a call to `roundf`.
const ROUND: f32 = 12_582_912.0;
/// High part of ln 2: nine significant bits, so `n·LN2_HI` is exact for |n| < 2¹⁵.
const LN2_HI: f32 = 0.693_359_4;
/// ln 2 − `LN2_HI`.
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' minimax coefficients for `(e^r − 1 − r)/r²` on |r| ≤ ln 2 / 2.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5, // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
];

/// `e^x` within 2 ulp for results in the normal range; +∞ above ≈ 88.72 and for +∞,
/// exactly 0 below ≈ −103.97 and for −∞, NaN for NaN. Subnormal results (x between
/// −103.97 and −87.34) are rounded once, so they are off by at most one unit of 2⁻¹⁴⁹
/// beyond the polynomial's relative error.
///
/// `#[inline(always)]` so that loops calling it vectorise; see [`exp_in_place`].
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Comparisons with NaN are false, so NaN passes through both selects.
    let x = if x > HI { HI } else { x };
    let x = if x < LO { LO } else { x };
    // n = round(x / ln 2): after adding ROUND the integer sits in the low mantissa bits
    // (read below without a float-to-int conversion, which would not vectorise: `as`
    // saturates lane by lane); subtracting ROUND gives it back as an exact f32.
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = P[0];
    p = p * r + P[1];
    p = p * r + P[2];
    p = p * r + P[3];
    p = p * r + P[4];
    p = p * r + P[5];
    let er = p * (r * r) + r + 1.0;
    // 2^n = 2^(n >> 1) · 2^(n − (n >> 1)): both halves lie in [−76, 64], normal floats,
    // so the first product is exact and the second rounds once. For NaN the bits are
    // meaningless, but `er` is NaN and carries through.
    let n = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let n1 = n >> 1;
    let n2 = n - n1;
    er * pow2(n1) * pow2(n2)
}

/// `2^k` for `k` in the normal exponent range [−126, 127], from the exponent bits.
#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits((k.wrapping_add(127) as u32) << 23)
}

/// Lanes per step of [`exp_in_place`]: one AVX-512 vector, two AVX2 vectors.
const LANES: usize = 16;

/// Replaces each element by its [`exp`], in place. Written as fixed 16-lane steps plus a
/// remainder so that LLVM turns the body into SIMD; the result of each element is the
/// same as a scalar call of [`exp`], whatever the slice's length or alignment.
pub fn exp_in_place(xs: &mut [f32]) {
    let mut lanes = xs.chunks_exact_mut(LANES);
    for chunk in &mut lanes {
        for x in chunk.iter_mut() {
            *x = exp(*x);
        }
    }
    for x in lanes.into_remainder() {
        *x = exp(*x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The spacing of `f32` values at the exact result `want` (> 0): one ulp, with the
    /// subnormal spacing 2⁻¹⁴⁹ as the floor.
    fn ulp(want: f64) -> f64 {
        let min_normal = f32::MIN_POSITIVE as f64;
        if want < min_normal {
            2f64.powi(-149)
        } else {
            2f64.powi(want.log2().floor() as i32 - 23)
        }
    }

    /// Error of `exp(x)` in ulp of the exact value.
    fn ulp_error(x: f32) -> f64 {
        let want = (x as f64).exp();
        let got = exp(x) as f64;
        (got - want).abs() / ulp(want)
    }

    #[test]
    fn within_two_ulp_on_the_normal_range() {
        let (lo, hi) = (-87.3f64, 88.7f64);
        let steps = 1 << 21;
        let mut worst = (0.0, 0.0f32);
        let mut check = |x: f32| {
            let e = ulp_error(x);
            if e > worst.0 {
                worst = (e, x);
            }
        };
        // A dense sweep, then random points, then floats of both signs spread over the
        // binades from 2⁻⁷ down to ~1e-32, where n = 0 and only the polynomial acts.
        for i in 0..=steps {
            check((lo + (hi - lo) * i as f64 / steps as f64) as f32);
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for _ in 0..1_000_000 {
            check(rng.random_range(lo as f32..hi as f32));
        }
        for i in 0..200_000u32 {
            check(f32::from_bits(0x3c00_0000 - i * 4099));
            check(-f32::from_bits(0x3c00_0000 - i * 4099));
        }
        assert!(worst.0 <= 2.0, "{} ulp at x = {:e}", worst.0, worst.1);
    }

    /// Every `f32` in [−87.3, 88.7] (about 2.2·10⁹ values; a minute on two cores):
    /// `cargo test -p tuneq-kernels every_float -- --ignored`.
    #[test]
    #[ignore = "slow: run by hand after changing exp"]
    fn within_two_ulp_for_every_float_in_the_normal_range() {
        use rayon::prelude::*;
        let ranges = [
            (0u32, 88.7f32.to_bits()),
            (1u32 << 31, (-87.3f32).to_bits()),
        ];
        let worst = ranges
            .into_par_iter()
            .flat_map(|(lo, hi)| (lo..=hi).into_par_iter())
            .fold(
                || (0.0f64, 0u32),
                |acc, bits| {
                    let e = ulp_error(f32::from_bits(bits));
                    if e > acc.0 { (e, bits) } else { acc }
                },
            )
            .reduce(|| (0.0, 0), |a, b| if b.0 > a.0 { b } else { a });
        let x = f32::from_bits(worst.1);
        assert!(worst.0 <= 2.0, "{} ulp at x = {x:e}", worst.0);
        eprintln!("worst {} ulp at x = {x:e}", worst.0);
    }

    #[test]
    fn subnormal_results_are_rounded_once() {
        // Below −87.34 the result is subnormal: error ≤ 2 units of the local spacing.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        for _ in 0..100_000 {
            let x = rng.random_range(-103.9f32..-87.3);
            assert!(ulp_error(x) <= 2.0, "x = {x}: {} ulp", ulp_error(x));
        }
    }

    #[test]
    fn edges_overflow_underflow_and_nan() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(88.73), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(88.72).is_finite());
        assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(exp(-104.0).to_bits(), 0);
        assert_eq!(exp(-1e30).to_bits(), 0);
        assert!(exp(-103.9) > 0.0, "2⁻¹⁴⁹ is still representable");
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-f32::NAN).is_nan());
    }

    #[test]
    fn the_slice_version_equals_the_scalar_one() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        // Lengths around the lane width, and an offset start so alignment varies.
        for len in [0, 1, 15, 16, 17, 33, 1000] {
            let data: Vec<f32> = (0..len + 1)
                .map(|_| rng.random_range(-110.0f32..90.0))
                .collect();
            let mut got = data.clone();
            exp_in_place(&mut got[1..]);
            assert_eq!(got[0], data[0]);
            for (g, x) in got[1..].iter().zip(&data[1..]) {
                assert_eq!(g.to_bits(), exp(*x).to_bits(), "x = {x}");
            }
        }
    }
}
