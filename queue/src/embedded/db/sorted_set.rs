//! Redis's sorted set, as the embedded store holds one: members ordered by (score,
//! member), with ZADD's options and the reply shape of a range.

use super::args::{bulk, format_score};
use redis::Value;
use std::collections::{BTreeSet, HashMap};

/// ZADD's leading options.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ZaddFlags {
    pub(super) nx: bool,
    pub(super) xx: bool,
    pub(super) gt: bool,
    pub(super) lt: bool,
    pub(super) ch: bool,
}

impl ZaddFlags {
    /// These flags plus `arg`, or None when `arg` is not a flag (the scores begin).
    pub(super) fn parse(self, arg: &[u8]) -> Option<Self> {
        let mut next = self;
        match arg.to_ascii_uppercase().as_slice() {
            b"NX" => next.nx = true,
            b"XX" => next.xx = true,
            b"GT" => next.gt = true,
            b"LT" => next.lt = true,
            b"CH" => next.ch = true,
            _ => return None,
        }
        Some(next)
    }
}

/// A sorted set: members ordered by (score, member), as Redis orders them.
#[derive(Debug, Default, Clone)]
pub(super) struct SortedSet {
    pub(super) scores: HashMap<Vec<u8>, f64>,
    pub(super) order: BTreeSet<(Score, Vec<u8>)>,
}

/// A score with the total order Redis uses (scores are never NaN).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Score(pub(super) f64);

impl Eq for Score {}
impl PartialOrd for Score {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Score {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl SortedSet {
    /// Adds or moves a member; true when it is new.
    pub(super) fn insert(&mut self, member: Vec<u8>, score: f64) -> bool {
        let old = self.scores.insert(member.clone(), score);
        if let Some(old) = old {
            self.order.remove(&(Score(old), member.clone()));
        }
        self.order.insert((Score(score), member));
        old.is_none()
    }

    pub(super) fn remove(&mut self, member: &[u8]) -> bool {
        match self.scores.remove(member) {
            Some(score) => {
                self.order.remove(&(Score(score), member.to_vec()));
                true
            }
            None => false,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.scores.len()
    }
}

/// A range's reply: each member, followed by its score with WITHSCORES.
pub(super) fn scored<'a>(
    picked: impl Iterator<Item = &'a (Score, Vec<u8>)>,
    with_scores: bool,
) -> Vec<Value> {
    let mut out = Vec::new();
    for (score, member) in picked {
        out.push(bulk(member));
        if with_scores {
            out.push(bulk(format_score(score.0).as_bytes()));
        }
    }
    out
}
