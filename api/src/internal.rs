//! The trainers' side door: `POST /internal/attempts/{job}/report`.
//!
//! A trainer reports its progress with the credential its attempt was started with
//! (`Authorization: Bearer <credential>`, see [`tuneq_queue::AttemptSigner`]). Each
//! report renews the attempt's lease and is fenced by the queue: a report from an
//! attempt that was superseded, preempted or cancelled is refused with 410 and changes
//! nothing, which tells that trainer to stop. A `finished` event completes the job. The
//! answer to a delivered report ([`AttemptReportAnswer`]) asks the trainer to write a
//! checkpoint and stop when its tenant paused the job.

use crate::error::{ApiError, ApiResult, Code};
use crate::records::finetune::AttemptResult;
use crate::state::AppState;
use actix_web::{HttpRequest, HttpResponse, web};
use tuneq_openapi::{
    AttemptReport, AttemptReportAnswer, EventKind, JobPayload, LogEntry, Progress, StoredJson,
    TrainEvent,
};
use tuneq_queue::{JobQueue, JobState, NewEvent, QueueError};

/// 410 to a trainer: stop this attempt (`code` says why).
fn gone(code: Code, message: &str) -> ApiError {
    ApiError::new(code, message)
}

/// Metrics events kept per run: enough to plot the loss, few enough that the job's
/// capped event log keeps its first events too.
const METRICS_EVENTS_PER_RUN: u64 = 50;

/// What a report leaves in the job's log: a [`LogEntry`] (its kind and fields), or a
/// warning in words.
enum Logged {
    Entry {
        kind: EventKind,
        fields: serde_json::Value,
    },
    Warning(String),
}

impl From<LogEntry> for Logged {
    fn from(entry: LogEntry) -> Self {
        let (kind, fields) = entry.encode();
        Self::Entry { kind, fields }
    }
}

impl Logged {
    /// The event the log keeps.
    fn event(&self) -> NewEvent<'_> {
        match self {
            Self::Entry { kind, fields } => NewEvent {
                kind: *kind,
                message: "",
                data: Some(fields),
            },
            Self::Warning(message) => NewEvent {
                kind: EventKind::Warning,
                message,
                data: None,
            },
        }
    }
}

/// Folds `events` into the job's progress and picks the ones its log records.
fn apply(progress: &mut Progress, events: &[TrainEvent]) -> Vec<Logged> {
    let mut log = Vec::new();
    for event in events {
        let mut logged = true;
        match event {
            TrainEvent::Started {
                total_steps,
                start_step,
                ..
            } => {
                progress.total_steps = *total_steps;
                restart_at(progress, *start_step);
            }
            TrainEvent::Resumed { step, .. } => {
                restart_at(progress, *step);
                progress.checkpoint_step = Some(*step);
            }
            TrainEvent::Step(m) => {
                progress.step = m.step;
                progress.total_steps = m.total_steps;
                progress.loss = Some(m.loss);
                progress.learning_rate = Some(m.lr);
                progress.eta_seconds = Some(m.eta_s);
                progress.tokens_seen = m.tokens_seen;
                let every = (m.total_steps / METRICS_EVENTS_PER_RUN).max(1);
                logged = m.step == 1 || m.step % every == 0 || m.step == m.total_steps;
            }
            TrainEvent::Eval {
                validation_loss, ..
            } => progress.validation_loss = Some(*validation_loss),
            TrainEvent::Checkpoint { step, .. } => progress.checkpoint_step = Some(*step),
            TrainEvent::Warning { message } => log.push(Logged::Warning(message.clone())),
            TrainEvent::Finished {
                step,
                validation_loss,
                ..
            } => {
                progress.step = *step;
                progress.eta_seconds = Some(0.0);
                if validation_loss.is_some() {
                    progress.validation_loss = *validation_loss;
                }
            }
            TrainEvent::Sample { .. }
            | TrainEvent::Interrupted { .. }
            | TrainEvent::EarlyStopped { .. } => {}
        }
        if let Some(entry) = LogEntry::of(event).filter(|_| logged) {
            log.push(entry.into());
        }
    }
    if progress.total_steps > 0 {
        progress.percent =
            (progress.step as f64 * 100.0 / progress.total_steps as f64).clamp(0.0, 100.0);
    }
    log
}

/// An attempt starts at `step`: whatever an earlier attempt did past it is done again.
fn restart_at(progress: &mut Progress, step: u64) {
    progress.lost_steps += progress.step.saturating_sub(step);
    progress.step = step;
}

/// Keeps a finished run's step metrics as the tenant's result file of the job: its id,
/// or None when the run left none or it could not be kept (the job succeeds either way;
/// the reason goes to the log).
async fn result_file(state: &AppState, job: &tuneq_queue::JobRecord, steps: u64) -> Option<String> {
    let kept = match JobPayload::decode(&job.id, &job.payload) {
        Ok(payload) => {
            crate::finetunes::results::keep(state, &job.tenant, &payload.finetune, steps).await
        }
        Err(e) => Err(ApiError::internal(e.to_string())),
    };
    kept.unwrap_or_else(|e| {
        tracing::warn!(job = %job.id, error = %e.detail.message, "a finished run's step metrics were not kept");
        None
    })
}

/// Sends a report's figures to the job's MLflow runs, when it has any (the tracker's
/// worker sends them; the report never waits on the tracking server).
async fn track(state: &AppState, job: &tuneq_queue::JobRecord, events: &[TrainEvent]) {
    let Some(tracker) = &state.tracker else {
        return;
    };
    let Ok(payload) = JobPayload::decode(&job.id, &job.payload) else {
        return;
    };
    match state.finetunes().get(&job.tenant, &payload.finetune).await {
        Ok(Some(record)) if !record.integrations.is_empty() => {
            tracker.log(&record.integrations, events)
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(job = %job.id, error = %e.detail.message, "cannot find a job's MLflow runs")
        }
    }
}

/// The attempt (job, fencing token) whose credential the request carries; refused
/// unless it is a credential this server signed for `job`.
fn attempt_of(state: &AppState, req: &HttpRequest, job: &str) -> ApiResult<(String, u64)> {
    let credential = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError::unauthenticated("An attempt credential is required."))?;
    state
        .config
        .attempt_signer
        .verify(credential.trim())
        .filter(|(id, _)| id == job)
        .ok_or_else(|| ApiError::unauthenticated("This is not a credential for this attempt."))
}

/// `POST /internal/attempts/{job}/report`.
#[tracing::instrument(skip_all, fields(job = %job))]
pub(crate) async fn report(
    state: web::Data<AppState>,
    req: HttpRequest,
    job: web::Path<String>,
    payload: web::Payload,
) -> ApiResult<HttpResponse> {
    let (id, token) = attempt_of(&state, &req, &job)?;
    // The body is read only now, for a holder of this attempt's credential, and only up
    // to the JSON limit: nobody else can make the server buffer anything.
    let body: AttemptReport =
        crate::body::read_json(payload, req.headers(), state.config.max_json_bytes).await?;
    let record = state
        .queue
        .get(&id)
        .await?
        .ok_or_else(|| gone(Code::JobGone, "The job no longer exists."))?;
    let mut progress = Progress::decode_optional(&id, record.progress.as_deref())
        .map_err(|e| ApiError::internal(e.to_string()))?
        .unwrap_or_default();
    let lost_before = progress.lost_steps;
    let log = apply(&mut progress, &body.events);
    let progress_json = progress
        .encode(&id)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let log_events: Vec<NewEvent<'_>> = log.iter().map(Logged::event).collect();
    let refused = |e: QueueError| match e {
        QueueError::StaleToken(_) => gone(
            Code::AttemptSuperseded,
            "This attempt is no longer the job's live attempt: stop.",
        ),
        QueueError::WrongState { state, .. } => gone(
            Code::AttemptStopped,
            &format!(
                "The job is {}: stop this attempt.",
                state.map_or("in another state", JobState::as_str)
            ),
        ),
        QueueError::NotFound(_) => gone(Code::JobGone, "The job no longer exists."),
        other => other.into(),
    };
    let renewal = state
        .queue
        .report(&id, token, body.seq, Some(&progress_json), &log_events)
        .await
        .map_err(refused)?;
    // A repeated report (a retry after a lost reply) sent its figures the first time.
    if renewal.recorded {
        track(&state, &record, &body.events).await;
    }
    if let Some(pool) = record.pool.as_deref() {
        state
            .pool_stats
            .lost(pool, progress.lost_steps.saturating_sub(lost_before));
        let speed = body.events.iter().rev().find_map(|e| match e {
            TrainEvent::Step(m) => Some(m.tokens_per_s),
            _ => None,
        });
        if let Some(speed) = speed {
            state.pool_stats.observe_speed(pool, speed);
        }
    }
    for event in &body.events {
        if let TrainEvent::Finished {
            step,
            adapter,
            train_loss,
            validation_loss,
            trained_tokens,
            ..
        } = event
        {
            let result = AttemptResult {
                adapter: adapter.clone(),
                trained_tokens: *trained_tokens,
                step: *step,
                train_loss: *train_loss,
                validation_loss: *validation_loss,
                result_file: result_file(&state, &record, *step).await,
            }
            .encode(&id)
            .map_err(|e| ApiError::internal(e.to_string()))?;
            state
                .queue
                .complete(&id, token, &result)
                .await
                .map_err(refused)?;
            tracing::info!(token, step, "attempt finished; job succeeded");
        }
    }
    // A pause reaches the trainer here, within a report's interval; its dispatcher's
    // heartbeat would stop it too, later (a trainer that stopped reporting).
    Ok(HttpResponse::Ok().json(AttemptReportAnswer {
        checkpoint_and_stop: renewal.pause_requested,
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tuneq_openapi::StepMetrics;

    fn step(step: u64, total: u64) -> TrainEvent {
        TrainEvent::Step(StepMetrics {
            step,
            total_steps: total,
            epoch: 0,
            loss: 1.0 / step as f64,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens_per_s: 100.0,
            elapsed_s: 1.0,
            eta_s: (total - step) as f64,
            tokens_seen: step * 10,
            token_accuracy: Some(0.5),
            preference: None,
        })
    }

    #[test]
    fn progress_follows_steps_and_the_log_samples_metrics() {
        let mut progress = Progress::default();
        let events: Vec<TrainEvent> = (1..=200).map(|s| step(s, 200)).collect();
        let log = apply(&mut progress, &events);
        assert_eq!(progress.step, 200);
        assert_eq!(progress.percent, 100.0);
        assert_eq!(progress.tokens_seen, 2000);
        // Step 1, then every 4th step: 1 + 50.
        assert_eq!(log.len(), 51);
        let log = apply(
            &mut progress,
            &[TrainEvent::Checkpoint {
                step: 200,
                location: "file:///x".into(),
            }],
        );
        assert!(matches!(
            log[0],
            Logged::Entry {
                kind: EventKind::Checkpoint,
                ..
            }
        ));
        assert_eq!(progress.checkpoint_step, Some(200));
    }

    #[test]
    fn steps_past_the_last_checkpoint_count_as_lost_when_an_attempt_restarts() {
        let mut progress = Progress::default();
        let first: Vec<TrainEvent> = (1..=30).map(|s| step(s, 100)).collect();
        apply(&mut progress, &first);
        // The next attempt resumes from the checkpoint at step 20 (and says so twice).
        let started = TrainEvent::Started {
            total_steps: 100,
            start_step: 20,
            train_examples: 8,
            validation_examples: 0,
            trainable_params: 10,
            dataset_format: "chat".into(),
        };
        let resumed = TrainEvent::Resumed {
            step: 20,
            checkpoint: "file:///ckpt".into(),
        };
        apply(&mut progress, &[resumed, started]);
        assert_eq!(progress.lost_steps, 10);
        assert_eq!(progress.step, 20);
        let second: Vec<TrainEvent> = (21..=25).map(|s| step(s, 100)).collect();
        apply(&mut progress, &second);
        assert_eq!(progress.lost_steps, 10, "steps going forward lose nothing");
    }
}
