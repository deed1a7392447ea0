//! Picking the next token from the model's logits: greedy at temperature 0, otherwise a
//! draw from the softmax at that temperature, cut to the nucleus of `top_p`, after
//! `logit_bias` and the presence and frequency penalties (OpenAI's definitions). The
//! draw comes from a ChaCha stream seeded per choice: the same seed and request give
//! the same tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// How a request wants its tokens picked.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 picks the most likely token; higher flattens the distribution.
    pub temperature: f32,
    /// Only the most likely tokens whose probabilities add up to this are drawn from.
    pub top_p: f32,
    /// Added to a token's logit (OpenAI's `logit_bias`, -100 … 100).
    pub logit_bias: HashMap<u32, f32>,
    /// Subtracted once from every token already generated.
    pub presence_penalty: f32,
    /// Subtracted per time a token was already generated.
    pub frequency_penalty: f32,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            logit_bias: HashMap::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl Sampling {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

/// One choice's sampler: its settings, its random stream and the counts of what it
/// generated (for the penalties).
#[derive(Debug)]
pub struct Sampler {
    sampling: Sampling,
    rng: ChaCha8Rng,
    generated: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler drawing from the stream of `seed`.
    pub fn new(sampling: Sampling, seed: u64) -> Self {
        Self {
            sampling,
            rng: ChaCha8Rng::seed_from_u64(seed),
            generated: HashMap::new(),
        }
    }

    /// The next token for `logits` (one per vocabulary entry), which it may adjust in place.
    pub fn pick(&mut self, logits: &mut [f32]) -> u32 {
        self.adjust(logits);
        let token = if self.sampling.temperature <= 0.0 {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        *self.generated.entry(token).or_default() += 1;
        token
    }

    /// Applies the bias and the penalties.
    fn adjust(&self, logits: &mut [f32]) {
        for (&token, &bias) in &self.sampling.logit_bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        let (presence, frequency) = (
            self.sampling.presence_penalty,
            self.sampling.frequency_penalty,
        );
        if presence != 0.0 || frequency != 0.0 {
            for (&token, &count) in &self.generated {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l -= presence + frequency * count as f32;
                }
            }
        }
    }

    /// A draw from the tempered softmax, within the `top_p` nucleus.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let t = self.sampling.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = logits.iter().map(|&l| ((l - max) / t).exp()).collect();
        let total: f32 = weights.iter().sum();
        if !(total.is_finite() && total > 0.0) {
            return argmax(logits);
        }
        let mut order: Vec<u32> = (0..weights.len() as u32).collect();
        let mut kept = weights.len();
        if self.sampling.top_p < 1.0 {
            // Most likely first; ties by id, so the cut is the same on every machine.
            order.sort_unstable_by(|&a, &b| {
                weights[b as usize]
                    .total_cmp(&weights[a as usize])
                    .then(a.cmp(&b))
            });
            let mut sum = 0.0;
            for (i, &id) in order.iter().enumerate() {
                sum += weights[id as usize] / total;
                if sum >= self.sampling.top_p {
                    kept = i + 1;
                    break;
                }
            }
        }
        let kept = &order[..kept.max(1)];
        let mass: f32 = kept.iter().map(|&id| weights[id as usize]).sum();
        let mut target = self.rng.random::<f32>() * mass;
        for &id in kept {
            target -= weights[id as usize];
            if target < 0.0 {
                return id;
            }
        }
        // Rounding left a sliver: the last token that has weight (never a masked one).
        kept.iter()
            .rev()
            .copied()
            .find(|&id| weights[id as usize] > 0.0)
            .unwrap_or_else(|| argmax(logits))
    }
}

/// The index of the largest logit (the first of equals, as PyTorch's `argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-probabilities of `logits` under their softmax.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_total = logits
        .iter()
        .map(|&l| ((l - max) as f64).exp())
        .sum::<f64>()
        .ln() as f32;
    logits.iter().map(|&l| l - max - log_total).collect()
}

/// The `k` most likely ids of `logprobs`, most likely first (ties by id).
pub fn top_k(logprobs: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut ids: Vec<u32> = (0..logprobs.len() as u32).collect();
    let k = k.min(ids.len());
    if k == 0 {
        return Vec::new();
    }
    let by_rank = |a: &u32, b: &u32| {
        logprobs[*b as usize]
            .total_cmp(&logprobs[*a as usize])
            .then(a.cmp(b))
    };
    ids.select_nth_unstable_by(k - 1, by_rank);
    ids.truncate(k);
    ids.sort_unstable_by(by_rank);
    ids.into_iter()
        .map(|id| (id, logprobs[id as usize]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![0.1, 2.0, -1.0, 1.5, 0.0, 1.9]
    }

    #[test]
    fn greedy_picks_the_largest_and_the_first_of_equals() {
        let mut s = Sampler::new(Sampling::greedy(), 0);
        assert_eq!(s.pick(&mut logits()), 1);
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens_and_another_seed_others() {
        let draw = |seed| {
            let mut s = Sampler::new(Sampling::default(), seed);
            (0..64).map(|_| s.pick(&mut logits())).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // At temperature 1 every token with weight is drawn now and then.
        let seen: std::collections::BTreeSet<u32> = draw(7).into_iter().collect();
        assert!(seen.len() >= 4, "{seen:?}");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let sampling = Sampling {
            top_p: 0.5,
            ..Sampling::default()
        };
        let mut s = Sampler::new(sampling, 3);
        for _ in 0..200 {
            // Tokens 1 (2.0) and 5 (1.9) hold over half of the mass between them.
            assert!(matches!(s.pick(&mut logits()), 1 | 5));
        }
    }

    #[test]
    fn bias_and_penalties_move_the_choice() {
        let sampling = Sampling {
            logit_bias: HashMap::from([(2, 100.0)]),
            ..Sampling::greedy()
        };
        assert_eq!(Sampler::new(sampling, 0).pick(&mut logits()), 2);
        let sampling = Sampling {
            frequency_penalty: 1.0,
            ..Sampling::greedy()
        };
        let mut s = Sampler::new(sampling, 0);
        assert_eq!(s.pick(&mut logits()), 1);
        // Token 1 was generated once: 2.0 − 1 falls behind 1.9.
        assert_eq!(s.pick(&mut logits()), 5);
    }

    #[test]
    fn a_masked_token_is_never_drawn() {
        let mut masked = logits();
        for l in masked.iter_mut().skip(2) {
            *l = f32::NEG_INFINITY;
        }
        for seed in 0..200 {
            let picked = Sampler::new(Sampling::default(), seed).pick(&mut masked.clone());
            assert!(picked < 2, "seed {seed} drew masked token {picked}");
        }
        assert_eq!(Sampler::new(Sampling::greedy(), 0).pick(&mut masked), 1);
    }

    #[test]
    fn logprobs_are_normalised_and_ranked() {
        let lp = log_softmax(&logits());
        let total: f64 = lp.iter().map(|&l| (l as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        let top = top_k(&lp, 3);
        assert_eq!(
            top.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            vec![1, 5, 3]
        );
        assert!(top_k(&lp, 0).is_empty());
        assert_eq!(top_k(&lp, 99).len(), 6);
    }
}
