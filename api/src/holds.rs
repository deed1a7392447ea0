//! Responses a client can hold open for as long as it likes — event streams
//! (`…/events?stream=true`) and downloads (file content, adapter archives), which last as
//! long as the client reads slowly — each take a slot here for their whole life, so no
//! tenant can keep the server's connections to itself.
//!
//! Two bounds: each tenant may hold [`HoldLimits::streams_per_tenant`] event streams and
//! [`HoldLimits::downloads_per_tenant`] downloads at once, and the whole process at most
//! [`Holds::per_process`] of both together — at most half of the server's connections
//! (`ApiConfig::max_connections`), so the other half always stays for short requests,
//! trainers' reports and health probes, however many tenants hold what. Past a bound a
//! request is answered 429 with `retry-after` before anything is held.
//!
//! A [`Hold`] is an RAII guard that the response body owns: its slot comes back whenever
//! the body is dropped — the stream ended, the client went away, the server stopped.

use crate::counts::{Counts, Full};
use crate::error::{ApiError, Code};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a client holds open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldKind {
    /// Server-sent events of a job.
    EventStream,
    /// A file's content or an adapter archive.
    Download,
}

/// The bounds on what clients hold open, and how long an event stream may last.
#[derive(Debug, Clone)]
pub struct HoldLimits {
    /// Event streams one tenant may hold open at once (all its keys together).
    pub streams_per_tenant: usize,
    /// Downloads one tenant may hold open at once.
    pub downloads_per_tenant: usize,
    /// Streams and downloads of all tenants together; the server holds at most half of
    /// its connections this way whatever this says (see [`Holds::per_process`]).
    pub per_process: usize,
    /// How long one event stream lasts at most: it then ends without `done`, and the
    /// client reconnects with `Last-Event-ID` (authenticating again).
    pub stream_lifetime: Duration,
    /// How often an open event stream checks that its key still exists (in the
    /// catalog, not this process's key cache, so a revocation through any API process
    /// counts): a revoked key's streams end within this.
    pub key_check: Duration,
}

impl Default for HoldLimits {
    fn default() -> Self {
        Self {
            streams_per_tenant: 16,
            downloads_per_tenant: 8,
            per_process: 256,
            stream_lifetime: Duration::from_secs(15 * 60),
            // As long as the key cache trusts a key (`records::tenant::key_cache::TTL`).
            key_check: Duration::from_secs(10),
        }
    }
}

/// `retry-after` (seconds) when no slot is free: streams and downloads last long, so a
/// client gains nothing by retrying sooner.
const RETRY_AFTER_S: u64 = 10;

/// The slots of one API process (one per [`crate::AppState`], shared by its workers).
#[derive(Debug)]
pub struct Holds {
    limits: HoldLimits,
    per_process: usize,
    held: Mutex<Held>,
    closing: AtomicBool,
}

/// What is held, per tenant and kind.
type Held = Counts<(String, HoldKind)>;

impl Holds {
    /// The slots of a server that holds at most `max_connections` connections.
    pub fn new(limits: HoldLimits, max_connections: usize) -> Self {
        Self {
            per_process: limits.per_process.min(max_connections / 2),
            limits,
            held: Mutex::default(),
            closing: AtomicBool::new(false),
        }
    }

    /// The bounds it keeps.
    pub fn limits(&self) -> &HoldLimits {
        &self.limits
    }

    /// Streams and downloads the process holds at most: [`HoldLimits::per_process`], and
    /// never more than half of the server's connections.
    pub fn per_process(&self) -> usize {
        self.per_process
    }

    /// What is held now, in the whole process.
    pub fn held(&self) -> usize {
        self.lock().total()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        // A panic while counting leaves the counts as they were: keep using them.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot of `kind` for `tenant`, or 429 (`too_many_streams`, `too_many_downloads`)
    /// with `retry-after` when the tenant or the process has none free.
    pub fn take(self: &Arc<Self>, tenant: &str, kind: HoldKind) -> Result<Hold, ApiError> {
        let (code, what, per_tenant) = match kind {
            HoldKind::EventStream => (
                Code::TooManyStreams,
                "event streams",
                self.limits.streams_per_tenant,
            ),
            HoldKind::Download => (
                Code::TooManyDownloads,
                "downloads",
                self.limits.downloads_per_tenant,
            ),
        };
        let key = (tenant.to_string(), kind);
        let mut held = self.lock();
        held.take(key.clone(), self.per_process, per_tenant)
            .map_err(|full| {
                let message = match full {
                    Full::Process => {
                        tracing::warn!(
                            tenant,
                            held = held.total(),
                            ?kind,
                            "no slot left for long responses"
                        );
                        format!(
                            "The server holds {} streams and downloads open already; try again shortly.",
                            self.per_process
                        )
                    }
                    Full::Key => format!(
                        "This tenant has {per_tenant} {what} open, its limit; close one or wait for one to end."
                    ),
                };
                ApiError::too_many(code, message, RETRY_AFTER_S)
            })?;
        Ok(Hold {
            holds: Arc::clone(self),
            key,
        })
    }

    /// Ends every event stream at its next look (the server is stopping): clients
    /// reconnect, with `Last-Event-ID`, to a server that stays.
    pub fn close(&self) {
        self.closing.store(true, Ordering::Relaxed);
    }

    /// Whether [`Holds::close`] was called.
    pub fn closing(&self) -> bool {
        self.closing.load(Ordering::Relaxed)
    }
}

/// The answer to a refused hold: `error`'s 429, on a connection closed after it, so a
/// refused client does not keep a connection either (idle until its keep-alive ends).
pub fn refusal(error: &ApiError) -> actix_web::HttpResponse {
    let mut response = actix_web::ResponseError::error_response(error);
    response
        .head_mut()
        .set_connection_type(actix_web::http::ConnectionType::Close);
    response
}

/// One held slot, given back when dropped.
#[derive(Debug)]
pub struct Hold {
    holds: Arc<Holds>,
    key: (String, HoldKind),
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.holds.lock().give_back(&self.key);
    }
}

/// A response body that keeps its [`Hold`] for as long as it is alive.
pub fn holding<S>(hold: Hold, body: S) -> impl futures::Stream<Item = S::Item>
where
    S: futures::Stream,
{
    use futures::StreamExt;
    futures::stream::unfold((hold, Box::pin(body)), |(hold, mut body)| async move {
        let item = body.next().await?;
        Some((item, (hold, body)))
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn holds(streams: usize, per_process: usize) -> Arc<Holds> {
        Arc::new(Holds::new(
            HoldLimits {
                streams_per_tenant: streams,
                downloads_per_tenant: 1,
                per_process,
                ..HoldLimits::default()
            },
            1000,
        ))
    }

    #[test]
    fn a_tenant_past_its_bound_is_refused_and_others_are_not() {
        let h = holds(2, 100);
        let a = h.take("a", HoldKind::EventStream).unwrap();
        let _b = h.take("a", HoldKind::EventStream).unwrap();
        let refused = h.take("a", HoldKind::EventStream).unwrap_err();
        assert_eq!(refused.code(), Code::TooManyStreams);
        assert!(refused.retry_after.is_some());
        // Kinds and tenants count apart.
        let _d = h.take("a", HoldKind::Download).unwrap();
        assert_eq!(
            h.take("a", HoldKind::Download).unwrap_err().code(),
            Code::TooManyDownloads
        );
        let _c = h.take("b", HoldKind::EventStream).unwrap();
        drop(a);
        let _again = h.take("a", HoldKind::EventStream).unwrap();
        assert_eq!(h.held(), 4);
    }

    #[test]
    fn the_process_bound_is_at_most_half_the_connections_and_slots_come_back() {
        let h = Arc::new(Holds::new(HoldLimits::default(), 10));
        assert_eq!(h.per_process(), 5);
        let held: Vec<_> = (0..5)
            .map(|i| h.take(&format!("t{i}"), HoldKind::EventStream).unwrap())
            .collect();
        assert_eq!(
            h.take("t9", HoldKind::Download).unwrap_err().code(),
            Code::TooManyDownloads
        );
        drop(held);
        assert_eq!(h.held(), 0);
        let _one = h.take("t9", HoldKind::Download).unwrap();
    }

    #[test]
    fn a_body_gives_its_slot_back_when_dropped_early_or_finished() {
        use futures::StreamExt;
        let h = holds(1, 10);
        let body = holding(
            h.take("a", HoldKind::EventStream).unwrap(),
            futures::stream::iter([1, 2, 3]),
        );
        let mut body = Box::pin(body);
        assert_eq!(futures::executor::block_on(body.next()), Some(1));
        assert_eq!(h.held(), 1);
        drop(body);
        assert_eq!(h.held(), 0);
        let body = holding(
            h.take("a", HoldKind::EventStream).unwrap(),
            futures::stream::iter([1]),
        );
        let all: Vec<_> = futures::executor::block_on(body.collect());
        assert_eq!(all, [1]);
        assert_eq!(h.held(), 0);
    }
}
