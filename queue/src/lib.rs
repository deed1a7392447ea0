//! The job queue: tuneq's source of truth for accepted jobs.
//!
//! Jobs belong to tenants, wait in line by priority (with aging, so nothing starves),
//! are shared between tenants by weighted fair queueing on GPU-time, and are claimed by
//! dispatchers for a node pool whose capacity (and the tenant's quota) is reserved in
//! the same atomic step as the lease. Every lease carries a fencing token; every later
//! change for that attempt (start, heartbeat, complete, fail, preempt) must present it,
//! and a stale one changes nothing. A lease that runs out makes the job *suspect*, never
//! silently re-dispatched: the dispatcher, which can see the attempt, decides.
//!
//! Layout, from the bottom up (each module uses only those above it):
//! - [`model`]: the job record, states (and their public OpenAI names), leases, events.
//! - [`prose`]: every message the queue stores passes one door (and can be reworded
//!   in tests, to prove no behaviour depends on words).
//! - `error`, `config`: [`QueueError`] (with `is_retryable`) and [`QueueConfig`].
//! - `reply`: reading replies (numbers, strings, job hashes, script status codes).
//! - `scripts`: the Lua scripts in `queue/lua/` as one Redis Functions library.
//! - [`embedded`]: the single-file store for `tuneq up` (an in-memory keyspace, the same
//!   scripts in an embedded Lua, and an append-only log synced per operation).
//! - `backend`: where the keys live (one redis-server, a Cluster, the embedded store)
//!   and how it was reached.
//! - `domain`: one scheduling domain's keys and the fenced-call machinery: retries of
//!   unknown outcomes, fenced transitions that recognise their own earlier try.
//! - `standing`: where a queued job stands (position estimates and their figures).
//! - [`JobQueue`]: the operations every backend offers.
//! - [`scripted`]: [`Queue`], written once, implementing [`JobQueue`]; `connection`
//!   opens one; [`catalog`]: files, API keys, fine-tune records and models, kept beyond
//!   a job's life in the queue, on the same backend.
//! - [`attempt`]: signed credentials a trainer reports its attempt's progress with.
//! - [`bench`](mod@bench): `tuneq bench queue`, the BullMQ kit's workload on our queue.
//! - Behind the `testing` feature: `test_ops` (the queue's movable clock),
//!   `testing` (real redis-servers for tests), `fault_proxy`.
//!
//! The design and its invariants are in `docs/queue.md` (B1–B7).

pub mod attempt;
mod backend;
pub mod bench;
pub mod catalog;
mod config;
mod connection;
mod domain;
pub mod embedded;
mod error;
#[cfg(feature = "testing")]
pub mod fault_proxy;
mod job_queue;
pub mod model;
pub mod prose;
mod reply;
pub mod scripted;
mod scripts;
mod standing;
#[cfg(feature = "testing")]
mod test_ops;
#[cfg(feature = "testing")]
pub mod testing;

pub use attempt::AttemptSigner;
pub use catalog::{Catalog, Entry, Page, Swap};
pub use config::QueueConfig;
pub use error::{QueueError, Result};
pub use job_queue::JobQueue;
pub use scripted::Queue;

pub use model::{
    Delivery, Enqueued, Inspection, JobEvent, JobId, JobRecord, JobState, Lease, NewEvent, NewJob,
    PoolUsage, Position, Renewal, SuspectVerdict, TenantSettings,
};
