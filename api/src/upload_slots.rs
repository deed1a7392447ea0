//! Uploads in progress, in one API process and per tenant: each holds a connection, a
//! spool file and, while it is validated, a core. Beyond the bounds an upload is
//! answered 429 before its body is read. Kept in the process's state (not a static), so
//! servers sharing a process (tests) never share slots.
//!
//! Also each tenant's turn to commit an upload ([`UploadSlots::commit_turn`]): the
//! storage quota is checked again and the file recorded under it, so uploads of one
//! tenant that finish together cannot each see room for themselves alone.

use crate::counts::{Counts, Full};
use crate::error::{ApiError, Code};
use std::sync::{Arc, Mutex};

/// Uploads at once in one process.
pub const PER_PROCESS: usize = 32;
/// Uploads at once of one tenant.
pub const PER_TENANT: usize = 4;
/// `retry-after` when no slot is free.
const RETRY_AFTER_S: u64 = 5;

/// Uploads in progress, per tenant.
type Held = Counts<String>;

/// Commit turns, striped by tenant: a fixed number of locks, however many tenants.
const COMMIT_STRIPES: usize = 64;

/// The upload slots of one process.
#[derive(Debug, Clone)]
pub struct UploadSlots {
    held: Arc<Mutex<Held>>,
    commits: Arc<[Arc<tokio::sync::Mutex<()>>]>,
}

impl Default for UploadSlots {
    fn default() -> Self {
        UploadSlots {
            held: Arc::default(),
            commits: (0..COMMIT_STRIPES)
                .map(|_| Arc::new(tokio::sync::Mutex::new(())))
                .collect(),
        }
    }
}

/// A slot held for one upload, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Mutex<Held>>,
    tenant: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut s) = self.slots.lock() {
            s.give_back(self.tenant.as_str());
        }
    }
}

impl UploadSlots {
    /// How many uploads `tenant` has in progress (each holding a slot).
    pub fn held(&self, tenant: &str) -> usize {
        self.held.lock().map_or(0, |s| s.of(tenant))
    }

    /// A slot for `tenant`, or 429 when the tenant or the process has none free.
    pub fn take(&self, tenant: &str) -> Result<Slot, ApiError> {
        let mut s = self
            .held
            .lock()
            .map_err(|_| ApiError::internal("upload slots are poisoned"))?;
        s.take(tenant.to_string(), PER_PROCESS, PER_TENANT)
            .map_err(|full| {
                let message = match full {
                    Full::Process => format!(
                        "The server is receiving {PER_PROCESS} uploads already; try again shortly."
                    ),
                    Full::Key => format!(
                        "This tenant has {PER_TENANT} uploads in progress; wait for one to finish."
                    ),
                };
                ApiError::too_many(Code::TooManyUploads, message, RETRY_AFTER_S)
            })?;
        Ok(Slot {
            slots: Arc::clone(&self.held),
            tenant: tenant.to_string(),
        })
    }

    /// `tenant`'s turn to check its storage quota and record a file, held until the
    /// guard is dropped (tenants that share a stripe wait for each other; a commit is a
    /// count and a write).
    pub async fn commit_turn(&self, tenant: &str) -> tokio::sync::OwnedMutexGuard<()> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let stripe = BuildHasherDefault::<DefaultHasher>::default().hash_one(tenant) as usize
            % self.commits.len();
        Arc::clone(&self.commits[stripe]).lock_owned().await
    }
}
