//! The experiment tracking a create request asks for (`integrations`): checked with
//! nothing written ([`check`]), then opened as MLflow runs ([`open_runs`]) before the
//! job is queued. Each run goes to the tenant's own experiment
//! (`<tenant>/<experiment_name>`), so tenants never write to each other's; a tracking
//! server that does not take the run refuses the create (503
//! `integration_unavailable`), so a job is never tracked by halves. OpenAI's `wandb` is
//! refused with the reason: this server offers MLflow.

use crate::error::{ApiError, ApiResult, Code};
use crate::records::finetune::FineTuneRecord;
use crate::state::AppState;
use std::collections::BTreeMap;
use tuneq_openapi::integrations::{
    MAX_INTEGRATIONS, MAX_RUN_NAME_CHARS, MAX_RUN_TAGS, MAX_TAG_KEY_CHARS, MAX_TAG_VALUE_CHARS,
};
use tuneq_openapi::{FineTuneCreate, MlflowRun, MlflowRunRequest};

/// The experiment a run goes to when the request names none.
const DEFAULT_EXPERIMENT: &str = "fine-tunes";
/// Tag keys only tuneq sets.
const RESERVED_TAG_PREFIXES: [&str; 2] = ["mlflow.", "tuneq."];

/// Checks the request's `integrations` with nothing written: the MLflow runs to open.
/// `wandb`, an unknown type, MLflow on a server without a tracking server, and names or
/// tags out of bounds are refused naming the field.
pub(crate) fn check(state: &AppState, body: &FineTuneCreate) -> ApiResult<Vec<MlflowRunRequest>> {
    let Some(integrations) = body.integrations.as_deref() else {
        return Ok(Vec::new());
    };
    if integrations.len() > MAX_INTEGRATIONS {
        return Err(refuse(
            "integrations",
            format!("At most {MAX_INTEGRATIONS} integrations may be given."),
        ));
    }
    let mut runs = Vec::new();
    for (i, integration) in integrations.iter().enumerate() {
        let param = format!("integrations[{i}]");
        match integration.kind.as_str() {
            "mlflow" => {
                if state.tracker.is_none() {
                    return Err(refuse(
                        &format!("{param}.type"),
                        "This server tracks no runs: its operator has configured no MLflow tracking server.".into(),
                    ));
                }
                if !runs.is_empty() {
                    return Err(refuse(
                        &param,
                        "Only one mlflow integration may be given.".into(),
                    ));
                }
                let run = integration.mlflow.clone().unwrap_or_default();
                check_run(&param, &run)?;
                runs.push(run);
            }
            "wandb" => {
                return Err(refuse(
                    &format!("{param}.type"),
                    "Weights & Biases is not offered: this server has no W&B-compatible server \
                     configured. Track the job in MLflow instead ({\"type\": \"mlflow\"}) where \
                     the operator configured a tracking server, or follow its events."
                        .into(),
                ));
            }
            other => {
                return Err(refuse(
                    &format!("{param}.type"),
                    format!("Unknown integration type {other:?}; the one offered is \"mlflow\"."),
                ));
            }
        }
    }
    Ok(runs)
}

fn check_run(param: &str, run: &MlflowRunRequest) -> ApiResult<()> {
    for (field, value) in [
        ("experiment_name", &run.experiment_name),
        ("run_name", &run.run_name),
    ] {
        if let Some(value) = value {
            check_text(
                &format!("{param}.mlflow.{field}"),
                value,
                MAX_RUN_NAME_CHARS,
            )?;
        }
    }
    let tags = run.tags.as_ref().map_or(0, BTreeMap::len);
    if tags > MAX_RUN_TAGS {
        return Err(refuse(
            &format!("{param}.mlflow.tags"),
            format!("At most {MAX_RUN_TAGS} tags may be given."),
        ));
    }
    for (key, value) in run.tags.iter().flatten() {
        let field = format!("{param}.mlflow.tags.{key}");
        check_text(&field, key, MAX_TAG_KEY_CHARS)?;
        if RESERVED_TAG_PREFIXES.iter().any(|p| key.starts_with(p)) {
            return Err(refuse(
                &field,
                "Tag keys starting with `mlflow.` or `tuneq.` are reserved.".into(),
            ));
        }
        if value.chars().count() > MAX_TAG_VALUE_CHARS {
            return Err(refuse(
                &field,
                format!("A tag value may be at most {MAX_TAG_VALUE_CHARS} characters."),
            ));
        }
    }
    Ok(())
}

/// A name: 1 to `max` characters, none of them a control character.
fn check_text(param: &str, value: &str, max: usize) -> ApiResult<()> {
    let count = value.chars().count();
    if count == 0 || count > max || value.chars().any(char::is_control) {
        return Err(refuse(
            param,
            format!("Must be 1 to {max} characters, none of them a control character."),
        ));
    }
    Ok(())
}

fn refuse(param: &str, message: String) -> ApiError {
    ApiError::invalid(param, Code::UnsupportedIntegration, message)
}

/// Opens the runs `requests` asks for on the tracking server: each in the tenant's
/// experiment, tagged with the job, given the job's parameters. A tracking server that
/// does not answer refuses the create with 503.
pub(crate) async fn open_runs(
    state: &AppState,
    requests: &[MlflowRunRequest],
    job: &FineTuneRecord,
) -> ApiResult<Vec<MlflowRun>> {
    let Some(tracker) = &state.tracker else {
        return Ok(Vec::new());
    };
    let mut runs = Vec::new();
    for request in requests {
        let experiment = request
            .experiment_name
            .as_deref()
            .unwrap_or(DEFAULT_EXPERIMENT);
        let experiment_name = format!("{}/{experiment}", job.tenant);
        let run_name = request
            .run_name
            .clone()
            .or_else(|| job.suffix.clone())
            .unwrap_or_else(|| job.id.clone());
        let ours = [
            ("tuneq.job_id".to_string(), job.id.clone()),
            (
                "tuneq.fine_tuned_model".to_string(),
                job.fine_tuned_model_name(),
            ),
        ];
        let tags = request.tags.clone().unwrap_or_default();
        let run = tracker
            .open_run(experiment_name, run_name, tags, &ours, &params_of(job))
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "cannot open an MLflow run");
                ApiError::new(
                    Code::IntegrationUnavailable,
                    "The MLflow tracking server did not take the run; try again later.",
                )
            })?;
        runs.push(run);
    }
    Ok(runs)
}

/// A job's parameters as its run's params: the model, the files, the hyperparameters
/// resolved, the method and the LoRA settings.
fn params_of(job: &FineTuneRecord) -> Vec<(String, String)> {
    let h = &job.hyperparameters;
    let mut params = vec![
        ("model", job.model.clone()),
        ("base_model", job.base_model_id().to_string()),
        ("training_file", job.training_file.clone()),
        ("n_epochs", h.n_epochs.to_string()),
        ("batch_size", h.batch_size.to_string()),
        (
            "learning_rate_multiplier",
            h.learning_rate_multiplier.to_string(),
        ),
        ("learning_rate", job.learning_rate.to_string()),
        ("seed", job.seed.to_string()),
        (
            "method",
            match job.method {
                tuneq_openapi::TrainingMethod::Supervised => "supervised",
                tuneq_openapi::TrainingMethod::Dpo { .. } => "dpo",
            }
            .to_string(),
        ),
        ("lora_r", job.lora.r.to_string()),
        ("lora_alpha", job.lora.alpha.to_string()),
        ("lora_dropout", job.lora.dropout.to_string()),
        ("lora_target_modules", job.lora.target_modules.join(",")),
        ("hardware", job.hardware.clone()),
    ];
    if let Some(validation) = &job.validation_file {
        params.push(("validation_file", validation.clone()));
    }
    if let Some(parent) = &job.parent {
        params.push(("parent_job", parent.job.clone()));
    }
    if let tuneq_openapi::TrainingMethod::Dpo { beta } = job.method {
        params.push(("beta", beta.to_string()));
    }
    params
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}
