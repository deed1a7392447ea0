//! What `tuneq up`, `tuneq api` and `tuneq dispatcher` share: opening the queue,
//! attempt credentials, the dispatcher with its local runtime, the loop that files
//! finished jobs, and graceful shutdown.

use super::BadInput;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use tokio::sync::watch;

/// The shortest admin key accepted.
pub const MIN_ADMIN_KEY_LEN: usize = 32;

/// What the API accepts, set the same way for `tuneq up` and `tuneq api`.
#[derive(Debug, clap::Args)]
pub struct ApiPolicyArgs {
    /// Admin key, enabling the `/admin` routes (tenants, keys, limits).
    #[arg(long, env = "TUNEQ_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<super::settings::Secret>,
    /// Largest accepted upload, in MiB.
    #[arg(long, default_value_t = 512)]
    max_upload_mib: u64,
    /// Accept webhook URLs on private, loopback and link-local addresses, and plain
    /// http:// (receivers on your own network). Off: https:// to public hosts only.
    #[arg(long, env = "TUNEQ_WEBHOOK_ALLOW_PRIVATE")]
    webhook_allow_private: bool,
    /// Jobs a tenant may have waiting, where an operator set none of its own (0: no
    /// limit). About 11 KB of the queue each.
    #[arg(long, env = "TUNEQ_DEFAULT_MAX_QUEUED", default_value_t = 1000)]
    default_max_queued: u32,
    /// Files a tenant may keep, where an operator set none of its own (0: no limit).
    #[arg(long, env = "TUNEQ_DEFAULT_MAX_FILES", default_value_t = 1000)]
    default_max_files: u64,
    /// GiB of files a tenant may keep, where an operator set none of its own (0: no
    /// limit).
    #[arg(long, env = "TUNEQ_DEFAULT_MAX_STORED_GIB", default_value_t = 50)]
    default_max_stored_gib: u64,
    /// Event streams (`…/events?stream=true`) one tenant may hold open at once; more
    /// answer 429 `too_many_streams`. All tenants' streams and downloads together stay
    /// under half of the server's connections whatever this says.
    #[arg(long, env = "TUNEQ_MAX_STREAMS_PER_TENANT", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    max_streams_per_tenant: u32,
    /// Downloads (file content, adapter archives) one tenant may have in progress at
    /// once; more answer 429 `too_many_downloads`.
    #[arg(long, env = "TUNEQ_MAX_DOWNLOADS_PER_TENANT", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    max_downloads_per_tenant: u32,
    /// How long one event stream lasts at most; it then ends without `done`, and the
    /// client reconnects with `Last-Event-ID`.
    #[arg(
        long,
        env = "TUNEQ_STREAM_LIFETIME",
        default_value = "15m",
        value_name = "DURATION"
    )]
    stream_lifetime: super::settings::Span,
}

impl ApiPolicyArgs {
    /// The limits of every tenant that has none of its own (`PUT
    /// /admin/tenants/{id}/limits` sets a tenant's), so that no tenant can fill the
    /// disk with jobs or files by default.
    pub fn default_limits(&self) -> tuneq_api::records::tenant::TenantLimits {
        let set = |n: u64| (n > 0).then_some(n);
        tuneq_api::records::tenant::TenantLimits {
            max_queued: (self.default_max_queued > 0).then_some(self.default_max_queued),
            max_files: set(self.default_max_files),
            max_stored_bytes: set(self.default_max_stored_gib.saturating_mul(1 << 30)),
            ..Default::default()
        }
    }

    /// The upload limit in bytes.
    pub fn max_upload_bytes(&self) -> u64 {
        self.max_upload_mib.saturating_mul(1 << 20)
    }

    /// Which webhook targets are accepted.
    pub fn webhooks(&self) -> tuneq_api::WebhookPolicy {
        tuneq_api::WebhookPolicy {
            allow_private: self.webhook_allow_private,
        }
    }

    /// What clients may hold open: event streams and downloads per tenant, and how long a
    /// stream lasts (a zero lifetime is refused: every stream would end at once).
    pub fn holds(&self) -> Result<tuneq_api::HoldLimits> {
        if self.stream_lifetime.0.is_zero() {
            return Err(BadInput("--stream-lifetime must be more than zero".into()).into());
        }
        Ok(tuneq_api::HoldLimits {
            streams_per_tenant: self.max_streams_per_tenant as usize,
            downloads_per_tenant: self.max_downloads_per_tenant as usize,
            stream_lifetime: self.stream_lifetime.0,
            ..tuneq_api::HoldLimits::default()
        })
    }

    /// The admin key as the API keeps it (hashed); None disables `/admin`. A key shorter
    /// than [`MIN_ADMIN_KEY_LEN`], or one that is easy to guess however long (32 × `a`,
    /// a repeated word), is refused: it opens every tenant's data.
    pub fn admin_key_hash(&self) -> Result<Option<String>> {
        let Some(key) = self.admin_key.as_ref().map(|k| k.expose().trim()) else {
            return Ok(None);
        };
        if key.chars().count() < MIN_ADMIN_KEY_LEN {
            return Err(BadInput(format!(
                "the admin key must be at least {MIN_ADMIN_KEY_LEN} characters (e.g. `openssl rand -hex 32`)"
            ))
            .into());
        }
        tuneq_api::auth::check_strength(key)
            .map_err(|weak| BadInput(format!("the admin key is refused: {weak}")))?;
        Ok(Some(tuneq_api::auth::key_hash(key)))
    }
}

/// Files and folders this process (and the trainers it starts) creates are readable by
/// its user only: the queue file, datasets, checkpoints, adapters and keys. Also raises
/// the open-file limit (see [`raise_file_limit`]).
pub fn private_files() {
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    raise_file_limit();
}

/// Raises this process's open-file limit to the most it may have: each connection,
/// spool file and trainer log holds one, and the usual soft limit (1 024) is reached
/// long before the machine's. Logged when it cannot.
pub fn raise_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        return;
    }
    limit.current = limit.maximum;
    if let Err(e) = setrlimit(Resource::Nofile, limit) {
        tracing::warn!(error = %e, "cannot raise the open-file limit");
    }
}

/// Makes `dir` (a data dir made before [`private_files`]) its owner's only.
pub fn make_private(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make {} private", dir.display()))
}

/// Removes upload spool files that a crashed process left in `dir` (logged).
pub fn clean_spool(dir: &Path) {
    match tuneq_api::files::clean_spool(dir) {
        Ok(0) => {}
        Ok(bytes) => {
            tracing::info!(bytes, dir = %dir.display(), "removed the spool files of an earlier run")
        }
        Err(e) => tracing::warn!(error = %e, dir = %dir.display(), "cannot clean the upload spool"),
    }
}

/// Memory one attempt may use: `--attempt-memory-mib` when given, else this machine's
/// memory (attempts run here one at a time per slot).
pub fn attempt_memory(mib: Option<u64>, slots: u32) -> Option<u64> {
    match mib {
        Some(mib) => Some(mib.saturating_mul(1 << 20)),
        None => machine_memory_bytes().map(|total| total / u64::from(slots.max(1))),
    }
}

/// This machine's memory in bytes (`MemTotal`), where `/proc/meminfo` says it.
pub fn machine_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// A base model to register: `--model ID=LOCATION`.
pub struct ModelArg {
    id: String,
    location: String,
}

/// Reads `--model ID=LOCATION`: the id is checked, a local folder must hold a model
/// (`config.json`) and is made absolute.
pub fn model_arg(text: &str) -> Result<ModelArg> {
    let (id, location) = pair(text, "--model")?;
    tuneq_queue::catalog::check_identifier("model", &id)
        .map_err(|e| BadInput(format!("--model {text}: {e}")))?;
    let location = match tuneq_storage::Location::parse(&location) {
        Ok(tuneq_storage::Location::Local(path)) => {
            if !path.join("config.json").is_file() {
                return Err(BadInput(format!(
                    "--model {text}: {} has no config.json (a Hugging Face model folder is expected)",
                    path.display()
                ))
                .into());
            }
            // A model of another architecture would be trained as Llama, wrongly and
            // silently: refused now, naming it (remote folders are checked by the
            // trainer when it loads them).
            match tuneq_pools::ModelShape::read(&path) {
                Some(Ok(_)) => {}
                Some(Err(refusal)) => {
                    return Err(BadInput(format!("--model {text}: {refusal}")).into());
                }
                None => {
                    return Err(BadInput(format!(
                        "--model {text}: {} holds no readable config.json of at most 1 MiB",
                        path.display()
                    ))
                    .into());
                }
            }
            std::fs::canonicalize(&path)
                .with_context(|| format!("--model {text}"))?
                .display()
                .to_string()
        }
        Ok(_) => location,
        Err(e) => return Err(BadInput(format!("--model {text}: {e}")).into()),
    };
    Ok(ModelArg { id, location })
}

/// Registers a `--model`.
pub async fn register_model(state: &tuneq_api::AppState, model: ModelArg) -> Result<()> {
    tuneq_api::records::model::register(
        &state.queue,
        &tuneq_api::records::model::BaseModel {
            id: model.id,
            location: model.location,
            base_learning_rate: 2e-4,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default(),
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{}", e.detail.message))
}

/// The queue domain every part of one deployment uses.
pub const DOMAIN: &str = "tuneq";

/// Opens the queue with `config`: on Redis when a URL is given (`redis://…`; several
/// comma-separated URLs are the seed nodes of a Redis Cluster), else the embedded file
/// `embedded`.
pub async fn open_queue(
    redis: Option<&str>,
    embedded: &Path,
    config: tuneq_queue::QueueConfig,
) -> Result<tuneq_queue::Queue> {
    match redis {
        Some(urls) if urls.contains(',') => {
            let urls: Vec<String> = urls.split(',').map(|u| u.trim().to_string()).collect();
            tuneq_queue::Queue::connect_cluster(&urls, DOMAIN, config)
                .await
                .context("cannot reach the Redis Cluster")
        }
        Some(url) => tuneq_queue::Queue::connect(url, DOMAIN, config)
            .await
            .with_context(|| format!("cannot reach Redis at {}", redact(url))),
        None => tuneq_queue::Queue::open_embedded(embedded, DOMAIN, config)
            .await
            .with_context(|| format!("cannot open the queue file {}", embedded.display())),
    }
}

/// `urls` (one Redis URL, or a Cluster's comma-separated seeds) with `password` set on
/// each, percent-encoded, so a deployment can keep the password in a Secret of its own
/// instead of writing it into a URL (where characters like `@`, `/` or `:` break it).
pub fn redis_with_password(urls: &str, password: Option<&str>) -> Result<String> {
    let Some(password) = password.filter(|p| !p.is_empty()) else {
        return Ok(urls.to_string());
    };
    let with = urls
        .split(',')
        .map(|u| {
            let bad = |why: &str| BadInput(format!("TUNEQ_REDIS_URL {}: {why}", redact(u.trim())));
            let mut url = url::Url::parse(u.trim()).map_err(|e| bad(&e.to_string()))?;
            url.set_password(Some(password))
                .map_err(|()| bad("cannot hold a password"))?;
            Ok(url.to_string())
        })
        .collect::<Result<Vec<_>, BadInput>>()?;
    Ok(with.join(","))
}

/// A Redis URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://…@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// The signer of attempt credentials from a shared secret (at least 32 characters), or
/// a random one for a single process that runs both the API and the dispatcher.
pub fn attempt_signer(secret: Option<&str>) -> Result<tuneq_queue::AttemptSigner> {
    match secret {
        Some(s) if s.len() >= 32 => Ok(tuneq_queue::AttemptSigner::new(s.as_bytes().to_vec())),
        Some(_) => Err(BadInput(
            "the attempt secret must be at least 32 characters (e.g. `openssl rand -hex 32`)"
                .into(),
        )
        .into()),
        None => Ok(tuneq_queue::AttemptSigner::new(
            rand::random::<[u8; 32]>().to_vec(),
        )),
    }
}

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

/// Files finished jobs' outcomes and sends their webhooks (see `tuneq_api::webhooks`)
/// until stopped. Two loops, so that filing never waits on a receiver: the sender runs
/// as a task of its own, with a share per tenant and endpoint, and once stopped gives
/// its tries in flight a short grace (`webhooks::sender::SHUTDOWN_GRACE`); a try it drops
/// stays in the send queue for the next start.
pub async fn settle_loop(state: tuneq_api::AppState, mut stop: watch::Receiver<bool>) {
    let sender = tokio::spawn(tuneq_api::webhooks::sender::run(
        state.clone(),
        tuneq_api::webhooks::SendLimits::default(),
        stopped(stop.clone()),
    ));
    const BATCH: u32 = 100;
    while !*stop.borrow() {
        let filed = match tuneq_api::webhooks::file_outcomes(&state, BATCH).await {
            Ok(filed) => filed,
            Err(e) => {
                tracing::warn!(error = %e, "cannot file finished jobs; retrying");
                0
            }
        };
        // A full batch: more may be waiting, so go on at once.
        if filed >= BATCH as usize {
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
            _ = stop.changed() => {}
        }
    }
    // Filing is a few catalog writes per job: one last batch costs no wait worth having.
    let _ = tuneq_api::webhooks::file_outcomes(&state, BATCH).await;
    let _ = sender.await;
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}

/// Resolves on the first Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            match term.as_mut() {
                Some(t) => { t.recv().await; }
                None => std::future::pending().await,
            }
        } => {}
    }
}

/// After the first signal: a second one exits at once.
pub fn force_on_second_signal() -> tokio::task::JoinHandle<()> {
    tokio::spawn(async {
        shutdown_signal().await;
        eprintln!("forced stop");
        std::process::exit(130);
    })
}

/// Parses `NAME=VALUE`.
pub fn pair(text: &str, what: &str) -> Result<(String, String)> {
    text.split_once('=')
        .map(|(a, b)| (a.trim().to_string(), b.trim().to_string()))
        .filter(|(a, b)| !a.is_empty() && !b.is_empty())
        .ok_or_else(|| BadInput(format!("{what} must be NAME=VALUE, not `{text}`")).into())
}

/// The pools the service uses: the pools file when one is named, else the `--pool
/// NAME=HARDWARE` shorthand (local pools with `memory` bytes per attempt, when known).
pub fn load_pools(
    file: Option<&Path>,
    shorthand: &[String],
    memory: Option<u64>,
) -> Result<tuneq_pools::PoolsFile> {
    if let Some(path) = file {
        return tuneq_pools::PoolsFile::load(path).map_err(|e| BadInput(e.to_string()).into());
    }
    let pairs = shorthand
        .iter()
        .map(|p| pair(p, "--pool"))
        .collect::<Result<Vec<_>>>()?;
    tuneq_pools::PoolsFile::from_shorthand(&pairs, memory)
        .map_err(|e| BadInput(e.to_string()).into())
}

/// Refuses a pools file with a Kubernetes pool (of those `serves`) that the dispatcher
/// cannot build a Job for, such as a volume on the runtime's own paths, naming the file
/// (`shown`) and the field as the file's own errors do: found when the file is checked
/// or the dispatcher starts, not when a job first runs there.
pub fn check_kubernetes_pools(
    file: &tuneq_pools::PoolsFile,
    shown: &str,
    serves: impl Fn(&tuneq_pools::Pool) -> bool,
) -> Result<()> {
    for (i, pool) in file.pools.iter().enumerate().filter(|(_, p)| serves(p)) {
        if let Err(e) = tuneq_dispatcher::kubernetes::check_pool(pool) {
            return Err(BadInput(format!("{shown}: pool[{i}].{}: {e}", e.field())).into());
        }
    }
    Ok(())
}

/// The local pools of `pools` (the ones this process runs attempts for), or a clear
/// refusal naming those it cannot run.
pub fn local_pools(pools: &tuneq_pools::PoolsFile) -> Result<Vec<tuneq_pools::Pool>> {
    let (local, remote): (Vec<_>, Vec<_>) = pools
        .pools
        .iter()
        .cloned()
        .partition(|p| p.runtime == tuneq_pools::RuntimeKind::Local);
    if let Some(pool) = remote.first() {
        return Err(BadInput(format!(
            "pool `{}` has runtime = \"kubernetes\", which this build's dispatcher does not run yet; only local pools can be served",
            pool.name
        ))
        .into());
    }
    Ok(local)
}

/// A multi-threaded runtime for a service command.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_kept_out_of_messages() {
        assert_eq!(
            redact("redis://:secret@host:6379/0"),
            "redis://…@host:6379/0"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(attempt_signer(Some("short")).is_err());
        assert!(attempt_signer(Some(&"x".repeat(32))).is_ok());
        assert_eq!(pair("a=b", "pool").unwrap(), ("a".into(), "b".into()));
        assert!(pair("a", "pool").is_err());
    }
}
