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
//! [Standard Webhooks]: https://www.standardwebhooks.com/

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult};
use crate::sealed::SealingKey;
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;
use tuneq_openapi::{ErrorBody, WebhookEvent, WebhookSecret};
use tuneq_queue::Catalog;

/// Catalog kind of tenants' signing secrets (one entry per tenant, id [`SECRET_ID`]).
const SECRET_KIND: &str = "webhook_secret";
const SECRET_ID: &str = "current";
/// Longest accepted webhook URL.
const MAX_URL_LEN: usize = 2048;
/// How long one try may take.
const TRY_TIMEOUT: Duration = Duration::from_secs(15);
/// Waits before each retry; after the last, delivery is given up.
const RETRY_DELAYS_S: [u64; 9] = [5, 300, 1800, 7200, 18000, 36000, 50400, 72000, 86400];

/// Which webhook targets the server accepts.
#[derive(Debug, Clone, Default)]
pub struct WebhookPolicy {
    /// Also private, loopback and link-local addresses, and plain `http://`: for
    /// receivers on the operator's own network (and tests). Off by default.
    pub allow_private: bool,
}

/// Checks a webhook URL given at create: the reason it is refused, if it is.
pub(crate) fn check_url(raw: &str, policy: &WebhookPolicy) -> Result<url::Url, String> {
    if raw.len() > MAX_URL_LEN {
        return Err(format!(
            "webhook_url is longer than {MAX_URL_LEN} characters."
        ));
    }
    let url = url::Url::parse(raw).map_err(|e| format!("webhook_url is not a URL: {e}."))?;
    match url.scheme() {
        "https" => {}
        "http" if policy.allow_private => {}
        "http" => return Err("webhook_url must use https://.".into()),
        other => return Err(format!("webhook_url must use https://, not {other}://.")),
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(
            "webhook_url must not carry credentials; put a token in the path or query.".into(),
        );
    }
    let Some(host) = url.host() else {
        return Err("webhook_url has no host.".into());
    };
    if policy.allow_private {
        return Ok(url);
    }
    match host {
        url::Host::Ipv4(ip) if !is_public(IpAddr::V4(ip)) => Err(format!(
            "webhook_url points at {ip}, which is not a public address."
        )),
        url::Host::Ipv6(ip) if !is_public(IpAddr::V6(ip)) => Err(format!(
            "webhook_url points at {ip}, which is not a public address."
        )),
        url::Host::Domain(name) if is_internal_name(name) => Err(format!(
            "webhook_url points at {name}, which is not a public host."
        )),
        _ => Ok(url),
    }
}

/// Host names that only ever mean something inside a network.
fn is_internal_name(name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost"
        || [
            ".localhost",
            ".local",
            ".internal",
            ".localdomain",
            ".home.arpa",
        ]
        .iter()
        .any(|suffix| name.ends_with(suffix))
        || !name.contains('.')
}

/// Whether `ip` is reachable on the public internet (and so a fair webhook target).
/// IPv6 forms that carry an IPv4 address (mapped, compatible, NAT64, 6to4, Teredo) are
/// not public whatever they carry: a relay or translator may deliver them to the
/// embedded address, which is how a guard that reads only the v6 bits is walked around.
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => is_public_v4(ip),
        IpAddr::V6(ip) => {
            if let Some(v4) = ip.to_ipv4_mapped() {
                return is_public_v4(v4);
            }
            let s = ip.segments();
            !(ip.is_unspecified()
                || ip.is_loopback()
                || ip.is_multicast()
                || s[0..6] == [0, 0, 0, 0, 0, 0] // IPv4-compatible (::/96, deprecated)
                || (s[0] == 0x64 && s[1] == 0xff9b) // NAT64: 64:ff9b::/96 and 64:ff9b:1::/48
                || s[0] == 0x2002 // 6to4
                || (s[0] == 0x2001 && s[1] == 0) // Teredo (2001::/32)
                || (s[0] == 0x2001 && s[1] < 0x0200) // IETF protocol assignments (2001::/23)
                || (s[0] & 0xfe00) == 0xfc00 // unique local
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0] == 0x3fff && s[1] < 0x1000) // documentation (3fff::/20)
                || (s[0] == 0x0100 && s[1..4] == [0, 0, 0])) // discard-only
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // carrier-grade NAT
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast (deprecated)
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || a >= 240) // reserved
}

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
        previous_until: Some(crate::files::now_seconds() + ROTATION_OVERLAP_S),
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
    let timestamp = crate::files::now_seconds();
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

/// Routes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(crate::resource("/webhooks/secret", "GET").route(web::get().to(secret)))
        .service(
            crate::resource("/webhooks/secret/rotate", "POST").route(web::post().to(rotate_secret)),
        );
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
        previous_expires_at: secrets.previous_expires_at(crate::files::now_seconds()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_targets() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "198.18.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a00:1",
            "2001:db8::1",
            "ff02::1",
            "192.88.99.1",
            "::7f00:1",
            "::a9fe:a9fe",
            "64:ff9b:1::a00:1",
            "64:ff9b::808:808",
            "2002:7f00:1::",
            "2002:808:808::1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "fec0::1",
            "3fff::1",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn urls_are_checked_before_a_job_is_accepted() {
        let strict = WebhookPolicy::default();
        assert!(check_url("https://hooks.example.com/tuneq?token=x", &strict).is_ok());
        for (bad, why) in [
            ("http://hooks.example.com/", "https"),
            ("ftp://hooks.example.com/", "https"),
            ("https://127.0.0.1/", "public"),
            ("https://[::1]:8443/", "public"),
            ("https://169.254.169.254/latest/meta-data", "public"),
            ("https://localhost/", "public"),
            ("https://metadata.google.internal/", "public"),
            ("https://printer/", "public"),
            ("https://user:pass@hooks.example.com/", "credentials"),
            ("not a url", "not a URL"),
        ] {
            let reason = check_url(bad, &strict).unwrap_err();
            assert!(reason.contains(why), "{bad}: {reason}");
        }
        let open = WebhookPolicy {
            allow_private: true,
        };
        assert!(check_url("http://127.0.0.1:9000/hook", &open).is_ok());
        assert!(check_url("ftp://127.0.0.1/", &open).is_err());
        // A backslash is a path separator to the url crate: the host is example.com,
        // and the URL kept is the one that will be called.
        let url = check_url("https://example.com\\@127.0.0.1/", &strict).unwrap();
        assert_eq!(url.host_str(), Some("example.com"));
        assert_eq!(url.as_str(), "https://example.com/@127.0.0.1/");
    }

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
