//! Learning-rate schedules with Hugging Face's semantics (`get_*_schedule_with_warmup`).

use tuneq_openapi::Scheduler;

/// Maps an optimiser step to its learning rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub peak: f64,
    /// Linear warmup steps from 0.
    pub warmup: u64,
    /// Total optimiser steps of the run.
    pub total: u64,
    /// Shape after warmup.
    pub kind: Scheduler,
}

impl LrSchedule {
    /// The rate for the update made after `completed` steps (0 for the first update).
    pub fn lr_at(&self, completed: u64) -> f64 {
        let s = completed as f64;
        if completed < self.warmup {
            return self.peak * s / (self.warmup.max(1) as f64);
        }
        let decay_steps = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = (s - self.warmup as f64) / decay_steps;
        match self.kind {
            Scheduler::Constant => self.peak,
            Scheduler::Linear => self.peak * (1.0 - progress).max(0.0),
            Scheduler::Cosine => {
                self.peak
                    * (0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())).max(0.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay_like_transformers() {
        let s = LrSchedule {
            peak: 1.0,
            warmup: 2,
            total: 10,
            kind: Scheduler::Linear,
        };
        let lrs: Vec<f64> = (0..10).map(|i| s.lr_at(i)).collect();
        assert_eq!(lrs[0], 0.0);
        assert_eq!(lrs[1], 0.5);
        assert_eq!(lrs[2], 1.0);
        assert!((lrs[6] - 0.5).abs() < 1e-12);
        let c = LrSchedule {
            kind: Scheduler::Cosine,
            ..s
        };
        assert!((c.lr_at(6) - 0.5).abs() < 1e-12);
        assert_eq!(
            LrSchedule {
                kind: Scheduler::Constant,
                ..s
            }
            .lr_at(9),
            1.0
        );
    }
}
