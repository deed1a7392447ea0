//! Who a request acts for. Every route but health and the spec needs
//! `Authorization: Bearer <key>`: a tenant's API key decides the tenant ([`Tenant`]), and
//! every object a handler touches is looked up under that tenant; the admin key from the
//! configuration makes an operator ([`Admin`]). The keys themselves are records (see
//! [`crate::records::tenant`]). Every authentication first asks the process's
//! [`crate::throttle`], so a source past its failures is refused whatever key it sends.

use crate::error::{ApiError, ApiResult, Code};
use crate::records::tenant;
use crate::state::AppState;
use crate::throttle::{Pass, Source, Throttle};
use actix_web::{FromRequest, HttpRequest, web};
use futures::future::LocalBoxFuture;

pub use crate::records::tenant::{WeakKey, check_strength, key_hash, new_key};

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

/// The tenant a request acts for, from its API key (and the key's hash, for what must
/// check later that the key still exists: an event stream).
#[derive(Clone)]
pub struct Tenant(pub String, String);

impl Tenant {
    /// The SHA-256 (hex) of the key the request authenticated with.
    pub(crate) fn key_hash(&self) -> &str {
        &self.1
    }
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key's hash stays out of logs.
        f.debug_tuple("Tenant").field(&self.0).finish()
    }
}

impl FromRequest for Tenant {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let presented = Presented::of(req);
        Box::pin(async move { presented?.tenant().await })
    }
}

/// An operator: the request carries the admin key from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequest for Admin {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        // Nothing to look up: the admin key's hash is in the configuration.
        Box::pin(std::future::ready(
            Presented::of(req).and_then(Presented::admin),
        ))
    }
}

/// What a request presents to be authenticated: the key it sends, where it comes from,
/// and the state to check the key against.
struct Presented {
    state: web::Data<AppState>,
    key: String,
    source: Option<Source>,
}

impl Presented {
    /// What `req` presents; an error when it sends no well-formed key.
    fn of(req: &HttpRequest) -> ApiResult<Self> {
        let state = req
            .app_data::<web::Data<AppState>>()
            .cloned()
            .ok_or_else(|| ApiError::internal("no application state"))?;
        Ok(Self {
            state,
            key: bearer(req)?,
            source: source_of(req),
        })
    }

    /// The tenant whose key this is.
    async fn tenant(self) -> ApiResult<Tenant> {
        let Self { state, key, source } = self;
        // Asked before the key is looked up, so a refusal says nothing of the key.
        let pass = admit(&state.auth_throttle, source, &key)?;
        match tenant::tenant_of_key(&state.queue, &key).await? {
            Some(tenant) => {
                settle(pass, true);
                Ok(Tenant(tenant, key_hash(&key)))
            }
            None => {
                settle(pass, false);
                Err(ApiError::unauthenticated(
                    "Incorrect API key provided. Keys are created with `tuneq up` or the admin API.",
                ))
            }
        }
    }

    /// An operator, when this is the admin key.
    fn admin(self) -> ApiResult<Admin> {
        let Self { state, key, source } = self;
        let Some(hash) = state.config.admin_key_hash.as_deref() else {
            return Err(ApiError::forbidden(
                "The admin API is disabled: start the server with an admin key.",
            ));
        };
        let pass = admit(&state.auth_throttle, source, &key)?;
        if key_hash(&key) == hash {
            settle(pass, true);
            Ok(Admin)
        } else {
            settle(pass, false);
            // As on every other route, a key that does not grant access is a 401.
            Err(ApiError::unauthenticated("This key is not the admin key."))
        }
    }
}

/// Where a request comes from, for [`throttle`]: its peer address (None for a peer
/// without one, which is not throttled).
fn source_of(req: &HttpRequest) -> Option<Source> {
    req.peer_addr().map(|a| Source::from(a.ip()))
}

/// Asks the throttle to let one authentication of `key` from `source` go ahead: 429
/// while the source, or the keys starting like this one, have used up their failures,
/// whatever key it sends.
fn admit<'t>(
    throttle: &'t Throttle,
    source: Option<Source>,
    key: &str,
) -> ApiResult<Vec<Pass<'t>>> {
    let refuse = |refused: crate::throttle::Throttled, what: &str| {
        ApiError::too_many(
            Code::TooManyFailedAuthentications,
            format!("Too many failed authentications {what}; wait before trying again."),
            refused.retry_after,
        )
    };
    let mut passes = Vec::with_capacity(2);
    if let Some(source) = source {
        passes.push(
            throttle
                .admit(source)
                .map_err(|r| refuse(r, "from this address"))?,
        );
    }
    // A refusal here drops the source's pass unsaid, which gives its credit back.
    passes.push(
        throttle
            .admit(Source::key_prefix(key))
            .map_err(|r| refuse(r, "with keys like this one"))?,
    );
    Ok(passes)
}

fn settle(passes: Vec<Pass<'_>>, right: bool) {
    for pass in passes {
        if right {
            pass.succeeded();
        } else {
            pass.failed();
        }
    }
}
