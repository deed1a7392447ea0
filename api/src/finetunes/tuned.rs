//! A tenant's fine-tuned model by its name, ready to be used: continued by a new job,
//! or answered with (`/v1/chat/completions`). The name is the model's (`ft:…`) or one
//! of its kept checkpoints' (`ft:…:ckpt-step-N`).

use crate::error::ApiResult;
use crate::records;
use crate::records::finetune::FineTuneRecord;
use crate::records::model::BaseModel;
use crate::state::AppState;
use tuneq_openapi::{JobStatus, LogEntry};
use tuneq_storage::ObjectKey;
use tuneq_storage::layout::{self, Id};

/// A fine-tuned model (or checkpoint) whose adapter can be read.
#[derive(Debug, Clone)]
pub(crate) struct TunedModel {
    /// The job that trained it.
    pub(crate) job: FineTuneRecord,
    /// The base model it adapts.
    pub(crate) base: BaseModel,
    /// Where its adapter's files are in the server's store.
    pub(crate) adapter: ObjectKey,
}

/// Why a name names no usable fine-tuned model of the tenant's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotUsable {
    /// No such model of the tenant's (another tenant's included), or it has not
    /// succeeded, or it was deleted.
    Unknown,
    /// The job no longer keeps a checkpoint at that step (a run keeps its last few).
    NoCheckpoint {
        /// The job.
        job: String,
        /// The step asked for.
        step: u64,
    },
    /// The base model it adapts is no longer registered.
    BaseGone {
        /// That base model's id.
        base: String,
    },
}

impl NotUsable {
    /// Why `name` cannot be used, for a client; `unknown` is what an unknown name is
    /// told (it depends on what the name was asked for).
    pub(crate) fn explain(&self, name: &str, unknown: &str) -> String {
        let shown = crate::quote::shown(name);
        match self {
            NotUsable::Unknown => unknown.to_string(),
            NotUsable::NoCheckpoint { job, step } => format!(
                "{job} keeps no checkpoint at step {step} (a run keeps its last few): GET /v1/fine_tuning/jobs/{job}/checkpoints lists them."
            ),
            NotUsable::BaseGone { base } => {
                format!("The base model of `{shown}`, `{base}`, is no longer registered.")
            }
        }
    }
}

/// The tenant's fine-tuned model or checkpoint called `name`.
pub(crate) async fn tuned_model(
    state: &AppState,
    tenant: &str,
    name: &str,
) -> ApiResult<Result<TunedModel, NotUsable>> {
    let (model, step) = records::finetune::split_checkpoint(name);
    let step = match step.map(str::parse::<u64>) {
        None => None,
        Some(Ok(step)) => Some(step),
        Some(Err(_)) => return Ok(Err(NotUsable::Unknown)),
    };
    let Some(job) = state.finetunes().by_model_name(tenant, model).await? else {
        return Ok(Err(NotUsable::Unknown));
    };
    let view = super::view::view(state, job.clone()).await?;
    if view.status != JobStatus::Succeeded || view.model_deleted_at.is_some() {
        return Ok(Err(NotUsable::Unknown));
    }
    let Some(base) = records::model::get(&state.queue, job.base_model_id()).await? else {
        return Ok(Err(NotUsable::BaseGone {
            base: job.base_model_id().to_string(),
        }));
    };
    let tenant_id = Id::parse(tenant).map_err(|_| crate::error::ApiError::internal("tenant id"))?;
    let job_key = Id::parse(&job.id).map_err(|_| crate::error::ApiError::internal("job id"))?;
    // The trainer writes the adapter at the root of the job's output, and each
    // checkpoint's in a folder of its own.
    let output = layout::job_output(&tenant_id, &job_key);
    let adapter = match step {
        None => output,
        Some(step) => match kept_checkpoint(state, &job, &output, step).await? {
            Some(key) => key,
            None => {
                return Ok(Err(NotUsable::NoCheckpoint {
                    job: job.id.clone(),
                    step,
                }));
            }
        },
    };
    Ok(Ok(TunedModel { job, base, adapter }))
}

/// Where checkpoint `step` of `job` is, when the run still keeps it: the folder its
/// checkpoint event named, under the job's output.
async fn kept_checkpoint(
    state: &AppState,
    job: &FineTuneRecord,
    output: &ObjectKey,
    step: u64,
) -> ApiResult<Option<ObjectKey>> {
    let events =
        tuneq_queue::JobQueue::events(&state.queue, &job.job_id, None, 10_000, true).await?;
    let folder = events
        .iter()
        .find_map(|event| match super::events::log_entry(event) {
            Some(LogEntry::Checkpoint { step: s, location }) if s == step => {
                location.rsplit('/').next().map(str::to_string)
            }
            _ => None,
        });
    let Some(key) = folder.and_then(|folder| {
        output
            .join(layout::CHECKPOINTS_DIR)
            .and_then(|k| k.join(&folder))
            .ok()
    }) else {
        return Ok(None);
    };
    let Ok(config) = key.join(layout::ADAPTER_FILES[0]) else {
        return Ok(None);
    };
    match state.store.head(&config).await {
        Ok(_) => Ok(Some(key)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e.into()),
    }
}
