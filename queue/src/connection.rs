//! Opening a queue: connecting to a redis-server, a Redis Cluster or the embedded file
//! for one scheduling domain, storing the domain's server-side settings, and opening
//! further queues (another domain, another connection) like an open one.

use crate::backend::{Backend, Origin};
use crate::domain::Domain;
use crate::scripted::Queue;
use crate::scripts::Scripts;
use crate::{QueueConfig, Result};
use std::sync::Arc;

impl Queue {
    /// Connects to `url` (`redis://host:port/db`) for scheduling domain `domain` and
    /// stores `config`'s server-side settings (aging, retention) in the domain.
    pub async fn connect(url: &str, domain: &str, config: QueueConfig) -> Result<Self> {
        Domain::check(domain)?;
        let origin = Origin::Redis {
            url: url.to_string(),
            response_timeout_ms: config.response_timeout_ms,
        };
        let backend = origin.connect().await?;
        Self::with_backend(backend, Arc::new(origin), domain, config).await
    }

    /// Connects to a Redis Cluster through any of its nodes `urls` (`redis://host:port`;
    /// the client discovers the rest) for scheduling domain `domain`, and stores `config`'s
    /// server-side settings in the domain. All of a domain's keys carry the hash tag
    /// `{domain}`, so the whole domain lives in one slot: its scripts run atomically on
    /// the node owning that slot, and domains spread over the nodes by their names.
    ///
    /// The cluster client itself re-sends a call after a redirect (MOVED, ASK), TRYAGAIN,
    /// a lost connection or a timeout, so a call may run twice even before this queue's
    /// own retries ([`crate::JobQueue`]'s rules on unknown outcomes). Fenced calls
    /// recognise their own earlier run; only an enqueue without an idempotency key could
    /// be accepted twice, so on a Cluster always send one.
    pub async fn connect_cluster(
        urls: &[impl AsRef<str>],
        domain: &str,
        config: QueueConfig,
    ) -> Result<Self> {
        Domain::check(domain)?;
        let origin = Origin::Cluster {
            urls: urls.iter().map(|u| u.as_ref().to_string()).collect(),
            response_timeout_ms: config.response_timeout_ms,
        };
        let backend = origin.connect().await?;
        Self::with_backend(backend, Arc::new(origin), domain, config).await
    }

    /// Opens (or creates) the embedded queue file at `path` for scheduling domain
    /// `domain`: no server, every acknowledged change synced to the file, and a restart
    /// replays it. Only one process may have the file open.
    pub async fn open_embedded(
        path: &std::path::Path,
        domain: &str,
        config: QueueConfig,
    ) -> Result<Self> {
        Domain::check(domain)?;
        let backend = Backend::open_embedded(path).await?;
        Self::with_backend(backend, Arc::new(Origin::Embedded), domain, config).await
    }

    async fn with_backend(
        backend: Backend,
        origin: Arc<Origin>,
        domain: &str,
        config: QueueConfig,
    ) -> Result<Self> {
        let domain = Domain::new(backend, domain, config.unknown_outcome_retries)?;
        if let Backend::Embedded(store) = &domain.backend {
            // The clock's high-water mark moves on every call that reads the time;
            // alone, that is no reason to sync the file (see Store::defer_field).
            store.defer_field(domain.meta().as_bytes(), b"clock");
        }
        let queue = Self {
            domain,
            origin,
            figures: Arc::default(),
            scripts: Scripts::get(),
            config,
        };
        queue.store_settings().await?;
        queue.domain.backend.preload(&queue.scripts.library).await?;
        Ok(queue)
    }

    /// Another scheduling domain on the same backend (same server, same Cluster, or same
    /// file).
    pub async fn domain_queue(&self, domain: &str, config: QueueConfig) -> Result<Self> {
        Self::with_backend(
            self.domain.backend.clone(),
            Arc::clone(&self.origin),
            domain,
            config,
        )
        .await
    }

    /// The same domain over a connection of its own, driven by the async runtime this is
    /// called on. A server whose workers each run a single-threaded runtime (actix-web)
    /// gives each worker one, so no call has to wake a thread of another runtime and
    /// wait for it to answer. The embedded store is in process: it is shared as is.
    pub async fn with_own_connection(&self) -> Result<Self> {
        let backend = match &*self.origin {
            Origin::Embedded => self.domain.backend.clone(),
            origin => origin.connect().await?,
        };
        Ok(Self {
            domain: self.domain.on(backend),
            ..self.clone()
        })
    }

    /// Stores `config`'s server-side settings (aging, retention, events kept) in the
    /// domain's meta hash, where the scripts read them.
    async fn store_settings(&self) -> Result<()> {
        let c = &self.config;
        let mut cmd = redis::cmd("HSET");
        cmd.arg(self.domain.meta())
            .arg("aging_horizon_ms")
            .arg(c.aging_horizon_ms)
            .arg("retention_ms")
            .arg(c.retention_ms)
            .arg("retention_count")
            .arg(c.retention_count)
            .arg("max_events_per_job")
            .arg(c.max_events_per_job);
        self.domain.query(&cmd).await
    }
}
