//! Datasets: upload (multipart, as OpenAI's SDKs send it, or a raw body), list,
//! retrieve, download, delete — `/v1/files…` and the same handlers at `/files…`.
//!
//! An upload is spooled to disk (bounded by the size limit), validated with the
//! trainer's own rules (`tuneq-dataset`), and refused with every bad line listed if any
//! line is wrong; nothing is stored then. A valid file goes to
//! `tenants/<tenant>/files/<file>/content.jsonl` and its record to the catalog. Keys
//! are built from checked ids only; the client's filename is display text.
//!
//! - `spool`: receiving the body into a private spool file, and the upload slots.
//! - `check`: validating the spooled file as a stream, with token statistics.
//! - `cpu`: the cores validation takes: one per core, a tenant's share, cancellation.

mod check;
mod cpu;
mod spool;

pub use check::template_work;
pub use cpu::{tenant_share, validations};
pub use spool::clean_spool;

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::holds::{self, HoldKind};
use crate::owned::{Own, Owned};
use crate::records;
use crate::refusals::Unauthenticated;
use crate::state::AppState;
use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, web};
use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;
use tuneq_openapi::ChatTemplateChoice;
use tuneq_openapi::ErrorBody;
use tuneq_openapi::{Deleted, FileList, FileObject, FilePurpose};
use tuneq_storage::PutMode;

use check::validate;
use spool::{broke_off, field_broke_off, spool};

/// The purpose an upload has (a job's result file is written by the job).
const PURPOSE: &str = "fine-tune";

fn new_file_id() -> String {
    format!("file-{}", hex::encode(rand::random::<[u8; 12]>()))
}

/// A display name: no control characters and no bidi controls (which make
/// `evil\u{202E}lmth.exe` read as `evilexe.html`), at most 255 bytes.
fn clean_filename(name: &str) -> String {
    let mut cleaned: String = name
        .chars()
        .filter(|&c| !c.is_control() && !crate::quote::is_bidi_control(c))
        .collect();
    while cleaned.len() > 255 {
        cleaned.pop();
    }
    if cleaned.trim().is_empty() {
        "upload.jsonl".into()
    } else {
        cleaned
    }
}

/// Query of a raw-body upload (`POST /files?filename=train.jsonl`).
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct RawUpload {
    /// The file's name (raw-body uploads only; display text).
    filename: Option<String>,
    /// `fine-tune` (raw-body uploads only).
    purpose: Option<String>,
    /// The base model whose tokenizer counts the tokens (raw-body uploads; a form takes
    /// it as the `model` field). Default: the first registered model with local files.
    model: Option<String>,
}

/// A raw-body upload: the JSONL bytes themselves.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)]
pub(crate) struct RawDataset(Vec<u8>);

/// The multipart form of an upload, as OpenAI's SDKs send it.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub(crate) struct UploadForm {
    /// The JSONL dataset.
    #[schema(value_type = String, format = Binary)]
    file: Vec<u8>,
    /// `fine-tune`.
    purpose: Option<String>,
    /// The base model whose tokenizer counts the tokens (default: the first registered
    /// model with local files).
    model: Option<String>,
}

/// An upload spooled to disk.
struct Spooled {
    file: tempfile::NamedTempFile,
    bytes: u64,
    filename: String,
    purpose: Option<String>,
    model: Option<String>,
}

/// How large an upload may be, and whose limit that is.
#[derive(Debug, Clone, Copy)]
struct UploadLimit {
    bytes: u64,
    /// The tenant's own limit (set by an operator), below the server's.
    tenant: bool,
}

/// 429 for an upload past the tenant's storage quota (files or bytes kept).
fn storage_quota(message: String) -> ApiError {
    let mut e = ApiError::too_many(
        Code::TenantStorageQuota,
        message,
        TENANT_UPLOAD_RETRY_AFTER_S,
    );
    e.detail.param = Some("file".into());
    e
}

/// `retry-after` of an upload over the tenant's limit: an operator may raise it.
const TENANT_UPLOAD_RETRY_AFTER_S: u64 = 60;

impl UploadLimit {
    /// The answer to an upload over the limit: the server's is a 413; a tenant's is a
    /// quota like its others (jobs waiting, jobs running), so a 429 with `retry-after`.
    fn exceeded(self) -> ApiError {
        if self.tenant {
            let mut e = ApiError::too_many(
                Code::TenantUploadLimit,
                format!(
                    "The upload is larger than this tenant's limit of {} bytes; ask an operator to raise max_upload_bytes.",
                    self.bytes
                ),
                TENANT_UPLOAD_RETRY_AFTER_S,
            );
            e.detail.param = Some("file".into());
            e
        } else {
            ApiError::too_large(self.bytes)
        }
    }
}

/// Receives an upload within `limit`; a declared length over it is refused before a
/// byte of the body is read.
async fn receive(
    state: &AppState,
    limit: UploadLimit,
    req: &HttpRequest,
    payload: web::Payload,
) -> ApiResult<Spooled> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // A multipart body carries a few hundred bytes of framing besides the file.
    if declared.is_some_and(|n| n > limit.bytes.saturating_add(64 << 10)) {
        return Err(limit.exceeded());
    }
    let is_multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    if !is_multipart {
        let query = web::Query::<RawUpload>::from_query(req.query_string())
            .map_err(|e| ApiError::invalid("filename", Code::InvalidQuery, e.to_string()))?;
        let (file, bytes) = spool(state, limit, payload.map_err(|e| broke_off(&e))).await?;
        return Ok(Spooled {
            file,
            bytes,
            filename: clean_filename(query.filename.as_deref().unwrap_or("upload.jsonl")),
            purpose: query.purpose.clone(),
            model: query.model.clone(),
        });
    }
    let mut form = actix_multipart::Multipart::new(req.headers(), payload);
    let mut purpose = None;
    let mut model = None;
    let mut spooled = None;
    while let Some(field) = form.next().await {
        let mut field = field.map_err(field_broke_off)?;
        let name = field.name().unwrap_or_default().to_string();
        // A second copy of a field would silently replace the first: refused instead.
        let repeated = match name.as_str() {
            "file" => spooled.is_some(),
            "purpose" => purpose.is_some(),
            "model" => model.is_some(),
            _ => false,
        };
        if repeated {
            return Err(ApiError::invalid(
                &name,
                Code::DuplicateField,
                format!("The form has more than one `{name}` field; send each once."),
            ));
        }
        match name.as_str() {
            "purpose" => purpose = Some(small_field(&mut field, "purpose", 64).await?),
            "model" => model = Some(small_field(&mut field, "model", 128).await?),
            "file" => {
                let filename = field
                    .content_disposition()
                    .and_then(|d| d.get_filename())
                    .map(clean_filename)
                    .unwrap_or_else(|| "upload.jsonl".into());
                let (file, bytes) = spool(state, limit, field.map_err(field_broke_off)).await?;
                spooled = Some((file, bytes, filename));
            }
            // Unknown fields are drained and ignored, as OpenAI does, within the limit.
            _ => {
                let mut drained = 0u64;
                while let Some(chunk) = field.next().await {
                    drained += chunk.map_err(field_broke_off)?.len() as u64;
                    if drained > limit.bytes {
                        return Err(limit.exceeded());
                    }
                }
            }
        }
    }
    let (file, bytes, filename) = spooled.ok_or_else(|| {
        ApiError::invalid(
            "file",
            Code::MissingFile,
            "The form has no `file` field with the dataset.",
        )
    })?;
    Ok(Spooled {
        file,
        bytes,
        filename,
        purpose,
        model,
    })
}

/// A short text field of a form (at most `max` bytes).
async fn small_field(
    field: &mut actix_multipart::Field,
    name: &str,
    max: usize,
) -> ApiResult<String> {
    let mut text = Vec::new();
    while let Some(chunk) = field.next().await {
        let chunk = chunk.map_err(field_broke_off)?;
        text.extend_from_slice(&chunk);
        if text.len() > max {
            return Err(ApiError::invalid(
                name,
                Code::InvalidValue,
                format!("{name} is too long"),
            ));
        }
    }
    Ok(String::from_utf8_lossy(&text).trim().to_string())
}

/// The tokenizer and template that count an upload's tokens: `requested`'s (a
/// registered base model, an alias of one, or one of the tenant's fine-tuned models,
/// whose base model's tokenizer and own trained template it uses; refused otherwise),
/// else the first registered model's whose files are local.
async fn counting_model(
    state: &AppState,
    tenant: &str,
    requested: Option<&str>,
) -> ApiResult<Option<check::CountWith>> {
    let local = |m: &records::model::BaseModel, template: Option<ChatTemplateChoice>| {
        match tuneq_storage::Location::parse(&m.location) {
            Ok(tuneq_storage::Location::Local(dir)) => Some(check::CountWith {
                model: m.id.clone(),
                dir,
                template: template.unwrap_or(m.template()),
            }),
            _ => None,
        }
    };
    match requested {
        Some(id) => {
            // A fine-tuned model (or its checkpoint) tokenizes as its base model does.
            let (name, _) = records::finetune::split_checkpoint(id);
            let tuned = state.finetunes().by_model_name(tenant, name).await?;
            let id = tuned.as_ref().map_or(id, |job| job.base_model_id());
            let model = records::model::resolve(&state.queue, &state.config.model_aliases, id)
                .await?
                .ok_or_else(|| {
                    ApiError::invalid(
                        "model",
                        Code::ModelNotFound,
                        format!("The model `{}` does not exist.", crate::quote::shown(id)),
                    )
                })?;
            Ok(local(&model, tuned.as_ref().map(|job| job.template())))
        }
        None => Ok(records::model::all(&state.queue)
            .await?
            .iter()
            .find_map(|m| local(m, None))),
    }
}

/// Uploads a JSONL dataset (multipart with `file` and `purpose`, or the raw body). It is
/// validated at once: a file with any bad line is refused with every line listed in
/// `error.lines`, and nothing is stored.
#[utoipa::path(post, path = "/v1/files", tag = "files", operation_id = "upload_file",
    params(RawUpload),
    request_body(content(
        (UploadForm = "multipart/form-data"),
        (RawDataset = "application/octet-stream"),
    )),
    responses(
        (status = 200, description = "Stored and validated", body = FileObject),
        (status = 400, description = "Invalid dataset or form", body = ErrorBody),
        Unauthenticated,
        (status = 413, description = "Over the server's size limit", body = ErrorBody),
        (status = 429, description = "Over the tenant's upload limit or storage quota, or too many uploads at once (`retry-after`)", body = ErrorBody),
    ))]
pub(crate) async fn upload(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    // The tenant's own limits, else the server's defaults, within the server's.
    let limits = records::tenant::get(&state.queue, &tenant.0)
        .await?
        .map(|t| t.limits)
        .unwrap_or_default()
        .or(&state.config.default_limits);
    // Refused before the body is read when the tenant is full already; checked again
    // when the file is recorded (see below).
    check_quota(&state, &tenant.0, &limits, 0).await?;
    let limit = match limits.max_upload_bytes {
        Some(bytes) if bytes < state.config.max_upload_bytes => UploadLimit {
            bytes,
            tenant: true,
        },
        _ => UploadLimit {
            bytes: state.config.max_upload_bytes,
            tenant: false,
        },
    };
    let slot = state.upload_slots.take(&tenant.0)?;
    let spooled = receive(&state, limit, &req, payload).await?;
    match spooled.purpose.as_deref() {
        Some(PURPOSE) | None => {}
        Some(other) => {
            return Err(ApiError::invalid(
                "purpose",
                Code::InvalidValue,
                format!("purpose must be \"{PURPOSE}\", not {other:?}."),
            ));
        }
    }
    check_quota(&state, &tenant.0, &limits, spooled.bytes).await?;
    let counting = counting_model(&state, &tenant.0, spooled.model.as_deref()).await?;
    let (validation, _slot) = validate(
        spooled.file.path().to_path_buf(),
        spooled.filename.clone(),
        counting,
        &tenant.0,
        slot,
    )
    .await?;
    let id = new_file_id();
    let key = records::file::content_key(&tenant.0, &id)?;
    tuneq_storage::transfer::upload_file(&*state.store, spooled.file.path(), &key, PutMode::Create)
        .await?;
    let object = FileObject {
        id: id.clone(),
        object: "file".into(),
        bytes: spooled.bytes,
        created_at: records::now_seconds(),
        filename: spooled.filename,
        purpose: PURPOSE.into(),
        status: "processed".into(),
        validation,
    };
    // The quota again, in the tenant's commit turn: uploads of one tenant that were
    // validated side by side each saw room for themselves alone (the probe's L1: with
    // max_files 2, four at once left 3). Within one API process; replicas each take
    // their own turns.
    let recorded = {
        let _turn = state.upload_slots.commit_turn(&tenant.0).await;
        match check_quota(&state, &tenant.0, &limits, object.bytes).await {
            Ok(()) => records::file::create(&state.queue, &tenant.0, &object).await,
            Err(e) => Err(e),
        }
    };
    if let Err(e) = recorded {
        if let Err(cleanup) = state.store.delete(&key).await {
            tracing::warn!(error = %cleanup, file = %id, "could not delete an unrecorded upload");
        }
        return Err(e);
    }
    tracing::info!(tenant = %tenant.0, file = %id, bytes = object.bytes, examples = object.validation.examples, "file uploaded");
    Ok(HttpResponse::Ok().json(object))
}

/// Refuses an upload of `bytes` (0: before its size is known) that would take
/// `tenant` past its `max_files` or `max_stored_bytes`.
async fn check_quota(
    state: &AppState,
    tenant: &str,
    limits: &records::tenant::TenantLimits,
    bytes: u64,
) -> ApiResult<()> {
    if let Some(max) = limits.max_files
        && records::file::count(&state.queue, tenant).await? >= max
    {
        return Err(storage_quota(format!(
            "This tenant keeps {max} files already, its limit; delete some or ask an operator to raise max_files."
        )));
    }
    if let Some(max) = limits.max_stored_bytes
        && bytes > 0
    {
        let kept: Vec<FileObject> = records::file::all(&state.queue, tenant).await?;
        let stored: u64 = kept.iter().map(|f| f.bytes).sum();
        if stored.saturating_add(bytes) > max {
            return Err(storage_quota(format!(
                "This upload ({bytes} bytes) would take the tenant's files to {} bytes, past its limit of {max}; delete some or ask an operator to raise max_stored_bytes.",
                stored.saturating_add(bytes)
            )));
        }
    }
    Ok(())
}

/// Query of a list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// The last id of the previous page.
    after: Option<String>,
    /// Page size, 1 to 1 000 (default 100).
    limit: Option<u32>,
    /// `desc` (newest first; the only order).
    order: Option<String>,
    /// `fine-tune` (other purposes list nothing).
    purpose: Option<String>,
}

/// Lists the tenant's files, newest first; `after` = the last id of the previous page.
#[utoipa::path(get, path = "/v1/files", tag = "files", operation_id = "list_files",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of files", body = FileList),
        (status = 400, description = "Invalid query", body = ErrorBody),
        Unauthenticated,
    ))]
pub(crate) async fn list(
    state: web::Data<AppState>,
    tenant: Tenant,
    query: web::Query<ListQuery>,
) -> ApiResult<HttpResponse> {
    if query.order.as_deref().is_some_and(|o| o != "desc") {
        return Err(ApiError::invalid(
            "order",
            Code::InvalidValue,
            "Only order=desc is supported.",
        ));
    }
    let limit = query.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            Code::InvalidValue,
            "limit must be 1 to 1000.",
        ));
    }
    let purpose = query.purpose.as_deref().map(FilePurpose::parse);
    if purpose == Some(None) {
        return Ok(HttpResponse::Ok().json(FileList {
            object: "list".into(),
            data: vec![],
            has_more: false,
            first_id: None,
            last_id: None,
        }));
    }
    let page = records::file::page(&state.queue, &tenant.0, query.after.as_deref(), limit).await?;
    let mut data = page.records;
    if let Some(Some(purpose)) = purpose {
        data.retain(|f| f.purpose == purpose.as_str());
    }
    Ok(HttpResponse::Ok().json(FileList {
        object: "list".into(),
        first_id: data.first().map(|f| f.id.clone()),
        last_id: data.last().map(|f| f.id.clone()),
        data,
        has_more: page.has_more,
    }))
}

/// A file.
#[utoipa::path(get, path = "/v1/files/{id}", tag = "files", operation_id = "retrieve_file",
    params(("id" = String, Path, description = "`file-…`")),
    responses(
        (status = 200, description = "The file", body = FileObject),
        Own<FileObject>,
    ))]
pub(crate) async fn retrieve(file: Own<FileObject>) -> ApiResult<HttpResponse> {
    Ok(HttpResponse::Ok().json(file.object))
}

/// The file's bytes as uploaded, streamed. A tenant holds a bounded number of
/// downloads at once (8 by default).
#[utoipa::path(get, path = "/v1/files/{id}/content", tag = "files", operation_id = "download_file",
    params(("id" = String, Path, description = "`file-…`")),
    responses(
        (status = 200, description = "The file's bytes: JSONL for an upload, CSV for a job's result file", content(
            (inline(tuneq_openapi::Binary) = "application/jsonl"),
            (inline(tuneq_openapi::Binary) = "text/csv"),
        )),
        Own<FileObject>,
        (status = 429, description = "The tenant (or the server) has as many downloads in progress as it may \
(`too_many_downloads`); retry after `retry-after`", body = ErrorBody),
    ))]
pub(crate) async fn content(
    state: web::Data<AppState>,
    owned: Own<FileObject>,
) -> ApiResult<HttpResponse> {
    let (tenant, file) = (owned.tenant, owned.object);
    // Held until the body is dropped: a client that reads slowly keeps its connection.
    let hold = match state.holds.take(&tenant.0, HoldKind::Download) {
        Ok(hold) => hold,
        Err(refused) => return Ok(holds::refusal(&refused)),
    };
    let object = state
        .store
        .get(&records::file::content_key(&tenant.0, &file.id)?, None)
        .await?;
    let (content_type, extension) = match FilePurpose::parse(&file.purpose) {
        Some(FilePurpose::FineTuneResults) => ("text/csv", "csv"),
        _ => ("application/jsonl", "jsonl"),
    };
    Ok(HttpResponse::Ok()
        .content_type(content_type)
        .no_chunking(object.meta.size)
        .insert_header((
            header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{}.{extension}\"", file.id),
        ))
        .streaming(holds::holding(
            hold,
            object.body.map_err(|e| {
                tracing::warn!(error = %e, "file download broke off");
                actix_web::error::ErrorInternalServerError("download broke off")
            }),
        )))
}

/// Deletes a file.
#[utoipa::path(delete, path = "/v1/files/{id}", tag = "files", operation_id = "delete_file",
    params(("id" = String, Path, description = "`file-…`")),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        (status = 400, description = "An unfinished job trains on it (`file_in_use`)", body = ErrorBody),
        Own<FileObject>,
    ))]
pub(crate) async fn delete(
    state: web::Data<AppState>,
    owned: Own<FileObject>,
) -> ApiResult<HttpResponse> {
    let (tenant, file) = (owned.tenant, owned.object);
    if let Some(job) = state
        .finetunes()
        .unfinished_using(&tenant.0, &file.id)
        .await?
    {
        return Err(ApiError::invalid(
            "id",
            Code::FileInUse,
            format!(
                "The fine-tuning job {job} trains on this file and has not finished; cancel it or wait for it, then delete the file."
            ),
        ));
    }
    let key = records::file::content_key(&tenant.0, &file.id)?;
    // The record goes first: a crash between the two leaves an object no record names
    // (storage to reclaim), never a record whose content is gone.
    records::file::delete(&state.queue, &tenant.0, &file.id).await?;
    match state.store.delete(&key).await {
        Ok(()) => {}
        Err(e) if e.is_not_found() => {}
        Err(e) => {
            tracing::warn!(error = %e, file = %file.id, "a deleted file's content was not removed");
        }
    }
    tracing::info!(tenant = %tenant.0, file = %file.id, "file deleted");
    Ok(HttpResponse::Ok().json(Deleted {
        id: file.id,
        object: "file".into(),
        deleted: true,
    }))
}

impl Owned for FileObject {
    const NOT_FOUND: &'static str = "No such file for this tenant";

    async fn find(state: &AppState, tenant: &str, id: &str) -> ApiResult<Self> {
        records::file::find(&state.queue, tenant, id).await
    }
}
