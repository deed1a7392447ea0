//! What a spec implies before anything is read: its LoRA settings and its step count.

use crate::error::{Error, Result};
use crate::lora::LoraSettings;
use tuneq_openapi::TrainSpec;

/// LoRA settings of a spec on a model of `architecture`: its targets as that family's
/// projections ([`tuneq_pools::Architecture::lora_targets`]), refused naming the field
/// where the model has no such projection.
pub fn lora_settings(
    spec: &TrainSpec,
    architecture: tuneq_pools::Architecture,
) -> Result<LoraSettings> {
    let targets = architecture
        .lora_targets(&spec.lora.target_modules)
        .map_err(|wrong| {
            Error::Spec(vec![tuneq_openapi::SpecError {
                field: "lora.target_modules".into(),
                message: wrong.to_string(),
            }])
        })?;
    Ok(LoraSettings {
        r: spec.lora.r as usize,
        alpha: spec.lora.alpha,
        dropout: spec.lora.dropout,
        targets,
        rslora: spec.lora.rslora,
    })
}

/// Optimiser steps per epoch and in total for `n` examples.
pub fn plan(n: usize, spec: &TrainSpec) -> (u64, u64) {
    let h = &spec.hyperparameters;
    let micro = n.div_ceil(h.batch_size as usize) as u64;
    let per_epoch = micro.div_ceil(h.gradient_accumulation_steps as u64).max(1);
    let total = per_epoch * h.epochs as u64;
    (per_epoch, h.max_steps.map_or(total, |m| m.min(total)))
}
