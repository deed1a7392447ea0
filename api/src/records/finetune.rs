//! Fine-tune records: what was asked (the catalog keeps it), and the outcome once the
//! job has finished (filed here too, because the queue trims finished jobs).
//!
//! The queue job is the source of truth for where a job is while it runs; this record
//! is what outlives it. An API process keeps copies of the records it read (see
//! `crate::cache` for why a copy is safe to use).

use crate::cache::RecordCache;
use crate::error::{ApiError, ApiResult};
use crate::redact;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use tuneq_openapi::{
    FailureClass, JobError, JobHyperparameters, LoraSpec, MalformedRecord, Progress, StoredJson,
};
use tuneq_queue::{Catalog, JobRecord, JobState};

/// Catalog kind of fine-tune records.
const KIND: &str = "finetune";

/// What joins a fine-tuned model's name and a checkpoint's step in the checkpoint's
/// name (`ft:…:ckpt-step-N`).
pub(crate) const CHECKPOINT_STEP: &str = ":ckpt-step-";

/// A model name as the fine-tuned model's name and, for one of its checkpoints, the
/// step as written (`ft:…:ckpt-step-N` → `(ft:…, Some("N"))`).
pub(crate) fn split_checkpoint(name: &str) -> (&str, Option<&str>) {
    match name.rsplit_once(CHECKPOINT_STEP) {
        Some((model, step)) => (model, Some(step)),
        None => (name, None),
    }
}

/// What the catalog keeps about a fine-tune.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FineTuneRecord {
    pub(crate) id: String,
    pub(crate) tenant: String,
    pub(crate) created_at: u64,
    /// The model as the request named it: a base model's id or an alias of one.
    pub(crate) model: String,
    /// The registered base model trained, when `model` is an alias of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) base_model: Option<String>,
    /// The fine-tuned model this job continues from, when `model` names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) parent: Option<Parent>,
    pub(crate) training_file: String,
    pub(crate) validation_file: Option<String>,
    pub(crate) hyperparameters: JobHyperparameters,
    /// What it optimises (absent: supervised, as every record before DPO).
    #[serde(
        default,
        skip_serializing_if = "tuneq_openapi::TrainingMethod::is_supervised"
    )]
    pub(crate) method: tuneq_openapi::TrainingMethod,
    pub(crate) learning_rate: f64,
    pub(crate) lora: LoraSpec,
    pub(crate) seed: u64,
    pub(crate) suffix: Option<String>,
    pub(crate) metadata: Option<BTreeMap<String, String>>,
    pub(crate) priority: u8,
    pub(crate) hardware: String,
    /// The queue job.
    pub(crate) job_id: String,
    /// SHA-256 of the create request, to tell a retry from a reused idempotency key.
    pub(crate) request_hash: String,
    /// Set once the job has finished (see `webhooks::settle`).
    #[serde(default)]
    pub(crate) outcome: Option<Outcome>,
    /// Where to send the finished job's event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) webhook_url: Option<String>,
    /// How sending it went so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) webhook: Option<WebhookProgress>,
    /// The most it may cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) max_cost: Option<f64>,
    /// What it was expected to take, at create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) estimate: Option<tuneq_openapi::JobEstimate>,
    /// The frozen weights' dtype, activation checkpointing and compute it runs with
    /// (absent in records written before they were kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) dtype: Option<tuneq_openapi::DtypeKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) activation_checkpointing: Option<tuneq_openapi::ActivationCheckpointing>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) compute: Option<tuneq_openapi::ComputeKind>,
    /// The MLflow runs that track it (`integrations`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) integrations: Vec<tuneq_openapi::MlflowRun>,
    /// The chat template it trains with, which its fine-tuned model answers with
    /// (absent in records written before it was kept: `model`, as they trained).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) chat_template: Option<tuneq_openapi::ChatTemplateChoice>,
}

impl FineTuneRecord {
    /// The chat template it trained with.
    pub(crate) fn template(&self) -> tuneq_openapi::ChatTemplateChoice {
        self.chat_template.unwrap_or_default()
    }

    /// The registered base model trained: `model`, or the one its alias stands for.
    pub(crate) fn base_model_id(&self) -> &str {
        self.base_model.as_deref().unwrap_or(&self.model)
    }

    /// What the fine-tuned model's name starts from: the model the request named, or,
    /// for a job that continues a fine-tuned model, that model's own.
    pub(crate) fn name_base(&self) -> &str {
        self.parent.as_ref().map_or(&self.model, |p| &p.name_base)
    }

    /// The fine-tuned model's name, OpenAI-style.
    pub(crate) fn fine_tuned_model_name(&self) -> String {
        format!(
            "ft:{}:{}:{}:{}",
            self.name_base(),
            self.tenant,
            self.suffix.as_deref().unwrap_or(""),
            self.id.trim_start_matches("ftjob-")
        )
    }
}

/// A webhook's delivery, as the record keeps it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WebhookProgress {
    /// How the delivery stands (a saved one is never `waiting`).
    pub(crate) status: tuneq_openapi::DeliveryStatus,
    pub(crate) attempts: u32,
    pub(crate) delivered_at: Option<u64>,
    pub(crate) last_error: Option<String>,
}

/// A finished job, as the catalog keeps it after the queue has forgotten the job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Outcome {
    pub(crate) status: tuneq_openapi::JobStatus,
    pub(crate) finished_at: u64,
    pub(crate) error: Option<JobError>,
    pub(crate) trained_tokens: Option<u64>,
    pub(crate) adapter: Option<String>,
    pub(crate) progress: Option<Progress>,
    pub(crate) attempts: u32,
    pub(crate) preemptions: u32,
    /// The job's result file (its step metrics), once it succeeded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) result_files: Vec<String>,
}

/// The fine-tuned model a job continues from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Parent {
    /// The job that trained it.
    pub(crate) job: String,
    /// The base its name starts from (`ft:<name_base>:…`), which the new job's name keeps.
    pub(crate) name_base: String,
}

/// A succeeded attempt's result, as the queue job keeps it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AttemptResult {
    /// Where the adapter was written.
    pub adapter: String,
    /// Tokens trained on.
    pub trained_tokens: u64,
    /// Steps done.
    pub step: u64,
    /// Final training loss.
    pub train_loss: Option<f64>,
    /// Final validation loss.
    pub validation_loss: Option<f64>,
    /// The tenant's file holding the run's step metrics (absent when it left none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_file: Option<String>,
}

/// Unix milliseconds (the queue's clock) as seconds (the API's).
pub(crate) fn ms_to_seconds(ms: u64) -> u64 {
    ms / 1000
}

impl StoredJson for AttemptResult {
    const FIELD: &'static str = "result";
}

/// The progress a queue job's trainer last reported (a stored value that does not read
/// is an error naming the job and the field).
pub(crate) fn progress_of(job: &JobRecord) -> ApiResult<Option<Progress>> {
    Progress::decode_optional(&job.id, job.progress.as_deref()).map_err(malformed)
}

/// A queue job's stored value that does not read: an internal error (the detail goes
/// to the log, never to the client).
pub(crate) fn malformed(e: MalformedRecord) -> ApiError {
    ApiError::internal(e.to_string())
}

/// The outcome of a finished queue job.
pub(crate) fn outcome_of(job: &JobRecord) -> ApiResult<Outcome> {
    let result =
        AttemptResult::decode_optional(&job.id, job.result.as_deref()).map_err(malformed)?;
    let error = (job.state == JobState::Failed).then(|| {
        let detail = job.error.as_deref().unwrap_or("The job failed.");
        // The full message stays in the operator's log; the tenant sees it without
        // server paths or store locations.
        tracing::info!(job = %job.id, error = detail, failure = ?job.failure, "job failed");
        JobError {
            // A job failed by a version that did not store its class yet failed as a
            // training failure: that is what it was told then, too.
            code: job.failure.unwrap_or(FailureClass::TrainingFailed),
            message: redact::paths(detail),
            param: None,
        }
    });
    Ok(Outcome {
        status: job.state.public_status(),
        finished_at: ms_to_seconds(job.finished_ms.unwrap_or(job.enqueued_ms)),
        error,
        trained_tokens: result.as_ref().map(|r| r.trained_tokens),
        result_files: result
            .as_ref()
            .and_then(|r| r.result_file.clone())
            .into_iter()
            .collect(),
        adapter: result.map(|r| r.adapter),
        progress: progress_of(job)?,
        attempts: job.attempts,
        preemptions: job.preemptions,
    })
}

/// The fine-tune records in the catalog, through this process's copies.
pub(crate) struct FineTunes<'a> {
    catalog: &'a dyn Catalog,
    cache: &'a RecordCache<FineTuneRecord>,
}

impl<'a> FineTunes<'a> {
    /// The records in `catalog`, with copies kept in `cache`.
    pub(crate) fn new(catalog: &'a dyn Catalog, cache: &'a RecordCache<FineTuneRecord>) -> Self {
        Self { catalog, cache }
    }

    /// The tenant's fine-tune `id`, from this process's copy when it has one.
    pub(crate) async fn get(&self, tenant: &str, id: &str) -> ApiResult<Option<FineTuneRecord>> {
        if let Some(record) = self.cache.get(tenant, id) {
            return Ok(Some(FineTuneRecord::clone(&record)));
        }
        self.get_fresh(tenant, id).await
    }

    /// The tenant's fine-tune `id` as the catalog has it now.
    pub(crate) async fn get_fresh(
        &self,
        tenant: &str,
        id: &str,
    ) -> ApiResult<Option<FineTuneRecord>> {
        if tuneq_queue::catalog::check_identifier("id", id).is_err() {
            return Ok(None);
        }
        let record: Option<FineTuneRecord> =
            super::read(self.catalog, (KIND, tenant), id, "fine-tune").await?;
        if let Some(record) = &record {
            self.cache.put(tenant, id, Arc::new(record.clone()));
        }
        Ok(record)
    }

    /// The tenant's fine-tune whose fine-tuned model is named `name` (`ft:…`, the job id
    /// its last part), read by that id rather than by a scan of the tenant's jobs; None
    /// for a name no job of the tenant's has.
    pub(crate) async fn by_model_name(
        &self,
        tenant: &str,
        name: &str,
    ) -> ApiResult<Option<FineTuneRecord>> {
        let Some((_, id)) = name.strip_prefix("ft:").and_then(|n| n.rsplit_once(':')) else {
            return Ok(None);
        };
        Ok(self
            .get(tenant, &format!("ftjob-{id}"))
            .await?
            .filter(|record| record.fine_tuned_model_name() == name))
    }

    /// The tenant's fine-tune `id`, or 404 (also for another tenant's id).
    pub(crate) async fn find(&self, tenant: &str, id: &str) -> ApiResult<FineTuneRecord> {
        self.get(tenant, id)
            .await?
            .ok_or_else(|| ApiError::not_found("fine-tuning job", id))
    }

    /// Records a new fine-tune; false (and nothing written) if its id is taken.
    pub(crate) async fn create(&self, record: &FineTuneRecord) -> ApiResult<bool> {
        Ok(self
            .catalog
            .create_entry(KIND, &record.tenant, &record.id, &super::body(record)?)
            .await?)
    }

    /// Writes `record` back to the catalog (and this process's copy).
    pub(crate) async fn save(&self, record: &FineTuneRecord) -> ApiResult<()> {
        self.catalog
            .update_entry(KIND, &record.tenant, &record.id, &super::body(record)?)
            .await?;
        self.cache
            .put(&record.tenant, &record.id, Arc::new(record.clone()));
        Ok(())
    }

    /// Every fine-tune of the tenant, newest first.
    pub(crate) async fn all(&self, tenant: &str) -> ApiResult<Vec<FineTuneRecord>> {
        super::read_all(self.catalog, (KIND, tenant), "fine-tune").await
    }

    /// A page of the tenant's fine-tunes, newest first, after the fine-tune `after`.
    pub(crate) async fn page(
        &self,
        tenant: &str,
        after: Option<&str>,
        limit: u32,
    ) -> ApiResult<super::Page<FineTuneRecord>> {
        super::page(self.catalog, (KIND, tenant), after, limit, "fine-tune").await
    }

    /// The first of the tenant's jobs that has not finished and trains on `file` (so
    /// the file must stay). Reads every job record of the tenant: deletes are rare.
    pub(crate) async fn unfinished_using(
        &self,
        tenant: &str,
        file: &str,
    ) -> ApiResult<Option<String>> {
        Ok(self
            .all(tenant)
            .await?
            .into_iter()
            .find(|j| {
                j.outcome.is_none()
                    && (j.training_file == file || j.validation_file.as_deref() == Some(file))
            })
            .map(|j| j.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(error: &str, failure: Option<tuneq_openapi::FailureClass>) -> JobRecord {
        JobRecord {
            id: "j000000000001".into(),
            tenant: "t".into(),
            state: JobState::Failed,
            priority: 5,
            pools: vec![],
            gpus: 1,
            payload: String::new(),
            attempts: 1,
            max_attempts: 3,
            preemptions: 0,
            stalls: 0,
            epoch: 1,
            pause_requested: false,
            pool: None,
            enqueued_ms: 0,
            finished_ms: Some(1000),
            due_ms: None,
            progress: None,
            result: None,
            error: Some(error.into()),
            failure,
        }
    }

    #[test]
    fn the_code_is_the_stored_failure_class_whatever_the_reason_says() {
        for class in FailureClass::ALL {
            let outcome = outcome_of(&failed("invalid input: loss became NaN", Some(*class)));
            let code = outcome.ok().and_then(|o| o.error).map(|e| e.code);
            assert_eq!(code, Some(*class));
        }
        // Failed before classes were stored: a training failure, whatever it says.
        let outcome = outcome_of(&failed("invalid input: line 3", None));
        let code = outcome.ok().and_then(|o| o.error).map(|e| e.code);
        assert_eq!(code, Some(FailureClass::TrainingFailed));
    }

    #[test]
    fn a_malformed_stored_result_is_an_error_naming_the_job_and_the_field() {
        let mut job = failed("x", None);
        job.state = JobState::Succeeded;
        job.result = Some("{\"adapter\": 7}".into());
        let err = outcome_of(&job).err().map(|e| e.detail.message.clone());
        assert!(
            err.is_some(),
            "a malformed result must not read as an empty one"
        );
        job.result = None;
        job.progress = Some("[1, 2]".into());
        assert!(outcome_of(&job).is_err(), "nor a malformed progress");
    }
}
