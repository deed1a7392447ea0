//! Running the crate's own loops 8 lanes wide where the CPU allows.
//!
//! The crate is compiled for baseline x86-64 (SSE2, 4 lanes), so that one binary runs
//! on every x86-64 machine; the GEMM libraries pick AVX2 or AVX-512 kernels at run time
//! themselves, but the loops here (softmax, exp, norms, SwiGLU, the attention's masking
//! and scaling) would stay 4 lanes wide. [`wide_twin!`] defines a function that runs an
//! `#[inline(always)]` body through a twin compiled with AVX2 and FMA enabled when the
//! CPU has them, and through the baseline build otherwise. Rust never contracts
//! `a·b + c` into an FMA on its own and never reorders float arithmetic, so both builds
//! compute the same bits (tested): a checkpoint resumed on a CPU without AVX2 replays
//! the same step.
//!
//! The `unsafe` the macro expands to is the call of the twin, made only after the CPU
//! was checked for both features.

#![allow(unsafe_code)]

/// Whether this CPU has AVX2 and FMA (checked once), and no test asked for the
/// baseline build.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    let has = *HAS.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    });
    has && !baseline_forced()
}

/// Whether a test asked for the baseline build (never outside tests).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn baseline_forced() -> bool {
    #[cfg(test)]
    {
        tests::forced()
    }
    #[cfg(not(test))]
    {
        false
    }
}

/// `wide_twin!(vis fn name(arg: Type, …) -> Ret { … });` defines `name`, whose body is
/// compiled twice: with AVX2 and FMA, taken when the CPU has them (see the module
/// notes), and as the crate is compiled, taken otherwise.
macro_rules! wide_twin {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        #[allow(unsafe_code)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn wide($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if $crate::simd::avx2_fma() {
                    // SAFETY: the CPU has AVX2 and FMA, the features `wide` is compiled for.
                    return unsafe { wide($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use wide_twin;

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{PoisonError, RwLock};

    /// Set while a test runs the baseline (4-lane) version. Other tests running at the
    /// same time then take it too, which changes their speed, not their bits.
    static BASELINE: AtomicBool = AtomicBool::new(false);

    /// Held for writing while the baseline is forced, for reading by [`on_wide`]: a run
    /// that must take the AVX2 build never overlaps a forced baseline.
    static SWITCH: RwLock<()> = RwLock::new(());

    pub(super) fn forced() -> bool {
        BASELINE.load(Ordering::Relaxed)
    }

    /// Runs `f` with every [`wide_twin!`](super::wide_twin) function taking the
    /// baseline build.
    pub(crate) fn on_baseline<R>(f: impl FnOnce() -> R) -> R {
        /// Lifts the switch even when `f` panics.
        struct Lift;
        impl Drop for Lift {
            fn drop(&mut self) {
                BASELINE.store(false, Ordering::Relaxed);
            }
        }
        let _only = SWITCH.write().unwrap_or_else(PoisonError::into_inner);
        BASELINE.store(true, Ordering::Relaxed);
        let _lift = Lift;
        f()
    }

    /// Runs `f` while no test forces the baseline, so [`wide_twin!`](super::wide_twin)
    /// functions take the AVX2 build wherever [`avx2_here`].
    pub(crate) fn on_wide<R>(f: impl FnOnce() -> R) -> R {
        let _shared = SWITCH.read().unwrap_or_else(PoisonError::into_inner);
        f()
    }

    /// Whether this CPU has AVX2 and FMA, so the AVX2 build can run here at all (else a
    /// comparison with the baseline is vacuous). Asks the CPU, not the test switch.
    pub(crate) fn avx2_here() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// RMSNorm, SwiGLU and GeGLU, forward and backward: the AVX2 build gives the baseline bits.
    #[test]
    fn the_avx2_build_of_the_row_kernels_gives_the_baseline_bits() {
        use crate::glu::{Gate, glu_backward, glu_forward};
        use crate::norm::{rms_norm_backward, rms_norm_forward};
        let (rows, h, inter) = (70, 48, 100);
        let value = |i: usize| ((i * 7919 % 1000) as f32 / 250.0 - 2.0) * 1.37;
        let x: Vec<f32> = (0..rows * h).map(value).collect();
        let w: Vec<f32> = (0..h).map(|i| value(i + 11)).collect();
        let dy: Vec<f32> = (0..rows * h).map(|i| value(i + 5)).collect();
        let gu: Vec<f32> = (0..rows * 2 * inter).map(|i| value(i + 3)).collect();
        let dh: Vec<f32> = (0..rows * inter).map(|i| value(i + 7)).collect();
        let run = || {
            let (mut out, mut inv, mut dx) =
                (vec![0.0; x.len()], vec![0.0; rows], vec![1.0; x.len()]);
            rms_norm_forward(&x, &w, 1e-5, &mut out, &mut inv);
            rms_norm_backward(&x, &w, &inv, &dy, &mut dx, true);
            let (mut act, mut d_gu) = (vec![0.0; rows * inter], vec![0.0; gu.len()]);
            glu_forward(&gu, inter, Gate::Silu, &mut act);
            glu_backward(&gu, inter, Gate::Silu, &dh, &mut d_gu);
            let (mut gelu, mut d_gelu) = (vec![0.0; rows * inter], vec![0.0; gu.len()]);
            glu_forward(&gu, inter, Gate::GeluTanh, &mut gelu);
            glu_backward(&gu, inter, Gate::GeluTanh, &dh, &mut d_gelu);
            [out, inv, dx, act, d_gu, gelu, d_gelu]
                .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        if !avx2_here() {
            eprintln!(
                "skipped: this CPU lacks AVX2 or FMA, so only the baseline build runs here and \
                 there is no AVX2 build to compare (the norm and glu tests check the baseline)"
            );
            return;
        }
        let wide = on_wide(run);
        assert!(wide == on_baseline(run), "the AVX2 build changed the bits");
    }
}
