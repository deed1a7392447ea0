//! Early stopping on the validation loss: after each validation, whether it improved on
//! the best so far (by more than `min_delta`), and whether `patience` validations in a
//! row have not. The best step's checkpoint is kept, and its adapter is the run's.

use crate::checkpoint::EarlyStopState;
use tuneq_openapi::EarlyStopping;

/// What a validation means for the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The best so far: keep this step.
    Improved,
    /// Not better, but patience is not used up.
    Waiting,
    /// `patience` validations without improvement: stop.
    Stop,
}

/// Records the validation loss `loss` of `step` in `state` under `rule`.
pub(super) fn observe(
    state: &mut Option<EarlyStopState>,
    rule: EarlyStopping,
    step: u64,
    loss: f64,
) -> Verdict {
    let improved = match state {
        None => loss.is_finite(),
        Some(s) => loss.is_finite() && loss < s.best_loss - rule.min_delta,
    };
    if improved {
        *state = Some(EarlyStopState {
            best_step: step,
            best_loss: loss,
            without_improvement: 0,
        });
        return Verdict::Improved;
    }
    let Some(s) = state else {
        // Not a number from the first validation on: nothing to keep yet.
        return Verdict::Waiting;
    };
    s.without_improvement += 1;
    if s.without_improvement >= rule.patience {
        Verdict::Stop
    } else {
        Verdict::Waiting
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patience_counts_validations_that_do_not_beat_the_best_by_min_delta() {
        let rule = EarlyStopping {
            patience: 2,
            min_delta: 0.1,
        };
        let mut state = None;
        let verdicts: Vec<Verdict> = [(1, 2.0), (2, 1.5), (3, 1.45), (4, 1.3), (5, 1.35), (6, 1.4)]
            .into_iter()
            .map(|(step, loss)| observe(&mut state, rule, step, loss))
            .collect();
        use Verdict::*;
        assert_eq!(
            verdicts,
            [Improved, Improved, Waiting, Improved, Waiting, Stop]
        );
        assert_eq!(state.map(|s| (s.best_step, s.best_loss)), Some((4, 1.3)));
        let mut nan_first = None;
        assert_eq!(observe(&mut nan_first, rule, 1, f64::NAN), Waiting);
        assert_eq!(nan_first, None);
    }
}
