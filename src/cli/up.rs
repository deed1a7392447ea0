//! `tuneq up`: the service on one machine with nothing else installed — the API, the
//! embedded queue (one file) and a local-directory object store under `--data-dir`.
//!
//! Today it serves tenants, keys and files; fine-tunes, the dispatcher and its local
//! runtime join it as issue 5 lands.

use anyhow::{Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// The tenant `tuneq up` creates for its printed key.
const DEFAULT_TENANT: &str = "default";

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "TUNEQ_HOST")]
    host: String,
    /// Port to listen on (0 picks a free one; the URL printed says which).
    #[arg(long, default_value_t = 8080, env = "TUNEQ_PORT")]
    port: u16,
    /// Where the queue file, uploads, checkpoints and adapters live.
    #[arg(long, default_value = ".tuneq/data", env = "TUNEQ_DATA_DIR")]
    data_dir: PathBuf,
    /// API key for the default tenant (else one is generated once and kept in
    /// `<data-dir>/api-key`).
    #[arg(long, env = "TUNEQ_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Admin key, enabling the `/admin` routes (tenants and keys).
    #[arg(long, env = "TUNEQ_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// Largest accepted upload, in MiB.
    #[arg(long, default_value_t = 512)]
    max_upload_mib: u64,
}

/// The default tenant's key: the one given, the one kept from an earlier start, or a
/// new one (kept in `<data-dir>/api-key`, readable by its owner only).
async fn default_key(
    state: &tuneq_api::AppState,
    given: Option<&str>,
    data_dir: &Path,
) -> Result<String> {
    let kept = data_dir.join("api-key");
    let key = match given {
        Some(k) => k.to_string(),
        None => match std::fs::read_to_string(&kept) {
            Ok(k) if !k.trim().is_empty() => k.trim().to_string(),
            _ => {
                let key = tuneq_api::auth::new_key();
                write_private(&kept, &key)?;
                key
            }
        },
    };
    tuneq_api::auth::add_key(state, DEFAULT_TENANT, Some(&key))
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?;
    Ok(key)
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(text.as_bytes())?;
    Ok(())
}

pub fn run(args: UpArgs) -> Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: UpArgs) -> Result<()> {
    let data_dir = &args.data_dir;
    std::fs::create_dir_all(data_dir.join("spool"))
        .with_context(|| format!("cannot create the data dir {}", data_dir.display()))?;
    let queue = tuneq_queue::Queue::open_embedded(
        &data_dir.join("queue.db"),
        "tuneq",
        tuneq_queue::QueueConfig::default(),
    )
    .await
    .context("cannot open the queue file")?;
    let state = tuneq_api::AppState {
        queue,
        store: Arc::new(tuneq_storage::LocalStore::new(data_dir.join("objects"))),
        config: tuneq_api::ApiConfig {
            max_upload_bytes: args.max_upload_mib.saturating_mul(1 << 20),
            admin_key_hash: args.admin_key.as_deref().map(tuneq_api::auth::key_hash),
            spool_dir: data_dir.join("spool"),
            ..tuneq_api::ApiConfig::default()
        },
    };
    tuneq_api::auth::create_tenant(&state, DEFAULT_TENANT, "Default tenant")
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?;
    let key = default_key(&state, args.api_key.as_deref(), data_dir).await?;
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tuneq_api::serve(listener, state)?;
    println!("tuneq is up at {url}");
    println!("  API key (tenant \"{DEFAULT_TENANT}\"): {key}");
    println!("  data: {}", data_dir.display());
    println!("  try:  curl -H \"Authorization: Bearer {key}\" {url}/v1/files");
    server.await.context("the server stopped with an error")
}
