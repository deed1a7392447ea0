//! DPO's loss on a step's preference pairs: from each sequence's log-probability under
//! the policy (this step's forward) and under the frozen reference, the loss, its
//! gradient with respect to every token's loss, and the figures TRL's `DPOTrainer`
//! logs. The same on both compute paths: each hands over the forward's per-token
//! losses and takes back per-token weights (see
//! `tuneq_kernels::llama::forward_backward_weighted`).
//!
//! A micro-batch holds `k` pairs as `2k` rows: the `k` preferred sequences, then the
//! `k` others in the same order (TRL's layout). A sequence's log-probability is minus
//! the sum of its row's token losses (only its answer's tokens carry one).

use tuneq_openapi::PreferenceMetrics;

/// Each pair's reference log-probabilities: the preferred sequence's, then the other's.
pub type PairLogps = [f64; 2];

/// A sequence's log-probability per row of a `rows × len` batch, from its per-position
/// losses `−log p(target)`.
pub fn row_logps(losses: &[f64], len: usize) -> Vec<f64> {
    losses
        .chunks(len.max(1))
        .map(|row| -row.iter().sum::<f64>())
        .collect()
}

/// DPO over one optimiser step: fed micro-batch by micro-batch, it keeps the step's
/// loss and figures.
#[derive(Debug, Clone)]
pub struct DpoStep {
    beta: f64,
    /// The step's pairs, over all its micro-batches: the loss is their mean.
    pairs: usize,
    sums: Sums,
}

/// Sums over the pairs seen so far.
#[derive(Debug, Clone, Default)]
struct Sums {
    loss: f64,
    rewards_chosen: f64,
    rewards_rejected: f64,
    correct: f64,
    logps_chosen: f64,
    logps_rejected: f64,
    seen: usize,
}

impl DpoStep {
    /// A step with `beta` over `pairs` pairs in all.
    pub fn new(beta: f64, pairs: usize) -> Self {
        Self {
            beta,
            pairs: pairs.max(1),
            sums: Sums::default(),
        }
    }

    /// The token weights of one micro-batch (`2k` rows of `len` positions, `reference`
    /// its `k` pairs'), given the forward's per-position losses: for a pair with
    /// `z = β·((π_c − ref_c) − (π_r − ref_r))` and loss `−log σ(z)`, the loss's
    /// gradient with respect to each token loss of the preferred row is
    /// `β·σ(−z)/pairs`, and its opposite on the other row. Records the pairs' loss and
    /// figures.
    pub fn weigh(&mut self, losses: &[f64], len: usize, reference: &[PairLogps]) -> Vec<f32> {
        let logps = row_logps(losses, len);
        let k = reference.len();
        let mut weights = vec![0f32; losses.len()];
        if logps.len() != 2 * k {
            // The kernels refuse the weights then: nothing is recorded.
            return Vec::new();
        }
        for (i, &reference) in reference.iter().enumerate() {
            let z = self.add_pair([logps[i], logps[k + i]], reference);
            // A whole row takes its sequence's weight: positions without a target
            // take no loss and no gradient whatever their weight.
            let w = (self.beta * sigmoid(-z) / self.pairs as f64) as f32;
            weights[i * len..(i + 1) * len].fill(w);
            weights[(k + i) * len..(k + i + 1) * len].fill(-w);
        }
        weights
    }

    /// Records one pair from its log-probabilities under the policy and the reference;
    /// returns `z`, the pair's scaled log-ratio difference (its loss is `−log σ(z)`).
    pub fn add_pair(&mut self, policy: PairLogps, reference: PairLogps) -> f64 {
        let [chosen, rejected] = policy;
        let reward_chosen = self.beta * (chosen - reference[0]);
        let reward_rejected = self.beta * (rejected - reference[1]);
        let z = reward_chosen - reward_rejected;
        let s = &mut self.sums;
        s.loss += softplus(-z);
        s.rewards_chosen += reward_chosen;
        s.rewards_rejected += reward_rejected;
        s.correct += f64::from(u8::from(reward_chosen > reward_rejected));
        s.logps_chosen += chosen;
        s.logps_rejected += rejected;
        s.seen += 1;
        z
    }

    /// The step's mean loss and figures over the pairs seen.
    pub fn finish(&self) -> (f64, PreferenceMetrics) {
        let s = &self.sums;
        let n = s.seen.max(1) as f64;
        (
            s.loss / n,
            PreferenceMetrics {
                rewards_chosen: s.rewards_chosen / n,
                rewards_rejected: s.rewards_rejected / n,
                rewards_accuracy: s.correct / n,
                rewards_margin: (s.rewards_chosen - s.rewards_rejected) / n,
                logps_chosen: s.logps_chosen / n,
                logps_rejected: s.logps_rejected / n,
            },
        )
    }
}

/// `log(1 + eˣ)` without overflow.
fn softplus(x: f64) -> f64 {
    if x > 0.0 {
        x + (-x).exp().ln_1p()
    } else {
        x.exp().ln_1p()
    }
}

/// `1 / (1 + e⁻ˣ)`.
fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weights are the loss's gradient with respect to each token loss, checked by
    /// central differences on the loss of one pair.
    #[test]
    fn the_weights_are_the_loss_s_gradient() {
        let len = 3;
        // Row 0 preferred, row 1 the other; the last position of each has no target.
        let losses = [0.7, 1.9, 0.0, 2.5, 0.4, 0.0];
        let reference = [[-2.0, -3.5]];
        let loss_of = |losses: &[f64]| {
            let mut step = DpoStep::new(0.3, 1);
            step.weigh(losses, len, &reference);
            step.finish().0
        };
        let mut step = DpoStep::new(0.3, 1);
        let weights = step.weigh(&losses, len, &reference);
        for (i, &w) in weights.iter().enumerate() {
            if losses[i] == 0.0 {
                continue;
            }
            let h = 1e-6;
            let (mut up, mut down) = (losses, losses);
            up[i] += h;
            down[i] -= h;
            let numeric = (loss_of(&up) - loss_of(&down)) / (2.0 * h);
            assert!((numeric - w as f64).abs() < 1e-6, "{i}: {numeric} vs {w}");
        }
        let (loss, m) = step.finish();
        // π_c = −2.6, π_r = −2.9: z = 0.3·((−2.6 + 2) − (−2.9 + 3.5)) = −0.36.
        assert!((loss - softplus(0.36)).abs() < 1e-12);
        assert!((m.rewards_chosen - 0.3 * -0.6).abs() < 1e-12);
        assert!((m.rewards_rejected - 0.3 * 0.6).abs() < 1e-12);
        assert_eq!(m.rewards_accuracy, 0.0);
        assert!((m.logps_chosen + 2.6).abs() < 1e-12);
    }

    #[test]
    fn the_loss_is_stable_far_from_zero() {
        assert!((softplus(800.0) - 800.0).abs() < 1e-9);
        assert!(softplus(-800.0) >= 0.0 && softplus(-800.0) < 1e-300);
        assert!(sigmoid(-800.0) >= 0.0 && sigmoid(800.0) == 1.0);
    }
}
