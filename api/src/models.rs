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
        display_name: model.display_name,
        details: model.details,
    }
}

/// The alias `alias` of the base model `base` (as shown) as the API shows it: with the
/// base's registration time and details.
fn alias(alias: &str, base: &Model) -> Model {
    Model {
        id: alias.to_string(),
        object: "model".into(),
        created: base.created,
        owned_by: "tuneq".into(),
        kind: "alias".into(),
        base_model: Some(base.id.clone()),
        fine_tuning_job_id: None,
        display_name: None,
        details: base.details.clone(),
    }
}

/// The aliases of `bases`.
fn aliases_of(state: &AppState, bases: &[Model]) -> Vec<Model> {
    state
        .config
        .model_aliases
        .iter()
        .filter_map(|(name, target)| {
            let base = bases.iter().find(|b| &b.id == target)?;
            Some(alias(name, base))
        })
        .collect()
}

/// `model` (a base model as [`base`] shows it) with the pools that can hold a fine-tune
/// of it, from its folder's shape (read on the blocking pool, cached) and this
/// service's pools file; as it was when it has no details.
async fn with_fitting_pools(
    state: &AppState,
    record: &records::model::BaseModel,
    mut model: Model,
) -> Model {
    if let Some(details) = model.details.as_mut()
        && let Ok(Some(shape)) = crate::fit::local_shape(record).await
    {
        details.fits_pools = crate::fit::pools_that_fit(state, &shape);
    }
    model
}

/// Every registered base model as the API shows it, with the pools that fit each.
async fn bases(state: &AppState) -> ApiResult<Vec<Model>> {
    let mut out = Vec::new();
    for record in records::model::all(&state.queue).await? {
        let shown = base(record.clone());
        out.push(with_fitting_pools(state, &record, shown).await);
    }
    Ok(out)
}

/// Every base model and alias, then the tenant's fine-tuned models.
#[utoipa::path(get, path = "/v1/models", tag = "models", operation_id = "list_models",
    responses(
        (status = 200, description = "The models", body = ModelList),
        Unauthenticated,
    ))]
pub(crate) async fn list(state: web::Data<AppState>, tenant: Tenant) -> ApiResult<HttpResponse> {
    let mut data = bases(&state).await?;
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
        let base_model = with_fitting_pools(&state, &model, base(model.clone())).await;
        let shown = match base_model.id == id {
            true => base_model,
            false => alias(&id, &base_model),
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
