//! The job as clients see it: the catalog record, with live state from the queue while
//! the job has not finished, and the tenant's fine-tuned models.

use crate::error::ApiResult;
use crate::records;
use crate::records::finetune::{FineTuneRecord, Outcome, ms_to_seconds, outcome_of, progress_of};
use crate::redact;
use crate::state::AppState;
use tuneq_openapi::{
    AdapterInfo, FineTuneJob, JobError, Method, Model, QueueStanding, SupervisedSettings,
    WebhookStatus,
};
use tuneq_queue::JobQueue;

/// The job as clients see it: the catalog record, with live state from the queue.
pub(super) async fn view(state: &AppState, record: FineTuneRecord) -> ApiResult<FineTuneJob> {
    let mut status = "queued".to_string();
    let mut progress = None;
    let mut queue = None;
    let mut attempts = 0;
    let mut preemptions = 0;
    let mut outcome = record.outcome.clone();
    if outcome.is_none() {
        // The job and, while it waits, where it stands: one call to the queue.
        match state.queue.status(&record.job_id, &record.tenant).await? {
            Some((job, _)) if job.state.is_terminal() => outcome = Some(outcome_of(&job)?),
            Some((job, standing)) => {
                status = job.state.public_status().to_string();
                progress = progress_of(&job)?;
                attempts = job.attempts;
                preemptions = job.preemptions;
                queue = standing.map(|p| QueueStanding {
                    ahead: p.ahead,
                    ahead_in_tenant: p.ahead_in_tenant,
                    estimated_start: p.estimated_start_ms.map(ms_to_seconds),
                });
            }
            // The queue forgets a finished job once its outcome is filed, which a copy
            // of the record made earlier does not show yet.
            None if let Some(filed) = state
                .finetunes()
                .get_fresh(&record.tenant, &record.id)
                .await?
                .and_then(|r| r.outcome) =>
            {
                outcome = Some(filed)
            }
            None => {
                outcome = Some(Outcome {
                    status: "failed".into(),
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
                })
            }
        }
    }
    let mut finished_at = None;
    let mut error = None;
    let mut trained_tokens = None;
    let mut adapter = None;
    if let Some(o) = outcome {
        status = o.status;
        finished_at = Some(o.finished_at);
        error = o.error.map(|mut e| {
            e.message = redact::paths(&e.message);
            e
        });
        trained_tokens = o.trained_tokens;
        progress = o.progress;
        attempts = o.attempts;
        preemptions = o.preemptions;
        adapter = o.adapter.filter(|_| status == "succeeded");
    }
    let estimated_finish = progress
        .as_ref()
        .filter(|_| status == "running")
        .and_then(|p| p.eta_seconds)
        .map(|eta| records::now_seconds() + eta.max(0.0) as u64);
    let hyperparameters = record.hyperparameters.clone();
    let webhook = record.webhook_url.clone().map(|url| {
        let progress = record.webhook.clone().unwrap_or_default();
        WebhookStatus {
            url,
            status: if progress.status.is_empty() {
                "waiting".into()
            } else {
                progress.status
            },
            attempts: progress.attempts,
            delivered_at: progress.delivered_at,
            last_error: progress.last_error,
        }
    });
    let lost_steps = progress.as_ref().map_or(0, |p| p.lost_steps);
    Ok(FineTuneJob {
        lost_steps,
        fine_tuned_model: adapter.is_some().then(|| record.fine_tuned_model_name()),
        adapter: adapter.map(|location| AdapterInfo {
            location: redact::tenant_location(&location, &record.tenant),
            download_url: format!("/v1/fine_tuning/jobs/{}/adapter", record.id),
        }),
        id: record.id,
        object: "fine_tuning.job".into(),
        created_at: record.created_at,
        model: record.model,
        organization_id: record.tenant,
        status,
        training_file: record.training_file,
        validation_file: record.validation_file,
        method: Method {
            kind: "supervised".into(),
            supervised: SupervisedSettings {
                hyperparameters: hyperparameters.clone(),
            },
        },
        hyperparameters,
        finished_at,
        error,
        result_files: Vec::new(),
        trained_tokens,
        seed: record.seed,
        estimated_finish,
        integrations: None,
        metadata: record.metadata,
        user_provided_suffix: record.suffix,
        priority: record.priority,
        hardware: record.hardware,
        lora: record.lora,
        dtype: record.dtype,
        activation_checkpointing: record.activation_checkpointing,
        compute: record.compute,
        learning_rate: record.learning_rate,
        progress,
        queue,
        failed_attempts: attempts,
        attempts,
        preemptions,
        estimate: record.estimate,
        webhook,
    })
}

/// The tenant's fine-tuned models (jobs that succeeded), newest first.
pub(crate) async fn fine_tuned_models(state: &AppState, tenant: &str) -> ApiResult<Vec<Model>> {
    let mut models = Vec::new();
    for record in state.finetunes().all(tenant).await? {
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
        if let Some(outcome) = outcome.filter(|o| o.status == "succeeded") {
            models.push(Model {
                id: record.fine_tuned_model_name(),
                object: "model".into(),
                created: outcome.finished_at,
                owned_by: record.tenant.clone(),
                kind: "fine-tuned".into(),
                base_model: Some(record.model.clone()),
                fine_tuning_job_id: Some(record.id.clone()),
            });
        }
    }
    Ok(models)
}
