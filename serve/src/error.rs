//! What can go wrong while serving a request.

/// An engine error. [`ServeError::Busy`] and [`ServeError::TenantBusy`] are the
/// client's to retry; the others are the model's or the server's.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Every generation slot is taken.
    #[error("all {0} generation slots are busy")]
    Busy(usize),
    /// The tenant already holds its share of the slots.
    #[error("this tenant already has {0} answers being generated")]
    TenantBusy(usize),
    /// The model or its adapter could not be loaded.
    #[error("cannot load the model: {0}")]
    Load(String),
    /// The model failed while generating.
    #[error("generation failed: {0}")]
    Model(#[from] tuneq_trainer::Error),
    /// The tokenizer or the chat template failed.
    #[error("{0}")]
    Text(#[from] tuneq_dataset::DataError),
    /// A batched decode step failed (every answer in it ends with this).
    #[error("generation failed: {0}")]
    Decode(String),
    /// Tensor arithmetic failed.
    #[error("generation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The prompt leaves no room in the model's context.
    #[error("the prompt has {tokens} tokens; the model's context holds {context}")]
    PromptTooLong {
        /// Tokens in the rendered prompt.
        tokens: usize,
        /// The model's context length.
        context: usize,
    },
    /// The `response_format` schema is invalid or asks for what the grammar engine does
    /// not support (the message says which keyword).
    #[error("{0}")]
    InvalidSchema(String),
    /// The model's vocabulary cannot be read for constrained decoding.
    #[error("this model cannot answer in JSON by constrained decoding: {0}")]
    JsonUnsupported(String),
    /// The grammar engine failed while generating.
    #[error("constrained decoding failed: {0}")]
    Grammar(String),
    /// The caller stopped listening (a stream's client went away).
    #[error("the client went away")]
    Abandoned,
}

/// An engine result.
pub type Result<T, E = ServeError> = std::result::Result<T, E>;
