//! `POST /v1/responses`: OpenAI's newer API for one model call, on the chat engine.
//!
//! A request is translated into a chat request (`instructions` becomes the system
//! message, `input` the messages, function calls and their outputs tool calls and tool
//! messages, `text.format` the response format, flat function tools chat's nested
//! ones) and planned, checked and generated exactly as one; the answer comes back as a
//! response object, or as the Responses API's typed stream events
//! (`response.created` … `response.output_text.delta` … `response.completed`).

use super::answer::Reading;
use super::request::{self, ChatPlan};
use super::stream::{self, AnswerSink, EventSender};
use super::{Started, generate_whole, random_id, start};
use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::refusals::GenerationRefused;
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use serde_json::{Value, json};
use std::sync::Arc;
use tuneq_openapi::responses::{
    IncompleteDetails, OutputItem, OutputText, ResponseObject, ResponseRequest, ResponseStatus,
    ResponseUsage,
};
use tuneq_openapi::{ChatCompletionRequest, FinishReason, ToolCallOut, Usage};

/// A response to `input` (and `instructions`), whole or streamed.
#[utoipa::path(post, path = "/v1/responses", tag = "chat", operation_id = "create_response",
    request_body = ResponseRequest,
    responses(
        (status = 200, description = "The response; with `stream`, server-sent events (`response.created`, `response.output_text.delta`, …, `response.completed`)",
            content(
                (ResponseObject = "application/json"),
                (String = "text/event-stream"),
            )),
        GenerationRefused,
    ))]
pub(crate) async fn create_response(
    state: web::Data<AppState>,
    tenant: Tenant,
    body: crate::body::JsonBody<ResponseRequest>,
) -> ApiResult<HttpResponse> {
    let body = body.0;
    let shift = usize::from(body.instructions.is_some());
    let plan = request::plan(as_chat(&body)?).map_err(|e| in_responses_terms(e, shift))?;
    let shell = Arc::new(shell(&body, &plan));
    let Started {
        inference,
        slot,
        prepared,
        span,
    } = start(&state, &tenant, &plan, "response").await?;
    if plan.stream {
        let sink = move |events| ResponseEvents::new(events, shell);
        return Ok(stream::respond(
            inference, slot, prepared, plan, tenant.0, span, sink,
        ));
    }
    let (choices, usage) = generate_whole(slot, prepared, Arc::new(plan), span).await?;
    inference.count(&tenant.0, usage);
    let choice = choices
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::internal("a response generated no choice"))?;
    let reading = Reading {
        content: choice.message.content,
        tool_calls: choice.message.tool_calls,
        reasoning: choice.message.reasoning_content,
        finish: choice.finish_reason,
    };
    Ok(HttpResponse::Ok().json(finished(&shell, &reading, usage)))
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, Code::InvalidValue, message)
}

/// The chat request `body` stands for.
fn as_chat(body: &ResponseRequest) -> ApiResult<ChatCompletionRequest> {
    if body.previous_response_id.is_some() {
        return Err(invalid(
            "previous_response_id",
            "Responses are not stored, so there is none to continue: send the whole conversation as input.",
        ));
    }
    if body.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(invalid(
            "truncation",
            "Only truncation \"disabled\" is offered: an input past the model's context is refused.",
        ));
    }
    let mut messages = Vec::new();
    if let Some(instructions) = &body.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match &body.input {
        Value::String(text) => messages.push(json!({"role": "user", "content": text})),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                messages.push(input_item(item, i)?);
            }
        }
        _ => {
            return Err(invalid(
                "input",
                "input must be a string or a list of messages.",
            ));
        }
    }
    let tools = body
        .tools
        .as_ref()
        .map(|tools| {
            tools
                .iter()
                .enumerate()
                .map(|(i, tool)| function_tool(tool, i))
                .collect::<ApiResult<Vec<_>>>()
        })
        .transpose()?;
    Ok(ChatCompletionRequest {
        model: body.model.clone(),
        messages,
        max_completion_tokens: body.max_output_tokens,
        temperature: body.temperature,
        top_p: body.top_p,
        stream: body.stream,
        tools,
        tool_choice: body.tool_choice.as_ref().map(tool_choice),
        parallel_tool_calls: body.parallel_tool_calls,
        response_format: body
            .text
            .as_ref()
            .map(response_format)
            .transpose()?
            .flatten(),
        ..ChatCompletionRequest::default()
    })
}

/// One input item as a chat message: a message (its text parts made chat's), a
/// function call (an assistant turn calling it) or a call's output (a tool message).
fn input_item(item: &Value, i: usize) -> ApiResult<Value> {
    let at = format!("input[{i}]");
    let kind = item
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    match kind {
        "message" => {
            let mut message = item.clone();
            if let Some(obj) = message.as_object_mut() {
                obj.remove("type");
                obj.remove("id");
                obj.remove("status");
                if let Some(Value::Array(parts)) = obj.get_mut("content") {
                    for (j, part) in parts.iter_mut().enumerate() {
                        *part = text_part(part, &format!("{at}.content[{j}]"))?;
                    }
                }
            }
            Ok(message)
        }
        "function_call" => {
            let field = |name: &str| {
                item.get(name).and_then(Value::as_str).ok_or_else(|| {
                    invalid(
                        &format!("{at}.{name}"),
                        format!("{at}.{name} must be a string."),
                    )
                })
            };
            Ok(
                json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": field("call_id")?, "type": "function",
                "function": {"name": field("name")?, "arguments": field("arguments")?}}]}),
            )
        }
        "function_call_output" => {
            let call = item.get("call_id").and_then(Value::as_str);
            let output = item.get("output").and_then(Value::as_str);
            match (call, output) {
                (Some(call), Some(output)) => {
                    Ok(json!({"role": "tool", "tool_call_id": call, "content": output}))
                }
                (None, _) => Err(invalid(
                    &format!("{at}.call_id"),
                    "call_id must be a string.",
                )),
                (_, None) => Err(invalid(&format!("{at}.output"), "output must be a string.")),
            }
        }
        other => Err(invalid(
            &format!("{at}.type"),
            format!(
                "input items of type `{}` are not offered; use message, function_call or function_call_output.",
                crate::quote::shown(other)
            ),
        )),
    }
}

/// A Responses text part (`input_text`, or `output_text` of an earlier answer) as
/// chat's `text` part.
fn text_part(part: &Value, at: &str) -> ApiResult<Value> {
    match part.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text" | "text") => Ok(json!({
            "type": "text",
            "text": part.get("text").cloned().unwrap_or(Value::Null),
        })),
        _ => Err(invalid(
            &format!("{at}.type"),
            "Only text parts (input_text, output_text) are offered.",
        )),
    }
}

/// A flat function tool (`{"type": "function", "name", "parameters"}`) as chat's. A
/// function tool of the Responses API is strict unless it says otherwise.
fn function_tool(tool: &Value, i: usize) -> ApiResult<Value> {
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(invalid(
            &format!("tools[{i}].type"),
            "Only function tools are offered.",
        ));
    }
    let mut function = tool.clone();
    if let Some(obj) = function.as_object_mut() {
        obj.remove("type");
        obj.entry("strict").or_insert(Value::Bool(true));
    }
    Ok(json!({"type": "function", "function": function}))
}

/// A tool choice in chat's shape (`{"type": "function", "name"}` nests its name).
fn tool_choice(choice: &Value) -> Value {
    match choice.get("name") {
        Some(name) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            json!({"type": "function", "function": {"name": name}})
        }
        _ => choice.clone(),
    }
}

/// `text.format` as chat's `response_format` (None for plain text).
fn response_format(text: &Value) -> ApiResult<Option<Value>> {
    let Some(format) = text.get("format") else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = format.clone();
            if let Some(obj) = schema.as_object_mut() {
                obj.remove("type");
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(invalid(
            "text.format.type",
            "text.format.type must be \"text\", \"json_object\" or \"json_schema\".",
        )),
    }
}

/// A refusal of the translated chat request, naming the Responses field: `messages[k]`
/// is `input[k − shift]` (or `instructions`), `response_format` is `text.format`,
/// `max_completion_tokens` is `max_output_tokens`.
fn in_responses_terms(mut e: ApiError, shift: usize) -> ApiError {
    let Some(param) = e.detail.param.take() else {
        return e;
    };
    let renamed = if let Some(rest) = param.strip_prefix("messages[") {
        let (index, tail) = rest.split_once(']').unwrap_or((rest, ""));
        match index.parse::<usize>() {
            Ok(k) if k < shift => "instructions".to_string(),
            Ok(k) => format!("input[{}]{tail}", k - shift),
            Err(_) => param,
        }
    } else if param == "messages" {
        "input".to_string()
    } else if let Some(rest) = param.strip_prefix("response_format") {
        format!("text.format{rest}")
    } else if param == "max_completion_tokens" {
        "max_output_tokens".to_string()
    } else {
        param
    };
    e.detail.param = Some(renamed);
    e
}

/// The response as it stands before generation: the request's settings echoed, no
/// output yet.
fn shell(body: &ResponseRequest, plan: &ChatPlan) -> ResponseObject {
    ResponseObject {
        id: format!("resp_{}", random_id(32)),
        object: "response".into(),
        created_at: crate::records::now_seconds(),
        status: ResponseStatus::InProgress,
        incomplete_details: None,
        instructions: body.instructions.clone(),
        max_output_tokens: body.max_output_tokens,
        model: body.model.clone(),
        output: Vec::new(),
        temperature: plan.sampling.temperature,
        top_p: plan.sampling.top_p,
        text: body
            .text
            .clone()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
        tools: body.tools.clone().unwrap_or_default(),
        tool_choice: body.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: plan.parallel_calls,
        previous_response_id: None,
        store: false,
        metadata: body.metadata.clone().unwrap_or_else(|| json!({})),
        truncation: "disabled".into(),
        usage: None,
        error: None,
    }
}

/// The finished response: its output items, status and usage.
fn finished(shell: &ResponseObject, reading: &Reading, usage: Usage) -> ResponseObject {
    let mut output = Vec::new();
    if let Some(text) = &reading.content {
        output.push(message_item(
            format!("msg_{}", random_id(32)),
            text.clone(),
            "completed",
        ));
    }
    for call in reading.tool_calls.iter().flatten() {
        output.push(call_item(call, &call.function.arguments, "completed"));
    }
    let incomplete = reading.finish == FinishReason::Length;
    ResponseObject {
        status: match incomplete {
            true => ResponseStatus::Incomplete,
            false => ResponseStatus::Completed,
        },
        incomplete_details: incomplete.then(|| IncompleteDetails {
            reason: "max_output_tokens".into(),
        }),
        output,
        usage: Some(ResponseUsage {
            input_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            total_tokens: usage.total_tokens,
            ..ResponseUsage::default()
        }),
        ..shell.clone()
    }
}

fn message_item(id: String, text: String, status: &str) -> OutputItem {
    OutputItem::Message {
        id,
        status: status.into(),
        role: "assistant".into(),
        content: vec![OutputText {
            kind: "output_text".into(),
            text,
            annotations: Vec::new(),
        }],
    }
}

fn call_item(call: &ToolCallOut, arguments: &str, status: &str) -> OutputItem {
    OutputItem::FunctionCall {
        id: format!("fc_{}", random_id(32)),
        call_id: call.id.clone(),
        name: call.function.name.clone(),
        arguments: arguments.to_string(),
        status: status.into(),
    }
}

/// The Responses API's stream events.
struct ResponseEvents {
    events: EventSender,
    shell: Arc<ResponseObject>,
    sequence: u64,
    /// The message item being streamed: its id and its text so far.
    message: Option<(String, String)>,
    /// The response once its one choice closed.
    reading: Option<Reading>,
}

impl ResponseEvents {
    fn new(events: EventSender, shell: Arc<ResponseObject>) -> Self {
        Self {
            events,
            shell,
            sequence: 0,
            message: None,
            reading: None,
        }
    }

    /// Sends one event of type `kind` with `fields`.
    fn event(&mut self, kind: &str, mut fields: Value) -> bool {
        if let Some(obj) = fields.as_object_mut() {
            obj.insert("type".into(), kind.into());
            obj.insert("sequence_number".into(), self.sequence.into());
        }
        self.sequence += 1;
        self.events
            .send(format!("event: {kind}\ndata: {fields}\n\n"))
    }

    /// Opens the message item, the first time text comes.
    fn open_message(&mut self) -> bool {
        if self.message.is_some() {
            return true;
        }
        let id = format!("msg_{}", random_id(32));
        self.message = Some((id.clone(), String::new()));
        let item = OutputItem::Message {
            id: id.clone(),
            status: "in_progress".into(),
            role: "assistant".into(),
            content: Vec::new(),
        };
        self.event(
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        ) && self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}),
        )
    }

    /// Sends text of the message item.
    fn delta(&mut self, text: String) -> bool {
        if !self.open_message() {
            return false;
        }
        let Some((id, so_far)) = self.message.as_mut() else {
            return false;
        };
        so_far.push_str(&text);
        let id = id.clone();
        self.event(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}),
        )
    }
}

impl AnswerSink for ResponseEvents {
    fn alive(&self) -> bool {
        self.events.alive()
    }

    fn open(&mut self, _index: u32) -> bool {
        let shell = self.shell.clone();
        self.event("response.created", json!({"response": *shell}))
            && self.event("response.in_progress", json!({"response": *shell}))
    }

    fn text(&mut self, _index: u32, piece: tuneq_serve::Piece) -> bool {
        self.delta(piece.text)
    }

    /// A response shows the answer's text only (its reasoning is not an output item).
    fn reasoning(&mut self, _index: u32, _piece: tuneq_serve::Piece) -> bool {
        self.events.alive()
    }

    fn close(&mut self, _index: u32, unshown: Option<String>, reading: &Reading) -> bool {
        if let Some(text) = unshown
            && !self.delta(text)
        {
            return false;
        }
        let mut index = 0;
        if let Some((id, text)) = self.message.clone() {
            let part = json!({"type": "output_text", "text": text, "annotations": []});
            let item = message_item(id.clone(), text.clone(), "completed");
            let sent = self.event(
                "response.output_text.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            ) && self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "part": part}),
            ) && self.event("response.output_item.done", json!({"output_index": 0, "item": item}));
            if !sent {
                return false;
            }
            index = 1;
        }
        for call in reading.tool_calls.iter().flatten() {
            let added = call_item(call, "", "in_progress");
            let OutputItem::FunctionCall { id, .. } = &added else {
                continue;
            };
            let id = id.clone();
            let arguments = &call.function.arguments;
            let mut done = call_item(call, arguments, "completed");
            if let OutputItem::FunctionCall { id: done_id, .. } = &mut done {
                done_id.clone_from(&id);
            }
            let sent = self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": added}),
            ) && self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": arguments}),
            ) && self.event(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "arguments": arguments}),
            ) && self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": done}),
            );
            if !sent {
                return false;
            }
            index += 1;
        }
        let mut reading = reading.clone();
        // The message's text as streamed (what a stream shows is what the response holds).
        reading.content = self.message.as_ref().map(|(_, text)| text.clone());
        self.reading = Some(reading);
        true
    }

    fn done(&mut self, usage: Usage) -> bool {
        let Some(reading) = self.reading.clone() else {
            return false;
        };
        let response = finished(&self.shell, &reading, usage);
        let kind = match response.status {
            ResponseStatus::Incomplete => "response.incomplete",
            _ => "response.completed",
        };
        self.event(kind, json!({"response": response}))
    }

    fn fail(&mut self, error: ApiError) {
        let mut response = (*self.shell).clone();
        response.status = ResponseStatus::Failed;
        response.error = Some(json!({"code": error.detail.code, "message": error.detail.message}));
        self.event("response.failed", json!({"response": response}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(value: Value) -> ResponseRequest {
        serde_json::from_value(value).expect("body")
    }

    #[test]
    fn input_instructions_tools_and_format_become_a_chat_request() {
        let chat = as_chat(&body(json!({
            "model": "m", "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "max_output_tokens": 9,
        })))
        .expect("chat");
        assert_eq!(
            chat.messages[0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert_eq!(
            chat.messages[1]["content"][0],
            json!({"type": "text", "text": "Weather?"})
        );
        assert_eq!(
            chat.messages[2]["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(
            chat.messages[3],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
        );
        assert_eq!(
            chat.tools.expect("tools")[0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(
            chat.tool_choice.expect("choice")["function"]["name"],
            "get_weather"
        );
        assert_eq!(
            chat.response_format.expect("format")["json_schema"]["name"],
            "w"
        );
        assert_eq!(chat.max_completion_tokens, Some(9));
    }

    #[test]
    fn refusals_name_the_responses_field() {
        let e = request::plan(
            as_chat(&body(json!({
                "model": "m", "instructions": "x",
                "input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            })))
            .expect("chat"),
        )
        .expect_err("a robot");
        assert_eq!(
            in_responses_terms(e, 1).detail.param.as_deref(),
            Some("input[1].role")
        );
        let e = as_chat(&body(
            json!({"model": "m", "input": [{"type": "web_search_call"}]}),
        ))
        .expect_err("not offered");
        assert_eq!(e.detail.param.as_deref(), Some("input[0].type"));
        let e = as_chat(&body(
            json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}),
        ))
        .expect_err("not stored");
        assert_eq!(e.detail.param.as_deref(), Some("previous_response_id"));
    }
}
