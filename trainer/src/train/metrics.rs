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

/// The step-metrics CSV a finished run leaves beside its adapter, as OpenAI's result
/// file has it: a row per step.
pub use tuneq_storage::layout::RESULTS_CSV;

/// Its header: OpenAI's columns.
const RESULTS_HEADER: &str = "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy";

impl MetricsFile {
    /// Writes [`RESULTS_CSV`] in the file's folder from its lines: each step's loss and
    /// token accuracy, and the validation loss and token accuracy on the steps that
    /// were validated (empty cells elsewhere, and where a figure is not a number).
    pub(super) fn write_results_csv(&self) -> Result<PathBuf> {
        let text = std::fs::read_to_string(&self.path).map_err(Error::io(&self.path))?;
        let mut rows: std::collections::BTreeMap<u64, [Option<f64>; 4]> = Default::default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let Some(step) = v.get("step").and_then(serde_json::Value::as_u64) else {
                continue;
            };
            let number = |key: &str| v.get(key).and_then(serde_json::Value::as_f64);
            let row = rows.entry(step).or_default();
            if v.get("loss").is_some() {
                row[0] = number("loss");
                row[1] = number("token_accuracy");
            } else {
                row[2] = number("validation_loss");
                row[3] = number("validation_token_accuracy");
            }
        }
        let mut csv = format!("{RESULTS_HEADER}\n");
        for (step, cells) in &rows {
            let cells: Vec<String> = cells
                .iter()
                .map(|c| {
                    c.filter(|x| x.is_finite())
                        .map_or(String::new(), |x| format!("{x:.5}"))
                })
                .collect();
            csv.push_str(&format!("{step},{}\n", cells.join(",")));
        }
        let path = self.path.with_file_name(RESULTS_CSV);
        tuneq_storage::local::write_atomic(&path, csv.as_bytes())?;
        Ok(path)
    }
}
