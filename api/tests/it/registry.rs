//! The model registry: `POST /admin/models` registers a base model every tenant may
//! fine-tune once its folder is checked (architecture, a tokenizer that loads, every
//! tensor of the shape the config says, every shard present; every problem at once),
//! records what it found for `GET /v1/models`, and `DELETE /admin/models/{id}` removes
//! one no unfinished job and no alias uses. Every refusal names the field and changes
//! nothing.
#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use support::{ADMIN_KEY, Server, create, examples, start, upload};
use tuneq_storage::testing::{self, TEST_BUCKET};

/// A small Llama's `config.json` fields.
fn config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512
    })
}

/// A safetensors file whose header lists `tensors` (name, shape) with no data: all the
/// registry reads.
fn write_header(path: &Path, tensors: &[(String, Vec<u64>)]) {
    let header: serde_json::Map<String, Value> = tensors
        .iter()
        .map(|(name, shape)| {
            (
                name.to_string(),
                json!({"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}),
            )
        })
        .collect();
    let header = Value::Object(header).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// A model folder `name` under the server's temp dir: `config`, a tokenizer that loads,
/// and weights holding [`tensors`].
fn folder(s: &Server, name: &str, config: &Value, layers: u64, embedding: [u64; 2]) -> PathBuf {
    let dir = s.dir.path().join("registry").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    tuneq_dataset::write_tokenizer_files(&dir, 512, 512).unwrap();
    write_header(
        &dir.join("model.safetensors"),
        &tensors(config, layers, embedding),
    );
    dir
}

/// Every tensor of `config`'s first `layers` layers, the embedding of `embedding`'s
/// shape.
fn tensors(config: &Value, layers: u64, embedding: [u64; 2]) -> Vec<(String, Vec<u64>)> {
    let shape: tuneq_pools::ModelShape = serde_json::from_value(config.clone()).unwrap();
    shape
        .expected_tensors()
        .into_iter()
        .filter(|t| {
            let layer = t.name.strip_prefix("model.layers.");
            let index = layer.and_then(|rest| rest.split('.').next()?.parse::<u64>().ok());
            index.is_none_or(|l| l < layers)
        })
        .map(|t| match t.name.as_str() {
            "model.embed_tokens.weight" => (t.name, embedding.to_vec()),
            _ => (t.name, t.shape),
        })
        .collect()
}

/// A folder of the small Llama with weights that match it.
fn good_folder(s: &Server, name: &str) -> PathBuf {
    folder(s, name, &config(), 2, [256, 64])
}

async fn post(s: &Server, key: &str, body: Value) -> (StatusCode, Value) {
    let response = s.post_json(key, "/admin/models", &body).await;
    (response.status(), response.json().await.unwrap())
}

/// The identity registration recorded for `id` once its background hash is done.
async fn hashed_identity(s: &Server, id: &str) -> tuneq_openapi::ModelIdentity {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let model = tuneq_api::records::model::get(&s.queue, id).await.unwrap();
        if let Some(identity) = model.and_then(|m| m.identity) {
            return identity;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id}: no hash recorded in a minute"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_registered_model_is_listed_and_fine_tuned() {
    let s = start(|_| {}).await;
    let dir = good_folder(&s, "small");
    let body = json!({"id": "small-llama", "location": dir.display().to_string()});
    let (status, model) = post(&s, ADMIN_KEY, body.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{model}");
    assert_eq!(model["id"], "small-llama", "{model}");
    assert_eq!(model["object"], "model", "{model}");
    // What a user needs to choose it, as its folder showed at registration.
    let details = &model["details"];
    assert_eq!(details["architecture"], "llama", "{model}");
    // Embedding, head, the final norm and 2 × (q, k, v, o, gate, up, down, two norms).
    let per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64;
    assert_eq!(
        details["parameters"],
        2 * 256 * 64 + 64 + 2 * per_layer,
        "{model}"
    );
    assert_eq!(details["context_length"], 512, "{model}");
    assert_eq!(details["dtype"], "float32", "{model}");
    assert_eq!(details["chat_template"], "own", "{model}");
    assert_eq!(details["renders_tools"], false, "{model}");
    assert!(model.get("display_name").is_none(), "{model}");
    // Registering it again as it is changes nothing; with a display name, only that.
    let (status, again) = post(&s, ADMIN_KEY, body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again["created"], model["created"], "{again}");
    let mut named = body;
    named["display_name"] = json!("Small Llama (test)");
    let (status, again) = post(&s, ADMIN_KEY, named).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again["display_name"], "Small Llama (test)", "{again}");
    assert_eq!(again["created"], model["created"], "{again}");
    // Retrieved, it also names the pools that can hold a fine-tune of it.
    let retrieved = s.json_as(&s.acme, "/v1/models/small-llama").await;
    assert_eq!(
        retrieved["display_name"], "Small Llama (test)",
        "{retrieved}"
    );
    let fits = retrieved["details"]["fits_pools"].as_array().unwrap();
    assert!(!fits.is_empty(), "{retrieved}");
    // Every tenant sees it, and fine-tunes it.
    for key in [&s.acme, &s.other] {
        let listed = s.json_as(key, "/v1/models").await;
        let ids: Vec<&str> = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["id"].as_str())
            .collect();
        assert!(ids.contains(&"small-llama"), "{listed}");
    }
    // Registration answered before the weights were hashed; the hash is recorded once
    // done, and a job then hands it to its trainer, with the folder's stamp: the trainer
    // does not read the weights again to fingerprint the run.
    let identity = tuneq_pools::folder::identity(&dir).unwrap();
    assert_eq!(hashed_identity(&s, "small-llama").await, identity);
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, job) = create(&s, &file, json!({"model": "small-llama"})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    let (lease, _) = support::claim(&s).await;
    use tuneq_openapi::StoredJson as _;
    let payload = tuneq_openapi::JobPayload::decode(&lease.id, &lease.payload).unwrap();
    assert_eq!(payload.spec.model_identity.as_ref(), Some(&identity));
    // Another location under the same id is refused.
    let other = good_folder(&s, "other");
    let (status, refusal) = post(
        &s,
        ADMIN_KEY,
        json!({"id": "small-llama", "location": other.display().to_string()}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{refusal}");
    assert_eq!(refusal["error"]["code"], "model_exists", "{refusal}");
    assert_eq!(refusal["error"]["param"], "id", "{refusal}");
}

#[tokio::test]
async fn folders_that_are_not_models_tuneq_trains_are_refused_naming_why() {
    let s = start(|_| {}).await;
    let phi = folder(
        &s,
        "phi",
        &json!({"architectures": ["PhiForCausalLM"], "model_type": "phi",
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "vocab_size": 256}),
        2,
        [256, 64],
    );
    let wrong_vocab = folder(&s, "vocab", &config(), 2, [300, 64]);
    let missing_layer = folder(&s, "layers", &config(), 1, [256, 64]);
    let extra_layer = good_folder(&s, "extra");
    let mut three_layers = tensors(&config(), 2, [256, 64]);
    three_layers.push((
        "model.layers.2.input_layernorm.weight".to_string(),
        vec![64],
    ));
    write_header(&extra_layer.join("model.safetensors"), &three_layers);
    let missing_shard = good_folder(&s, "shard");
    let index = json!({"weight_map": {
        "model.embed_tokens.weight": "model.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"
    }});
    std::fs::write(
        missing_shard.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    // Two problems at once: both are named.
    let two_problems = folder(&s, "two", &config(), 2, [300, 64]);
    std::fs::write(two_problems.join("tokenizer.json"), "{}").unwrap();
    let no_tokenizer = good_folder(&s, "no-tokenizer");
    std::fs::remove_file(no_tokenizer.join("tokenizer.json")).unwrap();
    let no_weights = good_folder(&s, "no-weights");
    std::fs::remove_file(no_weights.join("model.safetensors")).unwrap();
    let not_a_header = good_folder(&s, "not-a-header");
    std::fs::write(
        not_a_header.join("model.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\xff{",
    )
    .unwrap();
    let at = |p: &Path| p.display().to_string();
    let cases = [
        (
            json!({"id": "m", "location": at(&phi)}),
            "location",
            "unsupported_model_architecture",
            "\"phi\"",
        ),
        (
            json!({"id": "m", "location": at(&wrong_vocab)}),
            "location",
            "invalid_value",
            "embed_tokens",
        ),
        (
            json!({"id": "m", "location": at(&missing_layer)}),
            "location",
            "invalid_value",
            "model.layers.1.input_layernorm.weight",
        ),
        (
            json!({"id": "m", "location": at(&extra_layer)}),
            "location",
            "invalid_value",
            "num_hidden_layers = 2",
        ),
        (
            json!({"id": "m", "location": at(&missing_shard)}),
            "location",
            "invalid_value",
            "model-00002-of-00002.safetensors, which the folder lacks",
        ),
        (
            json!({"id": "m", "location": at(&two_problems)}),
            "location",
            "invalid_value",
            "(2 problems)",
        ),
        (
            json!({"id": "m", "location": at(&phi), "display_name": "a\nb"}),
            "display_name",
            "invalid_value",
            "control",
        ),
        (
            json!({"id": "m", "location": at(&no_tokenizer)}),
            "location",
            "invalid_value",
            "tokenizer.json",
        ),
        (
            json!({"id": "m", "location": at(&no_weights)}),
            "location",
            "invalid_value",
            "safetensors",
        ),
        (
            json!({"id": "m", "location": at(&not_a_header)}),
            "location",
            "invalid_value",
            "header",
        ),
        (
            json!({"id": "m", "location": "relative/folder"}),
            "location",
            "invalid_value",
            "absolute",
        ),
        (
            json!({"id": "m", "location": "s3://"}),
            "location",
            "invalid_value",
            "",
        ),
        (
            json!({"id": "m/../x", "location": at(&phi)}),
            "id",
            "invalid_value",
            "",
        ),
        (
            json!({"id": "m", "location": at(&wrong_vocab), "base_learning_rate": 5.0}),
            "base_learning_rate",
            "invalid_value",
            "1e-9",
        ),
    ];
    for (body, param, code, named) in cases {
        let (status, refusal) = post(&s, ADMIN_KEY, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {refusal}");
        assert_eq!(refusal["error"]["param"], param, "{body}: {refusal}");
        assert_eq!(refusal["error"]["code"], code, "{body}: {refusal}");
        let message = refusal["error"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{body}: {message}");
    }
    let (status, _) = post(
        &s,
        ADMIN_KEY,
        json!({"id": "m", "location": "/x", "extra": 1}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // A tenant's key is not the admin key.
    let (status, _) = post(&s, &s.acme, json!({"id": "m", "location": at(&phi)})).await;
    assert!(
        status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN,
        "{status}"
    );
    // Nothing was registered.
    let response = s.get_as(&s.acme, "/v1/models/m").await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_model_is_removed_only_once_no_unfinished_job_or_alias_uses_it() {
    let s = start(|config| {
        config
            .model_aliases
            .insert("aliased".into(), "kept-by-alias".into());
    })
    .await;
    for id in ["small-llama", "kept-by-alias"] {
        let dir = good_folder(&s, id);
        let (status, body) = post(
            &s,
            ADMIN_KEY,
            json!({"id": id, "location": dir.display().to_string()}),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, job) = create(&s, &file, json!({"model": "small-llama"})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    let delete = |id: &str| {
        s.request(
            reqwest::Method::DELETE,
            ADMIN_KEY,
            &format!("/admin/models/{id}"),
        )
        .send()
    };
    let refused = delete("small-llama").await.unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let refused: Value = refused.json().await.unwrap();
    assert_eq!(refused["error"]["code"], "model_in_use", "{refused}");
    let job_id = job["id"].as_str().unwrap();
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains(job_id),
        "{refused}"
    );
    let aliased: Value = delete("kept-by-alias").await.unwrap().json().await.unwrap();
    assert_eq!(aliased["error"]["code"], "model_in_use", "{aliased}");
    assert!(
        aliased["error"]["message"]
            .as_str()
            .unwrap()
            .contains("aliased")
    );
    // Once the job is cancelled, the model goes; its folder stays.
    let cancelled = s
        .post_as(&s.acme, &format!("/v1/fine_tuning/jobs/{job_id}/cancel"))
        .await;
    assert_eq!(cancelled.status(), StatusCode::OK);
    let removed = delete("small-llama").await.unwrap();
    assert_eq!(removed.status(), StatusCode::OK);
    let removed: Value = removed.json().await.unwrap();
    assert_eq!(
        removed,
        json!({"id": "small-llama", "object": "model", "deleted": true})
    );
    assert!(
        s.dir
            .path()
            .join("registry/small-llama/config.json")
            .is_file()
    );
    let gone = s.get_as(&s.acme, "/v1/models/small-llama").await;
    assert_eq!(gone.status(), StatusCode::NOT_FOUND);
    let (status, refusal) = create(&s, &file, json!({"model": "small-llama"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refusal}");
    // Unknown ids, and tenants' keys, are refused.
    assert_eq!(
        delete("small-llama").await.unwrap().status(),
        StatusCode::NOT_FOUND
    );
    let tenant = s
        .request(
            reqwest::Method::DELETE,
            &s.acme,
            "/admin/models/kept-by-alias",
        )
        .send()
        .await
        .unwrap();
    assert!(tenant.status().is_client_error() && tenant.status() != StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn with_model_roots_a_model_is_taken_only_from_under_one() {
    let s = start(|_| {}).await;
    // The roots are the operator's: a folder of this server's and one bucket prefix.
    let base = std::fs::canonicalize(s.dir.path()).unwrap();
    let root = base.join("registry");
    let inside = good_folder(&s, "inside");
    let outside = base.join("elsewhere");
    std::fs::create_dir_all(&outside).unwrap();
    let approved = format!("s3://{TEST_BUCKET}/{}", testing::unique_prefix("approved"));
    let in_store = uploaded(&inside, &format!("{approved}/llama")).await;
    let roots = [root.display().to_string(), approved.clone()];
    let s = start(move |config| {
        config.model_roots = tuneq_api::model_roots::ModelRoots::parse(&roots).unwrap();
        config.model_storage.s3 = testing::s3_config(testing::moto());
    })
    .await;
    let link = inside.join("../link");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    let refused = [
        outside.display().to_string(),
        format!("{}/../elsewhere", inside.display()),
        link.display().to_string(),
        format!("{approved}-not"),
        approved.replacen("s3://", "gs://", 1),
    ];
    for location in refused {
        let (status, refusal) = post(&s, ADMIN_KEY, json!({"id": "m", "location": location})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{location}: {refusal}");
        assert_eq!(refusal["error"]["param"], "location", "{refusal}");
        let message = refusal["error"]["message"].as_str().unwrap();
        assert!(message.contains("--model-root"), "{message}");
    }
    let response = s.get_as(&s.acme, "/v1/models/m").await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    for (id, location) in [
        ("local", inside.display().to_string()),
        ("remote", in_store),
    ] {
        let (status, model) = post(&s, ADMIN_KEY, json!({"id": id, "location": location})).await;
        assert_eq!(status, StatusCode::CREATED, "{model}");
    }
}

#[tokio::test]
async fn a_model_registered_with_a_built_in_template_trains_with_it() {
    let s = start(|_| {}).await;
    let dir = good_folder(&s, "alpaca");
    let location = dir.display().to_string();
    let body = json!({"id": "tmpl", "location": location, "chat_template": "alpaca"});
    let (status, model) = post(&s, ADMIN_KEY, body).await;
    assert_eq!(status, StatusCode::CREATED, "{model}");
    assert_eq!(model["details"]["template"], "alpaca", "{model}");
    assert_eq!(model["details"]["chat_template"], "built_in", "{model}");
    // Registered again without one, it keeps it.
    let (status, again) = post(&s, ADMIN_KEY, json!({"id": "tmpl", "location": location})).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again["details"]["template"], "alpaca", "{again}");
    // Its jobs train with it.
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, job) = create(&s, &file, json!({"model": "tmpl"})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    let (lease, _) = support::claim(&s).await;
    use tuneq_openapi::StoredJson as _;
    let payload = tuneq_openapi::JobPayload::decode(&lease.id, &lease.payload).unwrap();
    assert_eq!(
        payload.spec.chat_template,
        tuneq_openapi::ChatTemplateChoice::Alpaca
    );
    // A template tuneq does not have is refused, naming the field.
    let (status, refusal) = post(
        &s,
        ADMIN_KEY,
        json!({"id": "other", "location": location, "chat_template": "vicuna"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refusal}");
    assert_eq!(refusal["error"]["param"], "chat_template", "{refusal}");
}

/// Copies the files of the local folder `dir` to the moto bucket folder `uri`
/// (`s3://bucket/prefix`); returns `uri`.
async fn uploaded(dir: &Path, uri: &str) -> String {
    let location = tuneq_storage::Location::parse(uri).unwrap();
    let config = tuneq_storage::StorageConfig {
        s3: testing::s3_config(testing::moto()),
        ..Default::default()
    };
    let store = tuneq_storage::open(&location, &config).await.unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let key = tuneq_storage::ObjectKey::parse(&name).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        store
            .put(&key, bytes.into(), tuneq_storage::PutMode::Overwrite)
            .await
            .unwrap();
    }
    uri.to_string()
}

#[tokio::test]
async fn a_folder_in_a_store_is_checked_through_its_headers() {
    let s = start(|config| config.model_storage.s3 = testing::s3_config(testing::moto())).await;
    let bucket = format!("s3://{TEST_BUCKET}/{}", testing::unique_prefix("registry"));
    let good = uploaded(&good_folder(&s, "good"), &format!("{bucket}/good")).await;
    let (status, model) = post(&s, ADMIN_KEY, json!({"id": "in-store", "location": good})).await;
    assert_eq!(status, StatusCode::CREATED, "{model}");
    // What a local folder shows, read through the store.
    let details = &model["details"];
    assert_eq!(details["architecture"], "llama", "{model}");
    assert_eq!(details["dtype"], "float32", "{model}");
    assert_eq!(details["context_length"], 512, "{model}");
    assert_eq!(details["chat_template"], "own", "{model}");
    // Its jobs' trainers hash it once they have it: no identity is handed to them.
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, job) = create(&s, &file, json!({"model": "in-store"})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    let (lease, _) = support::claim(&s).await;
    use tuneq_openapi::StoredJson as _;
    let payload = tuneq_openapi::JobPayload::decode(&lease.id, &lease.payload).unwrap();
    assert_eq!(payload.spec.model, good);
    assert!(payload.spec.model_identity.is_none());
    // A folder whose weights disagree with its config, and one with nothing in it:
    // refused naming the problem, as for a local folder.
    let wrong = uploaded(
        &folder(&s, "wrong", &config(), 2, [300, 64]),
        &format!("{bucket}/wrong"),
    )
    .await;
    let empty = format!("{bucket}/nothing-here");
    for (location, named) in [(wrong, "embed_tokens"), (empty, "config.json")] {
        let (status, refusal) = post(&s, ADMIN_KEY, json!({"id": "m", "location": location})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{refusal}");
        assert_eq!(refusal["error"]["param"], "location", "{refusal}");
        let message = refusal["error"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{message}");
    }
}

/// A background hash is recorded only for the folder the model is still registered at
/// (compare-and-set), never over a registration made meanwhile; and registered again at
/// another folder after removal, the model gets that folder's hash.
#[tokio::test]
async fn a_background_hash_is_recorded_only_for_the_folder_still_registered() {
    use tuneq_api::records::model;
    let s = start(|_| {}).await;
    let first = good_folder(&s, "first");
    let mut changed = config();
    changed["max_position_embeddings"] = json!(256);
    let second = folder(&s, "second", &changed, 2, [256, 64]);
    let register = |dir: &Path| json!({"id": "m", "location": dir.display().to_string()});
    let (status, body) = post(&s, ADMIN_KEY, register(&first)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let first_identity = hashed_identity(&s, "m").await;
    assert_eq!(
        first_identity,
        tuneq_pools::folder::identity(&first).unwrap()
    );
    let location = |m: Option<model::BaseModel>| m.unwrap().location;
    let registered_at = location(model::get(&s.queue, "m").await.unwrap());
    // Another folder's hash, or one already recorded, changes nothing.
    let other = tuneq_pools::folder::identity(&second).unwrap();
    assert!(
        !model::record_identity(&s.queue, "m", "/elsewhere", &other)
            .await
            .unwrap()
    );
    assert!(
        !model::record_identity(&s.queue, "m", &registered_at, &first_identity)
            .await
            .unwrap()
    );
    assert!(
        !model::record_identity(&s.queue, "gone", &registered_at, &other)
            .await
            .unwrap()
    );
    let deleted = s
        .request(reqwest::Method::DELETE, ADMIN_KEY, "/admin/models/m")
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), StatusCode::OK);
    let (status, body) = post(&s, ADMIN_KEY, register(&second)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(hashed_identity(&s, "m").await, other);
    // A hash of the first folder, finished late, is not recorded over the second's.
    assert!(
        !model::record_identity(&s.queue, "m", &registered_at, &first_identity)
            .await
            .unwrap()
    );
    assert_eq!(
        model::get(&s.queue, "m").await.unwrap().unwrap().identity,
        Some(other)
    );
}
