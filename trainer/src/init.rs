//! `tuneq model init`: tiny and small Llama (or Qwen2, Qwen3) models with random weights
//! and a real tokenizer, in the Hugging Face layout, for tests, demos and benchmarks —
//! nothing is downloaded.

use crate::config::{LayerType, LlamaConfig, RopeScaling, TokenIds};
use crate::error::{Error, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use std::collections::BTreeMap;
use std::path::Path;
use tuneq_pools::{Architecture, ModelShape};

/// Model sizes `tuneq model init` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// vocab 4096, hidden 256, intermediate 688, 4 layers, 8 heads, 4 KV heads (≈5 M parameters).
    Tiny,
    /// vocab 32000, hidden 768, intermediate 2048, 12 layers, 12 heads (≈134 M parameters).
    Small,
    /// SmolLM2-135M's shape: vocab 49152, hidden 576, intermediate 1536, 30 layers, 9
    /// heads, 3 KV heads, tied embeddings (≈135 M parameters); for sizing a real model
    /// without downloading it.
    Smollm2,
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            "smollm2-135m" => Ok(Preset::Smollm2),
            other => Err(format!(
                "unknown preset {other:?}; use tiny, small or smollm2-135m"
            )),
        }
    }
}

/// Options of `tuneq model init`.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Size.
    pub preset: Preset,
    /// Seed of the weights.
    pub seed: u64,
    /// Number of safetensors shards (1 = a single `model.safetensors`).
    pub shards: usize,
    /// Share the embedding matrix with `lm_head`.
    pub tie_embeddings: bool,
    /// Write a Llama 3 `rope_scaling` block (factor 8) into the config.
    pub llama3_rope: bool,
    /// The family: Llama, Qwen2 (the same shapes, with q/k/v biases), Qwen3 (with q/k
    /// head norms), Mistral (Llama's maths, no sliding window), Gemma 2 or Gemma 3 (with
    /// a sliding window of 1/32 of the context on alternate layers, so that windows bind
    /// in tests of a few dozen tokens).
    pub architecture: tuneq_pools::Architecture,
}

impl InitOptions {
    /// The tiny preset from seed 0 in one file: the demo model `tuneq up` and
    /// `tuneq demo` write on first use.
    pub fn demo() -> Self {
        Self {
            preset: Preset::Tiny,
            seed: 0,
            shards: 1,
            tie_embeddings: false,
            llama3_rope: false,
            architecture: tuneq_pools::Architecture::Llama,
        }
    }
}

/// The config a preset stands for.
pub fn preset_config(opts: &InitOptions) -> LlamaConfig {
    let (vocab, hidden, inter, layers, heads, kv, max_pos) = match opts.preset {
        Preset::Tiny => (4096, 256, 688, 4, 8, 4, 1024),
        Preset::Small => (32000, 768, 2048, 12, 12, 12, 2048),
        Preset::Smollm2 => (49152, 576, 1536, 30, 9, 3, 8192),
    };
    let smollm2 = opts.preset == Preset::Smollm2;
    let architecture = opts.architecture;
    let head_dim = hidden / heads;
    let gemma = architecture.gemma();
    let alternating = |layers: u64| -> Vec<LayerType> {
        (0..layers)
            .map(|l| match l % 2 {
                0 => LayerType::SlidingAttention,
                _ => LayerType::FullAttention,
            })
            .collect()
    };
    LlamaConfig {
        shape: ModelShape {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv),
            head_dim: Some(hidden / heads),
            max_position_embeddings: Some(max_pos),
            tie_word_embeddings: opts.tie_embeddings || smollm2,
            torch_dtype: Some("float32".into()),
            sliding_window: gemma.then_some(max_pos / 32),
            model_type: Some(opts.architecture.model_type().into()),
            added_tokens: None,
            merges: None,
        },
        rms_norm_eps: 1e-5,
        // Gemma 3's global layers rotate with their own base, unlike its local ones.
        rope_theta: match (smollm2, architecture) {
            (true, _) => 100000.0,
            (false, Architecture::Gemma3) => 1_000_000.0,
            (false, _) => 10000.0,
        },
        rope_scaling: match architecture {
            // A pretraining context short enough that a test's prompt and answer cross
            // it (from the short factors to the long ones).
            Architecture::Phi3 => Some(longrope(head_dim * 3 / 4, max_pos / 32)),
            _ => opts.llama3_rope.then(|| RopeScaling {
                rope_type: "llama3".into(),
                factor: Some(8.0),
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 256,
                short_factor: None,
                long_factor: None,
                attention_factor: None,
            }),
        },
        bos_token_id: Some(TokenIds::One(1)),
        eos_token_id: Some(TokenIds::One(2)),
        attention_bias: false,
        mlp_bias: false,
        hidden_act: (!gemma).then(|| "silu".into()),
        hidden_activation: gemma.then(|| "gelu_pytorch_tanh".into()),
        // Unlike head_dim, so that a scale taken from the wrong one shows.
        query_pre_attn_scalar: gemma.then_some((head_dim + head_dim / 2) as f64),
        attn_logit_softcapping: (architecture == Architecture::Gemma2).then_some(50.0),
        final_logit_softcapping: (architecture == Architecture::Gemma2).then_some(30.0),
        layer_types: gemma.then(|| alternating(layers)),
        rope_local_base_freq: (architecture == Architecture::Gemma3).then_some(10000.0),
        // Phi-4-mini's: three quarters of each head rotate.
        partial_rotary_factor: (architecture == Architecture::Phi3).then_some(0.75),
    }
}

/// LongRoPE as Phi-4-mini scales it, over `rotated` dims of each head, for a context
/// extended from `original` positions: short factors near one, long ones growing with
/// the wavelength (made-up values of the published shape, distinct so that a factor
/// applied to the wrong frequency shows).
fn longrope(rotated: u64, original: u64) -> RopeScaling {
    let half = rotated / 2;
    let factors = |step: f64| (0..half).map(|i| 1.0 + step * i as f64).collect::<Vec<_>>();
    RopeScaling {
        rope_type: "longrope".into(),
        factor: None,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: original as usize,
        short_factor: Some(factors(0.02)),
        long_factor: Some(factors(0.5)),
        attention_factor: None,
    }
}

/// N(0, std²) samples from a seeded ChaCha20 stream (Box–Muller).
fn normal(rng: &mut ChaCha20Rng, n: usize, std: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        out.push((r * t.cos()) as f32 * std);
        if out.len() < n {
            out.push((r * t.sin()) as f32 * std);
        }
    }
    out
}

/// Writes a complete model folder to `out`.
pub fn write_model(opts: &InitOptions, out: &Path) -> Result<LlamaConfig> {
    if opts.shards == 0 {
        return Err(Error::Model {
            path: out.display().to_string(),
            message: "--shards must be at least 1".into(),
        });
    }
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let cfg = preset_config(opts);
    let tensors = random_weights(&cfg, opts.seed)?;
    write_weights(out, tensors, opts.shards)?;
    write_json(&out.join("config.json"), &hf_config_json(&cfg))?;
    write_json(
        &out.join("generation_config.json"),
        &serde_json::json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 5, "do_sample": false}),
    )?;
    crate::data::write_tokenizer_files(out, cfg.vocab_size(), cfg.max_position_embeddings())?;
    Ok(cfg)
}

/// `config.json` as `transformers` writes it for the family's causal LM
/// (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`).
pub fn hf_config_json(cfg: &LlamaConfig) -> serde_json::Value {
    let mut v = serde_json::to_value(cfg).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        let architecture = cfg.architecture();
        o.insert(
            "architectures".into(),
            serde_json::json!([architecture.causal_lm_class()]),
        );
        o.insert("initializer_range".into(), serde_json::json!(0.02));
        o.insert("pad_token_id".into(), serde_json::json!(5));
        o.insert("use_cache".into(), serde_json::json!(true));
        o.insert("attention_dropout".into(), serde_json::json!(0.0));
        o.insert("pretraining_tp".into(), serde_json::json!(1));
        o.retain(|_, v| !v.is_null());
        // The family's own fields (biases and norms are not fields), without the Llama
        // bias flags it does not read.
        use tuneq_pools::Architecture::{Gemma2, Gemma3, Llama, Mistral, Phi3, Qwen2, Qwen3};
        match architecture {
            Gemma2 | Gemma3 => {
                o.remove("mlp_bias");
                // Absent, a soft-cap would be the config class's default (Gemma 2's 50
                // and 30): none is written as null.
                for field in ["attn_logit_softcapping", "final_logit_softcapping"] {
                    o.entry(field).or_insert(serde_json::Value::Null);
                }
                // transformers' config class takes this scalar as an int only.
                if let Some(scalar) = cfg.query_pre_attn_scalar.filter(|s| s.fract() == 0.0) {
                    o.insert("query_pre_attn_scalar".into(), (scalar as u64).into());
                }
            }
            Llama => {}
            Qwen2 | Qwen3 => {
                o.insert("use_sliding_window".into(), serde_json::json!(false));
                let layers = cfg.shape.num_hidden_layers;
                o.insert("max_window_layers".into(), layers.into());
                o.remove("mlp_bias");
                if architecture == Qwen2 {
                    o.remove("attention_bias");
                }
            }
            Mistral => {
                o.remove("attention_bias");
                o.remove("mlp_bias");
                // No window: absent, transformers' MistralConfig would make it 4096.
                o.insert("sliding_window".into(), serde_json::Value::Null);
            }
            Phi3 => {
                o.remove("attention_bias");
                o.remove("mlp_bias");
                o.remove("pretraining_tp");
                o.insert("resid_pdrop".into(), serde_json::json!(0.0));
                o.insert("embd_pdrop".into(), serde_json::json!(0.0));
                // As Phi-3's published configs: the pretraining context beside
                // `rope_scaling`, which holds the kind and the two factor lists.
                if let Some(rs) = &cfg.rope_scaling {
                    o.insert(
                        "original_max_position_embeddings".into(),
                        rs.original_max_position_embeddings.into(),
                    );
                    o.insert(
                        "rope_scaling".into(),
                        serde_json::json!({
                            "type": rs.rope_type,
                            "short_factor": rs.short_factor,
                            "long_factor": rs.long_factor,
                        }),
                    );
                }
            }
        }
    }
    v
}

pub(crate) fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(v).map_err(|source| Error::Json {
        path: path.display().to_string(),
        source,
    })?;
    tuneq_storage::local::write_atomic(path, &bytes)?;
    Ok(())
}

/// Writes tensors as one file or `shards` files plus an index, in the given order.
pub fn write_weights(out: &Path, tensors: Vec<(String, Tensor)>, shards: usize) -> Result<()> {
    if shards <= 1 {
        let map: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        return crate::weights::save_safetensors(&out.join("model.safetensors"), &map);
    }
    let total: usize = tensors
        .iter()
        .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    let target = total.div_ceil(shards);
    let mut groups: Vec<BTreeMap<String, Tensor>> = vec![BTreeMap::new(); shards];
    let (mut g, mut filled) = (0usize, 0usize);
    for (name, t) in tensors {
        let size = t.elem_count() * t.dtype().size_in_bytes();
        if filled > 0 && filled + size > target && g + 1 < shards {
            g += 1;
            filled = 0;
        }
        filled += size;
        groups[g].insert(name, t);
    }
    let mut weight_map = BTreeMap::new();
    for (k, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", k + 1, shards);
        for name in group.keys() {
            weight_map.insert(name.clone(), file.clone());
        }
        crate::weights::save_safetensors(&out.join(&file), group)?;
    }
    write_json(
        &out.join("model.safetensors.index.json"),
        &serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
    )
}

/// An f32 CPU model of `cfg` with [`random_weights`] from `seed`, held in memory (no
/// folder), with fresh LoRA factors when `lora` is given: for benchmarks and tests.
pub fn random_model(
    cfg: LlamaConfig,
    seed: u64,
    lora: Option<(&crate::lora::LoraSettings, &mut ChaCha20Rng)>,
) -> Result<crate::model::Llama> {
    random_model_in(cfg, seed, lora, candle_core::DType::F32)
}

/// [`random_model`] with its frozen weights held in `dtype` (f32, or bf16: rounded).
pub fn random_model_in(
    cfg: LlamaConfig,
    seed: u64,
    lora: Option<(&crate::lora::LoraSettings, &mut ChaCha20Rng)>,
    dtype: candle_core::DType,
) -> Result<crate::model::Llama> {
    let tensors = random_weights_in(&cfg, seed, dtype)?;
    let mut map = crate::weights::WeightMap::from_tensors(tensors, "random");
    crate::model::Llama::from_weights(cfg, &mut map, dtype, &Device::Cpu, lora)
}

/// Random weights for `cfg` by Hugging Face name: N(0, 0.02) matrices (as HF's
/// `initializer_range`), norm weights near 1, drawn from a ChaCha20 stream seeded by `seed`.
pub fn random_weights(cfg: &LlamaConfig, seed: u64) -> Result<Vec<(String, Tensor)>> {
    random_weights_in(cfg, seed, candle_core::DType::F32)
}

/// [`random_weights`] converted to `dtype` as they are drawn (as `WeightMap::load`
/// converts a folder's), so at most one matrix is ever held in f32 besides them: the
/// bf16 benchmark's peak memory is that of a bf16 model.
fn random_weights_in(
    cfg: &LlamaConfig,
    seed: u64,
    dtype: candle_core::DType,
) -> Result<Vec<(String, Tensor)>> {
    let (h, v) = (cfg.hidden_size(), cfg.vocab_size());
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let dev = Device::Cpu;
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut rand_t = |name: String, shape: (usize, usize), rng: &mut ChaCha20Rng| -> Result<()> {
        let data = normal(rng, shape.0 * shape.1, 0.02);
        tensors.push((name, Tensor::from_vec(data, shape, &dev)?.to_dtype(dtype)?));
        Ok(())
    };
    rand_t("model.embed_tokens.weight".into(), (v, h), &mut rng)?;
    for l in 0..cfg.num_hidden_layers() {
        for (module, proj) in crate::model::layer_projections(cfg.architecture()) {
            let (in_dim, out_dim) = cfg.projection_shape(proj).unwrap_or((h, h));
            rand_t(
                format!("model.layers.{l}.{module}.{proj}.weight"),
                (out_dim, in_dim),
                &mut rng,
            )?;
        }
    }
    if !cfg.tie_word_embeddings() {
        rand_t("lm_head.weight".into(), (v, h), &mut rng)?;
    }
    // Norm weights are ones in HF's init; perturb them slightly so tests notice a norm that is skipped.
    for l in 0..cfg.num_hidden_layers() {
        for n in ["input_layernorm", "post_attention_layernorm"] {
            let data: Vec<f32> = normal(&mut rng, h, 0.1)
                .into_iter()
                .map(|x| 1.0 + x)
                .collect();
            tensors.push((
                format!("model.layers.{l}.{n}.weight"),
                Tensor::from_vec(data, h, &dev)?.to_dtype(dtype)?,
            ));
        }
    }
    let data: Vec<f32> = normal(&mut rng, h, 0.1)
        .into_iter()
        .map(|x| 1.0 + x)
        .collect();
    tensors.push((
        "model.norm.weight".into(),
        Tensor::from_vec(data, h, &dev)?.to_dtype(dtype)?,
    ));
    // Qwen3's q/k head norms and Qwen2's q/k/v biases, drawn last (a Llama's weights are
    // the same either way), far enough from one and zero that one that is skipped shows.
    if cfg.architecture().qk_norm() {
        let hd = cfg.head_dim();
        for l in 0..cfg.num_hidden_layers() {
            for norm in ["q_norm", "k_norm"] {
                let data: Vec<f32> = normal(&mut rng, hd, 0.1)
                    .into_iter()
                    .map(|x| 1.0 + x)
                    .collect();
                tensors.push((
                    format!("model.layers.{l}.self_attn.{norm}.weight"),
                    Tensor::from_vec(data, hd, &dev)?.to_dtype(dtype)?,
                ));
            }
        }
    }
    // Gemma's norms after attention's and the MLP's outputs.
    if cfg.architecture().gemma() {
        for l in 0..cfg.num_hidden_layers() {
            for n in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                let data = normal(&mut rng, h, 0.1);
                tensors.push((
                    format!("model.layers.{l}.{n}.weight"),
                    Tensor::from_vec(data, h, &dev)?.to_dtype(dtype)?,
                ));
            }
        }
    }
    if cfg.architecture().qkv_bias() {
        for l in 0..cfg.num_hidden_layers() {
            for proj in ["q_proj", "k_proj", "v_proj"] {
                let out_dim = cfg.projection_shape(proj).map_or(h, |(_, out)| out);
                tensors.push((
                    format!("model.layers.{l}.self_attn.{proj}.bias"),
                    Tensor::from_vec(normal(&mut rng, out_dim, 0.1), out_dim, &dev)?
                        .to_dtype(dtype)?,
                ));
            }
        }
    }

    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// A random model asked for in bf16 holds its frozen weights in bf16, rounded from
    /// the f32 model's: the bf16 benchmark once measured f32-stored weights because they
    /// were never converted.
    #[test]
    fn a_random_model_in_bf16_holds_the_f32_models_weights_rounded() {
        let opts = InitOptions {
            preset: Preset::Tiny,
            seed: 5,
            shards: 1,
            tie_embeddings: false,
            llama3_rope: false,
            architecture: tuneq_pools::Architecture::Llama,
        };
        let model = |dtype| random_model_in(preset_config(&opts), 5, None, dtype).expect("model");
        let (f32_model, bf16_model) = (model(DType::F32), model(DType::BF16));
        for (f, b) in f32_model.layers.iter().zip(&bf16_model.layers) {
            for (f, b) in f.projections.iter().zip(&b.projections) {
                assert_eq!(
                    (f.weight.dtype(), b.weight.dtype()),
                    (DType::F32, DType::BF16)
                );
                let rounded = f.weight.to_dtype(DType::BF16).expect("rounded");
                let same = rounded
                    .eq(&b.weight)
                    .and_then(|t| t.to_dtype(DType::F32)?.min_all()?.to_scalar::<f32>())
                    .expect("compared");
                assert_eq!(same, 1.0, "a bf16 weight is not the f32 one rounded");
            }
        }
    }

    /// What registration checks a folder's weights against
    /// (`ModelShape::expected_tensors`) is what the loader takes: the tensors a random
    /// model of every family is written with (and loads from), name for name and shape
    /// for shape, tied and untied.
    #[test]
    fn registration_expects_the_tensors_the_loader_takes_for_every_family() {
        for architecture in tuneq_pools::Architecture::ALL {
            for tie_embeddings in [false, true] {
                let opts = InitOptions {
                    architecture,
                    tie_embeddings,
                    ..InitOptions::demo()
                };
                let cfg = preset_config(&opts);
                let mut written: Vec<(String, Vec<u64>)> = random_weights(&cfg, 0)
                    .expect("weights")
                    .into_iter()
                    .map(|(name, t)| (name, t.dims().iter().map(|&d| d as u64).collect()))
                    .collect();
                let mut expected: Vec<(String, Vec<u64>)> = cfg
                    .shape
                    .expected_tensors()
                    .into_iter()
                    .map(|t| (t.name, t.shape))
                    .collect();
                written.sort();
                expected.sort();
                assert_eq!(written, expected, "{architecture:?}, tied {tie_embeddings}");
            }
        }
    }

    #[test]
    fn a_qwen2_model_is_written_with_its_biases_and_loads_as_qwen2() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = InitOptions {
            architecture: tuneq_pools::Architecture::Qwen2,
            ..InitOptions::demo()
        };
        write_model(&opts, dir.path()).expect("written");
        let config: serde_json::Value =
            crate::error::read_json(&dir.path().join("config.json")).expect("config");
        assert_eq!(config["model_type"], "qwen2");
        assert_eq!(config["architectures"][0], "Qwen2ForCausalLM");
        assert_eq!(tuneq_pools::architecture_of(&config), Ok(opts.architecture));
        let model =
            crate::model::Llama::load(dir.path(), DType::F32, &Device::Cpu, None).expect("loaded");
        assert_eq!(model.cfg.architecture(), tuneq_pools::Architecture::Qwen2);
        let biased: Vec<bool> = model.layers[0]
            .projections
            .iter()
            .map(|p| p.bias.is_some())
            .collect();
        assert_eq!(biased, [true, true, true, false, false, false, false]);
        // The Llama of the same seed has the same weights, without the biases.
        let llama = random_weights(&preset_config(&InitOptions::demo()), 0).expect("llama");
        let qwen = random_weights(&preset_config(&opts), 0).expect("qwen");
        assert_eq!(qwen.len(), llama.len() + 3 * model.layers.len());
    }

    #[test]
    fn a_qwen3_model_is_written_with_its_head_norms_and_loads_as_qwen3() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = InitOptions {
            architecture: tuneq_pools::Architecture::Qwen3,
            ..InitOptions::demo()
        };
        write_model(&opts, dir.path()).expect("written");
        let config: serde_json::Value =
            crate::error::read_json(&dir.path().join("config.json")).expect("config");
        assert_eq!(config["architectures"][0], "Qwen3ForCausalLM");
        assert_eq!(config["attention_bias"], false);
        assert_eq!(tuneq_pools::architecture_of(&config), Ok(opts.architecture));
        let model =
            crate::model::Llama::load(dir.path(), DType::F32, &Device::Cpu, None).expect("loaded");
        assert!((0..model.layers.len()).all(|l| model.qk_norm(l).is_some()));
        assert!(model.layers[0].projections.iter().all(|p| p.bias.is_none()));
    }
}
