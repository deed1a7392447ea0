//! The model's vocabulary as the grammar engine needs it: each token's bytes, in a trie.
//!
//! A JSON grammar is matched on bytes, so every token id needs the bytes it stands for.
//! Byte-level vocabularies (GPT-2's, Llama 3's, Qwen's, SmolLM's) spell bytes with a
//! printable alphabet, mapped back here; SentencePiece vocabularies with byte fallback
//! (Llama 2's, Mistral's) spell a space as `▁` and odd bytes as `<0xAB>`. Special tokens
//! are marked so the grammar never matches them as text; the model's end-of-turn ids
//! count as its end of sequence.

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tokenizers::{DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

/// Why a vocabulary cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum VocabularyError {
    /// Its decoder is neither byte-level nor byte fallback.
    #[error(
        "the tokenizer spells tokens in a way constrained decoding does not read (its decoder is neither ByteLevel nor ByteFallback)"
    )]
    UnknownSpelling,
    /// The tokenizer cannot be adjusted.
    #[error("the tokenizer cannot be prepared for constrained decoding: {0}")]
    Tokenizer(String),
    /// The model has no end-of-sequence token.
    #[error("the model has no end-of-sequence token")]
    NoEndToken,
}

/// A grammar engine's view of the tokenizer: the byte trie, and a copy of the
/// tokenizer that tokenizes text the grammar forces without adding a leading space.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl Vocabulary {
    fn encode(&self, bytes: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(bytes);
        self.tokenizer
            .encode(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(bytes, |b| self.encode(b.as_bytes()))
    }

    fn tokenize_bytes_special(&self, bytes: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(bytes, |b| {
            self.trie
                .tokenize_with_special(b, |b| self.encode(b.as_bytes()))
        })
    }
}

/// How the vocabulary spells bytes, read from the tokenizer's decoder.
#[derive(Debug, Default)]
struct Spelling {
    byte_level: bool,
    byte_fallback: bool,
    /// The character a SentencePiece vocabulary writes for a space.
    space: Option<char>,
}

impl Spelling {
    fn read(decoder: &DecoderWrapper, into: &mut Spelling) {
        match decoder {
            DecoderWrapper::ByteLevel(_) => into.byte_level = true,
            DecoderWrapper::ByteFallback(_) => into.byte_fallback = true,
            DecoderWrapper::Replace(replace) if replace.content == " " => {
                // The pattern is private; its serialised form says it.
                let pattern = serde_json::to_value(replace).ok();
                let pattern = pattern
                    .as_ref()
                    .and_then(|v| v.pointer("/pattern/String"))
                    .and_then(serde_json::Value::as_str);
                let mut chars = pattern.unwrap_or_default().chars();
                if let (Some(c), None) = (chars.next(), chars.next()) {
                    into.space = Some(c);
                }
            }
            DecoderWrapper::Sequence(seq) => {
                for d in seq.get_decoders() {
                    Self::read(d, into);
                }
            }
            _ => {}
        }
    }
}

/// The byte each character of GPT-2's byte-level alphabet stands for.
fn byte_level_alphabet() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(shifted).unwrap_or(char::REPLACEMENT_CHARACTER);
                shifted += 1;
                (c, b)
            }
        })
        .collect()
}

/// The tokenizer without what adds a leading space to text (SentencePiece's prepend
/// normaliser, Metaspace's prefix): forced text is a continuation, not a new text.
fn continuation_tokenizer(tokenizer: &Tokenizer) -> Result<Tokenizer, VocabularyError> {
    fn without_prepend(n: NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(seq) => {
                let kept: Vec<_> = seq
                    .as_ref()
                    .iter()
                    .filter_map(|n| without_prepend(n.clone()))
                    .collect();
                (!kept.is_empty()).then(|| {
                    NormalizerWrapper::Sequence(tokenizers::normalizers::Sequence::new(kept))
                })
            }
            n => Some(n),
        }
    }
    fn never_prefix(p: PreTokenizerWrapper) -> PreTokenizerWrapper {
        use tokenizers::pre_tokenizers::{metaspace::PrependScheme, sequence::Sequence};
        match p {
            PreTokenizerWrapper::Metaspace(mut m) => {
                m.prepend_scheme = PrependScheme::Never;
                PreTokenizerWrapper::Metaspace(m)
            }
            PreTokenizerWrapper::Sequence(seq) => PreTokenizerWrapper::Sequence(Sequence::new(
                seq.as_ref()
                    .iter()
                    .map(|p| never_prefix(p.clone()))
                    .collect(),
            )),
            p => p,
        }
    }
    let mut copy = tokenizer.clone();
    if let Some(n) = copy.get_normalizer().cloned() {
        copy.with_normalizer(without_prepend(n))
            .map_err(|e| VocabularyError::Tokenizer(e.to_string()))?;
    }
    if let Some(p) = copy.get_pre_tokenizer().cloned() {
        copy.with_pre_tokenizer(Some(never_prefix(p)));
    }
    Ok(copy)
}

/// The grammar engine's vocabulary for `tokenizer`, `width` ids wide (the logits' row;
/// ids past the tokenizer's are padding the grammar never allows), ending at any of
/// `end_ids`.
pub(super) fn token_env(
    tokenizer: &Tokenizer,
    end_ids: &[u32],
    width: usize,
) -> Result<TokEnv, VocabularyError> {
    let tokenizer = continuation_tokenizer(tokenizer)?;
    let mut spelling = Spelling::default();
    if let Some(decoder) = tokenizer.get_decoder() {
        Spelling::read(decoder, &mut spelling);
    }
    if !spelling.byte_level && !spelling.byte_fallback {
        return Err(VocabularyError::UnknownSpelling);
    }
    let known = tokenizer.get_vocab_size(true);
    let width = width.max(known);
    let mut bytes: Vec<Vec<u8>> = vec![Vec::new(); width];
    let mut special = HashSet::new();
    for (id, token) in tokenizer.get_added_tokens_decoder() {
        if token.special || (token.content.starts_with('<') && token.content.ends_with('>')) {
            special.insert(id);
        } else if let Some(slot) = bytes.get_mut(id as usize) {
            *slot = token.content.clone().into_bytes();
        }
    }
    let alphabet = byte_level_alphabet();
    for id in 0..known as u32 {
        let Some(name) = tokenizer.id_to_token(id) else {
            continue;
        };
        let spelled = if special.contains(&id) {
            let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            marked.extend_from_slice(name.as_bytes());
            Some(marked)
        } else if !bytes[id as usize].is_empty() {
            None
        } else if spelling.byte_level {
            // A name outside the alphabet stands for no bytes: never allowed.
            name.chars().map(|c| alphabet.get(&c).copied()).collect()
        } else if let Some(hex) = name.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
            u8::from_str_radix(hex, 16).ok().map(|b| vec![b])
        } else {
            let space = spelling.space.unwrap_or('\u{2581}');
            Some(name.replace(space, " ").into_bytes())
        };
        if let Some(spelled) = spelled {
            bytes[id as usize] = spelled;
        }
    }
    for (id, padding) in bytes.iter_mut().enumerate().skip(known) {
        *padding = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        padding.extend_from_slice(format!("<[{id}]>").as_bytes());
    }
    let end = *end_ids.first().ok_or(VocabularyError::NoEndToken)?;
    let mut trie = TokTrie::from(&TokRxInfo::new(width as u32, end), &bytes);
    if end_ids.len() > 1 {
        trie = trie.with_eos_tokens(end_ids);
    }
    Ok(Arc::new(Vocabulary { trie, tokenizer }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_alphabet_covers_every_byte_once() {
        let alphabet = byte_level_alphabet();
        assert_eq!(alphabet.len(), 256);
        let bytes: HashSet<u8> = alphabet.values().copied().collect();
        assert_eq!(bytes.len(), 256);
        assert_eq!(alphabet[&'Ġ'], b' ');
        assert_eq!(alphabet[&'a'], b'a');
    }
}
