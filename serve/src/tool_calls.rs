//! Reading a model's tool calls out of its text.
//!
//! Each family writes its calls its own way, and each way is read here:
//!
//! - a model fine-tuned by tuneq on conversations with tools (and Qwen's and Hermes'
//!   templates): `<tool_call>{"name": …, "arguments": …}</tool_call>` per call (see
//!   `tuneq_dataset::TOOLS_PREAMBLE`);
//! - Llama 3.1: the answer is the bare object, `parameters` in place of `arguments`;
//! - Mistral (v0.3, Nemo): `[TOOL_CALLS] [{"name": …, "arguments": …}, …]`, a list after
//!   a special token that decoding drops, so the answer reads as the bare list;
//! - Mistral's newer tokenizers (v11 on: Mistral Small 3.1 and later, Magistral,
//!   Devstral): `[TOOL_CALLS]name[ARGS]{…}` per call, both marks special tokens that
//!   decoding drops, so the answer reads `name{…}`, calls one after another;
//! - Phi-4-mini: `functools[{"name": …, "arguments": …}, …]`.
//!
//! A call that is not valid JSON, or names a tool the request did not declare, is not a
//! call: the text is then returned as the answer's content, as it was written.

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

/// Mistral's opening of its calls, where its tokenizer does not make it a special token
/// (decoding drops it where it does).
pub const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// Phi-4-mini's opening of its list of calls.
pub const PHI4_CALLS: &str = "functools";
/// Mistral's mark between a call's name and its arguments in its newer tokenizers,
/// where decoding does not drop it.
pub const MISTRAL_ARGS: &str = "[ARGS]";

/// Whether `c` may be part of a tool's name as Mistral writes it before its arguments.
fn in_name(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// The calls `text` is as a whole, if it is calls of declared tools with no tag
/// around them: Llama 3.1's one bare object (`{"name": …, "parameters": …}`),
/// Mistral's list (`[{…}, …]`, after its `[TOOL_CALLS]`) or Phi-4-mini's
/// (`functools[{…}, …]`), or Mistral's newer calls one after another
/// (`name{…}`, each maybe after `[TOOL_CALLS]`, its arguments maybe after `[ARGS]`).
pub fn bare_calls(text: &str, declared: &[String]) -> Option<Vec<ParsedCall>> {
    let text = text.trim();
    if text.starts_with('{') {
        return Some(vec![call(text, declared)?]);
    }
    if let Some(calls) = named_calls(text, declared) {
        return Some(calls);
    }
    let list = [MISTRAL_CALLS, PHI4_CALLS]
        .iter()
        .find_map(|opening| text.strip_prefix(opening))
        .unwrap_or(text)
        .trim_start();
    if !list.starts_with('[') {
        return None;
    }
    let Value::Array(items) = serde_json::from_str::<Value>(list).ok()? else {
        return None;
    };
    let calls = items
        .into_iter()
        .map(|item| call_of(item, declared))
        .collect::<Option<Vec<_>>>()?;
    (!calls.is_empty()).then_some(calls)
}

/// Mistral's newer calls, `name{…}` one after another, each maybe after `[TOOL_CALLS]`
/// and its arguments (an object) maybe after `[ARGS]`; None unless the whole text is
/// such calls of tools in `declared`.
fn named_calls(text: &str, declared: &[String]) -> Option<Vec<ParsedCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        rest = rest
            .strip_prefix(MISTRAL_CALLS)
            .unwrap_or(rest)
            .trim_start();
        let (name, after) = rest.split_at(rest.find(|c| !in_name(c))?);
        if !declared.iter().any(|d| d == name) {
            return None;
        }
        let after = after.trim_start();
        let after = after
            .strip_prefix(MISTRAL_ARGS)
            .unwrap_or(after)
            .trim_start();
        let mut values = serde_json::Deserializer::from_str(after).into_iter::<Value>();
        let Some(Ok(arguments @ Value::Object(_))) = values.next() else {
            return None;
        };
        rest = after[values.byte_offset()..].trim_start();
        calls.push(ParsedCall {
            name: name.to_string(),
            arguments,
        });
    }
    (!calls.is_empty()).then_some(calls)
}

/// Whether an answer that begins with `start` (its visible text so far) may turn out to
/// be bare calls ([`bare_calls`]) of tools in `declared`: it opens an object or a list,
/// its first word is (or may yet become) Phi-4-mini's opening, or it is a declared
/// tool's name followed by `{` or `[ARGS]` (or may yet become one: Mistral's newer
/// calls). None while that is undecided.
pub fn may_open_bare_calls(start: &str, declared: &[String]) -> Option<bool> {
    let start = start.trim_start();
    if start.is_empty() {
        return None;
    }
    if start.starts_with(['{', '[']) || start.starts_with(PHI4_CALLS) {
        return Some(true);
    }
    if PHI4_CALLS.starts_with(start) {
        return None;
    }
    match start.find(|c| !in_name(c)) {
        None if declared.iter().any(|d| d.starts_with(start)) => None,
        Some(end) if declared.iter().any(|d| d == &start[..end]) => {
            let after = &start[end..];
            match after.starts_with(['{', '[']) {
                true => Some(true),
                false => Some(false),
            }
        }
        _ => Some(false),
    }
}

/// One call's JSON: `name` and `arguments` (or `parameters`), the arguments an object
/// (or a string holding one).
fn call(json: &str, declared: &[String]) -> Option<ParsedCall> {
    call_of(serde_json::from_str::<Value>(json).ok()?, declared)
}

/// One call's parsed JSON, as [`call`] reads it.
fn call_of(value: Value, declared: &[String]) -> Option<ParsedCall> {
    let Value::Object(mut obj) = value else {
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

/// How a model writes its calls: what its chat template teaches it (a template that
/// renders no tool calls of its own takes tuneq's tags, see
/// `tuneq_dataset::TOOLS_PREAMBLE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallSyntax {
    /// `<tool_call>{"name": …, "arguments": …}</tool_call>`.
    Tagged,
    /// Llama 3.1's bare `{"name": …, "parameters": …}`.
    Llama31,
    /// Mistral's `[TOOL_CALLS] [{"name": …, "arguments": …}]`.
    Mistral,
    /// Phi-4-mini's `functools[{"name": …, "arguments": …}]`.
    Phi4,
}

impl CallSyntax {
    /// The syntax a chat template's source (a template that renders tool calls) writes
    /// calls in, by the marks each family's template carries.
    pub fn of_template(source: &str) -> Self {
        if source.contains(MISTRAL_CALLS) {
            CallSyntax::Mistral
        } else if source.contains(PHI4_CALLS) {
            CallSyntax::Phi4
        } else if source.contains("<|python_tag|>") {
            CallSyntax::Llama31
        } else {
            CallSyntax::Tagged
        }
    }

    /// The text that makes the model call a tool, for a request whose `tool_choice`
    /// requires one: the opening of a call in this syntax, with `name`'s when it names
    /// the tool (the rest, its arguments, is generated).
    pub fn forced_prefix(self, name: Option<&str>) -> String {
        let named = |key: &str| match name {
            Some(name) => format!("{{\"name\": {}, \"{key}\": ", Value::from(name)),
            None => String::new(),
        };
        match self {
            CallSyntax::Tagged => format!("{CALL_OPEN}\n{}", named("arguments")),
            CallSyntax::Llama31 => match name {
                Some(_) => named("parameters"),
                None => "{\"name\": \"".to_string(),
            },
            CallSyntax::Mistral => format!("{MISTRAL_CALLS} [{}", named("arguments")),
            CallSyntax::Phi4 => format!("{PHI4_CALLS}[{}", named("arguments")),
        }
    }
}

/// The calls of an answer that a forced prefix began (its text, prefix included), in
/// whichever of the syntaxes it is written.
pub fn forced_calls(text: &str, declared: &[String]) -> Option<Vec<ParsedCall>> {
    match text.trim_start().starts_with(CALL_OPEN) {
        true => tagged_calls(text, declared),
        false => bare_calls(text, declared),
    }
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
        let calls = bare_calls(
            " {\"name\": \"search\", \"parameters\": {\"q\": \"tuneq\"}} ",
            &declared(),
        )
        .expect("call");
        assert_eq!(calls[0].arguments, json!({"q": "tuneq"}));
        assert_eq!(bare_calls("The answer is {1}", &declared()), None);
    }

    #[test]
    fn mistral_s_and_phi4_mini_s_lists_of_calls_are_read() {
        let list = "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}, \"id\": \"a1b2c3d4e\"}, {\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}]";
        for text in [
            format!(" {list}"),
            format!("[TOOL_CALLS] {list}"),
            format!("[TOOL_CALLS]{list}"),
            format!("functools{list}"),
        ] {
            let calls = bare_calls(&text, &declared()).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(calls.len(), 2, "{text}");
            assert_eq!(calls[0].name, "get_weather");
            assert_eq!(calls[0].arguments, json!({"city": "Oslo"}));
            assert_eq!(calls[1].arguments, json!({"q": "x"}));
        }
        // A list that is not all calls of declared tools is text.
        for text in [
            "[1, 2, 3]",
            "[]",
            "[{\"name\": \"delete_all\", \"arguments\": {}}]",
            "functools[{\"name\": \"search\", \"arguments\": {}}] and more",
            "[TOOL_CALLS] [{\"name\": \"search\", \"arguments\": ",
        ] {
            assert_eq!(bare_calls(text, &declared()), None, "{text}");
        }
    }

    #[test]
    fn an_answer_may_open_bare_calls_until_its_first_word_says_otherwise() {
        for (start, may) in [
            ("", None),
            ("  ", None),
            (" {", Some(true)),
            ("[", Some(true)),
            ("func", None),
            ("functools[", Some(true)),
            ("fun fact", Some(false)),
            ("The", Some(false)),
            // Mistral's newer calls: a declared name, then its arguments.
            ("get", None),
            ("get_weather", None),
            ("get_weather{", Some(true)),
            ("get_weather[ARGS]", Some(true)),
            ("get_weather is a tool", Some(false)),
            ("getaway", Some(false)),
        ] {
            assert_eq!(may_open_bare_calls(start, &declared()), may, "{start:?}");
        }
    }

    #[test]
    fn mistral_s_newer_named_calls_are_read() {
        let paris = ParsedCall {
            name: "get_weather".into(),
            arguments: json!({"city": "Paris"}),
        };
        let search = ParsedCall {
            name: "search".into(),
            arguments: json!({"q": "rain {soon}"}),
        };
        let both = [paris.clone(), search.clone()];
        for text in [
            r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "rain {soon}"}"#,
            r#"get_weather{"city": "Paris"}search{"q": "rain {soon}"}"#,
            r#" get_weather [ARGS] {"city": "Paris"} search{"q": "rain {soon}"} "#,
        ] {
            assert_eq!(
                bare_calls(text, &declared()).as_deref(),
                Some(&both[..]),
                "{text}"
            );
        }
        let one = bare_calls(r#"get_weather{"city": "Paris"}"#, &declared());
        assert_eq!(one, Some(vec![paris]));
        // Not calls: an undeclared tool, arguments that are not an object, a name
        // without arguments, text after the calls.
        for text in [
            r#"delete_all{"now": true}"#,
            r#"get_weather["Paris"]"#,
            "get_weather",
            r#"get_weather{"city": "Paris"} and then some"#,
        ] {
            assert_eq!(bare_calls(text, &declared()), None, "{text}");
        }
    }

    #[test]
    fn each_syntax_s_forced_prefix_begins_a_call_read_back_whole() {
        // What the model generates after each prefix: a named tool's arguments and the
        // call's close, or (any tool) the whole call from where the prefix stops.
        let cases = [
            (
                CallSyntax::Tagged,
                "}\n</tool_call>",
                "{\"name\": \"search\", \"arguments\": {}}\n</tool_call>",
            ),
            (CallSyntax::Llama31, "}", "search\", \"parameters\": {}}"),
            (
                CallSyntax::Mistral,
                "}]",
                "{\"name\": \"search\", \"arguments\": {}}]",
            ),
            (
                CallSyntax::Phi4,
                "}]",
                "{\"name\": \"search\", \"arguments\": {}}]",
            ),
        ];
        for (syntax, close, any) in cases {
            let named = syntax.forced_prefix(Some("get_weather"));
            let text = format!("{named}{{\"city\": \"Lima\"}}{close}");
            let calls = forced_calls(&text, &declared()).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(calls[0].name, "get_weather", "{syntax:?}");
            assert_eq!(calls[0].arguments, json!({"city": "Lima"}), "{syntax:?}");
            let text = format!("{}{any}", syntax.forced_prefix(None));
            let calls = forced_calls(&text, &declared()).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(calls[0].name, "search", "{syntax:?}");
        }
    }

    #[test]
    fn a_template_s_marks_name_its_syntax() {
        for (source, syntax) in [
            (
                "{%- if message.tool_calls %}[TOOL_CALLS] [{{ calls }}]",
                CallSyntax::Mistral,
            ),
            (
                "<|tool|>{{ tools }}<|/tool|> functools[...]",
                CallSyntax::Phi4,
            ),
            ("{{- '<|python_tag|>' }}{\"name\": ", CallSyntax::Llama31),
            (
                "<tool_call>\n{{ tool_call | tojson }}\n</tool_call>",
                CallSyntax::Tagged,
            ),
        ] {
            assert_eq!(CallSyntax::of_template(source), syntax, "{source}");
        }
    }

    #[test]
    fn the_forced_prefix_is_the_start_of_a_tagged_call() {
        let mut text = CallSyntax::Tagged.forced_prefix(Some("get_weather"));
        text.push_str("{\"city\": \"Lima\"}}\n</tool_call>");
        let calls = tagged_calls(&text, &declared()).expect("calls");
        assert_eq!(calls[0].arguments, json!({"city": "Lima"}));
    }
}
