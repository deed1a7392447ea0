//! Uploaded files and the API's error body: the shapes OpenAI's fine-tuning API uses
//! (`docs/openai-compat.md`), with tuneq's validation report added.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// An uploaded dataset (OpenAI's `file` object plus `validation`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileObject {
    /// `file-…`.
    pub id: String,
    /// Always `file`.
    pub object: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Upload time, Unix seconds.
    pub created_at: u64,
    /// The name the client gave (display only; never part of a storage key).
    pub filename: String,
    /// `fine-tune` (an upload) or `fine-tune-results` (a job's step metrics, CSV).
    pub purpose: String,
    /// `processed`: validated and stored.
    pub status: String,
    /// What was found when the file was validated at upload.
    pub validation: FileValidation,
}

/// What a file may be for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilePurpose {
    /// A dataset uploaded for fine-tuning.
    FineTune,
    /// A job's step metrics (CSV), written when the job succeeds.
    FineTuneResults,
}

impl FilePurpose {
    /// Every purpose.
    pub const ALL: [Self; 2] = [Self::FineTune, Self::FineTuneResults];

    /// The purpose's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FineTune => "fine-tune",
            Self::FineTuneResults => "fine-tune-results",
        }
    }

    /// The purpose named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

/// What validating an upload found (a file with any bad line is refused instead).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileValidation {
    /// `chat`, `prompt_completion`, `alpaca`, `text` or `preference`; `csv` for a job's
    /// result file (whose `examples` are its rows, one per step).
    pub format: String,
    /// Number of examples (non-blank lines).
    pub examples: u64,
    /// Characters over all examples' text fields, a size hint before tokenization.
    pub characters: u64,
    /// Token statistics with a base model's tokenizer and chat template: the model named
    /// at upload (`model`), else the first registered model whose files are local. Null
    /// when there is none (a file is not tied to a model; jobs tokenize for theirs).
    #[serde(default)]
    pub tokens: Option<FileTokenStats>,
}

/// An upload's examples as a model's tokenizer sees them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileTokenStats {
    /// The base model whose tokenizer and chat template were used.
    pub model: String,
    /// The sequence length examples were cut at (a job's default `max_seq_len`).
    pub max_seq_len: u32,
    /// Tokens over all examples (after cutting).
    pub tokens: u64,
    /// Tokens that carry a loss (the answers).
    pub trained_tokens: u64,
    /// Shortest example, in tokens.
    pub min_len: u64,
    /// Longest example, in tokens.
    pub max_len: u64,
    /// Mean example length, in tokens.
    pub mean_len: f64,
    /// Examples longer than `max_seq_len`, which a job would cut.
    pub truncated: u64,
    /// Examples left with nothing to learn from (the answer was cut away).
    pub unlabelled: u64,
}

/// One bad line of a refused upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LineProblem {
    /// 1-based line number.
    pub line: u64,
    /// The offending field, e.g. `messages[2].role`; empty for the whole line.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// A page of files, newest first (OpenAI's list shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileList {
    /// Always `list`.
    pub object: String,
    /// The files.
    pub data: Vec<FileObject>,
    /// Whether more follow; ask again with `after` = the last id.
    pub has_more: bool,
    /// The first id on this page.
    pub first_id: Option<String>,
    /// The last id on this page.
    pub last_id: Option<String>,
}

/// The answer to a delete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Deleted {
    /// The id.
    pub id: String,
    /// The kind of object deleted (`file`).
    pub object: String,
    /// Always true.
    pub deleted: bool,
}

/// Every error answer: `{"error": {...}}`, as OpenAI's SDKs expect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong, for people (`message`) and programs (`type`, `code`, `param`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// A sentence saying what is wrong and how to fix it.
    pub message: String,
    /// The class: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A stable machine-readable code, e.g. `invalid_jsonl`, `file_too_large`: one of
    /// the `ErrorCode` schema, which lists them all.
    pub code: Option<String>,
    /// For a refused dataset: every bad line (at most 1 000; `message` gives the totals).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lines: Vec<LineProblem>,
}

/// A download's body: the bytes, as they are (`type: string, format: binary`), so that
/// generated clients hand them back untouched instead of decoding them as text or JSON.
/// Handlers name it as `body = inline(tuneq_openapi::Binary)` beside the real
/// `content_type`; only its schema is used.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)]
pub struct Binary(Vec<u8>);
