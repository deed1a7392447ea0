//! `POST /v1/chat/completions`: OpenAI's request and answer shapes, whole and streamed.
//!
//! Messages and tools travel as JSON here and are read by the dataset crate's validator
//! (the shapes a chat record accepts for training are the shapes a request accepts), so
//! an error names the field (`messages[1].content`). Every other field is typed; fields
//! OpenAI defines that do not change an answer here (`user`, `metadata`, `store`,
//! `service_tier`) are accepted and ignored; any other is refused.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// The most choices one request may ask for.
pub const MAX_CHOICES: u32 = 8;
/// The most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 4;
/// The longest stop string, in characters.
pub const MAX_STOP_CHARS: usize = 128;
/// The most alternatives `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// The most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 300;

/// A request for a model's answer to a conversation.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletionRequest {
    /// A base model's id or alias, or one of your fine-tuned models (`ft:…`, or a
    /// checkpoint's `ft:…:ckpt-step-N`).
    pub model: String,
    /// The conversation so far: OpenAI's message objects (`system`/`developer`, `user`,
    /// `assistant` with `tool_calls`, `tool`).
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<serde_json::Value>,
    /// Tokens to generate at most (deprecated by OpenAI in favour of
    /// `max_completion_tokens`; either is accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Tokens to generate at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    /// 0 to 2; 0 is greedy. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling, 0 (exclusive) to 1. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Answers to generate, 1 to 8. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// With the same seed and request, the same tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Up to 4 strings that end the answer (not included in it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopStrings>,
    /// Send the answer as server-sent events, chunk by chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// With `stream`: `include_usage` adds a last chunk with the token counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Return each answer token's log-probability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// With `logprobs`: the most likely alternatives per token, 0 to 20.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    /// Token id (as a string) → bias added to its logit, -100 to 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// -2 to 2: lowers the logit of every token already generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// -2 to 2: lowers a token's logit by this per time it was generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// Functions the model may call (`{"type": "function", "function": {...}}`). Where the
    /// answer is held to calls (`tool_choice` `required` or a named function, or tools
    /// beside a JSON `response_format`), a call names a declared function and, for a
    /// function with `strict: true`, its arguments follow its `parameters` schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// `none`, `auto`, `required`, or `{"type": "function", "function": {"name": …}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<serde_json::Value>,
    /// vLLM's extension (the `openai` SDK sends it in `extra_body`): variables handed to
    /// the model's chat template beside the messages, such as Qwen3's `enable_thinking:
    /// false`. At most 16; names of letters, digits and `_`, none of the names the
    /// template is rendered with (`messages`, `tools`, `add_generation_prompt`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// `false`: at most one call per answer, where the answer is held to calls (a
    /// required or named tool, or tools beside a JSON `response_format`); default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {...}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<serde_json::Value>,
    /// Accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
    /// Accepted and ignored (answers are never stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    /// Accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<String>,
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopStrings {
    /// One stop string.
    One(String),
    /// Up to four.
    Many(Vec<String>),
}

impl StopStrings {
    /// The strings, as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopStrings::One(s) => vec![s],
            StopStrings::Many(v) => v,
        }
    }
}

/// Streaming options.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Add a last chunk, with no choices, holding the request's `usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
}

/// Why an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model ended its turn, or a stop string appeared.
    Stop,
    /// The token limit or the model's context was reached.
    Length,
    /// The model called tools.
    ToolCalls,
}

/// A whole answer (`stream` off).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletion {
    /// `chatcmpl-…`.
    pub id: String,
    /// Always `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The model as the request named it.
    pub model: String,
    /// One per `n`.
    pub choices: Vec<ChatChoice>,
    /// Tokens read and written.
    pub usage: Usage,
    /// The engine's build, for telling answers of different builds apart.
    pub system_fingerprint: String,
}

/// One answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChoice {
    /// Its place among the choices.
    pub index: u32,
    /// The assistant's message.
    pub message: AssistantMessage,
    /// Per token, when `logprobs` was asked for.
    pub logprobs: Option<ChoiceLogprobs>,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

/// The assistant's message in an answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: String,
    /// The text; null when the answer is only tool calls.
    pub content: Option<String>,
    /// Always null (no refusals are generated apart from the text).
    pub refusal: Option<String>,
    /// The tools the model called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
    /// The reasoning the answer opened with, apart from `content`, for a model whose chat
    /// template writes `<think>…</think>` blocks (Qwen3, QwQ, DeepSeek-R1; the field
    /// DeepSeek's API and vLLM use); absent for other models or an empty block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// A call the model made.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ToolCallOut {
    /// `call_…`, for the `tool` message that answers it.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCallOut,
}

/// The function a call names.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallOut {
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON object written as a string.
    pub arguments: String,
}

/// Log-probabilities of an answer's tokens.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChoiceLogprobs {
    /// One per token.
    pub content: Vec<TokenLogprobOut>,
    /// Always null.
    pub refusal: Option<Vec<TokenLogprobOut>>,
}

/// A token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenLogprobOut {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its position.
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative token.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// Tokens a request read and wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    /// Tokens of the rendered prompt.
    pub prompt_tokens: u64,
    /// Tokens generated, over every choice.
    pub completion_tokens: u64,
    /// The sum.
    pub total_tokens: u64,
}

/// One server-sent chunk of a streamed answer (`data: {…}`; the stream ends with
/// `data: [DONE]`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionChunk {
    /// The same for every chunk of a request.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The model as the request named it.
    pub model: String,
    /// The engine's build.
    pub system_fingerprint: String,
    /// What changed, per choice (empty in the usage chunk).
    pub choices: Vec<ChunkChoice>,
    /// Only in the last chunk, with `stream_options.include_usage`.
    pub usage: Option<Usage>,
}

/// What one chunk adds to one choice.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChunkChoice {
    /// Which choice.
    pub index: u32,
    /// The new part of the message.
    pub delta: ChunkDelta,
    /// The new tokens' log-probabilities, when asked for.
    pub logprobs: Option<ChoiceLogprobs>,
    /// Set in the choice's last chunk.
    pub finish_reason: Option<FinishReason>,
}

/// The new part of an assistant message.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ChunkDelta {
    /// `assistant`, in a choice's first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// More text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// More reasoning (see `AssistantMessage.reasoning_content`), before any content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls (each whole, in the choice's last chunks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ChunkToolCall>>,
}

/// A tool call in a chunk.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChunkToolCall {
    /// Its place among the choice's calls.
    pub index: u32,
    /// `call_…`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCallOut,
}
