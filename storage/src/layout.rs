//! Where things live in a bucket. The tenant prefix always comes first, so one
//! tenant's objects can be listed, exported, or guarded by an IAM condition on their own.
//!
//! ```text
//! tenants/<tenant>/files/<file>/data.jsonl          uploaded datasets
//! tenants/<tenant>/jobs/<job>/output/               the trainer's output location:
//!     checkpoints/step-00000020/…  manifest.json    one committed checkpoint
//!     adapter_model.safetensors, adapter_config.json, samples.jsonl, metrics.jsonl
//!     manifest.json                                 written last: the run is complete
//! models/<model>/                                    registered base models
//! ```
//!
//! Identifiers are checked here ([`Id`]), so no key is ever pasted together from an
//! unchecked user string.

use crate::{Error, ObjectKey, Result};

/// A tenant, job, file or model identifier: 1–64 characters of `a-z`, `0-9`, `-`, `_`,
/// starting with a letter or digit.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(String);

impl Id {
    /// Checks `value` and wraps it.
    pub fn parse(value: &str) -> Result<Self> {
        let bad = |reason| {
            Err(Error::InvalidKey {
                segment: value.to_string(),
                reason,
            })
        };
        if value.is_empty() || value.len() > 64 {
            return bad("identifiers are 1 to 64 characters");
        }
        if !value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
        {
            return bad("identifiers use only a-z, 0-9, '-' and '_'");
        }
        if !value.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            return bad("identifiers start with a letter or digit");
        }
        Ok(Self(value.to_string()))
    }

    /// The identifier.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `tenants/<tenant>`
pub fn tenant_root(tenant: &Id) -> ObjectKey {
    key(&["tenants", tenant.as_str()])
}

/// `tenants/<tenant>/files/<file>`: the folder of one uploaded file.
pub fn tenant_file(tenant: &Id, file: &Id) -> ObjectKey {
    key(&["tenants", tenant.as_str(), "files", file.as_str()])
}

/// `tenants/<tenant>/jobs/<job>/output`: the trainer's output location for a job.
pub fn job_output(tenant: &Id, job: &Id) -> ObjectKey {
    key(&["tenants", tenant.as_str(), "jobs", job.as_str(), "output"])
}

/// The folder of a run's output that holds its checkpoints (`<output>/checkpoints/<name>`,
/// each a PEFT adapter with the optimiser state beside it).
pub const CHECKPOINTS_DIR: &str = "checkpoints";

/// The files of a PEFT adapter in a run's output: what a client downloads as the job's
/// adapter.
pub const ADAPTER_FILES: [&str; 2] = ["adapter_config.json", "adapter_model.safetensors"];

/// The file of a finished run's output that holds its step metrics as CSV (OpenAI's
/// result-file columns), which the API serves as the job's result file.
pub const RESULTS_CSV: &str = "step_metrics.csv";

/// `models/<model>`: a registered base model's folder.
pub fn model_root(model: &Id) -> ObjectKey {
    key(&["models", model.as_str()])
}

/// Builds a key from segments that are constants or checked [`Id`]s.
fn key(segments: &[&str]) -> ObjectKey {
    // Every segment is a literal or an `Id`, which are valid key segments by construction.
    ObjectKey::from_segments(segments.iter().copied()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_refuse_anything_that_could_escape() {
        for bad in ["", "..", "a/b", "A", "-x", "x y", "é", &"a".repeat(65)] {
            assert!(Id::parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(Id::parse("ftjob-0123_abc").is_ok());
    }

    #[test]
    fn tenant_prefix_comes_first() -> Result<()> {
        let t = Id::parse("acme")?;
        let j = Id::parse("ftjob-1")?;
        assert_eq!(
            job_output(&t, &j).as_str(),
            "tenants/acme/jobs/ftjob-1/output"
        );
        assert_eq!(
            tenant_file(&t, &Id::parse("file-9")?).as_str(),
            "tenants/acme/files/file-9"
        );
        Ok(())
    }
}
