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
mod sorted_set;

pub use args::format_score;
use args::{bound, bulk, count, float, glob, index_range, integer, text};
use sorted_set::{Score, SortedSet, ZaddFlags, scored};

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
        let arity = |min: usize, step: usize| -> Result<(), CommandError> {
            if args.len() < min || (step > 1 && !(args.len() - min).is_multiple_of(step)) {
                return err(format!(
                    "ERR wrong number of arguments for '{}' command",
                    name.to_lowercase()
                ));
            }
            Ok(())
        };
        match name.as_str() {
            "PING" => Ok(Value::SimpleString("PONG".into())),
            "TIME" => {
                let us = wall_clock_us();
                Ok(Value::Array(vec![
                    bulk((us / 1_000_000).to_string().as_bytes()),
                    bulk((us % 1_000_000).to_string().as_bytes()),
                ]))
            }
            "GET" => {
                arity(1, 1)?;
                match self.live(&args[0]).map(|e| &e.data) {
                    None => Ok(Value::Nil),
                    Some(Data::String(v)) => Ok(bulk(v)),
                    Some(_) => err(WRONG_TYPE),
                }
            }
            "SET" => {
                arity(2, 1)?;
                let mut expires_at_ms = None;
                let mut rest = args[2..].iter();
                while let Some(option) = rest.next() {
                    let option = text(option)?.to_ascii_uppercase();
                    let value = rest.next().map(|v| integer(v)).transpose()?;
                    let (Some(v), "PX" | "PXAT" | "EX") = (value, option.as_str()) else {
                        return err("ERR syntax error");
                    };
                    let v = u64::try_from(v).or_else(|_| err("ERR invalid expire time"))?;
                    expires_at_ms = Some(match option.as_str() {
                        "PX" => now_ms().saturating_add(v),
                        "EX" => now_ms().saturating_add(v.saturating_mul(1000)),
                        _ => v,
                    });
                }
                let (key, value) = (args[0].clone(), args[1].clone());
                let mut canonical = vec![b"SET".to_vec(), key.clone(), value.clone()];
                if let Some(at) = expires_at_ms {
                    canonical.push(b"PXAT".to_vec());
                    canonical.push(at.to_string().into_bytes());
                }
                self.keys.insert(
                    key,
                    Entry {
                        data: Data::String(value),
                        expires_at_ms,
                    },
                );
                self.record(canonical);
                Ok(Value::Okay)
            }
            "INCR" => {
                arity(1, 1)?;
                let current = match self.live(&args[0]).map(|e| &e.data) {
                    None => 0,
                    Some(Data::String(v)) => integer(v)?,
                    Some(_) => return err(WRONG_TYPE),
                };
                let next = current
                    .checked_add(1)
                    .ok_or_else(|| CommandError("ERR increment would overflow".into()))?;
                let expires_at_ms = self.live(&args[0]).and_then(|e| e.expires_at_ms);
                self.keys.insert(
                    args[0].clone(),
                    Entry {
                        data: Data::String(next.to_string().into_bytes()),
                        expires_at_ms,
                    },
                );
                self.record(vec![b"INCR".to_vec(), args[0].clone()]);
                Ok(Value::Int(next))
            }
            "DEL" => {
                arity(1, 1)?;
                let mut removed = 0;
                for key in args {
                    if self.live(key).is_some() {
                        self.keys.remove(key);
                        removed += 1;
                    }
                }
                if removed > 0 {
                    self.record([vec![b"DEL".to_vec()], args.to_vec()].concat());
                }
                Ok(count(removed))
            }
            "EXISTS" => {
                arity(1, 1)?;
                let n = args.iter().filter(|k| self.live(k).is_some()).count();
                Ok(count(n))
            }
            "HGET" => {
                arity(2, 1)?;
                Ok(self
                    .hash(&args[0])?
                    .and_then(|h| h.get(&args[1]))
                    .map_or(Value::Nil, |v| bulk(v)))
            }
            "HMGET" => {
                arity(2, 1)?;
                let h = self.hash(&args[0])?;
                let values = args[1..]
                    .iter()
                    .map(|f| {
                        h.as_ref()
                            .and_then(|h| h.get(f))
                            .map_or(Value::Nil, |v| bulk(v))
                    })
                    .collect();
                Ok(Value::Array(values))
            }
            "HGETALL" => {
                arity(1, 1)?;
                let mut out = Vec::new();
                if let Some(h) = self.hash(&args[0])? {
                    for (f, v) in h.iter() {
                        out.push(bulk(f));
                        out.push(bulk(v));
                    }
                }
                Ok(Value::Array(out))
            }
            "HSET" => {
                arity(3, 2)?;
                let h = self.hash_or_new(&args[0])?;
                let (mut added, mut changed) = (0, false);
                for fv in args[1..].chunks(2) {
                    match h.insert(fv[0].clone(), fv[1].clone()) {
                        None => (added, changed) = (added + 1, true),
                        Some(old) => changed |= old != fv[1],
                    }
                }
                if changed {
                    self.record([vec![b"HSET".to_vec()], args.to_vec()].concat());
                }
                Ok(count(added))
            }
            "HINCRBY" => {
                arity(3, 1)?;
                let by = integer(&args[2])?;
                let h = self.hash_or_new(&args[0])?;
                let current = match h.get(&args[1]) {
                    Some(v) => integer(v).or_else(|_| err("ERR hash value is not an integer"))?,
                    None => 0,
                };
                let next = current.checked_add(by).ok_or_else(|| {
                    CommandError("ERR increment or decrement would overflow".into())
                })?;
                h.insert(args[1].clone(), next.to_string().into_bytes());
                self.record([vec![b"HINCRBY".to_vec()], args.to_vec()].concat());
                Ok(Value::Int(next))
            }
            "HDEL" => {
                arity(2, 1)?;
                let removed = match self.hash(&args[0])? {
                    Some(h) => args[1..].iter().filter(|f| h.remove(*f).is_some()).count(),
                    None => 0,
                };
                self.drop_if_empty(&args[0]);
                if removed > 0 {
                    self.record([vec![b"HDEL".to_vec()], args.to_vec()].concat());
                }
                Ok(count(removed))
            }
            "RPUSH" => {
                arity(2, 1)?;
                self.or_new(&args[0], || Data::List(VecDeque::new()))?;
                let l = self.list(&args[0])?.expect("just created");
                l.extend(args[1..].iter().cloned());
                let len = l.len();
                self.record([vec![b"RPUSH".to_vec()], args.to_vec()].concat());
                Ok(count(len))
            }
            "LLEN" => {
                arity(1, 1)?;
                Ok(count(self.list(&args[0])?.map_or(0, |l| l.len())))
            }
            "LRANGE" => {
                arity(3, 1)?;
                let (start, stop) = (integer(&args[1])?, integer(&args[2])?);
                let Some(l) = self.list(&args[0])? else {
                    return Ok(Value::Array(vec![]));
                };
                Ok(Value::Array(match index_range(l.len(), start, stop) {
                    Some((a, b)) => l.range(a..=b).map(|v| bulk(v)).collect(),
                    None => vec![],
                }))
            }
            "LTRIM" => {
                arity(3, 1)?;
                let (start, stop) = (integer(&args[1])?, integer(&args[2])?);
                if let Some(l) = self.list(&args[0])? {
                    let before = l.len();
                    match index_range(l.len(), start, stop) {
                        Some((a, b)) => {
                            l.truncate(b + 1);
                            l.drain(..a);
                        }
                        None => l.clear(),
                    }
                    let trimmed = l.len() != before;
                    self.drop_if_empty(&args[0]);
                    // A trim that removed nothing changed nothing: no record.
                    if trimmed {
                        self.record([vec![b"LTRIM".to_vec()], args.to_vec()].concat());
                    }
                }
                Ok(Value::Okay)
            }
            "SADD" => {
                arity(2, 1)?;
                self.or_new(&args[0], || Data::Set(HashSet::new()))?;
                let s = self.set(&args[0])?.expect("just created");
                let added = args[1..].iter().filter(|m| s.insert(m.to_vec())).count();
                if added > 0 {
                    self.record([vec![b"SADD".to_vec()], args.to_vec()].concat());
                }
                Ok(count(added))
            }
            "SREM" => {
                arity(2, 1)?;
                let removed = match self.set(&args[0])? {
                    Some(s) => args[1..].iter().filter(|m| s.remove(*m)).count(),
                    None => 0,
                };
                self.drop_if_empty(&args[0]);
                if removed > 0 {
                    self.record([vec![b"SREM".to_vec()], args.to_vec()].concat());
                }
                Ok(count(removed))
            }
            "SMEMBERS" => {
                arity(1, 1)?;
                let mut members: Vec<Vec<u8>> = self
                    .set(&args[0])?
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default();
                members.sort();
                Ok(Value::Array(members.iter().map(|m| bulk(m)).collect()))
            }
            "SISMEMBER" => {
                arity(2, 1)?;
                let found = self.set(&args[0])?.is_some_and(|s| s.contains(&args[1]));
                Ok(Value::Int(i64::from(found)))
            }
            "SCARD" => {
                arity(1, 1)?;
                Ok(count(self.set(&args[0])?.map_or(0, |s| s.len())))
            }
            "ZADD" => {
                arity(3, 1)?;
                let mut flags = ZaddFlags::default();
                let mut at = 1;
                while let Some(flag) = args.get(at).and_then(|a| flags.parse(a)) {
                    flags = flag;
                    at += 1;
                }
                let pairs = &args[at..];
                if pairs.is_empty() || pairs.len() % 2 != 0 || (flags.nx && flags.xx) {
                    return err("ERR syntax error");
                }
                let pairs = pairs
                    .chunks(2)
                    .map(|sm| Ok((float(&sm[0])?, sm[1].clone())))
                    .collect::<Result<Vec<_>, CommandError>>()?;
                if flags.xx && self.zset(&args[0])?.is_none() {
                    return Ok(Value::Int(0));
                }
                self.or_new(&args[0], || Data::SortedSet(SortedSet::default()))?;
                let z = self.zset(&args[0])?.expect("just created");
                let (mut changed, mut written) = (0, false);
                for (score, member) in pairs {
                    let old = z.scores.get(&member).copied();
                    let write = match old {
                        None => !flags.xx,
                        Some(old) => {
                            !flags.nx && (!flags.gt || score > old) && (!flags.lt || score < old)
                        }
                    };
                    if !write || old == Some(score) {
                        continue;
                    }
                    z.insert(member, score);
                    written = true;
                    if old.is_none() || flags.ch {
                        changed += 1;
                    }
                }
                self.drop_if_empty(&args[0]);
                // Replayed with the same flags on the same state, it writes the same
                // members; one that wrote none (every score already as given, or kept
                // by NX/XX/GT/LT) changed nothing and needs no record.
                if written {
                    self.record([vec![b"ZADD".to_vec()], args.to_vec()].concat());
                }
                Ok(count(changed))
            }
            "ZREM" => {
                arity(2, 1)?;
                let removed = match self.zset(&args[0])? {
                    Some(z) => args[1..].iter().filter(|m| z.remove(m)).count(),
                    None => 0,
                };
                self.drop_if_empty(&args[0]);
                if removed > 0 {
                    self.record([vec![b"ZREM".to_vec()], args.to_vec()].concat());
                }
                Ok(count(removed))
            }
            "ZPOPMIN" => {
                // Recorded as the ZREM of what it took, which replays the same.
                let count = match args {
                    [_] => 1,
                    [_, n] => usize::try_from(integer(n)?)
                        .or_else(|_| err("ERR value is out of range, must be positive"))?,
                    _ => return err("ERR syntax error"),
                };
                let Some(z) = self.zset(&args[0])? else {
                    return Ok(Value::Array(vec![]));
                };
                let taken: Vec<(Score, Vec<u8>)> = z.order.iter().take(count).cloned().collect();
                for (_, member) in &taken {
                    z.remove(member);
                }
                self.drop_if_empty(&args[0]);
                if !taken.is_empty() {
                    let mut change = vec![b"ZREM".to_vec(), args[0].clone()];
                    change.extend(taken.iter().map(|(_, m)| m.clone()));
                    self.record(change);
                }
                Ok(Value::Array(scored(taken.iter(), true)))
            }
            "ZCARD" => {
                arity(1, 1)?;
                Ok(count(self.zset(&args[0])?.map_or(0, |z| z.len())))
            }
            "ZSCORE" => {
                arity(2, 1)?;
                Ok(self
                    .zset(&args[0])?
                    .and_then(|z| z.scores.get(&args[1]).copied())
                    .map_or(Value::Nil, |s| bulk(format_score(s).as_bytes())))
            }
            "ZRANK" => {
                arity(2, 1)?;
                let Some(z) = self.zset(&args[0])? else {
                    return Ok(Value::Nil);
                };
                let Some(&score) = z.scores.get(&args[1]) else {
                    return Ok(Value::Nil);
                };
                let rank = z.order.range(..(Score(score), args[1].clone())).count();
                Ok(count(rank))
            }
            "ZRANGE" => {
                arity(3, 1)?;
                let (start, stop) = (integer(&args[1])?, integer(&args[2])?);
                let with_scores = match &args[3..] {
                    [] => false,
                    [w] if w.eq_ignore_ascii_case(b"WITHSCORES") => true,
                    _ => return err("ERR syntax error"),
                };
                let Some(z) = self.zset(&args[0])? else {
                    return Ok(Value::Array(vec![]));
                };
                let Some((a, b)) = index_range(z.len(), start, stop) else {
                    return Ok(Value::Array(vec![]));
                };
                let picked = z.order.iter().skip(a).take(b - a + 1);
                Ok(Value::Array(scored(picked, with_scores)))
            }
            "ZRANGEBYSCORE" => {
                arity(3, 1)?;
                let ((min, min_open), (max, max_open)) = (bound(&args[1])?, bound(&args[2])?);
                let mut with_scores = false;
                let (mut offset, mut limit) = (0usize, usize::MAX);
                let mut rest = args[3..].iter();
                while let Some(option) = rest.next() {
                    if option.eq_ignore_ascii_case(b"WITHSCORES") {
                        with_scores = true;
                    } else if option.eq_ignore_ascii_case(b"LIMIT") {
                        let (Some(o), Some(c)) = (rest.next(), rest.next()) else {
                            return err("ERR syntax error");
                        };
                        let (o, c) = (integer(o)?, integer(c)?);
                        offset = usize::try_from(o).unwrap_or(usize::MAX);
                        limit = usize::try_from(c).unwrap_or(usize::MAX);
                    } else {
                        return err("ERR syntax error");
                    }
                }
                let Some(z) = self.zset(&args[0])? else {
                    return Ok(Value::Array(vec![]));
                };
                let picked = z
                    .order
                    .iter()
                    .skip_while(|(s, _)| s.0 < min || (min_open && s.0 == min))
                    .take_while(|(s, _)| s.0 < max || (!max_open && s.0 == max))
                    .skip(offset)
                    .take(limit);
                Ok(Value::Array(scored(picked, with_scores)))
            }
            "ZREVRANGEBYSCORE" => {
                arity(3, 1)?;
                let ((max, max_open), (min, min_open)) = (bound(&args[1])?, bound(&args[2])?);
                let (mut offset, mut limit) = (0usize, usize::MAX);
                match &args[3..] {
                    [] => {}
                    [l, o, c] if l.eq_ignore_ascii_case(b"LIMIT") => {
                        offset = usize::try_from(integer(o)?).unwrap_or(usize::MAX);
                        limit = usize::try_from(integer(c)?).unwrap_or(usize::MAX);
                    }
                    _ => return err("ERR syntax error"),
                }
                let Some(z) = self.zset(&args[0])? else {
                    return Ok(Value::Array(vec![]));
                };
                let picked = z
                    .order
                    .iter()
                    .rev()
                    .skip_while(|(s, _)| s.0 > max || (max_open && s.0 == max))
                    .take_while(|(s, _)| s.0 > min || (!min_open && s.0 == min))
                    .skip(offset)
                    .take(limit);
                Ok(Value::Array(scored(picked, false)))
            }
            "KEYS" => {
                arity(1, 1)?;
                Ok(Value::Array(self.matching(&args[0])))
            }
            "SCAN" => {
                // One pass returns everything, with cursor 0: SCAN's contract allows it.
                arity(1, 1)?;
                let mut pattern = b"*".to_vec();
                let mut rest = args[1..].iter();
                while let Some(option) = rest.next() {
                    let value = rest.next();
                    match (option.to_ascii_uppercase().as_slice(), value) {
                        (b"MATCH", Some(p)) => pattern = p.clone(),
                        (b"COUNT", Some(_)) => {}
                        _ => return err("ERR syntax error"),
                    }
                }
                Ok(Value::Array(vec![
                    bulk(b"0"),
                    Value::Array(self.matching(&pattern)),
                ]))
            }
            other => err(format!(
                "ERR unknown command '{}' (not supported by the embedded store)",
                other.to_lowercase()
            )),
        }
    }

    fn matching(&mut self, pattern: &[u8]) -> Vec<Value> {
        self.expire_all();
        let mut keys: Vec<&Vec<u8>> = self.keys.keys().filter(|k| glob(pattern, k)).collect();
        keys.sort();
        keys.into_iter().map(|k| bulk(k)).collect()
    }
}

#[cfg(test)]
mod tests;
