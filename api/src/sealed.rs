//! Secrets at rest: what the API keeps that would let someone act as us (webhook
//! signing secrets) is sealed with ChaCha20-Poly1305 before it reaches the queue's
//! catalog, so a copy of `queue.db` or a Redis dump does not give them away. The record's
//! owner (a tenant id) is bound in as associated data: a sealed value copied into
//! another tenant's record does not open.
//!
//! The key comes from the deployment: `tuneq up` keeps a random one in
//! `<data-dir>/secrets.key` (0600); `tuneq api` derives it from the attempt secret every
//! replica already shares.

use aws_lc_rs::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// What a sealed value starts with (and the version of its format).
const PREFIX: &str = "sealed:v1:";

/// The key secrets are sealed with.
#[derive(Clone)]
pub struct SealingKey([u8; 32]);

impl std::fmt::Debug for SealingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealingKey(…)")
    }
}

/// Why a sealed value could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The value is damaged, sealed for another owner, or sealed with another key.
    #[error(
        "a sealed secret does not open with this server's key (was the key or the attempt secret changed?)"
    )]
    WrongKey,
    /// The value is not in the sealed format.
    #[error("a sealed secret is malformed")]
    Malformed,
}

impl SealingKey {
    /// A key from 32 random bytes.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// The key in `bytes` (exactly 32).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The key's bytes, to keep it (in a 0600 file).
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A key derived from a deployment's shared secret, for purpose "secrets at rest".
    pub fn derive(shared_secret: &[u8]) -> Self {
        let mut mac = Hmac::<Sha256>::new_from_slice(shared_secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(b"tuneq: the key that seals secrets at rest, v1");
        Self(mac.finalize().into_bytes().into())
    }

    fn aead(&self) -> LessSafeKey {
        LessSafeKey::new(
            UnboundKey::new(&CHACHA20_POLY1305, &self.0)
                .unwrap_or_else(|_| unreachable!("a 32-byte key fits ChaCha20-Poly1305")),
        )
    }

    /// `plain` sealed for `owner`, as text.
    pub fn seal(&self, owner: &str, plain: &str) -> String {
        let nonce_bytes: [u8; NONCE_LEN] = rand::random();
        let mut sealed = plain.as_bytes().to_vec();
        // Sealing in place fails only on a buffer too large for the cipher (GiBs).
        if self
            .aead()
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce_bytes),
                Aad::from(owner.as_bytes()),
                &mut sealed,
            )
            .is_err()
        {
            unreachable!("a secret is far below the cipher's limit");
        }
        let mut out = nonce_bytes.to_vec();
        out.extend_from_slice(&sealed);
        format!("{PREFIX}{}", BASE64.encode(out))
    }

    /// Whether `text` is a sealed value (else it is a record from before sealing).
    pub fn is_sealed(text: &str) -> bool {
        text.starts_with(PREFIX)
    }

    /// The plain text of `text`, sealed for `owner`.
    pub fn open(&self, owner: &str, text: &str) -> Result<String, SealError> {
        let encoded = text.strip_prefix(PREFIX).ok_or(SealError::Malformed)?;
        let mut bytes = BASE64.decode(encoded).map_err(|_| SealError::Malformed)?;
        if bytes.len() < NONCE_LEN {
            return Err(SealError::Malformed);
        }
        let mut sealed = bytes.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&bytes).map_err(|_| SealError::Malformed)?;
        let plain = self
            .aead()
            .open_in_place(nonce, Aad::from(owner.as_bytes()), &mut sealed)
            .map_err(|_| SealError::WrongKey)?;
        String::from_utf8(plain.to_vec()).map_err(|_| SealError::Malformed)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sealed_secrets_open_only_with_their_key_and_owner() {
        let key = SealingKey::random();
        let sealed = key.seal("acme", "whsec_abc");
        assert!(SealingKey::is_sealed(&sealed));
        assert!(!sealed.contains("whsec_abc"));
        assert_eq!(key.open("acme", &sealed).unwrap(), "whsec_abc");
        assert!(matches!(
            key.open("globex", &sealed),
            Err(SealError::WrongKey)
        ));
        assert!(matches!(
            SealingKey::random().open("acme", &sealed),
            Err(SealError::WrongKey)
        ));
        assert!(matches!(
            key.open("acme", "whsec_abc"),
            Err(SealError::Malformed)
        ));
        // Two seals of one value differ (fresh nonces).
        assert_ne!(key.seal("acme", "x"), key.seal("acme", "x"));
        // A derived key is stable.
        assert_eq!(
            SealingKey::derive(b"shared").bytes(),
            SealingKey::derive(b"shared").bytes()
        );
    }
}
