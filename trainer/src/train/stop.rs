//! The stop request a signal handler sets: checkpoint, then exit.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Requests a checkpoint-and-exit (SIGTERM/SIGINT handlers set it).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// A flag that is not set.
    pub fn new() -> Self {
        Self::default()
    }
    /// The shared atomic, for signal handlers.
    pub fn atomic(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
    /// Whether a stop was requested.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
    /// Requests a stop.
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst)
    }
}
