//! What a trainer's reports leave in a job's event log: written by the API when a report
//! arrives and read back to render the job's events and list its checkpoints, as one
//! typed value on both sides (never re-parsed by field names).
//!
//! The queue's log keeps each entry as a kind and a message; for these entries the
//! message is the JSON of the entry's fields, so entries written before this type
//! existed read the same. Entries the queue writes itself (`queued`, `preempted`, …) and
//! trainers' warnings are plain text and not [`LogEntry`]s.

use serde::{Deserialize, Serialize};

/// One entry of a job's event log that a trainer's report produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "fields", rename_all = "snake_case")]
pub enum LogEntry {
    /// An attempt loaded its data and model and starts (or resumes) training.
    TrainingStarted {
        /// Optimiser steps the whole run takes.
        total_steps: u64,
        /// Step the attempt starts from.
        start_step: u64,
        /// Training examples.
        train_examples: u64,
        /// Validation examples.
        validation_examples: u64,
        /// Parameters trained (the adapter's).
        trainable_params: u64,
        /// The dataset's format as detected.
        dataset_format: String,
    },
    /// An attempt resumed from a checkpoint.
    Resumed {
        /// The checkpoint's step.
        step: u64,
        /// Where the checkpoint is stored.
        location: String,
    },
    /// A sample of the training metrics (the log keeps about 50 per run).
    Metrics {
        /// Steps done.
        step: u64,
        /// Steps the run takes.
        total_steps: u64,
        /// Training loss at this step (None when it was not a number).
        train_loss: Option<f64>,
        /// Learning rate at this step.
        learning_rate: Option<f64>,
        /// Training speed.
        tokens_per_s: Option<f64>,
        /// Seconds left, estimated.
        eta_s: Option<f64>,
        /// Tokens trained on so far.
        tokens_seen: u64,
    },
    /// A validation loss.
    Eval {
        /// The step it was measured at.
        step: u64,
        /// The loss (None when it was not a number).
        valid_loss: Option<f64>,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Its step.
        step: u64,
        /// Where it is stored.
        location: String,
    },
}

impl LogEntry {
    /// The entry as the log stores it: its kind and its message (the fields as JSON).
    pub fn encode(&self) -> (String, String) {
        let value = serde_json::to_value(self).unwrap_or_default();
        let kind = value["kind"].as_str().unwrap_or_default().to_string();
        (kind, value["fields"].to_string())
    }

    /// The entry a log event of `kind` with `message` holds; None for any other kind
    /// (and for a message that does not parse as that kind's fields).
    pub fn decode(kind: &str, message: &str) -> Option<Self> {
        let fields: serde_json::Value = serde_json::from_str(message).ok()?;
        serde_json::from_value(serde_json::json!({ "kind": kind, "fields": fields })).ok()
    }

    /// The entry's fields as a JSON value (what a rendered event carries as `data`).
    pub fn fields(&self) -> serde_json::Value {
        serde_json::to_value(self)
            .map(|mut v| v["fields"].take())
            .unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_through_the_logs_kind_and_message() {
        let entry = LogEntry::Metrics {
            step: 4,
            total_steps: 8,
            train_loss: Some(1.5),
            learning_rate: Some(1e-4),
            tokens_per_s: Some(100.0),
            eta_s: Some(2.0),
            tokens_seen: 40,
        };
        let (kind, message) = entry.encode();
        assert_eq!(kind, "metrics");
        assert_eq!(LogEntry::decode(&kind, &message), Some(entry));
        // What the log held before this type: the same kind and fields, a NaN loss as null.
        let old = r#"{"step":3,"location":"s3://b/tenants/t/ckpt"}"#;
        assert_eq!(
            LogEntry::decode("checkpoint", old),
            Some(LogEntry::Checkpoint {
                step: 3,
                location: "s3://b/tenants/t/ckpt".into()
            })
        );
        let nan = LogEntry::Eval {
            step: 2,
            valid_loss: Some(f64::NAN),
        };
        let (kind, message) = nan.encode();
        assert_eq!(message, r#"{"step":2,"valid_loss":null}"#);
        assert_eq!(
            LogEntry::decode(&kind, &message),
            Some(LogEntry::Eval {
                step: 2,
                valid_loss: None
            })
        );
        assert_eq!(LogEntry::decode("warning", "disk is slow"), None);
        assert_eq!(LogEntry::decode("queued", "{}"), None);
    }
}
