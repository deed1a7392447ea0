//! Token statistics of an encoded dataset, shown to users at upload and in run manifests.

use super::encoder::Example;

/// Size of a tokenized dataset.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenStats {
    /// Number of examples.
    pub examples: usize,
    /// Tokens over all examples (after truncation).
    pub tokens: u64,
    /// Tokens that carry a loss.
    pub trained_tokens: u64,
    /// Shortest example, in tokens (0 for an empty dataset).
    pub min_len: usize,
    /// Longest example, in tokens.
    pub max_len: usize,
    /// Mean example length, in tokens (0 for an empty dataset).
    pub mean_len: f64,
    /// Examples cut at `max_seq_len`.
    pub truncated: usize,
    /// Examples with no labelled token (nothing to learn from, e.g. the answer was truncated away).
    pub unlabelled: usize,
}

/// Computes [`TokenStats`]; `truncated` comes from [`super::Encoder::encode_all`].
pub fn token_stats(examples: &[Example], truncated: usize) -> TokenStats {
    let mut counter = TokenCounter::default();
    for example in examples {
        counter.add(example, false);
    }
    let mut stats = counter.stats();
    stats.truncated = truncated;
    stats
}

/// [`TokenStats`] built one example at a time, so a dataset's statistics never need all
/// of its examples in memory at once.
#[derive(Debug, Clone, Default)]
pub struct TokenCounter {
    stats: Option<TokenStats>,
}

impl TokenCounter {
    /// Counts `example`; `truncated` says it was cut at the sequence length.
    pub fn add(&mut self, example: &Example, truncated: bool) {
        let len = example.input_ids.len();
        let trained = example.trained_tokens();
        let s = self.stats.get_or_insert(TokenStats {
            examples: 0,
            tokens: 0,
            trained_tokens: 0,
            min_len: len,
            max_len: len,
            mean_len: 0.0,
            truncated: 0,
            unlabelled: 0,
        });
        s.examples += 1;
        s.tokens += len as u64;
        s.trained_tokens += trained as u64;
        s.min_len = s.min_len.min(len);
        s.max_len = s.max_len.max(len);
        s.truncated += usize::from(truncated);
        s.unlabelled += usize::from(trained == 0);
    }

    /// The statistics of every example counted so far.
    pub fn stats(&self) -> TokenStats {
        let mut stats = self.stats.clone().unwrap_or(TokenStats {
            examples: 0,
            tokens: 0,
            trained_tokens: 0,
            min_len: 0,
            max_len: 0,
            mean_len: 0.0,
            truncated: 0,
            unlabelled: 0,
        });
        if stats.examples > 0 {
            stats.mean_len = stats.tokens as f64 / stats.examples as f64;
        }
        stats
    }
}
