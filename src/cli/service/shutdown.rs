//! Graceful shutdown on Ctrl-C or SIGTERM, and a forced stop on the second signal.

/// Resolves on the first Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            match term.as_mut() {
                Some(t) => { t.recv().await; }
                None => std::future::pending().await,
            }
        } => {}
    }
}

/// After the first signal: a second one exits at once.
pub fn force_on_second_signal() -> tokio::task::JoinHandle<()> {
    tokio::spawn(async {
        shutdown_signal().await;
        eprintln!("forced stop");
        std::process::exit(130);
    })
}
