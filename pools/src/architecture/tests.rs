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

/// `config` with each of `changes` in turn is refused, naming the field changed.
fn refused_naming_each_field(config: &Value, changes: Vec<(&str, Value)>) {
    for (field, value) in changes {
        let refusal = architecture_of(&with(config.clone(), field, value.clone())).unwrap_err();
        assert_eq!(refusal.field(), field, "{field} = {value}");
    }
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

/// Qwen2.5-0.5B-Instruct's `config.json` as published.
fn qwen25() -> Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936
    })
}

#[test]
fn published_qwen2_configs_are_accepted_with_their_biases() {
    assert_eq!(architecture_of(&qwen25()), Ok(Architecture::Qwen2));
    assert!(Architecture::Qwen2.qkv_bias() && !Architecture::Llama.qkv_bias());
    let windowed = with(qwen25(), "use_sliding_window", json!(true));
    assert_eq!(
        architecture_of(&windowed).unwrap_err().field(),
        "use_sliding_window"
    );
    refused_naming_each_field(
        &qwen25(),
        vec![
            ("hidden_act", json!("gelu")),
            ("rope_scaling", json!({"type": "yarn", "factor": 4.0})),
            ("use_qk_norm", json!(true)),
        ],
    );
    let misnamed = with(qwen25(), "architectures", json!(["LlamaForCausalLM"]));
    assert_eq!(
        architecture_of(&misnamed).unwrap_err().field(),
        "architectures"
    );
}

/// Qwen3-0.6B's `config.json` as published.
fn qwen3() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936
    })
}

#[test]
fn published_qwen3_configs_are_accepted_with_their_qk_norms() {
    assert_eq!(architecture_of(&qwen3()), Ok(Architecture::Qwen3));
    assert!(Architecture::Qwen3.qk_norm() && !Architecture::Qwen3.qkv_bias());
    assert!(!Architecture::Qwen2.qk_norm() && !Architecture::Llama.qk_norm());
    let layered = with(
        qwen3(),
        "layer_types",
        json!(["full_attention", "full_attention"]),
    );
    assert_eq!(architecture_of(&layered), Ok(Architecture::Qwen3));
    refused_naming_each_field(
        &qwen3(),
        vec![
            ("attention_bias", json!(true)),
            ("use_sliding_window", json!(true)),
            (
                "layer_types",
                json!(["full_attention", "sliding_attention"]),
            ),
        ],
    );
}

/// Mistral-7B-Instruct-v0.3's `config.json` as published.
fn mistral_v03() -> Value {
    json!({
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": true, "vocab_size": 32768
    })
}

#[test]
fn mistral_is_accepted_with_its_window() {
    assert_eq!(architecture_of(&mistral_v03()), Ok(Architecture::Mistral));
    // v0.1's window of 4096 over a 32768 context, written or left to transformers'
    // default (which the class fills in), binds: accepted, and trained on the graph.
    let v01 = with(mistral_v03(), "sliding_window", json!(4096));
    let mut unnamed = mistral_v03();
    unnamed.as_object_mut().unwrap().remove("sliding_window");
    for config in [v01, unnamed.clone()] {
        assert_eq!(architecture_of(&config), Ok(Architecture::Mistral));
    }
    assert_eq!(with_class_defaults(unnamed)["sliding_window"], json!(4096));
    assert_eq!(
        with_class_defaults(mistral_v03())["sliding_window"],
        Value::Null,
        "null is no window"
    );
    refused_naming_each_field(
        &mistral_v03(),
        vec![
            ("sliding_window", json!(0)),
            ("sliding_window", json!("4096")),
            ("hidden_act", json!("gelu")),
        ],
    );
}

/// Gemma 2 2B's `config.json` as published.
fn gemma2() -> Value {
    json!({
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": [1, 107],
        "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
        "max_position_embeddings": 8192, "model_type": "gemma2",
        "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "transformers_version": "4.42.4", "use_cache": true, "vocab_size": 256000
    })
}

/// Gemma 3 1B's `config.json` as published, and the 270M's as transformers 5 writes
/// it (one RoPE per layer type).
fn gemma3() -> [Value; 2] {
    let one_b = json!({
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": null, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "initializer_range": 0.02, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144
    });
    let mut v5 = one_b.clone();
    let object = v5.as_object_mut().unwrap();
    for old in [
        "rope_local_base_freq",
        "rope_scaling",
        "rope_theta",
        "sliding_window_pattern",
    ] {
        object.remove(old);
    }
    object.insert(
        "rope_parameters".into(),
        json!({"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    );
    [one_b, v5]
}

#[test]
fn published_gemma_configs_are_accepted() {
    assert_eq!(architecture_of(&gemma2()), Ok(Architecture::Gemma2));
    for config in gemma3() {
        assert_eq!(architecture_of(&config), Ok(Architecture::Gemma3));
    }
    assert!(Architecture::Gemma2.gemma() && !Architecture::Llama.gemma());
    assert!(Architecture::Gemma3.qk_norm() && !Architecture::Gemma2.qk_norm());
    // Gemma 3 4B's global layers interpolate positions (linear, factor 8).
    let [one_b, v5] = gemma3();
    let scaled = with(
        one_b,
        "rope_scaling",
        json!({"rope_type": "linear", "factor": 8.0}),
    );
    assert_eq!(architecture_of(&scaled), Ok(Architecture::Gemma3));
    let cases = [
        (gemma2(), "hidden_activation", json!("silu")),
        (gemma2(), "hidden_act", json!("silu")),
        (gemma2(), "attn_logit_softcapping", json!(-1.0)),
        (gemma2(), "query_pre_attn_scalar", json!(0)),
        (gemma2(), "sliding_window", json!(1.5)),
        (gemma2(), "layer_types", json!(["chunked_attention"])),
        (gemma2(), "use_bidirectional_attention", json!(true)),
        (
            gemma2(),
            "rope_scaling",
            json!({"rope_type": "linear", "factor": 8.0}),
        ),
        (
            scaled.clone(),
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 8.0}),
        ),
        (
            v5.clone(),
            "rope_parameters",
            json!({"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
        ),
        (
            v5,
            "rope_parameters",
            json!({"rope_type": "default", "rope_theta": 1e6}),
        ),
        (scaled, "use_bidirectional_attention", json!(true)),
    ];
    for (config, field, value) in cases {
        let refusal = architecture_of(&with(config, field, value.clone())).unwrap_err();
        assert_eq!(refusal.field(), field, "{value}");
    }
    // Gemma's fields stay refused on the other families.
    let capped = with(llama32(), "final_logit_softcapping", json!(30.0));
    assert_eq!(
        architecture_of(&capped).unwrap_err().field(),
        "final_logit_softcapping"
    );
}

#[test]
fn a_gemma_without_layer_types_follows_its_class_s_pattern() {
    let sliding = |a: Architecture, pattern| -> Vec<bool> {
        (0..7).map(|l| a.default_sliding(l, pattern)).collect()
    };
    let (o, x) = (true, false);
    assert_eq!(sliding(Architecture::Gemma2, None), [o, x, o, x, o, x, o]);
    assert_eq!(sliding(Architecture::Gemma3, None), [o, o, o, o, o, x, o]);
    assert_eq!(
        sliding(Architecture::Gemma3, Some(2)),
        [o, x, o, x, o, x, o]
    );
    assert_eq!(sliding(Architecture::Llama, None), [x; 7]);
    let defaults: std::collections::HashMap<_, _> =
        Architecture::Gemma2.defaults().into_iter().collect();
    assert_eq!(defaults["final_logit_softcapping"], json!(30.0));
    assert!(
        !Architecture::Gemma3
            .defaults()
            .iter()
            .any(|(field, _)| *field == "final_logit_softcapping")
    );
    assert!(Architecture::Llama.defaults().is_empty());
}

/// Phi-3-mini-4k-instruct's `config.json` as published (its window of 2047 binds within
/// its 4096 positions, so that model trains on candle's graph).
fn phi3_mini() -> Value {
    json!({
        "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": null,
        "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": true,
        "vocab_size": 32064
    })
}

/// Phi-4-mini-instruct's `config.json` as published, its 48 LongRoPE factors per list
/// shortened to values of the same kind.
fn phi4_mini() -> Value {
    let factors = |base: f64| (0..48).map(|i| base + i as f64 * 0.5).collect::<Vec<_>>();
    json!({
        "architectures": ["Phi3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 199999, "embd_pdrop": 0.0,
        "eos_token_id": 199999, "full_attn_mod": 1, "hidden_act": "silu",
        "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
        "interpolate_factor": 1, "lm_head_bias": false, "max_position_embeddings": 131072,
        "mlp_bias": false, "model_type": "phi3", "num_attention_heads": 24,
        "num_hidden_layers": 32, "num_key_value_heads": 8,
        "original_max_position_embeddings": 4096, "pad_token_id": 199999,
        "partial_rotary_factor": 0.75, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": factors(1.0), "short_factor": factors(1.0),
                         "type": "longrope"},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16", "transformers_version": "4.45.0", "use_cache": true,
        "vocab_size": 200064
    })
}

#[test]
fn published_phi3_configs_are_accepted_with_their_rope() {
    assert_eq!(architecture_of(&phi3_mini()), Ok(Architecture::Phi3));
    assert_eq!(architecture_of(&phi4_mini()), Ok(Architecture::Phi3));
    let mut su = phi4_mini();
    su["rope_scaling"]["type"] = json!("su");
    assert_eq!(architecture_of(&su), Ok(Architecture::Phi3));
    refused_naming_each_field(
        &phi4_mini(),
        vec![
            ("partial_rotary_factor", json!(0.0)),
            ("partial_rotary_factor", json!(1.5)),
            ("resid_pdrop", json!(0.1)),
            ("embd_pdrop", json!(0.1)),
            ("rope_scaling", json!({"type": "yarn", "factor": 4.0})),
            (
                "rope_scaling",
                json!({"type": "longrope", "short_factor": [1.0]}),
            ),
            ("sliding_window", json!(0)),
        ],
    );
    // Another family's partial rotation is still refused: Phi-3's rule is its own.
    let refusal = architecture_of(&with(llama32(), "partial_rotary_factor", json!(0.75)));
    assert_eq!(refusal.unwrap_err().field(), "partial_rotary_factor");
}

#[test]
fn lora_targets_are_the_family_s_projections() {
    let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let every = names(&tuneq_openapi::PROJECTIONS);
    let fused = names(&tuneq_openapi::FUSED_PROJECTIONS);
    // All seven of a Llama's (the default) mean every projection of the model.
    assert_eq!(Architecture::Phi3.lora_targets(&every), Ok(fused.clone()));
    assert_eq!(Architecture::Llama.lora_targets(&every), Ok(every.clone()));
    let qkv = names(&["qkv_proj", "o_proj"]);
    assert_eq!(Architecture::Phi3.lora_targets(&qkv), Ok(qkv.clone()));
    // A projection the family has not, either way round, is refused naming it.
    let wrong = Architecture::Phi3
        .lora_targets(&names(&["q_proj", "v_proj"]))
        .unwrap_err();
    assert_eq!(wrong.module, "q_proj");
    assert!(wrong.to_string().contains("qkv_proj"), "{wrong}");
    let wrong = Architecture::Qwen2.lora_targets(&qkv).unwrap_err();
    assert_eq!(wrong.module, "qkv_proj");
    assert!(wrong.to_string().contains("qwen2 model"), "{wrong}");
}

#[test]
fn other_families_are_refused_by_name() {
    for family in ["gemma", "phi", "olmo2"] {
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
    let refusal =
        architecture_of(&with(llama32(), "hidden_act", json!("x".repeat(100_000)))).unwrap_err();
    assert!(refusal.to_string().len() < 300);
    assert_eq!(
        architecture_of(&json!([1, 2])),
        Err(Unsupported::NotAnObject)
    );
}
