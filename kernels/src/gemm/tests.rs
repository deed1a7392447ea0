use super::*;
use rand::{Rng, SeedableRng};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// The naive product in f64.
fn reference(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: &[f32], stride: usize) -> Vec<f64> {
    let mut out = vec![0f64; a.rows * b.cols];
    for i in 0..a.rows {
        for j in 0..b.cols {
            let dot: f64 = (0..a.cols)
                .map(|p| a.at(i, p) as f64 * b.at(p, j) as f64)
                .sum();
            out[i * b.cols + j] = alpha as f64 * dot + beta as f64 * c[i * stride + j] as f64;
        }
    }
    out
}

fn check(m: usize, n: usize, k: usize, transpose_a: bool, transpose_b: bool, beta: f32) {
    let a_data = random(m * k, 1);
    let b_data = random(k * n, 2);
    let a = if transpose_a {
        Mat::new(&a_data, k, m).t()
    } else {
        Mat::new(&a_data, m, k)
    };
    let b = if transpose_b {
        Mat::new(&b_data, n, k).t()
    } else {
        Mat::new(&b_data, k, n)
    };
    // C inside a wider buffer, to exercise the row stride.
    let stride = n + 3;
    let before = random(m * stride, 3);
    let want = reference(0.5, a, b, beta, &before, stride);
    let mut c = before.clone();
    gemm(0.5, a, b, beta, MatMut::strided(&mut c, m, n, stride));
    for i in 0..m {
        for j in 0..n {
            let (got, want) = (c[i * stride + j] as f64, want[i * n + j]);
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                "{m}×{n}×{k} tA={transpose_a} tB={transpose_b}: ({i},{j}) {got} vs {want}"
            );
        }
        for j in n..stride.min(c.len() - i * stride) {
            assert_eq!(
                c[i * stride + j],
                before[i * stride + j],
                "padding ({i},{j}) was written"
            );
        }
    }
}

#[test]
fn matches_the_naive_product_in_every_layout() {
    for (m, n, k) in [
        (1, 1, 1),
        (7, 5, 3),
        (300, 20, 17),
        (20, 300, 9),
        (129, 257, 64),
        (8, 1024, 8),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                for beta in [0.0, 1.0, -0.5] {
                    check(m, n, k, ta, tb, beta);
                }
            }
        }
    }
}

#[test]
fn copied_operands_give_the_same_product() {
    // A row-major over five 1024-column panels (copied at any thread count), and
    // B = Wᵀ over five row blocks (copied with five threads): both still match the
    // naive product, and the copy's scratch is reused across the calls.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(5)
        .build()
        .expect("a pool");
    pool.install(|| {
        for (m, n, k) in [(20, 4200, 30), (1300, 40, 70), (1300, 33, 50)] {
            let plan = Plan::new(m, n, k, 5);
            assert!(plan.a_packs.max(plan.b_packs) >= COPY_MIN_PACKS);
            for ta in [false, true] {
                for tb in [false, true] {
                    check(m, n, k, ta, tb, -0.5);
                }
            }
        }
    });
}

#[test]
fn beta_zero_ignores_what_c_held() {
    let a = vec![1.0f32; 4];
    let b = vec![2.0f32; 4];
    let mut c = vec![f32::NAN; 4];
    gemm(
        1.0,
        Mat::new(&a, 2, 2),
        Mat::new(&b, 2, 2),
        0.0,
        MatMut::new(&mut c, 2, 2),
    );
    assert_eq!(c, vec![4.0; 4]);
}

#[test]
fn k_zero_scales_c() {
    let mut c = vec![2.0f32; 6];
    gemm(
        1.0,
        Mat::new(&[], 2, 0),
        Mat::new(&[], 0, 3),
        0.5,
        MatMut::new(&mut c, 2, 3),
    );
    assert_eq!(c, vec![1.0; 6]);
}

/// A, B (stored transposed or not) and C for `C = α·A·B + β·C`, bit-compared across
/// thread counts and partitions. `α ≠ 1` with `β ≠ 0` matters: the library's full and
/// edge tiles round that epilogue differently, so a split that moved tile edges
/// would show here.
struct Case {
    m: usize,
    n: usize,
    k: usize,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    ta: bool,
    tb: bool,
}

#[cfg_attr(feature = "blas", allow(dead_code))]
impl Case {
    fn new(m: usize, n: usize, k: usize, ta: bool, tb: bool) -> Self {
        Self {
            m,
            n,
            k,
            a: random(m * k, 4),
            b: random(k * n, 5),
            c: random(m * n, 6),
            ta,
            tb,
        }
    }

    fn a(&self) -> Mat<'_> {
        if self.ta {
            Mat::new(&self.a, self.k, self.m).t()
        } else {
            Mat::new(&self.a, self.m, self.k)
        }
    }

    fn b(&self) -> Mat<'_> {
        if self.tb {
            Mat::new(&self.b, self.n, self.k).t()
        } else {
            Mat::new(&self.b, self.k, self.n)
        }
    }

    /// `gemm` in a pool of `threads`.
    fn run(&self, threads: usize) -> Vec<f32> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        let mut c = self.c.clone();
        let (m, n) = (self.m, self.n);
        pool.install(|| gemm(0.7, self.a(), self.b(), -0.3, MatMut::new(&mut c, m, n)));
        c
    }

    /// The library on C cut into `block` rows (or columns), in order, on this thread.
    fn split(&self, by_rows: bool, block: usize) -> Vec<f32> {
        let mut c = self.c.clone();
        let (m, n) = (self.m, self.n);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a pool");
        pool.install(|| {
            let c = MatMut::new(&mut c, m, n);
            in_blocks(0.7, self.a(), self.b(), -0.3, c, by_rows, block);
        });
        c
    }
}

/// Whether two results are the same, bit for bit (and of the same length).
pub(crate) fn same_bits(x: &[f32], y: &[f32]) -> bool {
    x.len() == y.len() && x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The library linked is the one the build asked for (`TUNEQ_BLAS`, which the test
/// process inherits from cargo's environment), so a BLAS test run cannot silently
/// test another.
#[test]
fn the_backend_is_the_one_the_build_asked_for() {
    let want = if !cfg!(feature = "blas") {
        if uses_own_kernels() {
            "tuneq-gemm"
        } else {
            "matrixmultiply"
        }
    } else if std::env::var("TUNEQ_BLAS").as_deref() == Ok("mkl") {
        "mkl"
    } else {
        "openblas"
    };
    assert!(backend().starts_with(want), "{} is not {want}", backend());
}

#[test]
fn the_result_does_not_depend_on_the_thread_count() {
    for (m, n, k) in [
        (1000, 96, 200),
        (64, 700, 300),
        (1024, 688, 256),
        (331, 257, 129),
        (77, 1030, 65),
        (1300, 9, 270),
        (9, 1300, 270),
        (20, 4200, 30),
    ] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let case = Case::new(m, n, k, ta, tb);
            let one = case.run(1);
            for threads in [2, 3, 5] {
                assert!(
                    same_bits(&one, &case.run(threads)),
                    "{m}×{n}×{k} tA={ta} tB={tb} with {threads} threads"
                );
            }
        }
    }
}

/// matrixmultiply only: a BLAS rounds differently at different block edges, which is
/// why the `blas` build splits into blocks of a fixed size instead.
#[test]
#[cfg(not(feature = "blas"))]
fn the_result_does_not_depend_on_the_partition() {
    for (m, n, k) in [(331, 257, 129), (200, 1100, 300)] {
        for (ta, tb) in [(false, true), (true, false)] {
            let case = Case::new(m, n, k, ta, tb);
            let whole = case.split(true, m.next_multiple_of(ALIGN));
            for block in [ALIGN, 2 * ALIGN, 3 * ALIGN, 5 * ALIGN] {
                for by_rows in [true, false] {
                    assert!(
                        same_bits(&whole, &case.split(by_rows, block)),
                        "{m}×{n}×{k} tA={ta} tB={tb}, blocks of {block} {}",
                        if by_rows { "rows" } else { "columns" }
                    );
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "reaches past")]
fn a_view_past_its_slice_is_refused() {
    let data = [0f32; 5];
    let _ = Mat::new(&data, 2, 3);
}

#[test]
#[should_panic(expected = "would overlap")]
fn overlapping_output_rows_are_refused() {
    let mut data = [0f32; 8];
    let _ = MatMut::strided(&mut data, 2, 4, 2);
}

#[test]
fn an_isa_limit_is_read_in_any_case_and_a_bad_one_is_named() {
    let read = |v: &str| IsaLimit::from_value(Some(v.into()));
    assert_eq!(IsaLimit::from_value(None), Ok(None));
    assert_eq!(read(""), Ok(None));
    assert_eq!(read(" AVX2 "), Ok(Some(IsaLimit::Avx2)));
    assert_eq!(read("avx512"), Ok(Some(IsaLimit::Avx512)));
    let err = read("sse4").expect_err("not a limit");
    assert_eq!(err.value, "sse4");
    assert!(
        err.to_string().contains("TUNEQ_GEMM_ISA=\"sse4\"")
            && err.to_string().contains("avx512 or avx2"),
        "{err}"
    );
}

#[test]
fn a_share_limits_the_split_while_it_lasts_even_when_its_body_panics() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .expect("a pool");
    pool.install(|| {
        assert_eq!(threads(), 4);
        with_share(2, || {
            assert_eq!(threads(), 2);
            with_share(9, || {
                assert_eq!(threads(), 4, "a share is at most the pool")
            });
            assert_eq!(threads(), 2);
        });
        assert_eq!(threads(), 4);
        let unwound = std::panic::catch_unwind(|| with_share(1, || panic!("in the body")));
        assert!(unwound.is_err());
        assert_eq!(threads(), 4, "the share outlived a panicking body");
    });
}
