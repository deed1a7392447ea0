//! The job as clients see it: the catalog record, with live state from the queue while
//! the job has not finished, and the tenant's fine-tuned models.

use crate::error::ApiResult;
use crate::records;
use crate::records::finetune::{FineTuneRecord, Outcome, ms_to_seconds, outcome_of, progress_of};
use crate::redact;
use crate::state::AppState;
use tuneq_openapi::{
    AdapterInfo, DpoHyperparameters, DpoSettings, FineTuneJob, JobError, JobHyperparameters,
    JobStatus, Method, Model, Progress, QueueStanding, SupervisedSettings, TrainingMethod,
    WebhookStatus,
};
use tuneq_queue::JobQueue;

/// The job as clients see it: the catalog record, with live state from the queue.
pub(super) async fn view(state: &AppState, record: FineTuneRecord) -> ApiResult<FineTuneJob> {
    let now = job_state(state, &record).await?;
    // Only a job that trained an adapter has a model that can have been deleted.
    let model_deleted_at = match now.adapter {
        Some(_) => records::model::deleted_at(&state.queue, &record.tenant, &record.id).await?,
        None => None,
    };
    let estimated_finish = now
        .progress
        .as_ref()
        .filter(|_| now.status == JobStatus::Running)
        .and_then(|p| p.eta_seconds)
        .map(|eta| records::now_seconds() + eta.max(0.0) as u64);
    let hyperparameters = record.hyperparameters.clone();
    let webhook = webhook_status(&record);
    let lost_steps = now.progress.as_ref().map_or(0, |p| p.lost_steps);
    Ok(FineTuneJob {
        lost_steps,
        pause_requested: now.pause_requested,
        fine_tuned_model: now
            .adapter
            .is_some()
            .then(|| record.fine_tuned_model_name()),
        model_deleted_at,
        adapter: now
            .adapter
            .filter(|_| model_deleted_at.is_none())
            .map(|location| AdapterInfo {
                location: redact::tenant_location(&location, &record.tenant),
                download_url: format!("/v1/fine_tuning/jobs/{}/adapter", record.id),
            }),
        base_model: Some(record.base_model_id().to_string()),
        parent_job: record.parent.as_ref().map(|p| p.job.clone()),
        id: record.id,
        object: "fine_tuning.job".into(),
        created_at: record.created_at,
        model: record.model,
        organization_id: record.tenant,
        status: now.status,
        training_file: record.training_file,
        validation_file: record.validation_file,
        method: method_of(record.method, &hyperparameters),
        hyperparameters,
        finished_at: now.finished_at,
        error: now.error,
        result_files: now.result_files,
        trained_tokens: now.trained_tokens,
        seed: record.seed,
        estimated_finish,
        integrations: (!record.integrations.is_empty()).then(|| {
            record
                .integrations
                .iter()
                .map(|run| tuneq_openapi::JobIntegration {
                    kind: "mlflow".into(),
                    mlflow: run.clone(),
                })
                .collect()
        }),
        metadata: record.metadata,
        user_provided_suffix: record.suffix,
        priority: record.priority,
        hardware: record.hardware,
        lora: record.lora,
        dtype: record.dtype,
        activation_checkpointing: record.activation_checkpointing,
        compute: record.compute,
        learning_rate: record.learning_rate,
        progress: now.progress,
        queue: now.queue,
        failed_attempts: now.attempts,
        attempts: now.attempts,
        preemptions: now.preemptions,
        estimate: record.estimate,
        webhook,
    })
}

/// Where a job stands now: live from the queue while it has not finished, from its
/// outcome once it has.
struct JobState {
    status: JobStatus,
    progress: Option<Progress>,
    queue: Option<QueueStanding>,
    attempts: u32,
    preemptions: u32,
    finished_at: Option<u64>,
    error: Option<JobError>,
    trained_tokens: Option<u64>,
    /// The adapter's location, once the job succeeded.
    adapter: Option<String>,
    /// Its result files, once it succeeded.
    result_files: Vec<String>,
    /// A pause is being carried out.
    pause_requested: bool,
}

/// The state of `record`'s job: its filed outcome, or the queue's view of the job
/// (and the outcome the queue holds once it finished).
async fn job_state(state: &AppState, record: &FineTuneRecord) -> ApiResult<JobState> {
    let mut now = JobState {
        status: JobStatus::Queued,
        progress: None,
        queue: None,
        attempts: 0,
        preemptions: 0,
        finished_at: None,
        error: None,
        trained_tokens: None,
        adapter: None,
        result_files: Vec::new(),
        pause_requested: false,
    };
    let outcome = match record.outcome.clone() {
        Some(outcome) => Some(outcome),
        None => live_state(state, record, &mut now).await?,
    };
    if let Some(o) = outcome {
        now.status = o.status;
        now.finished_at = Some(o.finished_at);
        now.error = o.error.map(|mut e| {
            e.message = redact::paths(&e.message);
            e
        });
        now.trained_tokens = o.trained_tokens;
        now.progress = o.progress;
        now.attempts = o.attempts;
        now.preemptions = o.preemptions;
        now.adapter = o.adapter.filter(|_| now.status == JobStatus::Succeeded);
        now.result_files = o.result_files;
    }
    Ok(now)
}

/// Asks the queue about a job whose outcome is not filed: fills `now` in while the job
/// runs or waits (with where it stands: one call to the queue), or returns its outcome
/// once it finished (a lost job's, when the queue has forgotten it unfiled).
async fn live_state(
    state: &AppState,
    record: &FineTuneRecord,
    now: &mut JobState,
) -> ApiResult<Option<Outcome>> {
    match state.queue.status(&record.job_id, &record.tenant).await? {
        Some((job, _)) if job.state.is_terminal() => Ok(Some(outcome_of(&job)?)),
        Some((job, standing)) => {
            now.status = job.state.public_status();
            now.pause_requested = job.pause_requested;
            now.progress = progress_of(&job)?;
            now.attempts = job.attempts;
            now.preemptions = job.preemptions;
            now.queue = standing.map(|p| QueueStanding {
                ahead: p.ahead,
                ahead_in_tenant: p.ahead_in_tenant,
                estimated_start: p.estimated_start_ms.map(ms_to_seconds),
            });
            Ok(None)
        }
        // The queue forgets a finished job once its outcome is filed, which a copy
        // of the record made earlier does not show yet.
        None if let Some(filed) = state
            .finetunes()
            .get_fresh(&record.tenant, &record.id)
            .await?
            .and_then(|r| r.outcome) =>
        {
            Ok(Some(filed))
        }
        None => Ok(Some(Outcome {
            status: JobStatus::Failed,
            finished_at: record.created_at,
            error: Some(JobError {
                code: tuneq_openapi::FailureClass::JobLost,
                message: "The job's queue record is gone.".into(),
                param: None,
            }),
            trained_tokens: None,
            adapter: None,
            progress: None,
            attempts: 0,
            preemptions: 0,
            result_files: Vec::new(),
        })),
    }
}

/// The job's webhook and how its delivery went, when it has one.
fn webhook_status(record: &FineTuneRecord) -> Option<WebhookStatus> {
    record.webhook_url.clone().map(|url| {
        let progress = record.webhook.clone().unwrap_or_default();
        WebhookStatus {
            url,
            status: progress.status,
            attempts: progress.attempts,
            delivered_at: progress.delivered_at,
            last_error: progress.last_error,
        }
    })
}

/// The tenant's fine-tuned models (jobs that succeeded), newest first.
pub(crate) async fn fine_tuned_models(state: &AppState, tenant: &str) -> ApiResult<Vec<Model>> {
    let mut models = Vec::new();
    let deleted = records::model::deleted_jobs(&state.queue, tenant).await?;
    for record in state.finetunes().all(tenant).await? {
        if deleted.contains(&record.id) {
            continue;
        }
        // A job that has just finished may not have its outcome filed yet.
        let outcome = match record.outcome.clone() {
            Some(o) => Some(o),
            None => state
                .queue
                .get(&record.job_id)
                .await?
                .filter(|job| job.state.is_terminal())
                .map(|job| outcome_of(&job))
                .transpose()?,
        };
        if let Some(outcome) = outcome.filter(|o| o.status == JobStatus::Succeeded) {
            models.push(Model {
                id: record.fine_tuned_model_name(),
                object: "model".into(),
                created: outcome.finished_at,
                owned_by: record.tenant.clone(),
                kind: "fine-tuned".into(),
                base_model: Some(record.base_model_id().to_string()),
                fine_tuning_job_id: Some(record.id.clone()),
                display_name: None,
                details: None,
            });
        }
    }
    Ok(models)
}

/// OpenAI's `method` of a job that optimises `method` with `hyperparameters`.
fn method_of(method: TrainingMethod, hyperparameters: &JobHyperparameters) -> Method {
    match method {
        TrainingMethod::Supervised => Method {
            kind: "supervised".into(),
            supervised: Some(SupervisedSettings {
                hyperparameters: hyperparameters.clone(),
            }),
            dpo: None,
        },
        TrainingMethod::Dpo { beta } => Method {
            kind: "dpo".into(),
            supervised: None,
            dpo: Some(DpoSettings {
                hyperparameters: DpoHyperparameters {
                    beta,
                    batch_size: hyperparameters.batch_size,
                    learning_rate_multiplier: hyperparameters.learning_rate_multiplier,
                    n_epochs: hyperparameters.n_epochs,
                },
            }),
        },
    }
}
