//! Webhooks: when a job with a `webhook_url` finishes, a signed event is POSTed there.
//!
//! - **Format:** [Standard Webhooks] v1, which OpenAI uses too, so `client.webhooks.unwrap()`
//!   of the OpenAI SDKs verifies and parses our events. Headers `webhook-id` (the event id,
//!   the same on every try: the receiver's idempotency key), `webhook-timestamp` (Unix
//!   seconds of this try) and `webhook-signature` (`v1,<base64 HMAC-SHA256>` over
//!   `<id>.<timestamp>.<body>`, keyed with the tenant's `whsec_…` secret).
//! - **Delivery:** at least once, unordered; a 2xx is success, anything else (redirects
//!   included, which are never followed) is retried after 5 s, 5 min, 30 min, 2 h, 5 h,
//!   10 h, 14 h, 20 h and 24 h, then given up. 410 Gone stops at once. A try gets 5 s
//!   ([`TRY_TIMEOUT`]) for the name lookup, and as much again for the connection and
//!   the answer's status line; a receiver slower than that has failed the try.
//! - **Isolation:** sends run beside each other with a share per tenant and per
//!   endpoint (see [`sender`]), so one tenant's receiver that never answers delays
//!   only that tenant's own webhooks, and filing outcomes never waits on a send.
//! - **SSRF guard:** a target must be `https://` to a host whose every address is public
//!   (no loopback, private, link-local — cloud metadata lives there — CGNAT, multicast
//!   or reserved ranges), checked when the job is created and again, on the resolved
//!   addresses, at every try; the connection then goes to exactly the addresses that
//!   were checked, so a DNS answer that changes in between cannot redirect it. An
//!   operator whose receivers are on a private network allows private targets (and
//!   plain `http://`) with [`WebhookPolicy::allow_private`].
//!
//! - `record`: the fine-tune record a delivery is about, read by filing and sending.
//! - `settle`: files each finished job's outcome and hands its webhook to the sender.
//! - [`sender`]: sends webhooks, a bounded number at once per tenant and per endpoint.
//! - [`crate::webhook_target`] (below the handlers) checks targets.
//!
//! [Standard Webhooks]: https://www.standardwebhooks.com/

mod record;
pub mod sender;
mod settle;

pub use sender::{SendLimits, Sender};
pub use settle::{file_outcomes, settle};

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult};
use crate::sealed::SealingKey;
use crate::state::AppState;
use crate::webhook_target::{WebhookPolicy, check_url, is_public};
use actix_web::{HttpResponse, web};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::net::SocketAddr;
use std::time::Duration;
use tuneq_openapi::{ErrorBody, WebhookEvent, WebhookSecret};
use tuneq_queue::{Catalog, Swap};

/// Catalog kind of tenants' signing secrets (one entry per tenant, id [`SECRET_ID`]).
const SECRET_KIND: &str = "webhook_secret";
const SECRET_ID: &str = "current";
/// How long one try may wait for the name lookup, and again for the connection and the
/// receiver's answer (the default of [`SendLimits::try_timeout`]).
pub const TRY_TIMEOUT: Duration = Duration::from_secs(5);
/// How many times a secret update re-reads the record after another write landed first.
const SWAP_TRIES: usize = 32;
/// Waits before each retry; after the last, delivery is given up.
const RETRY_DELAYS_S: [u64; 9] = [5, 300, 1800, 7200, 18000, 36000, 50400, 72000, 86400];

/// A new signing secret: `whsec_` and 32 random bytes in base64.
fn new_secret() -> String {
    format!("whsec_{}", BASE64.encode(rand::random::<[u8; 32]>()))
}

/// The `webhook-signature` value for `body` sent as event `id` at `timestamp`.
pub(crate) fn sign(secret: &str, id: &str, timestamp: u64, body: &[u8]) -> Result<String, String> {
    let key = BASE64
        .decode(secret.strip_prefix("whsec_").unwrap_or(secret))
        .map_err(|_| "the webhook secret is not base64".to_string())?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    Ok(format!("v1,{}", BASE64.encode(mac.finalize().into_bytes())))
}

/// How long the secret a rotation replaced still signs, so receivers can switch over.
const ROTATION_OVERLAP_S: u64 = 24 * 3600;

/// A tenant's signing secrets: the current one and, for a day after a rotation, the one
/// it replaced (events then carry a signature by each).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Secrets {
    current: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    previous: Option<String>,
    /// Unix seconds until which `previous` still signs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    previous_until: Option<u64>,
    /// When the rotation that made `current` was made (Unix ms, the API's clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rotated_ms: Option<u64>,
}

impl Secrets {
    /// The secrets that sign now.
    pub(crate) fn signing(&self, now: u64) -> Vec<&str> {
        let mut all = vec![self.current.as_str()];
        if let (Some(previous), Some(until)) = (&self.previous, self.previous_until)
            && now < until
        {
            all.push(previous);
        }
        all
    }

    /// When the replaced secret stops signing, while it still does.
    fn previous_expires_at(&self, now: u64) -> Option<u64> {
        self.previous_until.filter(|until| now < *until)
    }
}

/// The tenant's secrets record as stored: its body (for a compare-and-set) and what it
/// holds.
struct Stored {
    body: String,
    secrets: Secrets,
    /// False for a record from before sealing, which holds the secret in plain text.
    sealed: bool,
}

/// The tenant's secrets record, if it has one.
async fn read_secrets(state: &AppState, tenant: &str) -> ApiResult<Option<Stored>> {
    let Some(entry) = state
        .queue
        .get_entry(SECRET_KIND, tenant, SECRET_ID)
        .await?
    else {
        return Ok(None);
    };
    let body = entry.body;
    if SealingKey::is_sealed(&body) {
        let plain = state.config.sealing_key.open(tenant, &body).map_err(|e| {
            tracing::error!(tenant, error = %e, "cannot open a webhook secret");
            ApiError::internal(
                "The webhook secret cannot be read; an operator must check the server's sealing key.",
            )
        })?;
        let secrets = serde_json::from_str::<Secrets>(&plain)
            .map_err(|e| ApiError::internal(format!("webhook secret record: {e}")))?;
        return Ok(Some(Stored {
            body,
            secrets,
            sealed: true,
        }));
    }
    // Records written before rotation existed hold the bare secret.
    let secrets = if body.starts_with("whsec_") {
        Secrets {
            current: body.clone(),
            previous: None,
            previous_until: None,
            rotated_ms: None,
        }
    } else {
        serde_json::from_str::<Secrets>(&body)
            .map_err(|e| ApiError::internal(format!("webhook secret record: {e}")))?
    };
    Ok(Some(Stored {
        body,
        secrets,
        sealed: false,
    }))
}

/// The tenant's signing secrets, made on first use. They are kept sealed (see
/// [`crate::sealed`]); a record from before sealing is read as it is and sealed now.
/// Every write is a compare-and-set over the record read, so a rotation landing at the
/// same moment is never written over.
pub(crate) async fn tenant_secrets(state: &AppState, tenant: &str) -> ApiResult<Secrets> {
    for _ in 0..SWAP_TRIES {
        match read_secrets(state, tenant).await? {
            Some(stored) if stored.sealed => return Ok(stored.secrets),
            Some(stored) => {
                let sealed = seal(state, tenant, &stored.secrets)?;
                if swap(state, tenant, &stored.body, &sealed).await? == Swap::Swapped {
                    tracing::info!(tenant, "webhook secret sealed at rest");
                    return Ok(stored.secrets);
                }
            }
            None => {
                // Two first uses at once: the one whose create lands is the secret.
                let fresh = Secrets {
                    current: new_secret(),
                    previous: None,
                    previous_until: None,
                    rotated_ms: None,
                };
                state
                    .queue
                    .create_entry(
                        SECRET_KIND,
                        tenant,
                        SECRET_ID,
                        &seal(state, tenant, &fresh)?,
                    )
                    .await?;
            }
        }
    }
    Err(busy())
}

/// Too many writes to the tenant's secrets landed first, one after the other.
fn busy() -> ApiError {
    ApiError::unavailable("The webhook secret is being changed by other requests; try again.")
}

/// `secrets` as their catalog record: sealed for `tenant`.
fn seal(state: &AppState, tenant: &str, secrets: &Secrets) -> ApiResult<String> {
    let plain = serde_json::to_string(secrets).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(state.config.sealing_key.seal(tenant, &plain))
}

/// Writes `body` over the tenant's record if it still is `expected`.
async fn swap(state: &AppState, tenant: &str, expected: &str, body: &str) -> ApiResult<Swap> {
    Ok(state
        .queue
        .swap_entry(SECRET_KIND, tenant, SECRET_ID, expected, body)
        .await?)
}

/// Unix milliseconds by this process's clock.
fn now_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Replaces the tenant's current secret; the replaced one signs for another day.
/// `asked_ms` is when the request arrived.
///
/// Rotations that overlap become one: a rotation made after this request arrived
/// already replaced the secret it would replace, so its secret is the answer. Otherwise
/// the new record is written with a compare-and-set over the one read (on any replica,
/// since the record lives in the queue's store), and a write that lost reads again. So
/// every caller is handed a secret that was stored as current and, after one more
/// rotation, is kept as the previous one: none is handed a secret that never signs.
async fn rotate(state: &AppState, tenant: &str, asked_ms: u64) -> ApiResult<Secrets> {
    for _ in 0..SWAP_TRIES {
        let Some(stored) = read_secrets(state, tenant).await? else {
            tenant_secrets(state, tenant).await?;
            continue;
        };
        if stored.secrets.rotated_ms.is_some_and(|at| at >= asked_ms) {
            tracing::info!(tenant, "webhook secret rotated by an overlapping request");
            return Ok(stored.secrets);
        }
        let rotated = Secrets {
            current: new_secret(),
            previous: Some(stored.secrets.current),
            previous_until: Some(crate::records::now_seconds() + ROTATION_OVERLAP_S),
            rotated_ms: Some(now_ms().max(asked_ms)),
        };
        let sealed = seal(state, tenant, &rotated)?;
        if swap(state, tenant, &stored.body, &sealed).await? == Swap::Swapped {
            tracing::info!(tenant, "webhook secret rotated");
            return Ok(rotated);
        }
    }
    Err(busy())
}

/// How one try went.
#[derive(Debug, PartialEq)]
pub(crate) enum Delivery {
    /// The receiver answered 2xx.
    Delivered,
    /// Worth another try: why this one failed.
    Retry(String),
    /// Never worth another try (410 Gone, or a target the policy refuses).
    GiveUp(String),
}

/// When to try again after `attempts` failed tries; None: give up.
pub(crate) fn retry_delay(attempts: u32) -> Option<Duration> {
    let index = usize::try_from(attempts.checked_sub(1)?).ok()?;
    RETRY_DELAYS_S.get(index).map(|s| Duration::from_secs(*s))
}

/// POSTs `event`, signed with `secret`, to `target` once, giving the lookup `timeout` and
/// the connection and answer as much again.
pub(crate) async fn deliver(
    policy: &WebhookPolicy,
    target: &str,
    secrets: &Secrets,
    event: &WebhookEvent,
    timeout: Duration,
) -> Delivery {
    let url = match check_url(target, policy) {
        Ok(url) => url,
        Err(reason) => return Delivery::GiveUp(reason),
    };
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        return Delivery::GiveUp("webhook_url has no host".into());
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    // Resolve once, check every address, and connect to exactly those.
    let lookup = tokio::net::lookup_host((host.as_str(), port));
    let addresses: Vec<SocketAddr> = match tokio::time::timeout(timeout, lookup).await {
        Ok(Ok(found)) => found.collect(),
        Ok(Err(e)) => return Delivery::Retry(format!("cannot resolve {host}: {e}")),
        Err(_) => return Delivery::Retry(format!("resolving {host} took over {timeout:?}")),
    };
    if addresses.is_empty() {
        return Delivery::Retry(format!("{host} has no address"));
    }
    if !policy.allow_private
        && let Some(private) = addresses.iter().find(|a| !is_public(a.ip()))
    {
        return Delivery::GiveUp(format!(
            "{host} resolves to {}, which is not a public address",
            private.ip()
        ));
    }
    let client = match reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(timeout)
        .no_proxy()
        .resolve_to_addrs(&host, &addresses)
        .user_agent(concat!("tuneq-webhooks/", env!("CARGO_PKG_VERSION")))
        .build()
    {
        Ok(client) => client,
        Err(e) => return Delivery::Retry(format!("cannot build an HTTP client: {e}")),
    };
    let body = match serde_json::to_vec(event) {
        Ok(body) => body,
        Err(e) => return Delivery::GiveUp(format!("cannot encode the event: {e}")),
    };
    let timestamp = crate::records::now_seconds();
    // One signature per signing secret, space-separated: a receiver that knows either
    // one verifies the event.
    let signature = match secrets
        .signing(timestamp)
        .into_iter()
        .map(|secret| sign(secret, &event.id, timestamp, &body))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(signatures) => signatures.join(" "),
        Err(e) => return Delivery::GiveUp(e),
    };
    let sent = client
        .post(url)
        .header("content-type", "application/json")
        .header("webhook-id", &event.id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .body(body)
        .send()
        .await;
    match sent {
        Ok(response) if response.status().is_success() => Delivery::Delivered,
        Ok(response) if response.status() == reqwest::StatusCode::GONE => {
            Delivery::GiveUp("the receiver answered 410 Gone".into())
        }
        Ok(response) => Delivery::Retry(format!("the receiver answered {}", response.status())),
        // Without the URL: it may carry a token.
        Err(e) => Delivery::Retry(format!("cannot reach {host}: {}", e.without_url())),
    }
}

/// The tenant's webhook signing secret (made on first request): verify our events with
/// it, e.g. `client.webhooks.unwrap(body, headers, secret=…)` in the OpenAI SDK.
#[utoipa::path(get, path = "/webhooks/secret", tag = "webhooks", operation_id = "get_webhook_secret",
    responses(
        (status = 200, description = "The signing secret", body = WebhookSecret),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
    ))]
pub(crate) async fn secret(state: web::Data<AppState>, tenant: Tenant) -> ApiResult<HttpResponse> {
    let secrets = tenant_secrets(&state, &tenant.0).await?;
    Ok(HttpResponse::Ok().json(shown(&secrets)))
}

/// Replaces the tenant's webhook signing secret. For a day, events carry a signature by
/// the new secret and one by the replaced one, so receivers can switch without losing
/// an event.
#[utoipa::path(post, path = "/webhooks/secret/rotate", tag = "webhooks", operation_id = "rotate_webhook_secret",
    responses(
        (status = 200, description = "The new signing secret", body = WebhookSecret),
        (status = 401, description = "No or unknown API key", body = ErrorBody),
    ))]
pub(crate) async fn rotate_secret(
    state: web::Data<AppState>,
    tenant: Tenant,
) -> ApiResult<HttpResponse> {
    let secrets = rotate(&state, &tenant.0, now_ms()).await?;
    Ok(HttpResponse::Ok().json(shown(&secrets)))
}

fn shown(secrets: &Secrets) -> WebhookSecret {
    WebhookSecret {
        secret: secrets.current.clone(),
        previous_expires_at: secrets.previous_expires_at(crate::records::now_seconds()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn signatures_follow_standard_webhooks() {
        // The example of the Standard Webhooks specification's reference libraries.
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let signature = sign(
            secret,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        )
        .unwrap();
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert!(new_secret().starts_with("whsec_"));
        let rotated = Secrets {
            current: "whsec_new".into(),
            previous: Some("whsec_old".into()),
            previous_until: Some(100),
            rotated_ms: None,
        };
        assert_eq!(rotated.signing(99), ["whsec_new", "whsec_old"]);
        assert_eq!(
            rotated.signing(100),
            ["whsec_new"],
            "the old one signs for a day only"
        );
        assert_eq!(BASE64.decode(&new_secret()[6..]).unwrap().len(), 32);
    }

    #[test]
    fn retries_back_off_then_stop() {
        assert_eq!(retry_delay(0), None);
        assert_eq!(retry_delay(1), Some(Duration::from_secs(5)));
        assert_eq!(retry_delay(2), Some(Duration::from_secs(300)));
        assert_eq!(retry_delay(9), Some(Duration::from_secs(86400)));
        assert_eq!(retry_delay(10), None);
    }
}
