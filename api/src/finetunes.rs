//! Fine-tuning jobs: create, list, retrieve, cancel, events, checkpoints and the adapter
//! — at `/v1/fine_tuning/jobs…` (OpenAI's shapes) and `/finetunes…` (the same handlers).
//!
//! A fine-tune is two records. The catalog keeps what was asked (and, once the job has
//! finished, its outcome, because the queue trims finished jobs); the queue job is the
//! source of truth for where the job is. Its payload is the complete [`TrainSpec`], so a
//! dispatcher needs nothing else to run it. A request that can never run (unknown model,
//! missing file, no pool with the hardware, values out of range) is refused before
//! anything is written.

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult};
use crate::files;
use crate::models;
use crate::records;
use crate::redact;
use crate::state::AppState;
use crate::webhooks::{self, Delivery};
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use tuneq_openapi::ErrorBody;
use tuneq_openapi::{
    AdapterFileUrl, AdapterInfo, AdapterUrls, AutoOrInt, AutoOrNumber, CheckpointMetrics,
    CheckpointPolicy, FineTuneCheckpoint, FineTuneCheckpointList, FineTuneCreate, FineTuneEvent,
    FineTuneEventList, FineTuneJob, FineTuneList, HyperparametersRequest, JobError,
    JobHyperparameters, JobPayload, LoraSpec, Method, Model, Progress, QueueStanding, SamplingSpec,
    SupervisedSettings, TrainSpec, WebhookEvent, WebhookEventData, WebhookStatus,
};
use tuneq_queue::{Catalog, JobQueue, JobRecord, JobState, NewJob, QueueError};
use tuneq_storage::layout::{self, Id};

/// Catalog kind of fine-tune records.
const KIND: &str = "finetune";
/// Attempts before a job fails for good (preemptions do not count).
const MAX_ATTEMPTS: u32 = 3;
/// `retry-after` of a create refused for the tenant's queued-jobs limit.
const QUEUED_RETRY_AFTER_S: u64 = 30;

/// What the catalog keeps about a fine-tune.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FineTuneRecord {
    id: String,
    tenant: String,
    created_at: u64,
    model: String,
    training_file: String,
    validation_file: Option<String>,
    hyperparameters: JobHyperparameters,
    learning_rate: f64,
    lora: LoraSpec,
    seed: u64,
    suffix: Option<String>,
    metadata: Option<BTreeMap<String, String>>,
    priority: u8,
    hardware: String,
    /// The queue job.
    job_id: String,
    /// SHA-256 of the create request, to tell a retry from a reused idempotency key.
    request_hash: String,
    /// Set once the job has finished (see [`settle`]).
    #[serde(default)]
    outcome: Option<Outcome>,
    /// Where to send the finished job's event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    webhook_url: Option<String>,
    /// How sending it went so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    webhook: Option<WebhookProgress>,
    /// The most it may cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_cost: Option<f64>,
    /// What it was expected to take, at create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    estimate: Option<tuneq_openapi::JobEstimate>,
}

/// A webhook's delivery, as the record keeps it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct WebhookProgress {
    /// `retrying`, `delivered` or `failed`.
    status: String,
    attempts: u32,
    delivered_at: Option<u64>,
    last_error: Option<String>,
}

/// A finished job, as the catalog keeps it after the queue has forgotten the job.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Outcome {
    status: String,
    finished_at: u64,
    error: Option<JobError>,
    trained_tokens: Option<u64>,
    adapter: Option<String>,
    progress: Option<Progress>,
    attempts: u32,
    preemptions: u32,
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
}

/// Routes, under both prefixes. Each prefix is a scope, so the router compares one
/// static prefix before it tries the patterns with an `{id}` in them.
pub fn routes(cfg: &mut web::ServiceConfig) {
    for prefix in ["/v1/fine_tuning/jobs", "/finetunes"] {
        cfg.service(
            web::scope(prefix)
                .service(
                    crate::scoped_resource(prefix, "", "GET, POST")
                        .route(web::post().to(create))
                        .route(web::get().to(list)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}", "GET").route(web::get().to(retrieve)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}/cancel", "POST")
                        .route(web::post().to(cancel)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}/events", "GET")
                        .route(web::get().to(events)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}/checkpoints", "GET")
                        .route(web::get().to(checkpoints)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}/adapter", "GET")
                        .route(web::get().to(adapter)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}/adapter/urls", "GET")
                        .route(web::get().to(adapter_urls)),
                ),
        );
    }
}

fn new_id() -> String {
    format!("ftjob-{}", hex::encode(rand::random::<[u8; 12]>()))
}

/// The id a request with `Idempotency-Key` gets: the same key (per tenant) always maps
/// to the same job.
fn idempotent_id(tenant: &str, key: &str) -> String {
    let digest = Sha256::digest(format!("{tenant}\0{key}").as_bytes());
    format!("ftjob-{}", &hex::encode(digest)[..24])
}

fn idempotency_key(req: &HttpRequest) -> ApiResult<Option<String>> {
    let Some(value) = req.headers().get("idempotency-key") else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|k| !k.is_empty() && k.len() <= 255)
        .ok_or_else(|| {
            ApiError::invalid(
                "Idempotency-Key",
                "invalid_value",
                "Idempotency-Key must be 1 to 255 visible ASCII characters.",
            )
        })?;
    Ok(Some(key.to_string()))
}

/// Everything decided about a valid create request.
struct Plan {
    record: FineTuneRecord,
    spec: TrainSpec,
    pools: Vec<String>,
}

/// The hyperparameters a request gives, from `method.supervised` or the older place.
fn requested_hyperparameters(body: &FineTuneCreate) -> ApiResult<HyperparametersRequest> {
    if let Some(method) = &body.method {
        if method.kind != "supervised" || method.dpo.is_some() || method.reinforcement.is_some() {
            return Err(ApiError::invalid(
                "method.type",
                "unsupported_method",
                format!(
                    "Only the supervised method is offered, not `{}`.",
                    method.kind
                ),
            ));
        }
        if let Some(h) = method
            .supervised
            .as_ref()
            .and_then(|s| s.hyperparameters.clone())
        {
            if body.hyperparameters.is_some() {
                return Err(ApiError::invalid(
                    "hyperparameters",
                    "conflicting_values",
                    "Give hyperparameters either at the top level or in method.supervised, not both.",
                ));
            }
            return Ok(h);
        }
    }
    Ok(body.hyperparameters.clone().unwrap_or_default())
}

/// OpenAI's "auto" epochs: 3, moved so the run sees 100 to 25 000 examples, within 1–25.
fn auto_epochs(examples: u64) -> u64 {
    let examples = examples.max(1);
    let mut epochs = 3u64;
    if epochs * examples < 100 {
        epochs = 100u64.div_ceil(examples);
    }
    if epochs * examples > 25_000 {
        epochs = 25_000 / examples;
    }
    epochs.clamp(1, 25)
}

fn check_range<T: PartialOrd + std::fmt::Display>(
    param: &str,
    value: T,
    low: T,
    high: T,
) -> ApiResult<T> {
    if value < low || value > high {
        return Err(ApiError::invalid(
            param,
            "invalid_value",
            format!("{param} must be {low} to {high}, not {value}."),
        ));
    }
    Ok(value)
}

fn check_suffix(suffix: &str) -> ApiResult<()> {
    let ok = !suffix.is_empty()
        && suffix.len() <= 64
        && suffix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        return Err(ApiError::invalid(
            "suffix",
            "invalid_value",
            "suffix must be 1 to 64 letters, digits, '-', '_' or '.'.",
        ));
    }
    Ok(())
}

fn check_metadata(metadata: &BTreeMap<String, String>) -> ApiResult<()> {
    if metadata.len() > 16 {
        return Err(ApiError::invalid(
            "metadata",
            "invalid_value",
            "metadata holds at most 16 pairs.",
        ));
    }
    for (key, value) in metadata {
        crate::text::check("metadata key", key, 64, false).map_err(|mut e| {
            e.detail.param = Some("metadata".into());
            e
        })?;
        if !value.is_empty() {
            crate::text::check(&format!("metadata.{key}"), value, 512, true)?;
        }
    }
    Ok(())
}

/// The tenant's uploaded file `id`, or a 400 naming `param`.
async fn dataset(
    state: &AppState,
    tenant: &Tenant,
    param: &str,
    id: &str,
) -> ApiResult<tuneq_openapi::FileObject> {
    files::find(state, tenant, id).await.map_err(|e| {
        if e.status == StatusCode::NOT_FOUND {
            ApiError::invalid(
                param,
                "file_not_found",
                format!("No uploaded file `{id}`: upload it with POST /v1/files first."),
            )
        } else {
            e
        }
    })
}

/// Decides everything about a create request, refusing one that can never run.
async fn plan(
    state: &AppState,
    tenant: &Tenant,
    id: &str,
    body: &FineTuneCreate,
) -> ApiResult<Plan> {
    let base = models::base(state, &body.model).await?.ok_or_else(|| {
        ApiError::invalid(
            "model",
            "model_not_found",
            format!(
                "No base model `{}`: GET /v1/models lists the ones you can fine-tune.",
                body.model
            ),
        )
    })?;
    let training = dataset(state, tenant, "training_file", &body.training_file).await?;
    let validation = match &body.validation_file {
        Some(v) if v == &body.training_file => {
            return Err(ApiError::invalid(
                "validation_file",
                "invalid_value",
                "The validation file must not be the training file.",
            ));
        }
        Some(v) => Some(dataset(state, tenant, "validation_file", v).await?),
        None => None,
    };
    if body.integrations.as_ref().is_some_and(|i| !i.is_empty()) {
        return Err(ApiError::invalid(
            "integrations",
            "unsupported_integration",
            "Integrations are not offered; follow a job with its events instead.",
        ));
    }
    // The URL is kept as the url crate serialises it: what was checked is what is
    // later called, whichever parser reads the record.
    let webhook_url = match &body.webhook_url {
        Some(url) => Some(
            webhooks::check_url(url, &state.config.webhooks)
                .map_err(|reason| ApiError::invalid("webhook_url", "invalid_webhook_url", reason))?
                .to_string(),
        ),
        None => None,
    };
    let hardware = body.hardware.clone().unwrap_or_else(|| "any".into());
    if let Some(max_cost) = body.max_cost
        && !(max_cost.is_finite() && max_cost > 0.0)
    {
        return Err(ApiError::invalid(
            "max_cost",
            "invalid_value",
            format!("max_cost must be a number above 0, not {max_cost}."),
        ));
    }
    // The hardware class first: the cheapest refusal, before files are read.
    crate::fit::place(
        state,
        &tuneq_pools::Needs {
            class: &hardware,
            ..Default::default()
        },
    )?;
    let priority = check_range("priority", body.priority.unwrap_or(5), 0, 9)?;
    if let Some(suffix) = &body.suffix {
        check_suffix(suffix)?;
    }
    if let Some(metadata) = &body.metadata {
        check_metadata(metadata)?;
    }
    let h = requested_hyperparameters(body)?;
    let examples = training.validation.examples;
    let n_epochs = match h.n_epochs {
        None | Some(AutoOrInt::Auto(_)) => auto_epochs(examples),
        Some(AutoOrInt::Value(n)) => check_range("hyperparameters.n_epochs", n, 1, 50)?,
    };
    let batch_size = match h.batch_size {
        None | Some(AutoOrInt::Auto(_)) => examples.clamp(1, 8),
        Some(AutoOrInt::Value(n)) => check_range("hyperparameters.batch_size", n, 1, 256)?,
    };
    let multiplier = match h.learning_rate_multiplier {
        None | Some(AutoOrNumber::Auto(_)) => 1.0,
        Some(AutoOrNumber::Value(m)) if (0.001..=10.0).contains(&m) => m,
        Some(AutoOrNumber::Value(m)) => {
            return Err(ApiError::invalid(
                "hyperparameters.learning_rate_multiplier",
                "invalid_value",
                format!("learning_rate_multiplier must be 0.001 to 10, not {m}."),
            ));
        }
    };
    let learning_rate = h
        .learning_rate
        .unwrap_or(base.base_learning_rate * multiplier);
    let seed = body
        .seed
        .unwrap_or_else(|| u64::from(rand::random::<u32>()));
    let lora = body.lora.clone().unwrap_or_default();

    let tenant_id = Id::parse(&tenant.0).map_err(|_| ApiError::internal("tenant id"))?;
    let job_key = Id::parse(id).map_err(|_| ApiError::internal("job id"))?;
    let steps_per_epoch = examples.div_ceil(batch_size).max(1);
    let mut spec = TrainSpec {
        model: base.location.clone(),
        training_files: vec![
            state
                .store
                .uri(&files::content_key(&tenant.0, &training.id)?),
        ],
        validation_file: match &validation {
            Some(v) => Some(state.store.uri(&files::content_key(&tenant.0, &v.id)?)),
            None => None,
        },
        output: state.store.uri(&layout::job_output(&tenant_id, &job_key)),
        dataset_format: Default::default(),
        chat_template: Default::default(),
        hyperparameters: Default::default(),
        lora: lora.clone(),
        // Checkpoints about ten times per run (and every five minutes) bound what a
        // preemption can cost.
        checkpoint: CheckpointPolicy {
            every_steps: Some((steps_per_epoch * n_epochs / 10).max(1)),
            every_seconds: Some(300),
            keep_last: 2,
        },
        sampling: SamplingSpec {
            num_samples: 0,
            ..SamplingSpec::default()
        },
        device: Default::default(),
        dtype: Default::default(),
    };
    let hp = &mut spec.hyperparameters;
    hp.epochs = u32::try_from(n_epochs).unwrap_or(u32::MAX);
    hp.batch_size = u32::try_from(batch_size).unwrap_or(u32::MAX);
    hp.learning_rate = learning_rate;
    hp.seed = seed;
    if let Some(len) = h.max_seq_len {
        hp.max_seq_len = check_range("hyperparameters.max_seq_len", len, 8, 32_768)?;
    }
    if let Some(warmup) = h.warmup_steps {
        let total_steps = steps_per_epoch * n_epochs;
        if warmup > total_steps {
            return Err(ApiError::invalid(
                "hyperparameters.warmup_steps",
                "invalid_value",
                format!(
                    "warmup_steps {warmup} is more than the job's {total_steps} steps ({n_epochs} epoch(s) of {steps_per_epoch}); it would never reach its learning rate."
                ),
            ));
        }
        hp.warmup_steps = warmup;
    }
    if validation.is_some() {
        hp.eval_every_steps = spec.checkpoint.every_steps;
    }
    if let Err(problems) = spec.validate() {
        return Err(spec_problems(&problems));
    }
    let memory_bytes = crate::fit::check_job(&base, &spec, &training)?;
    let tokens =
        crate::fit::tokens_to_process(&training, &base.id, spec.hyperparameters.max_seq_len)
            .saturating_mul(n_epochs);
    let (pools, estimate) = crate::fit::place(
        state,
        &tuneq_pools::Needs {
            class: &hardware,
            memory_bytes,
            tokens: Some(tokens),
            max_cost: body.max_cost,
        },
    )?;
    let record = FineTuneRecord {
        id: id.to_string(),
        tenant: tenant.0.clone(),
        created_at: files::now_seconds(),
        model: body.model.clone(),
        training_file: training.id,
        validation_file: validation.map(|v| v.id),
        hyperparameters: JobHyperparameters {
            batch_size,
            learning_rate_multiplier: multiplier,
            n_epochs,
        },
        learning_rate,
        lora,
        seed,
        suffix: body.suffix.clone(),
        metadata: body.metadata.clone(),
        priority,
        hardware,
        job_id: String::new(),
        request_hash: request_hash(body),
        outcome: None,
        webhook_url,
        webhook: None,
        max_cost: body.max_cost,
        estimate,
    };
    Ok(Plan {
        record,
        spec,
        pools,
    })
}

/// The answer to a spec that does not validate: the first problem's field, every
/// problem in the message.
fn spec_problems(problems: &[tuneq_openapi::SpecError]) -> ApiError {
    let param = problems.first().map_or_else(String::new, |first| {
        first
            .field
            .replace("hyperparameters.epochs", "hyperparameters.n_epochs")
    });
    ApiError::invalid(
        &param,
        "invalid_value",
        problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
    )
}

fn request_hash(body: &FineTuneCreate) -> String {
    let canonical = serde_json::to_string(body).unwrap_or_default();
    hex::encode(Sha256::digest(canonical.as_bytes()))
}

/// The first of the tenant's jobs that has not finished and trains on `file` (so the
/// file must stay). Reads every job record of the tenant: deletes are rare.
pub(crate) async fn unfinished_job_using(
    state: &AppState,
    tenant: &str,
    file: &str,
) -> ApiResult<Option<String>> {
    let jobs: Vec<FineTuneRecord> = records::read_all(state, (KIND, tenant), "fine-tune").await?;
    Ok(jobs
        .into_iter()
        .find(|j| {
            j.outcome.is_none()
                && (j.training_file == file || j.validation_file.as_deref() == Some(file))
        })
        .map(|j| j.id))
}

/// The tenant's fine-tune `id`, from this process's copy when it has one (see
/// [`crate::cache`] for why a copy is safe to use).
async fn load(state: &AppState, tenant: &str, id: &str) -> ApiResult<Option<FineTuneRecord>> {
    if let Some(record) = state.finetunes.get(tenant, id) {
        return Ok(Some(FineTuneRecord::clone(&record)));
    }
    load_fresh(state, tenant, id).await
}

/// The tenant's fine-tune `id` as the catalog has it now.
async fn load_fresh(state: &AppState, tenant: &str, id: &str) -> ApiResult<Option<FineTuneRecord>> {
    if tuneq_queue::catalog::check_identifier("id", id).is_err() {
        return Ok(None);
    }
    let record: Option<FineTuneRecord> =
        records::read(state, (KIND, tenant), id, "fine-tune").await?;
    if let Some(record) = &record {
        state
            .finetunes
            .put(tenant, id, std::sync::Arc::new(record.clone()));
    }
    Ok(record)
}

async fn find(state: &AppState, tenant: &Tenant, id: &str) -> ApiResult<FineTuneRecord> {
    load(state, &tenant.0, id)
        .await?
        .ok_or_else(|| ApiError::not_found("fine-tuning job", id))
}

/// Creates a fine-tuning job. A request that can never run (unknown model, missing
/// file, hardware no pool offers, values out of range) is refused with 400 naming the
/// field, and nothing is created. With `Idempotency-Key`, a retried request returns the
/// job it created.
#[utoipa::path(post, path = "/v1/fine_tuning/jobs", tag = "fine-tuning", operation_id = "create_fine_tuning_job",
    params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retried create return the same job")),
    request_body = FineTuneCreate,
    responses(
        (status = 200, description = "The job, queued", body = FineTuneJob),
        (status = 400, description = "The request can never run; `param` names the field", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 429, description = "Too many jobs waiting", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(tenant = %tenant.0))]
pub(crate) async fn create(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    body: web::Json<FineTuneCreate>,
) -> ApiResult<HttpResponse> {
    let key = idempotency_key(&req)?;
    let id = match &key {
        Some(key) => idempotent_id(&tenant.0, key),
        None => new_id(),
    };
    // A retry of a request that was accepted answers with its job.
    if let Some(existing) = load(&state, &tenant.0, &id).await? {
        return same_request(&state, existing, &body).await;
    }
    let mut plan = plan(&state, &tenant, &id, &body).await?;
    let payload = serde_json::to_string(&JobPayload {
        finetune: id.clone(),
        spec: plan.spec,
    })
    .map_err(|e| ApiError::internal(e.to_string()))?;
    // The fine-tune id is the queue's idempotency key: a request that died between
    // enqueue and record, retried, finds the same queue job.
    let enqueued = state
        .queue
        .enqueue(&NewJob {
            tenant: tenant.0.clone(),
            priority: plan.record.priority,
            pools: plan.pools,
            gpus: 1,
            estimated_seconds: 0,
            max_attempts: MAX_ATTEMPTS,
            payload,
            idempotency_key: Some(id.clone()),
            notify: true,
        })
        .await
        .map_err(|e| match e {
            QueueError::OverQuota(_) => ApiError::too_many(
                "too_many_queued_jobs",
                "You have as many fine-tuning jobs waiting as your limit allows; try again once some have started.",
                QUEUED_RETRY_AFTER_S,
            ),
            other => other.into(),
        })?;
    plan.record.job_id = enqueued.id;
    let body_json =
        serde_json::to_string(&plan.record).map_err(|e| ApiError::internal(e.to_string()))?;
    if !state
        .queue
        .create_entry(KIND, &tenant.0, &id, &body_json)
        .await?
    {
        // A concurrent identical request won the race.
        let existing = find(&state, &tenant, &id).await?;
        return same_request(&state, existing, &body).await;
    }
    tracing::info!(finetune = %id, job = %plan.record.job_id, model = %plan.record.model, "fine-tune queued");
    Ok(HttpResponse::Ok().json(view(&state, plan.record).await?))
}

async fn same_request(
    state: &AppState,
    existing: FineTuneRecord,
    body: &FineTuneCreate,
) -> ApiResult<HttpResponse> {
    if existing.request_hash != request_hash(body) {
        return Err(ApiError::invalid(
            "Idempotency-Key",
            "idempotency_key_reused",
            "This Idempotency-Key was used for a different request; use a new key.",
        ));
    }
    Ok(HttpResponse::Ok().json(view(state, existing).await?))
}

fn ms_to_seconds(ms: u64) -> u64 {
    ms / 1000
}

/// The fine-tuned model's name, OpenAI-style.
fn fine_tuned_model_name(record: &FineTuneRecord) -> String {
    format!(
        "ft:{}:{}:{}:{}",
        record.model,
        record.tenant,
        record.suffix.as_deref().unwrap_or(""),
        record.id.trim_start_matches("ftjob-")
    )
}

fn progress_of(job: &JobRecord) -> Option<Progress> {
    job.progress
        .as_deref()
        .and_then(|p| serde_json::from_str(p).ok())
}

/// The outcome of a finished queue job.
fn outcome_of(job: &JobRecord) -> Outcome {
    let result: Option<AttemptResult> = job
        .result
        .as_deref()
        .and_then(|r| serde_json::from_str(r).ok());
    let error = (job.state == JobState::Failed).then(|| {
        let detail = job.error.as_deref().unwrap_or("The job failed.");
        // The full message stays in the operator's log; the tenant sees it without
        // server paths or store locations.
        tracing::info!(job = %job.id, error = detail, "job failed");
        JobError {
            code: failure_code(detail).into(),
            message: redact::paths(detail),
            param: None,
        }
    });
    Outcome {
        status: job.state.public_status().to_string(),
        finished_at: ms_to_seconds(job.finished_ms.unwrap_or(job.enqueued_ms)),
        error,
        trained_tokens: result.as_ref().map(|r| r.trained_tokens),
        adapter: result.map(|r| r.adapter),
        progress: progress_of(job),
        attempts: job.attempts,
        preemptions: job.preemptions,
    }
}

/// A stable code for how a job failed, from the dispatcher's account of its last
/// attempt: its input could not train (never retried), it diverged, or it failed
/// however many times it was tried.
fn failure_code(detail: &str) -> &'static str {
    if detail.contains("loss became") {
        "training_diverged"
    } else if detail.starts_with("invalid input:") {
        "invalid_training_input"
    } else {
        "training_failed"
    }
}

/// The job as clients see it: the catalog record, with live state from the queue.
async fn view(state: &AppState, record: FineTuneRecord) -> ApiResult<FineTuneJob> {
    let mut status = "queued".to_string();
    let mut progress = None;
    let mut queue = None;
    let mut attempts = 0;
    let mut preemptions = 0;
    let mut outcome = record.outcome.clone();
    if outcome.is_none() {
        // The job and, while it waits, where it stands: one call to the queue.
        match state.queue.status(&record.job_id, &record.tenant).await? {
            Some((job, _)) if job.state.is_terminal() => outcome = Some(outcome_of(&job)),
            Some((job, standing)) => {
                status = job.state.public_status().to_string();
                progress = progress_of(&job);
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
            None if let Some(filed) = load_fresh(state, &record.tenant, &record.id)
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
                        code: "job_lost".into(),
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
        .map(|eta| files::now_seconds() + eta.max(0.0) as u64);
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
        fine_tuned_model: adapter.is_some().then(|| fine_tuned_model_name(&record)),
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
        learning_rate: record.learning_rate,
        progress,
        queue,
        attempts,
        preemptions,
        estimate: record.estimate,
        webhook,
    })
}

/// Query of the job list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// The last id of the previous page.
    after: Option<String>,
    /// Page size, 1 to 100 (default 20).
    limit: Option<u32>,
    /// Only jobs with this status.
    status: Option<String>,
}

/// Lists the tenant's jobs, newest first; `status=` and `metadata[key]=value` filter.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs", tag = "fine-tuning", operation_id = "list_fine_tuning_jobs",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of jobs", body = FineTuneList),
        (status = 400, description = "Invalid query", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
    ))]
pub(crate) async fn list(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    query: web::Query<ListQuery>,
) -> ApiResult<HttpResponse> {
    let limit = check_range("limit", query.limit.unwrap_or(20), 1, 100)? as usize;
    const STATUSES: [&str; 6] = [
        "validating_files",
        "queued",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    ];
    if let Some(status) = &query.status
        && !STATUSES.contains(&status.as_str())
    {
        return Err(ApiError::invalid(
            "status",
            "invalid_value",
            format!("status must be one of {}.", STATUSES.join(", ")),
        ));
    }
    let metadata = metadata_filter(req.query_string());
    let mut after = query.after.clone();
    if let Some(a) = &after
        && load(&state, &tenant.0, a).await?.is_none()
    {
        return Err(ApiError::invalid(
            "after",
            "invalid_cursor",
            format!("`{a}` is not one of your fine-tuning jobs."),
        ));
    }
    // Filters are applied to pages read from the catalog until `limit` jobs match.
    let mut data = Vec::new();
    let mut has_more = false;
    'pages: loop {
        let page = state
            .queue
            .list_entries(KIND, &tenant.0, after.as_deref(), 100)
            .await?;
        for entry in &page.entries {
            let record: FineTuneRecord = records::parse(&entry.body, "fine-tune")?;
            let meta = record.metadata.clone().unwrap_or_default();
            if !metadata.iter().all(|(k, v)| meta.get(k) == Some(v)) {
                continue;
            }
            let job = view(&state, record).await?;
            if query.status.as_ref().is_some_and(|s| *s != job.status) {
                continue;
            }
            if data.len() == limit {
                has_more = true;
                break 'pages;
            }
            data.push(job);
        }
        if !page.has_more {
            break;
        }
        after = page.entries.last().map(|e| e.id.clone());
    }
    Ok(HttpResponse::Ok().json(FineTuneList {
        object: "list".into(),
        first_id: data.first().map(|j| j.id.clone()),
        last_id: data.last().map(|j| j.id.clone()),
        data,
        has_more,
    }))
}

/// `metadata[key]=value` pairs of a query string.
fn metadata_filter(query: &str) -> Vec<(String, String)> {
    web::Query::<Vec<(String, String)>>::from_query(query)
        .map(|q| q.into_inner())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("metadata[")
                .and_then(|rest| rest.strip_suffix(']'))
                .map(|key| (key.to_string(), v))
        })
        .collect()
}

/// A job: status, progress, queue standing, attempts, the adapter once succeeded.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}", tag = "fine-tuning", operation_id = "retrieve_fine_tuning_job",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "The job", body = FineTuneJob),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn retrieve(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let record = find(&state, &tenant, &id).await?;
    Ok(HttpResponse::Ok().json(view(&state, record).await?))
}

/// `POST /v1/fine_tuning/jobs/{id}/cancel`: a waiting job is cancelled at once; a
/// running one is asked to stop (it shows `running` until its attempt is gone). A
/// finished job is refused with 400 (not 409, which SDKs retry).
#[utoipa::path(post, path = "/v1/fine_tuning/jobs/{id}/cancel", tag = "fine-tuning", operation_id = "cancel_fine_tuning_job",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "The job, cancelled or being cancelled", body = FineTuneJob),
        (status = 400, description = "The job has already finished", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(tenant = %tenant.0, finetune = %id))]
pub(crate) async fn cancel(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let record = find(&state, &tenant, &id).await?;
    if let Some(outcome) = &record.outcome {
        return Err(already_finished(&outcome.status));
    }
    // The queue's cancel is repeatable (a finished job answers its state), so a job
    // that had already finished is told apart by reading it first.
    if let Some(job) = state.queue.get(&record.job_id).await?
        && job.state.is_terminal()
    {
        return Err(already_finished(job.state.public_status()));
    }
    state.queue.cancel(&record.job_id).await?;
    tracing::info!("fine-tune cancel requested");
    Ok(HttpResponse::Ok().json(view(&state, record).await?))
}

fn already_finished(status: &str) -> ApiError {
    ApiError::invalid(
        "id",
        "job_already_finished",
        format!("The job has already {status}; there is nothing to cancel."),
    )
}

/// Query of the checkpoints list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct PageQuery {
    /// The last id of the previous page.
    after: Option<String>,
    /// Page size, 1 to 100 (default 10).
    limit: Option<u32>,
}

/// Query of the events list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct EventsQuery {
    /// The last id of the previous page (with `stream`: stream what came after it).
    after: Option<String>,
    /// Page size, 1 to 1 000 (default 20).
    limit: Option<u32>,
    /// Stream the events as server-sent events, oldest first, until the job ends.
    stream: Option<bool>,
}

/// An event's id: the job's id and the event's place in its log.
fn event_id(finetune: &str, seq: u64) -> String {
    format!("ftevent-{}-{seq}", finetune.trim_start_matches("ftjob-"))
}

fn event_seq(finetune: &str, id: &str) -> ApiResult<u64> {
    let bad = || {
        ApiError::invalid(
            "after",
            "invalid_cursor",
            format!("`{id}` is not an event of this job."),
        )
    };
    let rest = id.strip_prefix("ftevent-").ok_or_else(bad)?;
    let (job, seq) = rest.rsplit_once('-').ok_or_else(bad)?;
    if job != finetune.trim_start_matches("ftjob-") {
        return Err(bad());
    }
    seq.parse().map_err(|_| bad())
}

/// The "leased" event's text: the pool, and why it was that one of the job's pools.
fn placed(record: &FineTuneRecord, pool: &str) -> String {
    let Some(estimate) = &record.estimate else {
        return format!("Placed on node pool {pool}");
    };
    let pools = estimate.pools.join(", ");
    match estimate.pools.iter().position(|p| p == pool) {
        Some(0) => format!(
            "Placed on node pool {pool}: the first of the job's pools ({pools}; spot first, then GPU, then price)"
        ),
        Some(_) => format!(
            "Placed on node pool {pool} of the job's pools ({pools}): those before it had no free slot or were given up on"
        ),
        None => format!("Placed on node pool {pool}"),
    }
}

/// The client's view of one queue event.
fn render_event(record: &FineTuneRecord, event: &tuneq_queue::JobEvent) -> FineTuneEvent {
    let mut level = "info";
    let mut kind = "message";
    let mut data = None;
    let message = match event.kind.as_str() {
        "queued" => format!("Created fine-tuning job: {}", record.id),
        "leased" => placed(record, &event.message),
        "started" => "Fine-tuning job started".into(),
        "training_started" => {
            data = serde_json::from_str(&event.message).ok();
            "Training started".into()
        }
        "metrics" => {
            kind = "metrics";
            let value: serde_json::Value = serde_json::from_str(&event.message).unwrap_or_default();
            let text = format!(
                "Step {}/{}: training loss={}",
                value["step"],
                value["total_steps"],
                value["train_loss"]
                    .as_f64()
                    .map_or("n/a".into(), |l| format!("{l:.4}"))
            );
            data = Some(value);
            text
        }
        "eval" => {
            kind = "metrics";
            let value: serde_json::Value = serde_json::from_str(&event.message).unwrap_or_default();
            let text = format!(
                "Step {}: validation loss={}",
                value["step"],
                value["valid_loss"]
                    .as_f64()
                    .map_or("n/a".into(), |l| format!("{l:.4}"))
            );
            data = Some(value);
            text
        }
        "checkpoint" | "resumed" => {
            let mut value: serde_json::Value =
                serde_json::from_str(&event.message).unwrap_or_default();
            if let Some(location) = value["location"].as_str() {
                value["location"] = redact::tenant_location(location, &record.tenant).into();
            }
            let text = if event.kind == "checkpoint" {
                format!("Checkpoint saved at step {}", value["step"])
            } else {
                format!("Resumed from the checkpoint at step {}", value["step"])
            };
            data = Some(value);
            text
        }
        "warning" => {
            level = "warn";
            redact::paths(&event.message)
        }
        "preempted" => {
            level = "warn";
            format!(
                "The attempt stopped ({}); the job resumes from its last checkpoint",
                redact::paths(&event.message)
            )
        }
        "unplaced" => {
            level = "warn";
            format!(
                "The attempt found no node ({}); the job is back in line",
                redact::paths(&event.message)
            )
        }
        "moved" => {
            level = "warn";
            format!("Moved on to other node pools: {}", event.message)
        }
        "lease_expired" => {
            level = "warn";
            "The attempt stopped reporting; checking whether it is alive".into()
        }
        "lease_recovered" | "adopted" => "The attempt is alive and continues".into(),
        "requeued" => {
            level = "warn";
            "The attempt was lost; the job is back in line".into()
        }
        "retry_scheduled" => {
            level = "warn";
            format!(
                "The attempt failed ({}); it will be retried",
                redact::paths(&event.message)
            )
        }
        "failed" => {
            level = "error";
            format!("The job failed: {}", redact::paths(&event.message))
        }
        "cancel_requested" => "Cancelling: stopping the running attempt".into(),
        "cancelled" => "The job was cancelled".into(),
        "succeeded" => "The job has successfully completed".into(),
        other => format!("{other}: {}", redact::paths(&event.message)),
    };
    FineTuneEvent {
        id: event_id(&record.id, event.seq),
        object: "fine_tuning.job.event".into(),
        created_at: ms_to_seconds(event.at_ms),
        level: level.into(),
        message,
        kind: kind.into(),
        data,
    }
}

/// The job's events, newest first; `after` = the last id seen. With `stream=true`,
/// server-sent events instead: every event oldest first (after `after` or
/// `Last-Event-ID`), then each new one as it happens, until the job has ended.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/events", tag = "fine-tuning", operation_id = "list_fine_tuning_events",
    params(("id" = String, Path, description = "`ftjob-…`"), EventsQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "With `stream`: resume after this event")),
    responses(
        (status = 200, description = "A page of events, or (with `stream`) server-sent events: \
`event` is the type, `id` the event's id, `data` the event object; a last `done` event carries the job", content(
            (FineTuneEventList = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 400, description = "Invalid query", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn events(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    id: web::Path<String>,
    query: web::Query<EventsQuery>,
) -> ApiResult<HttpResponse> {
    let record = find(&state, &tenant, &id).await?;
    let limit = check_range("limit", query.limit.unwrap_or(20), 1, 1000)? as usize;
    let last_event_id = req
        .headers()
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let after = match query.after.as_ref().or(last_event_id.as_ref()) {
        Some(a) => Some(event_seq(&record.id, a)?),
        None => None,
    };
    if query.stream == Some(true) {
        return Ok(stream_events(state.into_inner(), record, after));
    }
    let mut events = state
        .queue
        .events(&record.job_id, after, limit + 1, true)
        .await?;
    let has_more = events.len() > limit;
    events.truncate(limit);
    Ok(HttpResponse::Ok().json(FineTuneEventList {
        object: "list".into(),
        data: events.iter().map(|e| render_event(&record, e)).collect(),
        has_more,
    }))
}

/// How often a stream looks for new events.
const STREAM_POLL: std::time::Duration = std::time::Duration::from_millis(500);
/// A comment line this often keeps proxies from closing a quiet stream.
const STREAM_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// One server-sent event.
fn sse(event: &str, id: Option<&str>, data: &str) -> bytes::Bytes {
    let mut text = String::new();
    if let Some(id) = id {
        text.push_str(&format!("id: {id}\n"));
    }
    text.push_str(&format!("event: {event}\ndata: {data}\n\n"));
    bytes::Bytes::from(text)
}

/// Server-sent events of a job: what it logged after `after`, then new events as they
/// come, until it has ended (a last `done` event carries the job).
fn stream_events(
    state: std::sync::Arc<AppState>,
    record: FineTuneRecord,
    after: Option<u64>,
) -> HttpResponse {
    struct Cursor {
        state: std::sync::Arc<AppState>,
        record: FineTuneRecord,
        last: Option<u64>,
        pending: std::collections::VecDeque<bytes::Bytes>,
        quiet_since: std::time::Instant,
        done: bool,
    }
    let cursor = Cursor {
        state,
        record,
        last: after,
        pending: Default::default(),
        quiet_since: std::time::Instant::now(),
        done: false,
    };
    let stream = futures::stream::unfold(cursor, |mut c| async move {
        loop {
            if let Some(chunk) = c.pending.pop_front() {
                return Some((Ok::<_, actix_web::Error>(chunk), c));
            }
            if c.done {
                return None;
            }
            let ended = match c.state.queue.get(&c.record.job_id).await {
                Ok(job) => job.is_none_or(|j| j.state.is_terminal()),
                Err(e) => {
                    tracing::warn!(error = %e, "event stream: job store unavailable");
                    false
                }
            };
            match c
                .state
                .queue
                .events(&c.record.job_id, c.last, 1000, false)
                .await
            {
                Ok(events) if !events.is_empty() => {
                    for e in &events {
                        let rendered = render_event(&c.record, e);
                        let data = serde_json::to_string(&rendered).unwrap_or_default();
                        c.pending
                            .push_back(sse(&rendered.kind, Some(&rendered.id), &data));
                        c.last = Some(e.seq);
                    }
                    c.quiet_since = std::time::Instant::now();
                    continue;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "event stream: cannot read events"),
            }
            if ended {
                let job = match view(&c.state, c.record.clone()).await {
                    Ok(job) => serde_json::to_string(&job).unwrap_or_default(),
                    Err(_) => "{}".into(),
                };
                c.pending.push_back(sse("done", None, &job));
                c.done = true;
                continue;
            }
            if c.quiet_since.elapsed() >= STREAM_KEEPALIVE {
                c.quiet_since = std::time::Instant::now();
                return Some((Ok(bytes::Bytes::from_static(b": keep-alive\n\n")), c));
            }
            tokio::time::sleep(STREAM_POLL).await;
        }
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((actix_web::http::header::CACHE_CONTROL, "no-cache"))
        .insert_header(("x-accel-buffering", "no"))
        .streaming(stream)
}

/// The job's checkpoints, newest first.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/checkpoints", tag = "fine-tuning", operation_id = "list_fine_tuning_checkpoints",
    params(("id" = String, Path, description = "`ftjob-…`"), PageQuery),
    responses(
        (status = 200, description = "A page of checkpoints", body = FineTuneCheckpointList),
        (status = 400, description = "Invalid query", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn checkpoints(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
    query: web::Query<PageQuery>,
) -> ApiResult<HttpResponse> {
    let record = find(&state, &tenant, &id).await?;
    let limit = check_range("limit", query.limit.unwrap_or(10), 1, 100)? as usize;
    let events = state
        .queue
        .events(&record.job_id, None, 10_000, true)
        .await?;
    let mut last_loss = None;
    let mut all = Vec::new();
    // Oldest first, to know each checkpoint's latest losses.
    let mut valid_loss = None;
    for event in events.iter().rev() {
        let value: serde_json::Value = serde_json::from_str(&event.message).unwrap_or_default();
        match event.kind.as_str() {
            "metrics" => last_loss = value["train_loss"].as_f64(),
            "eval" => valid_loss = value["valid_loss"].as_f64(),
            "checkpoint" => {
                let step = value["step"].as_u64().unwrap_or_default();
                all.push(FineTuneCheckpoint {
                    id: format!("ftckpt-{}-{step}", record.id.trim_start_matches("ftjob-")),
                    object: "fine_tuning.job.checkpoint".into(),
                    created_at: ms_to_seconds(event.at_ms),
                    fine_tuned_model_checkpoint: format!(
                        "{}:ckpt-step-{step}",
                        fine_tuned_model_name(&record)
                    ),
                    fine_tuning_job_id: record.id.clone(),
                    step_number: step,
                    metrics: CheckpointMetrics {
                        step,
                        train_loss: last_loss,
                        valid_loss,
                    },
                    location: redact::tenant_location(
                        value["location"].as_str().unwrap_or_default(),
                        &record.tenant,
                    ),
                });
            }
            _ => {}
        }
    }
    all.reverse();
    let start = match &query.after {
        Some(a) => {
            all.iter().position(|c| &c.id == a).ok_or_else(|| {
                ApiError::invalid(
                    "after",
                    "invalid_cursor",
                    format!("`{a}` is not a checkpoint of this job."),
                )
            })? + 1
        }
        None => 0,
    };
    let page: Vec<_> = all.iter().skip(start).take(limit).cloned().collect();
    Ok(HttpResponse::Ok().json(FineTuneCheckpointList {
        object: "list".into(),
        has_more: start + page.len() < all.len(),
        first_id: page.first().map(|c| c.id.clone()),
        last_id: page.last().map(|c| c.id.clone()),
        data: page,
    }))
}

/// The PEFT files an adapter download holds.
const ADAPTER_FILES: [&str; 2] = ["adapter_config.json", "adapter_model.safetensors"];

/// The trained PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`) as a
/// tar archive.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/adapter", tag = "fine-tuning", operation_id = "download_adapter",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "The adapter", content_type = "application/x-tar", body = inline(tuneq_openapi::Binary)),
        (status = 400, description = "The job has not succeeded", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn adapter(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    use futures::TryStreamExt;
    let (record, output) = adapter_prefix(&state, &tenant, &id).await?;
    let mut entries = Vec::new();
    for name in ADAPTER_FILES {
        let key = output
            .join(name)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let object = state.store.get(&key, None).await?;
        entries.push(crate::tar::Entry {
            name: name.to_string(),
            size: object.meta.size,
            body: object.body.map_err(|e| {
                tracing::warn!(error = %e, "adapter download broke off");
                actix_web::error::ErrorInternalServerError("download broke off")
            }),
        });
    }
    let (size, archive) = crate::tar::stream(entries).map_err(ApiError::internal)?;
    Ok(HttpResponse::Ok()
        .content_type("application/x-tar")
        .no_chunking(size)
        .insert_header((
            actix_web::http::header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{}-adapter.tar\"", record.id),
        ))
        .streaming(archive))
}

/// Where a succeeded job's adapter is stored; a job that has not succeeded is refused.
async fn adapter_prefix(
    state: &AppState,
    tenant: &Tenant,
    id: &str,
) -> ApiResult<(FineTuneRecord, tuneq_storage::ObjectKey)> {
    let record = find(state, tenant, id).await?;
    let job = view(state, record.clone()).await?;
    if job.adapter.is_none() {
        return Err(ApiError::invalid(
            "id",
            "adapter_not_ready",
            format!(
                "The job is {}; its adapter exists once it has succeeded.",
                job.status
            ),
        ));
    }
    let tenant_id = Id::parse(&tenant.0).map_err(|_| ApiError::internal("tenant id"))?;
    let job_key = Id::parse(&record.id).map_err(|_| ApiError::internal("job id"))?;
    Ok((record, layout::job_output(&tenant_id, &job_key)))
}

/// How long presigned adapter URLs work.
const ADAPTER_URLS_VALID: std::time::Duration = std::time::Duration::from_secs(3600);

/// Presigned download URLs of the adapter's PEFT files, valid for an hour: for clients
/// that fetch straight from the object store (S3, GCS). A store that cannot presign
/// (a local folder) answers 400 `presign_unsupported`; the tar download works there.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/adapter/urls", tag = "fine-tuning", operation_id = "adapter_urls",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "One URL per file", body = AdapterUrls),
        (status = 400, description = "The job has not succeeded, or the store cannot presign", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn adapter_urls(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let (_, output) = adapter_prefix(&state, &tenant, &id).await?;
    let mut data = Vec::new();
    let mut expires_at = u64::MAX;
    for name in ADAPTER_FILES {
        let key = output
            .join(name)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let signed = match state
            .store
            .presign(&key, tuneq_storage::PresignMethod::Get, ADAPTER_URLS_VALID)
            .await
        {
            Ok(signed) => signed,
            Err(tuneq_storage::Error::Unsupported { .. }) => {
                return Err(ApiError::invalid(
                    "id",
                    "presign_unsupported",
                    format!(
                        "This server's object store cannot presign URLs; download the adapter as a tar at /v1/fine_tuning/jobs/{}/adapter.",
                        id.as_str()
                    ),
                ));
            }
            Err(e) => return Err(e.into()),
        };
        let expires = signed
            .expires_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        expires_at = expires_at.min(expires);
        data.push(AdapterFileUrl {
            name: name.to_string(),
            url: signed.url,
        });
    }
    Ok(HttpResponse::Ok().json(AdapterUrls {
        object: "list".into(),
        data,
        expires_at,
    }))
}

/// The tenant's fine-tuned models (jobs that succeeded), newest first.
pub(crate) async fn fine_tuned_models(state: &AppState, tenant: &str) -> ApiResult<Vec<Model>> {
    let mut models = Vec::new();
    for record in records::read_all::<FineTuneRecord>(state, (KIND, tenant), "fine-tune").await? {
        // A job that has just finished may not have its outcome filed yet.
        let outcome = match record.outcome.clone() {
            Some(o) => Some(o),
            None => state
                .queue
                .get(&record.job_id)
                .await?
                .filter(|job| job.state.is_terminal())
                .map(|job| outcome_of(&job)),
        };
        if let Some(outcome) = outcome.filter(|o| o.status == "succeeded") {
            models.push(Model {
                id: fine_tuned_model_name(&record),
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

/// Files the outcome of finished jobs in their fine-tune records (the queue's outbox
/// lists each finished job until this acknowledges it), so a record outlives the queue's
/// retention, and sends the webhooks asked for (see [`crate::webhooks`]): a delivery that
/// fails stays in the outbox until its next try is due. Returns how many were handled.
pub async fn settle(state: &AppState, batch: u32) -> ApiResult<usize> {
    use futures::StreamExt;
    let due = state.queue.due_deliveries(batch).await?;
    let handled = due.len();
    // Concurrently: one slow receiver must not hold up the others' events.
    futures::stream::iter(due)
        .for_each_concurrent(16, |delivery| async move {
            if let Err(e) = settle_one(state, &delivery).await {
                tracing::warn!(job = %delivery.job_id, error = %e.detail.message, "cannot settle a finished job; retrying");
            }
        })
        .await;
    Ok(handled)
}

/// Settles one finished job: its outcome filed, then its webhook tried.
async fn settle_one(state: &AppState, delivery: &tuneq_queue::Delivery) -> ApiResult<()> {
    let Some(job) = state.queue.get(&delivery.job_id).await? else {
        tracing::warn!(job = %delivery.job_id, "a finished job was trimmed before its outcome was filed");
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    let Ok(payload) = serde_json::from_str::<JobPayload>(&job.payload) else {
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    let Some(mut record) = load_fresh(state, &delivery.tenant, &payload.finetune).await? else {
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    if record.outcome.is_none() {
        record.outcome = Some(outcome_of(&job));
        save(state, &record).await?;
        tracing::info!(finetune = %record.id, status = %delivery.state, "fine-tune finished");
    }
    let pending = record.webhook_url.is_some()
        && record
            .webhook
            .as_ref()
            .is_none_or(|w| w.status == "retrying");
    if !pending {
        return Ok(state.queue.ack_delivery(delivery).await?);
    }
    let (Some(url), Some(outcome)) = (record.webhook_url.clone(), record.outcome.as_ref()) else {
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    let event = WebhookEvent {
        id: webhook_event_id(&record.id, &outcome.status),
        object: "event".into(),
        created_at: outcome.finished_at,
        kind: format!("fine_tuning.job.{}", outcome.status),
        data: WebhookEventData {
            id: record.id.clone(),
        },
    };
    let secrets = webhooks::tenant_secrets(state, &record.tenant).await?;
    let result = webhooks::deliver(&state.config.webhooks, &url, &secrets, &event).await;
    let progress = record.webhook.get_or_insert_with(WebhookProgress::default);
    progress.attempts += 1;
    let retry_in = match result {
        Delivery::Delivered => {
            progress.status = "delivered".into();
            progress.delivered_at = Some(files::now_seconds());
            progress.last_error = None;
            None
        }
        Delivery::Retry(reason) => match webhooks::retry_delay(progress.attempts) {
            Some(delay) => {
                progress.status = "retrying".into();
                progress.last_error = Some(reason);
                Some(delay)
            }
            None => {
                progress.status = "failed".into();
                progress.last_error = Some(reason);
                None
            }
        },
        Delivery::GiveUp(reason) => {
            progress.status = "failed".into();
            progress.last_error = Some(reason);
            None
        }
    };
    tracing::info!(
        finetune = %record.id,
        event = %event.id,
        attempt = progress.attempts,
        status = %progress.status,
        error = progress.last_error.as_deref().unwrap_or(""),
        "webhook"
    );
    save(state, &record).await?;
    match retry_in {
        Some(delay) => {
            let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
            Ok(state.queue.retry_delivery(delivery, ms).await?)
        }
        None => Ok(state.queue.ack_delivery(delivery).await?),
    }
}

/// The event id of a job reaching `status`: the same on every try.
fn webhook_event_id(finetune: &str, status: &str) -> String {
    let digest = Sha256::digest(format!("{finetune}|{status}").as_bytes());
    format!("evt_{}", &hex::encode(digest)[..24])
}

/// Writes `record` back to the catalog (and this process's copy).
async fn save(state: &AppState, record: &FineTuneRecord) -> ApiResult<()> {
    let body = serde_json::to_string(record).map_err(|e| ApiError::internal(e.to_string()))?;
    state
        .queue
        .update_entry(KIND, &record.tenant, &record.id, &body)
        .await?;
    state.finetunes.put(
        &record.tenant,
        &record.id,
        std::sync::Arc::new(record.clone()),
    );
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn auto_epochs_follow_openais_rule() {
        assert_eq!(auto_epochs(10), 10);
        assert_eq!(auto_epochs(1), 25);
        assert_eq!(auto_epochs(50), 3);
        assert_eq!(auto_epochs(1_000), 3);
        assert_eq!(auto_epochs(10_000), 2);
        assert_eq!(auto_epochs(100_000), 1);
    }

    #[test]
    fn event_cursors_round_trip_and_refuse_other_jobs() {
        let id = event_id("ftjob-abc", 7);
        assert_eq!(event_seq("ftjob-abc", &id).unwrap(), 7);
        assert!(event_seq("ftjob-abd", &id).is_err());
        assert!(event_seq("ftjob-abc", "ftevent-abc-x").is_err());
        assert!(event_seq("ftjob-abc", "nonsense").is_err());
    }

    #[test]
    fn idempotency_keys_map_to_one_id_per_tenant() {
        assert_eq!(idempotent_id("a", "k"), idempotent_id("a", "k"));
        assert_ne!(idempotent_id("a", "k"), idempotent_id("b", "k"));
        assert!(Id::parse(&idempotent_id("a", "k")).is_ok());
    }
}
