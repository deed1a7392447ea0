//! Integration tests of the dispatcher crate, one module per area.

#![allow(clippy::unwrap_used)]

mod control_loop;
mod kubernetes_job;
mod kubernetes_runtime;
mod local_runtime;
mod real_cluster;
mod support;
