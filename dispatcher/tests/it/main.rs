//! Integration tests of the dispatcher crate, one module per area.

#![allow(clippy::unwrap_used)]

mod control_loop;
mod kubernetes_job;
mod kubernetes_runtime;
mod local_runtime;
mod real_cluster;

/// A message as it was written before the queue reworded it (if it did): under
/// `TUNEQ_TEST_REWORD_MESSAGES=1` the queue stores every message reworded, to prove
/// that no behaviour depends on words; assertions on the words read them back here.
fn as_written(message: &str) -> String {
    match message.strip_prefix(tuneq_queue::prose::REWORDED) {
        Some(reworded) => reworded.chars().rev().collect(),
        None => message.to_string(),
    }
}
mod support;
