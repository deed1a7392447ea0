//! The JSON a queue job keeps for its owner (the queue itself never reads it): what to
//! run ([`crate::JobPayload`]), how far it got ([`crate::Progress`]) and what a
//! succeeded attempt left (the API's attempt result). Each is written and read through
//! [`StoredJson`], in one place; a stored value that does not read is an error naming
//! the job and the field, never a silent default.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A job's stored field that does not read as its type (or a value that cannot be
/// written as JSON).
#[derive(Debug, thiserror::Error)]
#[error("job {job}: its stored `{field}` does not read: {source}")]
pub struct MalformedRecord {
    /// The queue job.
    pub job: String,
    /// Which of its fields.
    pub field: &'static str,
    /// What the JSON reader said.
    #[source]
    pub source: serde_json::Error,
}

/// A value a queue job keeps as JSON in one of its fields.
pub trait StoredJson: Serialize + DeserializeOwned {
    /// The job's field that holds it (`payload`, `progress`, `result`).
    const FIELD: &'static str;

    /// The value as the job stores it.
    fn encode(&self, job: &str) -> Result<String, MalformedRecord> {
        serde_json::to_string(self).map_err(|source| MalformedRecord {
            job: job.to_string(),
            field: Self::FIELD,
            source,
        })
    }

    /// The value job `job` stores as `text`.
    fn decode(job: &str, text: &str) -> Result<Self, MalformedRecord> {
        serde_json::from_str(text).map_err(|source| MalformedRecord {
            job: job.to_string(),
            field: Self::FIELD,
            source,
        })
    }

    /// The value of an optional field (None where the job has none yet).
    fn decode_optional(job: &str, text: Option<&str>) -> Result<Option<Self>, MalformedRecord> {
        text.map(|t| Self::decode(job, t)).transpose()
    }
}

impl StoredJson for crate::JobPayload {
    const FIELD: &'static str = "payload";
}

impl StoredJson for crate::Progress {
    const FIELD: &'static str = "progress";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_value_names_the_job_and_the_field() {
        let err = crate::Progress::decode("j000000000007", "{\"step\": \"seven\"}")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with("job j000000000007: its stored `progress` does not read"),
            "{err}"
        );
        assert!(crate::Progress::decode_optional("j1", None).is_ok_and(|p| p.is_none()));
    }
}
