//! Dropout masks kept through a checkpointed forward, packed to a bit per element
//! where they can be.

/// A dropout mask kept through a checkpointed forward until its layer is recomputed.
/// The source cannot be asked again (it is a random stream), so the masks are stored;
/// packed to a bit each when, as dropout draws them, every element is `+0.0` or one
/// keep value, which makes them 32 times smaller than the layer input they sit beside.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum StoredMask {
    /// Bit `i` set: element `i` is `keep`, else `+0.0`.
    Bits {
        /// The kept elements' value, `1/(1 − p)`.
        keep: f32,
        /// One bit per element, 64 to a word.
        bits: Vec<u64>,
        /// Elements.
        len: usize,
    },
    /// Any other mask, as drawn.
    Full(Vec<f32>),
}

impl StoredMask {
    /// Packs `mask` when it is two-valued (compared by bits, so that unpacking is
    /// exact: a `-0.0` or a second non-zero value keeps the mask whole).
    pub(super) fn pack(mask: &[f32]) -> Self {
        let keep = mask
            .iter()
            .copied()
            .find(|v| v.to_bits() != 0)
            .unwrap_or(1.0);
        if !mask
            .iter()
            .all(|v| v.to_bits() == 0 || v.to_bits() == keep.to_bits())
        {
            return Self::Full(mask.to_vec());
        }
        let mut bits = vec![0u64; mask.len().div_ceil(64)];
        for (word, chunk) in bits.iter_mut().zip(mask.chunks(64)) {
            for (i, v) in chunk.iter().enumerate() {
                *word |= u64::from(v.to_bits() != 0) << i;
            }
        }
        Self::Bits {
            keep,
            bits,
            len: mask.len(),
        }
    }

    /// Writes the mask as drawn into `out`, replacing its contents.
    pub(super) fn unpack_into(&self, out: &mut Vec<f32>) {
        out.clear();
        match self {
            Self::Full(mask) => out.extend_from_slice(mask),
            Self::Bits { keep, bits, len } => {
                out.reserve_exact(*len);
                out.extend((0..*len).map(|i| {
                    if bits[i / 64] >> (i % 64) & 1 == 1 {
                        *keep
                    } else {
                        0.0
                    }
                }));
            }
        }
    }
}

/// The bytes a two-valued mask of `len` elements takes packed ([`StoredMask::Bits`]).
pub(super) fn packed_mask_bytes(len: usize) -> u64 {
    8 * len.div_ceil(64) as u64
}
