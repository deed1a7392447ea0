//! A base model of an architecture tuneq does not train is refused at create, naming the
//! architecture or the field, and nothing is queued: it would otherwise train as Llama,
//! wrongly and silently.
#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::json;
use support::{create, examples, start, upload};

/// A small model's shape, in the fields every family shares with Llama.
fn shape() -> serde_json::Value {
    json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512
    })
}

fn with(mut config: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    config
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    config
}

#[tokio::test]
async fn a_job_on_a_model_of_another_family_is_refused_naming_it() {
    let s = start(|_| {}).await;
    let cases = [
        (
            "phi",
            json!({"model_type": "phi", "architectures": ["PhiForCausalLM"]}),
            "\"phi\"",
        ),
        (
            "mistral-fractional-window",
            json!({"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                   "sliding_window": 128.5}),
            "sliding_window",
        ),
        (
            "qwen2-windowed",
            json!({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                   "use_sliding_window": true, "sliding_window": 128}),
            "use_sliding_window",
        ),
        (
            "gemma-silu",
            json!({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                   "hidden_activation": "silu"}),
            "hidden_activation",
        ),
        (
            "llama-with-bias",
            json!({"attention_bias": true}),
            "attention_bias",
        ),
        (
            "llama-windowed",
            json!({"sliding_window": 128}),
            "sliding_window",
        ),
    ];
    let file = upload(&s, &s.acme, &examples(8)).await;
    for (id, config, named) in &cases {
        support::register_model(
            &s.state,
            s.dir.path(),
            id,
            1e-4,
            with(shape(), config.clone()),
        )
        .await;
        let (status, body) = create(&s, &file, json!({"model": id})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{id}: {body}");
        assert_eq!(
            body["error"]["code"], "unsupported_model_architecture",
            "{body}"
        );
        assert_eq!(body["error"]["param"], "model", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{id}: {message}");
    }
    // Nothing was queued; a Llama of the same shape is accepted.
    let jobs = support::get_json(&s, "/v1/fine_tuning/jobs").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 0, "{jobs}");
    support::register_model(&s.state, s.dir.path(), "llama", 1e-4, shape()).await;
    let (status, body) = create(&s, &file, json!({"model": "llama"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // And so are the Qwen2, Qwen3, Mistral and Gemma families, which tuneq trains.
    for (id, qwen) in [
        (
            "qwen2",
            json!({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                   "sliding_window": 32768, "use_sliding_window": false}),
        ),
        (
            "qwen3",
            json!({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                   "attention_bias": false, "head_dim": 32, "use_sliding_window": false}),
        ),
        (
            "mistral",
            json!({"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                   "sliding_window": null}),
        ),
        (
            "mistral-windowed",
            json!({"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                   "sliding_window": 128}),
        ),
        (
            "gemma2",
            json!({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                   "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "query_pre_attn_scalar": 256}),
        ),
        (
            "gemma3",
            json!({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                   "sliding_window": 512, "rope_local_base_freq": 10000.0,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
        ),
    ] {
        support::register_model(&s.state, s.dir.path(), id, 1e-4, with(shape(), qwen)).await;
        let (status, body) = create(&s, &file, json!({"model": id})).await;
        assert_eq!(status, StatusCode::OK, "{id}: {body}");
    }
}

#[tokio::test]
async fn a_phi3_job_adapts_its_fused_projections_and_refuses_a_llama_s() {
    let s = start(|_| {}).await;
    let phi3 = json!({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                      "partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
                      "rope_scaling": {"type": "longrope",
                                       "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                                       "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]}});
    support::register_model(&s.state, s.dir.path(), "phi3", 1e-4, with(shape(), phi3)).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    // Left out, the targets are every projection: Phi-3's four fused ones, which the
    // job then names (its adapter will, as PEFT's does).
    let (status, body) = create(&s, &file, json!({"model": "phi3"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let id = body["id"].as_str().unwrap();
    let job = support::get_json(&s, &format!("/finetunes/{id}")).await;
    assert_eq!(
        job["lora"]["target_modules"],
        json!(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        "{job}"
    );
    let (status, _) = create(
        &s,
        &file,
        json!({"model": "phi3", "lora": {"target_modules": ["qkv_proj"]}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    // A Llama's q_proj is not a Phi-3 projection, nor Phi-3's qkv_proj a Llama's.
    support::register_model(&s.state, s.dir.path(), "llama", 1e-4, shape()).await;
    for (model, targets, named) in [
        ("phi3", json!(["q_proj", "v_proj"]), "\"q_proj\""),
        ("llama", json!(["qkv_proj"]), "\"qkv_proj\""),
    ] {
        let (status, body) = create(
            &s,
            &file,
            json!({"model": model, "lora": {"target_modules": targets}}),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{model}: {body}");
        assert_eq!(body["error"]["param"], "lora.target_modules", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{model}: {message}");
    }
}
