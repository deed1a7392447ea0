//! `tuneq train`: run a fine-tune from a spec file and/or flags.

use super::BadInput;
use anyhow::{Context, Result};
use clap::Args;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use tuneq_openapi::{
    ActivationCheckpointing, ChatTemplateChoice, ComputeKind, DatasetFormat, DeviceKind, DtypeKind,
    Scheduler, TrainSpec, TrainingMethod,
};
use tuneq_trainer::progress::{JsonLines, ProgressSink, Tee, TerminalBar};
use tuneq_trainer::train::{Outcome, StopFlag};

/// Every `TrainSpec` field as a flag; flags override the spec file.
#[derive(Args, Debug, Default)]
pub struct TrainArgs {
    /// JSON spec file (a `TrainSpec`); flags below override its fields.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// Train the built-in tiny demo model on the built-in demo task.
    #[arg(long, conflicts_with = "spec")]
    pub demo: bool,
    /// Base model folder or URI.
    #[arg(long)]
    pub model: Option<String>,
    /// Training JSONL file (repeat for several).
    #[arg(long = "train-file")]
    pub train_files: Vec<String>,
    /// Validation JSONL file.
    #[arg(long)]
    pub validation_file: Option<String>,
    /// Output folder or URI.
    #[arg(long)]
    pub output: Option<String>,
    /// Start from this adapter (a PEFT folder or URI) instead of fresh LoRA factors: it
    /// must have the run's rank, alpha, rsLoRA and target modules.
    #[arg(long)]
    pub init_adapter: Option<String>,
    /// Dataset format.
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// What the run optimises: `supervised` (cross-entropy on the answers) or `dpo`
    /// (direct preference optimisation on preference pairs, against the starting model).
    #[arg(long, value_enum)]
    pub method: Option<MethodArg>,
    /// DPO's β (with `--method dpo`; default 0.1).
    #[arg(long, requires = "method")]
    pub beta: Option<f64>,
    /// Chat template.
    #[arg(long, value_enum)]
    pub template: Option<TemplateArg>,
    /// Epochs.
    #[arg(long)]
    pub epochs: Option<u32>,
    /// Examples per micro-batch.
    #[arg(long)]
    pub batch_size: Option<u32>,
    /// Micro-batches per optimiser step.
    #[arg(long)]
    pub grad_accum: Option<u32>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Warmup steps.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Schedule after warmup.
    #[arg(long, value_enum)]
    pub scheduler: Option<SchedulerArg>,
    /// AdamW weight decay.
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Global gradient-norm clip (0 = off).
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Truncate examples to this many tokens.
    #[arg(long)]
    pub max_seq_len: Option<u32>,
    /// Stop after this many optimiser steps.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Compute validation loss every N steps.
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Stop once this many validations in a row have not improved on the best, and
    /// keep the best validated step's adapter (needs --validation-file and --eval-every).
    #[arg(long)]
    pub early_stopping_patience: Option<u32>,
    /// How much lower than the best a validation loss must be to count as better.
    #[arg(long, requires = "early_stopping_patience")]
    pub early_stopping_min_delta: Option<f64>,
    /// Seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// LoRA rank.
    #[arg(long)]
    pub lora_r: Option<u32>,
    /// LoRA alpha.
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// LoRA dropout.
    #[arg(long)]
    pub lora_dropout: Option<f64>,
    /// Comma-separated target modules (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj).
    #[arg(long, value_delimiter = ',')]
    pub targets: Option<Vec<String>>,
    /// Rank-stabilised LoRA scaling (alpha/√r).
    #[arg(long)]
    pub rslora: bool,
    /// Checkpoint every N optimiser steps.
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Checkpoint when this many seconds passed since the last one.
    #[arg(long)]
    pub checkpoint_every_seconds: Option<u64>,
    /// Complete checkpoints to keep.
    #[arg(long)]
    pub keep_checkpoints: Option<u32>,
    /// Validation prompts to generate samples for after training.
    #[arg(long)]
    pub samples: Option<u32>,
    /// Tokens generated per sample.
    #[arg(long)]
    pub sample_tokens: Option<u32>,
    /// Compute device.
    #[arg(long, value_enum)]
    pub device: Option<DeviceArg>,
    /// Dtype the frozen weights are held in (bf16: half the memory; f32 compute on the CPU).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Recompute each layer's activations in backward (`auto`: only when the run would
    /// not fit its memory limit otherwise).
    #[arg(long, value_enum)]
    pub activation_checkpointing: Option<CheckpointingArg>,
    /// How the CPU computes the frozen projections: `f32` (the default, PEFT parity) or
    /// `bf16` (bf16 operands, f32 accumulation: faster on CPUs with AVX512-BF16 or, with
    /// a oneMKL build, AMX; needs `--dtype bf16` or `auto`).
    #[arg(long, value_enum)]
    pub compute: Option<ComputeArg>,
    /// Progress output: `json` lines, a terminal `bar`, or `auto` (bar when stdout is a terminal).
    #[arg(long, value_enum, default_value = "auto")]
    pub progress: ProgressArg,
    /// Print the effective spec as JSON and exit.
    #[arg(long)]
    pub print_spec: bool,
    /// Also post progress to this control-plane URL (a dispatcher passes it, with the
    /// attempt's credential in `TUNEQ_REPORT_CREDENTIAL`).
    #[arg(long, env = tuneq_openapi::launch::ENV_REPORT_URL, requires = "report_credential")]
    pub report_url: Option<String>,
    /// The attempt's credential for `--report-url` (kept out of the process list).
    #[arg(long, env = tuneq_openapi::launch::ENV_REPORT_CREDENTIAL, hide_env_values = true)]
    pub report_credential: Option<String>,
    /// Storage settings (TOML: the `[storage]` table of tuneq's config, or its fields at
    /// the top level): S3 endpoint/region/path-style/profile, GCS endpoint/credentials.
    /// Unset fields follow the standard AWS environment and `STORAGE_EMULATOR_HOST` /
    /// application-default credentials.
    #[arg(long, env = tuneq_openapi::launch::ENV_STORAGE_CONFIG)]
    pub storage_config: Option<PathBuf>,
    /// Where remote models and datasets are cached and remote outputs are staged
    /// (default: `$TUNEQ_CACHE_DIR`, else `tuneq-cache` in the temp folder).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

/// Reads storage settings from a TOML file: a `[storage]` table, or its fields at the top.
pub fn load_storage_config(path: &std::path::Path) -> Result<tuneq_storage::StorageConfig> {
    let text =
        std::fs::read_to_string(path).map_err(|e| BadInput(format!("{}: {e}", path.display())))?;
    let mut value: toml::Table =
        toml::from_str(&text).map_err(|e| BadInput(format!("{}: {e}", path.display())))?;
    let table = match value.remove("storage") {
        Some(toml::Value::Table(t)) => t,
        Some(_) => {
            return Err(BadInput(format!("{}: [storage] must be a table", path.display())).into());
        }
        None => value,
    };
    table
        .try_into()
        .map_err(|e| BadInput(format!("{}: storage: {e}", path.display())).into())
}

macro_rules! value_enum {
    ($name:ident => $target:ty { $($variant:ident = $value:expr),* $(,)? }) => {
        #[derive(clap::ValueEnum, Clone, Copy, Debug)]
        #[allow(missing_docs)]
        pub enum $name { $($variant),* }
        impl From<$name> for $target {
            fn from(v: $name) -> Self { match v { $($name::$variant => $value),* } }
        }
    };
}

value_enum!(FormatArg => DatasetFormat { Auto = DatasetFormat::Auto, Chat = DatasetFormat::Chat, PromptCompletion = DatasetFormat::PromptCompletion, Alpaca = DatasetFormat::Alpaca, Text = DatasetFormat::Text, Preference = DatasetFormat::Preference });

/// `--method`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MethodArg {
    /// Cross-entropy on the answers.
    Supervised,
    /// Direct preference optimisation.
    Dpo,
}
value_enum!(TemplateArg => ChatTemplateChoice { Model = ChatTemplateChoice::Model, Llama2 = ChatTemplateChoice::Llama2, Chatml = ChatTemplateChoice::Chatml, Alpaca = ChatTemplateChoice::Alpaca });
value_enum!(SchedulerArg => Scheduler { Linear = Scheduler::Linear, Cosine = Scheduler::Cosine, Constant = Scheduler::Constant });
value_enum!(DeviceArg => DeviceKind { Cpu = DeviceKind::Cpu, Cuda = DeviceKind::Cuda });
value_enum!(DtypeArg => DtypeKind { F32 = DtypeKind::F32, Bf16 = DtypeKind::Bf16, Auto = DtypeKind::Auto });
value_enum!(ComputeArg => ComputeKind { F32 = ComputeKind::F32, Bf16 = ComputeKind::Bf16 });
value_enum!(CheckpointingArg => ActivationCheckpointing { Auto = ActivationCheckpointing::Auto, On = ActivationCheckpointing::On, Off = ActivationCheckpointing::Off });

/// Where progress goes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default)]
pub enum ProgressArg {
    /// A bar when stdout is a terminal, JSON lines otherwise.
    #[default]
    Auto,
    /// JSON lines on stdout.
    Json,
    /// A progress bar.
    Bar,
}

/// The effective spec: the file (if any), then every flag given.
pub fn build_spec(args: &TrainArgs) -> Result<TrainSpec> {
    let mut v = match &args.spec {
        Some(path) => {
            let bytes = std::fs::read(path)
                .with_context(|| format!("cannot read spec {}", path.display()))?;
            serde_json::from_slice::<serde_json::Value>(&bytes)
                .map_err(|e| BadInput(format!("{}: invalid JSON: {e}", path.display())))?
        }
        None => serde_json::json!({}),
    };
    let obj = v
        .as_object_mut()
        .ok_or_else(|| BadInput("spec must be a JSON object".into()))?;
    if let Some(m) = &args.model {
        obj.insert("model".into(), m.clone().into());
    }
    if !args.train_files.is_empty() {
        obj.remove("training_file");
        obj.insert("training_files".into(), args.train_files.clone().into());
    }
    if let Some(a) = &args.init_adapter {
        obj.insert("init_adapter".into(), a.clone().into());
    }
    if let Some(f) = &args.validation_file {
        obj.insert("validation_file".into(), f.clone().into());
    }
    if let Some(o) = &args.output {
        obj.insert("output".into(), o.clone().into());
    }
    set_section_flags(obj, args)?;
    set_choice_flags(obj, args)?;
    check_required(obj)?;
    let source = args
        .spec
        .as_ref()
        .map_or("flags".to_string(), |p| p.display().to_string());
    serde_json::from_value(v).map_err(|e| BadInput(format!("{source}: {e}")).into())
}

/// The spec, as JSON, that flags write into.
type SpecObject = serde_json::Map<String, serde_json::Value>;

/// Writes the flags that set a field of a section (`hyperparameters`, `lora`,
/// `checkpoint`, `sampling`) into `obj`, keeping the section's other fields.
fn set_section_flags(obj: &mut SpecObject, args: &TrainArgs) -> Result<()> {
    let spec_json = |name: &str, v: serde_json::Value| (name.to_string(), v);
    let mut nested: Vec<(&str, (String, serde_json::Value))> = Vec::new();
    macro_rules! nest {
        ($section:literal, $field:literal, $value:expr) => {
            if let Some(x) = $value {
                nested.push(($section, spec_json($field, serde_json::to_value(x)?)));
            }
        };
    }
    nest!("hyperparameters", "epochs", args.epochs);
    nest!("hyperparameters", "batch_size", args.batch_size);
    nest!(
        "hyperparameters",
        "gradient_accumulation_steps",
        args.grad_accum
    );
    nest!("hyperparameters", "learning_rate", args.lr);
    nest!("hyperparameters", "warmup_steps", args.warmup_steps);
    nest!(
        "hyperparameters",
        "scheduler",
        args.scheduler.map(Scheduler::from)
    );
    nest!("hyperparameters", "weight_decay", args.weight_decay);
    nest!("hyperparameters", "max_grad_norm", args.max_grad_norm);
    nest!("hyperparameters", "max_seq_len", args.max_seq_len);
    nest!("hyperparameters", "max_steps", args.max_steps);
    nest!("hyperparameters", "eval_every_steps", args.eval_every);
    nest!("hyperparameters", "seed", args.seed);
    nest!(
        "hyperparameters",
        "early_stopping",
        args.early_stopping_patience
            .map(|patience| tuneq_openapi::EarlyStopping {
                patience,
                min_delta: args.early_stopping_min_delta.unwrap_or(0.0),
            })
    );
    nest!("lora", "r", args.lora_r);
    nest!("lora", "alpha", args.lora_alpha);
    nest!("lora", "dropout", args.lora_dropout);
    nest!("lora", "target_modules", args.targets.clone());
    nest!("lora", "rslora", args.rslora.then_some(true));
    nest!("checkpoint", "every_steps", args.checkpoint_every);
    nest!("checkpoint", "every_seconds", args.checkpoint_every_seconds);
    nest!("checkpoint", "keep_last", args.keep_checkpoints);
    nest!("sampling", "num_samples", args.samples);
    nest!("sampling", "max_new_tokens", args.sample_tokens);
    for (section, (field, value)) in nested {
        let entry = obj
            .entry(section.to_string())
            .or_insert_with(|| serde_json::json!({}));
        let inner = entry
            .as_object_mut()
            .ok_or_else(|| BadInput(format!("spec field {section} must be an object")))?;
        inner.insert(field, value);
    }
    Ok(())
}

/// Writes the flags that choose among values (format, template, device, dtype, compute,
/// checkpointing) into `obj`, and the GPU a CUDA build picks when nothing chose a device.
fn set_choice_flags(obj: &mut SpecObject, args: &TrainArgs) -> Result<()> {
    match (args.method, args.beta) {
        (Some(MethodArg::Dpo), beta) => {
            let beta = beta.unwrap_or(TrainingMethod::DEFAULT_BETA);
            let method = TrainingMethod::Dpo { beta };
            obj.insert("method".into(), serde_json::to_value(method)?);
        }
        (Some(MethodArg::Supervised), Some(_)) => {
            return Err(BadInput("--beta is a setting of --method dpo".into()).into());
        }
        (Some(MethodArg::Supervised), None) => {
            let method = TrainingMethod::Supervised;
            obj.insert("method".into(), serde_json::to_value(method)?);
        }
        (None, _) => {}
    }
    if let Some(f) = args.format {
        obj.insert(
            "dataset_format".into(),
            serde_json::to_value(DatasetFormat::from(f))?,
        );
    }
    if let Some(t) = args.template {
        obj.insert(
            "chat_template".into(),
            serde_json::to_value(ChatTemplateChoice::from(t))?,
        );
    }
    if let Some(d) = args.device {
        obj.insert("device".into(), serde_json::to_value(DeviceKind::from(d))?);
    }
    if let Some(d) = args.dtype {
        obj.insert("dtype".into(), serde_json::to_value(DtypeKind::from(d))?);
    }
    if let Some(c) = args.compute {
        let c = ComputeKind::from(c);
        obj.insert("compute".into(), serde_json::to_value(c)?);
        // bf16 compute multiplies bf16 weights: unless a dtype was chosen, hold them so.
        if c == ComputeKind::Bf16 {
            obj.entry("dtype")
                .or_insert(serde_json::to_value(DtypeKind::Bf16)?);
        }
    }
    if let Some(c) = args.activation_checkpointing {
        obj.insert(
            "activation_checkpointing".into(),
            serde_json::to_value(ActivationCheckpointing::from(c))?,
        );
    }
    // A CUDA build picks the GPU (and bf16 for the frozen weights) when neither the spec
    // nor a flag chose a device and a GPU is present; a CPU build never changes the spec.
    if !obj.contains_key("device") && tuneq_trainer::train::cuda_available() {
        obj.insert("device".into(), serde_json::to_value(DeviceKind::Cuda)?);
        obj.entry("dtype")
            .or_insert(serde_json::to_value(DtypeKind::Bf16)?);
    }
    Ok(())
}

/// Refuses a spec without a model, an output or a training file, naming the flags.
fn check_required(obj: &SpecObject) -> Result<()> {
    let missing: Vec<&str> = [("model", "--model"), ("output", "--output")]
        .into_iter()
        .filter(|(k, _)| !obj.contains_key(*k))
        .map(|(_, flag)| flag)
        .chain(
            (!obj.contains_key("training_files") && !obj.contains_key("training_file"))
                .then_some("--train-file"),
        )
        .collect();
    if !missing.is_empty() {
        return Err(BadInput(format!(
            "missing {} (or a --spec file that sets them)",
            missing.join(", ")
        ))
        .into());
    }
    Ok(())
}

/// When a dispatcher started this trainer (it says so in
/// [`tuneq_dispatcher::local::PARENT_PID_ENV`]), asks the kernel for a SIGTERM when that
/// process dies — the same as a preemption notice: checkpoint, then exit — and stops at
/// once if it is already gone. Linux only; elsewhere the dispatcher's next start stops
/// what it left.
fn stop_with_parent(stop: &StopFlag) {
    let Some(parent) = std::env::var(tuneq_dispatcher::local::PARENT_PID_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    #[cfg(target_os = "linux")]
    {
        if let Err(e) =
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
        {
            tracing::warn!(error = %e, "cannot ask to be stopped with the dispatcher");
        }
        // The dispatcher may have died before the request above took effect.
        if parent_gone() {
            tracing::warn!(
                parent,
                "the dispatcher that started this trainer is gone; stopping"
            );
            stop.set();
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (parent, stop);
}

/// How often the memory watchdog looks at this process's resident memory.
const MEMORY_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// When the dispatcher set a memory limit ([`tuneq_dispatcher::local::MEMORY_LIMIT_ENV`]),
/// watches this process's resident memory and stops it as bad input past the limit, with
/// the figures: the same job would use as much again, so it must not be retried, and the
/// machine must not be pushed into swap or the OOM killer.
fn watch_memory() -> Result<()> {
    let Ok(text) = std::env::var(tuneq_dispatcher::local::MEMORY_LIMIT_ENV) else {
        return Ok(());
    };
    let limit: u64 = text.trim().parse().map_err(|_| {
        BadInput(format!(
            "{} must be a number of bytes, not `{text}`",
            tuneq_dispatcher::local::MEMORY_LIMIT_ENV
        ))
    })?;
    std::thread::Builder::new()
        .name("memory-watchdog".into())
        .spawn(move || {
            loop {
                if let Some(resident) = tuneq_trainer::bench::resident_bytes()
                    && resident > limit
                {
                    eprintln!(
                        "error: the attempt used {} MiB of memory, over its limit of {} MiB; lower batch_size, max_seq_len or lora.r",
                        resident >> 20,
                        limit >> 20
                    );
                    std::process::exit(tuneq_openapi::launch::EXIT_BAD_INPUT);
                }
                std::thread::sleep(MEMORY_CHECK_EVERY);
            }
        })
        .context("cannot start the memory watchdog")?;
    Ok(())
}

pub fn run(mut args: TrainArgs) -> Result<ExitCode> {
    if args.demo {
        // The demo is a spec file like any other (`--demo` conflicts with `--spec`).
        args.spec = Some(super::demo::prepare()?);
    }
    let spec = build_spec(&args)?;
    if args.print_spec {
        println!("{}", serde_json::to_string_pretty(&spec)?);
        return Ok(ExitCode::SUCCESS);
    }
    let stop = StopFlag::new();
    // The first SIGTERM/SIGINT asks for "checkpoint, then exit 75" (the launch contract's
    // interrupted); a second one exits at once.
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register_conditional_shutdown(sig, 1, stop.atomic())
            .context("cannot install signal handlers")?;
        signal_hook::flag::register(sig, stop.atomic())
            .context("cannot install signal handlers")?;
    }
    stop_with_parent(&stop);
    watch_memory()?;
    let bar = match args.progress {
        ProgressArg::Json => false,
        ProgressArg::Bar => true,
        ProgressArg::Auto => std::io::stdout().is_terminal(),
    };
    let mut sink: Box<dyn ProgressSink> = if bar {
        Box::new(TerminalBar::new())
    } else {
        Box::new(JsonLines::new(std::io::stdout()))
    };
    if let (Some(url), Some(credential)) = (&args.report_url, &args.report_credential) {
        // Superseded: stop at once, writing nothing more (the launch contract's 76).
        let superseded = || std::process::exit(tuneq_openapi::launch::EXIT_SUPERSEDED);
        // Paused: checkpoint and exit 75, as after SIGTERM.
        let reporter = tuneq_trainer::report::Reporter::new(
            url.clone(),
            credential.clone(),
            stop.clone(),
            superseded,
        )
        .context("cannot start the progress reporter")?;
        sink = Box::new(Tee(vec![sink, Box::new(reporter)]));
    }
    let storage_config = match &args.storage_config {
        Some(p) => load_storage_config(p)?,
        None => tuneq_storage::StorageConfig::default(),
    };
    let cache = args
        .cache_dir
        .clone()
        .unwrap_or_else(tuneq_trainer::remote::Storage::default_cache_dir);
    let storage = tuneq_trainer::remote::Storage::new(storage_config, cache)?;
    let outcome = tuneq_trainer::train::run_with(&spec, &storage, sink.as_mut(), &stop)?;
    if parent_gone() {
        // Its checkpoint is committed (the next attempt resumes from the store); the
        // reports would wait up to a minute for an API that died with the dispatcher.
        eprintln!(
            "the dispatcher that started this trainer is gone; exiting without the last report"
        );
        std::process::exit(tuneq_openapi::launch::EXIT_INTERRUPTED);
    }
    match outcome {
        Outcome::Finished { .. } => Ok(ExitCode::SUCCESS),
        // Never 0 after SIGTERM: Kubernetes would mark the Job Complete, and the
        // dispatcher would count an unfinished job as failed.
        Outcome::Interrupted { step } => {
            eprintln!(
                "interrupted after step {step}; the checkpoint is saved, a resumed run continues from it"
            );
            Ok(ExitCode::from(
                tuneq_openapi::launch::EXIT_INTERRUPTED as u8,
            ))
        }
    }
}

/// Whether a dispatcher started this trainer and is no longer its parent.
fn parent_gone() -> bool {
    let Some(parent) = std::env::var(tuneq_dispatcher::local::PARENT_PID_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return false;
    };
    rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get()) != parent
}
