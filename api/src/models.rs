//! Models: base models an operator registered (shared by every tenant) and the adapters
//! a tenant's fine-tunes produced. `GET /v1/models` and `GET /models` list both.

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult};
use crate::finetunes;
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};
use tuneq_openapi::{Model, ModelList};
use tuneq_queue::Catalog;
use tuneq_queue::catalog::check_identifier;

/// Catalog kind and owner of base models.
const BASE: (&str, &str) = ("model", "_base");

/// A registered base model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaseModel {
    /// The name clients fine-tune from (`[A-Za-z0-9._-]{1,128}`).
    pub id: String,
    /// Its Hugging Face–layout folder: a local path or a `file://`, `s3://`, `gs://` URI.
    pub location: String,
    /// Peak learning rate at `learning_rate_multiplier` 1.
    pub base_learning_rate: f64,
    /// When it was registered, Unix seconds.
    pub created: u64,
}

/// Registers (or re-points) a base model.
pub async fn register_base(state: &AppState, model: &BaseModel) -> ApiResult<()> {
    check_identifier("model", &model.id)
        .map_err(|e| ApiError::invalid("id", "invalid_value", e.to_string()))?;
    let body = serde_json::to_string(model).map_err(|e| ApiError::internal(e.to_string()))?;
    if !state
        .queue
        .create_entry(BASE.0, BASE.1, &model.id, &body)
        .await?
    {
        state
            .queue
            .update_entry(BASE.0, BASE.1, &model.id, &body)
            .await?;
    }
    tracing::info!(model = %model.id, location = %model.location, "base model registered");
    Ok(())
}

/// The base model `id`, if registered.
pub async fn base(state: &AppState, id: &str) -> ApiResult<Option<BaseModel>> {
    if check_identifier("model", id).is_err() {
        return Ok(None);
    }
    crate::records::read(state, BASE, id, "model").await
}

/// Every registered base model.
pub async fn bases(state: &AppState) -> ApiResult<Vec<BaseModel>> {
    crate::records::read_all(state, BASE, "model").await
}

/// Routes, under both prefixes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(crate::resource("/v1/models", "GET").route(web::get().to(list)))
        .service(crate::resource("/models", "GET").route(web::get().to(list)));
}

/// Every base model, then the tenant's fine-tuned models.
#[utoipa::path(get, path = "/v1/models", tag = "models", operation_id = "list_models",
    responses(
        (status = 200, description = "The models", body = ModelList),
        (status = 401, description = "No or unknown API key", body = tuneq_openapi::ErrorBody),
    ))]
pub(crate) async fn list(state: web::Data<AppState>, tenant: Tenant) -> ApiResult<HttpResponse> {
    let mut data: Vec<Model> = bases(&state)
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
