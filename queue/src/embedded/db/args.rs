//! Reading a command's arguments and writing its replies the way Redis does: numbers,
//! score bounds, index ranges, glob patterns, bulk strings and counts.

use super::{CommandError, err};
use redis::Value;

/// An argument as UTF-8 text.
pub(super) fn text(arg: &[u8]) -> Result<&str, CommandError> {
    std::str::from_utf8(arg).or_else(|_| err("ERR value is not valid UTF-8"))
}

/// An integer argument, refused with Redis's message when it is not one.
pub(super) fn integer(arg: &[u8]) -> Result<i64, CommandError> {
    text(arg)?
        .parse::<i64>()
        .or_else(|_| err("ERR value is not an integer or out of range"))
}

/// A float argument (`inf`, `-inf` included), refused with Redis's message when it is
/// not one.
pub(super) fn float(arg: &[u8]) -> Result<f64, CommandError> {
    let s = text(arg)?;
    let v = match s.to_ascii_lowercase().as_str() {
        "inf" | "+inf" => f64::INFINITY,
        "-inf" => f64::NEG_INFINITY,
        _ => s
            .parse::<f64>()
            .or_else(|_| err("ERR value is not a valid float"))?,
    };
    if v.is_nan() {
        return err("ERR value is not a valid float");
    }
    Ok(v)
}

/// A score bound of ZRANGEBYSCORE: `5`, `(5` (exclusive), `-inf`, `+inf`.
pub(super) fn bound(arg: &[u8]) -> Result<(f64, bool), CommandError> {
    match arg.strip_prefix(b"(") {
        Some(rest) => Ok((float(rest)?, true)),
        None => Ok((float(arg)?, false)),
    }
}

/// Formats a score the way Redis replies with one (shortest exact form).
pub fn format_score(v: f64) -> String {
    if v == f64::INFINITY {
        "inf".into()
    } else if v == f64::NEG_INFINITY {
        "-inf".into()
    } else {
        format!("{v}")
    }
}

/// A bulk-string reply.
pub(super) fn bulk(b: &[u8]) -> Value {
    Value::BulkString(b.to_vec())
}

/// An integer reply counting `n` things.
pub(super) fn count(n: usize) -> Value {
    Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
}

/// Resolves Redis's inclusive, possibly negative `start..=stop` over `len` items.
pub(super) fn index_range(len: usize, start: i64, stop: i64) -> Option<(usize, usize)> {
    let len = i64::try_from(len).ok()?;
    let start = if start < 0 {
        (len + start).max(0)
    } else {
        start
    };
    let stop = if stop < 0 {
        len + stop
    } else {
        stop.min(len - 1)
    };
    if start > stop || start >= len || stop < 0 {
        return None;
    }
    Some((usize::try_from(start).ok()?, usize::try_from(stop).ok()?))
}

/// Redis's glob matching for KEYS/SCAN (`*`, `?`, `[abc]`, `\x`).
pub(super) fn glob(pattern: &[u8], s: &[u8]) -> bool {
    match pattern.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((b'?', rest)) => !s.is_empty() && glob(rest, &s[1..]),
        Some((b'[', rest)) => {
            let Some(close) = rest.iter().position(|&c| c == b']') else {
                return s.first() == Some(&b'[') && glob(rest, &s[1..]);
            };
            let (class, after) = (&rest[..close], &rest[close + 1..]);
            match s.split_first() {
                Some((c, tail)) => class.contains(c) && glob(after, tail),
                None => false,
            }
        }
        Some((b'\\', rest)) if !rest.is_empty() => {
            s.first() == Some(&rest[0]) && glob(&rest[1..], &s[1..])
        }
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}
