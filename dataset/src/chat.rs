//! Chat records in every shape OpenAI's fine-tuning accepts: messages with `name`,
//! `weight`, assistant `tool_calls` (content absent or null), `tool` results, the legacy
//! `functions` / `function_call` / `function` role, and `tools` at the top of a record.
//!
//! Validation reports every problem of a line as `(field, message)`; a valid record
//! becomes a [`crate::Record::Chat`] in one shape, the legacy function-calling fields already
//! turned into tools (`function_call` → one tool call with a generated id, a `function`
//! message → a `tool` message answering it).

use crate::echoed::{echoed_fields, echoed_keys};
use crate::problems::{FieldProblem, kind};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The most messages one chat record may have. Generous (a conversation that long does
/// not fit any model's context), and it bounds the work of a template that has to be
/// rendered once per assistant turn (see the encoder).
pub const MAX_MESSAGES: usize = 2048;

/// The most tools one record may declare (OpenAI's limit for a request).
pub const MAX_TOOLS: usize = 128;

/// Who speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions before the conversation.
    System,
    /// The user.
    User,
    /// The model: the turns that take loss.
    Assistant,
    /// A tool's result, answering an assistant's tool call.
    Tool,
}

impl Role {
    /// The role's name, as OpenAI and chat templates spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One chat message, as chat templates see it (`content` is null for an assistant turn
/// that only calls tools).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said; None for an assistant turn that only calls tools.
    pub content: Option<String>,
    /// The speaker's name (OpenAI's `name`), passed to the template as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The tools an assistant turn calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// OpenAI's `weight` on an assistant turn: 0 takes no loss on it, 1 (or none) does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u8>,
    /// The reasoning an assistant turn opened with (see [`crate::echoed`]), passed to the
    /// template, which writes it where it writes reasoning (Qwen3's `<think>` block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message with the given role and content.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: Some(content.into()),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            weight: None,
            reasoning_content: None,
        }
    }

    /// Whether training takes loss on this message: an assistant turn not weighted 0.
    pub fn is_trained(&self) -> bool {
        self.role == Role::Assistant && self.weight != Some(0)
    }

    /// Whether it is a plain role-and-content message (what every template renders).
    pub fn is_plain(&self) -> bool {
        self.role != Role::Tool && self.tool_calls.is_empty() && self.content.is_some()
    }

    /// The content, empty when there is none.
    pub fn text(&self) -> &str {
        self.content.as_deref().unwrap_or_default()
    }
}

/// One tool call of an assistant turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which the `tool` message answering it names.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function called.
    pub function: FunctionCall,
}

impl ToolCall {
    /// A call `id` of the function `name` with `arguments`.
    pub fn function(id: &str, name: &str, arguments: Value) -> Self {
        Self {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments,
            },
        }
    }
}

/// The function a tool call names, with its arguments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments: OpenAI sends them as a JSON string; they are kept parsed, the way
    /// chat templates expect them (`arguments | tojson`).
    pub arguments: Value,
}

/// A preference pair's parts (see [`crate::Record::Preference`]).
pub(crate) struct PreferencePair {
    pub(crate) messages: Vec<Message>,
    pub(crate) tools: Vec<Value>,
    pub(crate) preferred: Message,
    pub(crate) rejected: Message,
}

/// A chat record's messages and tools: a non-empty `messages` array of well-formed messages in a valid
/// order, with at least one assistant message, and the tools it may call.
pub(crate) fn chat(
    obj: &Map<String, Value>,
    problems: &mut Vec<FieldProblem>,
) -> Option<(Vec<Message>, Vec<Value>)> {
    let before = problems.len();
    let (messages, tools, _) = conversation(obj, "", problems)?;
    if !messages.iter().any(|m| m.role == Role::Assistant) {
        problems.push((
            "messages".into(),
            "needs at least one assistant message".into(),
        ));
    }
    (problems.len() == before).then_some((messages, tools))
}

/// The messages and tools of a request for an answer (OpenAI's `/v1/chat/completions`
/// body): every shape a chat record accepts, without a record's need for an assistant
/// message. Each problem names its field (`messages[2].tool_call_id`).
pub fn request_conversation(
    obj: &Map<String, Value>,
) -> Result<crate::Conversation, Vec<(String, String)>> {
    let mut problems = Vec::new();
    match conversation(obj, "", &mut problems) {
        Some((messages, tools, _)) if problems.is_empty() => {
            Ok(crate::Conversation { messages, tools })
        }
        _ => Err(problems),
    }
}

/// A preference pair, OpenAI's DPO shape: `input` (a conversation, with its tools,
/// ending before the answer) and one assistant message in each of `preferred_output`
/// and `non_preferred_output`.
pub(crate) fn preference(
    obj: &Map<String, Value>,
    problems: &mut Vec<FieldProblem>,
) -> Option<PreferencePair> {
    let before = problems.len();
    let input = match obj.get("input") {
        Some(Value::Object(input)) => Some(input),
        Some(other) => {
            problems.push((
                "input".into(),
                format!("expected an object, got {}", kind(other)),
            ));
            None
        }
        None => {
            problems.push(("input".into(), "missing".into()));
            None
        }
    };
    let prompt = input.and_then(|input| conversation(input, "input.", problems));
    if let Some((messages, _, _)) = &prompt
        && messages.last().is_some_and(|m| m.role == Role::Assistant)
    {
        problems.push((
            format!("input.messages[{}]", messages.len() - 1),
            "the input ends where the answer begins: its last message is not the assistant's"
                .into(),
        ));
    }
    let mut calls = prompt
        .as_ref()
        .map(|(_, _, calls)| calls.clone())
        .unwrap_or_default();
    let mut answer = |field: &str, problems: &mut Vec<FieldProblem>| {
        let Some(Value::Array(items)) = obj.get(field) else {
            let got = obj.get(field).map_or("nothing", kind);
            problems.push((
                field.into(),
                format!("expected an array of one assistant message, got {got}"),
            ));
            return None;
        };
        if items.len() != 1 {
            problems.push((
                field.into(),
                format!(
                    "has {} messages; it holds exactly one, the assistant's answer",
                    items.len()
                ),
            ));
            return None;
        }
        let at = format!("{field}[0]");
        let Value::Object(m) = &items[0] else {
            problems.push((at, format!("expected an object, got {}", kind(&items[0]))));
            return None;
        };
        let reply = message(m, 1, &at, &mut calls, problems)?;
        if reply.role != Role::Assistant {
            problems.push((
                format!("{at}.role"),
                "the answer is an assistant message".into(),
            ));
            return None;
        }
        Some(reply)
    };
    let preferred = answer("preferred_output", problems);
    let rejected = answer("non_preferred_output", problems);
    let (messages, tools, _) = prompt?;
    if problems.len() != before {
        return None;
    }
    Some(PreferencePair {
        messages,
        tools,
        preferred: preferred?,
        rejected: rejected?,
    })
}

/// The messages and tools of `obj` (fields named under `prefix`), with the calls its
/// assistant turns made; None when any is malformed.
fn conversation(
    obj: &Map<String, Value>,
    prefix: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<(Vec<Message>, Vec<Value>, CallIds)> {
    let before = problems.len();
    let tools = tools(obj, prefix, problems);
    check_parallel_tool_calls(obj, prefix, problems);
    let items = message_items(obj, prefix, problems)?;
    let mut messages = Vec::with_capacity(items.len());
    let mut calls = CallIds::default();
    for (i, item) in items.iter().enumerate() {
        let at = format!("{prefix}messages[{i}]");
        let Value::Object(m) = item else {
            problems.push((at, format!("expected an object, got {}", kind(item))));
            continue;
        };
        if let Some(message) = message(m, i, &at, &mut calls, problems) {
            messages.push(message);
        }
    }
    let tools = tools?;
    (problems.len() == before).then_some((messages, tools, calls))
}

/// The record's tools: `tools` (OpenAI's shape) or the legacy `functions`, each made a
/// tool; empty when it has neither. None when either is malformed.
fn tools(
    obj: &Map<String, Value>,
    prefix: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<Vec<Value>> {
    match (obj.get("tools"), obj.get("functions")) {
        (Some(_), Some(_)) => {
            problems.push((
                format!("{prefix}functions"),
                "give either tools or the legacy functions, not both".into(),
            ));
            None
        }
        (Some(tools), None) => list(
            tools,
            &format!("{prefix}tools"),
            problems,
            |tool, at, problems| {
                let Value::Object(t) = tool else {
                    problems.push((
                        at.to_string(),
                        format!("expected an object, got {}", kind(tool)),
                    ));
                    return None;
                };
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    problems.push((format!("{at}.type"), "must be \"function\"".into()));
                }
                let function =
                    function_definition(t.get("function"), &format!("{at}.function"), problems)?;
                let mut tool = t.clone();
                tool.insert("function".into(), function);
                Some(Value::Object(tool))
            },
        ),
        (None, Some(functions)) => list(
            functions,
            &format!("{prefix}functions"),
            problems,
            |f, at, problems| {
                let function = function_definition(Some(f), at, problems)?;
                let mut tool = Map::new();
                tool.insert("type".into(), Value::from("function"));
                tool.insert("function".into(), function);
                Some(Value::Object(tool))
            },
        ),
        (None, None) => Some(Vec::new()),
    }
}

/// The items of the array `value` at `field` (at most [`MAX_TOOLS`]), each read by `item`.
fn list(
    value: &Value,
    field: &str,
    problems: &mut Vec<FieldProblem>,
    item: impl Fn(&Value, &str, &mut Vec<FieldProblem>) -> Option<Value>,
) -> Option<Vec<Value>> {
    let Value::Array(items) = value else {
        problems.push((
            field.into(),
            format!("expected an array, got {}", kind(value)),
        ));
        return None;
    };
    if items.len() > MAX_TOOLS {
        problems.push((
            field.into(),
            format!(
                "has {} entries; a record may have at most {MAX_TOOLS}",
                items.len()
            ),
        ));
        return None;
    }
    let read: Vec<Option<Value>> = items
        .iter()
        .enumerate()
        .map(|(i, v)| item(v, &format!("{field}[{i}]"), problems))
        .collect();
    read.into_iter().collect()
}

/// A function's definition (`name`, optional `description`, `parameters`, `strict`),
/// as given.
fn function_definition(
    value: Option<&Value>,
    at: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<Value> {
    let Some(Value::Object(f)) = value else {
        let got = value.map_or("nothing", kind);
        problems.push((at.into(), format!("expected an object, got {got}")));
        return None;
    };
    let before = problems.len();
    match f.get("name") {
        Some(Value::String(name)) if !name.is_empty() => {}
        Some(Value::String(_)) => problems.push((format!("{at}.name"), "must not be empty".into())),
        None => problems.push((format!("{at}.name"), "missing".into())),
        Some(other) => problems.push((
            format!("{at}.name"),
            format!("expected a string, got {}", kind(other)),
        )),
    }
    for (key, expected, fits) in [
        (
            "description",
            "a string",
            Value::is_string as fn(&Value) -> bool,
        ),
        ("parameters", "an object (a JSON Schema)", Value::is_object),
        ("strict", "true or false", Value::is_boolean),
    ] {
        if let Some(v) = f.get(key).filter(|v| !fits(v)) {
            problems.push((
                format!("{at}.{key}"),
                format!("expected {expected}, got {}", kind(v)),
            ));
        }
    }
    (problems.len() == before).then(|| Value::Object(f.clone()))
}

/// `parallel_tool_calls`, when given, is true or false. (It changes what a model may be
/// asked at inference, not the text it is trained on.)
fn check_parallel_tool_calls(
    obj: &Map<String, Value>,
    prefix: &str,
    problems: &mut Vec<FieldProblem>,
) {
    if let Some(v) = obj.get("parallel_tool_calls").filter(|v| !v.is_boolean()) {
        problems.push((
            format!("{prefix}parallel_tool_calls"),
            format!("expected true or false, got {}", kind(v)),
        ));
    }
}

/// The `messages` array, when it is one of 1 to [`MAX_MESSAGES`] items.
fn message_items<'o>(
    obj: &'o Map<String, Value>,
    prefix: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<&'o Vec<Value>> {
    let field = format!("{prefix}messages");
    let items = match obj.get("messages") {
        None => {
            problems.push((field, "missing".into()));
            return None;
        }
        Some(Value::Array(items)) => items,
        Some(other) => {
            problems.push((field, format!("expected an array, got {}", kind(other))));
            return None;
        }
    };
    if items.is_empty() {
        problems.push((field, "must not be empty".into()));
        return None;
    }
    if items.len() > MAX_MESSAGES {
        problems.push((
            field,
            format!(
                "has {} messages; a record may have at most {MAX_MESSAGES}",
                items.len()
            ),
        ));
        return None;
    }
    Some(items)
}

/// The keys a message may have.
const MESSAGE_KEYS: [&str; 7] = [
    "role",
    "content",
    "name",
    "weight",
    "tool_calls",
    "tool_call_id",
    "function_call",
];

/// The tool calls made so far in a conversation, so that a tool result names one, and a
/// legacy `function` message finds the call it answers.
#[derive(Default, Clone)]
struct CallIds {
    /// (id, function name) of every call, in order.
    made: Vec<(String, String)>,
    /// Legacy `function_call`s seen, for their generated ids.
    legacy: usize,
}

/// Message `i` (at `at`), every problem reported; None when there is any.
fn message(
    m: &Map<String, Value>,
    i: usize,
    at: &str,
    calls: &mut CallIds,
    problems: &mut Vec<FieldProblem>,
) -> Option<Message> {
    let before = problems.len();
    let known = |k: &str| MESSAGE_KEYS.contains(&k) || echoed_keys().any(|e| e == k);
    for key in m.keys().filter(|k| !known(k)) {
        let keys: Vec<&str> = MESSAGE_KEYS.into_iter().chain(echoed_keys()).collect();
        problems.push((
            format!("{at}.{key}"),
            format!("unknown key; a message has only {}", keys.join(", ")),
        ));
    }
    let (role, legacy_function) = role(m, at, problems)?;
    if role == Role::System && i != 0 {
        problems.push((
            format!("{at}.role"),
            "a system message is only allowed as the first message".into(),
        ));
    }
    let name = optional_string(m, "name", at, problems);
    let weight = weight(m, role, at, problems);
    let tool_calls = tool_calls(m, role, at, calls, problems);
    let tool_call_id = answered_call(
        m,
        role,
        legacy_function,
        name.as_deref(),
        at,
        calls,
        problems,
    );
    let calls_tools = tool_calls.as_ref().is_some_and(|c| !c.is_empty());
    let content = content(m, role, calls_tools, at, problems);
    let reasoning_content = echoed_fields(m, role == Role::Assistant, at, problems);
    if problems.len() != before {
        return None;
    }
    Some(Message {
        role,
        content: content?,
        name,
        tool_calls: tool_calls.unwrap_or_default(),
        tool_call_id,
        weight,
        reasoning_content,
    })
}

/// The role, and whether it was the legacy `function` (a tool result).
fn role(
    m: &Map<String, Value>,
    at: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<(Role, bool)> {
    let role = match m.get("role") {
        None => {
            problems.push((format!("{at}.role"), "missing".into()));
            return None;
        }
        Some(Value::String(r)) => r.as_str(),
        Some(other) => {
            problems.push((
                format!("{at}.role"),
                format!("expected a string, got {}", kind(other)),
            ));
            return None;
        }
    };
    Some(match role {
        "system" => (Role::System, false),
        "user" => (Role::User, false),
        "assistant" => (Role::Assistant, false),
        "tool" => (Role::Tool, false),
        "function" => (Role::Tool, true),
        other => {
            problems.push((
                format!("{at}.role"),
                format!(
                    "unknown role {other:?}; expected system, user, assistant, tool or function"
                ),
            ));
            return None;
        }
    })
}

/// An optional non-empty string field of a message.
fn optional_string(
    m: &Map<String, Value>,
    key: &str,
    at: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<String> {
    match m.get(key)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::String(_) => {
            problems.push((format!("{at}.{key}"), "must not be empty".into()));
            None
        }
        other => {
            problems.push((
                format!("{at}.{key}"),
                format!("expected a string, got {}", kind(other)),
            ));
            None
        }
    }
}

/// `weight`: 0 or 1, on assistant messages only.
fn weight(
    m: &Map<String, Value>,
    role: Role,
    at: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<u8> {
    let value = m.get("weight")?;
    if role != Role::Assistant {
        problems.push((
            format!("{at}.weight"),
            "only assistant messages have a weight".into(),
        ));
        return None;
    }
    match value.as_u64() {
        Some(w @ (0 | 1)) => Some(w as u8),
        _ => {
            problems.push((
                format!("{at}.weight"),
                format!("must be 0 or 1, not {value}"),
            ));
            None
        }
    }
}

/// An assistant's `tool_calls`, or its legacy `function_call` as one tool call.
fn tool_calls(
    m: &Map<String, Value>,
    role: Role,
    at: &str,
    calls: &mut CallIds,
    problems: &mut Vec<FieldProblem>,
) -> Option<Vec<ToolCall>> {
    let (field, value) = match (m.get("tool_calls"), m.get("function_call")) {
        (None, None) => return Some(Vec::new()),
        (Some(_), Some(_)) => {
            problems.push((
                format!("{at}.function_call"),
                "give either tool_calls or the legacy function_call, not both".into(),
            ));
            return None;
        }
        (Some(v), None) => ("tool_calls", v),
        (None, Some(v)) => ("function_call", v),
    };
    if role != Role::Assistant {
        problems.push((
            format!("{at}.{field}"),
            "only assistant messages call tools".into(),
        ));
        return None;
    }
    if field == "function_call" {
        let function = function_call(Some(value), &format!("{at}.function_call"), problems)?;
        calls.legacy += 1;
        let id = format!("call_{}", calls.legacy);
        calls.made.push((id.clone(), function.name.clone()));
        return Some(vec![ToolCall {
            id,
            kind: "function".into(),
            function,
        }]);
    }
    let Value::Array(items) = value else {
        problems.push((
            format!("{at}.tool_calls"),
            format!("expected an array, got {}", kind(value)),
        ));
        return None;
    };
    let mut read = Vec::with_capacity(items.len());
    for (j, item) in items.iter().enumerate() {
        let at = format!("{at}.tool_calls[{j}]");
        let Value::Object(call) = item else {
            problems.push((at, format!("expected an object, got {}", kind(item))));
            continue;
        };
        let id = match call.get("id") {
            Some(Value::String(id)) if !id.is_empty() => Some(id.clone()),
            _ => {
                problems.push((format!("{at}.id"), "missing: a non-empty string".into()));
                None
            }
        };
        if call.get("type").and_then(Value::as_str) != Some("function") {
            problems.push((format!("{at}.type"), "must be \"function\"".into()));
        }
        let function = function_call(call.get("function"), &format!("{at}.function"), problems);
        if let (Some(id), Some(function)) = (id, function) {
            calls.made.push((id.clone(), function.name.clone()));
            read.push(ToolCall {
                id,
                kind: "function".into(),
                function,
            });
        }
    }
    (read.len() == items.len()).then_some(read)
}

/// A called function: its `name` and its `arguments`, a string holding JSON.
fn function_call(
    value: Option<&Value>,
    at: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<FunctionCall> {
    let Some(Value::Object(f)) = value else {
        let got = value.map_or("nothing", kind);
        problems.push((at.into(), format!("expected an object, got {got}")));
        return None;
    };
    let name = match f.get("name") {
        Some(Value::String(name)) if !name.is_empty() => Some(name.clone()),
        _ => {
            problems.push((format!("{at}.name"), "missing: a non-empty string".into()));
            None
        }
    };
    let arguments = match f.get("arguments") {
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(arguments) => Some(arguments),
            Err(e) => {
                problems.push((format!("{at}.arguments"), format!("is not valid JSON: {e}")));
                None
            }
        },
        None => {
            problems.push((
                format!("{at}.arguments"),
                "missing: a string of JSON".into(),
            ));
            None
        }
        Some(other) => {
            problems.push((
                format!("{at}.arguments"),
                format!("expected a string of JSON, got {}", kind(other)),
            ));
            None
        }
    };
    Some(FunctionCall {
        name: name?,
        arguments: arguments?,
    })
}

/// The call a tool result answers: its `tool_call_id`, which an earlier assistant turn
/// must have made; for a legacy `function` message, the latest call of its `name`.
fn answered_call(
    m: &Map<String, Value>,
    role: Role,
    legacy_function: bool,
    name: Option<&str>,
    at: &str,
    calls: &CallIds,
    problems: &mut Vec<FieldProblem>,
) -> Option<String> {
    let given = optional_string(m, "tool_call_id", at, problems);
    if role != Role::Tool {
        if given.is_some() {
            problems.push((
                format!("{at}.tool_call_id"),
                "only tool messages answer a call".into(),
            ));
        }
        return None;
    }
    if legacy_function {
        let Some(name) = name else {
            problems.push((
                format!("{at}.name"),
                "missing: a function message names the function it answers".into(),
            ));
            return None;
        };
        let found = calls.made.iter().rev().find(|(_, called)| called == name);
        if found.is_none() {
            problems.push((
                format!("{at}.name"),
                format!("no earlier assistant message calls {name:?}"),
            ));
        }
        return found.map(|(id, _)| id.clone());
    }
    let Some(id) = given else {
        if !m.contains_key("tool_call_id") {
            problems.push((format!("{at}.tool_call_id"), "missing".into()));
        }
        return None;
    };
    if !calls.made.iter().any(|(made, _)| *made == id) {
        problems.push((
            format!("{at}.tool_call_id"),
            format!("no earlier assistant message makes the call {id:?}"),
        ));
    }
    Some(id)
}

/// The content: a string, or OpenAI's array of text parts (joined); null or absent only
/// on an assistant turn that calls tools. The outer None: a problem was reported; the
/// inner None: the turn has no content.
fn content(
    m: &Map<String, Value>,
    role: Role,
    calls_tools: bool,
    at: &str,
    problems: &mut Vec<FieldProblem>,
) -> Option<Option<String>> {
    let field = format!("{at}.content");
    match m.get("content") {
        None | Some(Value::Null) if calls_tools => Some(None),
        None => {
            problems.push((field, "missing".into()));
            None
        }
        Some(Value::Null) => {
            let why = match role {
                Role::Assistant => "null only when the message calls tools",
                _ => "must not be null",
            };
            problems.push((field, why.into()));
            None
        }
        Some(Value::String(c)) => Some(Some(c.clone())),
        Some(Value::Array(parts)) => text_parts(parts, &field, problems).map(Some),
        Some(other) => {
            problems.push((
                field,
                format!(
                    "expected a string or an array of text parts, got {}",
                    kind(other)
                ),
            ));
            None
        }
    }
}

/// OpenAI's content parts, `[{"type": "text", "text": …}, …]`, joined; other parts
/// (images, audio) are refused: tuneq trains on text.
fn text_parts(parts: &[Value], at: &str, problems: &mut Vec<FieldProblem>) -> Option<String> {
    let before = problems.len();
    let mut text = String::new();
    for (k, part) in parts.iter().enumerate() {
        let part_at = format!("{at}[{k}]");
        match (
            part.get("type").and_then(Value::as_str),
            part.get("text").and_then(Value::as_str),
        ) {
            (Some("text"), Some(t)) => text.push_str(t),
            (Some("text"), None) => {
                problems.push((format!("{part_at}.text"), "missing: a string".into()))
            }
            (Some(other), _) => problems.push((
                format!("{part_at}.type"),
                format!("{other:?} parts are not supported: tuneq trains on text parts only"),
            )),
            (None, _) => problems.push((format!("{part_at}.type"), "missing".into())),
        }
    }
    (problems.len() == before).then_some(text)
}
