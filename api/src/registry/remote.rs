//! A model folder in an object store, checked as a local one is: its small files
//! (config, tokenizer, chat template, shard index) and each weight file's safetensors
//! header — two ranged reads, never a tensor — are copied into a temporary folder of the
//! same layout, which [`super::inspect`] then reads. Every read is bounded; a file the
//! store lacks is left out, for the check to name.

use crate::error::{ApiError, ApiResult, Code};
use std::path::Path;
use tuneq_pools::folder;
use tuneq_storage::{GetRange, Location, ObjectKey, ObjectStore, StorageConfig};

/// The files read whole, with the most each may be (the bounds the local readers
/// keep: config 1 MiB, the tokenizer 64 MiB, the shard index 16 MiB).
const WHOLE: [(&str, u64); 5] = [
    ("config.json", 1 << 20),
    ("tokenizer.json", 64 << 20),
    ("tokenizer_config.json", 16 << 20),
    ("chat_template.jinja", 1 << 20),
    (folder::INDEX, 16 << 20),
];

/// The largest safetensors header read, as for a local folder.
const HEADER_LIMIT: u64 = 16 << 20;

/// The most weight files a folder's index may name (real ones: a few hundred at most).
const MAX_SHARDS: usize = 1024;

/// The most header bytes read from one folder's weight files in all.
const HEADERS_LIMIT: u64 = 256 << 20;

/// The folder at `location` as a temporary local one: what registration reads of it.
pub(super) async fn skeleton(
    location: &Location,
    config: &StorageConfig,
) -> ApiResult<tempfile::TempDir> {
    let store = tuneq_storage::open(location, config)
        .await
        .map_err(|e| unreadable("the store", &e))?;
    let dir = tempfile::tempdir().map_err(|e| ApiError::internal(format!("temp dir: {e}")))?;
    for (name, limit) in WHOLE {
        if let Some(bytes) = read_whole(store.as_ref(), name, limit).await? {
            write(dir.path(), name, &bytes)?;
        }
    }
    // The weight files the index names (or the single one): their headers only.
    let names = match folder::shard_names(dir.path()) {
        Ok(shards) if !shards.is_empty() => shards,
        _ => vec![folder::SINGLE.to_string()],
    };
    if names.len() > MAX_SHARDS {
        return Err(ApiError::invalid(
            "location",
            Code::InvalidValue,
            format!(
                "{} names {} weight files, more than the {MAX_SHARDS} read of a folder.",
                folder::INDEX,
                names.len()
            ),
        ));
    }
    let mut budget = HEADERS_LIMIT;
    for name in names {
        // A shard named by a path is never read; the check names it.
        if name.contains('/') || name.contains('\\') || name == ".." {
            continue;
        }
        if let Some(header) = read_header(store.as_ref(), &name).await? {
            budget = budget.checked_sub(header.len() as u64).ok_or_else(|| {
                ApiError::invalid(
                    "location",
                    Code::InvalidValue,
                    format!("The weight files' headers add up to more than the {HEADERS_LIMIT} bytes read of a folder."),
                )
            })?;
            write(dir.path(), &name, &header)?;
        }
    }
    Ok(dir)
}

/// The object `name`, whole, or None where the store lacks it; one larger than
/// `limit` is refused naming it.
async fn read_whole(store: &dyn ObjectStore, name: &str, limit: u64) -> ApiResult<Option<Vec<u8>>> {
    let Some(size) = size_of(store, name).await? else {
        return Ok(None);
    };
    if size > limit {
        return Err(ApiError::invalid(
            "location",
            Code::InvalidValue,
            format!("{name} is {size} bytes, more than the {limit} read of it."),
        ));
    }
    read_range(store, name, 0, size).await.map(Some)
}

/// The first bytes of the safetensors file `name`: its 8-byte length and, where that
/// is within [`HEADER_LIMIT`], the header (a longer one is left for the check to name).
async fn read_header(store: &dyn ObjectStore, name: &str) -> ApiResult<Option<Vec<u8>>> {
    let Some(size) = size_of(store, name).await? else {
        return Ok(None);
    };
    if size < 8 {
        return Ok(Some(Vec::new()));
    }
    let mut bytes = read_range(store, name, 0, 8).await?;
    let length = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
    if length <= HEADER_LIMIT {
        let end = 8u64.saturating_add(length).min(size);
        bytes.extend(read_range(store, name, 8, end).await?);
    }
    Ok(Some(bytes))
}

/// The size of `name`, None where the store lacks it.
async fn size_of(store: &dyn ObjectStore, name: &str) -> ApiResult<Option<u64>> {
    match store.head(&key(name)?).await {
        Ok(meta) => Ok(Some(meta.size)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(unreadable(name, &e)),
    }
}

/// Bytes `start..end` of `name`.
async fn read_range(
    store: &dyn ObjectStore,
    name: &str,
    start: u64,
    end: u64,
) -> ApiResult<Vec<u8>> {
    if start >= end {
        return Ok(Vec::new());
    }
    let object = store
        .get(&key(name)?, Some(GetRange::Bounded { start, end }))
        .await
        .map_err(|e| unreadable(name, &e))?;
    let bytes = tuneq_storage::collect(object.body)
        .await
        .map_err(|e| unreadable(name, &e))?;
    Ok(bytes.to_vec())
}

fn key(name: &str) -> ApiResult<ObjectKey> {
    ObjectKey::parse(name)
        .map_err(|e| ApiError::invalid("location", Code::InvalidValue, format!("{name}: {e}")))
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> ApiResult<()> {
    std::fs::write(dir.join(name), bytes)
        .map_err(|e| ApiError::internal(format!("temp copy of {name}: {e}")))
}

/// A store that could not be read: 503 where trying again may help, else a 400 on
/// `location` naming the file and the store's answer (credentials, a missing bucket).
fn unreadable(what: &str, e: &tuneq_storage::Error) -> ApiError {
    if e.is_retryable() {
        return ApiError::unavailable(format!("{what} could not be read from the store: {e}"));
    }
    ApiError::invalid(
        "location",
        Code::InvalidValue,
        format!("{what} cannot be read from the store: {e}"),
    )
}
