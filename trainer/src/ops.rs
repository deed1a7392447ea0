//! Differentiable building blocks with hand-written backward passes.
//!
//! candle's autograd computes (and keeps) gradients for every operand of a matmul or a
//! binary op, frozen or not, and its fast fused kernels (RMSNorm, RoPE, softmax) have no
//! backward at all. Each op here computes its forward on *detached* inputs with the
//! fastest kernel available, then re-attaches the result to the graph through
//! [`attach`], whose backward is a closure that returns only the input gradient.
//! That saves one GEMM per frozen linear, never stores gradients of frozen weights, and
//! keeps one tensor alive per op instead of the three or four a composed op would.
//!
//! Every formula is checked against PyTorch (tests/reference) and, in this module's
//! tests, against candle's composed ops and finite differences.

use candle_core::{CpuStorage, CustomOp1, D, DType, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

type Backward = Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync>;

/// Hands back a precomputed result in the forward pass and runs `bwd(arg, res, grad)`
/// in the backward pass.
struct Attached {
    name: &'static str,
    result: Mutex<Option<Tensor>>,
    bwd: Backward,
}

impl Attached {
    fn take(&self) -> Result<Tensor> {
        self.result
            .lock()
            .map_err(|_| candle_core::Error::Msg("attached result lock poisoned".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))
    }
}

impl CustomOp1 for Attached {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _storage: &CpuStorage, _layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = self.take()?;
        let shape = y.shape().clone();
        let (storage, layout) = y.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(candle_core::Error::Msg(format!(
                "{}: result not on the cpu",
                self.name
            )));
        };
        // `attach` made the result contiguous; a zero offset means the whole buffer is ours.
        if layout.start_offset() != 0
            || !layout.is_contiguous()
            || storage_len(cpu) != shape.elem_count()
        {
            return Err(candle_core::Error::Msg(format!(
                "{}: result is not a dense tensor",
                self.name
            )));
        }
        Ok((cpu.clone(), shape))
    }

    // Compiled in every build (candle's dummy CUDA backend has the same API), so the GPU
    // path is type-checked even where CUDA cannot be built.
    fn cuda_fwd(
        &self,
        _storage: &candle_core::CudaStorage,
        _layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let y = self.take()?;
        let shape = y.shape().clone();
        let (storage, layout) = y.storage_and_layout();
        let candle_core::Storage::Cuda(cuda) = &*storage else {
            return Err(candle_core::Error::Msg(format!(
                "{}: result not on the gpu",
                self.name
            )));
        };
        Ok((cuda.try_clone(layout)?, shape))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((self.bwd)(arg, res, grad_res)?))
    }
}

fn storage_len(s: &CpuStorage) -> usize {
    match s {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::U32(v) => v.len(),
        CpuStorage::I64(v) => v.len(),
        CpuStorage::U8(v) => v.len(),
        _ => usize::MAX,
    }
}

/// Makes `result` (computed from `x.detach()`) a differentiable function of `x` whose
/// input gradient is `bwd(x, result, grad_result)`. When `x` is not part of a graph the
/// result is returned as is.
pub fn attach(
    x: &Tensor,
    result: Tensor,
    name: &'static str,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !x.track_op() {
        return Ok(result);
    }
    let result = result.contiguous()?;
    // A contiguous tensor may still be a view at an offset into a larger buffer; copy it then.
    let result = if result.storage_and_layout().1.start_offset() != 0 {
        result.copy()?
    } else {
        result
    };
    x.apply_op1(Attached {
        name,
        result: Mutex::new(Some(result)),
        bwd: Box::new(bwd),
    })
}

/// `x · Wᵀ` for a frozen `w` of shape (out, in): the backward computes only `dX = dY · W`.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (in_dim, out_dim) = (w.dim(1)?, w.dim(0)?);
    let rows = x.elem_count() / in_dim;
    let y = x.detach().reshape((rows, in_dim))?.matmul(&w.t()?)?;
    let mut out_dims = dims.clone();
    if let Some(last) = out_dims.last_mut() {
        *last = out_dim;
    }
    let y = y.reshape(out_dims)?;
    let w = w.clone();
    attach(x, y, "frozen_linear", move |arg, _res, g| {
        let g2 = g.reshape((rows, out_dim))?;
        g2.matmul(&w)?.reshape(arg.shape())
    })
}

/// RMSNorm over the last dimension with a frozen weight, computed in f32 like Hugging Face
/// (`x · rsqrt(mean(x²) + eps) · w`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.detach().to_dtype(DType::F32)?;
    let inv = xf
        .sqr()?
        .mean_keepdim(D::Minus1)?
        .affine(1.0, eps)?
        .sqrt()?
        .recip()?;
    let w32 = w.to_dtype(DType::F32)?;
    let y = xf
        .broadcast_mul(&inv)?
        .to_dtype(dtype)?
        .broadcast_mul(&w.to_dtype(dtype)?)?;
    attach(x, y, "rms_norm", move |arg, _res, g| {
        // y = x̂·w with x̂ = x·r, r = 1/√(mean(x²)+eps):
        // dx = r · (g·w − x̂ · mean(g·w·x̂))
        let xf = arg.to_dtype(DType::F32)?;
        let xhat = xf.broadcast_mul(&inv)?;
        let gw = g.to_dtype(DType::F32)?.broadcast_mul(&w32)?;
        let dot = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = gw
            .broadcast_sub(&xhat.broadcast_mul(&dot)?)?
            .broadcast_mul(&inv)?;
        dx.to_dtype(arg.dtype())
    })
}

/// Rotary position embedding in Hugging Face's rotate-half layout.
/// `x`: (batch, heads, seq, head_dim); `cos`, `sin`: (seq, rotated / 2), where tables
/// narrower than the head rotate its first `rotated` dims and pass the rest.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (width, rotated) = (x.dim(D::Minus1)?, 2 * cos.dim(D::Minus1)?);
    if rotated < width {
        // A partial rotation (Phi-4-mini's): the first dims turn, the rest pass.
        let turned = rope(&x.narrow(D::Minus1, 0, rotated)?.contiguous()?, cos, sin)?;
        let passed = x.narrow(D::Minus1, rotated, width - rotated)?;
        return Tensor::cat(&[&turned, &passed], D::Minus1);
    }
    let y = candle_nn::rotary_emb::rope(&x.detach().contiguous()?, cos, sin)?;
    let (cos, neg_sin) = (cos.clone(), sin.neg()?);
    attach(x, y, "rope", move |_arg, _res, g| {
        // The rotation is orthogonal: its transpose is the rotation by −θ.
        candle_nn::rotary_emb::rope(&g.contiguous()?, &cos, &neg_sin)
    })
}

/// Softmax over the last dimension of attention scores (batch, heads, q, k) with a causal
/// mask: position q attends to keys 0..=q, or with a sliding `window` to the last
/// `window` of them (q itself included).
pub fn causal_softmax(scores: &Tensor, window: Option<usize>) -> Result<Tensor> {
    let (q_len, k_len) = (scores.dim(D::Minus2)?, scores.dim(D::Minus1)?);
    let mask = causal_mask(q_len, k_len, window, scores.device())?.to_dtype(scores.dtype())?;
    let masked = scores.detach().broadcast_add(&mask)?;
    let y = candle_nn::ops::softmax_last_dim(&masked)?;
    attach(scores, y, "causal_softmax", |_arg, y, g| {
        // dx = y ⊙ (g − Σ g⊙y); masked entries have y = 0 and so get no gradient.
        let dot = (g * y)?.sum_keepdim(D::Minus1)?;
        y * g.broadcast_sub(&dot)?
    })
}

/// Additive causal mask (q_len, k_len): 0 where allowed, −∞ above the diagonal and,
/// with a sliding `window`, as far below it as the window does not reach (key j is
/// seen by query position p when `p − window < j ≤ p`, as transformers' sliding-window
/// mask has it). The queries are the last `q_len` of `k_len` positions.
pub fn causal_mask(
    q_len: usize,
    k_len: usize,
    window: Option<usize>,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let offset = k_len.saturating_sub(q_len);
    let data: Vec<f32> = (0..q_len)
        .flat_map(|i| {
            let position = i + offset;
            (0..k_len).map(move |j| {
                let too_far = window.is_some_and(|w| j + w <= position);
                if j <= position && !too_far {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(data, (q_len, k_len), device)
}

/// Gemma's soft-cap `cap·tanh(x/cap)`, computed as transformers does (divide, tanh,
/// multiply); the backward is `g·(1 − tanh²)`.
pub fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    let squashed = (x.detach() / cap)?.tanh()?;
    let y = (&squashed * cap)?;
    attach(x, y, "softcap", move |_arg, _res, g| {
        let slope = squashed.sqr()?.affine(-1.0, 1.0)?;
        g * slope
    })
}

/// √(2/π), the tanh approximation's constant.
pub(crate) const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic term's coefficient in the tanh approximation.
pub(crate) const GELU_CUBIC: f64 = 0.044_715;

/// GELU in its tanh approximation (PyTorch's `gelu(approximate="tanh")`, Gemma's
/// `gelu_pytorch_tanh`): `x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`. The backward is
/// the exact derivative, computed in f32 from the input.
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    let y = x.detach().gelu()?;
    attach(x, y, "gelu_tanh", |arg, _res, g| {
        let dtype = arg.dtype();
        let x = arg.to_dtype(DType::F32)?;
        let x2 = x.sqr()?;
        let inner = ((&x2 * GELU_CUBIC)? + 1.0)?
            .mul(&x)?
            .affine(SQRT_2_OVER_PI, 0.0)?;
        let t = inner.tanh()?;
        // d/dx = ½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715·x²)
        let d_inner = ((&x2 * (3.0 * GELU_CUBIC))? + 1.0)?.affine(SQRT_2_OVER_PI, 0.0)?;
        let sech2 = t.sqr()?.affine(-1.0, 1.0)?;
        let slope = ((t + 1.0)?.affine(0.5, 0.0)? + (x * 0.5)?.mul(&sech2)?.mul(&d_inner)?)?;
        g.to_dtype(DType::F32)?.mul(&slope)?.to_dtype(dtype)
    })
}

/// Sum of token cross-entropies where `targets[i] >= 0`, divided by `denominator`.
///
/// `logits`: (n, vocab); `targets`: n ids with −100 (any negative) for "no loss".
/// Returns a scalar. The backward is `(softmax − onehot) · mask / denominator`, computed
/// without keeping log-probabilities alive between forward and backward.
pub fn masked_cross_entropy(logits: &Tensor, targets: &[i64], denominator: f64) -> Result<Tensor> {
    let weights = vec![(1.0 / denominator) as f32; targets.len()];
    weighted_cross_entropy(logits, targets, weights)
}

/// The target ids of `targets` for `logits` (n, vocab), 0 where there is no target, as
/// an (n, 1) tensor; an error when the lengths differ or an id is outside the vocabulary.
fn target_ids(logits: &Tensor, targets: &[i64]) -> Result<Tensor> {
    let (n, vocab) = logits.dims2()?;
    if targets.len() != n {
        return Err(candle_core::Error::Msg(format!(
            "{} targets for {n} logits rows",
            targets.len()
        )));
    }
    let ids: Vec<u32> = targets
        .iter()
        .map(|&t| if t >= 0 { t as u32 } else { 0 })
        .collect();
    if ids.iter().any(|&t| t as usize >= vocab) {
        return Err(candle_core::Error::Msg(
            "target id outside the vocabulary".into(),
        ));
    }
    Tensor::from_vec(ids, (n, 1), logits.device())
}

/// Every row's cross-entropy `−log softmax(logits)[target]`, 0 where the target is
/// negative, without a graph: what a preference loss sums per sequence.
pub fn token_losses(logits: &Tensor, targets: &[i64]) -> Result<Vec<f64>> {
    let ids = target_ids(logits, targets)?;
    let lf = logits.detach().to_dtype(DType::F32)?;
    let lsm = candle_nn::ops::log_softmax(&lf, D::Minus1)?;
    let nll = lsm
        .gather(&ids, 1)?
        .neg()?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(nll
        .into_iter()
        .zip(targets)
        .map(|(l, &t)| if t >= 0 { f64::from(l) } else { 0.0 })
        .collect())
}

/// How many rows of `logits` (n, vocab) whose target is not negative have it as their
/// largest logit: token accuracy's numerator, without a graph.
pub fn top1_hits(logits: &Tensor, targets: &[i64]) -> Result<u64> {
    let ids = target_ids(logits, targets)?;
    let lf = logits.detach().to_dtype(DType::F32)?;
    let best = lf.max_keepdim(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
    let target = lf.gather(&ids, 1)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(targets
        .iter()
        .zip(best.iter().zip(&target))
        .filter(|&(&t, (&best, &target))| t >= 0 && target >= best)
        .count() as u64)
}

/// `Σ weights[i]·CE_i` over the rows whose target is not negative (see
/// [`masked_cross_entropy`], whose weights are all 1/denominator). The backward is
/// `(softmax − onehot)·weight` per row.
pub fn weighted_cross_entropy(
    logits: &Tensor,
    targets: &[i64],
    weights: Vec<f32>,
) -> Result<Tensor> {
    let n = targets.len();
    if weights.len() != n {
        return Err(candle_core::Error::Msg(format!(
            "{} weights for {n} targets",
            weights.len()
        )));
    }
    let ids = target_ids(logits, targets)?;
    let weights: Vec<f32> = weights
        .into_iter()
        .zip(targets)
        .map(|(w, &t)| if t >= 0 { w } else { 0.0 })
        .collect();
    let weights = Tensor::from_vec(weights, (n, 1), logits.device())?;
    let lf = logits.detach().to_dtype(DType::F32)?;
    let lsm = candle_nn::ops::log_softmax(&lf, D::Minus1)?;
    let nll = lsm.gather(&ids, 1)?.neg()?;
    let loss = (nll * &weights)?.sum_all()?;
    drop(lsm);
    attach(logits, loss, "masked_cross_entropy", move |arg, _res, g| {
        let probs = candle_nn::ops::softmax_last_dim(&arg.to_dtype(DType::F32)?)?;
        let row_w = weights.broadcast_mul(g)?;
        let onehot = probs.zeros_like()?.scatter_add(&ids, &row_w, 1)?;
        probs
            .broadcast_mul(&row_w)?
            .sub(&onehot)?
            .to_dtype(arg.dtype())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor")
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .expect("sub")
            .abs()
            .expect("abs")
            .flatten_all()
            .expect("flat")
            .max(0)
            .expect("max")
            .to_scalar()
            .expect("s")
    }

    /// Gradient of sum(f(x) ⊙ probe) with respect to x, via candle's backward.
    fn grad_of(f: impl Fn(&Tensor) -> Result<Tensor>, x: &Tensor, probe: &Tensor) -> Tensor {
        let v = Var::from_tensor(x).expect("var");
        let y = f(v.as_tensor()).expect("fwd");
        let grads = (y * probe)
            .expect("mul")
            .sum_all()
            .expect("sum")
            .backward()
            .expect("bwd");
        grads.get(v.as_tensor()).expect("grad present").clone()
    }

    #[test]
    fn frozen_linear_matches_matmul_and_its_gradient() {
        let x = rand(&[2, 5, 8], 1);
        let w = rand(&[6, 8], 2);
        let probe = rand(&[2, 5, 6], 3);
        let composed = |x: &Tensor| x.broadcast_matmul(&w.t()?);
        assert!(
            max_diff(
                &frozen_linear(&x, &w).expect("fwd"),
                &composed(&x).expect("fwd")
            ) < 1e-6
        );
        let g1 = grad_of(|x| frozen_linear(x, &w), &x, &probe);
        let g2 = grad_of(composed, &x, &probe);
        assert!(max_diff(&g1, &g2) < 1e-5);
    }

    #[test]
    fn rms_norm_matches_composed_op_and_gradient() {
        let x = rand(&[2, 3, 16], 4);
        let w = rand(&[16], 5);
        let probe = rand(&[2, 3, 16], 6);
        let composed = |x: &Tensor| {
            let inv = x
                .sqr()?
                .mean_keepdim(D::Minus1)?
                .affine(1.0, 1e-5)?
                .sqrt()?
                .recip()?;
            x.broadcast_mul(&inv)?.broadcast_mul(&w)
        };
        assert!(
            max_diff(
                &rms_norm(&x, &w, 1e-5).expect("fwd"),
                &composed(&x).expect("fwd")
            ) < 1e-5
        );
        let g1 = grad_of(|x| rms_norm(x, &w, 1e-5), &x, &probe);
        let g2 = grad_of(composed, &x, &probe);
        assert!(max_diff(&g1, &g2) < 1e-5, "{}", max_diff(&g1, &g2));
    }

    #[test]
    fn rope_gradient_is_the_inverse_rotation() {
        let x = rand(&[1, 2, 4, 8], 7);
        let cos = rand(&[4, 4], 8);
        let sin = rand(&[4, 4], 9);
        let probe = rand(&[1, 2, 4, 8], 10);
        let g1 = grad_of(|x| rope(x, &cos, &sin), &x, &probe);
        let g2 = grad_of(
            |x| candle_nn::rotary_emb::rope_slow(x, &cos, &sin),
            &x,
            &probe,
        );
        assert!(max_diff(&g1, &g2) < 1e-5);
    }

    #[test]
    fn causal_softmax_matches_masked_softmax() {
        let s = rand(&[1, 2, 5, 5], 11);
        let probe = rand(&[1, 2, 5, 5], 12);
        for window in [None, Some(2), Some(5)] {
            let composed = |s: &Tensor| {
                let m = causal_mask(5, 5, window, &Device::Cpu)?;
                candle_nn::ops::softmax(&s.broadcast_add(&m)?, D::Minus1)
            };
            assert!(
                max_diff(
                    &causal_softmax(&s, window).expect("fwd"),
                    &composed(&s).expect("fwd")
                ) < 1e-6
            );
            let g1 = grad_of(|s| causal_softmax(s, window), &s, &probe);
            let g2 = grad_of(composed, &s, &probe);
            assert!(max_diff(&g1, &g2) < 1e-5);
        }
    }

    #[test]
    fn a_sliding_window_sees_the_last_positions_itself_included() {
        let allowed = |q: usize, k: usize, window| -> Vec<Vec<bool>> {
            causal_mask(q, k, window, &Device::Cpu)
                .expect("mask")
                .to_vec2::<f32>()
                .expect("rows")
                .into_iter()
                .map(|row| row.into_iter().map(|m| m == 0.0).collect())
                .collect()
        };
        let (o, x) = (true, false);
        assert_eq!(
            allowed(4, 4, Some(2)),
            [[o, x, x, x], [o, o, x, x], [x, o, o, x], [x, x, o, o]]
        );
        // Two queries continuing a cache of three: positions 3 and 4.
        assert_eq!(allowed(2, 5, Some(3)), [[x, o, o, o, x], [x, x, o, o, o]]);
        assert_eq!(allowed(2, 5, None), [[o, o, o, o, x], [o, o, o, o, o]]);
    }

    #[test]
    fn softcap_and_tanh_gelu_match_their_formulas_and_finite_differences() {
        let x = rand(&[3, 7], 21).affine(6.0, 0.0).expect("wide");
        let probe = rand(&[3, 7], 22);
        let values = x.flatten_all().expect("flat").to_vec1::<f32>().expect("v");
        let gelu =
            |v: f64| 0.5 * v * (1.0 + (SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v * v)).tanh());
        let capped = |v: f64| 5.0 * (v / 5.0).tanh();
        type Op = fn(&Tensor) -> Result<Tensor>;
        let cases: [(Op, &dyn Fn(f64) -> f64); 2] =
            [(|x| softcap(x, 5.0), &capped), (gelu_tanh, &gelu)];
        for (op, formula) in cases {
            let got = op(&x)
                .expect("fwd")
                .flatten_all()
                .expect("f")
                .to_vec1::<f32>()
                .expect("v");
            for (g, v) in got.iter().zip(&values) {
                assert!(
                    (f64::from(*g) - formula(f64::from(*v))).abs() < 1e-5,
                    "{v}: {g}"
                );
            }
            let grads = grad_of(op, &x, &probe)
                .flatten_all()
                .expect("f")
                .to_vec1::<f32>()
                .expect("g");
            let probes = probe.flatten_all().expect("f").to_vec1::<f32>().expect("p");
            for ((g, v), p) in grads.iter().zip(&values).zip(&probes) {
                let v = f64::from(*v);
                let slope = (formula(v + 1e-4) - formula(v - 1e-4)) / 2e-4;
                assert!(
                    (f64::from(*g) - slope * f64::from(*p)).abs() < 1e-4,
                    "{v}: {g} vs {}",
                    slope * f64::from(*p)
                );
            }
        }
    }

    #[test]
    fn masked_cross_entropy_matches_log_softmax_and_finite_differences() {
        let logits = rand(&[4, 7], 13);
        let targets = [3i64, -100, 6, 0];
        let loss = masked_cross_entropy(&logits, &targets, 3.0).expect("loss");
        let lsm = candle_nn::ops::log_softmax(&logits, D::Minus1)
            .expect("lsm")
            .to_vec2::<f32>()
            .expect("vec");
        let want = -(lsm[0][3] + lsm[2][6] + lsm[3][0]) / 3.0;
        let got: f32 = loss.to_scalar().expect("scalar");
        assert!((got - want).abs() < 1e-6);
        let probe = Tensor::new(1f32, &Device::Cpu).expect("probe");
        let g = grad_of(|l| masked_cross_entropy(l, &targets, 3.0), &logits, &probe);
        let base = logits.to_vec2::<f32>().expect("vec");
        let eps = 1e-2f32;
        for (r, c) in [(0usize, 3usize), (0, 1), (1, 2), (2, 6), (3, 5)] {
            let bump = |d: f32| {
                let mut v = base.clone();
                v[r][c] += d;
                let t = Tensor::new(v, &Device::Cpu).expect("t");
                masked_cross_entropy(&t, &targets, 3.0)
                    .expect("l")
                    .to_scalar::<f32>()
                    .expect("s")
            };
            let fd = (bump(eps) - bump(-eps)) / (2.0 * eps);
            let an = g.to_vec2::<f32>().expect("g")[r][c];
            assert!(
                (fd - an).abs() < 1e-3,
                "({r},{c}): fd {fd} vs analytic {an}"
            );
        }
    }
}
