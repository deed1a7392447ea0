//! Base models an operator registered, shared by every tenant, and the fine-tuned
//! models tenants deleted.

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
    /// A name to show beside the id, if the operator gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// What registration found in a local folder (none for a store location, nor for
    /// models registered before this was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<tuneq_openapi::ModelDetails>,
    /// The hash that fingerprints every run on a local folder, computed once at
    /// registration and handed to its trainers (none for a store location, nor for
    /// models registered before this was recorded: their trainers hash the folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<tuneq_openapi::ModelIdentity>,
    /// The chat template its jobs train with (and its fine-tuned models answer with);
    /// absent: `model`, the folder's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<tuneq_openapi::ChatTemplateChoice>,
}

impl BaseModel {
    /// A model at `location`, registered now, with nothing more known of it.
    pub fn new(id: &str, location: &str, base_learning_rate: f64) -> Self {
        Self {
            id: id.into(),
            location: location.into(),
            base_learning_rate,
            created: super::now_seconds(),
            display_name: None,
            details: None,
            identity: None,
            chat_template: None,
        }
    }

    /// The chat template its jobs train with.
    pub fn template(&self) -> tuneq_openapi::ChatTemplateChoice {
        self.chat_template.unwrap_or_default()
    }
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

/// Records `identity` as the weights' hash of the base model `id` while it is still
/// registered at `location` without it (compare-and-set: a registration or removal
/// made meanwhile wins); whether it was recorded.
pub async fn record_identity(
    catalog: &dyn Catalog,
    id: &str,
    location: &str,
    identity: &tuneq_openapi::ModelIdentity,
) -> ApiResult<bool> {
    loop {
        let Some(entry) = catalog.get_entry(BASE.0, BASE.1, id).await? else {
            return Ok(false);
        };
        let current: BaseModel = super::parse(&entry.body, "model")?;
        if current.location != location || current.identity.is_some() {
            return Ok(false);
        }
        let model = BaseModel {
            identity: Some(identity.clone()),
            ..current
        };
        let body = super::body(&model)?;
        match catalog
            .swap_entry(BASE.0, BASE.1, id, &entry.body, &body)
            .await?
        {
            tuneq_queue::catalog::Swap::Swapped => return Ok(true),
            tuneq_queue::catalog::Swap::Missing => return Ok(false),
            tuneq_queue::catalog::Swap::Changed => continue,
        }
    }
}

/// Removes the base model `id` from the registry; whether it was there.
pub async fn remove(catalog: &dyn Catalog, id: &str) -> ApiResult<bool> {
    if check_identifier("model", id).is_err() {
        return Ok(false);
    }
    let removed = catalog.delete_entry(BASE.0, BASE.1, id).await?;
    Ok(removed)
}

/// The base model `id`, if registered.
pub async fn get(catalog: &dyn Catalog, id: &str) -> ApiResult<Option<BaseModel>> {
    if check_identifier("model", id).is_err() {
        return Ok(None);
    }
    super::read(catalog, BASE, id, "model").await
}

/// The base model `name` stands for: the registered base model of that id, or the one
/// an alias in `aliases` maps it to (see [`crate::ApiConfig::model_aliases`]).
pub async fn resolve(
    catalog: &dyn Catalog,
    aliases: &std::collections::BTreeMap<String, String>,
    name: &str,
) -> ApiResult<Option<BaseModel>> {
    get(catalog, aliases.get(name).map_or(name, String::as_str)).await
}

/// Catalog kind of the fine-tuned models a tenant deleted (owner: the tenant; id: the
/// job that trained it). Kept apart from the job's record, which other writers (the
/// outcome, webhook deliveries) save whole: a deletion is never written over.
const DELETED: &str = "deleted_model";

/// A fine-tuned model its tenant deleted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeletedModel {
    /// The job that trained it.
    pub job: String,
    /// When it was deleted, Unix seconds.
    pub deleted_at: u64,
}

/// Records that `tenant` deleted the fine-tuned model of `job` (a repeat keeps the first
/// time).
pub async fn mark_deleted(
    catalog: &dyn Catalog,
    tenant: &str,
    job: &str,
    at: u64,
) -> ApiResult<()> {
    let body = super::body(&DeletedModel {
        job: job.to_string(),
        deleted_at: at,
    })?;
    catalog.create_entry(DELETED, tenant, job, &body).await?;
    Ok(())
}

/// When `tenant` deleted the fine-tuned model of `job`, if it did.
pub async fn deleted_at(catalog: &dyn Catalog, tenant: &str, job: &str) -> ApiResult<Option<u64>> {
    let found: Option<DeletedModel> =
        super::read(catalog, (DELETED, tenant), job, "deleted model").await?;
    Ok(found.map(|d| d.deleted_at))
}

/// The jobs whose fine-tuned models `tenant` deleted.
pub async fn deleted_jobs(
    catalog: &dyn Catalog,
    tenant: &str,
) -> ApiResult<std::collections::BTreeSet<String>> {
    let all: Vec<DeletedModel> =
        super::read_all(catalog, (DELETED, tenant), "deleted model").await?;
    Ok(all.into_iter().map(|d| d.job).collect())
}

/// Every registered base model.
pub async fn all(catalog: &dyn Catalog) -> ApiResult<Vec<BaseModel>> {
    super::read_all(catalog, BASE, "model").await
}
