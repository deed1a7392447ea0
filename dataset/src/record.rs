//! The four record shapes of a dataset line and their validation.
//!
//! Validation works on a parsed `serde_json` object and reports *every* problem of a line as
//! `(field, message)` pairs, so a user fixes a file in one pass instead of one error at a time.

use serde_json::{Map, Value};
use tuneq_openapi::DatasetFormat;

/// One chat message. `role` is `system`, `user` or `assistant` once validated.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// Who speaks: `system`, `user` or `assistant`.
    pub role: String,
    /// What is said.
    pub content: String,
}

impl Message {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// One validated training example before tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A conversation; loss on the assistant turns.
    Chat {
        /// Optional leading system message, then user/assistant turns.
        messages: Vec<Message>,
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
}

impl Record {
    /// The format this record belongs to.
    pub fn format(&self) -> DatasetFormat {
        match self {
            Record::Chat { .. } => DatasetFormat::Chat,
            Record::PromptCompletion { .. } => DatasetFormat::PromptCompletion,
            Record::Alpaca { .. } => DatasetFormat::Alpaca,
            Record::Text { .. } => DatasetFormat::Text,
        }
    }
}

/// The most messages one chat record may have. Generous (a conversation that long does
/// not fit any model's context), and it bounds the work of a template that has to be
/// rendered once per assistant turn (see the encoder).
pub const MAX_MESSAGES: usize = 2048;

/// The roles a chat message may have.
pub(crate) const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// A problem with one field of a line: `(field, message)`.
pub(crate) type FieldProblem = (String, String);

/// Picks the format an object's keys suggest, in order of precedence: `messages`, then
/// `prompt` + `completion`, then `instruction` + `output`, then `text`.
pub(crate) fn detect(obj: &Map<String, Value>) -> Option<DatasetFormat> {
    if obj.contains_key("messages") {
        Some(DatasetFormat::Chat)
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
    }
}

/// JSON type name for messages like "expected a string, got number".
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Validates `obj` as a record of `format` (never `Auto`), returning every problem found.
pub(crate) fn from_object(
    obj: &Map<String, Value>,
    format: DatasetFormat,
) -> Result<Record, Vec<FieldProblem>> {
    let mut problems = Vec::new();
    let record = match format {
        DatasetFormat::Chat => chat(obj, &mut problems),
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

/// A chat record: a non-empty `messages` array of well-formed messages in a valid
/// order, with at least one assistant message.
fn chat(obj: &Map<String, Value>, problems: &mut Vec<FieldProblem>) -> Option<Record> {
    let items = message_items(obj, problems)?;
    let before = problems.len();
    let mut messages = Vec::with_capacity(items.len());
    let mut first_turn_checked = false;
    for (i, item) in items.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(m) = item else {
            problems.push((at, format!("expected an object, got {}", kind(item))));
            continue;
        };
        if let Some(message) = message(m, &at, problems) {
            messages.push(message);
        }
        check_turn_order(m, i, &at, &mut first_turn_checked, problems);
    }
    if problems.len() == before && !messages.iter().any(|m| m.role == "assistant") {
        problems.push((
            "messages".into(),
            "needs at least one assistant message".into(),
        ));
    }
    (problems.len() == before).then_some(Record::Chat { messages })
}

/// The `messages` array, when it is one of 1 to [`MAX_MESSAGES`] items.
fn message_items<'o>(
    obj: &'o Map<String, Value>,
    problems: &mut Vec<FieldProblem>,
) -> Option<&'o Vec<Value>> {
    let items = match obj.get("messages") {
        None => {
            problems.push(("messages".into(), "missing".into()));
            return None;
        }
        Some(Value::Array(items)) => items,
        Some(other) => {
            problems.push((
                "messages".into(),
                format!("expected an array, got {}", kind(other)),
            ));
            return None;
        }
    };
    if items.is_empty() {
        problems.push(("messages".into(), "must not be empty".into()));
        return None;
    }
    if items.len() > MAX_MESSAGES {
        problems.push((
            "messages".into(),
            format!(
                "has {} messages; a record may have at most {MAX_MESSAGES}",
                items.len()
            ),
        ));
        return None;
    }
    Some(items)
}

/// The message `m` (at `at`): only `role` (a known one) and `content`, both strings.
/// Every problem is reported; None when there is any.
fn message(m: &Map<String, Value>, at: &str, problems: &mut Vec<FieldProblem>) -> Option<Message> {
    for key in m.keys() {
        if key != "role" && key != "content" {
            problems.push((
                format!("{at}.{key}"),
                "unknown key; a message has only \"role\" and \"content\"".into(),
            ));
        }
    }
    let role = match m.get("role") {
        None => {
            problems.push((format!("{at}.role"), "missing".into()));
            None
        }
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => Some(r.clone()),
        Some(Value::String(r)) => {
            problems.push((
                format!("{at}.role"),
                format!("unknown role {r:?}; expected system, user or assistant"),
            ));
            None
        }
        Some(other) => {
            problems.push((
                format!("{at}.role"),
                format!("expected a string, got {}", kind(other)),
            ));
            None
        }
    };
    let content = match m.get("content") {
        None => {
            problems.push((format!("{at}.content"), "missing".into()));
            None
        }
        Some(Value::String(c)) => Some(c.clone()),
        Some(other) => {
            problems.push((
                format!("{at}.content"),
                format!("expected a string, got {}", kind(other)),
            ));
            None
        }
    };
    Some(Message {
        role: role?,
        content: content?,
    })
}

/// The order rules for message `i` (at `at`): a system message only first, and the
/// first turn after it a user's. They look at the raw role, so an unknown role is
/// reported once, as unknown.
fn check_turn_order(
    m: &Map<String, Value>,
    i: usize,
    at: &str,
    first_turn_checked: &mut bool,
    problems: &mut Vec<FieldProblem>,
) {
    let Some(raw_role) = m.get("role").and_then(Value::as_str) else {
        return;
    };
    if raw_role == "system" && i != 0 {
        problems.push((
            format!("{at}.role"),
            "a system message is only allowed as the first message".into(),
        ));
    } else if raw_role != "system" && !*first_turn_checked {
        *first_turn_checked = true;
        if raw_role == "assistant" {
            problems.push((
                format!("{at}.role"),
                "the conversation must start with a user message (after an optional system message)"
                    .into(),
            ));
        }
    }
}
