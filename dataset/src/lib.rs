//! Datasets: from JSONL files to tokenized training examples with loss masks.
//!
//! A crate of its own (no candle), so the API validates uploads with the same rules the
//! trainer applies, and the trainer re-exports it as `tuneq_trainer::data`.
//!
//! The path of one training example:
//! JSONL line → [`Record`] (validated, format detected) → conversation rendered by a
//! [`ChatTemplate`] (or raw text for prompt/completion and text records) → token ids from the
//! model's `tokenizers` tokenizer, with `labels` = −100 wherever no loss is taken ([`Example`]).
//!
//! Layout:
//! - `record`: the four record shapes and their per-field validation.
//! - `chat`: chat records in OpenAI's shapes (tools, tool calls, weights, legacy functions).
//! - `problems`: how validation names a bad field and a JSON type.
//! - `jsonl`: reading a JSONL file or upload, detecting its format, collecting every bad line.
//! - `template`: chat templates (the model's own Jinja template via minijinja, or built-ins).
//! - `encoder`: records → [`Example`]s, loss masks from character spans (a chat rendered
//!   once, a message at a time, where the template allows), sampling prompts, and
//!   [`Encoder::measure`], the bounded-memory measure of a record that upload statistics use.
//! - `stats`: token statistics of an encoded dataset.
//! - `tokenizer_build`: the byte-level BPE tokenizer shipped with randomly initialised models.
//!
//! Everything here is synchronous and pure apart from reading files; an [`Encoder`] is
//! `Send + Sync`, so callers may encode from several threads.

mod answer;
mod chat;
mod echoed;
mod encoder;
mod jsonl;
mod preference;
mod problems;
mod pyjson;
mod record;
mod stats;
mod strftime;
mod template;
mod tokenizer_build;
mod tools;

pub use answer::{REASONING_BLOCK, common_prefix};
pub use chat::{
    FunctionCall, MAX_MESSAGES, MAX_TOOLS, Message, Role, ToolCall, request_conversation,
};
pub use encoder::{Conversation, Encoder, Example, IGNORE_INDEX, Length, MEASURE_MARGIN, Measured};
pub use jsonl::{
    LineError, LineValidator, MAX_REPORTED_ERRORS, ParsedDataset, parse_jsonl, read_jsonl,
};
pub use preference::EncodedPair;
pub use record::Record;
pub use stats::{TokenCounter, TokenStats, token_stats};
pub use template::{
    ALPACA_TEMPLATE, CHATML_TEMPLATE, ChatTemplate, LLAMA2_TEMPLATE, RENDERING_NAMES,
    TemplateVariables,
};
pub use tokenizer_build::{
    MIN_FREQUENCY, SPECIAL_TOKENS, build_tokenizer, tokenizer_config_json, write_tokenizer_files,
};
pub use tools::TOOLS_PREAMBLE;

/// Errors from reading, validating and encoding datasets.
///
/// None of these can be fixed by retrying: they name a bad file, a bad template or a
/// tokenizer that does not fit, and the user has to change one of them.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be read (or written).
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Some lines of a JSONL file are invalid. `errors` lists them in line order, at most
    /// [`MAX_REPORTED_ERRORS`] entries; `bad_lines` and `total` count all of them.
    #[error("{bad_lines} invalid line(s) in {file}")]
    InvalidLines {
        /// File name as given by the caller.
        file: String,
        /// The first [`MAX_REPORTED_ERRORS`] problems, in line order.
        errors: Vec<LineError>,
        /// Number of distinct lines with at least one problem.
        bad_lines: usize,
        /// Number of problems, including those left out of `errors`.
        total: usize,
    },
    /// The file holds no examples (it is empty or only blank lines).
    #[error("{file} has no examples")]
    Empty {
        /// File name as given by the caller.
        file: String,
    },
    /// A chat template failed to load or render.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed to load, train, encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

impl DataError {
    /// Whether trying again unchanged can help. Dataset problems are never transient.
    pub fn is_retryable(&self) -> bool {
        match self {
            DataError::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::TimedOut
            ),
            _ => false,
        }
    }
}

/// Result with [`DataError`] as the default error.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests;
