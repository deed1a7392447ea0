//! Decoding several sequences in one pass: how a server steps concurrent answers
//! together, and fills the caches of answers that join with their prompts in the same
//! pass.
//!
//! Each sequence adds a span of tokens after the tokens its own key/value cache holds
//! (caches of different lengths): one token for an answer being decoded, a whole prompt
//! for one that joins. The projections and the MLP run once over all the new tokens,
//! so every frozen weight is read once per pass rather than once per sequence — the
//! cost that dominates decoding; RoPE runs once over all rows, each at its own
//! position. Attention runs per sequence over its own cache, on plain slices: the
//! cache is kept in row form ([`RowLayer`]), appended in place, so a step costs no
//! tensor copies of the caches and no small tensor operations per sequence. Prompts
//! that start empty caches attend together through the kernels' fused causal
//! attention, packed end to end as segments of one row. The logits of a span are what
//! [`Llama::forward_cached`] gives for that sequence alone (within float rounding).
//! A window every layer shares (Mistral's, Phi-3's) is the kernels' too: each query
//! sees its cache, or its segment, from the window's edge. Gemma's attention (its own
//! scale, soft-capped scores, windows on some layers) is not: its rows attend over their
//! caches through [`attend_each`]. Phi-3's fused projections run as one product each and are split by
//! row; its partial RoPE turns each head's leading dims, and a span past LongRoPE's
//! pretraining context turns with the long tables, as [`Llama::forward_cached`] does.

use super::{KvCache, Layer, Llama, Roles};
use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::lora::LoraLinear;
use candle_core::{DType, Storage, Tensor};
use tuneq_kernels::attention::{CachedQuery, Heads, attention_forward, attention_over_cache};
use tuneq_kernels::few_rows::{MAX_ROWS, few_rows_times_weight};
use tuneq_kernels::glu::{Gate, glu_forward};
use tuneq_kernels::norm::rms_norm_forward;
use tuneq_kernels::rope::rope_in_place;
use tuneq_kernels::{Mat, MatMut, gemm, to_row_major};

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

/// Where a sequence's new tokens lie among a pass's rows.
#[derive(Debug, Clone, Copy)]
struct Span {
    /// Its first row.
    first: usize,
    /// Its tokens.
    len: usize,
    /// The tokens its cache held before the pass (the first new token's position).
    start: usize,
}

impl Span {
    /// A prompt filling an empty cache: attended by the fused causal attention.
    fn fresh(&self) -> bool {
        self.start == 0 && self.len > 1
    }
}

/// Writes into `attended` (rows × heads·head_dim) the causal attention of the rows of
/// the `fresh` spans, packed end to end as segments of one sequence for the kernels'
/// fused attention; `q`, `k`, `v` hold every row of the pass. With a sliding `window`,
/// each row's first visible key is moved up to the window's edge.
fn attend_fresh(
    fresh: &[Span],
    (q, k, v): (&[f32], &[f32], &[f32]),
    (heads, window): (Heads, Option<usize>),
    attended: &mut [f32],
) {
    let (q_len, kv_len) = (
        heads.heads * heads.head_dim,
        heads.kv_heads * heads.head_dim,
    );
    let seq: usize = fresh.iter().map(|s| s.len).sum();
    let shape = heads.shape(1, seq);
    let mut qkv = Vec::with_capacity(seq * shape.qkv_width());
    let mut starts = Vec::with_capacity(seq);
    for span in fresh {
        let segment = starts.len();
        for row in span.first..span.first + span.len {
            qkv.extend_from_slice(&q[row * q_len..(row + 1) * q_len]);
            qkv.extend_from_slice(&k[row * kv_len..(row + 1) * kv_len]);
            qkv.extend_from_slice(&v[row * kv_len..(row + 1) * kv_len]);
            let edge = window.map_or(0, |w| (starts.len() + 1).saturating_sub(w));
            starts.push(segment.max(edge) as u32);
        }
    }
    let mut out = vec![0f32; seq * q_len];
    let mut lse = vec![0f32; shape.lse_len()];
    attention_forward(&shape, &qkv, &starts, &mut out, &mut lse);
    let mut packed = out.chunks_exact(q_len);
    for span in fresh {
        let rows = span.first * q_len..(span.first + span.len) * q_len;
        for (to, from) in attended[rows].chunks_exact_mut(q_len).zip(&mut packed) {
            to.copy_from_slice(from);
        }
    }
}

/// Rows from which a pass multiplies `x·Wᵀ` as it stands (the GEMM then packs the
/// weight, which many rows amortise) rather than as `W·xᵀ` (which reads the weight in
/// place and packs only the rows, but must transpose the product back). Measured on
/// SmolLM2-135M's shapes (2 threads): `W·xᵀ` was 40 % faster at 8 rows, 13 % at 64,
/// 4 % at 256, before its transpose, which at 64 rows and more costs about that.
const PACKED_WEIGHT_ROWS: usize = 64;

/// The elements of `t`, a contiguous f32 tensor on the CPU, handed to `f`; None for
/// any other tensor.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return None;
    };
    let values = cpu.as_slice::<f32>().ok()?;
    Some(f(&values[start..end]))
}

/// `x·Wᵀ` (rows × out) for `xs` (rows × in) and the weight `w` (out × in), by the
/// kernels: up to [`MAX_ROWS`] rows (a decoding step) stream each weight row once
/// against all of them, bound by memory bandwidth (a step of 8 rows of SmolLM2: 80 ms
/// with candle's GEMM, which packs the whole weight every call, about 30 with this);
/// more rows (prompts) go through the GEMM.
fn times_weight(xs: &[f32], rows: usize, w: &[f32], (out, inp): (usize, usize)) -> Vec<f32> {
    if rows <= MAX_ROWS {
        return few_rows_times_weight(xs, rows, w, out);
    }
    let w = Mat::new(w, out, inp);
    let mut y = vec![0f32; rows * out];
    if rows >= PACKED_WEIGHT_ROWS {
        gemm(
            1.0,
            Mat::new(xs, rows, inp),
            w.t(),
            0.0,
            MatMut::new(&mut y, rows, out),
        );
    } else {
        // yᵀ = W·xᵀ: the GEMM reads its left operand in place and packs the right one,
        // which is the rows of x, not the weight.
        let mut by_weight = vec![0f32; out * rows];
        gemm(
            1.0,
            w,
            Mat::new(xs, rows, inp).t(),
            0.0,
            MatMut::new(&mut by_weight, out, rows),
        );
        to_row_major(Mat::new(&by_weight, out, rows).t(), &mut y);
    }
    y
}

/// A projection of a pass's `rows` rows (`xs`: rows × in): the frozen product by
/// [`times_weight`] (plus the bias, where there is one) plus the LoRA update
/// `scale·(x·Aᵀ)·Bᵀ` added into it by the GEMM. A weight or bias that is not f32 on the
/// CPU takes the layer's own forward.
fn project(p: &LoraLinear, xs: &[f32], rows: usize) -> Result<Vec<f32>> {
    let (out, inp) = p.weight.dims2()?;
    let frozen = with_f32(&p.weight, |w| times_weight(xs, rows, w, (out, inp))).and_then(|y| {
        let Some(bias) = &p.bias else {
            return Some(y);
        };
        with_f32(bias, |b| {
            let mut y = y;
            for row in y.chunks_exact_mut(out) {
                add(row, b);
            }
            y
        })
    });
    let Some(mut y) = frozen else {
        let x = Tensor::from_slice(xs, (rows, inp), p.weight.device())?;
        return Ok(p.forward(&x, None)?.flatten_all()?.to_vec1::<f32>()?);
    };
    let Some(lora) = &p.lora else {
        return Ok(y);
    };
    let r = lora.a.dim(0)?;
    let mut u = vec![0f32; rows * r];
    let added = with_f32(lora.a.as_tensor(), |a| {
        let a = Mat::new(a, r, inp);
        gemm(
            1.0,
            Mat::new(xs, rows, inp),
            a.t(),
            0.0,
            MatMut::new(&mut u, rows, r),
        );
    })
    .and_then(|()| {
        with_f32(lora.b.as_tensor(), |b| {
            let (b, u) = (Mat::new(b, out, r), Mat::new(&u, rows, r));
            gemm(
                p.scale as f32,
                u,
                b.t(),
                1.0,
                MatMut::new(&mut y, rows, out),
            );
        })
    });
    match added {
        Some(()) => Ok(y),
        None => Err(Error::Model {
            path: "model".into(),
            message: "LoRA factors that are not f32 on the CPU".into(),
        }),
    }
}

/// Logits (rows, vocab) of the final hidden states `last` (rows × hidden), soft-capped
/// where the family caps them.
fn head_logits(model: &Llama, last: Vec<f32>, rows: usize) -> Result<Tensor> {
    let shape @ (vocab, hidden) = model.lm_head.dims2()?;
    match with_f32(&model.lm_head, |w| times_weight(&last, rows, w, shape)) {
        Some(mut logits) => {
            if let Some(cap) = model.cfg.final_logit_softcapping {
                let cap = cap as f32;
                logits.iter_mut().for_each(|v| *v = softcapped(*v, cap));
            }
            Ok(Tensor::from_vec(logits, (rows, vocab), &model.device)?)
        }
        None => {
            let last = Tensor::from_vec(last, (rows, hidden), &model.device)?;
            Ok(model.logits(&last)?.to_dtype(DType::F32)?)
        }
    }
}

/// The RoPE angles of each row's position: row r's `rotated / 2` cosines and sines.
struct Rotation {
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// `0..rows`: row r reads row r of the tables.
    rows: Vec<u32>,
}

impl Rotation {
    /// The angles of `positions` (one per row) from the tables `(cos, sin)`.
    fn of(positions: &Tensor, (cos, sin): (&Tensor, &Tensor)) -> Result<Self> {
        let rows = positions.dim(0)?;
        Ok(Self {
            cos: cos.index_select(positions, 0)?.flatten_all()?.to_vec1()?,
            sin: sin.index_select(positions, 0)?.flatten_all()?.to_vec1()?,
            rows: (0..rows as u32).collect(),
        })
    }

    /// The model's angles of each span's positions, from the tables
    /// [`Llama::rope_for`] picks for the span (LongRoPE's long ones for a span past its
    /// pretraining context).
    fn of_spans(model: &Llama, spans: &[Span], positions: &Tensor) -> Result<Self> {
        if model.long_rope.is_none() {
            return Self::of(positions, (&model.cos, &model.sin));
        }
        let mut all = Self {
            cos: Vec::new(),
            sin: Vec::new(),
            rows: (0..positions.dim(0)? as u32).collect(),
        };
        for span in spans {
            let mine = positions.narrow(0, span.first, span.len)?;
            let part = Self::of(&mine, model.rope_for(span.start + span.len))?;
            all.cos.extend(part.cos);
            all.sin.extend(part.sin);
        }
        Ok(all)
    }

    /// Rotates, in place, the `heads` heads of width `head_dim` of every row of `x`:
    /// each head whole, or its leading dims where the tables are narrower (a partial
    /// rotation).
    fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize) {
        let width = heads * head_dim;
        let rotated = match self.rows.len() {
            0 => head_dim,
            rows => 2 * self.cos.len() / rows,
        };
        if rotated == head_dim {
            rope_in_place(
                x, width, 0, heads, head_dim, &self.rows, &self.cos, &self.sin, false,
            );
            return;
        }
        for head in 0..heads {
            rope_in_place(
                x,
                width,
                head * head_dim,
                1,
                rotated,
                &self.rows,
                &self.cos,
                &self.sin,
                false,
            );
        }
    }
}

/// Each row's `widths` leading columns of `xs` (rows of their sum), as one vector per
/// width: a fused projection's output split into its parts.
fn split_rows<const N: usize>(xs: &[f32], widths: [usize; N]) -> [Vec<f32>; N] {
    let row: usize = widths.iter().sum();
    let rows = xs.len() / row.max(1);
    let mut parts: [Vec<f32>; N] = std::array::from_fn(|i| Vec::with_capacity(rows * widths[i]));
    for x in xs.chunks_exact(row.max(1)) {
        let mut from = 0;
        for (part, width) in parts.iter_mut().zip(widths) {
            part.extend_from_slice(&x[from..from + width]);
            from += width;
        }
    }
    parts
}

/// `x += y`, element by element.
fn add(x: &mut [f32], y: &[f32]) {
    for (x, y) in x.iter_mut().zip(y) {
        *x += y;
    }
}

/// The MLP gate's activation of `cfg`'s family: Gemma's tanh GELU, SiLU elsewhere.
fn gate_of(cfg: &LlamaConfig) -> Gate {
    match cfg.architecture().gemma() {
        true => Gate::GeluTanh,
        false => Gate::Silu,
    }
}

/// Gemma's soft-cap `cap·tanh(x/cap)` of one value (as [`crate::ops::softcap`]).
fn softcapped(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

/// What shapes a layer's attention scores besides `q·k`: the scale, the soft-cap and
/// the sliding window.
#[derive(Debug, Clone, Copy)]
struct ScoreMath {
    scale: f32,
    softcap: Option<f32>,
    window: Option<usize>,
}

/// Attention of each row of the `spans` over its own cache (`layers[i]` for span i,
/// holding the pass's keys and values already), each up to its own position, with the
/// scores shaped by `math`, into `attended` (rows × heads·head_dim): the plain loops
/// for the attention the kernels do not implement (Gemma's).
fn attend_each(
    heads: Heads,
    math: ScoreMath,
    q: &[f32],
    (spans, layers): (&[Span], &[&RowLayer]),
    attended: &mut [f32],
) {
    let hd = heads.head_dim;
    let (q_len, kv_len) = (heads.heads * hd, heads.kv_heads * hd);
    let group = heads.heads / heads.kv_heads.max(1);
    let mut scores = Vec::new();
    for (span, layer) in spans.iter().zip(layers) {
        for j in 0..span.len {
            let (row, position) = (span.first + j, span.start + j);
            let first = math.window.map_or(0, |w| (position + 1).saturating_sub(w));
            for h in 0..heads.heads {
                let query = &q[row * q_len + h * hd..][..hd];
                let at = (h / group) * hd;
                scores.clear();
                scores.extend((first..=position).map(|t| {
                    let key = &layer.k[t * kv_len + at..][..hd];
                    let dot: f32 = query.iter().zip(key).map(|(a, b)| a * b).sum();
                    let s = dot * math.scale;
                    math.softcap.map_or(s, |cap| softcapped(s, cap))
                }));
                let top = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - top).exp();
                    total += *s;
                }
                let out = &mut attended[row * q_len + h * hd..][..hd];
                out.fill(0.0);
                for (t, p) in (first..=position).zip(&scores) {
                    let value = &layer.v[t * kv_len + at..][..hd];
                    for (o, v) in out.iter_mut().zip(value) {
                        *o += p / total * v;
                    }
                }
            }
        }
    }
}

/// RMSNorm of each row of `x` with the layer's `weight` (the kernels' own, as the
/// trainer's fused step computes it).
fn normed(x: &[f32], weight: &Tensor, eps: f64) -> Result<Vec<f32>> {
    let weight = weight.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let rows = x.len() / weight.len().max(1);
    let (mut out, mut inv_rms) = (vec![0f32; x.len()], vec![0f32; rows]);
    rms_norm_forward(x, &weight, eps as f32, &mut out, &mut inv_rms);
    Ok(out)
}

impl Llama {
    /// Logits (sequences, vocab) of the token after `spans[i]` for each sequence i,
    /// where `spans[i]` continues the tokens `caches[i]` holds (one token for an answer
    /// being decoded, a whole prompt for an empty cache); each span's keys and values
    /// are appended to its cache. No dropout, no gradients.
    pub fn forward_cached_spans(
        &self,
        spans: &[&[u32]],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let limit = self.cos.dim(0)?;
        let unusable = spans.iter().zip(caches.iter()).any(|(span, c)| {
            span.is_empty() || c.len + span.len() > limit || c.layers.len() != self.layers.len()
        });
        if spans.is_empty() || spans.len() != caches.len() || unusable {
            return Err(Error::Model {
                path: "model".into(),
                message: format!(
                    "cannot step {} spans over {} caches (max_position_embeddings {limit})",
                    spans.len(),
                    caches.len()
                ),
            });
        }
        if self.dtype != DType::F32 {
            return Err(Error::Model {
                path: "model".into(),
                message: "decoding several sequences at once needs f32 weights".into(),
            });
        }
        let refilled: Vec<_> = spans
            .iter()
            .zip(caches.iter_mut())
            .map(|(span, cache)| self.longrope_refill(span, cache))
            .collect();
        let spans: Vec<&[u32]> = refilled.iter().map(|span| &**span).collect();
        let mut layout = Vec::with_capacity(spans.len());
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for (span, cache) in spans.iter().zip(caches.iter()) {
            layout.push(Span {
                first: ids.len(),
                len: span.len(),
                start: cache.len,
            });
            ids.extend_from_slice(span);
            positions.extend((cache.len..cache.len + span.len()).map(|p| p as u32));
        }
        let rows = ids.len();
        let hidden = self.cfg.hidden_size();
        let input = Tensor::from_vec(ids, rows, &self.device)?;
        let mut x = self
            .embed_tokens
            .index_select(&input, 0)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if let Some(scale) = self.cfg.embedding_scale() {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        for cache in caches.iter_mut().filter(|c| c.rows.is_empty()) {
            cache.rows = cache
                .layers
                .iter_mut()
                .map(|slot| RowLayer::from_tensors(slot.take().as_ref()))
                .collect::<Result<_>>()?;
        }
        let positions = Tensor::from_vec(positions, rows, &self.device)?;
        let global = Rotation::of_spans(self, &layout, &positions)?;
        let local = match &self.local_rope {
            Some((cos, sin)) => Some(Rotation::of(&positions, (cos, sin))?),
            None => None,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let rotation = match (&local, layer.local_rope) {
                (Some(local), true) => local,
                _ => &global,
            };
            self.layer_rows(layer, l, &mut x, rotation, (&layout, caches))?;
        }
        for ((cache, span), ids) in caches.iter_mut().zip(&layout).zip(&spans) {
            cache.len += span.len;
            cache.tokens.extend_from_slice(ids);
        }
        let mut last = Vec::with_capacity(layout.len() * hidden);
        for span in &layout {
            let end = span.first + span.len - 1;
            last.extend_from_slice(&x[end * hidden..(end + 1) * hidden]);
        }
        let last = normed(&last, &self.norm, self.cfg.rms_norm_eps)?;
        head_logits(self, last, layout.len())
    }

    /// Decoder layer `l` on the rows of every span (`x`: rows × hidden, updated in
    /// place), each rotated by its row of `rotation`.
    fn layer_rows(
        &self,
        layer: &Layer,
        l: usize,
        x: &mut [f32],
        rotation: &Rotation,
        (spans, caches): (&[Span], &mut [&mut KvCache]),
    ) -> Result<()> {
        let cfg = &self.cfg;
        let rows = rotation.rows.len();
        let (nh, nkv, hd) = (
            cfg.num_attention_heads(),
            cfg.num_kv_heads(),
            cfg.head_dim(),
        );
        let roles = layer.roles()?;
        let eps = cfg.rms_norm_eps;
        let hn = normed(x, &layer.input_norm, eps)?;
        let (mut q, mut k, v) = match roles {
            Roles::Separate([q, k, v, ..]) => (
                project(q, &hn, rows)?,
                project(k, &hn, rows)?,
                project(v, &hn, rows)?,
            ),
            Roles::Fused([qkv, ..]) => {
                let [q, k, v] =
                    split_rows(&project(qkv, &hn, rows)?, [nh * hd, nkv * hd, nkv * hd]);
                (q, k, v)
            }
        };
        let (o_p, down_p) = layer.outputs()?;
        if let Some((q_norm, k_norm)) = &layer.qk_norm {
            q = normed(&q, q_norm, cfg.rms_norm_eps)?;
            k = normed(&k, k_norm, cfg.rms_norm_eps)?;
        }
        rotation.apply(&mut q, nh, hd);
        rotation.apply(&mut k, nkv, hd);
        let attended = self.attend((l, layer), (&q, &k, &v), rows, (spans, caches));
        let mut out = project(o_p, &attended, rows)?;
        if let Some(sandwich) = &layer.sandwich {
            out = normed(&out, &sandwich.after_attention, eps)?;
        }
        add(x, &out);
        let hn = normed(x, &layer.mlp_norm, eps)?;
        let act = match roles {
            Roles::Fused([_, _, gate_up, _]) => {
                // Each row is [gate | up], the layout the SwiGLU kernel reads.
                let gate_up = project(gate_up, &hn, rows)?;
                let mut act = vec![0f32; gate_up.len() / 2];
                glu_forward(&gate_up, cfg.intermediate_size(), gate_of(cfg), &mut act);
                act
            }
            Roles::Separate([_, _, _, _, gate, up, _]) => {
                let (gate, up) = (project(gate, &hn, rows)?, project(up, &hn, rows)?);
                let inter = gate.len() / rows;
                let mut gate_up = Vec::with_capacity(2 * gate.len());
                for (g, u) in gate.chunks_exact(inter).zip(up.chunks_exact(inter)) {
                    gate_up.extend_from_slice(g);
                    gate_up.extend_from_slice(u);
                }
                let mut act = gate;
                glu_forward(&gate_up, inter, gate_of(cfg), &mut act);
                act
            }
        };
        let mut out = project(down_p, &act, rows)?;
        if let Some(sandwich) = &layer.sandwich {
            out = normed(&out, &sandwich.after_mlp, eps)?;
        }
        add(x, &out);
        Ok(())
    }

    /// Layer `l`'s attention for every row of the pass (`rows` × heads·head_dim), after
    /// appending the rows' keys and values to their caches: rows continuing a cache
    /// attend over it, each up to its own position; prompts filling empty caches attend
    /// together through the fused causal attention.
    fn attend(
        &self,
        (l, layer): (usize, &Layer),
        (q, k, v): (&[f32], &[f32], &[f32]),
        rows: usize,
        (spans, caches): (&[Span], &mut [&mut KvCache]),
    ) -> Vec<f32> {
        let heads = Heads {
            heads: self.cfg.num_attention_heads(),
            kv_heads: self.cfg.num_kv_heads(),
            head_dim: self.cfg.head_dim(),
        };
        let (q_len, kv_len) = (
            heads.heads * heads.head_dim,
            heads.kv_heads * heads.head_dim,
        );
        for (span, cache) in spans.iter().zip(caches.iter_mut()) {
            let row = &mut cache.rows[l];
            let new = span.first * kv_len..(span.first + span.len) * kv_len;
            row.k.extend_from_slice(&k[new.clone()]);
            row.v.extend_from_slice(&v[new]);
        }
        let mut attended = vec![0f32; rows * q_len];
        // Gemma's scale and soft-cap are not the kernels'; a window every layer shares
        // (Mistral's, Phi-3's) is, as where each query's first visible key is.
        if self.cfg.architecture().gemma() {
            let math = ScoreMath {
                scale: self.cfg.attention_scale() as f32,
                softcap: self.cfg.attn_logit_softcapping.map(|c| c as f32),
                window: layer.window,
            };
            let layers: Vec<&RowLayer> = caches.iter().map(|c| &c.rows[l]).collect();
            attend_each(heads, math, q, (spans, &layers), &mut attended);
            return attended;
        }
        let mut outs = attended.chunks_exact_mut(q_len);
        let mut queries = Vec::with_capacity(rows);
        for (span, cache) in spans.iter().zip(caches.iter()) {
            let row = &cache.rows[l];
            for (j, out) in outs.by_ref().take(span.len).enumerate() {
                if span.fresh() {
                    continue;
                }
                let (r, position) = (span.first + j, span.start + j);
                let first = layer.window.map_or(0, |w| (position + 1).saturating_sub(w));
                let seen = first * kv_len..(position + 1) * kv_len;
                queries.push(CachedQuery {
                    q: &q[r * q_len..(r + 1) * q_len],
                    k: &row.k[seen.clone()],
                    v: &row.v[seen],
                    out,
                });
            }
        }
        attention_over_cache(heads, queries);
        let fresh: Vec<Span> = spans.iter().copied().filter(Span::fresh).collect();
        if !fresh.is_empty() {
            attend_fresh(&fresh, (q, k, v), (heads, layer.window), &mut attended);
        }
        attended
    }
}

#[cfg(test)]
mod tests {
    use crate::init::{InitOptions, Preset, preset_config};
    use crate::model::Llama;
    use candle_core::Tensor;

    fn tiny() -> Llama {
        tiny_of(tuneq_pools::Architecture::Llama)
    }

    fn tiny_of(architecture: tuneq_pools::Architecture) -> Llama {
        tiny_with(architecture, |_| {})
    }

    /// The tiny preset as `architecture`, its config changed by `edit`.
    fn tiny_with(
        architecture: tuneq_pools::Architecture,
        edit: impl FnOnce(&mut crate::config::LlamaConfig),
    ) -> Llama {
        let opts = InitOptions {
            preset: Preset::Tiny,
            seed: 9,
            shards: 1,
            tie_embeddings: false,
            llama3_rope: true,
            architecture,
        };
        let mut cfg = preset_config(&opts);
        cfg.shape.num_key_value_heads = Some(2);
        edit(&mut cfg);
        // LoRA on every projection, with B drawn too (PEFT starts it at zero, which
        // would leave the update untested).
        let lora = crate::lora::LoraSettings {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: crate::model::layer_projections(architecture)
                .map(|(_, name)| name.to_string())
                .collect(),
            rslora: false,
        };
        let mut rng = <rand_chacha::ChaCha20Rng as rand::SeedableRng>::seed_from_u64(9);
        let m = crate::init::random_model(cfg, 9, Some((&lora, &mut rng))).expect("model");
        for (i, p) in m.layers.iter().flat_map(|l| &l.projections).enumerate() {
            let factors = p.lora.as_ref().expect("every projection adapted");
            let b =
                Tensor::randn(0f32, 0.05, factors.b.shape(), &candle_core::Device::Cpu).expect("B");
            factors
                .b
                .set(&b)
                .unwrap_or_else(|e| panic!("projection {i}: {e}"));
        }
        m
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
            .expect("diff")
    }

    /// Steps `spans` together and checks each sequence's logits against the same span
    /// appended alone to its twin cache by [`Llama::forward_cached`].
    fn check_together(
        m: &Llama,
        spans: &[Vec<u32>],
        together: &mut [crate::model::KvCache],
        alone: &mut [crate::model::KvCache],
        what: &str,
    ) {
        let refs: Vec<&[u32]> = spans.iter().map(Vec::as_slice).collect();
        let mut caches: Vec<&mut crate::model::KvCache> = together.iter_mut().collect();
        let logits = m.forward_cached_spans(&refs, &mut caches).expect("spans");
        assert_eq!(logits.dims(), &[spans.len(), m.cfg.vocab_size()]);
        for (i, (span, cache)) in spans.iter().zip(alone.iter_mut()).enumerate() {
            let one = m.forward_cached(span, cache).expect("alone");
            let diff = max_diff(&one, &logits.get(i).expect("row"));
            assert!(diff < 1e-4, "{what}, sequence {i}: {diff}");
            assert_eq!(cache.len(), together[i].len(), "{what}, sequence {i}");
        }
    }

    #[test]
    fn prompts_and_steps_together_give_each_sequence_its_own_logits() {
        for architecture in tuneq_pools::Architecture::ALL {
            prompts_and_steps_together(&tiny_of(architecture));
        }
    }

    fn prompts_and_steps_together(m: &Llama) {
        // Three prompts of different lengths filled together (one of a single token,
        // which takes the per-row attention), then stepped together.
        let prompts: Vec<Vec<u32>> = vec![
            (0..5).map(|i| i * 37 + 1).collect(),
            (0..17).map(|i| i * 11 + 3).collect(),
            vec![42],
        ];
        let mut alone: Vec<_> = prompts.iter().map(|_| m.new_cache()).collect();
        let mut together: Vec<_> = prompts.iter().map(|_| m.new_cache()).collect();
        check_together(m, &prompts, &mut together, &mut alone, "prompts");
        for step in 0..4u32 {
            let ids: Vec<Vec<u32>> = (0..3).map(|i| vec![100 + step * 7 + i]).collect();
            check_together(m, &ids, &mut together, &mut alone, &format!("step {step}"));
        }
        // A prompt joining answers in flight, and a sequence continued by several
        // tokens at once (attended row by row over its cache).
        together.push(m.new_cache());
        alone.push(m.new_cache());
        let spans = vec![
            vec![7],
            vec![8, 9, 10],
            vec![11],
            (0..9).map(|i| i * 5).collect(),
        ];
        check_together(m, &spans, &mut together, &mut alone, "joined");
        assert_eq!(together[3].len(), 9);
    }

    #[test]
    fn a_longrope_answer_past_its_pretraining_context_is_the_full_forward_s() {
        // The tiny Phi-3's LongRoPE context is 32 positions: a prompt of 20 and steps
        // one token at a time cross it, once alone and once beside a second sequence.
        // Each step's logits must be the full forward's over the whole sequence (the
        // short tables up to 32 positions, the long ones for all of it past them), as
        // transformers' generate, which recomputes its cache at the crossing.
        let m = tiny_of(tuneq_pools::Architecture::Phi3);
        assert_eq!(m.cfg.longrope_context(), Some(32));
        let mut tokens: Vec<u32> = (0..20).map(|i| (i * 29 + 7) % 300).collect();
        let (mut alone, mut together, mut other) = (m.new_cache(), m.new_cache(), m.new_cache());
        let mut span = tokens.clone();
        for step in 0..20u32 {
            let full = m
                .forward(
                    &Tensor::new(tokens.as_slice(), m.device())
                        .and_then(|t| t.unsqueeze(0))
                        .expect("ids"),
                )
                .and_then(|l| Ok(l.get(0)?.get(tokens.len() - 1)?))
                .expect("full forward");
            let one = m.forward_cached(&span, &mut alone).expect("alone");
            let side = [3 + step];
            let mut caches = [&mut together, &mut other];
            let both = m
                .forward_cached_spans(&[&span, &side], &mut caches)
                .expect("together");
            let what = format!("at {} tokens", tokens.len());
            assert!(
                max_diff(&one, &full) < 1e-4,
                "alone {what}: {}",
                max_diff(&one, &full)
            );
            let row = both.get(0).expect("row");
            assert!(
                max_diff(&row, &full) < 1e-4,
                "together {what}: {}",
                max_diff(&row, &full)
            );
            assert_eq!((alone.len(), together.len()), (tokens.len(), tokens.len()));
            let next = 40 + step * 3;
            tokens.push(next);
            span = vec![next];
        }
    }

    #[test]
    fn prompts_filled_on_the_fast_path_match_the_cached_forward() {
        // A prompt alone (the fused attention, and each orientation of the GEMM: under
        // and over PACKED_WEIGHT_ROWS rows) against the graph, then a step of one row.
        // The Gemmas' windows (32 positions on the tiny preset) bind at these lengths.
        // So does a Mistral's window of 24 positions (Mistral 7B v0.1's kind).
        use tuneq_pools::Architecture::{Gemma2, Gemma3, Llama, Mistral};
        let windowed = |cfg: &mut crate::config::LlamaConfig| cfg.shape.sliding_window = Some(24);
        let models = [
            tiny_of(Llama),
            tiny_of(Gemma2),
            tiny_of(Gemma3),
            tiny_with(Mistral, windowed),
        ];
        for m in models {
            for len in [40u32, 70] {
                let prompt: Vec<u32> = (0..len).map(|i| (i * 13 + 5) % 200).collect();
                let (mut fast, mut graph) = (vec![m.new_cache()], vec![m.new_cache()]);
                check_together(&m, &[prompt], &mut fast, &mut graph, "alone");
                check_together(&m, &[vec![3]], &mut fast, &mut graph, "next");
            }
        }
    }

    #[test]
    fn bad_steps_are_refused() {
        let m = tiny();
        let mut cache = m.new_cache();
        assert!(m.forward_cached_spans(&[], &mut []).is_err());
        assert!(
            m.forward_cached_spans(&[&[1], &[2]], &mut [&mut cache])
                .is_err()
        );
        assert!(m.forward_cached_spans(&[&[]], &mut [&mut cache]).is_err());
        let past: Vec<u32> = vec![1; m.cfg.max_position_embeddings() + 1];
        assert!(m.forward_cached_spans(&[&past], &mut [&mut cache]).is_err());
        assert_eq!(cache.len(), 0, "a refused step changes nothing");
    }
}
