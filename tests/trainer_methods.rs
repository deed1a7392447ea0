//! `tuneq train` for the methods beyond supervised cross-entropy and the run's own
//! stopping rules, run as a real process: DPO (exact resume, continuing an adapter
//! against it, each method refusing the other's data), a run started from another's
//! adapter, and early stopping (the best validated adapter kept, and resumed to).

use std::path::Path;
use std::process::Command;

mod common;
use common::*;

/// `resume_args` for DPO on the shipped preference pairs (10 pairs in micro-batches of
/// 4 with 2 accumulated: 2 steps an epoch, 4 in all, a checkpoint every 2).
fn dpo_args(output: &Path) -> Vec<String> {
    let pairs = repo().join("examples/data/openai-preference.jsonl");
    let flags = [
        ("--max-seq-len", "512"),
        ("--method", "dpo"),
        ("--beta", "0.2"),
    ];
    with_flags(resume_args(output, &pairs), &flags)
}

/// The `preference` figures of each step a run reports.
fn step_events(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "step")
        .collect()
}

#[test]
fn a_dpo_run_killed_after_a_checkpoint_resumes_to_a_byte_identical_adapter() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reference = dir.path().join("reference");
    let whole = run_to_end(&dpo_args(&reference));
    let steps = step_events(&whole.stdout);
    assert_eq!(steps.len(), 4, "{steps:?}");
    // The reference is the model the run starts from: the first step sees no reward.
    assert!((steps[0]["loss"].as_f64().expect("loss") - std::f64::consts::LN_2).abs() < 1e-12);
    assert_eq!(steps[0]["preference"]["rewards_margin"], 0.0);
    assert!(
        steps[3]["preference"]["rewards_margin"]
            .as_f64()
            .expect("margin")
            != 0.0
    );

    let out = dir.path().join("killed");
    let args = dpo_args(&out);
    run_and_kill(&args, |e| e["event"] == "checkpoint" && e["step"] == 2);
    assert!(!out.join("manifest.json").exists());
    let resumed = run_to_end(&args);
    assert!(
        adapter_bytes(&out) == adapter_bytes(&reference),
        "the resumed DPO adapter differs from the uninterrupted run"
    );
    let figures = |events: &[serde_json::Value]| -> Vec<[serde_json::Value; 4]> {
        events
            .iter()
            .map(|e| {
                [
                    e["step"].clone(),
                    e["loss"].clone(),
                    e["grad_norm"].clone(),
                    e["preference"].clone(),
                ]
            })
            .collect()
    };
    let after = figures(&step_events(&resumed.stdout));
    assert_eq!(after.first().map(|f| &f[0]), Some(&3.into()));
    assert_eq!(
        after,
        figures(&steps[2..]),
        "the resumed steps report the same figures"
    );
}

#[test]
fn dpo_continues_an_adapter_against_it_and_each_method_refuses_the_other_s_data() {
    let (dir, train) = dir_with_task(16);
    let sft = dir.path().join("sft");
    run_to_end(&resume_args(&sft, &train));
    let args = dpo_args(&dir.path().join("dpo"));
    // Without dropout the policy's first forward is the reference's (which never has
    // any): the first step sees no reward.
    let sft = sft.display().to_string();
    let args = with_flags(args, &[("--lora-dropout", "0"), ("--init-adapter", &sft)]);
    let steps = step_events(&run_to_end(&args).stdout);
    assert!((steps[0]["loss"].as_f64().expect("loss") - std::f64::consts::LN_2).abs() < 1e-12);
    assert_eq!(steps[0]["preference"]["rewards_chosen"], 0.0);

    let refused = |args: &[String], field: &str| {
        let out = Command::new(BIN)
            .args(args)
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .expect("run tuneq");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(42), "{stderr}");
        assert!(stderr.contains(field), "{field} not named: {stderr}");
    };
    let mut chats_for_dpo = resume_args(&dir.path().join("a"), &train);
    chats_for_dpo.extend(["--method", "dpo"].map(String::from));
    refused(&chats_for_dpo, "method");
    let pairs = repo().join("examples/data/openai-preference.jsonl");
    refused(&resume_args(&dir.path().join("b"), &pairs), "method");
    let bad_beta = with_flags(dpo_args(&dir.path().join("c")), &[("--beta", "0")]);
    refused(&bad_beta, "method.beta");
}

/// `args` with each `(flag, value)` set: replaced where the flag is, added where not.
fn with_flags(mut args: Vec<String>, flags: &[(&str, &str)]) -> Vec<String> {
    for &(flag, value) in flags {
        match args.iter().position(|a| a == flag) {
            Some(at) => args[at + 1] = value.into(),
            None => args.extend([flag.into(), value.into()]),
        }
    }
    args
}

/// A run on the shipped task whose validation loss stops improving (lr 0.05, validated
/// every 2 steps, patience 2, one checkpoint kept).
fn early_stopping_args(output: &Path) -> Vec<String> {
    let train = repo().join("examples/data/tiny-task-train.jsonl");
    let val = repo().join("examples/data/tiny-task-val.jsonl");
    let flags = [
        ("--validation-file", val.to_str().expect("utf8")),
        ("--epochs", "3"),
        ("--batch-size", "8"),
        ("--grad-accum", "1"),
        ("--lr", "0.05"),
        ("--eval-every", "2"),
        ("--early-stopping-patience", "2"),
        ("--keep-checkpoints", "1"),
        ("--checkpoint-every", "100"),
        ("--samples", "0"),
    ];
    with_flags(resume_args(output, &train), &flags)
}

#[test]
fn early_stopping_keeps_the_best_validated_adapter_and_resumes_to_the_same_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("whole");
    let run = run_to_end(&early_stopping_args(&out));
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let of = |kind: &str| {
        events
            .iter()
            .find(|e| e["event"] == kind)
            .cloned()
            .expect(kind)
    };
    let (started, stopped) = (of("started"), of("early_stopped"));
    let total = started["total_steps"].as_u64().expect("total");
    let at = stopped["stopped_at"]
        .as_u64()
        .expect("stopped before the end");
    let best = stopped["best_step"].as_u64().expect("best");
    assert!(
        best < at && at < total,
        "best {best}, stopped {at} of {total}"
    );
    assert_eq!(of("finished")["step"], at);
    assert_eq!(
        of("finished")["validation_loss"],
        stopped["best_validation_loss"]
    );
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("manifest.json")).expect("manifest"),
    )
    .expect("JSON");
    assert_eq!(manifest["early_stopping"]["best_step"], best);
    // The best step's checkpoint outlives keep_last 1, and its adapter is the run's.
    let best_dir = out.join(format!("checkpoints/step-{best:08}"));
    let tensors = |path: &Path| {
        let bytes = std::fs::read(path).expect("adapter");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        let mut named: Vec<(String, Vec<u8>)> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, view.data().to_vec()))
            .collect();
        named.sort();
        named
    };
    assert_eq!(
        tensors(&out.join("adapter_model.safetensors")),
        tensors(&best_dir.join("adapter_model.safetensors"))
    );

    // Killed after the checkpoint of its best step, it resumes to the same end.
    let again = dir.path().join("killed");
    let args = early_stopping_args(&again);
    run_and_kill(&args, |e| e["event"] == "checkpoint" && e["step"] == best);
    run_to_end(&args);
    assert!(adapter_bytes(&again) == adapter_bytes(&out));

    let mut without_validation = early_stopping_args(&dir.path().join("refused"));
    let at = without_validation
        .iter()
        .position(|a| a == "--eval-every")
        .expect("flag");
    without_validation.drain(at..at + 2);
    let refused = Command::new(BIN)
        .args(&without_validation)
        .output()
        .expect("run tuneq");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(42), "{stderr}");
    assert!(
        stderr.contains("hyperparameters.early_stopping"),
        "{stderr}"
    );
}

/// The loss of each step in a run's `metrics.jsonl`, in order.
fn step_losses(output: &Path) -> Vec<f64> {
    std::fs::read_to_string(output.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("loss").and_then(serde_json::Value::as_f64))
        .collect()
}

/// `--init-adapter` starts from a finished run's adapter instead of fresh factors (the
/// continuation's first loss is where the first run ended, far below a fresh start),
/// is part of the fingerprint, and an adapter of another shape is refused as bad input
/// naming the field.
#[test]
fn a_run_starts_from_the_adapter_it_is_given_and_refuses_one_of_another_shape() {
    let (dir, train) = dir_with_task(40);
    let first = dir.path().join("first");
    run_to_end(&resume_args(&first, &train));
    let second = dir.path().join("second");
    let mut args = resume_args(&second, &train);
    args.extend(["--init-adapter".into(), first.display().to_string()]);
    run_to_end(&args);
    let (fresh, continued) = (step_losses(&first), step_losses(&second));
    assert!(
        continued[0] < fresh[0] - 0.5,
        "the continuation starts trained: {continued:?} vs {fresh:?}"
    );
    let manifest = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).expect("manifest"))
            .expect("JSON")
    };
    assert_ne!(
        manifest(&first)["fingerprint"],
        manifest(&second)["fingerprint"]
    );
    assert_eq!(
        manifest(&second)["spec"]["init_adapter"],
        first.display().to_string()
    );

    let mut other_shape = resume_args(&dir.path().join("third"), &train);
    other_shape.extend([
        "--init-adapter".into(),
        first.display().to_string(),
        "--lora-r".into(),
        "4".into(),
    ]);
    let out = Command::new(BIN)
        .args(&other_shape)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("run tuneq");
    assert_eq!(
        out.status.code(),
        Some(42),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("init_adapter"));
}
