//! Records → token ids and labels.
//!
//! Loss masks are computed on the *rendered text*, not on token ids: the answer spans are
//! byte ranges of the rendered string (by definition, what lies between the conversation
//! prefix rendered with the generation prompt and the conversation rendered through the
//! answer), then the full string is tokenized once with offsets and every token
//! overlapping an answer span is labelled. That tokenizes exactly like inference does, and
//! works with any tokenizer and template.
//!
//! Rendering two prefixes per assistant turn costs O(messages²); for the built-in
//! templates, whose text grows a message at a time ([`Growth`]), the spans are found with
//! one render per message instead, O(messages), and the same result (the tests compare
//! both ways on random conversations). Other templates render prefixes, which the cap on
//! messages per record ([`crate::MAX_MESSAGES`]) bounds.

use std::ops::Range;
use std::path::Path;

use tokenizers::Tokenizer;
use tuneq_openapi::ChatTemplateChoice;

use super::answer::{TurnRenderings, answer_span};
use super::chat::{Message, Role};
use super::record::Record;
use super::template::{ChatTemplate, Growth, TemplateKind};
use super::{DataError, Result};

#[cfg(test)]
#[path = "encoder_tests.rs"]
mod tests;

/// Label of a position that takes no loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// End-of-turn tokens that also stop generation when present in the vocabulary.
const END_OF_TURN_TOKENS: [&str; 5] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
];

/// A tokenized training example.
///
/// `labels[i]` is the target for the token at position `i` itself (not shifted; the loss
/// shifts) or [`IGNORE_INDEX`] where no loss is taken. Same length as `input_ids`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// Targets, or [`IGNORE_INDEX`].
    pub labels: Vec<i64>,
}

impl Example {
    /// Number of positions that carry a loss.
    pub fn trained_tokens(&self) -> usize {
        self.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()
    }
}

/// A conversation as the template renders it: its messages, and the tools passed to the
/// template (none when the template does not render tools: the messages then carry
/// them in their text, see [`crate::tools::without_tools`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    /// The messages.
    pub messages: Vec<Message>,
    /// The tools, each `{"type": "function", "function": {...}}`.
    pub tools: Vec<serde_json::Value>,
}

impl Conversation {
    pub(crate) fn render(
        &self,
        template: &ChatTemplate,
        add_generation_prompt: bool,
    ) -> Result<String> {
        template.render_with_tools(&self.messages, &self.tools, add_generation_prompt)
    }
}

/// Turns records into [`Example`]s with a tokenizer and a chat template.
pub struct Encoder {
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("vocab_size", &self.tokenizer.get_vocab_size(true))
            .field("template", &self.template)
            .finish()
    }
}

impl Encoder {
    /// An encoder from a loaded tokenizer and template.
    pub fn new(tokenizer: Tokenizer, template: ChatTemplate) -> Self {
        Self {
            tokenizer,
            template,
        }
    }

    /// Loads `tokenizer.json` and the chat template (see [`ChatTemplate::load`]) of a model.
    pub fn from_model_dir(model_dir: &Path, choice: ChatTemplateChoice) -> Result<Self> {
        let path = model_dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&path)
            .map_err(|e| DataError::Tokenizer(format!("cannot load {}: {e}", path.display())))?;
        let template = ChatTemplate::load(model_dir, choice)?;
        Ok(Self::new(tokenizer, template))
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Encodes one record, keeping at most `max_seq_len` tokens.
    ///
    /// Loss is taken on: the assistant turns of a chat (content and the end-of-turn marker the
    /// template emits, every assistant turn); the output of an alpaca record (rendered as a
    /// user/assistant chat); the completion and eos of `bos + prompt + completion + eos`; every
    /// token but the first of `bos + text + eos`. An example may end up with no labelled token
    /// after truncation; callers decide what to do with those.
    pub fn encode(&self, record: &Record, max_seq_len: usize) -> Result<Example> {
        self.encode_with_length(record, max_seq_len)
            .map(|(example, _)| example)
    }

    /// Like [`Encoder::encode`], also returning the length before truncation (so callers
    /// can count truncated examples).
    pub fn encode_with_length(
        &self,
        record: &Record,
        max_seq_len: usize,
    ) -> Result<(Example, usize)> {
        let Rendered { text, loss } = self.render_with_spans(record)?;
        let encoding = self
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| DataError::Tokenizer(e.to_string()))?;
        let ids = encoding.get_ids();
        let full_len = ids.len();
        let keep = full_len.min(max_seq_len);
        Ok((label(ids, encoding.get_offsets(), keep, &loss), full_len))
    }

    /// Measures a record for statistics: its first `max_seq_len` tokens and labels, as
    /// [`Encoder::encode`] gives them, and its length, exact or a lower bound.
    ///
    /// Unlike [`Encoder::encode`] it never tokenizes more of the text than the first
    /// `max_seq_len` tokens need: a window of the text, doubled until it holds
    /// [`MEASURE_MARGIN`] tokens more than that (or all of the text). Tokenizing costs
    /// a few hundred bytes of memory per byte of text, so the memory this takes is
    /// bounded by `max_seq_len` (and the vocabulary's longest token), not by the
    /// record's size. Tokens other than the last few of a window do not depend on where
    /// the window ends (pre-tokenizers split text into words that no merge crosses), so
    /// the tokens kept are the record's own. For a template of unknown growth, the
    /// answer spans are located only up to the end of the tokens kept.
    pub fn measure(&self, record: &Record, max_seq_len: usize) -> Result<Measured> {
        let (text, loss) = match record {
            Record::Chat { .. } | Record::Alpaca { .. } | Record::Preference { .. } => {
                let conversation = self.conversation(record);
                if self.growth(&conversation).is_none() {
                    let text = conversation.render(&self.template, false)?;
                    (text, Err(conversation))
                } else {
                    let (text, spans) = self.chat_spans(&conversation)?;
                    (text, Ok(LossOn::Spans(spans)))
                }
            }
            Record::PromptCompletion { .. } | Record::Text { .. } => {
                let Rendered { text, loss } = self.render_with_spans(record)?;
                (text, Ok(loss))
            }
        };
        let window = self.window(&text, max_seq_len)?;
        let keep = window.ids.len().min(max_seq_len);
        let cut = window.offsets[..keep]
            .iter()
            .map(|&(_, end)| end)
            .max()
            .unwrap_or(0);
        let loss = match loss {
            Ok(loss) => loss,
            Err(conversation) => {
                LossOn::Spans(self.spans_by_prefixes(&conversation, &text, cut)?)
            }
        };
        Ok(Measured {
            example: label(&window.ids, &window.offsets, keep, &loss),
            length: window.length,
        })
    }

    /// The first tokens of `text`: at least `max_seq_len` + [`MEASURE_MARGIN`] of
    /// them, or all of them when the text has fewer.
    fn window(&self, text: &str, max_seq_len: usize) -> Result<Window> {
        let need = max_seq_len.saturating_add(MEASURE_MARGIN);
        let mut size = need.saturating_mul(16).max(4096);
        loop {
            let whole = size >= text.len();
            let mut cut = size.min(text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            let encoding = self
                .tokenizer
                .encode(&text[..cut], false)
                .map_err(|e| DataError::Tokenizer(e.to_string()))?;
            let found = encoding.get_ids().len();
            if whole || found > need {
                let keep = if whole { found } else { max_seq_len };
                return Ok(Window {
                    ids: encoding.get_ids()[..keep].to_vec(),
                    offsets: encoding.get_offsets()[..keep].to_vec(),
                    length: if whole {
                        Length::Exact(found)
                    } else {
                        Length::AtLeast(found - MEASURE_MARGIN)
                    },
                });
            }
            size = size.saturating_mul(2);
        }
    }

    /// Encodes every record; returns the examples and how many were truncated.
    pub fn encode_all(
        &self,
        records: &[Record],
        max_seq_len: usize,
    ) -> Result<(Vec<Example>, usize)> {
        let mut examples = Vec::with_capacity(records.len());
        let mut truncated = 0;
        for record in records {
            let (example, full_len) = self.encode_with_length(record, max_seq_len)?;
            truncated += usize::from(full_len > example.input_ids.len());
            examples.push(example);
        }
        Ok((examples, truncated))
    }

    /// The prompt for sample generation and the reference answer.
    ///
    /// Chat and alpaca: everything before the *last* assistant turn, rendered with the
    /// generation prompt; the reference is that turn's content. Prompt/completion: `bos +
    /// prompt`, reference the completion. Text: `bos` + the first half of the text (split at
    /// a character boundary), reference the rest. Returns `(prompt ids, prompt text,
    /// reference)`.
    pub fn prompt_for_sampling(&self, record: &Record) -> Result<(Vec<u32>, String, String)> {
        let bos = self.template.bos_token();
        let (prompt, reference) = match record {
            Record::PromptCompletion { prompt, completion } => {
                (format!("{bos}{prompt}"), completion.clone())
            }
            Record::Text { text } => {
                let half = text.chars().count() / 2;
                let cut = text.char_indices().nth(half).map_or(text.len(), |(i, _)| i);
                (format!("{bos}{}", &text[..cut]), text[cut..].to_string())
            }
            Record::Chat { .. } | Record::Alpaca { .. } | Record::Preference { .. } => {
                let Conversation { messages, tools } = self.conversation(record);
                let last = messages
                    .iter()
                    .rposition(|m| m.role == Role::Assistant)
                    .ok_or_else(|| {
                        DataError::Template("conversation has no assistant message".into())
                    })?;
                let prompt = self
                    .template
                    .render_with_tools(&messages[..last], &tools, true)?;
                (prompt, messages[last].text().to_string())
            }
        };
        let ids = self
            .tokenizer
            .encode(prompt.as_str(), false)
            .map_err(|e| DataError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec();
        Ok((ids, prompt, reference))
    }

    /// Id of the template's eos token, when the tokenizer knows it.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.token_id(self.template.eos_token())
    }

    /// Id of the template's bos token, when the tokenizer knows it.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.token_id(self.template.bos_token())
    }

    /// Ids that end a generated answer: eos plus end-of-turn tokens the vocabulary has
    /// (`<|im_end|>`, `<|eot_id|>`, …), sorted and deduplicated. Sampling stops at any.
    pub fn stop_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = END_OF_TURN_TOKENS
            .iter()
            .filter_map(|t| self.tokenizer.token_to_id(t))
            .chain(self.eos_token_id())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Decodes ids to text, leaving out special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| DataError::Tokenizer(e.to_string()))
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        if token.is_empty() {
            None
        } else {
            self.tokenizer.token_to_id(token)
        }
    }

    /// The full text a record is trained on, as [`Encoder::encode`] tokenises it: the
    /// chat template applied to a chat or alpaca record, `bos + prompt + completion + eos`,
    /// or `bos + text + eos`.
    pub fn render(&self, record: &Record) -> Result<String> {
        Ok(self.render_with_spans(record)?.text)
    }

    /// The conversation a chat, alpaca or preference record stands for (a preference
    /// pair: its prompt and the preferred answer), as this template renders it (empty
    /// for other records): with its tools, or, for a template that does not render
    /// tools, with tools, calls and results written into plain messages.
    pub fn conversation(&self, record: &Record) -> Conversation {
        let messages = match record {
            Record::Chat { messages, tools } => return self.with_tools(messages.clone(), tools),
            Record::Preference {
                messages,
                tools,
                preferred,
                ..
            } => {
                let mut chosen = messages.clone();
                chosen.push(Message::clone(preferred));
                return self.with_tools(chosen, tools);
            }
            Record::Alpaca {
                instruction,
                input,
                output,
            } => {
                let alpaca_builtin =
                    self.template.kind() == TemplateKind::Builtin(ChatTemplateChoice::Alpaca);
                let user = match (input.is_empty(), alpaca_builtin) {
                    (true, _) => instruction.clone(),
                    (false, true) => format!("{instruction}\n\n### Input:\n{input}"),
                    (false, false) => format!("{instruction}\n\n{input}"),
                };
                vec![
                    Message::new(Role::User, user),
                    Message::new(Role::Assistant, output.clone()),
                ]
            }
            Record::PromptCompletion { .. } | Record::Text { .. } => Vec::new(),
        };
        Conversation {
            messages,
            tools: Vec::new(),
        }
    }

    /// `messages` and `tools` as this template renders them: as they are, or with the
    /// tools written into plain messages for a template that does not render tools.
    pub(crate) fn with_tools(
        &self,
        messages: Vec<Message>,
        tools: &[serde_json::Value],
    ) -> Conversation {
        if !crate::tools::uses_tools(&messages, tools) || self.template.handles_tools(tools) {
            return Conversation {
                messages,
                tools: tools.to_vec(),
            };
        }
        Conversation {
            messages: crate::tools::without_tools(&messages, tools),
            tools: Vec::new(),
        }
    }

    /// The text of `messages` (with the `tools` they may call) up to where the model's
    /// answer begins: what a request for an answer is generated from. Tools are
    /// rendered as training rendered them (by the template, or written into the
    /// messages for a template without tools), so a fine-tuned model sees the shape it
    /// learned. `variables` are handed to the template beside them.
    pub fn generation_prompt(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        variables: &crate::TemplateVariables,
    ) -> Result<String> {
        let Conversation { messages, tools } = self.with_tools(messages.to_vec(), tools);
        self.template
            .render_with_variables(&messages, &tools, true, variables)
    }

    /// How the template's text grows for this conversation, when it is known: a built-in
    /// template and plain messages.
    fn growth(&self, conversation: &Conversation) -> Option<Growth> {
        let plain =
            conversation.tools.is_empty() && conversation.messages.iter().all(Message::is_plain);
        self.template.growth().filter(|_| plain)
    }

    /// The full text of a record and where it takes loss.
    fn render_with_spans(&self, record: &Record) -> Result<Rendered> {
        let bos = self.template.bos_token();
        let eos = self.template.eos_token();
        match record {
            Record::PromptCompletion { prompt, completion } => {
                let start = bos.len() + prompt.len();
                let text = format!("{bos}{prompt}{completion}{eos}");
                let answer = Range {
                    start,
                    end: text.len(),
                };
                Ok(Rendered {
                    text,
                    loss: LossOn::Spans(vec![answer]),
                })
            }
            Record::Text { text } => Ok(Rendered {
                text: format!("{bos}{text}{eos}"),
                loss: LossOn::AllButFirst,
            }),
            Record::Chat { .. } | Record::Alpaca { .. } | Record::Preference { .. } => {
                let conversation = self.conversation(record);
                let (text, spans) = self.chat_spans(&conversation)?;
                Ok(Rendered {
                    text,
                    loss: LossOn::Spans(spans),
                })
            }
        }
    }

    /// A conversation's text and its answer spans, by the fastest exact way: a message at
    /// a time where the template's growth is known (O(messages) renders), else by
    /// rendering every prefix ([`Encoder::spans_by_prefixes`], O(messages²) work).
    pub(crate) fn chat_spans(
        &self,
        conversation: &Conversation,
    ) -> Result<(String, Vec<Range<usize>>)> {
        // Only a conversation the template refuses (a render error) falls through from
        // the fast way: the reference way below reports it as before.
        if let Some(growth) = self.growth(conversation)
            && let Some(found) = self.spans_by_growth(&conversation.messages, growth)
        {
            return Ok(found);
        }
        let full = conversation.render(&self.template, false)?;
        let spans = self.spans_by_prefixes(conversation, &full, usize::MAX)?;
        Ok((full, spans))
    }

    /// The answer spans by definition: for every assistant turn `i`, the conversation
    /// rendered up to it with the generation prompt (`before`) and through it
    /// (`through`); the answer is what lies between, trailing whitespace trimmed. Both
    /// renderings must be prefixes of `full`, the whole conversation's text. Two renders
    /// of a prefix per turn: quadratic in the conversation's length, so it stops at the
    /// first turn whose `before` reaches `stop` (bytes of `full`; `usize::MAX`: none).
    pub(crate) fn spans_by_prefixes(
        &self,
        conversation: &Conversation,
        full: &str,
        stop: usize,
    ) -> Result<Vec<Range<usize>>> {
        let Conversation { messages, tools } = conversation;
        let closing = self
            .template
            .render_with_tools(&[], tools, false)
            .unwrap_or_default();
        let mut spans = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            if !message.is_trained() {
                continue;
            }
            let before = self
                .template
                .render_with_tools(&messages[..i], tools, true)?;
            if before.len() >= stop && full.starts_with(&before) {
                break;
            }
            let through = self
                .template
                .render_with_tools(&messages[..=i], tools, false)?;
            let turn = TurnRenderings {
                full,
                before: &before,
                through: &through,
                closing: &closing,
            };
            if let Some(span) = answer_span(&turn, i)? {
                spans.push(span);
            }
        }
        Ok(spans)
    }

    /// The text and answer spans rendered a message at a time ([`Growth`]): one render
    /// per message plus one of the whole conversation, which must equal the text built
    /// up (a check that costs one render). None when a render fails or the texts differ;
    /// the caller then takes the reference way, which says why.
    pub(crate) fn spans_by_growth(
        &self,
        messages: &[Message],
        growth: Growth,
    ) -> Option<(String, Vec<Range<usize>>)> {
        let template = &self.template;
        let context = growth.context();
        let plain = template.render(&context, false).ok()?;
        let prompt = template
            .render(&context, true)
            .ok()?
            .strip_prefix(plain.as_str())?
            .to_string();
        let head = growth.head(messages);
        let mut text = template.render(&messages[..head], false).ok()?;
        let mut spans = Vec::new();
        for (i, message) in messages[..head].iter().enumerate() {
            if message.is_trained() {
                let before = template.render(&messages[..i], true).ok()?;
                let through = template.render(&messages[..=i], false).ok()?;
                let turn = TurnRenderings {
                    full: &text,
                    before: &before,
                    through: &through,
                    closing: "",
                };
                if let Some(span) = answer_span(&turn, i).ok()? {
                    spans.push(span);
                }
            }
        }
        let mut one = context;
        for message in &messages[head..] {
            one.push(message.clone());
            let rendered = template.render(&one, false).ok()?;
            one.pop();
            let added = rendered.strip_prefix(plain.as_str())?;
            let start = text.len();
            text.push_str(added);
            if message.is_trained() {
                // `before` is the text so far and the prompt; it must open this turn.
                if !added.starts_with(prompt.as_str()) {
                    return None;
                }
                let before = start + prompt.len();
                let end = text.trim_end().len().max(before);
                if end > before {
                    spans.push(before..end);
                }
            }
        }
        let full = template.render(messages, false).ok()?;
        (full == text).then_some((text, spans))
    }
}

/// The example of the first `keep` tokens of a text, labelled where `loss` says.
fn label(ids: &[u32], offsets: &[(usize, usize)], keep: usize, loss: &LossOn) -> Example {
    let mut labels = Vec::with_capacity(keep);
    for (i, (&id, &(start, end))) in ids.iter().zip(offsets).take(keep).enumerate() {
        let trained = match loss {
            LossOn::AllButFirst => i > 0,
            LossOn::Spans(spans) => spans.iter().any(|s| start < s.end && end > s.start),
        };
        labels.push(if trained { i64::from(id) } else { IGNORE_INDEX });
    }
    Example {
        input_ids: ids[..keep.min(ids.len())].to_vec(),
        labels,
    }
}

/// Tokens [`Encoder::measure`] reads past the `max_seq_len` it keeps, so that the end
/// of a window of the text, where tokens may differ from the whole text's, is never
/// among them; the length a window shows is a lower bound by as much.
pub const MEASURE_MARGIN: usize = 64;

/// A record measured by [`Encoder::measure`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    /// The first `max_seq_len` tokens and their labels.
    pub example: Example,
    /// The record's length in tokens.
    pub length: Length,
}

/// A record's length in tokens, as far as [`Encoder::measure`] read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Length {
    /// The whole text was tokenized: this many tokens.
    Exact(usize),
    /// Only the start was: the text has at least this many tokens.
    AtLeast(usize),
}

impl Length {
    /// Whether the record is longer than `n` tokens.
    pub fn exceeds(self, n: usize) -> bool {
        match self {
            Length::Exact(len) | Length::AtLeast(len) => len > n,
        }
    }
}

/// The first tokens of a text ([`Encoder::window`]).
struct Window {
    ids: Vec<u32>,
    offsets: Vec<(usize, usize)>,
    length: Length,
}

/// A record's full text and the positions that take loss.
struct Rendered {
    text: String,
    loss: LossOn,
}

/// Which tokens of a rendered text take loss.
enum LossOn {
    /// Tokens overlapping any of these byte ranges of the text.
    Spans(Vec<Range<usize>>),
    /// Every token but the first.
    AllButFirst,
}
