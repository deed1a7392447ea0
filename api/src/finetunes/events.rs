//! A job's event log: pages of events (`GET …/events`) and server-sent events
//! (`?stream=true`), each queue event rendered as the client sees it.

use super::range::check_range;
use super::view::view;
use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::holds::{self, Hold, HoldKind};
use crate::records::finetune::{FineTuneRecord, ms_to_seconds};
use crate::redact;
use crate::state::AppState;
use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use tuneq_openapi::{
    ErrorBody, EventKind, FailureClass, FineTuneEvent, FineTuneEventList, LogEntry, StopCause,
};
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

/// The trainer's log entry a queue event holds, if it is one.
pub(crate) fn log_entry(event: &tuneq_queue::JobEvent) -> Option<LogEntry> {
    let data = event.data.as_ref()?;
    LogEntry::decode(event.kind, data)
}

/// The client's view of one queue event.
fn render_event(record: &FineTuneRecord, event: &tuneq_queue::JobEvent) -> FineTuneEvent {
    let mut level = "info";
    let mut kind = "message";
    let mut data = None;
    let message = match log_entry(event) {
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
        LogEntry::Eval {
            step, valid_loss, ..
        } => (
            format!("Step {step}: validation loss={}", loss_text(*valid_loss)),
            true,
        ),
        LogEntry::Checkpoint { step, .. } => (format!("Checkpoint saved at step {step}"), false),
        LogEntry::EarlyStopped {
            stopped_at,
            best_step,
            best_validation_loss,
        } => (
            match stopped_at {
                Some(at) => format!(
                    "Early stopping at step {at}: the validation loss stopped improving; keeping step {best_step} (validation loss={})",
                    loss_text(*best_validation_loss)
                ),
                None => format!(
                    "Keeping the best validated step, {best_step} (validation loss={})",
                    loss_text(*best_validation_loss)
                ),
            },
            false,
        ),
        LogEntry::Resumed { step, .. } => {
            (format!("Resumed from the checkpoint at step {step}"), false)
        }
    };
    (text, is_metrics, entry.fields())
}

/// How a stopped attempt's cause reads in its event.
fn stopped_by(stop: Option<StopCause>) -> &'static str {
    match stop {
        Some(StopCause::Preemption) | None => "its machine was taken away",
        Some(StopCause::Shutdown) => "the service was shutting down",
        Some(StopCause::Restart) => "its dispatcher restarted",
        Some(StopCause::Pause) => "its tenant paused the job",
    }
}

/// The text of a plain event (the queue's own, a trainer's warning, and a trainer's
/// entry whose fields do not read); `level` is raised for the ones that warn.
fn render_plain(
    record: &FineTuneRecord,
    event: &tuneq_queue::JobEvent,
    level: &mut &str,
) -> String {
    let message = redact::paths(&event.message);
    let warn = |level: &mut &str, text: String| {
        *level = "warn";
        text
    };
    match event.kind {
        EventKind::Queued => format!("Created fine-tuning job: {}", record.id),
        EventKind::Leased => placed(record, event.pool.as_deref().unwrap_or("?")),
        EventKind::Started => "Fine-tuning job started".into(),
        EventKind::Warning => warn(level, message),
        EventKind::Preempted => warn(
            level,
            format!(
                "The attempt stopped ({}: {message}); the job resumes from its last checkpoint",
                stopped_by(event.stop)
            ),
        ),
        EventKind::Unplaced => warn(
            level,
            format!("The attempt found no node ({message}); the job is back in line"),
        ),
        EventKind::Moved => warn(level, format!("Moved on to other node pools: {message}")),
        EventKind::LeaseExpired => warn(
            level,
            "The attempt stopped reporting; checking whether it is alive".into(),
        ),
        EventKind::LeaseRecovered | EventKind::Adopted => {
            "The attempt is alive and continues".into()
        }
        EventKind::Requeued => warn(
            level,
            "The attempt was lost; the job is back in line".into(),
        ),
        EventKind::RetryScheduled => warn(
            level,
            format!("The attempt failed ({message}); it will be retried"),
        ),
        EventKind::Failed => {
            *level = "error";
            let code = event.failure.map_or("", FailureClass::code);
            format!("The job failed ({code}): {message}")
        }
        EventKind::CancelRequested => "Cancelling: stopping the running attempt".into(),
        EventKind::Cancelled => "The job was cancelled".into(),
        EventKind::PauseRequested => {
            "Pausing: the running attempt writes a checkpoint and stops".into()
        }
        EventKind::Paused if message.is_empty() => {
            "The job was paused; resume it to continue".into()
        }
        EventKind::Paused => format!("The job was paused ({message}); resume it to continue"),
        EventKind::Unpaused => "The job was resumed; it continues from its last checkpoint".into(),
        EventKind::Succeeded => "The job has successfully completed".into(),
        EventKind::TrainingStarted
        | EventKind::Resumed
        | EventKind::Metrics
        | EventKind::Eval
        | EventKind::Checkpoint
        | EventKind::EarlyStopped => format!("{}: {message}", event.kind.code()),
    }
}

/// The job's events, newest first; `after` = the last id seen. With `stream=true`,
/// server-sent events instead: every event oldest first (after `Last-Event-ID`, else
/// `after`), then each new one as it happens, until the job has ended. A tenant holds a
/// bounded number of streams at once (16 by default), and a stream lasts 15 minutes at
/// most: it then ends without `done`, and the client reconnects with `Last-Event-ID`.
/// A stream whose API key is revoked ends within seconds with an `error` event.
#[utoipa::path(get, path = "/v1/fine_tuning/jobs/{id}/events", tag = "fine-tuning", operation_id = "list_fine_tuning_events",
    params(("id" = String, Path, description = "`ftjob-…`"), EventsQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "With `stream`: resume after this event")),
    responses(
        (status = 200, description = "A page of events, or (with `stream`) server-sent events: \
`event` is the type, `id` the event's id, `data` the event object; a last `done` event carries the job. \
A stream that ends without `done` (its lifetime is over, the server is stopping) is resumed by \
reconnecting with `Last-Event-ID`; one whose key was revoked ends with an `error` event", content(
            (FineTuneEventList = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 400, description = "Invalid query", body = ErrorBody),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
        (status = 404, description = "No such job for this tenant", body = ErrorBody),
        (status = 429, description = "With `stream`: the tenant (or the server) has as many streams open \
as it may (`too_many_streams`); retry after `retry-after`", body = ErrorBody),
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
    let stream = query.stream == Some(true);
    // A client that reconnects to a stream keeps its URL (and so any `after` in it) and
    // says where it got to with `Last-Event-ID`: that wins.
    let cursor = if stream {
        last_event_id.as_ref().or(query.after.as_ref())
    } else {
        query.after.as_ref().or(last_event_id.as_ref())
    };
    let after = match cursor {
        Some(a) => Some(event_seq(&record.id, a)?),
        None => None,
    };
    if stream {
        let hold = match state.holds.take(&tenant.0, HoldKind::EventStream) {
            Ok(hold) => hold,
            Err(refused) => return Ok(holds::refusal(&refused)),
        };
        let watch = Watch {
            _hold: hold,
            tenant: tenant.0.clone(),
            key_hash: tenant.key_hash().to_string(),
        };
        return Ok(stream_events(state.into_inner(), record, after, watch));
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

/// Who an open stream serves, and the slot it holds (given back when the stream is
/// dropped: it ended, the client went away, the server stopped).
struct Watch {
    _hold: Hold,
    tenant: String,
    key_hash: String,
}

/// Why a stream ends before its job does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// The server is stopping.
    Closing,
    /// The stream has lasted its lifetime.
    Lifetime,
    /// Its API key was revoked.
    KeyRevoked,
}

impl Cut {
    /// What the stream sends last: a comment for the client to reconnect on, or (for a
    /// revoked key) an `error` event with the 401's body, after which reconnecting fails.
    fn last_words(self) -> bytes::Bytes {
        match self {
            Cut::Closing => bytes::Bytes::from_static(
                b": the server is stopping; reconnect with Last-Event-ID to go on\n\n",
            ),
            Cut::Lifetime => bytes::Bytes::from_static(
                b": this stream has lasted its lifetime; reconnect with Last-Event-ID to go on\n\n",
            ),
            Cut::KeyRevoked => {
                let error = ApiError::unauthenticated("The API key of this stream was revoked.");
                let body = tuneq_openapi::ErrorBody {
                    error: (*error.detail).clone(),
                };
                sse(
                    "error",
                    None,
                    &serde_json::to_string(&body).unwrap_or_default(),
                )
            }
        }
    }
}

/// Where an open event stream stands: what it has sent, what waits to be sent, and
/// when it must end.
struct StreamCursor {
    state: std::sync::Arc<AppState>,
    record: FineTuneRecord,
    last: Option<u64>,
    pending: std::collections::VecDeque<bytes::Bytes>,
    quiet_since: std::time::Instant,
    done: bool,
    watch: Watch,
    /// None: a lifetime too long to count (it never ends by age).
    ends_at: Option<std::time::Instant>,
    key_checked: std::time::Instant,
}

impl StreamCursor {
    /// Whether the stream must end now, before its job does.
    async fn cut(&mut self) -> Option<Cut> {
        let holds = &self.state.holds;
        if holds.closing() {
            return Some(Cut::Closing);
        }
        let now = std::time::Instant::now();
        if self.ends_at.is_some_and(|end| now >= end) {
            return Some(Cut::Lifetime);
        }
        if now.duration_since(self.key_checked) < holds.limits().key_check {
            return None;
        }
        self.key_checked = now;
        let watch = &self.watch;
        match crate::records::tenant::key_is_live(&self.state.queue, &watch.key_hash, &watch.tenant)
            .await
        {
            Ok(true) => None,
            Ok(false) => {
                tracing::info!(tenant = %watch.tenant, job = %self.record.id, "event stream ended: its key was revoked");
                Some(Cut::KeyRevoked)
            }
            Err(e) => {
                // Checked again next time; the lifetime bounds a stream meanwhile.
                tracing::warn!(error = %e, "event stream: cannot check its key");
                None
            }
        }
    }

    /// Whether the job has ended (a store that does not answer: not yet).
    async fn job_ended(&self) -> bool {
        match self.state.queue.get(&self.record.job_id).await {
            Ok(job) => job.is_none_or(|j| j.state.is_terminal()),
            Err(e) => {
                tracing::warn!(error = %e, "event stream: job store unavailable");
                false
            }
        }
    }

    /// Queues the events logged since the last one sent; whether there were any.
    async fn take_new_events(&mut self) -> bool {
        let events = match self
            .state
            .queue
            .events(&self.record.job_id, self.last, 1000, false)
            .await
        {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(error = %e, "event stream: cannot read events");
                return false;
            }
        };
        for e in &events {
            let rendered = render_event(&self.record, e);
            let data = serde_json::to_string(&rendered).unwrap_or_default();
            self.pending
                .push_back(sse(&rendered.kind, Some(&rendered.id), &data));
            self.last = Some(e.seq);
        }
        if !events.is_empty() {
            self.quiet_since = std::time::Instant::now();
        }
        !events.is_empty()
    }

    /// The stream's next chunk, waiting for one as long as it takes; None: it is over.
    async fn next_chunk(&mut self) -> Option<bytes::Bytes> {
        loop {
            if let Some(chunk) = self.pending.pop_front() {
                return Some(chunk);
            }
            if self.done {
                return None;
            }
            if let Some(cut) = self.cut().await {
                self.pending.push_back(cut.last_words());
                self.done = true;
                continue;
            }
            // Whether it had ended is read before its events, so none logged before the
            // end is missed.
            let ended = self.job_ended().await;
            if self.take_new_events().await {
                continue;
            }
            if ended {
                let job = match view(&self.state, self.record.clone()).await {
                    Ok(job) => serde_json::to_string(&job).unwrap_or_default(),
                    Err(_) => "{}".into(),
                };
                self.pending.push_back(sse("done", None, &job));
                self.done = true;
                continue;
            }
            if self.quiet_since.elapsed() >= STREAM_KEEPALIVE {
                self.quiet_since = std::time::Instant::now();
                return Some(bytes::Bytes::from_static(b": keep-alive\n\n"));
            }
            tokio::time::sleep(STREAM_POLL).await;
        }
    }
}

/// Server-sent events of a job: what it logged after `after`, then new events as they
/// come, until it has ended (a last `done` event carries the job) or the stream is cut
/// short (see [`Cut`]).
fn stream_events(
    state: std::sync::Arc<AppState>,
    record: FineTuneRecord,
    after: Option<u64>,
    watch: Watch,
) -> HttpResponse {
    let now = std::time::Instant::now();
    let lifetime = state.holds.limits().stream_lifetime;
    let cursor = StreamCursor {
        state,
        record,
        last: after,
        pending: Default::default(),
        quiet_since: now,
        done: false,
        watch,
        ends_at: now.checked_add(lifetime),
        key_checked: now,
    };
    let stream = futures::stream::unfold(cursor, |mut c| async move {
        let chunk = c.next_chunk().await?;
        Some((Ok::<_, actix_web::Error>(chunk), c))
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
