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
    let lens = examples.iter().map(|e| e.input_ids.len());
    let tokens: u64 = lens.clone().map(|l| l as u64).sum();
    let trained: Vec<usize> = examples.iter().map(Example::trained_tokens).collect();
    TokenStats {
        examples: examples.len(),
        tokens,
        trained_tokens: trained.iter().map(|&t| t as u64).sum(),
        min_len: lens.clone().min().unwrap_or(0),
        max_len: lens.max().unwrap_or(0),
        mean_len: if examples.is_empty() {
            0.0
        } else {
            tokens as f64 / examples.len() as f64
        },
        truncated,
        unlabelled: trained.iter().filter(|&&t| t == 0).count(),
    }
}
