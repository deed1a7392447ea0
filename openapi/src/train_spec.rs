//! [`TrainSpec`]: everything a trainer needs to run one fine-tune, and nothing else.
//!
//! A spec is plain data: locations are strings (a local path or a `file://`, `s3://`,
//! `gs://` URI) that the trainer resolves through the storage crate. Unknown fields are
//! refused so a typo in a spec file is an error, not a silently ignored setting.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The seven Llama projections LoRA can wrap, in PEFT's names.
pub use crate::projections::PROJECTIONS as ALL_TARGET_MODULES;

/// A complete, self-contained description of one LoRA training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// Base model: a Hugging Face–layout folder (`config.json`, `*.safetensors`, `tokenizer.json`).
    pub model: String,
    /// Training data: one or more JSONL files, read in order.
    #[serde(alias = "training_file", deserialize_with = "one_or_many")]
    pub training_files: Vec<String>,
    /// Optional JSONL file for validation loss and sample generations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_file: Option<String>,
    /// Where checkpoints, the adapter, metrics and the manifest are written.
    pub output: String,
    /// Dataset format; `auto` detects it from the first record.
    #[serde(default)]
    pub dataset_format: DatasetFormat,
    /// How conversations are rendered into text.
    #[serde(default)]
    pub chat_template: ChatTemplateChoice,
    /// Optimisation settings.
    #[serde(default)]
    pub hyperparameters: Hyperparameters,
    /// LoRA settings.
    #[serde(default)]
    pub lora: LoraSpec,
    /// When checkpoints are written.
    #[serde(default)]
    pub checkpoint: CheckpointPolicy,
    /// Samples generated from validation prompts after training.
    #[serde(default)]
    pub sampling: SamplingSpec,
    /// Compute device.
    #[serde(default)]
    pub device: DeviceKind,
    /// Compute dtype of the frozen base weights (LoRA factors and optimiser state stay f32).
    #[serde(default)]
    pub dtype: DtypeKind,
    /// Whether each layer's activations are recomputed in backward instead of kept:
    /// about a third more compute for a fraction of the activation memory. `auto` turns
    /// it on only when the run would not fit its memory limit otherwise.
    #[serde(default)]
    pub activation_checkpointing: ActivationCheckpointing,
    /// How the CPU computes the frozen projections: `f32` (the default, within the PEFT
    /// parity guarantee) or `bf16` (bf16 operands, f32 accumulation; AMX on a oneMKL
    /// build). `bf16` needs the weights in bf16 (`dtype` `bf16`, or `auto`, which it
    /// then resolves to bf16 on the CPU too).
    #[serde(default, skip_serializing_if = "ComputeKind::is_f32")]
    pub compute: ComputeKind,
    /// Start from this adapter (a PEFT folder or a URI of one, e.g. a finished run's
    /// output): its LoRA factors are the trainable tensors' first values instead of a
    /// fresh draw. Its `adapter_config.json` must have this run's rank, alpha, rsLoRA
    /// and target modules. Part of the run's fingerprint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_adapter: Option<String>,
    /// What the run optimises: the answers' cross-entropy (`supervised`, the default)
    /// or DPO on preference pairs. Part of the run's fingerprint.
    #[serde(default, skip_serializing_if = "TrainingMethod::is_supervised")]
    pub method: TrainingMethod,
    /// The base model's identity as its registration computed it: the trainer takes
    /// its hash instead of reading every weight again where the folder it sees has the
    /// same stamp (and hashes the folder itself where not, or where this is absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_identity: Option<ModelIdentity>,
}

/// A model folder's identity: the hash that fingerprints every run trained on it, and
/// a cheap stamp of the files it was computed from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelIdentity {
    /// SHA-256 (hex) over the SHA-256s of `config.json` and of each weight file, in
    /// load order.
    pub sha256: String,
    /// SHA-256 (hex) over each of those files' name, length and modification time
    /// (whole seconds): equal while none was replaced or rewritten.
    pub stamp: String,
}

impl ModelIdentity {
    /// Both fields are 64 lowercase hex digits.
    fn check(&self, bad: Report<'_>) {
        let hex =
            |s: &str| s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        for (field, value) in [("sha256", &self.sha256), ("stamp", &self.stamp)] {
            if !hex(value) {
                bad(
                    &format!("model_identity.{field}"),
                    "is 64 lowercase hexadecimal digits (a SHA-256)".into(),
                );
            }
        }
    }
}

/// What a run optimises.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum TrainingMethod {
    /// The mean cross-entropy of the answer tokens (supervised fine-tuning).
    #[default]
    Supervised,
    /// Direct preference optimisation (Rafailov et al., 2023) on preference pairs, as
    /// TRL's `DPOTrainer` computes it with its default sigmoid loss: per pair,
    /// `−log σ(β·((log π(chosen) − log π_ref(chosen)) − (log π(rejected) − log
    /// π_ref(rejected))))`, averaged over the step's pairs, where a completion's log
    /// probability is the sum over its tokens. The reference `π_ref` is the model the
    /// run starts from (the base model, or the adapter it continues), frozen.
    Dpo {
        /// How far the policy may move from the reference (OpenAI's and TRL's default
        /// 0.1); `0 < beta ≤ 10`.
        beta: f64,
    },
}

impl TrainingMethod {
    /// DPO's default β.
    pub const DEFAULT_BETA: f64 = 0.1;

    /// Supervised (left out of a serialised spec, so that fingerprints from before the
    /// field stay the same).
    pub fn is_supervised(&self) -> bool {
        *self == Self::Supervised
    }

    /// The sequences one example puts through the model in a step: a DPO pair is two
    /// (its preferred and its other answer, side by side in the batch), so memory
    /// estimates count twice the rows for the same `batch_size`.
    pub fn sequences_per_example(&self) -> u64 {
        match self {
            Self::Supervised => 1,
            Self::Dpo { .. } => 2,
        }
    }
}

/// How the CPU computes the frozen projections' and the head's products. LoRA, norms,
/// attention, the softmax and loss, and the optimiser stay f32 either way; on CUDA
/// candle's graph computes in the weights' dtype whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ComputeKind {
    /// f32 operands (bf16 weights widened exactly): results within 1e-4 of PyTorch +
    /// PEFT in f32.
    #[default]
    F32,
    /// bf16 operands with f32 accumulation, as PyTorch's bf16 autocast rounds a linear
    /// layer's inputs: on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later
    /// Xeons, AMD Zen 4 and later) the products run on `vdpbf16ps`, and on AMX tiles
    /// with a oneMKL build. Outside the f32 parity guarantee; on other CPUs it is no
    /// faster than `f32`.
    Bf16,
}

impl ComputeKind {
    /// Whether this is the default, `f32` (left out of serialised specs, so that specs
    /// and run fingerprints from before the field existed stay the same).
    pub fn is_f32(&self) -> bool {
        *self == Self::F32
    }
}

impl TrainSpec {
    /// The dtype the frozen weights are loaded in on a GPU (`true`) or the CPU (see
    /// [`DtypeKind::with_compute`]).
    pub fn weights_dtype(&self, gpu: bool) -> DtypeKind {
        self.dtype.with_compute(self.compute, gpu)
    }
}

/// Per-layer activation (gradient) checkpointing. Results are bit-identical either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActivationCheckpointing {
    /// On when the memory limit would be passed without it: the process's
    /// (`TUNEQ_MEMORY_LIMIT_BYTES`) on the CPU, one GPU's
    /// (`TUNEQ_ACCELERATOR_MEMORY_BYTES`) on CUDA.
    #[default]
    Auto,
    /// Always recompute.
    On,
    /// Never recompute.
    Off,
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

/// Record shape of a JSONL dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DatasetFormat {
    /// Detect from the first valid record.
    #[default]
    Auto,
    /// `{"messages": [{"role": "system|user|assistant", "content": "…"}, …]}`
    Chat,
    /// `{"prompt": "…", "completion": "…"}`
    PromptCompletion,
    /// `{"instruction": "…", "input": "…", "output": "…"}` (`input` optional)
    Alpaca,
    /// `{"text": "…"}`: loss on every token.
    Text,
    /// `{"input": {"messages": […], "tools": […]}, "preferred_output": [{"role":
    /// "assistant", …}], "non_preferred_output": [{"role": "assistant", …}]}`: OpenAI's
    /// preference pairs, for DPO.
    Preference,
}

/// Which chat template renders conversations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChatTemplateChoice {
    /// The model's own `chat_template` from `tokenizer_config.json` (ChatML when it has none).
    #[default]
    Model,
    /// Llama 2 `[INST]` format.
    Llama2,
    /// ChatML (`<|im_start|>role\n…<|im_end|>`).
    Chatml,
    /// Alpaca `### Instruction:` / `### Response:` format.
    Alpaca,
}

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Scheduler {
    /// Linear decay to zero at the last step.
    #[default]
    Linear,
    /// Half-cosine decay to zero at the last step.
    Cosine,
    /// Constant after warmup.
    Constant,
}

/// Optimisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Hyperparameters {
    /// Passes over the training data.
    pub epochs: u32,
    /// Examples per micro-batch.
    pub batch_size: u32,
    /// Micro-batches per optimiser step.
    pub gradient_accumulation_steps: u32,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Optimiser steps of linear warmup from zero.
    pub warmup_steps: u64,
    /// Schedule after warmup.
    pub scheduler: Scheduler,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables clipping.
    pub max_grad_norm: f64,
    /// Examples longer than this many tokens are truncated.
    pub max_seq_len: u32,
    /// Seed for LoRA init, shuffling and dropout.
    pub seed: u64,
    /// Stop after this many optimiser steps (default: all epochs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u64>,
    /// Compute validation loss every N optimiser steps (it is always computed at the end).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_every_steps: Option<u64>,
    /// Stop once the validation loss has not improved for `patience` validations, and
    /// keep the best validated step's adapter (needs a validation file and
    /// `eval_every_steps`). Off when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
}

/// Early stopping on the validation loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Validations in a row without improvement after which training stops (1–1000).
    pub patience: u32,
    /// How much lower than the best so far a validation loss must be to count as an
    /// improvement (≥ 0).
    #[serde(default)]
    pub min_delta: f64,
}

impl Default for Hyperparameters {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 4,
            gradient_accumulation_steps: 1,
            learning_rate: 2e-4,
            warmup_steps: 0,
            scheduler: Scheduler::Linear,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            max_seq_len: 512,
            seed: 42,
            max_steps: None,
            eval_every_steps: None,
            early_stopping: None,
        }
    }
}

/// LoRA settings, with PEFT's meaning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSpec {
    /// Rank of the update.
    pub r: u32,
    /// Scaling numerator: scale = alpha / r (or alpha / √r with rsLoRA).
    pub alpha: f64,
    /// Dropout on the LoRA branch input during training.
    pub dropout: f64,
    /// Projections to adapt (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
    /// `down_proj`; Phi-3 fuses them into `qkv_proj`, `o_proj`, `gate_up_proj`,
    /// `down_proj`). All seven (the default) means every projection of the model,
    /// whichever its family.
    pub target_modules: Vec<String>,
    /// Rank-stabilised scaling alpha / √r.
    pub rslora: bool,
}

impl Default for LoraSpec {
    fn default() -> Self {
        Self {
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: ALL_TARGET_MODULES.iter().map(|s| s.to_string()).collect(),
            rslora: false,
        }
    }
}

/// When checkpoints are written (in addition to SIGTERM/SIGINT and the end of training).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointPolicy {
    /// Every this many optimiser steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_steps: Option<u64>,
    /// When at least this many seconds passed since the last checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_seconds: Option<u64>,
    /// Complete checkpoints kept; older ones are deleted after a newer one is committed.
    pub keep_last: u32,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        Self {
            every_steps: None,
            every_seconds: Some(600),
            keep_last: 2,
        }
    }
}

/// Generations from validation prompts written after training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingSpec {
    /// Validation prompts to complete (0 disables).
    pub num_samples: u32,
    /// Greedy tokens generated per prompt.
    pub max_new_tokens: u32,
}

impl Default for SamplingSpec {
    fn default() -> Self {
        Self {
            num_samples: 8,
            max_new_tokens: 64,
        }
    }
}

/// Compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The CPU (f32).
    #[default]
    Cpu,
    /// The first CUDA device (needs a build with `--features cuda`).
    Cuda,
}

/// The dtype frozen weights are held in (LoRA factors and optimiser state are f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DtypeKind {
    /// 32-bit float (the CPU default).
    #[default]
    F32,
    /// bfloat16: half the weights' memory. On the CPU the weights are widened exactly
    /// to f32 where used (f32 compute); on CUDA the graph computes in bf16.
    Bf16,
    /// bf16 on a GPU, f32 on the CPU (what jobs created through the API run with
    /// unless they choose).
    Auto,
}

impl DtypeKind {
    /// The dtype this resolves to on a GPU (`true`) or on the CPU.
    pub fn on(self, gpu: bool) -> Self {
        match self {
            Self::Auto if gpu => Self::Bf16,
            Self::Auto => Self::F32,
            chosen => chosen,
        }
    }

    /// The dtype this resolves to for a job computing in `compute`: as [`Self::on`],
    /// except that `auto` is bf16 on the CPU too when the compute is bf16.
    pub fn with_compute(self, compute: ComputeKind, gpu: bool) -> Self {
        match (self, compute) {
            (Self::Auto, ComputeKind::Bf16) => Self::Bf16,
            (dtype, _) => dtype.on(gpu),
        }
    }
}

/// A spec that parsed but cannot run, naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SpecError {
    /// Dotted path of the offending field, e.g. `lora.r`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// The largest LoRA rank accepted: beyond it an adapter stops being small, and its
/// optimiser state can outgrow the machine.
pub const MAX_LORA_RANK: u32 = 256;
/// The largest LoRA alpha accepted (the update is scaled by alpha / r).
pub const MAX_LORA_ALPHA: f64 = 4096.0;
/// The learning rates accepted: below the least, updates vanish in rounding; above the
/// most, training diverges.
pub const MIN_LEARNING_RATE: f64 = 1e-9;
/// See [`MIN_LEARNING_RATE`].
pub const MAX_LEARNING_RATE: f64 = 1.0;
/// The longest sequence accepted (a model may allow less: its `max_position_embeddings`).
pub const MAX_SEQ_LEN: u32 = 131_072;

/// Where a check reports a problem: the field's dotted path and what is wrong with it.
type Report<'r> = &'r mut dyn FnMut(&str, String);

impl TrainSpec {
    /// Checks every value that serde cannot, returning all problems at once.
    pub fn validate(&self) -> Result<(), Vec<SpecError>> {
        let mut errs = Vec::new();
        let mut bad = |field: &str, message: String| {
            errs.push(SpecError {
                field: field.to_string(),
                message,
            })
        };
        self.check_locations(&mut bad);
        check_schedule(&self.hyperparameters, &mut bad);
        check_limits(&self.hyperparameters, &mut bad);
        self.check_lora(&mut bad);
        check_checkpoint(&self.checkpoint, &mut bad);
        self.check_method(&mut bad);
        self.check_early_stopping(&mut bad);
        if let Some(identity) = &self.model_identity {
            identity.check(&mut bad);
        }
        if errs.is_empty() { Ok(()) } else { Err(errs) }
    }

    /// Early stopping's settings are in range, and it has validations to watch.
    fn check_early_stopping(&self, bad: Report<'_>) {
        let Some(rule) = self.hyperparameters.early_stopping else {
            return;
        };
        if !(1..=1000).contains(&rule.patience) {
            bad(
                "hyperparameters.early_stopping.patience",
                format!("must be 1 to 1000, got {}", rule.patience),
            );
        }
        if !(rule.min_delta.is_finite() && rule.min_delta >= 0.0) {
            bad(
                "hyperparameters.early_stopping.min_delta",
                format!("must be ≥ 0, got {}", readable(rule.min_delta)),
            );
        }
        if self.validation_file.is_none() || self.hyperparameters.eval_every_steps.is_none() {
            bad(
                "hyperparameters.early_stopping",
                "watches the validation loss: give a validation file and eval_every_steps".into(),
            );
        }
    }

    /// DPO's β is in range, and its data can be preference pairs.
    fn check_method(&self, bad: Report<'_>) {
        let TrainingMethod::Dpo { beta } = self.method else {
            if self.dataset_format == DatasetFormat::Preference {
                bad(
                    "dataset_format",
                    "preference pairs train with the dpo method; set method to dpo or give \
                     chat, prompt/completion, alpaca or text records"
                        .into(),
                );
            }
            return;
        };
        if !(beta > 0.0 && beta <= 10.0) {
            bad("method.beta", format!("must be in (0, 10], got {beta}"));
        }
        if !matches!(
            self.dataset_format,
            DatasetFormat::Auto | DatasetFormat::Preference
        ) {
            bad(
                "dataset_format",
                "the dpo method trains on preference pairs (input, preferred_output, \
                 non_preferred_output); set dataset_format to preference or auto"
                    .into(),
            );
        }
    }

    /// The model, the training files and the output are named.
    fn check_locations(&self, bad: Report<'_>) {
        if self.model.trim().is_empty() {
            bad("model", "must name a model folder or URI".into());
        }
        if self.training_files.is_empty() || self.training_files.iter().any(|f| f.trim().is_empty())
        {
            bad(
                "training_files",
                "at least one non-empty training file is required".into(),
            );
        }
        if self.output.trim().is_empty() {
            bad("output", "must name an output folder or URI".into());
        }
    }

    /// The compute and dtype agree, and the LoRA settings are in range.
    fn check_lora(&self, bad: Report<'_>) {
        let l = &self.lora;
        if self.compute == ComputeKind::Bf16 && self.dtype == DtypeKind::F32 {
            bad(
                "compute",
                "bf16 compute multiplies bf16 weights: set dtype to bf16 or auto, or compute \
             to f32"
                    .into(),
            );
        }
        if !(1..=MAX_LORA_RANK).contains(&l.r) {
            bad(
                "lora.r",
                format!("must be 1 to {MAX_LORA_RANK}, got {}", l.r),
            );
        }
        if !(l.alpha.is_finite() && l.alpha > 0.0 && l.alpha <= MAX_LORA_ALPHA) {
            bad(
                "lora.alpha",
                format!(
                    "must be above 0 and at most {MAX_LORA_ALPHA}, got {}",
                    readable(l.alpha)
                ),
            );
        }
        if !(l.dropout.is_finite() && (0.0..1.0).contains(&l.dropout)) {
            bad(
                "lora.dropout",
                format!("must be in [0, 1), got {}", readable(l.dropout)),
            );
        }
        if l.target_modules.is_empty() {
            bad(
                "lora.target_modules",
                "at least one module is required".into(),
            );
        }
        for (i, m) in l.target_modules.iter().enumerate() {
            if l.target_modules[..i].contains(m) {
                bad(
                    "lora.target_modules",
                    format!("{m:?} is listed more than once"),
                );
            }
            if !crate::projections::is_projection(m) {
                bad(
                    "lora.target_modules",
                    format!(
                        "unknown module {m:?}; expected some of {} (or, on Phi-3, of {})",
                        ALL_TARGET_MODULES.join(", "),
                        crate::projections::FUSED_PROJECTIONS.join(", ")
                    ),
                );
            }
        }
    }
}

/// Epochs, batch, accumulation, learning rate and warmup.
fn check_schedule(h: &Hyperparameters, bad: Report<'_>) {
    if h.epochs == 0 {
        bad("hyperparameters.epochs", "must be at least 1".into());
    }
    if h.batch_size == 0 {
        bad("hyperparameters.batch_size", "must be at least 1".into());
    }
    if h.gradient_accumulation_steps == 0 {
        bad(
            "hyperparameters.gradient_accumulation_steps",
            "must be at least 1".into(),
        );
    }
    if !(h.learning_rate.is_finite()
        && (MIN_LEARNING_RATE..=MAX_LEARNING_RATE).contains(&h.learning_rate))
    {
        bad(
            "hyperparameters.learning_rate",
            format!(
                "must be between {MIN_LEARNING_RATE:e} and {MAX_LEARNING_RATE}, got {}",
                readable(h.learning_rate)
            ),
        );
    }
    if let Some(max) = h.max_steps
        && h.warmup_steps > max
    {
        bad(
            "hyperparameters.warmup_steps",
            format!("must be at most max_steps ({max}), got {}", h.warmup_steps),
        );
    }
}

/// Weight decay, gradient clipping, sequence length, step limit and evaluation period.
fn check_limits(h: &Hyperparameters, bad: Report<'_>) {
    if !(h.weight_decay.is_finite() && h.weight_decay >= 0.0) {
        bad(
            "hyperparameters.weight_decay",
            format!("must be ≥ 0, got {}", readable(h.weight_decay)),
        );
    }
    if !(h.max_grad_norm.is_finite() && h.max_grad_norm >= 0.0) {
        bad(
            "hyperparameters.max_grad_norm",
            format!("must be ≥ 0, got {}", readable(h.max_grad_norm)),
        );
    }
    if !(2..=MAX_SEQ_LEN).contains(&h.max_seq_len) {
        bad(
            "hyperparameters.max_seq_len",
            format!("must be 2 to {MAX_SEQ_LEN}, got {}", h.max_seq_len),
        );
    }
    if h.max_steps == Some(0) {
        bad(
            "hyperparameters.max_steps",
            "must be at least 1 when set".into(),
        );
    }
    if h.eval_every_steps == Some(0) {
        bad(
            "hyperparameters.eval_every_steps",
            "must be at least 1 when set".into(),
        );
    }
}

/// The checkpoint policy's periods and how many to keep.
fn check_checkpoint(c: &CheckpointPolicy, bad: Report<'_>) {
    if c.every_steps == Some(0) {
        bad(
            "checkpoint.every_steps",
            "must be at least 1 when set".into(),
        );
    }
    if c.every_seconds == Some(0) {
        bad(
            "checkpoint.every_seconds",
            "must be at least 1 when set".into(),
        );
    }
    if c.keep_last == 0 {
        bad("checkpoint.keep_last", "must be at least 1".into());
    }
}

/// `x` as a refusal repeats it: as Rust prints it while that is short, in scientific
/// notation when it would be a wall of digits (`1e308` printed plainly is 309 of them).
fn readable(x: f64) -> String {
    let plain = x.to_string();
    if plain.len() > 16 {
        format!("{x:e}")
    } else {
        plain
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal() -> serde_json::Value {
        serde_json::json!({"model": "m", "training_file": "t.jsonl", "output": "out"})
    }

    #[test]
    fn a_minimal_spec_takes_every_default() {
        let spec: TrainSpec = serde_json::from_value(minimal()).expect("minimal spec parses");
        assert_eq!(spec.training_files, vec!["t.jsonl".to_string()]);
        assert_eq!(spec.lora.target_modules.len(), 7);
        assert!(spec.validate().is_ok());
    }

    #[test]
    fn unknown_fields_are_refused() {
        let mut v = minimal();
        v["hyperparameters"] = serde_json::json!({"learning_rat": 1e-3});
        let err = serde_json::from_value::<TrainSpec>(v).expect_err("typo must fail");
        assert!(err.to_string().contains("learning_rat"), "{err}");
    }

    #[test]
    fn validation_names_every_bad_field() {
        let mut spec: TrainSpec = serde_json::from_value(minimal()).expect("parses");
        spec.lora.r = 0;
        spec.hyperparameters.batch_size = 0;
        spec.lora.target_modules.push("qkv".into());
        let errs = spec.validate().expect_err("invalid");
        let fields: Vec<_> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "hyperparameters.batch_size",
                "lora.r",
                "lora.target_modules"
            ]
        );
    }

    #[test]
    fn bf16_compute_needs_bf16_weights_and_makes_auto_bf16() {
        let mut spec: TrainSpec = serde_json::from_value(minimal()).expect("parses");
        assert_eq!(spec.compute, ComputeKind::F32);
        // The default stays out of serialised specs (fingerprints from before it match).
        assert!(
            !serde_json::to_string(&spec)
                .expect("json")
                .contains("compute")
        );
        spec.compute = ComputeKind::Bf16;
        let errs = spec.validate().expect_err("f32 weights");
        assert_eq!(errs[0].field, "compute");
        for dtype in [DtypeKind::Auto, DtypeKind::Bf16] {
            spec.dtype = dtype;
            assert!(spec.validate().is_ok());
            assert_eq!(spec.weights_dtype(false), DtypeKind::Bf16);
            assert_eq!(spec.weights_dtype(true), DtypeKind::Bf16);
        }
        spec.compute = ComputeKind::F32;
        spec.dtype = DtypeKind::Auto;
        assert_eq!(spec.weights_dtype(false), DtypeKind::F32);
        assert_eq!(spec.weights_dtype(true), DtypeKind::Bf16);
    }
}
