//! Liveness and readiness for load balancers and orchestrators.

use crate::state::AppState;
use actix_web::{HttpResponse, get, web};
use tuneq_queue::Catalog;

/// The process is up.
#[get("/healthz")]
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

/// The process can serve: the job store answers.
#[get("/readyz")]
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    match state.queue.count_entries("tenant", "tenants").await {
        Ok(_) => HttpResponse::Ok().json(serde_json::json!({"status": "ready"})),
        Err(e) => {
            tracing::warn!(error = %e, "not ready: job store");
            HttpResponse::ServiceUnavailable()
                .json(serde_json::json!({"status": "unavailable", "reason": "job store"}))
        }
    }
}
