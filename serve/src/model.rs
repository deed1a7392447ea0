//! A model loaded for answering: a base model's weights with, for a fine-tuned model,
//! its PEFT adapter installed, its tokenizer and chat template, the ids that end an
//! answer, and (prepared on first use) its JSON grammars.

use crate::error::{Result, ServeError};
use candle_core::{DType, Device};
use std::path::PathBuf;
use tuneq_dataset::Encoder;
use tuneq_trainer::model::Llama;

/// Which model to load: a base model's local folder and, for a fine-tuned model, its
/// adapter's; and the chat template its prompts are rendered with (the one it was
/// trained with).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelKey {
    /// The base model's Hugging Face–layout folder.
    pub base: PathBuf,
    /// The PEFT adapter's folder.
    pub adapter: Option<PathBuf>,
    /// The chat template.
    pub template: tuneq_openapi::ChatTemplateChoice,
}

/// A model ready to generate: weights (with the adapter installed), tokenizer, template.
pub struct LoadedModel {
    pub(crate) model: Llama,
    pub(crate) encoder: Encoder,
    pub(crate) stop_ids: Vec<u32>,
    /// JSON grammars over the vocabulary, prepared the first time an answer needs one.
    grammars: std::sync::OnceLock<std::result::Result<crate::json_format::JsonGrammars, String>>,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("context", &self.context_length())
            .finish_non_exhaustive()
    }
}

/// A loading failure, as the engine reports it.
fn load(e: impl std::fmt::Display) -> ServeError {
    ServeError::Load(e.to_string())
}

impl LoadedModel {
    /// Loads the model `key` names on the CPU, weights in f32.
    pub fn load(key: &ModelKey) -> Result<Self> {
        Self::load_sharing(key, None)
    }

    /// Loads the model `key` names; with `sibling`, a loaded model of the same base
    /// (with any adapter or none), its frozen weights are shared rather than read again,
    /// and only `key`'s adapter is installed: a base model's weights are in memory once
    /// however many of its fine-tuned models are resident.
    pub(crate) fn load_sharing(key: &ModelKey, sibling: Option<&LoadedModel>) -> Result<Self> {
        let device = Device::Cpu;
        let mut model = match sibling {
            Some(sibling) => {
                let mut model = sibling.model.clone();
                for projection in model.layers.iter_mut().flat_map(|l| &mut l.projections) {
                    projection.lora = None;
                }
                model
            }
            None => Llama::load(&key.base, DType::F32, &device, None).map_err(load)?,
        };
        if let Some(dir) = &key.adapter {
            let (settings, tensors) =
                tuneq_trainer::peft::load_adapter(dir, &device).map_err(load)?;
            model
                .set_adapter(&settings, &tensors, &dir.display().to_string())
                .map_err(load)?;
        }
        let encoder = Encoder::from_model_dir(&key.base, key.template).map_err(load)?;
        let stop_ids = tuneq_trainer::generate::stop_ids(&model, &encoder);
        Ok(Self {
            model,
            encoder,
            stop_ids,
            grammars: std::sync::OnceLock::new(),
        })
    }

    /// The model's JSON grammars (prepared on first use: about 0.1 s for a 50k
    /// vocabulary), or why its vocabulary cannot be constrained.
    pub fn json_grammars(&self) -> Result<&crate::json_format::JsonGrammars> {
        self.grammars
            .get_or_init(|| {
                crate::json_format::JsonGrammars::new(
                    self.encoder.tokenizer(),
                    &self.stop_ids,
                    self.vocab_size(),
                )
                .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| ServeError::JsonUnsupported(e.clone()))
    }

    /// Tokens the model attends to at most: prompt and answer together.
    pub fn context_length(&self) -> usize {
        self.model.cfg.max_position_embeddings()
    }

    /// The model's tokenizer and chat template.
    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// How the model writes tool calls in a conversation with `tools`: as its chat
    /// template teaches it, or in tuneq's tags where the template renders no tools (and
    /// training wrote them so).
    pub fn call_syntax(&self, tools: &[serde_json::Value]) -> crate::tool_calls::CallSyntax {
        let template = self.encoder.template();
        if !template.handles_tools(tools) {
            return crate::tool_calls::CallSyntax::Tagged;
        }
        let source = template.tool_use_source().unwrap_or(template.source());
        crate::tool_calls::CallSyntax::of_template(source)
    }

    /// The ids of the prompt for `messages` (with `tools`), rendered by the model's chat
    /// template (with `variables` beside them) up to where the answer begins, then
    /// `prefill` (the start of the answer the request forces).
    pub fn chat_prompt(
        &self,
        messages: &[tuneq_dataset::Message],
        tools: &[serde_json::Value],
        variables: &tuneq_dataset::TemplateVariables,
        prefill: &str,
    ) -> Result<Vec<u32>> {
        let mut text = self.encoder.generation_prompt(messages, tools, variables)?;
        text.push_str(prefill);
        self.tokenize(&text)
    }

    /// The ids of `text`, as the tokenizer reads it (no special tokens added).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .encoder
            .tokenizer()
            .encode(text, false)
            .map_err(|e| tuneq_dataset::DataError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// The ids that end an answer (end of sequence, end of turn).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Entries in the vocabulary (ids a `logit_bias` may name are below it).
    pub fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size()
    }
}
