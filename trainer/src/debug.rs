//! Reference computations for cross-checking against PyTorch (`tuneq debug …`):
//! full-sequence logits, and the loss and LoRA gradients of one batch.

use crate::error::{Error, Result};
use crate::model::Llama;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// Loads the model (and adapter when given) for evaluation in f32 on the CPU.
pub fn load_model(model_dir: &Path, adapter: Option<&Path>) -> Result<Llama> {
    let mut model = Llama::load(model_dir, DType::F32, &Device::Cpu, None)?;
    if let Some(dir) = adapter {
        let (settings, tensors) = crate::peft::load_adapter(dir, &Device::Cpu)?;
        model.set_adapter(&settings, &tensors, &dir.display().to_string())?;
    }
    Ok(model)
}

/// Reads the `input_ids` tensor (int64 or uint32, [batch, seq]) of a safetensors file.
pub fn read_input_ids(path: &Path) -> Result<Tensor> {
    let t = crate::weights::load_safetensors(path, &Device::Cpu)?;
    let ids = t.get("input_ids").ok_or_else(|| Error::Safetensors {
        path: path.display().to_string(),
        message: "no tensor named input_ids".into(),
    })?;
    Ok(ids.to_dtype(DType::U32)?)
}

/// Logits (batch, seq, vocab) for the ids in `input`, written to `out` as `logits`.
pub fn write_logits(model: &Llama, input: &Path, out: &Path) -> Result<()> {
    let ids = read_input_ids(input)?;
    let logits = model.forward(&ids)?;
    crate::weights::save_safetensors(out, &BTreeMap::from([("logits".to_string(), logits)]))
}

/// The causal-LM loss with labels = input ids (mean over every shifted position) and the
/// gradient of each LoRA tensor, written to `out` (`loss` and one tensor per PEFT key).
pub fn write_grads(model: &Llama, input: &Path, out: &Path) -> Result<f64> {
    let ids = read_input_ids(input)?;
    let (b, t) = ids.dims2()?;
    let flat = ids.flatten_all()?.to_vec1::<u32>()?;
    let batch = crate::batch::lm_batch(flat, b, t);
    let r = crate::train::accumulate(model, std::slice::from_ref(&batch), None)?;
    let mut tensors = BTreeMap::from([(
        "loss".to_string(),
        Tensor::new(r.loss as f32, &Device::Cpu)?,
    )]);
    for (v, g) in model.lora_vars().into_iter().zip(r.grads) {
        tensors.insert(v.name, g);
    }
    crate::weights::save_safetensors(out, &tensors)?;
    Ok(r.loss)
}
