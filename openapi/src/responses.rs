//! `POST /v1/responses`: the part of OpenAI's Responses API that stands on one model
//! call — `input` (a string or messages), `instructions`, `text.format`, function
//! `tools`, sampling, `stream` — answered by the same engine as chat completions.
//! Nothing is stored: `store` is accepted, `previous_response_id` refused.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A request for a response.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResponseRequest {
    /// A base model's id or alias, or one of your fine-tuned models.
    pub model: String,
    /// A string (the user's message), or a list of messages (`{"role", "content"}`,
    /// content a string or `input_text` parts; `type: "message"` optional) and
    /// `function_call` / `function_call_output` items.
    #[schema(value_type = Object)]
    pub input: serde_json::Value,
    /// A system message put before the input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Tokens to generate at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    /// 0 to 2; 0 is greedy. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling, 0 (exclusive) to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Send the response as server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", …}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub text: Option<serde_json::Value>,
    /// Function tools (`{"type": "function", "name", "parameters", …}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// `none`, `auto`, `required`, or `{"type": "function", "name": …}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<serde_json::Value>,
    /// Accepted; calls are parsed as the model writes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Refused: responses are not stored, so there is none to continue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    /// Accepted and ignored (responses are never stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    /// Returned as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
    /// Accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<String>,
    /// Accepted if `disabled` (the default): a prompt past the context is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncation: Option<String>,
}

/// Whether a response is whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStatus {
    /// Being generated (in a stream's first events).
    InProgress,
    /// Done.
    Completed,
    /// Cut short (`incomplete_details` says why).
    Incomplete,
    /// Failed while streaming.
    Failed,
}

/// A response.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResponseObject {
    /// `resp_…`.
    pub id: String,
    /// Always `response`.
    pub object: String,
    /// Unix seconds.
    pub created_at: u64,
    /// Where it stands.
    pub status: ResponseStatus,
    /// Why it is incomplete.
    pub incomplete_details: Option<IncompleteDetails>,
    /// The request's instructions.
    pub instructions: Option<String>,
    /// The request's limit.
    pub max_output_tokens: Option<u32>,
    /// The model as the request named it.
    pub model: String,
    /// What the model said: a message, or function calls.
    pub output: Vec<OutputItem>,
    /// The temperature used.
    pub temperature: f32,
    /// The `top_p` used.
    pub top_p: f32,
    /// The request's `text` settings.
    #[schema(value_type = Object)]
    pub text: serde_json::Value,
    /// The request's tools.
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    /// The request's tool choice.
    #[schema(value_type = Object)]
    pub tool_choice: serde_json::Value,
    /// Always true: calls are parsed as the model writes them.
    pub parallel_tool_calls: bool,
    /// Always null (nothing is stored).
    pub previous_response_id: Option<String>,
    /// Always false (nothing is stored).
    pub store: bool,
    /// The request's metadata.
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    /// Always `disabled`.
    pub truncation: String,
    /// Tokens read and written (null until a stream completes).
    pub usage: Option<ResponseUsage>,
    /// Set when a stream failed.
    #[schema(value_type = Option<Object>)]
    pub error: Option<serde_json::Value>,
}

/// Why a response is incomplete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IncompleteDetails {
    /// `max_output_tokens` (also when the model's context ran out).
    pub reason: String,
}

/// One item of a response's output.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The assistant's message.
    Message {
        /// `msg_…`.
        id: String,
        /// `in_progress` or `completed`.
        status: String,
        /// Always `assistant`.
        role: String,
        /// Its text parts.
        content: Vec<OutputText>,
    },
    /// A call of one of the request's functions.
    FunctionCall {
        /// `fc_…`.
        id: String,
        /// `call_…`, for the `function_call_output` that answers it.
        call_id: String,
        /// The function's name.
        name: String,
        /// Its arguments, a JSON object written as a string.
        arguments: String,
        /// Always `completed`.
        status: String,
    },
    /// A reasoning model's reasoning (the block its answer opened with), before its
    /// message.
    Reasoning {
        /// `rs_…`.
        id: String,
        /// Always empty: the reasoning is given whole, not summarised.
        #[schema(value_type = Vec<Object>)]
        summary: Vec<serde_json::Value>,
        /// The reasoning's text, one `reasoning_text` part.
        content: Vec<ReasoningText>,
        /// `in_progress` or `completed`.
        status: String,
    },
}

/// The text of a reasoning item.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ReasoningText {
    /// Always `reasoning_text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: String,
}

/// A text part of a message.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OutputText {
    /// Always `output_text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: String,
    /// Always empty.
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<serde_json::Value>,
}

/// Tokens a response read and wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ResponseUsage {
    /// Tokens of the rendered input.
    pub input_tokens: u64,
    /// Always zero cached.
    pub input_tokens_details: CachedTokens,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Always zero reasoning: a reasoning model's reasoning tokens are counted in
    /// `output_tokens`, not apart.
    pub output_tokens_details: ReasoningTokens,
    /// The sum.
    pub total_tokens: u64,
}

/// Input tokens served from a cache (none here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CachedTokens {
    /// Always 0.
    pub cached_tokens: u64,
}

/// Output tokens spent reasoning (none here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReasoningTokens {
    /// Always 0.
    pub reasoning_tokens: u64,
}
