//! The loop that files finished jobs' outcomes and sends their webhooks.

use tokio::sync::watch;

/// Files finished jobs' outcomes and sends their webhooks (see `tuneq_api::webhooks`)
/// until stopped. Two loops, so that filing never waits on a receiver: the sender runs
/// as a task of its own, with a share per tenant and endpoint, and once stopped gives
/// its tries in flight a short grace (`webhooks::sender::SHUTDOWN_GRACE`); a try it drops
/// stays in the send queue for the next start.
pub async fn settle_loop(state: tuneq_api::AppState, mut stop: watch::Receiver<bool>) {
    let sender = tokio::spawn(tuneq_api::webhooks::sender::run(
        state.clone(),
        tuneq_api::webhooks::SendLimits::default(),
        stopped(stop.clone()),
    ));
    const BATCH: u32 = 100;
    while !*stop.borrow() {
        let filed = match tuneq_api::webhooks::file_outcomes(&state, BATCH).await {
            Ok(filed) => filed,
            Err(e) => {
                tracing::warn!(error = %e, "cannot file finished jobs; retrying");
                0
            }
        };
        // A full batch: more may be waiting, so go on at once.
        if filed >= BATCH as usize {
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
            _ = stop.changed() => {}
        }
    }
    // Filing is a few catalog writes per job: one last batch costs no wait worth having.
    let _ = tuneq_api::webhooks::file_outcomes(&state, BATCH).await;
    let _ = sender.await;
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopped| *stopped).await;
}
