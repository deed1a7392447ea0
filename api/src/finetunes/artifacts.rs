//! What a job leaves behind: its checkpoints (from the event log) and the trained
//! adapter, as a tar download or as presigned URLs; and their deletion with the
//! fine-tuned model.

use super::range::check_range;
use super::view::view;
use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::holds::{self, HoldKind};
use crate::owned::Own;
use crate::records;
use crate::records::finetune::{FineTuneRecord, ms_to_seconds};
use crate::redact;
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use futures::TryStreamExt;
use serde::Deserialize;
use tuneq_openapi::{
    AdapterFileUrl, AdapterUrls, CheckpointMetrics, ErrorBody, FineTuneCheckpoint,
    FineTuneCheckpointList, LogEntry,
};
use tuneq_queue::JobQueue;
use tuneq_storage::layout::{self, Id};

/// Query of the checkpoints list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct PageQuery {
    /// The last id of the previous page.
    after: Option<String>,
    /// Page size, 1 to 100 (default 10).
    limit: Option<u32>,
}

/// The job's checkpoints, newest first.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/checkpoints", tag = "fine-tuning", operation_id = "list_fine_tuning_checkpoints",
    params(("id" = String, Path, description = "`ftjob-…`"), PageQuery),
    responses(
        (status = 200, description = "A page of checkpoints", body = FineTuneCheckpointList),
        (status = 400, description = "Invalid query", body = ErrorBody),
        Own<FineTuneRecord>,
    ))]
pub(crate) async fn checkpoints(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
    query: web::Query<PageQuery>,
) -> ApiResult<HttpResponse> {
    let record = state.finetunes().find(&tenant.0, &id).await?;
    let limit = check_range("limit", query.limit.unwrap_or(10), 1, 100)? as usize;
    if records::model::deleted_at(&state.queue, &tenant.0, &record.id)
        .await?
        .is_some()
    {
        // Deleted with the fine-tuned model.
        return Ok(HttpResponse::Ok().json(FineTuneCheckpointList {
            object: "list".into(),
            data: Vec::new(),
            has_more: false,
            first_id: None,
            last_id: None,
        }));
    }
    let events = state
        .queue
        .events(&record.job_id, None, 10_000, true)
        .await?;
    let mut last_loss = None;
    let mut all = Vec::new();
    // Oldest first, to know each checkpoint's latest losses.
    let mut valid_loss = None;
    for event in events.iter().rev() {
        match super::events::log_entry(event) {
            Some(LogEntry::Metrics { train_loss, .. }) => last_loss = train_loss,
            Some(LogEntry::Eval { valid_loss: v, .. }) => valid_loss = v,
            Some(LogEntry::Checkpoint { step, location }) => {
                all.push(FineTuneCheckpoint {
                    id: format!("ftckpt-{}-{step}", record.id.trim_start_matches("ftjob-")),
                    object: "fine_tuning.job.checkpoint".into(),
                    created_at: ms_to_seconds(event.at_ms),
                    fine_tuned_model_checkpoint: format!(
                        "{}{}{step}",
                        record.fine_tuned_model_name(),
                        crate::records::finetune::CHECKPOINT_STEP
                    ),
                    fine_tuning_job_id: record.id.clone(),
                    step_number: step,
                    metrics: CheckpointMetrics {
                        step,
                        train_loss: last_loss,
                        valid_loss,
                    },
                    location: redact::tenant_location(&location, &record.tenant),
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
                    Code::InvalidCursor,
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

use tuneq_storage::layout::ADAPTER_FILES;

/// The trained PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`) as a
/// tar archive. A tenant holds a bounded number of downloads at once (8 by default).
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/adapter", tag = "fine-tuning", operation_id = "download_adapter",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "The adapter", content_type = "application/x-tar", body = inline(tuneq_openapi::Binary)),
        (status = 400, description = "The job has not succeeded", body = ErrorBody),
        (status = 410, description = "The fine-tuned model was deleted, and its adapter with it (`object_gone`)", body = ErrorBody),
        Own<FineTuneRecord>,
        (status = 429, description = "The tenant (or the server) has as many downloads in progress as it may \
(`too_many_downloads`); retry after `retry-after`", body = ErrorBody),
    ))]
pub(crate) async fn adapter(
    state: web::Data<AppState>,
    job: Own<FineTuneRecord>,
) -> ApiResult<HttpResponse> {
    use futures::TryStreamExt;
    let tenant = job.tenant.0.clone();
    let (record, output) = adapter_prefix(&state, job).await?;
    // Held until the body is dropped: a client that reads slowly keeps its connection.
    let hold = match state.holds.take(&tenant, HoldKind::Download) {
        Ok(hold) => hold,
        Err(refused) => return Ok(holds::refusal(&refused)),
    };
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
        .streaming(holds::holding(hold, archive)))
}

/// Where a succeeded job's adapter is stored; a job that has not succeeded is refused.
async fn adapter_prefix(
    state: &AppState,
    job: Own<FineTuneRecord>,
) -> ApiResult<(FineTuneRecord, tuneq_storage::ObjectKey)> {
    let (tenant, record) = (job.tenant, job.object);
    let job = view(state, record.clone()).await?;
    if let Some(at) = job.model_deleted_at {
        return Err(ApiError::new(
            Code::ObjectGone,
            format!(
                "The fine-tuned model of {} was deleted (at {at}); its adapter is gone.",
                record.id
            ),
        ));
    }
    if job.adapter.is_none() {
        return Err(ApiError::invalid(
            "id",
            Code::AdapterNotReady,
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

/// Deletes the tenant's fine-tuned model `name` (`ft:…`), unless an unfinished job
/// continues from it (400 `model_in_use`): it is marked deleted first,
/// so it leaves `/v1/models` at once, then its job's output (adapter and checkpoints)
/// is removed from the store; the job stays, showing `model_deleted_at`. A model that
/// is not the tenant's, or is deleted already, is a 404 (a repeat still removes what a
/// broken-off deletion left).
pub(crate) async fn delete_model(state: &AppState, tenant: &str, name: &str) -> ApiResult<()> {
    let not_found = || ApiError::not_found("model", name);
    let all = state.finetunes().all(tenant).await?;
    let record = all
        .iter()
        .find(|r| r.fine_tuned_model_name() == name)
        .cloned()
        .ok_or_else(not_found)?;
    if let Some(child) = all
        .iter()
        .find(|r| r.outcome.is_none() && r.parent.as_ref().is_some_and(|p| p.job == record.id))
    {
        return Err(ApiError::invalid(
            "model",
            Code::ModelInUse,
            format!(
                "{} continues from this model; delete it once that job has finished (or cancel it).",
                child.id
            ),
        ));
    }
    let job = view(state, record.clone()).await?;
    let already = job.model_deleted_at.is_some();
    if !already && job.status != tuneq_openapi::JobStatus::Succeeded {
        return Err(not_found());
    }
    records::model::mark_deleted(&state.queue, tenant, &record.id, records::now_seconds()).await?;
    let tenant_id = Id::parse(tenant).map_err(|_| ApiError::internal("tenant id"))?;
    let job_key = Id::parse(&record.id).map_err(|_| ApiError::internal("job id"))?;
    let output = layout::job_output(&tenant_id, &job_key);
    let keys: Vec<_> = state
        .store
        .list(&output)
        .map_ok(|meta| meta.key)
        .try_collect()
        .await?;
    for key in &keys {
        state.store.delete(key).await?;
    }
    tracing::info!(tenant = %tenant, finetune = %record.id, objects = keys.len(), "fine-tuned model deleted");
    if already {
        return Err(not_found());
    }
    Ok(())
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
        (status = 410, description = "The fine-tuned model was deleted, and its adapter with it (`object_gone`)", body = ErrorBody),
        Own<FineTuneRecord>,
    ))]
pub(crate) async fn adapter_urls(
    state: web::Data<AppState>,
    job: Own<FineTuneRecord>,
) -> ApiResult<HttpResponse> {
    let id = job.id.clone();
    let (_, output) = adapter_prefix(&state, job).await?;
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
                    Code::PresignUnsupported,
                    format!(
                        "This server's object store cannot presign URLs; download the adapter as a tar at /v1/fine_tuning/jobs/{id}/adapter."
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
