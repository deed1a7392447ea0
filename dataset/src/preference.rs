//! Preference pairs as DPO trains on them: the prompt, and each answer's tokens after it.

use crate::encoder::{Conversation, Encoder, Example, IGNORE_INDEX};
use crate::record::Record;
use crate::{DataError, Result};

/// A preference pair's two sequences, each the prompt followed by one answer, with
/// labels on the answer's tokens only (as [`Example::labels`]: the token's own id where
/// the loss is taken, [`IGNORE_INDEX`] elsewhere).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedPair {
    /// The prompt and the preferred answer.
    pub chosen: Example,
    /// The prompt and the other answer.
    pub rejected: Example,
    /// Whether either sequence was longer than the length kept.
    pub truncated: bool,
}

impl EncodedPair {
    /// Whether both answers keep a labelled token: a pair without one teaches nothing.
    pub fn is_trainable(&self) -> bool {
        self.chosen.trained_tokens() > 0 && self.rejected.trained_tokens() > 0
    }
}

impl Encoder {
    /// Tokenises a preference record as TRL's `DPOTrainer` does a conversational pair:
    /// the prompt rendered with the generation prompt, and the prompt followed by each
    /// answer rendered whole; each answer's tokens are those after the longest start the
    /// prompt's tokens share with both sequences (where the template renders the prompt
    /// alone as it renders it before an answer, and no token spans the boundary, that is
    /// the whole prompt). Every token after it is trained on, the end-of-turn tokens the
    /// template writes after the answer included. Each sequence keeps its first
    /// `max_seq_len` tokens.
    ///
    /// # Errors
    /// [`DataError::Template`] when the template cannot render the conversation, or the
    /// record is not a preference pair; [`DataError::Tokenizer`] when tokenising fails.
    pub fn encode_pair(&self, record: &Record, max_seq_len: usize) -> Result<EncodedPair> {
        let Record::Preference {
            messages,
            tools,
            preferred,
            rejected,
        } = record
        else {
            return Err(DataError::Template(format!(
                "a {:?} record is not a preference pair",
                record.format()
            )));
        };
        let with = |answer: Option<&crate::chat::Message>| -> Conversation {
            let mut turns = messages.clone();
            turns.extend(answer.cloned());
            self.with_tools(turns, tools)
        };
        let prompt = self.tokens(&with(None).render(self.template(), true)?)?;
        let chosen = self.tokens(&with(Some(preferred)).render(self.template(), false)?)?;
        let rejected = self.tokens(&with(Some(rejected)).render(self.template(), false)?)?;
        let shared = common_prefix(&prompt, &chosen).min(common_prefix(&prompt, &rejected));
        let truncated = chosen.len().max(rejected.len()) > max_seq_len;
        Ok(EncodedPair {
            chosen: answer_after(&chosen, shared, max_seq_len),
            rejected: answer_after(&rejected, shared, max_seq_len),
            truncated,
        })
    }

    /// The ids of `text`, without special tokens added (the template writes its own).
    fn tokens(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer()
            .encode(text, false)
            .map_err(|e| DataError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }
}

/// How many leading ids `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The first `keep` of `ids`, labelled from position `from` on.
fn answer_after(ids: &[u32], from: usize, keep: usize) -> Example {
    let ids = &ids[..ids.len().min(keep)];
    Example {
        input_ids: ids.to_vec(),
        labels: ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                if i < from {
                    IGNORE_INDEX
                } else {
                    i64::from(id)
                }
            })
            .collect(),
    }
}
