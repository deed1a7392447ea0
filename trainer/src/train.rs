//! The training run: from a [`TrainSpec`] to a PEFT adapter, resumable at every checkpoint.
//!
//! One optimiser step = `gradient_accumulation_steps` micro-batches, each forward +
//! backward, gradients summed with token weighting (every micro-batch loss is divided by
//! the labelled-token count of the whole step, as Hugging Face does), clipped by global
//! norm, then one AdamW update at the scheduled learning rate. Which examples form a step
//! follows from the seed, the epoch and the step number alone, so a run restarted from a
//! checkpoint replays the same trajectory bit for bit (same thread count).
//!
//! Layout: `run` (the run itself: prepare, resume, train, finish), `inputs` (the
//! tokenised data, the model's digest, the run's fingerprint), `loading` (the model,
//! its compute mode and activation checkpointing), `device`, `spec` (what a spec
//! implies: LoRA settings, step counts), `accumulate` (forward and backward over a
//! step's micro-batches, fused or on candle's graph), `optimiser` (one optimiser step),
//! `evaluation` (validation loss), `metrics` (`metrics.jsonl`), `manifest` (the final
//! record) and `stop` (the stop request).

mod accumulate;
mod device;
mod early_stop;
mod evaluation;
mod inputs;
mod loading;
mod manifest;
mod metrics;
mod optimiser;
mod preference;
mod run;
mod spec;
mod stop;

pub use crate::step::{StepDropout, StepResult};
pub use accumulate::{accumulate, accumulate_for, accumulate_on_graph};
pub use device::{cuda_available, select_device, select_dtype};
pub use evaluation::evaluate;
pub use inputs::{EncodedData, encode_files};
pub use manifest::{FinalMetrics, Lineage, RunManifest, RunStatus};
pub use metrics::RESULTS_CSV;
pub use optimiser::{Stepped, Update, optimiser_step};
pub use preference::{pair_batch, pair_logps};
pub use run::run_with;
pub use spec::{lora_settings, plan};
pub use stop::StopFlag;

use crate::error::Result;
use crate::progress::ProgressSink;
use crate::remote::Storage;
use tuneq_openapi::TrainSpec;

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Training finished; the adapter is in the output.
    Finished {
        /// Optimiser steps.
        steps: u64,
        /// Final validation loss, when a validation file was given.
        validation_loss: Option<f64>,
    },
    /// A stop was requested; a checkpoint at `step` was committed.
    Interrupted {
        /// The checkpoint's step.
        step: u64,
    },
}

/// Runs `spec` with local files and the default storage settings (see [`run_with`]).
pub fn run(spec: &TrainSpec, sink: &mut dyn ProgressSink, stop: &StopFlag) -> Result<Outcome> {
    let storage = Storage::new(
        tuneq_storage::StorageConfig::default(),
        Storage::default_cache_dir(),
    )?;
    run_with(spec, &storage, sink, stop)
}
