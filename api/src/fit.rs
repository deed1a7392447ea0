//! What a base model allows a job to ask for, decided at create so that a job that can
//! never train is refused with the numbers instead of failing (and being retried) later:
//! a sequence length within the model's positions, a LoRA rank within the adapted
//! projections' width, and a rough memory estimate against what an attempt may use.

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use serde::Deserialize;
use tuneq_openapi::{DtypeKind, FileObject, LoraSpec, TrainSpec};

/// The shape of a Llama-family model, from its `config.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelShape {
    hidden_size: u64,
    intermediate_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    #[serde(default)]
    num_key_value_heads: Option<u64>,
    #[serde(default)]
    head_dim: Option<u64>,
    vocab_size: u64,
    #[serde(default)]
    max_position_embeddings: Option<u64>,
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
    fn projection(&self, name: &str) -> Option<(u64, u64)> {
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
    fn parameters(&self) -> u64 {
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

/// Refuses what `shape` cannot give `ask`, naming the field and the model's limit.
pub fn check(shape: &ModelShape, model: &str, ask: &Ask<'_>) -> ApiResult<()> {
    if let Some(positions) = shape.max_position_embeddings
        && ask.max_seq_len > positions
    {
        return Err(ApiError::invalid(
            "hyperparameters.max_seq_len",
            "exceeds_model_context",
            format!(
                "max_seq_len {} is longer than {model}'s {positions} positions.",
                ask.max_seq_len
            ),
        ));
    }
    let narrowest = ask
        .lora
        .target_modules
        .iter()
        .filter_map(|m| shape.projection(m).map(|(i, o)| (m, i.min(o))))
        .min_by_key(|(_, width)| *width);
    if let Some((module, width)) = narrowest
        && u64::from(ask.lora.r) > width
    {
        return Err(ApiError::invalid(
            "lora.r",
            "exceeds_projection_width",
            format!(
                "lora.r {} is wider than {model}'s {module} ({width}); a rank above a projection's width adds nothing.",
                ask.lora.r
            ),
        ));
    }
    Ok(())
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
const RUNTIME_BYTES: u64 = 256 << 20;

/// Refuses a job whose estimate exceeds `limit`, with both numbers.
pub fn check_memory(shape: &ModelShape, ask: &Ask<'_>, limit: u64) -> ApiResult<()> {
    let needed = memory_bytes(shape, ask);
    if needed > limit {
        return Err(ApiError::invalid(
            "hyperparameters.batch_size",
            "does_not_fit",
            format!(
                "This job needs about {} MiB (weights, LoRA with optimiser state, and activations for batch_size {} × max_seq_len {}), more than the {} MiB an attempt may use here; lower batch_size, max_seq_len or lora.r.",
                needed >> 20,
                ask.batch_size,
                ask.max_seq_len,
                limit >> 20
            ),
        ));
    }
    Ok(())
}

/// Refuses what the base model cannot give the job (context, projection width, memory)
/// and a training file with nothing to learn at the job's sequence length. Only models
/// with local files are checked here; the trainer checks the others.
pub(crate) fn check_job(
    state: &AppState,
    base: &crate::models::BaseModel,
    spec: &TrainSpec,
    training: &FileObject,
) -> ApiResult<()> {
    let h = &spec.hyperparameters;
    // The upload's statistics were counted at their own length, with some model's
    // tokenizer: they prove "nothing to learn" only for this model at a length no longer.
    if let Some(stats) = &training.validation.tokens
        && stats.model == base.id
        && stats.trained_tokens == 0
        && h.max_seq_len <= stats.max_seq_len
    {
        return Err(ApiError::invalid(
            "training_file",
            "no_trainable_tokens",
            format!(
                "No example of {} has a token to learn from at max_seq_len {} (every answer is cut off or empty); raise max_seq_len or fix the data.",
                training.id, h.max_seq_len
            ),
        ));
    }
    let Ok(tuneq_storage::Location::Local(dir)) = tuneq_storage::Location::parse(&base.location)
    else {
        return Ok(());
    };
    let Some(shape) = ModelShape::read(&dir) else {
        return Ok(());
    };
    let ask = Ask {
        lora: &spec.lora,
        max_seq_len: u64::from(h.max_seq_len),
        batch_size: u64::from(h.batch_size),
        dtype: spec.dtype,
    };
    check(&shape, &base.id, &ask)?;
    if let Some(limit) = state.config.attempt_memory_bytes {
        check_memory(&shape, &ask, limit)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn small() -> ModelShape {
        serde_json::from_value(serde_json::json!({
            "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 512
        }))
        .unwrap()
    }

    fn ask(lora: &LoraSpec, max_seq_len: u64, batch_size: u64) -> Ask<'_> {
        Ask {
            lora,
            max_seq_len,
            batch_size,
            dtype: DtypeKind::F32,
        }
    }

    #[test]
    fn the_model_bounds_sequence_length_and_rank() {
        let shape = small();
        let lora = LoraSpec::default();
        assert!(check(&shape, "m", &ask(&lora, 512, 4)).is_ok());
        let e = check(&shape, "m", &ask(&lora, 513, 4)).unwrap_err();
        assert_eq!(
            e.detail.param.as_deref(),
            Some("hyperparameters.max_seq_len")
        );
        // k_proj and v_proj are 64 → 32 wide (2 kv heads of 16).
        let wide = LoraSpec {
            r: 33,
            ..LoraSpec::default()
        };
        let e = check(&shape, "m", &ask(&wide, 128, 4)).unwrap_err();
        assert_eq!(e.detail.param.as_deref(), Some("lora.r"));
        assert!(e.detail.message.contains("k_proj"), "{}", e.detail.message);
        let only_mlp = LoraSpec {
            r: 33,
            target_modules: vec!["gate_proj".into()],
            ..LoraSpec::default()
        };
        assert!(check(&shape, "m", &ask(&only_mlp, 128, 4)).is_ok());
    }

    #[test]
    fn memory_grows_with_the_batch_and_is_refused_past_the_limit() {
        let shape = small();
        let lora = LoraSpec::default();
        let one = memory_bytes(&shape, &ask(&lora, 512, 1));
        let eight = memory_bytes(&shape, &ask(&lora, 512, 8));
        // Past the program's own share, the batch's activations dominate.
        assert!(
            eight - RUNTIME_BYTES > (one - RUNTIME_BYTES) * 4,
            "{one} {eight}"
        );
        assert!(check_memory(&shape, &ask(&lora, 512, 8), eight).is_ok());
        let e = check_memory(&shape, &ask(&lora, 512, 8), eight - 1).unwrap_err();
        assert!(e.detail.message.contains("MiB"), "{}", e.detail.message);
    }
}
