//! What the API accepts (`--admin-key`, upload size, webhook targets, tenant defaults,
//! streams and downloads, model aliases, where models may be registered from, the MLflow
//! tracking server), set the same way
//! for `tuneq up` and `tuneq api`.

use crate::cli::BadInput;
use crate::cli::settings::{Secret, Span};
use anyhow::Result;

/// The shortest admin key accepted.
pub const MIN_ADMIN_KEY_LEN: usize = 32;

/// What the API accepts, set the same way for `tuneq up` and `tuneq api`.
#[derive(Debug, clap::Args)]
pub struct ApiPolicyArgs {
    /// Admin key, enabling the `/admin` routes (tenants, keys, limits).
    #[arg(long, env = "TUNEQ_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<Secret>,
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
    stream_lifetime: Span,
    /// Another name for a registered base model, as ALIAS=MODEL (repeat, or
    /// comma-separated): the OpenAI model name clients' code asks for mapped to the open
    /// model trained in its place, e.g. `gpt-4o-mini-2024-07-18=smollm2-135m`. Jobs show
    /// the alias as `model` and the base model as `base_model`; `/v1/models` lists it.
    #[arg(
        long,
        env = "TUNEQ_MODEL_ALIASES",
        value_name = "ALIAS=MODEL",
        value_delimiter = ','
    )]
    model_alias: Vec<String>,
    /// A place `POST /admin/models` may register models from (repeat, or
    /// comma-separated): an absolute folder (a model is taken only in it, its links
    /// resolved) or a store prefix (`s3://bucket/models`, `gs://bucket`). Unset: any
    /// location the admin key names. Models given with `--model` are the operator's own
    /// and are not held to it.
    #[arg(long, env = "TUNEQ_MODEL_ROOTS", value_delimiter = ',')]
    model_root: Vec<String>,
    /// The MLflow tracking server jobs may ask to be tracked in
    /// (`integrations: [{"type": "mlflow"}]`): its base URL, e.g. `http://mlflow:5000`.
    /// Each job gets a run in its tenant's experiment (`<tenant>/<name>`) with its
    /// parameters, every step's metrics and the adapter as artifacts. Unset: jobs that
    /// ask for tracking are refused.
    #[arg(long, env = "TUNEQ_MLFLOW_TRACKING_URI", value_name = "URL")]
    mlflow_tracking_uri: Option<String>,
    /// The token the tracking server wants, sent as `Authorization: Bearer …`.
    #[arg(long, env = "TUNEQ_MLFLOW_TRACKING_TOKEN", hide_env_values = true)]
    mlflow_tracking_token: Option<Secret>,
}

impl ApiPolicyArgs {
    /// `--model-alias`, read: alias → base model id. Whether each base model is
    /// registered is checked once the models are ([`super::check_aliases`]).
    pub fn model_aliases(&self) -> Result<std::collections::BTreeMap<String, String>> {
        let mut aliases = std::collections::BTreeMap::new();
        for text in &self.model_alias {
            let (alias, base) = super::pair::pair(text, "--model-alias")?;
            tuneq_queue::catalog::check_identifier("model", &alias)
                .map_err(|e| BadInput(format!("--model-alias {text}: {e}")))?;
            if aliases.insert(alias.clone(), base).is_some() {
                return Err(BadInput(format!("--model-alias: {alias} is given twice")).into());
            }
        }
        Ok(aliases)
    }

    /// `--mlflow-tracking-uri` and its token: an http(s) URL without credentials in it
    /// (the token goes in its own, secret, setting).
    pub fn mlflow(&self) -> Result<Option<tuneq_api::tracking::MlflowServer>> {
        let Some(text) = &self.mlflow_tracking_uri else {
            if self.mlflow_tracking_token.is_some() {
                return Err(BadInput(
                    "--mlflow-tracking-token is given without --mlflow-tracking-uri".into(),
                )
                .into());
            }
            return Ok(None);
        };
        let url = url::Url::parse(text)
            .map_err(|e| BadInput(format!("--mlflow-tracking-uri {text}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(BadInput(format!(
                "--mlflow-tracking-uri {text}: an http:// or https:// URL of the tracking server is needed"
            ))
            .into());
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(BadInput(
                "--mlflow-tracking-uri must not carry credentials: give the token with --mlflow-tracking-token (TUNEQ_MLFLOW_TRACKING_TOKEN)".into(),
            )
            .into());
        }
        Ok(Some(tuneq_api::tracking::MlflowServer {
            url,
            token: self
                .mlflow_tracking_token
                .as_ref()
                .map(|t| t.expose().to_string()),
        }))
    }

    /// The API's settings these flags decide; the rest are the defaults.
    pub fn api_config(&self) -> Result<tuneq_api::ApiConfig> {
        Ok(tuneq_api::ApiConfig {
            max_upload_bytes: self.max_upload_bytes(),
            default_limits: self.default_limits(),
            webhooks: self.webhooks(),
            holds: self.holds()?,
            admin_key_hash: self.admin_key_hash()?,
            model_aliases: self.model_aliases()?,
            model_roots: tuneq_api::model_roots::ModelRoots::parse(&self.model_root)
                .map_err(|e| BadInput(e.to_string()))?,
            mlflow: self.mlflow()?,
            ..tuneq_api::ApiConfig::default()
        })
    }

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
