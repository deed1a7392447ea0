//! Rounding f32 operands to bf16 for bf16 compute, as PyTorch rounds them (to nearest,
//! ties to even), and pairing them as the own bf16 kernels read them: two consecutive
//! bf16 values along `k` in one f32's bits, the even one in the low half.

/// The bits of `x` rounded to the nearest bf16 (ties to even), as an f32 whose low 16
/// bits are zero: what `half::bf16::from_f32` gives, widened back, for every input but
/// a NaN, which stays a (quiet) NaN of the same sign. Overflow rounds to infinity.
#[inline]
pub(crate) fn rounded_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if x.is_nan() {
        return (b | 0x0040_0000) & 0xFFFF_0000;
    }
    b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000
}

/// `x` rounded to the nearest bf16, as an f32.
#[inline]
pub(crate) fn rounded(x: f32) -> f32 {
    f32::from_bits(rounded_bits(x))
}

/// The pair of `even` and `odd` rounded to bf16: `even`'s bits in the low half.
#[inline]
pub(crate) fn pair(even: f32, odd: f32) -> f32 {
    f32::from_bits(rounded_bits(even) >> 16 | rounded_bits(odd))
}

/// Writes `src` rounded and paired into `out` (`⌈src.len()/2⌉` elements), a zero
/// after an odd last element.
pub(crate) fn pair_row(src: &[f32], out: &mut [f32]) {
    let k = src.len();
    let (whole, last) = src.split_at(k / 2 * 2);
    for (o, two) in out.iter_mut().zip(whole.chunks_exact(2)) {
        *o = pair(two[0], two[1]);
    }
    if let Some(&x) = last.first() {
        out[k / 2] = pair(x, 0.0);
    }
}

/// [`pair_row`] of `row` into its own first `⌈row.len()/2⌉` elements (the rest is left
/// as it was): a row of the head's logit gradients is paired where it lies, so the
/// product with the head needs no second buffer of its size.
pub(crate) fn pair_in_place(row: &mut [f32]) {
    // Pair `i` is written over element `i`, after elements `2i` and `2i + 1` were
    // read: a block is read whole into `block` before any of its pairs is written, and
    // the pairs of a block starting at element `s` land below `s` (or, for the first
    // block, inside it, already read).
    const BLOCK: usize = 32;
    let k = row.len();
    let whole = k / 2 * 2;
    let mut block = [0f32; BLOCK];
    let mut start = 0;
    while start < whole {
        let len = BLOCK.min(whole - start);
        block[..len].copy_from_slice(&row[start..start + len]);
        let out = &mut row[start / 2..(start + len) / 2];
        for (o, two) in out.iter_mut().zip(block[..len].chunks_exact(2)) {
            *o = pair(two[0], two[1]);
        }
        start += len;
    }
    if k % 2 == 1 {
        row[k / 2] = pair(row[k - 1], 0.0);
    }
}

/// Rounds every element of `row` to bf16, in place.
pub(crate) fn round_in_place(row: &mut [f32]) {
    for x in row {
        *x = rounded(*x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairing_in_place_gives_the_pairs_of_a_copy() {
        for k in [0usize, 1, 2, 3, 31, 32, 33, 63, 64, 65, 100, 301] {
            let row: Vec<f32> = (0..k)
                .map(|i| (i as f32 * 0.37).sin() * 3.0 + 1e-3)
                .collect();
            let mut want = vec![f32::NAN; k.div_ceil(2)];
            pair_row(&row, &mut want);
            let mut got = row.clone();
            pair_in_place(&mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got[..k.div_ceil(2)]), bits(&want), "k = {k}");
            // And a pair is the two rounded values.
            if k >= 2 {
                let p = want[0].to_bits();
                assert_eq!(p << 16, rounded_bits(row[0]), "k = {k}: low half");
                assert_eq!(p & 0xFFFF_0000, rounded_bits(row[1]), "k = {k}: high half");
            }
        }
    }
}
