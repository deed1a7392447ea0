//! Encoding throughput against the number of turns per chat record, to show that
//! encoding is linear in a record's size: bytes per second stay about flat from 1 to
//! 10 000 turns (rendering every prefix of the conversation made them fall as 1/turns).
//!
//! `cargo run --release -p tuneq-dataset --example encode_throughput`
//!
//! For each built-in template and record size it prints the throughput of
//! `Encoder::encode_with_length` (the trainer's path: the whole record tokenized, 4096
//! tokens kept) and of `Encoder::measure` (the upload statistics: 512 tokens), in
//! bytes of JSONL per second, over about 4 MB of records.

use std::error::Error;
use std::time::Instant;

use tuneq_dataset::{ChatTemplate, Encoder, Message, Record, Role, build_tokenizer};
use tuneq_openapi::ChatTemplateChoice;

/// Bytes of records each measurement encodes.
const TARGET_BYTES: usize = 4 << 20;

fn record(turns: usize) -> (Record, usize) {
    let mut messages = vec![Message::new(
        Role::System,
        "You answer questions about Zorbia.",
    )];
    for i in 0..turns {
        messages.push(Message::new(
            Role::User,
            format!("What is the capital of province {i}?"),
        ));
        messages.push(Message::new(
            Role::Assistant,
            format!("The capital of province {i} is Velm."),
        ));
    }
    let json: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let bytes = serde_json::json!({ "messages": json }).to_string().len() + 1;
    (
        Record::Chat {
            messages,
            tools: vec![],
        },
        bytes,
    )
}

/// Bytes per second of `encode` over copies of a record of `bytes` bytes.
fn throughput(
    bytes: usize,
    mut encode: impl FnMut() -> Result<(), Box<dyn Error>>,
) -> Result<f64, Box<dyn Error>> {
    let reps = (TARGET_BYTES / bytes).max(1);
    let started = Instant::now();
    for _ in 0..reps {
        encode()?;
    }
    Ok((reps * bytes) as f64 / started.elapsed().as_secs_f64())
}

fn main() -> Result<(), Box<dyn Error>> {
    let tokenizer = build_tokenizer(4096)?;
    println!("template  turns  record_bytes  encode_MB/s  measure_MB/s");
    for choice in [
        ChatTemplateChoice::Chatml,
        ChatTemplateChoice::Llama2,
        ChatTemplateChoice::Alpaca,
    ] {
        let encoder = Encoder::new(
            tokenizer.clone(),
            ChatTemplate::builtin(choice, "<s>", "</s>")?,
        );
        for turns in [1, 10, 100, 1000, 10_000] {
            let (record, bytes) = record(turns);
            let encode = throughput(bytes, || {
                encoder.encode_with_length(&record, 4096)?;
                Ok(())
            })?;
            let measure = throughput(bytes, || {
                encoder.measure(&record, 512)?;
                Ok(())
            })?;
            println!(
                "{:<8} {turns:>6} {bytes:>13} {:>12.2} {:>13.2}",
                format!("{choice:?}").to_lowercase(),
                encode / 1e6,
                measure / 1e6
            );
        }
    }
    Ok(())
}
