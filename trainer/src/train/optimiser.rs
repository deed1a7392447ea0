//! One optimiser step: the accumulated gradients, clipped by global norm, then AdamW.

use super::accumulate::accumulate_for;
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::model::Llama;
use crate::optim::{AdamW, global_norm};
use crate::step::{Objective, StepDropout};
use tuneq_openapi::PreferenceMetrics;

/// What one optimiser step did.
#[derive(Debug, Clone, Copy)]
pub struct Stepped {
    /// Mean loss over the step's labelled tokens (before the update).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Non-padding tokens.
    pub tokens: usize,
    /// The share of labelled tokens ranked first.
    pub token_accuracy: Option<f64>,
    /// A DPO step's figures.
    pub preference: Option<PreferenceMetrics>,
}

/// How an optimiser step updates: the objective, the clip and the learning rate.
#[derive(Debug, Clone, Copy)]
pub struct Update<'a> {
    /// What the step minimises.
    pub objective: Objective<'a>,
    /// The global-norm clip (≤ 0: none).
    pub max_grad_norm: f64,
    /// The learning rate.
    pub lr: f64,
}

/// One optimiser step: forward and backward over the micro-batches, clipping by global
/// norm (`max_grad_norm` ≤ 0 turns it off, as in Hugging Face), then AdamW at `lr`.
/// A non-finite loss is refused before anything is updated.
pub fn optimiser_step(
    model: &Llama,
    opt: &mut AdamW,
    batches: &[Batch],
    dropout: Option<StepDropout<'_>>,
    update: Update<'_>,
) -> Result<Stepped> {
    let Update {
        objective,
        max_grad_norm,
        lr,
    } = update;
    let r = accumulate_for(model, batches, dropout, objective)?;
    if !r.loss.is_finite() {
        return Err(Error::Diverged {
            step: opt.step_count() + 1,
            loss: r.loss,
        });
    }
    let grad_norm = global_norm(&r.grads)?;
    let clip = if max_grad_norm > 0.0 {
        (max_grad_norm / (grad_norm + 1e-6)).min(1.0)
    } else {
        1.0
    };
    opt.step(&r.grads, lr, clip)?;
    Ok(Stepped {
        loss: r.loss,
        grad_norm,
        tokens: r.tokens,
        token_accuracy: r.token_accuracy,
        preference: r.preference,
    })
}
