//! The engine: the models resident in memory and the bound on generations at once.
//!
//! A model is a base model's folder with, for a fine-tuned model, its PEFT adapter's
//! folder; loading one reads its weights, tokenizer and chat template. The engine keeps
//! the `resident_models` used most recently (an LRU) and loads others on demand.
//! Generations run on the caller's (blocking) thread, each holding a [`Slot`]; past
//! `max_concurrent` slots a request is refused at once ([`ServeError::Busy`]) rather
//! than queued, so a burst cannot pile up memory or latency behind the server.

use crate::error::{Result, ServeError};
use candle_core::{DType, Device};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tuneq_dataset::Encoder;
use tuneq_trainer::model::Llama;

/// The engine's settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Generations at once; more are refused with [`ServeError::Busy`].
    pub max_concurrent: usize,
    /// Models (base + adapter) kept loaded.
    pub resident_models: usize,
    /// Answers of one model decoded together in one step at most.
    pub max_batch: usize,
    /// Tokens one answer may have at most (a request without `max_tokens` gets up to
    /// this, or what the context leaves, whichever is less).
    pub max_answer_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_concurrent: 8,
            resident_models: 4,
            max_batch: 8,
            max_answer_tokens: 4096,
        }
    }
}

/// Which model to load: a base model's local folder and, for a fine-tuned model, its
/// adapter's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelKey {
    /// The base model's Hugging Face–layout folder.
    pub base: PathBuf,
    /// The PEFT adapter's folder.
    pub adapter: Option<PathBuf>,
}

/// A model ready to generate: weights (with the adapter installed), tokenizer, template.
pub struct LoadedModel {
    pub(crate) model: Llama,
    pub(crate) encoder: Encoder,
    pub(crate) stop_ids: Vec<u32>,
    /// The decode loop that steps concurrent answers together, started by the first.
    batcher: std::sync::OnceLock<crate::batch::Batcher>,
    /// Answers the loop steps at once at most.
    max_batch: usize,
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
        let device = Device::Cpu;
        let mut model = Llama::load(&key.base, DType::F32, &device, None).map_err(load)?;
        if let Some(dir) = &key.adapter {
            let (settings, tensors) =
                tuneq_trainer::peft::load_adapter(dir, &device).map_err(load)?;
            model
                .set_adapter(&settings, &tensors, &dir.display().to_string())
                .map_err(load)?;
        }
        let encoder = Encoder::from_model_dir(&key.base, tuneq_openapi::ChatTemplateChoice::Model)
            .map_err(load)?;
        let stop_ids = tuneq_trainer::generate::stop_ids(&model, &encoder);
        Ok(Self {
            model,
            encoder,
            stop_ids,
            batcher: std::sync::OnceLock::new(),
            max_batch: 1,
            grammars: std::sync::OnceLock::new(),
        })
    }

    /// This model, decoding up to `max_batch` concurrent answers in one step.
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch.max(1);
        self
    }

    /// Generates an answer to `request` in the model's decode loop, beside the other
    /// answers in flight, handing each released piece to `on_piece` on this thread; when
    /// it returns false (the client left), generation stops with
    /// [`ServeError::Abandoned`]. Blocking: run it off the async threads.
    pub fn generate(
        self: &Arc<Self>,
        request: &crate::generation::GenerationRequest,
        on_piece: &mut dyn FnMut(crate::generation::Piece) -> bool,
    ) -> Result<crate::generation::Generated> {
        let batcher = match self.batcher.get() {
            Some(batcher) => batcher,
            None => {
                let started = crate::batch::Batcher::start(self.max_batch)?;
                self.batcher.get_or_init(|| started)
            }
        };
        batcher.generate(self.clone(), request, on_piece)
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

    /// The ids of the prompt for `messages` (with `tools`), rendered by the model's chat
    /// template up to where the answer begins, then `prefill` (the start of the answer
    /// the request forces).
    pub fn chat_prompt(
        &self,
        messages: &[tuneq_dataset::Message],
        tools: &[serde_json::Value],
        prefill: &str,
    ) -> Result<Vec<u32>> {
        let mut text = self.encoder.generation_prompt(messages, tools)?;
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

    /// The most answers the decode loop has stepped together so far (0 before the first).
    pub fn widest_step(&self) -> usize {
        self.batcher.get().map_or(0, |b| b.widest_step())
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

/// Models kept loaded, most recently used last.
type Resident = Vec<(ModelKey, Arc<LoadedModel>)>;

/// Loaded models and generation slots, shared by every request.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    resident: Mutex<Resident>,
    busy: Arc<AtomicUsize>,
}

impl Engine {
    /// An engine with nothing loaded.
    pub fn new(config: EngineConfig) -> Self {
        Self {
            config,
            resident: Mutex::new(Vec::new()),
            busy: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Generations running now.
    pub fn busy(&self) -> usize {
        self.busy.load(Ordering::Relaxed)
    }

    /// Takes a generation slot, or refuses when all are taken.
    pub fn try_slot(&self) -> Result<Slot> {
        let max = self.config.max_concurrent.max(1);
        self.busy
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| ServeError::Busy(max))?;
        Ok(Slot {
            busy: self.busy.clone(),
        })
    }

    /// The model `key` names, loaded now unless resident (blocking: call it off the
    /// async threads).
    pub fn model(&self, key: &ModelKey) -> Result<Arc<LoadedModel>> {
        if let Some(found) = self.touch(key) {
            return Ok(found);
        }
        let _span = tracing::info_span!("load_model", base = %key.base.display(),
            adapter = ?key.adapter.as_ref().map(|a| a.display().to_string()))
        .entered();
        let started = std::time::Instant::now();
        let loaded = Arc::new(LoadedModel::load(key)?.with_max_batch(self.config.max_batch));
        tracing::info!(
            took_ms = started.elapsed().as_millis() as u64,
            "model loaded"
        );
        let mut resident = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = resident.iter().position(|(k, _)| k == key) {
            // Loaded meanwhile by another request: keep the one already shared.
            let entry = resident.remove(at);
            let shared = entry.1.clone();
            resident.push(entry);
            return Ok(shared);
        }
        resident.push((key.clone(), loaded.clone()));
        let keep = self.config.resident_models.max(1);
        if resident.len() > keep {
            let evicted = resident.len() - keep;
            resident.drain(..evicted);
        }
        Ok(loaded)
    }

    /// The resident model `key` names, marked most recently used.
    fn touch(&self, key: &ModelKey) -> Option<Arc<LoadedModel>> {
        let mut resident = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        let at = resident.iter().position(|(k, _)| k == key)?;
        let entry = resident.remove(at);
        let model = entry.1.clone();
        resident.push(entry);
        Some(model)
    }

    /// How many models are loaded.
    pub fn resident(&self) -> usize {
        self.resident.lock().map_or(0, |r| r.len())
    }
}

/// A generation slot, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    busy: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_past_the_bound_are_refused_and_come_back_when_dropped() {
        let engine = Engine::new(EngineConfig {
            max_concurrent: 2,
            resident_models: 1,
            max_batch: 2,
            max_answer_tokens: 16,
        });
        let a = engine.try_slot().expect("first");
        let _b = engine.try_slot().expect("second");
        assert!(matches!(engine.try_slot(), Err(ServeError::Busy(2))));
        drop(a);
        assert_eq!(engine.busy(), 1);
        engine.try_slot().expect("a slot came back");
    }
}
