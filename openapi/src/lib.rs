//! tuneq's public contract: every type that crosses a process boundary.
//!
//! The API hands a [`TrainSpec`] to a trainer process; the trainer reports progress and
//! writes a manifest whose shapes are defined here too. Everything derives serde and a
//! utoipa schema so `openapi/openapi.json` is generated from these declarations.
//!
//! Layout:
//! - [`chat`]: `/v1/chat/completions` requests and answers, whole and streamed.
//! - [`failure`]: why a job failed, as a type ([`FailureClass`]) with a stable code.
//! - [`job_event`]: the vocabulary of a job's event log ([`EventKind`], [`StopCause`]).
//! - [`files`], [`finetunes`]: the REST API's objects (OpenAI's shapes plus tuneq's fields).
//! - [`integrations`]: the experiment tracking a job asks for and shows (MLflow).
//! - [`launch`]: how a dispatcher starts a trainer and reads its exit (the launch contract).
//! - [`responses`]: `/v1/responses` requests, response objects.
//! - [`projections`]: the projections LoRA can wrap ([`PROJECTIONS`], Phi-3's fused
//!   [`FUSED_PROJECTIONS`]).
//! - [`progress`]: events a trainer reports ([`TrainEvent`], [`StepMetrics`]).
//! - [`log`]: what those reports leave in a job's event log ([`LogEntry`]), written and
//!   read by the API.
//! - [`stored`]: the JSON a queue job keeps for the API, read and written in one place.
//! - [`train_spec`]: the complete description of one training run ([`TrainSpec`]) and its parts.

pub mod chat;
pub mod failure;
pub mod files;
pub mod finetunes;
pub mod integrations;
pub mod job_event;
pub mod launch;
pub mod log;
pub mod progress;
pub mod projections;
pub mod responses;
pub mod stored;
pub mod train_spec;

pub use chat::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChoiceLogprobs, ChunkChoice, ChunkDelta, ChunkToolCall, FinishReason, FunctionCallOut,
    StopStrings, StreamOptions, TokenLogprobOut, ToolCallOut, TopLogprob, Usage,
};
pub use failure::FailureClass;
pub use files::{
    Binary, Deleted, ErrorBody, ErrorDetail, FileList, FileObject, FilePurpose, FileTokenStats,
    FileValidation, LineProblem,
};
pub use finetunes::{
    AdapterFileUrl, AdapterInfo, AdapterUrls, AttemptReport, AttemptReportAnswer, Auto, AutoOrInt,
    AutoOrNumber, ChatTemplateSource, CheckpointMetrics, DeliveryStatus, DpoHyperparameters,
    DpoMethod, DpoSettings, FineTuneCheckpoint, FineTuneCheckpointList, FineTuneCreate,
    FineTuneEvent, FineTuneEventList, FineTuneJob, FineTuneList,
    Hyperparameters as JobHyperparameters, HyperparametersRequest, JobError, JobEstimate,
    JobPayload, JobStatus, Method, MethodRequest, Model, ModelDetails, ModelList, Progress,
    QueueStanding, SupervisedMethod, SupervisedSettings, WebhookEvent, WebhookEventData,
    WebhookSecret, WebhookStatus,
};
pub use integrations::{IntegrationRequest, JobIntegration, MlflowRun, MlflowRunRequest};
pub use job_event::{EventKind, StopCause};
pub use log::LogEntry;
pub use progress::{PreferenceMetrics, StepMetrics, TrainEvent};
pub use projections::{FUSED_PROJECTIONS, PROJECTIONS};
pub use stored::{MalformedRecord, StoredJson};
pub use train_spec::{
    ActivationCheckpointing, ChatTemplateChoice, CheckpointPolicy, ComputeKind, DatasetFormat,
    DeviceKind, DtypeKind, EarlyStopping, Hyperparameters, LoraSpec, MAX_LEARNING_RATE,
    MAX_LORA_ALPHA, MAX_LORA_RANK, MAX_SEQ_LEN, MIN_LEARNING_RATE, ModelIdentity, SamplingSpec,
    Scheduler, SpecError, TrainSpec, TrainingMethod,
};
