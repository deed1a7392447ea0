//! `tuneq debug …`: reference computations for the PyTorch cross-checks in tests/reference.

use anyhow::Result;
use clap::Subcommand;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum DebugCommand {
    /// Full-sequence logits for `input_ids` in a safetensors file.
    Logits(ProbeArgs),
    /// Loss (labels = input ids) and LoRA gradients of one batch (`--adapter` needed).
    Grads(ProbeArgs),
    /// Each record of a dataset as training sees it: the conversation, the rendered text,
    /// the token ids and the labels (−100 where no loss), one JSON object per line, with
    /// the chat template's source first.
    Encode {
        #[arg(long)]
        model: PathBuf,
        /// A JSONL dataset.
        #[arg(long)]
        data: PathBuf,
        #[arg(long, value_enum, default_value = "model")]
        chat_template: crate::cli::train::TemplateArg,
        #[arg(long, default_value_t = 4096)]
        max_seq_len: usize,
    },
    /// One DPO step over every pair of a preference file as one micro-batch, against
    /// the base model as reference: prints the loss and figures, writes the loss and
    /// the LoRA gradients (`--adapter` is the policy).
    DpoGrads {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        adapter: PathBuf,
        /// A JSONL file of preference pairs.
        #[arg(long)]
        pairs: PathBuf,
        #[arg(long, default_value_t = tuneq_openapi::TrainingMethod::DEFAULT_BETA)]
        beta: f64,
        #[arg(long, default_value_t = 1024)]
        max_seq_len: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Optimiser steps as training runs them (micro-batches, clipping, AdamW, dropout)
    /// over batches in a safetensors file, writing the adapter after every step.
    Steps(StepsArgs),
}

/// The model and the batch `tuneq debug logits` and `grads` run.
#[derive(clap::Args)]
pub struct ProbeArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// `input_ids` in a safetensors file.
    #[arg(long)]
    input_ids: PathBuf,
    #[arg(long)]
    out: PathBuf,
}

impl ProbeArgs {
    /// The model in f32, with the adapter when one is named.
    fn load(&self) -> Result<tuneq_trainer::model::Llama> {
        Ok(tuneq_trainer::debug::load_model(
            &self.model,
            self.adapter.as_deref(),
            tuneq_openapi::DtypeKind::F32,
        )?)
    }
}

/// What `tuneq debug steps` runs.
#[derive(clap::Args)]
pub struct StepsArgs {
    #[arg(long)]
    model: PathBuf,
    /// The adapter to start from (its factors become the trainable tensors).
    #[arg(long)]
    adapter: PathBuf,
    /// `input_ids`, `labels`, `attention_mask`: int64 (micro-batches, rows, len).
    #[arg(long)]
    batches: PathBuf,
    /// A folder for `step-N.safetensors` (and `masks.safetensors` with dropout).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// ≤ 0 turns clipping off.
    #[arg(long, default_value_t = 0.0)]
    max_grad_norm: f64,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    #[arg(long, default_value_t = 0.9)]
    beta1: f64,
    #[arg(long, default_value_t = 0.999)]
    beta2: f64,
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The dtype the frozen weights are held in (bf16: widened to f32 where used).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: super::train::DtypeArg,
    /// How the frozen projections are computed (bf16: bf16 operands, f32
    /// accumulation; needs `--dtype bf16`).
    #[arg(long, value_enum, default_value = "f32")]
    compute: super::train::ComputeArg,
}

pub fn run(cmd: DebugCommand) -> Result<ExitCode> {
    match cmd {
        DebugCommand::Logits(probe) => {
            tuneq_trainer::debug::write_logits(&probe.load()?, &probe.input_ids, &probe.out)?;
        }
        DebugCommand::Grads(probe) => {
            if probe.adapter.is_none() {
                return Err(super::BadInput(
                    "--adapter: gradients are an adapter's; name the adapter to start from".into(),
                )
                .into());
            }
            let loss =
                tuneq_trainer::debug::write_grads(&probe.load()?, &probe.input_ids, &probe.out)?;
            println!("{}", serde_json::json!({"loss": loss}));
        }
        DebugCommand::Encode {
            model,
            data,
            chat_template,
            max_seq_len,
        } => encode(&model, &data, chat_template, max_seq_len)?,
        DebugCommand::Steps(args) => steps(args)?,
        DebugCommand::DpoGrads {
            model,
            adapter,
            pairs,
            beta,
            max_seq_len,
            out,
        } => {
            let dtype = tuneq_openapi::DtypeKind::F32;
            let policy = tuneq_trainer::debug::load_model(&model, Some(&adapter), dtype)?;
            let (loss, figures) = tuneq_trainer::debug::write_dpo_grads(
                &policy,
                &model,
                &pairs,
                (beta, max_seq_len),
                &out,
            )?;
            println!(
                "{}",
                serde_json::json!({"loss": loss, "preference": figures})
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `tuneq debug encode`: prints the chat template, then each record as training sees it.
fn encode(
    model: &Path,
    data: &Path,
    chat_template: crate::cli::train::TemplateArg,
    max_seq_len: usize,
) -> Result<()> {
    let choice = tuneq_openapi::ChatTemplateChoice::from(chat_template);
    let encoder = tuneq_trainer::data::Encoder::from_model_dir(model, choice)?;
    let parsed = tuneq_trainer::data::read_jsonl(data, tuneq_openapi::DatasetFormat::Auto)?;
    let template = encoder.template();
    println!(
        "{}",
        serde_json::json!({"template": template.source(),
            "tool_use_template": template.tool_use_source(), "bos_token": template.bos_token(),
            "eos_token": template.eos_token(), "format": parsed.format})
    );
    for record in &parsed.records {
        let example = encoder.encode(record, max_seq_len)?;
        let conversation = encoder.conversation(record);
        println!(
            "{}",
            serde_json::json!({"messages": conversation.messages, "tools": conversation.tools,
                "text": encoder.render(record)?,
                "input_ids": example.input_ids, "labels": example.labels})
        );
    }
    Ok(())
}

/// `tuneq debug steps`: runs the optimiser steps and prints each step's loss.
fn steps(args: StepsArgs) -> Result<()> {
    let dropout = args.dropout;
    if !(0.0..1.0).contains(&dropout) {
        anyhow::bail!("--dropout must be in [0, 1), not {dropout}");
    }
    let compute = tuneq_openapi::ComputeKind::from(args.compute);
    let dtype = tuneq_openapi::DtypeKind::from(args.dtype);
    if compute == tuneq_openapi::ComputeKind::Bf16 && dtype != tuneq_openapi::DtypeKind::Bf16 {
        anyhow::bail!("--compute bf16 multiplies bf16 weights: add --dtype bf16");
    }
    let mut m = tuneq_trainer::debug::load_model(&args.model, Some(&args.adapter), dtype)?;
    m.set_cpu_compute(compute);
    let cfg = tuneq_trainer::debug::StepsConfig {
        micro_batches: args.micro_batches,
        lr: args.lr,
        max_grad_norm: args.max_grad_norm,
        adamw: tuneq_trainer::optim::AdamWConfig {
            beta1: args.beta1,
            beta2: args.beta2,
            eps: args.eps,
            weight_decay: args.weight_decay,
        },
        dropout,
        seed: args.seed,
    };
    let losses = tuneq_trainer::debug::write_steps(&m, &args.batches, &args.out, &cfg)?;
    println!("{}", serde_json::json!({"losses": losses}));
    Ok(())
}
