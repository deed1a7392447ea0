//! `tuneq merge`: fold an adapter into the base weights (W + scale·B·A) for serving stacks
//! that do not take adapters. Shard layout, tensor names and dtypes stay as in the base.

use crate::error::{Error, Result};
use crate::model::{layer_projections, peft_key};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// Files copied unchanged from the base model folder when present.
const COPIED: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
];

/// Writes the merged model into `out`. Returns how many projections were changed.
pub fn merge(model_dir: &Path, adapter_dir: &Path, out: &Path) -> Result<usize> {
    let cfg = crate::config::LlamaConfig::load(model_dir)?;
    let (settings, adapter) = crate::peft::load_adapter(adapter_dir, &Device::Cpu)?;
    let scale = settings.scale();
    let mut pending: BTreeMap<String, (Tensor, Tensor)> = BTreeMap::new();
    for l in 0..cfg.num_hidden_layers() {
        for (module, proj) in layer_projections(cfg.architecture()) {
            if !settings.targets(proj) {
                continue;
            }
            let (ka, kb) = (
                peft_key(l, module, proj, "A"),
                peft_key(l, module, proj, "B"),
            );
            let (Some(a), Some(b)) = (adapter.get(&ka), adapter.get(&kb)) else {
                return Err(Error::Model {
                    path: adapter_dir.display().to_string(),
                    message: format!("adapter lacks {ka} or {kb}"),
                });
            };
            pending.insert(
                format!("model.layers.{l}.{module}.{proj}.weight"),
                (a.clone(), b.clone()),
            );
        }
    }
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let mut merged = 0;
    for file in crate::weights::weight_files(model_dir)? {
        let tensors = crate::weights::load_safetensors(&file, &Device::Cpu)?;
        let mut written = BTreeMap::new();
        for (name, w) in tensors {
            let w = match pending.remove(&name) {
                Some((a, b)) => {
                    let dtype = w.dtype();
                    let delta = b
                        .to_dtype(DType::F32)?
                        .matmul(&a.to_dtype(DType::F32)?)?
                        .affine(scale, 0.0)?;
                    if delta.dims() != w.dims() {
                        return Err(Error::Model {
                            path: adapter_dir.display().to_string(),
                            message: format!(
                                "adapter update for {name} has shape {:?}, base has {:?}",
                                delta.dims(),
                                w.dims()
                            ),
                        });
                    }
                    merged += 1;
                    (w.to_dtype(DType::F32)? + delta)?.to_dtype(dtype)?
                }
                None => w,
            };
            written.insert(name, w);
        }
        let name = file.file_name().ok_or_else(|| Error::Model {
            path: file.display().to_string(),
            message: "no file name".into(),
        })?;
        crate::weights::save_safetensors(&out.join(name), &written)?;
    }
    if let Some(name) = pending.keys().next() {
        return Err(Error::Model {
            path: model_dir.display().to_string(),
            message: format!("base model has no tensor {name}"),
        });
    }
    for f in COPIED {
        let src = model_dir.join(f);
        if src.is_file() {
            std::fs::copy(&src, out.join(f)).map_err(Error::io(&src))?;
        }
    }
    Ok(merged)
}
