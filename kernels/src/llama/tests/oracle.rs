//! The f64 oracle the step is checked against: a naive Llama LoRA forward with
//! dropout masks, finite differences of its loss, and the tiny models and batches the
//! tests build.

use super::super::*;
use rand::{Rng, SeedableRng};

pub(super) fn random(n: usize, rng: &mut rand_chacha::ChaCha8Rng, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A model's tensors, owned; [`Owned::view`] lends them as a [`Model`].
pub(super) struct Owned {
    pub(super) dims: Dims,
    pub(super) embed: Vec<f32>,
    pub(super) norms: Vec<[Vec<f32>; 2]>,
    pub(super) weights: Vec<[Vec<f32>; 7]>,
    /// LoRA tensors in gradient order (layer, projection, A then B).
    pub(super) lora: Vec<Vec<f32>>,
    /// Per layer, which projections carry LoRA.
    pub(super) targets: Vec<[bool; 7]>,
    pub(super) r: usize,
    pub(super) lora_scale: f32,
    pub(super) norm: Vec<f32>,
    pub(super) lm_head: Vec<f32>,
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
    /// Per layer, the biases of q, k and v (Qwen2's), when the model has them.
    pub(super) qkv_bias: Option<Vec<[Vec<f32>; 3]>>,
    /// Per layer, the q and k heads' norm weights (Qwen3's), when the model has them.
    pub(super) qk_norm: Option<Vec<[Vec<f32>; 2]>>,
}

pub(super) fn tiny_dims() -> Dims {
    Dims {
        vocab: 61,
        hidden: 16,
        intermediate: 24,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        rotary_dim: 4,
        rms_eps: 1e-5,
        qk_norm: false,
        gemma: None,
    }
}

/// Llama 2 7B's shape, for the memory figures the module notes quote.
pub(super) fn llama7b() -> Dims {
    Dims {
        vocab: 32000,
        hidden: 4096,
        intermediate: 11008,
        layers: 32,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        rotary_dim: 128,
        rms_eps: 1e-5,
        qk_norm: false,
        gemma: None,
    }
}

/// Runs `step` with a dropout source that hands out `masks` in order, one per adapted
/// projection (checking each one's size), or with none when `masks` is empty.
pub(super) fn with_masks<R>(
    masks: &[Vec<f32>],
    step: impl FnOnce(Option<MaskSource<'_>>) -> R,
) -> R {
    let mut queue = masks.iter().cloned();
    let mut source = |rows: usize, inputs: usize| {
        let mask = queue.next().expect("a mask for every adapted projection");
        assert_eq!(mask.len(), rows * inputs);
        mask
    };
    step(if masks.is_empty() {
        None
    } else {
        Some(&mut source)
    })
}

/// HF's rotate-half tables, angle(p, i) = p / 10000^(2i/d).
pub(super) fn rope_tables(max_pos: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let (mut cos, mut sin) = (vec![], vec![]);
    for p in 0..max_pos {
        for i in 0..half {
            let angle = p as f64 / 10_000f64.powf(2.0 * i as f64 / head_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

impl Owned {
    pub(super) fn random(dims: Dims, targets: &[[bool; 7]], r: usize, seed: u64) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (v, h) = (dims.vocab, dims.hidden);
        let embed = random(v * h, &mut rng, -1.0, 1.0);
        let mut norms = vec![];
        let mut weights = vec![];
        let mut lora = vec![];
        for targets in targets.iter().cycle().take(dims.layers) {
            norms.push([random(h, &mut rng, 0.5, 1.5), random(h, &mut rng, 0.5, 1.5)]);
            let w: [Vec<f32>; 7] = std::array::from_fn(|p| {
                let (i, o) = dims.projection_shape(p);
                let bound = 1.0 / (i as f32).sqrt();
                random(o * i, &mut rng, -bound, bound)
            });
            weights.push(w);
            for (p, &t) in targets.iter().enumerate() {
                if t {
                    let (i, o) = dims.projection_shape(p);
                    let bound = 1.0 / (i as f32).sqrt();
                    lora.push(random(r * i, &mut rng, -bound, bound));
                    // B non-zero, so that A gets a gradient too.
                    lora.push(random(o * r, &mut rng, -0.3, 0.3));
                }
            }
        }
        let norm = random(h, &mut rng, 0.5, 1.5);
        let bound = 1.0 / (h as f32).sqrt();
        let lm_head = random(v * h, &mut rng, -4.0 * bound, 4.0 * bound);
        let (cos, sin) = rope_tables(128, dims.head_dim);
        Self {
            dims,
            embed,
            norms,
            weights,
            lora,
            targets: targets.iter().cycle().take(dims.layers).copied().collect(),
            r,
            lora_scale: 1.5,
            norm,
            lm_head,
            cos,
            sin,
            qkv_bias: None,
            qk_norm: None,
        }
    }

    /// The same model with per-head norms on q and k (Qwen3's decoder), their weights
    /// drawn near one.
    pub(super) fn with_qk_norm(mut self, seed: u64) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let hd = self.dims.head_dim;
        self.dims.qk_norm = true;
        self.qk_norm = Some(
            (0..self.dims.layers)
                .map(|_| std::array::from_fn(|_| random(hd, &mut rng, 0.5, 1.5)))
                .collect(),
        );
        self
    }

    /// The same model with random biases on q, k and v (Qwen2's decoder).
    pub(super) fn with_qkv_bias(mut self, seed: u64) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let dims = self.dims;
        self.qkv_bias = Some(
            (0..dims.layers)
                .map(|_| {
                    std::array::from_fn(|p| random(dims.projection_shape(p).1, &mut rng, -0.5, 0.5))
                })
                .collect(),
        );
        self
    }

    pub(super) fn view(&self) -> Model<'_> {
        let mut next = 0;
        let layers = (0..self.dims.layers)
            .map(|l| Layer {
                qk_norm: self.qk_norm.as_ref().map(|n| QkNorm {
                    q: &n[l][0],
                    k: &n[l][1],
                }),
                input_norm: &self.norms[l][0],
                post_norm: &self.norms[l][1],
                gemma: None,
                proj: std::array::from_fn(|p| Projection {
                    bias: self
                        .qkv_bias
                        .as_ref()
                        .and_then(|b| b[l].get(p))
                        .map(Vec::as_slice),
                    weight: Frozen::F32(&self.weights[l][p]),
                    lora: self.targets[l][p].then(|| {
                        next += 2;
                        Lora {
                            a: &self.lora[next - 2],
                            b: &self.lora[next - 1],
                            r: self.r,
                            scale: self.lora_scale,
                        }
                    }),
                }),
            })
            .collect();
        Model {
            dims: self.dims,
            embed: Frozen::F32(&self.embed),
            layers,
            norm: &self.norm,
            lm_head: Frozen::F32(&self.lm_head),
            cos: &self.cos,
            sin: &self.sin,
            local_rope: None,
            compute: Compute::F32,
        }
    }

    pub(super) fn zero_grads(&self) -> Vec<Vec<f32>> {
        self.lora.iter().map(|t| vec![0.0; t.len()]).collect()
    }

    pub(super) fn lora64(&self) -> Vec<Vec<f64>> {
        self.lora.iter().map(|t| widen(t)).collect()
    }
}

pub(super) fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// A batch's buffers, owned.
/// Two rows of 9: row 0 packs two examples (4 and 5 tokens; positions restart, the
/// second segment starts at column 4), row 1 holds 6 tokens right-padded with 3 pads
/// (id 0, no target). A few real tokens are unlabelled too (the prompt, say).
pub(super) fn tiny_batch(vocab: usize, seed: u64) -> OwnedBatch {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (rows, len) = (2, 9);
    let ids: Vec<u32> = (0..rows * len)
        .map(|i| {
            if i >= len + 6 {
                0
            } else {
                rng.random_range(0..vocab as u32)
            }
        })
        .collect();
    let mut targets: Vec<i64> = (0..rows * len)
        .map(|_| rng.random_range(0..vocab as i64))
        .collect();
    for i in [0, 3, 4, len, len + 5, len + 6, len + 7, len + 8] {
        targets[i] = -100;
    }
    let positions = [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8].to_vec();
    let starts = [0, 0, 0, 0, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0].to_vec();
    OwnedBatch {
        ids,
        rows,
        len,
        targets,
        positions,
        starts,
    }
}

/// The model in f64 with plain loops, from the definitions (HF's Llama with PEFT's
/// LoRA): `lora` replaces the model's LoRA tensors (gradient order), `masks` are the
/// dropout masks in forward order (empty: no dropout).
pub(super) fn reference_loss(
    m: &Owned,
    lora: &[Vec<f64>],
    batch: &OwnedBatch,
    scale: f64,
    masks: &[Vec<f32>],
) -> f64 {
    let d = m.dims;
    let (h, n, hd) = (d.hidden, batch.rows * batch.len, d.head_dim);
    let (nh, nkv) = (d.heads, d.kv_heads);
    let eps = d.rms_eps as f64;
    let rms_norm = |x: &[f64], w: &[f32]| -> Vec<f64> {
        let mut y = vec![0.0; x.len()];
        for (row, out) in x.chunks(h).zip(y.chunks_mut(h)) {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / h as f64;
            let r = 1.0 / (ms + eps).sqrt();
            for j in 0..h {
                out[j] = row[j] * r * w[j] as f64;
            }
        }
        y
    };
    let mut next_lora = 0;
    let mut next_mask = 0;
    // x (n × in) → n × out, with W, and LoRA when the projection has it.
    let mut linear = |x: &[f64], l: usize, p: usize| -> Vec<f64> {
        let (i, o) = d.projection_shape(p);
        let w = &m.weights[l][p];
        let mut y = vec![0.0; n * o];
        let bias = m.qkv_bias.as_ref().and_then(|b| b[l].get(p));
        for t in 0..n {
            for c in 0..o {
                y[t * o + c] = (0..i)
                    .map(|k| x[t * i + k] * w[c * i + k] as f64)
                    .sum::<f64>()
                    + bias.map_or(0.0, |b| b[c] as f64);
            }
        }
        if m.targets[l][p] {
            let (a, b) = (&lora[next_lora], &lora[next_lora + 1]);
            next_lora += 2;
            let mut xd = x.to_vec();
            if !masks.is_empty() {
                for (v, &k) in xd.iter_mut().zip(&masks[next_mask]) {
                    *v *= k as f64;
                }
                next_mask += 1;
            }
            let r = m.r;
            for t in 0..n {
                let u: Vec<f64> = (0..r)
                    .map(|q| (0..i).map(|k| xd[t * i + k] * a[q * i + k]).sum())
                    .collect();
                for c in 0..o {
                    let delta: f64 = (0..r).map(|q| u[q] * b[c * r + q]).sum();
                    y[t * o + c] += m.lora_scale as f64 * delta;
                }
            }
        }
        y
    };
    let rope = |x: &mut [f64], heads: usize| {
        let half = hd / 2;
        for t in 0..n {
            let pos = batch.positions[t] as usize;
            for head in 0..heads {
                let v = &mut x[(t * heads + head) * hd..][..hd];
                let old = v.to_vec();
                for j in 0..hd {
                    let c = m.cos[pos * half + j % half] as f64;
                    let s = m.sin[pos * half + j % half] as f64;
                    let rotated = if j < half {
                        -old[j + half]
                    } else {
                        old[j - half]
                    };
                    v[j] = old[j] * c + rotated * s;
                }
            }
        }
    };
    let mut x: Vec<f64> = batch
        .ids
        .iter()
        .flat_map(|&id| widen(&m.embed[id as usize * h..][..h]))
        .collect();
    for l in 0..d.layers {
        let hn = rms_norm(&x, &m.norms[l][0]);
        let mut q = linear(&hn, l, Q);
        let mut k = linear(&hn, l, K);
        let v = linear(&hn, l, V);
        if let Some(norms) = &m.qk_norm {
            // Qwen3: each head RMS-normalised over head_dim, then scaled.
            for (x, w) in [(&mut q, &norms[l][0]), (&mut k, &norms[l][1])] {
                for head in x.chunks_mut(hd) {
                    let ms = head.iter().map(|v| v * v).sum::<f64>() / hd as f64;
                    let r = 1.0 / (ms + eps).sqrt();
                    for (v, &w) in head.iter_mut().zip(w) {
                        *v *= r * w as f64;
                    }
                }
            }
        }
        rope(&mut q, nh);
        rope(&mut k, nkv);
        let mut attn = vec![0.0; n * nh * hd];
        for t in 0..n {
            let (row, col) = (t / batch.len, t % batch.len);
            for head in 0..nh {
                let g = head / (nh / nkv);
                let keys: Vec<usize> = (batch.starts[t] as usize..=col)
                    .map(|j| row * batch.len + j)
                    .collect();
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&u| {
                        (0..hd)
                            .map(|c| q[(t * nh + head) * hd + c] * k[(u * nkv + g) * hd + c])
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
                for c in 0..hd {
                    attn[(t * nh + head) * hd + c] = keys
                        .iter()
                        .zip(&s)
                        .map(|(&u, x)| (x - max).exp() / sum * v[(u * nkv + g) * hd + c])
                        .sum();
                }
            }
        }
        let o = linear(&attn, l, O);
        x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        let hn = rms_norm(&x, &m.norms[l][1]);
        let gate = linear(&hn, l, GATE);
        let up = linear(&hn, l, UP);
        let act: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let down = linear(&act, l, DOWN);
        x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
    }
    let hf = rms_norm(&x, &m.norm);
    let mut total = 0.0;
    for t in 0..n {
        let Ok(target) = usize::try_from(batch.targets[t]) else {
            continue;
        };
        let logits: Vec<f64> = (0..d.vocab)
            .map(|v| {
                (0..h)
                    .map(|j| hf[t * h + j] * m.lm_head[v * h + j] as f64)
                    .sum()
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        total += lse - logits[target];
    }
    total * scale
}

pub(super) const ALL: [bool; 7] = [true; 7];
pub(super) const QV: [bool; 7] = [true, false, true, false, false, false, false];
pub(super) const NONE: [bool; 7] = [false; 7];

/// Central differences of the f64 reference loss for every LoRA parameter, in
/// gradient order.
pub(super) fn finite_differences(
    m: &Owned,
    b: &OwnedBatch,
    scale: f64,
    masks: &[Vec<f32>],
) -> Vec<Vec<f64>> {
    let base = m.lora64();
    let step = 1e-5;
    (0..base.len())
        .map(|t| {
            (0..base[t].len())
                .map(|e| {
                    let mut lora = base.clone();
                    lora[t][e] = base[t][e] + step;
                    let plus = reference_loss(m, &lora, b, scale, masks);
                    lora[t][e] = base[t][e] - step;
                    let minus = reference_loss(m, &lora, b, scale, masks);
                    (plus - minus) / (2.0 * step)
                })
                .collect()
        })
        .collect()
}

/// Checks the step's loss against the reference and every gradient tensor against
/// finite differences, within 1e-4 of the tensor's largest |gradient|; returns the
/// worst loss and gradient errors.
pub(super) fn check_gradients(m: &Owned, b: &OwnedBatch, masks: &[Vec<f32>]) -> (f64, f64) {
    let scale = 1.0 / b.labelled() as f32;
    let mut grads = m.zero_grads();
    let got = with_masks(masks, |dropout| {
        forward_backward(&m.view(), &b.view(), scale, dropout, &mut grads)
    })
    .expect("a step");
    let want = reference_loss(m, &m.lora64(), b, scale as f64, masks);
    let loss_err = (got - want).abs() / want.abs();
    assert!(loss_err <= 1e-5, "loss {got} vs {want}");
    let fd = finite_differences(m, b, scale as f64, masks);
    let mut worst = 0f64;
    for (t, (g, f)) in grads.iter().zip(&fd).enumerate() {
        let size = f.iter().fold(0f64, |a, v| a.max(v.abs()));
        assert!(size > 0.0, "tensor {t} has no gradient");
        for (e, (&g, &f)) in g.iter().zip(f).enumerate() {
            let err = (g as f64 - f).abs() / size;
            worst = worst.max(err);
            assert!(err <= 1e-4, "tensor {t}[{e}]: {g} vs finite difference {f}");
        }
    }
    (loss_err, worst)
}
