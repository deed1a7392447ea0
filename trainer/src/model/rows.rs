//! One decoding step for several sequences at once: how a server decodes concurrent
//! answers together.
//!
//! Each sequence adds one token after the tokens its own key/value cache holds (caches
//! of different lengths). The projections and the MLP run once over all the new
//! tokens, so every frozen weight is read once per step rather than once per sequence
//! — the cost that dominates decoding; attention runs per sequence, over its own cache,
//! with its own positions. Row i is what [`Llama::forward_cached`] gives for sequence i
//! alone (within float rounding: the products are the same sums in another blocking).

use super::{KvCache, Layer, Llama, repeat_kv};
use crate::error::{Error, Result};
use crate::lora::LoraLinear;
use crate::ops::{causal_softmax, rms_norm, rope};
use candle_core::{DType, Storage, Tensor};

/// `x`·`w`ᵀ for `x` (…, in) of several rows and `w` (out, in), both f32 on the CPU, by
/// the kernels' own GEMM; None where that does not apply (one row: candle's product,
/// the one [`Llama::forward_cached`] takes, so one answer alone decodes as it always
/// did). For a few rows candle's GEMM is slower than for one (measured: 8 rows of
/// SmolLM2 cost 4× one), the own GEMM about as fast as one row.
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
    let mut y = vec![0f32; rows * out];
    use tuneq_kernels::{Mat, MatMut, gemm};
    gemm(
        1.0,
        Mat::new(&xs, rows, inp),
        Mat::new(&weights[start..end], out, inp).t(),
        0.0,
        MatMut::new(&mut y, rows, out),
    );
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

/// The RoPE tables of one sequence's next position.
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
        let rotations = caches
            .iter()
            .map(|c| {
                Ok((
                    self.cos.narrow(0, c.len, 1)?.contiguous()?,
                    self.sin.narrow(0, c.len, 1)?.contiguous()?,
                ))
            })
            .collect::<Result<Vec<Rotation>>>()?;
        for (l, layer) in self.layers.iter().enumerate() {
            x = self.layer_rows(layer, l, &x, &rotations, caches)?.detach();
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

    /// Decoder layer `l` on one new token per sequence (`x`: rows, 1, hidden).
    fn layer_rows(
        &self,
        layer: &Layer,
        l: usize,
        x: &Tensor,
        rotations: &[Rotation],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (
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
        let heads = |p: &LoraLinear, n: usize| -> Result<Tensor> {
            Ok(project(p, &hn)?
                .reshape((rows, 1, n, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (heads(q_p, nh)?, heads(k_p, nkv)?, heads(v_p, nkv)?);
        let mut attended = Vec::with_capacity(rows);
        for (i, ((cos, sin), cache)) in rotations.iter().zip(caches.iter_mut()).enumerate() {
            let q = rope(&q.narrow(0, i, 1)?, cos, sin)?;
            let k = rope(&k.narrow(0, i, 1)?, cos, sin)?;
            let v = v.narrow(0, i, 1)?;
            let slot = &mut cache.layers[l];
            let (k, v) = match slot.take() {
                Some((past_k, past_v)) => (
                    Tensor::cat(&[&past_k, &k], 2)?.detach(),
                    Tensor::cat(&[&past_v, &v], 2)?.detach(),
                ),
                None => (k.detach(), v.detach()),
            };
            *slot = Some((k.clone(), v.clone()));
            let (k, v) = (repeat_kv(&k, nh / nkv)?, repeat_kv(&v, nh / nkv)?);
            let scores = q.matmul(&k.t()?)?.affine(1.0 / (hd as f64).sqrt(), 0.0)?;
            let probs = causal_softmax(&scores)?;
            attended.push(
                probs
                    .matmul(&v)?
                    .transpose(1, 2)?
                    .reshape((1, 1, nh * hd))?,
            );
        }
        let attn = Tensor::cat(&attended, 0)?;
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
