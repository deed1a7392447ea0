//! The API's integration tests, as one test binary (one link instead of one per file):
//! each module drives a real server over HTTP; `support` starts one.

#![allow(clippy::unwrap_used, missing_docs)]

mod aliases;
mod architectures;
mod attempt_reports;
mod failure_codes;
mod files;
mod guessing;
mod hardening;
mod input;
mod limits;
mod openapi;
mod placement;
mod registry;
mod streams;
mod support;
mod validation;
mod webhook_delivery;
mod webhook_tenants;
