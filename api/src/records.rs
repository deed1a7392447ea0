//! Reading the API's records (tenants, keys, files, fine-tunes, models) from the
//! catalog: each is an entry whose body is the record as JSON.

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use serde::de::DeserializeOwned;
use tuneq_queue::Catalog;

/// A record's body as a `T`; a body that does not parse is our fault (500), named by
/// `what`.
pub(crate) fn parse<T: DeserializeOwned>(body: &str, what: &str) -> ApiResult<T> {
    serde_json::from_str(body).map_err(|e| ApiError::internal(format!("{what} record: {e}")))
}

/// The record (kind, owner, id), if there is one.
pub(crate) async fn read<T: DeserializeOwned>(
    state: &AppState,
    (kind, owner): (&str, &str),
    id: &str,
    what: &str,
) -> ApiResult<Option<T>> {
    match state.queue.get_entry(kind, owner, id).await? {
        Some(entry) => parse(&entry.body, what).map(Some),
        None => Ok(None),
    }
}

/// Every record of (kind, owner), newest first, read a page at a time.
pub(crate) async fn read_all<T: DeserializeOwned>(
    state: &AppState,
    (kind, owner): (&str, &str),
    what: &str,
) -> ApiResult<Vec<T>> {
    let mut records = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = state
            .queue
            .list_entries(kind, owner, after.as_deref(), 1000)
            .await?;
        for entry in &page.entries {
            records.push(parse(&entry.body, what)?);
        }
        if !page.has_more {
            return Ok(records);
        }
        after = page.entries.last().map(|e| e.id.clone());
    }
}
