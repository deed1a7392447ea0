//! Validation loss: over a set of examples, and recorded after a step.

use super::metrics::{MetricsFile, json_line};
use crate::batch::make_batch;
use crate::data::Example;
use crate::error::Result;
use crate::model::Llama;
use crate::progress::ProgressSink;
use candle_core::Tensor;
use tuneq_openapi::TrainEvent;

/// Mean loss over every labelled token of `examples`, without dropout.
pub fn evaluate(
    model: &Llama,
    examples: &[Example],
    batch_size: usize,
    pad_id: u32,
) -> Result<f64> {
    let total: usize = examples
        .iter()
        .map(|e| e.labels.iter().skip(1).filter(|&&l| l >= 0).count())
        .sum();
    if total == 0 {
        return Ok(f64::NAN);
    }
    let fused = crate::fast::ComputePath::for_model(model) == crate::fast::ComputePath::CpuFused;
    let mut loss = 0f64;
    for chunk in examples.chunks(batch_size.max(1)) {
        let refs: Vec<&Example> = chunk.iter().collect();
        if fused {
            let b = crate::batch::pack_batch(&refs, pad_id);
            loss += crate::fast::loss(model, &b, total as f64)? as f32 as f64;
            continue;
        }
        let b = make_batch(&refs, pad_id);
        let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), model.device())?;
        let hidden = model.hidden_states(&ids, None)?;
        let l =
            crate::ops::masked_cross_entropy(&model.logits(&hidden)?, &b.targets, total as f64)?;
        loss += l.to_scalar::<f32>()? as f64;
    }
    Ok(loss)
}

/// Computes validation loss after `step` and records it in `metrics.jsonl` and the progress stream.
pub(super) fn validate(
    model: &Llama,
    examples: &[Example],
    batch_size: usize,
    pad_id: u32,
    step: u64,
    metrics: &MetricsFile,
    sink: &mut dyn ProgressSink,
) -> Result<f64> {
    let loss = evaluate(model, examples, batch_size, pad_id)?;
    metrics.append(&json_line(
        &serde_json::json!({"step": step, "validation_loss": loss}),
    )?)?;
    sink.event(&TrainEvent::Eval {
        step,
        validation_loss: loss,
    });
    Ok(loss)
}
