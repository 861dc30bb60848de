//! PKCE (RFC 7636), S256 only: OAuth 2.1 §4.1.1 and the MCP authorization spec require it, and
//! `plain` would hand the verifier to anyone who sees the authorization request.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha256};

use crate::secret::constant_time_eq;

/// Why a PKCE parameter was refused. The messages are the `error_description`s clients see.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PkceError {
    /// No `code_challenge` in the authorization request.
    #[error("code_challenge is required (PKCE with S256)")]
    MissingChallenge,
    /// A method other than S256 (including `plain` and a missing method).
    #[error("code_challenge_method must be S256")]
    UnsupportedMethod,
    /// The challenge is not a base64url SHA-256.
    #[error(
        "code_challenge must be the base64url-encoded SHA-256 of the code verifier (43 characters)"
    )]
    MalformedChallenge,
    /// No `code_verifier` in the token request.
    #[error("code_verifier is required")]
    MissingVerifier,
    /// The verifier is not 43–128 unreserved characters (RFC 7636 §4.1).
    #[error("code_verifier must be 43 to 128 characters of [A-Za-z0-9-._~]")]
    MalformedVerifier,
    /// The verifier does not hash to the challenge.
    #[error("code_verifier does not match the code_challenge")]
    Mismatch,
}

/// Checks an authorization request's `code_challenge` and `code_challenge_method`.
pub fn check_challenge(challenge: Option<&str>, method: Option<&str>) -> Result<String, PkceError> {
    let challenge = challenge
        .filter(|c| !c.is_empty())
        .ok_or(PkceError::MissingChallenge)?;
    // RFC 7636 §4.3 makes a missing method mean `plain`; we support only S256, so it is refused.
    if method != Some("S256") {
        return Err(PkceError::UnsupportedMethod);
    }
    let decoded = URL_SAFE_NO_PAD
        .decode(challenge)
        .map_err(|_| PkceError::MalformedChallenge)?;
    if decoded.len() != 32 {
        return Err(PkceError::MalformedChallenge);
    }
    Ok(challenge.to_owned())
}

/// The S256 challenge of a verifier.
pub fn challenge_of(verifier: &str) -> String {
    URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()))
}

/// Checks a token request's `code_verifier` against the stored challenge.
pub fn verify(verifier: Option<&str>, challenge: &str) -> Result<(), PkceError> {
    let verifier = verifier
        .filter(|v| !v.is_empty())
        .ok_or(PkceError::MissingVerifier)?;
    let well_formed = (43..=128).contains(&verifier.len())
        && verifier
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~".contains(&b));
    if !well_formed {
        return Err(PkceError::MalformedVerifier);
    }
    if constant_time_eq(&challenge_of(verifier), challenge) {
        Ok(())
    } else {
        Err(PkceError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Computed independently: python3 -c "import hashlib,base64; print(base64.urlsafe_b64encode(hashlib.sha256(V.encode()).digest()))".
    const VERIFIER: &str = "dBjftJeZ4CVP-mJ92K9ZJdTzMhVPMlYz1ByuvgdxGIg";
    const CHALLENGE: &str = "SfKuRWh7sWBNYgepGYSrX5J6LTKp4ZfWlBYfaVqZ2rE";

    #[test]
    fn a_known_pair_verifies() {
        assert_eq!(challenge_of(VERIFIER), CHALLENGE);
        assert_eq!(
            check_challenge(Some(CHALLENGE), Some("S256")).unwrap(),
            CHALLENGE
        );
        verify(Some(VERIFIER), CHALLENGE).unwrap();
    }

    #[test]
    fn plain_missing_and_wrong_are_refused() {
        assert_eq!(
            check_challenge(Some(CHALLENGE), Some("plain")),
            Err(PkceError::UnsupportedMethod)
        );
        assert_eq!(
            check_challenge(Some(CHALLENGE), None),
            Err(PkceError::UnsupportedMethod)
        );
        assert_eq!(
            check_challenge(None, Some("S256")),
            Err(PkceError::MissingChallenge)
        );
        assert_eq!(
            check_challenge(Some("short"), Some("S256")),
            Err(PkceError::MalformedChallenge)
        );
        assert_eq!(verify(None, CHALLENGE), Err(PkceError::MissingVerifier));
        assert_eq!(
            verify(Some("abc"), CHALLENGE),
            Err(PkceError::MalformedVerifier)
        );
        let other = "A".repeat(43);
        assert_eq!(verify(Some(&other), CHALLENGE), Err(PkceError::Mismatch));
    }
}
