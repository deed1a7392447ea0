//! End-to-end: `tuneq train` with the base model, the dataset and the output in object
//! storage — S3 (moto's server) and GCS (fake-gcs-server), both started by the harness.
//!
//! Each run is configured the way users configure the official SDKs (AWS environment
//! variables, `STORAGE_EMULATOR_HOST`), is SIGKILLed right after its first checkpoint,
//! and is resumed with an empty cache, as on a replacement machine. The adapter must be
//! byte-identical to an uninterrupted local run, and a torn (manifest-less) checkpoint
//! left in the bucket must never be resumed.

#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use bytes::Bytes;
use common::*;
use futures::TryStreamExt;
use std::path::Path;
use tuneq_storage::testing::{self, TEST_BUCKET};
use tuneq_storage::{Location, ObjectKey, ObjectStore, PutMode};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The store at `base`, holding the tiny model and the training file `train`.
async fn open_with_inputs(
    base: &str,
    config: &tuneq_storage::StorageConfig,
    train: &Path,
) -> std::sync::Arc<dyn ObjectStore> {
    let store = tuneq_storage::open(&Location::parse(base).unwrap(), config)
        .await
        .unwrap();
    upload_inputs(store.as_ref(), train).await;
    store
}

/// Uploads the tiny model folder and the training file under `root`.
async fn upload_inputs(store: &dyn ObjectStore, train: &Path) {
    let model = ObjectKey::parse("models/tiny").unwrap();
    tuneq_storage::transfer::upload_dir(store, tiny_model(), &model)
        .await
        .unwrap();
    tuneq_storage::transfer::upload_file(
        store,
        train,
        &ObjectKey::parse("tenants/t1/files/file-1/train.jsonl").unwrap(),
        PutMode::Overwrite,
    )
    .await
    .unwrap();
}

/// How a trainer (its environment, as the AWS SDKs read it) and the test (a storage
/// configuration) reach moto's S3 server.
fn s3_settings(
    server: &testing::TestServer,
) -> ([(&'static str, &str); 4], tuneq_storage::StorageConfig) {
    let env = [
        ("AWS_ENDPOINT_URL", server.endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", "us-east-1"),
    ];
    let config = tuneq_storage::StorageConfig {
        s3: testing::s3_config(server),
        ..Default::default()
    };
    (env, config)
}

fn remote_round_trip(scheme: &str, env: &[(&str, &str)], config: tuneq_storage::StorageConfig) {
    let (dir, train) = dir_with_task(40);
    let reference = dir.path().join("reference");
    run_to_end(&resume_args(&reference, &train));
    let want = adapter_bytes(&reference);

    let base = format!("{scheme}://{TEST_BUCKET}/{}", testing::unique_prefix("e2e"));
    let rt = runtime();
    let store = rt.block_on(open_with_inputs(&base, &config, &train));

    let output = format!("{base}/tenants/t1/jobs/job-1/output");
    let mut args = resume_args_for(
        &format!("{base}/models/tiny"),
        &format!("{base}/tenants/t1/files/file-1/train.jsonl"),
        &output,
    );
    let first_cache = dir.path().join("cache-a");
    args.extend(["--cache-dir".into(), first_cache.display().to_string()]);
    run_and_kill_with_env(&args, env, |e| e["event"] == "checkpoint" && e["step"] == 4);

    // A torn upload of a later checkpoint: files but no manifest. Resume must skip it.
    let out_key = |k: &str| ObjectKey::parse(&format!("tenants/t1/jobs/job-1/output/{k}")).unwrap();
    rt.block_on(store.put(
        &out_key("checkpoints/step-00000006/adapter_model.safetensors"),
        Bytes::from_static(b"torn"),
        PutMode::Overwrite,
    ))
    .unwrap();
    assert!(
        !rt.block_on(store.is_committed(&out_key(""))).unwrap(),
        "a killed run must not look finished"
    );

    // A new machine: empty cache, everything comes from the bucket.
    let second_cache = dir.path().join("cache-b");
    let n = args.len();
    args[n - 1] = second_cache.display().to_string();
    let finished = run_to_end_with_env(&args, env);
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&finished.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let resumed = events
        .iter()
        .find(|e| e["event"] == "resumed")
        .expect("resumed");
    assert_eq!(resumed["step"], 4, "{resumed}");
    let done = events
        .iter()
        .find(|e| e["event"] == "finished")
        .expect("finished");
    assert_eq!(done["adapter"], output.as_str());
    let checkpoints: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] == "checkpoint")
        .map(|e| e["location"].as_str().unwrap())
        .collect();
    assert!(
        !checkpoints.is_empty() && checkpoints.iter().all(|l| l.starts_with(&output)),
        "checkpoint events must name remote locations: {checkpoints:?}"
    );

    let adapter = rt
        .block_on(store.get_bytes(&out_key("adapter_model.safetensors")))
        .unwrap();
    assert!(
        adapter[..] == want[..],
        "{scheme}: resumed remote adapter differs from the uninterrupted local run"
    );
    assert!(rt.block_on(store.is_committed(&out_key(""))).unwrap());
    for f in ["adapter_config.json", "metrics.jsonl", "samples.jsonl"] {
        rt.block_on(store.head(&out_key(f))).unwrap();
    }
    // keep_last (2) committed checkpoints remain, each with its manifest.
    let listed: Vec<String> = rt
        .block_on(
            store
                .list(&out_key("checkpoints"))
                .map_ok(|m| m.key.to_string())
                .try_collect::<Vec<_>>(),
        )
        .unwrap();
    let manifests = listed
        .iter()
        .filter(|k| k.ends_with("/manifest.json"))
        .count();
    assert_eq!(manifests, 2, "{listed:#?}");
}

#[test]
fn trains_from_and_to_s3_and_resumes_on_a_fresh_machine() {
    let server = testing::moto();
    let (env, config) = s3_settings(server);
    remote_round_trip("s3", &env, config);
}

#[test]
fn trains_from_and_to_gcs_and_resumes_on_a_fresh_machine() {
    let server = testing::fake_gcs();
    let env = [("STORAGE_EMULATOR_HOST", server.endpoint.as_str())];
    let config = tuneq_storage::StorageConfig {
        gcs: testing::gcs_config(server),
        ..Default::default()
    };
    remote_round_trip("gs", &env, config);
}

#[test]
fn a_missing_remote_dataset_exits_as_bad_input_naming_the_field() {
    let server = testing::moto();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(BIN)
        .args([
            "train",
            "--model",
            tiny_model().to_str().unwrap(),
            "--train-file",
            &format!("s3://{TEST_BUCKET}/does/not/exist.jsonl"),
            "--output",
            dir.path().join("out").to_str().unwrap(),
        ])
        .env("AWS_ENDPOINT_URL", &server.endpoint)
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "testing")
        .env("AWS_REGION", "us-east-1")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(tuneq_openapi::launch::EXIT_BAD_INPUT),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("training_files") && stderr.contains("does/not/exist.jsonl"),
        "{stderr}"
    );
}

/// The cache a trainer stages remote inputs through (README: "unchanged objects, by
/// size and etag, are not fetched again"). A cached copy altered locally shows whether
/// staging fetched the object again: it survives when the object is unchanged, and is
/// replaced once the object changes (here with its size kept, so only the etag differs).
#[test]
fn staging_skips_unchanged_remote_objects_and_fetches_changed_ones() {
    let server = testing::moto();
    let config = tuneq_storage::StorageConfig {
        s3: testing::s3_config(server),
        ..Default::default()
    };
    let (dir, train) = dir_with_task(8);
    let base = format!("s3://{TEST_BUCKET}/{}", testing::unique_prefix("cache"));
    let rt = runtime();
    let store = rt.block_on(open_with_inputs(&base, &config, &train));
    let model_uri = format!("{base}/models/tiny");
    let train_uri = format!("{base}/tenants/t1/files/file-1/train.jsonl");
    let storage = tuneq_trainer::remote::Storage::new(config, dir.path().join("cache")).unwrap();
    let stage = || {
        (
            storage.input_dir("model", &model_uri).unwrap(),
            storage.input_file("training_files", &train_uri).unwrap(),
        )
    };
    let (model, data) = stage();
    let config_json = model.join("config.json");
    assert_eq!(
        std::fs::read(&config_json).unwrap(),
        std::fs::read(tiny_model().join("config.json")).unwrap()
    );
    assert_eq!(
        std::fs::read(&data).unwrap(),
        std::fs::read(&train).unwrap()
    );
    std::fs::write(&config_json, b"cached").unwrap();
    std::fs::write(&data, b"cached").unwrap();

    // Unchanged objects: nothing is fetched.
    assert_eq!(stage(), (model.clone(), data.clone()));
    assert_eq!(std::fs::read(&config_json).unwrap(), b"cached");
    assert_eq!(std::fs::read(&data).unwrap(), b"cached");

    // Changed objects of the same size: fetched again.
    let same_size = |bytes: Vec<u8>| -> Bytes {
        let mut changed = bytes;
        changed[0] = if changed[0] == b'{' { b' ' } else { b'{' };
        Bytes::from(changed)
    };
    let changed_config = same_size(std::fs::read(tiny_model().join("config.json")).unwrap());
    let changed_train = same_size(std::fs::read(&train).unwrap());
    for (key, bytes) in [
        ("models/tiny/config.json", &changed_config),
        ("tenants/t1/files/file-1/train.jsonl", &changed_train),
    ] {
        rt.block_on(store.put(
            &ObjectKey::parse(key).unwrap(),
            bytes.clone(),
            PutMode::Overwrite,
        ))
        .unwrap();
    }
    stage();
    assert_eq!(std::fs::read(&config_json).unwrap(), changed_config);
    assert_eq!(std::fs::read(&data).unwrap(), changed_train);
}

/// Continuing a fine-tuned model stored remotely (`--init-adapter s3://…/output`, as
/// the API passes a continued job's parent output) fetches the adapter's two files, not
/// the checkpoints and logs the folder also holds.
#[test]
fn a_remote_starting_adapter_fetches_only_the_adapter_files() {
    let server = testing::moto();
    let (env, config) = s3_settings(server);
    let (dir, train) = dir_with_task(40);
    let parent = dir.path().join("parent");
    run_to_end(&resume_args(&parent, &train));
    assert!(
        parent.join("checkpoints").is_dir(),
        "the parent keeps checkpoints"
    );

    let base = format!("s3://{TEST_BUCKET}/{}", testing::unique_prefix("init"));
    let rt = runtime();
    let store = rt.block_on(async {
        tuneq_storage::open(&Location::parse(&base).unwrap(), &config)
            .await
            .unwrap()
    });
    let output_key = ObjectKey::parse("tenants/t1/jobs/parent/output").unwrap();
    rt.block_on(tuneq_storage::transfer::upload_dir(
        store.as_ref(),
        &parent,
        &output_key,
    ))
    .unwrap();

    let cache = dir.path().join("cache");
    let mut args = resume_args(&dir.path().join("child"), &train);
    args.extend([
        "--init-adapter".into(),
        format!("{base}/tenants/t1/jobs/parent/output"),
        "--cache-dir".into(),
        cache.display().to_string(),
    ]);
    run_to_end_with_env(&args, &env);
    let mut fetched: Vec<String> = walk(&cache.join("inputs"))
        .into_iter()
        .filter_map(|p| Some(p.file_name()?.to_str()?.to_string()))
        .collect();
    fetched.sort();
    assert_eq!(
        fetched,
        ["adapter_config.json", "adapter_model.safetensors"],
        "only the adapter is fetched"
    );
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
