//! `tuneq up`: the service on one machine with nothing else installed — the API, the
//! embedded queue (one file), a local-directory object store, and a dispatcher whose
//! local runtime runs each attempt as a `tuneq train` child process, all under
//! `--data-dir`. A tiny demo base model (`tuneq-tiny-demo`) is generated and registered
//! at first start, so a fine-tune works at once with nothing downloaded.
//!
//! Ctrl-C (or SIGTERM) stops it gracefully: running attempts checkpoint and their jobs
//! go back in line; the next start resumes them from that checkpoint.

use super::BadInput;
use super::service;
use super::settings::{self, Secret};
use anyhow::{Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// The tenant `tuneq up` creates for its printed key.
const DEFAULT_TENANT: &str = "default";
/// The base model `tuneq up` generates and registers.
const DEMO_MODEL: &str = "tuneq-tiny-demo";
/// The node pool of the local runtime.
const LOCAL_POOL: &str = "local";
/// The embedded queue's file in the data dir (`tuneq queue repair` finds it there too).
pub const QUEUE_FILE: &str = "queue.db";

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
    /// API key for the default tenant (else one is generated once); either way it is
    /// kept in `<data-dir>/api-key`.
    #[arg(long, env = "TUNEQ_API_KEY", hide_env_values = true)]
    api_key: Option<Secret>,
    #[command(flatten)]
    policy: service::ApiPolicyArgs,
    #[command(flatten)]
    inference: service::InferenceArgs,
    /// Fine-tunes trained at once (each is a `tuneq train` process).
    #[arg(long, default_value_t = 1, env = "TUNEQ_SLOTS")]
    slots: u32,
    /// Memory one fine-tune may use, in MiB (default: this machine's memory divided by
    /// `--slots`). A job estimated to need more is refused at create; a trainer that
    /// uses more stops, and its job fails with the figures.
    #[arg(long, env = "TUNEQ_ATTEMPT_MEMORY_MIB")]
    attempt_memory_mib: Option<u64>,
    /// Device the local trainers use (`cuda` needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: super::train::DeviceArg,
    #[command(flatten)]
    queue: settings::QueueArgs,
    /// More base models to fine-tune, as ID=LOCATION (repeat): a Hugging Face folder you
    /// have (e.g. a SmolLM2 or Llama 3.2 download) or an `s3://`/`gs://` URI. The demo
    /// model is always there too.
    #[arg(long = "model", value_name = "ID=PATH|URI")]
    models: Vec<String>,
    /// A pools file of local pools (TOML; see docs/pools.md) instead of the one pool
    /// `--slots`, `--attempt-memory-mib` and `--device` describe: each pool gets its own
    /// dispatcher loop in this process.
    #[arg(long = "pools", env = "TUNEQ_POOLS", value_name = "FILE",
          conflicts_with_all = ["slots", "attempt_memory_mib", "device"])]
    pools_file: Option<PathBuf>,
}

/// Generates the tiny demo model once and registers it.
async fn register_demo_model(state: &tuneq_api::AppState, data_dir: &Path) -> Result<()> {
    let dir = data_dir.join("models").join(DEMO_MODEL);
    if !dir.join("config.json").is_file() {
        tuneq_trainer::init::write_model(&tuneq_trainer::init::InitOptions::demo(), &dir)
            .with_context(|| format!("cannot write the demo model to {}", dir.display()))?;
    }
    let location = std::fs::canonicalize(&dir)?.display().to_string();
    let model = service::ModelArg {
        id: DEMO_MODEL.into(),
        location,
    };
    // A tiny randomly initialised model learns at a rate a real one would not.
    service::register_model(state, model, 2e-3).await
}

/// The default tenant's key: the one given, the one kept from an earlier start, or a
/// new one. It is kept in `<data-dir>/api-key`, readable by its owner only, where
/// scripts on this machine read it (`KEY=$(cat .tuneq/data/api-key)`). A given key that
/// replaces the kept one retires it: the old key stops working. A key revoked through
/// the admin API never comes back: a start that would register it again is refused,
/// naming where the key came from. Also says whether the key was made now (only then
/// is it printed).
async fn default_key(
    state: &tuneq_api::AppState,
    given: Option<&str>,
    data_dir: &Path,
) -> Result<(String, bool)> {
    let kept_path = data_dir.join("api-key");
    let kept = std::fs::read_to_string(&kept_path)
        .ok()
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty());
    let (key, generated) = match (given, &kept) {
        (Some(k), _) => (k.trim().to_string(), false),
        (None, Some(k)) => (k.clone(), false),
        (None, None) => (tuneq_api::auth::new_key(), true),
    };
    let from = if given.is_some() {
        "the API key given by --api-key (or TUNEQ_API_KEY)".to_string()
    } else {
        format!("the API key kept in {}", kept_path.display())
    };
    let what_to_do = if given.is_some() {
        "pass a new one (e.g. `openssl rand -hex 32`)".to_string()
    } else {
        format!(
            "remove {} to have a new one made, or pass a new one with --api-key",
            kept_path.display()
        )
    };
    let revoked = tuneq_api::records::tenant::revocation(&state.queue, &key)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?;
    if let Some(revoked) = revoked {
        return Err(BadInput(format!(
            "{from} was revoked (at {} Unix time) and stays revoked: {what_to_do}",
            revoked.revoked_at
        ))
        .into());
    }
    tuneq_api::records::tenant::add_key(&state.queue, DEFAULT_TENANT, Some(&key))
        .await
        .map_err(|e| -> anyhow::Error {
            if e.status.is_client_error() {
                BadInput(format!("{from} is refused: {}", e.detail.message)).into()
            } else {
                anyhow::anyhow!("{}", e.detail.message)
            }
        })?;
    if let Some(old) = kept.as_deref().filter(|old| *old != key) {
        let retired =
            tuneq_api::records::tenant::revoke_key_value(&state.queue, DEFAULT_TENANT, old)
                .await
                .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?;
        if retired {
            eprintln!(
                "the API key kept in {} was replaced and no longer works",
                kept_path.display()
            );
        }
    }
    if kept.as_deref() != Some(key.as_str()) {
        write_private(&kept_path, &key)?;
    }
    Ok((key, generated))
}

/// The key that seals secrets at rest: made once, kept in `<data-dir>/secrets.key`
/// (0600). Losing it makes the tenants' webhook secrets unreadable (rotate them).
fn sealing_key(data_dir: &Path) -> Result<tuneq_api::sealed::SealingKey> {
    use tuneq_api::sealed::SealingKey;
    let path = data_dir.join("secrets.key");
    match std::fs::read(&path) {
        Ok(bytes) => SealingKey::from_bytes(&bytes).ok_or_else(|| {
            anyhow::anyhow!(
                "{} is not a sealing key (32 bytes); restore it from a backup",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = SealingKey::random();
            write_private_bytes(&path, key.bytes())?;
            Ok(key)
        }
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    write_private_bytes(path, text.as_bytes())
}

fn write_private_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(bytes)?;
    file.sync_all()?;
    Ok(())
}

pub fn run(args: UpArgs) -> Result<ExitCode> {
    service::runtime()?.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: UpArgs) -> Result<()> {
    let data_dir = &private_data_dir(&args.data_dir)?;
    let models = args
        .models
        .iter()
        .map(|m| service::model_arg(m))
        .collect::<Result<Vec<_>>>()?;
    service::clean_spool(&data_dir.join("spool"));
    let pools = machine_pools(&args)?;
    let local_pools = service::local_pools(&pools)?;
    let placement = pools.placement.clone();
    let redis = args.queue.redis_url()?;
    let queue = service::open_queue(
        redis.as_deref(),
        &data_dir.join(QUEUE_FILE),
        args.queue.queue_config()?,
    )
    .await?;
    // The API and the dispatcher live in this process: a fresh secret per start will do
    // (trainers of an earlier run are stopped at start).
    let signer = service::attempt_signer(None)?;
    let state = api_state(&args, queue.clone(), pools, signer.clone(), data_dir)?;
    let (key, generated) = seed_catalog(&state, &args, data_dir, models).await?;
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let address = listener.local_addr()?;
    let url = format!("http://{address}");
    // Trainers on this machine report to the loopback address even when the API
    // listens on all interfaces.
    let report_url = if address.ip().is_unspecified() {
        format!("http://127.0.0.1:{}", address.port())
    } else {
        url.clone()
    };
    let api = service::RunningApi::start(listener, &state)?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut dispatcher_tasks = Vec::new();
    for pool in &local_pools {
        // The default pool keeps the data dir's layout of earlier versions.
        let work_dir = if args.pools_file.is_none() {
            data_dir.clone()
        } else {
            data_dir.join("pools").join(&pool.name)
        };
        dispatcher_tasks.push(service::spawn_dispatcher(
            queue.clone(),
            signer.clone(),
            service::LocalDispatch::for_pool(pool, &placement, report_url.clone(), work_dir),
            stop_rx.clone(),
        )?);
    }
    let settler_task = tokio::spawn(service::settle_loop(state, stop_rx));
    print_welcome(&url, &key, generated, data_dir);

    service::shutdown_signal().await;
    eprintln!(
        "stopping: running fine-tunes checkpoint and go back in line (Ctrl-C again to force)"
    );
    let _ = stop_tx.send(true);
    let forced = service::force_on_second_signal();
    for task in dispatcher_tasks {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("dispatcher: {e}"),
            Err(e) => eprintln!("dispatcher: {e}"),
        }
    }
    let _ = settler_task.await;
    api.stop().await;
    forced.abort();
    Ok(())
}

/// Makes everything this process and its trainers write (the queue file, datasets,
/// checkpoints, adapters, keys) its user's only, and the data dir with its `spool` and
/// `models` folders. Returns the data dir's absolute path.
fn private_data_dir(dir: &Path) -> Result<PathBuf> {
    service::private_files();
    let data_dir =
        std::path::absolute(dir).with_context(|| format!("bad data dir {}", dir.display()))?;
    for sub in ["spool", "models"] {
        std::fs::create_dir_all(data_dir.join(sub))
            .with_context(|| format!("cannot create the data dir {}", data_dir.display()))?;
    }
    service::make_private(&data_dir)?;
    Ok(data_dir)
}

/// The pools this machine serves: the pools file, else one local pool of the device's
/// hardware with `--slots` slots. Attempts run on this machine: a job that needs more
/// memory than one may use is refused at create.
fn machine_pools(args: &UpArgs) -> Result<tuneq_pools::PoolsFile> {
    let attempt_memory = service::attempt_memory(args.attempt_memory_mib, args.slots);
    let device: tuneq_openapi::DeviceKind = args.device.into();
    let hardware = match device {
        tuneq_openapi::DeviceKind::Cpu => "cpu",
        tuneq_openapi::DeviceKind::Cuda => "gpu",
    };
    let mut pools = service::load_pools(
        args.pools_file.as_deref(),
        &[format!("{LOCAL_POOL}={hardware}")],
        attempt_memory,
    )?;
    if args.pools_file.is_none() {
        pools.pools[0].slots = args.slots.max(1);
    }
    Ok(pools)
}

/// The API's state: the queue, the local object store under `data_dir`, and the
/// policy from the flags.
fn api_state(
    args: &UpArgs,
    queue: tuneq_queue::Queue,
    pools: tuneq_pools::PoolsFile,
    signer: tuneq_queue::AttemptSigner,
    data_dir: &Path,
) -> Result<tuneq_api::AppState> {
    Ok(tuneq_api::AppState::new(
        queue,
        Arc::new(tuneq_storage::LocalStore::new(data_dir.join("objects"))),
        tuneq_api::ApiConfig {
            spool_dir: data_dir.join("spool"),
            pools: Arc::new(pools),
            attempt_signer: signer,
            sealing_key: sealing_key(data_dir)?,
            ..args.policy.api_config()?
        },
    )
    .with_inference(args.inference.inference(
        tuneq_storage::StorageConfig::default(),
        data_dir.join("cache"),
    )?))
}

/// The default tenant with its limits and key, the demo model and the `--model`s.
/// Returns the key and whether it was made now.
async fn seed_catalog(
    state: &tuneq_api::AppState,
    args: &UpArgs,
    data_dir: &Path,
    models: Vec<service::ModelArg>,
) -> Result<(String, bool)> {
    tuneq_api::records::tenant::create_tenant(&state.queue, DEFAULT_TENANT, "Default tenant")
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?;
    tuneq_api::admin::apply_default_limits(state)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?;
    let (key, generated) =
        default_key(state, args.api_key.as_ref().map(Secret::expose), data_dir).await?;
    register_demo_model(state, data_dir).await?;
    for model in models {
        service::register_model(state, model, service::BASE_LEARNING_RATE).await?;
    }
    service::check_aliases(state).await?;
    Ok((key, generated))
}

/// Prints where the service is and how to call it.
fn print_welcome(url: &str, key: &str, generated: bool, data_dir: &Path) {
    let key_file = data_dir.join("api-key");
    println!("tuneq is up at {url}");
    // The key is printed once, when it is made; after that it is in its 0600 file, not
    // in every terminal scrollback and log the service's output lands in.
    if generated {
        println!("  API key (tenant \"{DEFAULT_TENANT}\", new): {key}");
    }
    println!("  API key file: {}", key_file.display());
    println!("  base model: {DEMO_MODEL}");
    println!("  data: {}", data_dir.display());
    println!("  docs: {url}/docs");
    println!(
        "  try:  curl -H \"Authorization: Bearer $(cat {})\" {url}/v1/models",
        key_file.display()
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
}
