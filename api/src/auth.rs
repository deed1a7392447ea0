//! Tenants and API keys. A key (`tq_` + 40 hex characters) is shown once, when it is
//! created; only its SHA-256 is stored, in the catalog. Every route but health and the
//! spec needs `Authorization: Bearer <key>`; the key decides the tenant, and every
//! object a handler touches is looked up under that tenant.

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use actix_web::{FromRequest, HttpRequest, web};
use futures::future::LocalBoxFuture;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tuneq_queue::{Catalog, JobQueue, catalog::check_identifier};

/// Catalog kind and owner of API keys (their id is the key's SHA-256).
const KEYS: (&str, &str) = ("apikey", "keys");
/// Catalog kind and owner of tenants.
const TENANTS: (&str, &str) = ("tenant", "tenants");

/// What the catalog keeps about a key.
#[derive(Debug, Serialize, Deserialize)]
struct KeyRecord {
    tenant: String,
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
    /// Its share of capacity against other tenants' (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// The SHA-256 of a key, hex: what is stored and looked up.
pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// A new random key.
pub fn new_key() -> String {
    format!("tq_{}", hex::encode(rand::random::<[u8; 20]>()))
}

/// Creates a tenant (idempotent: an existing one is returned as it is).
pub async fn create_tenant(state: &AppState, id: &str, name: &str) -> ApiResult<TenantRecord> {
    check_identifier("tenant", id).map_err(ApiError::from)?;
    let record = TenantRecord {
        id: id.to_string(),
        name: name.to_string(),
        limits: TenantLimits::default(),
    };
    let body = serde_json::to_string(&record).map_err(|e| ApiError::internal(e.to_string()))?;
    if !state
        .queue
        .create_entry(TENANTS.0, TENANTS.1, id, &body)
        .await?
    {
        return tenant(state, id)
            .await?
            .ok_or_else(|| ApiError::internal("tenant vanished while being created"));
    }
    tracing::info!(tenant = id, "tenant created");
    Ok(record)
}

/// The tenant, if it exists.
pub async fn tenant(state: &AppState, id: &str) -> ApiResult<Option<TenantRecord>> {
    crate::records::read(state, TENANTS, id, "tenant").await
}

/// Sets a tenant's limits: kept in its record and given to the queue, which enforces
/// the queued and running ones atomically with enqueue and claim.
pub async fn set_limits(
    state: &AppState,
    id: &str,
    limits: TenantLimits,
) -> ApiResult<TenantRecord> {
    let mut record = tenant(state, id)
        .await?
        .ok_or_else(|| ApiError::not_found("tenant", id))?;
    if let Some(w) = limits.weight
        && !(w > 0.0 && w <= 1000.0)
    {
        return Err(ApiError::invalid(
            "weight",
            "invalid_value",
            "weight must be above 0 and at most 1000.",
        ));
    }
    state
        .queue
        .set_tenant(
            id,
            &tuneq_queue::TenantSettings {
                weight: limits.weight.unwrap_or(1.0),
                max_running: limits.max_running,
                max_waiting: limits.max_queued,
            },
        )
        .await?;
    record.limits = limits;
    let body = serde_json::to_string(&record).map_err(|e| ApiError::internal(e.to_string()))?;
    state
        .queue
        .update_entry(TENANTS.0, TENANTS.1, id, &body)
        .await?;
    tracing::info!(tenant = id, limits = ?record.limits, "tenant limits set");
    Ok(record)
}

/// Registers `key` (given, or new when None) for `tenant` and returns it. The key is
/// stored only as its hash.
pub async fn add_key(state: &AppState, tenant_id: &str, key: Option<&str>) -> ApiResult<String> {
    if tenant(state, tenant_id).await?.is_none() {
        return Err(ApiError::not_found("tenant", tenant_id));
    }
    let key = key.map_or_else(new_key, str::to_string);
    if key.len() < 16 {
        return Err(ApiError::invalid(
            "api_key",
            "key_too_short",
            "API keys must be at least 16 characters.",
        ));
    }
    let body = serde_json::to_string(&KeyRecord {
        tenant: tenant_id.to_string(),
    })
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let hash = key_hash(&key);
    if !state
        .queue
        .create_entry(KEYS.0, KEYS.1, &hash, &body)
        .await?
    {
        let owner = owner_of(state, &hash).await?;
        if owner.as_deref() != Some(tenant_id) {
            return Err(ApiError::invalid(
                "api_key",
                "key_in_use",
                "This API key already belongs to another tenant.",
            ));
        }
    }
    Ok(key)
}

async fn owner_of(state: &AppState, hash: &str) -> ApiResult<Option<String>> {
    let record: Option<KeyRecord> = crate::records::read(state, KEYS, hash, "key").await?;
    Ok(record.map(|r| r.tenant))
}

fn bearer(req: &HttpRequest) -> ApiResult<String> {
    let header = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .ok_or_else(|| {
            ApiError::unauthenticated(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            )
        })?;
    let value = header
        .to_str()
        .map_err(|_| ApiError::unauthenticated("The Authorization header is not valid text."))?;
    let key = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            ApiError::unauthenticated("The Authorization header must be `Bearer <key>`.")
        })?;
    Ok(key.to_string())
}

/// The tenant a request acts for, from its API key.
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

impl FromRequest for Tenant {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let state = req.app_data::<web::Data<AppState>>().cloned();
        let key = bearer(req);
        Box::pin(async move {
            let state = state.ok_or_else(|| ApiError::internal("no application state"))?;
            let hash = key_hash(&key?);
            if let Some(tenant) = key_cache::get(&hash) {
                return Ok(Tenant(tenant));
            }
            match owner_of(&state, &hash).await? {
                Some(tenant) => {
                    key_cache::put(&hash, &tenant);
                    Ok(Tenant(tenant))
                }
                None => Err(ApiError::unauthenticated(
                    "Incorrect API key provided. Keys are created with `tuneq up` or the admin API.",
                )),
            }
        })
    }
}

/// An operator: the request carries the admin key from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequest for Admin {
    type Error = ApiError;
    type Future = std::future::Ready<Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let expected = req
            .app_data::<web::Data<AppState>>()
            .and_then(|s| s.config.admin_key_hash.clone());
        std::future::ready(match (bearer(req), expected) {
            (Err(e), _) => Err(e),
            (Ok(_), None) => Err(ApiError::forbidden(
                "The admin API is disabled: start the server with an admin key.",
            )),
            (Ok(key), Some(hash)) if key_hash(&key) == hash => Ok(Admin),
            (Ok(_), Some(_)) => Err(ApiError::forbidden("This key is not the admin key.")),
        })
    }
}

/// Keys already looked up, so most requests make no catalog read to authenticate. Only
/// known keys are kept (an unknown one is looked up every time), for at most
/// [`key_cache::TTL`], and at most [`key_cache::CAPACITY`] of them.
mod key_cache {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use std::time::{Duration, Instant};

    /// How long a looked-up key is trusted without asking the catalog again.
    pub const TTL: Duration = Duration::from_secs(60);
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
