//! Chat templates: turning a conversation into the exact text a model was trained on.
//!
//! A model's own template is the Jinja `chat_template` from its `tokenizer_config.json` (or a
//! `chat_template.jinja` file next to it), rendered with minijinja configured the way Hugging
//! Face renders it (`trim_blocks`, `lstrip_blocks`, a `raise_exception` function and Python
//! string methods such as `.strip()`, a `tojson` that writes JSON as Python's
//! `json.dumps` does, and `strftime_now` for the templates that write today's date, UTC). The built-ins below are written for tuneq; none of them renders
//! tools, so records with tools reach them through [`crate::tools::without_tools`].

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, Value, context};
use serde_json::Value as Json;
use tuneq_openapi::ChatTemplateChoice;

use super::chat::{Message, Role, ToolCall};
use super::{DataError, Result};

/// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message. `tuneq model init` writes
/// it into the `tokenizer_config.json` of random models, whose tokenizer has `<|im_start|>` and
/// `<|im_end|>` as special tokens.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Llama 2 chat: `{bos}[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} {eos}`,
/// the system block only inside the first instruction. The generation prompt is empty: the
/// answer follows `[/INST]` directly.
pub const LLAMA2_TEMPLATE: &str = "{% if messages and messages[0]['role'] == 'system' %}{% set system_text = messages[0]['content'] %}{% set turns = messages[1:] %}{% else %}{% set system_text = '' %}{% set turns = messages %}{% endif %}{% for message in turns %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' }}{% if loop.first and system_text %}{{ '<<SYS>>\\n' + system_text + '\\n<</SYS>>\\n\\n' }}{% endif %}{{ message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}{% else %}{{ raise_exception('the llama2 template supports system, user and assistant roles, not ' + message['role']) }}{% endif %}{% endfor %}";

/// Alpaca style: an optional system text, then `### Instruction:\n{user}\n\n` and
/// `### Response:\n{assistant}{eos}\n\n` blocks. Alpaca records put their input into the user
/// message as `\n\n### Input:\n{input}` when this template is used.
pub const ALPACA_TEMPLATE: &str = "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat";

/// Variables a request hands the chat template beside its messages (vLLM's
/// `chat_template_kwargs`: Qwen3's `enable_thinking`, …).
pub type TemplateVariables = serde_json::Map<String, Json>;

/// What a template renders beside the messages.
struct Beside<'a> {
    /// The tools the conversation may call.
    tools: &'a [Json],
    /// End where the model's answer begins.
    add_generation_prompt: bool,
    /// A request's own variables.
    variables: &'a TemplateVariables,
}

/// The names a template is rendered with, which a request's [`TemplateVariables`] may
/// not take.
pub const RENDERING_NAMES: [&str; 7] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
];

/// The name of the template a model may give for conversations with tools (the
/// `tool_use` entry of a `chat_template` list), which transformers takes when tools are
/// passed.
const TOOL_USE_NAME: &str = "tool_use";

/// A compiled chat template with the special-token strings it refers to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    kind: TemplateKind,
    /// Messages rendered so far (a render of n messages counts n): the work encoding a
    /// chat costs, which tests bound (O(messages) per record, never O(messages²)).
    rendered_messages: AtomicU64,
    /// What the template needs tool calls to be given as (Mistral's take only 9-character
    /// ids, Qwen3's first templates only string content): learned once, by probing.
    call_shape: std::sync::OnceLock<CallShape>,
    /// Whether the template renders tools and tool calls itself (it reads `tool_calls`),
    /// as the Llama 3.1+, Qwen2.5, Mistral and Hermes templates do.
    handles_tools: bool,
    /// The model's `tool_use` template, when its `chat_template` is a list with one.
    tool_use_source: Option<String>,
}

/// How the rendering of a conversation grows message by message, where that is known by
/// reading the template: the three built-ins (also when a model's own `chat_template` is
/// one of them word for word, as `tuneq model init` writes ChatML). It lets the encoder
/// render a conversation once, a message at a time, instead of once per assistant turn.
/// The encoder's tests check it against rendering every prefix, on random conversations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Growth {
    /// ChatML and Alpaca: each message's text depends on that message only, so rendering
    /// `m[..=i]` is rendering `m[..i]` followed by rendering `[m[i]]`; with the generation
    /// prompt, rendering `m[..i]` is followed by rendering `[]` with it.
    PerMessage,
    /// Llama 2: the system text goes inside the first turn, and there is no generation
    /// prompt. From the message after the first turn on, rendering `m[..=i]` is rendering
    /// `m[..i]` followed by what `m[i]` adds after one placeholder user turn.
    AfterFirstTurn,
}

impl Growth {
    /// How many leading messages are rendered as they are, before the growth rule holds.
    pub(crate) fn head(self, messages: &[Message]) -> usize {
        let head = match self {
            Growth::PerMessage => 0,
            Growth::AfterFirstTurn => {
                usize::from(messages.first().is_some_and(|m| m.role == Role::System)) + 1
            }
        };
        head.min(messages.len())
    }

    /// The messages a message after the head is rendered behind to get its text.
    pub(crate) fn context(self) -> Vec<Message> {
        match self {
            Growth::PerMessage => Vec::new(),
            Growth::AfterFirstTurn => vec![Message::new(Role::User, "x")],
        }
    }
}

/// Where a template came from; the encoder adapts Alpaca records to the Alpaca built-in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TemplateKind {
    /// The model's own `chat_template`.
    Model,
    /// A built-in; never `ChatTemplateChoice::Model`.
    Builtin(ChatTemplateChoice),
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("kind", &self.kind)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Loads the template for `choice` from a model folder.
    ///
    /// `bos_token`/`eos_token` always come from `tokenizer_config.json` (a string or an
    /// `{"content": …}` object; empty when absent or when the file is missing). With
    /// `ChatTemplateChoice::Model` the model's `chat_template` is used (a string, or a list of
    /// `{name, template}` from which `default` is taken), then `chat_template.jinja`, and
    /// ChatML when the model has none.
    pub fn load(model_dir: &Path, choice: ChatTemplateChoice) -> Result<Self> {
        let config_path = model_dir.join("tokenizer_config.json");
        let config: Json = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                DataError::Template(format!("{} is not valid JSON: {e}", config_path.display()))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(source) => {
                return Err(DataError::Io {
                    path: config_path.display().to_string(),
                    source,
                });
            }
        };
        let bos = token_string(config.get("bos_token"));
        let eos = token_string(config.get("eos_token"));
        if choice != ChatTemplateChoice::Model {
            return Self::builtin(choice, &bos, &eos);
        }
        let own = match model_template(config.get("chat_template"))? {
            Some(t) => Some(t),
            None => {
                let jinja = model_dir.join("chat_template.jinja");
                match std::fs::read_to_string(&jinja) {
                    Ok(t) => Some((t, None)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(source) => {
                        return Err(DataError::Io {
                            path: jinja.display().to_string(),
                            source,
                        });
                    }
                }
            }
        };
        match own {
            Some((source, tool_use)) => {
                let template = Self::from_source(source, &bos, &eos, TemplateKind::Model)?;
                match tool_use {
                    Some(tool_use) => template.with_tool_use(tool_use),
                    None => Ok(template),
                }
            }
            None => {
                tracing::info!(model_dir = %model_dir.display(), "model has no chat_template; using ChatML");
                Self::builtin(ChatTemplateChoice::Chatml, &bos, &eos)
            }
        }
    }

    /// A built-in template. `ChatTemplateChoice::Model` means ChatML here (the fallback for
    /// models without a template).
    pub fn builtin(choice: ChatTemplateChoice, bos_token: &str, eos_token: &str) -> Result<Self> {
        let (source, choice) = match choice {
            ChatTemplateChoice::Model | ChatTemplateChoice::Chatml => {
                (CHATML_TEMPLATE, ChatTemplateChoice::Chatml)
            }
            ChatTemplateChoice::Llama2 => (LLAMA2_TEMPLATE, choice),
            ChatTemplateChoice::Alpaca => (ALPACA_TEMPLATE, choice),
        };
        Self::from_source(
            source.to_string(),
            bos_token,
            eos_token,
            TemplateKind::Builtin(choice),
        )
    }

    /// Compiles an arbitrary Jinja chat template (as found in `tokenizer_config.json`).
    pub fn from_jinja(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        Self::from_source(
            source.to_string(),
            bos_token,
            eos_token,
            TemplateKind::Model,
        )
    }

    fn from_source(source: String, bos: &str, eos: &str, kind: TemplateKind) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| DataError::Template(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function(
            "strftime_now",
            |format: String| -> Result<Value, minijinja::Error> {
                crate::strftime::format_now(&format)
                    .map(Value::from)
                    .map_err(|why| {
                        minijinja::Error::new(
                            ErrorKind::InvalidOperation,
                            format!("strftime_now: {why}"),
                        )
                    })
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| DataError::Template(describe(&e)))?;
        Ok(Self {
            env,
            handles_tools: source.contains("tool_calls"),
            tool_use_source: None,
            source,
            bos_token: bos.to_string(),
            eos_token: eos.to_string(),
            kind,
            rendered_messages: AtomicU64::new(0),
            call_shape: std::sync::OnceLock::new(),
        })
    }

    /// Adds the model's `tool_use` template, rendered instead of the default one when a
    /// conversation has tools (as transformers does).
    fn with_tool_use(mut self, source: String) -> Result<Self> {
        self.env
            .add_template_owned(TOOL_USE_NAME, source.clone())
            .map_err(|e| DataError::Template(describe(&e)))?;
        self.tool_use_source = Some(source);
        Ok(self)
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the model's
    /// answer should begin (e.g. after `<|im_start|>assistant\n`).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the tools the conversation may call, passed to the
    /// template as `tools` (none when empty), as transformers'
    /// `apply_chat_template(messages, tools=…)` does.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[Json],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_with_variables(
            messages,
            tools,
            add_generation_prompt,
            &TemplateVariables::new(),
        )
    }

    /// [`ChatTemplate::render_with_tools`] with `variables` beside the messages, as
    /// transformers' `apply_chat_template(…, **kwargs)` hands them on (the rendering's
    /// own names, [`RENDERING_NAMES`], keep their values).
    pub fn render_with_variables(
        &self,
        messages: &[Message],
        tools: &[Json],
        add_generation_prompt: bool,
        variables: &TemplateVariables,
    ) -> Result<String> {
        self.rendered_messages
            .fetch_add(messages.len() as u64 + 1, Ordering::Relaxed);
        let adapted;
        let shape = self.call_shape();
        let messages = match shape.adapts(messages) {
            true => {
                adapted = messages.iter().map(|m| shape.adapt(m)).collect::<Vec<_>>();
                &adapted[..]
            }
            false => messages,
        };
        let beside = Beside {
            tools,
            add_generation_prompt,
            variables,
        };
        self.render_as_given(messages, &beside)
    }

    /// [`ChatTemplate::render_with_variables`] with the messages exactly as given.
    fn render_as_given(&self, messages: &[Message], beside: &Beside<'_>) -> Result<String> {
        let messages: Vec<Value> = messages.iter().map(|m| Value::from(Serde(m))).collect();
        let tools = (!beside.tools.is_empty()).then(|| Value::from(Serde(beside.tools)));
        let template = self
            .env
            .get_template(match (&self.tool_use_source, tools.is_some()) {
                (Some(_), true) => TOOL_USE_NAME,
                _ => TEMPLATE_NAME,
            })
            .map_err(|e| DataError::Template(describe(&e)))?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => beside.add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
                ..Value::from(Serde(beside.variables))
            })
            .map_err(|e| DataError::Template(describe(&e)))
    }

    /// Whether the template refuses a tool call whose id is not 9 letters or digits and
    /// takes one that is (Mistral's: their tokenizer writes ids so). OpenAI's ids
    /// (`call_` and 24 more) then reach it shortened ([`short_call_id`]), in training
    /// data and in the conversations sent to a fine-tuned model alike.
    pub fn wants_short_call_ids(&self) -> bool {
        self.call_shape().short_ids
    }

    /// How tool calls must be given to the template: as OpenAI writes them where it takes
    /// them so, else the first of the other shapes it takes (found by rendering a call in
    /// each, once; a template that takes none gets them as given, and says why).
    fn call_shape(&self) -> CallShape {
        *self.call_shape.get_or_init(|| {
            if !self.handles_tools {
                return CallShape::AS_GIVEN;
            }
            let takes = |shape: &CallShape| {
                let id = match shape.short_ids {
                    true => "a1b2c3d4e",
                    false => "call_0123456789abcdef01234567",
                };
                let call = ToolCall::function(id, "f", serde_json::json!({}));
                let messages = [
                    Message::new(Role::User, "?"),
                    Message {
                        content: shape.empty_content.then(String::new),
                        tool_calls: vec![call],
                        ..Message::new(Role::Assistant, "")
                    },
                    Message {
                        tool_call_id: Some(id.into()),
                        ..Message::new(Role::Tool, "{}")
                    },
                ];
                let tools = [serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}})];
                let beside = Beside {
                    tools: &tools,
                    add_generation_prompt: true,
                    variables: &TemplateVariables::new(),
                };
                self.render_as_given(&messages, &beside).is_ok()
            };
            CallShape::ALL
                .into_iter()
                .find(takes)
                .unwrap_or(CallShape::AS_GIVEN)
        })
    }

    /// Whether the template writes reasoning blocks ([`crate::REASONING_BLOCK`]), so
    /// that its model's answers open with one.
    pub fn writes_reasoning(&self) -> bool {
        let (open, close) = crate::REASONING_BLOCK;
        let writes = |source: &str| source.contains(open) && source.contains(close);
        writes(&self.source) || self.tool_use_source.as_deref().is_some_and(writes)
    }

    /// The beginning-of-sequence token text the template uses (may be empty).
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The end-of-sequence token text the template uses (may be empty).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// The Jinja source, for manifests and debugging.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub(crate) fn kind(&self) -> TemplateKind {
        self.kind
    }

    /// The work this template has done so far: every render counts the messages it
    /// rendered, plus one. Encoding a chat of n messages costs O(n) of it.
    pub fn rendered_messages(&self) -> u64 {
        self.rendered_messages.load(Ordering::Relaxed)
    }

    /// Whether the template renders tools and tool calls itself (for a conversation
    /// without tools: the default template; with: the `tool_use` one when there is one).
    pub fn handles_tools(&self, tools: &[Json]) -> bool {
        match &self.tool_use_source {
            Some(_) if !tools.is_empty() => true,
            _ => self.handles_tools,
        }
    }

    /// Whether this is the model's own template (not a built-in, nor the ChatML a model
    /// without one falls back to).
    pub fn is_models_own(&self) -> bool {
        matches!(self.kind, TemplateKind::Model)
    }

    /// The model's `tool_use` template, when it has one.
    pub fn tool_use_source(&self) -> Option<&str> {
        self.tool_use_source.as_deref()
    }

    /// How rendering grows message by message, when this is a built-in template's text.
    pub(crate) fn growth(&self) -> Option<Growth> {
        match self.source.as_str() {
            CHATML_TEMPLATE | ALPACA_TEMPLATE => Some(Growth::PerMessage),
            LLAMA2_TEMPLATE => Some(Growth::AfterFirstTurn),
            _ => None,
        }
    }
}

/// transformers' `tojson`: `json.dumps(value, ensure_ascii=False, indent=…,
/// sort_keys=…)`, not minijinja's HTML-safe compact JSON, so that tool schemas and
/// arguments render byte for byte as they do in Python.
fn tojson(
    value: &Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(crate::pyjson::dumps(
        &json,
        indent,
        sort_keys.unwrap_or(false),
    )))
}

/// A minijinja error with its detail and causes on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// A special token in `tokenizer_config.json`: a string, an `{"content": …}` object, or absent.
fn token_string(v: Option<&Json>) -> String {
    match v {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Object(o)) => o
            .get("content")
            .and_then(Json::as_str)
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    }
}

/// The `chat_template` entry: a string, or a list of `{name, template}` (take `default`,
/// and `tool_use` beside it when there is one).
fn model_template(v: Option<&Json>) -> Result<Option<(String, Option<String>)>> {
    match v {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some((s.clone(), None))),
        Some(Json::Array(list)) => {
            let named = |name: &str| {
                list.iter().find_map(|t| {
                    (t.get("name").and_then(Json::as_str) == Some(name))
                        .then(|| t.get("template").and_then(Json::as_str))
                        .flatten()
                })
            };
            match named("default") {
                Some(t) => Ok(Some((
                    t.to_string(),
                    named(TOOL_USE_NAME).map(str::to_string),
                ))),
                None => Err(DataError::Template(
                    "chat_template is a list without a \"default\" entry".into(),
                )),
            }
        }
        Some(other) => Err(DataError::Template(format!(
            "chat_template must be a string or a list of {{name, template}}, got {}",
            super::problems::kind(other)
        ))),
    }
}

/// Whether any call id of `messages` is not 9 letters or digits.
fn has_long_call_ids(messages: &[Message]) -> bool {
    messages.iter().any(|m| {
        let calls = m.tool_calls.iter().map(|c| c.id.as_str());
        calls
            .chain(m.tool_call_id.as_deref())
            .any(|id| short_call_id(id) != id)
    })
}

/// How a template needs tool calls given ([`ChatTemplate::call_shape`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CallShape {
    /// Ids as 9 letters or digits ([`short_call_id`]), as Mistral's templates take them.
    short_ids: bool,
    /// `""` for the content of a turn that only calls tools, where OpenAI writes null:
    /// Qwen3's first templates test `'</think>' in message.content`, which null fails.
    empty_content: bool,
}

impl CallShape {
    const AS_GIVEN: Self = Self {
        short_ids: false,
        empty_content: false,
    };

    /// The shapes to try, OpenAI's own first.
    const ALL: [Self; 4] = [
        Self::AS_GIVEN,
        Self {
            short_ids: true,
            empty_content: false,
        },
        Self {
            short_ids: false,
            empty_content: true,
        },
        Self {
            short_ids: true,
            empty_content: true,
        },
    ];

    /// Whether any of `messages` is given otherwise in this shape.
    fn adapts(&self, messages: &[Message]) -> bool {
        (self.short_ids && has_long_call_ids(messages))
            || (self.empty_content && messages.iter().any(|m| m.content.is_none()))
    }

    /// `message` in this shape.
    fn adapt(&self, message: &Message) -> Message {
        let mut message = message.clone();
        if self.short_ids {
            for call in &mut message.tool_calls {
                call.id = short_call_id(&call.id);
            }
            if let Some(id) = &mut message.tool_call_id {
                *id = short_call_id(id);
            }
        }
        if self.empty_content && message.content.is_none() {
            message.content = Some(String::new());
        }
        message
    }
}

/// A call id as 9 letters or digits: its last 9 letters and digits (as vLLM shortens
/// OpenAI's ids for Mistral's templates), zero-padded in front where it has fewer. A call
/// and the tool message answering it shorten alike.
fn short_call_id(id: &str) -> String {
    let kept: Vec<char> = id.chars().filter(char::is_ascii_alphanumeric).collect();
    let last: String = kept[kept.len().saturating_sub(9)..].iter().collect();
    format!("{last:0>9}")
}
