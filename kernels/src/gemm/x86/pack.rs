//! Packing: copying a block of A or B into the order the kernels read it, with 4 × 8
//! register transposes where the source runs the other way, and bf16 values paired
//! for the bf16 kernels.

use std::arch::x86_64::_mm256_loadu_ps;

use super::Bf16Mat;
use crate::gemm::Mat;

/// Copies `A[ic.., pc..]` (`mc × kc`) into `out` as panels of `mr` rows, each stored
/// column after column (`kc × mr`), the last one padded with zero rows.
pub(super) fn pack_a(
    a: Mat<'_>,
    ic: usize,
    mc: usize,
    pc: usize,
    kc: usize,
    mr: usize,
    out: &mut [f32],
) {
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
pub(super) fn pack_b(
    b: Mat<'_>,
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    nr: usize,
    out: &mut [f32],
) {
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
pub(super) fn pack_b_bf16(
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
