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
///
/// An argon2 hash needs its whole memory cost at once (19 MiB with the defaults). Allocating
/// and freeing that per attempt left glibc's arenas holding freed blocks on every thread that
/// ever hashed (a login flood grew resident memory far beyond the hashing threads' needs), so
/// each thread keeps one block buffer and reuses it: memory is bounded by the number of
/// threads that hash (the bounded hashing pool's), whatever the number of attempts.
pub fn verify_password(password: &str, hash: &str) -> Result<bool, PasswordError> {
    let parsed = PasswordHash::new(hash).map_err(|e| PasswordError::Hash(e.to_string()))?;
    match verify_with_thread_memory(password.as_bytes(), &parsed) {
        Some(matched) => Ok(matched),
        // Not an argon2 hash this path understands (or one too costly to keep the memory
        // for): the library's own verification, with its own allocation.
        None => Ok(Argon2::default()
            .verify_password(password.as_bytes(), &parsed)
            .is_ok()),
    }
}

/// The largest memory cost kept per thread for reuse, in KiB blocks (64 MiB).
const MAX_REUSED_BLOCKS: usize = 64 * 1024;

thread_local! {
    /// This thread's argon2 working memory, reused by every verification on it.
    static BLOCKS: std::cell::RefCell<Vec<argon2::Block>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Verifies with this thread's reused memory; `None` when `hash` cannot be verified that way.
fn verify_with_thread_memory(password: &[u8], hash: &PasswordHash<'_>) -> Option<bool> {
    let algorithm = argon2::Algorithm::try_from(hash.algorithm).ok()?;
    let version = argon2::Version::try_from(hash.version?).ok()?;
    let params = argon2::Params::try_from(hash).ok()?;
    let expected = hash.hash?;
    let mut salt = [0u8; 64];
    let salt = hash.salt?.decode_b64(&mut salt).ok()?;
    let blocks = params.block_count();
    if blocks > MAX_REUSED_BLOCKS {
        return None;
    }
    let mut out = vec![0u8; expected.len()];
    let hasher = Argon2::new(algorithm, version, params);
    BLOCKS.with(|memory| {
        let mut memory = memory.borrow_mut();
        if memory.len() < blocks {
            memory.resize(blocks, argon2::Block::default());
        }
        hasher
            .hash_password_into_with_memory(password, salt, &mut out, &mut memory[..blocks])
            .ok()
    })?;
    // `Output`'s equality is constant-time.
    Some(argon2::password_hash::Output::new(&out).ok()? == expected)
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
    fn reused_memory_verifies_like_the_library() {
        let hash = hash_password("correct horse battery").unwrap();
        let parsed = PasswordHash::new(&hash).unwrap();
        assert_eq!(
            verify_with_thread_memory(b"correct horse battery", &parsed),
            Some(true),
            "the default argon2id hash is verified with the reused memory"
        );
        assert_eq!(
            verify_with_thread_memory(b"wrong horse battery", &parsed),
            Some(false)
        );
        // Twice on one thread: the memory is reused, the answer the same.
        assert_eq!(
            verify_with_thread_memory(b"correct horse battery", &parsed),
            Some(true)
        );
    }

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
