//! What a tenant owns, as the path of a request names it: [`Owned`] says how to find an
//! object of one kind, and [`Own`] extracts the one the path's `{id}` names for the
//! request's tenant. Its refusals, 401 without a known key and 404 when the tenant has
//! no such object (another tenant's included), are written once, here, for the code and
//! for the OpenAPI document alike.

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult};
use crate::refusals::{NO_TENANT_KEY, error_responses};
use crate::state::AppState;
use actix_web::{FromRequest, HttpRequest, web};
use futures::future::LocalBoxFuture;
use std::collections::BTreeMap;
use utoipa::openapi::{RefOr, response::Response};

/// A kind of object that tenants own and find by id.
pub(crate) trait Owned: Sized + 'static {
    /// What the OpenAPI document says of its 404.
    const NOT_FOUND: &'static str;

    /// The object `id` of `tenant`; 404 when the tenant has none.
    async fn find(state: &AppState, tenant: &str, id: &str) -> ApiResult<Self>;
}

/// The object of kind `T` that the path's `{id}` names, of the request's tenant.
pub(crate) struct Own<T> {
    /// The tenant.
    pub tenant: Tenant,
    /// The id, as the path gives it.
    pub id: String,
    /// The object.
    pub object: T,
}

impl<T: Owned> FromRequest for Own<T> {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, payload: &mut actix_web::dev::Payload) -> Self::Future {
        let tenant = Tenant::from_request(req, payload);
        let id = web::Path::<String>::extract(req);
        let state = req.app_data::<web::Data<AppState>>().cloned();
        Box::pin(async move {
            // As handlers taking the tenant and then the path did: 401 comes first.
            let tenant = tenant.await?;
            // A path segment always reads as a string.
            let id = id
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .into_inner();
            let state = state.ok_or_else(|| ApiError::internal("no application state"))?;
            let object = T::find(&state, &tenant.0, &id).await?;
            Ok(Self { tenant, id, object })
        })
    }
}

impl<T: Owned> utoipa::IntoResponses for Own<T> {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        error_responses(&[NO_TENANT_KEY, ("404", T::NOT_FOUND)])
    }
}
