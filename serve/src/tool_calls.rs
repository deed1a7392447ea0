//! Reading a model's tool calls out of its text.
//!
//! A model fine-tuned by tuneq on conversations with tools (and Qwen's and Hermes'
//! templates) writes each call as `<tool_call>{"name": …, "arguments": …}</tool_call>`
//! (see `tuneq_dataset::TOOLS_PREAMBLE`); Llama 3.1's answers with the bare object,
//! `parameters` in place of `arguments`. Both are read here. A call that is not valid
//! JSON, or names a tool the request did not declare, is not a call: the text is then
//! returned as the answer's content, as it was written.

use serde_json::Value;

/// Where a call begins in the text.
pub const CALL_OPEN: &str = "<tool_call>";
/// Where it ends.
pub const CALL_CLOSE: &str = "</tool_call>";

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments (an object).
    pub arguments: Value,
}

/// The calls in `text`, which begins at the first [`CALL_OPEN`]: every block, the last
/// one's close optional (generation may stop on it). None unless every block is a call
/// of a tool in `declared`.
pub fn tagged_calls(text: &str, declared: &[String]) -> Option<Vec<ParsedCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let body = rest.strip_prefix(CALL_OPEN)?;
        let (inside, after) = match body.find(CALL_CLOSE) {
            Some(end) => (&body[..end], &body[end + CALL_CLOSE.len()..]),
            None => (body, ""),
        };
        calls.push(call(inside.trim(), declared)?);
        rest = after.trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// The call `text` is as a whole, if it is a bare JSON call of a declared tool
/// (Llama 3.1's `{"name": …, "parameters": …}`).
pub fn bare_call(text: &str, declared: &[String]) -> Option<ParsedCall> {
    let text = text.trim();
    text.starts_with('{').then(|| call(text, declared))?
}

/// One call's JSON: `name` and `arguments` (or `parameters`), the arguments an object
/// (or a string holding one).
fn call(json: &str, declared: &[String]) -> Option<ParsedCall> {
    let Value::Object(mut obj) = serde_json::from_str::<Value>(json).ok()? else {
        return None;
    };
    let name = obj.get("name")?.as_str()?.to_string();
    if !declared.contains(&name) {
        return None;
    }
    let arguments = obj
        .remove("arguments")
        .or_else(|| obj.remove("parameters"))
        .unwrap_or_else(|| Value::Object(Default::default()));
    let arguments = match arguments {
        Value::String(s) => serde_json::from_str(&s).ok()?,
        other => other,
    };
    arguments
        .is_object()
        .then_some(ParsedCall { name, arguments })
}

/// The text that makes the model call `name`: the beginning of a tagged call, for a
/// request whose `tool_choice` names the tool (the rest, its arguments, is generated).
pub fn forced_call_prefix(name: &str) -> String {
    format!(
        "{CALL_OPEN}\n{{\"name\": {}, \"arguments\": ",
        Value::from(name)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn declared() -> Vec<String> {
        vec!["get_weather".into(), "search".into()]
    }

    #[test]
    fn tagged_calls_are_read_with_or_without_the_last_close() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\": \"search\", \"arguments\": \"{\\\"q\\\": \\\"x\\\"}\"}";
        let calls = tagged_calls(text, &declared()).expect("calls");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, json!({"city": "Oslo"}));
        assert_eq!(calls[1].name, "search");
        assert_eq!(calls[1].arguments, json!({"q": "x"}));
    }

    #[test]
    fn malformed_or_undeclared_calls_are_not_calls() {
        for text in [
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
            "<tool_call>{\"name\": \"delete_all\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"search\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": \"search\"}</tool_call> trailing words",
            "",
        ] {
            assert_eq!(tagged_calls(text, &declared()), None, "{text}");
        }
    }

    #[test]
    fn a_bare_call_with_parameters_is_read() {
        let call = bare_call(
            " {\"name\": \"search\", \"parameters\": {\"q\": \"tuneq\"}} ",
            &declared(),
        )
        .expect("call");
        assert_eq!(call.arguments, json!({"q": "tuneq"}));
        assert_eq!(bare_call("The answer is {1}", &declared()), None);
    }

    #[test]
    fn the_forced_prefix_is_the_start_of_a_tagged_call() {
        let mut text = forced_call_prefix("get_weather");
        text.push_str("{\"city\": \"Lima\"}}\n</tool_call>");
        let calls = tagged_calls(&text, &declared()).expect("calls");
        assert_eq!(calls[0].arguments, json!({"city": "Lima"}));
    }
}
