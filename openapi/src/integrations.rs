//! Experiment tracking a job asks for (`integrations`): OpenAI's shape, an entry per
//! tracker, `{"type": <kind>, <kind>: {…}}`. tuneq tracks runs in an MLflow tracking
//! server its operator names; OpenAI's `wandb` is recognised and refused with the reason.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// The most integrations one job may ask for.
pub const MAX_INTEGRATIONS: usize = 4;
/// The most tags one tracked run may be given.
pub const MAX_RUN_TAGS: usize = 20;
/// The longest experiment or run name.
pub const MAX_RUN_NAME_CHARS: usize = 256;
/// The longest tag key (MLflow's limit).
pub const MAX_TAG_KEY_CHARS: usize = 250;
/// The longest tag value.
pub const MAX_TAG_VALUE_CHARS: usize = 5000;

/// One integration a create request asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct IntegrationRequest {
    /// `mlflow` (tuneq) or `wandb` (OpenAI's; refused unless the operator configured a
    /// W&B-compatible server, which this version does not offer).
    #[serde(rename = "type")]
    pub kind: String,
    /// With `type: "mlflow"`: where the run goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlflow: Option<MlflowRunRequest>,
    /// With `type: "wandb"`: OpenAI's W&B settings (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub wandb: Option<serde_json::Value>,
}

/// The MLflow run a job is tracked in.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MlflowRunRequest {
    /// The experiment (created when the server has none by that name; default
    /// `tuneq`). Up to 256 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experiment_name: Option<String>,
    /// The run's name (default: the fine-tuned model's suffix, else the job id). Up to
    /// 256 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_name: Option<String>,
    /// Tags set on the run: up to 20; keys up to 250 characters, not starting with
    /// `mlflow.` or `tuneq.` (reserved), values up to 5000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tags: Option<BTreeMap<String, String>>,
}

/// An integration of a job, as the job shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobIntegration {
    /// `mlflow`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The MLflow run the job is tracked in.
    pub mlflow: MlflowRun,
}

/// An MLflow run that tracks a job: its parameters (the hyperparameters, the model, the
/// files), every step's metrics, and the adapter as artifacts under `adapter/`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MlflowRun {
    /// The experiment's name.
    pub experiment_name: String,
    /// The experiment's id on the tracking server.
    pub experiment_id: String,
    /// The run's id.
    pub run_id: String,
    /// The run's name.
    pub run_name: String,
    /// The tags asked for.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, String>,
}
