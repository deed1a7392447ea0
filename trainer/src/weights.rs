//! Reading and writing Hugging Face safetensors checkpoints (single file or sharded).

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The safetensors files of a model folder, in load order.
pub fn weight_files(model_dir: &Path) -> Result<Vec<PathBuf>> {
    let index = model_dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v: serde_json::Value = crate::error::read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Model {
                path: index.display().to_string(),
                message: "missing \"weight_map\" object".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        let mut paths = Vec::new();
        for f in files {
            if f.contains('/') || f.contains("..") {
                return Err(Error::Model {
                    path: index.display().to_string(),
                    message: format!("unsafe shard name {f:?}"),
                });
            }
            let p = model_dir.join(&f);
            if !p.is_file() {
                return Err(Error::Model {
                    path: model_dir.display().to_string(),
                    message: format!("shard {f} listed in the index is missing"),
                });
            }
            paths.push(p);
        }
        return Ok(paths);
    }
    let single = model_dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(Error::Model {
        path: model_dir.display().to_string(),
        message: "no model.safetensors or model.safetensors.index.json".into(),
    })
}

/// All tensors of a model, by Hugging Face name.
pub struct WeightMap {
    tensors: HashMap<String, Tensor>,
    model_dir: PathBuf,
}

impl WeightMap {
    /// Reads every shard of `model_dir` onto `device`, converting floats to `dtype`.
    pub fn load(model_dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let mut tensors = HashMap::new();
        for file in weight_files(model_dir)? {
            let loaded = candle_core::safetensors::load(&file, &Device::Cpu).map_err(|e| {
                Error::Safetensors {
                    path: file.display().to_string(),
                    message: e.to_string(),
                }
            })?;
            for (k, t) in loaded {
                let t = if t.dtype().is_float() {
                    t.to_dtype(dtype)?
                } else {
                    t
                };
                tensors.insert(k, t.to_device(device)?);
            }
        }
        Ok(Self {
            tensors,
            model_dir: model_dir.to_path_buf(),
        })
    }

    /// Wraps tensors already in memory (random models for benchmarks).
    pub fn from_tensors(tensors: Vec<(String, Tensor)>, source: &str) -> Self {
        Self {
            tensors: tensors.into_iter().collect(),
            model_dir: PathBuf::from(source),
        }
    }

    /// Removes and returns tensor `name`, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.tensors.remove(name).ok_or_else(|| Error::Model {
            path: self.model_dir.display().to_string(),
            message: format!("tensor {name} is missing"),
        })?;
        if t.dims() != shape {
            return Err(Error::Model {
                path: self.model_dir.display().to_string(),
                message: format!(
                    "tensor {name} has shape {:?}, config.json implies {shape:?}",
                    t.dims()
                ),
            });
        }
        Ok(t)
    }

    /// Whether tensor `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Writes `tensors` to one safetensors file with `{"format": "pt"}` metadata, atomically.
pub fn save_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    let mut buffers = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t.to_device(&Device::Cpu)?.contiguous()?;
        let (dtype, bytes) = tensor_bytes(&t)?;
        buffers.push((name.clone(), dtype, t.dims().to_vec(), bytes));
    }
    for (name, dtype, shape, bytes) in &buffers {
        let view =
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).map_err(|e| {
                Error::Safetensors {
                    path: path.display().to_string(),
                    message: format!("{name}: {e}"),
                }
            })?;
        views.push((name.clone(), view));
    }
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    let data = safetensors::tensor::serialize(views, metadata).map_err(|e| Error::Safetensors {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    tuneq_storage::local::write_atomic(path, &data)?;
    Ok(())
}

fn tensor_bytes(t: &Tensor) -> Result<(safetensors::Dtype, Vec<u8>)> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => (
            safetensors::Dtype::F32,
            flat.to_vec1::<f32>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        DType::BF16 => (
            safetensors::Dtype::BF16,
            flat.to_vec1::<half::bf16>()?
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
        ),
        DType::F16 => (
            safetensors::Dtype::F16,
            flat.to_vec1::<half::f16>()?
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
        ),
        DType::I64 => (
            safetensors::Dtype::I64,
            flat.to_vec1::<i64>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        DType::U32 => (
            safetensors::Dtype::U32,
            flat.to_vec1::<u32>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        other => {
            return Err(Error::Safetensors {
                path: String::new(),
                message: format!("cannot write dtype {other:?}"),
            });
        }
    })
}

/// Reads one safetensors file fully into memory (f32 tensors stay exactly as written).
pub fn load_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(Error::Io {
            path: path.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
        });
    }
    candle_core::safetensors::load(path, device).map_err(|e| Error::Safetensors {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
