//! Inference for base and fine-tuned models: the engine behind `/v1/chat/completions`.
//!
//! The model code is the trainer's ([`tuneq_trainer::model::Llama`] with its key/value
//! cache and LoRA layers), so what is served is what was trained, token for token. This
//! crate adds what serving needs around it, and knows nothing of HTTP:
//!
//! - [`model`]: a model loaded for answering (weights + adapter, tokenizer, template);
//! - [`engine`]: resident models (an LRU of base + adapter, each with its decode loop)
//!   and the bound on generations at once;
//! - [`generation`]: the decoding of one answer, piece by piece; `batch`: the decode
//!   loop that steps a model's concurrent answers together;
//! - [`json_format`]: `response_format` JSON and tool calls by constrained decoding
//!   (llguidance);
//! - [`sampling`]: temperature, `top_p`, `logit_bias`, penalties, seeded draws,
//!   log-probabilities;
//! - [`staging`]: base models and adapters from object storage into local folders;
//! - [`text`]: incremental detokenisation and `stop` strings that never leak into a
//!   stream;
//! - [`bench`](mod@bench): `tuneq bench serve`, throughput and time to first token;
//! - [`tool_calls`]: the calls a model wrote, read back as structured calls.

mod batch;
pub mod bench;
pub mod engine;
pub mod error;
pub mod generation;
pub mod json_format;
pub mod model;
pub mod reasoning;
pub mod sampling;
pub mod staging;
pub mod text;
pub mod tool_calls;

pub use batch::DecodeTotals;
pub use engine::{Engine, EngineConfig, ServedModel, Slot};
pub use error::{Result, ServeError};
pub use generation::{Finish, Generated, GenerationRequest, Piece, TokenLogprob};
pub use json_format::{AnswerFormat, CallFormat, CallableTool, JsonFormat};
pub use model::{LoadedModel, ModelKey};
pub use sampling::Sampling;
pub use staging::Staging;
