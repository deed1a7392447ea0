//! The memory it takes to validate and measure one long line, as the API's upload check
//! does: at most [`PER_BYTE`] times the line's size plus [`FIXED`], and given back
//! afterwards. Read from the kernel's count of this process's resident memory (peak and
//! current), so it is a test binary of its own with one test: nothing else runs beside.
//! The test runs itself again with glibc's allocation thresholds fixed (by its
//! environment variables), so a freed block leaves resident memory at once instead of
//! being kept for reuse: then the peak counts what one line takes, not what was kept.

#![allow(clippy::unwrap_used, missing_docs)]

use tuneq_dataset::{ChatTemplate, Encoder, LineValidator, build_tokenizer};
use tuneq_openapi::{ChatTemplateChoice, DatasetFormat};

/// What one line may take per byte of it, on top of the line itself: the parsed JSON,
/// the record, the rendered text and the template's copies of the messages.
const PER_BYTE: usize = 6;
/// What it may take whatever the line's size: tokenizing the window of the text that
/// the statistics read ([`tuneq_dataset::Encoder::measure`]).
const FIXED: usize = 64 << 20;

/// `VmHWM` or `VmRSS` of this process, in bytes.
fn status(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kib << 10
}

/// Sets the peak back to the current resident size (`VmHWM` := `VmRSS`).
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

/// Lines of about `bytes` each, in the shapes an upload may have.
fn long_lines(bytes: usize) -> Vec<(&'static str, Vec<u8>)> {
    let words = "a ".repeat(bytes / 2);
    let text = serde_json::json!({ "text": words }).to_string();
    let prompt = serde_json::json!({ "prompt": words, "completion": "x" }).to_string();
    // As many messages as a record may have, each as long as that allows.
    let count = tuneq_dataset::MAX_MESSAGES - 1;
    let each = "b ".repeat(bytes / count / 2);
    let messages: Vec<serde_json::Value> = (0..count)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": each})
        })
        .collect();
    let chat = serde_json::json!({ "messages": messages }).to_string();
    vec![
        ("text", text.into_bytes()),
        ("prompt_completion", prompt.into_bytes()),
        ("chat", chat.into_bytes()),
    ]
}

/// Set in the environment of the run that measures.
const MEASURING: &str = "TUNEQ_MEASURE_MEMORY";

#[test]
fn one_long_line_takes_a_small_multiple_of_its_size_and_gives_it_back() {
    if std::env::var_os(MEASURING).is_none() {
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "one_long_line_takes_a_small_multiple_of_its_size_and_gives_it_back",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MEASURING, "1")
            .env("MALLOC_MMAP_THRESHOLD_", "131072")
            .env("MALLOC_TRIM_THRESHOLD_", "131072")
            .env("MALLOC_ARENA_MAX", "1")
            .status()
            .unwrap();
        assert!(status.success(), "the measuring run failed: {status}");
        return;
    }
    let tokenizer = build_tokenizer(4096).unwrap();
    let template = ChatTemplate::builtin(ChatTemplateChoice::Chatml, "<s>", "</s>").unwrap();
    let encoder = Encoder::new(tokenizer, template);
    // Warm up: first uses of the tokenizer and template allocate for good.
    let warm = br#"{"text":"warm up"}"#;
    let record = LineValidator::new("w", DatasetFormat::Auto)
        .push(warm)
        .unwrap();
    encoder.measure(&record, 512).unwrap();
    for (shape, line) in long_lines(6 << 20) {
        let mut after = Vec::new();
        for _ in 0..3 {
            let base = status("VmRSS:");
            reset_peak();
            let mut validator = LineValidator::new("d.jsonl", DatasetFormat::Auto);
            let record = validator.push(&line).unwrap();
            let measured = encoder.measure(&record, 512).unwrap();
            assert_eq!(measured.example.input_ids.len(), 512, "{shape}");
            drop((record, measured, validator));
            let peak = status("VmHWM:").saturating_sub(base);
            after.push(status("VmRSS:").saturating_sub(base));
            let bound = PER_BYTE * line.len() + FIXED;
            eprintln!(
                "{shape}: line {} bytes, peak +{} bytes ({:.1}× the line), after +{} bytes",
                line.len(),
                peak,
                peak as f64 / line.len() as f64,
                after.last().unwrap()
            );
            assert!(peak <= bound, "{shape}: peak +{peak} bytes > {bound}");
        }
        // Given back: what stays resident after a line does not grow with each line.
        assert!(
            after.iter().all(|&a| a <= FIXED),
            "{shape}: resident after each line {after:?}"
        );
    }
}
