//! The memory an attempt needs, estimated from the base model's shape and the job's
//! settings: what placement compares with a pool's memory, so a job that no pool can
//! ever hold is refused at create with the numbers instead of failing on a node.

use crate::architecture::{Unsupported, architecture_of};
use serde::{Deserialize, Serialize};
use tuneq_kernels::llama::{Compute, Dims, Gemma, PROJECTIONS, step_bytes_on_any_cpu};
use tuneq_openapi::{ActivationCheckpointing, ComputeKind, DtypeKind, LoraSpec};

/// The shape of a model of a family tuneq trains, from its `config.json`: the fields
/// placement's estimate reads, and the trainer's config carries them too (flattened into
/// its own).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Width of the residual stream.
    pub hidden_size: u64,
    /// Width of the MLP.
    pub intermediate_size: u64,
    /// Decoder layers.
    pub num_hidden_layers: u64,
    /// Query heads.
    pub num_attention_heads: u64,
    #[serde(default)]
    /// Key/value heads (grouped-query attention); the query heads when absent.
    pub num_key_value_heads: Option<u64>,
    #[serde(default)]
    /// Width of one head, when it is not hidden_size / heads.
    pub head_dim: Option<u64>,
    /// Tokens in the vocabulary.
    pub vocab_size: u64,
    #[serde(default)]
    /// Longest sequence it was trained for.
    pub max_position_embeddings: Option<u64>,
    #[serde(default)]
    /// Whether the head is the embedding matrix itself.
    pub tie_word_embeddings: bool,
    #[serde(default)]
    /// The dtype its files hold (`float32`, `bfloat16`, `float16`).
    pub torch_dtype: Option<String>,
    #[serde(default)]
    /// How many positions its sliding-window layers see (Mistral's every layer, Gemma's
    /// `sliding_attention` ones), after [`crate::architecture::with_class_defaults`].
    pub sliding_window: Option<u64>,
    #[serde(default)]
    /// Its family (`llama`, `qwen2`, `qwen3`, `mistral`, `gemma2`, `gemma3_text`; see
    /// [`crate::Architecture`]),
    /// which [`ModelShape::read`] and the trainer's loader check before reading the rest.
    pub model_type: Option<String>,
    /// How many tokens its `tokenizer.json` adds beside the model's own vocabulary (each
    /// costs about three times a vocabulary entry, see `tokenizer_bytes`). Read by
    /// [`ModelShape::read`]; None where no tokenizer was read, counted as all added.
    #[serde(skip)]
    pub added_tokens: Option<u64>,
    /// How many merges its `tokenizer.json`'s BPE model holds (Gemma's hold two per
    /// vocabulary entry, most others one). Read with [`Self::added_tokens`]; None where
    /// no tokenizer was read.
    #[serde(skip)]
    pub merges: Option<u64>,
}

/// The largest `tokenizer.json` read for its added tokens (real ones are 2–20 MB); a larger
/// one is not read, and its entries all count as added.
const TOKENIZER_FILE_LIMIT: u64 = 64 << 20;

/// The largest `config.json` read (real ones are a few KiB).
const CONFIG_FILE_LIMIT: u64 = 1 << 20;

/// The bytes of the file at `path`; None when it cannot be read or holds more than
/// `limit` bytes. Bounded by the read itself, so a file that grows after a size check
/// cannot pass it.
fn read_at_most(path: &std::path::Path, limit: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .ok()?;
    (bytes.len() as u64 <= limit).then_some(bytes)
}

/// How many tokens the tokenizer file at `path` adds and how many merges its model holds;
/// None when it is missing, larger than [`TOKENIZER_FILE_LIMIT`] or not a tokenizer file.
fn read_tokenizer_counts(path: &std::path::Path) -> Option<(u64, u64)> {
    let bytes = read_at_most(path, TOKENIZER_FILE_LIMIT)?;
    let file: TokenizerFile = serde_json::from_slice(&bytes).ok()?;
    let merges = file.model.map_or(0, |m| m.merges.len());
    Some((file.added_tokens.len() as u64, merges as u64))
}

/// The fields of a `tokenizer.json` the estimate needs; the rest is skipped unread.
#[derive(Deserialize)]
struct TokenizerFile {
    #[serde(default)]
    added_tokens: Vec<serde::de::IgnoredAny>,
    #[serde(default)]
    model: Option<TokenizerModel>,
}

/// The part of a tokenizer's model the estimate counts.
#[derive(Deserialize)]
struct TokenizerModel {
    #[serde(default)]
    merges: Vec<serde::de::IgnoredAny>,
}

impl ModelShape {
    /// The shape of the model in the local folder `dir`: None when it has no readable
    /// `config.json` of at most 1 MiB (the trainer will say why), an error when the config
    /// is of an architecture tuneq does not train ([`architecture_of`]).
    pub fn read(dir: &std::path::Path) -> Option<Result<Self, Unsupported>> {
        let text = read_at_most(&dir.join("config.json"), CONFIG_FILE_LIMIT)?;
        let config: serde_json::Value = serde_json::from_slice(&text).ok()?;
        if let Err(refusal) = architecture_of(&config) {
            return Some(Err(refusal));
        }
        let config = crate::architecture::with_class_defaults(config);
        let mut shape: Self = serde_json::from_value(config).ok()?;
        if let Some((added, merges)) = read_tokenizer_counts(&dir.join("tokenizer.json")) {
            (shape.added_tokens, shape.merges) = (Some(added), Some(merges));
        }
        Some(Ok(shape))
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> u64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> u64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// (in, out) features of a projection.
    pub fn projection(&self, name: &str) -> Option<(u64, u64)> {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.kv_heads() * self.head_dim();
        let i = self.intermediate_size;
        Some(match name {
            "q_proj" => (h, q),
            "k_proj" | "v_proj" => (h, kv),
            "o_proj" => (q, h),
            "gate_proj" | "up_proj" => (h, i),
            "down_proj" => (i, h),
            "qkv_proj" => (h, q + 2 * kv),
            "gate_up_proj" => (h, 2 * i),
            _ => return None,
        })
    }

    /// Parameters of the whole model: every tensor its weight files hold
    /// ([`ModelShape::expected_tensors`]: embedding, projections and their biases, norms,
    /// head unless tied), as transformers' `num_parameters()` counts them.
    pub fn parameters(&self) -> u64 {
        self.expected_tensors()
            .iter()
            .map(|t| t.shape.iter().product::<u64>())
            .sum()
    }

    /// Bytes per weight in its files (4 unless `torch_dtype` says a 16-bit type).
    pub fn file_bytes_per_weight(&self) -> u64 {
        match self.torch_dtype.as_deref() {
            Some("bfloat16" | "float16") => 2,
            _ => 4,
        }
    }

    /// Elements of its largest matrix (the embedding, or an MLP projection).
    pub fn largest_matrix(&self) -> u64 {
        let mlp = self.hidden_size * self.intermediate_size;
        (self.vocab_size * self.hidden_size).max(mlp)
    }

    /// Trainable parameters of `lora` on this model (on the projections its targets
    /// mean on this family, see [`crate::Architecture::lora_targets`]).
    pub fn lora_parameters(&self, lora: &LoraSpec) -> u64 {
        let targets = self
            .architecture()
            .lora_targets(&lora.target_modules)
            .unwrap_or_else(|_| lora.target_modules.clone());
        targets
            .iter()
            .filter_map(|m| self.projection(m))
            .map(|(i, o)| u64::from(lora.r) * (i + o))
            .sum::<u64>()
            * self.num_hidden_layers
    }

    /// Its family (Llama's when the config names none, as a config built in code may).
    pub fn architecture(&self) -> crate::Architecture {
        self.model_type
            .as_deref()
            .and_then(crate::Architecture::from_model_type)
            .unwrap_or(crate::Architecture::Llama)
    }

    /// Its sliding window where one can bind: Mistral's (every layer's) and Gemma's (its
    /// `sliding_attention` layers'), when shorter than the context. (The Qwens' window
    /// is read only with their switch, which their rules hold off.)
    pub fn binding_window(&self) -> Option<u64> {
        use crate::Architecture::{Gemma2, Gemma3, Mistral, Phi3};
        let read = matches!(self.architecture(), Mistral | Gemma2 | Gemma3 | Phi3);
        let window = self.sliding_window.filter(|_| read)?;
        match self.max_position_embeddings {
            Some(context) if window >= context => None,
            _ => Some(window),
        }
    }

    /// The architecture as the CPU kernels take it.
    pub fn dims(&self) -> Dims {
        let heads = self.num_attention_heads as usize;
        Dims {
            qk_norm: self.architecture().qk_norm(),
            vocab: self.vocab_size as usize,
            hidden: self.hidden_size as usize,
            intermediate: self.intermediate_size as usize,
            layers: self.num_hidden_layers as usize,
            heads,
            kv_heads: self.num_key_value_heads.map_or(heads, |k| k as usize),
            head_dim: self.head_dim() as usize,
            // The rotation changes no buffer's size.
            rotary_dim: self.head_dim() as usize,
            rms_eps: 1e-5,
            // A Gemma keeps two more normed outputs per layer; their sizes do not
            // depend on its scales or caps.
            gemma: self.architecture().gemma().then_some(Gemma {
                embed_scale: 1.0,
                attention_scale: 1.0,
                attention_softcap: None,
                logit_softcap: None,
            }),
        }
    }
}

/// What a job asks of its model.
#[derive(Debug, Clone)]
pub struct Ask<'a> {
    /// The LoRA settings.
    pub lora: &'a LoraSpec,
    /// Sequence length.
    pub max_seq_len: u64,
    /// Examples per micro-batch.
    pub batch_size: u64,
    /// The frozen weights' dtype.
    pub dtype: DtypeKind,
    /// How the CPU computes the frozen projections (bf16 makes `auto` weights bf16, and
    /// the step holds a rounded copy of each product's input).
    pub compute: ComputeKind,
    /// Whether the CPU step may recompute layers instead of keeping them.
    pub checkpointing: ActivationCheckpointing,
    /// Tokens of the training data, when known (the trainer holds them encoded).
    pub dataset_tokens: u64,
}

/// What an attempt on the CPU holds at its peak, in bytes, by part.
///
/// The trainer's peak is the larger of two moments: loading (the weights read so far
/// plus the tensor being read and converted) and the optimiser step (the weights, the
/// LoRA state, the encoded data, the step's own buffers, which
/// [`tuneq_kernels::llama::step_bytes`] counts from the same helpers the step allocates
/// with, and the scratch it does not count). Checked against the peak `tuneq train`
/// reports on three model shapes, f32 and bf16, with and without checkpointing, in
/// `tests/memory_estimate.rs` (within 10 %; all within 8 % on an AVX-512 EPYC; the tiny
/// model's peak has moved between runs on other CPUs, so there the median of five is
/// compared, within 10 % or 24 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuMemory {
    /// The program and the tokenizer.
    pub runtime: u64,
    /// The frozen weights as held.
    pub weights: u64,
    /// The largest tensor's extra copies while loading (read buffer, and the file's
    /// dtype before conversion).
    pub loading: u64,
    /// LoRA factors with their gradients, AdamW's moments and checkpoint copies.
    pub lora_state: u64,
    /// The encoded training data.
    pub data: u64,
    /// The step's activations and buffers for the largest micro-batch.
    pub step: u64,
    /// What the step uses besides: GEMM packing, attention's per-thread scratch, thread
    /// stacks and the allocator's per-thread arenas.
    pub scratch: u64,
    /// Whether `step` is with layers recomputed.
    pub checkpointing: bool,
}

impl CpuMemory {
    /// The peak.
    pub fn total(&self) -> u64 {
        self.runtime
            + self.weights
            + self
                .loading
                .max(self.lora_state + self.data + self.step + self.scratch)
    }
}

/// The program before it reads a tokenizer or a model, measured (Linux, resident).
pub const PROCESS_BYTES: u64 = 24 << 20;

/// A tokenizer's resident bytes during training: a fixed part, and a part per entry that
/// depends on where the entry lives. An added token (matched before the model splits the
/// text) costs about 1.6 KiB, an entry of the model's own vocabulary 0.37 KiB and each
/// merge 0.72 KiB (what parsing its file leaves resident included). Fitted on the
/// trainer's resident memory once the tokenizer is loaded and before the weights are
/// read: `tuneq model init`'s byte-level BPE tokenizers, whose entries are mostly added
/// tokens (small: 29106 of 32000: 54 MiB), the real SmolLM2-135M's (49152 entries and
/// 48900 merges: 67 MiB), Qwen2.5's (151936 and 151387: 166 MiB) and Gemma 3's (262144
/// entries, 6384 of them added, and 514906 merges: 470 MiB). Without a tokenizer file
/// every entry counts as added: the larger figure for all but Gemma's kind.
fn tokenizer_bytes(shape: &ModelShape) -> u64 {
    let added = shape
        .added_tokens
        .unwrap_or(shape.vocab_size)
        .min(shape.vocab_size);
    let own = shape.vocab_size - added;
    let merges = match shape.added_tokens {
        Some(_) => shape.merges.unwrap_or(own),
        None => 0,
    };
    (4 << 20) + 1614 * added + 382 * own + 740 * merges
}

/// What the step holds besides [`step_bytes_on_any_cpu`], for a step whose own buffers
/// are `step` bytes, with [`REFERENCE_THREADS`] threads: GEMM packing, attention's
/// per-thread scratch, thread stacks, and what mimalloc keeps of freed buffers (the
/// trainer never hands them back between steps, see `MIMALLOC_PURGE_DELAY`), which grows
/// with the buffers the step allocates and frees. Fitted on tiny, small and SmolLM2-135M's
/// shape, f32 and bf16 weights, with and without checkpointing, with the kernels' own x86
/// GEMM (the implied scratch ran from 14 MiB on tiny to 76 MiB on SmolLM2's shape, where
/// the step's buffers are 829 MiB): the estimates are then within 8 % of every peak,
/// where a constant 48 MiB was 14–20 % over on tiny. matrixmultiply, which the kernels
/// fall back to on CPUs without AVX2 and on other architectures, copies more operands:
/// 16–76 MiB were measured with it.
pub fn step_scratch_bytes(step: u64) -> u64 {
    (20 << 20) + step / 16
}

/// The thread count the estimate's constants were measured with.
pub const REFERENCE_THREADS: u64 = 2;

/// Scratch each further compute thread adds (GEMM packing, the allocator's per-thread
/// caches): 6.0 MiB per thread from 8 to 16 threads on small, 4.0 on SmolLM2-135M's
/// shape, with the kernels' own x86 GEMM (15.7 with matrixmultiply, whose operand copies
/// were kept per thread).
pub const SCRATCH_PER_THREAD_BYTES: u64 = 6 << 20;

/// The kernels' compute mode for a job's `compute`.
pub fn kernel_compute(kind: ComputeKind) -> Compute {
    match kind {
        ComputeKind::F32 => Compute::F32,
        ComputeKind::Bf16 => Compute::Bf16,
    }
}

/// What an attempt with `threads` compute threads holds beyond the estimate (which
/// counts [`REFERENCE_THREADS`]); nothing for fewer threads, so that it stays an upper
/// bound.
pub fn thread_scratch_bytes(threads: u64) -> u64 {
    SCRATCH_PER_THREAD_BYTES * threads.saturating_sub(REFERENCE_THREADS)
}

/// Copies of the LoRA parameters an attempt holds: the factors, their gradients (the
/// kernels' and the optimiser's), AdamW's two moments, and a checkpoint's serialised
/// adapter and optimiser state.
const LORA_COPIES: u64 = 8;

/// Bytes the trainer keeps per token of training data (ids, targets, offsets).
const DATA_BYTES_PER_TOKEN: u64 = 16;

/// The peak memory of an attempt on the CPU (the fused step), by part. With
/// `checkpointing: auto` and a `limit` (the pool's memory), layers are recomputed only
/// when keeping them would pass it, as the trainer decides.
pub fn cpu_memory(shape: &ModelShape, ask: &Ask<'_>, limit: Option<u64>) -> CpuMemory {
    let dims = shape.dims();
    let weight_bytes = weight_bytes(ask, false);
    let file_bytes = shape.file_bytes_per_weight();
    let converting = if file_bytes == weight_bytes {
        0
    } else {
        file_bytes
    };
    let largest_tensor = shape.largest_matrix();
    let ranks = vec![
        std::array::from_fn(|p| {
            if adapts(&ask.lora.target_modules, PROJECTIONS[p]) {
                ask.lora.r as usize
            } else {
                0
            }
        });
        dims.layers
    ];
    let tokens = (ask.batch_size * ask.max_seq_len) as usize;
    let dropout = ask.lora.dropout > 0.0;
    let bf16 = ask.dtype.with_compute(ask.compute, false) == DtypeKind::Bf16;
    let compute = match ask.compute {
        ComputeKind::F32 => Compute::F32,
        ComputeKind::Bf16 => Compute::Bf16,
    };
    // The node's CPU is not known here: bf16 compute counts the widened operands.
    let step =
        |recompute| step_bytes_on_any_cpu(&dims, tokens, &ranks, dropout, recompute, bf16, compute);
    let kept = step(false);
    let mut memory = CpuMemory {
        runtime: PROCESS_BYTES + tokenizer_bytes(shape),
        weights: shape.parameters() * weight_bytes,
        loading: largest_tensor * (file_bytes + converting),
        lora_state: shape.lora_parameters(ask.lora) * 4 * LORA_COPIES,
        data: ask.dataset_tokens * DATA_BYTES_PER_TOKEN,
        step: kept,
        scratch: step_scratch_bytes(kept),
        checkpointing: false,
    };
    let recompute = match ask.checkpointing {
        ActivationCheckpointing::On => true,
        ActivationCheckpointing::Off => false,
        ActivationCheckpointing::Auto => limit.is_some_and(|limit| memory.total() > limit),
    };
    if recompute {
        memory.step = step(true);
        memory.scratch = step_scratch_bytes(memory.step);
        memory.checkpointing = true;
    }
    memory
}

/// Whether `targets` adapt the kernels' projection `name`: by its own name, or by the
/// fused projection it is a part of (Phi-3's `qkv_proj`, `gate_up_proj`).
fn adapts(targets: &[String], name: &str) -> bool {
    let fused = match name {
        "q_proj" | "k_proj" | "v_proj" => "qkv_proj",
        "gate_proj" | "up_proj" => "gate_up_proj",
        _ => name,
    };
    targets.iter().any(|t| t == name || t == fused)
}

/// Bytes per frozen weight of `dtype` on a GPU or on the CPU.
fn weight_bytes(ask: &Ask<'_>, gpu: bool) -> u64 {
    match ask.dtype.with_compute(ask.compute, gpu) {
        DtypeKind::Bf16 => 2,
        _ => 4,
    }
}

/// The least memory an attempt on the CPU needs: with layers recomputed when the job
/// allows it (`on`, or `auto`, which turns it on when a pool's memory asks for it).
/// What placement compares with a CPU pool's memory: every family trains on the fused
/// CPU step there.
pub fn cpu_memory_needed(shape: &ModelShape, ask: &Ask<'_>) -> u64 {
    cpu_memory(shape, ask, Some(0)).total()
}

/// Floats candle's graph keeps per token and layer for backward: measured through the
/// CPU graph (`TUNEQ_CPU_PATH=graph`) on tiny, small and SmolLM2-135M's shape (20.7 K,
/// 60.3 K and 40.4 K floats), fitted as `42·hidden + 8·intermediate + 3·heads·seq`
/// (norms in f32, q/k/v and their transposed copies, repeated keys and values, scores
/// and probabilities, the MLP's products, LoRA's intermediates).
/// A Gemma's layers keep more: two more norms (their f32 copies and outputs) and GELU's
/// input beside its output, fitted as `6·hidden + intermediate/2` on the small preset's
/// shape as Gemma 3 (its measured peak 4428 MiB, 422 under the Llama terms plus a first
/// guess); Gemma 2's soft-capped scores beside the raw ones and their tanh, `3·heads·seq`
/// (its peak 452 MiB over Gemma 3's). Phi-3's fused q/k/v and gate/up products stay
/// alive beside the parts split from them, fitted as `hidden + intermediate` on the
/// small preset's shape as Phi-3 (its peak 4372 MiB, 225 over the Llama terms).
fn graph_floats_per_token_layer(shape: &ModelShape, seq: u64) -> u64 {
    let llama =
        42 * shape.hidden_size + 8 * shape.intermediate_size + 3 * shape.num_attention_heads * seq;
    let architecture = shape.architecture();
    let gemma = match architecture.gemma() {
        true => 6 * shape.hidden_size + shape.intermediate_size / 2,
        false => 0,
    };
    let softcapped_scores = match architecture == crate::Architecture::Gemma2 {
        true => 3 * shape.num_attention_heads * seq,
        false => 0,
    };
    let fused_products = match architecture.fuses_projections() {
        true => shape.hidden_size + shape.intermediate_size,
        false => 0,
    };
    llama + gemma + softcapped_scores + fused_products
}

/// Copies of the logits the graph's loss keeps (logits, log-softmax, their gradients).
const GRAPH_LOGIT_COPIES: u64 = 6;

/// What the graph holds besides, measured on the CPU.
const GRAPH_FIXED_BYTES: u64 = 64 << 20;

/// The memory an attempt needs on candle's graph, in bytes: the accelerator's memory
/// when `on_gpu` (weights at their dtype, activations in bf16 for a bf16 model, the
/// loss in f32, and the CUDA context), else the process's on the CPU graph
/// (`TUNEQ_CPU_PATH=graph`, where `tests/memory_estimate.rs` checks it within 10 %).
/// With `activation_checkpointing: on` the graph keeps each layer's input and one
/// layer's graph at a time; this figure counts `auto` as off (see
/// [`graph_checkpointing`] for when `auto` turns it on).
pub fn graph_memory_bytes(shape: &ModelShape, ask: &Ask<'_>, on_gpu: bool) -> u64 {
    let weight_bytes = weight_bytes(ask, on_gpu);
    let activation_bytes = if on_gpu { weight_bytes } else { 4 };
    let tokens = ask.batch_size * ask.max_seq_len;
    let per_layer =
        tokens * graph_floats_per_token_layer(shape, ask.max_seq_len) * activation_bytes;
    let layers = if ask.checkpointing == ActivationCheckpointing::On {
        shape.num_hidden_layers * tokens * shape.hidden_size * activation_bytes + per_layer
    } else {
        shape.num_hidden_layers * per_layer
    };
    // Gemma 2's soft-capped logits keep their tanh and the capped copy besides.
    let logit_copies = match shape.architecture() == crate::Architecture::Gemma2 {
        true => GRAPH_LOGIT_COPIES + 2,
        false => GRAPH_LOGIT_COPIES,
    };
    let logits = logit_copies * tokens * shape.vocab_size * 4;
    let fixed = if on_gpu {
        GPU_RUNTIME_BYTES
    } else {
        PROCESS_BYTES + tokenizer_bytes(shape) + GRAPH_FIXED_BYTES
    };
    fixed
        + shape.parameters() * weight_bytes
        + shape.lora_parameters(ask.lora) * 4 * LORA_COPIES
        + layers
        + logits
}

/// The accelerator memory an attempt on a GPU needs ([`graph_memory_bytes`] on CUDA).
/// Not yet checked on a GPU (none was available); its graph terms are the CPU graph's.
pub fn gpu_memory_bytes(shape: &ModelShape, ask: &Ask<'_>) -> u64 {
    graph_memory_bytes(shape, ask, true)
}

/// Whether candle's graph recomputes layers: `on`; `off`; or, for `auto`, when keeping
/// every layer's activations would pass `limit` (the accelerator's memory on a GPU, the
/// process's limit on the CPU graph). The trainer decides with this, from the limit its
/// launcher passes, and placement assumes it (see [`gpu_memory_needed`]).
pub fn graph_checkpointing(
    shape: &ModelShape,
    ask: &Ask<'_>,
    on_gpu: bool,
    limit: Option<u64>,
) -> bool {
    match ask.checkpointing {
        ActivationCheckpointing::On => true,
        ActivationCheckpointing::Off => false,
        ActivationCheckpointing::Auto => limit.is_some_and(|limit| {
            let keep = Ask {
                checkpointing: ActivationCheckpointing::Off,
                ..ask.clone()
            };
            graph_memory_bytes(shape, &keep, on_gpu) > limit
        }),
    }
}

/// What an attempt holds on candle's graph, with `auto` resolved against a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphMemory {
    /// Bytes ([`graph_memory_bytes`]).
    pub bytes: u64,
    /// Whether layers are recomputed ([`graph_checkpointing`]).
    pub checkpointing: bool,
}

/// The memory of an attempt on candle's graph, recomputing layers as
/// [`graph_checkpointing`] decides for `limit`.
pub fn graph_memory(
    shape: &ModelShape,
    ask: &Ask<'_>,
    on_gpu: bool,
    limit: Option<u64>,
) -> GraphMemory {
    let checkpointing = graph_checkpointing(shape, ask, on_gpu, limit);
    let resolved = Ask {
        checkpointing: if checkpointing {
            ActivationCheckpointing::On
        } else {
            ActivationCheckpointing::Off
        },
        ..ask.clone()
    };
    GraphMemory {
        bytes: graph_memory_bytes(shape, &resolved, on_gpu),
        checkpointing,
    }
}

/// The least accelerator memory an attempt on a GPU needs: with layers recomputed when
/// the job allows it (`on`, or `auto`, which the trainer turns on when the GPU's memory
/// asks for it). What placement compares with a GPU pool's memory.
pub fn gpu_memory_needed(shape: &ModelShape, ask: &Ask<'_>) -> u64 {
    graph_memory(shape, ask, true, Some(0)).bytes
}

/// The CUDA context, cuBLAS workspace and allocator slack on a GPU.
pub const GPU_RUNTIME_BYTES: u64 = 512 << 20;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
