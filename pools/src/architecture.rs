//! Which model architectures tuneq trains, decided from a model's `config.json`.
//!
//! tuneq implements the Llama decoder (Llama 2/3.x, SmolLM2, TinyLlama). Other families
//! look alike on paper — the same field names for the same shapes — but differ in the
//! maths (biases on q/k/v, per-head norms, GeGLU, soft-capping, sliding windows, fused
//! projections), and a loader that ignores what it does not know trains them wrongly and
//! silently. So a config is accepted only when its `model_type` is on the allow-list
//! ([`Architecture`]) and every field that changes the maths holds a value tuneq
//! implements; everything else is refused naming the architecture or the field
//! ([`Unsupported`]). Registration, job creation and the trainer's loader all ask
//! [`architecture_of`], so the three can never disagree.
//!
//! Fields tuneq does not know and transformers' Llama does not read either (metadata such
//! as `transformers_version`, `initializer_range`, `use_cache`) are not maths and pass.

use serde_json::Value;

/// A model architecture tuneq trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `model_type: "llama"` (`LlamaForCausalLM`).
    Llama,
}

impl Architecture {
    /// Every architecture tuneq trains.
    pub const ALL: [Architecture; 1] = [Architecture::Llama];

    /// Its `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
        }
    }

    /// The `architectures` entry transformers writes for its causal language model.
    pub fn causal_lm_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
        }
    }

    fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == model_type)
    }
}

/// The longest piece of a config value repeated in a refusal: the file is the operator's,
/// but a message is no place for a whole document.
const SHOWN_CHARS: usize = 64;

/// Why a model's `config.json` is not one tuneq can train.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unsupported {
    /// The file is not a JSON object.
    #[error("config.json is not a JSON object")]
    NotAnObject,
    /// No `model_type`: transformers itself cannot tell which model it is.
    #[error(
        "config.json names no model_type; tuneq trains {} models (a config written by transformers names its type)",
        supported()
    )]
    NoModelType,
    /// A `model_type` tuneq does not implement.
    #[error(
        "the {model_type:?} architecture is not supported: tuneq trains {} models",
        supported()
    )]
    ModelType {
        /// The `model_type` the config names (shortened).
        model_type: String,
    },
    /// An `architectures` entry that is not the family's causal language model.
    #[error(
        "architectures names {class:?}, which is not supported: tuneq trains {expected} models"
    )]
    Class {
        /// The class named (shortened).
        class: String,
        /// The class tuneq trains for this `model_type`.
        expected: &'static str,
    },
    /// A field whose value changes the maths in a way tuneq does not implement.
    #[error("config.json field {field} = {value} is not supported: {why}")]
    Field {
        /// The field's name (a dotted path inside nested objects).
        field: &'static str,
        /// Its value as written (shortened).
        value: String,
        /// What tuneq implements instead.
        why: &'static str,
    },
}

impl Unsupported {
    /// The `config.json` field the refusal is about.
    pub fn field(&self) -> &'static str {
        match self {
            Unsupported::NotAnObject => "config.json",
            Unsupported::NoModelType | Unsupported::ModelType { .. } => "model_type",
            Unsupported::Class { .. } => "architectures",
            Unsupported::Field { field, .. } => field,
        }
    }
}

fn supported() -> String {
    Architecture::ALL
        .iter()
        .map(|a| format!("{:?}", a.model_type()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn shown(text: &str) -> String {
    let mut out: String = text.chars().take(SHOWN_CHARS).collect();
    if text.chars().nth(SHOWN_CHARS).is_some() {
        out.push('…');
    }
    out
}

fn shown_value(value: &Value) -> String {
    shown(&value.to_string())
}

/// A rule on one field: the values of it that tuneq implements, and what to say otherwise.
struct Rule {
    field: &'static str,
    implemented: fn(&Value) -> bool,
    why: &'static str,
}

fn is_absent_or(value: &Value, ok: impl Fn(&Value) -> bool) -> bool {
    value.is_null() || ok(value)
}

/// The fields transformers' Llama reads that change its maths, with the values tuneq
/// implements. (Shapes, `rms_norm_eps`, `rope_theta`, `tie_word_embeddings` and the token
/// ids are implemented for every value and are checked for consistency by the loader.)
const LLAMA_RULES: &[Rule] = &[
    Rule {
        field: "hidden_act",
        implemented: |v| is_absent_or(v, |v| v == "silu"),
        why: "the MLP's activation is SiLU",
    },
    Rule {
        field: "attention_bias",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "the attention projections have no bias",
    },
    Rule {
        field: "mlp_bias",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "the MLP projections have no bias",
    },
    Rule {
        field: "attention_dropout",
        implemented: |v| is_absent_or(v, |v| v.as_f64() == Some(0.0)),
        why: "dropout on the attention weights is not implemented (LoRA dropout is)",
    },
    Rule {
        field: "rope_scaling",
        implemented: |v| is_absent_or(v, rope_kind_is_implemented),
        why: "RoPE scaling of kind \"llama3\" (or none) is implemented",
    },
    Rule {
        field: "rope_parameters",
        implemented: |v| is_absent_or(v, rope_kind_is_implemented),
        why: "RoPE scaling of kind \"llama3\" (or \"default\") is implemented",
    },
];

/// Fields of other families that change their maths. Transformers' Llama would ignore
/// them, but a Llama config that sets one was almost surely written for another model
/// (or edited by hand), and training it as Llama would be silently wrong: refused unless
/// they hold their neutral value.
const FOREIGN_RULES: &[Rule] = &[
    Rule {
        field: "hidden_activation",
        implemented: Value::is_null,
        why: "a Gemma-style activation; Llama's is hidden_act = silu",
    },
    Rule {
        field: "sliding_window",
        implemented: Value::is_null,
        why: "sliding-window attention is not implemented (every layer attends to all earlier positions)",
    },
    Rule {
        field: "use_sliding_window",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "sliding-window attention is not implemented",
    },
    Rule {
        field: "attn_logit_softcapping",
        implemented: Value::is_null,
        why: "attention logit soft-capping is not implemented",
    },
    Rule {
        field: "final_logit_softcapping",
        implemented: Value::is_null,
        why: "final logit soft-capping is not implemented",
    },
    Rule {
        field: "query_pre_attn_scalar",
        implemented: Value::is_null,
        why: "attention is scaled by 1/sqrt(head_dim)",
    },
    Rule {
        field: "use_qk_norm",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "per-head norms on queries and keys are not implemented",
    },
    Rule {
        field: "qk_layernorm",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "per-head norms on queries and keys are not implemented",
    },
    Rule {
        field: "partial_rotary_factor",
        implemented: |v| is_absent_or(v, |v| v.as_f64() == Some(1.0)),
        why: "RoPE rotates the whole head",
    },
    Rule {
        field: "rope_interleaved",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "RoPE rotates the head's two halves (transformers' layout), not interleaved pairs",
    },
    Rule {
        field: "qkv_bias",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "the attention projections have no bias",
    },
];

/// Whether a `rope_scaling` / `rope_parameters` object asks for a kind tuneq implements.
fn rope_kind_is_implemented(value: &Value) -> bool {
    let Some(object) = value.as_object() else {
        return false;
    };
    let kind = object
        .get("rope_type")
        .or_else(|| object.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    matches!(kind, "default" | "llama3")
}

/// The architecture of the model whose parsed `config.json` is `config`, or why tuneq
/// cannot train it.
pub fn architecture_of(config: &Value) -> Result<Architecture, Unsupported> {
    let object = config.as_object().ok_or(Unsupported::NotAnObject)?;
    let model_type = match object.get("model_type") {
        None | Some(Value::Null) => return Err(Unsupported::NoModelType),
        Some(Value::String(name)) => name,
        Some(other) => {
            return Err(Unsupported::ModelType {
                model_type: shown_value(other),
            });
        }
    };
    let architecture =
        Architecture::from_model_type(model_type).ok_or_else(|| Unsupported::ModelType {
            model_type: shown(model_type),
        })?;
    if let Some(classes) = object.get("architectures").filter(|v| !v.is_null()) {
        let expected = architecture.causal_lm_class();
        let named: Vec<&Value> = match classes {
            Value::Array(list) => list.iter().collect(),
            other => vec![other],
        };
        if let Some(wrong) = named.into_iter().find(|c| c.as_str() != Some(expected)) {
            return Err(Unsupported::Class {
                class: wrong.as_str().map_or_else(|| shown_value(wrong), shown),
                expected,
            });
        }
    }
    let rules = match architecture {
        Architecture::Llama => LLAMA_RULES.iter().chain(FOREIGN_RULES),
    };
    for rule in rules {
        let value = object.get(rule.field).unwrap_or(&Value::Null);
        if !(rule.implemented)(value) {
            return Err(Unsupported::Field {
                field: rule.field,
                value: shown_value(value),
                why: rule.why,
            });
        }
    }
    Ok(architecture)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Llama 3.2 1B's `config.json` as published.
    fn llama32() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
            "initializer_range": 0.02, "intermediate_size": 8192,
            "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
            "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256
        })
    }

    /// `config` with `field` set to `value`.
    fn with(mut config: Value, field: &str, value: Value) -> Value {
        config[field] = value;
        config
    }

    #[test]
    fn published_llama_configs_are_accepted() {
        assert_eq!(architecture_of(&llama32()), Ok(Architecture::Llama));
        // SmolLM2's carries fields of its own, at their neutral values.
        let smol = with(
            with(llama32(), "rope_interleaved", json!(false)),
            "is_llama_config",
            json!(true),
        );
        assert_eq!(architecture_of(&smol), Ok(Architecture::Llama));
        // transformers ≥ 5 writes rope_parameters.
        let v5 = with(
            llama32(),
            "rope_parameters",
            json!({"rope_type": "default", "rope_theta": 10000.0}),
        );
        assert_eq!(architecture_of(&v5), Ok(Architecture::Llama));
    }

    #[test]
    fn other_families_are_refused_by_name() {
        for family in ["qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"] {
            let config = with(llama32(), "model_type", json!(family));
            let refusal = architecture_of(&config).unwrap_err();
            assert_eq!(
                refusal,
                Unsupported::ModelType {
                    model_type: family.into()
                }
            );
            assert_eq!(refusal.field(), "model_type");
            let message = refusal.to_string();
            assert!(
                message.contains(family) && message.contains("\"llama\""),
                "{message}"
            );
        }
        let unnamed = llama32().as_object().map(|o| {
            let mut o = o.clone();
            o.remove("model_type");
            Value::Object(o)
        });
        assert_eq!(
            architecture_of(&unnamed.unwrap()),
            Err(Unsupported::NoModelType)
        );
    }

    #[test]
    fn a_llama_config_naming_another_class_is_refused() {
        let config = with(llama32(), "architectures", json!(["Qwen2ForCausalLM"]));
        let refusal = architecture_of(&config).unwrap_err();
        assert_eq!(refusal.field(), "architectures");
        assert!(refusal.to_string().contains("Qwen2ForCausalLM"));
    }

    #[test]
    fn fields_that_change_the_maths_are_refused_naming_the_field() {
        let cases = [
            ("hidden_act", json!("gelu_pytorch_tanh")),
            ("attention_bias", json!(true)),
            ("mlp_bias", json!(true)),
            ("attention_dropout", json!(0.1)),
            ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0})),
            ("rope_scaling", json!({"type": "linear", "factor": 2.0})),
            (
                "rope_parameters",
                json!({"rope_type": "dynamic", "factor": 2.0}),
            ),
            ("hidden_activation", json!("gelu_pytorch_tanh")),
            ("sliding_window", json!(4096)),
            ("use_sliding_window", json!(true)),
            ("attn_logit_softcapping", json!(50.0)),
            ("final_logit_softcapping", json!(30.0)),
            ("query_pre_attn_scalar", json!(256)),
            ("use_qk_norm", json!(true)),
            ("partial_rotary_factor", json!(0.75)),
            ("rope_interleaved", json!(true)),
        ];
        for (field, value) in cases {
            let refusal = architecture_of(&with(llama32(), field, value.clone())).unwrap_err();
            assert_eq!(refusal.field(), field, "{value}");
            assert!(refusal.to_string().contains(field), "{refusal}");
        }
        // Neutral values of foreign fields pass: a null sliding window is no window.
        for (field, value) in [
            ("sliding_window", Value::Null),
            ("use_sliding_window", json!(false)),
            ("partial_rotary_factor", json!(1.0)),
        ] {
            assert_eq!(
                architecture_of(&with(llama32(), field, value)),
                Ok(Architecture::Llama)
            );
        }
    }

    #[test]
    fn refusals_repeat_at_most_a_short_piece_of_the_value() {
        let long = "q".repeat(100_000);
        let refusal = architecture_of(&with(llama32(), "model_type", json!(long))).unwrap_err();
        assert!(
            refusal.to_string().len() < 300,
            "{}",
            refusal.to_string().len()
        );
        let refusal = architecture_of(&with(llama32(), "hidden_act", json!("x".repeat(100_000))))
            .unwrap_err();
        assert!(refusal.to_string().len() < 300);
        assert_eq!(
            architecture_of(&json!([1, 2])),
            Err(Unsupported::NotAnObject)
        );
    }
}
