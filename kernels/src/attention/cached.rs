//! Attention of a few new query rows over caches of keys and values: how a server
//! decodes. Each row is one sequence's next token (or one token of a span continuing a
//! cache) and sees the positions its own cache holds, so the rows share nothing but the
//! heads' shape. Work is small per row (a cache of a few hundred positions), so it
//! runs as one rayon task per (row, kv head), each over its group of query heads, and
//! every loop is 8 lanes wide where the CPU has AVX2 (see [`crate::simd`]).

use rayon::prelude::*;

use crate::reduce;
use crate::simd::wide_twin;

/// The heads of a model's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Query heads; a multiple of `kv_heads`.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl Heads {
    /// The shape of a fused attention call over `batch` rows of `seq` tokens with these
    /// heads.
    pub fn shape(self, batch: usize, seq: usize) -> super::AttentionShape {
        super::AttentionShape {
            batch,
            seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            scale: super::AttentionShape::head_scale(self.head_dim),
            softcap: None,
        }
    }
}

/// One query row and the cache it attends over.
#[derive(Debug)]
pub struct CachedQuery<'a> {
    /// The row's query heads (`heads × head_dim`), RoPE applied.
    pub q: &'a [f32],
    /// Keys of the positions the row sees, position by position and kv head by kv
    /// head (`positions × kv_heads × head_dim`), RoPE applied.
    pub k: &'a [f32],
    /// Values, laid out as `k`.
    pub v: &'a [f32],
    /// Where the row's attention goes (`heads × head_dim`).
    pub out: &'a mut [f32],
}

/// Writes into each query's `out` `softmax(q·kᵀ/√d)·v` per query head, over every
/// position of its cache (query head `h` reads kv head `h / (heads / kv_heads)`).
///
/// # Panics
/// If a buffer's length does not fit `heads`, or a cache is empty.
pub fn attention_over_cache(heads: Heads, queries: Vec<CachedQuery<'_>>) {
    let Heads {
        heads: nh,
        kv_heads: nkv,
        head_dim: hd,
    } = heads;
    assert!(
        nh > 0 && nkv > 0 && hd > 0 && nh.is_multiple_of(nkv),
        "{heads:?} cannot be grouped"
    );
    let group = nh / nkv;
    let mut tasks = Vec::with_capacity(queries.len() * nkv);
    for query in queries {
        let row = nkv * hd;
        assert!(
            query.q.len() == nh * hd && query.out.len() == nh * hd,
            "a query row and its output hold {} heads of {hd}",
            nh
        );
        assert!(
            !query.k.is_empty()
                && query.k.len().is_multiple_of(row)
                && query.v.len() == query.k.len(),
            "a cache holds whole positions of {nkv} kv heads of {hd}, keys and values alike"
        );
        let q_groups = query.q.chunks_exact(group * hd);
        for (g, (q, out)) in q_groups
            .zip(query.out.chunks_exact_mut(group * hd))
            .enumerate()
        {
            tasks.push(Task {
                q,
                k: query.k,
                v: query.v,
                kv_head: g,
                out,
            });
        }
    }
    tasks
        .into_par_iter()
        .for_each_init(Vec::new, |scores, mut task| {
            attend_group(&mut task, heads, scores);
        });
}

/// One (row, kv head): its group of query heads over its cache.
struct Task<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    kv_head: usize,
    out: &'a mut [f32],
}

wide_twin! {
    /// The attention of `task`'s query heads, with `scores` as scratch.
    fn attend_group(task: &mut Task<'_>, heads: Heads, scores: &mut Vec<f32>) {
        let (nkv, hd) = (heads.kv_heads, heads.head_dim);
        let (k, v) = (task.k, task.v);
        let positions = k.len() / (nkv * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let at = |p: usize| (p * nkv + task.kv_head) * hd;
        scores.clear();
        scores.resize(positions, 0.0);
        for (q, out) in task.q.chunks_exact(hd).zip(task.out.chunks_exact_mut(hd)) {
            for (p, s) in scores.iter_mut().enumerate() {
                *s = reduce::dot(q, &k[at(p)..at(p) + hd]) * scale;
            }
            let max = reduce::max(scores);
            for s in scores.iter_mut() {
                *s = crate::exp::exp(*s - max);
            }
            let inv = 1.0 / reduce::sum(scores);
            out.fill(0.0);
            for (p, &w) in scores.iter().enumerate() {
                let w = w * inv;
                for (o, x) in out.iter_mut().zip(&v[at(p)..at(p) + hd]) {
                    *o += w * x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::attention_forward;
    use crate::simd::tests::{avx2_here, on_baseline, on_wide};
    use crate::testing::random;

    /// Every row of a causal sequence, attended over a cache of the positions up to
    /// it, against the fused forward over the whole sequence; `out` per row.
    fn rows_over_caches(heads: Heads, seq: usize) -> (Vec<f32>, Vec<f32>) {
        let Heads {
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
        } = heads;
        let shape = heads.shape(1, seq);
        let qkv = random(seq * shape.qkv_width(), 3, 2.0);
        let (mut fused, mut lse) = (vec![0f32; seq * nh * hd], vec![0f32; shape.lse_len()]);
        attention_forward(&shape, &qkv, &vec![0; seq], &mut fused, &mut lse);
        let width = shape.qkv_width();
        let part = |t: usize, from: usize, len: usize| &qkv[t * width + from..][..len];
        let k: Vec<f32> = (0..seq)
            .flat_map(|t| part(t, nh * hd, nkv * hd).to_vec())
            .collect();
        let v: Vec<f32> = (0..seq)
            .flat_map(|t| part(t, (nh + nkv) * hd, nkv * hd).to_vec())
            .collect();
        let mut cached = vec![0f32; seq * nh * hd];
        let queries = cached
            .chunks_exact_mut(nh * hd)
            .enumerate()
            .map(|(t, out)| CachedQuery {
                q: part(t, 0, nh * hd),
                k: &k[..(t + 1) * nkv * hd],
                v: &v[..(t + 1) * nkv * hd],
                out,
            })
            .collect();
        attention_over_cache(heads, queries);
        (cached, fused)
    }

    #[test]
    fn each_row_over_its_cache_equals_the_fused_causal_attention() {
        for (heads, seq) in [
            (
                Heads {
                    heads: 4,
                    kv_heads: 2,
                    head_dim: 16,
                },
                37,
            ),
            (
                Heads {
                    heads: 3,
                    kv_heads: 3,
                    head_dim: 8,
                },
                5,
            ),
            (
                Heads {
                    heads: 9,
                    kv_heads: 3,
                    head_dim: 64,
                },
                70,
            ),
        ] {
            let (cached, fused) = rows_over_caches(heads, seq);
            let diff = cached
                .iter()
                .zip(&fused)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "{heads:?}, {seq} positions: {diff}");
        }
    }

    #[test]
    fn the_avx2_build_gives_the_baseline_bits() {
        if !avx2_here() {
            eprintln!("skipped: this CPU lacks AVX2 or FMA, so there is no AVX2 build to compare");
            return;
        }
        let heads = Heads {
            heads: 4,
            kv_heads: 1,
            head_dim: 24,
        };
        let bits = || {
            rows_over_caches(heads, 19)
                .0
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert!(
            on_wide(bits) == on_baseline(bits),
            "the AVX2 build changed the bits"
        );
    }
}
