//! Retrying transient backend failures with exponential backoff and full jitter.

use crate::{Error, Result};
use rand::Rng;
use std::future::Future;
use std::time::Duration;

/// How often and how patiently to retry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetryPolicy {
    /// Tries in all, the first included.
    pub attempts: u32,
    /// Backoff before the second try; doubles after each failure.
    pub base: Duration,
    /// Upper bound of one backoff.
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 6,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(8),
        }
    }
}

impl RetryPolicy {
    /// The pause before try number `attempt + 1` (full jitter: uniform in 0..=backoff).
    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX));
        let ceiling = exp.min(self.cap);
        let millis = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(rand::rng().random_range(0..=millis))
    }

    /// Runs `op` until it succeeds, fails with a non-retryable error, or runs out of tries.
    pub async fn run<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut attempt = 0;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() && attempt + 1 < self.attempts => {
                    let pause = self.backoff(attempt);
                    tracing::warn!(operation = what, attempt, error = %e, ?pause, "retrying storage operation");
                    tokio::time::sleep(pause).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Whether an HTTP status means "try again later".
pub(crate) fn status_is_transient(status: u16) -> bool {
    matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
}

/// Maps an HTTP status from a storage API to a typed error.
pub(crate) fn error_for_status(status: u16, uri: &str, message: String) -> Error {
    let uri = uri.to_string();
    match status {
        404 => Error::NotFound { uri },
        401 | 403 => Error::PermissionDenied { uri, message },
        409 | 412 => Error::PreconditionFailed { uri, message },
        429 => Error::Throttled { uri, message },
        s => Error::Backend {
            uri,
            message: format!("HTTP {s}: {message}"),
            retryable: status_is_transient(s),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn transient() -> Error {
        Error::Backend {
            uri: "u".into(),
            message: "reset".into(),
            retryable: true,
        }
    }

    #[tokio::test]
    async fn retries_transient_errors_then_succeeds() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            attempts: 4,
            base: Duration::from_millis(1),
            cap: Duration::from_millis(2),
        };
        let out = policy
            .run("test", || {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move { if n < 2 { Err(transient()) } else { Ok(n) } }
            })
            .await;
        assert_eq!(out.ok(), Some(2));
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn gives_up_at_once_on_permanent_errors_and_after_the_budget() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            attempts: 3,
            base: Duration::from_millis(1),
            cap: Duration::from_millis(1),
        };
        let out: Result<()> = policy
            .run("test", || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { Err(Error::NotFound { uri: "u".into() }) }
            })
            .await;
        assert!(matches!(out, Err(Error::NotFound { .. })));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        calls.store(0, Ordering::SeqCst);
        let out: Result<()> = policy
            .run("test", || {
                calls.fetch_add(1, Ordering::SeqCst);
                async { Err(transient()) }
            })
            .await;
        assert!(out.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn statuses_map_to_typed_errors() {
        assert!(matches!(
            error_for_status(404, "u", String::new()),
            Error::NotFound { .. }
        ));
        assert!(error_for_status(503, "u", String::new()).is_retryable());
        assert!(error_for_status(429, "u", String::new()).is_retryable());
        assert!(!error_for_status(400, "u", String::new()).is_retryable());
        assert!(matches!(
            error_for_status(412, "u", String::new()),
            Error::PreconditionFailed { .. }
        ));
    }
}
