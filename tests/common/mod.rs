//! Helpers shared by the end-to-end tests: the tiny model, the shipped task, and
//! running `tuneq train` to the end or killing it at a chosen progress event.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

pub const BIN: &str = env!("CARGO_BIN_EXE_tuneq");

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The tiny model, written once per test process.
pub fn tiny_model() -> &'static Path {
    static MODEL: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &MODEL
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let model = dir.path().join("tiny");
            let out = tuneq(&[
                "model",
                "init",
                "--preset",
                "tiny",
                "--seed",
                "1",
                "--out",
                model.to_str().expect("utf8"),
            ]);
            assert!(
                out.status.success(),
                "model init failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            (dir, model)
        })
        .1
}

/// The real model: SmolLM2-135M-Instruct dequantized from its GGUF by
/// `scripts/fetch-real-model` (which `scripts/test` runs), at `TUNEQ_REAL_MODEL` or
/// `target/models/smollm2-135m-instruct-q4_1`. Missing, the test fails with that command.
pub fn real_model() -> PathBuf {
    real_model_of("TUNEQ_REAL_MODEL", "smollm2-135m-instruct-q4_1", "smollm2")
}

/// A real model `scripts/fetch-real-model NAME` converts (`name`), at the environment
/// variable `var` or `target/models/<folder>`. Missing, the test fails with that command.
pub fn real_model_of(var: &str, folder: &str, name: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/models").join(folder));
    assert!(
        path.join("model.safetensors").is_file(),
        "the real model is missing at {}: fetch and convert it with `scripts/fetch-real-model \
         {name}` (scripts/test does), or point {var} at it",
        path.display()
    );
    path
}

pub fn tuneq(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("run tuneq")
}

/// `tuneq train` of the tiny model on `train` into `output`, with the `extra` flags.
pub fn train_tiny(train: &Path, output: &Path, extra: &[&str]) -> Output {
    train_tiny_with_env(train, output, extra, &[])
}

/// [`train_tiny`] with extra environment variables.
pub fn train_tiny_with_env(
    train: &Path,
    output: &Path,
    extra: &[&str],
    env: &[(&str, String)],
) -> Output {
    Command::new(BIN)
        .args([
            "train",
            "--model",
            tiny_model().to_str().expect("utf8"),
            "--train-file",
            train.to_str().expect("utf8"),
            "--output",
            output.to_str().expect("utf8"),
        ])
        .args(extra)
        .env("RAYON_NUM_THREADS", "2")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("run tuneq")
}

/// The standard error of `out`, a run that must have exited as bad input.
pub fn bad_input_stderr(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(tuneq_openapi::launch::EXIT_BAD_INPUT),
        "stderr: {stderr}"
    );
    stderr
}

/// Training flags shared by the resume tests: small, but with dropout, accumulation,
/// warmup and a cosine schedule so every piece of resumable state matters.
pub fn resume_args(output: &Path, train: &Path) -> Vec<String> {
    resume_args_for(
        tiny_model().to_str().expect("utf8"),
        train.to_str().expect("utf8"),
        output.to_str().expect("utf8"),
    )
}

/// [`resume_args`] with any model, training file and output location (paths or URIs).
pub fn resume_args_for(model: &str, train: &str, output: &str) -> Vec<String> {
    [
        "train",
        "--progress",
        "json",
        "--model",
        model,
        "--train-file",
        train,
        "--output",
        output,
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "2",
        "--scheduler",
        "cosine",
        "--lora-dropout",
        "0.1",
        "--max-seq-len",
        "48",
        "--checkpoint-every",
        "2",
        "--weight-decay",
        "0.01",
        "--samples",
        "1",
        "--sample-tokens",
        "4",
        "--seed",
        "3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The first `n` lines of the shipped training task.
pub fn small_train_file(dir: &Path, n: usize) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("examples/data/tiny-task-train.jsonl"))
        .expect("task file");
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .collect();
    let path = dir.join("train.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").expect("write");
    path
}

/// A fresh temporary folder holding [`small_train_file`] of `n` lines; the folder and
/// the file.
pub fn dir_with_task(n: usize) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let train = small_train_file(dir.path(), n);
    (dir, train)
}

pub fn run_to_end(args: &[String]) -> Output {
    run_to_end_with_env(args, &[])
}

/// [`run_to_end`] with extra environment variables; returns the finished process.
pub fn run_to_end_with_env(args: &[String], env: &[(&str, &str)]) -> Output {
    let out = Command::new(BIN)
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .envs(env.iter().copied())
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "train failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Starts a run and SIGKILLs it as soon as `kill_when` accepts a progress line.
pub fn run_and_kill(args: &[String], kill_when: impl Fn(&serde_json::Value) -> bool) {
    run_and_kill_with_env(args, &[], kill_when);
}

/// [`run_and_kill`] with extra environment variables.
pub fn run_and_kill_with_env(
    args: &[String],
    env: &[(&str, &str)],
    kill_when: impl Fn(&serde_json::Value) -> bool,
) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut killed = false;
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if kill_when(&event) {
            child.kill().expect("SIGKILL");
            killed = true;
            break;
        }
    }
    let _ = child.wait();
    assert!(killed, "the run ended before the kill point was reached");
}

/// Decides, from one progress event, that this is the moment to SIGKILL the trainer.
pub type KillPoint = Box<dyn Fn(&serde_json::Value) -> bool>;

pub fn adapter_bytes(output: &Path) -> Vec<u8> {
    std::fs::read(output.join("adapter_model.safetensors")).expect("adapter written")
}

/// Every file called `name` under `dir`, at any depth.
pub fn files_named(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.file_name().is_some_and(|n| n == name) {
                found.push(path);
            }
        }
    }
    found
}
