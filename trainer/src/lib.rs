//! The tuneq trainer: LoRA fine-tuning of Llama-family models with candle.
//!
//! The trainer turns a [`tuneq_openapi::TrainSpec`] into a PEFT adapter. It knows nothing
//! of Redis, Kubernetes or HTTP servers: it reads a model and datasets, trains, writes
//! checkpoints and the adapter, and reports progress through a [`progress::ProgressSink`].
//!
//! Layout:
//! - [`config`]: the Llama `config.json` fields (incl. Llama 3 `rope_scaling`).
//! - [`weights`]: reading sharded safetensors by HF names; writing safetensors.
//! - [`ops`]: RMSNorm, RoPE, causal softmax, frozen linear and masked cross-entropy with
//!   hand-written backward passes (no gradients for frozen weights).
//! - [`lora`]: the LoRA-wrapped linear layer and its settings.
//! - [`model`]: the Llama decoder built from those pieces.
//! - [`optim`], [`schedule`]: AdamW with saveable state; warmup + linear/cosine/constant.
//! - [`data`]: JSONL datasets (chat, prompt/completion, alpaca, text), chat templates,
//!   tokenisation with loss masks, and the tokenizer `tuneq model init` ships.
//! - [`batch`]: padded micro-batches in a seed-determined order.
//! - [`checkpoint`]: atomic, manifest-last checkpoints and exact resume; [`compute`]: the
//!   compute path, GEMM library and CPU features a checkpoint records.
//! - [`peft`]: the adapter format PEFT, vLLM and LoRAX load.
//! - [`remote`]: models and datasets staged from S3/GCS, outputs mirrored back, manifest last.
//! - [`step`]: what a training step takes and gives, on either compute path; [`dpo`]:
//!   the preference loss a DPO step weighs its tokens by.
//! - [`train`]: the training run (device, inputs, accumulation, optimiser step,
//!   evaluation, metrics, manifest), one module per noun.
//! - [`progress`]: where progress goes (JSON lines, terminal bar).
//! - [`generate`], [`merge`], [`init`], [`bench`](mod@bench), [`debug`]: the other `tuneq`
//!   commands.
//!
//! Concurrency: one run is one thread of control; candle parallelises each kernel over
//! `RAYON_NUM_THREADS` threads. Results are bit-reproducible for a fixed thread count.

pub mod batch;
pub mod bench;
pub mod checkpoint;
pub mod compute;
pub mod config;
/// Datasets live in their own crate, so the API can validate uploads without candle.
pub use tuneq_dataset as data;
pub mod debug;
pub mod dpo;
pub mod error;
pub mod fast;
pub mod generate;
pub mod init;
pub mod lora;
pub mod merge;
pub mod model;
pub mod ops;
pub mod optim;
pub mod peft;
pub mod progress;
pub mod remote;
pub mod report;
pub mod schedule;
pub mod step;
pub mod train;
pub mod weights;

pub use error::{Error, Result};
