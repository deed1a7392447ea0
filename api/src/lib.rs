//! The REST service: native routes, OpenAI-compatible routes, tenants and API keys.
//!
//! Layout, in floors: a module uses only modules on its own floor or below, so the way
//! of the data never doubles back.
//!
//! 1. Handlers, one module per area of routes:
//!    - `files`: dataset upload with validation, list, retrieve, download, delete.
//!    - `finetunes`: fine-tuning jobs (create → `plan`, `integrations`, `view`, `events`,
//!      `artifacts`; `control`: cancel, pause, resume).
//!    - `models`: registered base models and the tenant's fine-tuned ones.
//!    - `chat`: `/v1/chat/completions`, answers from those models, whole or streamed.
//!    - `internal`: where trainers report progress, fenced by their attempt's credential.
//!    - `webhooks`: tenants' signing secrets, delivery, the `settle` loop that files
//!      each finished job's outcome, and the `sender` that sends its event with a share
//!      per tenant and endpoint (both run beside the server).
//!    - `routes` declares every route once (a handler's `#[utoipa::path]` gives its
//!      path, method and OpenAPI entry) and serves both prefixes of the aliased ones.
//!    - `admin`: tenants and keys. `registry`: base models (`/admin/models`). `health`: liveness and readiness. `metrics`:
//!      Prometheus counters at `/metrics`. `spec`: the OpenAPI document
//!      (`/openapi.json`, committed as `openapi/openapi.json`) and its page (`/docs`).
//! 2. What handlers share: `auth` (the `Tenant` and `Admin` extractors), `body` (JSON
//!    read within a limit), `fit` (placement and cost checks), `owned` (the object of
//!    the tenant's that a path names), `refusals` (the 401, 403 and 404 answers that
//!    routes document alike), `text`, `tar`.
//! 3. `state`: the queue, the object store, the settings and what the process learns
//!    (`pool_stats`) or keeps copies of (`cache`).
//! 4. `records`: typed access to the catalog's records (fine-tunes, files, models,
//!    tenants and keys), taking the catalog and a tenant id, never the state.
//! 5. At the bottom, each depending on nothing here but `error`: `error` (every error
//!    as OpenAI's error body), `guard` (what every request passes before routing:
//!    methods, encodings, body pace), `cache`, `pool_stats`, `redact`, `sealed`,
//!    `webhook_target` (the SSRF guard), `throttle` (how fast a source may try keys),
//!    `quote` (how a message repeats a client's value), `tracking` (runs in an MLflow
//!    server: the client and its background worker), `upload_slots` (uploads at
//!    once, per process and per tenant), `inference` (the engine, model staging and
//!    token counts of a server that answers chat requests), `model_roots` (where the
//!    operator lets models be registered from),
//!    `holds` (how many event streams and downloads a tenant and the process hold open),
//!    both counted by `counts` (what is held, in all and per tenant).

pub mod admin;
pub mod auth;
mod blocking;
mod body;
mod cache;
pub mod chat;
mod counts;
pub mod error;
pub mod files;
pub mod finetunes;
pub mod fit;
pub mod guard;
pub mod health;
pub mod holds;
pub mod inference;
pub mod internal;
pub mod metrics;
pub mod model_roots;
pub mod models;
mod owned;
pub mod pool_stats;
mod quote;
pub mod records;
pub mod redact;
mod refusals;
pub mod registry;
mod routes;
pub mod sealed;
pub mod spec;
pub mod state;
mod tar;
mod text;
mod throttle;
pub mod tracking;
pub mod upload_slots;
pub mod webhook_target;
pub mod webhooks;

pub use error::{ApiError, ApiResult, Code};
pub use holds::HoldLimits;
pub use state::{ApiConfig, AppState};
pub use webhook_target::WebhookPolicy;

use actix_web::{App, HttpServer, web};

/// Every route, for `App::configure`, with the extractors' limits and error bodies. The
/// handlers take their [`AppState`] from the app's data (see [`serve`]).
pub fn configure(json_limit: usize) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(
            web::JsonConfig::default()
                .limit(json_limit)
                .error_handler(|e, _| match &e {
                    actix_web::error::JsonPayloadError::Payload(p) if guard::is_body_timeout(p) => {
                        guard::body_timeout().into()
                    }
                    actix_web::error::JsonPayloadError::Overflow { limit }
                    | actix_web::error::JsonPayloadError::OverflowKnownLength { limit, .. } => {
                        body::too_large(*limit).into()
                    }
                    _ => ApiError::invalid(
                        "body",
                        Code::InvalidJson,
                        format!("The JSON body is invalid: {e}"),
                    )
                    .into(),
                }),
        )
        .app_data(web::QueryConfig::default().error_handler(|e, _| {
            ApiError::invalid(
                "query",
                Code::InvalidQuery,
                format!("The query is invalid: {e}"),
            )
            .into()
        }))
        .app_data(web::PathConfig::default().error_handler(|e, _| {
            ApiError::invalid("path", Code::InvalidPath, e.to_string()).into()
        }))
        .configure(|cfg| routes::configure(cfg, spec::routes()))
        .default_service(web::to(|| async {
            Err::<actix_web::HttpResponse, _>(ApiError::new(Code::UnknownRoute, "No such route."))
        }));
    }
}

/// Serves the API on `listener` until the returned server is stopped (through its
/// handle: signals are left to the caller, which may have work to finish first), with
/// `workers` threads (None: one per CPU core).
pub fn serve(
    listener: std::net::TcpListener,
    state: AppState,
    workers: Option<usize>,
) -> std::io::Result<actix_web::dev::Server> {
    let json_limit = state.config.max_json_bytes;
    let pace = state.config.body_pace;
    let workers = workers.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let connections_per_worker = state.config.max_connections.div_ceil(workers).max(1);
    let server = HttpServer::new(move || {
        let shared = state.clone();
        App::new()
            // Each worker thread gets its own queue connection (see
            // `Queue::with_own_connection`); caches and settings stay shared.
            .data_factory(move || {
                let shared = shared.clone();
                async move {
                    let queue = shared.queue.with_own_connection().await.map_err(|e| {
                        tracing::error!(error = %e, "a server worker cannot reach the queue");
                    })?;
                    Ok::<_, ()>(AppState { queue, ..shared })
                }
            })
            // The access log, only where `tuneq::access` is enabled (TUNEQ_LOG): the
            // middleware renders parts of every request before the level is checked.
            .wrap(actix_web::middleware::Condition::new(
                tracing::enabled!(target: "tuneq::access", tracing::Level::INFO),
                actix_web::middleware::Logger::new("%{x-request-id}i %r %s %Dms")
                    .log_target("tuneq::access"),
            ))
            .wrap_fn(move |mut req, srv| {
                use actix_web::dev::Service;
                use tracing::Instrument;
                let started = std::time::Instant::now();
                // The metric label and the span field come from a fixed set: any
                // other method reads `other` (see `guard`).
                let method = guard::method_label(req.method()).unwrap_or("other");
                // Kept or made here, so handlers, the access log and the answer see one id.
                let request_id = guard::request_id(&req);
                let id_header = actix_web::http::header::HeaderValue::from_str(&request_id).ok();
                if let Some(value) = &id_header {
                    req.headers_mut().insert(
                        actix_web::http::header::HeaderName::from_static(guard::REQUEST_ID),
                        value.clone(),
                    );
                }
                let span = tracing::info_span!("request", request_id = %request_id, method, path = %req.path());
                let answer = match guard::refusal(&req) {
                    Some(error) => {
                        Err(req.into_response(actix_web::ResponseError::error_response(&error)))
                    }
                    None => {
                        guard::pace_body(&mut req, pace);
                        Ok(srv.call(req))
                    }
                };
                async move {
                    let mut response = match answer {
                        Ok(call) => call.await?.map_into_boxed_body(),
                        Err(refused) => refused.map_into_boxed_body(),
                    };
                    if let Some(value) = id_header {
                        response.headers_mut().insert(
                            actix_web::http::header::HeaderName::from_static(guard::REQUEST_ID),
                            value,
                        );
                    }
                    let route = response.request().app_data::<routes::RoutePattern>().cloned();
                    metrics::observe(
                        method,
                        route.as_ref().map_or("unmatched", |r| &r.0),
                        response.status().as_u16(),
                        started.elapsed(),
                    );
                    Ok(response)
                }
                .instrument(span)
            })
            .configure(configure(json_limit))
    })
    .disable_signals()
    // A client that closes its side of the connection has gone: its request's work is
    // dropped (an upload's validation stops, an event stream or a download ends and
    // gives back the slot it held, see `holds`) instead of running on for nobody.
    // HTTP/1.1 clients do not half-close while they wait for an answer.
    .h1_allow_half_closed(false)
    .workers(workers)
    .max_connections(connections_per_worker);
    Ok(server.listen(listener)?.run())
}
