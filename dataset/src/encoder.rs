//! Records → token ids and labels.
//!
//! Loss masks are computed on the *rendered text*, not on token ids: the answer spans are
//! byte ranges of the rendered string (found by rendering the conversation prefix with the
//! generation prompt, and the conversation through the answer), then the full string is
//! tokenized once with offsets and every token overlapping an answer span is labelled. That
//! tokenizes exactly like inference does, and works with any tokenizer and template.

use std::ops::Range;
use std::path::Path;

use tokenizers::Tokenizer;
use tuneq_openapi::ChatTemplateChoice;

use super::record::{Message, Record};
use super::template::{ChatTemplate, TemplateKind};
use super::{DataError, Result};

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
        let offsets = encoding.get_offsets();
        let full_len = ids.len();
        let keep = full_len.min(max_seq_len);
        let mut labels = Vec::with_capacity(keep);
        for (i, (&id, &(start, end))) in ids.iter().zip(offsets).take(keep).enumerate() {
            let trained = match &loss {
                LossOn::AllButFirst => i > 0,
                LossOn::Spans(spans) => spans.iter().any(|s| start < s.end && end > s.start),
            };
            labels.push(if trained { i64::from(id) } else { IGNORE_INDEX });
        }
        Ok((
            Example {
                input_ids: ids[..keep].to_vec(),
                labels,
            },
            full_len,
        ))
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
            Record::Chat { .. } | Record::Alpaca { .. } => {
                let messages = self.conversation(record);
                let last = messages
                    .iter()
                    .rposition(|m| m.role == "assistant")
                    .ok_or_else(|| {
                        DataError::Template("conversation has no assistant message".into())
                    })?;
                let prompt = self.template.render(&messages[..last], true)?;
                (prompt, messages[last].content.clone())
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

    /// The conversation a chat or alpaca record stands for (empty for other records).
    pub fn conversation(&self, record: &Record) -> Vec<Message> {
        match record {
            Record::Chat { messages } => messages.clone(),
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
                    Message::new("user", user),
                    Message::new("assistant", output.clone()),
                ]
            }
            Record::PromptCompletion { .. } | Record::Text { .. } => Vec::new(),
        }
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
            Record::Chat { .. } | Record::Alpaca { .. } => {
                let messages = self.conversation(record);
                let full = self.template.render(&messages, false)?;
                let mut spans = Vec::new();
                for (i, message) in messages.iter().enumerate() {
                    if message.role != "assistant" {
                        continue;
                    }
                    let before = self.template.render(&messages[..i], true)?;
                    let through = self.template.render(&messages[..=i], false)?;
                    if !through.starts_with(&before) || !full.starts_with(&through) {
                        return Err(DataError::Template(format!(
                            "rendering is not prefix-stable at message {i}: the text before an \
                             assistant turn changes when later messages are added, so the \
                             answer cannot be located; choose a built-in template"
                        )));
                    }
                    let end = through.trim_end().len().max(before.len());
                    if end > before.len() {
                        spans.push(before.len()..end);
                    }
                }
                Ok(Rendered {
                    text: full,
                    loss: LossOn::Spans(spans),
                })
            }
        }
    }
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
