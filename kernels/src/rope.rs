//! Rotary position embedding in Hugging Face's rotate-half layout, in place.
//!
//! For a head vector `x` of width `d` with halves `x₁ = x[..d/2]`, `x₂ = x[d/2..]` at
//! position `p`, with `c = cos[p]`, `s = sin[p]` (tables of `d/2` angles per position):
//! `x₁ ← x₁·c − x₂·s`, `x₂ ← x₁·s + x₂·c`. This is HF's `x·cos + rotate_half(x)·sin`
//! with the tables duplicated across both halves, and the same arithmetic as candle's
//! `rope` kernel.
//!
//! The fused step rotates q and k where the qkv GEMM wrote them (rows of
//! `[q heads | k heads | v heads]`), so no transposed copies are made, and rotates the
//! gradients dq and dk back with the inverse (the transpose: `s → −s`) in backward.
//! Rows are independent; rayon runs fixed blocks of [`ROWS`] rows.

use rayon::prelude::*;

/// Rows (tokens) per parallel task.
pub const ROWS: usize = 16;

/// Rotates, in place, `heads` contiguous head vectors of width `head_dim` that start at
/// column `first_col` of each row of `buf` (rows `row_stride` apart), row `r` by the
/// angles of position `positions[r]` from the `(max_pos, head_dim/2)` tables `cos` and
/// `sin`. With `inverse`, applies the transposed rotation (by `−θ`), which undoes the
/// forward one and maps an output gradient to the input gradient.
///
/// One row per entry of `positions`; columns outside the heads are not touched.
///
/// # Panics
/// If `head_dim` is odd or 0, the heads do not fit in a row (`first_col + heads·head_dim
/// > row_stride`), `buf` is too short for `positions.len()` rows, the tables differ in
/// length or are not whole rows of `head_dim/2`, or a position is past the tables.
// The layout takes this many numbers; a struct would only rename them at each call.
#[allow(clippy::too_many_arguments)]
pub fn rope_in_place(
    buf: &mut [f32],
    row_stride: usize,
    first_col: usize,
    heads: usize,
    head_dim: usize,
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
    inverse: bool,
) {
    assert!(
        head_dim > 0 && head_dim.is_multiple_of(2),
        "head_dim {head_dim} must be even and positive"
    );
    let half = head_dim / 2;
    let width = heads * head_dim;
    assert!(
        first_col + width <= row_stride,
        "{heads} heads of {head_dim} from column {first_col} do not fit in rows of {row_stride}"
    );
    assert_eq!(cos.len(), sin.len(), "cos and sin tables differ in length");
    assert_eq!(
        cos.len() % half,
        0,
        "tables of {} are not rows of {half}",
        cos.len()
    );
    let max_pos = cos.len() / half;
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= max_pos) {
        panic!("position {p} is past the RoPE tables' {max_pos} positions");
    }
    let rows = positions.len();
    if rows == 0 || width == 0 {
        return;
    }
    let needed = (rows - 1) * row_stride + first_col + width;
    assert!(
        buf.len() >= needed,
        "{rows} rows of stride {row_stride} need {needed} elements, the buffer has {}",
        buf.len()
    );
    // Multiplying by −1 is exact, so the inverse rounds exactly like a forward rotation
    // with a negated sine table.
    let sign = if inverse { -1.0f32 } else { 1.0 };
    buf[..needed]
        .par_chunks_mut(ROWS * row_stride)
        .zip(positions.par_chunks(ROWS))
        .for_each(|(block, positions)| {
            for (i, &p) in positions.iter().enumerate() {
                let start = i * row_stride + first_col;
                let row = &mut block[start..start + width];
                let p = p as usize;
                let (c, s) = (&cos[p * half..][..half], &sin[p * half..][..half]);
                for head in row.chunks_exact_mut(head_dim) {
                    let (x1, x2) = head.split_at_mut(half);
                    for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(c).zip(s) {
                        let s = s * sign;
                        let (x, y) = (*a, *b);
                        *a = x * c - y * s;
                        *b = x * s + y * c;
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    /// HF's tables: angle(p, i) = p / θ^(2i/d), (max_pos, d/2) each.
    fn tables(max_pos: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
        let half = head_dim / 2;
        let (mut cos, mut sin) = (vec![], vec![]);
        for p in 0..max_pos {
            for i in 0..half {
                let inv_freq = 1.0 / 10_000f64.powf(2.0 * i as f64 / head_dim as f64);
                let angle = p as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        (cos, sin)
    }

    /// HF in f64: `x·cat(cos, cos) + rotate_half(x)·cat(sin, sin)`, with
    /// `rotate_half(x) = cat(−x₂, x₁)`. Returns the result and, per element, the size of
    /// its two terms, which bounds the rounding of the f32 kernel.
    fn reference(x: &[f32], cos: &[f32], sin: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let d = x.len();
        let half = d / 2;
        let full = |t: &[f32], j: usize| t[j % half] as f64;
        let rotated = |j: usize| {
            if j < half {
                -(x[j + half] as f64)
            } else {
                x[j - half] as f64
            }
        };
        (0..d)
            .map(|j| {
                let (a, b) = (x[j] as f64 * full(cos, j), rotated(j) * full(sin, j));
                (a + b, a.abs() + b.abs())
            })
            .unzip()
    }

    /// A qkv-like buffer: rows of [q: 4 heads | k: 2 heads | v: 2 heads] plus 3 padding
    /// columns, head_dim 8; rotating the k block touches only it.
    #[test]
    fn matches_hf_rotate_half_on_the_k_block_of_a_qkv_buffer() {
        let (nh, nkv, hd, rows) = (4, 2, 8, 37);
        let stride = (nh + 2 * nkv) * hd + 3;
        let (cos, sin) = tables(64, hd);
        let positions: Vec<u32> = (0..rows as u32).map(|r| (r * 7) % 64).collect();
        let before = random(rows * stride, 1);
        let mut buf = before.clone();
        rope_in_place(
            &mut buf,
            stride,
            nh * hd,
            nkv,
            hd,
            &positions,
            &cos,
            &sin,
            false,
        );
        for (r, &p) in positions.iter().enumerate() {
            let p = p as usize;
            let (c, s) = (&cos[p * hd / 2..][..hd / 2], &sin[p * hd / 2..][..hd / 2]);
            for col in 0..stride {
                let i = r * stride + col;
                let in_k = (nh * hd..(nh + nkv) * hd).contains(&col);
                if !in_k {
                    assert_eq!(buf[i].to_bits(), before[i].to_bits(), "({r}, {col})");
                }
            }
            for head in 0..nkv {
                let start = r * stride + (nh + head) * hd;
                let (want, size) = reference(&before[start..start + hd], c, s);
                for j in 0..hd {
                    let got = buf[start + j] as f64;
                    assert!(
                        (got - want[j]).abs() <= 1e-6 * size[j],
                        "row {r} head {head} [{j}]: {got} vs {}",
                        want[j]
                    );
                }
            }
        }
    }

    #[test]
    fn the_inverse_undoes_the_forward() {
        let (heads, hd, rows) = (3, 16, 20);
        let stride = heads * hd;
        let (cos, sin) = tables(4096, hd);
        // Large positions, where angles are large and the tables least tidy.
        let positions: Vec<u32> = (0..rows as u32).map(|r| 4095 - r * 13).collect();
        let x = random(rows * stride, 2);
        let mut buf = x.clone();
        rope_in_place(
            &mut buf, stride, 0, heads, hd, &positions, &cos, &sin, false,
        );
        assert!(buf.iter().zip(&x).any(|(a, b)| a != b), "nothing rotated");
        rope_in_place(&mut buf, stride, 0, heads, hd, &positions, &cos, &sin, true);
        for (i, (a, b)) in buf.iter().zip(&x).enumerate() {
            assert!((a - b).abs() <= 1e-6, "[{i}]: {a} vs {b}");
        }
    }

    /// The inverse is the transpose: ⟨R·x, y⟩ = ⟨x, Rᵀ·y⟩ for any tables (here random
    /// ones, which are not rotations), which is what backward needs.
    #[test]
    fn the_inverse_is_the_transpose() {
        let (heads, hd, rows) = (2, 6, 5);
        let stride = heads * hd;
        let cos = random(10 * hd / 2, 3);
        let sin = random(10 * hd / 2, 4);
        let positions = [0u32, 9, 3, 3, 7];
        let x = random(rows * stride, 5);
        let y = random(rows * stride, 6);
        let (mut rx, mut rty) = (x.clone(), y.clone());
        rope_in_place(&mut rx, stride, 0, heads, hd, &positions, &cos, &sin, false);
        rope_in_place(&mut rty, stride, 0, heads, hd, &positions, &cos, &sin, true);
        let dot = |a: &[f32], b: &[f32]| -> f64 {
            a.iter().zip(b).map(|(&a, &b)| a as f64 * b as f64).sum()
        };
        let (lhs, rhs) = (dot(&rx, &y), dot(&x, &rty));
        assert!(
            (lhs - rhs).abs() <= 1e-6 * (1.0 + lhs.abs()),
            "{lhs} vs {rhs}"
        );
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (heads, hd, rows) = (5, 32, 70);
        let stride = heads * hd + 1;
        let (cos, sin) = tables(128, hd);
        let positions: Vec<u32> = (0..rows as u32).map(|r| r % 128).collect();
        let x = random(rows * stride, 7);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            let mut buf = x.clone();
            pool.install(|| {
                rope_in_place(
                    &mut buf, stride, 1, heads, hd, &positions, &cos, &sin, false,
                )
            });
            buf.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }

    #[test]
    #[should_panic(expected = "past the RoPE tables")]
    fn a_position_past_the_tables_is_refused() {
        let (cos, sin) = tables(4, 4);
        let mut buf = [0f32; 8];
        rope_in_place(&mut buf, 4, 0, 1, 4, &[0, 4], &cos, &sin, false);
    }
}
