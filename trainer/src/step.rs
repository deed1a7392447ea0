//! What a training step's forward and backward take and give, the same on both compute
//! paths: the fused CPU kernels ([`crate::fast`]) and candle's graph ([`crate::train`]).

use crate::dpo::{DpoStep, PairLogps};
use candle_core::Tensor;
use tuneq_openapi::PreferenceMetrics;

/// Loss and gradients of one optimiser step.
pub struct StepResult {
    /// Mean loss over labelled tokens.
    pub loss: f64,
    /// Summed gradients, one per trainable tensor.
    pub grads: Vec<Tensor>,
    /// Non-padding tokens.
    pub tokens: usize,
    /// The share of labelled tokens whose target has the largest logit (token
    /// accuracy), when the step had any.
    pub token_accuracy: Option<f64>,
    /// A DPO step's figures.
    pub preference: Option<PreferenceMetrics>,
}

/// What a step's micro-batches added up to besides their gradients.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tally {
    /// The summed cross-entropy (see [`StepResult::loss`]).
    pub loss: f64,
    /// Non-padding tokens.
    pub tokens: usize,
    /// Labelled tokens.
    pub labelled: usize,
    /// Labelled tokens whose target has the largest logit.
    pub correct: u64,
}

impl StepResult {
    /// A step's result: for DPO, with its loss and figures from `dpo`, else with the
    /// summed cross-entropy of `tally`.
    pub fn new(tally: Tally, grads: Vec<Tensor>, dpo: Option<DpoStep>) -> Self {
        let (loss, preference) = match dpo {
            Some(step) => {
                let (loss, figures) = step.finish();
                (loss, Some(figures))
            }
            None => (tally.loss, None),
        };
        Self {
            loss,
            grads,
            tokens: tally.tokens,
            token_accuracy: (tally.labelled > 0)
                .then(|| tally.correct as f64 / tally.labelled as f64),
            preference,
        }
    }
}

/// What a step minimises.
#[derive(Debug, Clone, Copy)]
pub enum Objective<'a> {
    /// The mean cross-entropy of the labelled tokens.
    CrossEntropy,
    /// DPO (see [`crate::dpo`]): every micro-batch holds pairs, and `reference` has,
    /// per micro-batch, its pairs' reference log-probabilities.
    Dpo {
        /// β.
        beta: f64,
        /// Per micro-batch, per pair.
        reference: &'a [Vec<PairLogps>],
    },
}

impl<'a> Objective<'a> {
    /// A DPO step's bookkeeping with its reference, for DPO.
    pub fn dpo(&self) -> Option<(DpoStep, &'a [Vec<PairLogps>])> {
        match *self {
            Self::CrossEntropy => None,
            Self::Dpo { beta, reference } => {
                let pairs = reference.iter().map(Vec::len).sum();
                Some((DpoStep::new(beta, pairs), reference))
            }
        }
    }
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
