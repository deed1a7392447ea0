//! Node pools: where attempts run, and how a job is matched to them.
//!
//! Layout:
//! - [`architecture`]: which model architectures tuneq trains, from a `config.json`
//!   (registration, job creation and the trainer's loader all ask it).
//! - [`folder`]: a model folder's weight files, their safetensors headers, and its
//!   identity (the hash that fingerprints runs, computed once at registration).
//! - [`file`](mod@file): the pools file (TOML) that `tuneq api`, `tuneq dispatcher` and
//!   `tuneq up` read, checked field by field.
//! - [`kube_syntax`]: what the Kubernetes API server accepts in the names, keys, label
//!   values, paths and image references a pools file hands to it.
//! - [`quantity`]: CPU and memory written as Kubernetes writes them.
//! - [`memory`]: the memory an attempt needs, from the model's shape and the job.
//! - [`tensors`]: the tensors a model's weights hold, with the shapes its config implies.
//! - [`placement`]: which pools a job may use, in which order, at what cost; when an
//!   attempt moves on to the next pool.

pub mod architecture;
pub mod file;
pub mod folder;
pub mod kube_syntax;
pub mod memory;
pub mod placement;
pub mod quantity;
pub mod tensors;

pub use architecture::{Architecture, Unsupported, WrongTargets, architecture_of};
pub use file::{Hardware, KubernetesPool, Pool, PoolsError, PoolsFile, RuntimeKind};
pub use memory::{
    Ask, CpuMemory, GraphMemory, ModelShape, cpu_memory, cpu_memory_needed, gpu_memory_bytes,
    gpu_memory_needed, graph_checkpointing, graph_memory, graph_memory_bytes, kernel_compute,
    thread_scratch_bytes,
};
pub use placement::{Candidate, Estimate, Needs, Refusal, Setback, choose, plan, usable};
pub use tensors::ExpectedTensor;
