//! A job's event log: pages of events (`GET …/events`) and server-sent events
//! (`?stream=true`), each queue event rendered as the client sees it.

use super::plan::check_range;
use super::view::view;
use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::records::finetune::{FineTuneRecord, ms_to_seconds};
use crate::redact;
use crate::state::AppState;
use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use tuneq_openapi::{ErrorBody, FineTuneEvent, FineTuneEventList, LogEntry};
use tuneq_queue::JobQueue;

/// Query of the events list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct EventsQuery {
    /// The last id of the previous page (with `stream`: stream what came after it).
    after: Option<String>,
    /// Page size, 1 to 1 000 (default 20).
    limit: Option<u32>,
    /// Stream the events as server-sent events, oldest first, until the job ends.
    stream: Option<bool>,
}

/// An event's id: the job's id and the event's place in its log.
fn event_id(finetune: &str, seq: u64) -> String {
    format!("ftevent-{}-{seq}", finetune.trim_start_matches("ftjob-"))
}

fn event_seq(finetune: &str, id: &str) -> ApiResult<u64> {
    let bad = || {
        ApiError::invalid(
            "after",
            Code::InvalidCursor,
            format!("`{id}` is not an event of this job."),
        )
    };
    let rest = id.strip_prefix("ftevent-").ok_or_else(bad)?;
    let (job, seq) = rest.rsplit_once('-').ok_or_else(bad)?;
    if job != finetune.trim_start_matches("ftjob-") {
        return Err(bad());
    }
    seq.parse().map_err(|_| bad())
}

/// The "leased" event's text: the pool, and why it was that one of the job's pools.
fn placed(record: &FineTuneRecord, pool: &str) -> String {
    let Some(estimate) = &record.estimate else {
        return format!("Placed on node pool {pool}");
    };
    let pools = estimate.pools.join(", ");
    match estimate.pools.iter().position(|p| p == pool) {
        Some(0) => format!(
            "Placed on node pool {pool}: the first of the job's pools ({pools}; spot first, then GPU, then price)"
        ),
        Some(_) => format!(
            "Placed on node pool {pool} of the job's pools ({pools}): those before it had no free slot or were given up on"
        ),
        None => format!("Placed on node pool {pool}"),
    }
}

/// The client's view of one queue event.
fn render_event(record: &FineTuneRecord, event: &tuneq_queue::JobEvent) -> FineTuneEvent {
    let mut level = "info";
    let mut kind = "message";
    let mut data = None;
    let message = match LogEntry::decode(&event.kind, &event.message) {
        Some(entry) => {
            let (text, is_metrics, fields) = render_entry(record, entry);
            if is_metrics {
                kind = "metrics";
            }
            data = Some(fields);
            text
        }
        None => render_plain(record, event, &mut level),
    };
    FineTuneEvent {
        id: event_id(&record.id, event.seq),
        object: "fine_tuning.job.event".into(),
        created_at: ms_to_seconds(event.at_ms),
        level: level.into(),
        message,
        kind: kind.into(),
        data,
    }
}

/// A loss as the event's text shows it.
fn loss_text(loss: Option<f64>) -> String {
    loss.map_or("n/a".into(), |l| format!("{l:.4}"))
}

/// A trainer's log entry as the client sees it: its text, whether it is a metrics
/// event, and its fields (locations relative to the tenant's prefix).
fn render_entry(record: &FineTuneRecord, mut entry: LogEntry) -> (String, bool, serde_json::Value) {
    if let LogEntry::Checkpoint { location, .. } | LogEntry::Resumed { location, .. } = &mut entry {
        *location = redact::tenant_location(location, &record.tenant);
    }
    let (text, is_metrics) = match &entry {
        LogEntry::TrainingStarted { .. } => ("Training started".to_string(), false),
        LogEntry::Metrics {
            step,
            total_steps,
            train_loss,
            ..
        } => (
            format!(
                "Step {step}/{total_steps}: training loss={}",
                loss_text(*train_loss)
            ),
            true,
        ),
        LogEntry::Eval { step, valid_loss } => (
            format!("Step {step}: validation loss={}", loss_text(*valid_loss)),
            true,
        ),
        LogEntry::Checkpoint { step, .. } => (format!("Checkpoint saved at step {step}"), false),
        LogEntry::Resumed { step, .. } => {
            (format!("Resumed from the checkpoint at step {step}"), false)
        }
    };
    (text, is_metrics, entry.fields())
}

/// The text of a plain-text event (the queue's own, and trainers' warnings); `level`
/// is raised for the ones that warn.
fn render_plain(
    record: &FineTuneRecord,
    event: &tuneq_queue::JobEvent,
    level: &mut &str,
) -> String {
    match event.kind.as_str() {
        "queued" => format!("Created fine-tuning job: {}", record.id),
        "leased" => placed(record, &event.message),
        "started" => "Fine-tuning job started".into(),
        "warning" => {
            *level = "warn";
            redact::paths(&event.message)
        }
        "preempted" => {
            *level = "warn";
            format!(
                "The attempt stopped ({}); the job resumes from its last checkpoint",
                redact::paths(&event.message)
            )
        }
        "unplaced" => {
            *level = "warn";
            format!(
                "The attempt found no node ({}); the job is back in line",
                redact::paths(&event.message)
            )
        }
        "moved" => {
            *level = "warn";
            format!("Moved on to other node pools: {}", event.message)
        }
        "lease_expired" => {
            *level = "warn";
            "The attempt stopped reporting; checking whether it is alive".into()
        }
        "lease_recovered" | "adopted" => "The attempt is alive and continues".into(),
        "requeued" => {
            *level = "warn";
            "The attempt was lost; the job is back in line".into()
        }
        "retry_scheduled" => {
            *level = "warn";
            format!(
                "The attempt failed ({}); it will be retried",
                redact::paths(&event.message)
            )
        }
        "failed" => {
            *level = "error";
            format!("The job failed: {}", redact::paths(&event.message))
        }
        "cancel_requested" => "Cancelling: stopping the running attempt".into(),
        "cancelled" => "The job was cancelled".into(),
        "succeeded" => "The job has successfully completed".into(),
        other => format!("{other}: {}", redact::paths(&event.message)),
    }
}

/// The job's events, newest first; `after` = the last id seen. With `stream=true`,
/// server-sent events instead: every event oldest first (after `after` or
/// `Last-Event-ID`), then each new one as it happens, until the job has ended.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/events", tag = "fine-tuning", operation_id = "list_fine_tuning_events",
    params(("id" = String, Path, description = "`ftjob-…`"), EventsQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "With `stream`: resume after this event")),
    responses(
        (status = 200, description = "A page of events, or (with `stream`) server-sent events: \
`event` is the type, `id` the event's id, `data` the event object; a last `done` event carries the job", content(
            (FineTuneEventList = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 400, description = "Invalid query", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
    ))]
pub(crate) async fn events(
    state: web::Data<AppState>,
    tenant: Tenant,
    req: HttpRequest,
    id: web::Path<String>,
    query: web::Query<EventsQuery>,
) -> ApiResult<HttpResponse> {
    let record = state.finetunes().find(&tenant.0, &id).await?;
    let limit = check_range("limit", query.limit.unwrap_or(20), 1, 1000)? as usize;
    let last_event_id = req
        .headers()
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let after = match query.after.as_ref().or(last_event_id.as_ref()) {
        Some(a) => Some(event_seq(&record.id, a)?),
        None => None,
    };
    if query.stream == Some(true) {
        return Ok(stream_events(state.into_inner(), record, after));
    }
    let mut events = state
        .queue
        .events(&record.job_id, after, limit + 1, true)
        .await?;
    let has_more = events.len() > limit;
    events.truncate(limit);
    Ok(HttpResponse::Ok().json(FineTuneEventList {
        object: "list".into(),
        data: events.iter().map(|e| render_event(&record, e)).collect(),
        has_more,
    }))
}

/// How often a stream looks for new events.
const STREAM_POLL: std::time::Duration = std::time::Duration::from_millis(500);
/// A comment line this often keeps proxies from closing a quiet stream.
const STREAM_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// One server-sent event.
fn sse(event: &str, id: Option<&str>, data: &str) -> bytes::Bytes {
    let mut text = String::new();
    if let Some(id) = id {
        text.push_str(&format!("id: {id}\n"));
    }
    text.push_str(&format!("event: {event}\ndata: {data}\n\n"));
    bytes::Bytes::from(text)
}

/// Server-sent events of a job: what it logged after `after`, then new events as they
/// come, until it has ended (a last `done` event carries the job).
fn stream_events(
    state: std::sync::Arc<AppState>,
    record: FineTuneRecord,
    after: Option<u64>,
) -> HttpResponse {
    struct Cursor {
        state: std::sync::Arc<AppState>,
        record: FineTuneRecord,
        last: Option<u64>,
        pending: std::collections::VecDeque<bytes::Bytes>,
        quiet_since: std::time::Instant,
        done: bool,
    }
    let cursor = Cursor {
        state,
        record,
        last: after,
        pending: Default::default(),
        quiet_since: std::time::Instant::now(),
        done: false,
    };
    let stream = futures::stream::unfold(cursor, |mut c| async move {
        loop {
            if let Some(chunk) = c.pending.pop_front() {
                return Some((Ok::<_, actix_web::Error>(chunk), c));
            }
            if c.done {
                return None;
            }
            let ended = match c.state.queue.get(&c.record.job_id).await {
                Ok(job) => job.is_none_or(|j| j.state.is_terminal()),
                Err(e) => {
                    tracing::warn!(error = %e, "event stream: job store unavailable");
                    false
                }
            };
            match c
                .state
                .queue
                .events(&c.record.job_id, c.last, 1000, false)
                .await
            {
                Ok(events) if !events.is_empty() => {
                    for e in &events {
                        let rendered = render_event(&c.record, e);
                        let data = serde_json::to_string(&rendered).unwrap_or_default();
                        c.pending
                            .push_back(sse(&rendered.kind, Some(&rendered.id), &data));
                        c.last = Some(e.seq);
                    }
                    c.quiet_since = std::time::Instant::now();
                    continue;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "event stream: cannot read events"),
            }
            if ended {
                let job = match view(&c.state, c.record.clone()).await {
                    Ok(job) => serde_json::to_string(&job).unwrap_or_default(),
                    Err(_) => "{}".into(),
                };
                c.pending.push_back(sse("done", None, &job));
                c.done = true;
                continue;
            }
            if c.quiet_since.elapsed() >= STREAM_KEEPALIVE {
                c.quiet_since = std::time::Instant::now();
                return Some((Ok(bytes::Bytes::from_static(b": keep-alive\n\n")), c));
            }
            tokio::time::sleep(STREAM_POLL).await;
        }
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((actix_web::http::header::CACHE_CONTROL, "no-cache"))
        .insert_header(("x-accel-buffering", "no"))
        .streaming(stream)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn event_cursors_round_trip_and_refuse_other_jobs() {
        let id = event_id("ftjob-abc", 7);
        assert_eq!(event_seq("ftjob-abc", &id).unwrap(), 7);
        assert!(event_seq("ftjob-abd", &id).is_err());
        assert!(event_seq("ftjob-abc", "ftevent-abc-x").is_err());
        assert!(event_seq("ftjob-abc", "nonsense").is_err());
    }
}
