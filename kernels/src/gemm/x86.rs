//! The crate's own f32 GEMM for x86-64 CPUs with AVX-512F, or AVX2 and FMA.
//!
//! Why not matrixmultiply: like every GEMM it first copies ("packs") its operands into
//! the order its kernel reads them, but a row-major A (every activation the step
//! multiplies) and a transposed B (every `x·Wᵀ`) are copied one element at a time,
//! which took ~21 % of a tiny-preset step (perf, AMD EPYC with AVX-512), a third of the
//! time of the multiply itself. Here those copies transpose 4 × 8 blocks in AVX
//! registers, and an A used against a single panel of B (LoRA's rank-r products) is
//! not copied at all: the kernel broadcasts its elements in place, with any strides.
//!
//! The usual blocking: B in panels of `nr` columns and at most [`KC`] rows ([`NC`]
//! columns at a time), A in panels of `mr` rows ([`MC`] rows at a time); a kernel
//! keeps an `mr × nr` tile of C in registers (12 × 32 with AVX-512, 6 × 16 with AVX2,
//! twice the rows and one vector of columns for products at most a vector wide).
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

use super::Mat;

/// The instruction set the kernels run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// 16-lane kernels (AVX-512F).
    Avx512,
    /// 8-lane kernels (AVX2 and FMA).
    Avx2,
}

impl Isa {
    /// The best this CPU runs, checked once; `None` without AVX2 and FMA.
    pub(crate) fn detected() -> Option<Self> {
        static FOUND: OnceLock<Option<Isa>> = OnceLock::new();
        *FOUND.get_or_init(|| {
            if std::arch::is_x86_feature_detected!("avx512f") {
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

    /// Whether this CPU has the bf16 kernels (AVX-512F and AVX512-BF16), checked once.
    pub(crate) fn bf16_detected() -> bool {
        static FOUND: OnceLock<bool> = OnceLock::new();
        *FOUND.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
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
    /// as LoRA's rank-r products do.
    fn tile(self, n: usize) -> Tile {
        match self {
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
    // With one panel of B, each element of A is read once: packing it would cost more
    // than it saves, so the kernel reads it in place (a whole tile of rows is needed).
    let in_place = n <= nr && m >= mr;
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

/// Copies `A[ic.., pc..]` (`mc × kc`) into `out` as panels of `mr` rows, each stored
/// column after column (`kc × mr`), the last one padded with zero rows.
fn pack_a(a: Mat<'_>, ic: usize, mc: usize, pc: usize, kc: usize, mr: usize, out: &mut [f32]) {
    let panels = mc.div_ceil(mr);
    for (q, panel) in out[..panels * kc * mr]
        .chunks_exact_mut(kc * mr)
        .enumerate()
    {
        let first = ic + q * mr;
        let rows = mr.min(ic + mc - first);
        if a.col_stride == 1 {
            // Rows of A are contiguous: 4 × 8 blocks transposed in registers, the
            // rest element by element.
            let (whole_p, whole_i) = (kc / 8 * 8, rows / 4 * 4);
            for p0 in (0..whole_p).step_by(8) {
                for i0 in (0..whole_i).step_by(4) {
                    let start = (first + i0) * a.row_stride + pc + p0;
                    transpose_4x8(
                        &a.data[start..],
                        a.row_stride,
                        &mut panel[p0 * mr + i0..],
                        mr,
                    );
                }
            }
            for i in 0..rows {
                let start = (first + i) * a.row_stride + pc;
                let from = if i < whole_i { whole_p } else { 0 };
                for p in from..kc {
                    panel[p * mr + i] = a.data[start + p];
                }
            }
            if rows < mr {
                for dst in panel.chunks_exact_mut(mr) {
                    dst[rows..].fill(0.0);
                }
            }
        } else {
            for (p, dst) in panel.chunks_exact_mut(mr).enumerate() {
                let column = (pc + p) * a.col_stride + first * a.row_stride;
                for (i, d) in dst[..rows].iter_mut().enumerate() {
                    *d = a.data[column + i * a.row_stride];
                }
                dst[rows..].fill(0.0);
            }
        }
    }
}

/// Copies `B[pc.., jc..]` (`kc × nc`) into `out` as panels of `nr` columns, each
/// `kc × nr` row-major, the last one padded with zeros.
fn pack_b(b: Mat<'_>, pc: usize, kc: usize, jc: usize, nc: usize, nr: usize, out: &mut [f32]) {
    let panels = nc.div_ceil(nr);
    for (q, panel) in out[..panels * kc * nr]
        .chunks_exact_mut(kc * nr)
        .enumerate()
    {
        let j0 = jc + q * nr;
        let cols = nr.min(jc + nc - j0);
        if b.col_stride == 1 {
            for (p, dst) in panel.chunks_exact_mut(nr).enumerate() {
                let start = (pc + p) * b.row_stride + j0;
                let src = &b.data[start..start + cols];
                if cols == nr {
                    copy_row(dst, src);
                } else {
                    dst[..cols].copy_from_slice(src);
                    dst[cols..].fill(0.0);
                }
            }
        } else {
            // Columns of B are contiguous (a transposed weight) or nothing is: walk each
            // column down, writing it across the panel's rows.
            if cols < nr {
                panel.fill(0.0);
            }
            let (whole_p, whole_j) = if b.row_stride == 1 {
                (kc / 8 * 8, cols / 4 * 4)
            } else {
                (0, 0)
            };
            for jj0 in (0..whole_j).step_by(4) {
                let column = (j0 + jj0) * b.col_stride + pc;
                for p0 in (0..whole_p).step_by(8) {
                    let src = &b.data[column + p0..];
                    transpose_4x8(src, b.col_stride, &mut panel[p0 * nr + jj0..], nr);
                }
            }
            for jj in 0..cols {
                let column = (j0 + jj) * b.col_stride + pc * b.row_stride;
                let from = if jj < whole_j { whole_p } else { 0 };
                for p in from..kc {
                    panel[p * nr + jj] = b.data[column + p * b.row_stride];
                }
            }
        }
    }
}

/// As [`pack_b`] for bf16 values: pair `p` of column `j` is rows `2p` and `2p + 1` of
/// B (`pc..pc + kc` counts pairs), carried in one f32's bits.
fn pack_b_bf16(
    b: Bf16Mat<'_>,
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    nr: usize,
    out: &mut [f32],
) {
    let pair = |lo: u32, hi: u32| f32::from_bits(lo | hi << 16);
    let panels = nc.div_ceil(nr);
    for (q, panel) in out[..panels * kc * nr]
        .chunks_exact_mut(kc * nr)
        .enumerate()
    {
        let j0 = jc + q * nr;
        let cols = nr.min(jc + nc - j0);
        if cols < nr {
            panel.fill(0.0);
        }
        if b.row_stride == 1 {
            // Columns contiguous (a weight used transposed, `x·Wᵀ`): walk each column
            // down, two values per pair, writing it across the panel's rows.
            let whole = (b.rows.saturating_sub(2 * pc) / 2).min(kc);
            for jj in 0..cols {
                let column = &b.data[(j0 + jj) * b.col_stride + 2 * pc..];
                for (p, two) in column[..2 * whole].chunks_exact(2).enumerate() {
                    panel[p * nr + jj] = pair(two[0].to_bits().into(), two[1].to_bits().into());
                }
                for p in whole..kc {
                    let row = 2 * (pc + p);
                    panel[p * nr + jj] = pair(b.bits(row, j0 + jj), b.bits(row + 1, j0 + jj));
                }
            }
            continue;
        }
        for (p, dst) in panel.chunks_exact_mut(nr).enumerate() {
            let row = 2 * (pc + p);
            if b.col_stride == 1 && row + 1 < b.rows {
                // Rows contiguous (a weight used as stored, `dY·W`): two rows side by side.
                let lo = &b.data[row * b.row_stride + j0..][..cols];
                let hi = &b.data[(row + 1) * b.row_stride + j0..][..cols];
                for ((d, lo), hi) in dst.iter_mut().zip(lo).zip(hi) {
                    *d = pair(lo.to_bits().into(), hi.to_bits().into());
                }
            } else {
                for (jj, d) in dst[..cols].iter_mut().enumerate() {
                    *d = pair(b.bits(row, j0 + jj), b.bits(row + 1, j0 + jj));
                }
            }
        }
    }
}

/// `dst[p·dst_stride + r] = src[r·src_stride + p]` for `r < 4`, `p < 8`: a 4 × 8 block
/// transposed in AVX registers.
///
/// # Panics
/// If either block reaches past its slice.
#[inline]
fn transpose_4x8(src: &[f32], src_stride: usize, dst: &mut [f32], dst_stride: usize) {
    assert!(src.len() >= 3 * src_stride + 8 && dst.len() >= 7 * dst_stride + 4);
    // SAFETY: both blocks are inside their slices (asserted), and every CPU the kernels
    // run on has AVX (`Isa` requires AVX2 or AVX-512F).
    unsafe { transpose_4x8_avx(src.as_ptr(), src_stride, dst.as_mut_ptr(), dst_stride) }
}

/// # Safety
/// As [`transpose_4x8`] checks, and the CPU has AVX.
#[target_feature(enable = "avx")]
unsafe fn transpose_4x8_avx(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::{
        _mm_storeu_ps, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm256_shuffle_ps,
        _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };
    // SAFETY: the caller's.
    unsafe {
        let row = |r: usize| _mm256_loadu_ps(src.add(r * src_stride));
        let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
        // Pairs of rows interleaved, then pairs of pairs: lane half h of `u[q]` holds
        // column q + 4h of the four rows.
        let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
        let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
        let u = [
            _mm256_shuffle_ps::<0x44>(t0, t2),
            _mm256_shuffle_ps::<0xEE>(t0, t2),
            _mm256_shuffle_ps::<0x44>(t1, t3),
            _mm256_shuffle_ps::<0xEE>(t1, t3),
        ];
        for (q, u) in u.into_iter().enumerate() {
            _mm_storeu_ps(dst.add(q * dst_stride), _mm256_castps256_ps128(u));
            _mm_storeu_ps(dst.add((q + 4) * dst_stride), _mm256_extractf128_ps::<1>(u));
        }
    }
}

/// `dst = src` for a tile's row (8, 16 or 32 floats): a fixed-length copy, which
/// compiles to vector moves rather than a call of `memcpy`.
#[inline(always)]
fn copy_row(dst: &mut [f32], src: &[f32]) {
    fn fixed<const N: usize>(dst: &mut [f32], src: &[f32]) {
        if let (Ok(d), Ok(s)) = (<&mut [f32; N]>::try_from(dst), <&[f32; N]>::try_from(src)) {
            *d = *s;
        }
    }
    match dst.len() {
        32 => fixed::<32>(dst, src),
        16 => fixed::<16>(dst, src),
        _ => dst.copy_from_slice(src),
    }
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
mod tests {
    use super::*;

    /// Deterministic values in [−1, 1).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// `C = 0.7·A·B + β·C` on `isa`, with A and B stored transposed or not and C inside
    /// a wider buffer; returns that buffer.
    fn product(
        isa: Isa,
        (m, n, k): (usize, usize, usize),
        ta: bool,
        tb: bool,
        beta: f32,
    ) -> Vec<f32> {
        let (a, b) = (values(m * k, 1), values(k * n, 2));
        let a = if ta {
            Mat::new(&a, k, m).t()
        } else {
            Mat::new(&a, m, k)
        };
        let b = if tb {
            Mat::new(&b, n, k).t()
        } else {
            Mat::new(&b, k, n)
        };
        let ldc = n + 3;
        let mut c = values(m * ldc, 3);
        // SAFETY: `isa` is available (checked by the callers); C holds m rows of n
        // elements ldc apart and is only this thread's.
        unsafe { gemm(isa, 0.7, a, b, beta, c.as_mut_ptr(), ldc) };
        c
    }

    /// The shapes: whole and edge tiles of both widths, A read in place (with its last
    /// tile moved up) and packed, more than one block of `k`, of A's rows and of B's
    /// columns.
    const SHAPES: [(usize, usize, usize); 8] = [
        (1, 1, 1),
        (5, 3, 7),
        (7, 8, 9),
        (30, 8, 600),
        (100, 16, 300),
        (13, 33, 257),
        (250, 1030, 40),
        (37, 70, 520),
    ];

    #[test]
    fn each_instruction_set_computes_the_product_and_both_give_the_same_bits() {
        let avx512 = Isa::Avx512.available();
        assert!(Isa::Avx2.available(), "these kernels need AVX2 and FMA");
        for (m, n, k) in SHAPES {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let before = values(m * (n + 3), 3);
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for beta in [0.0, -0.3] {
                    let got = product(Isa::Avx2, (m, n, k), ta, tb, beta);
                    let ldc = n + 3;
                    for i in 0..m {
                        for j in 0..n {
                            let at = |x: &[f32],
                                      r: usize,
                                      c: usize,
                                      t: bool,
                                      cols: usize,
                                      rows: usize| {
                                if t { x[c * rows + r] } else { x[r * cols + c] }
                            };
                            let dot: f64 = (0..k)
                                .map(|p| {
                                    at(&a, i, p, ta, k, m) as f64 * at(&b, p, j, tb, n, k) as f64
                                })
                                .sum();
                            let want = 0.7 * dot + beta as f64 * before[i * ldc + j] as f64;
                            let got = got[i * ldc + j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                                "{m}×{n}×{k} tA={ta} tB={tb} β={beta}: ({i},{j}) {got} vs {want}"
                            );
                        }
                        for j in n..ldc {
                            assert_eq!(
                                got[i * ldc + j].to_bits(),
                                before[i * ldc + j].to_bits(),
                                "padding ({i},{j}) was written"
                            );
                        }
                    }
                    if avx512 {
                        let wide = product(Isa::Avx512, (m, n, k), ta, tb, beta);
                        assert!(
                            wide.iter()
                                .zip(&got)
                                .all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{m}×{n}×{k} tA={ta} tB={tb} β={beta}: AVX-512 and AVX2 differ"
                        );
                    }
                }
            }
        }
    }

    /// `C = 0.7·A·B + β·C` on the bf16 kernels for B (`k × n`, bf16) stored as is
    /// (`as_stored`) or transposed, A given as pairs of `a16` (`m × k`), computed whole
    /// and, when `split`, in blocks of rows and of columns as the threads' splits cut it.
    fn bf16_product(
        (m, n, k): (usize, usize, usize),
        a16: &[bf16],
        b16: &[bf16],
        as_stored: bool,
        beta: f32,
        split: Option<(usize, usize)>,
    ) -> Vec<f32> {
        let pairs = k.div_ceil(2);
        let a: Vec<f32> = (0..m * pairs)
            .map(|e| {
                let (i, p) = (e / pairs, e % pairs);
                let lo = u32::from(a16[i * k + 2 * p].to_bits());
                let hi = if 2 * p + 1 < k {
                    u32::from(a16[i * k + 2 * p + 1].to_bits())
                } else {
                    0
                };
                f32::from_bits(lo | hi << 16)
            })
            .collect();
        let b = if as_stored {
            Bf16Mat {
                data: b16,
                rows: k,
                cols: n,
                row_stride: n,
                col_stride: 1,
            }
        } else {
            Bf16Mat {
                data: b16,
                rows: k,
                cols: n,
                row_stride: 1,
                col_stride: k,
            }
        };
        let ldc = n + 3;
        let mut c = values(m * ldc, 3);
        let (rows, cols) = split.unwrap_or((m, n));
        for i0 in (0..m).step_by(rows) {
            for j0 in (0..n).step_by(cols) {
                let a_block = Mat::strided(&a[i0 * pairs..], rows.min(m - i0), pairs, pairs, 1);
                let b_block = b.columns(j0, cols.min(n - j0));
                // SAFETY: the bf16 kernels were detected (checked by the caller); the
                // block of C lies inside `c` and is only this thread's.
                unsafe {
                    gemm_bf16(
                        0.7,
                        a_block,
                        b_block,
                        beta,
                        c.as_mut_ptr().add(i0 * ldc + j0),
                        ldc,
                    )
                };
            }
        }
        c
    }

    #[test]
    fn the_bf16_kernels_compute_the_product_and_any_split_gives_the_same_bits() {
        if !Isa::bf16_detected() {
            eprintln!("this CPU has no AVX512-BF16: the bf16 kernels are not run here");
            return;
        }
        let to_bf16 = |v: Vec<f32>| -> Vec<bf16> { v.into_iter().map(bf16::from_f32).collect() };
        // Odd and even k over more than one block of pairs, A read in place (n ≤ 16,
        // m ≥ 24) and packed, edge tiles, more than one panel of B's columns.
        for (m, n, k) in [
            (1, 1, 1),
            (30, 8, 1201),
            (50, 16, 64),
            (13, 33, 517),
            (70, 1030, 40),
        ] {
            let (a16, b16) = (to_bf16(values(m * k, 1)), to_bf16(values(k * n, 2)));
            let before = values(m * (n + 3), 3);
            for as_stored in [true, false] {
                for beta in [0.0, -0.3] {
                    let got = bf16_product((m, n, k), &a16, &b16, as_stored, beta, None);
                    let ldc = n + 3;
                    for i in 0..m {
                        for j in 0..n {
                            let w = |p: usize| {
                                if as_stored {
                                    b16[p * n + j]
                                } else {
                                    b16[j * k + p]
                                }
                            };
                            let dot: f64 = (0..k)
                                .map(|p| {
                                    f64::from(a16[i * k + p].to_f32()) * f64::from(w(p).to_f32())
                                })
                                .sum();
                            let want = 0.7 * dot + f64::from(beta) * f64::from(before[i * ldc + j]);
                            let got = f64::from(got[i * ldc + j]);
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                                "{m}×{n}×{k} stored {as_stored} β={beta}: ({i},{j}) {got} vs {want}"
                            );
                        }
                        for j in n..ldc {
                            assert_eq!(got[i * ldc + j].to_bits(), before[i * ldc + j].to_bits());
                        }
                    }
                    for split in [(64, n), (m, 64), (7, 5)] {
                        let parts =
                            bf16_product((m, n, k), &a16, &b16, as_stored, beta, Some(split));
                        assert!(
                            parts
                                .iter()
                                .zip(&got)
                                .all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{m}×{n}×{k} stored {as_stored} β={beta}: split {split:?} changed bits"
                        );
                    }
                }
            }
        }
    }
}
