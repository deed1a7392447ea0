//! What the kernels' unit tests share: seeded random inputs, and running a computation on
//! thread pools of several sizes to check that its bits do not depend on them.

use rand::{Rng, SeedableRng};

/// `n` values drawn uniformly from `-scale..scale`, the same for the same `seed`.
pub(crate) fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The bits of each value, to compare results exactly.
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Checks that `run` gives the same on pools of 1, 2 and 3 threads.
pub(crate) fn assert_same_on_any_thread_count<T>(run: impl Fn() -> T + Sync)
where
    T: PartialEq + std::fmt::Debug + Send,
{
    let on = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool")
            .install(&run)
    };
    let one = on(1);
    assert_eq!(one, on(2));
    assert_eq!(one, on(3));
}
