//! Models: base models an operator registered (shared by every tenant) and the adapters
//! a tenant's fine-tunes produced. `GET /v1/models` and `GET /models` list both;
//! `GET /v1/models/{model}` retrieves one. Base
//! models are records ([`crate::records::model`]); fine-tuned ones come from the jobs.

use crate::auth::Tenant;
use crate::error::ApiResult;
use crate::finetunes;
use crate::records;
use crate::refusals::{Unauthenticated, UnknownModel};
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use tuneq_openapi::{Model, ModelList};

/// A registered base model as the API shows it.
fn base(model: records::model::BaseModel) -> Model {
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

/// Every base model, then the tenant's fine-tuned models.
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
    data.extend(finetunes::fine_tuned_models(&state, &tenant.0).await?);
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list".into(),
        data,
    }))
}

/// One model by its id: a base model, or one of the tenant's fine-tuned models (as
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
    if let Some(model) = records::model::get(&state.queue, &id).await? {
        return Ok(HttpResponse::Ok().json(base(model)));
    }
    finetunes::fine_tuned_models(&state, &tenant.0)
        .await?
        .into_iter()
        .find(|model| model.id == id)
        .map(|model| HttpResponse::Ok().json(model))
        .ok_or_else(|| crate::error::ApiError::not_found("model", &id))
}
