//! The byte-level BPE tokenizer that ships with randomly initialised models.
//!
//! It is trained at build time of a model folder (not downloaded) on `assets/corpus.txt`, an
//! English corpus written for tuneq, with the `tokenizers` crate's BPE trainer. Byte-level
//! BPE can encode any string, so a random model can train on any dataset; the merges make
//! ordinary English and digits cost a sensible number of tokens, so sequence lengths in tests
//! and examples look like those of real models.

use std::path::Path;

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, NormalizerWrapper, PostProcessorWrapper, Tokenizer, TokenizerBuilder,
};

use super::template::CHATML_TEMPLATE;
use super::{DataError, Result};

/// The training corpus, embedded so the tokenizer is the same wherever tuneq runs.
const CORPUS: &str = include_str!("../assets/corpus.txt");

/// Special tokens with their ids 0..=5: unk, bos, eos, ChatML turn markers, padding.
pub const SPECIAL_TOKENS: [&str; 6] = [
    "<unk>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<pad>",
];

/// Smallest vocabulary: the special tokens plus the 256 byte symbols.
const MIN_VOCAB: usize = SPECIAL_TOKENS.len() + 256;

/// Pairs seen fewer times are not merged. Pairs seen once are mostly whole numbers that occur
/// a single time; a token for each would make number tokenization inconsistent, so those
/// slots become reserved tokens instead.
pub const MIN_FREQUENCY: u64 = 2;

/// Longest merged token, in characters; keeps whole long numbers out of the vocabulary.
const MAX_TOKEN_LENGTH: usize = 16;

/// Builds the tokenizer with exactly `vocab_size` entries (added tokens included).
///
/// Ids 0–5 are [`SPECIAL_TOKENS`], then the 256 byte symbols, then merges learned from the
/// corpus (pairs seen at least [`MIN_FREQUENCY`] times), then special `<|reserved_N|>` tokens
/// up to `vocab_size` (the corpus yields about 2,900 entries, so both the 4096 and the 32000
/// vocabularies end in reserved tokens that a model never sees). The result is deterministic:
/// the trainer orders merges by count, then by pair id, whatever the thread count.
pub fn build_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    if vocab_size < MIN_VOCAB {
        return Err(DataError::Tokenizer(format!(
            "vocab_size {vocab_size} is below the minimum {MIN_VOCAB} (special tokens + 256 bytes)"
        )));
    }
    let tok_err = |e: tokenizers::Error| DataError::Tokenizer(e.to_string());
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(MIN_FREQUENCY)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .max_token_length(Some(MAX_TOKEN_LENGTH))
        .build();
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        ByteLevel,
        PostProcessorWrapper,
        ByteLevel,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
    .with_post_processor(None)
    .with_decoder(Some(ByteLevel::default()))
    .build()
    .map_err(tok_err)?;
    tokenizer
        .train(&mut trainer, CORPUS.split_inclusive("\n\n"))
        .map_err(tok_err)?;

    let have = tokenizer.get_vocab_size(true);
    if have < vocab_size {
        let reserved: Vec<AddedToken> = (0..vocab_size - have)
            .map(|i| AddedToken::from(format!("<|reserved_{i}|>"), true))
            .collect();
        tokenizer.add_special_tokens(reserved).map_err(tok_err)?;
    }
    let tokenizer = Tokenizer::from(tokenizer);
    let got = tokenizer.get_vocab_size(true);
    if got != vocab_size {
        return Err(DataError::Tokenizer(format!(
            "built a vocabulary of {got} entries instead of {vocab_size}"
        )));
    }
    Ok(tokenizer)
}

/// What `tokenizer_config.json` of a random model holds: the special tokens, the ChatML
/// [`CHATML_TEMPLATE`], and settings that make Hugging Face's `PreTrainedTokenizerFast`
/// encode exactly as the Rust tokenizer does (no automatic bos/eos, no clean-up).
pub fn tokenizer_config_json(model_max_length: usize) -> serde_json::Value {
    serde_json::json!({
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[5],
        "unk_token": SPECIAL_TOKENS[0],
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
    })
}

/// Writes `tokenizer.json` (from [`build_tokenizer`]) and `tokenizer_config.json` (from
/// [`tokenizer_config_json`]) into `dir`, which must exist.
pub fn write_tokenizer_files(dir: &Path, vocab_size: usize, model_max_length: usize) -> Result<()> {
    let tokenizer = build_tokenizer(vocab_size)?;
    let tokenizer_path = dir.join("tokenizer.json");
    tokenizer.save(&tokenizer_path, true).map_err(|e| {
        DataError::Tokenizer(format!("cannot write {}: {e}", tokenizer_path.display()))
    })?;
    let config_path = dir.join("tokenizer_config.json");
    let config = serde_json::to_vec_pretty(&tokenizer_config_json(model_max_length))
        .map_err(|e| DataError::Tokenizer(e.to_string()))?;
    std::fs::write(&config_path, config).map_err(|source| DataError::Io {
        path: config_path.display().to_string(),
        source,
    })
}
