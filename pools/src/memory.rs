//! The memory an attempt needs, estimated from the base model's shape and the job's
//! settings: what placement compares with a pool's memory, so a job that no pool can
//! ever hold is refused at create with the numbers instead of failing on a node.

use serde::Deserialize;
use tuneq_openapi::{DtypeKind, LoraSpec};

/// The shape of a Llama-family model, from its `config.json`.
#[derive(Debug, Clone, Deserialize)]
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
    /// Key/value heads (grouped-query attention).
    pub num_key_value_heads: Option<u64>,
    #[serde(default)]
    /// Width of one head, when it is not hidden_size / heads.
    pub head_dim: Option<u64>,
    /// Tokens in the vocabulary.
    pub vocab_size: u64,
    #[serde(default)]
    /// Longest sequence it was trained for.
    pub max_position_embeddings: Option<u64>,
}

impl ModelShape {
    /// The shape of the model in the local folder `dir`; None when it has no readable
    /// `config.json` (the trainer will say why).
    pub fn read(dir: &std::path::Path) -> Option<Self> {
        let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn head_dim(&self) -> u64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// (in, out) features of a projection.
    pub fn projection(&self, name: &str) -> Option<(u64, u64)> {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.num_key_value_heads.unwrap_or(self.num_attention_heads) * self.head_dim();
        let i = self.intermediate_size;
        Some(match name {
            "q_proj" => (h, q),
            "k_proj" | "v_proj" => (h, kv),
            "o_proj" => (q, h),
            "gate_proj" | "up_proj" => (h, i),
            "down_proj" => (i, h),
            _ => return None,
        })
    }

    /// Parameters of the whole model.
    pub fn parameters(&self) -> u64 {
        let per_layer: u64 = [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
        .iter()
        .filter_map(|p| self.projection(p))
        .map(|(i, o)| i * o)
        .sum();
        per_layer * self.num_hidden_layers + 2 * self.vocab_size * self.hidden_size
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
}

/// A rough upper estimate of the memory an attempt needs, in bytes: frozen weights at
/// their dtype, LoRA parameters with their gradients and AdamW's two moments (fp32),
/// and the activations a backward pass keeps for batch × sequence length.
pub fn memory_bytes(shape: &ModelShape, ask: &Ask<'_>) -> u64 {
    let weight_bytes = match ask.dtype {
        DtypeKind::F32 => 4,
        DtypeKind::Bf16 => 2,
    };
    let frozen = shape.parameters() * weight_bytes;
    let lora_params: u64 = ask
        .lora
        .target_modules
        .iter()
        .filter_map(|m| shape.projection(m))
        .map(|(i, o)| u64::from(ask.lora.r) * (i + o))
        .sum::<u64>()
        * shape.num_hidden_layers;
    let lora = lora_params * 4 * 4;
    let tokens = ask.batch_size * ask.max_seq_len;
    // Per token and layer: the residual stream, attention and MLP inputs/outputs kept
    // for backward (about 16 hidden-sized and 3 intermediate-sized fp32 vectors), plus
    // the attention scores (heads × sequence length), and the logits at the end.
    let per_token_layer = (16 * shape.hidden_size
        + 3 * shape.intermediate_size
        + shape.num_attention_heads * ask.max_seq_len)
        * 4;
    let activations =
        tokens * (per_token_layer * shape.num_hidden_layers + 2 * shape.vocab_size * 4);
    RUNTIME_BYTES + frozen + lora + activations
}

/// What a trainer process holds besides the model and its training state: the program,
/// the tokenizer, thread stacks and the allocator's pools (a tiny model's run peaks at
/// about 290 MB resident).
pub const RUNTIME_BYTES: u64 = 256 << 20;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    pub(crate) fn small() -> ModelShape {
        serde_json::from_value(serde_json::json!({
            "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 512
        }))
        .unwrap()
    }

    fn ask(lora: &LoraSpec, batch_size: u64, dtype: DtypeKind) -> Ask<'_> {
        Ask {
            lora,
            max_seq_len: 512,
            batch_size,
            dtype,
        }
    }

    #[test]
    fn memory_grows_with_the_batch_and_halves_its_weights_in_bf16() {
        let shape = small();
        let lora = LoraSpec::default();
        let one = memory_bytes(&shape, &ask(&lora, 1, DtypeKind::F32));
        let eight = memory_bytes(&shape, &ask(&lora, 8, DtypeKind::F32));
        // Past the program's own share, the batch's activations dominate.
        assert!(
            eight - RUNTIME_BYTES > (one - RUNTIME_BYTES) * 4,
            "{one} {eight}"
        );
        let bf16 = memory_bytes(&shape, &ask(&lora, 1, DtypeKind::Bf16));
        assert_eq!(one - bf16, shape.parameters() * 2);
    }

    #[test]
    fn a_7b_llama_needs_its_weights_and_more() {
        // Llama 2 7B's config.json.
        let shape: ModelShape = serde_json::from_value(serde_json::json!({
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096
        }))
        .unwrap();
        let params = shape.parameters();
        assert!((6_500_000_000..7_000_000_000).contains(&params), "{params}");
        let lora = LoraSpec::default();
        let bf16 = memory_bytes(&shape, &ask(&lora, 1, DtypeKind::Bf16));
        assert!(bf16 > params * 2, "{bf16}");
    }
}
