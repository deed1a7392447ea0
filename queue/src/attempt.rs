//! Attempt credentials: what a trainer presents when it reports progress.
//!
//! A credential names one attempt — the job and the fencing token of its lease — and is
//! signed (HMAC-SHA256) with a secret the dispatcher and the API share, so a trainer
//! can only report for the attempt it was started for. Whether that attempt is still
//! the live one is the queue's call: the token is fenced like any other.

use crate::JobId;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Signs and checks attempt credentials (`<job>.<token>.<signature>`).
#[derive(Clone)]
pub struct AttemptSigner {
    key: Vec<u8>,
}

impl std::fmt::Debug for AttemptSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AttemptSigner(<secret>)")
    }
}

impl AttemptSigner {
    /// A signer with `secret` (at least 32 bytes of randomness in production).
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self { key: secret.into() }
    }

    fn mac(&self, job: &str, token: u64) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(format!("{job}.{token}").as_bytes());
        mac
    }

    /// The credential of attempt `token` of `job`.
    pub fn sign(&self, job: &str, token: u64) -> String {
        let signature = hex::encode(self.mac(job, token).finalize().into_bytes());
        format!("{job}.{token}.{signature}")
    }

    /// The attempt a credential names, if it is genuine.
    pub fn verify(&self, credential: &str) -> Option<(JobId, u64)> {
        let (rest, signature) = credential.rsplit_once('.')?;
        let (job, token) = rest.rsplit_once('.')?;
        let token: u64 = token.parse().ok()?;
        let signature = hex::decode(signature).ok()?;
        self.mac(job, token).verify_slice(&signature).ok()?;
        Some((job.to_string(), token))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn credentials_verify_only_unchanged_and_with_the_same_secret() {
        let signer = AttemptSigner::new(b"0123456789abcdef0123456789abcdef".to_vec());
        let credential = signer.sign("j000000000042", 7);
        assert_eq!(
            signer.verify(&credential),
            Some(("j000000000042".to_string(), 7))
        );
        let other_token = credential.replacen(".7.", ".8.", 1);
        assert_eq!(signer.verify(&other_token), None);
        let other_job = credential.replacen("42", "43", 1);
        assert_eq!(signer.verify(&other_job), None);
        assert_eq!(
            AttemptSigner::new(b"another secret".to_vec()).verify(&credential),
            None
        );
        for junk in ["", "a.b", "j1.x.00", "j1.1.zz", "j1.1."] {
            assert_eq!(signer.verify(junk), None, "{junk}");
        }
    }
}
