//! One decoding step for several sequences at once: how a server decodes concurrent
//! answers together.
//!
//! Each sequence adds one token after the tokens its own key/value cache holds (caches
//! of different lengths). The projections and the MLP run once over all the new
//! tokens, so every frozen weight is read once per step rather than once per sequence
//! — the cost that dominates decoding; RoPE runs once over all rows, each at its own
//! position. Attention runs per sequence over its own cache, on plain slices: the
//! cache is kept in row form ([`RowLayer`]), appended in place, so a step costs no
//! tensor copies of the caches and no small tensor operations per sequence. Row i is
//! what [`Llama::forward_cached`] gives for sequence i alone (within float rounding).

use super::{KvCache, Layer, Llama};
use crate::error::{Error, Result};
use crate::lora::LoraLinear;
use crate::ops::{rms_norm, rope};
use candle_core::{DType, Storage, Tensor};

/// One layer's keys and values in row form: position by position, kv head by kv head,
/// `head_dim` floats each (after RoPE), so a new position is appended in place.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowLayer {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl RowLayer {
    /// The row form of a layer's cached tensors ((1, kv heads, tokens, head dim)).
    fn from_tensors(cached: Option<&(Tensor, Tensor)>) -> Result<Self> {
        let flat = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.squeeze(0)?
                .transpose(0, 1)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        Ok(match cached {
            Some((k, v)) => Self {
                k: flat(k)?,
                v: flat(v)?,
            },
            None => Self::default(),
        })
    }
}

/// Writes into `out` (heads × head_dim) the attention of the query `q` (heads ×
/// head_dim) over every position of `layer` (kv heads shared by groups of heads).
fn attend(q: &[f32], layer: &RowLayer, (nh, nkv, hd): (usize, usize, usize), out: &mut [f32]) {
    let positions = layer.k.len() / (nkv * hd);
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut weights = vec![0f32; positions];
    for h in 0..nh {
        let g = h / group;
        let q = &q[h * hd..(h + 1) * hd];
        let at = |p: usize| (p * nkv + g) * hd;
        for (p, w) in weights.iter_mut().enumerate() {
            let k = &layer.k[at(p)..at(p) + hd];
            *w = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
        }
        let max = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0;
        for w in weights.iter_mut() {
            *w = (*w - max).exp();
            total += *w;
        }
        let out = &mut out[h * hd..(h + 1) * hd];
        out.fill(0.0);
        for (p, w) in weights.iter().enumerate() {
            let v = &layer.v[at(p)..at(p) + hd];
            let w = w / total;
            for (o, x) in out.iter_mut().zip(v) {
                *o += w * x;
            }
        }
    }
}

/// `x`·`w`ᵀ for `x` (…, in) of several rows and `w` (out, in), both f32 on the CPU, by
/// the kernels' own GEMM; None where that does not apply (one row: candle's product,
/// the one [`Llama::forward_cached`] takes, so one answer alone decodes as it always
/// did). For a few rows candle's GEMM packs the whole weight every call (measured: 8
/// rows of SmolLM2 cost 4× one); computed as `W·xᵀ`, the own GEMM reads the weight in
/// place and packs only the few rows (a step of 8 rows: 110 → 80 ms).
fn rows_linear(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let (out, inp) = w.dims2()?;
    let rows = x.elem_count() / inp.max(1);
    if rows < 2 || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        return Ok(None);
    }
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let (storage, layout) = w.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return Ok(None);
    };
    let Ok(weights) = cpu.as_slice::<f32>() else {
        return Ok(None);
    };
    // yᵀ = W·xᵀ: the GEMM reads its left operand in place and packs the right one,
    // which is the few rows of x, not the weight.
    let mut by_weight = vec![0f32; out * rows];
    use tuneq_kernels::{Mat, MatMut, gemm};
    gemm(
        1.0,
        Mat::new(&weights[start..end], out, inp),
        Mat::new(&xs, rows, inp).t(),
        0.0,
        MatMut::new(&mut by_weight, out, rows),
    );
    let mut y = vec![0f32; rows * out];
    for (j, column) in by_weight.chunks_exact(rows).enumerate() {
        for (i, &value) in column.iter().enumerate() {
            y[i * out + j] = value;
        }
    }
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = out;
    }
    Ok(Some(Tensor::from_vec(y, dims, x.device())?))
}

/// A projection of a decoding step: the frozen product by [`rows_linear`] where it
/// applies, plus the LoRA update as the layer computes it.
fn project(p: &LoraLinear, x: &Tensor) -> Result<Tensor> {
    let Some(base) = rows_linear(x, &p.weight)? else {
        return Ok(p.forward(x, None)?);
    };
    match p.lora_delta(x)? {
        Some(delta) => Ok((base + delta)?),
        None => Ok(base),
    }
}

/// The RoPE tables of each sequence's next position.
type Rotation = (Tensor, Tensor);

impl Llama {
    /// Logits (sequences, vocab) of the token after `ids[i]` for each sequence i, where
    /// `ids[i]` continues the tokens `caches[i]` holds; each id's keys and values are
    /// appended to its cache. No dropout, no gradients.
    pub fn forward_cached_rows(&self, ids: &[u32], caches: &mut [&mut KvCache]) -> Result<Tensor> {
        let rows = ids.len();
        let limit = self.cos.dim(0)?;
        let unusable = caches
            .iter()
            .find(|c| c.len >= limit || c.layers.len() != self.layers.len());
        if rows == 0 || rows != caches.len() || unusable.is_some() {
            return Err(Error::Model {
                path: "model".into(),
                message: format!(
                    "cannot step {rows} tokens over {} caches (max_position_embeddings {limit})",
                    caches.len()
                ),
            });
        }
        let hidden = self.cfg.hidden_size();
        let input = Tensor::from_vec(ids.to_vec(), rows, &self.device)?;
        let mut x = self
            .embed_tokens
            .index_select(&input, 0)?
            .reshape((rows, 1, hidden))?;
        if self.dtype != DType::F32 {
            return Err(Error::Model {
                path: "model".into(),
                message: "decoding several sequences at once needs f32 weights".into(),
            });
        }
        for cache in caches.iter_mut().filter(|c| c.rows.is_empty()) {
            cache.rows = cache
                .layers
                .iter_mut()
                .map(|slot| RowLayer::from_tensors(slot.take().as_ref()))
                .collect::<Result<_>>()?;
        }
        let positions: Vec<u32> = caches.iter().map(|c| c.len as u32).collect();
        let positions = Tensor::from_vec(positions, rows, &self.device)?;
        let half = self.cos.dim(1)?;
        let rotation = (
            self.cos
                .index_select(&positions, 0)?
                .reshape((rows, 1, half))?,
            self.sin
                .index_select(&positions, 0)?
                .reshape((rows, 1, half))?,
        );
        for (l, layer) in self.layers.iter().enumerate() {
            x = self.layer_rows(layer, l, &x, &rotation, caches)?.detach();
        }
        for cache in caches.iter_mut() {
            cache.len += 1;
        }
        let last = rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)?.reshape((rows, hidden))?;
        match rows_linear(&last, &self.lm_head)? {
            Some(logits) => Ok(logits),
            None => Ok(self.logits(&last)?.to_dtype(DType::F32)?),
        }
    }

    /// Decoder layer `l` on one new token per sequence (`x`: rows, 1, hidden), each
    /// rotated by its row of `rotation` ((rows, 1, head_dim / 2) each).
    fn layer_rows(
        &self,
        layer: &Layer,
        l: usize,
        x: &Tensor,
        (cos, sin): &Rotation,
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let cfg = &self.cfg;
        let dims @ (nh, nkv, hd) = (
            cfg.num_attention_heads(),
            cfg.num_kv_heads(),
            cfg.head_dim(),
        );
        let [q_p, k_p, v_p, o_p, gate_p, up_p, down_p] = layer.projections.as_slice() else {
            return Err(Error::Model {
                path: "model".into(),
                message: "layer without seven projections".into(),
            });
        };
        let hn = rms_norm(x, &layer.input_layernorm, cfg.rms_norm_eps)?;
        // (rows, heads, 1, head_dim), rotated, as plain floats.
        let heads = |p: &LoraLinear, n: usize, rotate: bool| -> Result<Vec<f32>> {
            let h = project(p, &hn)?
                .reshape((rows, 1, n, hd))?
                .transpose(1, 2)?
                .contiguous()?;
            let h = if rotate { rope(&h, cos, sin)? } else { h };
            Ok(h.flatten_all()?.to_vec1::<f32>()?)
        };
        let (q, k, v) = (
            heads(q_p, nh, true)?,
            heads(k_p, nkv, true)?,
            heads(v_p, nkv, false)?,
        );
        let mut attended = vec![0f32; rows * nh * hd];
        let (q_len, kv_len) = (nh * hd, nkv * hd);
        for (i, cache) in caches.iter_mut().enumerate() {
            let row = &mut cache.rows[l];
            row.k.extend_from_slice(&k[i * kv_len..(i + 1) * kv_len]);
            row.v.extend_from_slice(&v[i * kv_len..(i + 1) * kv_len]);
            attend(
                &q[i * q_len..(i + 1) * q_len],
                row,
                dims,
                &mut attended[i * q_len..(i + 1) * q_len],
            );
        }
        let attn = Tensor::from_vec(attended, (rows, 1, nh * hd), x.device())?;
        let x = (x + project(o_p, &attn)?)?;
        let hn = rms_norm(&x, &layer.post_attention_layernorm, cfg.rms_norm_eps)?;
        let gate = project(gate_p, &hn)?.silu()?;
        let up = project(up_p, &hn)?;
        Ok((&x + project(down_p, &(gate * up)?)?)?)
    }
}

#[cfg(test)]
mod tests {
    use crate::init::{InitOptions, Preset, preset_config};
    use crate::model::Llama;
    use candle_core::Tensor;

    fn tiny() -> Llama {
        let opts = InitOptions {
            preset: Preset::Tiny,
            seed: 9,
            shards: 1,
            tie_embeddings: false,
            llama3_rope: true,
        };
        let mut cfg = preset_config(&opts);
        cfg.shape.num_key_value_heads = Some(2);
        crate::init::random_model(cfg, 9, None).expect("model")
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
            .expect("diff")
    }

    #[test]
    fn a_step_over_rows_gives_each_sequence_its_own_logits() {
        let m = tiny();
        // Three prompts of different lengths, each then stepped alone and together.
        let prompts: [Vec<u32>; 3] = [
            (0..5).map(|i| i * 37 + 1).collect(),
            (0..17).map(|i| i * 11 + 3).collect(),
            vec![42],
        ];
        let mut alone: Vec<_> = prompts.iter().map(|_| m.new_cache()).collect();
        let mut together: Vec<_> = prompts.iter().map(|_| m.new_cache()).collect();
        for (p, (a, t)) in prompts
            .iter()
            .zip(alone.iter_mut().zip(together.iter_mut()))
        {
            m.forward_cached(p, a).expect("prefill");
            m.forward_cached(p, t).expect("prefill");
        }
        for step in 0..4u32 {
            let ids: Vec<u32> = (0..3).map(|i| 100 + step * 7 + i).collect();
            let mut refs: Vec<&mut crate::model::KvCache> = together.iter_mut().collect();
            let rows = m.forward_cached_rows(&ids, &mut refs).expect("rows");
            assert_eq!(rows.dims(), &[3, m.cfg.vocab_size()]);
            for (i, cache) in alone.iter_mut().enumerate() {
                let one = m.forward_cached(&ids[i..=i], cache).expect("one");
                let row = rows.get(i).expect("row");
                let diff = max_diff(&one, &row);
                assert!(diff < 1e-4, "step {step}, sequence {i}: {diff}");
            }
        }
        for (a, t) in alone.iter().zip(&together) {
            assert_eq!(a.len(), t.len());
        }
    }

    #[test]
    fn bad_steps_are_refused() {
        let m = tiny();
        let mut cache = m.new_cache();
        assert!(m.forward_cached_rows(&[], &mut []).is_err());
        assert!(m.forward_cached_rows(&[1, 2], &mut [&mut cache]).is_err());
    }
}
