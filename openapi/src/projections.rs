//! The seven projections of a Llama layer that LoRA can wrap, in PEFT's module names:
//! what a spec's `target_modules` may name, and the order the kernels keep a layer's
//! projections in.

/// The seven projections, in a layer's order: attention's q, k, v, o, then the MLP's
/// gate, up, down.
pub const PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];
