//! What registering a model folder checks (a local one, or the local copy of a store
//! folder's small files and weight headers that [`super::remote`] makes), and what it
//! learns once for `GET /v1/models`: a `config.json` of an architecture tuneq trains, a tokenizer and
//! chat template that load, and safetensors weights holding every tensor the config
//! implies ([`tuneq_pools::ModelShape::expected_tensors`]) with its shape, every shard a
//! `model.safetensors.index.json` names present. Every problem found is reported at
//! once, naming the file and the tensor or field. Only the weights' headers are read,
//! each bounded by [`HEADER_LIMIT`].

use crate::error::{ApiError, Code};
use std::collections::BTreeMap;
use std::path::Path;
use tuneq_openapi::{ChatTemplateChoice, ChatTemplateSource, ModelDetails, ModelIdentity};
use tuneq_pools::ModelShape;
use tuneq_pools::folder;

/// The largest safetensors header read (real ones are well under 1 MiB).
const HEADER_LIMIT: u64 = 16 << 20;

/// How many tensors of one kind of problem a refusal names before it counts the rest.
const NAMED: usize = 5;

/// A checked folder: its canonical path and what registration records of it.
pub struct Inspected {
    pub(crate) location: String,
    /// What `GET /v1/models` shows of it.
    pub details: ModelDetails,
    /// The hash every run on a local folder is fingerprinted with, and the stamp it
    /// holds for (see [`identity`]); none for a folder in a store, which its trainers
    /// hash once they have it.
    pub identity: Option<ModelIdentity>,
}

/// A tensor as a weight file's header lists it.
struct Listed {
    file: String,
    dtype: String,
    shape: serde_json::Value,
}

/// Checks the local folder `path` (blocking: it reads files, and loads the tokenizer
/// with the chat template `choice`).
pub(crate) fn inspect(path: &Path, choice: ChatTemplateChoice) -> Result<Inspected, ApiError> {
    let shape = match ModelShape::read(path) {
        Some(Ok(shape)) => shape,
        Some(Err(refusal)) => {
            return Err(ApiError::invalid(
                "location",
                Code::UnsupportedModelArchitecture,
                format!("The model at this location cannot be trained: {refusal}."),
            ));
        }
        None => {
            return Err(refused(vec![
                "config.json: missing, unreadable, not JSON or over 1 MiB (a Hugging Face model folder is expected)".into(),
            ]));
        }
    };
    let mut problems = Vec::new();
    let a_tool = [serde_json::json!({"type": "function", "function": {"name": "f"}})];
    let template = match tuneq_dataset::Encoder::from_model_dir(path, choice) {
        Ok(encoder) => {
            let template = encoder.template();
            let source = match template.is_models_own() {
                true => ChatTemplateSource::Own,
                false => ChatTemplateSource::BuiltIn,
            };
            Some((source, template.handles_tools(&a_tool)))
        }
        Err(e) => {
            problems.push(format!("the tokenizer or chat template does not load: {e}"));
            None
        }
    };
    let dtype = match weights(path, &shape) {
        Ok(dtype) => Some(dtype),
        Err(found) => {
            problems.extend(found);
            None
        }
    };
    let (Some((chat_template, renders_tools)), Some(dtype), true) =
        (template, dtype, problems.is_empty())
    else {
        return Err(refused(problems));
    };
    let location = std::fs::canonicalize(path)
        .map(|p| p.display().to_string())
        .map_err(|_| refused(vec!["the folder cannot be read".into()]))?;
    Ok(Inspected {
        location,
        identity: None,
        details: ModelDetails {
            architecture: shape.architecture().model_type().into(),
            parameters: shape.parameters(),
            context_length: shape.max_position_embeddings.unwrap_or(0),
            dtype,
            chat_template,
            template: choice,
            renders_tools,
            fits_pools: Vec::new(),
        },
    })
}

/// `known`, where the local folder's stamp is still the one it was computed for
/// (blocking, reading only the files' sizes and times).
pub(crate) fn still_known(
    path: &Path,
    known: Option<&ModelIdentity>,
) -> Result<Option<ModelIdentity>, ApiError> {
    let Some(known) = known else {
        return Ok(None);
    };
    let stamp = folder::stamp(path).map_err(|e| refused(vec![e.to_string()]))?;
    Ok((stamp == known.stamp).then(|| known.clone()))
}

/// The local folder's identity (blocking): `known` where the folder's stamp is still
/// the one it was computed for, else every weight read and hashed (about a minute for
/// 14 GB).
pub(crate) fn identity(
    path: &Path,
    known: Option<&ModelIdentity>,
) -> Result<ModelIdentity, ApiError> {
    if let Some(known) = still_known(path, known)? {
        return Ok(known);
    }
    let started = std::time::Instant::now();
    let identity = folder::identity(path).map_err(|e| refused(vec![e.to_string()]))?;
    tracing::info!(folder = %path.display(), seconds = started.elapsed().as_secs_f64(), "model weights hashed");
    Ok(identity)
}

/// The 400 for `problems`, every one of them named.
fn refused(problems: Vec<String>) -> ApiError {
    let count = problems.len();
    let listed = problems
        .iter()
        .enumerate()
        .map(|(i, p)| format!("({}) {p}", i + 1))
        .collect::<Vec<_>>()
        .join("; ");
    let noun = if count == 1 { "problem" } else { "problems" };
    ApiError::invalid(
        "location",
        Code::InvalidValue,
        format!("The folder is not a model tuneq can train ({count} {noun}): {listed}."),
    )
}

/// Checks the folder's weights against `shape`; the embedding's dtype as transformers
/// names it (`float32`, `bfloat16`, `float16`), or every problem found.
fn weights(path: &Path, shape: &ModelShape) -> Result<String, Vec<String>> {
    let (files, mut problems) = weight_files(path);
    let mut listed: BTreeMap<String, Listed> = BTreeMap::new();
    for file in &files {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match safetensors_header(file) {
            Ok(header) => {
                for (tensor, info) in header.tensors {
                    let dtype = info["dtype"].as_str().unwrap_or_default().to_string();
                    let shape = info["shape"].clone();
                    let file = name.clone();
                    listed.insert(tensor, Listed { file, dtype, shape });
                }
            }
            Err(why) => problems.push(format!("{name} {why}")),
        }
    }
    let layers = listed
        .keys()
        .filter_map(|t| {
            t.strip_prefix("model.layers.")?
                .split('.')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .map(|layer| layer + 1)
        .max()
        .unwrap_or(0);
    if layers > shape.num_hidden_layers {
        problems.push(format!(
            "the weights hold {layers} layers, config.json says num_hidden_layers = {}",
            shape.num_hidden_layers
        ));
    }
    let mut missing = Vec::new();
    let mut misshapen = Vec::new();
    for expected in shape.expected_tensors() {
        match listed.get(&expected.name) {
            None => missing.push(expected.name),
            Some(found) if found.shape != serde_json::json!(expected.shape) => {
                misshapen.push(format!(
                    "{}: {} is {}, config.json implies {:?}",
                    found.file, expected.name, found.shape, expected.shape
                ));
            }
            Some(_) => {}
        }
    }
    if !missing.is_empty() {
        problems.push(format!(
            "{} tensor(s) config.json implies are in no weight file: {}",
            missing.len(),
            named(&missing)
        ));
    }
    if !misshapen.is_empty() {
        problems.push(format!(
            "{} tensor(s) do not have the shape config.json implies: {}",
            misshapen.len(),
            named(&misshapen)
        ));
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let stored = listed
        .get("model.embed_tokens.weight")
        .map_or("", |t| t.dtype.as_str());
    Ok(match stored {
        "F32" => "float32".into(),
        "BF16" => "bfloat16".into(),
        "F16" => "float16".into(),
        other => other.to_lowercase(),
    })
}

/// The first [`NAMED`] of `items`, and how many more there are.
fn named(items: &[String]) -> String {
    let shown = items[..items.len().min(NAMED)].join(", ");
    match items.len().saturating_sub(NAMED) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

/// The weight files of the folder (see [`folder::weight_files`]) that are there, and
/// every problem with the listing: each shard the index names that the folder lacks,
/// an index that cannot be read, neither an index nor `model.safetensors`.
fn weight_files(path: &Path) -> (Vec<std::path::PathBuf>, Vec<String>) {
    let shards = match folder::shard_names(path) {
        Ok(shards) => shards,
        Err(e) => return (Vec::new(), vec![e.to_string()]),
    };
    if shards.is_empty() {
        return match folder::weight_files(path) {
            Ok(files) => (files, Vec::new()),
            Err(e) => (Vec::new(), vec![e.to_string()]),
        };
    }
    let missing = folder::missing_shards(path, &shards);
    let problems = missing
        .iter()
        .map(|shard| folder::FolderError::MissingShard(shard.clone()).to_string())
        .collect();
    let present = shards
        .iter()
        .filter(|shard| !missing.contains(shard))
        .map(|shard| path.join(shard))
        .collect();
    (present, problems)
}

/// The header of the safetensors file `file`, at most [`HEADER_LIMIT`] of it.
fn safetensors_header(file: &Path) -> Result<folder::Header, String> {
    let mut f = std::fs::File::open(file).map_err(|_| "cannot be opened".to_string())?;
    folder::read_header(&mut f, HEADER_LIMIT).map_err(|e| e.to_string())
}
