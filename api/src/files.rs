//! Datasets: upload (multipart, as OpenAI's SDKs send it, or a raw body), list,
//! retrieve, download, delete — `/v1/files…` and the same handlers at `/files…`.
//!
//! An upload is spooled to disk (bounded by the size limit), validated with the
//! trainer's own rules (`tuneq-dataset`), and refused with every bad line listed if any
//! line is wrong; nothing is stored then. A valid file goes to
//! `tenants/<tenant>/files/<file>/content.jsonl` and its record to the catalog. Keys
//! are built from checked ids only; the client's filename is display text.

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, web};
use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;
use std::io::Write;
use tuneq_dataset::{DataError, Encoder, LineValidator, Record, TokenCounter};
use tuneq_openapi::ErrorBody;
use tuneq_openapi::{
    DatasetFormat, Deleted, FileList, FileObject, FileTokenStats, FileValidation, LineProblem,
};
use tuneq_queue::Catalog;
use tuneq_storage::layout::{self, Id};
use tuneq_storage::{ObjectKey, PutMode};

/// Catalog kind of files.
const KIND: &str = "file";
/// The only purpose a file can have here.
const PURPOSE: &str = "fine-tune";

/// Routes, under both prefixes. Each prefix is a scope, so the router compares one
/// static prefix before it tries the patterns with an `{id}` in them.
pub fn routes(cfg: &mut web::ServiceConfig) {
    for prefix in ["/v1/files", "/files"] {
        cfg.service(
            web::scope(prefix)
                .service(
                    crate::scoped_resource(prefix, "", "GET, POST")
                        .route(web::post().to(upload))
                        .route(web::get().to(list)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}", "GET, DELETE")
                        .route(web::get().to(retrieve))
                        .route(web::delete().to(delete)),
                )
                .service(
                    crate::scoped_resource(prefix, "/{id}/content", "GET")
                        .route(web::get().to(content)),
                ),
        );
    }
}

fn new_file_id() -> String {
    format!("file-{}", hex::encode(rand::random::<[u8; 12]>()))
}

/// The storage key of a file's bytes.
pub(crate) fn content_key(tenant: &str, file: &str) -> ApiResult<ObjectKey> {
    let tenant =
        Id::parse(tenant).map_err(|_| ApiError::internal("tenant id is not a storage id"))?;
    let file = Id::parse(file).map_err(|_| ApiError::not_found("file", file))?;
    layout::tenant_file(&tenant, &file)
        .join("content.jsonl")
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// A display name: no control characters, at most 255 bytes.
fn clean_filename(name: &str) -> String {
    let mut cleaned: String = name.chars().filter(|c| !c.is_control()).collect();
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

/// The answer to a body that broke off: too slow (408), or cut by the client (400).
fn broke_off(e: &actix_web::error::PayloadError) -> ApiError {
    if crate::guard::is_body_timeout(e) {
        return crate::guard::body_timeout();
    }
    ApiError::invalid(
        "file",
        "upload_interrupted",
        format!("The upload broke off: {e}"),
    )
}

/// [`broke_off`] for a form's field.
fn field_broke_off(e: actix_multipart::MultipartError) -> ApiError {
    match e {
        actix_multipart::MultipartError::Payload(p) => broke_off(&p),
        other => ApiError::invalid("file", "invalid_multipart", other.to_string()),
    }
}

/// Writes `chunks` to a new spool file, refusing more than `limit` bytes.
async fn spool<S>(
    state: &AppState,
    limit: UploadLimit,
    mut chunks: S,
) -> ApiResult<(tempfile::NamedTempFile, u64)>
where
    S: futures::Stream<Item = Result<bytes::Bytes, ApiError>> + Unpin,
{
    let mut file = spool_file(&state.config.spool_dir)
        .map_err(|e| ApiError::internal(format!("cannot spool the upload: {e}")))?;
    let mut bytes = 0u64;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        bytes += chunk.len() as u64;
        if bytes > limit.bytes {
            return Err(limit.exceeded());
        }
        file.write_all(&chunk)
            .map_err(|e| ApiError::internal(format!("cannot spool the upload: {e}")))?;
    }
    Ok((file, bytes))
}

/// What spool files of this process are named with: a file whose process is gone was
/// left by a crash, and [`clean_spool`] removes it.
fn spool_prefix(pid: u32) -> String {
    format!("tuneq-upload-{pid}-")
}

/// A new spool file in `dir`, readable by this user only.
fn spool_file(dir: &std::path::Path) -> std::io::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(&spool_prefix(std::process::id()))
        .suffix(".jsonl")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)
}

/// Removes the spool files in `dir` that processes no longer running left behind (a
/// crash or a kill in the middle of an upload), and returns how many bytes that freed.
/// Files of live processes (another API process may share the folder) are kept.
pub fn clean_spool(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut freed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("tuneq-upload-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let alive =
            pid == std::process::id() || std::path::Path::new(&format!("/proc/{pid}")).exists();
        if alive {
            continue;
        }
        let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
        match std::fs::remove_file(entry.path()) {
            Ok(()) => freed += bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(freed)
}

/// Uploads in progress, in the whole process and per tenant: each holds a connection, a
/// spool file and, while it is validated, a core. Beyond the bounds an upload is
/// answered 429 before its body is read.
mod upload_slots {
    use crate::error::ApiError;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    /// Uploads at once in one process.
    pub const PER_PROCESS: usize = 32;
    /// Uploads at once of one tenant.
    pub const PER_TENANT: usize = 4;
    /// `retry-after` when no slot is free.
    const RETRY_AFTER_S: u64 = 5;

    #[derive(Default)]
    struct Slots {
        total: usize,
        by_tenant: HashMap<String, usize>,
    }

    fn slots() -> &'static Mutex<Slots> {
        static SLOTS: OnceLock<Mutex<Slots>> = OnceLock::new();
        SLOTS.get_or_init(Default::default)
    }

    /// A slot held for one upload, given back when dropped.
    pub struct Slot(String);

    impl Drop for Slot {
        fn drop(&mut self) {
            if let Ok(mut s) = slots().lock() {
                s.total = s.total.saturating_sub(1);
                if let Some(n) = s.by_tenant.get_mut(&self.0) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        s.by_tenant.remove(&self.0);
                    }
                }
            }
        }
    }

    /// A slot for `tenant`, or 429 when the tenant or the process has none free.
    pub fn take(tenant: &str) -> Result<Slot, ApiError> {
        let mut s = slots()
            .lock()
            .map_err(|_| ApiError::internal("upload slots are poisoned"))?;
        if s.total >= PER_PROCESS {
            return Err(ApiError::too_many(
                "too_many_uploads",
                format!(
                    "The server is receiving {PER_PROCESS} uploads already; try again shortly."
                ),
                RETRY_AFTER_S,
            ));
        }
        let mine = s.by_tenant.get(tenant).copied().unwrap_or(0);
        if mine >= PER_TENANT {
            return Err(ApiError::too_many(
                "too_many_uploads",
                format!(
                    "This tenant has {PER_TENANT} uploads in progress; wait for one to finish."
                ),
                RETRY_AFTER_S,
            ));
        }
        s.total += 1;
        s.by_tenant.insert(tenant.to_string(), mine + 1);
        Ok(Slot(tenant.to_string()))
    }
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
    let mut e = ApiError::too_many("tenant_storage_quota", message, TENANT_UPLOAD_RETRY_AFTER_S);
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
                "tenant_upload_limit",
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
            .map_err(|e| ApiError::invalid("filename", "invalid_query", e.to_string()))?;
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
                "duplicate_field",
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
            "missing_file",
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
                "invalid_value",
                format!("{name} is too long"),
            ));
        }
    }
    Ok(String::from_utf8_lossy(&text).trim().to_string())
}

/// The tokenizer that counts an upload's tokens: `requested` (refused when it is not a
/// registered base model), else the first registered model whose files are local.
async fn counting_model(
    state: &AppState,
    requested: Option<&str>,
) -> ApiResult<Option<(String, std::path::PathBuf)>> {
    let local = |m: &crate::models::BaseModel| match tuneq_storage::Location::parse(&m.location) {
        Ok(tuneq_storage::Location::Local(path)) => Some((m.id.clone(), path)),
        _ => None,
    };
    match requested {
        Some(id) => {
            let model = crate::models::base(state, id).await?.ok_or_else(|| {
                ApiError::invalid(
                    "model",
                    "model_not_found",
                    format!("The model `{id}` does not exist."),
                )
            })?;
            Ok(local(&model))
        }
        None => Ok(crate::models::bases(state).await?.iter().find_map(local)),
    }
}

/// Sequence length token statistics cut examples at: a job's default.
const STATS_MAX_SEQ_LEN: u32 = 512;

/// Tokenizers (with chat templates) by model folder, loaded once per process.
fn encoder_for(dir: &std::path::Path) -> Result<std::sync::Arc<Encoder>, String> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    static ENCODERS: OnceLock<Mutex<HashMap<std::path::PathBuf, Arc<Encoder>>>> = OnceLock::new();
    let cache = ENCODERS.get_or_init(Default::default);
    if let Some(encoder) = cache.lock().ok().and_then(|c| c.get(dir).cloned()) {
        return Ok(encoder);
    }
    let encoder = Arc::new(
        Encoder::from_model_dir(dir, tuneq_openapi::ChatTemplateChoice::default())
            .map_err(|e| e.to_string())?,
    );
    if let Ok(mut c) = cache.lock() {
        c.insert(dir.to_path_buf(), Arc::clone(&encoder));
    }
    Ok(encoder)
}

/// Counts an upload's tokens one example at a time with a model's tokenizer.
struct TokenCounting {
    model: String,
    encoder: std::sync::Arc<Encoder>,
    counter: TokenCounter,
    /// Set when a record could not be encoded: then no statistics are shown.
    failed: bool,
}

impl TokenCounting {
    /// A counter with `model`'s tokenizer; None (logged) when its files cannot be read.
    fn new((model, dir): (String, std::path::PathBuf)) -> Option<Self> {
        match encoder_for(&dir) {
            Ok(encoder) => Some(Self {
                model,
                encoder,
                counter: TokenCounter::default(),
                failed: false,
            }),
            Err(e) => {
                tracing::warn!(model = %model, error = %e, "cannot count an upload's tokens");
                None
            }
        }
    }

    fn add(&mut self, record: &Record) {
        if self.failed {
            return;
        }
        match self
            .encoder
            .encode_with_length(record, STATS_MAX_SEQ_LEN as usize)
        {
            Ok((example, full_len)) => self
                .counter
                .add(&example, full_len > example.input_ids.len()),
            Err(e) => {
                tracing::warn!(model = %self.model, error = %e, "cannot count an upload's tokens");
                self.failed = true;
            }
        }
    }

    fn stats(&self) -> Option<FileTokenStats> {
        if self.failed {
            return None;
        }
        let stats = self.counter.stats();
        Some(FileTokenStats {
            model: self.model.clone(),
            max_seq_len: STATS_MAX_SEQ_LEN,
            tokens: stats.tokens,
            trained_tokens: stats.trained_tokens,
            min_len: stats.min_len as u64,
            max_len: stats.max_len as u64,
            mean_len: stats.mean_len,
            truncated: stats.truncated as u64,
            unlabelled: stats.unlabelled as u64,
        })
    }
}

fn characters(record: &Record) -> usize {
    match record {
        Record::Chat { messages } => messages.iter().map(|m| m.content.chars().count()).sum(),
        Record::PromptCompletion { prompt, completion } => {
            prompt.chars().count() + completion.chars().count()
        }
        Record::Alpaca {
            instruction,
            input,
            output,
        } => instruction.chars().count() + input.chars().count() + output.chars().count(),
        Record::Text { text } => text.chars().count(),
    }
}

fn format_name(format: DatasetFormat) -> String {
    serde_json::to_value(format)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The longest line an upload may have: what validation holds in memory at once.
const MAX_LINE_BYTES: usize = 8 << 20;

/// Uploads validated at once in one process: validation takes a core for a while.
fn validation_permits() -> &'static tokio::sync::Semaphore {
    static PERMITS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    PERMITS.get_or_init(|| {
        tokio::sync::Semaphore::new(
            std::thread::available_parallelism()
                .map(std::num::NonZeroUsize::get)
                .unwrap_or(2),
        )
    })
}

/// Validates the spooled file with the trainer's rules, reading it as a stream: memory
/// stays within one line ([`MAX_LINE_BYTES`]) whatever the file's size.
async fn validate(
    path: std::path::PathBuf,
    filename: String,
    counting: Option<(String, std::path::PathBuf)>,
) -> ApiResult<FileValidation> {
    let _permit = validation_permits()
        .acquire()
        .await
        .map_err(|_| ApiError::internal("the validation semaphore is closed"))?;
    let checked = tokio::task::spawn_blocking(move || scan(&path, &filename, counting))
        .await
        .map_err(|e| ApiError::internal(format!("validation task: {e}")))?;
    let (format, examples, characters, tokens) = match checked {
        Ok(checked) => checked,
        Err(DataError::InvalidLines {
            errors,
            bad_lines,
            total,
            ..
        }) => {
            let lines: Vec<LineProblem> = errors
                .into_iter()
                .map(|e| LineProblem {
                    line: e.line as u64,
                    field: e.field,
                    message: e.message,
                })
                .collect();
            let first = lines
                .first()
                .map(|l| {
                    let field = if l.field.is_empty() {
                        String::new()
                    } else {
                        format!(" {}", l.field)
                    };
                    format!(" First: line {}{}: {}.", l.line, field, l.message)
                })
                .unwrap_or_default();
            return Err(ApiError::bad_lines(
                format!(
                    "The file has {bad_lines} invalid line(s) ({total} problem(s)); `error.lines` lists them.{first}"
                ),
                lines,
            ));
        }
        Err(DataError::Empty { .. }) => {
            return Err(ApiError::invalid(
                "file",
                "empty_file",
                "The file has no examples: it is empty or only blank lines.",
            ));
        }
        Err(other) => {
            tracing::error!(error = %other, "upload validation failed");
            return Err(ApiError::internal("The upload could not be validated."));
        }
    };
    Ok(FileValidation {
        format: format_name(format),
        examples,
        characters,
        tokens,
    })
}

/// The checks of [`validate`], on a blocking thread: the format, examples, characters
/// and token statistics of the file at `path`.
fn scan(
    path: &std::path::Path,
    filename: &str,
    counting: Option<(String, std::path::PathBuf)>,
) -> Result<(DatasetFormat, u64, u64, Option<FileTokenStats>), DataError> {
    use std::io::{BufRead, Read};
    let io = |source| DataError::Io {
        path: filename.to_string(),
        source,
    };
    let mut reader =
        std::io::BufReader::with_capacity(1 << 16, std::fs::File::open(path).map_err(io)?);
    let mut validator = LineValidator::new(filename, DatasetFormat::Auto);
    let mut counting = counting.and_then(TokenCounting::new);
    let (mut examples, mut chars) = (0u64, 0u64);
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(io)?;
        if read == 0 {
            break;
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if line.len() > MAX_LINE_BYTES {
            validator.reject_line(format!(
                "the line is longer than {} MiB",
                MAX_LINE_BYTES >> 20
            ));
            skip_line(&mut reader).map_err(io)?;
            continue;
        }
        if let Some(record) = validator.push(&line) {
            examples += 1;
            chars += characters(&record) as u64;
            // A file with a bad line is refused: its tokens need no counting.
            if let Some(c) = counting.as_mut().filter(|_| !validator.has_problems()) {
                c.add(&record);
            }
        }
    }
    let format = validator.finish()?;
    Ok((
        format,
        examples,
        chars,
        counting.as_ref().and_then(TokenCounting::stats),
    ))
}

/// Reads past the rest of the current line.
fn skip_line(reader: &mut impl std::io::BufRead) -> std::io::Result<()> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                reader.consume(i + 1);
                return Ok(());
            }
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
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
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 413, description = "Over the server's size limit", body = ErrorBody),
        (status = 429, description = "Over the tenant's upload limit or storage quota, or too many uploads at once (`retry-after`)", body = ErrorBody),
    ))]
pub(crate) async fn upload(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    // The tenant's own limits, when it has them, within the server's.
    let limits = crate::auth::tenant(&state, &tenant.0)
        .await?
        .map(|t| t.limits)
        .unwrap_or_default();
    if let Some(max) = limits.max_files
        && state.queue.count_entries(KIND, &tenant.0).await? >= max
    {
        return Err(storage_quota(format!(
            "This tenant keeps {max} files already, its limit; delete some or ask an operator to raise max_files."
        )));
    }
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
    let _slot = upload_slots::take(&tenant.0)?;
    let spooled = receive(&state, limit, &req, payload).await?;
    match spooled.purpose.as_deref() {
        Some(PURPOSE) | None => {}
        Some(other) => {
            return Err(ApiError::invalid(
                "purpose",
                "invalid_value",
                format!("purpose must be \"{PURPOSE}\", not {other:?}."),
            ));
        }
    }
    if let Some(max) = limits.max_stored_bytes {
        let kept: Vec<FileObject> =
            crate::records::read_all(&state, (KIND, &tenant.0), "file").await?;
        let stored: u64 = kept.iter().map(|f| f.bytes).sum();
        if stored.saturating_add(spooled.bytes) > max {
            return Err(storage_quota(format!(
                "This upload ({} bytes) would take the tenant's files to {} bytes, past its limit of {max}; delete some or ask an operator to raise max_stored_bytes.",
                spooled.bytes,
                stored.saturating_add(spooled.bytes)
            )));
        }
    }
    let counting = counting_model(&state, spooled.model.as_deref()).await?;
    let validation = validate(
        spooled.file.path().to_path_buf(),
        spooled.filename.clone(),
        counting,
    )
    .await?;
    let id = new_file_id();
    let key = content_key(&tenant.0, &id)?;
    tuneq_storage::transfer::upload_file(&*state.store, spooled.file.path(), &key, PutMode::Create)
        .await?;
    let object = FileObject {
        id: id.clone(),
        object: "file".into(),
        bytes: spooled.bytes,
        created_at: now_seconds(),
        filename: spooled.filename,
        purpose: PURPOSE.into(),
        status: "processed".into(),
        validation,
    };
    let body = serde_json::to_string(&object).map_err(|e| ApiError::internal(e.to_string()))?;
    if let Err(e) = state.queue.create_entry(KIND, &tenant.0, &id, &body).await {
        if let Err(cleanup) = state.store.delete(&key).await {
            tracing::warn!(error = %cleanup, file = %id, "could not delete an unrecorded upload");
        }
        return Err(e.into());
    }
    tracing::info!(tenant = %tenant.0, file = %id, bytes = object.bytes, examples = object.validation.examples, "file uploaded");
    Ok(HttpResponse::Ok().json(object))
}

pub(crate) fn now_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
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
        (status = 401, description = "No or unknown API key", body = ErrorBody),
    ))]
pub(crate) async fn list(
    state: web::Data<AppState>,
    tenant: Tenant,
    query: web::Query<ListQuery>,
) -> ApiResult<HttpResponse> {
    if query.order.as_deref().is_some_and(|o| o != "desc") {
        return Err(ApiError::invalid(
            "order",
            "invalid_value",
            "Only order=desc is supported.",
        ));
    }
    let limit = query.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            "invalid_value",
            "limit must be 1 to 1000.",
        ));
    }
    if query.purpose.as_deref().is_some_and(|p| p != PURPOSE) {
        return Ok(HttpResponse::Ok().json(FileList {
            object: "list".into(),
            data: vec![],
            has_more: false,
            first_id: None,
            last_id: None,
        }));
    }
    let page = state
        .queue
        .list_entries(KIND, &tenant.0, query.after.as_deref(), limit)
        .await?;
    let data = page
        .entries
        .iter()
        .map(|e| crate::records::parse::<FileObject>(&e.body, "file"))
        .collect::<ApiResult<Vec<_>>>()?;
    Ok(HttpResponse::Ok().json(FileList {
        object: "list".into(),
        first_id: data.first().map(|f| f.id.clone()),
        last_id: data.last().map(|f| f.id.clone()),
        data,
        has_more: page.has_more,
    }))
}

/// The tenant's file, or 404 (also for another tenant's id or a malformed one).
pub(crate) async fn find(state: &AppState, tenant: &Tenant, id: &str) -> ApiResult<FileObject> {
    if tuneq_queue::catalog::check_identifier("id", id).is_err() {
        return Err(ApiError::not_found("file", id));
    }
    crate::records::read(state, (KIND, &tenant.0), id, "file")
        .await?
        .ok_or_else(|| ApiError::not_found("file", id))
}

/// A file.
#[utoipa::path(get, path = "/v1/files/{id}", tag = "files", operation_id = "retrieve_file",
    params(("id" = String, Path, description = "`file-…`")),
    responses(
        (status = 200, description = "The file", body = FileObject),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such file for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn retrieve(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    Ok(HttpResponse::Ok().json(find(&state, &tenant, &id).await?))
}

/// The file's bytes as uploaded, streamed.
#[utoipa::path(get, path = "/v1/files/{id}/content", tag = "files", operation_id = "download_file",
    params(("id" = String, Path, description = "`file-…`")),
    responses(
        (status = 200, description = "The JSONL bytes", content_type = "application/jsonl", body = inline(tuneq_openapi::Binary)),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such file for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn content(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let file = find(&state, &tenant, &id).await?;
    let object = state
        .store
        .get(&content_key(&tenant.0, &file.id)?, None)
        .await?;
    Ok(HttpResponse::Ok()
        .content_type("application/jsonl")
        .no_chunking(object.meta.size)
        .insert_header((
            header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{}.jsonl\"", file.id),
        ))
        .streaming(object.body.map_err(|e| {
            tracing::warn!(error = %e, "file download broke off");
            actix_web::error::ErrorInternalServerError("download broke off")
        })))
}

/// Deletes a file.
#[utoipa::path(delete, path = "/v1/files/{id}", tag = "files", operation_id = "delete_file",
    params(("id" = String, Path, description = "`file-…`")),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        (status = 400, description = "An unfinished job trains on it (`file_in_use`)", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such file for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn delete(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let file = find(&state, &tenant, &id).await?;
    if let Some(job) = crate::finetunes::unfinished_job_using(&state, &tenant.0, &file.id).await? {
        return Err(ApiError::invalid(
            "id",
            "file_in_use",
            format!(
                "The fine-tuning job {job} trains on this file and has not finished; cancel it or wait for it, then delete the file."
            ),
        ));
    }
    let key = content_key(&tenant.0, &file.id)?;
    // The record goes first: a crash between the two leaves an object no record names
    // (storage to reclaim), never a record whose content is gone.
    state.queue.delete_entry(KIND, &tenant.0, &file.id).await?;
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn spool_files_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        // A pid far above any pid_max is never a live process.
        let dead = dir.path().join("tuneq-upload-2147483646-abc.jsonl");
        std::fs::write(&dead, vec![0u8; 1000]).unwrap();
        let mine = spool_file(dir.path()).unwrap();
        let unrelated = dir.path().join("notes.txt");
        std::fs::write(&unrelated, "keep").unwrap();
        assert_eq!(clean_spool(dir.path()).unwrap(), 1000);
        assert!(!dead.exists());
        assert!(mine.path().exists());
        assert!(unrelated.exists());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(mine.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_stream_scan_counts_what_parse_jsonl_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        let text = "\u{feff}{\"text\":\"héllo\"}\r\n\n{\"text\":\"b\"}";
        std::fs::write(&path, text).unwrap();
        let (format, examples, chars, tokens) = scan(&path, "d.jsonl", None).unwrap();
        let parsed =
            tuneq_dataset::parse_jsonl("d.jsonl", text.as_bytes(), DatasetFormat::Auto).unwrap();
        assert_eq!(format, parsed.format);
        assert_eq!(examples, parsed.records.len() as u64);
        assert_eq!(chars, 6);
        assert!(tokens.is_none());
    }
}
