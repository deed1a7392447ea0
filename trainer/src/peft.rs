//! The PEFT adapter format: `adapter_config.json` + `adapter_model.safetensors`.
//!
//! Tensor names are PEFT's (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`)
//! and the config carries exactly what PEFT, vLLM and LoRAX read, so an adapter written
//! here loads unchanged with `PeftModel.from_pretrained` and in serving stacks.

use crate::error::{Error, Result};
use crate::lora::LoraSettings;
use crate::model::Llama;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// File name of the adapter config.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// File name of the adapter tensors.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// `adapter_config.json`, with the fields every loader needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterConfig {
    /// Always `LORA`.
    pub peft_type: String,
    /// Always `CAUSAL_LM`.
    #[serde(default)]
    pub task_type: Option<String>,
    /// The base model this adapter was trained on.
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// Rank.
    pub r: usize,
    /// Scaling numerator.
    pub lora_alpha: f64,
    /// Dropout used in training.
    #[serde(default)]
    pub lora_dropout: f64,
    /// Adapted projections.
    pub target_modules: Vec<String>,
    /// Always `none`.
    #[serde(default = "none")]
    pub bias: String,
    /// alpha/√r scaling.
    #[serde(default)]
    pub use_rslora: bool,
    /// Always false.
    #[serde(default)]
    pub use_dora: bool,
    /// Always false (Llama linears are not transposed).
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// Always null (vLLM refuses adapters that save extra modules).
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    /// PEFT's default init.
    #[serde(default = "yes")]
    pub init_lora_weights: bool,
    /// Written adapters are for inference.
    #[serde(default = "yes")]
    pub inference_mode: bool,
    /// Per-module ranks (unused, empty).
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, usize>,
    /// Per-module alphas (unused, empty).
    #[serde(default)]
    pub alpha_pattern: BTreeMap<String, f64>,
    /// Base model revision (unknown).
    #[serde(default)]
    pub revision: Option<String>,
}

fn none() -> String {
    "none".into()
}
fn yes() -> bool {
    true
}

impl AdapterConfig {
    /// The config for adapters trained with `settings` on `base`.
    pub fn new(settings: &LoraSettings, base: &str) -> Self {
        Self {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            base_model_name_or_path: Some(base.to_string()),
            r: settings.r,
            lora_alpha: settings.alpha,
            lora_dropout: settings.dropout,
            target_modules: settings.targets.clone(),
            bias: "none".into(),
            use_rslora: settings.rslora,
            use_dora: false,
            fan_in_fan_out: false,
            modules_to_save: None,
            init_lora_weights: true,
            inference_mode: true,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            revision: None,
        }
    }

    /// LoRA settings this adapter implies; refuses features we do not implement.
    pub fn settings(&self, source: &str) -> Result<LoraSettings> {
        let refuse = |message: String| {
            Err(Error::Model {
                path: source.to_string(),
                message,
            })
        };
        if self.peft_type != "LORA" {
            return refuse(format!("peft_type {:?} is not LORA", self.peft_type));
        }
        if self.use_dora || self.bias != "none" || self.fan_in_fan_out {
            return refuse("DoRA, LoRA biases and fan_in_fan_out are not supported".into());
        }
        if !self.rank_pattern.is_empty() || !self.alpha_pattern.is_empty() {
            return refuse("rank_pattern/alpha_pattern are not supported".into());
        }
        Ok(LoraSettings {
            r: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets: self.target_modules.clone(),
            rslora: self.use_rslora,
        })
    }
}

/// Writes the model's LoRA factors as a PEFT adapter into `dir` (config first, weights
/// atomically), f32 as trained.
pub fn save_adapter(model: &Llama, settings: &LoraSettings, base: &str, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    let cfg = AdapterConfig::new(settings, base);
    let json = serde_json::to_vec_pretty(&cfg).map_err(|source| Error::Json {
        path: ADAPTER_CONFIG.into(),
        source,
    })?;
    tuneq_storage::local::write_atomic(&dir.join(ADAPTER_CONFIG), &json)?;
    let tensors: BTreeMap<String, Tensor> = model
        .lora_vars()
        .into_iter()
        .map(|v| (v.name, v.var.as_tensor().clone()))
        .collect();
    crate::weights::save_safetensors(&dir.join(ADAPTER_WEIGHTS), &tensors)
}

/// Reads a PEFT adapter folder: its settings and tensors by PEFT key.
pub fn load_adapter(
    dir: &Path,
    device: &Device,
) -> Result<(LoraSettings, HashMap<String, Tensor>)> {
    let cfg_path = dir.join(ADAPTER_CONFIG);
    if !cfg_path.is_file() {
        return Err(Error::Model {
            path: dir.display().to_string(),
            message: format!("{ADAPTER_CONFIG} not found"),
        });
    }
    let cfg: AdapterConfig = crate::error::read_json(&cfg_path)?;
    let settings = cfg.settings(&cfg_path.display().to_string())?;
    let mut tensors = crate::weights::load_safetensors(&dir.join(ADAPTER_WEIGHTS), device)?;
    // PEFT also accepts keys with the adapter name (`lora_A.default.weight`); normalise them.
    let renamed: Vec<(String, String)> = tensors
        .keys()
        .filter(|k| k.contains(".default.weight"))
        .map(|k| (k.clone(), k.replace(".default.weight", ".weight")))
        .collect();
    for (old, new) in renamed {
        if let Some(t) = tensors.remove(&old) {
            tensors.insert(new, t);
        }
    }
    Ok((settings, tensors))
}
