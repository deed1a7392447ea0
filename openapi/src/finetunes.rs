//! Fine-tuning jobs, their events and checkpoints, and models: OpenAI's object shapes
//! (`docs/openai-compat.md`) with tuneq's extra fields, which
//! OpenAI's SDKs accept and keep.

use crate::progress::TrainEvent;
use crate::train_spec::{LoraSpec, TrainSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// The literal `"auto"`: let the service choose from the dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Auto {
    /// Chosen by the service.
    Auto,
}

/// A whole number, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum AutoOrInt {
    /// `"auto"`.
    Auto(Auto),
    /// The value.
    Value(u64),
}

/// A number, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum AutoOrNumber {
    /// `"auto"`.
    Auto(Auto),
    /// The value.
    Value(f64),
}

/// Training settings of a create request: OpenAI's three (each a value or `"auto"`)
/// and tuneq's finer ones.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HyperparametersRequest {
    /// Examples per optimiser step (1–256), or `"auto"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<AutoOrInt>,
    /// Scales the base learning rate (0 < x ≤ 10), or `"auto"` (1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate_multiplier: Option<AutoOrNumber>,
    /// Passes over the training data (1–50), or `"auto"` (from the dataset's size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_epochs: Option<AutoOrInt>,
    /// DPO only: how far the trained model may move from the reference (0 < β ≤ 10),
    /// or `"auto"` (0.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta: Option<AutoOrNumber>,
    /// Stop once the validation loss has not improved for `patience` validations and
    /// keep the best validated step's model (tuneq; needs a validation file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<crate::EarlyStopping>,
    /// Peak learning rate, instead of a multiplier of the base one (tuneq).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate: Option<f64>,
    /// Longest example in tokens; longer ones are truncated (tuneq, 8–32 768).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_len: Option<u32>,
    /// Warmup steps (tuneq).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
}

/// OpenAI's `method.supervised`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SupervisedMethod {
    /// Its hyperparameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyperparameters: Option<HyperparametersRequest>,
}

/// OpenAI's `method.dpo`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DpoMethod {
    /// Its hyperparameters (`beta` among them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyperparameters: Option<HyperparametersRequest>,
}

/// OpenAI's `method`: `supervised` or `dpo`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MethodRequest {
    /// `supervised` or `dpo` (`reinforcement` is refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// Settings of the supervised method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supervised: Option<SupervisedMethod>,
    /// Settings of the DPO method: trains on preference pairs against the model the
    /// job starts from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<DpoMethod>,
    /// Not offered; present only to refuse it by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reinforcement: Option<serde_json::Value>,
}

/// `POST /finetunes` and `POST /v1/fine_tuning/jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FineTuneCreate {
    /// Base model id (see `GET /v1/models`).
    pub model: String,
    /// Id of an uploaded training file.
    pub training_file: String,
    /// Id of an uploaded validation file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_file: Option<String>,
    /// Training settings (OpenAI's older place for them; `method` is the newer one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyperparameters: Option<HyperparametersRequest>,
    /// `{"type": "supervised", "supervised": {"hyperparameters": {…}}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<MethodRequest>,
    /// Up to 64 characters (letters, digits, `-`, `_`, `.`) in the fine-tuned model's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    /// Seed (random when absent; echoed on the job).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Up to 16 pairs; keys ≤ 64 characters, values ≤ 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    /// Experiment tracking: `[{"type": "mlflow", "mlflow": {"experiment_name", "run_name",
    /// "tags"}}]` tracks the job in the MLflow server the operator configured (up to
    /// 4 entries, one of each type). OpenAI's `wandb` is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrations: Option<Vec<crate::IntegrationRequest>>,
    /// LoRA settings (tuneq; defaults: r 8, alpha 16, all seven projections).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSpec>,
    /// 0 (lowest) to 9 (most urgent); default 5 (tuneq).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// Hardware class a node pool must offer: `cpu`, `gpu`, `spot-cpu`, `spot-gpu`
    /// (tuneq; default: any pool, spot and GPU first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<String>,
    /// The most the job may cost, in the pools' currency (tuneq): a job whose estimate
    /// on every pool it could use exceeds it is refused at create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
    /// Where to POST a signed event (Standard Webhooks; secret at `GET /webhooks/secret`)
    /// when the job succeeds, fails or is cancelled (tuneq). `https://` to a public
    /// address, unless the server allows private targets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook_url: Option<String>,
    /// The dtype the base model's frozen weights are held in (tuneq): `f32`, `bf16`
    /// (half the memory; on the CPU widened exactly to f32 where used), or `auto`, the
    /// default: bf16 on GPU pools, f32 on CPU pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<crate::DtypeKind>,
    /// Recompute each layer's activations in backward instead of keeping them (tuneq):
    /// `auto` (default) turns it on where a CPU attempt would not fit its memory
    /// otherwise; `on` also on GPU pools, where Llama 2 7B in bf16 fits an L4 only with
    /// it; `off`. Results are the same either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<crate::ActivationCheckpointing>,
    /// How CPU pools compute the frozen projections (tuneq): `f32` (default; within
    /// 1e-4 of PyTorch + PEFT) or `bf16` (bf16 operands, f32 accumulation: faster on
    /// CPUs with AVX512-BF16 or, with a oneMKL build, AMX; needs `dtype` `bf16` or
    /// `auto`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<crate::ComputeKind>,
}

/// Hyperparameters as the job runs them (`"auto"` resolved).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Hyperparameters {
    /// Examples per optimiser step.
    pub batch_size: u64,
    /// Multiplier of the base learning rate.
    pub learning_rate_multiplier: f64,
    /// Passes over the training data.
    pub n_epochs: u64,
}

/// OpenAI's `method` on a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Method {
    /// `supervised` or `dpo`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The supervised method's settings (with `type` `supervised`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supervised: Option<SupervisedSettings>,
    /// The DPO method's settings (with `type` `dpo`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<DpoSettings>,
}

/// `method.dpo` on a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DpoSettings {
    /// As run.
    pub hyperparameters: DpoHyperparameters,
}

/// A DPO job's hyperparameters as it runs them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DpoHyperparameters {
    /// β.
    pub beta: f64,
    /// Pairs per optimiser step.
    pub batch_size: u64,
    /// Multiplier of the base learning rate.
    pub learning_rate_multiplier: f64,
    /// Passes over the training pairs.
    pub n_epochs: u64,
}

/// `method.supervised` on a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SupervisedSettings {
    /// As run.
    pub hyperparameters: Hyperparameters,
}

/// Why a job failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct JobError {
    /// Stable code: the failure's class.
    pub code: crate::FailureClass,
    /// What happened.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
}

/// How far a running job has got (tuneq).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Progress {
    /// Optimiser steps done.
    pub step: u64,
    /// Steps the run takes (0 until training has started).
    pub total_steps: u64,
    /// `step / total_steps` in percent.
    pub percent: f64,
    /// Latest training loss.
    pub loss: Option<f64>,
    /// Latest validation loss.
    pub validation_loss: Option<f64>,
    /// Learning rate of the latest step.
    pub learning_rate: Option<f64>,
    /// Estimated seconds to the end.
    pub eta_seconds: Option<f64>,
    /// Tokens trained on so far.
    pub tokens_seen: u64,
    /// Step of the latest checkpoint (where a new attempt resumes).
    pub checkpoint_step: Option<u64>,
    /// Steps done again because an attempt ended past its last checkpoint (preempted,
    /// failed, restarted): the work a preemption cost.
    #[serde(default)]
    pub lost_steps: u64,
}

/// Where a queued job stands (tuneq).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct QueueStanding {
    /// Jobs likely to start before it, all tenants counted by weight.
    pub ahead: u64,
    /// Jobs of the same tenant ahead of it.
    pub ahead_in_tenant: u64,
    /// Estimated start, Unix seconds; null until run times are known.
    pub estimated_start: Option<u64>,
}

/// The trained adapter (tuneq).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AdapterInfo {
    /// Where it was written (a `file://`, `s3://` or `gs://` URI).
    pub location: String,
    /// Download it: a tar archive of the PEFT folder.
    pub download_url: String,
}

/// A fine-tuning job (OpenAI's `fine_tuning.job` plus tuneq's fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FineTuneJob {
    /// `ftjob-…`.
    pub id: String,
    /// Always `fine_tuning.job`.
    pub object: String,
    /// Unix seconds.
    pub created_at: u64,
    /// The model as the request named it: a base model, or an alias of one (an OpenAI
    /// model name the operator maps to an open model).
    pub model: String,
    /// The registered base model trained: `model` itself, or the one its alias stands
    /// for, or the base of the fine-tuned model it continues (tuneq).
    #[serde(default)]
    pub base_model: Option<String>,
    /// The job whose fine-tuned model this job continues from, when `model` named one
    /// (tuneq).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_job: Option<String>,
    /// The tenant.
    pub organization_id: String,
    /// Where it stands.
    pub status: JobStatus,
    /// Training file id.
    pub training_file: String,
    /// Validation file id.
    pub validation_file: Option<String>,
    /// As run.
    pub hyperparameters: Hyperparameters,
    /// As run.
    pub method: Method,
    /// `ft:<base>:<tenant>:<suffix>:<id>` once succeeded.
    pub fine_tuned_model: Option<String>,
    /// Unix seconds, once finished.
    pub finished_at: Option<u64>,
    /// Why it failed.
    pub error: Option<JobError>,
    /// Result file ids (none yet).
    pub result_files: Vec<String>,
    /// Tokens trained on, once succeeded.
    pub trained_tokens: Option<u64>,
    /// Seed.
    pub seed: u64,
    /// Estimated end while running, Unix seconds.
    pub estimated_finish: Option<u64>,
    /// The runs that track the job (null when it asked for none).
    pub integrations: Option<Vec<crate::JobIntegration>>,
    /// The caller's metadata.
    pub metadata: Option<BTreeMap<String, String>>,
    /// The suffix asked for.
    pub user_provided_suffix: Option<String>,
    /// Priority, 0–9 (tuneq).
    pub priority: u8,
    /// Hardware class asked for, or `any` (tuneq).
    pub hardware: String,
    /// LoRA settings as run (tuneq).
    pub lora: LoraSpec,
    /// The frozen weights' dtype as asked (`auto`: bf16 on GPU pools, f32 on CPU pools,
    /// bf16 everywhere with `compute: bf16`; tuneq; null for jobs created before it was
    /// kept).
    pub dtype: Option<crate::DtypeKind>,
    /// Activation checkpointing as asked (tuneq; null for jobs created before it was
    /// kept).
    pub activation_checkpointing: Option<crate::ActivationCheckpointing>,
    /// How CPU pools compute the frozen projections (tuneq; null for jobs created before
    /// it was kept).
    pub compute: Option<crate::ComputeKind>,
    /// Peak learning rate as run (tuneq).
    pub learning_rate: f64,
    /// Progress while running and after (tuneq).
    pub progress: Option<Progress>,
    /// Standing while queued (tuneq).
    pub queue: Option<QueueStanding>,
    /// Attempts that failed (crashed, or the trainer reported an error) and so spent
    /// one of the job's tries; preemptions are counted apart, in `preemptions` (tuneq).
    pub failed_attempts: u32,
    /// The same count as `failed_attempts`, under its first name: kept for clients that
    /// read it (tuneq; deprecated).
    #[schema(deprecated)]
    pub attempts: u32,
    /// Times its machine was taken away and it resumed (tuneq).
    pub preemptions: u32,
    /// Steps trained again after attempts ended past their last checkpoint (tuneq).
    pub lost_steps: u64,
    /// A pause was asked while an attempt runs: the attempt is writing a checkpoint
    /// and stopping, and the status turns `paused` once it has (tuneq).
    #[serde(default)]
    pub pause_requested: bool,
    /// What training is expected to take on the first pool of the job's list, made at
    /// create from the pool's price and speed (tuneq; absent when the speed or the
    /// training file's token count is unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<JobEstimate>,
    /// The adapter, once succeeded, until the fine-tuned model is deleted (tuneq).
    pub adapter: Option<AdapterInfo>,
    /// When the fine-tuned model was deleted (`DELETE /v1/models/{model}`), Unix
    /// seconds; its adapter and checkpoints are gone, the job stays (tuneq).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_deleted_at: Option<u64>,
    /// The webhook asked for at create, and how its delivery went (tuneq).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookStatus>,
}

/// What a job is expected to take (tuneq).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobEstimate {
    /// The pool the estimate is for (the first of the job's list).
    pub pool: String,
    /// Training time in seconds, without waiting or preemptions.
    pub seconds: f64,
    /// That time at the pool's price per hour.
    pub cost: f64,
    /// The pools the job may run on, best first.
    pub pools: Vec<String>,
}

/// Presigned download URLs of an adapter's files (tuneq): fetch them with any HTTP
/// client, no API key, until they expire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AdapterUrls {
    /// Always `list`.
    pub object: String,
    /// One per PEFT file.
    pub data: Vec<AdapterFileUrl>,
    /// When the URLs stop working, Unix seconds.
    pub expires_at: u64,
}

/// One adapter file and where to download it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AdapterFileUrl {
    /// `adapter_config.json` or `adapter_model.safetensors`.
    pub name: String,
    /// A presigned `GET` URL.
    pub url: String,
}

/// A fine-tuning job's status, by OpenAI's names: retries, preemptions and lost leases
/// stay internal (a job waiting for any reason is `queued`, one with a live attempt
/// `running`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// OpenAI's status while it checks the files (tuneq checks them at upload and at
    /// create, so a job is never in it; listed for clients that filter by it).
    ValidatingFiles,
    /// Waiting to run.
    Queued,
    /// An attempt is running.
    Running,
    /// Finished with an adapter.
    Succeeded,
    /// Failed for good (`error` says why).
    Failed,
    /// Cancelled.
    Cancelled,
    /// Paused by its tenant (`POST …/pause`): holding no machine, its progress in a
    /// checkpoint, until `POST …/resume` puts it back in line.
    Paused,
}

impl JobStatus {
    /// Every status, in the order declared.
    pub const ALL: &'static [Self] = &[
        Self::ValidatingFiles,
        Self::Queued,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::Cancelled,
        Self::Paused,
    ];

    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ValidatingFiles => "validating_files",
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Paused => "paused",
        }
    }

    /// The status named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|s| s.as_str() == name)
    }
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a job's webhook delivery stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// The job has not finished, or its first try has not been made.
    #[default]
    Waiting,
    /// A try failed; another is due.
    Retrying,
    /// The endpoint took the event.
    Delivered,
    /// Given up: after the last retry, or the endpoint answered 410.
    Failed,
}

/// A job's webhook and its delivery.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WebhookStatus {
    /// Where the event is sent.
    pub url: String,
    /// How its delivery stands.
    pub status: DeliveryStatus,
    /// Tries so far.
    pub attempts: u32,
    /// Unix seconds of the delivery that succeeded.
    pub delivered_at: Option<u64>,
    /// Why the last try failed.
    pub last_error: Option<String>,
}

/// The event a webhook carries: OpenAI's shape, so `client.webhooks.unwrap()` of the
/// OpenAI SDKs verifies and parses it. Thin: fetch the job for its state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WebhookEvent {
    /// `evt_…`, the same for every try (also the `webhook-id` header).
    pub id: String,
    /// Always `event`.
    pub object: String,
    /// Unix seconds when the job finished.
    pub created_at: u64,
    /// `fine_tuning.job.succeeded`, `fine_tuning.job.failed` or
    /// `fine_tuning.job.cancelled`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The job.
    pub data: WebhookEventData,
}

/// What a webhook event is about.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WebhookEventData {
    /// `ftjob-…`.
    pub id: String,
}

/// A tenant's webhook signing secret.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WebhookSecret {
    /// `whsec_` and the base64 of 32 random bytes: the key that signs every webhook
    /// sent for this tenant's jobs (`webhook-signature: v1,<base64 HMAC-SHA256>` over
    /// `<webhook-id>.<webhook-timestamp>.<body>`).
    pub secret: String,
    /// After a rotation: until when (Unix seconds) the replaced secret still signs too.
    pub previous_expires_at: Option<u64>,
}

/// A page of jobs, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FineTuneList {
    /// Always `list`.
    pub object: String,
    /// The jobs.
    pub data: Vec<FineTuneJob>,
    /// Whether more follow; ask again with `after` = the last id.
    pub has_more: bool,
    /// The first id on this page.
    pub first_id: Option<String>,
    /// The last id on this page.
    pub last_id: Option<String>,
}

/// One event of a job (OpenAI's `fine_tuning.job.event`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FineTuneEvent {
    /// `ftevent-…`: the cursor.
    pub id: String,
    /// Always `fine_tuning.job.event`.
    pub object: String,
    /// Unix seconds.
    pub created_at: u64,
    /// `info`, `warn` or `error`.
    pub level: String,
    /// What happened.
    pub message: String,
    /// `message` or `metrics`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Figures of a `metrics` event (`step`, `total_steps`, `train_loss`, …).
    pub data: Option<serde_json::Value>,
}

/// A page of events, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FineTuneEventList {
    /// Always `list`.
    pub object: String,
    /// The events.
    pub data: Vec<FineTuneEvent>,
    /// Whether older ones follow; ask again with `after` = the last id.
    pub has_more: bool,
}

/// Figures at a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CheckpointMetrics {
    /// Its step.
    pub step: u64,
    /// Training loss of the step.
    pub train_loss: Option<f64>,
    /// Latest validation loss.
    pub valid_loss: Option<f64>,
}

/// A checkpoint (OpenAI's `fine_tuning.job.checkpoint`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FineTuneCheckpoint {
    /// `ftckpt-…`.
    pub id: String,
    /// Always `fine_tuning.job.checkpoint`.
    pub object: String,
    /// Unix seconds.
    pub created_at: u64,
    /// `ft:…:ckpt-step-<N>`.
    pub fine_tuned_model_checkpoint: String,
    /// The job.
    pub fine_tuning_job_id: String,
    /// Its step.
    pub step_number: u64,
    /// Figures at that step.
    pub metrics: CheckpointMetrics,
    /// Where it was written (tuneq).
    pub location: String,
}

/// A page of checkpoints, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FineTuneCheckpointList {
    /// Always `list`.
    pub object: String,
    /// The checkpoints.
    pub data: Vec<FineTuneCheckpoint>,
    /// Whether older ones follow.
    pub has_more: bool,
    /// The first id on this page.
    pub first_id: Option<String>,
    /// The last id on this page.
    pub last_id: Option<String>,
}

/// A model (OpenAI's `model` plus tuneq's fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Model {
    /// The name to fine-tune from, or `ft:…` for an adapter.
    pub id: String,
    /// Always `model`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// `tuneq` for base models, the tenant for fine-tuned ones.
    pub owned_by: String,
    /// `base`, `alias` (another name of a base model) or `fine-tuned` (tuneq).
    pub kind: String,
    /// The base model a fine-tuned model was trained from, or an alias stands for (tuneq).
    pub base_model: Option<String>,
    /// A fine-tuned model's job (tuneq).
    pub fine_tuning_job_id: Option<String>,
    /// The name the operator gave a base model to show beside its id (tuneq).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// What a user needs to choose a base model (and an alias's or a fine-tuned model's
    /// base), as its registration found the folder (tuneq); absent for a model named at
    /// start (`--model`) whose folder did not pass the check, and for one registered
    /// before these were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<ModelDetails>,
}

/// A base model's facts, read from its folder once when it was registered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelDetails {
    /// Its family: `config.json`'s `model_type` (`llama`, `qwen2`, `qwen3`, `mistral`,
    /// `gemma2`, `gemma3_text`, `phi3`).
    pub architecture: String,
    /// Its parameters, every tensor of its weights counted once (a tied head is the
    /// embedding), as transformers' `num_parameters()` counts them.
    pub parameters: u64,
    /// The longest sequence it was trained for (`max_position_embeddings`).
    pub context_length: u64,
    /// How its weights are stored: `float32`, `bfloat16` or `float16` (the embedding's).
    pub dtype: String,
    /// Whose chat template renders its conversations.
    pub chat_template: ChatTemplateSource,
    /// The template its jobs train with, its fine-tuned models answer with, and
    /// uploads are counted with: `model` (its own, ChatML where it has none) or the
    /// built-in the operator registered it with.
    #[serde(default)]
    pub template: crate::ChatTemplateChoice,
    /// Whether that template renders tools and tool calls itself (otherwise tuneq
    /// describes tools in a system message).
    pub renders_tools: bool,
    /// The pools that can hold a fine-tune of it at the default settings, by the
    /// memory estimate and the pools file (empty: none can).
    #[serde(default)]
    pub fits_pools: Vec<String>,
}

/// Whose chat template a model's conversations are rendered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChatTemplateSource {
    /// The model's own (`tokenizer_config.json`'s `chat_template` or `chat_template.jinja`).
    Own,
    /// tuneq's built-in ChatML: the model ships none.
    BuiltIn,
}

/// All models the caller can use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    /// The models.
    pub data: Vec<Model>,
}

/// What a trainer posts to `/internal/attempts/{job}/report` with its attempt's token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AttemptReport {
    /// Numbers the attempt's reports from 1: a repeated report is recorded once.
    pub seq: u64,
    /// Events since the previous report, in order.
    pub events: Vec<TrainEvent>,
}

/// What the control plane answers a delivered [`AttemptReport`]: what the attempt is to
/// do next.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AttemptReportAnswer {
    /// The tenant paused the job: write a checkpoint and stop as after SIGTERM (the
    /// launch contract's interrupted exit); the job waits paused until resumed.
    #[serde(default)]
    pub checkpoint_and_stop: bool,
}

/// What a fine-tune's queue job carries from the API to a dispatcher: everything an
/// attempt needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobPayload {
    /// The fine-tune (`ftjob-…`).
    pub finetune: String,
    /// The run.
    pub spec: TrainSpec,
}
