//! Operator routes, behind the admin key: create tenants, their limits, and their API
//! keys (create, list, revoke).

use crate::auth::Admin;
use crate::error::{ApiError, ApiResult, Code};
use crate::records::tenant::{self, ApiKeyInfo, TenantLimits, TenantRecord};
use crate::refusals::{NotAdmin, UnknownKey, UnknownTenant};
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};
use tuneq_queue::JobQueue;

/// `POST /admin/tenants` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewTenant {
    /// 1 to 64 characters of a-z, 0-9, '-' and '_'.
    id: String,
    /// Display name (default: the id).
    #[serde(default)]
    name: Option<String>,
}

/// Creates a tenant (admin key only).
#[utoipa::path(post, path = "/admin/tenants", tag = "admin", operation_id = "create_tenant",
    request_body = NewTenant,
    security(("admin_key" = [])),
    responses(
        (status = 201, description = "Created", body = TenantRecord),
        (status = 200, description = "Already there as asked (same name, or none given): nothing changed", body = TenantRecord),
        (status = 400, description = "Invalid id", body = tuneq_openapi::ErrorBody),
        (status = 409, description = "A tenant with this id exists under another name; nothing changed", body = tuneq_openapi::ErrorBody),
        NotAdmin,
    ))]
pub(crate) async fn create_tenant(
    state: web::Data<AppState>,
    _: Admin,
    body: crate::body::JsonBody<NewTenant>,
) -> ApiResult<HttpResponse> {
    if tuneq_storage::layout::Id::parse(&body.id).is_err() {
        return Err(ApiError::invalid(
            "id",
            Code::InvalidValue,
            "Tenant ids are 1 to 64 characters of a-z, 0-9, '-' and '_', starting with a letter or digit.",
        ));
    }
    let name = body.name.clone().unwrap_or_else(|| body.id.clone());
    crate::text::check("name", &name, 128, false)?;
    match tenant::create_tenant(&state.queue, &body.id, &name).await? {
        tenant::Creation::Created(tenant) => {
            apply_limits(&state, &tenant).await?;
            Ok(HttpResponse::Created().json(tenant))
        }
        tenant::Creation::Existing(tenant)
            if body.name.as_ref().is_none_or(|asked| *asked == tenant.name) =>
        {
            Ok(HttpResponse::Ok().json(tenant))
        }
        tenant::Creation::Existing(_) => Err(ApiError::invalid(
            "id",
            Code::TenantExists,
            "A tenant with this id exists under another name; nothing was changed.",
        )),
    }
}

/// A new key, shown once.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct NewKey {
    /// Its tenant.
    tenant: String,
    /// The key (only its hash is kept).
    api_key: String,
}

/// Creates an API key for a tenant (admin key only); the key is shown once.
#[utoipa::path(post, path = "/admin/tenants/{id}/keys", tag = "admin", operation_id = "create_api_key",
    params(("id" = String, Path, description = "The tenant")),
    security(("admin_key" = [])),
    responses(
        (status = 201, description = "The new key", body = NewKey),
        (status = 400, description = "Invalid request", body = tuneq_openapi::ErrorBody),
        UnknownTenant,
    ))]
pub(crate) async fn create_key(
    state: web::Data<AppState>,
    _: Admin,
    tenant: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let api_key = tenant::add_key(&state.queue, &tenant, None).await?;
    tracing::info!(tenant = %tenant, "API key created");
    Ok(HttpResponse::Created().json(NewKey {
        tenant: tenant.into_inner(),
        api_key,
    }))
}

/// A tenant's keys.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct KeyList {
    /// Always `list`.
    object: String,
    /// The keys, newest first: ids and prefixes, never the keys.
    data: Vec<ApiKeyInfo>,
}

/// Lists a tenant's API keys by id and prefix (admin key only).
#[utoipa::path(get, path = "/admin/tenants/{id}/keys", tag = "admin", operation_id = "list_api_keys",
    params(("id" = String, Path, description = "The tenant")),
    security(("admin_key" = [])),
    responses(
        (status = 200, description = "The tenant's keys", body = KeyList),
        (status = 400, description = "Not a tenant id", body = tuneq_openapi::ErrorBody),
        UnknownTenant,
    ))]
pub(crate) async fn list_keys(
    state: web::Data<AppState>,
    _: Admin,
    tenant: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let data = tenant::list_keys(&state.queue, &tenant).await?;
    Ok(HttpResponse::Ok().json(KeyList {
        object: "list".into(),
        data,
    }))
}

/// Revokes a tenant's API key (admin key only): it stops working at once on this API
/// process, and within 10 seconds on every other.
#[utoipa::path(delete, path = "/admin/tenants/{id}/keys/{key_id}", tag = "admin", operation_id = "revoke_api_key",
    params(
        ("id" = String, Path, description = "The tenant"),
        ("key_id" = String, Path, description = "The key's id (`key_…`)"),
    ),
    security(("admin_key" = [])),
    responses(
        (status = 200, description = "The revoked key", body = ApiKeyInfo),
        (status = 400, description = "Not a tenant id", body = tuneq_openapi::ErrorBody),
        UnknownKey,
    ))]
pub(crate) async fn revoke_key(
    state: web::Data<AppState>,
    _: Admin,
    path: web::Path<(String, String)>,
) -> ApiResult<HttpResponse> {
    let (tenant, key_id) = path.into_inner();
    let revoked = tenant::revoke_key(&state.queue, &tenant, &key_id).await?;
    Ok(HttpResponse::Ok().json(revoked))
}

/// Sets a tenant's limits (admin key only): jobs waiting (429 beyond), jobs running at
/// once (the rest wait), largest upload (413 beyond), and fair-share weight.
#[utoipa::path(put, path = "/admin/tenants/{id}/limits", tag = "admin", operation_id = "set_tenant_limits",
    params(("id" = String, Path, description = "The tenant")),
    request_body = TenantLimits,
    security(("admin_key" = [])),
    responses(
        (status = 200, description = "The tenant with its limits", body = TenantRecord),
        (status = 400, description = "Invalid limits", body = tuneq_openapi::ErrorBody),
        UnknownTenant,
    ))]
pub(crate) async fn set_limits(
    state: web::Data<AppState>,
    _: Admin,
    tenant: web::Path<String>,
    body: crate::body::JsonBody<TenantLimits>,
) -> ApiResult<HttpResponse> {
    let record = set_tenant_limits(&state, &tenant, body.0).await?;
    Ok(HttpResponse::Ok().json(record))
}

/// Gives the queue what it enforces of `tenant`'s limits, its own or else the server's
/// defaults.
async fn apply_limits(state: &AppState, tenant: &TenantRecord) -> ApiResult<()> {
    let limits = tenant.limits.or(&state.config.default_limits);
    Ok(state
        .queue
        .set_tenant(&tenant.id, &limits.queue_settings())
        .await?)
}

/// Gives the queue every tenant's limits, with the server's defaults where a tenant has
/// none of its own: at start, so a change of the defaults reaches tenants made before it
/// (and before there were defaults). Returns how many tenants there are.
pub async fn apply_default_limits(state: &AppState) -> ApiResult<usize> {
    let tenants = tenant::all(&state.queue).await?;
    for tenant in &tenants {
        apply_limits(state, tenant).await?;
    }
    Ok(tenants.len())
}

/// Sets a tenant's limits: kept in its record and given to the queue, which enforces
/// the queued and running ones atomically with enqueue and claim.
async fn set_tenant_limits(
    state: &AppState,
    id: &str,
    limits: TenantLimits,
) -> ApiResult<TenantRecord> {
    let mut record = tenant::get(&state.queue, id)
        .await?
        .ok_or_else(|| ApiError::not_found("tenant", id))?;
    if let Some(w) = limits.weight
        && !(w > 0.0 && w <= 1000.0)
    {
        return Err(ApiError::invalid(
            "weight",
            Code::InvalidValue,
            "weight must be above 0 and at most 1000.",
        ));
    }
    state
        .queue
        .set_tenant(
            id,
            &limits.or(&state.config.default_limits).queue_settings(),
        )
        .await?;
    record.limits = limits;
    tenant::update(&state.queue, &record).await?;
    tracing::info!(tenant = id, limits = ?record.limits, "tenant limits set");
    Ok(record)
}
