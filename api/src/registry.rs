//! The operator's model registry, behind the admin key: `POST /admin/models` registers a
//! base model every tenant may fine-tune (as `--model ID=LOCATION` does at start), and
//! `DELETE /admin/models/{id}` removes one no unfinished job uses.
//!
//! A local folder is checked before it is registered ([`inspect`]: a `config.json` of an
//! architecture tuneq trains, a tokenizer and chat template that load, every tensor the
//! config implies with its shape; every problem at once), and what that finds is
//! recorded for `GET /v1/models`, with the folder's identity: its weights are hashed
//! once, in the background after the registration answers ([`hashing`]), and every job's
//! trainer takes that hash for the run's fingerprint rather than reading the weights
//! again (see [`tuneq_pools::folder`]). A folder in an object store (`s3://`, `gs://`) is
//! checked the same way through a local copy of its small files and weight headers
//! ([`remote`]); its trainers hash it once they have it.

mod hashing;
mod inspect;
mod remote;

use crate::model_roots::ModelRoots;
pub use inspect::Inspected;

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
    /// A name to show beside the id: 1 to 128 characters, no control characters.
    #[serde(default)]
    display_name: Option<String>,
    /// The chat template its jobs train with and its fine-tuned models answer with:
    /// `model` (the default: the folder's own, ChatML where it has none), or the
    /// built-in `chatml`, `llama2` or `alpaca` — for a base model whose folder has no
    /// template, or one that does not suit chat fine-tuning.
    #[serde(default)]
    chat_template: Option<tuneq_openapi::ChatTemplateChoice>,
}

/// Registers a base model (admin key only): 201 with the model, 200 when it is
/// registered at that location already (its details read again, its display name
/// changed when one is given), 409 `model_exists` when the id names another location; a
/// folder (local or in a store) that is not a model tuneq trains is refused naming every
/// problem, one outside the `--model-root`s naming them.
#[utoipa::path(post, path = "/admin/models", tag = "admin", operation_id = "register_model",
    request_body = NewModel,
    security(("admin_key" = [])),
    responses(
        (status = 201, description = "Registered", body = Model),
        (status = 200, description = "Registered at this location already: its details read again, its display name changed when one is given", body = Model),
        (status = 400, description = "The id or location is invalid, or the folder is not a model tuneq trains (`unsupported_model_architecture`, `invalid_value`; `param` names the field)", body = tuneq_openapi::ErrorBody),
        (status = 409, description = "The id names a model at another location (`model_exists`); nothing changed", body = tuneq_openapi::ErrorBody),
        (status = 503, description = "The object store holding the folder did not answer; nothing changed, try again", body = tuneq_openapi::ErrorBody),
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
    if let Some(name) = &body.display_name {
        check_display_name(name)?;
    }
    let existing = records::model::get(&state.queue, &body.id).await?;
    // Registering again without one keeps the template it had.
    let chat_template = body
        .chat_template
        .or(existing.as_ref().and_then(|m| m.chat_template));
    let asked = Asked {
        roots: &state.config.model_roots,
        storage: &state.config.model_storage,
        template: chat_template.unwrap_or_default(),
        earlier: existing.as_ref(),
        hash_now: false,
    };
    let found = checked_location(&body.location, asked).await?;
    let (location, details, identity) = (found.location, Some(found.details), found.identity);
    // What it is registered as: the folder as found now (its weights hashed again only
    // where a file changed).
    if let Some(existing) = existing {
        if existing.location == location {
            // The same folder again: a new display name if one is given; the id,
            // learning rate and registration time stay.
            let model = BaseModel {
                display_name: body.display_name.or(existing.display_name.clone()),
                details,
                identity,
                chat_template,
                ..existing.clone()
            };
            if model != existing {
                records::model::register(&state.queue, &model).await?;
                hash_unless_known(&state, &model);
            }
            return Ok(HttpResponse::Ok().json(crate::models::base(model)));
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
        display_name: body.display_name,
        details,
        identity,
        chat_template,
        ..BaseModel::new(&body.id, &location, rate)
    };
    records::model::register(&state.queue, &model).await?;
    hash_unless_known(&state, &model);
    Ok(HttpResponse::Created().json(crate::models::base(model)))
}

/// Starts hashing a registered local folder whose identity is not known yet.
fn hash_unless_known(state: &AppState, model: &BaseModel) {
    let local = matches!(
        tuneq_storage::Location::parse(&model.location),
        Ok(tuneq_storage::Location::Local(_))
    );
    if local && model.identity.is_none() {
        hashing::hash_in_background(
            state.queue.clone(),
            model.id.clone(),
            model.location.clone(),
        );
    }
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

/// What registration records of the model at `location` (see [`inspect`]) with the
/// chat template `template`, read through `storage` where it is in a store: its
/// details, and a local folder's identity (its weights hashed unless `earlier`, an
/// earlier registration of it, holds for the folder's stamp); or why it cannot be
/// registered. For models named at start (`--model`), which are registered either way.
pub async fn inspection(
    location: &str,
    template: tuneq_openapi::ChatTemplateChoice,
    earlier: Option<&BaseModel>,
    storage: &tuneq_storage::StorageConfig,
) -> ApiResult<Inspected> {
    let asked = Asked {
        roots: &ModelRoots::default(),
        storage,
        template,
        earlier,
        hash_now: true,
    };
    checked_location(location, asked).await
}

/// What a registration asks of its location: where models may come from, how stores
/// are reached, the chat template it will train with, what an earlier registration of
/// the id found, and whether a local folder's weights are hashed before it answers
/// (else only an earlier hash the folder still matches is kept; see [`hashing`]).
#[derive(Clone, Copy)]
struct Asked<'a> {
    roots: &'a ModelRoots,
    storage: &'a tuneq_storage::StorageConfig,
    template: tuneq_openapi::ChatTemplateChoice,
    earlier: Option<&'a BaseModel>,
    hash_now: bool,
}

/// A display name: 1 to 128 characters, none of them a control character.
fn check_display_name(name: &str) -> ApiResult<()> {
    let length = name.chars().count();
    if (1..=128).contains(&length) && !name.chars().any(char::is_control) {
        return Ok(());
    }
    Err(ApiError::invalid(
        "display_name",
        Code::InvalidValue,
        "display_name is 1 to 128 characters, none of them a control character.",
    ))
}

/// The location as it is registered (a local folder made canonical, a store URI as
/// given) and what its folder showed, checked as [`inspect`] says: a store folder
/// through a local copy of its small files and weight headers ([`remote`]).
async fn checked_location(text: &str, asked: Asked<'_>) -> ApiResult<Inspected> {
    let roots = asked.roots;
    let refused = |message: String| ApiError::invalid("location", Code::InvalidValue, message);
    if !text.contains("://") && !Path::new(text).is_absolute() {
        return Err(refused(
            "A local location is an absolute path (the folder on the machines that run the trainers).".into(),
        ));
    }
    let outside = || {
        refused(format!(
            "The location is outside the places models may be registered from (--model-root): {}.",
            roots.describe()
        ))
    };
    let template = asked.template;
    match tuneq_storage::Location::parse(text) {
        Ok(tuneq_storage::Location::Local(path)) => {
            // Nothing outside the roots is read: checked as written, then resolved.
            if !roots.allows_folder(&path, None) {
                return Err(outside());
            }
            let resolved = std::fs::canonicalize(&path).ok();
            if !roots.allows_folder(&path, resolved.as_deref()) {
                return Err(outside());
            }
            // An earlier hash holds only for the same folder.
            let canonical = resolved.map(|p| p.display().to_string());
            let known = asked
                .earlier
                .filter(|m| Some(&m.location) == canonical.as_ref())
                .and_then(|m| m.identity.clone());
            let hash_now = asked.hash_now;
            crate::blocking::run("the model folder check", move || {
                let mut checked = inspect::inspect(&path, template)?;
                checked.identity = match hash_now {
                    true => Some(inspect::identity(&path, known.as_ref())?),
                    false => inspect::still_known(&path, known.as_ref())?,
                };
                Ok(checked)
            })
            .await?
        }
        Ok(store) if !roots.allows_store(&store) => Err(outside()),
        Ok(store) => {
            let copy = remote::skeleton(&store, asked.storage).await?;
            let check = move || inspect::inspect(copy.path(), template);
            let mut checked = crate::blocking::run("the model folder check", check).await??;
            checked.location = text.to_string();
            Ok(checked)
        }
        Err(e) => Err(refused(e.to_string())),
    }
}
