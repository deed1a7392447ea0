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
            "qwen",
            json!({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}),
            "\"qwen2\"",
        ),
        (
            "gemma",
            json!({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                   "hidden_activation": "gelu_pytorch_tanh"}),
            "\"gemma2\"",
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
}
