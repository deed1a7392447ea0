//! Where the queue's keys live: a Redis server (or Cluster slot), or the embedded
//! single-file store. Both take the same commands and scripts and answer with the same
//! reply shapes, so [`crate::Queue`] is written once. [`Origin`] says how a backend was
//! reached, so another connection like it can be opened.

use crate::embedded::{Store, StoreError};
use crate::reply::parse;
use crate::scripts::{Library, LuaScript};
use crate::{QueueError, Result};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, FromRedisValue, Pipeline, Value};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// The connection to wherever the keys live.
#[derive(Clone)]
pub(crate) enum Backend {
    /// One redis-server.
    Redis(Arc<RedisLink>),
    /// A Redis Cluster. Every command, pipeline and script of a domain names keys with
    /// the domain's hash tag, so the client routes each one to the node that owns that
    /// one slot; only keyspace scans need an explicit route ([`Backend::scan_query`]).
    Cluster(ClusterConnection),
    /// The embedded single-file store.
    Embedded(Arc<Store>),
}

/// The connection to one redis-server, replaced after a call whose outcome is unknown.
///
/// The connection manager reconnects when its connection breaks, but a connection whose
/// replies stall without being cut (a half-open TCP connection, a blackholed route) stays
/// "up": every later call on it would time out too, until TCP gives up minutes later. So
/// a call that ends with an unknown outcome opens a new connection in place of the one it
/// used (once: calls that failed on an already replaced connection leave it be).
pub(crate) struct RedisLink {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// The connection in use, and how many times it has been replaced.
    current: RwLock<(u64, ConnectionManager)>,
}

impl RedisLink {
    /// Connects to `client`'s server.
    pub(crate) async fn connect(
        client: redis::Client,
        config: ConnectionManagerConfig,
    ) -> Result<Self> {
        let conn = ConnectionManager::new_with_config(client.clone(), config.clone())
            .await
            .map_err(QueueError::from_redis)?;
        Ok(Self {
            client,
            config,
            current: RwLock::new((0, conn)),
        })
    }

    /// The connection in use, and its generation.
    pub(crate) fn get(&self) -> (u64, ConnectionManager) {
        let current = self.current.read().unwrap_or_else(|e| e.into_inner());
        (current.0, current.1.clone())
    }

    /// Runs `call` on the connection in use; replaces that connection if the outcome is
    /// unknown.
    async fn on<T, F, Fut>(&self, call: F) -> Result<T>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let (generation, conn) = self.get();
        let outcome = call(conn).await;
        if let Err(e) = &outcome
            && e.is_retryable()
        {
            self.replace(generation, e).await;
        }
        outcome
    }

    /// Opens a new connection in place of generation `generation`, unless another call
    /// has already replaced it.
    async fn replace(&self, generation: u64, why: &QueueError) {
        if self.get().0 != generation {
            return;
        }
        match ConnectionManager::new_with_config(self.client.clone(), self.config.clone()).await {
            Ok(fresh) => {
                let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
                if current.0 == generation {
                    *current = (generation + 1, fresh);
                    tracing::warn!(
                        error = why as &dyn std::error::Error,
                        "replaced the queue's Redis connection after an unknown outcome"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a new Redis connection; keeping the old one");
            }
        }
    }
}

fn command_args(cmd: &Cmd) -> Result<Vec<Vec<u8>>> {
    cmd.args_iter()
        .map(|a| match a {
            redis::Arg::Simple(bytes) => Ok(bytes.to_vec()),
            _ => Err(QueueError::Protocol(
                "cursor arguments are not supported by the embedded store".into(),
            )),
        })
        .collect()
}

impl Backend {
    /// Runs `work` on the embedded store off the async threads (it syncs a file).
    async fn on_store<T: Send + 'static>(
        store: &Arc<Store>,
        work: impl FnOnce(&Store) -> std::result::Result<T, StoreError> + Send + 'static,
    ) -> Result<T> {
        let store = Arc::clone(store);
        tokio::task::spawn_blocking(move || work(&store))
            .await
            .map_err(|e| QueueError::Unavailable(e.into()))?
            .map_err(QueueError::from_store)
    }

    /// Sends one command.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T> {
        match self {
            Backend::Redis(link) => {
                link.on(|mut conn| async move {
                    cmd.query_async(&mut conn)
                        .await
                        .map_err(QueueError::from_redis)
                })
                .await
            }
            Backend::Cluster(conn) => cmd
                .query_async(&mut conn.clone())
                .await
                .map_err(QueueError::from_redis),
            Backend::Embedded(store) => {
                let command = command_args(cmd)?;
                let mut replies = Self::on_store(store, move |s| s.execute(&[command])).await?;
                parse(replies.pop().unwrap_or(Value::Nil))
            }
        }
    }

    /// Sends a command that reads the keyspace (`KEYS`, `SCAN`) for keys of `key`'s slot.
    /// Each Cluster node sees only its own keys, and the client would send `KEYS` to every
    /// primary and `SCAN` to a random node, so on a Cluster it goes to the primary that owns
    /// `key`'s slot (a domain's keys all share it). Elsewhere it is [`Backend::query`].
    pub(crate) async fn scan_query<T: FromRedisValue>(&self, cmd: &Cmd, key: &str) -> Result<T> {
        match self {
            Backend::Cluster(conn) => {
                let route = Route::with_key(key, SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                let reply = conn
                    .clone()
                    .route_command(cmd.clone(), routing)
                    .await
                    .map_err(QueueError::from_redis)?;
                parse(reply)
            }
            Backend::Redis(_) | Backend::Embedded(_) => self.query(cmd).await,
        }
    }

    /// Sends a pipeline; an atomic one runs as one unit on both backends.
    pub(crate) async fn pipeline<T: FromRedisValue>(&self, pipe: &Pipeline) -> Result<T> {
        match self {
            Backend::Redis(link) => {
                link.on(|mut conn| async move {
                    pipe.query_async(&mut conn)
                        .await
                        .map_err(QueueError::from_redis)
                })
                .await
            }
            Backend::Cluster(conn) => pipe
                .query_async(&mut conn.clone())
                .await
                .map_err(QueueError::from_redis),
            Backend::Embedded(store) => {
                let commands = pipe
                    .cmd_iter()
                    .map(command_args)
                    .collect::<Result<Vec<_>>>()?;
                let replies = Self::on_store(store, move |s| s.execute(&commands)).await?;
                parse(Value::Array(replies))
            }
        }
    }

    /// Loads the scripts' library into Redis, so that the first calls do not each find
    /// it missing (nothing to do for the embedded store, which loads it on first use).
    pub(crate) async fn preload(&self, library: &Library) -> Result<()> {
        match self {
            Backend::Redis(link) => library.load(&mut link.get().1).await,
            Backend::Cluster(conn) => library.load(&mut conn.clone()).await,
            Backend::Embedded(_) => Ok(()),
        }
    }

    /// Runs `script` with one key and `args`.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        script: &LuaScript,
        key: &str,
        args: &[&str],
    ) -> Result<T> {
        match self {
            Backend::Redis(link) => {
                link.on(|mut conn| async move { script.send(&mut conn, key, args).await })
                    .await
            }
            // FCALL is routed by its one key (the meta key with the domain's hash tag);
            // a FUNCTION LOAD goes to every primary.
            Backend::Cluster(conn) => script.send(&mut conn.clone(), key, args).await,
            Backend::Embedded(store) => {
                let library = Arc::clone(&script.library);
                let function = script.function.clone();
                let keys = vec![key.as_bytes().to_vec()];
                let args: Vec<Vec<u8>> = args.iter().map(|a| a.as_bytes().to_vec()).collect();
                let reply = Self::on_store(store, move |s| {
                    s.fcall(&library.name, &library.source, &function, &keys, &args)
                })
                .await?;
                parse(reply)
            }
        }
    }
}

/// Where a queue's backend is, and how to connect to it again.
pub(crate) enum Origin {
    /// One redis-server.
    Redis {
        /// Its URL.
        url: String,
        /// How long to wait for an answer (ms).
        response_timeout_ms: u64,
    },
    /// A Redis Cluster.
    Cluster {
        /// Seed nodes' URLs.
        urls: Vec<String>,
        /// How long to wait for an answer (ms).
        response_timeout_ms: u64,
    },
    /// The embedded file, shared in process as it is.
    Embedded,
}

impl Origin {
    /// Opens a connection to the server or Cluster.
    pub(crate) async fn connect(&self) -> Result<Backend> {
        match self {
            Origin::Redis {
                url,
                response_timeout_ms,
            } => {
                let client =
                    redis::Client::open(url.as_str()).map_err(|e| QueueError::Invalid {
                        field: "redis_url",
                        message: e.to_string(),
                    })?;
                let manager_config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(5)))
                    .set_response_timeout(Some(Duration::from_millis(*response_timeout_ms)));
                let link = RedisLink::connect(client, manager_config).await?;
                Ok(Backend::Redis(Arc::new(link)))
            }
            Origin::Cluster {
                urls,
                response_timeout_ms,
            } => {
                let client =
                    redis::cluster::ClusterClient::builder(urls.iter().map(String::as_str))
                        .connection_timeout(Duration::from_secs(5))
                        .response_timeout(Duration::from_millis(*response_timeout_ms))
                        .build()
                        .map_err(|e| QueueError::Invalid {
                            field: "redis_url",
                            message: e.to_string(),
                        })?;
                let conn = client
                    .get_async_connection()
                    .await
                    .map_err(QueueError::from_redis)?;
                Ok(Backend::Cluster(conn))
            }
            Origin::Embedded => Err(QueueError::Invalid {
                field: "backend",
                message: "the embedded store has no connections to open".into(),
            }),
        }
    }
}

impl Backend {
    /// Opens (or creates) the embedded store at `path`, off the async threads (it reads
    /// and may rewrite the file).
    pub(crate) async fn open_embedded(path: &Path) -> Result<Self> {
        let path = path.to_path_buf();
        let store = tokio::task::spawn_blocking(move || Store::open(&path))
            .await
            .map_err(|e| QueueError::Unavailable(e.into()))?
            .map_err(QueueError::from_store)?;
        Ok(Backend::Embedded(Arc::new(store)))
    }
}
