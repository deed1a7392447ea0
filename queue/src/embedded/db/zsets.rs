//! Sorted-set commands: ZADD, ZREM, ZPOPMIN, ZCARD, ZSCORE, ZRANK, ZRANGE, ZRANGEBYSCORE and ZREVRANGEBYSCORE (the structure itself is `sorted_set`).

use super::args::{bound, bulk, count, float, format_score, index_range, integer};
use super::sorted_set::{Score, SortedSet, ZaddFlags, scored};
use super::{Call, CommandError, Data, Db, err};
use redis::Value;

impl Db {
    /// Runs `call`, one of this module's commands.
    pub(super) fn sorted_set_command(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        match call.name {
            "ZADD" => self.zadd(call),
            "ZREM" => {
                call.arity(2, 1)?;
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
            "ZPOPMIN" => self.zpopmin(call),
            "ZCARD" => {
                call.arity(1, 1)?;
                Ok(count(self.zset(&args[0])?.map_or(0, |z| z.len())))
            }
            "ZSCORE" => {
                call.arity(2, 1)?;
                Ok(self
                    .zset(&args[0])?
                    .and_then(|z| z.scores.get(&args[1]).copied())
                    .map_or(Value::Nil, |s| bulk(format_score(s).as_bytes())))
            }
            "ZRANK" => {
                call.arity(2, 1)?;
                let Some(z) = self.zset(&args[0])? else {
                    return Ok(Value::Nil);
                };
                let Some(&score) = z.scores.get(&args[1]) else {
                    return Ok(Value::Nil);
                };
                let rank = z.order.range(..(Score(score), args[1].clone())).count();
                Ok(count(rank))
            }
            "ZRANGE" => self.zrange(call),
            "ZRANGEBYSCORE" => self.zrangebyscore(call),
            "ZREVRANGEBYSCORE" => self.zrevrangebyscore(call),
            _ => call.unknown(),
        }
    }

    /// ZADD key [NX|XX] [GT|LT] [CH] score member …: recorded only when it wrote a member.
    fn zadd(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        call.arity(3, 1)?;
        let mut flags = ZaddFlags::default();
        let mut at = 1;
        while let Some(flag) = args.get(at).and_then(|a| flags.parse(a)) {
            flags = flag;
            at += 1;
        }
        let pairs = &args[at..];
        if pairs.is_empty() || !pairs.len().is_multiple_of(2) || (flags.nx && flags.xx) {
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
                Some(old) => !flags.nx && (!flags.gt || score > old) && (!flags.lt || score < old),
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

    /// ZPOPMIN key [count]: recorded as the ZREM of what it took.
    fn zpopmin(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
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

    /// ZRANGE key start stop [WITHSCORES], by rank.
    fn zrange(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        call.arity(3, 1)?;
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

    /// ZRANGEBYSCORE key min max [WITHSCORES] [LIMIT offset count].
    fn zrangebyscore(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        call.arity(3, 1)?;
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

    /// ZREVRANGEBYSCORE key max min [LIMIT offset count].
    fn zrevrangebyscore(&mut self, call: &Call<'_>) -> Result<Value, CommandError> {
        let args = call.args;
        call.arity(3, 1)?;
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
}
