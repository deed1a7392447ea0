//! Hash commands: HGET, HMGET, HGETALL, HSET, HINCRBY and HDEL.

use super::args::{bulk, count, integer};
use super::{Call, CommandError, Db, err};
use redis::Value;

impl Db {
    /// Runs `call`, one of this module's commands.
    pub(super) fn hash_command(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        match call.name {
            "HGET" => {
                call.arity(2, 1)?;
                Ok(self
                    .hash(&args[0])?
                    .and_then(|h| h.get(&args[1]))
                    .map_or(Value::Nil, |v| bulk(v)))
            }
            "HMGET" => {
                call.arity(2, 1)?;
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
                call.arity(1, 1)?;
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
                call.arity(3, 2)?;
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
                call.arity(3, 1)?;
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
                call.arity(2, 1)?;
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
            _ => call.unknown(),
        }
    }
}
