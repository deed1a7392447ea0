//! `C = α·A·B + β·C` on strided `f32` views.
//!
//! The backend, chosen at run time: on x86-64 with AVX-512F or AVX2 and FMA, the
//! crate's own kernels (`x86`; the same bits with either instruction set), elsewhere
//! `matrixmultiply` (pure Rust), and with the `blas` feature a system BLAS. It is called
//! once per block of C's rows (or columns, when C is wider than tall) from rayon. There
//! are as many blocks as rayon threads (one, for small products), each a multiple of 64
//! rows: the shared operand is packed once per call, so fewer, larger blocks pack it
//! fewer times (fixed 128-row blocks packed a weight 8 times for 1024 token rows).
//! Blocks are cut along every kernel's tile edges, and each element of C is computed by
//! the same kernel over the same order of `k` whichever block it falls in, so the
//! result does not depend on the thread count or the split (tested bit for bit).
//!
//! matrixmultiply packs an operand with contiguous copies only when A's columns, or
//! B's rows, are contiguous, and element by element otherwise; for it, an operand it
//! would gather like that several times (A of a 32000-column product, packed once per
//! 1024-column panel) is first copied into that layout, in 32 × 32 tiles, in a
//! per-thread scratch buffer.
//!
//! `unsafe` here and in `x86`: the libraries and kernels take raw pointers and
//! strides. Every view is checked against its slice's length when it is made, and the
//! output view's rows never overlap, which is all they need to stay in bounds.

#![allow(unsafe_code)]

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod x86;

/// The crate's own kernels, when this is an x86-64 CPU with AVX2 and FMA (or AVX-512F)
/// and no BLAS was asked for; `None` means matrixmultiply (or the BLAS).
#[cfg(target_arch = "x86_64")]
fn own_kernels() -> Option<x86::Isa> {
    if cfg!(feature = "blas") {
        None
    } else {
        x86::Isa::detected()
    }
}

/// The environment variable that caps the instruction set of the own kernels, as
/// `ONEDNN_MAX_CPU_ISA` and `MKL_ENABLE_INSTRUCTIONS` do for oneDNN and oneMKL: `avx2`
/// runs the AVX2 kernels (and no bf16 kernels) on an AVX-512 CPU, `avx512` (the
/// default) the best the CPU has. For measuring on an AVX-512 machine what an
/// AVX2-only node gets (`scripts/bench-train --isa avx2`); the checkpoint records the
/// kernels used (`tuneq-gemm-1 (avx2)`).
pub const ISA_LIMIT_ENV: &str = "TUNEQ_GEMM_ISA";

/// The widest instruction set the own kernels may use ([`ISA_LIMIT_ENV`]); a cap, so a
/// CPU without it runs what it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsaLimit {
    /// AVX-512F (and AVX512-BF16 for bf16 products) where the CPU has them.
    Avx512,
    /// AVX2 and FMA at most.
    Avx2,
}

/// [`ISA_LIMIT_ENV`] holds something other than an [`IsaLimit`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ISA_LIMIT_ENV}={value:?} is not an instruction set limit; use avx512 or avx2")]
pub struct IsaLimitError {
    /// What the variable held.
    pub value: String,
}

impl IsaLimit {
    /// The limit [`ISA_LIMIT_ENV`] sets, `None` when it is unset or empty. The kernels
    /// read it once, at their first product, and ignore a value that is not a limit:
    /// a binary calls this at start to refuse one instead.
    pub fn from_env() -> Result<Option<Self>, IsaLimitError> {
        Self::from_value(std::env::var_os(ISA_LIMIT_ENV))
    }

    /// The limit a value of [`ISA_LIMIT_ENV`] sets (any case, spaces around ignored).
    fn from_value(value: Option<std::ffi::OsString>) -> Result<Option<Self>, IsaLimitError> {
        let Some(value) = value else {
            return Ok(None);
        };
        match value.to_str().map(str::trim) {
            Some("") => Ok(None),
            Some(v) if v.eq_ignore_ascii_case("avx512") => Ok(Some(Self::Avx512)),
            Some(v) if v.eq_ignore_ascii_case("avx2") => Ok(Some(Self::Avx2)),
            _ => Err(IsaLimitError {
                value: value.to_string_lossy().into_owned(),
            }),
        }
    }
}

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

    /// Row `i` as a slice, when the view's columns are contiguous (`None` otherwise).
    ///
    /// # Panics
    /// If `i` is not a row of the view.
    pub fn row(&self, i: usize) -> Option<&'a [f32]> {
        assert!(i < self.rows, "row {i} of a view of {} rows", self.rows);
        let start = i * self.row_stride;
        (self.col_stride == 1).then(|| &self.data[start..start + self.cols])
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
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = own_kernels() {
        return isa.name();
    }
    #[cfg(feature = "blas")]
    {
        crate::blas::name()
    }
    #[cfg(not(feature = "blas"))]
    {
        "matrixmultiply-0.3"
    }
}

/// What multiplies the frozen projections in bf16 compute
/// ([`Compute::Bf16`](crate::llama::Compute)) with bf16-stored weights: oneMKL's bf16
/// GEMM on a oneMKL build, the crate's own bf16 kernels on a CPU with AVX512-BF16, else
/// [`backend`] on operands widened back to f32.
pub fn bf16_backend() -> &'static str {
    if cfg!(tuneq_blas_mkl) {
        "mkl cblas_gemm_bf16bf16f32"
    } else if own_bf16_kernels() {
        "tuneq-gemm-1 (avx512-bf16 vdpbf16ps)"
    } else {
        static WIDENED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        WIDENED.get_or_init(|| format!("{} on widened bf16 operands", backend()))
    }
}

/// `C = α·A·B + β·C`. With `β = 0`, C's old contents are ignored (NaNs included).
///
/// # Panics
/// If the shapes do not agree.
pub fn gemm(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, mut c: MatMut<'_>) {
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
    if without_products(m, n, k, beta, &mut c) {
        return;
    }
    let plan = Plan::new(m, n, k, threads());
    // Operands matrixmultiply would gather element by element, more than once, are
    // first copied into the layout it packs with contiguous runs (see `Plan`). The own
    // kernels read A in place and pack B with contiguous runs either way.
    let gathers = !uses_own_kernels();
    let mut a_copy = (gathers && plan.a_packs >= COPY_MIN_PACKS && a.row_stride != 1 && m > 1)
        .then(|| SCRATCH_A.take());
    let mut b_copy = (gathers && plan.b_packs >= COPY_MIN_PACKS && b.col_stride != 1 && n > 1)
        .then(|| SCRATCH_B.take());
    let a = match a_copy.as_mut() {
        // A column-major: the copy holds Aᵀ row-major.
        Some(buf) => Mat::new(copy_row_major(a.t(), buf), k, m).t(),
        None => a,
    };
    let b = match b_copy.as_mut() {
        Some(buf) => Mat::new(copy_row_major(b, buf), k, n),
        None => b,
    };
    in_blocks(alpha, a, b, beta, c, plan.by_rows, plan.block);
    if let Some(buf) = a_copy {
        SCRATCH_A.set(buf);
    }
    if let Some(buf) = b_copy {
        SCRATCH_B.set(buf);
    }
}

/// Whether bf16 products run on the crate's own bf16 kernels: an x86-64 CPU with
/// AVX512-BF16, and no BLAS asked for.
pub(crate) fn own_bf16_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        own_kernels().is_some() && x86::Isa::bf16_detected()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `C = A·op(W) + β·C` with bf16 operands and f32 sums on the crate's own bf16 kernels
/// (`vdpbf16ps`): `a` holds A's rows as bf16 pairs (`m × ⌈k/2⌉` f32s, each the bits of
/// elements `2p` (low half) and `2p + 1` of its row, zero past an odd `k`), `w` is
/// `rows × cols` row-major, used transposed (`C = A·Wᵀ`, `k = cols`) when
/// `transposed`, as is (`k = rows`) otherwise. Split over threads like [`gemm`]; the
/// bits do not depend on the split.
///
/// # Panics
/// If the shapes do not agree, or [`own_bf16_kernels`] is false.
#[cfg(target_arch = "x86_64")]
pub(crate) fn gemm_bf16_pairs(
    a: Mat<'_>,
    w: &[half::bf16],
    (rows, cols): (usize, usize),
    transposed: bool,
    beta: f32,
    mut c: MatMut<'_>,
) {
    assert!(own_bf16_kernels(), "this CPU or build has no bf16 kernels");
    assert!(
        w.len() >= rows * cols,
        "W holds {} elements, {rows}×{cols} needed",
        w.len()
    );
    let b = if transposed {
        x86::Bf16Mat {
            data: w,
            rows: cols,
            cols: rows,
            row_stride: 1,
            col_stride: cols,
        }
    } else {
        x86::Bf16Mat {
            data: w,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    };
    let (m, n, k) = (c.rows, c.cols, b.rows);
    assert_eq!(
        (a.rows, a.cols, b.cols),
        (m, k.div_ceil(2), n),
        "A (pairs) is {}×{}, op(W) {k}×{}, C {m}×{n}",
        a.rows,
        a.cols,
        b.cols
    );
    if without_products(m, n, k, beta, &mut c) {
        return;
    }
    let plan = Plan::new(m, n, k, threads());
    for_blocks(
        a,
        c,
        plan.by_rows,
        plan.block,
        |a, first, cols, out, stride| {
            // SAFETY: the bf16 kernels were detected (asserted above); `out` is the block
            // of C as `for_blocks` promises.
            unsafe { x86::gemm_bf16(1.0, a, b.columns(first, cols), beta, out, stride) };
        },
    );
}

/// `C = A·op(W) + β·C` with bf16 operands and f32 products and accumulation, through
/// oneMKL's `cblas_gemm_bf16bf16f32` (AMX tiles on Sapphire Rapids and later): `a` is
/// `m × k` row-major with `m = C`'s rows, `w` is `rows × cols` row-major, used
/// transposed (`C = A·Wᵀ`, `k = cols`) when `transposed`, as is (`k = rows`) otherwise.
/// Split like [`gemm`] on a BLAS: fixed blocks of C's rows, so the result does not
/// depend on the thread count.
///
/// # Panics
/// If the shapes do not agree.
#[cfg(tuneq_blas_mkl)]
pub(crate) fn gemm_bf16(
    a: &[half::bf16],
    w: &[half::bf16],
    (rows, cols): (usize, usize),
    transposed: bool,
    beta: f32,
    mut c: MatMut<'_>,
) {
    let (m, n) = (c.rows, c.cols);
    let (k, w_out) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    assert_eq!(n, w_out, "C has {n} columns, op(W) {w_out}");
    assert!(
        a.len() >= m * k,
        "A holds {} elements, {m}×{k} needed",
        a.len()
    );
    assert!(
        w.len() >= rows * cols,
        "W holds {} elements, {rows}×{cols} needed",
        w.len()
    );
    if without_products(m, n, k, beta, &mut c) {
        return;
    }
    let block = if m.saturating_mul(n).saturating_mul(k) < SERIAL_WORK {
        m
    } else {
        BLAS_BLOCK
    };
    for_row_blocks(c, block, |first, out| {
        let stride = out.row_stride;
        // SAFETY: A's rows `first..first + out.rows` and all of W lie in their slices
        // (checked above); `out` is an exclusive, bounds-checked view of those rows of C.
        unsafe {
            crate::blas::gemm_bf16(
                out.rows,
                n,
                k,
                a[first * k..].as_ptr(),
                k,
                w.as_ptr(),
                (transposed, cols),
                beta,
                out.data.as_mut_ptr(),
                stride,
            );
        }
    });
}

/// Rows (or columns) of C per parallel block are a multiple of this: of every
/// matrixmultiply kernel tile (16 × 16 with AVX-512, 8 × 8 with AVX2) and of its row
/// panel (64). Blocks then cut C along tile edges, so every tile of C (and whether the
/// library runs it through its full or its edge kernel, whose `β` epilogues round
/// differently) is the same whatever the split.
const ALIGN: usize = 64;

/// Rows (or columns) of C per parallel block with the `blas` feature: fixed, so that the
/// split, and with it the library's choice of kernels, does not follow the thread count.
#[cfg_attr(not(feature = "blas"), allow(dead_code))]
const BLAS_BLOCK: usize = 256;

/// matrixmultiply's column panel of B (`nc`): A is packed once per panel of C's columns.
const NC: usize = 1024;

thread_local! {
    /// The share of the pool a product may split over on this thread (see
    /// [`with_share`]); `None`: all of it.
    static SHARE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The threads a product on this thread splits over.
fn threads() -> usize {
    let all = rayon::current_num_threads();
    SHARE.get().map_or(all, |share| share.clamp(1, all))
}

/// Runs `body` with the products it computes on this thread split over at most
/// `threads` blocks: for work already running as one of several parallel tasks, whose
/// products would otherwise each split over the whole pool. The split never changes a
/// result (see the module's notes), only how many blocks pack their operands.
pub(crate) fn with_share<R>(threads: usize, body: impl FnOnce() -> R) -> R {
    /// Puts the previous share back, also when `body` unwinds.
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SHARE.set(self.0);
        }
    }
    let _restore = Restore(SHARE.replace(Some(threads)));
    body()
}

/// Below this many multiply-adds a product runs as one call on the current thread.
const SERIAL_WORK: usize = 1 << 21;

/// An operand that would be packed element by element at least this many times is
/// copied into a contiguous layout first. The copy costs about one gather, and a
/// contiguous pack is not much cheaper than a gathering one when the operand stays in
/// cache: measured on the trainer's shapes (2 threads), copying at 2 packs (x for
/// 1024 × 2048 × 768, dlogits for the lm_head's dH) was even or slower, while at 16–32
/// (A of the 32000-wide lm_head, packed once per 1024-column panel) it gained ~10 %.
const COPY_MIN_PACKS: usize = 4;

thread_local! {
    /// Per-thread buffers for the copied operands, reused across calls. Taken out of the
    /// cell for the duration of a call, so a nested call on the same thread (rayon runs
    /// other tasks while it waits) finds it empty and allocates its own.
    static SCRATCH_A: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    static SCRATCH_B: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// How a product is split: C's rows (or columns) in as many blocks as there are threads,
/// so the operand shared by all blocks is packed once per thread, not once per fixed
/// small block.
struct Plan {
    by_rows: bool,
    block: usize,
    /// How many times the library packs each element of A, and of B, over all blocks.
    a_packs: usize,
    b_packs: usize,
}

impl Plan {
    fn new(m: usize, n: usize, k: usize, threads: usize) -> Self {
        let parts = if m.saturating_mul(n).saturating_mul(k) < SERIAL_WORK {
            1
        } else {
            threads.max(1)
        };
        let by_rows = m >= n;
        let len = if by_rows { m } else { n };
        // A BLAS picks its kernels by block size, and rounds differently at different
        // block edges, so there the blocks have a fixed size: the result then depends on
        // the shapes alone, never on the thread count.
        let small = m.saturating_mul(n).saturating_mul(k) < SERIAL_WORK;
        let block = if cfg!(feature = "blas") && !small {
            BLAS_BLOCK
        } else {
            len.div_ceil(parts).next_multiple_of(ALIGN)
        };
        let blocks = len.div_ceil(block);
        let (a_packs, b_packs) = if by_rows {
            (n.div_ceil(NC), blocks)
        } else {
            (blocks * block.min(n).div_ceil(NC), 1)
        };
        Self {
            by_rows,
            block,
            a_packs,
            b_packs,
        }
    }
}

/// Copies the view into `buf` row-major (resized to fit): a transpose, for the view of
/// a matrix's `t()`. In 32 × 32 tiles, so both sides stay in cache, and in parallel
/// over bands of 32 rows for large views.
pub fn to_row_major(v: Mat<'_>, buf: &mut Vec<f32>) {
    copy_row_major(v, buf);
}

/// Copies the view into `buf` row-major (resized to fit) and returns the filled part.
/// Transposing views are copied in 32 × 32 tiles, in parallel over row bands.
fn copy_row_major<'b>(v: Mat<'_>, buf: &'b mut Vec<f32>) -> &'b [f32] {
    const TILE: usize = 32;
    let (rows, cols) = (v.rows, v.cols);
    buf.clear();
    buf.resize(rows * cols, 0.0);
    let band = |(band, out): (usize, &mut [f32])| {
        let first = band * TILE;
        let band_rows = out.len() / cols;
        for j0 in (0..cols).step_by(TILE) {
            let j1 = (j0 + TILE).min(cols);
            for i in 0..band_rows {
                let src = (first + i) * v.row_stride;
                let dst = &mut out[i * cols + j0..i * cols + j1];
                for (j, d) in (j0..j1).zip(dst) {
                    *d = v.data[src + j * v.col_stride];
                }
            }
        }
    };
    if rows * cols < SERIAL_WORK / 16 {
        buf.chunks_mut(TILE * cols).enumerate().for_each(band);
    } else {
        buf.par_chunks_mut(TILE * cols).enumerate().for_each(band);
    }
    buf
}

/// `C = α·A·B + β·C` with C split into blocks of `block` rows (`by_rows`) or columns,
/// one library call per block, in parallel.
fn in_blocks(
    alpha: f32,
    a: Mat<'_>,
    b: Mat<'_>,
    beta: f32,
    c: MatMut<'_>,
    by_rows: bool,
    block: usize,
) {
    for_blocks(a, c, by_rows, block, |a, first, cols, out, stride| {
        let b_block = Mat {
            data: &b.data[first * b.col_stride..],
            cols,
            ..b
        };
        // SAFETY: `out` is the block of C as `for_blocks` promises.
        unsafe { kernel(alpha, a, b_block, beta, out, a.rows, cols, stride) };
    });
}

/// Runs `body(A's rows for the block, first column, columns, pointer to the block's
/// first element of C, C's row stride)` for each block of `block` rows of C (`by_rows`,
/// with those rows of A) or of `block` columns (with all of A), in parallel when there
/// is more than one block. `body` may write its block of C, and nothing else.
fn for_blocks(
    a: Mat<'_>,
    c: MatMut<'_>,
    by_rows: bool,
    block: usize,
    body: impl Fn(Mat<'_>, usize, usize, *mut f32, usize) + Sync,
) {
    if by_rows {
        let n = c.cols;
        for_row_blocks(c, block, |first, out| {
            let a_block = Mat {
                data: &a.data[first * a.row_stride..],
                rows: out.rows,
                ..a
            };
            body(a_block, 0, n, out.data.as_mut_ptr(), out.row_stride);
        });
    } else {
        for_column_blocks(c, block, |first, cols, out, stride| {
            body(a, first, cols, out, stride);
        });
    }
}

/// Runs `body(first row, those rows of C)` for each block of `block` rows of C, in
/// parallel when there is more than one block.
fn for_row_blocks(c: MatMut<'_>, block: usize, body: impl Fn(usize, MatMut<'_>) + Sync) {
    let (m, n, stride) = (c.rows, c.cols, c.row_stride);
    let run = |(index, out): (usize, &mut [f32])| {
        let first = index * block;
        body(first, MatMut::strided(out, block.min(m - first), n, stride));
    };
    let data = &mut c.data[..(m - 1) * stride + n];
    if block >= m {
        run((0, data));
    } else {
        data.par_chunks_mut(block * stride)
            .enumerate()
            .for_each(run);
    }
}

/// Runs `body(first column, columns, pointer to that column of C's first row, C's row
/// stride)` for each block of `block` columns of C, in parallel when there is more than
/// one block. `body` may write the block's columns of C's rows, and nothing else.
fn for_column_blocks(
    c: MatMut<'_>,
    block: usize,
    body: impl Fn(usize, usize, *mut f32, usize) + Sync,
) {
    let n = c.cols;
    let stride = c.row_stride;
    let base = SendPtr(c.data.as_mut_ptr());
    let run = |index: usize| {
        let first = index * block;
        // SAFETY: `c` was checked to hold its rows of `n` columns `stride ≥ n` apart, so
        // columns `first..first + cols` of every row lie inside it, and blocks write
        // disjoint column ranges. The exclusive borrow of `c.data` lasts for this call.
        body(
            first,
            block.min(n - first),
            unsafe { base.at(first) },
            stride,
        );
    };
    let blocks = n.div_ceil(block);
    if blocks == 1 {
        run(0);
    } else {
        (0..blocks).into_par_iter().for_each(run);
    }
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

// SAFETY: only used by `for_column_blocks`, whose blocks write disjoint elements.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

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
    #[cfg(feature = "blas")]
    if let (Some(la), Some(lb)) = (
        crate::blas::layout(a.row_stride, a.col_stride, a.cols, a.rows),
        crate::blas::layout(b.row_stride, b.col_stride, b.cols, b.rows),
    ) {
        // SAFETY: as for the library call below; the layouts describe the same views.
        unsafe {
            crate::blas::sgemm(
                m,
                n,
                a.cols,
                alpha,
                a.data.as_ptr(),
                la,
                b.data.as_ptr(),
                lb,
                beta,
                c,
                c_stride,
            );
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = own_kernels() {
        // SAFETY: `isa` was detected on this CPU; C as the caller promises.
        unsafe { x86::gemm(isa, alpha, a, b, beta, c, c_stride) };
        return;
    }
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

/// Whether products run on the crate's own kernels (not matrixmultiply or a BLAS).
fn uses_own_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        own_kernels().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `C = β·C` (the `k = 0` case), with `β = 0` writing zeros.
/// Does what `C = α·A·B + β·C` asks when there is nothing to multiply, and says whether
/// that was so: nothing for an empty C, `C = β·C` for an empty inner dimension.
fn without_products(m: usize, n: usize, k: usize, beta: f32, c: &mut MatMut<'_>) -> bool {
    if m == 0 || n == 0 {
        return true;
    }
    if k == 0 {
        scale(beta, c);
        return true;
    }
    false
}

fn scale(beta: f32, c: &mut MatMut<'_>) {
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
pub(crate) mod tests;
