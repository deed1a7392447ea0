//! Validation loss: over a set of examples, and recorded after a step.

use super::metrics::{MetricsFile, json_line};
use crate::batch::make_batch;
use crate::data::{EncodedPair, Example};
use crate::dpo::PairLogps;
use crate::error::Result;
use crate::model::Llama;
use crate::progress::ProgressSink;
use candle_core::Tensor;
use tuneq_openapi::TrainEvent;

/// A validation: the loss, and for cross-entropy the token accuracy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// The mean loss (NaN when nothing carries a label).
    pub loss: f64,
    /// The share of labelled tokens whose target has the largest logit (none for DPO).
    pub token_accuracy: Option<f64>,
}

/// Mean loss over every labelled token of `examples`, without dropout, and the share of
/// them the model ranks first.
pub fn evaluate(
    model: &Llama,
    examples: &[Example],
    batch_size: usize,
    pad_id: u32,
) -> Result<Evaluation> {
    let total: usize = examples
        .iter()
        .map(|e| e.labels.iter().skip(1).filter(|&&l| l >= 0).count())
        .sum();
    if total == 0 {
        return Ok(Evaluation {
            loss: f64::NAN,
            token_accuracy: None,
        });
    }
    let fused = crate::fast::ComputePath::for_model(model) == crate::fast::ComputePath::CpuFused;
    let (mut loss, mut correct) = (0f64, 0u64);
    for chunk in examples.chunks(batch_size.max(1)) {
        let refs: Vec<&Example> = chunk.iter().collect();
        if fused {
            let b = crate::batch::pack_batch(&refs, pad_id);
            let (l, hits) = crate::fast::loss(model, &b, total as f64)?;
            loss += l as f32 as f64;
            correct += hits;
            continue;
        }
        let b = make_batch(&refs, pad_id);
        let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), model.device())?;
        let logits = model.logits(&model.hidden_states(&ids, None)?)?;
        correct += crate::ops::top1_hits(&logits, &b.targets)?;
        let l = crate::ops::masked_cross_entropy(&logits, &b.targets, total as f64)?;
        loss += l.to_scalar::<f32>()? as f64;
    }
    Ok(Evaluation {
        loss,
        token_accuracy: Some(correct as f64 / total as f64),
    })
}

/// Held-out data and how its loss is taken.
#[derive(Debug, Clone, Copy)]
pub(super) enum Heldout<'a> {
    /// The mean cross-entropy of examples.
    Examples(&'a [Example]),
    /// The mean DPO loss of pairs against their reference log-probabilities.
    Pairs {
        /// The pairs.
        pairs: &'a [EncodedPair],
        /// Their log-probabilities under the reference.
        reference: &'a [PairLogps],
        /// β.
        beta: f64,
    },
}

impl Heldout<'_> {
    /// Whether there is nothing to evaluate.
    pub(super) fn is_empty(&self) -> bool {
        match self {
            Self::Examples(examples) => examples.is_empty(),
            Self::Pairs { pairs, .. } => pairs.is_empty(),
        }
    }

    /// The loss of this data under `model`.
    pub(super) fn evaluate(
        &self,
        model: &Llama,
        batch_size: usize,
        pad_id: u32,
    ) -> Result<Evaluation> {
        match *self {
            Self::Examples(examples) => evaluate(model, examples, batch_size, pad_id),
            Self::Pairs {
                pairs,
                reference,
                beta,
            } => Ok(Evaluation {
                loss: super::preference::dpo_loss(
                    model,
                    pairs,
                    reference,
                    (beta, batch_size, pad_id),
                )?,
                token_accuracy: None,
            }),
        }
    }
}

/// Computes validation loss after `step` and records it in `metrics.jsonl` and the progress stream.
pub(super) fn validate(
    model: &Llama,
    data: Heldout<'_>,
    (batch_size, pad_id): (usize, u32),
    step: u64,
    metrics: &MetricsFile,
    sink: &mut dyn ProgressSink,
) -> Result<f64> {
    let Evaluation {
        loss,
        token_accuracy,
    } = data.evaluate(model, batch_size, pad_id)?;
    metrics.append(&json_line(&serde_json::json!({
        "step": step,
        "validation_loss": loss,
        "validation_token_accuracy": token_accuracy,
    }))?)?;
    sink.event(&TrainEvent::Eval {
        step,
        validation_loss: loss,
        token_accuracy,
    });
    Ok(loss)
}
