//! Uploaded datasets: the record of each (a [`FileObject`]) and where its bytes are
//! stored (`tenants/<tenant>/files/<file>/content.jsonl`).

use crate::error::{ApiError, ApiResult};
use tuneq_openapi::FileObject;
use tuneq_queue::Catalog;
use tuneq_storage::ObjectKey;
use tuneq_storage::layout::{self, Id};

/// Catalog kind of files.
const KIND: &str = "file";

/// The storage key of a file's bytes.
pub(crate) fn content_key(tenant: &str, file: &str) -> ApiResult<ObjectKey> {
    let tenant =
        Id::parse(tenant).map_err(|_| ApiError::internal("tenant id is not a storage id"))?;
    let file = Id::parse(file).map_err(|_| ApiError::not_found("file", file))?;
    layout::tenant_file(&tenant, &file)
        .join("content.jsonl")
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// The tenant's file `id`, if there is one (None too for a malformed id).
pub(crate) async fn get(
    catalog: &dyn Catalog,
    tenant: &str,
    id: &str,
) -> ApiResult<Option<FileObject>> {
    if tuneq_queue::catalog::check_identifier("id", id).is_err() {
        return Ok(None);
    }
    super::read(catalog, (KIND, tenant), id, "file").await
}

/// The tenant's file `id`, or 404 (also for another tenant's id or a malformed one).
pub(crate) async fn find(catalog: &dyn Catalog, tenant: &str, id: &str) -> ApiResult<FileObject> {
    get(catalog, tenant, id)
        .await?
        .ok_or_else(|| ApiError::not_found("file", id))
}

/// Every file of the tenant, newest first.
pub(crate) async fn all(catalog: &dyn Catalog, tenant: &str) -> ApiResult<Vec<FileObject>> {
    super::read_all(catalog, (KIND, tenant), "file").await
}

/// How many files the tenant keeps.
pub(crate) async fn count(catalog: &dyn Catalog, tenant: &str) -> ApiResult<u64> {
    Ok(catalog.count_entries(KIND, tenant).await?)
}

/// A page of the tenant's files, newest first, after the file `after`.
pub(crate) async fn page(
    catalog: &dyn Catalog,
    tenant: &str,
    after: Option<&str>,
    limit: u32,
) -> ApiResult<super::Page<FileObject>> {
    super::page(catalog, (KIND, tenant), after, limit, "file").await
}

/// Records a new file (whose id is fresh, so it cannot be taken).
pub(crate) async fn create(
    catalog: &dyn Catalog,
    tenant: &str,
    file: &FileObject,
) -> ApiResult<()> {
    catalog
        .create_entry(KIND, tenant, &file.id, &super::body(file)?)
        .await?;
    Ok(())
}

/// Forgets the tenant's file `id` (its bytes are the caller's to delete).
pub(crate) async fn delete(catalog: &dyn Catalog, tenant: &str, id: &str) -> ApiResult<()> {
    catalog.delete_entry(KIND, tenant, id).await?;
    Ok(())
}
