//! Reference computations for cross-checking against PyTorch (`tuneq debug …`):
//! full-sequence logits, the loss and LoRA gradients of one batch, and a run of
//! optimiser steps (micro-batches, clipping, AdamW, dropout) with the adapter after each.

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::model::Llama;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// Loads the model (and adapter when given) on the CPU with its frozen weights held in
/// `dtype` (f32, or bf16 widened to f32 where used; compute is f32 either way).
pub fn load_model(
    model_dir: &Path,
    adapter: Option<&Path>,
    dtype: tuneq_openapi::DtypeKind,
) -> Result<Llama> {
    let dtype = match dtype.on(false) {
        tuneq_openapi::DtypeKind::Bf16 => DType::BF16,
        _ => DType::F32,
    };
    let mut model = Llama::load(model_dir, dtype, &Device::Cpu, None)?;
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
    save_grads(model, &r, out)?;
    Ok(r.loss)
}

/// A step's loss and the gradient of each LoRA tensor, written to `out` (`loss` and
/// one tensor per PEFT key).
fn save_grads(model: &Llama, r: &crate::step::StepResult, out: &Path) -> Result<()> {
    let mut tensors = BTreeMap::from([(
        "loss".to_string(),
        Tensor::new(r.loss as f32, &Device::Cpu)?,
    )]);
    for (v, g) in model.lora_vars().into_iter().zip(&r.grads) {
        tensors.insert(v.name, g.clone());
    }
    crate::weights::save_safetensors(out, &tensors)
}

/// One DPO step over every pair of the preference file `pairs` as one micro-batch:
/// the policy is `model` with its adapter, the reference `model_dir`'s base model
/// (what a run that starts from a fresh adapter compares with, and TRL's reference for
/// a PEFT model). Writes the loss and the LoRA gradients to `out` as [`write_grads`]
/// does; returns the step's loss and figures.
pub fn write_dpo_grads(
    model: &Llama,
    model_dir: &Path,
    pairs: &Path,
    (beta, max_seq_len): (f64, usize),
    out: &Path,
) -> Result<(f64, tuneq_openapi::PreferenceMetrics)> {
    use tuneq_openapi::{ChatTemplateChoice, DatasetFormat, DtypeKind, TrainingMethod};
    let encoder = crate::data::Encoder::from_model_dir(model_dir, ChatTemplateChoice::Model)?;
    let method = TrainingMethod::Dpo { beta };
    let files = [pairs.to_path_buf()];
    let data = crate::train::encode_files(
        &encoder,
        &files,
        DatasetFormat::Preference,
        method,
        max_seq_len,
    )?;
    let pad_id = encoder.eos_token_id().unwrap_or(0);
    let base = load_model(model_dir, None, DtypeKind::F32)?;
    let all = data.pairs.len();
    let reference = crate::train::pair_logps(&base, &data.pairs, all, pad_id)?;
    let refs: Vec<_> = data.pairs.iter().collect();
    let batch = crate::train::pair_batch(&refs, pad_id);
    let objective = crate::step::Objective::Dpo {
        beta,
        reference: std::slice::from_ref(&reference),
    };
    let r = crate::train::accumulate_for(model, std::slice::from_ref(&batch), None, objective)?;
    save_grads(model, &r, out)?;
    let figures = r.preference.ok_or_else(|| Error::Model {
        path: pairs.display().to_string(),
        message: "a DPO step reported no preference figures".into(),
    })?;
    Ok((r.loss, figures))
}

/// The optimiser settings of [`write_steps`].
#[derive(Debug, Clone, Copy)]
pub struct StepsConfig {
    /// Micro-batches per optimiser step.
    pub micro_batches: usize,
    /// Constant learning rate.
    pub lr: f64,
    /// Global-norm clipping threshold (≤ 0: off).
    pub max_grad_norm: f64,
    /// AdamW settings.
    pub adamw: crate::optim::AdamWConfig,
    /// LoRA dropout probability.
    pub dropout: f64,
    /// Seed of the dropout streams (one per step, as in training).
    pub seed: u64,
}

/// One `i64` tensor of a safetensors file as a flat vector with its shape.
fn read_i64(
    tensors: &std::collections::HashMap<String, Tensor>,
    name: &str,
    path: &Path,
) -> Result<(Vec<i64>, Vec<usize>)> {
    let t = tensors.get(name).ok_or_else(|| Error::Safetensors {
        path: path.display().to_string(),
        message: format!("no tensor named {name}"),
    })?;
    Ok((
        t.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?,
        t.dims().to_vec(),
    ))
}

/// Runs optimiser steps exactly as training does, over the micro-batches in `input`
/// (`input_ids`, `labels` and `attention_mask`, each (micro-batches, rows, len); step s
/// takes micro-batches `s·m … s·m + m − 1`). After each step `out/step-N.safetensors`
/// holds the adapter (PEFT keys) with `loss` and `grad_norm`; with dropout,
/// `out/masks.safetensors` holds every mask as `s{step}.m{micro}.{module}`. Returns the
/// losses.
pub fn write_steps(model: &Llama, input: &Path, out: &Path, cfg: &StepsConfig) -> Result<Vec<f64>> {
    let m = cfg.micro_batches.max(1);
    let batches = read_micro_batches(model, input, m)?;
    let modules: Vec<String> = model
        .lora_vars()
        .iter()
        .filter_map(|v| v.name.strip_suffix(".lora_A.weight").map(str::to_string))
        .collect();
    let mut opt = crate::optim::AdamW::new(model.lora_vars(), cfg.adamw)?;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let mut masks = BTreeMap::new();
    let mut losses = Vec::new();
    for (step, micro) in batches.chunks(m).enumerate() {
        let mut rng = crate::batch::rng_for(cfg.seed, crate::batch::streams::DROPOUT + step as u64);
        let mut drawn = Vec::new();
        let done = crate::train::optimiser_step(
            model,
            &mut opt,
            micro,
            Some(crate::train::StepDropout {
                p: cfg.dropout,
                rng: &mut rng,
                record: Some(&mut drawn),
            }),
            crate::train::Update {
                objective: crate::step::Objective::CrossEntropy,
                max_grad_norm: cfg.max_grad_norm,
                lr: cfg.lr,
            },
        )?;
        name_masks(&mut masks, drawn, &modules, step, micro.len())?;
        save_step(model, out, step, &done)?;
        losses.push(done.loss);
    }
    if !masks.is_empty() {
        crate::weights::save_safetensors(&out.join("masks.safetensors"), &masks)?;
    }
    Ok(losses)
}

/// The micro-batches in `input` (`input_ids`, `labels`, `attention_mask`, each
/// (micro-batches, rows, len)), checked to be whole steps of `m` over `model`'s
/// vocabulary.
fn read_micro_batches(model: &Llama, input: &Path, m: usize) -> Result<Vec<Batch>> {
    let tensors = crate::weights::load_safetensors(input, &Device::Cpu)?;
    let (ids, shape) = read_i64(&tensors, "input_ids", input)?;
    let (labels, label_shape) = read_i64(&tensors, "labels", input)?;
    let (attention, mask_shape) = read_i64(&tensors, "attention_mask", input)?;
    let bad = |message: String| Error::Safetensors {
        path: input.display().to_string(),
        message,
    };
    let [count, rows, len] = shape[..] else {
        return Err(bad(format!(
            "input_ids has shape {shape:?}, expected (micro-batches, rows, len)"
        )));
    };
    if label_shape != shape || mask_shape != shape {
        return Err(bad(
            "input_ids, labels and attention_mask differ in shape".into()
        ));
    }
    if count == 0 || count % m != 0 {
        return Err(bad(format!(
            "{count} micro-batches are not whole steps of {m}"
        )));
    }
    let vocab = model.cfg.vocab_size() as i64;
    if ids.iter().any(|&t| !(0..vocab).contains(&t)) {
        return Err(bad("a token id is outside the vocabulary".into()));
    }
    let size = rows * len;
    Ok((0..count)
        .map(|i| {
            let span = i * size..(i + 1) * size;
            let ids = ids[span.clone()].iter().map(|&t| t as u32).collect();
            crate::batch::labelled_batch(ids, &labels[span.clone()], &attention[span], rows, len)
        })
        .collect())
}

/// Files the masks one step drew under `s{step}.m{micro}.{module}`. Masks come
/// micro-batch by micro-batch (`micro_batches` of them), each in the order the adapted
/// projections run: layer by layer, in `model::PROJECTIONS` order.
fn name_masks(
    masks: &mut BTreeMap<String, Tensor>,
    drawn: Vec<Tensor>,
    modules: &[String],
    step: usize,
    micro_batches: usize,
) -> Result<()> {
    if !drawn.is_empty() && drawn.len() != modules.len() * micro_batches {
        return Err(Error::Model {
            path: "debug steps".into(),
            message: format!(
                "{} dropout masks for {} adapted projections",
                drawn.len(),
                modules.len()
            ),
        });
    }
    for (i, mask) in drawn.into_iter().enumerate() {
        let name = format!(
            "s{step}.m{}.{}",
            i / modules.len(),
            modules[i % modules.len()]
        );
        masks.insert(name, mask);
    }
    Ok(())
}

/// Writes `out/step-{step + 1}.safetensors`: the adapter after the step, its loss and
/// its gradient norm.
fn save_step(model: &Llama, out: &Path, step: usize, done: &crate::train::Stepped) -> Result<()> {
    let mut saved: BTreeMap<String, Tensor> = model
        .lora_vars()
        .into_iter()
        .map(|v| (v.name, v.var.as_tensor().clone()))
        .collect();
    saved.insert("loss".into(), Tensor::new(done.loss as f32, &Device::Cpu)?);
    saved.insert(
        "grad_norm".into(),
        Tensor::new(done.grad_norm as f32, &Device::Cpu)?,
    );
    crate::weights::save_safetensors(&out.join(format!("step-{}.safetensors", step + 1)), &saved)
}
