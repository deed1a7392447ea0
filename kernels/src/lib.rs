//! CPU kernels for the trainer's fast path, on plain `f32` slices (frozen weights may be
//! `bf16`, widened to `f32` as they are used).
//!
//! candle's autograd pays for generality on the CPU: every edge of the graph zero-fills
//! and adds a fresh gradient, every op allocates its output, and its GEMM runs AVX2
//! kernels at half of what the core can do (see `docs/trainer-speed.md`).
//! The fused LoRA step is built from the pieces here instead; candle's graph stays the
//! CUDA path and the test oracle the fast path is checked against.
//!
//! Everything here is deterministic for a given backend: parallel work is split into
//! fixed chunks whose arithmetic does not depend on the thread count, so a resumed run
//! replays the same bytes.
//!
//! Modules:
//! - [`gemm`](mod@gemm): `C = α·A·B + β·C` on strided views, split over rayon into one
//!   block of C's rows (or columns) per thread, cut on the kernels' tile edges: fewer
//!   blocks pack the shared operand (the weight) fewer times, and tile-aligned cuts keep
//!   every element's arithmetic the same for any thread count. On x86-64 with AVX2 (or
//!   AVX-512) its own kernels, which pack with in-register transposes and give the same
//!   bits on either instruction set; elsewhere matrixmultiply. With `blas` (the FFI
//!   declarations) and `simd`, one of the modules allowed `unsafe` (the kernels take
//!   raw pointers).
//! - [`exp`]: a branch-free `f32` exp (≤ 2 ulp) that loops vectorise around.
//! - [`norm`]: RMSNorm forward (saving `1/rms` per row) and backward into `dx`, optionally
//!   adding to it so the residual gradient is folded in.
//! - [`rope`]: rotate-half RoPE in place on head vectors inside token rows (the qkv
//!   buffer), forward and inverse (for dq, dk).
//! - [`tanh`]: a branch-free `f32` tanh (≤ 3 ulp), for Gemma's soft-caps and GELU.
//! - [`glu`]: `act(g)·u` over `[gate | up]` rows (SwiGLU, or GeGLU with tanh GELU), and
//!   the backward into `[dg | du]`.
//! - [`loss`]: the lm_head fused with masked cross-entropy over labelled rows, about
//!   16 MiB of logits at a time, writing the hidden-state gradient in the same pass; its
//!   chunk buffers' size is public ([`loss::scratch_bytes`]) for sizing a step.
//! - [`attention`]: fused causal attention forward and backward (flash-attention style,
//!   grouped-query by index, block-diagonal masks for packed rows), one deterministic
//!   task per (batch row, kv head); and the attention of a few rows over caches of keys
//!   and values ([`attention::attention_over_cache`]), which a server's decoding step
//!   runs.
//! - [`few_rows`]: `x·Wᵀ` for at most 8 rows, each weight row streamed once against all
//!   of them: a decoding step's projections, bound by memory bandwidth.
//! - [`llama`]: the whole Llama LoRA forward and backward of one micro-batch, built from
//!   the kernels above, returning the loss and adding into the LoRA gradients; with
//!   optional per-layer activation checkpointing (bit-identical results, a fraction of
//!   the memory), frozen weights stored as f32 or bf16 ([`llama::Frozen`], widened
//!   exactly to f32 where they are used), an opt-in bf16 compute of the frozen
//!   projections ([`llama::Compute`]: bf16 operands, f32 sums; AVX512-BF16 through
//!   the own kernels, AMX through oneMKL), and
//!   [`llama::step_bytes`] to size a step before running it.
//! - `bf16` (private): rounding to bf16 and pairing for bf16 compute.
//! - `reduce` (private): fixed-order 16-lane sums and max, shared by the row kernels.
//! - `simd` (private): runs the row kernels, the attention's loops and the loss's row
//!   softmax compiled for AVX2 and FMA when the CPU has them (the crate itself targets
//!   baseline x86-64); the same bits either way, tested.

pub mod attention;
mod bf16;
#[cfg(feature = "blas")]
mod blas;
pub mod exp;
pub mod few_rows;
pub mod gemm;
pub mod glu;
pub mod llama;
pub mod loss;
pub mod norm;
mod reduce;
pub mod rope;
mod simd;
pub mod tanh;
#[cfg(test)]
mod testing;

pub use gemm::{
    ISA_LIMIT_ENV, IsaLimit, IsaLimitError, Mat, MatMut, backend, bf16_backend, gemm, to_row_major,
};
