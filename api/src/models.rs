//! Models: base models an operator registered (shared by every tenant) and the adapters
//! a tenant's fine-tunes produced. `GET /v1/models` and `GET /models` list both. Base
//! models are records ([`crate::records::model`]); fine-tuned ones come from the jobs.

use crate::auth::Tenant;
use crate::error::ApiResult;
use crate::finetunes;
use crate::records;
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use tuneq_openapi::{Model, ModelList};

/// Every base model, then the tenant's fine-tuned models.
#[utoipa::path(get, path = "/v1/models", tag = "models", operation_id = "list_models",
    responses(
        (status = 200, description = "The models", body = ModelList),
        (status = 401, description = "No or unknown API key", body = tuneq_openapi::ErrorBody),
    ))]
pub(crate) async fn list(state: web::Data<AppState>, tenant: Tenant) -> ApiResult<HttpResponse> {
    let mut data: Vec<Model> = records::model::all(&state.queue)
        .await?
        .into_iter()
        .map(|model| Model {
            id: model.id,
            object: "model".into(),
            created: model.created,
            owned_by: "tuneq".into(),
            kind: "base".into(),
            base_model: None,
            fine_tuning_job_id: None,
        })
        .collect();
    data.extend(finetunes::fine_tuned_models(&state, &tenant.0).await?);
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list".into(),
        data,
    }))
}
