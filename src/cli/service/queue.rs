//! Opening the queue (embedded, Redis or Redis Cluster) and the signer of attempt
//! credentials that goes with it.

use crate::cli::BadInput;
use anyhow::{Context, Result};
use std::path::Path;

/// The queue domain every part of one deployment uses.
pub const DOMAIN: &str = "tuneq";

/// Opens the queue with `config`: on Redis when a URL is given (`redis://…`; several
/// comma-separated URLs are the seed nodes of a Redis Cluster), else the embedded file
/// `embedded`.
pub async fn open_queue(
    redis: Option<&str>,
    embedded: &Path,
    config: tuneq_queue::QueueConfig,
) -> Result<tuneq_queue::Queue> {
    match redis {
        Some(urls) if urls.contains(',') => {
            let urls: Vec<String> = urls.split(',').map(|u| u.trim().to_string()).collect();
            tuneq_queue::Queue::connect_cluster(&urls, DOMAIN, config)
                .await
                .context("cannot reach the Redis Cluster")
        }
        Some(url) => tuneq_queue::Queue::connect(url, DOMAIN, config)
            .await
            .with_context(|| format!("cannot reach Redis at {}", redact(url))),
        None => tuneq_queue::Queue::open_embedded(embedded, DOMAIN, config)
            .await
            .with_context(|| format!("cannot open the queue file {}", embedded.display())),
    }
}

/// `urls` (one Redis URL, or a Cluster's comma-separated seeds) with `password` set on
/// each, percent-encoded, so a deployment can keep the password in a Secret of its own
/// instead of writing it into a URL (where characters like `@`, `/` or `:` break it).
pub fn redis_with_password(urls: &str, password: Option<&str>) -> Result<String> {
    let Some(password) = password.filter(|p| !p.is_empty()) else {
        return Ok(urls.to_string());
    };
    let with = urls
        .split(',')
        .map(|u| {
            let bad = |why: &str| BadInput(format!("TUNEQ_REDIS_URL {}: {why}", redact(u.trim())));
            let mut url = url::Url::parse(u.trim()).map_err(|e| bad(&e.to_string()))?;
            url.set_password(Some(password))
                .map_err(|()| bad("cannot hold a password"))?;
            Ok(url.to_string())
        })
        .collect::<Result<Vec<_>, BadInput>>()?;
    Ok(with.join(","))
}

/// A Redis URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://…@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// The signer of attempt credentials from a shared secret (at least 32 characters), or
/// a random one for a single process that runs both the API and the dispatcher.
pub fn attempt_signer(secret: Option<&str>) -> Result<tuneq_queue::AttemptSigner> {
    match secret {
        Some(s) if s.len() >= 32 => Ok(tuneq_queue::AttemptSigner::new(s.as_bytes().to_vec())),
        Some(_) => Err(BadInput(
            "the attempt secret must be at least 32 characters (e.g. `openssl rand -hex 32`)"
                .into(),
        )
        .into()),
        None => Ok(tuneq_queue::AttemptSigner::new(
            rand::random::<[u8; 32]>().to_vec(),
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_kept_out_of_messages() {
        assert_eq!(
            redact("redis://:secret@host:6379/0"),
            "redis://…@host:6379/0"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(attempt_signer(Some("short")).is_err());
        assert!(attempt_signer(Some(&"x".repeat(32))).is_ok());
    }
}
