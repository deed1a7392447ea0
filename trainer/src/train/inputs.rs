//! A run's inputs and their identity: the tokenised datasets, the base model's digest,
//! and the fingerprint that keeps a checkpoint from resuming a different run.

use super::metrics::json_line;
use crate::checkpoint;
use crate::data::{EncodedPair, Encoder, Example, ParsedDataset, Record};
use crate::error::{Error, Result};
use crate::progress::ProgressSink;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use tuneq_openapi::{TrainEvent, TrainSpec, TrainingMethod};

/// Tokenised data of one or more files.
pub struct EncodedData {
    /// Examples that carry at least one label (supervised runs).
    pub examples: Vec<Example>,
    /// Preference pairs whose answers both keep a labelled token (DPO runs).
    pub pairs: Vec<EncodedPair>,
    /// Records, parallel to the files' order (for sample prompts).
    pub records: Vec<Record>,
    /// Detected or given format of the first file.
    pub format: tuneq_openapi::DatasetFormat,
    /// Examples that were cut to `max_seq_len`.
    pub truncated: usize,
    /// Examples dropped because nothing was left to learn after truncation.
    pub dropped: usize,
    /// SHA-256 of each file, in order.
    pub sha256: Vec<String>,
}

impl EncodedData {
    /// What an epoch goes through: examples, or pairs for DPO.
    pub fn items(&self) -> usize {
        self.examples.len() + self.pairs.len()
    }
}

/// Reads, validates and tokenises `files` for `method`: preference pairs for DPO,
/// anything else for supervised runs. Every bad line of every file is reported.
pub fn encode_files(
    encoder: &Encoder,
    files: &[PathBuf],
    format: tuneq_openapi::DatasetFormat,
    method: TrainingMethod,
    max_len: usize,
) -> Result<EncodedData> {
    let mut parsed: Vec<ParsedDataset> = Vec::new();
    let mut errors = Vec::new();
    for f in files {
        match crate::data::read_jsonl(f, format) {
            Ok(p) => parsed.push(p),
            Err(e) => errors.push(e),
        }
    }
    match errors.len() {
        0 => {}
        1 => return Err(Error::Data(errors.remove(0))),
        _ => return Err(Error::Datasets(errors)),
    }
    let dpo = !method.is_supervised();
    // A preference pair trained as a chat would teach the preferred answer and drop the
    // other, and DPO has nothing to compare in a chat: never either, silently.
    if let Some((file, p)) = files
        .iter()
        .zip(&parsed)
        .find(|(_, p)| (p.format == tuneq_openapi::DatasetFormat::Preference) != dpo)
    {
        let message = if dpo {
            format!(
                "{} holds {} records; the dpo method trains on preference pairs (input, preferred_output, non_preferred_output)",
                file.display(),
                serde_json::to_value(p.format)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            )
        } else {
            format!(
                "{} holds preference pairs (input, preferred_output, non_preferred_output), which train with the dpo method; give chat, prompt/completion, alpaca or text records, or set method to dpo",
                file.display()
            )
        };
        return Err(Error::Spec(vec![tuneq_openapi::SpecError {
            field: "method".into(),
            message,
        }]));
    }
    let mut out = EncodedData {
        pairs: Vec::new(),
        examples: Vec::new(),
        records: Vec::new(),
        format: parsed.first().map(|p| p.format).unwrap_or(format),
        truncated: 0,
        dropped: 0,
        sha256: files
            .iter()
            .map(|f| checkpoint::sha256_file(f))
            .collect::<Result<_>>()?,
    };
    for p in parsed {
        for r in p.records {
            if dpo {
                let pair = encoder.encode_pair(&r, max_len)?;
                out.truncated += usize::from(pair.truncated);
                if pair.is_trainable() {
                    out.pairs.push(pair);
                    out.records.push(r);
                } else {
                    out.dropped += 1;
                }
                continue;
            }
            let (ex, full_len) = encoder.encode_with_length(&r, max_len)?;
            if full_len > max_len {
                out.truncated += 1;
            }
            if ex.labels.iter().skip(1).any(|&l| l >= 0) {
                out.examples.push(ex);
                out.records.push(r);
            } else {
                out.dropped += 1;
            }
        }
    }
    Ok(out)
}

/// Everything that determines the trajectory, hashed: a checkpoint from a different spec,
/// dataset or model is never resumed.
#[derive(Serialize)]
struct Fingerprint<'a> {
    hyperparameters: &'a tuneq_openapi::Hyperparameters,
    lora: &'a tuneq_openapi::LoraSpec,
    dataset_format: tuneq_openapi::DatasetFormat,
    chat_template: tuneq_openapi::ChatTemplateChoice,
    dtype: tuneq_openapi::DtypeKind,
    /// Left out when f32, so that fingerprints from before the field stay the same.
    #[serde(skip_serializing_if = "tuneq_openapi::ComputeKind::is_f32")]
    compute: tuneq_openapi::ComputeKind,
    train_sha256: &'a [String],
    model_sha256: &'a str,
    /// The adapter the run starts from; left out when none, so that fingerprints from
    /// before the field stay the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    init_adapter_sha256: Option<&'a str>,
    /// Left out when supervised, so that fingerprints from before the field stay the same.
    #[serde(skip_serializing_if = "TrainingMethod::is_supervised")]
    method: TrainingMethod,
}

/// SHA-256 over an adapter folder's config and weights (the identity of the adapter a
/// run starts from).
pub fn adapter_sha256(dir: &Path) -> Result<String> {
    let mut h = Sha256::new();
    for name in [crate::peft::ADAPTER_CONFIG, crate::peft::ADAPTER_WEIGHTS] {
        h.update(checkpoint::sha256_file(&dir.join(name))?.as_bytes());
    }
    Ok(hex::encode(h.finalize()))
}

/// The base model's identity hash (SHA-256 over its config and weight files): the one
/// its registration computed (the spec's `model_identity`) while the folder's stamp
/// still matches it, else every file read again — a 7B model's 14 GB on each start.
pub(super) fn model_sha256(
    spec: &TrainSpec,
    model_dir: &Path,
    sink: &mut dyn ProgressSink,
) -> Result<String> {
    use tuneq_pools::folder;
    let unreadable = |e: folder::FolderError| Error::Model {
        path: model_dir.display().to_string(),
        message: e.to_string(),
    };
    if let Some(registered) = &spec.model_identity {
        if folder::stamp(model_dir).map_err(unreadable)? == registered.stamp {
            return Ok(registered.sha256.clone());
        }
        sink.event(&TrainEvent::Warning {
            message: "the base model's files changed since it was registered (a weight file or config.json was replaced or rewritten): they are hashed again for this run's fingerprint; register the folder again (POST /admin/models) so that later jobs start without it".into(),
        });
    }
    Ok(folder::identity(model_dir).map_err(unreadable)?.sha256)
}

/// The training and validation data, tokenised at `max_seq_len`; refused when no
/// training example is left to learn from, and warned about when examples were cut or
/// dropped.
pub(super) fn encode_data(
    spec: &TrainSpec,
    encoder: &Encoder,
    train_files: &[PathBuf],
    val_file: Option<&PathBuf>,
    sink: &mut dyn ProgressSink,
) -> Result<(EncodedData, Option<EncodedData>)> {
    let max_len = spec.hyperparameters.max_seq_len as usize;
    let (format, method) = (spec.dataset_format, spec.method);
    let train = encode_files(encoder, train_files, format, method, max_len)?;
    let val = match val_file {
        Some(f) => Some(encode_files(
            encoder,
            std::slice::from_ref(f),
            format,
            method,
            max_len,
        )?),
        None => None,
    };
    if train.items() == 0 && train.dropped > 0 {
        // Records parsed, but none kept a labelled token within max_seq_len.
        return Err(Error::Spec(vec![tuneq_openapi::SpecError {
            field: "hyperparameters.max_seq_len".into(),
            message: format!(
                "no example of {} has a token to learn from at max_seq_len {max_len} (every answer is cut off or empty); raise max_seq_len or fix the data",
                spec.training_files.join(", ")
            ),
        }]));
    }
    if train.items() == 0 {
        return Err(Error::Data(crate::data::DataError::Empty {
            file: spec.training_files.join(", "),
        }));
    }
    for (what, d) in [("training", Some(&train)), ("validation", val.as_ref())] {
        let Some(d) = d else { continue };
        if d.truncated > 0 {
            sink.event(&TrainEvent::Warning {
                message: format!(
                    "{} {what} examples were longer than max_seq_len {max_len} and were truncated",
                    d.truncated
                ),
            });
        }
        if d.dropped > 0 {
            sink.event(&TrainEvent::Warning {
                message: format!("{} {what} examples had no trainable tokens left after truncation and were skipped", d.dropped),
            });
        }
    }
    Ok((train, val))
}

/// The run's fingerprint: a hash of everything that determines its trajectory.
pub(super) fn fingerprint(
    spec: &TrainSpec,
    train: &EncodedData,
    model_sha: &str,
    init_adapter_sha: Option<&str>,
) -> Result<String> {
    let fp = Fingerprint {
        init_adapter_sha256: init_adapter_sha,
        method: spec.method,
        hyperparameters: &spec.hyperparameters,
        lora: &spec.lora,
        dataset_format: spec.dataset_format,
        chat_template: spec.chat_template,
        dtype: spec.dtype,
        compute: spec.compute,
        train_sha256: &train.sha256,
        model_sha256: model_sha,
    };
    Ok(hex::encode(Sha256::digest(json_line(&fp)?.as_bytes())))
}
