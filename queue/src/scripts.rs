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

/// The codes the scripts store, generated from their one declaration: `KIND` (event
/// kinds), `STOP` (who stopped an attempt) and `FAILURE` (failure classes), each a
/// table from code to code. A script names a code as `KIND.preempted`; one this build
/// does not declare is nil there, and the test below refuses it before it can run.
fn vocabulary() -> String {
    fn table(name: &str, codes: impl Iterator<Item = &'static str>) -> String {
        let members: Vec<String> = codes.map(|c| format!("['{c}'] = '{c}'")).collect();
        format!("local {name} = {{{}}}\n", members.join(", "))
    }
    use tuneq_openapi::{EventKind, FailureClass, StopCause};
    table("KIND", EventKind::ALL.iter().map(|k| k.code()))
        + &table("STOP", StopCause::ALL.iter().map(|c| c.code()))
        + &table("FAILURE", FailureClass::ALL.iter().map(|c| c.code()))
}

/// Every script: its name and its body.
const SOURCES: [(&str, &str); 18] = [
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
    ("pause", include_str!("../lua/pause.lua")),
    ("resume", include_str!("../lua/resume.lua")),
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
    pub(crate) pause: LuaScript,
    pub(crate) resume: LuaScript,
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
            let prelude = format!("{}\n{PRELUDE}", vocabulary());
            let library = Arc::new(Library::new(&prelude, &SOURCES));
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
                pause: script("pause"),
                resume: script("resume"),
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

#[cfg(test)]
mod tests {
    use super::*;
    use tuneq_openapi::{EventKind, FailureClass, StopCause};

    /// Every script with its file name, the prelude included.
    fn all_sources() -> Vec<(&'static str, &'static str)> {
        let mut all = vec![("prelude", PRELUDE)];
        all.extend(SOURCES);
        all
    }

    /// The names a script takes from the generated table `table` (`TABLE.name`).
    fn uses<'a>(source: &'a str, table: &str) -> Vec<&'a str> {
        let prefix = format!("{table}.");
        let mut found = Vec::new();
        let mut rest = source;
        while let Some(at) = rest.find(&prefix) {
            let before = rest[..at].chars().next_back();
            let after = &rest[at + prefix.len()..];
            let name_len = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                found.push(&after[..name_len]);
            }
            rest = &after[name_len..];
        }
        found
    }

    #[test]
    fn every_code_a_script_names_is_declared_once_in_rust() {
        for (file, source) in all_sources() {
            for name in uses(source, "KIND") {
                assert!(
                    EventKind::parse(name).is_some(),
                    "{file}.lua: KIND.{name} is not an EventKind"
                );
            }
            for name in uses(source, "STOP") {
                assert!(
                    StopCause::parse(name).is_some(),
                    "{file}.lua: STOP.{name} is not a StopCause"
                );
            }
            for name in uses(source, "FAILURE") {
                assert!(
                    FailureClass::parse(name).is_some(),
                    "{file}.lua: FAILURE.{name} is not a FailureClass"
                );
            }
        }
    }

    #[test]
    fn every_kind_the_queue_writes_is_written_by_a_script_and_no_other() {
        let written: Vec<&str> = all_sources()
            .into_iter()
            .flat_map(|(_, source)| uses(source, "KIND"))
            .collect();
        for kind in EventKind::ALL {
            assert_eq!(
                written.contains(&kind.code()),
                kind.is_written_by_queue(),
                "{kind:?}: written by a script? is_written_by_queue says otherwise"
            );
        }
    }

    #[test]
    fn no_script_writes_an_event_kind_as_a_literal() {
        for (file, source) in all_sources() {
            for line in source.lines() {
                let call = ["event(", "event_json("]
                    .iter()
                    .find_map(|f| line.find(f).map(|at| &line[at..]));
                let Some(call) = call else { continue };
                // The kind is the third argument of both.
                let kind = call.split(',').nth(2).map(str::trim).unwrap_or_default();
                assert!(
                    !kind.starts_with('\'') && !kind.starts_with('"'),
                    "{file}.lua writes an event kind as a literal: {line}"
                );
            }
        }
    }

    #[test]
    fn the_generated_tables_hold_every_code() {
        let vocabulary = vocabulary();
        for kind in EventKind::ALL {
            assert!(vocabulary.contains(&format!("['{0}'] = '{0}'", kind.code())));
        }
        assert!(vocabulary.starts_with("local KIND = {"));
    }
}
