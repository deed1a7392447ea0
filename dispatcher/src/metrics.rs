//! The dispatcher's Prometheus metrics, per pool: attempts started, attempts ended by how
//! they ended (preemptions among them), attempts held now and how many of them are still
//! pending (placed, the trainer not started), and how long claimed jobs took to be
//! started on the runtime. Rendered in the text exposition format by
//! [`Metrics::render`]; `tuneq dispatcher --metrics-addr` serves it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counters and gauges shared by the dispatcher loops of one process.
#[derive(Debug, Clone, Default)]
pub struct Metrics(Arc<Mutex<Inner>>);

#[derive(Debug, Default)]
struct Inner {
    started: BTreeMap<String, u64>,
    ended: BTreeMap<(String, &'static str), u64>,
    running: BTreeMap<String, u64>,
    pending: BTreeMap<String, u64>,
    start_seconds: BTreeMap<String, (f64, u64)>,
    /// Pools whose loop has begun, and when each last finished a tick without error.
    ticks: BTreeMap<String, Option<Instant>>,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A panic while holding the lock leaves counters that are still counters.
        let mut inner = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut inner)
    }

    /// An attempt was started on `pool`, `took` after its job was claimed.
    pub fn started(&self, pool: &str, took: Duration) {
        self.with(|m| {
            *m.started.entry(pool.to_string()).or_default() += 1;
            let (sum, count) = m.start_seconds.entry(pool.to_string()).or_default();
            *sum += took.as_secs_f64();
            *count += 1;
        });
    }

    /// An attempt on `pool` ended as `end` (`finished`, `preempted`, `crashed`, …).
    pub fn ended(&self, pool: &str, end: &'static str) {
        self.with(|m| *m.ended.entry((pool.to_string(), end)).or_default() += 1);
    }

    /// `pool` runs `n` attempts now.
    pub fn running(&self, pool: &str, n: usize) {
        self.with(|m| {
            m.running.insert(pool.to_string(), n as u64);
        });
    }

    /// `n` of `pool`'s attempts are placed but their trainers not started yet.
    pub fn pending(&self, pool: &str, n: usize) {
        self.with(|m| {
            m.pending.insert(pool.to_string(), n as u64);
        });
    }

    /// `pool`'s control loop has begun (it is not ready until its first good tick).
    pub fn serving(&self, pool: &str) {
        self.with(|m| {
            m.ticks.entry(pool.to_string()).or_insert(None);
        });
    }

    /// `pool`'s control loop finished a tick without error.
    pub fn ticked(&self, pool: &str) {
        self.with(|m| {
            m.ticks.insert(pool.to_string(), Some(Instant::now()));
        });
    }

    /// Pools whose loop has not finished a good tick within `max_age` (its queue
    /// unreachable, its runtime failing, or not started yet), or `None` before any loop
    /// began: what readiness reports.
    pub fn stale_pools(&self, max_age: Duration) -> Option<Vec<String>> {
        self.with(|m| {
            if m.ticks.is_empty() {
                return None;
            }
            Some(
                m.ticks
                    .iter()
                    .filter(|(_, at)| at.is_none_or(|at| at.elapsed() > max_age))
                    .map(|(pool, _)| pool.clone())
                    .collect(),
            )
        })
    }

    /// The metrics in Prometheus's text format.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let label = |v: &str| v.replace('\\', "\\\\").replace('"', "\\\"");
        self.with(|m| {
            let mut out = String::new();
            let _ = writeln!(out, "# HELP tuneq_dispatcher_attempts_started_total Attempts started, per pool.");
            let _ = writeln!(out, "# TYPE tuneq_dispatcher_attempts_started_total counter");
            for (pool, n) in &m.started {
                let _ = writeln!(out, "tuneq_dispatcher_attempts_started_total{{pool=\"{}\"}} {n}", label(pool));
            }
            let _ = writeln!(out, "# HELP tuneq_dispatcher_attempts_ended_total Attempts ended, per pool and how (preempted counts preemptions).");
            let _ = writeln!(out, "# TYPE tuneq_dispatcher_attempts_ended_total counter");
            for ((pool, end), n) in &m.ended {
                let _ = writeln!(out, "tuneq_dispatcher_attempts_ended_total{{pool=\"{}\",end=\"{end}\"}} {n}", label(pool));
            }
            let _ = writeln!(out, "# HELP tuneq_dispatcher_attempts_running Attempts running (or placed and pending), per pool.");
            let _ = writeln!(out, "# TYPE tuneq_dispatcher_attempts_running gauge");
            for (pool, n) in &m.running {
                let _ = writeln!(out, "tuneq_dispatcher_attempts_running{{pool=\"{}\"}} {n}", label(pool));
            }
            let _ = writeln!(out, "# HELP tuneq_dispatcher_attempts_pending Attempts placed whose trainer has not started (no node yet, an image pulling), per pool.");
            let _ = writeln!(out, "# TYPE tuneq_dispatcher_attempts_pending gauge");
            for (pool, n) in &m.pending {
                let _ = writeln!(out, "tuneq_dispatcher_attempts_pending{{pool=\"{}\"}} {n}", label(pool));
            }
            let _ = writeln!(out, "# HELP tuneq_dispatcher_time_to_start_seconds From a job's claim to its attempt started on the runtime.");
            let _ = writeln!(out, "# TYPE tuneq_dispatcher_time_to_start_seconds summary");
            for (pool, (sum, count)) in &m.start_seconds {
                let _ = writeln!(out, "tuneq_dispatcher_time_to_start_seconds_sum{{pool=\"{}\"}} {sum}", label(pool));
                let _ = writeln!(out, "tuneq_dispatcher_time_to_start_seconds_count{{pool=\"{}\"}} {count}", label(pool));
            }
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_per_pool_and_end() {
        let m = Metrics::default();
        m.started("l4-spot", Duration::from_millis(1500));
        m.started("l4-spot", Duration::from_millis(500));
        m.ended("l4-spot", "preempted");
        m.ended("l4-spot", "preempted");
        m.ended("xeon", "finished");
        m.running("l4-spot", 1);
        m.pending("l4-spot", 1);
        let text = m.render();
        for line in [
            "tuneq_dispatcher_attempts_started_total{pool=\"l4-spot\"} 2",
            "tuneq_dispatcher_attempts_ended_total{pool=\"l4-spot\",end=\"preempted\"} 2",
            "tuneq_dispatcher_attempts_ended_total{pool=\"xeon\",end=\"finished\"} 1",
            "tuneq_dispatcher_attempts_running{pool=\"l4-spot\"} 1",
            "tuneq_dispatcher_attempts_pending{pool=\"l4-spot\"} 1",
            "tuneq_dispatcher_time_to_start_seconds_sum{pool=\"l4-spot\"} 2",
            "tuneq_dispatcher_time_to_start_seconds_count{pool=\"l4-spot\"} 2",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from:\n{text}"
            );
        }
    }

    #[test]
    fn pools_are_stale_until_a_good_tick_and_again_once_it_is_old() {
        let m = Metrics::default();
        assert_eq!(m.stale_pools(Duration::from_secs(30)), None);
        m.serving("a");
        m.serving("b");
        m.ticked("a");
        assert_eq!(
            m.stale_pools(Duration::from_secs(30)),
            Some(vec!["b".to_string()])
        );
        m.ticked("b");
        assert_eq!(m.stale_pools(Duration::from_secs(30)), Some(vec![]));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            m.stale_pools(Duration::from_millis(10)),
            Some(vec!["a".to_string(), "b".to_string()])
        );
    }
}
