//! Liveness and readiness for load balancers and orchestrators.

use crate::state::AppState;
use actix_web::{HttpResponse, web};
use tuneq_queue::Catalog;

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "health", operation_id = "healthz",
    responses((status = 200, description = "Up", body = Object)))]
pub(crate) async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

/// The process can serve: the job store answers.
#[utoipa::path(get, path = "/readyz", tag = "health", operation_id = "readyz",
    responses(
        (status = 200, description = "Ready", body = Object),
        (status = 503, description = "The job store does not answer", body = Object),
    ))]
pub(crate) async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    match state.queue.count_entries("tenant", "tenants").await {
        Ok(_) => HttpResponse::Ok().json(serde_json::json!({"status": "ready"})),
        Err(e) => {
            tracing::warn!(error = %e, "not ready: job store");
            HttpResponse::ServiceUnavailable()
                .json(serde_json::json!({"status": "unavailable", "reason": "job store"}))
        }
    }
}
