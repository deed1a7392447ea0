//! Commands on keys of any type and on plain strings: PING, TIME, GET, SET, INCR, DEL, EXISTS, KEYS and SCAN.

use super::args::{bulk, count, glob, integer, text};
use super::{Call, CommandError, Data, Db, Entry, WRONG_TYPE, err, now_ms, wall_clock_us};
use redis::Value;

impl Db {
    /// Runs `call`, one of this module's commands.
    pub(super) fn keyspace_command(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        match call.name {
            "PING" => Ok(Value::SimpleString("PONG".into())),
            "TIME" => {
                let us = wall_clock_us();
                Ok(Value::Array(vec![
                    bulk((us / 1_000_000).to_string().as_bytes()),
                    bulk((us % 1_000_000).to_string().as_bytes()),
                ]))
            }
            "GET" => {
                call.arity(1, 1)?;
                match self.live(&args[0]).map(|e| &e.data) {
                    None => Ok(Value::Nil),
                    Some(Data::String(v)) => Ok(bulk(v)),
                    Some(_) => err(WRONG_TYPE),
                }
            }
            "SET" => self.set_string(call),
            "INCR" => self.incr(call),
            "DEL" => self.del(call),
            "EXISTS" => {
                call.arity(1, 1)?;
                let n = args.iter().filter(|k| self.live(k).is_some()).count();
                Ok(count(n))
            }
            "KEYS" => {
                call.arity(1, 1)?;
                Ok(Value::Array(self.matching(&args[0])))
            }
            "SCAN" => self.scan(call),
            _ => call.unknown(),
        }
    }

    /// SET key value [PX ms|PXAT ms|EX s]: recorded with its expiry as PXAT, which replays the same.
    fn set_string(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        call.arity(2, 1)?;
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

    /// INCR key, keeping the key's expiry.
    fn incr(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        call.arity(1, 1)?;
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

    /// DEL key …: recorded only when it removed a key.
    fn del(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        call.arity(1, 1)?;
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

    /// SCAN cursor [MATCH pattern] [COUNT n]: one pass returns everything, with cursor 0 (SCAN's contract allows it).
    fn scan(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        // One pass returns everything, with cursor 0: SCAN's contract allows it.
        call.arity(1, 1)?;
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

    /// The live keys matching a glob `pattern`, sorted.
    fn matching(&mut self, pattern: &[u8]) -> Vec<Value> {
        self.expire_all();
        let mut keys: Vec<&Vec<u8>> = self.keys.keys().filter(|k| glob(pattern, k)).collect();
        keys.sort();
        keys.into_iter().map(|k| bulk(k)).collect()
    }
}
