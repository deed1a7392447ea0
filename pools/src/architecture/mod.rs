//! Which model architectures tuneq trains, decided from a model's `config.json`.
//!
//! tuneq implements the Llama decoder (Llama 2/3.x, SmolLM2, TinyLlama), Qwen2 (Qwen2,
//! Qwen2.5: Llama's decoder with a bias on the q, k and v projections), Qwen3 (Llama's
//! decoder with an RMSNorm on each query and key head), Mistral (Llama's decoder
//! with a sliding window on every layer), Phi-3 (q/k/v and gate/up fused, partial RoPE,
//! LongRoPE) and Gemma 2 and Gemma 3
//! text (a GeGLU MLP, `(1 + w)` norms around both halves of each layer, embeddings
//! scaled by √hidden, sliding-window layers beside global ones, soft-capped scores and
//! logits on Gemma 2, per-head norms and a local RoPE base on Gemma 3). Other families look
//! alike on paper — the same field names for the same shapes — but differ in the
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
    /// `model_type: "qwen2"` (`Qwen2ForCausalLM`: Qwen2, Qwen2.5): Llama's decoder with a
    /// bias on the q, k and v projections.
    Qwen2,
    /// `model_type: "qwen3"` (`Qwen3ForCausalLM`): Llama's decoder with an RMSNorm on
    /// each head of the queries and keys, before RoPE.
    Qwen3,
    /// `model_type: "mistral"` (`MistralForCausalLM`): Llama's decoder; its sliding
    /// window must be absent or at least the context (see [`architecture_of`]).
    Mistral,
    /// `model_type: "gemma2"` (`Gemma2ForCausalLM`): a GeGLU MLP (tanh-approximated
    /// GELU), `(1 + w)` RMSNorms before and after attention and the MLP, embeddings
    /// scaled by √hidden, attention scaled by `query_pre_attn_scalar`, soft-capped
    /// attention scores and final logits, sliding-window layers alternating with global
    /// ones.
    Gemma2,
    /// `model_type: "gemma3_text"` (`Gemma3ForCausalLM`): Gemma 2's decoder without the
    /// soft-capping (unless the config asks for it), with Qwen3-style norms on each query
    /// and key head, and a RoPE base of its own (`rope_local_base_freq`) on the
    /// sliding-window layers, five of every six by default.
    Gemma3,
    /// `model_type: "phi3"` (`Phi3ForCausalLM`: Phi-3, Phi-3.5-mini, Phi-4-mini): Llama's
    /// decoder with q, k and v fused into one `qkv_proj` and the MLP's gate and up into
    /// one `gate_up_proj`, RoPE on the first `partial_rotary_factor` of each head
    /// (Phi-4-mini's 0.75), LongRoPE scaling, and a sliding window when the config names
    /// one.
    Phi3,
}

impl Architecture {
    /// Every architecture tuneq trains.
    pub const ALL: [Architecture; 7] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Mistral,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Phi3,
    ];

    /// Its `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Mistral => "mistral",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Phi3 => "phi3",
        }
    }

    /// The `architectures` entry transformers writes for its causal language model.
    pub fn causal_lm_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
        }
    }

    /// Whether the q, k and v projections carry a bias (Qwen2's always do, whatever
    /// the config says: transformers' Qwen2 reads no field for it).
    pub fn qkv_bias(self) -> bool {
        matches!(self, Architecture::Qwen2)
    }

    /// Whether each query and key head is RMS-normalised before RoPE (Qwen3's `q_norm`
    /// and `k_norm`, `head_dim` weights each).
    pub fn qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Gemma3)
    }

    /// Whether it is a Gemma: every RMSNorm multiplies by `1 + w`, each half of a layer
    /// is normed before and after (`pre_feedforward_layernorm`,
    /// `post_feedforward_layernorm`), the MLP is GeGLU with tanh-approximated GELU, the
    /// embeddings are scaled by √hidden, attention by `query_pre_attn_scalar`, and
    /// layers may attend through a sliding window (see `layer_types`).
    pub fn gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }

    /// Whether a layer holds q, k and v as one `qkv_proj` and the MLP's gate and up as
    /// one `gate_up_proj` (Phi-3), which LoRA wraps whole.
    pub fn fuses_projections(self) -> bool {
        matches!(self, Architecture::Phi3)
    }

    /// A layer's projections, in PEFT's names and the layer's order.
    pub fn projections(self) -> &'static [&'static str] {
        match self.fuses_projections() {
            true => &tuneq_openapi::FUSED_PROJECTIONS,
            false => &tuneq_openapi::PROJECTIONS,
        }
    }

    /// The projections a job's `target_modules` (already checked to name known
    /// projections) wraps on a model of this family: the names themselves, each of
    /// which the model must have, except that naming all seven of a Llama's (the
    /// default) means every projection, which on Phi-3 is its four fused ones.
    pub fn lora_targets(self, requested: &[String]) -> Result<Vec<String>, WrongTargets> {
        let own = self.projections();
        if self.fuses_projections() && tuneq_openapi::projections::names_every_projection(requested)
        {
            return Ok(own.iter().map(|p| p.to_string()).collect());
        }
        match requested.iter().find(|m| !own.contains(&m.as_str())) {
            Some(missing) => Err(WrongTargets {
                module: shown(missing),
                architecture: self,
            }),
            None => Ok(requested.to_vec()),
        }
    }

    /// What transformers' config class sets for a field that a `config.json` leaves
    /// out, where that value changes the maths and differs from Llama's (for Gemma 2, a
    /// config without `final_logit_softcapping` soft-caps at 30; for Mistral, one without
    /// `sliding_window` has a window of 4096). [`with_class_defaults`] fills these in, so
    /// an absent field means what it means to transformers.
    pub fn defaults(self) -> Vec<(&'static str, Value)> {
        use serde_json::json;
        let gemma = [
            ("hidden_activation", json!("gelu_pytorch_tanh")),
            ("query_pre_attn_scalar", json!(256)),
            ("sliding_window", json!(4096)),
            ("tie_word_embeddings", json!(true)),
            ("rms_norm_eps", json!(1e-6)),
        ];
        match self {
            Architecture::Gemma2 => gemma
                .into_iter()
                .chain([
                    ("attn_logit_softcapping", json!(50.0)),
                    ("final_logit_softcapping", json!(30.0)),
                    ("rope_theta", json!(10000.0)),
                ])
                .collect(),
            Architecture::Gemma3 => gemma
                .into_iter()
                .chain([
                    ("rope_theta", json!(1_000_000.0)),
                    ("rope_local_base_freq", json!(10000.0)),
                ])
                .collect(),
            Architecture::Mistral => vec![("sliding_window", json!(MISTRAL_DEFAULT_WINDOW))],
            Architecture::Phi3 => vec![
                ("rms_norm_eps", json!(1e-5)),
                ("max_position_embeddings", json!(4096)),
                ("original_max_position_embeddings", json!(4096)),
            ],
            _ => Vec::new(),
        }
    }

    /// Whether layer `layer` of `layers` attends through the sliding window when the
    /// config names no `layer_types`: Gemma 2's even layers, Gemma 3's all but every
    /// `pattern`-th (its `sliding_window_pattern`, 6 by default); no layer of the
    /// other families.
    pub fn default_sliding(self, layer: usize, pattern: Option<u64>) -> bool {
        match self {
            Architecture::Gemma2 => layer.is_multiple_of(2),
            Architecture::Gemma3 => {
                let pattern = pattern.unwrap_or(6).max(1) as usize;
                !(layer + 1).is_multiple_of(pattern)
            }
            _ => false,
        }
    }

    /// The rules of its config's fields: what transformers' class reads that changes
    /// the maths, then the fields of other families.
    fn rules(self) -> impl Iterator<Item = &'static Rule> {
        // The Gemmas share their rules of Gemma's fields; the others refuse those fields.
        let (own, gemma): (&'static [Rule], &'static [Rule]) = match self {
            Architecture::Llama => (LLAMA_RULES, GEMMA_FIELDS),
            Architecture::Qwen2 => (QWEN2_RULES, GEMMA_FIELDS),
            Architecture::Qwen3 => (QWEN3_RULES, GEMMA_FIELDS),
            Architecture::Mistral => (MISTRAL_RULES, GEMMA_FIELDS),
            Architecture::Gemma2 => (GEMMA2_RULES, GEMMA_RULES),
            Architecture::Gemma3 => (GEMMA3_RULES, GEMMA_RULES),
            Architecture::Phi3 => (PHI3_RULES, GEMMA_FIELDS),
        };
        // A family's own rule of a field replaces the common one (Phi-3's partial RoPE).
        let foreign = FOREIGN_RULES
            .iter()
            .filter(move |f| !own.iter().any(|o| o.field == f.field));
        own.iter().chain(gemma).chain(foreign)
    }

    /// The architecture a `model_type` names, if tuneq trains it.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
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

/// The `model_type`s tuneq trains, quoted, for messages.
pub fn supported() -> String {
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

/// A job's `target_modules` names a projection its model does not have (a Llama's
/// `q_proj` on Phi-3, whose q, k and v are one `qkv_proj`, or the reverse).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "{module:?} is not a projection of a {} model, whose projections are {}",
    architecture.model_type(),
    architecture.projections().join(", ")
)]
pub struct WrongTargets {
    /// The module named (shortened).
    pub module: String,
    /// The model's architecture.
    pub architecture: Architecture,
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

/// The MLP's SiLU, which every family here has.
const SILU: Rule = Rule {
    field: "hidden_act",
    implemented: |v| is_absent_or(v, |v| v == "silu"),
    why: "the MLP's activation is SiLU",
};

const NO_ATTENTION_BIAS: Rule = Rule {
    field: "attention_bias",
    implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
    why: "the attention projections have no bias",
};

const NO_ATTENTION_DROPOUT: Rule = Rule {
    field: "attention_dropout",
    implemented: |v| is_absent_or(v, |v| v.as_f64() == Some(0.0)),
    why: "dropout on the attention weights is not implemented (LoRA dropout is)",
};

const ROPE_SCALING: Rule = Rule {
    field: "rope_scaling",
    implemented: |v| is_absent_or(v, rope_kind_is_implemented),
    why: "RoPE scaling of kind \"llama3\" (or none) is implemented",
};

const ROPE_PARAMETERS: Rule = Rule {
    field: "rope_parameters",
    implemented: |v| is_absent_or(v, rope_kind_is_implemented),
    why: "RoPE scaling of kind \"llama3\" (or \"default\") is implemented",
};

/// The Qwens' window switch (their `sliding_window` and `max_window_layers` are read
/// only with it).
const QWEN_NO_WINDOW: Rule = Rule {
    field: "use_sliding_window",
    implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
    why: "sliding-window attention is not implemented for the Qwens (every layer attends to all earlier positions, as their published configs ask)",
};

/// The fields transformers' Llama reads that change its maths, with the values tuneq
/// implements, and a window, which Llama's maths has not (the Qwens name one, read only
/// with their switch; Mistral's and Gemma's are theirs).
/// (Shapes, `rms_norm_eps`, `rope_theta`, `tie_word_embeddings` and the token ids are
/// implemented for every value and are checked for consistency by the loader.)
const LLAMA_RULES: &[Rule] = &[
    SILU,
    NO_ATTENTION_BIAS,
    Rule {
        field: "mlp_bias",
        implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
        why: "the MLP projections have no bias",
    },
    NO_ATTENTION_DROPOUT,
    ROPE_SCALING,
    ROPE_PARAMETERS,
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
];

/// Qwen2's (its q/k/v biases are not a field: always there).
const QWEN2_RULES: &[Rule] = &[
    SILU,
    NO_ATTENTION_DROPOUT,
    QWEN_NO_WINDOW,
    ROPE_SCALING,
    ROPE_PARAMETERS,
];

/// Qwen3's (its q/k norms are not a field: always there).
const QWEN3_RULES: &[Rule] = &[
    SILU,
    NO_ATTENTION_BIAS,
    NO_ATTENTION_DROPOUT,
    QWEN_NO_WINDOW,
    Rule {
        field: "layer_types",
        implemented: |v| {
            is_absent_or(v, |v| {
                v.as_array()
                    .is_some_and(|all| all.iter().all(|t| t == "full_attention"))
            })
        },
        why: "every layer attends to all earlier positions (full_attention)",
    },
    ROPE_SCALING,
    ROPE_PARAMETERS,
];

/// Mistral's: its window (every layer's) may be any positive length; one shorter than
/// the context binds (see [`crate::ModelShape::binding_window`]).
const MISTRAL_RULES: &[Rule] = &[
    SILU,
    NO_ATTENTION_DROPOUT,
    GEMMA_WINDOW,
    ROPE_SCALING,
    ROPE_PARAMETERS,
];

/// Gemma's GeGLU: tanh-approximated GELU (`hidden_activation`; transformers' Gemmas
/// read no other field for it, and `hidden_act` is only ever written beside it).
const GELU_TANH: Rule = Rule {
    field: "hidden_activation",
    implemented: |v| is_absent_or(v, |v| v == "gelu_pytorch_tanh"),
    why: "the MLP's activation is tanh-approximated GELU (gelu_pytorch_tanh)",
};

const GELU_TANH_ACT: Rule = Rule {
    field: "hidden_act",
    implemented: |v| is_absent_or(v, |v| v == "gelu_pytorch_tanh"),
    why: "the MLP's activation is tanh-approximated GELU (gelu_pytorch_tanh)",
};

fn is_positive_number(v: &Value) -> bool {
    v.as_f64().is_some_and(|x| x.is_finite() && x > 0.0)
}

fn is_positive_integer(v: &Value) -> bool {
    v.as_u64().is_some_and(|x| x > 0)
}

/// A soft-cap is a positive number, or none.
const ATTENTION_SOFTCAP: Rule = Rule {
    field: "attn_logit_softcapping",
    implemented: |v| is_absent_or(v, is_positive_number),
    why: "a soft-cap is a positive number (or null for none)",
};

const FINAL_SOFTCAP: Rule = Rule {
    field: "final_logit_softcapping",
    implemented: |v| is_absent_or(v, is_positive_number),
    why: "a soft-cap is a positive number (or null for none)",
};

const QUERY_PRE_ATTN_SCALAR: Rule = Rule {
    field: "query_pre_attn_scalar",
    implemented: |v| is_absent_or(v, is_positive_number),
    why: "attention is scaled by query_pre_attn_scalar^-1/2, a positive number",
};

/// A window (Gemma's and Mistral's).
const GEMMA_WINDOW: Rule = Rule {
    field: "sliding_window",
    implemented: |v| is_absent_or(v, is_positive_integer),
    why: "a window is a positive whole number of positions",
};

const LAYER_TYPES: Rule = Rule {
    field: "layer_types",
    implemented: |v| {
        is_absent_or(v, |v| {
            v.as_array().is_some_and(|all| {
                all.iter()
                    .all(|t| t == "full_attention" || t == "sliding_attention")
            })
        })
    },
    why: "each layer is full_attention or sliding_attention",
};

const CAUSAL: Rule = Rule {
    field: "use_bidirectional_attention",
    implemented: |v| is_absent_or(v, |v| v == &Value::Bool(false)),
    why: "attention is causal (a bidirectional encoder such as EmbeddingGemma is not a causal LM)",
};

/// Both Gemmas' (their sandwich norms, GeGLU and embedding scale are not fields).
const GEMMA_RULES: &[Rule] = &[
    CAUSAL,
    GELU_TANH,
    GELU_TANH_ACT,
    NO_ATTENTION_BIAS,
    NO_ATTENTION_DROPOUT,
    ATTENTION_SOFTCAP,
    FINAL_SOFTCAP,
    QUERY_PRE_ATTN_SCALAR,
    GEMMA_WINDOW,
    LAYER_TYPES,
];

/// Gemma 2's own, beside [`GEMMA_RULES`].
const GEMMA2_RULES: &[Rule] = &[ROPE_SCALING, ROPE_PARAMETERS];

/// Gemma 3 text's own, beside [`GEMMA_RULES`]; its RoPE may be linearly scaled on the global layers (Gemma 3 4B and
/// larger), and transformers ≥ 5 writes one `rope_parameters` object per layer type.
const GEMMA3_RULES: &[Rule] = &[
    Rule {
        field: "sliding_window_pattern",
        implemented: |v| is_absent_or(v, is_positive_integer),
        why: "the pattern is a positive whole number of layers",
    },
    Rule {
        field: "rope_scaling",
        implemented: |v| is_absent_or(v, |v| rope_kind_is(v, &["default", "llama3", "linear"])),
        why: "RoPE scaling of kind \"linear\" or \"llama3\" (or none) is implemented",
    },
    Rule {
        field: "rope_parameters",
        implemented: |v| is_absent_or(v, gemma3_rope_is_implemented),
        why: "one RoPE per layer type (full_attention: default, linear or llama3; sliding_attention: default) is implemented",
    },
];

/// Whether Gemma 3's `rope_parameters` (transformers ≥ 5: an object per layer type)
/// ask for RoPE tuneq implements: the global layers' default, linear or llama3, the
/// sliding layers' unscaled.
fn gemma3_rope_is_implemented(value: &Value) -> bool {
    let Some(object) = value.as_object() else {
        return false;
    };
    object.iter().all(|(kind, params)| match kind.as_str() {
        "full_attention" => rope_kind_is(params, &["default", "llama3", "linear"]),
        "sliding_attention" => rope_kind_is(params, &["default"]),
        _ => false,
    })
}

/// Phi-3's: fused projections (not a field), RoPE on part of each head, LongRoPE, a
/// window on every layer (as Mistral's), and no dropout on the residual stream or the
/// embeddings.
const PHI3_RULES: &[Rule] = &[
    SILU,
    NO_ATTENTION_BIAS,
    NO_ATTENTION_DROPOUT,
    Rule {
        field: "resid_pdrop",
        implemented: |v| is_absent_or(v, |v| v.as_f64() == Some(0.0)),
        why: "dropout on the residual stream is not implemented (LoRA dropout is)",
    },
    Rule {
        field: "embd_pdrop",
        implemented: |v| is_absent_or(v, |v| v.as_f64() == Some(0.0)),
        why: "dropout on the embeddings is not implemented (LoRA dropout is)",
    },
    GEMMA_WINDOW,
    Rule {
        field: "partial_rotary_factor",
        implemented: |v| is_absent_or(v, is_rotary_fraction),
        why: "RoPE rotates a fraction in (0, 1] of each head",
    },
    Rule {
        field: "rope_scaling",
        implemented: |v| is_absent_or(v, phi3_rope_is_implemented),
        why: "RoPE scaling of kind \"longrope\" (or \"su\", or none) with short_factor and long_factor lists is implemented",
    },
    Rule {
        field: "rope_parameters",
        implemented: |v| is_absent_or(v, phi3_rope_is_implemented),
        why: "RoPE of kind \"default\" or \"longrope\" (with short_factor and long_factor lists) is implemented",
    },
];

fn is_rotary_fraction(v: &Value) -> bool {
    v.as_f64().is_some_and(|x| x > 0.0 && x <= 1.0)
}

/// Whether a Phi-3 RoPE object asks for what tuneq implements: no scaling, or LongRoPE
/// (`su` is its older name) with its two lists of per-frequency factors, and a partial
/// rotation in (0, 1] where it names one (transformers ≥ 5 writes it here).
fn phi3_rope_is_implemented(value: &Value) -> bool {
    let Some(object) = value.as_object() else {
        return false;
    };
    let factors = |name: &str| {
        object
            .get(name)
            .and_then(Value::as_array)
            .is_some_and(|all| !all.is_empty() && all.iter().all(is_positive_number))
    };
    let partial = object
        .get("partial_rotary_factor")
        .is_none_or(|v| is_absent_or(v, is_rotary_fraction));
    let kind_ok = rope_kind_is(value, &["default"])
        || (rope_kind_is(value, &["longrope", "su"])
            && factors("short_factor")
            && factors("long_factor"));
    kind_ok && partial
}

/// transformers' `MistralConfig` window when a config names none (`null` is no window).
const MISTRAL_DEFAULT_WINDOW: u64 = 4096;

/// Gemma's fields, which the other families' classes would ignore (see
/// [`FOREIGN_RULES`]).
const GEMMA_FIELDS: &[Rule] = &[
    Rule {
        field: "hidden_activation",
        implemented: Value::is_null,
        why: "a Gemma-style activation; Llama's is hidden_act = silu",
    },
    Rule {
        field: "attn_logit_softcapping",
        implemented: Value::is_null,
        why: "attention logit soft-capping is implemented for Gemma only",
    },
    Rule {
        field: "final_logit_softcapping",
        implemented: Value::is_null,
        why: "final logit soft-capping is implemented for Gemma only",
    },
    Rule {
        field: "query_pre_attn_scalar",
        implemented: Value::is_null,
        why: "attention is scaled by 1/sqrt(head_dim)",
    },
];

/// Fields of other families that change their maths. Transformers' class would ignore
/// them, but a config that sets one was almost surely written for another model (or
/// edited by hand), and training it as this family would be silently wrong: refused
/// unless they hold their neutral value.
const FOREIGN_RULES: &[Rule] = &[
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
    rope_kind_is(value, &["default", "llama3"])
}

/// Whether a RoPE object's kind (`rope_type`, or the older `type`; `default` when it
/// names none) is one of `kinds`.
fn rope_kind_is(value: &Value, kinds: &[&str]) -> bool {
    let Some(object) = value.as_object() else {
        return false;
    };
    let kind = object
        .get("rope_type")
        .or_else(|| object.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    kinds.contains(&kind)
}

/// `config` with what its family's config class sets for the fields it leaves out
/// ([`Architecture::defaults`]), and, for a Gemma naming no `layer_types`, the class's
/// pattern of sliding and global layers. A config tuneq does not train is returned as is.
/// Placement and the trainer both read a config through this, so they see the same model.
pub fn with_class_defaults(config: Value) -> Value {
    match architecture_of(&config) {
        Ok(architecture) => with_defaults_of(config, architecture),
        Err(_) => config,
    }
}

/// [`with_class_defaults`] for a config already known to be of `architecture`.
pub fn with_defaults_of(mut config: Value, architecture: Architecture) -> Value {
    let Some(object) = config.as_object_mut() else {
        return config;
    };
    for (field, value) in architecture.defaults() {
        object.entry(field).or_insert(value);
    }
    if architecture.gemma() && object.get("layer_types").is_none_or(Value::is_null) {
        let layers = object
            .get("num_hidden_layers")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let pattern = object.get("sliding_window_pattern").and_then(Value::as_u64);
        let types: Vec<&str> = (0..layers as usize)
            .map(|l| match architecture.default_sliding(l, pattern) {
                true => "sliding_attention",
                false => "full_attention",
            })
            .collect();
        object.insert("layer_types".into(), serde_json::json!(types));
    }
    config
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
    for rule in architecture.rules() {
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
mod tests;
