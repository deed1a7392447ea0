use super::memory::packed_mask_bytes;
use super::*;
use rand::{Rng, SeedableRng};

fn random(n: usize, rng: &mut rand_chacha::ChaCha8Rng, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A model's tensors, owned; [`Owned::view`] lends them as a [`Model`].
struct Owned {
    dims: Dims,
    embed: Vec<f32>,
    norms: Vec<[Vec<f32>; 2]>,
    weights: Vec<[Vec<f32>; 7]>,
    /// LoRA tensors in gradient order (layer, projection, A then B).
    lora: Vec<Vec<f32>>,
    /// Per layer, which projections carry LoRA.
    targets: Vec<[bool; 7]>,
    r: usize,
    lora_scale: f32,
    norm: Vec<f32>,
    lm_head: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

fn tiny_dims() -> Dims {
    Dims {
        vocab: 61,
        hidden: 16,
        intermediate: 24,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        rms_eps: 1e-5,
    }
}

/// HF's rotate-half tables, angle(p, i) = p / 10000^(2i/d).
fn rope_tables(max_pos: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let (mut cos, mut sin) = (vec![], vec![]);
    for p in 0..max_pos {
        for i in 0..half {
            let angle = p as f64 / 10_000f64.powf(2.0 * i as f64 / head_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

impl Owned {
    fn random(dims: Dims, targets: &[[bool; 7]], r: usize, seed: u64) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (v, h) = (dims.vocab, dims.hidden);
        let embed = random(v * h, &mut rng, -1.0, 1.0);
        let mut norms = vec![];
        let mut weights = vec![];
        let mut lora = vec![];
        for targets in targets.iter().cycle().take(dims.layers) {
            norms.push([random(h, &mut rng, 0.5, 1.5), random(h, &mut rng, 0.5, 1.5)]);
            let w: [Vec<f32>; 7] = std::array::from_fn(|p| {
                let (i, o) = dims.projection_shape(p);
                let bound = 1.0 / (i as f32).sqrt();
                random(o * i, &mut rng, -bound, bound)
            });
            weights.push(w);
            for (p, &t) in targets.iter().enumerate() {
                if t {
                    let (i, o) = dims.projection_shape(p);
                    let bound = 1.0 / (i as f32).sqrt();
                    lora.push(random(r * i, &mut rng, -bound, bound));
                    // B non-zero, so that A gets a gradient too.
                    lora.push(random(o * r, &mut rng, -0.3, 0.3));
                }
            }
        }
        let norm = random(h, &mut rng, 0.5, 1.5);
        let bound = 1.0 / (h as f32).sqrt();
        let lm_head = random(v * h, &mut rng, -4.0 * bound, 4.0 * bound);
        let (cos, sin) = rope_tables(128, dims.head_dim);
        Self {
            dims,
            embed,
            norms,
            weights,
            lora,
            targets: targets.iter().cycle().take(dims.layers).copied().collect(),
            r,
            lora_scale: 1.5,
            norm,
            lm_head,
            cos,
            sin,
        }
    }

    fn view(&self) -> Model<'_> {
        let mut next = 0;
        let layers = (0..self.dims.layers)
            .map(|l| Layer {
                input_norm: &self.norms[l][0],
                post_norm: &self.norms[l][1],
                proj: std::array::from_fn(|p| Projection {
                    weight: &self.weights[l][p],
                    lora: self.targets[l][p].then(|| {
                        next += 2;
                        Lora {
                            a: &self.lora[next - 2],
                            b: &self.lora[next - 1],
                            r: self.r,
                            scale: self.lora_scale,
                        }
                    }),
                }),
            })
            .collect();
        Model {
            dims: self.dims,
            embed: &self.embed,
            layers,
            norm: &self.norm,
            lm_head: &self.lm_head,
            cos: &self.cos,
            sin: &self.sin,
        }
    }

    fn zero_grads(&self) -> Vec<Vec<f32>> {
        self.lora.iter().map(|t| vec![0.0; t.len()]).collect()
    }

    fn lora64(&self) -> Vec<Vec<f64>> {
        self.lora.iter().map(|t| widen(t)).collect()
    }
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// A batch's buffers, owned.
struct OwnedBatch {
    ids: Vec<u32>,
    rows: usize,
    len: usize,
    targets: Vec<i64>,
    positions: Vec<u32>,
    starts: Vec<u32>,
}

impl OwnedBatch {
    fn view(&self) -> Batch<'_> {
        Batch {
            ids: &self.ids,
            rows: self.rows,
            len: self.len,
            targets: &self.targets,
            positions: &self.positions,
            starts: &self.starts,
        }
    }

    fn labelled(&self) -> usize {
        self.targets.iter().filter(|&&t| t >= 0).count()
    }
}

/// Two rows of 9: row 0 packs two examples (4 and 5 tokens; positions restart, the
/// second segment starts at column 4), row 1 holds 6 tokens right-padded with 3 pads
/// (id 0, no target). A few real tokens are unlabelled too (the prompt, say).
fn tiny_batch(vocab: usize, seed: u64) -> OwnedBatch {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (rows, len) = (2, 9);
    let ids: Vec<u32> = (0..rows * len)
        .map(|i| {
            if i >= len + 6 {
                0
            } else {
                rng.random_range(0..vocab as u32)
            }
        })
        .collect();
    let mut targets: Vec<i64> = (0..rows * len)
        .map(|_| rng.random_range(0..vocab as i64))
        .collect();
    for i in [0, 3, 4, len, len + 5, len + 6, len + 7, len + 8] {
        targets[i] = -100;
    }
    let positions = [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8].to_vec();
    let starts = [0, 0, 0, 0, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0].to_vec();
    OwnedBatch {
        ids,
        rows,
        len,
        targets,
        positions,
        starts,
    }
}

/// The model in f64 with plain loops, from the definitions (HF's Llama with PEFT's
/// LoRA): `lora` replaces the model's LoRA tensors (gradient order), `masks` are the
/// dropout masks in forward order (empty: no dropout).
fn reference_loss(
    m: &Owned,
    lora: &[Vec<f64>],
    batch: &OwnedBatch,
    scale: f64,
    masks: &[Vec<f32>],
) -> f64 {
    let d = m.dims;
    let (h, n, hd) = (d.hidden, batch.rows * batch.len, d.head_dim);
    let (nh, nkv) = (d.heads, d.kv_heads);
    let eps = d.rms_eps as f64;
    let rms_norm = |x: &[f64], w: &[f32]| -> Vec<f64> {
        let mut y = vec![0.0; x.len()];
        for (row, out) in x.chunks(h).zip(y.chunks_mut(h)) {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / h as f64;
            let r = 1.0 / (ms + eps).sqrt();
            for j in 0..h {
                out[j] = row[j] * r * w[j] as f64;
            }
        }
        y
    };
    let mut next_lora = 0;
    let mut next_mask = 0;
    // x (n × in) → n × out, with W, and LoRA when the projection has it.
    let mut linear = |x: &[f64], l: usize, p: usize| -> Vec<f64> {
        let (i, o) = d.projection_shape(p);
        let w = &m.weights[l][p];
        let mut y = vec![0.0; n * o];
        for t in 0..n {
            for c in 0..o {
                y[t * o + c] = (0..i).map(|k| x[t * i + k] * w[c * i + k] as f64).sum();
            }
        }
        if m.targets[l][p] {
            let (a, b) = (&lora[next_lora], &lora[next_lora + 1]);
            next_lora += 2;
            let mut xd = x.to_vec();
            if !masks.is_empty() {
                for (v, &k) in xd.iter_mut().zip(&masks[next_mask]) {
                    *v *= k as f64;
                }
                next_mask += 1;
            }
            let r = m.r;
            for t in 0..n {
                let u: Vec<f64> = (0..r)
                    .map(|q| (0..i).map(|k| xd[t * i + k] * a[q * i + k]).sum())
                    .collect();
                for c in 0..o {
                    let delta: f64 = (0..r).map(|q| u[q] * b[c * r + q]).sum();
                    y[t * o + c] += m.lora_scale as f64 * delta;
                }
            }
        }
        y
    };
    let rope = |x: &mut [f64], heads: usize| {
        let half = hd / 2;
        for t in 0..n {
            let pos = batch.positions[t] as usize;
            for head in 0..heads {
                let v = &mut x[(t * heads + head) * hd..][..hd];
                let old = v.to_vec();
                for j in 0..hd {
                    let c = m.cos[pos * half + j % half] as f64;
                    let s = m.sin[pos * half + j % half] as f64;
                    let rotated = if j < half {
                        -old[j + half]
                    } else {
                        old[j - half]
                    };
                    v[j] = old[j] * c + rotated * s;
                }
            }
        }
    };
    let mut x: Vec<f64> = batch
        .ids
        .iter()
        .flat_map(|&id| widen(&m.embed[id as usize * h..][..h]))
        .collect();
    for l in 0..d.layers {
        let hn = rms_norm(&x, &m.norms[l][0]);
        let mut q = linear(&hn, l, Q);
        let mut k = linear(&hn, l, K);
        let v = linear(&hn, l, V);
        rope(&mut q, nh);
        rope(&mut k, nkv);
        let mut attn = vec![0.0; n * nh * hd];
        for t in 0..n {
            let (row, col) = (t / batch.len, t % batch.len);
            for head in 0..nh {
                let g = head / (nh / nkv);
                let keys: Vec<usize> = (batch.starts[t] as usize..=col)
                    .map(|j| row * batch.len + j)
                    .collect();
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&u| {
                        (0..hd)
                            .map(|c| q[(t * nh + head) * hd + c] * k[(u * nkv + g) * hd + c])
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
                for c in 0..hd {
                    attn[(t * nh + head) * hd + c] = keys
                        .iter()
                        .zip(&s)
                        .map(|(&u, x)| (x - max).exp() / sum * v[(u * nkv + g) * hd + c])
                        .sum();
                }
            }
        }
        let o = linear(&attn, l, O);
        x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        let hn = rms_norm(&x, &m.norms[l][1]);
        let gate = linear(&hn, l, GATE);
        let up = linear(&hn, l, UP);
        let act: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let down = linear(&act, l, DOWN);
        x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
    }
    let hf = rms_norm(&x, &m.norm);
    let mut total = 0.0;
    for t in 0..n {
        let Ok(target) = usize::try_from(batch.targets[t]) else {
            continue;
        };
        let logits: Vec<f64> = (0..d.vocab)
            .map(|v| {
                (0..h)
                    .map(|j| hf[t * h + j] * m.lm_head[v * h + j] as f64)
                    .sum()
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        total += lse - logits[target];
    }
    total * scale
}

const ALL: [bool; 7] = [true; 7];
const QV: [bool; 7] = [true, false, true, false, false, false, false];
const NONE: [bool; 7] = [false; 7];

/// Central differences of the f64 reference loss for every LoRA parameter, in
/// gradient order.
fn finite_differences(m: &Owned, b: &OwnedBatch, scale: f64, masks: &[Vec<f32>]) -> Vec<Vec<f64>> {
    let base = m.lora64();
    let step = 1e-5;
    (0..base.len())
        .map(|t| {
            (0..base[t].len())
                .map(|e| {
                    let mut lora = base.clone();
                    lora[t][e] = base[t][e] + step;
                    let plus = reference_loss(m, &lora, b, scale, masks);
                    lora[t][e] = base[t][e] - step;
                    let minus = reference_loss(m, &lora, b, scale, masks);
                    (plus - minus) / (2.0 * step)
                })
                .collect()
        })
        .collect()
}

/// Checks the step's loss against the reference and every gradient tensor against
/// finite differences, within 1e-4 of the tensor's largest |gradient|; returns the
/// worst loss and gradient errors.
fn check_gradients(m: &Owned, b: &OwnedBatch, masks: &[Vec<f32>]) -> (f64, f64) {
    let scale = 1.0 / b.labelled() as f32;
    let mut grads = m.zero_grads();
    let mut queue = masks.iter().cloned();
    let mut source = |rows: usize, inputs: usize| {
        let mask = queue.next().expect("a mask for every adapted projection");
        assert_eq!(mask.len(), rows * inputs);
        mask
    };
    let dropout: Option<MaskSource<'_>> = if masks.is_empty() {
        None
    } else {
        Some(&mut source)
    };
    let got = forward_backward(&m.view(), &b.view(), scale, dropout, &mut grads).expect("a step");
    let want = reference_loss(m, &m.lora64(), b, scale as f64, masks);
    let loss_err = (got - want).abs() / want.abs();
    assert!(loss_err <= 1e-5, "loss {got} vs {want}");
    let fd = finite_differences(m, b, scale as f64, masks);
    let mut worst = 0f64;
    for (t, (g, f)) in grads.iter().zip(&fd).enumerate() {
        let size = f.iter().fold(0f64, |a, v| a.max(v.abs()));
        assert!(size > 0.0, "tensor {t} has no gradient");
        for (e, (&g, &f)) in g.iter().zip(f).enumerate() {
            let err = (g as f64 - f).abs() / size;
            worst = worst.max(err);
            assert!(err <= 1e-4, "tensor {t}[{e}]: {g} vs finite difference {f}");
        }
    }
    (loss_err, worst)
}

#[test]
fn gradients_match_finite_differences_with_lora_on_all_seven() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 5);
    let b = tiny_batch(m.dims.vocab, 6);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("all seven: loss {loss_err:e}, gradients {grad_err:e} of their max");
}

#[test]
fn gradients_match_finite_differences_with_lora_on_q_and_v() {
    let m = Owned::random(tiny_dims(), &[QV], 2, 7);
    let b = tiny_batch(m.dims.vocab, 8);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("q and v: loss {loss_err:e}, gradients {grad_err:e} of their max");
}

/// LoRA only above layer 0 (the layers below get no backward at all), and a rank
/// of 3 on a third layer.
#[test]
fn gradients_match_finite_differences_with_lora_only_in_upper_layers() {
    let dims = Dims {
        layers: 3,
        ..tiny_dims()
    };
    let m = Owned::random(
        dims,
        &[NONE, [false, true, false, true, false, false, true], ALL],
        3,
        9,
    );
    let b = tiny_batch(m.dims.vocab, 10);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("upper layers: loss {loss_err:e}, gradients {grad_err:e} of their max");
}

/// Dropout masks (0 or 1/(1 − p)) for every adapted projection of `m`, in forward
/// order, each `n × in`.
fn dropout_masks(m: &Owned, n: usize, p: f64, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let keep = (1.0 / (1.0 - p)) as f32;
    let mut masks = vec![];
    for targets in &m.targets {
        for (proj, _) in targets.iter().enumerate().filter(|&(_, &t)| t) {
            let i = m.dims.projection_shape(proj).0;
            masks.push(
                (0..n * i)
                    .map(|_| if rng.random::<f64>() < p { 0.0 } else { keep })
                    .collect(),
            );
        }
    }
    masks
}

#[test]
fn gradients_match_finite_differences_with_dropout() {
    for (targets, seed) in [(ALL, 20), (QV, 21)] {
        let m = Owned::random(tiny_dims(), &[targets], 2, seed);
        let b = tiny_batch(m.dims.vocab, seed + 10);
        let masks = dropout_masks(&m, b.rows * b.len, 0.3, seed + 20);
        let (loss_err, grad_err) = check_gradients(&m, &b, &masks);
        eprintln!("dropout: loss {loss_err:e}, gradients {grad_err:e} of their max");
        // The masks matter: without them the loss is another.
        let plain = reference_loss(&m, &m.lora64(), &b, 1.0, &[]);
        let masked = reference_loss(&m, &m.lora64(), &b, 1.0, &masks);
        assert!((plain - masked).abs() > 1e-3 * plain.abs());
    }
}

/// One draw per adapted projection, in forward order, with its shape, with and
/// without checkpointing; a mask of the wrong length is an error and nothing is
/// added.
#[test]
fn masks_are_drawn_in_forward_order() {
    let dims = Dims {
        layers: 3,
        ..tiny_dims()
    };
    let layers = [ALL, NONE, [false, false, false, true, false, true, true]];
    let m = Owned::random(dims, &layers, 2, 22);
    let b = tiny_batch(m.dims.vocab, 23);
    let n = b.rows * b.len;
    let (h, q, i) = (16, 16, 24);
    let want = [
        (n, h),
        (n, h),
        (n, h),
        (n, q),
        (n, h),
        (n, h),
        (n, i),
        (n, q),
        (n, h),
        (n, i),
    ];
    for checkpoint_layers in [false, true] {
        let options = StepOptions { checkpoint_layers };
        let step = |dropout: Option<MaskSource<'_>>, grads: &mut [Vec<f32>]| {
            forward_backward_with(&m.view(), &b.view(), 0.1, dropout, grads, options)
        };
        // Checkpointing replays the stored masks: nothing is drawn twice.
        let mut calls = vec![];
        let mut source = |rows: usize, inputs: usize| {
            calls.push((rows, inputs));
            vec![1.0; rows * inputs]
        };
        let mut grads = m.zero_grads();
        let with_ones = step(Some(&mut source), &mut grads).expect("a step");
        assert_eq!(calls, want);
        // Masks of ones change nothing.
        let mut plain = m.zero_grads();
        let without = step(None, &mut plain).expect("a step");
        assert_eq!(with_ones, without);
        assert_eq!(grads, plain);

        for bad in [5, 10] {
            let mut count = 0;
            let mut short = |rows: usize, inputs: usize| {
                count += 1;
                vec![1.0; rows * inputs - usize::from(count == bad)]
            };
            let mut grads: Vec<Vec<f32>> = m
                .zero_grads()
                .into_iter()
                .map(|g| vec![7.0; g.len()])
                .collect();
            let err = step(Some(&mut short), &mut grads).expect_err("a short mask");
            eprintln!("{err}");
            assert!(grads.iter().flatten().all(|&v| v == 7.0));
        }
    }
}

/// A batch without labels or without tokens: a zero loss, and nothing added.
#[test]
fn empty_and_unlabelled_batches_add_nothing() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 24);
    let mut b = tiny_batch(m.dims.vocab, 25);
    b.targets.fill(-100);
    let mut grads: Vec<Vec<f32>> = m
        .zero_grads()
        .into_iter()
        .map(|g| vec![0.5; g.len()])
        .collect();
    let l = forward_backward(&m.view(), &b.view(), 1.0, None, &mut grads).expect("a step");
    assert_eq!(l, 0.0);
    assert_eq!(loss(&m.view(), &b.view(), 1.0), Ok(0.0));
    let empty = OwnedBatch {
        ids: vec![],
        rows: 0,
        len: 9,
        targets: vec![],
        positions: vec![],
        starts: vec![],
    };
    let l = forward_backward(&m.view(), &empty.view(), 1.0, None, &mut grads).expect("a step");
    assert_eq!(l, 0.0);
    assert_eq!(loss(&m.view(), &empty.view(), 1.0), Ok(0.0));
    assert!(grads.iter().flatten().all(|&v| v == 0.5));
}

#[test]
fn micro_batches_accumulate() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 11);
    let (b1, b2) = (tiny_batch(m.dims.vocab, 12), tiny_batch(m.dims.vocab, 13));
    let scale = 1.0 / (b1.labelled() + b2.labelled()) as f32;
    let run = |batches: &[&OwnedBatch]| {
        let mut grads = m.zero_grads();
        let losses: Vec<f64> = batches
            .iter()
            .map(|b| {
                forward_backward(&m.view(), &b.view(), scale, None, &mut grads).expect("a step")
            })
            .collect();
        (losses, grads)
    };
    let (one, g1) = run(&[&b1]);
    let (two, g2) = run(&[&b2]);
    let (both, g) = run(&[&b1, &b2]);
    assert_eq!(both, [one[0], two[0]]);
    for (t, ((g, g1), g2)) in g.iter().zip(&g1).zip(&g2).enumerate() {
        for (e, ((&g, &a), &b)) in g.iter().zip(g1).zip(g2).enumerate() {
            assert_eq!(g.to_bits(), (a + b).to_bits(), "tensor {t}[{e}]");
        }
    }
    assert!(g1.iter().flatten().any(|&v| v != 0.0));
}

/// A larger model and batch, so that GEMMs split into several blocks and attention
/// into several query blocks.
fn larger_case() -> (Owned, OwnedBatch) {
    let dims = Dims {
        vocab: 200,
        hidden: 32,
        intermediate: 144,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        rms_eps: 1e-6,
    };
    let m = Owned::random(dims, &[ALL], 4, 14);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
    let (rows, len) = (3, 70);
    let b = OwnedBatch {
        ids: (0..rows * len).map(|_| rng.random_range(0..200)).collect(),
        rows,
        len,
        targets: (0..rows * len)
            .map(|i| {
                if i % 5 == 0 {
                    -100
                } else {
                    rng.random_range(0..200)
                }
            })
            .collect(),
        positions: (0..rows * len).map(|i| (i % len) as u32).collect(),
        starts: vec![0; rows * len],
    };
    (m, b)
}

/// The same bits on 1 and 2 threads.
#[test]
fn results_do_not_depend_on_the_thread_count() {
    let (m, b) = larger_case();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        pool.install(|| {
            let mut grads = m.zero_grads();
            let loss =
                forward_backward(&m.view(), &b.view(), 0.01, None, &mut grads).expect("a step");
            let eval = loss_only(&m, &b);
            let bits: Vec<Vec<u32>> = grads
                .iter()
                .map(|g| g.iter().map(|v| v.to_bits()).collect())
                .collect();
            (loss.to_bits(), eval.to_bits(), bits)
        })
    };
    let one = run(1);
    assert_eq!(
        one.0, one.1,
        "the evaluation loss differs from the training one"
    );
    assert_eq!(one, run(2));
}

fn loss_only(m: &Owned, b: &OwnedBatch) -> f64 {
    loss(&m.view(), &b.view(), 0.01).expect("a loss")
}

#[test]
fn bad_gradient_buffers_are_errors_and_nothing_is_added() {
    let m = Owned::random(tiny_dims(), &[QV], 2, 16);
    let b = tiny_batch(m.dims.vocab, 17);
    let model = m.view();
    let mut grads = m.zero_grads();
    grads.pop();
    let err =
        forward_backward(&model, &b.view(), 1.0, None, &mut grads).expect_err("a missing gradient");
    eprintln!("{err}");
    let mut grads = m.zero_grads();
    grads[2].push(0.0);
    let err =
        forward_backward(&model, &b.view(), 1.0, None, &mut grads).expect_err("a long gradient");
    eprintln!("{err}");
    // A bad batch: the gradients are left as they were.
    let mut grads: Vec<Vec<f32>> = m
        .zero_grads()
        .into_iter()
        .map(|g| vec![7.0; g.len()])
        .collect();
    let mut bad = tiny_batch(m.dims.vocab, 17);
    bad.targets[3] = 1000;
    assert!(forward_backward(&model, &bad.view(), 1.0, None, &mut grads).is_err());
    assert!(grads.iter().flatten().all(|&v| v == 7.0));
}

#[test]
fn the_loss_matches_the_f64_reference() {
    for (targets, seed) in [
        (ALL, 1),
        ([true, false, true, false, false, false, false], 2),
    ] {
        let m = Owned::random(tiny_dims(), &[targets], 2, seed);
        let b = tiny_batch(m.dims.vocab, seed + 10);
        let scale = 1.0 / b.labelled() as f32;
        let got = loss(&m.view(), &b.view(), scale).expect("a loss");
        let want = reference_loss(&m, &m.lora64(), &b, scale as f64, &[]);
        let err = (got - want).abs() / want.abs();
        eprintln!("loss {got} vs {want}: relative error {err:e}");
        assert!(err <= 1e-5, "loss {got} vs {want}: {err:e}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 3);
    let model = m.view();
    let good = tiny_batch(m.dims.vocab, 4);
    assert!(loss(&model, &good.view(), 1.0).is_ok());
    let check = |change: &dyn Fn(&mut OwnedBatch), what: &str| {
        let mut b = tiny_batch(m.dims.vocab, 4);
        change(&mut b);
        let err = loss(&model, &b.view(), 1.0).expect_err(what);
        eprintln!("{what}: {err}");
    };
    check(&|b| b.ids[5] = 61, "a token past the vocabulary");
    check(&|b| b.targets[7] = 61, "a target past the vocabulary");
    check(&|b| b.positions[2] = 128, "a position past the tables");
    check(&|b| b.starts[10] = 2, "a segment starting after its token");
    check(&|b| b.ids.pop().map_or((), drop), "too few ids");
    check(&|b| b.targets.push(0), "too many targets");
    check(&|b| b.rows = 3, "rows that the buffers do not hold");

    let bad_model = |change: &dyn Fn(&mut Model<'_>), what: &str| {
        let mut model = m.view();
        change(&mut model);
        let err = loss(&model, &good.view(), 1.0).expect_err(what);
        eprintln!("{what}: {err}");
    };
    bad_model(&|m| m.dims.layers = 3, "a missing layer");
    bad_model(&|m| m.dims.kv_heads = 3, "heads not a multiple of kv heads");
    bad_model(&|m| m.dims.head_dim = 3, "an odd head_dim");
    bad_model(&|m| m.embed = &m.embed[1..], "a short embedding");
    bad_model(&|m| m.sin = &m.sin[2..], "tables of different lengths");
    bad_model(
        &|m| m.layers[1].proj[5].weight = &m.layers[1].proj[5].weight[1..],
        "a short weight",
    );
    bad_model(
        &|m| {
            if let Some(l) = m.layers[0].proj[2].lora.as_mut() {
                l.r = 3;
            }
        },
        "a LoRA rank its factors do not have",
    );
}
/// Two accumulating micro-batches on a pool of `threads`, with `masks[k]` the dropout
/// masks of micro-batch `k` in forward order (none: no dropout): the losses' and the
/// gradients' bits.
fn step_bits(
    m: &Owned,
    batches: &[&OwnedBatch],
    masks: &[Vec<Vec<f32>>],
    threads: usize,
    checkpoint_layers: bool,
) -> (Vec<u64>, Vec<Vec<u32>>) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a pool");
    let scale = 1.0 / batches.iter().map(|b| b.labelled()).sum::<usize>() as f32;
    pool.install(|| {
        let mut grads = m.zero_grads();
        let mut losses = vec![];
        for (k, b) in batches.iter().enumerate() {
            let mut queue = masks.get(k).into_iter().flatten().cloned();
            let mut source = |rows: usize, inputs: usize| {
                let mask = queue.next().expect("a mask for every adapted projection");
                assert_eq!(mask.len(), rows * inputs);
                mask
            };
            let dropout: Option<MaskSource<'_>> = if masks.is_empty() {
                None
            } else {
                Some(&mut source)
            };
            let options = StepOptions { checkpoint_layers };
            let loss =
                forward_backward_with(&m.view(), &b.view(), scale, dropout, &mut grads, options)
                    .expect("a step");
            losses.push(loss.to_bits());
        }
        assert!(grads.iter().flatten().any(|&v| v != 0.0));
        let bits = grads
            .iter()
            .map(|g| g.iter().map(|v| v.to_bits()).collect())
            .collect();
        (losses, bits)
    })
}

/// Masks that are not two-valued (0, −0, and two keep values), which a checkpointed
/// step must keep whole.
fn odd_masks(m: &Owned, n: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    dropout_masks(m, n, 0.3, seed)
        .into_iter()
        .map(|mask| {
            mask.into_iter()
                .map(|v| match rng.random_range(0..10) {
                    0 => -0.0,
                    1 => 1.25,
                    _ => v,
                })
                .collect()
        })
        .collect()
}

/// Checkpointing recomputes each layer's forward with the same code, inputs and masks,
/// so the losses and the accumulated gradients are the same bits as without it: on
/// the oracle-checked models (GQA; LoRA on all seven, on q and v, and only above
/// layer 0 with a gap), without dropout, with two-valued (packed) masks and with odd
/// (kept whole) masks, over two micro-batches, on 1 and 2 threads; and on a model
/// large enough that the kernels split into several blocks.
#[test]
fn checkpointing_gives_the_same_bits() {
    let three = Dims {
        layers: 3,
        ..tiny_dims()
    };
    let upper = [NONE, [false, true, false, true, false, false, true], ALL];
    let models = [
        Owned::random(tiny_dims(), &[ALL], 2, 30),
        Owned::random(tiny_dims(), &[QV], 2, 31),
        Owned::random(three, &upper, 3, 32),
    ];
    for (k, m) in models.iter().enumerate() {
        let seed = 40 + 10 * k as u64;
        let (b1, b2) = (
            tiny_batch(m.dims.vocab, seed),
            tiny_batch(m.dims.vocab, seed + 1),
        );
        let n = b1.rows * b1.len;
        let drawn = [
            dropout_masks(m, n, 0.3, seed + 2),
            dropout_masks(m, n, 0.3, seed + 3),
        ];
        let odd = [odd_masks(m, n, seed + 4), odd_masks(m, n, seed + 5)];
        for masks in [&[][..], &drawn[..], &odd[..]] {
            let plain = step_bits(m, &[&b1, &b2], masks, 1, false);
            for threads in [1, 2] {
                let checkpointed = step_bits(m, &[&b1, &b2], masks, threads, true);
                assert!(
                    plain == checkpointed,
                    "model {k}, {} masks, {threads} threads: checkpointing changed the bits",
                    masks.len()
                );
            }
        }
    }
    let (m, b) = larger_case();
    let masks = [dropout_masks(&m, b.rows * b.len, 0.1, 33)];
    for masks in [&[][..], &masks[..]] {
        let plain = step_bits(&m, &[&b], masks, 2, false);
        assert!(plain == step_bits(&m, &[&b], masks, 2, true));
        assert!(plain == step_bits(&m, &[&b], masks, 1, true));
    }
}

/// A stored mask unpacks to the bits drawn: two-valued masks pack to a bit each
/// (any length, all zeros too), anything else is kept whole.
#[test]
fn stored_masks_unpack_to_the_drawn_bits() {
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let keep = 1.0 / 0.9f32;
    let two: Vec<f32> = (0..131)
        .map(|i| if i % 3 == 0 { 0.0 } else { keep })
        .collect();
    let cases = [
        (two.clone(), true),
        (vec![0.0; 70], true),
        (vec![keep; 64], true),
        (vec![], true),
        ([&two[..5], &[-0.0], &two[6..]].concat(), false),
        ([&two[..5], &[2.0], &two[6..]].concat(), false),
    ];
    let mut out = vec![9.0; 3];
    for (mask, packed) in cases {
        let stored = StoredMask::pack(&mask);
        assert_eq!(
            matches!(stored, StoredMask::Bits { .. }),
            packed,
            "{mask:?}"
        );
        stored.unpack_into(&mut out);
        assert_eq!(bits(&out), bits(&mask));
    }
}

/// What the step holds, by [`step_bytes`]: checkpointing keeps one layer's state and
/// the layer inputs; the 7B figures for the module notes.
#[test]
fn step_bytes_shrinks_with_checkpointing() {
    let llama7b = Dims {
        vocab: 32000,
        hidden: 4096,
        intermediate: 11008,
        layers: 32,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        rms_eps: 1e-5,
    };
    let ranks = vec![[8; 7]; 32];
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for dropout in [false, true] {
        let full = step_bytes(&llama7b, 2048, &ranks, dropout, false);
        let ckpt = step_bytes(&llama7b, 2048, &ranks, dropout, true);
        eprintln!(
            "7B, 2048 tokens, r = 8 on all seven, dropout {dropout}: {:.2} GiB, checkpointed {:.2} GiB",
            gib(full),
            gib(ckpt)
        );
        assert!(ckpt * 4 < full);
    }
    // The layer inputs dominate what a checkpointed step keeps per layer.
    let d = tiny_dims();
    let ranks = vec![ALL.map(|t| 2 * usize::from(t)); d.layers];
    let one = step_bytes(&d, 100, &ranks, true, true);
    let more = step_bytes(&Dims { layers: 3, ..d }, 100, &[ranks[0]; 3], true, true);
    let packed: u64 = (0..7)
        .map(|p| packed_mask_bytes(100 * d.projection_shape(p).0))
        .sum();
    assert_eq!(more - one, 4 * 100 * d.hidden as u64 + packed);
    assert_eq!(step_bytes(&d, 0, &ranks, true, true), 0);
    // No LoRA: no backward, no inputs kept.
    let none = vec![[0; 7]; d.layers];
    assert!(step_bytes(&d, 100, &none, false, true) < step_bytes(&d, 100, &none, false, false));
}
