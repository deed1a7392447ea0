//! `metrics.jsonl`: a line per step and per evaluation, cut back on resume.

use crate::error::{Error, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// `v` as one JSON line.
pub(super) fn json_line<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|source| Error::Json {
        path: "metrics".into(),
        source,
    })
}

/// Appends lines to `metrics.jsonl`, first cutting it back to `keep_through` steps on resume.
pub(super) struct MetricsFile {
    path: PathBuf,
}

impl MetricsFile {
    /// The file in `output`, cut back to the lines of steps up to `keep_through`.
    pub(super) fn open(output: &Path, keep_through: u64) -> Result<Self> {
        let path = output.join("metrics.jsonl");
        let kept: Vec<String> = match std::fs::read_to_string(&path) {
            Ok(s) => s
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_some_and(|s| s <= keep_through)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            Err(_) => Vec::new(),
        };
        tuneq_storage::local::write_atomic(&path, kept.concat().as_bytes())?;
        Ok(Self { path })
    }

    /// Appends one line.
    pub(super) fn append(&self, line: &str) -> Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .map_err(Error::io(&self.path))?;
        writeln!(f, "{line}").map_err(Error::io(&self.path))
    }
}
