//! A system BLAS (`cblas_sgemm`) behind the `blas` feature: OpenBLAS or oneMKL, linked by
//! `build.rs`. [`crate::gemm`] calls it, one sequential call per block of C, exactly as it
//! calls `matrixmultiply`; the library's own threads are turned off so the rayon split
//! stays the only parallelism and the result does not depend on the thread count.

#![allow(unsafe_code)]

use std::sync::Once;

const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;
const TRANS: i32 = 112;

unsafe extern "C" {
    fn cblas_sgemm(
        layout: i32,
        trans_a: i32,
        trans_b: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: f32,
        a: *const f32,
        lda: i32,
        b: *const f32,
        ldb: i32,
        beta: f32,
        c: *mut f32,
        ldc: i32,
    );
}

#[cfg(not(tuneq_blas_mkl))]
unsafe extern "C" {
    fn openblas_set_num_threads(n: i32);
}

#[cfg(tuneq_blas_mkl)]
unsafe extern "C" {
    fn cblas_gemm_bf16bf16f32(
        layout: i32,
        trans_a: i32,
        trans_b: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: f32,
        a: *const u16,
        lda: i32,
        b: *const u16,
        ldb: i32,
        beta: f32,
        c: *mut f32,
        ldc: i32,
    );
    fn MKL_Set_Threading_Layer(layer: i32) -> i32;
    fn MKL_Set_Num_Threads(n: i32);
    fn MKL_CBWR_Set(setting: i32) -> i32;
}

/// The library's name, for checkpoints and benchmark reports.
pub fn name() -> &'static str {
    if cfg!(tuneq_blas_mkl) {
        "mkl (cblas)"
    } else {
        "openblas (cblas)"
    }
}

/// One thread inside the library (ours split the work), and for MKL its conditional
/// numerical reproducibility mode, so results do not move with memory alignment.
fn configure() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain setters of the library's global configuration, called once.
        unsafe {
            #[cfg(not(tuneq_blas_mkl))]
            openblas_set_num_threads(1);
            #[cfg(tuneq_blas_mkl)]
            {
                // MKL_THREADING_SEQUENTIAL, before any other call: tuneq splits the
                // work over its own threads, and the default (Intel OpenMP) layer
                // needs libiomp5, which the wheel does not bring.
                let _ = MKL_Set_Threading_Layer(1);
                MKL_Set_Num_Threads(1);
                // MKL_CBWR_AUTO | MKL_CBWR_STRICT
                let _ = MKL_CBWR_Set(2 | 0x10000);
            }
        }
    });
}

/// A row-major operand as cblas sees it: whether it is transposed and its leading
/// dimension; `None` when neither stride is 1 (cblas cannot read it).
pub(crate) fn layout(
    row_stride: usize,
    col_stride: usize,
    cols: usize,
    rows: usize,
) -> Option<(bool, usize)> {
    if col_stride == 1 && row_stride >= cols.max(1) {
        Some((false, row_stride))
    } else if row_stride == 1 && col_stride >= rows.max(1) {
        Some((true, col_stride))
    } else {
        None
    }
}

/// `C = α·A·B + β·C` through `cblas_sgemm`.
///
/// # Safety
/// `a`, `b` and `c` must point at matrices of the given shapes and leading dimensions
/// (`c` writable, not touched by another thread during the call); every dimension and
/// leading dimension must fit in an `i32`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: *const f32,
    (trans_a, lda): (bool, usize),
    b: *const f32,
    (trans_b, ldb): (bool, usize),
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    configure();
    let t = |x: bool| if x { TRANS } else { NO_TRANS };
    let i = |x: usize| i32::try_from(x).unwrap_or(i32::MAX);
    // SAFETY: the caller's.
    unsafe {
        cblas_sgemm(
            ROW_MAJOR,
            t(trans_a),
            t(trans_b),
            i(m),
            i(n),
            i(k),
            alpha,
            a,
            i(lda),
            b,
            i(ldb),
            beta,
            c,
            i(ldc),
        );
    }
}

/// `C = A·op(B) + β·C` through oneMKL's `cblas_gemm_bf16bf16f32`: bf16 operands, f32
/// products and accumulation (AMX tiles or AVX512-BF16 where the CPU has them). A is
/// row-major and not transposed.
///
/// # Safety
/// As for [`sgemm`], with `a` and `b` pointing at bf16 elements.
#[cfg(tuneq_blas_mkl)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_bf16(
    m: usize,
    n: usize,
    k: usize,
    a: *const half::bf16,
    lda: usize,
    b: *const half::bf16,
    (trans_b, ldb): (bool, usize),
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    configure();
    let i = |x: usize| i32::try_from(x).unwrap_or(i32::MAX);
    // SAFETY: the caller's; `half::bf16` is a `u16` in memory (`repr(transparent)`).
    unsafe {
        cblas_gemm_bf16bf16f32(
            ROW_MAJOR,
            NO_TRANS,
            if trans_b { TRANS } else { NO_TRANS },
            i(m),
            i(n),
            i(k),
            1.0,
            a.cast(),
            i(lda),
            b.cast(),
            i(ldb),
            beta,
            c,
            i(ldc),
        );
    }
}
