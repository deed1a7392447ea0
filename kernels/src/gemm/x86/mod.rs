//! The crate's own f32 GEMM for x86-64 CPUs with AVX-512F, or AVX2 and FMA.
//!
//! Why not matrixmultiply: like every GEMM it first copies ("packs") its operands into
//! the order its kernel reads them, but a row-major A (every activation the step
//! multiplies) and a transposed B (every `x·Wᵀ`) are copied one element at a time,
//! which took ~21 % of a tiny-preset step (perf, AMD EPYC with AVX-512), a third of the
//! time of the multiply itself. Here B's copies transpose 4 × 8 blocks in AVX
//! registers, and A is mostly not copied at all: the kernel broadcasts its elements in
//! place, with any strides, when its rows are contiguous or it meets a single panel of
//! B (LoRA's rank-r products); see [`reads_a_in_place`].
//!
//! The usual blocking: B in panels of `nr` columns and at most [`KC`] rows ([`NC`]
//! columns at a time), A in panels of `mr` rows ([`MC`] rows at a time); a kernel
//! keeps an `mr × nr` tile of C in registers (12 × 32 with AVX-512, 6 × 16 with AVX2,
//! twice the rows and one vector of columns for products at most a vector wide, and the
//! AVX2 one for products at most 8 columns wide on either).
//!
//! **Same bits everywhere.** Every element of C is computed the same way whatever its
//! place in a tile, the split over threads, the tile shape or the instruction set: its
//! sum runs over `k` in blocks of [`KC`], each block one chain of FMAs from zero in
//! increasing `k`, and each block is folded in as `C = α·sum + β·C` with one FMA (`β`
//! the caller's for the first block, 1 after). Lanes never mix, and padded rows and
//! columns are computed apart and thrown away. So the AVX-512 and the AVX2 kernels
//! give the same bits (tested), and a checkpoint resumes exactly on either.
//!
//! **bf16 operands** (CPUs with AVX512-BF16: Cooper Lake, Sapphire Rapids and later,
//! AMD Zen 4 and later): the same driver and tiles multiply bf16 pairs with `vdpbf16ps`,
//! which takes two bf16 products per f32 lane and instruction, so twice the products of
//! an f32 FMA. An "element" of A and B is then a pair of consecutive bf16 values along
//! `k`, carried in an f32's 32 bits (low half the even `k`, high half the odd), so the
//! packing copies those bits as it copies f32s. Each lane's sum still runs from zero
//! over the pairs in increasing order and is folded into C once per [`KC`] pairs, so
//! these kernels too give the same bits for any split; the instruction adds a pair's
//! two exact products in its own order and flushes subnormals to zero, so the bits
//! differ from the f32 kernels on widened operands (a different GEMM backend for a
//! checkpoint's record).
//!
//! The `unsafe` here: the intrinsics, the kernels' raw pointers (into bounds-checked
//! views and packed buffers, see each SAFETY note) and the calls of the AVX builds,
//! made only after the CPU was checked for them.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, __m512, __m512bh, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps,
    _mm256_setzero_ps, _mm256_storeu_ps, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_mul_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
};
use std::cell::Cell;
use std::mem::transmute;
use std::sync::OnceLock;

use half::bf16;

use super::{IsaLimit, Mat};

mod pack;
use pack::{pack_a, pack_b, pack_b_bf16};

/// The instruction set the kernels run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// 16-lane kernels (AVX-512F).
    Avx512,
    /// 8-lane kernels (AVX2 and FMA).
    Avx2,
}

impl Isa {
    /// The best this CPU runs within the [`IsaLimit`] of the environment, checked once;
    /// `None` without AVX2 and FMA.
    pub(crate) fn detected() -> Option<Self> {
        static FOUND: OnceLock<Option<Isa>> = OnceLock::new();
        *FOUND.get_or_init(|| {
            let avx512_allowed = IsaLimit::from_env() != Ok(Some(IsaLimit::Avx2));
            if avx512_allowed && std::arch::is_x86_feature_detected!("avx512f") {
                Some(Self::Avx512)
            } else if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                Some(Self::Avx2)
            } else {
                None
            }
        })
    }

    /// Whether the bf16 kernels run here: the AVX-512 kernels do (see [`detected`]) and
    /// the CPU has AVX512-BF16; checked once.
    ///
    /// [`detected`]: Isa::detected
    pub(crate) fn bf16_detected() -> bool {
        static FOUND: OnceLock<bool> = OnceLock::new();
        *FOUND.get_or_init(|| {
            Self::detected() == Some(Self::Avx512)
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }

    /// Whether this CPU runs it.
    #[cfg(test)]
    pub(crate) fn available(self) -> bool {
        matches!(
            (self, Self::detected()),
            (Self::Avx512, Some(Self::Avx512)) | (Self::Avx2, Some(_))
        )
    }

    /// The name recorded as the GEMM backend.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Avx512 => "tuneq-gemm-1 (avx512)",
            Self::Avx2 => "tuneq-gemm-1 (avx2)",
        }
    }

    /// The tile (rows of A × columns of B) for a product `n` columns wide: a narrow one
    /// (one vector per row, more rows) when B has at most a vector's width of columns,
    /// as LoRA's rank-r products do. At most 8 columns take the AVX2 tile even where
    /// AVX-512 runs: half of a 16-lane FMA would be padding, and on CPUs that split
    /// 512-bit FMAs in two (AMD Zen 4) that doubles the time of LoRA's rank-8 products.
    /// The bits are the same (see the module's notes).
    fn tile(self, n: usize) -> Tile {
        match self {
            Self::Avx512 if n <= 8 => Tile::Avx2Narrow,
            Self::Avx512 if n <= 16 => Tile::Avx512Narrow,
            Self::Avx512 => Tile::Avx512Wide,
            Self::Avx2 if n <= 8 => Tile::Avx2Narrow,
            Self::Avx2 => Tile::Avx2Wide,
        }
    }
}

/// A kernel and its tile shape.
#[derive(Debug, Clone, Copy)]
enum Tile {
    Avx512Wide,
    Avx512Narrow,
    Avx2Wide,
    Avx2Narrow,
    /// bf16 pairs, `vdpbf16ps`: the AVX-512 tiles' shapes.
    Bf16Wide,
    Bf16Narrow,
}

impl Tile {
    /// The tile for bf16 pairs and a product `n` columns wide.
    fn bf16(n: usize) -> Self {
        if n <= 16 {
            Self::Bf16Narrow
        } else {
            Self::Bf16Wide
        }
    }
}

impl Tile {
    /// Rows of A per tile.
    fn mr(self) -> usize {
        match self {
            Self::Avx512Wide | Self::Bf16Wide => 12,
            Self::Avx512Narrow | Self::Bf16Narrow => 24,
            Self::Avx2Wide => 6,
            Self::Avx2Narrow => 12,
        }
    }

    /// Columns of B per tile.
    fn nr(self) -> usize {
        match self {
            Self::Avx512Wide | Self::Bf16Wide => 32,
            Self::Avx512Narrow | Self::Bf16Narrow => 16,
            Self::Avx2Wide => 16,
            Self::Avx2Narrow => 8,
        }
    }
}

/// Rows of B (the `k` extent) per block: each element's sum is folded into C once per
/// block, so this is part of the arithmetic (the same for every split and kernel). A
/// packed B panel of `KC × 32` floats (32 KiB) stays in L1 while it is used.
const KC: usize = 256;

/// Columns of B packed at a time: `KC × NC` floats, 1 MiB.
const NC: usize = 1024;

/// Rows of A packed at a time: `MC × KC` floats (240 KiB) stay in L2 while each panel
/// of B passes over them. A multiple of every tile's rows.
const MC: usize = 240;

/// The largest tile, for the scratch an edge tile is computed in.
const MAX_TILE: usize = 24 * 32;

thread_local! {
    /// The packed operands, per thread, reused across calls (taken out for a call's
    /// duration).
    static PACKED_A: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static PACKED_B: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// `C = α·A·B + β·C` for `A` (`m × k`) and `B` (`k × n`) with any strides, on this
/// thread. With `β = 0`, C's old contents are not read.
///
/// # Safety
/// `isa` must be [`available`](Isa::available); `c` must point at `m` rows of `n`
/// writable elements, `ldc` apart, that no other thread touches during the call.
pub(crate) unsafe fn gemm(
    isa: Isa,
    alpha: f32,
    a: Mat<'_>,
    b: Mat<'_>,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: the caller's.
    unsafe { drive(isa.tile(b.cols), alpha, a, SourceB::Mat(b), beta, c, ldc) }
}

/// A bf16 matrix view (`rows × cols`, element (i, j) at `data[i·row_stride +
/// j·col_stride]`), used as the B of a bf16 product: its pairs run down the columns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bf16Mat<'a> {
    pub(crate) data: &'a [bf16],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
}

impl<'a> Bf16Mat<'a> {
    /// Columns `first..first + cols` of it.
    pub(crate) fn columns(self, first: usize, cols: usize) -> Self {
        Self {
            data: &self.data[first * self.col_stride..],
            cols,
            ..self
        }
    }

    /// Element (i, j)'s bits, 0 (a bf16 zero) past the last row.
    #[inline]
    fn bits(&self, i: usize, j: usize) -> u32 {
        if i < self.rows {
            u32::from(self.data[i * self.row_stride + j * self.col_stride].to_bits())
        } else {
            0
        }
    }
}

/// `C = α·A·B + β·C` over bf16 operands with f32 sums, on this thread: `a` holds A's
/// rows as bf16 pairs (`m × ⌈k/2⌉` f32s whose bits are elements `2p` (low half) and
/// `2p + 1` of the row, a zero past an odd `k`), `b` is B (`k × n`).
///
/// # Safety
/// [`Isa::bf16_detected`] must be true; `c` as for [`gemm`].
pub(crate) unsafe fn gemm_bf16(
    alpha: f32,
    a: Mat<'_>,
    b: Bf16Mat<'_>,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    debug_assert_eq!(a.cols, b.rows.div_ceil(2));
    // SAFETY: the caller's.
    unsafe { drive(Tile::bf16(b.cols), alpha, a, SourceB::Bf16(b), beta, c, ldc) }
}

/// B as the driver packs it.
#[derive(Clone, Copy)]
enum SourceB<'a> {
    /// Elements as stored: f32s, or for the bf16 tiles pairs already in an f32's bits.
    Mat(Mat<'a>),
    /// bf16 values, paired down the columns while packing.
    Bf16(Bf16Mat<'a>),
}

impl SourceB<'_> {
    /// Rows in the driver's elements (bf16 pairs for [`Self::Bf16`]) and columns.
    fn shape(&self) -> (usize, usize) {
        match self {
            Self::Mat(b) => (b.rows, b.cols),
            Self::Bf16(b) => (b.rows.div_ceil(2), b.cols),
        }
    }
}

/// The blocked product for one tile shape; see the module's documentation.
///
/// # Safety
/// The tile's kernel runs on this CPU; `c` as for [`gemm`].
unsafe fn drive(
    tile: Tile,
    alpha: f32,
    a: Mat<'_>,
    b: SourceB<'_>,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    let (m, k) = (a.rows, a.cols);
    let (b_rows, n) = b.shape();
    debug_assert_eq!(k, b_rows);
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let (mr, nr) = (tile.mr(), tile.nr());
    let in_place = reads_a_in_place(&a, n, tile);
    let mut packed_b = PACKED_B.take();
    grow(&mut packed_b, KC.min(k) * NC.min(n).next_multiple_of(nr));
    let mut packed_a = PACKED_A.take();
    if !in_place {
        grow(&mut packed_a, KC.min(k) * MC.min(m).next_multiple_of(mr));
    }
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let beta = if pc == 0 { beta } else { 1.0 };
            match b {
                SourceB::Mat(b) => pack_b(b, pc, kc, jc, nc, nr, &mut packed_b),
                SourceB::Bf16(b) => pack_b_bf16(b, pc, kc, jc, nc, nr, &mut packed_b),
            }
            for ic in (0..m).step_by(MC) {
                let mc = MC.min(m - ic);
                if !in_place {
                    pack_a(a, ic, mc, pc, kc, mr, &mut packed_a);
                }
                for jr in (0..nc).step_by(nr) {
                    let panel = &packed_b[(jr / nr) * kc * nr..][..kc * nr];
                    let cols = nr.min(nc - jr);
                    for ir in (0..mc).step_by(mr) {
                        let rows = mr.min(mc - ir);
                        let tile_a = if in_place {
                            // The last tile moves up to end at A's last row: its first
                            // rows are computed again (the same bits) and not written.
                            let first = (ic + ir).min(m - mr);
                            let start = first * a.row_stride + pc * a.col_stride;
                            TileA {
                                data: &a.data[start..],
                                row_stride: a.row_stride,
                                col_stride: a.col_stride,
                                skip: ic + ir - first,
                            }
                        } else {
                            TileA {
                                data: &packed_a[(ir / mr) * mr * kc..][..mr * kc],
                                row_stride: 1,
                                col_stride: mr,
                                skip: 0,
                            }
                        };
                        // SAFETY: rows `ic + ir..` (`rows` of them) and columns
                        // `jc + jr..` (`cols`) lie in C, as the caller promised for all
                        // of C; the tile's A holds `mr × kc` elements at its strides
                        // (rows `first..first + mr ≤ m`, columns `pc..pc + kc ≤ k` of
                        // the view, or a whole packed panel).
                        unsafe {
                            run_tile(
                                tile,
                                kc,
                                &tile_a,
                                panel,
                                alpha,
                                beta,
                                c.add((ic + ir) * ldc + jc + jr),
                                ldc,
                                (rows, cols),
                            );
                        }
                    }
                }
            }
        }
    }
    PACKED_B.set(packed_b);
    PACKED_A.set(packed_a);
}

/// Whether the kernel reads A where it is rather than from a packed copy. A whole tile
/// of rows is needed (the last tile moves up to end at A's last row), and then:
/// - with one panel of B, each element of A is read once, so packing it costs more than
///   it saves;
/// - with rows of A contiguous (every activation the step multiplies), a tile's rows
///   are `mr` short streams the kernel broadcasts from as well as from a packed panel,
///   and the copy, a transpose, was about 5 % of a tiny-preset step. Not when the rows
///   are a multiple of 4 KiB apart (a 4096-wide vocabulary's logits, a 1024-wide
///   hidden state): then every row of the tile falls in the same L1 set, and the
///   evictions made such a product 30 % slower than packing.
///
/// Either way each element of C is computed the same way (see the module's notes), so
/// this choice does not change a bit.
fn reads_a_in_place(a: &Mat<'_>, n: usize, tile: Tile) -> bool {
    /// Rows this many floats apart (4 KiB) share an L1 set.
    const L1_SET_STRIDE: usize = 1024;
    a.rows >= tile.mr()
        && (n <= tile.nr() || (a.col_stride == 1 && !a.row_stride.is_multiple_of(L1_SET_STRIDE)))
}

/// Makes `buf` at least `len` long (packs overwrite what they use, so the values do
/// not matter).
fn grow(buf: &mut Vec<f32>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
}

/// The A operand of one tile: element (i, p) at `data[i·row_stride + p·col_stride]`,
/// of which the first `skip` rows are computed but not written.
struct TileA<'a> {
    data: &'a [f32],
    row_stride: usize,
    col_stride: usize,
    skip: usize,
}

/// One tile of C: straight into C when it is whole, else through a scratch tile (rows
/// of A past the end are zeros or skipped rows, columns of B past the end are the
/// panel's zero padding), of which only the real part is copied back.
///
/// # Safety
/// `c` points at `rows` rows of `cols` writable elements, `ldc` apart; `a` holds the
/// tile's `mr × kc` elements at its strides; the tile's kernel runs on this CPU.
#[allow(clippy::too_many_arguments)]
unsafe fn run_tile(
    tile: Tile,
    kc: usize,
    a: &TileA<'_>,
    panel: &[f32],
    alpha: f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
    (rows, cols): (usize, usize),
) {
    let (mr, nr) = (tile.mr(), tile.nr());
    let kernel = |c: *mut f32, ldc: usize| {
        let (a, rsa, csa, b) = (a.data.as_ptr(), a.row_stride, a.col_stride, panel.as_ptr());
        // SAFETY: A's `mr × kc` elements and the panel's `kc × nr` are readable (the
        // caller's promise; the panel slice is exactly that long), C as the caller of
        // the closure says.
        unsafe {
            match tile {
                Tile::Avx512Wide => kernel_avx512::<12, 2>(kc, a, rsa, csa, b, alpha, beta, c, ldc),
                Tile::Avx512Narrow => {
                    kernel_avx512::<24, 1>(kc, a, rsa, csa, b, alpha, beta, c, ldc)
                }
                Tile::Avx2Wide => kernel_avx2::<6, 2>(kc, a, rsa, csa, b, alpha, beta, c, ldc),
                Tile::Avx2Narrow => kernel_avx2::<12, 1>(kc, a, rsa, csa, b, alpha, beta, c, ldc),
                Tile::Bf16Wide => kernel_bf16::<12, 2>(kc, a, rsa, csa, b, alpha, beta, c, ldc),
                Tile::Bf16Narrow => kernel_bf16::<24, 1>(kc, a, rsa, csa, b, alpha, beta, c, ldc),
            }
        }
    };
    if a.skip == 0 && rows == mr && cols == nr {
        kernel(c, ldc);
        return;
    }
    let mut scratch = [0f32; MAX_TILE];
    let first = a.skip;
    if beta != 0.0 {
        for i in 0..rows {
            for j in 0..cols {
                // SAFETY: (i, j) is inside the tile's part of C.
                scratch[(first + i) * nr + j] = unsafe { *c.add(i * ldc + j) };
            }
        }
    }
    kernel(scratch.as_mut_ptr(), nr);
    for i in 0..rows {
        for j in 0..cols {
            // SAFETY: as above.
            unsafe { *c.add(i * ldc + j) = scratch[(first + i) * nr + j] };
        }
    }
}

/// Defines a kernel `C[MR × NV·LANES] = α·A·B + β·C` over `kc` steps of `k`: A read in
/// place (element (i, p) at `a + i·rsa + p·csa`), B from a packed panel (`kc` rows of
/// `NV·LANES`), accumulators in registers, each step `acc = dot(a, b, acc)`.
macro_rules! kernel {
    ($name:ident, $feature:literal, $lanes:literal, $vec:ty, $zero:ident, $load:ident,
     $set1:ident, $dot:ident, $fmadd:ident, $mul:ident, $store:ident) => {
        /// # Safety
        /// The CPU has the kernel's features; A's `MR × kc` elements and the panel's
        /// `kc × NV·LANES` are readable, C's `MR` rows of `NV·LANES` writable.
        #[target_feature(enable = $feature)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name<const MR: usize, const NV: usize>(
            kc: usize,
            a: *const f32,
            rsa: usize,
            csa: usize,
            b: *const f32,
            alpha: f32,
            beta: f32,
            c: *mut f32,
            ldc: usize,
        ) {
            let mut acc: [[$vec; NV]; MR] = [[$zero(); NV]; MR];
            for p in 0..kc {
                // SAFETY: p < kc, so these are inside the panel and A's block.
                unsafe {
                    let mut bv: [$vec; NV] = [$zero(); NV];
                    for (v, bv) in bv.iter_mut().enumerate() {
                        *bv = $load(b.add(p * NV * $lanes + v * $lanes));
                    }
                    let ap = a.add(p * csa);
                    for (i, row) in acc.iter_mut().enumerate() {
                        let x = $set1(*ap.add(i * rsa));
                        for (acc, bv) in row.iter_mut().zip(&bv) {
                            *acc = $dot(x, *bv, *acc);
                        }
                    }
                }
            }
            let alpha = $set1(alpha);
            for (i, row) in acc.iter().enumerate() {
                for (v, acc) in row.iter().enumerate() {
                    // SAFETY: row i < MR, columns v·LANES.. < NV·LANES of C.
                    unsafe {
                        let out = c.add(i * ldc + v * $lanes);
                        let value = if beta == 0.0 {
                            $mul(alpha, *acc)
                        } else {
                            $fmadd(alpha, *acc, $mul($load(out), $set1(beta)))
                        };
                        $store(out, value);
                    }
                }
            }
        }
    };
}

kernel!(
    kernel_avx512,
    "avx512f",
    16,
    __m512,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    _mm512_fmadd_ps,
    _mm512_mul_ps,
    _mm512_storeu_ps
);
kernel!(
    kernel_avx2,
    "avx2,fma",
    8,
    __m256,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    _mm256_fmadd_ps,
    _mm256_mul_ps,
    _mm256_storeu_ps
);
kernel!(
    kernel_bf16,
    "avx512f,avx512bf16",
    16,
    __m512,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_set1_ps,
    dot_bf16,
    _mm512_fmadd_ps,
    _mm512_mul_ps,
    _mm512_storeu_ps
);

/// `acc + x·b` over bf16 pairs: lane i adds the two products of `x`'s and `b`'s pair i
/// (each vector's 32 bits per lane read as two bf16 values).
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn dot_bf16(x: __m512, b: __m512, acc: __m512) -> __m512 {
    // SAFETY: bit casts between 512-bit vector types.
    let (x, b) = unsafe {
        (
            transmute::<__m512, __m512bh>(x),
            transmute::<__m512, __m512bh>(b),
        )
    };
    _mm512_dpbf16_ps(acc, x, b)
}

#[cfg(test)]
mod tests;
