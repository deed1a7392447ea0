//! The webhook sender: works through the tenants' send queues (see
//! [`tuneq_queue::JobQueue::due_sends`]) with a continuously refilled set of tries.
//!
//! - **Shares:** at most [`SendLimits::per_endpoint`] tries at once to one endpoint
//!   (a tenant's scheme, host and port), at most [`SendLimits::per_tenant`] for one
//!   tenant and [`SendLimits::total`] in all. A receiver that never answers therefore
//!   holds only its own tenant's share, for at most [`SendLimits::try_timeout`] per try,
//!   and the other tenants' webhooks go out beside it.
//! - **Past the bound:** deliveries a tenant cannot start now are not dropped: they wait
//!   in the queue's durable send queue, and each poll takes at most a few per tenant
//!   into memory, so a tenant with thousands due holds no more memory than one with a
//!   few, and hides no other tenant's deliveries.
//! - **Retries:** a failed try waits in the send queue for the schedule's next delay
//!   ([`super::retry_delay`]): an endpoint that keeps failing is tried less and less
//!   often. Every try of an event carries the same `webhook-id`.
//! - **Shutdown:** [`run`] gives tries in flight [`SHUTDOWN_GRACE`] to end, then drops
//!   them. A dropped try is still in the send queue (only a finished try acknowledges
//!   or reschedules it), so the next start sends it: none is lost, and a receiver may
//!   see an event twice, as at-least-once delivery allows.
//!
//! Concurrency: one sender per API process; each try is a task of its own in a
//! [`JoinSet`], which the sender polls for finished tries between refills.

use super::Delivery as Try;
use super::record::{record_of, webhook_pending};
use crate::error::ApiResult;
use crate::records::finetune::{FineTuneRecord, WebhookProgress};
use crate::records::now_seconds;
use crate::state::AppState;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;
use tokio::task::{Id, JoinSet};
use tuneq_openapi::DeliveryStatus;
use tuneq_openapi::{WebhookEvent, WebhookEventData};
use tuneq_queue::{Delivery, JobQueue};

/// How often the sender looks for deliveries whose time has come.
const POLL: Duration = Duration::from_millis(500);
/// How long [`run`] waits, once stopped, for tries in flight.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How many tries may run at once, and how long each may take.
#[derive(Debug, Clone)]
pub struct SendLimits {
    /// Tries in flight in all.
    pub total: usize,
    /// Tries in flight for one tenant.
    pub per_tenant: usize,
    /// Tries in flight to one endpoint of a tenant (scheme, host and port).
    pub per_endpoint: usize,
    /// Tenants whose due deliveries one poll reads (those waiting longest first). More
    /// than `total`, so tenants whose tries fill every slot cannot hide the rest.
    pub tenants_per_poll: u32,
    /// How long a try may wait for the name lookup, and again for the connection and
    /// the receiver's status line.
    pub try_timeout: Duration,
}

impl Default for SendLimits {
    fn default() -> Self {
        Self {
            total: 64,
            per_tenant: 4,
            per_endpoint: 2,
            tenants_per_poll: 256,
            try_timeout: super::TRY_TIMEOUT,
        }
    }
}

/// What a try in flight holds: its place in the shares.
struct Slot {
    member: String,
    tenant: String,
    endpoint: String,
}

/// The set of tries in flight and the shares they hold.
pub struct Sender {
    state: AppState,
    limits: SendLimits,
    tries: JoinSet<()>,
    slots: HashMap<Id, Slot>,
    members: HashSet<String>,
    per_tenant: HashMap<String, usize>,
    per_endpoint: HashMap<String, usize>,
}

impl Sender {
    /// A sender for the API process `state`, with nothing in flight.
    pub fn new(state: AppState, limits: SendLimits) -> Self {
        Self {
            state,
            limits,
            tries: JoinSet::new(),
            slots: HashMap::new(),
            members: HashSet::new(),
            per_tenant: HashMap::new(),
            per_endpoint: HashMap::new(),
        }
    }

    /// How many tries are in flight.
    pub fn in_flight(&self) -> usize {
        self.slots.len()
    }

    /// Starts tries for the deliveries whose time has come, as far as the shares allow;
    /// the rest stay in the send queue for a later refill. Returns how many started.
    pub async fn refill(&mut self) -> ApiResult<usize> {
        if self.in_flight() >= self.limits.total {
            return Ok(0);
        }
        // Twice a tenant's share, so a tenant whose oldest deliveries wait for a busy
        // endpoint can still send to its others.
        let per_tenant = u32::try_from(self.limits.per_tenant.saturating_mul(2)).unwrap_or(8);
        let due = self
            .state
            .queue
            .due_sends(self.limits.tenants_per_poll, per_tenant)
            .await?;
        let mut started = 0;
        for delivery in due {
            if self.in_flight() >= self.limits.total {
                break;
            }
            if self.members.contains(&member_of(&delivery))
                || self.tenant_load(&delivery.tenant) >= self.limits.per_tenant
            {
                continue;
            }
            match self.start(delivery).await {
                Ok(true) => started += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e.detail.message, "cannot read a webhook's record; retrying")
                }
            }
        }
        Ok(started)
    }

    /// Starts a try of `delivery` if its endpoint has room; whether it started.
    async fn start(&mut self, delivery: Delivery) -> ApiResult<bool> {
        let Some((record, _)) = record_of(&self.state, &delivery).await? else {
            return Ok(false);
        };
        let url = match (&record.webhook_url, webhook_pending(&record)) {
            (Some(url), true) => url.clone(),
            _ => {
                self.state.queue.ack_delivery(&delivery).await?;
                return Ok(false);
            }
        };
        let endpoint = endpoint_of(&delivery.tenant, &url);
        if self.per_endpoint.get(&endpoint).copied().unwrap_or(0) >= self.limits.per_endpoint {
            return Ok(false);
        }
        let slot = Slot {
            member: member_of(&delivery),
            tenant: delivery.tenant.clone(),
            endpoint,
        };
        *self.per_tenant.entry(slot.tenant.clone()).or_default() += 1;
        *self.per_endpoint.entry(slot.endpoint.clone()).or_default() += 1;
        self.members.insert(slot.member.clone());
        let (state, timeout) = (self.state.clone(), self.limits.try_timeout);
        let handle = self.tries.spawn(async move {
            if let Err(e) = send(&state, &delivery, record, &url, timeout).await {
                tracing::warn!(job = %delivery.job_id, error = %e.detail.message, "cannot record a webhook try; retrying");
            }
        });
        self.slots.insert(handle.id(), slot);
        Ok(true)
    }

    /// Tries in flight for `tenant`.
    fn tenant_load(&self, tenant: &str) -> usize {
        self.per_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Waits for the next try to end and frees its share; false when none is in flight.
    pub async fn next_done(&mut self) -> bool {
        let id = match self.tries.join_next_with_id().await {
            None => return false,
            Some(Ok((id, ()))) => id,
            Some(Err(e)) => {
                if e.is_panic() {
                    tracing::error!("a webhook try panicked; it stays in the send queue");
                }
                e.id()
            }
        };
        if let Some(slot) = self.slots.remove(&id) {
            self.members.remove(&slot.member);
            release(&mut self.per_tenant, &slot.tenant);
            release(&mut self.per_endpoint, &slot.endpoint);
        }
        true
    }

    /// Waits for every try in flight to end.
    pub async fn drain(&mut self) {
        while self.next_done().await {}
    }
}

/// A delivery's identity in the send queue.
fn member_of(delivery: &Delivery) -> String {
    delivery.member()
}

/// Counts one try fewer under `key`, forgetting keys with none.
fn release(counts: &mut HashMap<String, usize>, key: &str) {
    if let Some(n) = counts.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(key);
        }
    }
}

/// The share key of `url` for `tenant`: the tenant, the scheme, host and port (a URL
/// that does not parse is its own endpoint; the try refuses it).
fn endpoint_of(tenant: &str, url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => format!(
            "{tenant} {}://{}:{}",
            parsed.scheme(),
            parsed.host_str().unwrap_or(""),
            parsed.port_or_known_default().unwrap_or(0)
        ),
        Err(_) => format!("{tenant} {url}"),
    }
}

/// Sends webhooks until `stop` resolves: refills the set of tries every [`POLL`] and
/// frees shares as tries end. Once stopped, tries in flight get [`SHUTDOWN_GRACE`];
/// those still running then are dropped and stay in the send queue for the next start.
pub async fn run(state: AppState, limits: SendLimits, stop: impl Future<Output = ()>) {
    let mut sender = Sender::new(state, limits);
    let mut poll = tokio::time::interval(POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            () = &mut stop => break,
            _ = poll.tick() => {
                if let Err(e) = sender.refill().await {
                    tracing::warn!(error = %e.detail.message, "cannot read the webhook send queue; retrying");
                }
            }
            true = sender.next_done(), if sender.in_flight() > 0 => {}
        }
    }
    let left = sender.in_flight();
    if tokio::time::timeout(SHUTDOWN_GRACE, sender.drain())
        .await
        .is_err()
    {
        tracing::info!(
            in_flight = sender.in_flight(),
            started = left,
            "webhook tries dropped at shutdown; they are sent at the next start"
        );
    }
}

/// Tries `record`'s webhook once and records how it went: in the record, and in the
/// send queue (acknowledged, or rescheduled for the next try).
async fn send(
    state: &AppState,
    delivery: &Delivery,
    mut record: FineTuneRecord,
    url: &str,
    timeout: Duration,
) -> ApiResult<()> {
    let Some(outcome) = record.outcome.as_ref() else {
        // record_of fills it in; nothing to announce without it.
        return Ok(state.queue.ack_delivery(delivery).await?);
    };
    let event = WebhookEvent {
        id: webhook_event_id(&record.id, outcome.status.as_str()),
        object: "event".into(),
        created_at: outcome.finished_at,
        kind: format!("fine_tuning.job.{}", outcome.status),
        data: WebhookEventData {
            id: record.id.clone(),
        },
    };
    let secrets = super::tenant_secrets(state, &record.tenant).await?;
    let result = super::deliver(&state.config.webhooks, url, &secrets, &event, timeout).await;
    let progress = record.webhook.get_or_insert_with(WebhookProgress::default);
    progress.attempts += 1;
    let retry_in = match result {
        Try::Delivered => {
            progress.status = DeliveryStatus::Delivered;
            progress.delivered_at = Some(now_seconds());
            progress.last_error = None;
            None
        }
        Try::Retry(reason) => match super::retry_delay(progress.attempts) {
            Some(delay) => {
                progress.status = DeliveryStatus::Retrying;
                progress.last_error = Some(reason);
                Some(delay)
            }
            None => {
                progress.status = DeliveryStatus::Failed;
                progress.last_error = Some(reason);
                None
            }
        },
        Try::GiveUp(reason) => {
            progress.status = DeliveryStatus::Failed;
            progress.last_error = Some(reason);
            None
        }
    };
    tracing::info!(
        finetune = %record.id,
        event = %event.id,
        attempt = progress.attempts,
        status = ?progress.status,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_per_tenant_scheme_host_and_port() {
        assert_eq!(
            endpoint_of("acme", "https://hooks.example.com/a?x=1"),
            "acme https://hooks.example.com:443"
        );
        assert_eq!(
            endpoint_of("acme", "https://hooks.example.com:443/b"),
            endpoint_of("acme", "https://hooks.example.com/a")
        );
        assert_ne!(
            endpoint_of("acme", "https://hooks.example.com/a"),
            endpoint_of("other", "https://hooks.example.com/a"),
            "tenants sharing a receiver do not share a share"
        );
        assert_eq!(endpoint_of("acme", "::"), "acme ::");
    }

    #[test]
    fn a_share_freed_is_forgotten() {
        let mut counts = HashMap::from([("a".to_string(), 2)]);
        release(&mut counts, "a");
        assert_eq!(counts.get("a"), Some(&1));
        release(&mut counts, "a");
        assert!(counts.is_empty());
        release(&mut counts, "b");
        assert!(counts.is_empty());
    }
}
