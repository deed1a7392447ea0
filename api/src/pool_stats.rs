//! What the API learns about each node pool from the trainers' own reports: the tokens per
//! second attempts reach there, which job estimates use in place of the pools file's
//! figure once measured, and the steps attempts there had to train again (the work
//! preemptions and crashes cost).
//!
//! Kept per API process, only for pools of the pools file (so report contents cannot grow
//! it), and learned afresh after a restart: until a pool's first report, estimates use the
//! file's `tokens_per_second`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use tuneq_pools::PoolsFile;

/// Weight of the newest speed sample in the running average: a pool's figure follows
/// a change of hardware or image within a few reports, and one odd sample moves it little.
const SPEED_WEIGHT: f64 = 0.2;

#[derive(Debug, Default, Clone, Copy)]
struct PoolFigures {
    tokens_per_second: Option<f64>,
    lost_steps: u64,
}

/// Figures per pool, shared by the API's handlers.
#[derive(Debug, Default)]
pub struct PoolStats(Mutex<BTreeMap<String, PoolFigures>>);

impl PoolStats {
    /// Figures for the pools of `file`, none measured yet.
    pub fn new(file: &PoolsFile) -> Self {
        Self(Mutex::new(
            file.pools
                .iter()
                .map(|p| (p.name.clone(), PoolFigures::default()))
                .collect(),
        ))
    }

    fn with<R>(&self, pool: &str, f: impl FnOnce(&mut PoolFigures) -> R) -> Option<R> {
        let mut pools = self.0.lock().unwrap_or_else(|e| e.into_inner());
        pools.get_mut(pool).map(f)
    }

    /// An attempt on `pool` reports `tokens_per_second` (ignored unless finite and > 0).
    pub fn observe_speed(&self, pool: &str, tokens_per_second: f64) {
        if !(tokens_per_second.is_finite() && tokens_per_second > 0.0) {
            return;
        }
        self.with(pool, |f| {
            f.tokens_per_second = Some(match f.tokens_per_second {
                Some(old) => old + SPEED_WEIGHT * (tokens_per_second - old),
                None => tokens_per_second,
            });
        });
    }

    /// An attempt on `pool` resumed `steps` behind where the last one got.
    pub fn lost(&self, pool: &str, steps: u64) {
        self.with(pool, |f| f.lost_steps = f.lost_steps.saturating_add(steps));
    }

    /// `pool`'s measured tokens per second, once reported.
    pub fn speed(&self, pool: &str) -> Option<f64> {
        self.with(pool, |f| f.tokens_per_second).flatten()
    }

    /// The Prometheus text of the figures.
    pub fn render(&self, out: &mut String, label: impl Fn(&str) -> String) {
        use std::fmt::Write;
        let pools = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(
            out,
            "# HELP tuneq_pool_tokens_per_second Training speed attempts report on a pool (running average), used for estimates."
        );
        let _ = writeln!(out, "# TYPE tuneq_pool_tokens_per_second gauge");
        for (pool, f) in pools.iter() {
            if let Some(tps) = f.tokens_per_second {
                let _ = writeln!(
                    out,
                    "tuneq_pool_tokens_per_second{{pool=\"{}\"}} {tps}",
                    label(pool)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP tuneq_lost_steps_total Steps trained again because an attempt on the pool ended past its last checkpoint."
        );
        let _ = writeln!(out, "# TYPE tuneq_lost_steps_total counter");
        for (pool, f) in pools.iter() {
            let _ = writeln!(
                out,
                "tuneq_lost_steps_total{{pool=\"{}\"}} {}",
                label(pool),
                f.lost_steps
            );
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn stats() -> PoolStats {
        PoolStats::new(&PoolsFile::from_shorthand(&[("cpu".into(), "cpu".into())], None).unwrap())
    }

    #[test]
    fn speeds_are_averaged_and_only_known_pools_kept() {
        let s = stats();
        assert_eq!(s.speed("cpu"), None);
        s.observe_speed("cpu", 100.0);
        assert_eq!(s.speed("cpu"), Some(100.0));
        s.observe_speed("cpu", 200.0);
        assert_eq!(s.speed("cpu"), Some(120.0));
        s.observe_speed("cpu", f64::NAN);
        s.observe_speed("cpu", -5.0);
        assert_eq!(s.speed("cpu"), Some(120.0));
        s.observe_speed("made-up", 1.0);
        s.lost("made-up", 7);
        s.lost("cpu", 7);
        let mut text = String::new();
        s.render(&mut text, str::to_string);
        assert!(!text.contains("made-up"), "{text}");
        assert!(
            text.contains("tuneq_lost_steps_total{pool=\"cpu\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("tuneq_pool_tokens_per_second{pool=\"cpu\"} 120"),
            "{text}"
        );
    }
}
