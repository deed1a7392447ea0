//! The projections of a decoder layer that LoRA can wrap, in PEFT's module names: what a
//! spec's `target_modules` may name, and the order the kernels keep a layer's projections
//! in.
//!
//! Most families keep seven separate projections ([`PROJECTIONS`]); Phi-3 fuses q, k and
//! v into one `qkv_proj` and the MLP's gate and up into one `gate_up_proj`
//! ([`FUSED_PROJECTIONS`]), and PEFT wraps those fused matrices whole.

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

/// The four projections of a layer that fuses q, k and v, and gate and up (Phi-3), in
/// its order.
pub const FUSED_PROJECTIONS: [&str; 4] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"];

/// Whether `name` is a projection of some family tuneq trains (which ones a model has is
/// its architecture's to say, once the model is known).
pub fn is_projection(name: &str) -> bool {
    PROJECTIONS.contains(&name) || FUSED_PROJECTIONS.contains(&name)
}

/// Whether `targets` names every projection of a seven-projection layer (the default):
/// "every projection", which on a fused layer means each of its four.
pub fn names_every_projection(targets: &[String]) -> bool {
    PROJECTIONS.iter().all(|p| targets.iter().any(|t| t == p))
}
