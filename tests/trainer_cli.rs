//! End-to-end tests of `tuneq train` and friends, run as a real process.
//!
//! They use the tiny preset written by `tuneq model init` and the synthetic task in
//! `examples/data/`, and check what a user relies on: bad input exits 42 (the launch contract's code) and names
//! every bad line; a run killed with SIGKILL at any point and restarted ends with a
//! byte-identical adapter; SIGTERM writes a checkpoint and exits 75 (interrupted, never 0); the model learns.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

mod common;
use common::*;

#[test]
fn a_run_killed_at_any_point_resumes_to_a_byte_identical_adapter() {
    let (dir, train) = dir_with_task(40);
    let reference = dir.path().join("reference");
    run_to_end(&resume_args(&reference, &train));
    let want = adapter_bytes(&reference);

    let step = |n: u64| move |e: &serde_json::Value| e["event"] == "step" && e["step"] == n;
    let checkpoint =
        |n: u64| move |e: &serde_json::Value| e["event"] == "checkpoint" && e["step"] == n;
    let kill_points: [(&str, KillPoint); 3] = [
        ("between checkpoints", Box::new(step(3))),
        ("right after a checkpoint", Box::new(checkpoint(4))),
        ("during the last steps", Box::new(step(9))),
    ];
    for (name, kill_when) in kill_points {
        let out = dir.path().join(name.replace(' ', "-"));
        let args = resume_args(&out, &train);
        run_and_kill(&args, kill_when);
        assert!(
            !out.join("manifest.json").exists(),
            "{name}: killed run must not look finished"
        );
        run_to_end(&args);
        assert!(
            adapter_bytes(&out) == want,
            "{name}: resumed adapter differs from the uninterrupted run"
        );
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
        let steps: Vec<u64> = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("loss").is_some())
            .filter_map(|v| v["step"].as_u64())
            .collect();
        // 40 examples in batches of 4 × 2 accumulated: 5 steps an epoch, 2 epochs.
        let expected: Vec<u64> = (1..=10).collect();
        assert_eq!(
            steps, expected,
            "{name}: metrics.jsonl must have each step once, in order"
        );
    }
}

#[test]
fn sigterm_writes_a_checkpoint_and_exits_interrupted() {
    let (dir, train) = dir_with_task(40);
    let out = dir.path().join("out");
    let mut args = resume_args(&out, &train);
    let at = args
        .iter()
        .position(|a| a == "--checkpoint-every")
        .expect("flag present");
    args[at + 1] = "1000".into();
    let mut child = Command::new(BIN)
        .args(&args)
        .env("RAYON_NUM_THREADS", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.expect("line");
        if line.contains("\"event\":\"step\"") {
            let status = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status()
                .expect("kill");
            assert!(status.success());
            break;
        }
    }
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().expect("wait");
    assert_eq!(
        status.code(),
        Some(tuneq_openapi::launch::EXIT_INTERRUPTED),
        "SIGTERM must exit 75 (interrupted), never 0, got {status:?}"
    );
    assert!(
        rest.iter().any(|l| l.contains("\"event\":\"interrupted\"")),
        "no interrupted event: {rest:?}"
    );
    let ckpts = std::fs::read_dir(out.join("checkpoints"))
        .expect("checkpoints")
        .count();
    assert_eq!(ckpts, 1, "exactly one checkpoint written on SIGTERM");
}

/// A run of [`resume_args`] into `dir/out`, killed once it has written its checkpoint
/// of step 2: its output folder and its arguments.
fn killed_after_step_2_checkpoint(dir: &Path, train: &Path) -> (std::path::PathBuf, Vec<String>) {
    let out = dir.join("out");
    let args = resume_args(&out, train);
    run_and_kill(&args, |e| e["event"] == "checkpoint" && e["step"] == 2);
    (out, args)
}

#[test]
fn incomplete_checkpoints_are_never_resumed() {
    let (dir, train) = dir_with_task(16);
    let reference = dir.path().join("reference");
    run_to_end(&resume_args(&reference, &train));
    let (out, args) = killed_after_step_2_checkpoint(dir.path(), &train);
    // Fake a later checkpoint whose manifest never got written, and one whose file was cut short.
    let ck = out.join("checkpoints");
    let good = ck.join("step-00000002");
    let torn = ck.join("step-00000003");
    std::fs::create_dir_all(&torn).expect("mkdir");
    std::fs::copy(
        good.join("adapter_model.safetensors"),
        torn.join("adapter_model.safetensors"),
    )
    .expect("copy");
    let damaged = ck.join("step-00000004");
    copy_dir(&good, &damaged);
    let f = damaged.join("optimizer.safetensors");
    let len = std::fs::metadata(&f).expect("meta").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .expect("open")
        .set_len(len / 2)
        .expect("truncate");
    let out_run = Command::new(BIN)
        .args(&args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("run");
    assert!(out_run.status.success());
    let stdout = String::from_utf8_lossy(&out_run.stdout);
    assert!(
        stdout.contains("\"event\":\"resumed\",\"step\":2"),
        "must resume from step 2: {stdout}"
    );
    assert!(
        stdout.contains("skipping damaged checkpoint"),
        "must warn about the damaged one"
    );
    assert!(adapter_bytes(&out) == adapter_bytes(&reference));
}

#[test]
fn a_checkpoint_whose_bytes_changed_but_not_its_size_is_refused_by_its_sha256() {
    let (dir, train) = dir_with_task(16);
    let (out, args) = killed_after_step_2_checkpoint(dir.path(), &train);
    // A later checkpoint, complete and of the right sizes, whose adapter rotted on disk:
    // only its SHA-256 tells it from a sound one.
    let ck = out.join("checkpoints");
    let good = ck.join("step-00000002");
    let rotten = ck.join("step-00000003");
    copy_dir(&good, &rotten);
    let f = rotten.join("adapter_model.safetensors");
    let mut bytes = std::fs::read(&f).expect("read");
    let n = bytes.len();
    for b in &mut bytes[n - 8..] {
        *b ^= 0x5a;
    }
    std::fs::write(&f, &bytes).expect("write");
    let finished = run_to_end(&args);
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&finished.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let warning = events
        .iter()
        .find(|e| e["event"] == "warning")
        .expect("a warning");
    let message = warning["message"].as_str().expect("message");
    assert!(
        message.contains("skipping damaged checkpoint")
            && message.contains("step-00000003")
            && message.contains("adapter_model.safetensors does not match its SHA-256"),
        "{message}"
    );
    let resumed = events
        .iter()
        .find(|e| e["event"] == "resumed")
        .expect("resumed");
    assert_eq!(resumed["step"], 2);
    assert!(
        resumed["checkpoint"]
            .as_str()
            .is_some_and(|c| c.ends_with("step-00000002")),
        "falls back to the sound checkpoint: {resumed}"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

#[test]
fn bad_dataset_lines_are_all_listed_with_the_bad_input_exit_code() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        concat!(
            "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"yo\"}]}\n",
            "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":5}]}\n",
            "not json\n",
            "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":\"y\"}]}\n",
        ),
    )
    .expect("write");
    let out = train_tiny(&bad, &dir.path().join("o"), &["--progress", "json"]);
    bad_input_stderr(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "bad.jsonl:2",
        "messages[1].content",
        "bad.jsonl:3",
        "bad.jsonl:4",
        "messages[0].role",
    ] {
        assert!(
            stderr.contains(needle),
            "stderr lacks {needle:?}:\n{stderr}"
        );
    }
    let json: serde_json::Value = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("a JSON error on stdout");
    assert_eq!(json["error"]["lines"].as_array().map(Vec::len), Some(3));
    assert!(
        !dir.path().join("o").join("checkpoints").exists(),
        "bad input must change nothing"
    );
}

#[test]
fn bad_specs_and_missing_models_exit_as_bad_input_naming_the_problem() {
    let (dir, train) = dir_with_task(4);
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        r#"{"model": "m", "training_file": "t", "output": "o", "lora": {"rank": 8}}"#,
    )
    .expect("write");
    let out = tuneq(&["train", "--spec", spec.to_str().expect("utf8")]);
    bad_input_stderr(&out);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("rank"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = tuneq(&[
        "train",
        "--model",
        dir.path().join("nope").to_str().expect("utf8"),
        "--train-file",
        train.to_str().expect("utf8"),
        "--output",
        dir.path().join("o").to_str().expect("utf8"),
    ]);
    bad_input_stderr(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));

    let out = train_tiny(
        &train,
        &dir.path().join("o"),
        &["--lora-r", "0", "--targets", "q_proj,qkv"],
    );
    let stderr = bad_input_stderr(&out);
    assert!(
        stderr.contains("lora.r") && stderr.contains("qkv"),
        "{stderr}"
    );

    // Every answer cut off by a short max_seq_len: the field to change is named.
    let out = train_tiny(&train, &dir.path().join("o"), &["--max-seq-len", "4"]);
    let stderr = bad_input_stderr(&out);
    assert!(
        stderr.contains("max_seq_len") && stderr.contains("no example"),
        "{stderr}"
    );
}

#[test]
fn the_tiny_model_learns_the_shipped_task() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let data = repo().join("examples/data");
    let result = train_tiny(
        &data.join("tiny-task-train.jsonl"),
        &out,
        &[
            "--progress",
            "json",
            "--validation-file",
            data.join("tiny-task-val.jsonl").to_str().expect("utf8"),
            "--epochs",
            "4",
            "--batch-size",
            "8",
            "--lr",
            "2e-3",
            "--warmup-steps",
            "5",
            "--max-seq-len",
            "128",
            "--samples",
            "2",
            "--sample-tokens",
            "16",
        ],
    );
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).expect("manifest"))
            .expect("json");
    let base = manifest["metrics"]["base_validation_loss"]
        .as_f64()
        .expect("base loss");
    let tuned = manifest["metrics"]["validation_loss"]
        .as_f64()
        .expect("final loss");
    assert!(
        tuned <= 0.7 * base,
        "validation loss {tuned:.4} is not 30% below the base model's {base:.4}"
    );
    let samples = std::fs::read_to_string(out.join("samples.jsonl")).expect("samples");
    assert_eq!(samples.lines().count(), 2);
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "metrics.jsonl",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    assert_eq!(
        manifest["base_model"]["sha256"].as_str().map(str::len),
        Some(64)
    );

    // Generation with the adapter applied on the fly must equal generation with the
    // adapter folded into the weights, and differ from the base model's: `generate`
    // really applies the adapter, and `merge` really folds it.
    let generate = |model: &Path, adapter: Option<&Path>| {
        let mut args = vec![
            "generate".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--prompt".into(),
            "Next number after 4?".into(),
            "--max-new-tokens".into(),
            "8".into(),
        ];
        if let Some(adapter) = adapter {
            args.extend(["--adapter".into(), adapter.display().to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let generated = tuneq(&args);
        assert!(
            generated.status.success(),
            "{}",
            String::from_utf8_lossy(&generated.stderr)
        );
        String::from_utf8(generated.stdout).expect("utf8")
    };
    let with_adapter = generate(tiny_model(), Some(&out));
    // `generate` prints the completion alone.
    assert!(
        !with_adapter.trim().is_empty(),
        "nothing was generated: {with_adapter:?}"
    );
    let merged = dir.path().join("merged");
    let merge = tuneq(&[
        "merge",
        "--model",
        tiny_model().to_str().expect("utf8"),
        "--adapter",
        out.to_str().expect("utf8"),
        "--out",
        merged.to_str().expect("utf8"),
    ]);
    assert!(
        merge.status.success(),
        "{}",
        String::from_utf8_lossy(&merge.stderr)
    );
    assert_eq!(
        generate(&merged, None),
        with_adapter,
        "the merged model generates otherwise than base + adapter"
    );
    assert_eq!(
        generate(tiny_model(), Some(&out)),
        with_adapter,
        "greedy generation is not deterministic"
    );
    assert_ne!(
        generate(tiny_model(), None),
        with_adapter,
        "the adapter changed nothing in what the model generates"
    );
}

/// The spec a successful `tuneq train --print-spec` printed.
fn printed_spec(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("spec JSON")
}

#[test]
fn flags_override_the_spec_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        r#"{"model": "m", "training_file": "t.jsonl", "output": "o",
            "hyperparameters": {"learning_rate": 0.001, "epochs": 3}, "lora": {"r": 4}}"#,
    )
    .expect("write");
    let out = tuneq(&[
        "train",
        "--spec",
        spec.to_str().expect("utf8"),
        "--lr",
        "0.5",
        "--targets",
        "q_proj,v_proj",
        "--print-spec",
    ]);
    let effective = printed_spec(&out);
    assert_eq!(effective["hyperparameters"]["learning_rate"], 0.5);
    assert_eq!(effective["hyperparameters"]["epochs"], 3);
    assert_eq!(effective["lora"]["r"], 4);
    assert_eq!(
        effective["lora"]["target_modules"],
        serde_json::json!(["q_proj", "v_proj"])
    );
    assert_eq!(effective["training_files"], serde_json::json!(["t.jsonl"]));
}

#[test]
fn every_flag_overrides_the_demo_spec() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .args([
            "train",
            "--demo",
            "--print-spec",
            // Flags the demo once copied by hand, and flags it silently dropped.
            "--epochs",
            "1",
            "--lora-r",
            "4",
            "--checkpoint-every",
            "7",
            "--samples",
            "1",
            "--train-file",
            "mine.jsonl",
        ])
        .env("TUNEQ_DEMO_DIR", dir.path())
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("run tuneq");
    let effective = printed_spec(&out);
    assert_eq!(effective["hyperparameters"]["epochs"], 1);
    assert_eq!(effective["lora"]["r"], 4);
    assert_eq!(effective["checkpoint"]["every_steps"], 7);
    assert_eq!(effective["sampling"]["num_samples"], 1);
    assert_eq!(
        effective["training_files"],
        serde_json::json!(["mine.jsonl"])
    );
    // What no flag touched is the demo's.
    assert_eq!(effective["lora"]["alpha"], 16.0);
    assert_eq!(
        effective["model"],
        dir.path().join("model").display().to_string()
    );
}

/// `--compute bf16` trains on the fused CPU path with bf16 operands (weights loaded as
/// bf16 from `auto`), records that path in its checkpoints, and is refused with f32
/// weights and on the CPU graph, naming the field.
#[test]
fn bf16_compute_trains_and_is_refused_where_it_cannot_run() {
    let (dir, train) = dir_with_task(8);
    let args = |output: &str, extra: &[&str]| -> Vec<String> {
        let mut args = resume_args(&dir.path().join(output), &train);
        args.extend(
            ["--compute", "bf16"]
                .iter()
                .chain(extra)
                .map(|s| s.to_string()),
        );
        args
    };
    run_to_end(&args("bf16", &[]));
    let output = dir.path().join("bf16");
    assert!(output.join("adapter_model.safetensors").exists());
    let states = files_named(&output, "trainer_state.json");
    assert!(!states.is_empty(), "no checkpoint under {output:?}");
    let state = std::fs::read_to_string(&states[0]).expect("state");
    assert!(state.contains("cpu-fused-bf16"), "{state}");

    let refused = |args: Vec<String>, env: &[(&str, &str)], words: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tuneq"))
            .args(&args)
            .envs(env.iter().copied())
            .output()
            .expect("run tuneq");
        let stderr = bad_input_stderr(&out);
        assert!(words.iter().all(|w| stderr.contains(w)), "{stderr}");
    };
    refused(args("f32", &["--dtype", "f32"]), &[], &["compute", "dtype"]);
    refused(
        args("graph", &[]),
        &[("TUNEQ_CPU_PATH", "graph")],
        &["compute", "graph"],
    );
}

/// A Gemma trains on the fused CPU kernels like every family: its checkpoint records
/// the fused path and the step's arithmetic, and no event warns of a slower path.
#[test]
fn a_gemma_trains_on_the_fused_kernels() {
    let (dir, train) = dir_with_task(8);
    let model = dir.path().join("gemma2");
    let init = tuneq(&[
        "model",
        "init",
        "--preset",
        "tiny",
        "--arch",
        "gemma2",
        "--out",
        model.to_str().expect("utf8"),
    ]);
    assert!(init.status.success(), "{init:?}");
    let output = dir.path().join("out");
    let args = resume_args_for(
        model.to_str().expect("utf8"),
        train.to_str().expect("utf8"),
        output.to_str().expect("utf8"),
    );
    let out = run_to_end(&args);
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let warnings: Vec<_> = events.iter().filter(|e| e["event"] == "warning").collect();
    assert!(warnings.is_empty(), "a plain run warned: {warnings:?}");
    let states = files_named(&output, "trainer_state.json");
    assert!(!states.is_empty(), "no checkpoint under {output:?}");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&states[0]).expect("state")).expect("json");
    assert_eq!(state["compute"]["path"], "cpu-fused", "{state}");
    assert!(output.join("adapter_model.safetensors").exists());
}

#[test]
fn an_unavailable_device_exits_as_bad_input() {
    // A CUDA build refuses only when no device answers; with one, `--device cuda` trains,
    // and there is nothing unavailable to ask for here.
    if tuneq_trainer::train::cuda_available() {
        eprintln!(
            "skipped: CUDA device 0 answers in this build, so `--device cuda` is available and \
             cannot be refused here"
        );
        return;
    }
    let (dir, train) = dir_with_task(4);
    let output = dir.path().join("o");
    // (`--dtype bf16` trains on the CPU: bf16 storage, f32 compute; see
    // tests/memory_estimate.rs.)
    let out = train_tiny(&train, &output, &["--device", "cuda"]);
    let stderr = bad_input_stderr(&out);
    // Without CUDA support the message says how to get it; with it, which device failed.
    let why = if cfg!(feature = "cuda") {
        "CUDA device 0"
    } else {
        "--features cuda"
    };
    assert!(stderr.contains(why), "{stderr}");
}

#[test]
fn storage_config_files_are_checked_field_by_field() {
    let (dir, train) = dir_with_task(4);
    let config = dir.path().join("tuneq.toml");
    std::fs::write(
        &config,
        "[storage.s3]\nendpiont = \"http://127.0.0.1:9000\"\n",
    )
    .expect("write");
    let out = train_tiny(
        &train,
        &dir.path().join("out"),
        &["--storage-config", config.to_str().expect("utf8")],
    );
    let stderr = bad_input_stderr(&out);
    assert!(
        stderr.contains("tuneq.toml") && stderr.contains("endpiont"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("out").exists(),
        "bad input changes nothing"
    );
}

#[test]
fn a_trainer_past_its_memory_limit_stops_as_bad_input_with_the_figures() {
    let (dir, train) = dir_with_task(4);
    let output = dir.path().join("o");
    let out = train_tiny_with_env(
        &train,
        &output,
        &[],
        &[
            // 32 MiB: less than the program itself holds once it has loaded the model.
            ("TUNEQ_MEMORY_LIMIT_BYTES", (32u64 << 20).to_string()),
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(tuneq_openapi::launch::EXIT_BAD_INPUT),
        "{out:?}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("over its limit of 32 MiB"), "{stderr}");
    // A limit it stays under changes nothing.
    let out = train_tiny_with_env(
        &train,
        &dir.path().join("o2"),
        &["--epochs", "1"],
        &[("TUNEQ_MEMORY_LIMIT_BYTES", (8u64 << 30).to_string())],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn activation_checkpointing_changes_no_byte_of_the_adapter() {
    // With dropout, so the recomputed layers must replay the very masks drawn.
    let (dir, train) = dir_with_task(24);
    let adapter = |setting: &str| {
        let output = dir.path().join(setting);
        let out = train_tiny_with_env(
            &train,
            &output,
            &[
                "--max-steps",
                "3",
                "--batch-size",
                "4",
                "--lora-dropout",
                "0.1",
                "--activation-checkpointing",
                setting,
                "--progress",
                "json",
            ],
            &[],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read(output.join("adapter_model.safetensors")).expect("adapter")
    };
    let (kept, recomputed) = (adapter("off"), adapter("on"));
    assert!(!kept.is_empty());
    assert!(kept == recomputed, "checkpointing changed the adapter");
}

#[test]
fn model_estimate_prints_the_memory_by_part_and_refuses_bad_flags() {
    let model = tiny_model().to_str().expect("utf8");
    let out = tuneq(&["model", "estimate", "--model", model, "--memory", "1Mi"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let total = v["cpu"]["total_mib"].as_u64().expect("total");
    let parts: u64 = ["runtime_mib", "weights_mib"]
        .iter()
        .map(|k| v["cpu"][k].as_u64().expect("part"))
        .sum();
    assert!(total > parts && parts > 0, "{v}");
    // 1 MiB holds nothing: auto checkpointing is on, and it still does not fit.
    assert_eq!(v["cpu"]["fits"], false, "{v}");
    assert_eq!(v["cpu"]["checkpointing"], true, "{v}");
    assert!(v["gpu"]["total_mib"].as_u64().expect("gpu") > 0);
    assert_eq!(v["gpu"]["fits"], serde_json::Value::Null, "{v}");
    // Each compute thread past the estimate's two adds its scratch.
    let scratch = |threads: &str| {
        let out = tuneq(&["model", "estimate", "--model", model, "--threads", threads]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["cpu"]["scratch_mib"].as_u64().expect("scratch")
    };
    let per_thread_mib = tuneq_pools::memory::SCRATCH_PER_THREAD_BYTES >> 20;
    assert_eq!(scratch("34") - scratch("2"), 32 * per_thread_mib);
    // The same on a GPU: 1 MiB of accelerator memory turns recomputation on.
    let out = tuneq(&[
        "model",
        "estimate",
        "--model",
        model,
        "--accelerator-memory",
        "1Mi",
    ]);
    let on: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        (&on["gpu"]["checkpointing"], &on["gpu"]["fits"]),
        (&serde_json::json!(true), &serde_json::json!(false)),
        "{on}"
    );
    assert!(
        on["gpu"]["total_mib"].as_u64() < v["gpu"]["total_mib"].as_u64(),
        "{on} {v}"
    );
    // bf16 compute holds the weights in bf16 (half the f32 default's) unless told f32,
    // which it refuses.
    let weights = |extra: &[&str]| {
        let mut args = vec!["model", "estimate", "--model", model];
        args.extend(extra);
        let out = tuneq(&args);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        v["cpu"]["weights_mib"].as_u64().expect("weights")
    };
    let (f32_weights, bf16_weights) = (weights(&[]), weights(&["--compute", "bf16"]));
    assert!(
        bf16_weights * 2 <= f32_weights + 1,
        "{bf16_weights} vs {f32_weights}"
    );
    for bad in [
        vec!["--compute", "bf16", "--dtype", "f32"],
        vec!["--memory", "12XB"],
        vec!["--accelerator-memory", "-1"],
        vec!["--batch-size", "0"],
        vec!["--max-seq-len", "99999999999"],
    ] {
        let mut args = vec!["model", "estimate", "--model", model];
        args.extend(bad.iter().copied());
        let out = tuneq(&args);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
    }
    let out = tuneq(&["model", "estimate", "--model", "/nonexistent"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
}

/// `TUNEQ_GEMM_ISA` caps the own kernels' instruction set (what `scripts/bench-train
/// --isa avx2` measures an AVX2-only node with), the cap is what the run records, and a
/// value that is not a cap is refused before anything runs.
#[test]
fn an_instruction_set_cap_picks_the_kernels_and_a_bad_one_is_refused() {
    let bench = |isa: &str, compute: &str| {
        Command::new(env!("CARGO_BIN_EXE_tuneq"))
            .args(["bench", "train", "--preset", "tiny", "--batch", "1"])
            .args(["--seq", "16", "--steps", "1", "--warmup", "0"])
            .args(["--compute", compute])
            .env("TUNEQ_GEMM_ISA", isa)
            .output()
            .expect("run tuneq")
    };
    let gemm_of = |out: std::process::Output| -> String {
        assert!(out.status.success(), "{out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let json = stdout.lines().last().expect("a JSON line");
        let report: serde_json::Value = serde_json::from_str(json).expect("JSON");
        report["compute"]["gemm"]
            .as_str()
            .expect("compute.gemm")
            .to_string()
    };
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert_eq!(gemm_of(bench("avx2", "f32")), "tuneq-gemm-1 (avx2)");
        assert_eq!(
            gemm_of(bench("AVX2", "bf16")),
            "tuneq-gemm-1 (avx2) on widened bf16 operands"
        );
        if std::arch::is_x86_feature_detected!("avx512f") {
            assert_eq!(gemm_of(bench("avx512", "f32")), "tuneq-gemm-1 (avx512)");
        }
    }
    let out = bench("sse2", "f32");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("TUNEQ_GEMM_ISA=\"sse2\"") && stderr.contains("avx512 or avx2"),
        "{stderr}"
    );
}

/// The hash a run's fingerprint and manifest carry for its base model: the one the
/// spec's `model_identity` brings (registration computed it) while the folder's stamp
/// matches it, the folder's own, read again and warned about, once a file changed.
#[test]
fn a_registered_models_hash_is_taken_while_its_files_are_unchanged() {
    let (dir, train) = dir_with_task(8);
    let model = dir.path().join("model");
    copy_dir(tiny_model(), &model);
    let real = tuneq_pools::folder::identity(&model).expect("identity");
    let run = |name: &str, identity: &tuneq_openapi::ModelIdentity| {
        let output = dir.path().join(name);
        let spec = dir.path().join(format!("{name}.json"));
        let body = serde_json::json!({
            "model": model, "training_files": [train], "output": output,
            "hyperparameters": {"epochs": 1, "batch_size": 4, "max_seq_len": 48},
            "model_identity": identity,
        });
        std::fs::write(&spec, body.to_string()).expect("spec");
        let args = [
            "train",
            "--progress",
            "json",
            "--spec",
            spec.to_str().expect("utf8"),
        ];
        let out = run_to_end(&args.map(String::from));
        let manifest: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(output.join("manifest.json")).expect("manifest"),
        )
        .expect("json");
        let warned = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|e| e["event"] == "warning");
        (manifest["base_model"]["sha256"].clone(), warned)
    };
    // A hash no file has: it can only have come from the spec.
    let registered = tuneq_openapi::ModelIdentity {
        sha256: "ab".repeat(32),
        stamp: real.stamp.clone(),
    };
    assert_eq!(
        run("taken", &registered),
        (serde_json::json!("ab".repeat(32)), false)
    );
    // The config rewritten since: the folder is hashed again, and the run says so.
    let config = std::fs::read(model.join("config.json")).expect("config");
    std::fs::write(model.join("config.json"), config).expect("rewrite");
    let file = std::fs::File::options()
        .write(true)
        .open(model.join("config.json"))
        .expect("open");
    file.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000))
        .expect("touch");
    assert_eq!(
        run("hashed", &registered),
        (serde_json::json!(real.sha256), true)
    );
}
