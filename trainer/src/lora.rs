//! LoRA: a low-rank trainable update beside a frozen linear layer.
//!
//! `y = W·x + scale · B·A·dropout(x)`, with `W` a plain frozen tensor and `A` (r × in),
//! `B` (out × r) candle `Var`s. `A` starts kaiming-uniform (PEFT's U(±1/√in)) from our own
//! seeded ChaCha stream, `B` starts at zero, so step 0 reproduces the base model exactly.

use crate::ops::frozen_linear;
use candle_core::{DType, Result, Tensor, Var};
use rand::Rng;
use rand_chacha::ChaCha20Rng;

/// Names and shapes of a LoRA setup, independent of any tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSettings {
    /// Rank.
    pub r: usize,
    /// Scaling numerator.
    pub alpha: f64,
    /// Dropout probability on the LoRA input (training only).
    pub dropout: f64,
    /// Target module names (`q_proj`, …).
    pub targets: Vec<String>,
    /// alpha/√r instead of alpha/r.
    pub rslora: bool,
}

impl LoraSettings {
    /// The factor applied to `B·A·x`.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Whether `module` is adapted.
    pub fn targets(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t == module)
    }
}

/// The trainable factors of one adapted projection.
#[derive(Debug, Clone)]
pub struct LoraFactors {
    /// Down-projection, (r, in).
    pub a: Var,
    /// Up-projection, (out, r).
    pub b: Var,
}

impl LoraFactors {
    /// PEFT's default init: A ~ U(±1/√in) (kaiming-uniform with a = √5), B = 0.
    pub fn init(
        r: usize,
        in_dim: usize,
        out_dim: usize,
        rng: &mut ChaCha20Rng,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let bound = 1.0 / (in_dim as f64).sqrt();
        let a: Vec<f32> = (0..r * in_dim)
            .map(|_| rng.random_range(-bound..bound) as f32)
            .collect();
        let a = Var::from_tensor(&Tensor::from_vec(a, (r, in_dim), device)?)?;
        let b = Var::zeros((out_dim, r), DType::F32, device)?;
        Ok(Self { a, b })
    }
}

/// Randomness used by dropout in one training forward pass.
pub struct DropoutCtx<'a> {
    /// Probability of zeroing an input element.
    pub p: f64,
    /// The step's seeded stream; draws happen in a fixed order, so runs replay exactly.
    pub rng: &'a mut ChaCha20Rng,
    /// Where each drawn mask (rows × in, already scaled by 1/(1−p)) is appended, in the
    /// order the adapted projections run; `tuneq debug steps` exports them so PyTorch
    /// can apply the very same masks, and a checkpointed layer keeps its own.
    pub record: Option<&'a mut Vec<Tensor>>,
    /// When set, masks are taken from here in order instead of drawn: a checkpointed
    /// layer recomputed in backward applies exactly the masks its forward drew.
    pub replay: Option<&'a mut std::collections::VecDeque<Tensor>>,
}

/// The next dropout mask of `n` elements from a step's stream: 0 with probability `p`,
/// else `1/(1−p)`, one `f64` draw per element. Both compute paths draw through here, in
/// the same order, so they apply the same masks and a resumed run replays them.
pub fn draw_mask(rng: &mut ChaCha20Rng, p: f64, n: usize) -> Vec<f32> {
    let kept = (1.0 / (1.0 - p)) as f32;
    (0..n)
        .map(|_| if rng.random::<f64>() < p { 0.0 } else { kept })
        .collect()
}

/// A frozen projection with an optional LoRA update.
#[derive(Debug, Clone)]
pub struct LoraLinear {
    /// Frozen weight, (out, in), in the compute dtype.
    pub weight: Tensor,
    /// Frozen bias, (out), in the compute dtype (Qwen2's q, k and v have one).
    pub bias: Option<Tensor>,
    /// Trainable factors when this projection is a target.
    pub lora: Option<LoraFactors>,
    /// Scale applied to the LoRA branch.
    pub scale: f64,
}

impl LoraLinear {
    /// Applies the layer to `x` (…, in). `dropout` is `None` at evaluation time.
    pub fn forward(&self, x: &Tensor, dropout: Option<&mut DropoutCtx<'_>>) -> Result<Tensor> {
        let mut y = frozen_linear(x, &self.weight)?;
        if let Some(bias) = &self.bias {
            y = y.broadcast_add(bias)?;
        }
        let Some(lora) = &self.lora else { return Ok(y) };
        let dtype = x.dtype();
        let in_dim = self.weight.dim(1)?;
        let rows = x.elem_count() / in_dim;
        let x2 = x.reshape((rows, in_dim))?;
        let x2 = match dropout {
            Some(ctx) if ctx.p > 0.0 => {
                let mask = match ctx.replay.as_deref_mut() {
                    Some(queue) => queue.pop_front().ok_or_else(|| {
                        candle_core::Error::Msg(
                            "a recomputed layer asked for more dropout masks than its forward drew"
                                .into(),
                        )
                    })?,
                    None => {
                        let mask = draw_mask(ctx.rng, ctx.p, rows * in_dim);
                        let mask = Tensor::from_vec(mask, (rows, in_dim), x.device())?;
                        if let Some(record) = ctx.record.as_deref_mut() {
                            record.push(mask.clone());
                        }
                        mask
                    }
                };
                (x2 * mask.to_dtype(dtype)?)?
            }
            _ => x2,
        };
        let a = lora.a.as_tensor().to_dtype(dtype)?;
        let b = lora.b.as_tensor().to_dtype(dtype)?;
        let delta = x2
            .matmul(&a.t()?)?
            .matmul(&b.t()?)?
            .affine(self.scale, 0.0)?;
        let delta = delta.reshape(y.shape())?;
        y + delta
    }

    /// The LoRA update alone, `scale · x·Aᵀ·Bᵀ` (…, out), without dropout; None when
    /// the projection is not adapted. For callers that compute the frozen product
    /// their own way (a decoding step's few rows).
    pub fn lora_delta(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        let dtype = x.dtype();
        let (out_dim, in_dim) = self.weight.dims2()?;
        let rows = x.elem_count() / in_dim;
        let a = lora.a.as_tensor().to_dtype(dtype)?;
        let b = lora.b.as_tensor().to_dtype(dtype)?;
        let delta = x
            .reshape((rows, in_dim))?
            .matmul(&a.t()?)?
            .matmul(&b.t()?)?
            .affine(self.scale, 0.0)?;
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out_dim;
        }
        Ok(Some(delta.reshape(dims)?))
    }
}
