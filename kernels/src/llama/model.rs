//! The model and the batch as the step sees them: views of the tensors, the
//! architecture's shapes, and what the step derives from them (row groups, scratch).

use super::forward::ForwardWork;
use super::frozen::{self, Compute, Frozen, FrozenWork};
use super::groups;
use super::memory::{forward_work_lengths, widening_len, widest_side};
use super::{GATE, K, O, Q, UP, V};
use crate::glu::Gate;

/// The architecture.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Rows of the embedding and of the head.
    pub vocab: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the MLP.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; `heads` must be a multiple of it.
    pub kv_heads: usize,
    /// Width of one head (even).
    pub head_dim: usize,
    /// How many leading dims of each query and key head RoPE rotates (even, at most
    /// `head_dim`): all of them, or Phi-4-mini's partial share.
    pub rotary_dim: usize,
    /// RMSNorm's ε.
    pub rms_eps: f32,
    /// Whether every query and key head is RMS-normalised before RoPE (Qwen3, Gemma 3):
    /// each layer then has [`Layer::qk_norm`], and the step keeps the heads before the
    /// norm.
    pub qk_norm: bool,
    /// What Gemma 2 and 3 compute differently, exactly when the model is one: each
    /// layer then has [`Layer::gemma`].
    pub gemma: Option<Gemma>,
}

/// What a Gemma computes beyond a Llama, model-wide. Per layer it also normalises each
/// half's output before its residual add ([`GemmaLayer`]); its MLP gate is GELU's tanh
/// form ([`Gate::GeluTanh`]); its norms multiply by `1 + w`, which the caller passes as
/// the weights themselves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemma {
    /// The embeddings' factor, `√hidden` rounded to f32 (transformers' `normalizer`).
    pub embed_scale: f32,
    /// The attention scores' scale, `query_pre_attn_scalar^(−1/2)`.
    pub attention_scale: f32,
    /// Gemma 2's soft-cap of the attention scores (`attn_logit_softcapping`).
    pub attention_softcap: Option<f32>,
    /// Gemma 2's soft-cap of the final logits (`final_logit_softcapping`).
    pub logit_softcap: Option<f32>,
}

impl Dims {
    /// The MLP gate's activation: GeGLU's for a Gemma, SwiGLU's otherwise.
    pub(super) fn gate(&self) -> Gate {
        match self.gemma {
            Some(_) => Gate::GeluTanh,
            None => Gate::Silu,
        }
    }

    /// The attention scores' scale: a Gemma's own, `1/√head_dim` otherwise.
    pub(super) fn attention_scale(&self) -> f32 {
        self.gemma.map_or_else(
            || crate::attention::AttentionShape::head_scale(self.head_dim),
            |g| g.attention_scale,
        )
    }

    /// `(in, out)` of projection `p` ([`PROJECTIONS`](super::PROJECTIONS) order).
    pub fn projection_shape(&self, p: usize) -> (usize, usize) {
        let (h, q, kv, i) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        );
        match p {
            Q => (h, q),
            K | V => (h, kv),
            O => (q, h),
            GATE | UP => (h, i),
            _ => (i, h),
        }
    }

    /// Rotates, in place, the query and key heads of every row of the qkv buffer `qkv`
    /// (their leading [`Self::rotary_dim`] dims) by each row's position, or back with
    /// `inverse`.
    pub(super) fn rotate_qk(
        &self,
        qkv: &mut [f32],
        positions: &[u32],
        (cos, sin): (&[f32], &[f32]),
        inverse: bool,
    ) {
        let (width, heads) = (self.qkv_width(), self.heads + self.kv_heads);
        if self.rotary_dim == self.head_dim {
            // q and k are adjacent: one call rotates both.
            crate::rope::rope_in_place(
                qkv,
                width,
                0,
                heads,
                self.head_dim,
                positions,
                cos,
                sin,
                inverse,
            );
            return;
        }
        for head in 0..heads {
            crate::rope::rope_in_place(
                qkv,
                width,
                head * self.head_dim,
                1,
                self.rotary_dim,
                positions,
                cos,
                sin,
                inverse,
            );
        }
    }

    /// Width of a row of the qkv buffer, `(heads + 2·kv_heads)·head_dim`.
    pub(super) fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The first column of projection `p`'s output inside the buffer it writes (the qkv
    /// buffer, the `[gate | up]` buffer, or a buffer of its own).
    pub(super) fn output_column(&self, p: usize) -> usize {
        match p {
            K => self.heads * self.head_dim,
            V => (self.heads + self.kv_heads) * self.head_dim,
            UP => self.intermediate,
            _ => 0,
        }
    }

    /// Row stride of the buffer projection `p` writes.
    pub(super) fn output_stride(&self, p: usize) -> usize {
        match p {
            Q | K | V => self.qkv_width(),
            GATE | UP => 2 * self.intermediate,
            _ => self.projection_shape(p).1,
        }
    }
}

/// A LoRA update of a projection: `y += scale·(x_d·Aᵀ)·Bᵀ`.
#[derive(Debug, Clone, Copy)]
pub struct Lora<'a> {
    /// A, `r × in`, row-major.
    pub a: &'a [f32],
    /// B, `out × r`, row-major.
    pub b: &'a [f32],
    /// Rank.
    pub r: usize,
    /// Scale of the branch (alpha/r or alpha/√r).
    pub scale: f32,
}

/// A frozen linear layer with an optional LoRA update.
#[derive(Debug, Clone, Copy)]
pub struct Projection<'a> {
    /// `out × in`, row-major, frozen (f32 or bf16).
    pub weight: Frozen<'a>,
    /// `out`, frozen, added to every row of the product (Qwen2's q, k and v).
    pub bias: Option<&'a [f32]>,
    /// The trainable update, when this projection is a target.
    pub lora: Option<Lora<'a>>,
}

/// One decoder layer.
#[derive(Debug, Clone, Copy)]
pub struct Layer<'a> {
    /// RMSNorm weight before attention, `hidden`.
    pub input_norm: &'a [f32],
    /// RMSNorm weight before the MLP, `hidden`.
    pub post_norm: &'a [f32],
    /// q, k, v, o, gate, up, down ([`PROJECTIONS`](super::PROJECTIONS) order).
    pub proj: [Projection<'a>; 7],
    /// The q and k heads' norm weights, exactly when [`Dims::qk_norm`].
    pub qk_norm: Option<super::QkNorm<'a>>,
    /// A Gemma's own per-layer parts, exactly when [`Dims::gemma`].
    pub gemma: Option<GemmaLayer<'a>>,
}

/// What a Gemma layer has beyond a Llama layer.
#[derive(Debug, Clone, Copy)]
pub struct GemmaLayer<'a> {
    /// RMSNorm weight of the attention's output before its residual add
    /// (`post_attention_layernorm`), `hidden`. (Its norm before the MLP,
    /// `pre_feedforward_layernorm`, is [`Layer::post_norm`].)
    pub after_attention: &'a [f32],
    /// RMSNorm weight of the MLP's output before its residual add
    /// (`post_feedforward_layernorm`), `hidden`.
    pub after_mlp: &'a [f32],
    /// A `sliding_attention` layer: it attends within [`Batch::window_starts`] when
    /// the batch has them (a window that binds on it), and rotates with
    /// [`Model::local_rope`] when the model has them (Gemma 3's local base).
    pub sliding: bool,
}

/// A Llama causal LM with LoRA, as views of its tensors.
#[derive(Debug, Clone)]
pub struct Model<'a> {
    /// Architecture.
    pub dims: Dims,
    /// Token embeddings, `vocab × hidden` (frozen; f32 or bf16).
    pub embed: Frozen<'a>,
    /// Decoder layers, `dims.layers` of them.
    pub layers: Vec<Layer<'a>>,
    /// Final RMSNorm weight, `hidden`.
    pub norm: &'a [f32],
    /// Language-model head, `vocab × hidden` (frozen; f32 or bf16; may be the
    /// embedding itself).
    pub lm_head: Frozen<'a>,
    /// RoPE cosines, `(max_pos, rotary_dim/2)`.
    pub cos: &'a [f32],
    /// RoPE sines, like `cos`.
    pub sin: &'a [f32],
    /// The sliding layers' own cosines and sines, shaped like `cos` and `sin` (Gemma 3's
    /// `rope_local_base_freq`); `None`: every layer rotates with `cos` and `sin`.
    pub local_rope: Option<(&'a [f32], &'a [f32])>,
    /// How the projections' frozen products are computed (f32 by default).
    pub compute: Compute,
}

impl<'a> Model<'a> {
    /// The logits the loss reads through `head`: soft-capped where a Gemma 2 caps them.
    pub(super) fn logits<'h>(&self, head: crate::loss::Head<'h>) -> crate::loss::Logits<'h> {
        crate::loss::Logits {
            head,
            vocab: self.dims.vocab,
            softcap: self.dims.gemma.and_then(|g| g.logit_softcap),
        }
    }

    /// The RoPE cosines and sines layer `l` rotates with.
    pub(super) fn rope_of(&self, l: usize) -> (&[f32], &[f32]) {
        let sliding = self.layers[l].gemma.is_some_and(|g| g.sliding);
        match self.local_rope {
            Some(local) if sliding => local,
            _ => (self.cos, self.sin),
        }
    }

    /// The LoRA tensors' lengths, in gradient order: layer, projection, A then B.
    pub fn lora_lengths(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for layer in &self.layers {
            for (p, proj) in layer.proj.iter().enumerate() {
                if let Some(l) = &proj.lora {
                    let (i, o) = self.dims.projection_shape(p);
                    out.push(l.r * i);
                    out.push(o * l.r);
                }
            }
        }
        out
    }

    /// Resident bytes of the frozen matrices (embedding, head, projections) as stored:
    /// 2 per element for bf16, 4 for f32; a head that is the embedding's storage counts
    /// once. Norms, RoPE tables and LoRA factors are not included.
    pub fn frozen_bytes(&self) -> u64 {
        let head = if self.lm_head.same_storage(&self.embed) {
            0
        } else {
            self.lm_head.bytes()
        };
        let layers: u64 = self
            .layers
            .iter()
            .flat_map(|l| l.proj.iter().map(|p| p.weight.bytes()))
            .sum();
        self.embed.bytes() + head + layers
    }

    /// Whether the step widens the head whole for the loss: a bf16 head in f32 compute,
    /// and in bf16 compute any head the own bf16 kernels do not take as stored.
    fn head_widened(&self) -> bool {
        match self.compute {
            Compute::F32 => self.lm_head.is_bf16(),
            Compute::Bf16 => !frozen::head_as_stored(self.compute, self.lm_head.is_bf16()),
        }
    }

    /// How the step groups the batch's rows (see [`groups`]): by its shape, unless the
    /// step widens bf16 weights, whose scratch is not repeated per group.
    pub(super) fn row_groups(&self, batch: &Batch<'_>) -> Vec<std::ops::Range<usize>> {
        groups::row_groups(batch.rows, batch.len, self.widening_len() > 0)
    }

    /// Whether a bf16 GEMM (oneMKL's or the own kernels) takes the projections as
    /// stored, in bf16 compute.
    pub(super) fn projections_bf16_gemm(&self) -> bool {
        let all_bf16 = self
            .layers
            .iter()
            .all(|l| l.proj.iter().all(|p| p.weight.is_bf16()));
        frozen::uses_bf16_gemm(self.compute, all_bf16)
    }

    /// The length of the scratch the step widens frozen matrices into: the largest
    /// matrix it widens whole (the head, see [`head_widened`](Self::head_widened); each
    /// bf16 projection in f32 compute; in bf16 compute, every projection unless a bf16
    /// GEMM takes them as stored). 0 with f32 weights in f32 compute.
    pub(super) fn widening_len(&self) -> usize {
        let bf16_gemm = self.projections_bf16_gemm();
        let widened = self.layers.iter().flat_map(|l| {
            (0..7).filter(move |&p| match self.compute {
                Compute::F32 => l.proj[p].weight.is_bf16(),
                Compute::Bf16 => !bf16_gemm,
            })
        });
        widening_len(&self.dims, self.head_widened(), widened)
    }

    /// A layer forward's scratch for `n` tokens, with room for masked inputs when the
    /// step draws dropout masks.
    pub(super) fn forward_work(&self, n: usize, dropout: bool) -> ForwardWork {
        let [hn, act, xd] = forward_work_lengths(&self.dims, n, dropout).map(|len| vec![0.0; len]);
        ForwardWork {
            hn,
            act,
            xd,
            frozen: self.frozen_work(n),
        }
    }

    /// The frozen products' scratch for `n` tokens: the widening scratch
    /// ([`widening_len`](Self::widening_len)) and, in bf16 compute, the rounded
    /// activation operand.
    pub(super) fn frozen_work(&self, n: usize) -> FrozenWork {
        FrozenWork::new(
            self.compute,
            self.widening_len(),
            (n, widest_side(&self.dims)),
            self.projections_bf16_gemm(),
        )
    }
}

/// One micro-batch: `rows` sequences of `len` tokens, flattened row-major.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// Token ids, `rows·len`.
    pub ids: &'a [u32],
    /// Sequence rows.
    pub rows: usize,
    /// Tokens per row (padded or packed).
    pub len: usize,
    /// Per token, the id it must predict; negative for no loss.
    pub targets: &'a [i64],
    /// Per token, its RoPE position.
    pub positions: &'a [u32],
    /// Per token, the position within its row of the first token of its segment (see
    /// [`attention_forward`](crate::attention::attention_forward)): all zeros is plain
    /// causal attention.
    pub starts: &'a [u32],
    /// Per token, the first key a Gemma's sliding layers let it see (its segment start
    /// or the window's edge, the later), when the window binds on the batch; `None`:
    /// those layers attend as `starts` says.
    pub window_starts: Option<&'a [u32]>,
}

impl<'a> Batch<'a> {
    /// The segment starts layer `layer` attends with.
    pub(super) fn starts_of(&self, layer: &Layer<'_>) -> &'a [u32] {
        match (self.window_starts, layer.gemma) {
            (Some(window), Some(g)) if g.sliding => window,
            _ => self.starts,
        }
    }
}

/// A [`Batch`] that owns its vectors: what benchmarks and tests build.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedBatch {
    /// See [`Batch::ids`].
    pub ids: Vec<u32>,
    /// See [`Batch::rows`].
    pub rows: usize,
    /// See [`Batch::len`].
    pub len: usize,
    /// See [`Batch::targets`].
    pub targets: Vec<i64>,
    /// See [`Batch::positions`].
    pub positions: Vec<u32>,
    /// See [`Batch::starts`].
    pub starts: Vec<u32>,
}

impl OwnedBatch {
    /// `rows` rows of `len` tokens, one example a row from position 0 (no packing).
    pub fn unpacked(ids: Vec<u32>, targets: Vec<i64>, rows: usize, len: usize) -> Self {
        Self {
            ids,
            rows,
            len,
            targets,
            positions: (0..rows * len).map(|i| (i % len) as u32).collect(),
            starts: vec![0; rows * len],
        }
    }

    /// The batch the step reads.
    pub fn view(&self) -> Batch<'_> {
        Batch {
            ids: &self.ids,
            rows: self.rows,
            len: self.len,
            targets: &self.targets,
            positions: &self.positions,
            starts: &self.starts,
            window_starts: None,
        }
    }

    /// Tokens that carry a loss.
    pub fn labelled(&self) -> usize {
        self.targets.iter().filter(|&&t| t >= 0).count()
    }
}

/// Draws the dropout mask (`rows·len × in`, values 0 or 1/(1−p)) for the next adapted
/// projection. Called in forward order: layer by layer, q, k, v, o, gate, up, down, only
/// for projections with LoRA. The arguments are the number of token rows and `in`.
pub type MaskSource<'m> = &'m mut dyn FnMut(usize, usize) -> Vec<f32>;

impl Model<'_> {
    /// Per layer, each projection's LoRA rank (0 without LoRA), for [`step_bytes`].
    pub fn lora_ranks(&self) -> Vec<[usize; 7]> {
        self.layers
            .iter()
            .map(|layer| std::array::from_fn(|p| layer.proj[p].lora.map_or(0, |l| l.r)))
            .collect()
    }
}
