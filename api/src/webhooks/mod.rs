//! Webhooks: when a job with a `webhook_url` finishes, a signed event is POSTed there.
//!
//! - **Format:** [Standard Webhooks] v1, which OpenAI uses too, so `client.webhooks.unwrap()`
//!   of the OpenAI SDKs verifies and parses our events. Headers `webhook-id` (the event id,
//!   the same on every try: the receiver's idempotency key), `webhook-timestamp` (Unix
//!   seconds of this try) and `webhook-signature` (`v1,<base64 HMAC-SHA256>` over
//!   `<id>.<timestamp>.<body>`, keyed with the tenant's `whsec_…` secret).
//! - **Delivery:** at least once, unordered; a 2xx is success, anything else (redirects
//!   included, which are never followed) is retried after 5 s, 5 min, 30 min, 2 h, 5 h,
//!   10 h, 14 h, 20 h and 24 h, then given up. 410 Gone stops at once.
//! - **SSRF guard:** a target must be `https://` to a host whose every address is public
//!   (no loopback, private, link-local — cloud metadata lives there — CGNAT, multicast
//!   or reserved ranges), checked when the job is created and again, on the resolved
//!   addresses, at every try; the connection then goes to exactly the addresses that
//!   were checked, so a DNS answer that changes in between cannot redirect it. An
//!   operator whose receivers are on a private network allows private targets (and
//!   plain `http://`) with [`WebhookPolicy::allow_private`].
//!
//! - `settle`: the loop that files each finished job's outcome and sends its event.
//! - [`crate::webhook_target`] (below the handlers) checks targets.
//!
//! [Standard Webhooks]: https://www.standardwebhooks.com/

mod settle;

pub use settle::settle;

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
use tuneq_queue::Catalog;

/// Catalog kind of tenants' signing secrets (one entry per tenant, id [`SECRET_ID`]).
const SECRET_KIND: &str = "webhook_secret";
const SECRET_ID: &str = "current";
/// How long one try may take.
const TRY_TIMEOUT: Duration = Duration::from_secs(15);
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

/// The tenant's signing secrets, made on first use. They are kept sealed (see
/// [`crate::sealed`]); a record from before sealing is read as it is and sealed now.
pub(crate) async fn tenant_secrets(state: &AppState, tenant: &str) -> ApiResult<Secrets> {
    let key = &state.config.sealing_key;
    let parse = |body: &str| -> ApiResult<(Secrets, bool)> {
        if SealingKey::is_sealed(body) {
            let plain = key.open(tenant, body).map_err(|e| {
                tracing::error!(tenant, error = %e, "cannot open a webhook secret");
                ApiError::internal("The webhook secret cannot be read; an operator must check the server's sealing key.")
            })?;
            let secrets = serde_json::from_str::<Secrets>(&plain)
                .map_err(|e| ApiError::internal(format!("webhook secret record: {e}")))?;
            return Ok((secrets, true));
        }
        // Records written before rotation existed hold the bare secret.
        if body.starts_with("whsec_") {
            return Ok((
                Secrets {
                    current: body.to_string(),
                    previous: None,
                    previous_until: None,
                },
                false,
            ));
        }
        serde_json::from_str::<Secrets>(body)
            .map(|s| (s, false))
            .map_err(|e| ApiError::internal(format!("webhook secret record: {e}")))
    };
    if let Some(entry) = state
        .queue
        .get_entry(SECRET_KIND, tenant, SECRET_ID)
        .await?
    {
        let (secrets, sealed) = parse(&entry.body)?;
        if !sealed {
            replace(state, tenant, &secrets).await?;
            tracing::info!(tenant, "webhook secret sealed at rest");
        }
        return Ok(secrets);
    }
    // Two first uses at once: the one whose create lands is the secret.
    let fresh = Secrets {
        current: new_secret(),
        previous: None,
        previous_until: None,
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
    let entry = state
        .queue
        .get_entry(SECRET_KIND, tenant, SECRET_ID)
        .await?
        .ok_or_else(|| ApiError::internal("the webhook secret vanished"))?;
    parse(&entry.body).map(|(secrets, _)| secrets)
}

/// `secrets` as their catalog record: sealed for `tenant`.
fn seal(state: &AppState, tenant: &str, secrets: &Secrets) -> ApiResult<String> {
    let plain = serde_json::to_string(secrets).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(state.config.sealing_key.seal(tenant, &plain))
}

/// Writes `secrets` over the tenant's record, sealed.
async fn replace(state: &AppState, tenant: &str, secrets: &Secrets) -> ApiResult<()> {
    state
        .queue
        .update_entry(
            SECRET_KIND,
            tenant,
            SECRET_ID,
            &seal(state, tenant, secrets)?,
        )
        .await?;
    Ok(())
}

/// Replaces the tenant's current secret; the replaced one signs for another day.
async fn rotate(state: &AppState, tenant: &str) -> ApiResult<Secrets> {
    let old = tenant_secrets(state, tenant).await?;
    let rotated = Secrets {
        current: new_secret(),
        previous: Some(old.current),
        previous_until: Some(crate::records::now_seconds() + ROTATION_OVERLAP_S),
    };
    replace(state, tenant, &rotated).await?;
    tracing::info!(tenant, "webhook secret rotated");
    Ok(rotated)
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

/// POSTs `event`, signed with `secret`, to `target` once.
pub(crate) async fn deliver(
    policy: &WebhookPolicy,
    target: &str,
    secrets: &Secrets,
    event: &WebhookEvent,
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
    let addresses: Vec<SocketAddr> = match tokio::net::lookup_host((host.as_str(), port)).await {
        Ok(found) => found.collect(),
        Err(e) => return Delivery::Retry(format!("cannot resolve {host}: {e}")),
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
        .timeout(TRY_TIMEOUT)
        .connect_timeout(Duration::from_secs(5))
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
    let secrets = rotate(&state, &tenant.0).await?;
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
