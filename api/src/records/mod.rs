//! The floor under the handlers: typed access to the API's records in the catalog.
//!
//! Each record is a catalog entry whose body is the record as JSON. Every function here
//! takes the catalog (and, for a tenant's records, the tenant's id), never `AppState`,
//! so the handlers above share one way of reading and writing each record and nothing
//! here can reach back up into them.
//!
//! - `finetune`: what was asked for a fine-tune, and its outcome once finished.
//! - `file`: uploaded datasets (the record and where its bytes are stored).
//! - `model`: base models an operator registered.
//! - `tenant`: tenants, their limits, and their API keys (stored hashed).

pub mod file;
pub mod finetune;
pub mod model;
pub mod tenant;

use crate::error::{ApiError, ApiResult};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tuneq_queue::Catalog;

/// A record's body as a `T`; a body that does not parse is our fault (500), named by
/// `what`.
pub(crate) fn parse<T: DeserializeOwned>(body: &str, what: &str) -> ApiResult<T> {
    serde_json::from_str(body).map_err(|e| ApiError::internal(format!("{what} record: {e}")))
}

/// A record as the body of its entry.
pub(crate) fn body<T: Serialize>(record: &T) -> ApiResult<String> {
    serde_json::to_string(record).map_err(|e| ApiError::internal(e.to_string()))
}

/// The record (kind, owner, id), if there is one.
pub(crate) async fn read<T: DeserializeOwned>(
    catalog: &dyn Catalog,
    (kind, owner): (&str, &str),
    id: &str,
    what: &str,
) -> ApiResult<Option<T>> {
    match catalog.get_entry(kind, owner, id).await? {
        Some(entry) => parse(&entry.body, what).map(Some),
        None => Ok(None),
    }
}

/// One page of the records of (kind, owner), newest first.
pub(crate) struct Page<T> {
    /// The records on this page.
    pub(crate) records: Vec<T>,
    /// Whether older records follow.
    pub(crate) has_more: bool,
    /// The entry id to read the next page after.
    pub(crate) last_id: Option<String>,
}

/// Up to `limit` records of (kind, owner) created before `after` (None: the newest).
pub(crate) async fn page<T: DeserializeOwned>(
    catalog: &dyn Catalog,
    (kind, owner): (&str, &str),
    after: Option<&str>,
    limit: u32,
    what: &str,
) -> ApiResult<Page<T>> {
    let page = catalog.list_entries(kind, owner, after, limit).await?;
    Ok(Page {
        records: page
            .entries
            .iter()
            .map(|entry| parse(&entry.body, what))
            .collect::<ApiResult<_>>()?,
        has_more: page.has_more,
        last_id: page.entries.last().map(|e| e.id.clone()),
    })
}

/// Every record of (kind, owner), newest first, read a page at a time.
pub(crate) async fn read_all<T: DeserializeOwned>(
    catalog: &dyn Catalog,
    owner_of: (&str, &str),
    what: &str,
) -> ApiResult<Vec<T>> {
    let mut records = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = page(catalog, owner_of, after.as_deref(), 1000, what).await?;
        records.extend(page.records);
        if !page.has_more {
            return Ok(records);
        }
        after = page.last_id;
    }
}

/// Now, in Unix seconds: the clock every record's times are read from.
pub(crate) fn now_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}
