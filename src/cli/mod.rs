//! Command-line interface: one module per subcommand.

mod api;
mod bench;
mod bench_api;
mod debug;
mod demo;
mod dispatcher;
mod generate;
mod merge;
mod model;
mod models;
mod queue;
mod service;
mod settings;
mod train;
mod up;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;
use tuneq_openapi::FailureClass;

/// tuneq: LoRA fine-tuning of Llama-family models, from one binary.
#[derive(Parser)]
#[command(name = "tuneq", version, about, propagate_version = true)]
struct Cli {
    /// Compute threads (sets RAYON_NUM_THREADS; results are bit-reproducible for a fixed count).
    #[arg(long, global = true, env = "TUNEQ_THREADS")]
    threads: Option<usize>,
    /// Settings of `up`, `api` and `dispatcher` from a TOML file, one table per service
    /// (`[api]`, …) keyed by flag names; flags and the environment win over it.
    #[arg(long, global = true, env = "TUNEQ_CONFIG", value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole service on this machine: API, queue (embedded or Redis), local
    /// object store and a dispatcher training on this machine.
    Up(up::UpArgs),
    /// Run the REST API alone (queue on Redis, objects on S3/GCS/a shared folder).
    Api(api::ApiArgs),
    /// Run the REST API with models served (`/v1/chat/completions`, `/v1/responses`): the
    /// deployment on the nodes that generate, beside `tuneq api`.
    Serve(api::ServeArgs),
    /// Run a dispatcher: claim jobs for one node pool from Redis and train them here.
    Dispatcher(dispatcher::DispatcherArgs),
    /// Train a LoRA adapter (from a spec file, flags, or `--demo`).
    Train(Box<train::TrainArgs>),
    /// Model utilities.
    Model {
        #[command(subcommand)]
        command: model::ModelCommand,
    },
    /// The model registry of a running service: `add` a base model, `remove` one.
    Models {
        #[command(subcommand)]
        command: models::ModelsCommand,
    },
    /// Generate a completion greedily with a model and optional adapter.
    Generate(generate::GenerateArgs),
    /// Fold an adapter into the base weights, writing a merged model.
    Merge(merge::MergeArgs),
    /// Maintenance of the embedded queue file (`repair`).
    Queue {
        #[command(subcommand)]
        command: queue::QueueCommand,
    },
    /// Settings: `tuneq config show SERVICE [FLAGS]` prints what a service would run
    /// with, where each setting came from, secrets masked.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
    /// Reference computations for cross-checking against PyTorch.
    #[command(hide = true)]
    Debug {
        #[command(subcommand)]
        command: debug::DebugCommand,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the effective settings of a service (flags, environment, config file,
    /// defaults) as a config file would hold them, and exit.
    Show {
        #[command(subcommand)]
        service: ShowService,
    },
}

/// The services whose settings `tuneq config show` prints; each takes the service's flags.
#[derive(Subcommand)]
enum ShowService {
    Up(up::UpArgs),
    Api(api::ApiArgs),
    Serve(api::ServeArgs),
    Dispatcher(dispatcher::DispatcherArgs),
}

/// Exit code for bad user input (spec, dataset, model files) of every command but
/// `tuneq train`, which follows the launch contract
/// ([`tuneq_openapi::launch::EXIT_BAD_INPUT`]).
pub const EXIT_BAD_INPUT: u8 = 2;

/// How a command's failures become exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCodes {
    /// Every command but `tuneq train`: bad input 2, anything else 1.
    Command,
    /// `tuneq train`: the launch contract's code for each failure class (bad input 42,
    /// a diverged run 43), anything else 1.
    Trainer,
}

impl ExitCodes {
    /// The exit code of a failure of `class`.
    fn of(self, class: FailureClass) -> u8 {
        let contract = tuneq_openapi::launch::TrainerExit::code_for(class);
        match (self, class) {
            (_, FailureClass::TrainingFailed) => 1,
            (Self::Command, _) => EXIT_BAD_INPUT,
            (Self::Trainer, _) => contract.and_then(|c| u8::try_from(c).ok()).unwrap_or(1),
        }
    }
}

pub fn main() -> ExitCode {
    let (mut cli_command, sources) = match command_with_config() {
        Ok(found) => found,
        Err(e) => return report(&e, ExitCodes::Command),
    };
    let matches = cli_command.get_matches_mut();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(code) = reexec_with_runtime_env(cli.threads) {
        return code;
    }
    // The service logs what it does; one-shot commands only what went wrong. The API
    // benchmark serves with the service's filter, so it pays for the same spans.
    init_tracing(
        if matches!(
            cli.command,
            Command::Up(_)
                | Command::Api(_)
                | Command::Serve(_)
                | Command::Dispatcher(_)
                | Command::Bench {
                    command: bench::BenchCommand::Api { .. }
                }
        ) {
            "info,tuneq::access=warn"
        } else {
            "warn"
        },
    );
    let codes = if matches!(cli.command, Command::Train(_)) {
        ExitCodes::Trainer
    } else {
        ExitCodes::Command
    };
    // The kernels read their instruction-set cap on first use and ignore a bad one;
    // refuse it here, before anything runs (or a service hands it to its trainers).
    if let Err(e) = tuneq_kernels::IsaLimit::from_env() {
        return report(&anyhow::Error::new(BadInput(e.to_string())), codes);
    }
    let result = match cli.command {
        Command::Up(args) => up::run(args),
        Command::Api(args) => api::run(args),
        Command::Serve(args) => api::run_serve(args),
        Command::Dispatcher(args) => dispatcher::run(args),
        Command::Train(args) => train::run(*args),
        Command::Model { command } => model::run(command),
        Command::Models { command } => models::run(command),
        Command::Generate(args) => generate::run(args),
        Command::Merge(args) => merge::run(args),
        Command::Queue { command } => queue::run(command),
        Command::Config {
            command: ConfigCommand::Show { .. },
        } => show_settings(&matches, &sources),
        Command::Bench { command } => bench::run(command),
        Command::Debug { command } => debug::run(command),
    };
    match result {
        Ok(code) => code,
        Err(e) => report(&e, codes),
    }
}

/// The CLI with the config file's settings (if one is given, for a service or
/// `tuneq config`) as its flags' defaults, and where they came from.
fn command_with_config() -> anyhow::Result<(clap::Command, settings::ConfigSources)> {
    let command = Cli::command();
    let Some(path) = settings::config_path(&command) else {
        return Ok((command, settings::ConfigSources::default()));
    };
    let (command, mut sources) = settings::apply_config_file(command, &path)?;
    sources.path = Some(path);
    Ok((command, sources))
}

/// `tuneq config show SERVICE`: the service's effective settings on stdout, in the
/// order of its flags (the command a config file changed has them reordered).
fn show_settings(
    matches: &clap::ArgMatches,
    sources: &settings::ConfigSources,
) -> anyhow::Result<ExitCode> {
    let command = Cli::command();
    let shown = matches
        .subcommand_matches("config")
        .and_then(|m| m.subcommand_matches("show"))
        .and_then(|m| m.subcommand())
        .and_then(|(name, sub_matches)| {
            let sub = command
                .find_subcommand("config")?
                .find_subcommand("show")?
                .find_subcommand(name)?;
            Some(settings::show(name, sub, sub_matches, sources))
        })
        .ok_or_else(|| anyhow::anyhow!("no service to show"))?;
    print!("{shown}");
    Ok(ExitCode::SUCCESS)
}

/// Prints an error with its cause chain and exits with the code `codes` give its
/// failure class.
pub fn report(e: &anyhow::Error, codes: ExitCodes) -> ExitCode {
    eprintln!("error: {e}");
    for cause in e.chain().skip(1) {
        eprintln!("  caused by: {cause}");
    }
    if let Some(t) = e
        .chain()
        .find_map(|c| c.downcast_ref::<tuneq_trainer::Error>())
    {
        print_details(t);
    }
    ExitCode::from(codes.of(failure_class(e)))
}

/// The class of failure an error is: a trainer error's own, the CLI's usage errors are
/// invalid input, anything else a failure.
fn failure_class(e: &anyhow::Error) -> FailureClass {
    let trainer = e.chain().find_map(|c| {
        c.downcast_ref::<tuneq_trainer::Error>()
            .map(tuneq_trainer::Error::failure_class)
            .filter(|class| *class != FailureClass::TrainingFailed)
    });
    let usage = e
        .chain()
        .any(|c| c.downcast_ref::<BadInput>().is_some())
        .then_some(FailureClass::InvalidTrainingInput);
    trainer.or(usage).unwrap_or(FailureClass::TrainingFailed)
}

/// Lists every bad line of a dataset error on stderr, one per line, and emits the same
/// as one JSON object (`{"error": …}`) on stdout for machines.
fn print_details(e: &tuneq_trainer::Error) {
    let data_errors: Vec<&tuneq_trainer::data::DataError> = match e {
        tuneq_trainer::Error::Data(d) => vec![d],
        tuneq_trainer::Error::Datasets(ds) => ds.iter().collect(),
        _ => Vec::new(),
    };
    let mut lines = Vec::new();
    for d in data_errors {
        if let tuneq_trainer::data::DataError::InvalidLines { errors, .. } = d {
            for l in errors {
                eprintln!(
                    "  {}:{}: {}: {}",
                    l.file,
                    l.line,
                    if l.field.is_empty() {
                        "(line)"
                    } else {
                        &l.field
                    },
                    l.message
                );
                lines.push(serde_json::json!(l));
            }
        }
    }
    let fields: Vec<serde_json::Value> = match e {
        tuneq_trainer::Error::Spec(errs) => errs
            .iter()
            .map(|s| serde_json::json!({"field": s.field, "message": s.message}))
            .collect(),
        _ => Vec::new(),
    };
    let body = serde_json::json!({"error": {
        "type": if e.is_bad_input() { "invalid_request_error" } else { "internal_error" },
        "failure": e.failure_class(),
        "message": e.to_string(),
        "lines": lines,
        "fields": fields,
    }});
    println!("{body}");
}

/// A usage error detected by the CLI itself (bad input: exit code 2, 42 for `tuneq train`).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// Logs to stderr, filtered by `TUNEQ_LOG` (e.g. `debug`, `tuneq_api=debug`), else `default`;
/// in colour only on a terminal, so a log file or collector gets plain lines.
fn init_tracing(default: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("TUNEQ_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

/// Environment the compute runtime reads once at start, so it must be in place before the
/// process starts:
/// - `RAYON_NUM_THREADS` for `--threads` (candle and rayon size their pools from it);
/// - `MIMALLOC_PURGE_DELAY=-1` unless the user set it: mimalloc otherwise hands freed
///   tensor memory back to the OS after 1 s and the next step faults in fresh, zeroed huge
///   pages. Measured with `perf` on `tuneq bench train --preset tiny`, 1 thread: kernel
///   page zeroing fell from 20% to 4% of samples and total CPU samples by 29%.
fn runtime_env(threads: Option<usize>) -> Vec<(&'static str, String)> {
    let mut want = Vec::new();
    if let Some(n) = threads {
        let n = n.max(1).to_string();
        want.push(("RAYON_NUM_THREADS", n.clone()));
        want.push(("CANDLE_NUM_THREADS", n));
    }
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        want.push(("MIMALLOC_PURGE_DELAY", "-1".to_string()));
    }
    want
}

/// Replaces this process with itself under [`runtime_env`] when any of it is missing.
/// `exec` keeps the pid, so signals (SIGTERM → checkpoint) still reach the trainer.
/// Returns an exit code only if exec failed.
fn reexec_with_runtime_env(threads: Option<usize>) -> Option<ExitCode> {
    use std::os::unix::process::CommandExt;
    let want = runtime_env(threads);
    if want
        .iter()
        .all(|(k, v)| std::env::var(k).ok().as_deref() == Some(v.as_str()))
    {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .envs(want)
        .exec();
    eprintln!("error: cannot restart with the runtime environment: {err}");
    Some(ExitCode::from(1))
}
