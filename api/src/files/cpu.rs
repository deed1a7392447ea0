//! The cores that validating uploads takes, shared out: one validation per core in the
//! whole process, at most [`tenant_share`] of them for one tenant, and a validation
//! whose upload is gone stops (its [`Turn`] travels with the work and is given back
//! only when the work has stopped, not when the client leaves).
//!
//! Uploads wait for a turn rather than being refused: each waiting upload holds an
//! upload slot (`crate::upload_slots`: 4 per tenant, 32 per process), so the waiting
//! line is bounded, and a client that gives up leaves it at once.

use crate::error::{ApiError, ApiResult};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Validations at once in the process: one per core.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get)
}

fn permits() -> &'static Arc<Semaphore> {
    static PERMITS: OnceLock<Arc<Semaphore>> = OnceLock::new();
    PERMITS.get_or_init(|| Arc::new(Semaphore::new(cores())))
}

/// The most validations one tenant runs (or waits for a core for) at once: half the
/// cores, at least one, so one tenant never holds them all while another waits.
pub fn tenant_share() -> usize {
    (cores() / 2).max(1)
}

/// Validations held by each tenant, and a signal when one ends.
struct Shares {
    held: Mutex<HashMap<String, usize>>,
    ended: Notify,
}

fn shares() -> &'static Shares {
    static SHARES: OnceLock<Shares> = OnceLock::new();
    SHARES.get_or_init(|| Shares {
        held: Mutex::new(HashMap::new()),
        ended: Notify::new(),
    })
}

/// How many validations `tenant` has running or waiting for a core now: what a
/// client that went away stops holding once its validation has stopped.
pub fn validations(tenant: &str) -> usize {
    shares()
        .held
        .lock()
        .map_or(0, |held| held.get(tenant).copied().unwrap_or(0))
}

/// One of a tenant's [`tenant_share`] places, given back when dropped.
struct Share(String);

impl Share {
    fn take(tenant: &str) -> ApiResult<Option<Self>> {
        let mut held = shares()
            .held
            .lock()
            .map_err(|_| ApiError::internal("validation shares are poisoned"))?;
        let mine = held.entry(tenant.to_string()).or_insert(0);
        if *mine >= tenant_share() {
            return Ok(None);
        }
        *mine += 1;
        Ok(Some(Self(tenant.to_string())))
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        if let Ok(mut held) = shares().held.lock()
            && let Some(n) = held.get_mut(&self.0)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.0);
            }
        }
        shares().ended.notify_waiters();
    }
}

/// The right to validate on a core: move it into the work, so it is given back when the
/// work stops.
pub(super) struct Turn {
    _share: Share,
    _permit: OwnedSemaphorePermit,
}

/// Waits for a core within the tenant's share.
pub(super) async fn turn(tenant: &str) -> ApiResult<Turn> {
    let share = loop {
        // Listen before looking, so an end between the two is not missed.
        let ended = shares().ended.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        if let Some(share) = Share::take(tenant)? {
            break share;
        }
        ended.await;
    };
    let permit = Arc::clone(permits())
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("the validation semaphore is closed"))?;
    Ok(Turn {
        _share: share,
        _permit: permit,
    })
}

/// Set when dropped: the request that started a validation is gone (the client hung
/// up, or the server is stopping), so the work should stop at its next line.
#[derive(Debug, Default)]
pub(super) struct CancelOnDrop(Arc<AtomicBool>);

impl CancelOnDrop {
    /// The flag the work reads.
    pub(super) fn flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.0)
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tenant_holds_at_most_its_share_and_the_next_waits_for_one_to_end() {
        let tenant = "cpu-share-test";
        let mut held = Vec::new();
        for _ in 0..tenant_share() {
            held.push(turn(tenant).await.unwrap());
        }
        assert_eq!(validations(tenant), tenant_share());
        let mut next = Box::pin(turn(tenant));
        assert!(
            futures::poll!(next.as_mut()).is_pending(),
            "past its share a tenant waits"
        );
        // Another tenant is not held up (where there is a core besides).
        if cores() > tenant_share() {
            drop(turn("cpu-share-other").await.unwrap());
        }
        held.pop();
        let last = next.await.unwrap();
        assert_eq!(validations(tenant), tenant_share());
        drop(last);
        held.clear();
        assert_eq!(validations(tenant), 0);
    }

    #[test]
    fn dropping_the_guard_sets_the_flag() {
        let guard = CancelOnDrop::default();
        let flag = guard.flag();
        assert!(!flag.load(Ordering::Relaxed));
        drop(guard);
        assert!(flag.load(Ordering::Relaxed));
    }
}
