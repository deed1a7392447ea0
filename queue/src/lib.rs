//! The job queue: tuneq's source of truth for accepted jobs.
//!
//! Not built yet (issue 4). It will hold the job record and state machine, the Redis
//! priority queue with weighted tenant fairness, leases with fencing tokens, retries with
//! backoff, cancel, preemption requeue, the per-job event log and the webhook outbox,
//! behind one trait with two backends (Redis Lua scripts; an embedded single-file store)
//! that pass one conformance suite. See `ARCHITECTURE.md` and `queue-design.md`.
