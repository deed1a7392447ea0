//! What a tenant does to a job once it exists: cancel it, pause it, resume it. Each
//! reads the job first, so a finished job is refused naming what it became, and then
//! asks the queue, whose commands are repeatable; the answer is the job as it stands.
//!
//! A pause of a waiting job takes effect at once. A running job's attempt is stopped by
//! its dispatcher after a checkpoint (the job shows `running` with `pause_requested`
//! until then), and holds no machine while paused; a resumed job goes back to its place
//! in line, and its next attempt starts from that checkpoint, so the adapter it ends
//! with is the one an uninterrupted run makes.

use super::view::view;
use crate::error::{ApiError, ApiResult, Code};
use crate::owned::Own;
use crate::records::finetune::FineTuneRecord;
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use tuneq_openapi::{ErrorBody, FineTuneJob, JobStatus};
use tuneq_queue::{JobQueue, JobRecord, JobState, QueueError};

/// A command on a job, named in refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Cancel,
    Pause,
    Resume,
}

impl Command {
    fn verb(self) -> &'static str {
        match self {
            Self::Cancel => "cancel",
            Self::Pause => "pause",
            Self::Resume => "resume",
        }
    }
}

/// `POST /v1/fine_tuning/jobs/{id}/cancel`: a waiting or paused job is cancelled at
/// once; a running one is asked to stop (it shows `running` until its attempt is gone).
/// A finished job is refused with 400 (not 409, which SDKs retry).
#[utoipa::path(post, path = "/v1/fine_tuning/jobs/{id}/cancel", tag = "fine-tuning", operation_id = "cancel_fine_tuning_job",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "The job, cancelled or being cancelled", body = FineTuneJob),
        (status = 400, description = "The job has already finished", body = ErrorBody),
        Own<FineTuneRecord>,
    ))]
#[tracing::instrument(skip_all, fields(tenant = %job.tenant.0, finetune = %job.id))]
pub(crate) async fn cancel(
    state: web::Data<AppState>,
    job: Own<FineTuneRecord>,
) -> ApiResult<HttpResponse> {
    let record = job.object;
    live_job(&state, &record, Command::Cancel).await?;
    state.queue.cancel(&record.job_id).await?;
    tracing::info!("fine-tune cancel requested");
    Ok(HttpResponse::Ok().json(view(&state, record).await?))
}

/// `POST /v1/fine_tuning/jobs/{id}/pause`: a waiting job is paused at once; a running
/// one writes a checkpoint and stops (it shows `running` with `pause_requested` until
/// then, and `paused` after), freeing its machine. Pausing a paused job changes
/// nothing. A finished job, or one being cancelled, is refused with 400.
#[utoipa::path(post, path = "/v1/fine_tuning/jobs/{id}/pause", tag = "fine-tuning", operation_id = "pause_fine_tuning_job",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "The job, paused or pausing", body = FineTuneJob),
        (status = 400, description = "The job has finished (`job_already_finished`) or is being \
cancelled (`job_being_cancelled`)", body = ErrorBody),
        Own<FineTuneRecord>,
    ))]
#[tracing::instrument(skip_all, fields(tenant = %job.tenant.0, finetune = %job.id))]
pub(crate) async fn pause(
    state: web::Data<AppState>,
    job: Own<FineTuneRecord>,
) -> ApiResult<HttpResponse> {
    let record = job.object;
    live_job(&state, &record, Command::Pause).await?;
    let now = state
        .queue
        .pause(&record.job_id)
        .await
        .map_err(|e| refused(e, Command::Pause))?;
    tracing::info!(state = %now, "fine-tune pause requested");
    Ok(HttpResponse::Ok().json(view(&state, record).await?))
}

/// `POST /v1/fine_tuning/jobs/{id}/resume`: a paused job goes back to its place in
/// line; its next attempt continues from the checkpoint the pause wrote. Only a paused
/// job can be resumed (`job_not_paused` otherwise, also while a pause is still being
/// carried out); a finished job is refused with `job_already_finished`.
#[utoipa::path(post, path = "/v1/fine_tuning/jobs/{id}/resume", tag = "fine-tuning", operation_id = "resume_fine_tuning_job",
    params(("id" = String, Path, description = "`ftjob-…`")),
    responses(
        (status = 200, description = "The job, back in line", body = FineTuneJob),
        (status = 400, description = "The job is not paused (`job_not_paused`), has finished \
(`job_already_finished`) or is being cancelled (`job_being_cancelled`)", body = ErrorBody),
        Own<FineTuneRecord>,
    ))]
#[tracing::instrument(skip_all, fields(tenant = %job.tenant.0, finetune = %job.id))]
pub(crate) async fn resume(
    state: web::Data<AppState>,
    job: Own<FineTuneRecord>,
) -> ApiResult<HttpResponse> {
    let record = job.object;
    let queued = live_job(&state, &record, Command::Resume).await?;
    if let Some(job) = queued.filter(|j| j.state != JobState::Paused) {
        return Err(not_paused(job.state.public_status(), job.pause_requested));
    }
    let now = state
        .queue
        .resume(&record.job_id)
        .await
        .map_err(|e| refused(e, Command::Resume))?;
    tracing::info!(state = %now, "fine-tune resumed");
    Ok(HttpResponse::Ok().json(view(&state, record).await?))
}

/// The queue's job behind `record`, refused for `command` when it has finished (or,
/// for a pause or a resume, is being cancelled). The queue's commands are repeatable (a
/// finished job answers its state), so a job that had already finished is told apart
/// by reading it first. None: the queue has forgotten it (its outcome is being filed).
async fn live_job(
    state: &AppState,
    record: &FineTuneRecord,
    command: Command,
) -> ApiResult<Option<JobRecord>> {
    if let Some(outcome) = &record.outcome {
        return Err(already_finished(outcome.status, command));
    }
    let job = state.queue.get(&record.job_id).await?;
    if let Some(job) = &job {
        if job.state.is_terminal() {
            return Err(already_finished(job.state.public_status(), command));
        }
        if job.state == JobState::CancelRequested && command != Command::Cancel {
            return Err(being_cancelled(command));
        }
    }
    Ok(job)
}

/// The 400 for a command the queue refused because the job moved on meanwhile.
fn refused(e: QueueError, command: Command) -> ApiError {
    match e {
        QueueError::WrongState {
            state: Some(state), ..
        } if state.is_terminal() => already_finished(state.public_status(), command),
        QueueError::WrongState {
            state: Some(JobState::CancelRequested),
            ..
        } => being_cancelled(command),
        // What is left of a resume the queue refused: a pause still being carried out.
        QueueError::WrongState {
            state: Some(state), ..
        } if command == Command::Resume => not_paused(state.public_status(), true),
        other => other.into(),
    }
}

fn already_finished(status: JobStatus, command: Command) -> ApiError {
    ApiError::invalid(
        "id",
        Code::JobAlreadyFinished,
        format!(
            "The job has already {status}; there is nothing to {}.",
            command.verb()
        ),
    )
}

fn being_cancelled(command: Command) -> ApiError {
    ApiError::invalid(
        "id",
        Code::JobBeingCancelled,
        format!(
            "The job is being cancelled; there is nothing to {}.",
            command.verb()
        ),
    )
}

/// The 400 for resuming a job that is `status`, not paused (`pausing`: its pause is
/// still being carried out).
fn not_paused(status: JobStatus, pausing: bool) -> ApiError {
    let message = if pausing {
        "The job is still pausing (its attempt is writing a checkpoint); resume it once its \
         status is paused."
            .to_string()
    } else {
        format!("The job is {status}, not paused; there is nothing to resume.")
    };
    ApiError::invalid("id", Code::JobNotPaused, message)
}
