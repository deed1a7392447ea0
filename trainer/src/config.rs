//! The Llama architecture settings, read from a Hugging Face `config.json`.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tuneq_pools::ModelShape;

/// `rope_scaling`: Llama 3's, linear (Gemma 3's) or LongRoPE (Phi-3's); the kinds a
/// family may name are its rules' (`tuneq_pools::architecture`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// `llama3`, `linear` or `longrope`.
    #[serde(alias = "type")]
    pub rope_type: String,
    /// Context extension factor (LongRoPE's is `max_position_embeddings` over
    /// `original_max_position_embeddings` where it names none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// Wavelength boundary (low frequencies).
    #[serde(default = "one")]
    pub low_freq_factor: f64,
    /// Wavelength boundary (high frequencies).
    #[serde(default = "four")]
    pub high_freq_factor: f64,
    /// Context length the base model was trained with.
    #[serde(default = "eight_k")]
    pub original_max_position_embeddings: usize,
    /// LongRoPE's divisors of each frequency up to `original_max_position_embeddings`
    /// positions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_factor: Option<Vec<f64>>,
    /// LongRoPE's divisors of each frequency past them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_factor: Option<Vec<f64>>,
    /// LongRoPE's scale of the cosines and sines, where the config names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_factor: Option<f64>,
}

impl RopeScaling {
    /// Whether it is LongRoPE (`su` is its older name).
    fn longrope(&self) -> bool {
        matches!(self.rope_type.as_str(), "longrope" | "su")
    }
}

fn one() -> f64 {
    1.0
}
fn four() -> f64 {
    4.0
}
fn eight_k() -> usize {
    8192
}
fn rope_theta_default() -> f64 {
    10000.0
}
fn eps_default() -> f64 {
    1e-6
}
/// The context length of a config that names none (Llama 2's).
const DEFAULT_MAX_POSITIONS: u64 = 2048;

/// How a layer attends (`layer_types` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// To every earlier position.
    FullAttention,
    /// To the last `sliding_window` positions, itself included.
    SlidingAttention,
}

/// A token id field that may be a single id or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids (Llama 3 lists several end tokens).
    Many(Vec<u32>),
}

impl TokenIds {
    /// All ids.
    pub fn ids(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// The fields of a Hugging Face `LlamaConfig` that the trainer uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// The model's shape (sizes, heads, vocabulary, context length, tied head, stored
    /// dtype): the same struct placement reads the file with.
    #[serde(flatten)]
    pub shape: ModelShape,
    /// RMSNorm epsilon.
    #[serde(default = "eps_default")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "rope_theta_default")]
    pub rope_theta: f64,
    /// Llama 3 frequency scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Biases on attention projections (unsupported: Llama has none).
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on MLP projections (unsupported: Llama has none).
    #[serde(default)]
    pub mlp_bias: bool,
    /// Activation; only `silu` is supported.
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Gemma's activation (`gelu_pytorch_tanh`, the only one its rules accept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_activation: Option<String>,
    /// Gemma's attention scale: scores are multiplied by `query_pre_attn_scalar^-1/2`
    /// instead of `head_dim^-1/2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma's soft-cap of the attention scores: `cap·tanh(score/cap)`.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma's soft-cap of the final logits.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Which layers attend through the sliding window; Gemma's default pattern where a
    /// config names none (filled in by the loader).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<LayerType>>,
    /// Gemma 3's RoPE base on its sliding-window layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
    /// The fraction of each head RoPE rotates (Phi-4-mini's 0.75); the whole head where
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
}

impl LlamaConfig {
    /// Reads and checks `config.json` in `model_dir`.
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("config.json");
        if !path.is_file() {
            return Err(Error::Model {
                path: model_dir.display().to_string(),
                message: "config.json not found (expected a Hugging Face model folder)".into(),
            });
        }
        let raw: serde_json::Value = crate::error::read_json(&path)?;
        // Another family's config parses as Llama's (the same names for the same shapes)
        // and would train wrongly and silently: refused here, by the rule registration
        // and job creation use too.
        let architecture = tuneq_pools::architecture_of(&raw).map_err(|refusal| Error::Model {
            path: path.display().to_string(),
            message: refusal.to_string(),
        })?;
        let cfg: Self =
            serde_json::from_value(Self::normalise(raw, architecture)).map_err(|source| {
                Error::Json {
                    path: path.display().to_string(),
                    source,
                }
            })?;
        cfg.check().map_err(|message| Error::Model {
            path: path.display().to_string(),
            message,
        })?;
        Ok(cfg)
    }

    /// transformers ≥ 5 writes `rope_parameters` (`rope_theta`, `rope_type` and the scaling
    /// fields together) instead of top-level `rope_theta` + `rope_scaling`; fold it into the
    /// older layout so a missing `rope_theta` never silently falls back to 10000.
    ///
    /// It also fills in what the family's config class sets for fields the file leaves
    /// out ([`tuneq_pools::architecture::with_class_defaults`], as placement reads it),
    /// and reads Gemma 3's per-layer `rope_parameters`.
    fn normalise(
        raw: serde_json::Value,
        architecture: tuneq_pools::Architecture,
    ) -> serde_json::Value {
        let mut raw = tuneq_pools::architecture::with_defaults_of(raw, architecture);
        let Some(obj) = raw.as_object_mut() else {
            return raw;
        };
        if architecture == tuneq_pools::Architecture::Gemma3 {
            Self::fold_layer_rope(obj);
            return raw;
        }
        Self::fold_rope_parameters(obj);
        Self::place_original_context(obj);
        raw
    }

    /// transformers ≥ 5's single `rope_parameters` as `rope_theta`, `rope_scaling` and
    /// `partial_rotary_factor`.
    fn fold_rope_parameters(obj: &mut serde_json::Map<String, serde_json::Value>) {
        let Some(params) = rope_parameters(obj) else {
            return;
        };
        for field in ["rope_theta", "partial_rotary_factor"] {
            if let Some(value) = params.get(field)
                && !obj.contains_key(field)
            {
                obj.insert(field.into(), value.clone());
            }
        }
        Self::scaling_from(obj, &params);
    }

    /// A transformers ≥ 5 RoPE object `params` as `rope_scaling` (without its
    /// `rope_theta`), unless it scales nothing or the config names a `rope_scaling`.
    fn scaling_from(
        obj: &mut serde_json::Map<String, serde_json::Value>,
        params: &serde_json::Map<String, serde_json::Value>,
    ) {
        let kind = params
            .get("rope_type")
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if kind != "default" && obj.get("rope_scaling").is_none_or(|v| v.is_null()) {
            let mut scaling = params.clone();
            scaling.remove("rope_theta");
            obj.insert("rope_scaling".into(), serde_json::Value::Object(scaling));
        }
    }

    /// LongRoPE's pretraining context: Phi-3's configs name it beside `rope_scaling`,
    /// not in it (transformers moves it in, as here).
    fn place_original_context(obj: &mut serde_json::Map<String, serde_json::Value>) {
        let Some(original) = obj.get("original_max_position_embeddings").cloned() else {
            return;
        };
        if let Some(scaling) = obj.get_mut("rope_scaling").and_then(|s| s.as_object_mut()) {
            scaling
                .entry("original_max_position_embeddings")
                .or_insert(original);
        }
    }

    /// Gemma 3's `rope_parameters` (transformers ≥ 5) name one RoPE per layer type:
    /// the global layers' becomes `rope_theta` and `rope_scaling`, the sliding ones'
    /// `rope_local_base_freq` (its rules refuse a scaled local RoPE).
    fn fold_layer_rope(obj: &mut serde_json::Map<String, serde_json::Value>) {
        let Some(params) = rope_parameters(obj) else {
            return;
        };
        let theta = |kind: &str| params.get(kind).and_then(|p| p.get("rope_theta")).cloned();
        if let Some(local) = theta("sliding_attention") {
            obj.insert("rope_local_base_freq".into(), local);
        }
        if let Some(global) = theta("full_attention") {
            obj.insert("rope_theta".into(), global);
        }
        if let Some(full) = params.get("full_attention").and_then(|p| p.as_object()) {
            Self::scaling_from(obj, full);
        }
    }

    fn check(&self) -> std::result::Result<(), String> {
        let shape = &self.shape;
        if shape.num_attention_heads == 0 || shape.num_hidden_layers == 0 || shape.hidden_size == 0
        {
            return Err(
                "hidden_size, num_attention_heads and num_hidden_layers must be positive".into(),
            );
        }
        if shape.head_dim.is_none() && !shape.hidden_size.is_multiple_of(shape.num_attention_heads)
        {
            return Err("hidden_size must be divisible by num_attention_heads".into());
        }
        if !self
            .num_attention_heads()
            .is_multiple_of(self.num_kv_heads())
        {
            return Err("num_attention_heads must be a multiple of num_key_value_heads".into());
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err("head_dim must be even for rotary embeddings".into());
        }
        let rotary = self.rotary_dim();
        if rotary == 0 || !rotary.is_multiple_of(2) {
            return Err(format!(
                "partial_rotary_factor rotates {rotary} of each head's {} dimensions; RoPE needs an even, positive number",
                self.head_dim()
            ));
        }
        if let Some(rs) = &self.rope_scaling {
            let half = rotary / 2;
            for (name, factors) in [
                ("short_factor", &rs.short_factor),
                ("long_factor", &rs.long_factor),
            ] {
                if rs.longrope() && factors.as_ref().map(Vec::len) != Some(half) {
                    return Err(format!(
                        "rope_scaling.{name} must list {half} factors, one per rotated frequency"
                    ));
                }
            }
            let scales = matches!(rs.rope_type.as_str(), "linear" | "llama3");
            if scales && rs.factor.is_none_or(|f| !(f.is_finite() && f > 0.0)) {
                return Err(format!(
                    "rope_scaling.factor must be a positive number for {} scaling",
                    rs.rope_type
                ));
            }
        }
        if let Some(types) = &self.layer_types
            && types.len() != self.num_hidden_layers()
        {
            return Err(format!(
                "layer_types names {} layers, the model has {}",
                types.len(),
                self.num_hidden_layers()
            ));
        }
        // The fields that change the maths (activation, biases, RoPE scaling kind) were
        // checked against the architecture's rules before parsing.
        Ok(())
    }

    /// The factor attention scores are multiplied by: `query_pre_attn_scalar^-1/2`
    /// (Gemma) or `head_dim^-1/2`.
    pub fn attention_scale(&self) -> f64 {
        match self.query_pre_attn_scalar {
            Some(scalar) => scalar.powf(-0.5),
            None => 1.0 / (self.head_dim() as f64).sqrt(),
        }
    }

    /// The positions layer `layer` sees, itself included, when it attends through a
    /// sliding window that can bind; None for a layer that sees every earlier position.
    /// Gemma's `sliding_attention` layers have the window, a Mistral's every layer (see
    /// `sliding_window` in [`ModelShape`]).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let window = Some(self.shape.binding_window()? as usize);
        match (&self.layer_types, self.architecture()) {
            (Some(types), _) => match types.get(layer)? {
                LayerType::SlidingAttention => window,
                LayerType::FullAttention => None,
            },
            (None, tuneq_pools::Architecture::Mistral | tuneq_pools::Architecture::Phi3) => window,
            (None, _) => None,
        }
    }

    /// Whether layer `layer` rotates with the local RoPE base (Gemma 3's
    /// `sliding_attention` layers, whether or not their window binds).
    pub fn local_rope(&self, layer: usize) -> bool {
        let sliding = self
            .layer_types
            .as_ref()
            .and_then(|types| types.get(layer))
            .is_some_and(|t| *t == LayerType::SlidingAttention);
        self.rope_local_base_freq.is_some() && sliding
    }

    /// The factor embeddings are multiplied by (Gemma's √hidden, rounded to f32 as
    /// transformers' buffer is), if any.
    pub fn embedding_scale(&self) -> Option<f32> {
        self.architecture()
            .gemma()
            .then(|| (self.hidden_size() as f64).sqrt() as f32)
    }

    /// Inverse frequencies of the sliding layers' RoPE (Gemma 3's local base, never
    /// scaled), if the model has one.
    pub fn local_inv_freq(&self) -> Option<Vec<f32>> {
        let base = self.rope_local_base_freq?;
        Some(inv_freq_of(base, self.head_dim()))
    }

    /// The architecture (checked by the loader; a config built in code without a
    /// `model_type` is Llama's).
    pub fn architecture(&self) -> tuneq_pools::Architecture {
        self.shape.architecture()
    }

    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub fn vocab_size(&self) -> usize {
        self.shape.vocab_size as usize
    }

    /// Model width.
    pub fn hidden_size(&self) -> usize {
        self.shape.hidden_size as usize
    }

    /// MLP width.
    pub fn intermediate_size(&self) -> usize {
        self.shape.intermediate_size as usize
    }

    /// Decoder layers.
    pub fn num_hidden_layers(&self) -> usize {
        self.shape.num_hidden_layers as usize
    }

    /// Query heads.
    pub fn num_attention_heads(&self) -> usize {
        self.shape.num_attention_heads as usize
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.shape.kv_heads() as usize
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.shape.head_dim() as usize
    }

    /// Longest position the model supports (2048 where the config names none).
    pub fn max_position_embeddings(&self) -> usize {
        self.shape
            .max_position_embeddings
            .unwrap_or(DEFAULT_MAX_POSITIONS) as usize
    }

    /// Whether `lm_head` shares the embedding matrix.
    pub fn tie_word_embeddings(&self) -> bool {
        self.shape.tie_word_embeddings
    }

    /// Input and output width of a target projection, by PEFT module name.
    pub fn projection_shape(&self, module: &str) -> Option<(usize, usize)> {
        let (i, o) = self.shape.projection(module)?;
        Some((i as usize, o as usize))
    }

    /// Inverse RoPE frequencies, with Llama 3 scaling when configured.
    ///
    /// Rounded the way transformers computes them (the exponent `2i/d` in float32, the
    /// power rounded to float32, its reciprocal in float32), not correctly: the exact
    /// form differs by one ulp in a third of the frequencies (11 of SmolLM2's 32), a
    /// difference every position's rotation then carries. This form gives PyTorch's bits
    /// but where its float32 `pow` is itself an ulp off (1 of 64 for θ = 10⁶, d = 128).
    ///
    /// LongRoPE's are its short factors' (see [`Self::long_inv_freq`]).
    pub fn inv_freq(&self) -> Vec<f32> {
        let base = inv_freq_of(self.rope_theta, self.rotary_dim());
        let Some(rs) = self.rope_scaling.as_ref() else {
            return base;
        };
        let factor = rs.factor.unwrap_or(1.0);
        if rs.rope_type == "linear" {
            // Positions interpolated: every frequency divided by the factor.
            return base
                .into_iter()
                .map(|f| (f64::from(f) / factor) as f32)
                .collect();
        }
        if rs.longrope() {
            return self.longrope_inv_freq(rs.short_factor.as_deref().unwrap_or_default());
        }
        if rs.rope_type != "llama3" {
            return base;
        }
        let old = rs.original_max_position_embeddings as f64;
        let low_wavelen = old / rs.low_freq_factor;
        let high_wavelen = old / rs.high_freq_factor;
        base.into_iter()
            .map(f64::from)
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let scaled = if wavelen > low_wavelen {
                    f / factor
                } else if wavelen < high_wavelen {
                    f
                } else {
                    let smooth = (old / wavelen - rs.low_freq_factor)
                        / (rs.high_freq_factor - rs.low_freq_factor);
                    (1.0 - smooth) * f / factor + smooth * f
                };
                scaled as f32
            })
            .collect()
    }

    /// How many leading dimensions of each head RoPE rotates: `head_dim` times
    /// `partial_rotary_factor`, truncated as transformers truncates it.
    pub fn rotary_dim(&self) -> usize {
        match self.partial_rotary_factor {
            Some(fraction) => (self.head_dim() as f64 * fraction) as usize,
            None => self.head_dim(),
        }
    }

    /// LongRoPE's inverse frequencies past `original_max_position_embeddings` positions
    /// (its long factors'), if it is scaled so.
    pub fn long_inv_freq(&self) -> Option<Vec<f32>> {
        let rs = self.rope_scaling.as_ref().filter(|rs| rs.longrope())?;
        Some(self.longrope_inv_freq(rs.long_factor.as_deref().unwrap_or_default()))
    }

    /// The positions up to which LongRoPE rotates with its short factors: a forward pass
    /// over positions past them rotates all of its positions with the long ones, as
    /// transformers' decides per call from the last position.
    pub fn longrope_context(&self) -> Option<usize> {
        let rs = self.rope_scaling.as_ref().filter(|rs| rs.longrope())?;
        Some(rs.original_max_position_embeddings)
    }

    /// Whether a pass whose last position is `end - 1` rotates with LongRoPE's long
    /// factors: it reaches past the pretraining context (never without LongRoPE).
    pub fn long_rope_at(&self, end: usize) -> bool {
        self.longrope_context().is_some_and(|context| end > context)
    }

    /// The scale of RoPE's cosines and sines: LongRoPE's `attention_factor`, by default
    /// `√(1 + ln s / ln original)` for a context extended `s` times; 1 otherwise.
    pub fn rope_attention_factor(&self) -> f64 {
        let Some(rs) = self.rope_scaling.as_ref().filter(|rs| rs.longrope()) else {
            return 1.0;
        };
        if let Some(factor) = rs.attention_factor {
            return factor;
        }
        let original = rs.original_max_position_embeddings as f64;
        let scale = rs
            .factor
            .unwrap_or(self.max_position_embeddings() as f64 / original);
        match scale <= 1.0 {
            true => 1.0,
            false => (1.0 + scale.ln() / original.ln()).sqrt(),
        }
    }

    /// LongRoPE's frequencies, each divided by its factor, rounded as transformers
    /// computes them (the exponent and the power in float32, the product and its
    /// reciprocal in float32).
    fn longrope_inv_freq(&self, factors: &[f64]) -> Vec<f32> {
        let d = self.rotary_dim();
        (0..d / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / d as f32;
                let power = self.rope_theta.powf(f64::from(exponent)) as f32;
                let factor = factors.get(i).copied().unwrap_or(1.0) as f32;
                1.0 / (factor * power)
            })
            .collect()
    }
}

/// transformers ≥ 5's `rope_parameters` object, if the config has one.
fn rope_parameters(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    obj.get("rope_parameters")?.as_object().cloned()
}

/// RoPE's inverse frequencies for `base` and heads of width `d`, rounded as transformers
/// rounds them (see [`LlamaConfig::inv_freq`]).
fn inv_freq_of(base: f64, d: usize) -> Vec<f32> {
    (0..d / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / d as f32;
            1.0 / base.powf(f64::from(exponent)) as f32
        })
        .collect()
}
