//! The tensors a model's weights hold, named as transformers saves them, with the
//! shapes its `config.json` implies: what registering a model folder checks its
//! safetensors files against, before any job loads them. The trainer's loader takes the
//! same names and shapes (a test of `tuneq-trainer` holds the two together for every
//! family).

use crate::memory::ModelShape;

/// One tensor a model's weights must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedTensor {
    /// Its name in the safetensors files (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Its shape, outermost first (`[out, in]` for a linear layer's weight).
    pub shape: Vec<u64>,
}

impl ModelShape {
    /// Every tensor a checkpoint of this shape and family holds: the embedding, each
    /// layer's norms and projections (Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k
    /// norms, a Gemma's four norms a layer, Phi-3's fused `qkv_proj` and `gate_up_proj`),
    /// the final norm, and the head unless it is tied to the embedding.
    pub fn expected_tensors(&self) -> Vec<ExpectedTensor> {
        let architecture = self.architecture();
        let (h, v) = (self.hidden_size, self.vocab_size);
        let tensor = |name: String, shape: Vec<u64>| ExpectedTensor { name, shape };
        let mut out = vec![tensor("model.embed_tokens.weight".into(), vec![v, h])];
        let mut norms = vec!["input_layernorm", "post_attention_layernorm"];
        if architecture.gemma() {
            norms.extend(["pre_feedforward_layernorm", "post_feedforward_layernorm"]);
        }
        for layer in 0..self.num_hidden_layers {
            let at = |rest: &str| format!("model.layers.{layer}.{rest}");
            for norm in &norms {
                out.push(tensor(at(&format!("{norm}.weight")), vec![h]));
            }
            if architecture.qk_norm() {
                for norm in ["q_norm", "k_norm"] {
                    let name = at(&format!("self_attn.{norm}.weight"));
                    out.push(tensor(name, vec![self.head_dim()]));
                }
            }
            for &projection in architecture.projections() {
                let Some((input, output)) = self.projection(projection) else {
                    continue;
                };
                let module = match projection {
                    "gate_proj" | "up_proj" | "down_proj" | "gate_up_proj" => "mlp",
                    _ => "self_attn",
                };
                let name = at(&format!("{module}.{projection}"));
                out.push(tensor(format!("{name}.weight"), vec![output, input]));
                let biased = matches!(projection, "q_proj" | "k_proj" | "v_proj");
                if architecture.qkv_bias() && biased {
                    out.push(tensor(format!("{name}.bias"), vec![output]));
                }
            }
        }
        out.push(tensor("model.norm.weight".into(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(tensor("lm_head.weight".into(), vec![v, h]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(model_type: &str, tied: bool) -> ModelShape {
        serde_json::from_value(serde_json::json!({
            "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "model_type": model_type, "tie_word_embeddings": tied
        }))
        .expect("a shape")
    }

    fn named<'a>(tensors: &'a [ExpectedTensor], name: &str) -> Option<&'a [u64]> {
        tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.shape.as_slice())
    }

    #[test]
    fn each_family_names_its_own_tensors() {
        let llama = shape("llama", false).expected_tensors();
        // Embedding, 2 × (2 norms + 7 projections), final norm, head.
        assert_eq!(llama.len(), 1 + 2 * 9 + 2);
        let q = named(&llama, "model.layers.1.self_attn.q_proj.weight");
        assert_eq!(q, Some(&[64, 64][..]));
        let k = named(&llama, "model.layers.0.self_attn.k_proj.weight");
        assert_eq!(k, Some(&[32, 64][..]));
        let down = named(&llama, "model.layers.0.mlp.down_proj.weight");
        assert_eq!(down, Some(&[64, 172][..]));
        assert_eq!(named(&llama, "lm_head.weight"), Some(&[256, 64][..]));
        let tied = shape("llama", true).expected_tensors();
        assert_eq!(named(&tied, "lm_head.weight"), None);

        let qwen2 = shape("qwen2", true).expected_tensors();
        let bias = named(&qwen2, "model.layers.0.self_attn.v_proj.bias");
        assert_eq!(bias, Some(&[32][..]));
        assert_eq!(named(&qwen2, "model.layers.0.self_attn.o_proj.bias"), None);

        let gemma3 = shape("gemma3_text", true).expected_tensors();
        for name in [
            "model.layers.1.pre_feedforward_layernorm.weight",
            "model.layers.1.post_feedforward_layernorm.weight",
        ] {
            assert_eq!(named(&gemma3, name), Some(&[64][..]), "{name}");
        }
        let k_norm = named(&gemma3, "model.layers.1.self_attn.k_norm.weight");
        assert_eq!(k_norm, Some(&[16][..]));

        let phi3 = shape("phi3", false).expected_tensors();
        let qkv = named(&phi3, "model.layers.0.self_attn.qkv_proj.weight");
        assert_eq!(qkv, Some(&[128, 64][..]));
        let gate_up = named(&phi3, "model.layers.0.mlp.gate_up_proj.weight");
        assert_eq!(gate_up, Some(&[344, 64][..]));
        assert_eq!(named(&phi3, "model.layers.0.self_attn.q_proj.weight"), None);
    }
}
