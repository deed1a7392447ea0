//! Set commands: SADD, SREM, SMEMBERS, SISMEMBER and SCARD.

use super::args::{bulk, count};
use super::{Call, CommandError, Data, Db};
use redis::Value;
use std::collections::HashSet;

impl Db {
    /// Runs `call`, one of this module's commands.
    pub(super) fn set_command(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        match call.name {
            "SADD" => {
                call.arity(2, 1)?;
                self.or_new(&args[0], || Data::Set(HashSet::new()))?;
                let s = self.set(&args[0])?.expect("just created");
                let added = args[1..].iter().filter(|m| s.insert(m.to_vec())).count();
                if added > 0 {
                    self.record([vec![b"SADD".to_vec()], args.to_vec()].concat());
                }
                Ok(count(added))
            }
            "SREM" => {
                call.arity(2, 1)?;
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
                call.arity(1, 1)?;
                let mut members: Vec<Vec<u8>> = self
                    .set(&args[0])?
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default();
                members.sort();
                Ok(Value::Array(members.iter().map(|m| bulk(m)).collect()))
            }
            "SISMEMBER" => {
                call.arity(2, 1)?;
                let found = self.set(&args[0])?.is_some_and(|s| s.contains(&args[1]));
                Ok(Value::Int(i64::from(found)))
            }
            "SCARD" => {
                call.arity(1, 1)?;
                Ok(count(self.set(&args[0])?.map_or(0, |s| s.len())))
            }
            _ => call.unknown(),
        }
    }
}
