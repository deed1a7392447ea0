//! Tools for a template that does not render them: the conversation is rewritten into
//! plain role-and-content messages, which every template renders, by the rules in
//! `docs/datasets.md` ("Tools and templates without them"):
//!
//! - the tools are described in the system message (one is added first when the record
//!   has none): [`TOOLS_PREAMBLE`], then `<tools>`, one JSON schema per line, `</tools>`;
//! - an assistant turn's tool calls follow its content, each as
//!   `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` (JSON as Python writes it);
//! - a tool's result becomes a user message `<tool_response>\n…\n</tool_response>`.
//!
//! Loss is unchanged: assistant turns (with their calls) take it, unless weighted 0;
//! tool results never do.

use crate::chat::{Message, Role};
use crate::pyjson;
use serde_json::Value;

/// What the system message says before the tool schemas.
pub const TOOLS_PREAMBLE: &str = "You can call the tools below. To call one, answer with \
<tool_call>{\"name\": <tool name>, \"arguments\": <JSON arguments>}</tool_call>; each result \
comes back in <tool_response></tool_response>.";

/// Whether a conversation needs tools rendered: it declares tools, calls them or answers
/// a call.
pub fn uses_tools(messages: &[Message], tools: &[Value]) -> bool {
    !tools.is_empty() || messages.iter().any(|m| !m.is_plain())
}

/// The conversation as plain messages, tools written into their text (see the module
/// notes).
pub fn without_tools(messages: &[Message], tools: &[Value]) -> Vec<Message> {
    let mut plain: Vec<Message> = messages.iter().map(plain_message).collect();
    if !tools.is_empty() {
        let schemas: Vec<String> = tools
            .iter()
            .map(|t| pyjson::dumps(t, None, false))
            .collect();
        let described = format!(
            "{TOOLS_PREAMBLE}\n<tools>\n{}\n</tools>",
            schemas.join("\n")
        );
        match plain.first_mut() {
            Some(first) if first.role == Role::System => {
                let system = first.text();
                let text = if system.is_empty() {
                    described
                } else {
                    format!("{system}\n\n{described}")
                };
                first.content = Some(text);
            }
            _ => plain.insert(0, Message::new(Role::System, described)),
        }
    }
    plain
}

/// One message as plain role and content.
fn plain_message(m: &Message) -> Message {
    match m.role {
        Role::Tool => Message::new(
            Role::User,
            format!("<tool_response>\n{}\n</tool_response>", m.text()),
        ),
        _ if m.tool_calls.is_empty() => Message {
            name: None,
            ..m.clone()
        },
        _ => {
            let calls: Vec<String> = m
                .tool_calls
                .iter()
                .map(|call| {
                    let body = serde_json::json!({
                        "name": call.function.name,
                        "arguments": call.function.arguments,
                    });
                    format!(
                        "<tool_call>\n{}\n</tool_call>",
                        pyjson::dumps(&body, None, false)
                    )
                })
                .collect();
            let mut text = m.text().to_string();
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&calls.join("\n"));
            Message {
                weight: m.weight,
                ..Message::new(m.role, text)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ToolCall;
    use serde_json::json;

    fn call(id: &str, name: &str, arguments: Value) -> ToolCall {
        ToolCall::function(id, name, arguments)
    }

    #[test]
    fn tools_go_into_the_system_message_and_calls_and_results_into_text() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}),
        ];
        let messages = vec![
            Message::new(Role::User, "Paris?"),
            Message {
                content: None,
                tool_calls: vec![call("c1", "weather", json!({"city": "Paris", "days": 2}))],
                weight: Some(1),
                ..Message::new(Role::Assistant, "")
            },
            Message {
                tool_call_id: Some("c1".into()),
                ..Message::new(Role::Tool, "18 C")
            },
            Message::new(Role::Assistant, "18 C in Paris."),
        ];
        let plain = without_tools(&messages, &tools);
        assert_eq!(plain.len(), 5);
        assert_eq!(plain[0].role, Role::System);
        assert_eq!(
            plain[0].text(),
            format!(
                "{TOOLS_PREAMBLE}\n<tools>\n{{\"type\": \"function\", \"function\": {{\"name\": \"weather\", \"parameters\": {{\"type\": \"object\"}}}}}}\n</tools>"
            )
        );
        assert_eq!(
            plain[2].text(),
            "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>"
        );
        assert_eq!(plain[2].weight, Some(1));
        assert_eq!(
            (plain[3].role, plain[3].text()),
            (Role::User, "<tool_response>\n18 C\n</tool_response>")
        );
        assert!(plain.iter().all(Message::is_plain));
        assert!(uses_tools(&messages, &[]) && !uses_tools(&plain, &[]));
    }

    #[test]
    fn a_system_message_keeps_its_text_before_the_tools() {
        let tools = vec![json!({"type": "function", "function": {"name": "f"}})];
        let plain = without_tools(
            &[
                Message::new(Role::System, "Be brief."),
                Message::new(Role::Assistant, "ok"),
            ],
            &tools,
        );
        assert_eq!(plain.len(), 2);
        assert!(
            plain[0]
                .text()
                .starts_with("Be brief.\n\nYou can call the tools below.")
        );
    }
}
