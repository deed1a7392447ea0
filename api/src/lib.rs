//! The REST service: native routes, OpenAI-compatible routes, tenants and API keys.
//!
//! Layout:
//! - `state`: what handlers share (queue + catalog, object store, settings).
//! - `error`: every error as OpenAI's error body, with a 4xx that names the field.
//! - `auth`: API keys (stored hashed) → tenants; the admin key.
//! - `files`: dataset upload with validation, list, retrieve, download, delete.
//! - `finetunes`: fine-tuning jobs, their events, checkpoints and adapter; `settle`
//!   files each finished job's outcome.
//! - `models`: registered base models and the tenant's fine-tuned ones.
//! - `internal`: where trainers report progress, fenced by their attempt's credential.
//! - `admin`: tenants and keys. `health`: liveness and readiness.
//! - `spec`: the OpenAPI document (`/openapi.json`, committed as `openapi/openapi.json`)
//!   and its page (`/docs`).
//!
//! - `metrics`: Prometheus counters at `/metrics`.

pub mod admin;
pub mod auth;
pub mod error;
pub mod files;
pub mod finetunes;
pub mod health;
pub mod internal;
pub mod metrics;
pub mod models;
mod records;
pub mod spec;
pub mod state;
mod tar;

pub use error::{ApiError, ApiResult};
pub use state::{ApiConfig, AppState, PoolInfo};

use actix_web::{App, HttpServer, web};

/// Every route, for `App::configure`.
pub fn configure(state: AppState) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        let json_limit = state.config.max_json_bytes;
        cfg.app_data(web::Data::new(state))
            .app_data(
                web::JsonConfig::default()
                    .limit(json_limit)
                    .error_handler(|e, _| {
                        ApiError::invalid(
                            "body",
                            "invalid_json",
                            format!("The JSON body is invalid: {e}"),
                        )
                        .into()
                    }),
            )
            .app_data(web::QueryConfig::default().error_handler(|e, _| {
                ApiError::invalid(
                    "query",
                    "invalid_query",
                    format!("The query is invalid: {e}"),
                )
                .into()
            }))
            .app_data(web::PathConfig::default().error_handler(|e, _| {
                ApiError::invalid("path", "invalid_path", e.to_string()).into()
            }))
            .configure(health::routes)
            .configure(files::routes)
            .configure(finetunes::routes)
            .configure(models::routes)
            .configure(internal::routes)
            .configure(spec::routes)
            .configure(metrics::routes)
            .configure(admin::routes)
            .default_service(web::to(|| async {
                Err::<actix_web::HttpResponse, _>(ApiError::new(
                    actix_web::http::StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "unknown_route",
                    "No such route.",
                ))
            }));
    }
}

/// A route's resource: a method it does not serve (`allow` lists those it does)
/// answers 405 with an `Allow` header and the error body.
pub(crate) fn resource(path: impl Into<String>, allow: &'static str) -> actix_web::Resource {
    let path: String = path.into();
    web::resource(path).default_service(web::to(move || async move {
        let error = ApiError::new(
            actix_web::http::StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            format!("This route serves {allow} only."),
        );
        let mut response = actix_web::ResponseError::error_response(&error);
        response.headers_mut().insert(
            actix_web::http::header::ALLOW,
            actix_web::http::header::HeaderValue::from_static(allow),
        );
        response
    }))
}

/// Serves the API on `listener` until the returned server is stopped (through its
/// handle: signals are left to the caller, which may have work to finish first).
pub fn serve(
    listener: std::net::TcpListener,
    state: AppState,
) -> std::io::Result<actix_web::dev::Server> {
    Ok(HttpServer::new(move || {
        App::new()
            .wrap(actix_web::middleware::Logger::new("%r %s %Dms").log_target("tuneq::access"))
            .wrap_fn(|req, srv| {
                use actix_web::dev::Service;
                use tracing::Instrument;
                let started = std::time::Instant::now();
                let method = req.method().to_string();
                let span = tracing::info_span!("request", method = %method, path = %req.path());
                let answer = srv.call(req);
                async move {
                    let response = answer.await?;
                    let route = response
                        .request()
                        .match_pattern()
                        .unwrap_or_else(|| "unmatched".into());
                    metrics::observe(
                        &method,
                        &route,
                        response.status().as_u16(),
                        started.elapsed(),
                    );
                    Ok(response)
                }
                .instrument(span)
            })
            .configure(configure(state.clone()))
    })
    .disable_signals()
    .listen(listener)?
    .run())
}
