//! The row-grouped step (see `llama::groups`) on batches large enough to be grouped.

use super::*;

/// Five rows of 128 (640 tokens: two groups, rows 0–2 and 3–4) on the larger model:
/// row 1 packs two segments, row 4 is right-padded, some tokens are unlabelled.
pub(super) fn grouped_case() -> (Owned, OwnedBatch) {
    let (m, _) = larger_case();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
    let (rows, len) = (5, 128);
    let n = rows * len;
    let padded = |i: usize| i >= 4 * len + 100;
    let split = |i: usize| i / len == 1 && i % len >= 60;
    let b = OwnedBatch {
        ids: (0..n)
            .map(|i| {
                if padded(i) {
                    0
                } else {
                    rng.random_range(0..200)
                }
            })
            .collect(),
        rows,
        len,
        targets: (0..n)
            .map(|i| {
                if padded(i) || i % 7 == 0 {
                    -100
                } else {
                    rng.random_range(0..200)
                }
            })
            .collect(),
        positions: (0..n)
            .map(|i| (if split(i) { i % len - 60 } else { i % len }) as u32)
            .collect(),
        starts: (0..n).map(|i| if split(i) { 60 } else { 0 }).collect(),
    };
    (m, b)
}

/// Rows `rows` of `b`.
fn rows_of(b: &OwnedBatch, rows: std::ops::Range<usize>) -> OwnedBatch {
    let t = rows.start * b.len..rows.end * b.len;
    OwnedBatch {
        ids: b.ids[t.clone()].to_vec(),
        rows: rows.len(),
        len: b.len,
        targets: b.targets[t.clone()].to_vec(),
        positions: b.positions[t.clone()].to_vec(),
        starts: b.starts[t].to_vec(),
    }
}

#[test]
fn a_grouped_step_adds_what_its_groups_add_one_after_the_other() {
    // The grouped step's gradients are, bit for bit, those of a step on the first
    // group's rows followed by one on the second's (each too small to be grouped), with
    // each group's rows of the masks; the loss is their sum up to its last bits (the
    // batch-wide loss sums its chunks in another order).
    let (m, b) = grouped_case();
    assert_eq!(
        crate::llama::groups::row_groups(b.rows, b.len, false),
        vec![0..3, 3..5]
    );
    let (first, second) = (rows_of(&b, 0..3), rows_of(&b, 3..5));
    let scale = 1.0 / b.labelled() as f32;
    let n = b.rows * b.len;
    let masks = dropout_masks(&m, n, 0.2, 17);
    let cut = |rows: std::ops::Range<usize>| -> Vec<Vec<f32>> {
        masks
            .iter()
            .map(|mask| {
                let i = mask.len() / n;
                mask[rows.start * b.len * i..rows.end * b.len * i].to_vec()
            })
            .collect()
    };
    for with_masks in [false, true] {
        for checkpoint_layers in [false, true] {
            let options = StepOptions { checkpoint_layers };
            let step = |batch: &OwnedBatch, masks: Vec<Vec<f32>>, grads: &mut Vec<Vec<f32>>| {
                let mut queue = masks.into_iter();
                let mut source = |_: usize, _: usize| queue.next().expect("a mask");
                let dropout: Option<MaskSource<'_>> = with_masks.then_some(&mut source);
                forward_backward_with(&m.view(), &batch.view(), scale, dropout, grads, options)
                    .expect("a step")
                    .loss
            };
            let mut whole = m.zero_grads();
            let loss = step(&b, masks.clone(), &mut whole);
            let mut parts = m.zero_grads();
            let parts_loss =
                step(&first, cut(0..3), &mut parts) + step(&second, cut(3..5), &mut parts);
            let (whole_all, parts_all) = (whole.concat(), parts.concat());
            if cfg!(feature = "blas") {
                // The head's products stay batch-wide (640 rows against 384 and 256),
                // and a BLAS rounds a row by the shape of the block it falls in (see
                // `gemm`'s `Plan`): OpenBLAS on AMD Zen 3 does, so there the sums
                // agree to rounding, not to the bit.
                let largest = whole_all.iter().fold(0f32, |m, g| m.max(g.abs()));
                let worst = whole_all
                    .iter()
                    .zip(&parts_all)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    worst <= 1e-5 * largest,
                    "masks {with_masks}, checkpointing {checkpoint_layers}: the gradients \
                     differ by {worst} (largest {largest})"
                );
            } else {
                assert!(
                    crate::gemm::tests::same_bits(&whole_all, &parts_all),
                    "masks {with_masks}, checkpointing {checkpoint_layers}: the gradients differ"
                );
            }
            assert!(whole.iter().flatten().any(|&g| g != 0.0));
            // The head's logits round by block under a BLAS, as above.
            let tolerance = if cfg!(feature = "blas") { 1e-7 } else { 1e-12 };
            assert!(
                (loss - parts_loss).abs() <= tolerance * loss.abs(),
                "{loss} vs {parts_loss}"
            );
        }
    }
}

#[test]
fn a_grouped_step_matches_the_f64_reference_loss_and_its_own_evaluation() {
    let (m, b) = grouped_case();
    let scale = 1.0 / b.labelled() as f32;
    let mut grads = m.zero_grads();
    let loss = forward_backward(&m.view(), &b.view(), scale, None, &mut grads).expect("a step");
    let reference = reference_loss(&m, &m.lora64(), &b, scale as f64, &[]);
    assert!(
        (loss - reference).abs() <= 1e-5 * reference.abs(),
        "{loss} vs {reference}"
    );
    assert_eq!(
        loss.to_bits(),
        super::loss(&m.view(), &b.view(), scale)
            .expect("a loss")
            .to_bits()
    );
}
