//! Integration tests of the fake API server through kube-rs: the server's semantics, the
//! watcher, the loopback HTTP server, and the simulators read back by tuneq's classifier.

#![allow(clippy::unwrap_used)]

mod api;
mod processes;
mod simulators;
mod watch;

use serde_json::{Value, json};

/// A minimal Job named `name` with `labels`, one container `trainer`.
pub fn job(name: &str, labels: Value) -> k8s_openapi::api::batch::v1::Job {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 25,
                         "containers": [{"name": "trainer", "image": "tuneq:test"}]},
            },
        },
    }))
    .unwrap()
}
