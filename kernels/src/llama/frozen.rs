//! Frozen matrices as they are stored: `f32`, or `bf16` widened to `f32` where used.
//!
//! A bf16 value is the top half of an f32, so widening is a shift (exact, no rounding)
//! and a step on bf16-stored weights computes the same bits as one on their f32
//! widening: the widened matrix goes through the same [`gemm`](crate::gemm::gemm).

use half::bf16;
use rayon::prelude::*;

/// A frozen matrix as stored: f32, or bf16 widened to f32 where it is used.
///
/// bf16 halves the resident size of the weights (a 7B Llama's frozen weights take
/// ~13 GiB instead of ~27 GiB); the step widens each bf16 matrix into one reusable f32
/// scratch right before its product (see [`step_bytes`](super::step_bytes)), so compute,
/// LoRA factors and gradients stay f32 and the results are those of the f32 widening,
/// bit for bit.
#[derive(Debug, Clone, Copy)]
pub enum Frozen<'a> {
    /// Stored as f32, used as is.
    F32(&'a [f32]),
    /// Stored as bf16, widened exactly to f32 where it is used.
    Bf16(&'a [bf16]),
}

impl<'a> Frozen<'a> {
    /// Elements (not bytes).
    pub fn len(&self) -> usize {
        match self {
            Self::F32(w) => w.len(),
            Self::Bf16(w) => w.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it is stored as bf16 (and so needs the widening scratch).
    pub fn is_bf16(&self) -> bool {
        matches!(self, Self::Bf16(_))
    }

    /// Resident bytes of the storage: 4 per element as f32, 2 as bf16.
    pub fn bytes(&self) -> u64 {
        match self {
            Self::F32(w) => std::mem::size_of_val(*w) as u64,
            Self::Bf16(w) => std::mem::size_of_val(*w) as u64,
        }
    }

    /// Whether `self` and `other` are the same storage (tied embeddings), so that its
    /// bytes are counted once.
    pub(super) fn same_storage(&self, other: &Frozen<'_>) -> bool {
        match (self, other) {
            (Self::F32(a), Frozen::F32(b)) => std::ptr::eq(*a, *b),
            (Self::Bf16(a), Frozen::Bf16(b)) => std::ptr::eq(*a, *b),
            _ => false,
        }
    }

    /// The whole matrix as f32: the stored slice itself, or, for bf16, widened into
    /// the first `len()` elements of `scratch` (which the step sizes for the largest
    /// bf16 matrix it widens, see `memory::widening_len`).
    pub(super) fn as_f32<'s>(&self, scratch: &'s mut [f32]) -> &'s [f32]
    where
        'a: 's,
    {
        match *self {
            Self::F32(w) => w,
            Self::Bf16(w) => {
                let out = &mut scratch[..w.len()];
                widen(w, out);
                out
            }
        }
    }

    /// Copies elements `start..start + out.len()` into `out`, widened (one embedding
    /// row: sequential, it is short).
    pub(super) fn copy_to(&self, start: usize, out: &mut [f32]) {
        match *self {
            Self::F32(w) => out.copy_from_slice(&w[start..][..out.len()]),
            Self::Bf16(w) => widen_sequential(&w[start..][..out.len()], out),
        }
    }
}

impl<'a> From<&'a [f32]> for Frozen<'a> {
    fn from(w: &'a [f32]) -> Self {
        Self::F32(w)
    }
}

impl<'a> From<&'a [bf16]> for Frozen<'a> {
    fn from(w: &'a [bf16]) -> Self {
        Self::Bf16(w)
    }
}

/// Elements per parallel widening job: 256 KiB of f32 written, large enough that
/// rayon's per-job cost vanishes against the memory traffic.
const WIDEN_CHUNK: usize = 1 << 16;

/// One bf16 as the f32 it is the top half of: exact for every bit pattern, NaN payloads
/// and the sign of zero included. (`half::bf16::to_f32` gives the same value except
/// that it sets the quiet bit of a signalling NaN; a shift keeps the bits and
/// vectorises.)
#[inline]
pub(super) fn widen_one(b: bf16) -> f32 {
    f32::from_bits(u32::from(b.to_bits()) << 16)
}

/// `out[i] = widen_one(src[i])` on the calling thread.
fn widen_sequential(src: &[bf16], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(src) {
        *o = widen_one(b);
    }
}

/// `out[i] = widen_one(src[i])` for every `i < out.len()` (the lengths are equal at
/// every call site), split over rayon in fixed chunks. Elementwise, so the result does
/// not depend on the split or the thread count.
pub(super) fn widen(src: &[bf16], out: &mut [f32]) {
    out.par_chunks_mut(WIDEN_CHUNK)
        .zip(src.par_chunks(WIDEN_CHUNK))
        .for_each(|(o, s)| widen_sequential(s, o));
}
