//! What computed a run: the path through the trainer, the GEMM library and the CPU
//! features its kernels dispatch on. Each of these can change the rounding of a step,
//! so a checkpoint records them beside the thread count, and a resume on a different
//! machine or build warns that it will not be bit-identical.

use crate::fast::ComputePath;
use crate::model::Llama;
use serde::{Deserialize, Serialize};

/// The compute environment of a run, as recorded in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeEnv {
    /// `cpu-fused` (the kernels of `tuneq-kernels`), `cpu-fused-bf16` (the same with
    /// bf16 compute of the frozen projections), `candle-graph-cpu` or
    /// `candle-graph-cuda` (candle's autograd).
    pub path: String,
    /// The GEMM library the path multiplies with.
    pub gemm: String,
    /// The SIMD features of this CPU that GEMM and elementwise kernels choose between.
    pub cpu_features: Vec<String>,
    /// The fused step's arithmetic ([`tuneq_kernels::llama::STEP_ARITHMETIC`]) on the
    /// fused paths, empty on candle's graph. Empty in checkpoints written before it was
    /// recorded, so a resume from one of those warns too.
    #[serde(default)]
    pub step: String,
}

impl ComputeEnv {
    /// The environment a step of `model` uses in this build on this machine.
    pub fn detect(model: &Llama) -> Self {
        let (path, gemm) = match (ComputePath::for_model(model), model.device().is_cpu()) {
            (ComputePath::CpuFused, _)
                if model.cpu_compute == tuneq_kernels::llama::Compute::Bf16 =>
            {
                ("cpu-fused-bf16", tuneq_kernels::bf16_backend())
            }
            (ComputePath::CpuFused, _) => ("cpu-fused", tuneq_kernels::backend()),
            (ComputePath::Graph, true) => ("candle-graph-cpu", "gemm-0.19 (candle)"),
            (ComputePath::Graph, false) => ("candle-graph-cuda", "cublas (candle)"),
        };
        let step = match ComputePath::for_model(model) {
            ComputePath::CpuFused => tuneq_kernels::llama::STEP_ARITHMETIC,
            ComputePath::Graph => "",
        };
        Self {
            path: path.into(),
            gemm: gemm.into(),
            cpu_features: cpu_features(),
            step: step.into(),
        }
    }

    /// A sentence naming what differs from `other`, or `None` when nothing does.
    pub fn difference(&self, other: &ComputeEnv) -> Option<String> {
        let mut parts = Vec::new();
        if self.path != other.path {
            parts.push(format!("compute path {} → {}", other.path, self.path));
        }
        if self.step != other.step {
            let name = |s: &str| {
                if s.is_empty() {
                    "unrecorded".to_string()
                } else {
                    s.to_string()
                }
            };
            parts.push(format!(
                "fused step {} → {}",
                name(&other.step),
                name(&self.step)
            ));
        }
        if self.gemm != other.gemm {
            parts.push(format!("GEMM {} → {}", other.gemm, self.gemm));
        }
        if self.cpu_features != other.cpu_features {
            parts.push(format!(
                "CPU features [{}] → [{}]",
                other.cpu_features.join(" "),
                self.cpu_features.join(" ")
            ));
        }
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

/// The dispatch-relevant SIMD features this CPU has, in a fixed order.
fn cpu_features() -> Vec<String> {
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        let features = [
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            ("avx512bw", std::arch::is_x86_feature_detected!("avx512bw")),
            ("avx512vl", std::arch::is_x86_feature_detected!("avx512vl")),
            (
                "avx512bf16",
                std::arch::is_x86_feature_detected!("avx512bf16"),
            ),
        ];
        found.extend(
            features
                .iter()
                .filter(|(_, on)| *on)
                .map(|(n, _)| n.to_string()),
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            found.push("neon".to_string());
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_of_any_part_is_named() {
        let here = ComputeEnv {
            path: "cpu-fused".into(),
            gemm: "matrixmultiply-0.3".into(),
            cpu_features: cpu_features(),
            step: tuneq_kernels::llama::STEP_ARITHMETIC.into(),
        };
        assert_eq!(here.difference(&here), None);
        let mut other = here.clone();
        other.cpu_features = vec!["avx2".into()];
        other.gemm = "openblas".into();
        let said = here.difference(&other).expect("a difference");
        assert!(
            said.contains("GEMM openblas") && said.contains("CPU features [avx2]"),
            "{said}"
        );
        // A checkpoint from before the step's arithmetic was recorded.
        let old: ComputeEnv = serde_json::from_str(
            r#"{"path": "cpu-fused", "gemm": "matrixmultiply-0.3", "cpu_features": []}"#,
        )
        .expect("an older record still reads");
        let said = here.difference(&old).expect("a difference");
        assert!(said.contains("fused step unrecorded → "), "{said}");
    }
}
