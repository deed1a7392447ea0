//! Tool calls by constrained decoding: when a request requires a call (`tool_choice`
//! `required` or a named function), or lets the model choose between calling its tools
//! and answering in a JSON `response_format`, the answer is held to a grammar of calls in
//! the model's own syntax ([`CallSyntax`]): a declared tool's name, then arguments that
//! follow the tool's schema where the tool is `strict` (any object where it is not).
//!
//! The grammar is Lark, as llguidance reads it, with each JSON part (a call, the JSON
//! answer) an embedded JSON schema (`%json`).

use super::JsonFormat;
use crate::error::Result;
use crate::tool_calls::{CALL_CLOSE, CALL_OPEN, CallSyntax, MISTRAL_CALLS, PHI4_CALLS};
use serde_json::{Value, json};

/// A tool an answer may call.
#[derive(Debug, Clone, PartialEq)]
pub struct CallableTool {
    /// Its name.
    pub name: String,
    /// The schema its arguments follow (`{"type": "object"}` for a tool that is not
    /// strict).
    pub arguments: Value,
}

impl CallableTool {
    /// The tool as a chat request declares it (`{"type": "function", "function": {…}}`):
    /// its name, and its `parameters` as the arguments' schema when it is `strict`.
    /// None without a name.
    pub fn of_declared(tool: &Value) -> Option<Self> {
        let function = tool.get("function")?;
        let name = function.get("name")?.as_str()?.to_string();
        let strict = function.get("strict").and_then(Value::as_bool) == Some(true);
        let arguments = match function.get("parameters") {
            Some(parameters) if strict => parameters.clone(),
            _ => JsonFormat::Object.schema(),
        };
        Some(Self { name, arguments })
    }
}

/// What a constrained answer with tools may be.
#[derive(Debug, Clone, PartialEq)]
pub struct CallFormat {
    /// How the model writes calls.
    pub syntax: CallSyntax,
    /// The tools it may call (one, for a named `tool_choice`).
    pub tools: Vec<CallableTool>,
    /// Several calls in one answer (`parallel_tool_calls`, on unless turned off).
    pub parallel: bool,
    /// Instead of calls, JSON in this format (a `response_format` beside tools the model
    /// may call or not); None: the answer is calls.
    pub or_json: Option<JsonFormat>,
}

/// The Lark grammar of `format`, for a model whose `[TOOL_CALLS]` token (Mistral's calls
/// opening) is `mistral_calls`, when its vocabulary has one. `schema` prepares each
/// embedded JSON schema (the server's whitespace rules), or refuses it.
pub(super) fn lark(
    format: &CallFormat,
    mistral_calls: Option<u32>,
    schema: &dyn Fn(Value) -> Result<Value>,
) -> Result<String> {
    let quoted = |text: &str| Value::from(text).to_string();
    // One call's object, its arguments under any of `keys`.
    let call = |keys: &[&str]| -> Result<Value> {
        let calls: Vec<Value> = format
            .tools
            .iter()
            .flat_map(|tool| keys.iter().map(move |key| call_schema(tool, key)))
            .collect();
        schema(json!({ "anyOf": calls }))
    };
    // Each syntax: what opens the calls, what goes between two, what closes them.
    let (open, between, close) = match format.syntax {
        CallSyntax::Tagged => (
            quoted(&format!("{CALL_OPEN}\n")),
            quoted(&format!("\n{CALL_CLOSE}\n{CALL_OPEN}\n")),
            quoted(&format!("\n{CALL_CLOSE}")),
        ),
        CallSyntax::Llama31 => (String::new(), String::new(), String::new()),
        CallSyntax::Mistral => (
            match mistral_calls {
                Some(id) => format!("<[{id}]> \" \"? \"[\""),
                None => quoted(&format!("{MISTRAL_CALLS} [")),
            },
            quoted(", "),
            quoted("]"),
        ),
        CallSyntax::Phi4 => (quoted(&format!("{PHI4_CALLS}[")), quoted(", "), quoted("]")),
    };
    let more = match format.parallel {
        true => format!(" ({between} call)*"),
        false => String::new(),
    };
    // A list of calls in the syntax's marks, and the bare object Llama 3.1 writes (one
    // call per answer), which tuneq reads as a call in tagged answers too (see
    // `tool_calls::bare_calls`): each syntax's ways, and only their rules.
    let (listed, bare) = match format.syntax {
        CallSyntax::Tagged => (true, true),
        CallSyntax::Llama31 => (false, true),
        CallSyntax::Mistral | CallSyntax::Phi4 => (true, false),
    };
    let ways: Vec<String> = [
        listed.then(|| format!("{open} call{more} {close}")),
        bare.then(|| "bare".to_string()),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut lark = String::new();
    match &format.or_json {
        Some(answer) => {
            lark.push_str("start: answer | calls\n");
            lark.push_str(&format!("answer: %json {}\n", schema(answer.schema())?));
        }
        None => lark.push_str("start: calls\n"),
    }
    lark.push_str(&format!("calls: {}\n", ways.join(" | ")));
    if listed {
        lark.push_str(&format!("call: %json {}\n", call(&["arguments"])?));
    }
    if bare {
        let schema = call(&["parameters", "arguments"])?;
        lark.push_str(&format!("bare: %json {schema}\n"));
    }
    Ok(lark)
}

/// The schema of one call of `tool`, its arguments under `key`.
fn call_schema(tool: &CallableTool, key: &str) -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            key: tool.arguments,
        },
        "required": ["name", key],
        "additionalProperties": false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<CallableTool> {
        [
            json!({"type": "function", "function": {"name": "get_weather", "strict": true,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": false}}}),
            json!({"type": "function", "function": {"name": "search",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}),
        ]
        .iter()
        .map(|t| CallableTool::of_declared(t).expect("named"))
        .collect()
    }

    #[test]
    fn only_a_strict_tool_s_arguments_follow_its_schema() {
        let tools = tools();
        assert_eq!(tools[0].arguments["required"], json!(["city"]));
        assert_eq!(tools[1].arguments, json!({"type": "object"}));
        assert_eq!(CallableTool::of_declared(&json!({"function": {}})), None);
    }

    #[test]
    fn each_syntax_opens_separates_and_closes_its_calls_its_own_way() {
        let grammar = |syntax, parallel, or_json| {
            let format = CallFormat {
                syntax,
                tools: tools(),
                parallel,
                or_json,
            };
            lark(&format, Some(7), &Ok).expect("grammar")
        };
        let tagged = grammar(CallSyntax::Tagged, true, None);
        assert!(tagged.starts_with("start: calls\n"), "{tagged}");
        assert!(
            tagged.contains(r#"calls: "<tool_call>\n" call ("\n</tool_call>\n<tool_call>\n" call)* "\n</tool_call>" | bare"#),
            "{tagged}"
        );
        let one = grammar(CallSyntax::Tagged, false, None);
        assert!(
            one.contains(r#"calls: "<tool_call>\n" call "\n</tool_call>" | bare"#),
            "{one}"
        );
        let mistral = grammar(CallSyntax::Mistral, true, None);
        assert!(
            mistral.contains(r#"calls: <[7]> " "? "[" call (", " call)* "]""#),
            "{mistral}"
        );
        let llama = grammar(CallSyntax::Llama31, true, Some(JsonFormat::Object));
        assert!(llama.starts_with("start: answer | calls\n"), "{llama}");
        assert!(llama.contains("\"parameters\""), "{llama}");
        assert!(llama.contains("calls: bare\n"), "{llama}");
        // Only the rules a syntax uses are compiled.
        assert!(!llama.contains("\ncall: %json"), "{llama}");
        assert!(!mistral.contains("\nbare: %json"), "{mistral}");
    }

    /// Tokens picked at random among those the grammar allows, until it ends: the
    /// answer's text, as a model's would read. Tokens that close strings, objects and
    /// lists grow likelier step by step, so that answers end.
    fn random_answer(format: &CallFormat, seed: u64) -> String {
        use crate::json_format::{AnswerFormat, JsonGrammars};
        use rand::{Rng, SeedableRng};
        let tokenizer = tuneq_dataset::build_tokenizer(4096).expect("tokenizer");
        let end = tokenizer.token_to_id("</s>").expect("end token");
        let grammars = JsonGrammars::new(&tokenizer, &[end], 4096).expect("vocabulary");
        let mut constraint = grammars
            .constrain(&AnswerFormat::Calls(format.clone()))
            .expect("grammar");
        let closes: Vec<bool> = (0..4096u32)
            .map(|id| {
                let text = tokenizer.decode(&[id], false).unwrap_or_default();
                id == end || text.contains(['"', '}', ']', '<'])
            })
            .collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut ids = Vec::new();
        for step in 0..400 {
            if constraint.is_done() {
                break;
            }
            let push = step as f32 / 20.0;
            let mut logits: Vec<f32> = closes
                .iter()
                .map(|&closes| rng.random::<f32>() + if closes { push } else { 0.0 })
                .collect();
            constraint.mask(&mut logits).expect("mask");
            let next = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .expect("a token") as u32;
            assert!(
                logits[next as usize].is_finite(),
                "no token allowed after {ids:?}"
            );
            constraint.accept(next).expect("accepted");
            if next == end {
                break;
            }
            ids.push(next);
        }
        tokenizer.decode(&ids, false).expect("text")
    }

    #[test]
    fn answers_held_to_calls_are_calls_of_declared_tools_whatever_the_logits() {
        let declared = vec!["get_weather".to_string(), "search".to_string()];
        for syntax in [
            CallSyntax::Tagged,
            CallSyntax::Llama31,
            CallSyntax::Mistral,
            CallSyntax::Phi4,
        ] {
            for seed in 0..4 {
                let format = CallFormat {
                    syntax,
                    tools: tools(),
                    parallel: seed % 2 == 0,
                    or_json: None,
                };
                let text = random_answer(&format, seed);
                let calls = crate::tool_calls::forced_calls(&text, &declared)
                    .unwrap_or_else(|| panic!("{syntax:?}: not calls: {text}"));
                assert!(format.parallel || calls.len() == 1, "{text}");
                for call in calls.iter().filter(|c| c.name == "get_weather") {
                    let city = call.arguments.as_object().expect("object");
                    assert!(city.len() == 1 && city["city"].is_string(), "{text}");
                }
            }
        }
    }

    #[test]
    fn beside_a_json_format_the_answer_is_that_json_or_calls() {
        let declared = vec!["get_weather".to_string(), "search".to_string()];
        let place = json!({"type": "object", "properties": {"town": {"type": "string"}},
            "required": ["town"], "additionalProperties": false});
        let (mut answers, mut calls) = (0, 0);
        for seed in 0..12 {
            let format = CallFormat {
                syntax: CallSyntax::Tagged,
                tools: tools(),
                parallel: true,
                or_json: Some(JsonFormat::Schema(place.clone())),
            };
            let text = random_answer(&format, seed);
            match crate::tool_calls::forced_calls(&text, &declared) {
                Some(_) => calls += 1,
                None => {
                    let value: Value = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("neither calls nor JSON ({e}): {text}"));
                    assert!(
                        value["town"].is_string() && value.as_object().expect("object").len() == 1
                    );
                    answers += 1;
                }
            }
        }
        assert!(answers > 0 && calls > 0, "{answers} answers, {calls} calls");
    }
}
