//! List commands: RPUSH, LLEN, LRANGE and LTRIM.

use super::args::{bulk, count, index_range, integer};
use super::{Call, CommandError, Data, Db};
use redis::Value;
use std::collections::VecDeque;

impl Db {
    /// Runs `call`, one of this module's commands.
    pub(super) fn list_command(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        match call.name {
            "RPUSH" => {
                call.arity(2, 1)?;
                self.or_new(&args[0], || Data::List(VecDeque::new()))?;
                let l = self.list(&args[0])?.expect("just created");
                l.extend(args[1..].iter().cloned());
                let len = l.len();
                self.record([vec![b"RPUSH".to_vec()], args.to_vec()].concat());
                Ok(count(len))
            }
            "LLEN" => {
                call.arity(1, 1)?;
                Ok(count(self.list(&args[0])?.map_or(0, |l| l.len())))
            }
            "LRANGE" => {
                call.arity(3, 1)?;
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
                call.arity(3, 1)?;
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
            _ => call.unknown(),
        }
    }
}
