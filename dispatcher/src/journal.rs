//! The dispatcher's journal: its live attempts (job, fencing token, process id), written
//! atomically whenever they change, so a restarted dispatcher knows what its previous
//! run left behind.

use crate::DispatchError;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One live attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// The job.
    pub job: String,
    /// The attempt's fencing token.
    pub token: u64,
    /// Its process, when it has one.
    pub pid: Option<u32>,
}

/// The journal file.
#[derive(Debug, Clone)]
pub struct Journal {
    path: PathBuf,
}

impl Journal {
    /// The journal at `path` (created on first write).
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    /// A journal error on this journal's file.
    fn error(&self, source: impl std::error::Error + Send + Sync + 'static) -> DispatchError {
        DispatchError::Journal {
            path: self.path.clone(),
            source: Box::new(source),
        }
    }

    /// The attempts recorded (none when there is no journal yet).
    pub fn read(&self) -> Result<Vec<JournalEntry>, DispatchError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| self.error(e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(self.error(e)),
        }
    }

    /// Replaces the recorded attempts (write to a temporary file, sync, rename).
    pub fn write(&self, entries: &[JournalEntry]) -> Result<(), DispatchError> {
        use std::io::Write;
        let io = |e: std::io::Error| self.error(e);
        let text = serde_json::to_vec(entries).map_err(|e| self.error(e))?;
        let tmp = self.path.with_extension("tmp");
        let mut file = std::fs::File::create(&tmp).map_err(io)?;
        file.write_all(&text).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &self.path).map_err(io)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_a_reopen_and_a_missing_journal_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path().join("attempts.json"));
        assert!(journal.read().unwrap().is_empty());
        let entries = vec![JournalEntry {
            job: "j000000000001".into(),
            token: 4,
            pid: Some(77),
        }];
        journal.write(&entries).unwrap();
        assert_eq!(
            Journal::new(dir.path().join("attempts.json"))
                .read()
                .unwrap(),
            entries
        );
        std::fs::write(dir.path().join("attempts.json"), b"{broken").unwrap();
        assert!(journal.read().is_err());
    }
}
