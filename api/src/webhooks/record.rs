//! The fine-tune record behind a finished job's delivery: what both filing
//! ([`super::settle`]) and sending ([`super::sender`]) read before they act on it.

use crate::error::ApiResult;
use crate::records::finetune::{FineTuneRecord, outcome_of};
use crate::state::AppState;
use tuneq_openapi::{JobPayload, StoredJson};
use tuneq_queue::{Delivery, JobQueue};

/// The fine-tune record a delivery is about, with its outcome filled in from the job
/// when not filed yet (the second value says so; the record is not saved); None, and
/// the delivery acknowledged, when nothing is left to do for it: its job or record is
/// gone.
pub(super) async fn record_of(
    state: &AppState,
    delivery: &Delivery,
) -> ApiResult<Option<(FineTuneRecord, bool)>> {
    let Some(job) = state.queue.get(&delivery.job_id).await? else {
        tracing::warn!(job = %delivery.job_id, "a finished job was trimmed before its outcome was filed or its webhook sent");
        state.queue.ack_delivery(delivery).await?;
        return Ok(None);
    };
    let record = match JobPayload::decode(&job.id, &job.payload) {
        Ok(payload) => {
            state
                .finetunes()
                .get_fresh(&delivery.tenant, &payload.finetune)
                .await?
        }
        Err(e) => {
            // It never reads: nothing can be sent for it, now or later.
            tracing::error!(error = %e, "a finished job's payload does not read; its delivery is dropped");
            None
        }
    };
    let Some(mut record) = record else {
        state.queue.ack_delivery(delivery).await?;
        return Ok(None);
    };
    let unfiled = record.outcome.is_none();
    if unfiled {
        record.outcome = Some(outcome_of(&job)?);
    }
    Ok(Some((record, unfiled)))
}

/// Whether `record`'s webhook is still to be sent.
pub(super) fn webhook_pending(record: &FineTuneRecord) -> bool {
    record.webhook_url.is_some()
        && record
            .webhook
            .as_ref()
            .is_none_or(|w| w.status == tuneq_openapi::DeliveryStatus::Retrying)
}
