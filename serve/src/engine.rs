//! The engine: the models resident in memory and the bound on generations at once.
//!
//! A model is a base model's folder with, for a fine-tuned model, its PEFT adapter's
//! folder; loading one reads its weights, tokenizer and chat template. The engine keeps
//! the `resident_models` used most recently (an LRU) and loads others on demand; the
//! fine-tuned models of one base share its weights (loading another only reads its
//! adapter), so each resident model past the first of a base costs its adapter. Each
//! resident model ([`ServedModel`]) has one decode loop that generates its answers
//! together (`batch`), the callers waiting on their own (blocking) threads, each
//! holding a [`Slot`]; past `max_concurrent` slots a request is refused at once
//! ([`ServeError::Busy`]) rather than queued, so a burst cannot pile up memory or
//! latency behind the server. One tenant holds at most `max_per_tenant` of them
//! ([`ServeError::TenantBusy`]), so one tenant's burst cannot take every slot from the
//! others.

use crate::batch::{Batcher, DecodeTotals};
use crate::error::{Result, ServeError};
use crate::generation::{Generated, GenerationRequest, Piece};
use crate::model::{LoadedModel, ModelKey};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// The engine's settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Generations at once; more are refused with [`ServeError::Busy`].
    pub max_concurrent: usize,
    /// Generations one tenant may have at once; more are refused with
    /// [`ServeError::TenantBusy`].
    pub max_per_tenant: usize,
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
            max_per_tenant: 8,
            resident_models: 4,
            max_batch: 8,
            max_answer_tokens: 4096,
        }
    }
}

/// A resident model with its decode loop, which steps the model's concurrent answers
/// together (started by the first answer; it ends when the model is dropped).
#[derive(Debug)]
pub struct ServedModel {
    model: Arc<LoadedModel>,
    batcher: OnceLock<Batcher>,
    /// Answers the loop steps at once at most.
    max_batch: usize,
    /// The engine's totals its loop counts into.
    totals: Arc<DecodeTotals>,
}

impl std::ops::Deref for ServedModel {
    type Target = LoadedModel;
    fn deref(&self) -> &LoadedModel {
        &self.model
    }
}

impl ServedModel {
    /// `model`, decoding up to `max_batch` concurrent answers in one step, its passes
    /// counted into `totals`.
    pub fn new(model: LoadedModel, max_batch: usize, totals: Arc<DecodeTotals>) -> Self {
        Self {
            model: Arc::new(model),
            batcher: OnceLock::new(),
            max_batch: max_batch.max(1),
            totals,
        }
    }

    /// Generates an answer to `request` in the model's decode loop, beside the other
    /// answers in flight, handing each released piece to `on_piece` on this thread; when
    /// it returns false (the client left), generation stops with
    /// [`ServeError::Abandoned`]. Blocking: run it off the async threads.
    pub fn generate(
        &self,
        request: &GenerationRequest,
        on_piece: &mut dyn FnMut(Piece) -> bool,
    ) -> Result<Generated> {
        let batcher = match self.batcher.get() {
            Some(batcher) => batcher,
            None => {
                let started = Batcher::start(self.max_batch, self.totals.clone())?;
                self.batcher.get_or_init(|| started)
            }
        };
        batcher.generate(self.model.clone(), request, on_piece)
    }

    /// The most answers the decode loop has stepped together so far (0 before the first).
    pub fn widest_step(&self) -> usize {
        self.batcher.get().map_or(0, |b| b.widest_step())
    }

    /// Passes of the decode loop so far that left a prompt partly filled, to go on in
    /// the next (a long prompt fills in chunks beside the answers in flight).
    pub fn chunked_passes(&self) -> usize {
        self.batcher.get().map_or(0, |b| b.chunked_passes())
    }
}

/// Models kept loaded, most recently used last.
type Resident = Vec<(ModelKey, Arc<ServedModel>)>;

/// Loaded models and generation slots, shared by every request.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    resident: Mutex<Resident>,
    slots: Arc<Mutex<Taken>>,
    /// Every decode loop's passes, for `/metrics`.
    totals: Arc<DecodeTotals>,
}

/// The generation slots taken, in all and by tenant (a tenant without one has no entry,
/// so the map holds at most `max_concurrent` entries).
#[derive(Debug, Default)]
struct Taken {
    all: usize,
    by_tenant: HashMap<String, usize>,
}

impl Engine {
    /// An engine with nothing loaded.
    pub fn new(config: EngineConfig) -> Self {
        Self {
            config,
            resident: Mutex::new(Vec::new()),
            slots: Arc::new(Mutex::new(Taken::default())),
            totals: Arc::default(),
        }
    }

    /// What the decode loops of every model loaded so far have done together.
    pub fn decode_totals(&self) -> &DecodeTotals {
        &self.totals
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Generations running now.
    pub fn busy(&self) -> usize {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .all
    }

    /// Takes a generation slot for `tenant`, or refuses when all are taken or the
    /// tenant holds its share.
    pub fn try_slot(&self, tenant: &str) -> Result<Slot> {
        let max = self.config.max_concurrent.max(1);
        let share = self.config.max_per_tenant.clamp(1, max);
        let mut taken = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if taken.all >= max {
            return Err(ServeError::Busy(max));
        }
        if taken.by_tenant.get(tenant).is_some_and(|&n| n >= share) {
            return Err(ServeError::TenantBusy(share));
        }
        taken.all += 1;
        *taken.by_tenant.entry(tenant.to_string()).or_default() += 1;
        Ok(Slot {
            slots: self.slots.clone(),
            tenant: tenant.to_string(),
        })
    }

    /// The model `key` names, loaded now unless resident (blocking: call it off the
    /// async threads).
    pub fn model(&self, key: &ModelKey) -> Result<Arc<ServedModel>> {
        if let Some(found) = self.touch(key) {
            return Ok(found);
        }
        let _span = tracing::info_span!("load_model", base = %key.base.display(),
            adapter = ?key.adapter.as_ref().map(|a| a.display().to_string()))
        .entered();
        let started = std::time::Instant::now();
        let sibling = self.resident_of_base(key);
        let loaded = Arc::new(ServedModel::new(
            LoadedModel::load_sharing(key, sibling.as_deref().map(std::ops::Deref::deref))?,
            self.config.max_batch,
            self.totals.clone(),
        ));
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

    /// A resident model of `key`'s base model (with another adapter or none), whose
    /// weights a new model of that base shares.
    fn resident_of_base(&self, key: &ModelKey) -> Option<Arc<ServedModel>> {
        let resident = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        resident
            .iter()
            .find(|(k, _)| k.base == key.base)
            .map(|(_, model)| model.clone())
    }

    /// The resident model `key` names, marked most recently used.
    fn touch(&self, key: &ModelKey) -> Option<Arc<ServedModel>> {
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
    slots: Arc<Mutex<Taken>>,
    tenant: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut taken = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        taken.all = taken.all.saturating_sub(1);
        if let Some(n) = taken.by_tenant.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                taken.by_tenant.remove(&self.tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_past_the_bound_are_refused_and_come_back_when_dropped() {
        let engine = Engine::new(EngineConfig {
            max_concurrent: 2,
            max_per_tenant: 2,
            resident_models: 1,
            max_batch: 2,
            max_answer_tokens: 16,
        });
        let a = engine.try_slot("t1").expect("first");
        let _b = engine.try_slot("t2").expect("second");
        assert!(matches!(engine.try_slot("t3"), Err(ServeError::Busy(2))));
        drop(a);
        assert_eq!(engine.busy(), 1);
        engine.try_slot("t3").expect("a slot came back");
    }

    #[test]
    fn one_tenant_holds_at_most_its_share_and_leaves_the_rest_to_others() {
        let engine = Engine::new(EngineConfig {
            max_concurrent: 4,
            max_per_tenant: 2,
            ..EngineConfig::default()
        });
        let first = engine.try_slot("greedy").expect("first");
        let _second = engine.try_slot("greedy").expect("second");
        assert!(matches!(
            engine.try_slot("greedy"),
            Err(ServeError::TenantBusy(2))
        ));
        let _other = engine
            .try_slot("other")
            .expect("another tenant still gets one");
        drop(first);
        let _again = engine.try_slot("greedy").expect("its slot came back");
        let taken = engine.slots.lock().expect("lock");
        assert_eq!((taken.all, taken.by_tenant.len()), (3, 2));
    }

    #[test]
    fn a_tenant_without_slots_leaves_no_entry() {
        let engine = Engine::new(EngineConfig::default());
        drop(engine.try_slot("once").expect("slot"));
        assert!(engine.slots.lock().expect("lock").by_tenant.is_empty());
    }

    /// A demo base model and two PEFT adapters over it, with B drawn (PEFT starts it at
    /// zero, which would make every adapter the base).
    fn base_and_adapters(dir: &std::path::Path) -> (ModelKey, ModelKey, ModelKey) {
        use tuneq_trainer::lora::LoraSettings;
        let base = dir.join("base");
        tuneq_trainer::init::write_model(&tuneq_trainer::init::InitOptions::demo(), &base)
            .expect("model");
        let settings = LoraSettings {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
            rslora: false,
        };
        let adapter = |seed: u64| {
            let mut rng = <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(seed);
            let cpu = candle_core::Device::Cpu;
            let model = tuneq_trainer::model::Llama::load(
                &base,
                candle_core::DType::F32,
                &cpu,
                Some((&settings, &mut rng)),
            )
            .expect("model with LoRA");
            for factors in model
                .layers
                .iter()
                .flat_map(|l| &l.projections)
                .flat_map(|p| &p.lora)
            {
                let b = candle_core::Tensor::randn(0f32, 0.5, factors.b.shape(), &cpu).expect("B");
                factors.b.set(&b).expect("set B");
            }
            let out = dir.join(format!("adapter-{seed}"));
            tuneq_trainer::peft::save_adapter(&model, &settings, "demo", &out).expect("save");
            ModelKey {
                base: base.clone(),
                adapter: Some(out),
                template: Default::default(),
            }
        };
        let bare = ModelKey {
            base: base.clone(),
            adapter: None,
            template: Default::default(),
        };
        (bare, adapter(1), adapter(2))
    }

    fn greedy(model: &LoadedModel) -> Vec<String> {
        let message = tuneq_dataset::Message::new(tuneq_dataset::Role::User, "Hello there");
        let request = crate::GenerationRequest {
            prompt: model
                .chat_prompt(&[message], &[], &Default::default(), "")
                .expect("prompt"),
            max_new_tokens: 12,
            sampling: crate::Sampling::greedy(),
            seed: 0,
            stop: Vec::new(),
            markers: Vec::new(),
            logprobs: Some(1),
            format: None,
        };
        let generated = model
            .generate_alone(&request, &mut |_| true)
            .expect("generate");
        generated.logprobs.into_iter().map(|l| l.token).collect()
    }

    #[test]
    fn fine_tuned_models_of_one_base_share_its_weights_and_answer_as_if_loaded_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (bare, first, second) = base_and_adapters(dir.path());
        let engine = Engine::new(EngineConfig::default());
        let models = [&first, &bare, &second].map(|key| engine.model(key).expect("load"));
        let weight = |m: &LoadedModel| m.model.layers[0].projections[0].weight.id();
        assert!(
            models.iter().all(|m| weight(m) == weight(&models[0])),
            "one copy of the base"
        );
        for (key, model) in [&first, &bare, &second].iter().zip(&models) {
            let alone = LoadedModel::load(key).expect("alone");
            assert_ne!(
                weight(model),
                alone.model.layers[0].projections[0].weight.id()
            );
            assert_eq!(greedy(model), greedy(&alone), "{key:?}");
        }
        assert_ne!(
            greedy(&models[0]),
            greedy(&models[2]),
            "the adapters differ"
        );
    }
}
