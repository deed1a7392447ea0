//! `tuneq generate`: greedy completion with a model and an optional adapter.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use tuneq_openapi::ChatTemplateChoice;
use tuneq_trainer::data::{Encoder, Message, Role};

#[derive(Args)]
pub struct GenerateArgs {
    /// Base model folder.
    #[arg(long)]
    model: PathBuf,
    /// PEFT adapter folder.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The user message (rendered with the chat template) or raw text with `--raw`.
    #[arg(long)]
    prompt: String,
    /// Use the prompt as raw text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
}

pub fn run(args: GenerateArgs) -> Result<ExitCode> {
    let model = tuneq_trainer::debug::load_model(
        &args.model,
        args.adapter.as_deref(),
        tuneq_openapi::DtypeKind::F32,
    )?;
    let encoder = Encoder::from_model_dir(&args.model, ChatTemplateChoice::Model)?;
    let text = if args.raw {
        args.prompt.clone()
    } else {
        encoder
            .template()
            .render(&[Message::new(Role::User, args.prompt.clone())], true)?
    };
    let ids = encoder
        .tokenizer()
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?
        .get_ids()
        .to_vec();
    let stop = tuneq_trainer::generate::stop_ids(&model, &encoder);
    let started = std::time::Instant::now();
    let out = tuneq_trainer::generate::greedy(&model, &ids, args.max_new_tokens, &stop)?;
    let took = started.elapsed().as_secs_f64();
    println!("{}", encoder.decode(&out)?);
    eprintln!(
        "generated {} tokens after a {}-token prompt in {took:.2} s ({:.0} tokens/s, key/value cache)",
        out.len(),
        ids.len(),
        out.len() as f64 / took.max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}
