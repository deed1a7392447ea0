//! Models: base models an operator registered (shared by every tenant) and the adapters
//! a tenant's fine-tunes produced. `GET /v1/models` and `GET /models` list both;
//! `GET /v1/models/{model}` retrieves one. Base
//! models are records ([`crate::records::model`]); fine-tuned ones come from the jobs.

use crate::auth::Tenant;
use crate::error::ApiResult;
use crate::finetunes;
use crate::records;
use crate::refusals::{OperatorsModel, Unauthenticated, UnknownModel};
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use tuneq_openapi::{Deleted, Model, ModelList};

/// A registered base model as the API shows it.
pub(crate) fn base(model: records::model::BaseModel) -> Model {
    Model {
        id: model.id,
        object: "model".into(),
        created: model.created,
        owned_by: "tuneq".into(),
        kind: "base".into(),
        base_model: None,
        fine_tuning_job_id: None,
    }
}

/// The alias `alias` of base model `base` as the API shows it.
fn alias(alias: &str, base: &str, created: u64) -> Model {
    Model {
        id: alias.to_string(),
        object: "model".into(),
        created,
        owned_by: "tuneq".into(),
        kind: "alias".into(),
        base_model: Some(base.to_string()),
        fine_tuning_job_id: None,
    }
}

/// The aliases of `bases`, each with its base model's registration time.
fn aliases_of(state: &AppState, bases: &[Model]) -> Vec<Model> {
    state
        .config
        .model_aliases
        .iter()
        .filter_map(|(name, target)| {
            let base = bases.iter().find(|b| &b.id == target)?;
            Some(alias(name, target, base.created))
        })
        .collect()
}

/// Every base model and alias, then the tenant's fine-tuned models.
#[utoipa::path(get, path = "/v1/models", tag = "models", operation_id = "list_models",
    responses(
        (status = 200, description = "The models", body = ModelList),
        Unauthenticated,
    ))]
pub(crate) async fn list(state: web::Data<AppState>, tenant: Tenant) -> ApiResult<HttpResponse> {
    let mut data: Vec<Model> = records::model::all(&state.queue)
        .await?
        .into_iter()
        .map(base)
        .collect();
    data.extend(aliases_of(&state, &data));
    data.extend(finetunes::fine_tuned_models(&state, &tenant.0).await?);
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list".into(),
        data,
    }))
}

/// One model by its id: a base model, an alias, or one of the tenant's fine-tuned models (as
/// OpenAI's `models.retrieve`). Another tenant's fine-tuned model answers 404, as an
/// unknown one does.
#[utoipa::path(get, path = "/v1/models/{model}", tag = "models", operation_id = "retrieve_model",
    params(("model" = String, Path, description = "A base model's id or a fine-tuned model's name (`ft:…`)")),
    responses(
        (status = 200, description = "The model", body = Model),
        UnknownModel,
    ))]
pub(crate) async fn retrieve(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id = id.into_inner();
    if let Some(model) =
        records::model::resolve(&state.queue, &state.config.model_aliases, &id).await?
    {
        let shown = match model.id == id {
            true => base(model),
            false => alias(&id, &model.id, model.created),
        };
        return Ok(HttpResponse::Ok().json(shown));
    }
    finetunes::fine_tuned_models(&state, &tenant.0)
        .await?
        .into_iter()
        .find(|model| model.id == id)
        .map(|model| HttpResponse::Ok().json(model))
        .ok_or_else(|| crate::error::ApiError::not_found("model", &id))
}

/// Deletes one of the tenant's fine-tuned models (as OpenAI's `models.delete`): its
/// adapter and checkpoints are removed from the store, and the job that trained it
/// stays, with `model_deleted_at`. Base models and aliases are the operator's: 403.
#[utoipa::path(delete, path = "/v1/models/{model}", tag = "models", operation_id = "delete_model",
    params(("model" = String, Path, description = "A fine-tuned model's name (`ft:…`)")),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        (status = 400, description = "An unfinished job continues from the model (`model_in_use`)", body = tuneq_openapi::ErrorBody),
        OperatorsModel,
    ))]
pub(crate) async fn delete(
    state: web::Data<AppState>,
    tenant: Tenant,
    id: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let id = id.into_inner();
    if records::model::resolve(&state.queue, &state.config.model_aliases, &id)
        .await?
        .is_some()
    {
        return Err(crate::error::ApiError::forbidden(format!(
            "`{}` is a base model the operator registered; only fine-tuned models are deleted through the API.",
            crate::quote::shown(&id)
        )));
    }
    finetunes::delete_model(&state, &tenant.0, &id).await?;
    Ok(HttpResponse::Ok().json(Deleted {
        id,
        object: "model".into(),
        deleted: true,
    }))
}
