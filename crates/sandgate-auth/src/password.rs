//! Passwords: argon2id hashes (PHC strings), never the password itself.

use argon2::Argon2;
use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};

/// A password could not be hashed, or a stored hash is unreadable.
#[derive(Debug, thiserror::Error)]
pub enum PasswordError {
    /// Too short to be worth storing.
    #[error("the password must be at least {min} characters")]
    TooShort {
        /// The minimum length.
        min: usize,
    },
    /// Hashing failed, or the stored hash is not a PHC string.
    #[error("password hashing failed: {0}")]
    Hash(String),
}

/// The shortest password accepted.
pub const MIN_PASSWORD_CHARS: usize = 10;

/// Hashes a password with argon2id and a fresh salt.
pub fn hash_password(password: &str) -> Result<String, PasswordError> {
    if password.chars().count() < MIN_PASSWORD_CHARS {
        return Err(PasswordError::TooShort {
            min: MIN_PASSWORD_CHARS,
        });
    }
    let salt = SaltString::generate(&mut OsRng);
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| PasswordError::Hash(e.to_string()))
}

/// Whether `password` matches the stored `hash`.
pub fn verify_password(password: &str, hash: &str) -> Result<bool, PasswordError> {
    let parsed = PasswordHash::new(hash).map_err(|e| PasswordError::Hash(e.to_string()))?;
    Ok(Argon2::default()
        .verify_password(password.as_bytes(), &parsed)
        .is_ok())
}

/// A hash to verify against when the user does not exist, so that a wrong email takes as long
/// as a wrong password (no account enumeration by timing).
pub fn dummy_hash() -> &'static str {
    static DUMMY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DUMMY.get_or_init(|| hash_password("not-a-real-password-0").unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_verifies_its_password_only() {
        let hash = hash_password("correct horse battery").unwrap();
        assert!(hash.starts_with("$argon2id$"));
        assert!(verify_password("correct horse battery", &hash).unwrap());
        assert!(!verify_password("wrong horse battery", &hash).unwrap());
        assert!(matches!(
            hash_password("short"),
            Err(PasswordError::TooShort { .. })
        ));
    }
}
