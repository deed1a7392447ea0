//! Reading and writing Hugging Face safetensors checkpoints (single file or sharded).

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The safetensors files of a model folder, in load order (see
/// [`tuneq_pools::folder::weight_files`]).
pub fn weight_files(model_dir: &Path) -> Result<Vec<PathBuf>> {
    tuneq_pools::folder::weight_files(model_dir).map_err(|e| Error::Model {
        path: model_dir.display().to_string(),
        message: e.to_string(),
    })
}

/// All tensors of a model, by Hugging Face name.
pub struct WeightMap {
    tensors: HashMap<String, Tensor>,
    model_dir: PathBuf,
}

impl WeightMap {
    /// Reads every shard of `model_dir` onto `device`, converting floats to `dtype`.
    /// Tensors are read one at a time (see [`read_shard`]), so loading holds at most
    /// the tensors read so far plus a few copies of the largest one.
    pub fn load(model_dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let mut tensors = HashMap::new();
        for file in weight_files(model_dir)? {
            read_shard(&file, &mut |name, t| {
                let t = if t.dtype().is_float() {
                    t.to_dtype(dtype)?
                } else {
                    t
                };
                tensors.insert(name, t.to_device(device)?);
                Ok(())
            })?;
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

/// The longest safetensors header read (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Reads the safetensors file `path` one tensor at a time, in file order, handing each
/// to `each` as a CPU tensor of its stored dtype.
///
/// Reading the whole file first (as `candle_core::safetensors::load` does) holds the
/// file and its tensors at once: twice a shard's size, 20 GB for a 7B model's first
/// 10 GB shard, which decides whether the model loads at all on a node sized for it.
/// Here one buffer of the largest tensor's size is reused for every tensor.
pub fn read_shard(path: &Path, each: &mut dyn FnMut(String, Tensor) -> Result<()>) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let bad = |message: String| Error::Safetensors {
        path: path.display().to_string(),
        message,
    };
    let io = |e: std::io::Error| bad(e.to_string());
    let mut file = std::fs::File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let header = tuneq_pools::folder::read_header(&mut file, MAX_HEADER_BYTES.min(file_len))
        .map_err(|e| bad(format!("{e}")))?;
    let (entries, data_start) = (header.tensors, header.data_start);
    let mut infos = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        let info: safetensors::tensor::TensorInfo =
            serde_json::from_value(value).map_err(|e| bad(format!("{name}: {e}")))?;
        let (start, end) = info.data_offsets;
        let elements = info
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(info.dtype.bitsize()))
            .map(|bits| bits.div_ceil(8));
        if start > end || data_start + end as u64 > file_len || elements != Some(end - start) {
            return Err(bad(format!(
                "{name}: offsets {start}..{end} do not hold a {:?} {:?} within the file's {file_len} bytes",
                info.dtype, info.shape
            )));
        }
        infos.push((name, info));
    }
    infos.sort_by_key(|(_, info)| info.data_offsets);
    let mut buffer = Vec::new();
    for (name, info) in infos {
        let (start, end) = info.data_offsets;
        let dtype = DType::try_from(info.dtype).map_err(|e| bad(format!("{name}: {e}")))?;
        buffer.resize(end - start, 0);
        file.seek(SeekFrom::Start(data_start + start as u64))
            .map_err(io)?;
        file.read_exact(&mut buffer).map_err(io)?;
        let t = Tensor::from_raw_buffer(&buffer, dtype, &info.shape, &Device::Cpu)
            .map_err(|e| bad(format!("{name}: {e}")))?;
        each(name, t)?;
    }
    Ok(())
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

/// Reads one safetensors file into memory (tensors stay exactly as written).
pub fn load_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(Error::Io {
            path: path.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
        });
    }
    let mut tensors = HashMap::new();
    read_shard(path, &mut |name, t| {
        tensors.insert(name, t.to_device(device)?);
        Ok(())
    })?;
    Ok(tensors)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn written(dir: &Path) -> (PathBuf, BTreeMap<String, Tensor>) {
        let dev = Device::Cpu;
        let tensors = BTreeMap::from([
            (
                "a".to_string(),
                Tensor::arange(0f32, 12.0, &dev)
                    .unwrap()
                    .reshape((3, 4))
                    .unwrap(),
            ),
            (
                "b".to_string(),
                Tensor::new(&[1.5f32, -2.25], &dev)
                    .unwrap()
                    .to_dtype(DType::BF16)
                    .unwrap(),
            ),
            ("c".to_string(), Tensor::new(&[7i64, -1], &dev).unwrap()),
        ]);
        let path = dir.join("m.safetensors");
        save_safetensors(&path, &tensors).unwrap();
        (path, tensors)
    }

    #[test]
    fn shards_read_a_tensor_at_a_time_give_back_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let (path, tensors) = written(dir.path());
        let back = load_safetensors(&path, &Device::Cpu).unwrap();
        assert_eq!(back.len(), tensors.len());
        for (name, t) in &tensors {
            let b = &back[name];
            assert_eq!((b.dtype(), b.dims()), (t.dtype(), t.dims()), "{name}");
            let diff = (b.to_dtype(DType::F64).unwrap() - t.to_dtype(DType::F64).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert_eq!(diff, 0.0, "{name}");
        }
    }

    #[test]
    fn damaged_shards_are_refused_with_the_file_named() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = written(dir.path());
        let bytes = std::fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
        let cases = [
            // Cut short: the last tensor's bytes are missing.
            bytes[..bytes.len() - 4].to_vec(),
            // A header longer than the file.
            [&(1u64 << 40).to_le_bytes()[..], &bytes[8..]].concat(),
            // Offsets that do not match the shape (one element too many).
            {
                let changed = header.replacen("[3,4]", "[3,5]", 1);
                assert_ne!(changed, header);
                let mut b = (changed.len() as u64).to_le_bytes().to_vec();
                b.extend_from_slice(changed.as_bytes());
                b.extend_from_slice(&bytes[8 + header_len..]);
                b
            },
            // Not JSON.
            [&4u64.to_le_bytes()[..], b"{{{{"].concat(),
        ];
        for (i, case) in cases.iter().enumerate() {
            let bad = dir.path().join(format!("bad{i}.safetensors"));
            std::fs::write(&bad, case).unwrap();
            let err = load_safetensors(&bad, &Device::Cpu)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("bad{i}.safetensors")),
                "case {i}: {err}"
            );
        }
    }
}
