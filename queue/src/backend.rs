//! Where the queue's keys live: a Redis server (or Cluster slot), or the embedded
//! single-file store. Both take the same commands and scripts and answer with the same
//! reply shapes, so [`crate::Queue`] is written once.

use crate::embedded::{Store, StoreError};
use crate::{QueueError, Result};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, FromRedisValue, Pipeline, Value};
use std::sync::Arc;

/// One of the queue's Lua scripts: its source (for the embedded engine) and the
/// `redis::Script` that sends it with EVALSHA (reloading it on NOSCRIPT).
pub(crate) struct LuaScript {
    name: &'static str,
    source: Arc<str>,
    script: redis::Script,
}

impl LuaScript {
    /// The script's name (its file's), for logs.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn new(name: &'static str, source: String) -> Self {
        let script = redis::Script::new(&source);
        Self {
            name,
            source: source.into(),
            script,
        }
    }

    /// Sends the script with EVALSHA over a Redis connection, loading it on NOSCRIPT.
    async fn send<T: FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
        key: &str,
        args: &[&str],
    ) -> Result<T> {
        let mut invocation = self.script.key(key);
        for a in args {
            invocation.arg(*a);
        }
        invocation.invoke_async(conn).await.map_err(unavailable)
    }
}

/// The connection to wherever the keys live.
#[derive(Clone)]
pub(crate) enum Backend {
    /// One redis-server.
    Redis(ConnectionManager),
    /// A Redis Cluster. Every command, pipeline and script of a domain names keys with
    /// the domain's hash tag, so the client routes each one to the node that owns that
    /// one slot; only keyspace scans need an explicit route ([`Backend::scan_query`]).
    Cluster(ClusterConnection),
    /// The embedded single-file store.
    Embedded(Arc<Store>),
}

/// A Redis error as the queue sees it: a lost connection, a timeout or a server that
/// cannot answer yet is an unknown outcome ([`QueueError::Unavailable`], worth a retry
/// by whoever can retry safely); anything else is a definite refusal.
pub(crate) fn unavailable(e: redis::RedisError) -> QueueError {
    match e.retry_method() {
        redis::RetryMethod::NoRetry => QueueError::Protocol(e.to_string()),
        _ => QueueError::Unavailable(e.to_string()),
    }
}

fn store_error(e: StoreError) -> QueueError {
    match e {
        StoreError::Command(message) => QueueError::Protocol(message),
        other => QueueError::Unavailable(other.to_string()),
    }
}

fn parse<T: FromRedisValue>(value: Value) -> Result<T> {
    T::from_redis_value(value).map_err(|e| QueueError::Protocol(e.to_string()))
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
            .map_err(|e| QueueError::Unavailable(format!("embedded store task: {e}")))?
            .map_err(store_error)
    }

    /// Sends one command.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T> {
        match self {
            Backend::Redis(conn) => cmd
                .query_async(&mut conn.clone())
                .await
                .map_err(unavailable),
            Backend::Cluster(conn) => cmd
                .query_async(&mut conn.clone())
                .await
                .map_err(unavailable),
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
                    .map_err(unavailable)?;
                parse(reply)
            }
            Backend::Redis(_) | Backend::Embedded(_) => self.query(cmd).await,
        }
    }

    /// Sends a pipeline; an atomic one runs as one unit on both backends.
    pub(crate) async fn pipeline<T: FromRedisValue>(&self, pipe: &Pipeline) -> Result<T> {
        match self {
            Backend::Redis(conn) => pipe
                .query_async(&mut conn.clone())
                .await
                .map_err(unavailable),
            Backend::Cluster(conn) => pipe
                .query_async(&mut conn.clone())
                .await
                .map_err(unavailable),
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

    /// Loads `scripts` into Redis's script cache, so their first use does not pay a
    /// NOSCRIPT round trip (nothing to do for the embedded store, which compiles on use).
    pub(crate) async fn preload(&self, scripts: &[&LuaScript]) -> Result<()> {
        if let Backend::Redis(conn) = self {
            for s in scripts {
                s.script
                    .load_async(&mut conn.clone())
                    .await
                    .map_err(unavailable)?;
            }
        }
        Ok(())
    }

    /// Runs `script` with one key and `args`.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        script: &LuaScript,
        key: &str,
        args: &[&str],
    ) -> Result<T> {
        match self {
            Backend::Redis(conn) => script.send(&mut conn.clone(), key, args).await,
            // EVALSHA is routed by its one key (the meta key with the domain's hash tag);
            // a NOSCRIPT reload (SCRIPT LOAD) goes to every primary.
            Backend::Cluster(conn) => script.send(&mut conn.clone(), key, args).await,
            Backend::Embedded(store) => {
                let sha = script.script.get_hash().to_string();
                let source = Arc::clone(&script.source);
                let keys = vec![key.as_bytes().to_vec()];
                let args: Vec<Vec<u8>> = args.iter().map(|a| a.as_bytes().to_vec()).collect();
                let reply =
                    Self::on_store(store, move |s| s.eval(&sha, &source, &keys, &args)).await?;
                parse(reply)
            }
        }
    }
}
