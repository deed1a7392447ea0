//! `tuneq dispatcher`: claims jobs for one node pool from the Redis queue and runs them
//! on this machine (the local runtime), reporting to a `tuneq api`. Ctrl-C or SIGTERM
//! checkpoints its running attempts and puts their jobs back in line.

use super::service;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct DispatcherArgs {
    /// The queue's Redis (`redis://…`; comma-separated seeds for a Cluster).
    #[arg(long, env = "TUNEQ_REDIS_URL", hide_env_values = true)]
    redis: String,
    /// The API trainers report to (its base URL).
    #[arg(long, env = "TUNEQ_API_URL")]
    api_url: String,
    /// Secret shared with the API (at least 32 characters).
    #[arg(long, env = "TUNEQ_ATTEMPT_SECRET", hide_env_values = true)]
    attempt_secret: String,
    /// The node pool it serves (as the API's `--pool` names it).
    #[arg(long, default_value = "local")]
    pool: String,
    /// Fine-tunes trained at once; also the pool's capacity.
    #[arg(long, default_value_t = 1)]
    slots: u32,
    /// Device the trainers use (`cuda` needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: super::train::DeviceArg,
    /// Attempt folders, the model cache and the journal of live attempts.
    #[arg(long, default_value = ".tuneq/dispatcher", env = "TUNEQ_WORK_DIR")]
    work_dir: PathBuf,
    /// Its name as a lease owner (default: the pool's name and the host's).
    #[arg(long)]
    owner: Option<String>,
    /// Memory one attempt may use, in MiB (default: this machine's memory divided by
    /// `--slots`); a trainer that uses more stops, and its job fails with the figures.
    #[arg(long, env = "TUNEQ_ATTEMPT_MEMORY_MIB")]
    attempt_memory_mib: Option<u64>,
}

pub fn run(args: DispatcherArgs) -> Result<ExitCode> {
    service::runtime()?.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: DispatcherArgs) -> Result<()> {
    // Attempt folders (specs with credentials' context, checkpoints, logs) are private.
    service::private_files();
    let queue = service::open_queue(Some(&args.redis), std::path::Path::new("")).await?;
    let signer = service::attempt_signer(Some(&args.attempt_secret))?;
    let work_dir = std::path::absolute(&args.work_dir)?;
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    let owner = args
        .owner
        .clone()
        .unwrap_or_else(|| format!("{}@{host}", args.pool));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = service::spawn_dispatcher(
        queue,
        signer,
        service::LocalDispatch {
            pool: args.pool.clone(),
            slots: args.slots,
            device: args.device.into(),
            report_url: args.api_url.clone(),
            work_dir,
            owner,
            memory_limit_bytes: service::attempt_memory(args.attempt_memory_mib, args.slots),
        },
        stop_rx,
    )?;
    println!(
        "tuneq dispatcher serves pool {} with {} slot(s)",
        args.pool, args.slots
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    service::shutdown_signal().await;
    let _ = stop_tx.send(true);
    let forced = service::force_on_second_signal();
    let outcome = task.await;
    forced.abort();
    match outcome {
        Ok(result) => result.map_err(Into::into),
        Err(e) => Err(e.into()),
    }
}
