//! What a spec implies before anything is read: its LoRA settings and its step count.

use crate::lora::LoraSettings;
use tuneq_openapi::TrainSpec;

/// LoRA settings of a spec.
pub fn lora_settings(spec: &TrainSpec) -> LoraSettings {
    LoraSettings {
        r: spec.lora.r as usize,
        alpha: spec.lora.alpha,
        dropout: spec.lora.dropout,
        targets: spec.lora.target_modules.clone(),
        rslora: spec.lora.rslora,
    }
}

/// Optimiser steps per epoch and in total for `n` examples.
pub fn plan(n: usize, spec: &TrainSpec) -> (u64, u64) {
    let h = &spec.hyperparameters;
    let micro = n.div_ceil(h.batch_size as usize) as u64;
    let per_epoch = micro.div_ceil(h.gradient_accumulation_steps as u64).max(1);
    let total = per_epoch * h.epochs as u64;
    (per_epoch, h.max_steps.map_or(total, |m| m.min(total)))
}
