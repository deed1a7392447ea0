//! What every handler shares: the queue (jobs and the catalog), the object store, the
//! server's settings, and what this process learns or keeps a copy of. It sits below the
//! handlers and above the records: nothing here reaches up into a handler.

use crate::cache::RecordCache;
use crate::records::finetune::{FineTuneRecord, FineTunes};
use crate::webhook_target::WebhookPolicy;
use std::path::PathBuf;
use std::sync::Arc;
use tuneq_queue::{AttemptSigner, Queue};
use tuneq_storage::ObjectStore;

/// The server's settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Largest accepted upload, in bytes.
    pub max_upload_bytes: u64,
    /// Largest accepted JSON request body, in bytes.
    pub max_json_bytes: usize,
    /// SHA-256 (hex) of the admin key; None disables the admin routes.
    pub admin_key_hash: Option<String>,
    /// Where uploads are spooled while they are validated.
    pub spool_dir: PathBuf,
    /// Node pools jobs can be placed on: a request no pool can ever run (hardware,
    /// memory, cost) is refused at create.
    pub pools: std::sync::Arc<tuneq_pools::PoolsFile>,
    /// Checks the credentials trainers report progress with (shared with the dispatcher).
    pub attempt_signer: AttemptSigner,
    /// Which webhook targets are accepted.
    pub webhooks: WebhookPolicy,
    /// Seals the secrets the catalog keeps (webhook signing secrets).
    pub sealing_key: crate::sealed::SealingKey,
    /// The pace request bodies must keep.
    pub body_pace: crate::guard::BodyPace,
    /// Connections the server holds at once (spread over its workers); more wait in
    /// the listen backlog. Keep it under the process's file limit.
    pub max_connections: usize,
    /// The limits of every tenant where its own leave one unset (none by default here;
    /// `tuneq up` and `tuneq api` set the server's from their flags).
    pub default_limits: crate::records::tenant::TenantLimits,
    /// What clients may hold open (event streams, downloads): per tenant, and for the
    /// process at most half of `max_connections` (see [`crate::holds`]).
    pub holds: crate::holds::HoldLimits,
    /// Other names of registered base models, alias → base model id: an OpenAI model
    /// name (`gpt-4o-mini-2024-07-18`) mapped to the open model that stands in for it,
    /// so that clients' code runs unchanged. Listed in `/v1/models`.
    pub model_aliases: std::collections::BTreeMap<String, String>,
    /// Where `POST /admin/models` may take models from (`--model-root`); empty:
    /// anywhere.
    pub model_roots: crate::model_roots::ModelRoots,
    /// How registration reads a model folder in an object store (the settings the
    /// trainers use: `--storage-config`, the environment).
    pub model_storage: tuneq_storage::StorageConfig,
    /// The MLflow tracking server jobs' runs go to (`integrations`); None: jobs that ask
    /// for tracking are refused.
    pub mlflow: Option<crate::tracking::MlflowServer>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            max_upload_bytes: 512 << 20,
            max_json_bytes: 1 << 20,
            admin_key_hash: None,
            spool_dir: std::env::temp_dir(),
            pools: std::sync::Arc::new(tuneq_pools::PoolsFile {
                placement: Default::default(),
                pools: Vec::new(),
            }),
            attempt_signer: AttemptSigner::new(rand::random::<[u8; 32]>().to_vec()),
            webhooks: WebhookPolicy::default(),
            sealing_key: crate::sealed::SealingKey::random(),
            body_pace: crate::guard::BodyPace::default(),
            max_connections: 512,
            default_limits: Default::default(),
            holds: crate::holds::HoldLimits::default(),
            model_aliases: Default::default(),
            model_roots: Default::default(),
            model_storage: Default::default(),
            mlflow: None,
        }
    }
}

/// Fine-tune records an API process keeps a copy of.
const CACHED_FINETUNES: usize = 10_000;

/// Shared by every request.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Jobs and the catalog.
    pub queue: Queue,
    /// Datasets, checkpoints and adapters.
    pub store: Arc<dyn ObjectStore>,
    /// Settings.
    pub config: ApiConfig,
    /// Copies of fine-tune records, so polling a job reads only its live state.
    pub(crate) finetune_cache: Arc<RecordCache<FineTuneRecord>>,
    /// Speeds and lost steps per pool, learned from the trainers' reports.
    pub pool_stats: Arc<crate::pool_stats::PoolStats>,
    /// How fast each source may try keys (see [`crate::throttle`]).
    pub(crate) auth_throttle: Arc<crate::throttle::Throttle>,
    /// Uploads in progress, per process and per tenant (see [`crate::upload_slots`]).
    pub upload_slots: crate::upload_slots::UploadSlots,
    /// The event streams and downloads clients hold open (see [`crate::holds`]).
    pub holds: Arc<crate::holds::Holds>,
    /// Tracks jobs in MLflow, when the operator named a tracking server.
    pub(crate) tracker: Option<crate::tracking::Tracker>,
    /// Answers chat requests, when this server serves models (see
    /// [`AppState::with_inference`]).
    pub(crate) inference: Option<Arc<crate::inference::Inference>>,
}

impl AppState {
    /// The state of an API process over `queue` and `store`.
    pub fn new(queue: Queue, store: Arc<dyn ObjectStore>, config: ApiConfig) -> Self {
        let tracker = config
            .mlflow
            .clone()
            .map(|server| crate::tracking::Tracker::start(server, store.clone()));
        Self {
            queue,
            store,
            pool_stats: Arc::new(crate::pool_stats::PoolStats::new(&config.pools)),
            holds: Arc::new(crate::holds::Holds::new(
                config.holds.clone(),
                config.max_connections,
            )),
            tracker,
            config,
            finetune_cache: Arc::new(RecordCache::new(CACHED_FINETUNES)),
            auth_throttle: Arc::default(),
            upload_slots: Default::default(),
            inference: None,
        }
    }

    /// This state, serving models with `inference` (`/v1/chat/completions`).
    pub fn with_inference(mut self, inference: crate::inference::Inference) -> Self {
        self.inference = Some(Arc::new(inference));
        self
    }

    /// The fine-tune records, read through this process's copies.
    pub(crate) fn finetunes(&self) -> FineTunes<'_> {
        FineTunes::new(&self.queue, &self.finetune_cache)
    }
}
