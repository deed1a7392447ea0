//! Filing outcomes: the outcome of each finished job goes into its fine-tune record (the
//! queue's outbox lists each finished job until this is done), so a record outlives the
//! queue's retention. A job whose webhook is still to be sent is then handed to its
//! tenant's send queue, which [`super::sender`] works through; filing never waits on a
//! send. It runs beside the server (`tuneq api` and `tuneq up` call [`file_outcomes`] on
//! a timer), never inside a request.

use super::record::{record_of, webhook_pending};
use super::sender::{SendLimits, Sender};
use crate::error::ApiResult;
use crate::state::AppState;
use tuneq_queue::{Delivery, JobQueue};

/// Files the outcomes of up to `batch` finished jobs whose turn has come, and hands
/// those with a webhook still to send to the sender. Returns how many were taken.
pub async fn file_outcomes(state: &AppState, batch: u32) -> ApiResult<usize> {
    let due = state.queue.due_deliveries(batch).await?;
    for delivery in &due {
        if let Err(e) = file_one(state, delivery).await {
            tracing::warn!(job = %delivery.job_id, error = %e.detail.message, "cannot file a finished job's outcome; retrying");
        }
    }
    Ok(due.len())
}

/// One round of both stages, each to its end: files the outcomes of up to `batch`
/// finished jobs, then tries every webhook whose time has come (as many at once as the
/// shares allow) and waits for the tries. Tests and tools use it to step the service by
/// hand; the service runs the stages as two loops instead, so that neither waits on the
/// other. Returns how many outcomes it took.
pub async fn settle(state: &AppState, batch: u32) -> ApiResult<usize> {
    let filed = file_outcomes(state, batch).await?;
    let mut sender = Sender::new(state.clone(), SendLimits::default());
    // A try that ends acknowledges or reschedules its delivery (5 s at least), so each
    // refill starts only deliveries no earlier one tried; the bound covers a try that
    // could record nothing (its delivery stays due).
    for _ in 0..64 {
        if sender.refill().await? == 0 {
            break;
        }
        sender.drain().await;
    }
    Ok(filed)
}

/// Files one finished job's outcome, then acknowledges it or hands its webhook over.
async fn file_one(state: &AppState, delivery: &Delivery) -> ApiResult<()> {
    let Some((record, unfiled)) = record_of(state, delivery).await? else {
        return Ok(());
    };
    if unfiled {
        state.finetunes().save(&record).await?;
        tracing::info!(finetune = %record.id, status = %delivery.state, "fine-tune finished");
        if let (Some(tracker), Some(outcome)) = (&state.tracker, &record.outcome)
            && !record.integrations.is_empty()
        {
            tracker.end(
                &record.integrations,
                outcome.status,
                &record.tenant,
                &record.id,
            );
        }
    }
    if webhook_pending(&record) {
        state.queue.hand_over_delivery(delivery).await?;
        Ok(())
    } else {
        Ok(state.queue.ack_delivery(delivery).await?)
    }
}
