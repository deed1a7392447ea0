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
    IncompleteDetails, OutputItem, OutputText, ReasoningText, ResponseObject, ResponseRequest,
    ResponseStatus, ResponseUsage,
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
    let (chat, origins) = as_chat(&body)?;
    let plan = request::plan(chat).map_err(|e| in_responses_terms(e, &origins))?;
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
    let response = finished(&shell, &reading, &mut ItemIds::new(), usage);
    Ok(HttpResponse::Ok().json(response))
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, Code::InvalidValue, message)
}

/// Where a chat message came from: the `instructions`, or an item of `input`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Instructions,
    Input(usize),
}

/// The chat request `body` stands for, and where each of its messages came from. A
/// `reasoning` item (an earlier response's, sent back) is no message of its own: its
/// text is the `reasoning_content` of the assistant turn that follows it.
fn as_chat(body: &ResponseRequest) -> ApiResult<(ChatCompletionRequest, Vec<Origin>)> {
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
    let (mut messages, mut origins) = (Vec::new(), Vec::new());
    if let Some(instructions) = &body.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
        origins.push(Origin::Instructions);
    }
    match &body.input {
        Value::String(text) => {
            messages.push(json!({"role": "user", "content": text}));
            origins.push(Origin::Input(0));
        }
        Value::Array(items) => {
            let mut reasoning: Option<String> = None;
            for (i, item) in items.iter().enumerate() {
                if item.get("type").and_then(Value::as_str) == Some("reasoning") {
                    reasoning
                        .get_or_insert_default()
                        .push_str(&reasoning_text(item, i)?);
                    continue;
                }
                let mut message = input_item(item, i)?;
                if let Some(text) = reasoning.take()
                    && message.get("role").and_then(Value::as_str) == Some("assistant")
                {
                    message["reasoning_content"] = text.into();
                }
                messages.push(message);
                origins.push(Origin::Input(i));
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
    let chat = ChatCompletionRequest {
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
    };
    Ok((chat, origins))
}

/// The text of a `reasoning` input item: its `reasoning_text` parts (or, without any,
/// its summary's texts), one after another.
fn reasoning_text(item: &Value, i: usize) -> ApiResult<String> {
    let parts = |key: &str| -> ApiResult<String> {
        let Some(parts) = item.get(key).filter(|v| !v.is_null()) else {
            return Ok(String::new());
        };
        let Some(parts) = parts.as_array() else {
            return Err(invalid(
                &format!("input[{i}].{key}"),
                format!("input[{i}].{key} must be a list of text parts."),
            ));
        };
        let mut text = String::new();
        for (j, part) in parts.iter().enumerate() {
            let Some(piece) = part.get("text").and_then(Value::as_str) else {
                return Err(invalid(
                    &format!("input[{i}].{key}[{j}].text"),
                    format!("input[{i}].{key}[{j}].text must be a string."),
                ));
            };
            text.push_str(piece);
        }
        Ok(text)
    };
    let content = parts("content")?;
    match content.is_empty() {
        true => parts("summary"),
        false => Ok(content),
    }
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
                "input items of type `{}` are not offered; use message, reasoning, function_call or function_call_output.",
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
/// is the input item (or the `instructions`) it came from (`origins`),
/// `response_format` is `text.format`, `max_completion_tokens` is `max_output_tokens`.
fn in_responses_terms(mut e: ApiError, origins: &[Origin]) -> ApiError {
    let Some(param) = e.detail.param.take() else {
        return e;
    };
    let renamed = if let Some(rest) = param.strip_prefix("messages[") {
        let (index, tail) = rest.split_once(']').unwrap_or((rest, ""));
        match index.parse::<usize>().ok().and_then(|k| origins.get(k)) {
            Some(Origin::Instructions) => "instructions".to_string(),
            Some(Origin::Input(i)) => format!("input[{i}]{tail}"),
            None => param,
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

/// The ids of a response's output items, made once, so that a stream's events and the
/// response it ends with name the same items.
#[derive(Debug, Clone)]
struct ItemIds {
    reasoning: String,
    message: String,
    /// One per call, made when the calls are known.
    calls: Vec<String>,
}

impl ItemIds {
    fn new() -> Self {
        Self {
            reasoning: format!("rs_{}", random_id(32)),
            message: format!("msg_{}", random_id(32)),
            calls: Vec::new(),
        }
    }

    /// The id of call `i`, made the first time it is asked for.
    fn call(&mut self, i: usize) -> String {
        while self.calls.len() <= i {
            self.calls.push(format!("fc_{}", random_id(32)));
        }
        self.calls[i].clone()
    }
}

/// The finished response: its output items (the reasoning, the message, the calls, in
/// that order), status and usage.
fn finished(
    shell: &ResponseObject,
    reading: &Reading,
    ids: &mut ItemIds,
    usage: Usage,
) -> ResponseObject {
    let mut output = Vec::new();
    if let Some(reasoning) = &reading.reasoning {
        output.push(reasoning_item(
            ids.reasoning.clone(),
            reasoning.clone(),
            "completed",
        ));
    }
    if let Some(text) = &reading.content {
        output.push(message_item(ids.message.clone(), text.clone(), "completed"));
    }
    for (i, call) in reading.tool_calls.iter().flatten().enumerate() {
        output.push(call_item(
            ids.call(i),
            call,
            &call.function.arguments,
            "completed",
        ));
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

fn reasoning_item(id: String, text: String, status: &str) -> OutputItem {
    OutputItem::Reasoning {
        id,
        summary: Vec::new(),
        content: match text.is_empty() {
            true => Vec::new(),
            false => vec![ReasoningText {
                kind: "reasoning_text".into(),
                text,
            }],
        },
        status: status.into(),
    }
}

fn message_item(id: String, text: String, status: &str) -> OutputItem {
    OutputItem::Message {
        id,
        status: status.into(),
        role: "assistant".into(),
        content: match text.is_empty() && status != "completed" {
            true => Vec::new(),
            false => vec![OutputText {
                kind: "output_text".into(),
                text,
                annotations: Vec::new(),
            }],
        },
    }
}

fn call_item(id: String, call: &ToolCallOut, arguments: &str, status: &str) -> OutputItem {
    OutputItem::FunctionCall {
        id,
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
    ids: ItemIds,
    /// The reasoning item's text so far, once it opened; and whether it is done.
    reasoning: Option<String>,
    reasoning_done: bool,
    /// The message item's text so far, once it opened.
    message: Option<String>,
    /// The response once its one choice closed.
    reading: Option<Reading>,
}

impl ResponseEvents {
    fn new(events: EventSender, shell: Arc<ResponseObject>) -> Self {
        Self {
            events,
            shell,
            sequence: 0,
            ids: ItemIds::new(),
            reasoning: None,
            reasoning_done: false,
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

    /// The output index of the message item: after the reasoning, if any.
    fn message_index(&self) -> usize {
        usize::from(self.reasoning.is_some())
    }

    /// Sends `text` of the reasoning item, opening it the first time.
    fn reasoning_delta(&mut self, text: String) -> bool {
        if text.is_empty() || self.reasoning_done {
            return self.events.alive();
        }
        let id = self.ids.reasoning.clone();
        if self.reasoning.is_none() {
            self.reasoning = Some(String::new());
            let item = reasoning_item(id.clone(), String::new(), "in_progress");
            let opened = self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            ) && self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": 0, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": ""}}),
            );
            if !opened {
                return false;
            }
        }
        if let Some(so_far) = self.reasoning.as_mut() {
            so_far.push_str(&text);
        }
        self.event(
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": text}),
        )
    }

    /// Ends the reasoning item, once, when the message begins or the answer ends.
    fn close_reasoning(&mut self) -> bool {
        let Some(text) = self.reasoning.clone().filter(|_| !self.reasoning_done) else {
            return true;
        };
        self.reasoning_done = true;
        let id = self.ids.reasoning.clone();
        let item = reasoning_item(id.clone(), text.clone(), "completed");
        self.event(
            "response.reasoning_text.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text}),
        ) && self.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                   "part": {"type": "reasoning_text", "text": text}}),
        ) && self.event(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        )
    }

    /// Opens the message item, the first time text comes.
    fn open_message(&mut self) -> bool {
        if self.message.is_some() {
            return true;
        }
        if !self.close_reasoning() {
            return false;
        }
        self.message = Some(String::new());
        let (id, index) = (self.ids.message.clone(), self.message_index());
        let item = message_item(id.clone(), String::new(), "in_progress");
        self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        ) && self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}),
        )
    }

    /// Sends text of the message item.
    fn delta(&mut self, text: String) -> bool {
        if !self.open_message() {
            return false;
        }
        if let Some(so_far) = self.message.as_mut() {
            so_far.push_str(&text);
        }
        let (id, index) = (self.ids.message.clone(), self.message_index());
        self.event(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
        )
    }

    /// Ends the message item, when there is one; the output index after it.
    fn close_message(&mut self) -> Option<usize> {
        let index = self.message_index();
        let Some(text) = self.message.clone() else {
            return Some(index);
        };
        let id = self.ids.message.clone();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let item = message_item(id.clone(), text.clone(), "completed");
        let sent = self.event(
            "response.output_text.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
        ) && self.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        ) && self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        sent.then_some(index + 1)
    }

    /// Sends the calls, each whole, from output index `index` on.
    fn calls(&mut self, mut index: usize, calls: &[ToolCallOut]) -> bool {
        for (i, call) in calls.iter().enumerate() {
            let id = self.ids.call(i);
            let arguments = &call.function.arguments;
            let added = call_item(id.clone(), call, "", "in_progress");
            let done = call_item(id.clone(), call, arguments, "completed");
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
        true
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

    fn reasoning(&mut self, _index: u32, piece: tuneq_serve::Piece) -> bool {
        self.reasoning_delta(piece.text)
    }

    fn close(&mut self, _index: u32, unshown: Option<String>, reading: &Reading) -> bool {
        if let Some(text) = unshown
            && !self.delta(text)
        {
            return false;
        }
        if !self.close_reasoning() {
            return false;
        }
        let Some(next) = self.close_message() else {
            return false;
        };
        if !self.calls(next, reading.tool_calls.as_deref().unwrap_or_default()) {
            return false;
        }
        let mut reading = reading.clone();
        // The items as streamed (what a stream shows is what the response holds).
        reading.reasoning = self.reasoning.clone();
        reading.content = self.message.clone();
        self.reading = Some(reading);
        true
    }

    fn done(&mut self, usage: Usage) -> bool {
        let Some(reading) = self.reading.clone() else {
            return false;
        };
        let response = finished(&self.shell, &reading, &mut self.ids, usage);
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
        let (chat, origins) = as_chat(&body(json!({
            "model": "m", "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "A call "}, {"type": "reasoning_text", "text": "it is."}]},
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
        // The reasoning item is the reasoning of the turn after it, not a message.
        assert_eq!(chat.messages[2]["reasoning_content"], "A call it is.");
        assert_eq!(chat.messages.len(), 4);
        assert_eq!(
            origins,
            [
                Origin::Instructions,
                Origin::Input(0),
                Origin::Input(2),
                Origin::Input(3)
            ]
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
        let (chat, origins) = as_chat(&body(json!({
            "model": "m", "instructions": "x",
            "input": [
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
                {"role": "user", "content": "a"}, {"role": "robot", "content": "b"},
            ],
        })))
        .expect("chat");
        let e = request::plan(chat).expect_err("a robot");
        assert_eq!(
            in_responses_terms(e, &origins).detail.param.as_deref(),
            Some("input[2].role")
        );
        let e = as_chat(&body(json!({"model": "m", "input": [
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": 1}]},
        ]})))
        .expect_err("not text");
        assert_eq!(e.detail.param.as_deref(), Some("input[0].content[0].text"));
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
