//! A fake Kubernetes API server, in process, for testing tuneq's kube-rs code: faithful
//! where kube-rs depends on the server (uids, resourceVersions, watches with bookmarks and
//! `410 Expired`, the status subresource, delete propagation, the exact error `reason`
//! strings), with step-driven simulators of the Job controller, the scheduler, the kubelet
//! and the disruptions of a spot cluster, so a test decides when each thing happens.
//!
//! Dev-only (`publish = false`). What no fake can prove (validation, admission, RBAC, real
//! controller timing) is listed in `docs/kubernetes.md`.
//!
//! Layout:
//! - [`store`]: the objects, the resourceVersion counter, the watch history, and the
//!   server's write rules (stamping, `/status`, deletion, finalizers, grace periods).
//! - [`selector`]: label selectors (equality and set-based) and field selectors.
//! - `api`: the HTTP routes and their answers (`Status` bodies, codes, `Warning`s).
//! - `watch`: watch streams, bookmarks, `Expired`.
//! - [`log`]: the request log tests assert on.
//! - [`transport`]: reaching the fake: a `tower::Service` for `kube::Client`, a loopback
//!   HTTP server and its kubeconfig.
//! - [`controller`]: the Job controller simulator ([`FakeCluster::sync_jobs`]).
//! - [`kubelet`]: the scheduler, kubelet and disruption simulators.
//! - [`process`]: the process kubelet, which runs pods as local processes of a real
//!   binary ([`FakeCluster::run_pods_as_processes`]).
//!
//! Concurrency: one `std::sync::Mutex` over the whole [`store::State`], never held across
//! an await; every change bumps a `tokio::sync::watch` signal that open watch streams
//! wait on. Simulators run only when a test calls them: no background timers, except the
//! process kubelet's task once a test starts one.

pub mod controller;
pub mod kubelet;
pub mod log;
pub mod process;
pub mod selector;
pub mod store;
pub mod transport;

mod api;
mod watch;

pub use log::RequestRecord;
pub use store::Kind;
pub use transport::kubeconfig;

use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::State;

/// The body of every answer: a JSON document or a watch stream.
pub type ResponseBody =
    http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, std::convert::Infallible>;

/// Errors of the simulators and the transport.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A simulator was told about an object the cluster does not have.
    #[error("no {kind:?} called {name:?} in the fake cluster")]
    NotFound {
        /// Its kind.
        kind: Kind,
        /// The name it was asked by.
        name: String,
    },
    /// The loopback server could not bind or read its address.
    #[error("cannot serve the fake API on 127.0.0.1")]
    Serve(#[source] std::io::Error),
    /// A simulator was asked for something the object's state does not allow.
    #[error("{0}")]
    InvalidState(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What open watch streams wait on: the last resourceVersion and how many times streams
/// were told to close.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Signal {
    rv: u64,
    epoch: u64,
}

struct Inner {
    state: Mutex<State>,
    signal: tokio::sync::watch::Sender<Signal>,
    /// The process kubelet running this cluster's pods, if one is.
    processes: Mutex<Option<std::sync::Weak<process::Shared>>>,
}

/// A fake cluster: cheap to clone (clones share the cluster).
#[derive(Clone)]
pub struct FakeCluster {
    inner: Arc<Inner>,
}

impl Default for FakeCluster {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for FakeCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (objects, rv) = self.with_state(|s| (s.objects.len(), s.rv));
        f.debug_struct("FakeCluster")
            .field("objects", &objects)
            .field("resource_version", &rv)
            .finish()
    }
}

impl FakeCluster {
    /// An empty cluster.
    pub fn new() -> Self {
        let (signal, _) = tokio::sync::watch::channel(Signal::default());
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                signal,
                processes: Mutex::new(None),
            }),
        }
    }

    /// Runs `f` on the state under the lock, then wakes watches if it changed anything.
    pub fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let (r, rv) = {
            // A panic elsewhere under the lock leaves the state as it was: keep serving.
            let mut state = self
                .inner
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let r = f(&mut state);
            (r, state.rv)
        };
        self.inner.signal.send_if_modified(|s| {
            let changed = s.rv != rv;
            s.rv = rv;
            changed
        });
        r
    }

    pub(crate) fn processes(
        &self,
    ) -> std::sync::MutexGuard<'_, Option<std::sync::Weak<process::Shared>>> {
        self.inner
            .processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<Signal> {
        self.inner.signal.subscribe()
    }

    /// The object `name` (`name` or `namespace/name`) of `kind`, as stored.
    pub fn get(&self, kind: Kind, name: &str) -> Option<Value> {
        self.with_state(|s| s.find(kind, name).and_then(|k| s.objects.get(&k).cloned()))
    }

    /// Every object of `kind`, in name order, as stored.
    pub fn list(&self, kind: Kind) -> Vec<Value> {
        self.with_state(|s| {
            s.objects
                .iter()
                .filter(|((k, _, _), _)| *k == kind)
                .map(|(_, o)| o.clone())
                .collect()
        })
    }

    /// Stores `obj` as a client's POST would (stamped, status reset for Jobs and Pods).
    /// Its namespace is `metadata.namespace`, or `default`.
    pub fn create(&self, kind: Kind, obj: Value) -> Result<Value> {
        let namespace = if kind.namespaced() {
            store::meta_str(&obj, "namespace")
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        let name = store::meta_str(&obj, "name")
            .unwrap_or_default()
            .to_string();
        self.with_state(|s| s.create(&(kind, namespace, name.clone()), obj, false))
            .map_err(|_| Error::InvalidState(format!("{kind:?} {name:?} already exists")))
    }

    /// Every request served so far, oldest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.with_state(|s| s.log.clone())
    }

    /// The last resourceVersion handed out.
    pub fn resource_version(&self) -> u64 {
        self.with_state(|s| s.rv)
    }

    /// The cluster's clock (the machine's, plus what [`FakeCluster::advance`] added).
    pub fn now(&self) -> k8s_openapi::jiff::Timestamp {
        self.with_state(|s| s.now())
    }

    /// Moves the cluster's clock forward (for `activeDeadlineSeconds`, the classifier's
    /// timeouts): times written afterwards are that much later.
    pub fn advance(&self, by: Duration) {
        self.with_state(|s| s.clock_offset += by);
    }

    /// The next `n` watch requests answer one ERROR event with reason `Expired` (code 410)
    /// and end, so the client must relist.
    pub fn expire_next_watches(&self, n: usize) {
        self.with_state(|s| s.watch.expire_next += n);
    }

    /// A compaction: watches from any resourceVersion before now answer `Expired`.
    pub fn compact(&self) {
        self.with_state(|s| s.watch.compacted_below = s.rv + 1);
    }

    /// Ends every open watch stream (cleanly, as an API server restart or a load balancer
    /// does), so clients re-watch from their last resourceVersion.
    pub fn close_watches(&self) {
        self.inner.signal.send_modify(|s| s.epoch += 1);
    }

    /// From now on, every create of `kind` is answered `code` with `reason` and
    /// `message`, as a real API server refuses an object its validation or an admission
    /// webhook rejects (`422 Invalid`, `403 Forbidden`); the fake validates nothing itself.
    pub fn refuse_creates(&self, kind: Kind, code: u16, reason: &'static str, message: &str) {
        let refusal = store::ApiError {
            code,
            reason,
            message: message.to_string(),
            details: None,
        };
        self.with_state(|s| s.refused_creates.insert(kind, refusal));
    }

    /// How often idle watches that allow bookmarks get one (default 1 s).
    pub fn set_bookmark_interval(&self, every: Duration) {
        self.with_state(|s| s.watch.bookmark_interval = every);
    }
}
