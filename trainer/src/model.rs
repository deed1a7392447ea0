//! A Llama decoder with LoRA-wrapped projections, written for training.
//!
//! candle-transformers' Llama is inference-only (last-token logits, private fields, fused
//! kernels without backward), so the trainer carries its own: RMSNorm, rotate-half RoPE
//! (with Llama 3 scaling), grouped-query attention with a causal mask, SwiGLU, and the
//! Hugging Face tensor names, so the same folder loads here and in `transformers`. Qwen2
//! is the same decoder with a bias on q, k and v (`tuneq_pools::Architecture::qkv_bias`),
//! Qwen3 with an RMSNorm on each query and key head before RoPE (`qk_norm`). Gemma 2
//! and 3 add what [`tuneq_pools::Architecture::gemma`] lists: their `(1 + w)` norms are
//! held as `1 + w` (the same arithmetic in f32), the norms after attention and after the
//! MLP are the layer's [`Sandwich`], and the rest (GeGLU, scaled embeddings and
//! attention, soft-caps, sliding windows, a local RoPE) follows the config. Phi-3 is
//! Llama's decoder with q, k and v in one `qkv_proj` and gate and up in one
//! `gate_up_proj` (each one [`LoraLinear`], split after it, as PEFT wraps them), RoPE on
//! the first `partial_rotary_factor` of each head, and LongRoPE's two sets of
//! frequencies.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::lora::{DropoutCtx, LoraFactors, LoraLinear, LoraSettings};
use crate::ops::{causal_softmax, frozen_linear, gelu_tanh, rms_norm, rope, softcap};
use crate::weights::WeightMap;
use candle_core::{D, DType, Device, Tensor, Var};
use rand_chacha::ChaCha20Rng;
use std::path::Path;

mod rows;

/// The seven projections of a decoder layer, with the submodule PEFT names them under.
pub const PROJECTIONS: [(&str, &str); 7] = [
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
];

/// A layer's projections on `architecture`, each with the submodule PEFT names it under,
/// in the layer's order (the seven of [`PROJECTIONS`], or Phi-3's four fused ones).
pub fn layer_projections(
    architecture: tuneq_pools::Architecture,
) -> impl Iterator<Item = (&'static str, &'static str)> {
    architecture.projections().iter().map(|&proj| {
        let module = match proj {
            "gate_proj" | "up_proj" | "down_proj" | "gate_up_proj" => "mlp",
            _ => "self_attn",
        };
        (module, proj)
    })
}

/// One decoder layer.
#[derive(Clone)]
pub struct Layer {
    /// The norm before attention (`input_layernorm`).
    input_norm: Tensor,
    /// The norm before the MLP: Llama's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`.
    mlp_norm: Tensor,
    /// Gemma's norms of the attention's and the MLP's outputs, before each residual add.
    sandwich: Option<Sandwich>,
    /// Qwen3's and Gemma 3's per-head norm weights of q and k (`head_dim` each).
    qk_norm: Option<(Tensor, Tensor)>,
    /// How many positions it sees when it attends through a sliding window.
    window: Option<usize>,
    /// Whether it rotates with the local RoPE tables (Gemma 3's sliding layers).
    local_rope: bool,
    /// q, k, v, o, gate, up, down, in [`PROJECTIONS`] order; on Phi-3 qkv, o, gate_up,
    /// down (see [`layer_projections`]).
    pub projections: Vec<LoraLinear>,
}

/// A layer's projections by role: seven separate ones, or Phi-3's fused four.
pub(crate) enum Roles<'a> {
    Separate([&'a LoraLinear; 7]),
    Fused([&'a LoraLinear; 4]),
}

/// Gemma's norms around each half of a layer, after it and before the residual add.
#[derive(Clone)]
struct Sandwich {
    /// `post_attention_layernorm`.
    after_attention: Tensor,
    /// `post_feedforward_layernorm`.
    after_mlp: Tensor,
}

impl Layer {
    /// Layer `i` from the weights `w`; with `lora`, the targeted projections get fresh
    /// factors drawn from its generator (in [`PROJECTIONS`] order).
    fn from_weights(
        cfg: &LlamaConfig,
        w: &mut WeightMap,
        i: usize,
        lora: &mut Option<(&LoraSettings, &mut ChaCha20Rng)>,
        device: &Device,
    ) -> Result<Self> {
        let h = cfg.hidden_size();
        let architecture = cfg.architecture();
        let p = format!("model.layers.{i}");
        let mut norm =
            |name: &str, len: usize| take_norm(w, &format!("{p}.{name}.weight"), len, architecture);
        let input_norm = norm("input_layernorm", h)?;
        let after_attention = norm("post_attention_layernorm", h)?;
        let (mlp_norm, sandwich) = match architecture.gemma() {
            true => (
                norm("pre_feedforward_layernorm", h)?,
                Some(Sandwich {
                    after_attention,
                    after_mlp: norm("post_feedforward_layernorm", h)?,
                }),
            ),
            false => (after_attention, None),
        };
        let qk_norm = match architecture.qk_norm() {
            true => Some((
                norm("self_attn.q_norm", cfg.head_dim())?,
                norm("self_attn.k_norm", cfg.head_dim())?,
            )),
            false => None,
        };
        let mut projections = Vec::with_capacity(PROJECTIONS.len());
        for (module, proj) in layer_projections(architecture) {
            // Every name in PROJECTIONS has a shape; see `LlamaConfig::projection_shape`.
            let (in_dim, out_dim) = cfg.projection_shape(proj).unwrap_or((h, h));
            let weight = w.take(&format!("{p}.{module}.{proj}.weight"), &[out_dim, in_dim])?;
            let bias = match (architecture.qkv_bias(), proj) {
                (true, "q_proj" | "k_proj" | "v_proj") => {
                    Some(w.take(&format!("{p}.{module}.{proj}.bias"), &[out_dim])?)
                }
                _ => None,
            };
            let (factors, scale) = match lora.as_mut() {
                Some((settings, rng)) if settings.targets(proj) => (
                    Some(LoraFactors::init(settings.r, in_dim, out_dim, rng, device)?),
                    settings.scale(),
                ),
                _ => (None, 0.0),
            };
            projections.push(LoraLinear {
                weight,
                bias,
                lora: factors,
                scale,
            });
        }
        Ok(Self {
            input_norm,
            mlp_norm,
            sandwich,
            qk_norm,
            window: cfg.layer_window(i),
            local_rope: cfg.local_rope(i),
            projections,
        })
    }

    /// Its projections by role.
    pub(crate) fn roles(&self) -> Result<Roles<'_>> {
        let p = &self.projections;
        match p.len() {
            7 => Ok(Roles::Separate([
                &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6],
            ])),
            4 => Ok(Roles::Fused([&p[0], &p[1], &p[2], &p[3]])),
            n => Err(Error::Model {
                path: "model".into(),
                message: format!("a layer of {n} projections (seven, or Phi-3's four)"),
            }),
        }
    }

    /// The queries, keys and values of `hn` (…, hidden), each (…, heads·head_dim) of its
    /// own heads (`widths`: query and key/value widths): three projections, or one split.
    fn qkv(
        &self,
        hn: &Tensor,
        (q_width, kv_width): (usize, usize),
        dropout: &mut Option<&mut DropoutCtx<'_>>,
    ) -> Result<[Tensor; 3]> {
        Ok(match self.roles()? {
            Roles::Separate([q, k, v, ..]) => [
                q.forward(hn, dropout.as_deref_mut())?,
                k.forward(hn, dropout.as_deref_mut())?,
                v.forward(hn, dropout.as_deref_mut())?,
            ],
            Roles::Fused([qkv, ..]) => {
                let all = qkv.forward(hn, dropout.as_deref_mut())?;
                [
                    all.narrow(D::Minus1, 0, q_width)?,
                    all.narrow(D::Minus1, q_width, kv_width)?,
                    all.narrow(D::Minus1, q_width + kv_width, kv_width)?,
                ]
            }
        })
    }

    /// The MLP's gate and up products of `hn`: two projections, or one split in halves.
    fn gate_up(
        &self,
        hn: &Tensor,
        dropout: &mut Option<&mut DropoutCtx<'_>>,
    ) -> Result<(Tensor, Tensor)> {
        Ok(match self.roles()? {
            Roles::Separate([_, _, _, _, gate, up, _]) => (
                gate.forward(hn, dropout.as_deref_mut())?,
                up.forward(hn, dropout.as_deref_mut())?,
            ),
            Roles::Fused([_, _, gate_up, _]) => {
                let both = gate_up.forward(hn, dropout.as_deref_mut())?;
                let half = both.dim(D::Minus1)? / 2;
                (
                    both.narrow(D::Minus1, 0, half)?,
                    both.narrow(D::Minus1, half, half)?,
                )
            }
        })
    }

    /// The attention's output projection and the MLP's down projection.
    fn outputs(&self) -> Result<(&LoraLinear, &LoraLinear)> {
        Ok(match self.roles()? {
            Roles::Separate([_, _, _, o, _, _, down]) => (o, down),
            Roles::Fused([_, o, _, down]) => (o, down),
        })
    }
}

/// The norm weight `name` (`len` wide); a Gemma's multiplies by `1 + w`, held as such,
/// so that it is a Llama norm.
fn take_norm(
    w: &mut WeightMap,
    name: &str,
    len: usize,
    architecture: tuneq_pools::Architecture,
) -> Result<Tensor> {
    let weight = w.take(name, &[len])?;
    match architecture.gemma() {
        true => Ok(weight.affine(1.0, 1.0)?),
        false => Ok(weight),
    }
}

/// A Llama causal LM with optional LoRA on chosen projections. A clone shares the
/// frozen tensors (candle's tensors are reference-counted), so a server can install
/// several adapters over one copy of a base model's weights.
#[derive(Clone)]
pub struct Llama {
    /// Architecture.
    pub cfg: LlamaConfig,
    embed_tokens: Tensor,
    /// Decoder layers.
    pub layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// The RoPE tables in f32 for the CPU fast path, which computes in f32 whatever
    /// the weights' dtype (the same tensors as `cos`/`sin` on an f32 model).
    rope_f32: (Tensor, Tensor),
    /// The sliding-window layers' own RoPE tables (Gemma 3's local base), in the
    /// compute dtype.
    local_rope: Option<RopeTables>,
    /// The same in f32, for the CPU fast path.
    local_rope_f32: Option<RopeTables>,
    /// LongRoPE's tables past its pretraining context (Phi-3), which a pass over any
    /// position past it rotates every position with.
    long_rope: Option<(Tensor, Tensor)>,
    /// The same in f32, for the CPU fast path.
    long_rope_f32: Option<(Tensor, Tensor)>,
    dtype: DType,
    device: Device,
    /// Recompute each layer's activations in backward instead of keeping them (the
    /// fused CPU path; the same bits either way). Set by the run from the spec.
    pub checkpoint_layers: bool,
    /// How the fused CPU path computes the frozen projections' products: f32 (the
    /// default, PEFT parity) or bf16 operands with f32 accumulation (the spec's
    /// `compute: bf16`). The graph computes in the weights' dtype and ignores it.
    pub cpu_compute: tuneq_kernels::llama::Compute,
}

/// A trainable tensor with its PEFT name.
#[derive(Debug, Clone)]
pub struct NamedVar {
    /// PEFT key, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    pub name: String,
    /// The variable.
    pub var: Var,
}

/// PEFT's key for factor `ab` (`A` or `B`) of a projection.
pub fn peft_key(layer: usize, module: &str, proj: &str, ab: &str) -> String {
    format!("base_model.model.model.layers.{layer}.{module}.{proj}.lora_{ab}.weight")
}

impl Llama {
    /// Sets how the fused CPU path computes the frozen projections (see
    /// [`Self::cpu_compute`]).
    pub fn set_cpu_compute(&mut self, kind: tuneq_openapi::ComputeKind) {
        self.cpu_compute = tuneq_pools::kernel_compute(kind);
    }

    /// Loads a Hugging Face Llama folder. With `lora`, the targeted projections get fresh
    /// factors drawn from `rng` (layer by layer, in [`PROJECTIONS`] order).
    pub fn load(
        model_dir: &Path,
        dtype: DType,
        device: &Device,
        lora: Option<(&LoraSettings, &mut ChaCha20Rng)>,
    ) -> Result<Self> {
        Self::load_with_config(
            LlamaConfig::load(model_dir)?,
            model_dir,
            dtype,
            device,
            lora,
        )
    }

    /// As [`Llama::load`], with the folder's `config.json` already read (and checked) by
    /// the caller: the model is built from that config, not from a second read.
    pub fn load_with_config(
        cfg: LlamaConfig,
        model_dir: &Path,
        dtype: DType,
        device: &Device,
        lora: Option<(&LoraSettings, &mut ChaCha20Rng)>,
    ) -> Result<Self> {
        let mut w = WeightMap::load(model_dir, dtype, device)?;
        Self::from_weights(cfg, &mut w, dtype, device, lora)
    }

    /// Builds the model from already-loaded weights.
    pub fn from_weights(
        cfg: LlamaConfig,
        w: &mut WeightMap,
        dtype: DType,
        device: &Device,
        mut lora: Option<(&LoraSettings, &mut ChaCha20Rng)>,
    ) -> Result<Self> {
        let (h, v) = (cfg.hidden_size(), cfg.vocab_size());
        let embed_tokens = w.take("model.embed_tokens.weight", &[v, h])?;
        let layers = (0..cfg.num_hidden_layers())
            .map(|i| Layer::from_weights(&cfg, w, i, &mut lora, device))
            .collect::<Result<Vec<_>>>()?;
        let norm = take_norm(w, "model.norm.weight", h, cfg.architecture())?;
        let lm_head = if cfg.tie_word_embeddings() && !w.contains("lm_head.weight") {
            embed_tokens.clone()
        } else {
            w.take("lm_head.weight", &[v, h])?
        };
        let positions = cfg.max_position_embeddings();
        let inv = cfg.inv_freq();
        let scale = cfg.rope_attention_factor() as f32;
        // Each table in f32 (the fast path's) and in the compute dtype (the same
        // tensors on an f32 model).
        let tables = |inv: &[f32], scale: f32| -> Result<(RopeTables, RopeTables)> {
            let f32 = rope_tables(inv, positions, scale, device, DType::F32)?;
            let own = match dtype {
                DType::F32 => f32.clone(),
                _ => rope_tables(inv, positions, scale, device, dtype)?,
            };
            Ok((f32, own))
        };
        let (rope_f32, (cos, sin)) = tables(&inv, scale)?;
        let (local_rope_f32, local_rope) = match cfg.local_inv_freq() {
            Some(inv) => tables(&inv, 1.0).map(|(f, own)| (Some(f), Some(own)))?,
            None => (None, None),
        };
        let (long_rope_f32, long_rope) = match cfg.long_inv_freq() {
            Some(inv) => tables(&inv, scale).map(|(f, own)| (Some(f), Some(own)))?,
            None => (None, None),
        };
        Ok(Self {
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            rope_f32,
            local_rope,
            local_rope_f32,
            long_rope,
            long_rope_f32,
            dtype,
            device: device.clone(),
            checkpoint_layers: false,
            cpu_compute: tuneq_kernels::llama::Compute::F32,
        })
    }

    /// The compute device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype of frozen weights and activations.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Every LoRA factor with its PEFT name, in a fixed order (layer, projection, A then B).
    pub fn lora_vars(&self) -> Vec<NamedVar> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let names = layer_projections(self.cfg.architecture());
            for ((module, proj), lin) in names.zip(&layer.projections) {
                if let Some(l) = &lin.lora {
                    out.push(NamedVar {
                        name: peft_key(i, module, proj, "A"),
                        var: l.a.clone(),
                    });
                    out.push(NamedVar {
                        name: peft_key(i, module, proj, "B"),
                        var: l.b.clone(),
                    });
                }
            }
        }
        out
    }

    /// Installs adapter factors by PEFT name (from an adapter file or a checkpoint),
    /// replacing the LoRA settings with `settings`. Every target must be present.
    pub fn set_adapter(
        &mut self,
        settings: &LoraSettings,
        tensors: &std::collections::HashMap<String, Tensor>,
        source: &str,
    ) -> Result<()> {
        let scale = settings.scale();
        let architecture = self.cfg.architecture();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let names = layer_projections(architecture);
            for ((module, proj), lin) in names.zip(layer.projections.iter_mut()) {
                if !settings.targets(proj) {
                    lin.lora = None;
                    continue;
                }
                let (in_dim, out_dim) = (lin.weight.dim(1)?, lin.weight.dim(0)?);
                let get = |ab: &str, shape: [usize; 2]| -> Result<Var> {
                    let key = peft_key(i, module, proj, ab);
                    let t = tensors.get(&key).ok_or_else(|| Error::Model {
                        path: source.to_string(),
                        message: format!("adapter tensor {key} is missing"),
                    })?;
                    if t.dims() != shape {
                        return Err(Error::Model {
                            path: source.to_string(),
                            message: format!(
                                "adapter tensor {key} has shape {:?}, expected {shape:?}",
                                t.dims()
                            ),
                        });
                    }
                    Ok(Var::from_tensor(
                        &t.to_dtype(DType::F32)?.to_device(&self.device)?,
                    )?)
                };
                let a = get("A", [settings.r, in_dim])?;
                let b = get("B", [out_dim, settings.r])?;
                lin.lora = Some(LoraFactors { a, b });
                lin.scale = scale;
            }
        }
        Ok(())
    }

    /// The frozen tensors in the order the CPU fast path reads them in place: embeddings,
    /// final norm, lm_head, the f32 RoPE cos and sin tables, then per layer its two norms.
    /// Layer `l`'s q and k head norm weights (Qwen3), when it has them.
    pub(crate) fn qk_norm(&self, l: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers[l].qk_norm.as_ref().map(|(q, k)| (q, k))
    }

    pub(crate) fn frozen_parts(&self) -> (Vec<&Tensor>, Vec<[&Tensor; 2]>) {
        let top = vec![
            &self.embed_tokens,
            &self.norm,
            &self.lm_head,
            &self.rope_f32.0,
            &self.rope_f32.1,
        ];
        let layers = self
            .layers
            .iter()
            .map(|l| [&l.input_norm, &l.mlp_norm])
            .collect();
        (top, layers)
    }

    /// Final hidden states (batch, seq, hidden) for token ids (batch, seq).
    pub fn hidden_states(
        &self,
        ids: &Tensor,
        mut dropout: Option<&mut DropoutCtx<'_>>,
    ) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let rope = self.rope_prefix(t)?;
        let mut x = self.embed(ids)?;
        for layer in &self.layers {
            x = self.layer_forward(layer, &x, &rope, dropout.as_deref_mut(), None)?;
        }
        self.final_norm(&x)
    }

    /// The frozen embeddings of `ids` (batch, seq) → (batch, seq, hidden), scaled
    /// where the family scales them (Gemma).
    pub(crate) fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let x = self
            .embed_tokens
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.hidden_size()))?;
        match self.cfg.embedding_scale() {
            Some(scale) => Ok(x.affine(f64::from(scale), 0.0)?),
            None => Ok(x),
        }
    }

    /// The final RMSNorm.
    pub(crate) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(x, &self.norm, self.cfg.rms_norm_eps)?)
    }

    /// RoPE tables for the first `t` positions; an error past the model's positions.
    pub(crate) fn rope_prefix(&self, t: usize) -> Result<RopeSlice> {
        if t > self.cos.dim(0)? {
            return Err(Error::Model {
                path: "model".into(),
                message: format!(
                    "sequence of {t} tokens exceeds max_position_embeddings {}",
                    self.cos.dim(0)?
                ),
            });
        }
        self.rope_range(0, t)
    }

    /// RoPE tables for positions `start..start + t` (within the model's positions).
    fn rope_range(&self, start: usize, t: usize) -> Result<RopeSlice> {
        let narrow = |(cos, sin): (&Tensor, &Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((
                cos.narrow(0, start, t)?.contiguous()?,
                sin.narrow(0, start, t)?.contiguous()?,
            ))
        };
        Ok(RopeSlice {
            global: narrow(self.rope_for(start + t))?,
            local: match &self.local_rope {
                Some((cos, sin)) => Some(narrow((cos, sin))?),
                None => None,
            },
        })
    }

    /// The model's RoPE tables for a pass whose last position is `end - 1`: LongRoPE's
    /// long ones past its pretraining context, the usual ones otherwise.
    pub(crate) fn rope_for(&self, end: usize) -> (&Tensor, &Tensor) {
        match &self.long_rope {
            Some((cos, sin)) if self.cfg.long_rope_at(end) => (cos, sin),
            _ => (&self.cos, &self.sin),
        }
    }

    /// The sliding layers' own tables in f32 (Gemma 3), for the fused CPU path.
    pub(crate) fn local_rope_f32(&self) -> Option<&RopeTables> {
        self.local_rope_f32.as_ref()
    }

    /// A Gemma layer's norms of its attention's and its MLP's outputs, and whether it
    /// is a sliding layer (attends through the window, or rotates with the local
    /// tables), for the fused CPU path.
    pub(crate) fn gemma_layer(&self, l: usize) -> Option<(&Tensor, &Tensor, bool)> {
        let layer = &self.layers[l];
        let sliding = layer.window.is_some() || layer.local_rope;
        let s = layer.sandwich.as_ref()?;
        Some((&s.after_attention, &s.after_mlp, sliding))
    }

    /// LongRoPE's long tables in f32, for the fused CPU path (which picks them as
    /// [`Self::rope_for`] does).
    pub(crate) fn long_rope_f32(&self) -> Option<&(Tensor, Tensor)> {
        self.long_rope_f32.as_ref()
    }

    /// One decoder layer on `x` (batch, seq, hidden), residuals included. With `cache`
    /// (generation: no dropout, no gradients), the positions of `x` follow the keys and
    /// values the cache holds, attend to them as well, and append theirs to it.
    pub(crate) fn layer_forward(
        &self,
        layer: &Layer,
        x: &Tensor,
        rope_tables: &RopeSlice,
        mut dropout: Option<&mut DropoutCtx<'_>>,
        cache: Option<&mut LayerCache>,
    ) -> Result<Tensor> {
        let (cos, sin) = rope_tables.of(layer);
        let (b, t, _) = x.dims3()?;
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads(),
            cfg.num_kv_heads(),
            cfg.head_dim(),
        );
        let eps = cfg.rms_norm_eps;
        let (o_p, down_p) = layer.outputs()?;
        let hn = rms_norm(x, &layer.input_norm, eps)?;
        let heads = |flat: Tensor, n: usize| -> Result<Tensor> {
            Ok(flat
                .contiguous()?
                .reshape((b, t, n, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let [q, k, v] = layer.qkv(&hn, (nh * hd, nkv * hd), &mut dropout)?;
        let (mut q, mut k, v) = (heads(q, nh)?, heads(k, nkv)?, heads(v, nkv)?);
        if let Some((q_norm, k_norm)) = &layer.qk_norm {
            q = rms_norm(&q, q_norm, eps)?;
            k = rms_norm(&k, k_norm, eps)?;
        }
        let (q, k) = (rope(&q, cos, sin)?, rope(&k, cos, sin)?);
        let (k, v) = match cache {
            Some(slot) => {
                let (k, v) = match slot.take() {
                    Some((past_k, past_v)) => (
                        Tensor::cat(&[&past_k, &k], 2)?,
                        Tensor::cat(&[&past_v, &v], 2)?,
                    ),
                    None => (k, v),
                };
                // Detached: a cached tensor must not keep this call's graph (every
                // activation of every earlier token) alive through its op's inputs.
                let (k, v) = (k.detach(), v.detach());
                *slot = Some((k.clone(), v.clone()));
                (k, v)
            }
            None => (k, v),
        };
        let (k, v) = (repeat_kv(&k, nh / nkv)?, repeat_kv(&v, nh / nkv)?);
        let mut scores = q.matmul(&k.t()?)?.affine(cfg.attention_scale(), 0.0)?;
        if let Some(cap) = cfg.attn_logit_softcapping {
            scores = softcap(&scores, cap)?;
        }
        // Rectangular with a cache: the queries are the last rows of the causal mask.
        let probs = causal_softmax(&scores, layer.window)?;
        let attn = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, nh * hd))?;
        let mut attended = o_p.forward(&attn, dropout.as_deref_mut())?;
        if let Some(sandwich) = &layer.sandwich {
            attended = rms_norm(&attended, &sandwich.after_attention, eps)?;
        }
        let x = (x + attended)?;
        let hn = rms_norm(&x, &layer.mlp_norm, eps)?;
        let (gate, up) = layer.gate_up(&hn, &mut dropout)?;
        let gate = match self.cfg.architecture().gemma() {
            true => gelu_tanh(&gate)?,
            false => gate.silu()?,
        };
        let mut out = down_p.forward(&(gate * up)?, dropout)?;
        if let Some(sandwich) = &layer.sandwich {
            out = rms_norm(&out, &sandwich.after_mlp, eps)?;
        }
        Ok((&x + out)?)
    }

    /// An empty key/value cache for [`Self::forward_cached`].
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![None; self.layers.len()],
            rows: Vec::new(),
            len: 0,
            tokens: Vec::new(),
        }
    }

    /// The tokens to feed for `ids` after what `cache` holds: `ids` themselves, or,
    /// where `ids` take a cache filled within LongRoPE's pretraining context past it,
    /// every token so far and `ids`, after emptying the cache. Keys rotated with the
    /// short factors do not mix with queries rotated with the long ones: transformers'
    /// Phi-3 drops its cache at that step and recomputes it all with the long ones, and
    /// so does this.
    pub(crate) fn longrope_refill<'a>(
        &self,
        ids: &'a [u32],
        cache: &mut KvCache,
    ) -> std::borrow::Cow<'a, [u32]> {
        let crosses = self.long_rope.is_some()
            && cache.len > 0
            && !self.cfg.long_rope_at(cache.len)
            && self.cfg.long_rope_at(cache.len + ids.len());
        if !crosses {
            return std::borrow::Cow::Borrowed(ids);
        }
        let mut all = std::mem::take(&mut cache.tokens);
        all.extend_from_slice(ids);
        *cache = self.new_cache();
        std::borrow::Cow::Owned(all)
    }

    /// Logits (vocab) of the last of `ids`, which continue the tokens `cache` already
    /// holds; their keys and values are appended to it. Feeding a prompt and then one
    /// token at a time gives the logits of [`Self::forward`] on the whole sequence,
    /// without recomputing the prefix for every new token. No dropout, no gradients.
    pub fn forward_cached(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let limit = self.cos.dim(0)?;
        if ids.is_empty()
            || cache.len + ids.len() > limit
            || cache.layers.len() != self.layers.len()
            || !cache.rows.is_empty()
        {
            return Err(Error::Model {
                path: "model".into(),
                message: format!(
                    "cannot append {} tokens to a cache of {} (max_position_embeddings {limit})",
                    ids.len(),
                    cache.len
                ),
            });
        }
        let ids = &*self.longrope_refill(ids, cache);
        let (start, t) = (cache.len, ids.len());
        if t == 0
            || start + t > limit
            || cache.layers.len() != self.layers.len()
            || !cache.rows.is_empty()
        {
            return Err(Error::Model {
                path: "model".into(),
                message: format!(
                    "cannot append {t} tokens to a cache of {start} (max_position_embeddings {limit})"
                ),
            });
        }
        let cfg = &self.cfg;
        let input = Tensor::from_vec(ids.to_vec(), (1, t), &self.device)?;
        let mut x = self.embed(&input)?;
        let rope = self.rope_range(start, t)?;
        for (layer, slot) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = self
                .layer_forward(layer, &x, &rope, None, Some(slot))?
                .detach();
        }
        cache.len += t;
        cache.tokens.extend_from_slice(ids);
        let last = rms_norm(&x, &self.norm, cfg.rms_norm_eps)?.narrow(1, t - 1, 1)?;
        Ok(self.logits(&last)?.flatten_all()?.to_dtype(DType::F32)?)
    }

    /// Logits (rows, vocab) for hidden states (…, hidden), soft-capped where the
    /// family caps them (Gemma 2).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let h = self.cfg.hidden_size();
        let rows = hidden.elem_count() / h;
        let logits = frozen_linear(&hidden.reshape((rows, h))?, &self.lm_head)?;
        match self.cfg.final_logit_softcapping {
            Some(cap) => Ok(softcap(&logits, cap)?),
            None => Ok(logits),
        }
    }

    /// Logits (batch, seq, vocab) in f32, without dropout.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let hidden = self.hidden_states(ids, None)?;
        Ok(self
            .logits(&hidden)?
            .to_dtype(DType::F32)?
            .reshape((b, t, self.cfg.vocab_size()))?)
    }
}

/// The RoPE tables (positions, head_dim / 2) of a run of positions: the model's own,
/// and the sliding-window layers' where they have a base of their own (Gemma 3).
pub(crate) struct RopeSlice {
    global: (Tensor, Tensor),
    local: Option<(Tensor, Tensor)>,
}

impl RopeSlice {
    /// The cosines and sines `layer` rotates with.
    fn of(&self, layer: &Layer) -> (&Tensor, &Tensor) {
        match (&self.local, layer.local_rope) {
            (Some((cos, sin)), true) => (cos, sin),
            _ => (&self.global.0, &self.global.1),
        }
    }
}

/// RoPE cosines and sines, (positions, rotary dims / 2) each.
pub(crate) type RopeTables = (Tensor, Tensor);

/// One layer's cached keys and values (batch, kv heads, positions, head_dim), once it
/// has seen a token.
pub(crate) type LayerCache = Option<(Tensor, Tensor)>;

/// Keys and values (each (1, kv heads, tokens, head dim), after RoPE) of every layer for
/// the tokens generated so far. Once [`Llama::forward_cached_spans`] has continued a
/// cache it holds them in row form instead, appended in place, and only that method
/// may continue it.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    /// The row form, one per layer; empty until the first pass over spans.
    rows: Vec<rows::RowLayer>,
    len: usize,
    /// The tokens held, for LongRoPE's one refill past its pretraining context (see
    /// [`Llama::longrope_refill`]).
    tokens: Vec<u32>,
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// (b, kv, t, d) → (b, kv·n_rep, t, d), each kv head repeated for its query group.
fn repeat_kv(x: &Tensor, n_rep: usize) -> candle_core::Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv, n_rep, t, d))?
        .reshape((b, kv * n_rep, t, d))
}

/// cos/sin tables (`n` positions, rotated dims / 2) for rotate-half RoPE with the inverse
/// frequencies `inv`, each multiplied by `scale` (LongRoPE's attention factor, else 1),
/// computed in f32 like HF.
fn rope_tables(
    inv: &[f32],
    n: usize,
    scale: f32,
    device: &Device,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let half = inv.len();
    let mut angles = Vec::with_capacity(n * half);
    for pos in 0..n {
        for f in inv {
            angles.push(pos as f32 * f);
        }
    }
    let angles = Tensor::from_vec(angles, (n, half), device)?;
    let scaled = |t: Tensor| -> Result<Tensor> {
        let t = match scale == 1.0 {
            true => t,
            false => t.affine(f64::from(scale), 0.0)?,
        };
        Ok(t.to_dtype(dtype)?)
    };
    Ok((scaled(angles.cos()?)?, scaled(angles.sin()?)?))
}
