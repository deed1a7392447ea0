//! Progress events a trainer emits: JSON lines on stdout today, posted to the control
//! plane by later issues. One tagged enum so consumers can match on `event`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One thing that happened during a training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TrainEvent {
    /// Data and model are loaded; training is about to start (or resume).
    Started {
        /// Optimiser steps the whole run takes.
        total_steps: u64,
        /// Step the run starts from (0, or the resumed checkpoint's step).
        start_step: u64,
        /// Training examples after tokenisation.
        train_examples: u64,
        /// Validation examples.
        validation_examples: u64,
        /// Trainable LoRA parameters.
        trainable_params: u64,
        /// Dataset format detected or given.
        dataset_format: String,
    },
    /// Training continues from a checkpoint.
    Resumed {
        /// The checkpoint's step.
        step: u64,
        /// Where it was read from.
        checkpoint: String,
    },
    /// One optimiser step finished.
    Step(StepMetrics),
    /// Validation loss was computed.
    Eval {
        /// Optimiser steps completed.
        step: u64,
        /// Mean loss over validation tokens that carry a label.
        validation_loss: f64,
        /// The share of those tokens whose target has the largest logit (absent for
        /// DPO, and from trainers before it was reported).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token_accuracy: Option<f64>,
    },
    /// Early stopping chose the adapter the run keeps: the best validated step's.
    EarlyStopped {
        /// The step training stopped at, when the validation loss stopped improving
        /// before the last step (absent when the run went to its end).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stopped_at: Option<u64>,
        /// The step whose adapter is kept.
        best_step: u64,
        /// Its validation loss.
        best_validation_loss: f64,
    },
    /// A checkpoint was committed (its manifest written).
    Checkpoint {
        /// Optimiser steps completed.
        step: u64,
        /// Its location.
        location: String,
    },
    /// A completion generated from a validation prompt with the trained adapter.
    Sample {
        /// Index of the record in its file.
        index: u64,
        /// The prompt as rendered.
        prompt: String,
        /// The greedy completion.
        completion: String,
        /// The reference answer from the dataset.
        reference: String,
    },
    /// Something the user should know that did not stop the run.
    Warning {
        /// What happened.
        message: String,
    },
    /// The run stopped early on SIGTERM/SIGINT after writing a checkpoint.
    Interrupted {
        /// Step of the checkpoint written.
        step: u64,
    },
    /// The run finished and the adapter is written.
    Finished {
        /// Optimiser steps completed.
        step: u64,
        /// Adapter location.
        adapter: String,
        /// Final training loss (mean of the last step).
        train_loss: Option<f64>,
        /// Final validation loss, when a validation file was given.
        validation_loss: Option<f64>,
        /// Tokens seen in training (not counting padding).
        trained_tokens: u64,
        /// The trainer process's peak resident memory in bytes, where the OS tells it
        /// (Linux): what sizing a pool's memory, or checking the estimate placement
        /// made, needs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peak_memory_bytes: Option<u64>,
    },
}

/// Figures of one optimiser step; also one line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StepMetrics {
    /// Optimiser steps completed (1 after the first).
    pub step: u64,
    /// Steps the run takes.
    pub total_steps: u64,
    /// Epoch (0-based) this step belongs to.
    pub epoch: u32,
    /// Mean loss over labelled tokens of the step (DPO: the mean preference loss over
    /// the step's pairs).
    pub loss: f64,
    /// Learning rate used for this update.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Non-padding tokens processed per second in this step.
    pub tokens_per_s: f64,
    /// Seconds since this process started training.
    pub elapsed_s: f64,
    /// Estimated seconds to the end of training.
    pub eta_s: f64,
    /// Tokens processed so far in the run (across resumes).
    pub tokens_seen: u64,
    /// The share of the step's labelled tokens whose target has the largest logit
    /// (absent from trainers before it was reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_accuracy: Option<f64>,
    /// A DPO step's figures (absent for supervised steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preference: Option<PreferenceMetrics>,
}

/// A DPO step's figures, means over its pairs, named and computed as TRL's
/// `DPOTrainer` logs them (`rewards/chosen`, …). A completion's reward is
/// `β·(log π(completion) − log π_ref(completion))`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PreferenceMetrics {
    /// The preferred completions' mean reward.
    pub rewards_chosen: f64,
    /// The non-preferred completions' mean reward.
    pub rewards_rejected: f64,
    /// The share of pairs whose preferred completion has the higher reward.
    pub rewards_accuracy: f64,
    /// The mean of chosen minus rejected reward.
    pub rewards_margin: f64,
    /// The preferred completions' mean log-probability under the policy.
    pub logps_chosen: f64,
    /// The non-preferred completions' mean log-probability under the policy.
    pub logps_rejected: f64,
}
