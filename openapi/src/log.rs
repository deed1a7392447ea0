//! What a trainer's reports leave in a job's event log: written by the API when a report
//! arrives and read back to render the job's events and list its checkpoints, as one
//! typed value on both sides (never re-parsed by field names).
//!
//! The queue's log keeps each entry as an event of the entry's [`EventKind`] whose
//! `data` is the entry's fields. Entries the queue writes itself (`queued`,
//! `preempted`, …) and trainers' warnings are not [`LogEntry`]s.

use crate::EventKind;
use crate::progress::TrainEvent;
use serde::{Deserialize, Serialize};

/// One entry of a job's event log that a trainer's report produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "fields", rename_all = "snake_case")]
pub enum LogEntry {
    /// An attempt loaded its data and model and starts (or resumes) training: the
    /// trainer's [`TrainEvent::Started`] as it reported it, its fields kept as they are.
    TrainingStarted(#[serde(with = "started_fields")] TrainEvent),
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
        /// A DPO step's figures.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        preference: Option<crate::PreferenceMetrics>,
        /// The step's token accuracy (OpenAI's name for it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        train_mean_token_accuracy: Option<f64>,
    },
    /// A validation loss.
    Eval {
        /// The step it was measured at.
        step: u64,
        /// The loss (None when it was not a number).
        valid_loss: Option<f64>,
        /// The validation token accuracy (OpenAI's name for it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        valid_mean_token_accuracy: Option<f64>,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Its step.
        step: u64,
        /// Where it is stored.
        location: String,
    },
    /// Early stopping kept the best validated step's adapter.
    EarlyStopped {
        /// Where training stopped, when before its last step.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stopped_at: Option<u64>,
        /// The step kept.
        best_step: u64,
        /// Its validation loss (None when it was not a number).
        best_validation_loss: Option<f64>,
    },
}

impl LogEntry {
    /// The kind of event the log keeps it as.
    pub fn kind(&self) -> EventKind {
        match self {
            Self::TrainingStarted(_) => EventKind::TrainingStarted,
            Self::Resumed { .. } => EventKind::Resumed,
            Self::Metrics { .. } => EventKind::Metrics,
            Self::Eval { .. } => EventKind::Eval,
            Self::Checkpoint { .. } => EventKind::Checkpoint,
            Self::EarlyStopped { .. } => EventKind::EarlyStopped,
        }
    }

    /// The entry a trainer's `event` leaves in the log; None for the events the log does
    /// not keep as entries (warnings are kept as plain text, see the module's docs).
    pub fn of(event: &TrainEvent) -> Option<Self> {
        Some(match event {
            TrainEvent::Started { .. } => Self::TrainingStarted(event.clone()),
            TrainEvent::Resumed { step, checkpoint } => Self::Resumed {
                step: *step,
                location: checkpoint.clone(),
            },
            TrainEvent::Step(m) => Self::Metrics {
                step: m.step,
                total_steps: m.total_steps,
                train_loss: Some(m.loss),
                learning_rate: Some(m.lr),
                tokens_per_s: Some(m.tokens_per_s),
                eta_s: Some(m.eta_s),
                tokens_seen: m.tokens_seen,
                preference: m.preference,
                train_mean_token_accuracy: m.token_accuracy,
            },
            TrainEvent::Eval {
                step,
                validation_loss,
                token_accuracy,
            } => Self::Eval {
                step: *step,
                valid_loss: Some(*validation_loss),
                valid_mean_token_accuracy: *token_accuracy,
            },
            TrainEvent::Checkpoint { step, location } => Self::Checkpoint {
                step: *step,
                location: location.clone(),
            },
            TrainEvent::EarlyStopped {
                stopped_at,
                best_step,
                best_validation_loss,
            } => Self::EarlyStopped {
                stopped_at: *stopped_at,
                best_step: *best_step,
                best_validation_loss: Some(*best_validation_loss),
            },
            TrainEvent::Sample { .. }
            | TrainEvent::Warning { .. }
            | TrainEvent::Interrupted { .. }
            | TrainEvent::Finished { .. } => return None,
        })
    }

    /// The entry as the log stores it: its kind and its fields (a JSON object).
    pub fn encode(&self) -> (EventKind, serde_json::Value) {
        (self.kind(), self.fields())
    }

    /// The entry a log event of `kind` with `fields` holds; None for any other kind
    /// (and for fields that do not read as that kind's).
    pub fn decode(kind: EventKind, fields: &serde_json::Value) -> Option<Self> {
        serde_json::from_value(serde_json::json!({ "kind": kind, "fields": fields })).ok()
    }

    /// The entry's fields as a JSON value (what a rendered event carries as `data`).
    pub fn fields(&self) -> serde_json::Value {
        serde_json::to_value(self)
            .map(|mut v| v["fields"].take())
            .unwrap_or_default()
    }
}

/// A trainer's `started` event as the log keeps it: its fields without the `event` tag
/// (the tag is the entry's kind).
mod started_fields {
    use super::TrainEvent;
    use serde::de::Error as _;
    use serde::ser::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(event: &TrainEvent, s: S) -> Result<S::Ok, S::Error> {
        let mut value = serde_json::to_value(event).map_err(S::Error::custom)?;
        if let Some(fields) = value.as_object_mut() {
            fields.retain(|name, _| name != "event");
        }
        value.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TrainEvent, D::Error> {
        let mut fields = serde_json::Map::deserialize(d)?;
        fields.insert("event".into(), "started".into());
        serde_json::from_value(serde_json::Value::Object(fields)).map_err(D::Error::custom)
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
            preference: Some(crate::PreferenceMetrics {
                rewards_chosen: 0.5,
                rewards_rejected: -0.25,
                rewards_accuracy: 1.0,
                rewards_margin: 0.75,
                logps_chosen: -12.0,
                logps_rejected: -20.0,
            }),
            train_mean_token_accuracy: Some(0.25),
        };
        let (kind, fields) = entry.encode();
        assert_eq!(kind, EventKind::Metrics);
        assert_eq!(LogEntry::decode(kind, &fields), Some(entry));
        // What the log held before this type: the same kind and fields, a NaN loss as null.
        let old = r#"{"step":3,"location":"s3://b/tenants/t/ckpt"}"#;
        assert_eq!(
            LogEntry::decode(EventKind::Checkpoint, &serde_json::from_str(old).unwrap()),
            Some(LogEntry::Checkpoint {
                step: 3,
                location: "s3://b/tenants/t/ckpt".into()
            })
        );
        let nan = LogEntry::Eval {
            step: 2,
            valid_loss: Some(f64::NAN),
            valid_mean_token_accuracy: None,
        };
        let (kind, fields) = nan.encode();
        assert_eq!(fields.to_string(), r#"{"step":2,"valid_loss":null}"#);
        assert_eq!(
            LogEntry::decode(kind, &fields),
            Some(LogEntry::Eval {
                step: 2,
                valid_loss: None,
                valid_mean_token_accuracy: None,
            })
        );
        let empty = serde_json::json!({});
        assert_eq!(LogEntry::decode(EventKind::Warning, &empty), None);
        assert_eq!(LogEntry::decode(EventKind::Queued, &empty), None);
        // A trainer's `started` event keeps its own fields, under the entry's kind.
        let fields = r#"{"dataset_format":"chat","start_step":20,"total_steps":100,"train_examples":8,"trainable_params":10,"validation_examples":0}"#;
        let reported = format!(r#"{{"event":"started",{}"#, &fields[1..]);
        let started: TrainEvent = serde_json::from_str(&reported).unwrap();
        let (kind, data) = LogEntry::of(&started).unwrap().encode();
        assert_eq!(kind, EventKind::TrainingStarted);
        assert_eq!(
            data,
            serde_json::from_str::<serde_json::Value>(fields).unwrap()
        );
        assert_eq!(
            LogEntry::decode(kind, &data),
            Some(LogEntry::TrainingStarted(started))
        );
    }
}
