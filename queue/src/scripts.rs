//! The queue's Lua scripts (`queue/lua/*.lua`) and how they are loaded: one Redis
//! Functions library with `prelude.lua` on top, built once per process, called with
//! FCALL on Redis (loaded again where it is missing) and run by the embedded store's
//! own Lua.

use crate::{QueueError, Result};
use redis::{FromRedisValue, Value};
use std::sync::{Arc, OnceLock};

/// The queue's Lua scripts as one Redis Functions library: `prelude.lua` once, then
/// each script's body as a registered function of `(KEYS, ARGV)`. Redis builds the
/// prelude's helpers once, when it loads the library, instead of on every call, as
/// `EVALSHA` of prelude + script would. The library's name carries a hash of its code,
/// so processes running different versions of the scripts never replace each other's.
/// The embedded store runs the same library in its own Lua.
pub(crate) struct Library {
    /// Its name (`tuneq_` and a hash of its code).
    pub(crate) name: String,
    /// Its code, as `FUNCTION LOAD` takes it.
    pub(crate) source: Arc<str>,
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
    pub(crate) async fn load(&self, conn: &mut impl redis::aio::ConnectionLike) -> Result<()> {
        let loaded: redis::RedisResult<Value> = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(&*self.source)
            .query_async(conn)
            .await;
        match loaded {
            Err(e) if !e.detail().is_some_and(|d| d.contains("already exists")) => {
                Err(QueueError::from_redis(e))
            }
            _ => Ok(()),
        }
    }
}

/// One of the queue's scripts: a function of the [`Library`].
pub(crate) struct LuaScript {
    name: &'static str,
    /// The function's name in the library.
    pub(crate) function: String,
    /// The library that holds it.
    pub(crate) library: Arc<Library>,
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
    pub(crate) async fn send<T: FromRedisValue>(
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
                call.query_async(conn).await.map_err(QueueError::from_redis)
            }
            reply => reply.map_err(QueueError::from_redis),
        }
    }
}

/// The helpers every script shares.
const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// Every script: its name and its body.
const SOURCES: [(&str, &str); 16] = [
    ("enqueue", include_str!("../lua/enqueue.lua")),
    ("enqueue_bulk", include_str!("../lua/enqueue_bulk.lua")),
    ("claim", include_str!("../lua/claim.lua")),
    ("start", include_str!("../lua/start.lua")),
    ("heartbeat", include_str!("../lua/heartbeat.lua")),
    ("complete", include_str!("../lua/complete.lua")),
    (
        "complete_and_claim",
        include_str!("../lua/complete_and_claim.lua"),
    ),
    ("fail", include_str!("../lua/fail.lua")),
    ("preempt", include_str!("../lua/preempt.lua")),
    ("cancel", include_str!("../lua/cancel.lua")),
    (
        "confirm_cancelled",
        include_str!("../lua/confirm_cancelled.lua"),
    ),
    ("expire_leases", include_str!("../lua/expire_leases.lua")),
    (
        "resolve_suspect",
        include_str!("../lua/resolve_suspect.lua"),
    ),
    ("trim", include_str!("../lua/trim.lua")),
    ("outbox", include_str!("../lua/outbox.lua")),
    ("catalog", include_str!("../lua/catalog.lua")),
];

/// The scripts, each a function of one library (built once per process).
pub(crate) struct Scripts {
    pub(crate) library: Arc<Library>,
    pub(crate) enqueue: LuaScript,
    pub(crate) enqueue_bulk: LuaScript,
    pub(crate) claim: LuaScript,
    pub(crate) start: LuaScript,
    pub(crate) heartbeat: LuaScript,
    pub(crate) complete: LuaScript,
    pub(crate) complete_and_claim: LuaScript,
    pub(crate) fail: LuaScript,
    pub(crate) preempt: LuaScript,
    pub(crate) cancel: LuaScript,
    pub(crate) confirm_cancelled: LuaScript,
    pub(crate) expire_leases: LuaScript,
    pub(crate) resolve_suspect: LuaScript,
    pub(crate) trim: LuaScript,
    pub(crate) outbox: LuaScript,
    pub(crate) catalog: LuaScript,
}

impl Scripts {
    /// The scripts, built once per process.
    pub(crate) fn get() -> Arc<Self> {
        static SCRIPTS: OnceLock<Arc<Scripts>> = OnceLock::new();
        Arc::clone(SCRIPTS.get_or_init(|| {
            let library = Arc::new(Library::new(PRELUDE, &SOURCES));
            let script = |name| LuaScript::new(name, &library);
            Arc::new(Self {
                enqueue: script("enqueue"),
                enqueue_bulk: script("enqueue_bulk"),
                claim: script("claim"),
                start: script("start"),
                heartbeat: script("heartbeat"),
                complete: script("complete"),
                complete_and_claim: script("complete_and_claim"),
                fail: script("fail"),
                preempt: script("preempt"),
                cancel: script("cancel"),
                confirm_cancelled: script("confirm_cancelled"),
                expire_leases: script("expire_leases"),
                resolve_suspect: script("resolve_suspect"),
                trim: script("trim"),
                outbox: script("outbox"),
                catalog: script("catalog"),
                library,
            })
        }))
    }
}
