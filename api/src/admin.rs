//! Operator routes, behind the admin key: create tenants and their API keys.

use crate::auth::{self, Admin};
use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};

/// Routes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(web::resource("/admin/tenants").route(web::post().to(create_tenant)))
        .service(web::resource("/admin/tenants/{id}/keys").route(web::post().to(create_key)));
}

/// `POST /admin/tenants` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    id: String,
    #[serde(default)]
    name: Option<String>,
}

async fn create_tenant(
    state: web::Data<AppState>,
    _: Admin,
    body: web::Json<NewTenant>,
) -> ApiResult<HttpResponse> {
    if tuneq_storage::layout::Id::parse(&body.id).is_err() {
        return Err(ApiError::invalid(
            "id",
            "invalid_value",
            "Tenant ids are 1 to 64 characters of a-z, 0-9, '-' and '_', starting with a letter or digit.",
        ));
    }
    let name = body.name.clone().unwrap_or_else(|| body.id.clone());
    let tenant = auth::create_tenant(&state, &body.id, &name).await?;
    Ok(HttpResponse::Created().json(tenant))
}

/// A new key, shown once.
#[derive(Debug, Serialize)]
struct NewKey {
    tenant: String,
    api_key: String,
}

async fn create_key(
    state: web::Data<AppState>,
    _: Admin,
    tenant: web::Path<String>,
) -> ApiResult<HttpResponse> {
    let api_key = auth::add_key(&state, &tenant, None).await?;
    tracing::info!(tenant = %tenant, "API key created");
    Ok(HttpResponse::Created().json(NewKey {
        tenant: tenant.into_inner(),
        api_key,
    }))
}
