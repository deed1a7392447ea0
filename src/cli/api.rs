//! `tuneq api`: the REST service alone, for the production shape — the queue on Redis,
//! objects on S3, GCS or a shared folder, and dispatchers (`tuneq dispatcher`) running
//! elsewhere. It also files finished jobs' outcomes.

use super::service;
use super::settings::{self, Secret};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct ApiArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0", env = "TUNEQ_HOST")]
    host: String,
    /// Port to listen on (0 picks a free one; the URL printed says which).
    #[arg(long, default_value_t = 8080, env = "TUNEQ_PORT")]
    port: u16,
    #[command(flatten)]
    queue: settings::QueueArgs,
    /// Where uploads, checkpoints and adapters live: `file:///srv/tuneq`, `s3://bucket/prefix`
    /// or `gs://bucket/prefix` (trainers must reach the same place).
    #[arg(long, env = "TUNEQ_STORE")]
    store: String,
    /// Storage settings (TOML; see `tuneq train --help`).
    #[arg(long, env = "TUNEQ_STORAGE_CONFIG")]
    storage_config: Option<PathBuf>,
    /// Node pools jobs may be placed on, as NAME=HARDWARE (repeat; e.g. `cpu-pool=cpu`,
    /// `l4-spot=spot-gpu`): a shorthand for a pools file of local pools.
    #[arg(long = "pool", default_value = "local=cpu")]
    pools: Vec<String>,
    /// The pools file (TOML; see docs/pools.md): the pools, their hardware, memory and
    /// price. Replaces `--pool`.
    #[arg(
        long = "pools",
        env = "TUNEQ_POOLS",
        conflicts_with = "pools",
        value_name = "FILE"
    )]
    pools_file: Option<PathBuf>,
    /// Base models to register at start, as ID=LOCATION (repeat; a folder or URI in
    /// Hugging Face layout).
    #[arg(long = "model")]
    models: Vec<String>,
    /// Secret shared with the dispatchers, to check trainers' attempt credentials
    /// (at least 32 characters).
    #[arg(long, env = "TUNEQ_ATTEMPT_SECRET", hide_env_values = true)]
    attempt_secret: Secret,
    #[command(flatten)]
    policy: service::ApiPolicyArgs,
    /// Where uploads are spooled while they are validated.
    #[arg(long, env = "TUNEQ_SPOOL_DIR")]
    spool_dir: Option<PathBuf>,
    /// Memory one attempt may use on the dispatchers' machines, in MiB, for pools given
    /// with `--pool`: a job estimated to need more is refused at create (default: not
    /// checked). A pools file says it per pool.
    #[arg(long, env = "TUNEQ_ATTEMPT_MEMORY_MIB")]
    attempt_memory_mib: Option<u64>,
}

/// `tuneq serve`: the API with models served (`/v1/chat/completions`, `/v1/responses`),
/// for a deployment of its own on the nodes that generate.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    api: ApiArgs,
    #[command(flatten)]
    inference: service::InferenceArgs,
    /// Where base models and adapters from the store are staged (default: `tuneq-cache`
    /// in the temp folder).
    #[arg(long, env = "TUNEQ_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
}

/// What a process of the API does besides answering requests.
enum Role {
    /// `tuneq api`: files finished jobs' outcomes and sends their webhooks.
    Api,
    /// `tuneq serve`: answers chat requests with the models; the API replicas file outcomes.
    Serve(Box<tuneq_api::inference::Inference>),
}

pub fn run(args: ApiArgs) -> Result<ExitCode> {
    service::runtime()?.block_on(serve(args, |_| Ok(Role::Api)))?;
    Ok(ExitCode::SUCCESS)
}

/// Runs `tuneq serve`.
pub fn run_serve(args: ServeArgs) -> Result<ExitCode> {
    let ServeArgs {
        api,
        inference,
        cache_dir,
    } = args;
    let cache = cache_dir.unwrap_or_else(tuneq_trainer::remote::Storage::default_cache_dir);
    service::runtime()?.block_on(serve(api, move |storage| {
        Ok(Role::Serve(Box::new(
            inference.inference(storage.clone(), cache)?,
        )))
    }))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(
    args: ApiArgs,
    role: impl FnOnce(&tuneq_storage::StorageConfig) -> Result<Role>,
) -> Result<()> {
    let Some(redis) = args.queue.redis_url()? else {
        anyhow::bail!(super::BadInput(
            "the API keeps its queue on Redis: give --redis (TUNEQ_REDIS_URL)".into()
        ));
    };
    let attempt_secret = &args.attempt_secret;
    let queue = service::open_queue(
        Some(&redis),
        std::path::Path::new(""),
        args.queue.queue_config()?,
    )
    .await?;
    let storage_config = match &args.storage_config {
        Some(p) => super::train::load_storage_config(p)?,
        None => tuneq_storage::StorageConfig::default(),
    };
    let location = tuneq_storage::Location::parse(&args.store)
        .map_err(|e| super::BadInput(format!("--store: {e}")))?;
    let store = tuneq_storage::open(&location, &storage_config)
        .await
        .with_context(|| format!("cannot open the store {}", args.store))?;
    let role = role(&storage_config)?;
    let pools = service::load_pools(
        args.pools_file.as_deref(),
        &args.pools,
        args.attempt_memory_mib.map(|m| m.saturating_mul(1 << 20)),
    )?;
    service::private_files();
    let spool_dir = args.spool_dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&spool_dir)
        .with_context(|| format!("cannot create {}", spool_dir.display()))?;
    service::clean_spool(&spool_dir);
    let models = args
        .models
        .iter()
        .map(|m| service::model_arg(m))
        .collect::<Result<Vec<_>>>()?;
    let mut state = tuneq_api::AppState::new(
        queue,
        store,
        tuneq_api::ApiConfig {
            spool_dir,
            pools: std::sync::Arc::new(pools),
            attempt_signer: service::attempt_signer(Some(attempt_secret.expose()))?,
            // Every replica shares the attempt secret, so each derives the same key.
            sealing_key: tuneq_api::sealed::SealingKey::derive(attempt_secret.expose().as_bytes()),
            model_storage: storage_config.clone(),
            ..args.policy.api_config()?
        },
    );
    let files_outcomes = match role {
        Role::Api => true,
        Role::Serve(inference) => {
            state = state.with_inference(*inference);
            false
        }
    };
    tuneq_api::admin::apply_default_limits(&state)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.detail.message))?;
    for model in models {
        service::register_model(&state, model, service::BASE_LEARNING_RATE).await?;
    }
    service::check_aliases(&state).await?;
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let url = format!("http://{}", listener.local_addr()?);
    let api = service::RunningApi::start(listener, &state)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let settler = files_outcomes.then(|| tokio::spawn(service::settle_loop(state, stop_rx)));
    match files_outcomes {
        true => println!("tuneq api is up at {url}"),
        false => println!("tuneq serve is up at {url}"),
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    service::shutdown_signal().await;
    let _ = stop_tx.send(true);
    let forced = service::force_on_second_signal();
    if let Some(settler) = settler {
        let _ = settler.await;
    }
    api.stop().await;
    forced.abort();
    Ok(())
}
