//! Integration tests of the dispatcher crate, one module per area.

#![allow(clippy::unwrap_used)]

mod kubernetes_job;
