//! What `tuneq up`, `tuneq api` and `tuneq dispatcher` share, one module per noun:
//!
//! - `policy`: what the API accepts (admin key, uploads, webhooks, tenant defaults).
//! - `process`: private files, the open-file limit, the upload spool, the async runtime.
//! - `inference`: answering chat requests (generations at once, resident models).
//! - `memory`: the memory one attempt may use.
//! - `model`: base models from `--model ID=LOCATION`.
//! - `queue`: opening the queue, and the attempt credentials' signer.
//! - `pools`: the pools served, from a file or the `--pool` shorthand.
//! - `pair`: `NAME=VALUE` arguments.
//! - `dispatch`: dispatcher loops on a local runtime or a Kubernetes pool.
//! - `outcomes`: the loop that files finished jobs and sends their webhooks.
//! - `server`: the HTTP API on its own task, and its orderly stop.
//! - `shutdown`: graceful shutdown on signals.

mod dispatch;
mod inference;
mod memory;
mod model;
mod outcomes;
mod pair;
mod policy;
mod pools;
mod process;
pub mod queue;
mod server;
mod shutdown;

pub use dispatch::{
    KubernetesDispatch, LocalDispatch, spawn_dispatcher, spawn_kubernetes_dispatcher,
};
pub use inference::InferenceArgs;
pub use memory::attempt_memory;
pub use model::{BASE_LEARNING_RATE, ModelArg, check_aliases, model_arg, register_model};
pub use outcomes::settle_loop;
pub use policy::ApiPolicyArgs;
pub use pools::{check_kubernetes_pools, load_pools, local_pools};
pub use process::{clean_spool, make_private, private_files, runtime};
pub use queue::{attempt_signer, open_queue};
pub use server::RunningApi;
pub use shutdown::{force_on_second_signal, shutdown_signal};
