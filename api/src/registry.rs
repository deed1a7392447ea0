//! The operator's model registry, behind the admin key: `POST /admin/models` registers a
//! base model every tenant may fine-tune (as `--model ID=LOCATION` does at start), and
//! `DELETE /admin/models/{id}` removes one no unfinished job uses.
//!
//! A local folder is checked before it is registered: a `config.json` of an architecture
//! tuneq trains ([`tuneq_pools::architecture_of`], the rule the trainer and job creation
//! use), a `tokenizer.json`, and safetensors weights whose embedding and layers are the
//! shape the config says. A folder in an object store (`s3://`, `gs://`) is checked by
//! the trainer when it loads it, as for `--model`.

use crate::auth::Admin;
use crate::error::{ApiError, ApiResult, Code};
use crate::records::{self, model::BaseModel};
use crate::refusals::{NotAdmin, UnknownModel};
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use serde::Deserialize;
use std::path::Path;
use tuneq_openapi::{Deleted, Model};
use tuneq_queue::JobQueue;

/// The learning rate a model is registered with when the request names none (LoRA's
/// usual 2e-4, as `--model`); a job's `learning_rate_multiplier` scales it.
const DEFAULT_BASE_LEARNING_RATE: f64 = 2e-4;

/// The largest safetensors header read (real ones are well under 1 MiB).
const HEADER_LIMIT: u64 = 16 << 20;

/// `POST /admin/models` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewModel {
    /// The name jobs fine-tune it by: 1 to 128 characters of A-Z, a-z, 0-9, '.', '_'
    /// and '-'.
    id: String,
    /// Its Hugging Face–layout folder: an absolute local path (on the machines that run
    /// the trainers) or an `s3://` or `gs://` URI.
    location: String,
    /// The peak learning rate at `learning_rate_multiplier` 1 (default 2e-4), from 1e-9
    /// to 1.
    #[serde(default)]
    base_learning_rate: Option<f64>,
}

/// Registers a base model (admin key only): 201 with the model, 200 when it is
/// registered at that location already, 409 `model_exists` when the id names another
/// location; a local folder that is not a model tuneq trains is refused naming why.
#[utoipa::path(post, path = "/admin/models", tag = "admin", operation_id = "register_model",
    request_body = NewModel,
    security(("admin_key" = [])),
    responses(
        (status = 201, description = "Registered", body = Model),
        (status = 200, description = "Registered at this location already: nothing changed", body = Model),
        (status = 400, description = "The id or location is invalid, or the folder is not a model tuneq trains (`unsupported_model_architecture`, `invalid_value`; `param` names the field)", body = tuneq_openapi::ErrorBody),
        (status = 409, description = "The id names a model at another location (`model_exists`); nothing changed", body = tuneq_openapi::ErrorBody),
        NotAdmin,
    ))]
pub(crate) async fn register(
    state: web::Data<AppState>,
    _: Admin,
    body: crate::body::JsonBody<NewModel>,
) -> ApiResult<HttpResponse> {
    let body = body.0;
    tuneq_queue::catalog::check_identifier("model", &body.id)
        .map_err(|e| ApiError::invalid("id", Code::InvalidValue, e.to_string()))?;
    let rate = body
        .base_learning_rate
        .unwrap_or(DEFAULT_BASE_LEARNING_RATE);
    if !(1e-9..=1.0).contains(&rate) {
        return Err(ApiError::invalid(
            "base_learning_rate",
            Code::InvalidValue,
            "base_learning_rate is from 1e-9 to 1.",
        ));
    }
    let location = checked_location(&body.location).await?;
    if let Some(existing) = records::model::get(&state.queue, &body.id).await? {
        if existing.location == location {
            return Ok(HttpResponse::Ok().json(crate::models::base(existing)));
        }
        return Err(ApiError::invalid(
            "id",
            Code::ModelExists,
            format!(
                "A base model `{}` is registered at another location; delete it first (DELETE /admin/models/{}) to register it again.",
                body.id, body.id
            ),
        ));
    }
    let model = BaseModel {
        id: body.id,
        location,
        base_learning_rate: rate,
        created: records::now_seconds(),
    };
    records::model::register(&state.queue, &model).await?;
    Ok(HttpResponse::Created().json(crate::models::base(model)))
}

/// Removes a base model (admin key only) that no unfinished job of any tenant trains
/// on and no alias names (400 `model_in_use` naming one); its files are not touched.
/// Fine-tuned models of it stay usable where their base stays reachable.
#[utoipa::path(delete, path = "/admin/models/{id}", tag = "admin", operation_id = "delete_base_model",
    params(("id" = String, Path, description = "The base model")),
    security(("admin_key" = [])),
    responses(
        (status = 200, description = "Removed from the registry", body = Deleted),
        (status = 400, description = "An unfinished job trains on it, or an alias names it (`model_in_use`)", body = tuneq_openapi::ErrorBody),
        UnknownModel,
        NotAdmin,
    ))]
pub(crate) async fn delete(
    state: web::Data<AppState>,
    _: Admin,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id = id.into_inner();
    if records::model::get(&state.queue, &id).await?.is_none() {
        return Err(ApiError::not_found("model", &id));
    }
    if let Some((alias, _)) = state
        .config
        .model_aliases
        .iter()
        .find(|(_, target)| **target == id)
    {
        return Err(ApiError::invalid(
            "id",
            Code::ModelInUse,
            format!(
                "The alias `{alias}` names this model; remove the alias (--model-alias) first."
            ),
        ));
    }
    for tenant in records::tenant::all(&state.queue).await? {
        for job in state.finetunes().all(&tenant.id).await? {
            let trains_on_it = job.base_model.as_deref().unwrap_or(&job.model) == id;
            if !trains_on_it || !unfinished(&state, &job).await? {
                continue;
            }
            return Err(ApiError::invalid(
                "id",
                Code::ModelInUse,
                format!(
                    "Job {} of tenant {} has not finished and trains on this model; delete it once that job has finished (or is cancelled).",
                    job.id, tenant.id
                ),
            ));
        }
    }
    records::model::remove(&state.queue, &id).await?;
    tracing::info!(model = %id, "base model removed from the registry");
    Ok(HttpResponse::Ok().json(Deleted {
        id,
        object: "model".into(),
        deleted: true,
    }))
}

/// Whether `job` has not finished: no outcome filed, and the queue still holds it in a
/// state that is not final (a job the queue has forgotten is having its outcome filed).
async fn unfinished(state: &AppState, job: &records::finetune::FineTuneRecord) -> ApiResult<bool> {
    if job.outcome.is_some() {
        return Ok(false);
    }
    Ok(state
        .queue
        .get(&job.job_id)
        .await?
        .is_some_and(|queued| !queued.state.is_terminal()))
}

/// The location as it is registered: a local folder checked to hold a model tuneq
/// trains (made canonical), a store URI as given.
async fn checked_location(text: &str) -> ApiResult<String> {
    let refused = |message: String| ApiError::invalid("location", Code::InvalidValue, message);
    if !text.contains("://") && !Path::new(text).is_absolute() {
        return Err(refused(
            "A local location is an absolute path (the folder on the machines that run the trainers).".into(),
        ));
    }
    match tuneq_storage::Location::parse(text) {
        Ok(tuneq_storage::Location::Local(path)) => {
            let path = path.to_path_buf();
            let checked = tokio::task::spawn_blocking(move || check_folder(&path))
                .await
                .map_err(|_| ApiError::internal("the model folder check stopped"))??;
            Ok(checked)
        }
        Ok(_) => Ok(text.to_string()),
        Err(e) => Err(refused(e.to_string())),
    }
}

/// Checks that the local folder `path` holds a model tuneq trains, whose weights have
/// the shape its config says; its canonical path.
fn check_folder(path: &Path) -> ApiResult<String> {
    let refused = |message: String| ApiError::invalid("location", Code::InvalidValue, message);
    let shape = match tuneq_pools::ModelShape::read(path) {
        Some(Ok(shape)) => shape,
        Some(Err(refusal)) => {
            return Err(ApiError::invalid(
                "location",
                Code::UnsupportedModelArchitecture,
                format!("The model at this location cannot be trained: {refusal}."),
            ));
        }
        None => {
            return Err(refused(
                "The folder holds no readable config.json of at most 1 MiB (a Hugging Face model folder is expected).".into(),
            ));
        }
    };
    if !path.join("tokenizer.json").is_file() {
        return Err(refused(
            "The folder holds no tokenizer.json (a Hugging Face tokenizer file).".into(),
        ));
    }
    check_weights(path, &shape).map_err(refused)?;
    std::fs::canonicalize(path)
        .map(|p| p.display().to_string())
        .map_err(|_| refused("The folder cannot be read.".into()))
}

/// Checks the folder's safetensors headers against `shape`: the embedding is vocabulary
/// × hidden, and the layers are numbered 0 to `num_hidden_layers − 1`. Only headers are
/// read, each bounded by [`HEADER_LIMIT`].
fn check_weights(path: &Path, shape: &tuneq_pools::ModelShape) -> Result<(), String> {
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(path)
        .map_err(|_| "The folder cannot be read.".to_string())?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err("The folder holds no .safetensors weights.".into());
    }
    let mut embedding = None;
    let mut layers = 0u64;
    for file in &files {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let header = safetensors_header(file).map_err(|why| format!("{name}: {why}"))?;
        for (tensor, info) in header {
            if tensor == "model.embed_tokens.weight" {
                embedding = info.get("shape").cloned();
            }
            if let Some(layer) = tensor
                .strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.parse::<u64>().ok())
            {
                layers = layers.max(layer + 1);
            }
        }
    }
    let expected = serde_json::json!([shape.vocab_size, shape.hidden_size]);
    match embedding {
        None => return Err("No weight file holds model.embed_tokens.weight.".into()),
        Some(found) if found != expected => {
            return Err(format!(
                "model.embed_tokens.weight is {found}, but config.json says vocab_size × hidden_size = {expected}."
            ));
        }
        Some(_) => {}
    }
    if layers != shape.num_hidden_layers {
        return Err(format!(
            "The weights hold {layers} layers, but config.json says num_hidden_layers = {}.",
            shape.num_hidden_layers
        ));
    }
    Ok(())
}

/// The tensors a safetensors file's header lists (name → dtype, shape, offsets).
fn safetensors_header(
    file: &Path,
) -> Result<serde_json::Map<String, serde_json::Value>, &'static str> {
    use std::io::Read;
    let mut f = std::fs::File::open(file).map_err(|_| "cannot be opened")?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| "is too short to be a safetensors file")?;
    let len = u64::from_le_bytes(len);
    if len > HEADER_LIMIT {
        return Err("has a header larger than 16 MiB");
    }
    let mut header = Vec::with_capacity(len as usize);
    f.take(len)
        .read_to_end(&mut header)
        .map_err(|_| "cannot be read")?;
    let mut map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|_| "has a header that is not JSON")?;
    map.remove("__metadata__");
    Ok(map)
}
