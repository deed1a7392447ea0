//! The fields OpenAI's answers put on an assistant message besides its content and
//! calls, which its SDK sends back when a client appends an answer to the conversation
//! (`messages.append(completion.choices[0].message)`, as OpenAI's function-calling guide
//! does): accepted on assistant messages and checked for their type. `reasoning_content`
//! (the reasoning of a model whose template writes it, as tuneq, DeepSeek's API and vLLM
//! return it) is kept for the template; a refusal, annotations and audio take no part in
//! the rendering.

use serde_json::{Map, Value};

use super::problems::{FieldProblem, kind};

/// The JSON an echoed field holds (besides null).
#[derive(Clone, Copy)]
enum Holds {
    String,
    Array,
    Object,
}

impl Holds {
    fn fits(self, value: &Value) -> bool {
        matches!(
            (self, value),
            (_, Value::Null)
                | (Self::String, Value::String(_))
                | (Self::Array, Value::Array(_))
                | (Self::Object, Value::Object(_))
        )
    }

    fn name(self) -> &'static str {
        match self {
            Self::String => "a string",
            Self::Array => "an array",
            Self::Object => "an object",
        }
    }
}

/// The keys, and what each holds.
const ECHOED: [(&str, Holds); 4] = [
    ("refusal", Holds::String),
    ("annotations", Holds::Array),
    ("audio", Holds::Object),
    ("reasoning_content", Holds::String),
];

/// The keys of the echoed fields, for messages.
pub(crate) fn echoed_keys() -> impl Iterator<Item = &'static str> {
    ECHOED.iter().map(|(key, _)| *key)
}

/// Checks the echoed fields of message `m` (at `at`; `assistant`: whether it is an
/// assistant's); its `reasoning_content`, if any.
pub(crate) fn echoed_fields(
    m: &Map<String, Value>,
    assistant: bool,
    at: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<String> {
    for (key, holds) in ECHOED {
        let Some(value) = m.get(key) else {
            continue;
        };
        if !assistant {
            problems.push((
                format!("{at}.{key}"),
                "only an assistant message has it".into(),
            ));
        } else if !holds.fits(value) {
            problems.push((
                format!("{at}.{key}"),
                format!("expected {} or null, got {}", holds.name(), kind(value)),
            ));
        }
    }
    match m.get("reasoning_content") {
        Some(Value::String(reasoning)) if assistant && !reasoning.is_empty() => {
            Some(reasoning.clone())
        }
        _ => None,
    }
}
