//! The Llama architecture settings, read from a Hugging Face `config.json`.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// `rope_scaling` of Llama 3 style checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// Must be `llama3` (other kinds are refused at load).
    #[serde(alias = "type")]
    pub rope_type: String,
    /// Context extension factor.
    pub factor: f64,
    /// Wavelength boundary (low frequencies).
    #[serde(default = "one")]
    pub low_freq_factor: f64,
    /// Wavelength boundary (high frequencies).
    #[serde(default = "four")]
    pub high_freq_factor: f64,
    /// Context length the base model was trained with.
    #[serde(default = "eight_k")]
    pub original_max_position_embeddings: usize,
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
fn max_pos_default() -> usize {
    2048
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
    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width when it differs from hidden/heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "eps_default")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "rope_theta_default")]
    pub rope_theta: f64,
    /// Llama 3 frequency scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Longest position the model supports.
    #[serde(default = "max_pos_default")]
    pub max_position_embeddings: usize,
    /// Whether `lm_head` shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Stored dtype (`float32`, `bfloat16`, `float16`).
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// Biases on attention projections (unsupported: Llama has none).
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on MLP projections (unsupported: Llama has none).
    #[serde(default)]
    pub mlp_bias: bool,
    /// Activation; only `silu` is supported.
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Model type; only `llama` is accepted (see `tuneq_pools::architecture_of`).
    #[serde(default)]
    pub model_type: Option<String>,
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
        tuneq_pools::architecture_of(&raw).map_err(|refusal| Error::Model {
            path: path.display().to_string(),
            message: refusal.to_string(),
        })?;
        let cfg: Self =
            serde_json::from_value(Self::normalise(raw)).map_err(|source| Error::Json {
                path: path.display().to_string(),
                source,
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
    fn normalise(mut raw: serde_json::Value) -> serde_json::Value {
        let Some(obj) = raw.as_object_mut() else {
            return raw;
        };
        let Some(params) = obj
            .get("rope_parameters")
            .and_then(|p| p.as_object())
            .cloned()
        else {
            return raw;
        };
        if let Some(theta) = params.get("rope_theta")
            && !obj.contains_key("rope_theta")
        {
            obj.insert("rope_theta".into(), theta.clone());
        }
        let kind = params
            .get("rope_type")
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if kind != "default" && obj.get("rope_scaling").is_none_or(|v| v.is_null()) {
            let mut scaling = params.clone();
            scaling.remove("rope_theta");
            obj.insert("rope_scaling".into(), serde_json::Value::Object(scaling));
        }
        raw
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.num_attention_heads == 0 || self.num_hidden_layers == 0 || self.hidden_size == 0 {
            return Err(
                "hidden_size, num_attention_heads and num_hidden_layers must be positive".into(),
            );
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err("hidden_size must be divisible by num_attention_heads".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return Err("num_attention_heads must be a multiple of num_key_value_heads".into());
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err("head_dim must be even for rotary embeddings".into());
        }
        // The fields that change the maths (activation, biases, RoPE scaling kind) were
        // checked against the architecture's rules before parsing.
        Ok(())
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Input and output width of a target projection, by PEFT module name.
    pub fn projection_shape(&self, module: &str) -> Option<(usize, usize)> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.num_kv_heads() * self.head_dim();
        Some(match module {
            "q_proj" => (h, q),
            "k_proj" | "v_proj" => (h, kv),
            "o_proj" => (q, h),
            "gate_proj" | "up_proj" => (h, i),
            "down_proj" => (i, h),
            _ => return None,
        })
    }

    /// Inverse RoPE frequencies, with Llama 3 scaling when configured.
    ///
    /// Rounded the way transformers computes them (the exponent `2i/d` in float32, the
    /// power rounded to float32, its reciprocal in float32), not correctly: the exact
    /// form differs by one ulp in a third of the frequencies (11 of SmolLM2's 32), a
    /// difference every position's rotation then carries. This form gives PyTorch's bits
    /// but where its float32 `pow` is itself an ulp off (1 of 64 for θ = 10⁶, d = 128).
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim();
        let base: Vec<f32> = (0..d / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / d as f32;
                1.0 / self.rope_theta.powf(f64::from(exponent)) as f32
            })
            .collect();
        let Some(rs) = self
            .rope_scaling
            .as_ref()
            .filter(|r| r.rope_type == "llama3")
        else {
            return base;
        };
        let old = rs.original_max_position_embeddings as f64;
        let low_wavelen = old / rs.low_freq_factor;
        let high_wavelen = old / rs.high_freq_factor;
        base.into_iter()
            .map(f64::from)
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let scaled = if wavelen > low_wavelen {
                    f / rs.factor
                } else if wavelen < high_wavelen {
                    f
                } else {
                    let smooth = (old / wavelen - rs.low_freq_factor)
                        / (rs.high_freq_factor - rs.low_freq_factor);
                    (1.0 - smooth) * f / rs.factor + smooth * f
                };
                scaled as f32
            })
            .collect()
    }
}
