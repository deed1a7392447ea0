//! Who a request acts for. Every route but health and the spec needs
//! `Authorization: Bearer <key>`: a tenant's API key decides the tenant ([`Tenant`]), and
//! every object a handler touches is looked up under that tenant; the admin key from the
//! configuration makes an operator ([`Admin`]). The keys themselves are records (see
//! [`crate::records::tenant`]); failed attempts are slowed down per client address.

use crate::error::{ApiError, ApiResult};
use crate::records::tenant;
use crate::state::AppState;
use actix_web::{FromRequest, HttpRequest, web};
use futures::future::LocalBoxFuture;

pub use crate::records::tenant::{key_hash, new_key};

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
        let client = req.peer_addr().map(|a| a.ip());
        Box::pin(async move {
            let state = state.ok_or_else(|| ApiError::internal("no application state"))?;
            let key = key?;
            match tenant::tenant_of_key(&state.queue, &key).await? {
                Some(tenant) => Ok(Tenant(tenant)),
                None => Err(failures::answer(
                    client,
                    ApiError::unauthenticated(
                        "Incorrect API key provided. Keys are created with `tuneq up` or the admin API.",
                    ),
                )
                .await),
            }
        })
    }
}

/// An operator: the request carries the admin key from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequest for Admin {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let expected = req
            .app_data::<web::Data<AppState>>()
            .and_then(|s| s.config.admin_key_hash.clone());
        let key = bearer(req);
        let client = req.peer_addr().map(|a| a.ip());
        Box::pin(async move {
            match (key, expected) {
                (Err(e), _) => Err(e),
                (Ok(_), None) => Err(ApiError::forbidden(
                    "The admin API is disabled: start the server with an admin key.",
                )),
                (Ok(key), Some(hash)) if key_hash(&key) == hash => Ok(Admin),
                // As on every other route, a key that does not grant access is a 401.
                (Ok(_), Some(_)) => Err(failures::answer(
                    client,
                    ApiError::unauthenticated("This key is not the admin key."),
                )
                .await),
            }
        })
    }
}

/// Failed authentications by client address. A client past [`failures::FREE`] failures
/// in a [`failures::WINDOW`] gets each further failure answered only after
/// [`failures::PENALTY`], and with 429 when it already has [`failures::IN_PENALTY`]
/// answers waiting: guessing keys goes at a crawl. Keys that work are never slowed
/// (they are answered before this is consulted), so a busy client behind the same
/// address as a guesser keeps working.
mod failures {
    use crate::error::{ApiError, Code};
    use std::collections::HashMap;
    use std::net::IpAddr;
    use std::sync::{Mutex, OnceLock};
    use std::time::{Duration, Instant};

    /// Failures a client may have in a window before it is slowed down.
    pub const FREE: u32 = 30;
    /// The window failures are counted in.
    pub const WINDOW: Duration = Duration::from_secs(60);
    /// How long a failure past [`FREE`] waits before it is answered.
    pub const PENALTY: Duration = Duration::from_secs(1);
    /// Answers a client may have waiting at once; more are refused at once with 429.
    pub const IN_PENALTY: u32 = 8;
    /// Clients tracked at most (expired ones are dropped first when full).
    const CLIENTS: usize = 10_000;

    struct Client {
        since: Instant,
        failures: u32,
        waiting: u32,
    }

    fn clients() -> &'static Mutex<HashMap<IpAddr, Client>> {
        static CLIENTS: OnceLock<Mutex<HashMap<IpAddr, Client>>> = OnceLock::new();
        CLIENTS.get_or_init(Default::default)
    }

    /// What to do with one more failure of `ip`.
    enum Verdict {
        Now,
        After,
        Refuse(u64),
    }

    fn count(ip: IpAddr) -> Verdict {
        let Ok(mut clients) = clients().lock() else {
            return Verdict::Now;
        };
        let now = Instant::now();
        if clients.len() >= CLIENTS && !clients.contains_key(&ip) {
            clients.retain(|_, c| now.duration_since(c.since) < WINDOW || c.waiting > 0);
            if clients.len() >= CLIENTS {
                clients.clear();
            }
        }
        let client = clients.entry(ip).or_insert(Client {
            since: now,
            failures: 0,
            waiting: 0,
        });
        if now.duration_since(client.since) >= WINDOW {
            client.since = now;
            client.failures = 0;
        }
        client.failures = client.failures.saturating_add(1);
        if client.failures <= FREE {
            Verdict::Now
        } else if client.waiting >= IN_PENALTY {
            let left = WINDOW.saturating_sub(now.duration_since(client.since));
            Verdict::Refuse(left.as_secs().max(1))
        } else {
            client.waiting += 1;
            Verdict::After
        }
    }

    /// One answer of a client's waiting out its penalty.
    struct Waiting(IpAddr);

    impl Drop for Waiting {
        fn drop(&mut self) {
            if let Ok(mut clients) = clients().lock()
                && let Some(c) = clients.get_mut(&self.0)
            {
                c.waiting = c.waiting.saturating_sub(1);
            }
        }
    }

    /// `error` (a failed authentication of `client`), answered now, after the penalty,
    /// or replaced by a 429.
    pub async fn answer(client: Option<IpAddr>, error: ApiError) -> ApiError {
        let Some(ip) = client else {
            return error;
        };
        match count(ip) {
            Verdict::Now => error,
            Verdict::After => {
                // Given back even when the client hangs up while it waits.
                let _waiting = Waiting(ip);
                tokio::time::sleep(PENALTY).await;
                error
            }
            Verdict::Refuse(retry_after) => ApiError::too_many(
                Code::TooManyFailedAuthentications,
                "Too many failed authentications from this address; wait before trying again.",
                retry_after,
            ),
        }
    }
}
