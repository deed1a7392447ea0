use super::*;
use crate::gemm::tests::same_bits;

/// Deterministic values in [−1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    crate::testing::random(len, seed, 1.0)
}

/// `C = 0.7·A·B + β·C` on `isa`, with A and B stored transposed or not and C inside
/// a wider buffer; returns that buffer.
fn product(isa: Isa, (m, n, k): (usize, usize, usize), ta: bool, tb: bool, beta: f32) -> Vec<f32> {
    let (a, b) = (values(m * k, 1), values(k * n, 2));
    let a = if ta {
        Mat::new(&a, k, m).t()
    } else {
        Mat::new(&a, m, k)
    };
    let b = if tb {
        Mat::new(&b, n, k).t()
    } else {
        Mat::new(&b, k, n)
    };
    let ldc = n + 3;
    let mut c = values(m * ldc, 3);
    // SAFETY: `isa` is available (checked by the callers); C holds m rows of n
    // elements ldc apart and is only this thread's.
    unsafe { gemm(isa, 0.7, a, b, beta, c.as_mut_ptr(), ldc) };
    c
}

/// The shapes: whole and edge tiles of both widths, A read in place (with its last
/// tile moved up) and packed, more than one block of `k`, of A's rows and of B's
/// columns.
const SHAPES: [(usize, usize, usize); 9] = [
    (1, 1, 1),
    (5, 3, 7),
    (7, 8, 9),
    (30, 8, 600),
    (100, 16, 300),
    (13, 33, 257),
    (250, 1030, 40),
    (37, 70, 520),
    // Rows of A 4 KiB apart: packed even when they are contiguous.
    (20, 40, 1024),
];

#[test]
fn each_instruction_set_computes_the_product_and_both_give_the_same_bits() {
    let avx512 = Isa::Avx512.available();
    assert!(Isa::Avx2.available(), "these kernels need AVX2 and FMA");
    for (m, n, k) in SHAPES {
        let (a, b) = (values(m * k, 1), values(k * n, 2));
        let before = values(m * (n + 3), 3);
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for beta in [0.0, -0.3] {
                let got = product(Isa::Avx2, (m, n, k), ta, tb, beta);
                let ldc = n + 3;
                for i in 0..m {
                    for j in 0..n {
                        let at =
                            |x: &[f32], r: usize, c: usize, t: bool, cols: usize, rows: usize| {
                                if t { x[c * rows + r] } else { x[r * cols + c] }
                            };
                        let dot: f64 = (0..k)
                            .map(|p| at(&a, i, p, ta, k, m) as f64 * at(&b, p, j, tb, n, k) as f64)
                            .sum();
                        let want = 0.7 * dot + beta as f64 * before[i * ldc + j] as f64;
                        let got = got[i * ldc + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                            "{m}×{n}×{k} tA={ta} tB={tb} β={beta}: ({i},{j}) {got} vs {want}"
                        );
                    }
                    for j in n..ldc {
                        assert_eq!(
                            got[i * ldc + j].to_bits(),
                            before[i * ldc + j].to_bits(),
                            "padding ({i},{j}) was written"
                        );
                    }
                }
                if avx512 {
                    let wide = product(Isa::Avx512, (m, n, k), ta, tb, beta);
                    assert!(
                        same_bits(&wide, &got),
                        "{m}×{n}×{k} tA={ta} tB={tb} β={beta}: AVX-512 and AVX2 differ"
                    );
                }
            }
        }
    }
}

#[test]
fn a_read_in_place_and_a_packed_give_the_same_bits() {
    // The same A (37 × 520) as contiguous rows, which the kernel reads in place, and
    // with its rows 4 KiB apart, which it packs; both against several panels of B.
    let (m, n, k) = (37, 70, 520);
    let a = values(m * k, 1);
    let mut spread = vec![f32::NAN; (m - 1) * 1024 + k];
    for (row, values) in spread.chunks_mut(1024).zip(a.chunks(k)) {
        row[..k].copy_from_slice(values);
    }
    let b = values(k * n, 2);
    let (contiguous, spread) = (Mat::new(&a, m, k), Mat::strided(&spread, m, k, 1024, 1));
    for isa in [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|i| i.available())
    {
        let tile = isa.tile(n);
        assert!(reads_a_in_place(&contiguous, n, tile));
        assert!(!reads_a_in_place(&spread, n, tile));
        let run = |a: Mat<'_>| {
            let mut c = vec![0f32; m * n];
            // SAFETY: `isa` is available; C holds m rows of n elements and is only this
            // thread's.
            unsafe { gemm(isa, 0.7, a, Mat::new(&b, k, n), 0.0, c.as_mut_ptr(), n) };
            c
        };
        let (in_place, packed) = (run(contiguous), run(spread));
        assert!(
            same_bits(&in_place, &packed),
            "{isa:?}: A in place and A packed differ"
        );
    }
}

/// `C = 0.7·A·B + β·C` on the bf16 kernels for B (`k × n`, bf16) stored as is
/// (`as_stored`) or transposed, A given as pairs of `a16` (`m × k`), computed whole
/// and, when `split`, in blocks of rows and of columns as the threads' splits cut it.
fn bf16_product(
    (m, n, k): (usize, usize, usize),
    a16: &[bf16],
    b16: &[bf16],
    as_stored: bool,
    beta: f32,
    split: Option<(usize, usize)>,
) -> Vec<f32> {
    let pairs = k.div_ceil(2);
    let a: Vec<f32> = (0..m * pairs)
        .map(|e| {
            let (i, p) = (e / pairs, e % pairs);
            let lo = u32::from(a16[i * k + 2 * p].to_bits());
            let hi = if 2 * p + 1 < k {
                u32::from(a16[i * k + 2 * p + 1].to_bits())
            } else {
                0
            };
            f32::from_bits(lo | hi << 16)
        })
        .collect();
    let b = if as_stored {
        Bf16Mat {
            data: b16,
            rows: k,
            cols: n,
            row_stride: n,
            col_stride: 1,
        }
    } else {
        Bf16Mat {
            data: b16,
            rows: k,
            cols: n,
            row_stride: 1,
            col_stride: k,
        }
    };
    let ldc = n + 3;
    let mut c = values(m * ldc, 3);
    let (rows, cols) = split.unwrap_or((m, n));
    for i0 in (0..m).step_by(rows) {
        for j0 in (0..n).step_by(cols) {
            let a_block = Mat::strided(&a[i0 * pairs..], rows.min(m - i0), pairs, pairs, 1);
            let b_block = b.columns(j0, cols.min(n - j0));
            // SAFETY: the bf16 kernels were detected (checked by the caller); the
            // block of C lies inside `c` and is only this thread's.
            unsafe {
                gemm_bf16(
                    0.7,
                    a_block,
                    b_block,
                    beta,
                    c.as_mut_ptr().add(i0 * ldc + j0),
                    ldc,
                )
            };
        }
    }
    c
}

/// What a bf16 product comes to on a CPU without the bf16 kernels: both operands widened
/// to f32 (exactly) and multiplied by the f32 GEMM. Arguments and result as for
/// [`bf16_product`].
fn widened_product(
    (m, n, k): (usize, usize, usize),
    a16: &[bf16],
    b16: &[bf16],
    as_stored: bool,
    beta: f32,
) -> Vec<f32> {
    let widen = |v: &[bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let (a, b) = (widen(a16), widen(b16));
    let b = if as_stored {
        Mat::new(&b, k, n)
    } else {
        Mat::new(&b, n, k).t()
    };
    let ldc = n + 3;
    let mut c = values(m * ldc, 3);
    crate::gemm::gemm(
        0.7,
        Mat::new(&a, m, k),
        b,
        beta,
        crate::gemm::MatMut::strided(&mut c, m, n, ldc),
    );
    c
}

#[test]
fn the_bf16_kernels_compute_the_product_and_any_split_gives_the_same_bits() {
    let own = Isa::bf16_detected();
    if !own {
        eprintln!(
            "skipped: the bf16 kernels and their splits (no AVX512-BF16 on this CPU, or \
             TUNEQ_GEMM_ISA caps the own kernels); checking the fallback instead (operands \
             widened to f32, f32 GEMM)"
        );
    }
    let to_bf16 = |v: Vec<f32>| -> Vec<bf16> { v.into_iter().map(bf16::from_f32).collect() };
    // Odd and even k over more than one block of pairs, A read in place (n ≤ 16,
    // m ≥ 24) and packed, edge tiles, more than one panel of B's columns.
    for (m, n, k) in [
        (1, 1, 1),
        (30, 8, 1201),
        (50, 16, 64),
        (13, 33, 517),
        (70, 1030, 40),
    ] {
        let (a16, b16) = (to_bf16(values(m * k, 1)), to_bf16(values(k * n, 2)));
        let before = values(m * (n + 3), 3);
        for as_stored in [true, false] {
            for beta in [0.0, -0.3] {
                let got = if own {
                    bf16_product((m, n, k), &a16, &b16, as_stored, beta, None)
                } else {
                    widened_product((m, n, k), &a16, &b16, as_stored, beta)
                };
                let ldc = n + 3;
                for i in 0..m {
                    for j in 0..n {
                        let w = |p: usize| {
                            if as_stored {
                                b16[p * n + j]
                            } else {
                                b16[j * k + p]
                            }
                        };
                        let dot: f64 = (0..k)
                            .map(|p| f64::from(a16[i * k + p].to_f32()) * f64::from(w(p).to_f32()))
                            .sum();
                        let want = 0.7 * dot + f64::from(beta) * f64::from(before[i * ldc + j]);
                        let got = f64::from(got[i * ldc + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                            "{m}×{n}×{k} stored {as_stored} β={beta}: ({i},{j}) {got} vs {want}"
                        );
                    }
                    for j in n..ldc {
                        assert_eq!(got[i * ldc + j].to_bits(), before[i * ldc + j].to_bits());
                    }
                }
                if !own {
                    continue;
                }
                for split in [(64, n), (m, 64), (7, 5)] {
                    let parts = bf16_product((m, n, k), &a16, &b16, as_stored, beta, Some(split));
                    assert!(
                        same_bits(&parts, &got),
                        "{m}×{n}×{k} stored {as_stored} β={beta}: split {split:?} changed bits"
                    );
                }
            }
        }
    }
}
