//! Where the queue's keys live: a Redis server (or Cluster slot), or the embedded
//! single-file store. Both take the same commands and scripts and answer with the same
//! reply shapes, so [`crate::Queue`] is written once.

use crate::embedded::{Store, StoreError};
use crate::{QueueError, Result};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, FromRedisValue, Pipeline, Value};
use std::sync::{Arc, RwLock};

/// The queue's Lua scripts as one Redis Functions library: `prelude.lua` once, then
/// each script's body as a registered function of `(KEYS, ARGV)`. Redis builds the
/// prelude's helpers once, when it loads the library, instead of on every call, as
/// `EVALSHA` of prelude + script would. The library's name carries a hash of its code,
/// so processes running different versions of the scripts never replace each other's.
/// The embedded store runs the same library in its own Lua.
pub(crate) struct Library {
    name: String,
    source: Arc<str>,
}

impl Library {
    /// The library of `scripts` (name, body), with `prelude` in front.
    pub(crate) fn new(prelude: &str, scripts: &[(&'static str, &str)]) -> Self {
        let mut code = format!("{prelude}\n");
        for (name, body) in scripts {
            code.push_str(&format!(
                "redis.register_function(LIBRARY .. '_{name}', function(KEYS, ARGV)\n\
                 begin_call(KEYS, ARGV)\n{body}\nend)\n"
            ));
        }
        let hash = redis::Script::new(&code).get_hash().to_string();
        let name = format!("tuneq_{}", &hash[..16]);
        let source = format!("#!lua name={name}\nlocal LIBRARY = '{name}'\n{code}");
        Self {
            name,
            source: source.into(),
        }
    }

    /// Loads the library into Redis (into every primary of a Cluster: the client sends
    /// `FUNCTION LOAD` to all of them). One that is there already is the same code.
    async fn load(&self, conn: &mut impl redis::aio::ConnectionLike) -> Result<()> {
        let loaded: redis::RedisResult<Value> = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(&*self.source)
            .query_async(conn)
            .await;
        match loaded {
            Err(e) if !e.detail().is_some_and(|d| d.contains("already exists")) => {
                Err(unavailable(e))
            }
            _ => Ok(()),
        }
    }
}

/// One of the queue's scripts: a function of the [`Library`].
pub(crate) struct LuaScript {
    name: &'static str,
    function: String,
    library: Arc<Library>,
}

impl LuaScript {
    /// The script's name (its file's), for logs.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// Script `name` of `library` (which must hold it).
    pub(crate) fn new(name: &'static str, library: &Arc<Library>) -> Self {
        Self {
            name,
            function: format!("{}_{name}", library.name),
            library: Arc::clone(library),
        }
    }

    /// Calls the function over a Redis connection with FCALL. A server that lacks the
    /// library (restarted without persistence, flushed, a new Cluster node) gets it
    /// loaded, and the call is made again: a missing function ran nothing.
    async fn send<T: FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
        key: &str,
        args: &[&str],
    ) -> Result<T> {
        let mut call = redis::cmd("FCALL");
        call.arg(&self.function).arg(1).arg(key).arg(args);
        match call.query_async(conn).await {
            Err(e)
                if e.detail()
                    .is_some_and(|d| d.starts_with("Function not found")) =>
            {
                self.library.load(conn).await?;
                call.query_async(conn).await.map_err(unavailable)
            }
            reply => reply.map_err(unavailable),
        }
    }
}

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

/// A Redis error as the queue sees it: a lost connection, a timeout or a server that
/// cannot answer yet is an unknown outcome ([`QueueError::Unavailable`], worth a retry
/// by whoever can retry safely); anything else is a definite refusal.
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
            .map_err(unavailable)?;
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
                    tracing::warn!(error = %why, "replaced the queue's Redis connection after an unknown outcome");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a new Redis connection; keeping the old one");
            }
        }
    }
}

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
            Backend::Redis(link) => {
                link.on(
                    |mut conn| async move { cmd.query_async(&mut conn).await.map_err(unavailable) },
                )
                .await
            }
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
            Backend::Redis(link) => {
                link.on(|mut conn| async move {
                    pipe.query_async(&mut conn).await.map_err(unavailable)
                })
                .await
            }
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
