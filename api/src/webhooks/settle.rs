//! The settle loop: files the outcome of finished jobs in their fine-tune records (the
//! queue's outbox lists each finished job until this acknowledges it), so a record
//! outlives the queue's retention, and sends the webhooks asked for: a delivery that
//! fails stays in the outbox until its next try is due. It runs beside the server
//! (`tuneq api` and `tuneq up` call [`settle`] on a timer), never inside a request.

use super::Delivery;
use crate::error::ApiResult;
use crate::records::finetune::{WebhookProgress, outcome_of};
use crate::records::now_seconds;
use crate::state::AppState;
use sha2::{Digest, Sha256};
use tuneq_openapi::{JobPayload, WebhookEvent, WebhookEventData};
use tuneq_queue::JobQueue;

/// Settles up to `batch` finished jobs whose turn has come. Returns how many were
/// handled.
pub async fn settle(state: &AppState, batch: u32) -> ApiResult<usize> {
    use futures::StreamExt;
    let due = state.queue.due_deliveries(batch).await?;
    let handled = due.len();
    // Concurrently: one slow receiver must not hold up the others' events.
    futures::stream::iter(due)
        .for_each_concurrent(16, |delivery| async move {
            if let Err(e) = settle_one(state, &delivery).await {
                tracing::warn!(job = %delivery.job_id, error = %e.detail.message, "cannot settle a finished job; retrying");
            }
        })
        .await;
    Ok(handled)
}
/// Settles one finished job: its outcome filed, then its webhook tried.
async fn settle_one(state: &AppState, delivery: &tuneq_queue::Delivery) -> ApiResult<()> {
    let Some(job) = state.queue.get(&delivery.job_id).await? else {
        tracing::warn!(job = %delivery.job_id, "a finished job was trimmed before its outcome was filed");
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    let Ok(payload) = serde_json::from_str::<JobPayload>(&job.payload) else {
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    let Some(mut record) = state
        .finetunes()
        .get_fresh(&delivery.tenant, &payload.finetune)
        .await?
    else {
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    if record.outcome.is_none() {
        record.outcome = Some(outcome_of(&job));
        state.finetunes().save(&record).await?;
        tracing::info!(finetune = %record.id, status = %delivery.state, "fine-tune finished");
    }
    let pending = record.webhook_url.is_some()
        && record
            .webhook
            .as_ref()
            .is_none_or(|w| w.status == "retrying");
    if !pending {
        return Ok(state.queue.ack_delivery(delivery).await?);
    }
    let (Some(url), Some(outcome)) = (record.webhook_url.clone(), record.outcome.as_ref()) else {
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    let event = WebhookEvent {
        id: webhook_event_id(&record.id, &outcome.status),
        object: "event".into(),
        created_at: outcome.finished_at,
        kind: format!("fine_tuning.job.{}", outcome.status),
        data: WebhookEventData {
            id: record.id.clone(),
        },
    };
    let secrets = super::tenant_secrets(state, &record.tenant).await?;
    let result = super::deliver(&state.config.webhooks, &url, &secrets, &event).await;
    let progress = record.webhook.get_or_insert_with(WebhookProgress::default);
    progress.attempts += 1;
    let retry_in = match result {
        Delivery::Delivered => {
            progress.status = "delivered".into();
            progress.delivered_at = Some(now_seconds());
            progress.last_error = None;
            None
        }
        Delivery::Retry(reason) => match super::retry_delay(progress.attempts) {
            Some(delay) => {
                progress.status = "retrying".into();
                progress.last_error = Some(reason);
                Some(delay)
            }
            None => {
                progress.status = "failed".into();
                progress.last_error = Some(reason);
                None
            }
        },
        Delivery::GiveUp(reason) => {
            progress.status = "failed".into();
            progress.last_error = Some(reason);
            None
        }
    };
    tracing::info!(
        finetune = %record.id,
        event = %event.id,
        attempt = progress.attempts,
        status = %progress.status,
        error = progress.last_error.as_deref().unwrap_or(""),
        "webhook"
    );
    state.finetunes().save(&record).await?;
    match retry_in {
        Some(delay) => {
            let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
            Ok(state.queue.retry_delivery(delivery, ms).await?)
        }
        None => Ok(state.queue.ack_delivery(delivery).await?),
    }
}

/// The event id of a job reaching `status`: the same on every try.
fn webhook_event_id(finetune: &str, status: &str) -> String {
    let digest = Sha256::digest(format!("{finetune}|{status}").as_bytes());
    format!("evt_{}", &hex::encode(digest)[..24])
}
