//! `GET /metrics`: Prometheus text exposition of the process's counters.
//!
//! - `tuneq_http_requests_total{method,route,status}` and
//!   `tuneq_http_request_duration_seconds{method,route}` (histogram), labelled by route
//!   pattern (`/v1/fine_tuning/jobs/{id}`), never by raw path, so ids cannot blow up
//!   the label space;
//! - `tuneq_queue_waiting_jobs`: the queue's depth;
//! - `tuneq_pool_capacity{pool}` and `tuneq_pool_used{pool}` for the configured pools;
//! - `tuneq_pool_tokens_per_second{pool}` and `tuneq_lost_steps_total{pool}`, learned from
//!   the trainers' reports ([`crate::pool_stats`]);
//! - `tuneq_chat_tokens_total{tenant,kind}`, `tuneq_generations_running`,
//!   `tuneq_generation_slots` and the decode loops' `tuneq_decode_passes_total`,
//!   `tuneq_decode_rows_total` and `tuneq_decode_chunked_passes_total`, on a server that
//!   answers chat requests ([`crate::chat`]);
//! - `tuneq_build_info{version}`.
//!
//! The registry is process-wide, like Prometheus clients' default registry.

use crate::state::AppState;
use actix_web::{HttpResponse, web};
use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use tuneq_queue::JobQueue;

/// Upper bounds of the latency histogram's buckets, in seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// One (route, method)'s answers: by status, and their latency.
#[derive(Default)]
struct RouteStats {
    statuses: BTreeMap<u16, u64>,
    latency: Histogram,
}

/// Stats by route, then method: a request that finds its entries allocates nothing.
#[derive(Default)]
struct Registry {
    routes: BTreeMap<String, BTreeMap<String, RouteStats>>,
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// (route, method) series kept at most: routes come from patterns and methods from a
/// fixed set, so this is never reached; it bounds the registry even if that changes.
const MAX_SERIES: usize = 1024;

/// Records one answered request.
pub fn observe(method: &str, route: &str, status: u16, took: Duration) {
    let Ok(mut r) = registry().lock() else {
        return;
    };
    let known = r.routes.get(route).is_some_and(|m| m.contains_key(method));
    let (method, route) =
        if known || r.routes.values().map(BTreeMap::len).sum::<usize>() < MAX_SERIES {
            (method, route)
        } else {
            ("other", "other")
        };
    if !r.routes.contains_key(route) {
        r.routes.insert(route.to_string(), BTreeMap::new());
    }
    let Some(methods) = r.routes.get_mut(route) else {
        return;
    };
    if !methods.contains_key(method) {
        methods.insert(method.to_string(), RouteStats::default());
    }
    let Some(stats) = methods.get_mut(method) else {
        return;
    };
    // Statuses are our own answers' (a few dozen codes at most); anything outside
    // HTTP's range is counted as 500.
    let status = if (100..600).contains(&status) {
        status
    } else {
        500
    };
    *stats.statuses.entry(status).or_default() += 1;
    let h = &mut stats.latency;
    let seconds = took.as_secs_f64();
    for (i, bound) in BUCKETS.iter().enumerate() {
        if seconds <= *bound {
            h.counts[i] += 1;
        }
    }
    h.count += 1;
    h.sum += seconds;
}

/// A label value with `\`, `"` and newlines escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The exposition text.
async fn render(state: &AppState) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "# HELP tuneq_build_info The running version.");
    let _ = writeln!(out, "# TYPE tuneq_build_info gauge");
    let _ = writeln!(
        out,
        "tuneq_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    if let Ok(r) = registry().lock() {
        let _ = writeln!(out, "# HELP tuneq_http_requests_total Requests answered.");
        let _ = writeln!(out, "# TYPE tuneq_http_requests_total counter");
        for (route, methods) in &r.routes {
            for (method, stats) in methods {
                for (status, n) in &stats.statuses {
                    let _ = writeln!(
                        out,
                        "tuneq_http_requests_total{{method=\"{}\",route=\"{}\",status=\"{status}\"}} {n}",
                        label(method),
                        label(route)
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP tuneq_http_request_duration_seconds Time to answer."
        );
        let _ = writeln!(out, "# TYPE tuneq_http_request_duration_seconds histogram");
        for (route, method, h) in r.routes.iter().flat_map(|(route, methods)| {
            methods
                .iter()
                .map(move |(method, stats)| (route, method, &stats.latency))
        }) {
            let labels = format!("method=\"{}\",route=\"{}\"", label(method), label(route));
            for (bound, n) in BUCKETS.iter().zip(h.counts) {
                let _ = writeln!(
                    out,
                    "tuneq_http_request_duration_seconds_bucket{{{labels},le=\"{bound}\"}} {n}"
                );
            }
            let _ = writeln!(
                out,
                "tuneq_http_request_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(
                out,
                "tuneq_http_request_duration_seconds_sum{{{labels}}} {}",
                h.sum
            );
            let _ = writeln!(
                out,
                "tuneq_http_request_duration_seconds_count{{{labels}}} {}",
                h.count
            );
        }
    }
    if let Ok(waiting) = state.queue.waiting_jobs(Duration::from_secs(1)).await {
        let _ = writeln!(
            out,
            "# HELP tuneq_queue_waiting_jobs Jobs waiting in line to be placed, all tenants."
        );
        let _ = writeln!(out, "# TYPE tuneq_queue_waiting_jobs gauge");
        let _ = writeln!(out, "tuneq_queue_waiting_jobs {waiting}");
    }
    state.pool_stats.render(&mut out, label);
    if let Some(inference) = &state.inference {
        inference.render(&mut out, label);
    }
    let _ = writeln!(
        out,
        "# HELP tuneq_pool_capacity Accelerators (or slots) in a node pool."
    );
    let _ = writeln!(out, "# TYPE tuneq_pool_capacity gauge");
    let _ = writeln!(out, "# HELP tuneq_pool_used Accelerators held by leases.");
    let _ = writeln!(out, "# TYPE tuneq_pool_used gauge");
    for pool in &state.config.pools.pools {
        if let Ok(usage) = state.queue.pool_usage(&pool.name).await {
            let name = label(&pool.name);
            let _ = writeln!(
                out,
                "tuneq_pool_capacity{{pool=\"{name}\"}} {}",
                usage.capacity
            );
            let _ = writeln!(out, "tuneq_pool_used{{pool=\"{name}\"}} {}", usage.used);
        }
    }
    out
}

/// Prometheus metrics (no key: scrape from inside the network).
#[utoipa::path(get, path = "/metrics", tag = "health", operation_id = "metrics",
    security(()),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String)))]
pub(crate) async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(render(&state).await)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_series_are_bounded_whatever_is_observed() {
        for i in 0..(MAX_SERIES + 100) {
            observe(
                "GET",
                &format!("/bounded-test/{i}"),
                200,
                Duration::from_millis(1),
            );
        }
        let r = registry().lock().unwrap();
        let series: usize = r.routes.values().map(BTreeMap::len).sum();
        assert!(series <= MAX_SERIES + 1, "{series}");
        assert!(r.routes.contains_key("other"));
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
