//! `C = α·A·B + β·C` on strided `f32` views.
//!
//! The backend is `matrixmultiply` (pure Rust, AVX-512 and AVX2 kernels chosen at run
//! time), called once per fixed block of C's rows or columns from rayon. Each element of
//! C is computed by the same kernel over the same order of `k` whichever block it falls
//! in, so the result does not depend on the thread count.
//!
//! This is the crate's only module with `unsafe`: the library takes raw pointers and
//! strides. Every view is checked against its slice's length when it is made, and the
//! output view's rows never overlap, which is all the library needs to stay in bounds.

#![allow(unsafe_code)]

use rayon::prelude::*;

/// Rows (or columns) of C per parallel task: large enough that packing the other
/// operand once per task is a small cost beside the multiply.
const BLOCK: usize = 128;

/// A read-only matrix view: element `(i, j)` is `data[i·row_stride + j·col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Mat<'a> {
    /// A row-major `rows × cols` matrix.
    ///
    /// # Panics
    /// If `data` is shorter than `rows·cols`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }

    /// A view with explicit strides (in elements).
    ///
    /// # Panics
    /// If an element of the view would lie outside `data`.
    pub fn strided(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        assert!(
            last_index(rows, cols, row_stride, col_stride).is_none_or(|last| last < data.len()),
            "a {rows}×{cols} view with strides ({row_stride}, {col_stride}) reaches past a slice of {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Element `(i, j)`.
    pub fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.row_stride + j * self.col_stride]
    }
}

/// A writable matrix view with contiguous rows that never overlap: element `(i, j)` is
/// `data[i·row_stride + j]`, `row_stride ≥ cols`.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
}

impl<'a> MatMut<'a> {
    /// A row-major `rows × cols` matrix.
    ///
    /// # Panics
    /// If `data` is shorter than `rows·cols`.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols)
    }

    /// A view of `cols` columns in rows `row_stride` apart (a column block of a wider
    /// matrix, say).
    ///
    /// # Panics
    /// If `row_stride < cols` (rows would overlap) or the view reaches past `data`.
    pub fn strided(data: &'a mut [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        assert!(
            row_stride >= cols || rows <= 1,
            "rows of {cols} columns {row_stride} apart would overlap"
        );
        assert!(
            last_index(rows, cols, row_stride, 1).is_none_or(|last| last < data.len()),
            "a {rows}×{cols} view with row stride {row_stride} reaches past a slice of {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            row_stride,
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// The index of a view's last element, `None` for an empty view.
fn last_index(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return None;
    }
    let last = (rows - 1).checked_mul(row_stride).and_then(|r| {
        (cols - 1)
            .checked_mul(col_stride)
            .and_then(|c| r.checked_add(c))
    });
    Some(last.unwrap_or(usize::MAX))
}

/// The GEMM library in use, for the checkpoint's record and the benchmark's report.
pub fn backend() -> &'static str {
    "matrixmultiply-0.3"
}

/// `C = α·A·B + β·C`. With `β = 0`, C's old contents are ignored (NaNs included).
///
/// # Panics
/// If the shapes do not agree.
pub fn gemm(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: MatMut<'_>) {
    assert_eq!(
        a.cols, b.rows,
        "A is {}×{}, B is {}×{}",
        a.rows, a.cols, b.rows, b.cols
    );
    assert_eq!(
        (c.rows, c.cols),
        (a.rows, b.cols),
        "C is {}×{}, A·B is {}×{}",
        c.rows,
        c.cols,
        a.rows,
        b.cols
    );
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        scale(beta, c);
        return;
    }
    let stride = c.row_stride;
    if m >= n {
        // Blocks of C's rows, each with the matching rows of A.
        c.data[..(m - 1) * stride + n]
            .par_chunks_mut(BLOCK * stride)
            .enumerate()
            .for_each(|(block, out)| {
                let first = block * BLOCK;
                let rows = BLOCK.min(m - first);
                let a_block = Mat {
                    data: &a.data[first * a.row_stride..],
                    rows,
                    ..a
                };
                sequential(
                    alpha,
                    a_block,
                    b,
                    beta,
                    MatMut::strided(out, rows, n, stride),
                );
            });
    } else {
        // Blocks of C's columns, each with the matching columns of B. Column blocks of
        // C interleave in memory, so each task gets its own rows' sub-slices through
        // raw views checked above; see `column_blocks`.
        column_blocks(alpha, a, b, beta, c);
    }
}

/// Splits C into blocks of `BLOCK` columns and runs them in parallel.
fn column_blocks(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: MatMut<'_>) {
    let (m, n) = (c.rows, c.cols);
    let stride = c.row_stride;
    let base = SendPtr(c.data.as_mut_ptr());
    (0..n.div_ceil(BLOCK)).into_par_iter().for_each(|block| {
        let first = block * BLOCK;
        let cols = BLOCK.min(n - first);
        let b_block = Mat {
            data: &b.data[first * b.col_stride..],
            cols,
            ..b
        };
        // SAFETY: `c` was checked to hold `m` rows of `n` columns `stride ≥ n` apart, so
        // columns `first..first + cols` of every row lie inside it, and tasks write
        // disjoint column ranges. The exclusive borrow of `c.data` lasts for this call.
        unsafe {
            kernel(alpha, a, b_block, beta, base.at(first), m, cols, stride);
        }
    });
}

/// A raw pointer that may cross to rayon's threads; see the SAFETY note where it is used.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
impl SendPtr {
    /// The pointer `offset` elements on (a method, so closures capture the whole wrapper).
    ///
    /// # Safety
    /// As for `pointer::add`.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller's.
        unsafe { self.0.add(offset) }
    }
}

// SAFETY: only used by `column_blocks`, whose tasks write disjoint elements.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// One call of the library on the current thread.
fn sequential(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: MatMut<'_>) {
    // SAFETY: `c` is an exclusive, bounds-checked view (see `MatMut::strided`).
    unsafe {
        kernel(
            alpha,
            a,
            b,
            beta,
            c.data.as_mut_ptr(),
            c.rows,
            c.cols,
            c.row_stride,
        )
    }
}

/// # Safety
/// `c` must point at `m` rows of `n` writable elements, `c_stride` apart, that no other
/// thread touches during the call. `a` and `b` are bounds-checked views.
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(
    alpha: f32,
    a: Mat<'_>,
    b: Mat<'_>,
    beta: f32,
    c: *mut f32,
    m: usize,
    n: usize,
    c_stride: usize,
) {
    debug_assert!(a.rows == m && b.cols == n && a.cols == b.rows);
    // Views hold at most isize::MAX elements (they are slices), so strides fit.
    let s = |x: usize| x as isize;
    // SAFETY: A and B stay within their slices (checked when the views were made); C as
    // the caller promises.
    unsafe {
        matrixmultiply::sgemm(
            m,
            a.cols,
            n,
            alpha,
            a.data.as_ptr(),
            s(a.row_stride),
            s(a.col_stride),
            b.data.as_ptr(),
            s(b.row_stride),
            s(b.col_stride),
            beta,
            c,
            s(c_stride),
            1,
        );
    }
}

/// `C = β·C` (the `k = 0` case), with `β = 0` writing zeros.
fn scale(beta: f32, c: MatMut<'_>) {
    for i in 0..c.rows {
        let row = &mut c.data[i * c.row_stride..i * c.row_stride + c.cols];
        if beta == 0.0 {
            row.fill(0.0);
        } else {
            row.iter_mut().for_each(|x| *x *= beta);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    /// The naive product in f64.
    fn reference(
        alpha: f32,
        a: Mat<'_>,
        b: Mat<'_>,
        beta: f32,
        c: &[f32],
        stride: usize,
    ) -> Vec<f64> {
        let mut out = vec![0f64; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                let dot: f64 = (0..a.cols)
                    .map(|p| a.at(i, p) as f64 * b.at(p, j) as f64)
                    .sum();
                out[i * b.cols + j] = alpha as f64 * dot + beta as f64 * c[i * stride + j] as f64;
            }
        }
        out
    }

    fn check(m: usize, n: usize, k: usize, transpose_a: bool, transpose_b: bool, beta: f32) {
        let a_data = random(m * k, 1);
        let b_data = random(k * n, 2);
        let a = if transpose_a {
            Mat::new(&a_data, k, m).t()
        } else {
            Mat::new(&a_data, m, k)
        };
        let b = if transpose_b {
            Mat::new(&b_data, n, k).t()
        } else {
            Mat::new(&b_data, k, n)
        };
        // C inside a wider buffer, to exercise the row stride.
        let stride = n + 3;
        let before = random(m * stride, 3);
        let want = reference(0.5, a, b, beta, &before, stride);
        let mut c = before.clone();
        gemm(0.5, a, b, beta, MatMut::strided(&mut c, m, n, stride));
        for i in 0..m {
            for j in 0..n {
                let (got, want) = (c[i * stride + j] as f64, want[i * n + j]);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                    "{m}×{n}×{k} tA={transpose_a} tB={transpose_b}: ({i},{j}) {got} vs {want}"
                );
            }
            for j in n..stride.min(c.len() - i * stride) {
                assert_eq!(
                    c[i * stride + j],
                    before[i * stride + j],
                    "padding ({i},{j}) was written"
                );
            }
        }
    }

    #[test]
    fn matches_the_naive_product_in_every_layout() {
        for (m, n, k) in [
            (1, 1, 1),
            (7, 5, 3),
            (300, 20, 17),
            (20, 300, 9),
            (129, 257, 64),
            (8, 1024, 8),
        ] {
            for ta in [false, true] {
                for tb in [false, true] {
                    for beta in [0.0, 1.0, -0.5] {
                        check(m, n, k, ta, tb, beta);
                    }
                }
            }
        }
    }

    #[test]
    fn beta_zero_ignores_what_c_held() {
        let a = vec![1.0f32; 4];
        let b = vec![2.0f32; 4];
        let mut c = vec![f32::NAN; 4];
        gemm(
            1.0,
            Mat::new(&a, 2, 2),
            Mat::new(&b, 2, 2),
            0.0,
            MatMut::new(&mut c, 2, 2),
        );
        assert_eq!(c, vec![4.0; 4]);
    }

    #[test]
    fn k_zero_scales_c() {
        let mut c = vec![2.0f32; 6];
        gemm(
            1.0,
            Mat::new(&[], 2, 0),
            Mat::new(&[], 0, 3),
            0.5,
            MatMut::new(&mut c, 2, 3),
        );
        assert_eq!(c, vec![1.0; 6]);
    }

    #[test]
    fn the_result_does_not_depend_on_the_thread_count() {
        for (m, n, k) in [(1000, 96, 200), (64, 700, 300)] {
            let a = random(m * k, 4);
            let b = random(k * n, 5);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a pool");
                let mut c = vec![0f32; m * n];
                pool.install(|| {
                    gemm(
                        1.0,
                        Mat::new(&a, m, k),
                        Mat::new(&b, k, n),
                        0.0,
                        MatMut::new(&mut c, m, n),
                    )
                });
                c
            };
            let one = run(1);
            for threads in [2, 3] {
                assert!(
                    one.iter()
                        .zip(run(threads))
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}×{n}×{k} with {threads} threads"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "reaches past")]
    fn a_view_past_its_slice_is_refused() {
        let data = [0f32; 5];
        let _ = Mat::new(&data, 2, 3);
    }

    #[test]
    #[should_panic(expected = "would overlap")]
    fn overlapping_output_rows_are_refused() {
        let mut data = [0f32; 8];
        let _ = MatMut::strided(&mut data, 2, 4, 2);
    }
}
