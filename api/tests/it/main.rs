//! The API's integration tests, as one test binary (one link instead of one per file):
//! each module drives a real server over HTTP; `support` starts one.

#![allow(clippy::unwrap_used, missing_docs)]

mod attempt_reports;
mod files;
mod hardening;
mod limits;
mod openapi;
mod placement;
mod streams;
mod support;
mod webhook_delivery;
