//! The in-memory data of the embedded store: the subset of Redis's data types and
//! commands that the queue's scripts and its Rust side use, with Redis's reply shapes.
//!
//! Every command that changes something is also recorded, in a canonical form that
//! replays to the same result (a relative expiry becomes an absolute one), so the log
//! holds effects, not scripts: replaying a log never depends on the scripts' code.

use redis::Value;
use std::collections::{HashMap, HashSet, VecDeque};

/// One command as Redis receives it: the name, then the arguments.
pub type Command = Vec<Vec<u8>>;

/// A command refused the way Redis refuses it (the text of its error reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandError(pub String);

impl std::fmt::Display for CommandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(message: impl Into<String>) -> Result<T, CommandError> {
    Err(CommandError(message.into()))
}

mod args;
mod hashes;
mod keyspace;
mod lists;
mod sets;
mod sorted_set;
mod zsets;

pub use args::format_score;
use args::text;
use sorted_set::SortedSet;

/// A command being run: its upper-cased name and its arguments.
struct Call<'a> {
    name: &'a str,
    args: &'a [Vec<u8>],
}

impl Call<'_> {
    /// At least `min` arguments, and with `step > 1` a whole number of `step`-sized
    /// groups after them (field/value pairs).
    fn arity(&self, min: usize, step: usize) -> Result<(), CommandError> {
        let n = self.args.len();
        if n < min || (step > 1 && !(n - min).is_multiple_of(step)) {
            return err(format!(
                "ERR wrong number of arguments for '{}' command",
                self.name.to_lowercase()
            ));
        }
        Ok(())
    }

    /// The reply to a command this store does not have.
    fn unknown<T>(&self) -> Result<T, CommandError> {
        err(format!(
            "ERR unknown command '{}' (not supported by the embedded store)",
            self.name.to_lowercase()
        ))
    }
}

const WRONG_TYPE: &str = "WRONGTYPE Operation against a key holding the wrong kind of value";

/// A hash's fields and values.
type Fields = HashMap<Vec<u8>, Vec<u8>>;

#[derive(Debug, Clone)]
enum Data {
    String(Vec<u8>),
    Hash(Fields),
    List(VecDeque<Vec<u8>>),
    Set(HashSet<Vec<u8>>),
    SortedSet(SortedSet),
}

impl Data {
    fn is_empty(&self) -> bool {
        match self {
            Data::String(_) => false,
            Data::Hash(h) => h.is_empty(),
            Data::List(l) => l.is_empty(),
            Data::Set(s) => s.is_empty(),
            Data::SortedSet(z) => z.len() == 0,
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    data: Data,
    /// Unix milliseconds after which the key no longer exists.
    expires_at_ms: Option<u64>,
}

/// The keyspace, plus the changes recorded since [`Db::take_changes`] last ran.
#[derive(Debug, Default)]
pub struct Db {
    keys: HashMap<Vec<u8>, Entry>,
    changes: Vec<Command>,
}

/// Wall-clock milliseconds since the Unix epoch (Redis `TIME` and key expiry).
pub fn wall_clock_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or_default()
}

fn now_ms() -> u64 {
    u64::try_from(wall_clock_us() / 1000).unwrap_or(u64::MAX)
}

impl Db {
    /// The changes recorded since the last call, in order.
    pub fn take_changes(&mut self) -> Vec<Command> {
        std::mem::take(&mut self.changes)
    }

    /// Forgets recorded changes (after replaying a log, whose changes are already in it).
    pub fn clear_changes(&mut self) {
        self.changes.clear();
    }

    /// Every live key as the commands that recreate it (a log compaction's snapshot).
    pub fn dump(&mut self) -> Vec<Command> {
        self.expire_all();
        let mut out = Vec::new();
        let mut names: Vec<&Vec<u8>> = self.keys.keys().collect();
        names.sort();
        for name in names {
            let entry = &self.keys[name];
            let cmd = |verb: &str| vec![verb.as_bytes().to_vec(), name.clone()];
            match &entry.data {
                Data::String(v) => {
                    let mut c = cmd("SET");
                    c.push(v.clone());
                    if let Some(at) = entry.expires_at_ms {
                        c.push(b"PXAT".to_vec());
                        c.push(at.to_string().into_bytes());
                    }
                    out.push(c);
                }
                Data::Hash(h) => {
                    let mut c = cmd("HSET");
                    let mut fields: Vec<_> = h.iter().collect();
                    fields.sort();
                    for (f, v) in fields {
                        c.push(f.clone());
                        c.push(v.clone());
                    }
                    out.push(c);
                }
                Data::List(l) => {
                    let mut c = cmd("RPUSH");
                    c.extend(l.iter().cloned());
                    out.push(c);
                }
                Data::Set(s) => {
                    let mut c = cmd("SADD");
                    let mut members: Vec<_> = s.iter().cloned().collect();
                    members.sort();
                    c.extend(members);
                    out.push(c);
                }
                Data::SortedSet(z) => {
                    let mut c = cmd("ZADD");
                    for (score, member) in &z.order {
                        c.push(format_score(score.0).into_bytes());
                        c.push(member.clone());
                    }
                    out.push(c);
                }
            }
        }
        out
    }

    /// The number of live keys.
    #[cfg(test)]
    fn key_count(&mut self) -> usize {
        self.expire_all();
        self.keys.len()
    }

    fn expire_all(&mut self) {
        let now = now_ms();
        self.keys
            .retain(|_, e| e.expires_at_ms.is_none_or(|at| at > now));
    }

    /// The live entry at `key`, dropping it first if it has expired.
    fn live(&mut self, key: &[u8]) -> Option<&mut Entry> {
        let expired = self
            .keys
            .get(key)
            .and_then(|e| e.expires_at_ms)
            .is_some_and(|at| at <= now_ms());
        if expired {
            self.keys.remove(key);
        }
        self.keys.get_mut(key)
    }

    fn hash(&mut self, key: &[u8]) -> Result<Option<&mut Fields>, CommandError> {
        match self.live(key).map(|e| &mut e.data) {
            None => Ok(None),
            Some(Data::Hash(h)) => Ok(Some(h)),
            Some(_) => err(WRONG_TYPE),
        }
    }

    fn hash_or_new(&mut self, key: &[u8]) -> Result<&mut Fields, CommandError> {
        self.or_new(key, || Data::Hash(HashMap::new()))?;
        Ok(self.hash(key)?.expect("just created"))
    }

    fn list(&mut self, key: &[u8]) -> Result<Option<&mut VecDeque<Vec<u8>>>, CommandError> {
        match self.live(key).map(|e| &mut e.data) {
            None => Ok(None),
            Some(Data::List(l)) => Ok(Some(l)),
            Some(_) => err(WRONG_TYPE),
        }
    }

    fn set(&mut self, key: &[u8]) -> Result<Option<&mut HashSet<Vec<u8>>>, CommandError> {
        match self.live(key).map(|e| &mut e.data) {
            None => Ok(None),
            Some(Data::Set(s)) => Ok(Some(s)),
            Some(_) => err(WRONG_TYPE),
        }
    }

    fn zset(&mut self, key: &[u8]) -> Result<Option<&mut SortedSet>, CommandError> {
        match self.live(key).map(|e| &mut e.data) {
            None => Ok(None),
            Some(Data::SortedSet(z)) => Ok(Some(z)),
            Some(_) => err(WRONG_TYPE),
        }
    }

    /// Creates `key` with `empty()` unless it exists (with the right type, checked by
    /// the caller's typed accessor).
    fn or_new(&mut self, key: &[u8], empty: impl FnOnce() -> Data) -> Result<(), CommandError> {
        if self.live(key).is_none() {
            self.keys.insert(
                key.to_vec(),
                Entry {
                    data: empty(),
                    expires_at_ms: None,
                },
            );
        }
        Ok(())
    }

    /// Drops `key` if a removal emptied it (Redis never keeps empty collections).
    fn drop_if_empty(&mut self, key: &[u8]) {
        if self.keys.get(key).is_some_and(|e| e.data.is_empty()) {
            self.keys.remove(key);
        }
    }

    fn record(&mut self, command: Command) {
        self.changes.push(command);
    }

    /// Runs one command. Commands that changed something are recorded.
    pub fn execute(&mut self, args: &[Vec<u8>]) -> Result<Value, CommandError> {
        let Some((name, args)) = args.split_first() else {
            return err("ERR empty command");
        };
        let name = text(name)?.to_ascii_uppercase();
        let call = Call { name: &name, args };
        match name.as_str() {
            "PING" | "TIME" | "GET" | "SET" | "INCR" | "DEL" | "EXISTS" | "KEYS" | "SCAN" => {
                self.keyspace_command(&call)
            }
            "HGET" | "HMGET" | "HGETALL" | "HSET" | "HINCRBY" | "HDEL" => self.hash_command(&call),
            "RPUSH" | "LLEN" | "LRANGE" | "LTRIM" => self.list_command(&call),
            "SADD" | "SREM" | "SMEMBERS" | "SISMEMBER" | "SCARD" => self.set_command(&call),
            "ZADD" | "ZREM" | "ZPOPMIN" | "ZCARD" | "ZSCORE" | "ZRANK" | "ZRANGE"
            | "ZRANGEBYSCORE" | "ZREVRANGEBYSCORE" => self.sorted_set_command(&call),
            _ => call.unknown(),
        }
    }
}

#[cfg(test)]
mod tests;
