//! Reading JSONL datasets: one record per line, format detected or given, every bad line
//! reported with its line number and field.

use std::path::Path;

use serde_json::Value;
use tuneq_openapi::DatasetFormat;

use super::record::{self, Record, detect, format_name, kind};
use super::{DataError, Result};

/// At most this many problems are listed in [`DataError::InvalidLines`]; the counts there
/// still cover all of them. Keeps the error (and an API response built from it) bounded.
pub const MAX_REPORTED_ERRORS: usize = 1000;

/// One problem on one line of a JSONL file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LineError {
    /// File name as given by the caller.
    pub file: String,
    /// 1-based line number.
    pub line: usize,
    /// Path of the offending field, e.g. `messages[2].role` or `completion`; empty for
    /// problems with the whole line (JSON syntax, not an object, unknown shape).
    pub field: String,
    /// What is wrong, e.g. "expected a string, got number".
    pub message: String,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}:{}: {}", self.file, self.line, self.message)
        } else {
            write!(
                f,
                "{}:{}: {}: {}",
                self.file, self.line, self.field, self.message
            )
        }
    }
}

/// A validated dataset file.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedDataset {
    /// File name as given by the caller.
    pub file: String,
    /// The format of every record; resolved, never `Auto`.
    pub format: DatasetFormat,
    /// The records in file order.
    pub records: Vec<Record>,
}

/// Reads and validates a JSONL file; see [`parse_jsonl`] for the rules.
pub fn read_jsonl(path: &Path, format: DatasetFormat) -> Result<ParsedDataset> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: name.clone(),
        source,
    })?;
    parse_jsonl(&name, &bytes, format)
}

/// Validates JSONL bytes (a file or an upload); `file` is the name used in errors.
///
/// Blank lines are skipped; `\r\n` endings and a UTF-8 byte-order mark are accepted. With
/// `DatasetFormat::Auto` the format is detected from the first JSON object with a recognised
/// key set (`messages` → chat; `prompt` + `completion`; `instruction` + `output` → alpaca;
/// `text`), and every line must then match that format. Every problem of every line is
/// collected, so one run shows all that needs fixing.
pub fn parse_jsonl(file: &str, bytes: &[u8], format: DatasetFormat) -> Result<ParsedDataset> {
    let mut validator = LineValidator::new(file, format);
    let mut records = Vec::new();
    for raw in bytes.split(|&b| b == b'\n') {
        if let Some(record) = validator.push(raw) {
            records.push(record);
        }
    }
    let format = validator.finish()?;
    Ok(ParsedDataset {
        file: file.to_string(),
        format,
        records,
    })
}

/// Validates a JSONL file one line at a time, so a file of any size is checked in the
/// memory of its longest line: [`parse_jsonl`] for bytes in memory, and the API's
/// upload check, which reads its spool file as a stream. Same rules as [`parse_jsonl`].
#[derive(Debug)]
pub struct LineValidator {
    /// The format in force and the line it was detected on (0 = given by the caller).
    resolved: Option<(DatasetFormat, usize)>,
    problems: Problems,
    line: usize,
    non_blank: usize,
}

impl LineValidator {
    /// A validator of the file named `file` (the name errors use).
    pub fn new(file: &str, format: DatasetFormat) -> Self {
        Self {
            resolved: match format {
                DatasetFormat::Auto => None,
                given => Some((given, 0)),
            },
            problems: Problems::new(file),
            line: 0,
            non_blank: 0,
        }
    }

    /// The number of the line [`LineValidator::push`] saw last (1-based).
    pub fn line(&self) -> usize {
        self.line
    }

    /// Whether any line so far was invalid.
    pub fn has_problems(&self) -> bool {
        self.problems.total > 0
    }

    /// Records a line that could not be read whole (e.g. longer than a caller's limit).
    pub fn reject_line(&mut self, message: String) {
        self.line += 1;
        self.non_blank += 1;
        self.problems.push(self.line, "", message);
    }

    /// Checks the next line (without its `\n`; a trailing `\r` and, on the first line, a
    /// UTF-8 byte-order mark are accepted) and returns its record when it is valid.
    pub fn push(&mut self, raw: &[u8]) -> Option<Record> {
        self.line += 1;
        let line = self.line;
        let raw = if line == 1 {
            raw.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(raw)
        } else {
            raw
        };
        if raw.iter().all(u8::is_ascii_whitespace) {
            return None;
        }
        self.non_blank += 1;
        let text = match std::str::from_utf8(raw) {
            Ok(t) => t,
            Err(e) => {
                self.problems.push(
                    line,
                    "",
                    format!("not valid UTF-8 (at byte {})", e.valid_up_to() + 1),
                );
                return None;
            }
        };
        let value: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                self.problems.push(line, "", json_syntax_message(&e));
                return None;
            }
        };
        let Value::Object(obj) = &value else {
            self.problems.push(
                line,
                "",
                format!("expected a JSON object, got {}", kind(&value)),
            );
            return None;
        };
        let (fmt, detected_at) = match self.resolved {
            Some(r) => r,
            None => match detect(obj) {
                Some(f) => {
                    self.resolved = Some((f, line));
                    (f, line)
                }
                None => {
                    self.problems.push(line, "", UNRECOGNISED.to_string());
                    return None;
                }
            },
        };
        match record::from_object(obj, fmt) {
            Ok(r) => Some(r),
            Err(problems) => {
                let hint = mismatch_hint(obj, fmt, detected_at);
                for (field, message) in problems {
                    let message = match (&hint, message.as_str()) {
                        (Some(h), "missing") => format!("missing ({h})"),
                        _ => message,
                    };
                    self.problems.push(line, &field, message);
                }
                None
            }
        }
    }

    /// The file's format, or why it is refused: every problem found (up to
    /// [`MAX_REPORTED_ERRORS`] listed), or [`DataError::Empty`].
    pub fn finish(self) -> Result<DatasetFormat> {
        let file = self.problems.file.clone();
        if self.non_blank == 0 {
            return Err(DataError::Empty { file });
        }
        if let Some(err) = self.problems.into_error() {
            return Err(err);
        }
        // A non-blank file without errors resolved a format.
        self.resolved
            .map(|(format, _)| format)
            .ok_or(DataError::Empty { file })
    }
}

const UNRECOGNISED: &str = "unrecognised record: expected a \"messages\" key (chat), \"prompt\" and \"completion\", \"instruction\" and \"output\" (alpaca), or \"text\"";

/// serde_json's message without its "at line 1 column N" tail, plus the column.
fn json_syntax_message(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let what = full
        .rfind(" at line ")
        .map_or(full.as_str(), |i| &full[..i]);
    format!("invalid JSON at column {}: {what}", e.column())
}

/// When a line lacks a field of the file's format but looks like another format, says so.
fn mismatch_hint(
    obj: &serde_json::Map<String, Value>,
    fmt: DatasetFormat,
    detected_at: usize,
) -> Option<String> {
    let looks_like = detect(obj).filter(|f| *f != fmt)?;
    let origin = if detected_at == 0 {
        "as requested".to_string()
    } else {
        format!("detected from line {detected_at}")
    };
    Some(format!(
        "the file is in {} format ({origin}) but this line looks like {} format",
        format_name(fmt),
        format_name(looks_like)
    ))
}

/// Collects problems, keeping at most [`MAX_REPORTED_ERRORS`] of them and counting the rest.
#[derive(Debug)]
struct Problems {
    file: String,
    listed: Vec<LineError>,
    total: usize,
    bad_lines: usize,
    last_bad_line: usize,
}

impl Problems {
    fn new(file: &str) -> Self {
        Self {
            file: file.to_string(),
            listed: Vec::new(),
            total: 0,
            bad_lines: 0,
            last_bad_line: 0,
        }
    }

    fn push(&mut self, line: usize, field: &str, message: String) {
        self.total += 1;
        if line != self.last_bad_line {
            self.bad_lines += 1;
            self.last_bad_line = line;
        }
        if self.listed.len() < MAX_REPORTED_ERRORS {
            self.listed.push(LineError {
                file: self.file.clone(),
                line,
                field: field.to_string(),
                message,
            });
        }
    }

    fn into_error(self) -> Option<DataError> {
        (self.total > 0).then_some(DataError::InvalidLines {
            file: self.file,
            errors: self.listed,
            bad_lines: self.bad_lines,
            total: self.total,
        })
    }
}
