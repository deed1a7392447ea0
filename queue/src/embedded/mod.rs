//! The embedded backend: the queue in one durable file, for `tuneq up` and tests, with
//! no server to run.
//!
//! It runs the *same* Lua scripts as Redis, in an embedded Lua 5.1 (the version Redis
//! embeds) against an in-memory keyspace (`db`) that answers the commands the
//! scripts use with Redis's reply shapes. The transition logic therefore exists once,
//! and one conformance suite checks both backends.
//!
//! Durability is by an append-only log of *effects* (`log`): every operation's
//! changes are written as one record and synced before the operation is acknowledged;
//! opening the file replays them. Operations run one at a time, as on Redis. An
//! operation that changed nothing writes nothing, and neither does one that only moved
//! a high-water mark such as the queue clock (see [`Store::defer_field`]): an idle
//! queue does not sync its file. A damaged file is refused rather than cut short;
//! [`repair`] keeps what is intact.

mod db;
mod log;

pub use db::Db;
#[cfg(feature = "testing")]
pub use log::CompactionCrash;
pub use log::{COMPACT_AT_BYTES, DroppedRange, LogError, RepairReport, repair};

use db::{Command, CommandError, format_score};
use log::Log;
use mlua::{Function, Lua, LuaOptions, StdLib, Table, Variadic};
use redis::Value;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a store whose append failed tries to go back to what its file holds (see
/// [`StoreError::Broken`]): each try reads the whole file again, so not on every call.
pub const RECOVERY_EVERY: Duration = Duration::from_secs(1);

/// Why an embedded operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The file could not be opened, read or written.
    #[error(transparent)]
    Log(Arc<LogError>),
    /// A command or script was refused (its error reply).
    #[error("{0}")]
    Command(String),
    /// An earlier write to the file failed, so memory was ahead of the disk. After a
    /// failed append (a full disk) the store goes back to what the file holds by itself
    /// at most every [`RECOVERY_EVERY`], and answers this until it could; after a failed
    /// compaction it refuses everything until it is reopened (which replays the file).
    #[error("queue file {path} failed earlier and is not usable yet")]
    Broken {
        /// The file.
        path: PathBuf,
        /// The first failure.
        #[source]
        cause: Arc<LogError>,
    },
    /// The embedded Lua engine failed.
    #[error("embedded Lua failed")]
    Lua(#[source] mlua::Error),
}

impl From<LogError> for StoreError {
    fn from(e: LogError) -> Self {
        StoreError::Log(Arc::new(e))
    }
}

impl From<CommandError> for StoreError {
    fn from(e: CommandError) -> Self {
        StoreError::Command(e.0)
    }
}

fn lua_error(e: mlua::Error) -> StoreError {
    StoreError::Lua(e)
}

/// A store whose memory went ahead of its file.
struct Broken {
    /// The write that failed.
    cause: Arc<LogError>,
    /// Whether rewinding to the file's last whole record makes memory and file agree
    /// again (a failed append); not after a failed compaction, whose file is unknown.
    recoverable: bool,
    /// When memory was last found ahead (the failure, or the last try to recover).
    since: Instant,
}

/// The keyspace, the Lua engine that scripts it, and the file that keeps it.
pub struct Store {
    path: PathBuf,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// Owns the keyspace (as app data), so `redis.call` inside a script reaches it.
    lua: Lua,
    /// Compiled scripts by their SHA-1 (the name EVALSHA uses).
    compiled: HashMap<String, Function>,
    /// The Functions libraries loaded so far, by name.
    libraries: HashSet<String>,
    log: Log,
    broken: Option<Broken>,
    /// Hash fields whose writes alone do not need a record (see [`Store::defer_field`]).
    deferrable: HashSet<(Vec<u8>, Vec<u8>)>,
    /// Their latest writes not yet in the file, one HSET each, in first-written order:
    /// written at the head of the next record.
    deferred: Vec<Command>,
}

impl Store {
    /// Opens (or creates) the store at `path`, replaying what it holds. A record torn
    /// by a crash mid-write (never acknowledged) is dropped, its bytes copied aside;
    /// damage to acknowledged records is refused ([`LogError::Corrupt`]).
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let opened = Log::open(path)?;
        let mut keyspace = Db::default();
        for (n, batch) in opened.batches.iter().enumerate() {
            for command in batch {
                keyspace.execute(command).map_err(|e| {
                    StoreError::Command(format!(
                        "queue file {} record {n} does not replay: {e}",
                        path.display()
                    ))
                })?;
            }
        }
        keyspace.clear_changes();
        let lua = scripting_engine().map_err(lua_error)?;
        lua.set_app_data(keyspace);
        tracing::debug!(
            path = %path.display(),
            records = opened.batches.len(),
            torn_bytes_cut = opened.truncated_bytes,
            torn_copy = ?opened.torn_copy,
            migrated = opened.migrated,
            "queue file opened"
        );
        Ok(Self {
            path: path.to_path_buf(),
            inner: Mutex::new(Inner {
                lua,
                compiled: HashMap::new(),
                libraries: HashSet::new(),
                log: opened.log,
                broken: None,
                deferrable: HashSet::new(),
                deferred: Vec::new(),
            }),
        })
    }

    /// Declares hash field `field` of `key` a high-water mark (the queue clock): an
    /// operation whose only change is writing it is not written to the file on its
    /// own, but at the head of the next record that has other changes (or when the
    /// store is dropped). Losing such a write to a crash loses nothing acknowledged:
    /// every durable change is written in the same record as the mark's value it was
    /// made under, so after a restart the mark is at least as high as anything stored.
    /// Without this, every periodic call that reads the clock (a dispatcher's claim
    /// and lease check twice a second, the webhook sender's poll) synced the file.
    pub fn defer_field(&self, key: &[u8], field: &[u8]) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.deferrable.insert((key.to_vec(), field.to_vec()));
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `step` on the locked store and commits what it wrote, whatever it answered.
    fn committed<T>(
        &self,
        step: impl FnOnce(&mut Inner) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut inner = self.lock()?;
        let outcome = step(&mut inner);
        inner.commit()?;
        outcome
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>, StoreError> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(broken) = &inner.broken else {
            return Ok(inner);
        };
        if broken.recoverable && broken.since.elapsed() >= RECOVERY_EVERY {
            match inner.recover() {
                Ok(()) => return Ok(inner),
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "queue file: cannot go back to its last whole record yet");
                    if let Some(broken) = &mut inner.broken {
                        broken.since = Instant::now();
                    }
                }
            }
        }
        match &inner.broken {
            Some(broken) => Err(StoreError::Broken {
                path: self.path.clone(),
                cause: Arc::clone(&broken.cause),
            }),
            None => Ok(inner),
        }
    }

    /// Why the store refuses calls now, if it does: the write that failed (see
    /// [`StoreError::Broken`]), and whether the store recovers by itself.
    pub fn failure(&self) -> Option<(Arc<LogError>, bool)> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner
            .broken
            .as_ref()
            .map(|b| (Arc::clone(&b.cause), b.recoverable))
    }

    /// Runs `commands` as one atomic unit (like MULTI/EXEC) and returns their replies.
    /// The first refused command ends the unit with its error; what ran before it is
    /// kept, as on Redis.
    pub fn execute(&self, commands: &[Command]) -> Result<Vec<Value>, StoreError> {
        let mut inner = self.lock()?;
        let outcome = {
            let mut keyspace = keyspace(&inner.lua)?;
            commands
                .iter()
                .map(|c| keyspace.execute(c))
                .collect::<Result<Vec<_>, CommandError>>()
        };
        inner.commit()?;
        Ok(outcome?)
    }

    /// Runs a script (`source`, known by its SHA-1 `sha`) with `keys` and `args`, as
    /// EVALSHA would, and returns its reply.
    pub fn eval(
        &self,
        sha: &str,
        source: &str,
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
    ) -> Result<Value, StoreError> {
        self.committed(|inner| inner.run_script(sha, source, keys, args))
    }

    /// Calls `function` of the Functions library `library` (whose code is `source`,
    /// loaded on first use) with `keys` and `args`, as FCALL would, and returns its
    /// reply.
    pub fn fcall(
        &self,
        library: &str,
        source: &str,
        function: &str,
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
    ) -> Result<Value, StoreError> {
        self.committed(|inner| {
            inner.load_library(library, source)?;
            inner.call_loaded(function, keys, args)
        })
    }
}

/// Test hooks (`testing` feature): compaction on demand, and crashes in the middle of it.
#[cfg(feature = "testing")]
impl Store {
    /// Compacts the file now, as the automatic trigger would.
    pub fn compact_now(&self) -> Result<(), StoreError> {
        self.lock()?.compact()
    }

    /// Makes the next `n` appends fail as on a full disk (ENOSPC), each after writing
    /// half of its record, as a write cut short by the disk filling up does.
    pub fn fail_next_appends(&self, n: u32) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.log.failing_appends = n;
    }

    /// Makes the next compaction stop at `at` as if the process had crashed there. Like
    /// any failed write it breaks the store, which must then be reopened (dropped and
    /// opened again from the file, as after a crash).
    pub fn crash_next_compaction(&self, at: CompactionCrash) -> Result<(), StoreError> {
        self.lock()?.log.crash = Some(at);
        Ok(())
    }
}

/// The keyspace, borrowed from the engine.
fn keyspace(lua: &Lua) -> Result<mlua::AppDataRefMut<'_, Db>, StoreError> {
    lua.app_data_mut::<Db>()
        .ok_or_else(|| StoreError::Lua(mlua::Error::RuntimeError("the keyspace is missing".into())))
}

impl Inner {
    fn run_script(
        &mut self,
        sha: &str,
        source: &str,
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
    ) -> Result<Value, StoreError> {
        let function = match self.compiled.get(sha) {
            Some(f) => f.clone(),
            None => {
                let f = self
                    .lua
                    .load(source)
                    .set_name(format!("@user_script:{sha}"))
                    .into_function()
                    .map_err(|e| StoreError::Command(format!("ERR compiling script: {e}")))?;
                self.compiled.insert(sha.to_string(), f.clone());
                f
            }
        };
        let globals = self.lua.globals();
        globals
            .set("KEYS", strings(&self.lua, keys).map_err(lua_error)?)
            .map_err(lua_error)?;
        globals
            .set("ARGV", strings(&self.lua, args).map_err(lua_error)?)
            .map_err(lua_error)?;
        let returned: mlua::Value = function
            .call(())
            .map_err(|e| StoreError::Command(format!("ERR script failed: {e}")))?;
        script_reply(&returned)
    }

    /// Loads the Functions library `library` (whose code is `source`) unless it is.
    fn load_library(&mut self, library: &str, source: &str) -> Result<(), StoreError> {
        if self.libraries.contains(library) {
            return Ok(());
        }
        // Redis reads the `#!lua name=…` line itself; to Lua it is a comment.
        let code = match source.starts_with("#!") {
            true => format!("--{source}"),
            false => source.to_string(),
        };
        self.lua
            .load(code)
            .set_name(format!("@user_function:{library}"))
            .exec()
            .map_err(|e| StoreError::Command(format!("ERR loading library: {e}")))?;
        self.libraries.insert(library.to_string());
        Ok(())
    }

    /// Calls `function` of a loaded library with `keys` and `args`.
    fn call_loaded(
        &mut self,
        function: &str,
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
    ) -> Result<Value, StoreError> {
        let registered: Table = self
            .lua
            .named_registry_value(FUNCTIONS)
            .map_err(lua_error)?;
        let Some(function) = registered
            .raw_get::<Option<Function>>(function)
            .map_err(lua_error)?
        else {
            return Err(StoreError::Command("ERR Function not found".into()));
        };
        let keys = strings(&self.lua, keys).map_err(lua_error)?;
        let args = strings(&self.lua, args).map_err(lua_error)?;
        let returned: mlua::Value = function
            .call((keys, args))
            .map_err(|e| StoreError::Command(format!("ERR function failed: {e}")))?;
        script_reply(&returned)
    }

    /// Writes what the last operation changed as one synced record; compacts the file
    /// when it has grown enough. A failed write breaks the store (see
    /// [`StoreError::Broken`]).
    fn commit(&mut self) -> Result<(), StoreError> {
        let changes = keyspace(&self.lua)?.take_changes();
        if changes.is_empty() {
            return Ok(());
        }
        if changes.iter().all(|c| self.is_deferrable(c)) {
            for change in changes {
                match self
                    .deferred
                    .iter_mut()
                    .find(|d| d.get(..3) == change.get(..3))
                {
                    Some(earlier) => *earlier = change,
                    None => self.deferred.push(change),
                }
            }
            return Ok(());
        }
        let mut changes = changes;
        if !self.deferred.is_empty() {
            changes.splice(0..0, std::mem::take(&mut self.deferred));
        }
        if let Err(e) = self.log.append(&changes) {
            return Err(self.break_on(e, true));
        }
        if self.log.wants_compaction() {
            self.compact()?;
        }
        Ok(())
    }

    /// Rewrites the file as the live keys (see [`Log::compact`]).
    fn compact(&mut self) -> Result<(), StoreError> {
        let span = tracing::info_span!(
            "queue.compaction",
            path = %self.log.path().display(),
            bytes_before = self.log.len(),
            bytes_after = tracing::field::Empty,
        );
        let _entered = span.enter();
        let snapshot = keyspace(&self.lua)?.dump();
        match self.log.compact(&snapshot) {
            Ok(done) => {
                span.record("bytes_after", self.log.len());
                if done {
                    tracing::info!("queue file compacted");
                }
                Ok(())
            }
            Err(e) => Err(self.break_on(e, false)),
        }
    }
}

impl Inner {
    /// Breaks the store on a failed write: memory is now ahead of the file.
    /// `recoverable`: a failed append, which [`Inner::recover`] undoes.
    fn break_on(&mut self, e: LogError, recoverable: bool) -> StoreError {
        let e = Arc::new(e);
        tracing::error!(path = %self.log.path().display(), error = %e, recoverable, "queue file write failed; calls are refused until memory and file agree again");
        self.broken = Some(Broken {
            cause: Arc::clone(&e),
            recoverable,
            since: Instant::now(),
        });
        StoreError::Log(e)
    }

    /// Makes memory what the file holds again after a failed append: the file is cut
    /// back to its last whole record and the keyspace rebuilt from its records, which
    /// drops the changes of the operation whose write failed (never acknowledged) and
    /// the deferred high-water marks (which, as after a restart, the records cover).
    fn recover(&mut self) -> Result<(), StoreError> {
        let batches = self.log.rewind()?;
        let mut keyspace = Db::default();
        for (n, batch) in batches.iter().enumerate() {
            for command in batch {
                keyspace.execute(command).map_err(|e| {
                    StoreError::Command(format!(
                        "queue file {} record {n} does not replay: {e}",
                        self.log.path().display()
                    ))
                })?;
            }
        }
        keyspace.clear_changes();
        self.lua.set_app_data(keyspace);
        self.deferred.clear();
        self.broken = None;
        tracing::warn!(path = %self.log.path().display(), records = batches.len(), "queue file writable again: memory is back to what the file holds");
        Ok(())
    }

    /// Whether `change` only sets one declared high-water mark field.
    fn is_deferrable(&self, change: &Command) -> bool {
        match change.as_slice() {
            [verb, key, field, _] => {
                verb.as_slice() == b"HSET"
                    && self.deferrable.contains(&(key.clone(), field.clone()))
            }
            _ => false,
        }
    }
}

impl Drop for Inner {
    /// Writes the deferred high-water marks, so an orderly shutdown keeps them.
    fn drop(&mut self) {
        if self.broken.is_none() && !self.deferred.is_empty() {
            let deferred = std::mem::take(&mut self.deferred);
            if let Err(e) = self.log.append(&deferred) {
                tracing::warn!(error = %e, "queue file: the last clock reading was not kept");
            }
        }
    }
}

/// Lua strings of `items`, as the KEYS and ARGV tables.
fn strings(lua: &Lua, items: &[Vec<u8>]) -> mlua::Result<Table> {
    lua.create_sequence_from(
        items
            .iter()
            .map(|i| lua.create_string(i))
            .collect::<mlua::Result<Vec<_>>>()?,
    )
}

/// The registry entry holding the functions libraries registered, by name.
const FUNCTIONS: &str = "tuneq_registered_functions";

/// A Lua 5.1 with the libraries Redis gives scripts (base, table, string, math), the
/// `redis` table (call, pcall, error_reply, status_reply, register_function) and `cjson`.
fn scripting_engine() -> mlua::Result<Lua> {
    let lua = Lua::new_with(
        StdLib::TABLE | StdLib::STRING | StdLib::MATH,
        LuaOptions::default(),
    )?;
    let redis = lua.create_table()?;
    redis.set(
        "call",
        lua.create_function(|lua, args: Variadic<mlua::Value>| redis_call(lua, &args, true))?,
    )?;
    redis.set(
        "pcall",
        lua.create_function(|lua, args: Variadic<mlua::Value>| redis_call(lua, &args, false))?,
    )?;
    redis.set(
        "error_reply",
        lua.create_function(|lua, message: mlua::LuaString| reply_table(lua, "err", message))?,
    )?;
    redis.set(
        "status_reply",
        lua.create_function(|lua, status: mlua::LuaString| reply_table(lua, "ok", status))?,
    )?;
    let registered = lua.create_table()?;
    lua.set_named_registry_value(FUNCTIONS, &registered)?;
    redis.set(
        "register_function",
        lua.create_function(move |_, (name, callback): (mlua::LuaString, Function)| {
            registered.raw_set(name, callback)
        })?,
    )?;
    lua.globals().set("redis", redis)?;
    let cjson = lua.create_table()?;
    cjson.set(
        "encode",
        lua.create_function(|_, value: mlua::Value| {
            serde_json::to_string(&to_json(&value, 0)?).map_err(mlua::Error::external)
        })?,
    )?;
    cjson.set(
        "decode",
        lua.create_function(|lua, text: mlua::LuaString| {
            let parsed: serde_json::Value =
                serde_json::from_slice(&text.as_bytes()).map_err(mlua::Error::external)?;
            from_json(lua, &parsed)
        })?,
    )?;
    lua.globals().set("cjson", cjson)?;
    Ok(lua)
}

fn reply_table(lua: &Lua, field: &str, text: mlua::LuaString) -> mlua::Result<Table> {
    let t = lua.create_table()?;
    t.set(field, text)?;
    Ok(t)
}

/// Formats a Lua number as Redis does when a script passes one to a command: integral
/// values as plain digits, others in their shortest exact form.
fn number_arg(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 1e17 {
        format!("{}", n as i64)
    } else {
        format_score(n)
    }
}

/// `redis.call` (errors raise) and `redis.pcall` (errors come back as `{err=…}`).
fn redis_call(lua: &Lua, args: &[mlua::Value], raise: bool) -> mlua::Result<mlua::Value> {
    let command = args
        .iter()
        .map(|a| match a {
            mlua::Value::String(s) => Ok(s.as_bytes().to_vec()),
            mlua::Value::Integer(i) => Ok(i.to_string().into_bytes()),
            mlua::Value::Number(n) => Ok(number_arg(*n).into_bytes()),
            _ => Err(mlua::Error::runtime(
                "Lua redis lib command arguments must be strings or integers",
            )),
        })
        .collect::<mlua::Result<Command>>()?;
    let outcome = {
        let mut keyspace = lua
            .app_data_mut::<Db>()
            .ok_or_else(|| mlua::Error::runtime("the keyspace is missing"))?;
        keyspace.execute(&command)
    };
    match outcome {
        Ok(reply) => to_lua(lua, &reply),
        Err(e) if raise => Err(mlua::Error::runtime(e.0)),
        Err(e) => reply_table(lua, "err", lua.create_string(&e.0)?).map(mlua::Value::Table),
    }
}

/// A command's reply as Redis hands it to a script.
fn to_lua(lua: &Lua, reply: &Value) -> mlua::Result<mlua::Value> {
    Ok(match reply {
        Value::Nil => mlua::Value::Boolean(false),
        Value::Int(i) => mlua::Value::Number(*i as f64),
        Value::BulkString(b) => mlua::Value::String(lua.create_string(b)?),
        Value::Okay => mlua::Value::Table(reply_table(lua, "ok", lua.create_string("OK")?)?),
        Value::SimpleString(s) => {
            mlua::Value::Table(reply_table(lua, "ok", lua.create_string(s)?)?)
        }
        Value::Array(items) => {
            let t = lua.create_table()?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, to_lua(lua, item)?)?;
            }
            mlua::Value::Table(t)
        }
        other => return Err(mlua::Error::runtime(format!("unexpected reply {other:?}"))),
    })
}

/// A script's return value as the reply Redis would send.
fn script_reply(value: &mlua::Value) -> Result<Value, StoreError> {
    Ok(match value {
        mlua::Value::Nil | mlua::Value::Boolean(false) => Value::Nil,
        mlua::Value::Boolean(true) => Value::Int(1),
        mlua::Value::Integer(i) => Value::Int(*i),
        mlua::Value::Number(n) => Value::Int(*n as i64),
        mlua::Value::String(s) => Value::BulkString(s.as_bytes().to_vec()),
        mlua::Value::Table(t) => {
            if let Ok(mlua::Value::String(e)) = t.raw_get::<mlua::Value>("err") {
                return Err(StoreError::Command(e.to_string_lossy()));
            }
            if let Ok(mlua::Value::String(s)) = t.raw_get::<mlua::Value>("ok") {
                return Ok(Value::SimpleString(s.to_string_lossy()));
            }
            let mut items = Vec::new();
            for i in 1.. {
                match t.raw_get::<mlua::Value>(i).map_err(lua_error)? {
                    mlua::Value::Nil => break,
                    item => items.push(script_reply(&item)?),
                }
            }
            Value::Array(items)
        }
        _ => Value::Nil,
    })
}

/// `cjson.encode`'s view of a Lua value: a table with keys 1..n is an array, any other
/// table an object (an empty one encodes as `{}`, like Redis's cjson).
fn to_json(value: &mlua::Value, depth: usize) -> mlua::Result<serde_json::Value> {
    if depth > 100 {
        return Err(mlua::Error::runtime("cjson: nesting too deep"));
    }
    Ok(match value {
        mlua::Value::Nil => serde_json::Value::Null,
        mlua::Value::Boolean(b) => serde_json::Value::Bool(*b),
        mlua::Value::Integer(i) => serde_json::Value::from(*i),
        mlua::Value::Number(n) if n.fract() == 0.0 && n.abs() < 9.007e15 => {
            serde_json::Value::from(*n as i64)
        }
        mlua::Value::Number(n) => serde_json::Number::from_f64(*n)
            .map(serde_json::Value::Number)
            .ok_or_else(|| mlua::Error::runtime("cjson: cannot encode a non-finite number"))?,
        mlua::Value::String(s) => serde_json::Value::String(s.to_string_lossy()),
        mlua::Value::Table(t) => {
            let len = t.raw_len();
            let pairs = t.clone().pairs::<mlua::Value, mlua::Value>().count();
            if len > 0 && len == pairs {
                let items = (1..=len)
                    .map(|i| to_json(&t.raw_get::<mlua::Value>(i)?, depth + 1))
                    .collect::<mlua::Result<Vec<_>>>()?;
                serde_json::Value::Array(items)
            } else {
                let mut object = serde_json::Map::new();
                for pair in t.clone().pairs::<mlua::Value, mlua::Value>() {
                    let (k, v) = pair?;
                    let key = match &k {
                        mlua::Value::String(s) => s.to_string_lossy(),
                        mlua::Value::Integer(i) => i.to_string(),
                        mlua::Value::Number(n) => number_arg(*n),
                        _ => {
                            return Err(mlua::Error::runtime(
                                "cjson: table key must be a string or number",
                            ));
                        }
                    };
                    object.insert(key, to_json(&v, depth + 1)?);
                }
                // A Lua table's own order is its hash order: sorted keys make the same
                // table encode the same from run to run.
                object.sort_keys();
                serde_json::Value::Object(object)
            }
        }
        _ => return Err(mlua::Error::runtime("cjson: cannot encode this type")),
    })
}

fn from_json(lua: &Lua, value: &serde_json::Value) -> mlua::Result<mlua::Value> {
    Ok(match value {
        serde_json::Value::Null => mlua::Value::Nil,
        serde_json::Value::Bool(b) => mlua::Value::Boolean(*b),
        serde_json::Value::Number(n) => mlua::Value::Number(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => mlua::Value::String(lua.create_string(s)?),
        serde_json::Value::Array(items) => {
            let t = lua.create_table()?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, from_json(lua, item)?)?;
            }
            mlua::Value::Table(t)
        }
        serde_json::Value::Object(map) => {
            let t = lua.create_table()?;
            for (k, v) in map {
                t.raw_set(k.as_str(), from_json(lua, v)?)?;
            }
            mlua::Value::Table(t)
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn bytes(items: &[&str]) -> Vec<Vec<u8>> {
        items.iter().map(|s| s.as_bytes().to_vec()).collect()
    }

    /// A fresh store path inside a temporary directory, removed when the guard drops.
    fn temp_file() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("tuneq-store-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("queue.db");
        (dir, path)
    }

    #[test]
    fn scripts_see_redis_reply_shapes_and_numbers_pass_as_redis_formats_them() {
        let (_dir, path) = temp_file();
        let store = Store::open(&path).unwrap();
        let script = r#"
            redis.call('HSET', KEYS[1], 'big', 1764484135000, 'half', 0.5)
            local missing = redis.call('GET', 'nothing')
            local ok = redis.call('SET', 'k', 'v')
            local err = redis.pcall('HGET', 'k', 'f')
            return {redis.call('HGET', KEYS[1], 'big'), redis.call('HGET', KEYS[1], 'half'),
                    tostring(missing), ok.ok, err.err ~= nil and 1 or 0, 7.9,
                    cjson.encode({seq = 3, kind = 'queued'})}
        "#;
        let reply = store.eval("s1", script, &bytes(&["h"]), &[]).unwrap();
        let Value::Array(items) = reply else { panic!() };
        assert_eq!(items[0], Value::BulkString(b"1764484135000".to_vec()));
        assert_eq!(items[1], Value::BulkString(b"0.5".to_vec()));
        assert_eq!(items[2], Value::BulkString(b"false".to_vec()));
        assert_eq!(items[3], Value::BulkString(b"OK".to_vec()));
        assert_eq!(items[4], Value::Int(1));
        assert_eq!(items[5], Value::Int(7), "numbers are truncated to integers");
        assert_eq!(
            items[6],
            Value::BulkString(br#"{"kind":"queued","seq":3}"#.to_vec())
        );
    }

    #[test]
    fn functions_libraries_load_once_and_are_called_by_name_like_fcall() {
        let (_dir, path) = temp_file();
        let store = Store::open(&path).unwrap();
        let library = "#!lua name=lib\n\
            local calls = 0\n\
            redis.register_function('lib_count', function(KEYS, ARGV)\n\
              calls = calls + 1\n\
              redis.call('SET', KEYS[1], ARGV[1])\n\
              return {calls, redis.call('GET', KEYS[1])}\n\
            end)";
        let call =
            |arg: &str| store.fcall("lib", library, "lib_count", &bytes(&["k"]), &bytes(&[arg]));
        let two =
            |n: i64, v: &[u8]| Value::Array(vec![Value::Int(n), Value::BulkString(v.to_vec())]);
        assert_eq!(call("a").unwrap(), two(1, b"a"));
        // Loaded once: the library's state lives on between calls, as in Redis.
        assert_eq!(call("b").unwrap(), two(2, b"b"));
        let missing = store.fcall("lib", library, "lib_other", &[], &[]);
        assert_eq!(missing.unwrap_err().to_string(), "ERR Function not found");
    }

    #[test]
    fn script_errors_are_error_replies_and_keep_earlier_writes_like_redis() {
        let (_dir, path) = temp_file();
        let store = Store::open(&path).unwrap();
        let failing = "redis.call('SET', 'a', '1'); return redis.call('HGET', 'a', 'f')";
        let e = store.eval("s2", failing, &[], &[]).unwrap_err();
        assert!(e.to_string().contains("WRONGTYPE"), "{e}");
        let refusing = "return redis.error_reply('no such job')";
        let e = store.eval("s3", refusing, &[], &[]).unwrap_err();
        assert_eq!(e.to_string(), "no such job");
        drop(store);
        let reopened = Store::open(&path).unwrap();
        let got = reopened.execute(&[bytes(&["GET", "a"])]).unwrap();
        assert_eq!(got, vec![Value::BulkString(b"1".to_vec())]);
    }

    #[test]
    fn a_reopened_store_has_every_acknowledged_change_and_compaction_keeps_them() {
        let (_dir, path) = temp_file();
        let store = Store::open(&path).unwrap();
        for i in 0..50 {
            let script = "redis.call('INCR', KEYS[1]); redis.call('ZADD', 'z', ARGV[1], ARGV[1])";
            store
                .eval("s4", script, &bytes(&["n"]), &bytes(&[&i.to_string()]))
                .unwrap();
        }
        let mut inner = store.lock().unwrap();
        let snapshot = keyspace(&inner.lua).unwrap().dump();
        assert!(inner.log.compact(&snapshot).unwrap());
        drop(inner);
        store.execute(&[bytes(&["HSET", "h", "f", "v"])]).unwrap();
        drop(store);
        let reopened = Store::open(&path).unwrap();
        let got = reopened
            .execute(&[
                bytes(&["GET", "n"]),
                bytes(&["ZCARD", "z"]),
                bytes(&["HGET", "h", "f"]),
            ])
            .unwrap();
        assert_eq!(
            got,
            vec![
                Value::BulkString(b"50".to_vec()),
                Value::Int(50),
                Value::BulkString(b"v".to_vec())
            ]
        );
    }
}
