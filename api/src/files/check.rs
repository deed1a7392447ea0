//! The upload check: the trainer's own rules applied to the spooled file as a stream,
//! one line in memory at a time, with token statistics counted one example at a time
//! by a base model's tokenizer (reading no more of an example than its first
//! `max_seq_len` tokens), stopping when the request is gone.

use crate::error::{ApiError, ApiResult, Code};
use crate::upload_slots;
use std::sync::atomic::{AtomicBool, Ordering};
use tuneq_dataset::{DataError, Encoder, LineValidator, Record, TokenCounter};
use tuneq_openapi::{
    ChatTemplateChoice, DatasetFormat, FileTokenStats, FileValidation, LineProblem,
};

/// Sequence length token statistics cut examples at: a job's default.
const STATS_MAX_SEQ_LEN: u32 = 512;

/// The model whose tokenizer and chat template count an upload's tokens.
pub(crate) struct CountWith {
    /// Its id, as the statistics name it.
    pub(crate) model: String,
    /// Its local folder.
    pub(crate) dir: std::path::PathBuf,
    /// The template its jobs train with.
    pub(crate) template: ChatTemplateChoice,
}

/// Tokenizers (with chat templates) by model folder and template, loaded once per
/// process.
fn encoder_for(
    dir: &std::path::Path,
    template: ChatTemplateChoice,
) -> Result<std::sync::Arc<Encoder>, String> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    type Cache = Mutex<HashMap<(std::path::PathBuf, ChatTemplateChoice), Arc<Encoder>>>;
    static ENCODERS: OnceLock<Cache> = OnceLock::new();
    let cache = ENCODERS.get_or_init(Default::default);
    let key = (dir.to_path_buf(), template);
    if let Some(encoder) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(encoder);
    }
    let encoder = Arc::new(Encoder::from_model_dir(dir, template).map_err(|e| e.to_string())?);
    if let Ok(mut c) = cache.lock() {
        c.insert(key, Arc::clone(&encoder));
    }
    Ok(encoder)
}

/// The work the model in `dir`'s own chat template has done for upload statistics in
/// this process: messages rendered ([`tuneq_dataset::ChatTemplate::rendered_messages`]).
/// Encoding a record of n messages costs O(n) of it; tests bound it.
pub fn template_work(dir: &std::path::Path) -> u64 {
    encoder_for(dir, ChatTemplateChoice::Model).map_or(0, |e| e.template().rendered_messages())
}

/// Counts an upload's tokens one example at a time with a model's tokenizer.
struct TokenCounting {
    model: String,
    encoder: std::sync::Arc<Encoder>,
    counter: TokenCounter,
    /// Set when a record could not be encoded: then no statistics are shown.
    failed: bool,
}

impl TokenCounting {
    /// A counter with `model`'s tokenizer; None (logged) when its files cannot be read.
    fn new(
        CountWith {
            model,
            dir,
            template,
        }: CountWith,
    ) -> Option<Self> {
        match encoder_for(&dir, template) {
            Ok(encoder) => Some(Self {
                model,
                encoder,
                counter: TokenCounter::default(),
                failed: false,
            }),
            Err(e) => {
                tracing::warn!(model = %model, error = %e, "cannot count an upload's tokens");
                None
            }
        }
    }

    fn add(&mut self, record: &Record) {
        if self.failed {
            return;
        }
        // Only the tokens kept count, so only those are read: the memory this takes is
        // bounded by the sequence length, not by the record's size.
        let max_seq_len = STATS_MAX_SEQ_LEN as usize;
        match self.encoder.measure(record, max_seq_len) {
            Ok(measured) => self
                .counter
                .add(&measured.example, measured.length.exceeds(max_seq_len)),
            Err(e) => {
                tracing::warn!(model = %self.model, error = %e, "cannot count an upload's tokens");
                self.failed = true;
            }
        }
    }

    fn stats(&self) -> Option<FileTokenStats> {
        if self.failed {
            return None;
        }
        let stats = self.counter.stats();
        Some(FileTokenStats {
            model: self.model.clone(),
            max_seq_len: STATS_MAX_SEQ_LEN,
            tokens: stats.tokens,
            trained_tokens: stats.trained_tokens,
            min_len: stats.min_len as u64,
            max_len: stats.max_len as u64,
            mean_len: stats.mean_len,
            truncated: stats.truncated as u64,
            unlabelled: stats.unlabelled as u64,
        })
    }
}

fn characters(record: &Record) -> usize {
    match record {
        Record::Chat { messages, .. } => messages.iter().map(|m| m.text().chars().count()).sum(),
        Record::PromptCompletion { prompt, completion } => {
            prompt.chars().count() + completion.chars().count()
        }
        Record::Alpaca {
            instruction,
            input,
            output,
        } => instruction.chars().count() + input.chars().count() + output.chars().count(),
        Record::Text { text } => text.chars().count(),
        Record::Preference {
            messages,
            preferred,
            rejected,
            ..
        } => messages
            .iter()
            .chain([&**preferred, &**rejected])
            .map(|m| m.text().chars().count())
            .sum(),
    }
}

fn format_name(format: DatasetFormat) -> String {
    serde_json::to_value(format)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The longest line an upload may have: what validation holds in memory at once.
const MAX_LINE_BYTES: usize = 8 << 20;

/// Validates the spooled file with the trainer's rules, reading it as a stream: memory
/// stays within one line ([`MAX_LINE_BYTES`], a small multiple of it while the line is
/// checked) whatever the file's size.
///
/// The work waits for a core within the tenant's share ([`super::cpu`]) and runs on a
/// blocking thread, which takes the upload's `slot` along: when the request is dropped
/// (the client hung up), the work stops at its next line, and only then are the core
/// and the slot given back. The slot comes back with the validation otherwise.
pub(super) async fn validate(
    path: std::path::PathBuf,
    filename: String,
    counting: Option<CountWith>,
    tenant: &str,
    slot: upload_slots::Slot,
) -> ApiResult<(FileValidation, upload_slots::Slot)> {
    let turn = super::cpu::turn(tenant).await?;
    let cancel = super::cpu::CancelOnDrop::default();
    let cancelled = cancel.flag();
    let (checked, slot) = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        (scan(&path, &filename, counting, &cancelled), slot)
    })
    .await
    .map_err(|e| ApiError::internal(format!("validation task: {e}")))?;
    drop(cancel);
    let Some(checked) = checked.transpose() else {
        // Only a dropped request cancels, and then nobody waits for this answer.
        return Err(ApiError::internal("the validation was cancelled"));
    };
    let (format, examples, characters, tokens) = match checked {
        Ok(checked) => checked,
        Err(DataError::InvalidLines {
            errors,
            bad_lines,
            total,
            ..
        }) => {
            let lines: Vec<LineProblem> = errors
                .into_iter()
                .map(|e| LineProblem {
                    line: e.line as u64,
                    field: e.field,
                    message: e.message,
                })
                .collect();
            let first = lines
                .first()
                .map(|l| {
                    let field = if l.field.is_empty() {
                        String::new()
                    } else {
                        format!(" {}", l.field)
                    };
                    format!(" First: line {}{}: {}.", l.line, field, l.message)
                })
                .unwrap_or_default();
            return Err(ApiError::bad_lines(
                format!(
                    "The file has {bad_lines} invalid line(s) ({total} problem(s)); `error.lines` lists them.{first}"
                ),
                lines,
            ));
        }
        Err(DataError::Empty { .. }) => {
            return Err(ApiError::invalid(
                "file",
                Code::EmptyFile,
                "The file has no examples: it is empty or only blank lines.",
            ));
        }
        Err(other) => {
            tracing::error!(error = %other, "upload validation failed");
            return Err(ApiError::internal("The upload could not be validated."));
        }
    };
    Ok((
        FileValidation {
            format: format_name(format),
            examples,
            characters,
            tokens,
        },
        slot,
    ))
}

/// What [`scan`] finds: format, examples, characters and token statistics.
type Scanned = (DatasetFormat, u64, u64, Option<FileTokenStats>);

/// The checks of [`validate`], on a blocking thread: the format, examples, characters
/// and token statistics of the file at `path`; None when `cancelled` was set (checked
/// before every line).
fn scan(
    path: &std::path::Path,
    filename: &str,
    counting: Option<CountWith>,
    cancelled: &AtomicBool,
) -> Result<Option<Scanned>, DataError> {
    use std::io::{BufRead, Read};
    let io = |source| DataError::Io {
        path: filename.to_string(),
        source,
    };
    let mut reader =
        std::io::BufReader::with_capacity(1 << 16, std::fs::File::open(path).map_err(io)?);
    let mut validator = LineValidator::new(filename, DatasetFormat::Auto);
    let mut counting = counting.and_then(TokenCounting::new);
    let (mut examples, mut chars) = (0u64, 0u64);
    let mut line = Vec::new();
    loop {
        if cancelled.load(Ordering::Relaxed) {
            tracing::info!(file = %filename, line = validator.line(), "upload validation stopped: the request is gone");
            return Ok(None);
        }
        line.clear();
        let read = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(io)?;
        if read == 0 {
            break;
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if line.len() > MAX_LINE_BYTES {
            validator.reject_line(format!(
                "the line is longer than {} MiB",
                MAX_LINE_BYTES >> 20
            ));
            skip_line(&mut reader).map_err(io)?;
            continue;
        }
        if let Some(record) = validator.push(&line) {
            examples += 1;
            chars += characters(&record) as u64;
            // A file with a bad line is refused: its tokens need no counting.
            if let Some(c) = counting.as_mut().filter(|_| !validator.has_problems()) {
                c.add(&record);
            }
        }
    }
    let format = validator.finish()?;
    Ok(Some((
        format,
        examples,
        chars,
        counting.as_ref().and_then(TokenCounting::stats),
    )))
}

/// Reads past the rest of the current line.
fn skip_line(reader: &mut impl std::io::BufRead) -> std::io::Result<()> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                reader.consume(i + 1);
                return Ok(());
            }
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_scan_counts_what_parse_jsonl_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        let text = "\u{feff}{\"text\":\"héllo\"}\r\n\n{\"text\":\"b\"}";
        std::fs::write(&path, text).unwrap();
        let (format, examples, chars, tokens) =
            scan(&path, "d.jsonl", None, &AtomicBool::new(false))
                .unwrap()
                .unwrap();
        let parsed =
            tuneq_dataset::parse_jsonl("d.jsonl", text.as_bytes(), DatasetFormat::Auto).unwrap();
        assert_eq!(format, parsed.format);
        assert_eq!(examples, parsed.records.len() as u64);
        assert_eq!(chars, 6);
        assert!(tokens.is_none());
    }

    #[test]
    fn a_cancelled_scan_stops_before_the_next_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"text\":\"a\"}\n".repeat(1000)).unwrap();
        let cancelled = AtomicBool::new(true);
        assert!(scan(&path, "d.jsonl", None, &cancelled).unwrap().is_none());
    }
}
