//! A chat request checked field by field and made a plan: what to render, how to pick
//! tokens, when to stop, what to read back. Every refusal names the field, as OpenAI's
//! API does; nothing here touches a model (the checks that need one, the prompt's
//! length against the context, come once it is loaded).

use crate::error::{ApiError, ApiResult, Code};
use std::collections::HashMap;
use tuneq_dataset::Conversation;
use tuneq_openapi::ChatCompletionRequest;
use tuneq_openapi::chat::{
    MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS,
};
use tuneq_serve::tool_calls::{CALL_OPEN, CallSyntax};
use tuneq_serve::{AnswerFormat, CallFormat, CallableTool, JsonFormat, Sampling};

/// How the request lets the model use its tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToolMode {
    /// No tools, or `tool_choice: "none"`: the answer is text.
    Off,
    /// The model may call tools (`auto`, the default with tools).
    Auto,
    /// The model must call one (`required`): the answer starts a call.
    Required,
    /// The model must call this one: the answer starts its call.
    Named(String),
}

/// What a chat request asks for, checked.
#[derive(Debug, Clone)]
pub(crate) struct ChatPlan {
    /// The model as the request names it.
    pub(crate) model: String,
    /// The conversation and its tools.
    pub(crate) conversation: Conversation,
    /// The declared tools' names.
    pub(crate) tool_names: Vec<String>,
    /// How tools may be used.
    pub(crate) tools: ToolMode,
    /// Several calls in one answer (`parallel_tool_calls`, on unless turned off).
    pub(crate) parallel_calls: bool,
    /// Variables for the chat template (`chat_template_kwargs`).
    pub(crate) template_variables: tuneq_dataset::TemplateVariables,
    /// Tokens to generate at most, when the request says.
    pub(crate) max_new_tokens: Option<usize>,
    /// How tokens are picked.
    pub(crate) sampling: Sampling,
    /// Answers to generate.
    pub(crate) n: u32,
    /// The first choice's seed (choice i draws from seed + i).
    pub(crate) seed: u64,
    /// Stop strings.
    pub(crate) stop: Vec<String>,
    /// Alternatives per token, when log-probabilities are asked for.
    pub(crate) logprobs: Option<usize>,
    /// JSON the answer must be (`response_format`), enforced while generating.
    pub(crate) json: Option<JsonFormat>,
    /// Stream the answer.
    pub(crate) stream: bool,
    /// With `stream`: end with a usage chunk.
    pub(crate) include_usage: bool,
}

impl ChatPlan {
    /// The text the answer is forced to start with (a call the request requires), in
    /// the model's own syntax.
    pub(crate) fn prefill(&self, syntax: CallSyntax) -> String {
        match &self.tools {
            ToolMode::Named(name) => syntax.forced_prefix(Some(name)),
            ToolMode::Required => syntax.forced_prefix(None),
            ToolMode::Off | ToolMode::Auto => String::new(),
        }
    }

    /// What the answer must be, in the model's call `syntax`: JSON (`response_format`),
    /// calls (a required or named tool), either (a JSON `response_format` beside tools
    /// the model may call); None when it is free text (which may hold calls).
    pub(crate) fn answer_format(&self, syntax: CallSyntax) -> Option<AnswerFormat> {
        let callable = |only: Option<&str>| -> Vec<CallableTool> {
            self.conversation
                .tools
                .iter()
                .filter_map(CallableTool::of_declared)
                .filter(|tool| only.is_none_or(|name| tool.name == name))
                .collect()
        };
        let calls = |tools, or_json| {
            Some(AnswerFormat::Calls(CallFormat {
                syntax,
                tools,
                parallel: self.parallel_calls,
                or_json,
            }))
        };
        match (&self.tools, &self.json) {
            (ToolMode::Off, json) => json.clone().map(AnswerFormat::Json),
            (ToolMode::Auto, None) => None,
            (ToolMode::Auto, Some(json)) => calls(callable(None), Some(json.clone())),
            (ToolMode::Required, _) => calls(callable(None), None),
            (ToolMode::Named(name), _) => calls(callable(Some(name)), None),
        }
    }

    /// Where the plain text of an answer ends: a tool call's opening, when the model
    /// may call tools of its own accord.
    pub(crate) fn markers(&self) -> Vec<String> {
        match self.tools {
            ToolMode::Auto => vec![CALL_OPEN.to_string()],
            _ => Vec::new(),
        }
    }
}

/// Variables a request may hand its model's chat template at most.
const MAX_TEMPLATE_VARIABLES: usize = 16;

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, Code::InvalidValue, message)
}

/// Checks `body` and makes its plan.
pub(crate) fn plan(body: ChatCompletionRequest) -> ApiResult<ChatPlan> {
    let conversation = conversation(&body)?;
    let tool_names: Vec<String> = conversation
        .tools
        .iter()
        .filter_map(|t| t.pointer("/function/name")?.as_str().map(str::to_string))
        .collect();
    let tools = tool_mode(body.tool_choice.as_ref(), &tool_names)?;
    let json = body
        .response_format
        .as_ref()
        .map(response_format)
        .transpose()?
        .flatten();
    let max_new_tokens = match (body.max_tokens, body.max_completion_tokens) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "max_tokens",
                Code::ConflictingValues,
                "Give max_tokens or max_completion_tokens, not both.",
            ));
        }
        (Some(0), _) => return Err(invalid("max_tokens", "max_tokens must be at least 1.")),
        (_, Some(0)) => {
            return Err(invalid(
                "max_completion_tokens",
                "max_completion_tokens must be at least 1.",
            ));
        }
        (a, b) => a.or(b).map(|n| n as usize),
    };
    let n = body.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(invalid("n", format!("n must be 1 to {MAX_CHOICES}.")));
    }
    let logprobs = match (body.logprobs.unwrap_or(false), body.top_logprobs) {
        (_, Some(k)) if k > MAX_TOP_LOGPROBS => {
            return Err(invalid(
                "top_logprobs",
                format!("top_logprobs must be 0 to {MAX_TOP_LOGPROBS}."),
            ));
        }
        (false, Some(_)) => {
            return Err(invalid(
                "top_logprobs",
                "top_logprobs needs logprobs set to true.",
            ));
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, None) => None,
    };
    let stream = body.stream.unwrap_or(false);
    if body.stream_options.is_some() && !stream {
        return Err(invalid(
            "stream_options",
            "stream_options is only allowed with stream set to true.",
        ));
    }
    Ok(ChatPlan {
        model: body.model.clone(),
        conversation,
        tool_names,
        tools,
        parallel_calls: body.parallel_tool_calls.unwrap_or(true),
        template_variables: template_variables(body.chat_template_kwargs.clone())?,
        max_new_tokens,
        sampling: sampling(&body)?,
        n,
        seed: body.seed.map_or_else(rand::random, |s| s as u64),
        stop: stop_strings(body.stop.clone())?,
        logprobs,
        json,
        stream,
        include_usage: body
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// The messages and tools, checked as a chat record's are (OpenAI's `developer` role
/// is read as `system`, which is what it replaced).
fn conversation(body: &ChatCompletionRequest) -> ApiResult<Conversation> {
    let mut messages = body.messages.clone();
    for m in &mut messages {
        if let Some(role) = m.get_mut("role")
            && role == "developer"
        {
            *role = "system".into();
        }
    }
    let mut obj = serde_json::Map::new();
    obj.insert("messages".into(), messages.into());
    if let Some(tools) = &body.tools {
        obj.insert("tools".into(), tools.clone().into());
    }
    tuneq_dataset::request_conversation(&obj).map_err(|problems| {
        let (field, message) = problems.into_iter().next().unwrap_or_else(|| {
            (
                "messages".to_string(),
                "is not a valid conversation".to_string(),
            )
        });
        invalid(&field, format!("{field}: {message}"))
    })
}

/// `chat_template_kwargs`, checked: at most [`MAX_TEMPLATE_VARIABLES`], each named as a
/// template variable may be and none of the names the template is rendered with.
fn template_variables(
    kwargs: Option<serde_json::Map<String, serde_json::Value>>,
) -> ApiResult<tuneq_dataset::TemplateVariables> {
    let kwargs = kwargs.unwrap_or_default();
    if kwargs.len() > MAX_TEMPLATE_VARIABLES {
        return Err(invalid(
            "chat_template_kwargs",
            format!("chat_template_kwargs holds at most {MAX_TEMPLATE_VARIABLES} variables."),
        ));
    }
    for name in kwargs.keys() {
        let well_formed = (1..=64).contains(&name.len())
            && name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !well_formed {
            return Err(invalid(
                "chat_template_kwargs",
                format!(
                    "`{}` is not a template variable's name: letters, digits and _, 64 at most, not starting with a digit.",
                    crate::quote::shown(name)
                ),
            ));
        }
        if tuneq_dataset::RENDERING_NAMES.contains(&name.as_str()) {
            return Err(invalid(
                &format!("chat_template_kwargs.{name}"),
                format!("`{name}` is set by the rendering itself; choose another variable."),
            ));
        }
    }
    Ok(kwargs)
}

/// `tool_choice` against the declared tools.
fn tool_mode(choice: Option<&serde_json::Value>, names: &[String]) -> ApiResult<ToolMode> {
    use serde_json::Value;
    let needs_tools = |what: &str| {
        invalid(
            "tool_choice",
            format!("tool_choice {what} needs tools: the request declares none."),
        )
    };
    match choice {
        None => Ok(if names.is_empty() {
            ToolMode::Off
        } else {
            ToolMode::Auto
        }),
        Some(Value::String(s)) if s == "none" => Ok(ToolMode::Off),
        Some(Value::String(s)) if s == "auto" => Ok(if names.is_empty() {
            ToolMode::Off
        } else {
            ToolMode::Auto
        }),
        Some(Value::String(s)) if s == "required" => match names.is_empty() {
            true => Err(needs_tools("`required`")),
            false => Ok(ToolMode::Required),
        },
        Some(Value::Object(obj)) if obj.get("type").and_then(Value::as_str) == Some("function") => {
            let name = obj.get("function").and_then(|f| f.get("name"));
            let Some(name) = name.and_then(Value::as_str) else {
                return Err(invalid(
                    "tool_choice.function.name",
                    "tool_choice names no function: give {\"type\": \"function\", \"function\": {\"name\": …}}.",
                ));
            };
            if !names.iter().any(|n| n == name) {
                return Err(invalid(
                    "tool_choice.function.name",
                    format!(
                        "tool_choice names `{}`, which is not one of the request's tools.",
                        crate::quote::shown(name)
                    ),
                ));
            }
            Ok(ToolMode::Named(name.to_string()))
        }
        Some(_) => Err(invalid(
            "tool_choice",
            "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}.",
        )),
    }
}

/// The longest `json_schema.name` (OpenAI's limit).
const MAX_SCHEMA_NAME: usize = 64;

/// `response_format`: None for text; JSON formats are enforced by constrained decoding
/// (the schema itself is checked against the model's grammar engine once it is loaded).
fn response_format(format: &serde_json::Value) -> ApiResult<Option<JsonFormat>> {
    use serde_json::Value;
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(JsonFormat::Object)),
        Some("json_schema") => {
            let Some(spec) = format.get("json_schema").and_then(Value::as_object) else {
                return Err(invalid(
                    "response_format.json_schema",
                    "response_format json_schema needs a json_schema object with a name and a schema.",
                ));
            };
            let name = spec.get("name").and_then(Value::as_str).unwrap_or_default();
            let named = (1..=MAX_SCHEMA_NAME).contains(&name.len())
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !named {
                return Err(invalid(
                    "response_format.json_schema.name",
                    format!(
                        "The schema's name must be 1 to {MAX_SCHEMA_NAME} letters, digits, _ or -."
                    ),
                ));
            }
            match spec.get("schema") {
                None => Ok(Some(JsonFormat::Object)),
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(JsonFormat::Schema(schema.clone())))
                }
                Some(_) => Err(invalid(
                    "response_format.json_schema.schema",
                    "The schema must be a JSON Schema object.",
                )),
            }
        }
        _ => Err(invalid(
            "response_format.type",
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\".",
        )),
    }
}

/// Temperature, `top_p`, penalties and `logit_bias`, each in OpenAI's range.
fn sampling(body: &ChatCompletionRequest) -> ApiResult<Sampling> {
    let ranged = |param: &str, value: Option<f32>, lo: f32, hi: f32, default: f32| {
        let v = value.unwrap_or(default);
        if v.is_finite() && (lo..=hi).contains(&v) {
            Ok(v)
        } else {
            Err(invalid(param, format!("{param} must be {lo} to {hi}.")))
        }
    };
    let top_p = ranged("top_p", body.top_p, 0.0, 1.0, 1.0)?;
    if top_p == 0.0 {
        return Err(invalid("top_p", "top_p must be above 0 (and at most 1)."));
    }
    let mut logit_bias = HashMap::new();
    let bias = body.logit_bias.clone().unwrap_or_default();
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(invalid(
            "logit_bias",
            format!("logit_bias may have {MAX_LOGIT_BIAS} entries at most."),
        ));
    }
    for (token, value) in bias {
        let param = format!("logit_bias.{}", crate::quote::shown(&token));
        let Ok(id) = token.parse::<u32>() else {
            return Err(invalid(&param, "logit_bias keys are token ids."));
        };
        logit_bias.insert(id, ranged(&param, Some(value), -100.0, 100.0, 0.0)?);
    }
    Ok(Sampling {
        temperature: ranged("temperature", body.temperature, 0.0, 2.0, 1.0)?,
        top_p,
        logit_bias,
        presence_penalty: ranged("presence_penalty", body.presence_penalty, -2.0, 2.0, 0.0)?,
        frequency_penalty: ranged("frequency_penalty", body.frequency_penalty, -2.0, 2.0, 0.0)?,
    })
}

/// `stop`: up to four non-empty strings of bounded length.
fn stop_strings(stop: Option<tuneq_openapi::StopStrings>) -> ApiResult<Vec<String>> {
    let stop = stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!("stop may hold {MAX_STOP_STRINGS} strings at most."),
        ));
    }
    for (i, s) in stop.iter().enumerate() {
        if s.is_empty() || s.chars().count() > MAX_STOP_CHARS {
            return Err(invalid(
                &format!("stop[{i}]"),
                format!("Each stop string has 1 to {MAX_STOP_CHARS} characters."),
            ));
        }
    }
    Ok(stop)
}
