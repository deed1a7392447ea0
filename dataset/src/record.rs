//! The four record shapes of a dataset line and their validation (chat records in
//! `chat`).
//!
//! Validation works on a parsed `serde_json` object and reports *every* problem of a line as
//! `(field, message)` pairs, so a user fixes a file in one pass instead of one error at a time.

use crate::chat::{Message, PreferencePair};
pub(crate) use crate::problems::{FieldProblem, kind};
use serde_json::{Map, Value};
use tuneq_openapi::DatasetFormat;

/// One validated training example before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A conversation; loss on the assistant turns (but those weighted 0).
    Chat {
        /// Optional leading system message, then the turns.
        messages: Vec<Message>,
        /// The tools the assistant may call, each `{"type": "function", "function":
        /// {...}}` as given (the legacy `functions` made tools); empty for none.
        tools: Vec<Value>,
    },
    /// A raw prompt and its completion; loss on the completion.
    PromptCompletion {
        /// Text before the answer (may be empty).
        prompt: String,
        /// The answer (never empty).
        completion: String,
    },
    /// Alpaca-style instruction, optional input and output; loss on the output.
    Alpaca {
        /// The task.
        instruction: String,
        /// Extra context for the task; empty when absent.
        input: String,
        /// The answer.
        output: String,
    },
    /// Plain text; loss on every token.
    Text {
        /// The text (never empty).
        text: String,
    },
    /// A preference pair (OpenAI's DPO format): a prompt conversation and two answers.
    Preference {
        /// The prompt: the conversation before the answer.
        messages: Vec<Message>,
        /// The tools the answers may call, as for [`Record::Chat`].
        tools: Vec<Value>,
        /// The answer to prefer (an assistant message; boxed, as the variant is the
        /// largest).
        preferred: Box<Message>,
        /// The answer to prefer less.
        rejected: Box<Message>,
    },
}

impl Record {
    /// The format this record belongs to.
    pub fn format(&self) -> DatasetFormat {
        match self {
            Record::Chat { .. } => DatasetFormat::Chat,
            Record::PromptCompletion { .. } => DatasetFormat::PromptCompletion,
            Record::Alpaca { .. } => DatasetFormat::Alpaca,
            Record::Text { .. } => DatasetFormat::Text,
            Record::Preference { .. } => DatasetFormat::Preference,
        }
    }
}

/// Picks the format an object's keys suggest, in order of precedence: `messages`, then
/// `input` + `preferred_output`, then `prompt` + `completion`, then `instruction` +
/// `output`, then `text`.
pub(crate) fn detect(obj: &Map<String, Value>) -> Option<DatasetFormat> {
    if obj.contains_key("messages") {
        Some(DatasetFormat::Chat)
    } else if obj.contains_key("input") && obj.contains_key("preferred_output") {
        Some(DatasetFormat::Preference)
    } else if obj.contains_key("prompt") && obj.contains_key("completion") {
        Some(DatasetFormat::PromptCompletion)
    } else if obj.contains_key("instruction") && obj.contains_key("output") {
        Some(DatasetFormat::Alpaca)
    } else if obj.contains_key("text") {
        Some(DatasetFormat::Text)
    } else {
        None
    }
}

/// The name users write in a spec for a format (`chat`, `prompt_completion`, …).
pub(crate) fn format_name(format: DatasetFormat) -> &'static str {
    match format {
        DatasetFormat::Auto => "auto",
        DatasetFormat::Chat => "chat",
        DatasetFormat::PromptCompletion => "prompt_completion",
        DatasetFormat::Alpaca => "alpaca",
        DatasetFormat::Text => "text",
        DatasetFormat::Preference => "preference",
    }
}

/// Validates `obj` as a record of `format` (never `Auto`), returning every problem found.
pub(crate) fn from_object(
    obj: &Map<String, Value>,
    format: DatasetFormat,
) -> Result<Record, Vec<FieldProblem>> {
    let mut problems = Vec::new();
    let record = match format {
        DatasetFormat::Chat => crate::chat::chat(obj, &mut problems)
            .map(|(messages, tools)| Record::Chat { messages, tools }),
        DatasetFormat::Preference => crate::chat::preference(obj, &mut problems).map(
            |PreferencePair {
                 messages,
                 tools,
                 preferred,
                 rejected,
             }| Record::Preference {
                messages,
                tools,
                preferred: Box::new(preferred),
                rejected: Box::new(rejected),
            },
        ),
        DatasetFormat::PromptCompletion => {
            let prompt = string_field(obj, "prompt", false, &mut problems);
            let completion = string_field(obj, "completion", true, &mut problems);
            prompt
                .zip(completion)
                .map(|(prompt, completion)| Record::PromptCompletion { prompt, completion })
        }
        DatasetFormat::Alpaca => {
            let instruction = string_field(obj, "instruction", false, &mut problems);
            let input = match obj.get("input") {
                None | Some(Value::Null) => Some(String::new()),
                Some(Value::String(s)) => Some(s.clone()),
                Some(other) => {
                    problems.push((
                        "input".into(),
                        format!("expected a string, got {}", kind(other)),
                    ));
                    None
                }
            };
            let output = string_field(obj, "output", false, &mut problems);
            match (instruction, input, output) {
                (Some(instruction), Some(input), Some(output)) => Some(Record::Alpaca {
                    instruction,
                    input,
                    output,
                }),
                _ => None,
            }
        }
        DatasetFormat::Text => {
            string_field(obj, "text", true, &mut problems).map(|text| Record::Text { text })
        }
        DatasetFormat::Auto => {
            problems.push((String::new(), "internal: format not resolved".into()));
            None
        }
    };
    match record {
        Some(r) if problems.is_empty() => Ok(r),
        _ => Err(problems),
    }
}

/// Reads a required string field; `non_empty` also refuses "".
fn string_field(
    obj: &Map<String, Value>,
    key: &str,
    non_empty: bool,
    problems: &mut Vec<FieldProblem>,
) -> Option<String> {
    match obj.get(key) {
        None => {
            problems.push((key.into(), "missing".into()));
            None
        }
        Some(Value::String(s)) if non_empty && s.is_empty() => {
            problems.push((key.into(), "must not be empty".into()));
            None
        }
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            problems.push((
                key.into(),
                format!("expected a string, got {}", kind(other)),
            ));
            None
        }
    }
}
