//! Where a queued job stands: its place in its tenant's line, an estimate of the jobs
//! that run before it under fair share, and when it should start.
//!
//! A job's own rank is read exactly, on every call. The rest of the estimate depends
//! on the whole domain — the active tenants with their weights and waiting counts, the
//! pools with their capacity and average run time, the queue clock — which changes
//! slowly and costs two round trips to read. Those [`DomainFigures`] are kept per
//! process for [`FIGURES_MAX_AGE`], so a status page that clients poll costs the store
//! one round trip of plain reads, not a script: on Redis a Lua call that reads six keys
//! costs about ten times the reads themselves. A pool or tenant setting changed through
//! a queue drops its process's figures at once; other processes see it within the age.

use crate::Result;
use crate::model::Position;
use crate::reply::{number, strings, unsigned};
use redis::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How old the domain's figures in a position estimate may be.
pub(crate) const FIGURES_MAX_AGE: Duration = Duration::from_secs(1);

/// Active tenants an estimate looks at (the claim script's fair share looks at as many).
const TENANTS_CONSIDERED: usize = 64;

/// The domain-wide inputs of a position estimate, as read at one moment.
#[derive(Debug)]
pub(crate) struct DomainFigures {
    read_at: Instant,
    /// The queue clock (ms) when they were read.
    clock_ms: f64,
    /// Whether a test pinned the clock (it does not move with real time).
    pinned: bool,
    /// Active tenants: weight and jobs waiting.
    tenants: Vec<(String, f64, u64)>,
    /// Every pool: capacity and average run time (ms), once a job has finished there.
    pools: HashMap<String, (f64, Option<f64>)>,
}

impl DomainFigures {
    /// Jobs waiting in line (ready to be claimed), all tenants together.
    pub(crate) fn waiting(&self) -> u64 {
        self.tenants.iter().map(|(_, _, waiting)| waiting).sum()
    }
}

/// The latest [`DomainFigures`] of one domain, shared by a process's clones of a queue.
#[derive(Debug, Default)]
pub(crate) struct FiguresCache {
    latest: Mutex<Option<Arc<DomainFigures>>>,
}

impl FiguresCache {
    /// The kept figures, unless they are older than `max_age`.
    pub(crate) fn fresh(&self, max_age: Duration) -> Option<Arc<DomainFigures>> {
        let latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
        latest
            .as_ref()
            .filter(|f| f.read_at.elapsed() <= max_age)
            .cloned()
    }

    /// Drops the kept figures (a setting they depend on changed here).
    pub(crate) fn forget(&self) {
        *self.latest.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Keeps `figures` as the latest.
    pub(crate) fn keep(&self, figures: Arc<DomainFigures>) {
        *self.latest.lock().unwrap_or_else(|e| e.into_inner()) = Some(figures);
    }
}

/// The first read of the figures: the active tenants, the pools and the clock.
pub(crate) fn first_read(prefix: &str, meta: &str) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.cmd("ZRANGE")
        .arg(format!("{prefix}tenants"))
        .arg(0)
        .arg(TENANTS_CONSIDERED - 1)
        .cmd("SMEMBERS")
        .arg(format!("{prefix}pools"))
        .cmd("HMGET")
        .arg(meta)
        .arg("clock_offset")
        .arg("clock")
        .arg("clock_pinned")
        .cmd("TIME");
    pipe
}

/// What the first read found, and the second read it calls for: each tenant's weight
/// and waiting jobs, and each pool's capacity and average run time.
pub(crate) struct FirstRead {
    read_at: Instant,
    clock_ms: f64,
    pinned: bool,
    tenants: Vec<String>,
    pools: Vec<String>,
}

impl FirstRead {
    /// Parses the reply to [`first_read`].
    pub(crate) fn parse(reply: &[Value]) -> Result<Self> {
        let clock = match reply.get(2) {
            Some(Value::Array(fields)) => fields.as_slice(),
            _ => &[],
        };
        let time = strings(reply.get(3))?;
        let seconds: f64 = time.first().and_then(|t| t.parse().ok()).unwrap_or(0.0);
        let micros: f64 = time.get(1).and_then(|t| t.parse().ok()).unwrap_or(0.0);
        // A clock pinned by a test moves only when the test advances it.
        let pinned = number(clock.get(2))?;
        let base = pinned.unwrap_or(seconds * 1000.0 + (micros / 1000.0).floor());
        let ms = base + number(clock.first())?.unwrap_or(0.0);
        Ok(Self {
            read_at: Instant::now(),
            // The queue clock never goes back: its high-water mark wins.
            clock_ms: ms.max(number(clock.get(1))?.unwrap_or(0.0)),
            pinned: pinned.is_some(),
            tenants: strings(reply.first())?,
            pools: strings(reply.get(1))?,
        })
    }

    /// The second read.
    pub(crate) fn second_read(&self, prefix: &str) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        for tenant in &self.tenants {
            pipe.cmd("HGET")
                .arg(format!("{prefix}tenant:{tenant}"))
                .arg("weight")
                .cmd("ZCARD")
                .arg(format!("{prefix}ready:{tenant}"));
        }
        for pool in &self.pools {
            pipe.cmd("HMGET")
                .arg(format!("{prefix}pool:{pool}"))
                .arg("capacity")
                .arg("avg_run_ms");
        }
        pipe
    }

    /// Whether there is anything to read a second time.
    pub(crate) fn needs_second_read(&self) -> bool {
        !self.tenants.is_empty() || !self.pools.is_empty()
    }

    /// The figures, from the reply to [`Self::second_read`].
    pub(crate) fn finish(self, reply: &[Value]) -> Result<DomainFigures> {
        let mut tenants = Vec::with_capacity(self.tenants.len());
        for (i, tenant) in self.tenants.into_iter().enumerate() {
            let weight = number(reply.get(2 * i))?.unwrap_or(1.0);
            let waiting = unsigned(reply.get(2 * i + 1))?;
            tenants.push((tenant, weight, waiting));
        }
        let offset = 2 * tenants.len();
        let mut pools = HashMap::with_capacity(self.pools.len());
        for (i, pool) in self.pools.into_iter().enumerate() {
            if let Some(Value::Array(fields)) = reply.get(offset + i)
                && let Some(capacity) = number(fields.first())?
            {
                pools.insert(pool, (capacity, number(fields.get(1))?));
            }
        }
        Ok(DomainFigures {
            read_at: self.read_at,
            clock_ms: self.clock_ms,
            pinned: self.pinned,
            tenants,
            pools,
        })
    }
}

/// Reads one job's place: its hash (HGETALL), its rank in `tenant`'s line and that
/// tenant's weight.
pub(crate) fn job_read(prefix: &str, id: &str, tenant: &str) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.cmd("HGETALL")
        .arg(format!("{prefix}job:{id}"))
        .cmd("ZRANK")
        .arg(format!("{prefix}ready:{tenant}"))
        .arg(id)
        .cmd("HGET")
        .arg(format!("{prefix}tenant:{tenant}"))
        .arg("weight");
    pipe
}

impl DomainFigures {
    /// The standing of the job ranked `rank` (0: next) in `tenant`'s line, whose tenant
    /// weighs `own_weight`, allowed on `pools` (empty: any): jobs of its own tenant in
    /// front of it, plus what each other active tenant gets first under the weights
    /// (the fair share claims follow); the start spreads those over the capacity of its
    /// pools at their average run time, unknown until a job has finished on one.
    pub(crate) fn estimate(
        &self,
        tenant: &str,
        own_weight: f64,
        rank: u64,
        pools: &[String],
    ) -> Position {
        let own_weight = if own_weight > 0.0 { own_weight } else { 1.0 };
        let mut ahead = rank as f64;
        for (other, weight, waiting) in &self.tenants {
            if other != tenant {
                let share = ((rank + 1) as f64 * weight / own_weight).ceil();
                ahead += (*waiting as f64).min(share);
            }
        }
        let (mut capacity, mut weighted) = (0.0, 0.0);
        let mut count = |name: &String| {
            if let Some((cap, Some(avg))) = self.pools.get(name) {
                capacity += cap;
                weighted += cap * avg;
            }
        };
        if pools.is_empty() {
            self.pools.keys().for_each(&mut count);
        } else {
            pools.iter().for_each(&mut count);
        }
        let estimated_start_ms = (capacity > 0.0).then(|| {
            let since_read = if self.pinned {
                0.0
            } else {
                self.read_at.elapsed().as_millis() as f64
            };
            let now = self.clock_ms + since_read;
            // Everyone ahead runs in waves of `capacity`; this job starts after the
            // waves before it.
            let average = weighted / capacity;
            (now + ((ahead / capacity).floor() * average).floor()) as u64
        });
        Position {
            ahead_in_tenant: rank,
            ahead: ahead as u64,
            estimated_start_ms,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn figures(tenants: &[(&str, f64, u64)], pools: &[(&str, f64, Option<f64>)]) -> DomainFigures {
        DomainFigures {
            read_at: Instant::now(),
            clock_ms: 1_000_000.0,
            pinned: false,
            tenants: tenants
                .iter()
                .map(|(t, w, n)| (t.to_string(), *w, *n))
                .collect(),
            pools: pools
                .iter()
                .map(|(p, c, a)| (p.to_string(), (*c, *a)))
                .collect(),
        }
    }

    #[test]
    fn other_tenants_count_by_their_weight_and_what_they_have_waiting() {
        let f = figures(&[("a", 1.0, 5), ("b", 2.0, 10), ("c", 1.0, 1)], &[]);
        // Rank 2 in a's line: 3 turns of a's; b gets twice as many, c has only 1.
        let p = f.estimate("a", 1.0, 2, &[]);
        assert_eq!((p.ahead_in_tenant, p.ahead), (2, 2 + 6 + 1));
        assert_eq!(p.estimated_start_ms, None, "no run time known yet");
    }

    #[test]
    fn the_start_spreads_the_jobs_ahead_over_the_pools_capacity() {
        let f = figures(
            &[("a", 1.0, 4), ("b", 1.0, 4)],
            &[("gpu", 2.0, Some(10_000.0)), ("cpu", 8.0, None)],
        );
        let p = f.estimate("a", 1.0, 3, &["gpu".to_string()]);
        assert_eq!(p.ahead, 3 + 4);
        // 7 ahead on 2 slots: 3 waves of 10 s before this job's.
        let wait = p.estimated_start_ms.unwrap() as f64 - 1_000_000.0;
        assert!((30_000.0..30_500.0).contains(&wait), "{wait}");
    }
}
