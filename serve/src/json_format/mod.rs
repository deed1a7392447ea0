//! `response_format` JSON by constrained decoding: the answer is JSON (an object, or
//! one a schema describes) because every token that would break it is masked out before
//! the token is picked — not because the model is asked nicely.
//!
//! A schema is compiled by llguidance into a grammar over the model's vocabulary
//! ([`vocabulary`]); per step the grammar says which tokens may come next, and the end
//! of turn is allowed only once the JSON is complete. A top-level object or array ends
//! by itself: after its last brace nothing more may come, and the answer stops there.
//! Whitespace between tokens is capped, so a small model cannot loop on newlines.
//! Properties come in the schema's order. An invalid or unsupported schema is refused
//! when the grammar is compiled, before anything is generated. Tool calls are held to a
//! grammar the same way ([`calls`]).

mod calls;
mod vocabulary;

use crate::error::{Result, ServeError};
use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;

pub use calls::{CallFormat, CallableTool};
pub use vocabulary::VocabularyError;

/// Whitespace allowed between JSON tokens: up to 8 spaces, tabs or newlines.
const WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,8}";

/// What JSON an answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonFormat {
    /// Any JSON object (`json_object`).
    Object,
    /// A value the schema describes (`json_schema`).
    Schema(Value),
}

impl JsonFormat {
    /// The schema the answer follows.
    pub fn schema(&self) -> Value {
        match self {
            JsonFormat::Object => serde_json::json!({"type": "object"}),
            JsonFormat::Schema(schema) => schema.clone(),
        }
    }
}

/// What an answer must be, enforced token by token.
#[derive(Debug, Clone, PartialEq)]
pub enum AnswerFormat {
    /// JSON (`response_format`).
    Json(JsonFormat),
    /// Tool calls (or, where the format says, JSON instead).
    Calls(CallFormat),
}

/// Compiles JSON formats for one model; the vocabulary's masks are prepared once.
pub struct JsonGrammars {
    factory: ParserFactory,
    /// Mistral's `[TOOL_CALLS]` token, where the vocabulary has it.
    mistral_calls: Option<u32>,
}

impl std::fmt::Debug for JsonGrammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonGrammars").finish_non_exhaustive()
    }
}

impl JsonGrammars {
    /// Grammars over `tokenizer`'s vocabulary, `width` ids wide (the logits' row),
    /// ending at any of `end_ids`.
    pub fn new(
        tokenizer: &tokenizers::Tokenizer,
        end_ids: &[u32],
        width: usize,
    ) -> std::result::Result<Self, VocabularyError> {
        let env = vocabulary::token_env(tokenizer, end_ids, width)?;
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| VocabularyError::Tokenizer(e.to_string()))?;
        factory.quiet();
        let mistral_calls = tokenizer.token_to_id(crate::tool_calls::MISTRAL_CALLS);
        Ok(Self {
            factory,
            mistral_calls,
        })
    }

    /// A fresh constraint for one answer in `format`; an invalid or unsupported schema
    /// is [`ServeError::InvalidSchema`].
    pub fn constrain(&self, format: &AnswerFormat) -> Result<JsonConstraint> {
        let grammar = match format {
            AnswerFormat::Json(json) => TopLevelGrammar::from_json_schema(prepared(json.schema())?),
            AnswerFormat::Calls(calls) => {
                TopLevelGrammar::from_lark(calls::lark(calls, self.mistral_calls, &prepared)?)
            }
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ServeError::InvalidSchema(first_line(&e.to_string())))?;
        Ok(JsonConstraint {
            matcher: Matcher::new(Ok(parser)),
        })
    }
}

/// `schema` with the server's options for the grammar engine (the whitespace allowed
/// between tokens): a client's own options (`x-guidance`) are dropped, not the client's
/// to set.
fn prepared(mut schema: Value) -> Result<Value> {
    match &mut schema {
        Value::Object(obj) => {
            obj.remove("x-guidance");
            let options = JsonCompileOptions {
                whitespace_pattern: Some(WHITESPACE.into()),
                ..Default::default()
            };
            options.apply_to(&mut schema);
            Ok(schema)
        }
        Value::Bool(_) => Ok(schema),
        _ => Err(ServeError::InvalidSchema(
            "a schema is a JSON object (or true / false)".into(),
        )),
    }
}

/// The first line of a grammar error (the rest is the engine's detail).
fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or(message).to_string()
}

/// One answer's constraint: which tokens may come next.
pub struct JsonConstraint {
    matcher: Matcher,
}

impl std::fmt::Debug for JsonConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonConstraint")
            .field("done", &self.matcher.is_stopped())
            .finish()
    }
}

impl JsonConstraint {
    /// Whether the JSON is complete and nothing more may follow.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Sets the logit of every token that may not come next to −∞.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self
            .matcher
            .compute_mask()
            .map_err(|e| ServeError::Grammar(e.to_string()))?;
        allowed.iter_unset_entries(|id| {
            if let Some(l) = logits.get_mut(id) {
                *l = f32::NEG_INFINITY;
            }
        });
        if let Some(past) = logits.get_mut(allowed.len()..) {
            past.fill(f32::NEG_INFINITY);
        }
        Ok(())
    }

    /// Moves past `token`, which [`JsonConstraint::mask`] allowed.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ServeError::Grammar(e.to_string()))
    }
}
