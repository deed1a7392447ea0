//! AdamW with state that can be saved and restored exactly.
//!
//! candle-nn's AdamW hides its moments and step count, so a resumed run could not
//! continue the same trajectory. This one keeps them in the open, applies PyTorch's
//! update (`torch.optim.AdamW`, decoupled weight decay, bias correction), and folds the
//! gradient-clipping factor into the step.

use crate::error::{Error, Result};
use crate::model::NamedVar;
use candle_core::{Device, Tensor};
use std::collections::{BTreeMap, HashMap};

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The optimiser: one (m, v) pair per trainable tensor, and the step count.
pub struct AdamW {
    cfg: AdamWConfig,
    params: Vec<NamedVar>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    step: u64,
}

impl AdamW {
    /// Fresh state (zero moments, step 0) for `params`.
    pub fn new(params: Vec<NamedVar>, cfg: AdamWConfig) -> Result<Self> {
        let exp_avg = params
            .iter()
            .map(|p| p.var.as_tensor().zeros_like())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let exp_avg_sq = exp_avg.clone();
        Ok(Self {
            cfg,
            params,
            exp_avg,
            exp_avg_sq,
            step: 0,
        })
    }

    /// Optimiser steps taken (the bias-correction `t`).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The trainable tensors, in order.
    pub fn params(&self) -> &[NamedVar] {
        &self.params
    }

    /// One update with learning rate `lr`; every gradient is multiplied by `grad_scale`
    /// first (the clipping factor). `grads[i]` belongs to `params[i]`.
    pub fn step(&mut self, grads: &[Tensor], lr: f64, grad_scale: f64) -> Result<()> {
        let c = self.cfg;
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        let step_size = lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        for (i, p) in self.params.iter().enumerate() {
            let g = grads[i].affine(grad_scale, 0.0)?;
            let m = ((&self.exp_avg[i] * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            let v = ((&self.exp_avg_sq[i] * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let theta = p.var.as_tensor();
            let theta = if c.weight_decay != 0.0 {
                (theta * (1.0 - lr * c.weight_decay))?
            } else {
                theta.clone()
            };
            let denom = ((v.sqrt()? / bc2_sqrt)? + c.eps)?;
            let update = ((&m / denom)? * step_size)?;
            p.var.set(&(theta - update)?)?;
            self.exp_avg[i] = m;
            self.exp_avg_sq[i] = v;
        }
        Ok(())
    }

    /// The moments as `exp_avg.<name>` / `exp_avg_sq.<name>` tensors (f32).
    pub fn state_tensors(&self) -> BTreeMap<String, Tensor> {
        let mut out = BTreeMap::new();
        for (i, p) in self.params.iter().enumerate() {
            out.insert(format!("exp_avg.{}", p.name), self.exp_avg[i].clone());
            out.insert(format!("exp_avg_sq.{}", p.name), self.exp_avg_sq[i].clone());
        }
        out
    }

    /// Restores moments saved by [`Self::state_tensors`] and the step count.
    pub fn restore(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        step: u64,
        device: &Device,
        source: &str,
    ) -> Result<()> {
        for (i, p) in self.params.iter().enumerate() {
            for (prefix, slot) in [
                ("exp_avg", &mut self.exp_avg[i]),
                ("exp_avg_sq", &mut self.exp_avg_sq[i]),
            ] {
                let key = format!("{prefix}.{}", p.name);
                let t = tensors.get(&key).ok_or_else(|| Error::Checkpoint {
                    path: source.to_string(),
                    message: format!("optimiser tensor {key} is missing"),
                })?;
                if t.dims() != p.var.dims() {
                    return Err(Error::Checkpoint {
                        path: source.to_string(),
                        message: format!("{key} has the wrong shape"),
                    });
                }
                *slot = t.to_device(device)?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// The global L2 norm of `grads`, computed in f64 over f32 values for stability.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let mut sum = 0f64;
    for g in grads {
        let s: f32 = g.sqr()?.sum_all()?.to_scalar()?;
        sum += s as f64;
    }
    Ok(sum.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn matches_a_hand_computed_pytorch_step() -> Result<()> {
        // torch.optim.AdamW([p], lr=0.1, weight_decay=0.01), p=[1,-2], grad=[0.5,0.25]:
        // after one step p = [1·(1-0.001) - 0.1, -2·(1-0.001) - 0.1] = [0.899, -2.098]
        let var = Var::new(&[1f32, -2.0], &Device::Cpu)?;
        let mut opt = AdamW::new(
            vec![NamedVar {
                name: "p".into(),
                var: var.clone(),
            }],
            AdamWConfig {
                weight_decay: 0.01,
                ..Default::default()
            },
        )?;
        opt.step(&[Tensor::new(&[0.5f32, 0.25], &Device::Cpu)?], 0.1, 1.0)?;
        let got = var.as_tensor().to_vec1::<f32>()?;
        assert!(
            (got[0] - 0.899).abs() < 1e-6 && (got[1] + 2.098).abs() < 1e-6,
            "{got:?}"
        );
        Ok(())
    }
}
