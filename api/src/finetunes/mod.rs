//! Fine-tuning jobs: create, list, retrieve, cancel, pause, resume, events, checkpoints
//! and the adapter
//! — at `/v1/fine_tuning/jobs…` (OpenAI's shapes) and `/finetunes…` (the same handlers).
//!
//! A fine-tune is two records. The catalog keeps what was asked (and, once the job has
//! finished, its outcome, because the queue trims finished jobs: see
//! [`crate::records::finetune`]); the queue job is the source of truth for where the job
//! is. Its payload is the complete [`TrainSpec`](tuneq_openapi::TrainSpec), so a
//! dispatcher needs nothing else to run it. A request that can never run (unknown
//! model, missing file, no pool with the hardware, values out of range) is refused
//! before anything is written.
//!
//! - this module: the create, list and retrieve handlers.
//! - `control`: what a tenant does to a job once created: cancel, pause, resume.
//! - `plan`: a create request → the record and the [`TrainSpec`](tuneq_openapi::TrainSpec)
//!   to queue, or the 400 that says why it can never run.
//! - `view`: the job as clients see it (the record with the queue's live state).
//! - `events`: the job's event log as pages and as server-sent events.
//! - `artifacts`: checkpoints and the trained adapter (tar download, presigned URLs), and
//!   their deletion with the fine-tuned model.
//! - `range`: a number a request gives, within its bounds or refused naming the field.
//!
//! The settle loop that files outcomes and sends webhooks lives with the webhooks.

pub(crate) mod artifacts;
mod control;
pub(crate) mod events;
pub(crate) mod integrations;
mod plan;
mod range;
pub(crate) mod results;
pub(crate) mod tuned;
mod view;

// The handlers, with their OpenAPI declarations, for `crate::routes`.
pub(crate) use artifacts::{
    __path_adapter, __path_adapter_urls, __path_checkpoints, adapter, adapter_urls, checkpoints,
    delete_model,
};
pub(crate) use control::{__path_cancel, __path_pause, __path_resume, cancel, pause, resume};
pub(crate) use events::{__path_events, events};
pub(crate) use view::fine_tuned_models;

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::owned::{Own, Owned};
use crate::records::finetune::FineTuneRecord;
use crate::refusals::Unauthenticated;
use crate::state::AppState;
use actix_web::{HttpRequest, HttpResponse, web};
use plan::{plan, request_hash};
use range::check_range;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tuneq_openapi::{ErrorBody, FineTuneCreate, FineTuneJob, FineTuneList, JobPayload, JobStatus};
use tuneq_queue::{JobQueue, NewJob, QueueError};
use view::view;

/// Attempts before a job fails for good (preemptions do not count).
const MAX_ATTEMPTS: u32 = 3;
/// `retry-after` of a create refused for the tenant's queued-jobs limit.
const QUEUED_RETRY_AFTER_S: u64 = 30;

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
        // Printable ASCII only: `to_str` lets a tab through, and a key is compared
        // byte for byte, so a look-alike with a control character is another key.
        .filter(|k| {
            !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| (b' '..=b'~').contains(&b))
        })
        .ok_or_else(|| {
            ApiError::invalid(
                "Idempotency-Key",
                Code::InvalidValue,
                "Idempotency-Key must be 1 to 255 printable ASCII characters (no tabs or other control characters).",
            )
        })?;
    Ok(Some(key.to_string()))
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
        Unauthenticated,
        (status = 429, description = "Too many jobs waiting", body = ErrorBody),
    ))]
#[tracing::instrument(skip_all, fields(tenant = %tenant.0))]
pub(crate) async fn create(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    body: crate::body::JsonBody<FineTuneCreate>,
) -> ApiResult<HttpResponse> {
    let key = idempotency_key(&req)?;
    let id = match &key {
        Some(key) => idempotent_id(&tenant.0, key),
        None => new_id(),
    };
    // A retry of a request that was accepted answers with its job.
    if let Some(existing) = state.finetunes().get(&tenant.0, &id).await? {
        return same_request(&state, existing, &body).await;
    }
    let mut plan = plan(&state, &tenant, &id, &body).await?;
    plan.record.integrations = integrations::open_runs(&state, &plan.runs, &plan.record).await?;
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
                Code::TooManyQueuedJobs,
                "You have as many fine-tuning jobs waiting as your limit allows; try again once some have started.",
                QUEUED_RETRY_AFTER_S,
            ),
            other => other.into(),
        })?;
    plan.record.job_id = enqueued.id;
    if !state.finetunes().create(&plan.record).await? {
        // A concurrent identical request won the race.
        let existing = state.finetunes().find(&tenant.0, &id).await?;
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
            Code::IdempotencyKeyReused,
            "This Idempotency-Key was used for a different request; use a new key.",
        ));
    }
    Ok(HttpResponse::Ok().json(view(state, existing).await?))
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
        Unauthenticated,
    ))]
pub(crate) async fn list(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    query: web::Query<ListQuery>,
) -> ApiResult<HttpResponse> {
    let limit = check_range("limit", query.limit.unwrap_or(20), 1, 100)? as usize;
    let wanted = match query.status.as_deref() {
        None => None,
        Some(name) => Some(JobStatus::parse(name).ok_or_else(|| {
            let names: Vec<&str> = JobStatus::ALL.iter().map(|s| s.as_str()).collect();
            ApiError::invalid(
                "status",
                Code::InvalidValue,
                format!("status must be one of {}.", names.join(", ")),
            )
        })?),
    };
    let metadata = metadata_filter(req.query_string());
    let mut after = query.after.clone();
    if let Some(a) = &after
        && state.finetunes().get(&tenant.0, a).await?.is_none()
    {
        return Err(ApiError::invalid(
            "after",
            Code::InvalidCursor,
            format!("`{a}` is not one of your fine-tuning jobs."),
        ));
    }
    // Filters are applied to pages read from the catalog until `limit` jobs match.
    let mut data = Vec::new();
    let mut has_more = false;
    'pages: loop {
        let page = state
            .finetunes()
            .page(&tenant.0, after.as_deref(), 100)
            .await?;
        for record in page.records {
            let meta = record.metadata.clone().unwrap_or_default();
            if !metadata.iter().all(|(k, v)| meta.get(k) == Some(v)) {
                continue;
            }
            let job = view(&state, record).await?;
            if wanted.is_some_and(|s| s != job.status) {
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
        after = page.last_id;
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
        Own<FineTuneRecord>,
    ))]
pub(crate) async fn retrieve(
    state: web::Data<AppState>,
    job: Own<FineTuneRecord>,
) -> ApiResult<HttpResponse> {
    Ok(HttpResponse::Ok().json(view(&state, job.object).await?))
}

impl Owned for FineTuneRecord {
    const NOT_FOUND: &'static str = "No such job for this tenant";

    async fn find(state: &AppState, tenant: &str, id: &str) -> ApiResult<Self> {
        state.finetunes().find(tenant, id).await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tuneq_storage::layout::Id;

    #[test]
    fn idempotency_keys_map_to_one_id_per_tenant() {
        assert_eq!(idempotent_id("a", "k"), idempotent_id("a", "k"));
        assert_ne!(idempotent_id("a", "k"), idempotent_id("b", "k"));
        assert!(Id::parse(&idempotent_id("a", "k")).is_ok());
    }
}
