//! What registering a local model folder checks, and what it learns once for
//! `GET /v1/models`: a `config.json` of an architecture tuneq trains, a tokenizer and
//! chat template that load, and safetensors weights holding every tensor the config
//! implies ([`tuneq_pools::ModelShape::expected_tensors`]) with its shape, every shard a
//! `model.safetensors.index.json` names present. Every problem found is reported at
//! once, naming the file and the tensor or field. Only the weights' headers are read,
//! each bounded by [`HEADER_LIMIT`].

use crate::error::{ApiError, Code};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use tuneq_openapi::{ChatTemplateSource, ModelDetails};
use tuneq_pools::ModelShape;

/// The largest safetensors header read (real ones are well under 1 MiB).
const HEADER_LIMIT: u64 = 16 << 20;

/// The largest `model.safetensors.index.json` read (real ones are tens of KiB).
const INDEX_LIMIT: u64 = 16 << 20;

/// How many tensors of one kind of problem a refusal names before it counts the rest.
const NAMED: usize = 5;

/// A checked folder: its canonical path and what registration records of it.
pub(crate) struct Inspected {
    pub(crate) location: String,
    pub(crate) details: ModelDetails,
}

/// A tensor as a weight file's header lists it.
struct Listed {
    file: String,
    dtype: String,
    shape: serde_json::Value,
}

/// Checks the local folder `path` (blocking: it reads files, and loads the tokenizer).
pub(crate) fn inspect(path: &Path) -> Result<Inspected, ApiError> {
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
    let template = match tuneq_dataset::Encoder::from_model_dir(
        path,
        tuneq_openapi::ChatTemplateChoice::Model,
    ) {
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
        details: ModelDetails {
            architecture: shape.architecture().model_type().into(),
            parameters: shape.parameters(),
            context_length: shape.max_position_embeddings.unwrap_or(0),
            dtype,
            chat_template,
            renders_tools,
            fits_pools: Vec::new(),
        },
    })
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
    let mut problems = missing_shards(path);
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(path)
        .map_err(|_| vec!["the folder cannot be read".to_string()])?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() && problems.is_empty() {
        return Err(vec!["the folder holds no .safetensors weights".into()]);
    }
    let mut listed: BTreeMap<String, Listed> = BTreeMap::new();
    for file in &files {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match safetensors_header(file) {
            Ok(header) => {
                for (tensor, info) in header {
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

/// The shards `model.safetensors.index.json` names that the folder lacks (or why the
/// index cannot be read); none without an index.
fn missing_shards(path: &Path) -> Vec<String> {
    const INDEX: &str = "model.safetensors.index.json";
    let Ok(meta) = std::fs::metadata(path.join(INDEX)) else {
        return Vec::new();
    };
    if meta.len() > INDEX_LIMIT {
        return vec![format!("{INDEX} is larger than 16 MiB")];
    }
    let index: serde_json::Value = match std::fs::read(path.join(INDEX))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
    {
        Some(index) => index,
        None => return vec![format!("{INDEX} cannot be read as JSON")],
    };
    let Some(map) = index["weight_map"].as_object() else {
        return vec![format!("{INDEX} has no weight_map")];
    };
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    shards
        .into_iter()
        .filter(|shard| {
            // A shard is a file name in this folder, never a path out of it.
            let plain = !shard.contains('/') && !shard.contains('\\') && *shard != "..";
            !plain || !path.join(shard).is_file()
        })
        .map(|shard| format!("{INDEX} names the shard {shard}, which the folder lacks"))
        .collect()
}

/// The tensors a safetensors file's header lists (name → dtype, shape, offsets).
fn safetensors_header(
    file: &Path,
) -> Result<serde_json::Map<String, serde_json::Value>, &'static str> {
    use std::io::Read;
    let mut f = std::fs::File::open(file).map_err(|_| "cannot be opened")?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| "is too short to be a safetensors file")?;
    let len = u64::from_le_bytes(len);
    if len > HEADER_LIMIT {
        return Err("has a header larger than 16 MiB");
    }
    let mut header = Vec::with_capacity(len as usize);
    f.take(len)
        .read_to_end(&mut header)
        .map_err(|_| "cannot be read")?;
    let mut map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|_| "has a header that is not JSON")?;
    map.remove("__metadata__");
    Ok(map)
}
