//! `tuneq dispatcher`: claims jobs for node pools from the Redis queue and runs them —
//! on this machine (local pools) or as Jobs on a Kubernetes cluster (the one it runs in,
//! or `KUBECONFIG`'s) — reporting to a `tuneq api`: one local pool (`--pool`), or every
//! pool of a pools file (`--pools`), each with its own loop. Ctrl-C or SIGTERM
//! checkpoints its local attempts and puts their jobs back in line; Kubernetes attempts
//! keep running and are adopted by the next start.
//! `--check-config FILE` checks a pools file (by Kubernetes' rules, and by building each
//! Kubernetes pool's Job as the dispatcher would) and says what it defines.

use super::service;
use super::settings::{self, Secret};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct DispatcherArgs {
    #[command(flatten)]
    queue: settings::QueueArgs,
    /// The API trainers report to (its base URL).
    #[arg(long, env = "TUNEQ_API_URL", required_unless_present = "check_config")]
    api_url: Option<String>,
    /// Secret shared with the API (at least 32 characters).
    #[arg(
        long,
        env = "TUNEQ_ATTEMPT_SECRET",
        hide_env_values = true,
        required_unless_present = "check_config"
    )]
    attempt_secret: Option<Secret>,
    /// The node pool it serves (as the API's `--pool` names it).
    #[arg(long, default_value = "local")]
    pool: String,
    /// The pools file (TOML; see docs/pools.md): serve its pools (those named with
    /// `--serve`, else all) instead of `--pool`/`--slots`/`--device`.
    #[arg(long = "pools", env = "TUNEQ_POOLS", value_name = "FILE",
          conflicts_with_all = ["pool", "slots", "device", "attempt_memory_mib",
                                "accelerator_memory_mib"])]
    pools_file: Option<PathBuf>,
    /// With `--pools`: a pool to serve (repeat; default: every pool of the file).
    #[arg(long = "serve", value_name = "POOL", requires = "pools_file")]
    serve: Vec<String>,
    /// Serve Prometheus metrics per pool (attempts started, ended by how, running,
    /// pending, time to start) at `http://ADDR/metrics`, e.g. `0.0.0.0:9090`, with
    /// `/healthz` (the process answers) and `/readyz` (every pool's loop finished a
    /// tick within the last 30 s) for probes.
    #[arg(long, env = "TUNEQ_METRICS_ADDR", value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Check a pools file, print what it defines, and exit (0 when it is valid).
    #[arg(long, value_name = "FILE", exclusive = true)]
    check_config: Option<PathBuf>,
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
    /// With `--device cuda`: one GPU's memory, in MiB, so that a trainer with
    /// `activation_checkpointing: auto` recomputes layers when they would not fit in it.
    #[arg(long, env = "TUNEQ_ACCELERATOR_MEMORY_MIB",
          value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    accelerator_memory_mib: Option<u64>,
}

pub fn run(args: DispatcherArgs) -> Result<ExitCode> {
    if let Some(path) = &args.check_config {
        return check_config(path);
    }
    service::runtime()?.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

/// How long a pool's loop may go without a good tick before `/readyz` says so (ticks
/// come every half second; a queue or API server that does not answer stops them).
const READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves `metrics` at `http://addr/metrics`, with `/healthz` and `/readyz`, until the
/// task is aborted.
fn serve_metrics(
    addr: std::net::SocketAddr,
    metrics: tuneq_dispatcher::metrics::Metrics,
) -> Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    use actix_web::{App, HttpResponse, HttpServer, web};
    let server = HttpServer::new(move || {
        let for_metrics = metrics.clone();
        let for_ready = metrics.clone();
        App::new()
            .route(
                "/metrics",
                web::get().to(move || {
                    let body = for_metrics.render();
                    async move {
                        HttpResponse::Ok()
                            .content_type("text/plain; version=0.0.4")
                            .body(body)
                    }
                }),
            )
            .route(
                "/healthz",
                web::get().to(|| async { HttpResponse::Ok().body("ok") }),
            )
            .route(
                "/readyz",
                web::get().to(move || {
                    let stale = for_ready.stale_pools(READY_WITHIN);
                    async move {
                        match stale {
                            Some(stale) if stale.is_empty() => HttpResponse::Ok().body("ok"),
                            Some(stale) => HttpResponse::ServiceUnavailable().body(format!(
                                "no good tick within {}s: {}",
                                READY_WITHIN.as_secs(),
                                stale.join(", ")
                            )),
                            None => HttpResponse::ServiceUnavailable().body("no pool loop yet"),
                        }
                    }
                }),
            )
    })
    .workers(1)
    .disable_signals()
    .bind(addr)
    .map_err(|e| anyhow::anyhow!(super::BadInput(format!("--metrics-addr {addr}: {e}"))))?;
    for bound in server.addrs() {
        println!("tuneq dispatcher metrics at http://{bound}/metrics");
    }
    Ok(tokio::spawn(server.run()))
}

/// One pool this process serves.
enum Dispatch {
    /// Attempts as child processes here.
    Local(service::LocalDispatch),
    /// Attempts as Jobs on the cluster.
    Kubernetes(Box<service::KubernetesDispatch>),
}

/// Checks a pools file and prints one line per pool.
fn check_config(path: &std::path::Path) -> Result<ExitCode> {
    let file = service::load_pools(Some(path), &[], None)?;
    service::check_kubernetes_pools(&file, &path.display().to_string(), |_| true)?;
    println!(
        "{}: {} pool(s); after {} preemptions within {} a job moves on",
        path.display(),
        file.pools.len(),
        file.placement.preemptions_before_fallback,
        humantime::format_duration(file.placement.preemption_window)
    );
    for pool in &file.pools {
        println!(
            "  {:<24} {:<10} {:<8} {} slot(s), cpu {}, memory {}, {}/h",
            pool.name,
            format!("{:?}", pool.runtime).to_lowercase(),
            pool.class(),
            pool.slots,
            pool.cpu.0,
            pool.memory.as_ref().map_or("-".into(), |m| m.0.to_string()),
            pool.price_per_hour
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A pool loop's task: it ends when the loop stops.
type PoolTask = tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>;

/// Serves the pools until Ctrl-C or SIGTERM, then stops every loop and waits for them.
async fn serve(args: DispatcherArgs) -> Result<()> {
    let (Some(redis), Some(api_url), Some(secret)) =
        (args.queue.redis_url()?, &args.api_url, &args.attempt_secret)
    else {
        anyhow::bail!(super::BadInput(
            "--redis, --api-url and --attempt-secret are required".into()
        ));
    };
    // Attempt folders (specs with credentials' context, checkpoints, logs) are private.
    service::private_files();
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    let work_dir = std::path::absolute(&args.work_dir)?;
    let metrics = tuneq_dispatcher::metrics::Metrics::default();
    let dispatches = match &args.pools_file {
        Some(path) => file_dispatches(&args, path, api_url, &host, &work_dir, &metrics)?,
        None => vec![single_dispatch(&args, api_url, &host, work_dir, &metrics)],
    };
    let queue = service::open_queue(
        Some(&redis),
        std::path::Path::new(""),
        args.queue.queue_config()?,
    )
    .await?;
    let signer = service::attempt_signer(Some(secret.expose()))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let tasks = spawn_pools(&queue, &signer, dispatches, &stop_rx).await?;
    let metrics_server = match args.metrics_addr {
        Some(addr) => Some(serve_metrics(addr, metrics.clone())?),
        None => None,
    };
    use std::io::Write;
    let _ = std::io::stdout().flush();
    service::shutdown_signal().await;
    if let Some(server) = metrics_server {
        server.abort();
    }
    let _ = stop_tx.send(true);
    let forced = service::force_on_second_signal();
    let mut outcome = Ok(());
    for task in tasks {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => outcome = Err(e.into()),
            Err(e) => outcome = Err(e.into()),
        }
    }
    forced.abort();
    outcome
}

/// The pools of the pools file at `path` this process serves (those named with
/// `--serve`, else all), after checking the names and the Kubernetes pools' Jobs.
fn file_dispatches(
    args: &DispatcherArgs,
    path: &std::path::Path,
    api_url: &str,
    host: &str,
    work_dir: &std::path::Path,
    metrics: &tuneq_dispatcher::metrics::Metrics,
) -> Result<Vec<Dispatch>> {
    let file = service::load_pools(Some(path), &[], None)?;
    for name in &args.serve {
        if file.pool(name).is_none() {
            anyhow::bail!(super::BadInput(format!(
                "--serve {name}: {} defines no such pool",
                path.display()
            )));
        }
    }
    let chosen = |p: &tuneq_pools::Pool| args.serve.is_empty() || args.serve.contains(&p.name);
    service::check_kubernetes_pools(&file, &path.display().to_string(), chosen)?;
    let mut dispatches = Vec::new();
    for pool in file.pools.iter().filter(|p| chosen(p)) {
        match pool.runtime {
            tuneq_pools::RuntimeKind::Local => {
                let mut dispatch = service::LocalDispatch::for_pool(
                    pool,
                    &file.placement,
                    api_url.to_string(),
                    work_dir.join(&pool.name),
                );
                dispatch.owner = format!("{}@{host}", pool.name);
                dispatch.metrics = metrics.clone();
                dispatches.push(Dispatch::Local(dispatch));
            }
            tuneq_pools::RuntimeKind::Kubernetes => dispatches.push(Dispatch::Kubernetes(
                Box::new(service::KubernetesDispatch {
                    pool: pool.clone(),
                    placement: file.placement.clone(),
                    report_url: api_url.to_string(),
                    owner: format!("{}@{host}", pool.name),
                    metrics: metrics.clone(),
                }),
            )),
        }
    }
    Ok(dispatches)
}

/// The one local pool of `--pool`, `--slots` and `--device`.
fn single_dispatch(
    args: &DispatcherArgs,
    api_url: &str,
    host: &str,
    work_dir: PathBuf,
    metrics: &tuneq_dispatcher::metrics::Metrics,
) -> Dispatch {
    Dispatch::Local(service::LocalDispatch {
        pool: args.pool.clone(),
        slots: args.slots,
        device: args.device.into(),
        report_url: api_url.to_string(),
        work_dir,
        owner: args
            .owner
            .clone()
            .unwrap_or_else(|| format!("{}@{host}", args.pool)),
        memory_limit_bytes: service::attempt_memory(args.attempt_memory_mib, args.slots),
        accelerator_memory_bytes: match args.device {
            super::train::DeviceArg::Cuda => args.accelerator_memory_mib.map(|mib| mib << 20),
            _ => None,
        },
        placement: Default::default(),
        metrics: metrics.clone(),
    })
}

/// Starts one loop per pool, each saying what it serves; the Kubernetes pools share one
/// client, connected when the first of them starts.
async fn spawn_pools(
    queue: &tuneq_queue::Queue,
    signer: &tuneq_queue::AttemptSigner,
    dispatches: Vec<Dispatch>,
    stop_rx: &tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<PoolTask>> {
    let mut tasks = Vec::new();
    let mut client = None;
    for dispatch in dispatches {
        match dispatch {
            Dispatch::Local(local) => {
                println!(
                    "tuneq dispatcher serves pool {} with {} slot(s) (local)",
                    local.pool, local.slots
                );
                tasks.push(service::spawn_dispatcher(
                    queue.clone(),
                    signer.clone(),
                    local,
                    stop_rx.clone(),
                )?);
            }
            Dispatch::Kubernetes(dispatch) => {
                let client = match &client {
                    Some(client) => client,
                    None => client.insert(tuneq_dispatcher::kubernetes::connect().await?),
                };
                println!(
                    "tuneq dispatcher serves pool {} with {} slot(s) (kubernetes, namespace {})",
                    dispatch.pool.name,
                    dispatch.pool.slots,
                    dispatch
                        .pool
                        .kubernetes
                        .as_ref()
                        .map_or("?", |k| k.namespace.as_str())
                );
                tasks.push(service::spawn_kubernetes_dispatcher(
                    queue.clone(),
                    signer.clone(),
                    client.clone(),
                    *dispatch,
                    stop_rx.clone(),
                )?);
            }
        }
    }
    Ok(tasks)
}
