//! Tenants, their limits, and their API keys. A key (`tq_` + 40 hex characters) is
//! shown once, when it is created; only its SHA-256 is stored, under which the catalog
//! keeps the key's tenant. Each tenant also has an index of its keys by a public id,
//! to list and revoke them by. A revoked key leaves a [`Revocation`] under its hash, so
//! it can never be registered again (not by a restart that passes it once more).

use crate::error::{ApiError, ApiResult, Code};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tuneq_queue::{Catalog, catalog::check_identifier};

/// Catalog kind and owner of API keys (their id is the key's SHA-256).
const KEYS: (&str, &str) = ("apikey", "keys");
/// Catalog kind of a tenant's key index (owner: the tenant; id: the key's public id).
const TENANT_KEYS: &str = "tenantkey";
/// Catalog kind and owner of tenants.
const TENANTS: (&str, &str) = ("tenant", "tenants");
/// Catalog kind and owner of revoked keys' tombstones (their id is the key's SHA-256).
/// One per revocation, which only operators make: bounded by their actions.
const REVOKED: (&str, &str) = ("revokedkey", "keys");

/// What the catalog keeps of a revoked key, under its hash: that it may never come back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Revocation {
    /// The tenant it belonged to.
    pub tenant: String,
    /// Its public id when it was revoked (none for a key made before ids existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// When it was revoked (Unix seconds).
    pub revoked_at: u64,
}

/// What the catalog keeps about a key, under its hash.
#[derive(Debug, Serialize, Deserialize)]
struct KeyRecord {
    tenant: String,
    /// Its public id (a key made before ids existed gets one the next time it is used
    /// or registered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
}

/// What the tenant's key index keeps about a key: enough to list and revoke it, never
/// the key itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct KeyIndexEntry {
    id: String,
    /// The key's SHA-256, to find its record when it is revoked.
    hash: String,
    prefix: String,
    created_at: u64,
}

/// An API key as operators see it: its public id and first characters, never the key.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ApiKeyInfo {
    /// Its public id (`key_…`), to revoke it by.
    pub id: String,
    /// Its tenant.
    pub tenant: String,
    /// The key's first characters (`tq_1a2b…`), to recognise it.
    pub prefix: String,
    /// When it was created (Unix seconds; 0 for keys made before this was recorded).
    pub created_at: u64,
}

fn new_key_id() -> String {
    format!("key_{}", hex::encode(rand::random::<[u8; 8]>()))
}

/// The first characters of `key`, safe to show: a quarter of it at most, so the rest
/// stays secret.
fn key_prefix(key: &str) -> String {
    let shown: String = key.chars().take((key.chars().count() / 4).min(8)).collect();
    format!("{shown}…")
}

/// A tenant.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct TenantRecord {
    /// Its id (`[A-Za-z0-9._-]{1,128}`).
    pub id: String,
    /// A display name.
    pub name: String,
    /// Its limits (none by default).
    #[serde(default)]
    pub limits: TenantLimits,
}

/// What one tenant may use. Unset limits do not apply.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    /// Jobs it may have waiting; creating one more answers 429 with `retry-after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued: Option<u32>,
    /// Jobs (accelerators) it may run at once; the rest wait in line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u32>,
    /// Largest upload in bytes (at most the server's limit); a larger one answers 429
    /// (`tenant_upload_limit`, with `retry-after`), like the other quotas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_upload_bytes: Option<u64>,
    /// Files it may keep; an upload beyond answers 429 (`tenant_storage_quota`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_files: Option<u64>,
    /// Bytes of files it may keep; an upload that would pass it answers 429
    /// (`tenant_storage_quota`). Uploads in flight at the same moment may overshoot by
    /// at most the per-tenant uploads at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_stored_bytes: Option<u64>,
    /// Its share of capacity against other tenants' (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

impl TenantLimits {
    /// These limits with `defaults` for each one left unset: what applies to the tenant.
    /// The server's defaults bound every tenant an operator has not set otherwise, so a
    /// new tenant cannot fill the disk with jobs or files before anyone looks.
    pub fn or(&self, defaults: &TenantLimits) -> TenantLimits {
        TenantLimits {
            max_queued: self.max_queued.or(defaults.max_queued),
            max_running: self.max_running.or(defaults.max_running),
            max_upload_bytes: self.max_upload_bytes.or(defaults.max_upload_bytes),
            max_files: self.max_files.or(defaults.max_files),
            max_stored_bytes: self.max_stored_bytes.or(defaults.max_stored_bytes),
            weight: self.weight.or(defaults.weight),
        }
    }

    /// What the queue enforces of them (jobs waiting and running, fair-share weight).
    pub fn queue_settings(&self) -> tuneq_queue::TenantSettings {
        tuneq_queue::TenantSettings {
            weight: self.weight.unwrap_or(1.0),
            max_running: self.max_running,
            max_waiting: self.max_queued,
        }
    }
}

/// The SHA-256 of a key, hex: what is stored and looked up.
pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// A new random key.
pub fn new_key() -> String {
    format!("tq_{}", hex::encode(rand::random::<[u8; 20]>()))
}

/// Guesses (as a power of ten) a key chosen by a person must need at least, by the
/// zxcvbn estimate (which knows repeats, sequences, keyboard walks and common words):
/// 10¹² is decades at the failed-authentication rate ([`crate::throttle`]) of one
/// source, and what a word or two with digits reaches. Generated keys are far above.
pub const MIN_KEY_GUESSES_LOG10: f64 = 12.0;

/// Characters of a key the strength estimate looks at (it grows faster than linearly
/// with the length; a longer key is only stronger).
const STRENGTH_PREFIX: usize = 128;

/// A key a person chose that is too easy to guess.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "the key is too easy to guess (about 10^{guesses_log10:.0} guesses; at least 10^{:.0} are needed): use a generated one, e.g. `openssl rand -hex 32`",
    MIN_KEY_GUESSES_LOG10
)]
pub struct WeakKey {
    /// The estimate of guesses it needs, as a power of ten.
    pub guesses_log10: f64,
}

/// Whether `key` (an API or admin key given by an operator) is hard enough to guess.
pub fn check_strength(key: &str) -> Result<(), WeakKey> {
    let looked_at: String = key.chars().take(STRENGTH_PREFIX).collect();
    let guesses_log10 = zxcvbn::zxcvbn(&looked_at, &[]).guesses_log10();
    if guesses_log10 >= MIN_KEY_GUESSES_LOG10 {
        Ok(())
    } else {
        Err(WeakKey { guesses_log10 })
    }
}

/// What [`create_tenant`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Creation {
    /// The tenant is new.
    Created(TenantRecord),
    /// It was there already, and is left as it was.
    Existing(TenantRecord),
}

/// Creates a tenant (idempotent: an existing one is left and returned as it is).
pub async fn create_tenant(catalog: &dyn Catalog, id: &str, name: &str) -> ApiResult<Creation> {
    check_identifier("tenant", id).map_err(ApiError::from)?;
    let record = TenantRecord {
        id: id.to_string(),
        name: name.to_string(),
        limits: TenantLimits::default(),
    };
    let body = serde_json::to_string(&record).map_err(|e| ApiError::internal(e.to_string()))?;
    if !catalog
        .create_entry(TENANTS.0, TENANTS.1, id, &body)
        .await?
    {
        return get(catalog, id)
            .await?
            .map(Creation::Existing)
            .ok_or_else(|| ApiError::internal("tenant vanished while being created"));
    }
    tracing::info!(tenant = id, "tenant created");
    Ok(Creation::Created(record))
}

/// Every tenant.
pub async fn all(catalog: &dyn Catalog) -> ApiResult<Vec<TenantRecord>> {
    super::read_all(catalog, TENANTS, "tenant").await
}

/// The tenant, if it exists.
pub async fn get(catalog: &dyn Catalog, id: &str) -> ApiResult<Option<TenantRecord>> {
    super::read(catalog, TENANTS, id, "tenant").await
}

/// Registers `key` (given, or new when None) for `tenant` and returns it. The key is
/// stored only as its hash, and listed in the tenant's key index by a public id.
pub async fn add_key(
    catalog: &dyn Catalog,
    tenant_id: &str,
    key: Option<&str>,
) -> ApiResult<String> {
    if get(catalog, tenant_id).await?.is_none() {
        return Err(ApiError::not_found("tenant", tenant_id));
    }
    let key = key.map_or_else(new_key, str::to_string);
    if key.len() < 16 {
        return Err(ApiError::invalid(
            "api_key",
            Code::KeyTooShort,
            "API keys must be at least 16 characters.",
        ));
    }
    if let Err(weak) = check_strength(&key) {
        return Err(ApiError::invalid(
            "api_key",
            Code::KeyTooWeak,
            weak.to_string(),
        ));
    }
    let hash = key_hash(&key);
    if let Some(revoked) = revocation(catalog, &key).await? {
        return Err(ApiError::invalid(
            "api_key",
            Code::KeyRevoked,
            format!(
                "This API key was revoked (at {} Unix time) and cannot be registered again; use a new key.",
                revoked.revoked_at
            ),
        ));
    }
    let id = new_key_id();
    let body = serde_json::to_string(&KeyRecord {
        tenant: tenant_id.to_string(),
        id: Some(id.clone()),
    })
    .map_err(|e| ApiError::internal(e.to_string()))?;
    if catalog.create_entry(KEYS.0, KEYS.1, &hash, &body).await? {
        index_key(catalog, tenant_id, &id, &hash, &key).await?;
        return Ok(key);
    }
    match read_key(catalog, &hash).await? {
        Some(record) if record.tenant == tenant_id => {
            if record.id.is_none() {
                backfill_index(catalog, &hash, &key_prefix(&key)).await?;
            }
            Ok(key)
        }
        _ => Err(ApiError::invalid(
            "api_key",
            Code::KeyInUse,
            "This API key already belongs to another tenant.",
        )),
    }
}

/// Lists key `id` (whose hash is `hash`) in its tenant's index.
async fn index_key(
    catalog: &dyn Catalog,
    tenant_id: &str,
    id: &str,
    hash: &str,
    key: &str,
) -> ApiResult<()> {
    let entry = KeyIndexEntry {
        id: id.to_string(),
        hash: hash.to_string(),
        prefix: key_prefix(key),
        created_at: super::now_seconds(),
    };
    let body = serde_json::to_string(&entry).map_err(|e| ApiError::internal(e.to_string()))?;
    catalog
        .create_entry(TENANT_KEYS, tenant_id, id, &body)
        .await?;
    Ok(())
}

/// Gives a key made before key ids existed an id and an index entry, so it can be listed
/// and revoked like any other.
async fn backfill_index(catalog: &dyn Catalog, hash: &str, prefix: &str) -> ApiResult<()> {
    let Some(mut record) = read_key(catalog, hash).await? else {
        return Ok(());
    };
    if record.id.is_some() {
        return Ok(());
    }
    let id = new_key_id();
    record.id = Some(id.clone());
    let entry = KeyIndexEntry {
        id: id.clone(),
        hash: hash.to_string(),
        prefix: prefix.to_string(),
        created_at: 0,
    };
    let body = serde_json::to_string(&entry).map_err(|e| ApiError::internal(e.to_string()))?;
    catalog
        .create_entry(TENANT_KEYS, &record.tenant, &id, &body)
        .await?;
    let body = serde_json::to_string(&record).map_err(|e| ApiError::internal(e.to_string()))?;
    catalog.update_entry(KEYS.0, KEYS.1, hash, &body).await?;
    Ok(())
}

/// The tenant's keys, newest first (ids and prefixes; the keys themselves are not kept).
pub async fn list_keys(catalog: &dyn Catalog, tenant_id: &str) -> ApiResult<Vec<ApiKeyInfo>> {
    if get(catalog, tenant_id).await?.is_none() {
        return Err(ApiError::not_found("tenant", tenant_id));
    }
    let entries: Vec<KeyIndexEntry> =
        super::read_all(catalog, (TENANT_KEYS, tenant_id), "key index").await?;
    Ok(entries
        .into_iter()
        .map(|e| ApiKeyInfo {
            id: e.id,
            tenant: tenant_id.to_string(),
            prefix: e.prefix,
            created_at: e.created_at,
        })
        .collect())
}

/// Revokes the tenant's key `key_id`: it stops working at once in this process, and
/// within `key_cache::TTL` in every other API process.
pub async fn revoke_key(
    catalog: &dyn Catalog,
    tenant_id: &str,
    key_id: &str,
) -> ApiResult<ApiKeyInfo> {
    if check_identifier("key", key_id).is_err() {
        return Err(ApiError::not_found("API key", key_id));
    }
    let entry: KeyIndexEntry = super::read(catalog, (TENANT_KEYS, tenant_id), key_id, "key index")
        .await?
        .ok_or_else(|| ApiError::not_found("API key", key_id))?;
    // The tombstone first: a crash after it leaves a key that is revoked twice over,
    // never one that can come back.
    record_revocation(catalog, &entry.hash, tenant_id, Some(key_id)).await?;
    catalog.delete_entry(KEYS.0, KEYS.1, &entry.hash).await?;
    key_cache::evict(&entry.hash);
    catalog.delete_entry(TENANT_KEYS, tenant_id, key_id).await?;
    tracing::info!(tenant = tenant_id, key = key_id, "API key revoked");
    Ok(ApiKeyInfo {
        id: entry.id,
        tenant: tenant_id.to_string(),
        prefix: entry.prefix,
        created_at: entry.created_at,
    })
}

/// Revokes `key` itself if it belongs to `tenant_id` (for `tuneq up --api-key`, which
/// retires the key it replaces). Whether there was such a key.
pub async fn revoke_key_value(
    catalog: &dyn Catalog,
    tenant_id: &str,
    key: &str,
) -> ApiResult<bool> {
    let hash = key_hash(key);
    let Some(record) = read_key(catalog, &hash).await? else {
        return Ok(false);
    };
    if record.tenant != tenant_id {
        return Ok(false);
    }
    if let Some(id) = &record.id {
        revoke_key(catalog, tenant_id, id).await?;
    } else {
        record_revocation(catalog, &hash, tenant_id, None).await?;
        catalog.delete_entry(KEYS.0, KEYS.1, &hash).await?;
        key_cache::evict(&hash);
    }
    Ok(true)
}

/// Leaves the tombstone of the key whose hash is `hash` (kept if one is there already).
async fn record_revocation(
    catalog: &dyn Catalog,
    hash: &str,
    tenant_id: &str,
    key_id: Option<&str>,
) -> ApiResult<()> {
    let tombstone = Revocation {
        tenant: tenant_id.to_string(),
        key_id: key_id.map(str::to_string),
        revoked_at: super::now_seconds(),
    };
    catalog
        .create_entry(REVOKED.0, REVOKED.1, hash, &super::body(&tombstone)?)
        .await?;
    Ok(())
}

/// The revocation of `key`, if it was ever revoked: such a key is refused for good.
pub async fn revocation(catalog: &dyn Catalog, key: &str) -> ApiResult<Option<Revocation>> {
    super::read(catalog, REVOKED, &key_hash(key), "key revocation").await
}

async fn read_key(catalog: &dyn Catalog, hash: &str) -> ApiResult<Option<KeyRecord>> {
    super::read(catalog, KEYS, hash, "key").await
}

/// The tenant of API key `key`, if it is a key we know. Keys looked up lately are
/// answered from this process's memory (see [`key_cache`]); a key made before key ids
/// existed is given one on the way.
pub(crate) async fn tenant_of_key(catalog: &dyn Catalog, key: &str) -> ApiResult<Option<String>> {
    let hash = key_hash(key);
    if let Some(tenant) = key_cache::get(&hash) {
        return Ok(Some(tenant));
    }
    let Some(record) = read_key(catalog, &hash).await? else {
        return Ok(None);
    };
    if record.id.is_none()
        && let Err(e) = backfill_index(catalog, &hash, &key_prefix(key)).await
    {
        tracing::warn!(error = %e, "cannot give an older API key its id");
    }
    key_cache::put(&hash, &record.tenant);
    Ok(Some(record.tenant))
}

/// Whether the key whose SHA-256 is `hash` still belongs to `tenant_id`, asked of the
/// catalog itself rather than this process's [`key_cache`], so a revocation made through
/// any API process is seen: what an open event stream checks every so often.
pub(crate) async fn key_is_live(
    catalog: &dyn Catalog,
    hash: &str,
    tenant_id: &str,
) -> ApiResult<bool> {
    Ok(read_key(catalog, hash)
        .await?
        .is_some_and(|record| record.tenant == tenant_id))
}

/// Writes the tenant's record back (its limits changed).
pub(crate) async fn update(catalog: &dyn Catalog, record: &TenantRecord) -> ApiResult<()> {
    catalog
        .update_entry(TENANTS.0, TENANTS.1, &record.id, &super::body(record)?)
        .await?;
    Ok(())
}

/// Keys already looked up, so most requests make no catalog read to authenticate. Only
/// known keys are kept (an unknown one is looked up every time), for at most
/// [`key_cache::TTL`], and at most [`key_cache::CAPACITY`] of them.
mod key_cache {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use std::time::{Duration, Instant};

    /// How long a looked-up key is trusted without asking the catalog again: how long a
    /// key revoked through another API process may still work in this one.
    pub const TTL: Duration = Duration::from_secs(10);
    /// Keys kept at most; the cache is emptied when full.
    pub const CAPACITY: usize = 10_000;

    fn cache() -> &'static Mutex<HashMap<String, (String, Instant)>> {
        static CACHE: OnceLock<Mutex<HashMap<String, (String, Instant)>>> = OnceLock::new();
        CACHE.get_or_init(Default::default)
    }

    /// The tenant of key hash `hash`, if it was looked up within the TTL.
    pub fn get(hash: &str) -> Option<String> {
        let cache = cache().lock().ok()?;
        cache
            .get(hash)
            .filter(|(_, at)| at.elapsed() < TTL)
            .map(|(tenant, _)| tenant.clone())
    }

    /// Forgets `hash` (its key was revoked).
    pub fn evict(hash: &str) {
        if let Ok(mut cache) = cache().lock() {
            cache.remove(hash);
        }
    }

    /// Remembers that `hash` belongs to `tenant`.
    pub fn put(hash: &str, tenant: &str) {
        if let Ok(mut cache) = cache().lock() {
            if cache.len() >= CAPACITY {
                cache.clear();
            }
            cache.insert(hash.to_string(), (tenant.to_string(), Instant::now()));
        }
    }
}
