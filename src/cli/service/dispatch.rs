//! Dispatcher loops started by a service: on a local runtime or on a Kubernetes pool.

use anyhow::{Context, Result};
use std::path::PathBuf;
use tokio::sync::watch;

/// Where a dispatcher's local runtime works and reports.
pub struct LocalDispatch {
    /// The pool it serves.
    pub pool: String,
    /// Attempts at once.
    pub slots: u32,
    /// The trainers' device.
    pub device: tuneq_openapi::DeviceKind,
    /// The API's base URL, where trainers report.
    pub report_url: String,
    /// Attempt folders, the cache and the journal go under it.
    pub work_dir: PathBuf,
    /// Its name as a lease owner.
    pub owner: String,
    /// Memory one attempt may use, in bytes (None: no limit).
    pub memory_limit_bytes: Option<u64>,
    /// Memory of one accelerator, in bytes (GPU pools that say it).
    pub accelerator_memory_bytes: Option<u64>,
    /// When a job preempted here moves on to the rest of its pools.
    pub placement: tuneq_pools::file::PlacementSettings,
    /// Where it counts what it does.
    pub metrics: tuneq_dispatcher::metrics::Metrics,
}

impl LocalDispatch {
    /// The dispatcher of local pool `pool`: its slots, its memory per attempt, CUDA on
    /// GPU pools; its lease owner name is the pool's.
    pub fn for_pool(
        pool: &tuneq_pools::Pool,
        placement: &tuneq_pools::file::PlacementSettings,
        report_url: String,
        work_dir: PathBuf,
    ) -> Self {
        Self {
            pool: pool.name.clone(),
            slots: pool.slots,
            device: match pool.hardware {
                tuneq_pools::Hardware::Cpu => tuneq_openapi::DeviceKind::Cpu,
                tuneq_pools::Hardware::Gpu => tuneq_openapi::DeviceKind::Cuda,
            },
            report_url,
            work_dir,
            owner: pool.name.clone(),
            memory_limit_bytes: pool
                .memory
                .as_ref()
                .map(tuneq_pools::quantity::Memory::bytes),
            accelerator_memory_bytes: match pool.hardware {
                tuneq_pools::Hardware::Gpu => pool
                    .accelerator_memory
                    .as_ref()
                    .map(tuneq_pools::quantity::Memory::bytes),
                tuneq_pools::Hardware::Cpu => None,
            },
            placement: placement.clone(),
            metrics: Default::default(),
        }
    }
}

/// What a dispatcher loop of a Kubernetes pool needs.
pub struct KubernetesDispatch {
    /// The pool.
    pub pool: tuneq_pools::Pool,
    /// When a job preempted there moves on to the rest of its pools.
    pub placement: tuneq_pools::file::PlacementSettings,
    /// The API's base URL as the trainer pods reach it.
    pub report_url: String,
    /// Its name as a lease owner.
    pub owner: String,
    /// Where it counts what it does.
    pub metrics: tuneq_dispatcher::metrics::Metrics,
}

/// Starts a dispatcher loop for a Kubernetes pool; it stops when `stop` turns true,
/// leaving its attempts running (the next start adopts them).
pub fn spawn_kubernetes_dispatcher(
    queue: tuneq_queue::Queue,
    signer: tuneq_queue::AttemptSigner,
    client: tuneq_dispatcher::kubernetes::runtime::KubeClient,
    dispatch: KubernetesDispatch,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>> {
    let mut config = tuneq_dispatcher::DispatcherConfig::new(&dispatch.pool.name, &dispatch.owner);
    config.slots = dispatch.pool.slots.max(1);
    config.placement = dispatch.placement;
    config.metrics = dispatch.metrics;
    let runtime = tuneq_dispatcher::kubernetes::KubernetesRuntime::new(
        client,
        tuneq_dispatcher::kubernetes::KubernetesSettings::new(dispatch.pool, dispatch.report_url),
    )?;
    let dispatcher = tuneq_dispatcher::Dispatcher::new(queue, config, Box::new(runtime), signer);
    Ok(tokio::spawn(dispatcher.run(stop)))
}

/// Starts a dispatcher with a local runtime; it stops (checkpointing its attempts) when
/// `stop` turns true.
pub fn spawn_dispatcher(
    queue: tuneq_queue::Queue,
    signer: tuneq_queue::AttemptSigner,
    local: LocalDispatch,
    stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<Result<(), tuneq_dispatcher::DispatchError>>> {
    for sub in ["attempts", "cache"] {
        std::fs::create_dir_all(local.work_dir.join(sub))
            .with_context(|| format!("cannot create {}", local.work_dir.display()))?;
    }
    let settings = tuneq_dispatcher::local::LocalSettings {
        exe: std::env::current_exe().context("cannot find the tuneq binary")?,
        work_dir: local.work_dir.join("attempts"),
        report_base_url: local.report_url,
        device: local.device,
        cache_dir: local.work_dir.join("cache"),
        memory_limit_bytes: local.memory_limit_bytes,
        accelerator_memory_bytes: local.accelerator_memory_bytes,
    };
    let mut config = tuneq_dispatcher::DispatcherConfig::new(&local.pool, &local.owner);
    config.slots = local.slots.max(1);
    config.placement = local.placement;
    config.metrics = local.metrics;
    let runtime =
        tuneq_dispatcher::local::LocalRuntime::new(settings, local.work_dir.join("attempts.json"));
    let dispatcher = tuneq_dispatcher::Dispatcher::new(queue, config, Box::new(runtime), signer);
    Ok(tokio::spawn(dispatcher.run(stop)))
}
