//! From what the engine generated to OpenAI's answer objects: the message (its text, or
//! the tool calls read out of it), why it finished, and the log-probabilities.

use super::request::{ChatPlan, ToolMode};
use tuneq_openapi::{
    AssistantMessage, ChoiceLogprobs, FinishReason, FunctionCallOut, TokenLogprobOut, ToolCallOut,
    TopLogprob,
};
use tuneq_serve::tool_calls::{ParsedCall, bare_calls, forced_calls, tagged_calls};
use tuneq_serve::{Finish, Generated, TokenLogprob};

/// A generated answer, read.
#[derive(Debug, Clone)]
pub(crate) struct Reading {
    /// Its text; None when it is only tool calls.
    pub(crate) content: Option<String>,
    /// The calls it made.
    pub(crate) tool_calls: Option<Vec<ToolCallOut>>,
    /// The reasoning block it opened with ([`tuneq_serve::reasoning`]), when not empty.
    pub(crate) reasoning: Option<String>,
    /// Why it ended.
    pub(crate) finish: FinishReason,
}

/// Reads `generated` for `plan`: tool calls where the plan lets the model make them
/// (and the text holds well-formed calls of declared tools), the text otherwise.
/// `prefill` is the start of the answer the request forced. An answer that is bare calls
/// (Llama 3.1's one JSON object, Mistral's or Phi-4-mini's list; see
/// [`tuneq_serve::tool_calls`]) is read as calls too (a stream holds such an answer back
/// until it ends: `holdback`). With `reasons` (the model writes reasoning blocks and
/// nothing was prefilled), a block the answer opens with is kept apart from the rest.
pub(crate) fn read(
    plan: &ChatPlan,
    prefill: &str,
    generated: &Generated,
    reasons: bool,
) -> Reading {
    let finish = match generated.finish {
        Finish::Stop => FinishReason::Stop,
        Finish::Length => FinishReason::Length,
    };
    let (reasoning, text) = match reasons {
        true => tuneq_serve::reasoning::split(&generated.text),
        false => (None, generated.text.as_str()),
    };
    let after = generated.after_marker.as_deref().unwrap_or_default();
    let calls = match &plan.tools {
        ToolMode::Off => None,
        ToolMode::Required | ToolMode::Named(_) => {
            let whole = format!("{prefill}{text}{after}");
            forced_calls(&whole, &plan.tool_names)
        }
        ToolMode::Auto if generated.after_marker.is_some() => tagged_calls(after, &plan.tool_names),
        ToolMode::Auto => bare_calls(text, &plan.tool_names),
    };
    match calls {
        Some(calls) => {
            let text = match &plan.tools {
                ToolMode::Auto if generated.after_marker.is_some() => text.trim(),
                _ => "",
            };
            Reading {
                content: (!text.is_empty()).then(|| text.to_string()),
                tool_calls: Some(calls.into_iter().map(call_out).collect()),
                reasoning,
                finish: FinishReason::ToolCalls,
            }
        }
        None => Reading {
            content: Some(format!("{prefill}{text}{after}")),
            tool_calls: None,
            reasoning,
            finish,
        },
    }
}

impl Reading {
    /// The assistant message it makes.
    pub(crate) fn message(&self) -> AssistantMessage {
        AssistantMessage {
            role: "assistant".into(),
            content: self.content.clone(),
            refusal: None,
            tool_calls: self.tool_calls.clone(),
            reasoning_content: self.reasoning.clone(),
        }
    }
}

/// A call as OpenAI shows it: a fresh id, the arguments as a JSON string.
fn call_out(call: ParsedCall) -> ToolCallOut {
    ToolCallOut {
        id: format!("call_{}", super::random_id(24)),
        kind: "function".into(),
        function: FunctionCallOut {
            name: call.name,
            arguments: call.arguments.to_string(),
        },
    }
}

/// Log-probabilities as OpenAI shows them.
pub(crate) fn logprobs(tokens: &[TokenLogprob]) -> ChoiceLogprobs {
    ChoiceLogprobs {
        content: tokens
            .iter()
            .map(|t| TokenLogprobOut {
                token: t.token.clone(),
                logprob: t.logprob,
                bytes: t.token.as_bytes().to_vec(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|(token, logprob)| TopLogprob {
                        token: token.clone(),
                        logprob: *logprob,
                        bytes: token.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
        refusal: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::request::plan;
    use serde_json::json;

    fn planned(tool_choice: serde_json::Value) -> ChatPlan {
        let body = serde_json::from_value(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "tool_choice": tool_choice,
        }))
        .expect("body");
        plan(body).expect("plan")
    }

    fn generated(text: &str, after: Option<&str>) -> Generated {
        Generated {
            text: text.into(),
            after_marker: after.map(str::to_string),
            finish: Finish::Stop,
            tokens: 5,
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn a_tagged_call_becomes_tool_calls_and_the_text_before_it_content() {
        let p = planned(json!("auto"));
        let r = read(
            &p,
            "",
            &generated(
                "Let me look. ",
                Some(
                    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
                ),
            ),
            false,
        );
        assert_eq!(r.finish, FinishReason::ToolCalls);
        assert_eq!(r.content.as_deref(), Some("Let me look."));
        let calls = r.tool_calls.expect("calls");
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, "{\"city\":\"Oslo\"}");
        assert!(calls[0].id.starts_with("call_"));
    }

    #[test]
    fn a_malformed_call_is_returned_as_text() {
        let p = planned(json!("auto"));
        let r = read(
            &p,
            "",
            &generated("Hm ", Some("<tool_call>{not json")),
            false,
        );
        assert_eq!(r.finish, FinishReason::Stop);
        assert_eq!(r.content.as_deref(), Some("Hm <tool_call>{not json"));
        assert!(r.tool_calls.is_none());
    }

    #[test]
    fn a_named_tool_choice_reads_the_forced_prefix_and_the_generated_arguments() {
        let p = planned(json!({"type": "function", "function": {"name": "get_weather"}}));
        let prefill = p.prefill(tuneq_serve::tool_calls::CallSyntax::Tagged);
        let r = read(
            &p,
            &prefill,
            &generated("{\"city\": \"Lima\"}}\n</tool_call>", None),
            false,
        );
        assert_eq!(r.finish, FinishReason::ToolCalls);
        assert_eq!(r.content, None);
        assert_eq!(
            r.tool_calls.expect("calls")[0].function.arguments,
            "{\"city\":\"Lima\"}"
        );
    }

    #[test]
    fn a_bare_json_call_of_a_declared_tool_is_a_tool_call() {
        let p = planned(json!("auto"));
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}";
        let r = read(&p, "", &generated(text, None), false);
        assert_eq!(r.finish, FinishReason::ToolCalls);
        assert_eq!(r.content, None);
        assert_eq!(
            r.tool_calls.expect("calls")[0].function.arguments,
            "{\"city\":\"Rome\"}"
        );
    }

    #[test]
    fn with_tool_choice_none_a_call_stays_text() {
        let p = planned(json!("none"));
        let text = "{\"name\": \"get_weather\", \"arguments\": {}}";
        let r = read(&p, "", &generated(text, None), false);
        assert_eq!(r.content.as_deref(), Some(text));
        assert_eq!(r.finish, FinishReason::Stop);
    }

    #[test]
    fn a_reasoning_block_is_kept_apart_from_the_content_and_the_calls() {
        let p = planned(json!("auto"));
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let r = read(
            &p,
            "",
            &generated("<think>\nOslo.\n</think>\n\n", Some(call)),
            true,
        );
        assert_eq!(r.finish, FinishReason::ToolCalls);
        assert_eq!((r.content, r.reasoning.as_deref()), (None, Some("Oslo.")));
        assert_eq!(r.tool_calls.expect("calls")[0].function.name, "get_weather");
        let r = read(
            &p,
            "",
            &generated("<think>\n\n</think>\n\nSunny.", None),
            true,
        );
        assert_eq!((r.content.as_deref(), r.reasoning), (Some("Sunny."), None));
        // A model whose template writes no reasoning keeps the text as it is.
        let text = "<think>x</think> Sunny.";
        let r = read(&p, "", &generated(text, None), false);
        assert_eq!((r.content.as_deref(), r.reasoning), (Some(text), None));
    }
}
