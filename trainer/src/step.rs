//! What a training step's forward and backward take and give, the same on both compute
//! paths: the fused CPU kernels ([`crate::fast`]) and candle's graph ([`crate::train`]).

use candle_core::Tensor;

/// Loss and gradients of one optimiser step.
pub struct StepResult {
    /// Mean loss over labelled tokens.
    pub loss: f64,
    /// Summed gradients, one per trainable tensor.
    pub grads: Vec<Tensor>,
    /// Non-padding tokens.
    pub tokens: usize,
}

/// Dropout for one optimiser step: the probability, the step's stream, and optionally
/// where to record the masks drawn (see [`DropoutCtx::record`]).
pub struct StepDropout<'a> {
    /// Probability of zeroing a LoRA input element.
    pub p: f64,
    /// The step's stream.
    pub rng: &'a mut rand_chacha::ChaCha20Rng,
    /// Receives every mask, micro-batch by micro-batch.
    pub record: Option<&'a mut Vec<Tensor>>,
}
