//! The final record of a run, `manifest.json` in the output.

use super::Outcome;
use crate::checkpoint;
use crate::error::{Error, Result};
use crate::progress::ProgressSink;
use serde::Serialize;
use std::path::Path;
use tuneq_openapi::{TrainEvent, TrainSpec};

/// How the run a manifest records ended. Only a finished run writes one, so there is one
/// status today; a manifest with another (from a later version) reads as not finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// The adapter is written.
    Succeeded,
}

/// The final record of a run, `manifest.json` in the output.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct RunManifest {
    /// How the run ended.
    pub status: RunStatus,
    /// The spec as run.
    pub spec: TrainSpec,
    /// Base model identity.
    pub base_model: Lineage,
    /// Training files' identity.
    pub training_files: Vec<Lineage>,
    /// Validation file identity.
    pub validation_file: Option<Lineage>,
    /// Seed.
    pub seed: u64,
    /// Run fingerprint (equal fingerprints train identical adapters).
    pub fingerprint: String,
    /// Final figures.
    pub metrics: FinalMetrics,
    /// Files of the adapter and their digests.
    pub adapter_files: Vec<checkpoint::ManifestEntry>,
    /// With early stopping: the validated step whose adapter the run kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopped>,
    /// tuneq version.
    pub trainer_version: String,
}

/// What early stopping kept.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct EarlyStopped {
    /// The step training stopped at, when before its last.
    pub stopped_at: Option<u64>,
    /// The step whose adapter is the run's.
    pub best_step: u64,
    /// Its validation loss.
    pub best_validation_loss: f64,
}

/// A location and its SHA-256.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct Lineage {
    /// Where it was read from.
    pub location: String,
    /// Hex SHA-256 (for a model: over config.json and weight files).
    pub sha256: String,
}

/// Final figures of a run.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct FinalMetrics {
    /// Optimiser steps.
    pub steps: u64,
    /// Loss of the last step.
    pub train_loss: Option<f64>,
    /// Validation loss before training (the base model with a zero LoRA update).
    pub base_validation_loss: Option<f64>,
    /// Validation loss after training.
    pub validation_loss: Option<f64>,
    /// Non-padding tokens processed.
    pub trained_tokens: u64,
    /// Training examples.
    pub train_examples: u64,
    /// Validation examples.
    pub validation_examples: u64,
}

/// The outcome of a finished run with the same fingerprint in `out` (reported as
/// finished): it has nothing left to do.
pub(super) fn finished_before(
    out: &crate::remote::Output,
    fingerprint: &str,
    sink: &mut dyn ProgressSink,
) -> Option<Outcome> {
    let output = &out.local;
    let done = crate::error::read_json::<RunManifest>(&output.join("manifest.json")).ok()?;
    if done.fingerprint != fingerprint
        || done.status != RunStatus::Succeeded
        || !output.join(crate::peft::ADAPTER_WEIGHTS).is_file()
    {
        return None;
    }
    sink.event(&TrainEvent::Finished {
        step: done.metrics.steps,
        adapter: out.display(""),
        train_loss: done.metrics.train_loss,
        validation_loss: done.metrics.validation_loss,
        trained_tokens: done.metrics.trained_tokens,
        peak_memory_bytes: None,
    });
    Some(Outcome::Finished {
        steps: done.metrics.steps,
        validation_loss: done.metrics.validation_loss,
    })
}

/// The adapter's files in `output`, with their sizes and digests.
pub(super) fn adapter_files(output: &Path) -> Result<Vec<checkpoint::ManifestEntry>> {
    let mut adapter_files = Vec::new();
    for f in [crate::peft::ADAPTER_CONFIG, crate::peft::ADAPTER_WEIGHTS] {
        let p = output.join(f);
        let size = std::fs::metadata(&p).map_err(Error::io(&p))?.len();
        adapter_files.push(checkpoint::ManifestEntry {
            name: f.into(),
            size,
            sha256: checkpoint::sha256_file(&p)?,
        });
    }
    Ok(adapter_files)
}
