//! Base models an operator registered, shared by every tenant.

use crate::error::{ApiError, ApiResult, Code};
use serde::{Deserialize, Serialize};
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
pub async fn register(catalog: &dyn Catalog, model: &BaseModel) -> ApiResult<()> {
    check_identifier("model", &model.id)
        .map_err(|e| ApiError::invalid("id", Code::InvalidValue, e.to_string()))?;
    let body = super::body(model)?;
    if !catalog
        .create_entry(BASE.0, BASE.1, &model.id, &body)
        .await?
    {
        catalog
            .update_entry(BASE.0, BASE.1, &model.id, &body)
            .await?;
    }
    tracing::info!(model = %model.id, location = %model.location, "base model registered");
    Ok(())
}

/// The base model `id`, if registered.
pub async fn get(catalog: &dyn Catalog, id: &str) -> ApiResult<Option<BaseModel>> {
    if check_identifier("model", id).is_err() {
        return Ok(None);
    }
    super::read(catalog, BASE, id, "model").await
}

/// Every registered base model.
pub async fn all(catalog: &dyn Catalog) -> ApiResult<Vec<BaseModel>> {
    super::read_all(catalog, BASE, "model").await
}
