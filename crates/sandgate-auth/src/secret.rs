//! Opaque secrets: authorization codes, refresh tokens, session ids, CSRF tokens and client
//! secrets. Each is 256 random bits, URL-safe base64; only its SHA-256 is ever stored, so a
//! database leak yields nothing that can be presented back to sandgate.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What kind of secret a value is: the prefix makes leaked values recognisable (secret scanners)
/// and keeps one kind from being accepted where another is expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// An authorization code (`sgc_`).
    AuthorizationCode,
    /// A refresh token (`sgr_`).
    RefreshToken,
    /// A browser session id (`sgs_`).
    Session,
    /// A CSRF token (`sgx_`).
    Csrf,
    /// A confidential client's secret (`sgk_`).
    ClientSecret,
}

impl SecretKind {
    fn prefix(self) -> &'static str {
        match self {
            SecretKind::AuthorizationCode => "sgc_",
            SecretKind::RefreshToken => "sgr_",
            SecretKind::Session => "sgs_",
            SecretKind::Csrf => "sgx_",
            SecretKind::ClientSecret => "sgk_",
        }
    }
}

/// Generates a fresh secret of `kind` from the OS's randomness.
pub fn generate(kind: SecretKind) -> String {
    let bytes: [u8; 32] = rand::random();
    format!("{}{}", kind.prefix(), URL_SAFE_NO_PAD.encode(bytes))
}

/// The SHA-256 of a secret, as stored. A fast hash is right here: the secrets carry 256 bits of
/// entropy, so there is nothing for a slow hash to protect (passwords use argon2 instead).
pub fn hash(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

/// Compares two strings in time independent of where they differ (CSRF tokens, secrets).
pub fn constant_time_eq(a: &str, b: &str) -> bool {
    constant_time_eq_bytes(a.as_bytes(), b.as_bytes())
}

/// Compares two byte strings (e.g. stored and presented secret hashes) in time independent of
/// where they differ.
pub fn constant_time_eq_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

/// Whether `value` looks like a secret of `kind` (right prefix, right length).
pub fn is_kind(value: &str, kind: SecretKind) -> bool {
    value
        .strip_prefix(kind.prefix())
        .is_some_and(|rest| rest.len() == 43)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_unique_prefixed_and_hash_stably() {
        let a = generate(SecretKind::RefreshToken);
        let b = generate(SecretKind::RefreshToken);
        assert_ne!(a, b);
        assert!(is_kind(&a, SecretKind::RefreshToken));
        assert!(!is_kind(&a, SecretKind::AuthorizationCode));
        assert_eq!(hash(&a), hash(&a));
        assert_ne!(hash(&a), hash(&b));
        assert!(constant_time_eq(&a, &a.clone()));
        assert!(!constant_time_eq(&a, &b));
    }
}
