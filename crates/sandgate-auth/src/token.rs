//! Access tokens: short-lived JWTs signed with Ed25519 (`EdDSA`), verified on every request.
//!
//! The audience is the MCP resource URL (RFC 8707 / MCP authorization spec), so a token minted
//! for another resource is refused. Keys carry a `kid`; verifiers hold every key that may still
//! have live tokens, which is what makes rotation seamless.

use std::collections::HashMap;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::Utc;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Scope;

/// PKCS#8 v1 prefix for an Ed25519 private key (RFC 8410 §7): the 32-byte seed follows.
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

/// The claims of a sandgate access token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccessClaims {
    /// Issuer: the gateway's public URL.
    pub iss: String,
    /// Subject: who the token acts for (a user id, or a client id for client credentials).
    pub sub: String,
    /// Audience: the MCP resource URL.
    pub aud: String,
    /// Expiry (unix seconds).
    pub exp: i64,
    /// Issued at (unix seconds).
    pub iat: i64,
    /// Token id, recorded in the audit trail.
    pub jti: String,
    /// The tenant whose sandboxes the token reaches.
    pub tenant: Uuid,
    /// Space-separated scopes (RFC 8693 `scope` claim).
    pub scope: String,
    /// The grant (connection) the token belongs to, when it came from an OAuth flow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<Uuid>,
    /// The OAuth client the token was issued to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
}

impl AccessClaims {
    /// The scopes the token holds (unknown names are dropped: they grant nothing).
    pub fn scopes(&self) -> Vec<Scope> {
        self.scope
            .split_ascii_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect()
    }

    /// Whether the token holds `scope`.
    pub fn has_scope(&self, scope: Scope) -> bool {
        self.scope
            .split_ascii_whitespace()
            .any(|s| s == scope.as_str())
    }
}

/// Why a token was refused (or could not be made).
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// Not a JWT, or its claims are not ours.
    #[error("the access token is malformed")]
    Malformed(#[source] jsonwebtoken::errors::Error),
    /// Past its `exp`.
    #[error("the access token has expired")]
    Expired,
    /// Minted for another resource.
    #[error("the access token was issued for another resource")]
    WrongAudience,
    /// Issued by someone else.
    #[error("the access token was issued by another issuer")]
    WrongIssuer,
    /// Signed by a key we do not know (or no longer trust).
    #[error("the access token is signed by an unknown key")]
    UnknownKey,
    /// The signature does not verify.
    #[error("the access token's signature is invalid")]
    BadSignature,
    /// A signing key could not be used.
    #[error("signing key {kid} is unusable")]
    Key {
        /// The key's id.
        kid: String,
        /// What was wrong with it.
        #[source]
        source: jsonwebtoken::errors::Error,
    },
    /// Signing failed.
    #[error("signing the access token failed")]
    Sign(#[source] jsonwebtoken::errors::Error),
}

/// An Ed25519 signing key with its id.
#[derive(Clone)]
pub struct KeyPair {
    /// Key id (`kid` header, JWKS entry).
    pub kid: String,
    seed: [u8; 32],
}

impl std::fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyPair")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

impl KeyPair {
    /// Generates a fresh key from the OS's randomness.
    pub fn generate() -> Self {
        let seed: [u8; 32] = rand::random();
        Self {
            kid: format!("k_{}", Uuid::now_v7().simple()),
            seed,
        }
    }

    /// Rebuilds a key from its stored id and 32-byte seed.
    pub fn from_seed(kid: String, seed: [u8; 32]) -> Self {
        Self { kid, seed }
    }

    /// The private seed, for storage.
    pub fn seed(&self) -> &[u8; 32] {
        &self.seed
    }

    /// The public half.
    pub fn verifying_key(&self) -> VerifyingKey {
        let signing = ed25519_dalek::SigningKey::from_bytes(&self.seed);
        VerifyingKey {
            kid: self.kid.clone(),
            public: signing.verifying_key().to_bytes(),
        }
    }

    fn encoding_key(&self) -> EncodingKey {
        let mut der = Vec::with_capacity(48);
        der.extend_from_slice(&ED25519_PKCS8_PREFIX);
        der.extend_from_slice(&self.seed);
        EncodingKey::from_ed_der(&der)
    }
}

/// The public half of a signing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyingKey {
    /// Key id.
    pub kid: String,
    /// Raw Ed25519 public key.
    pub public: [u8; 32],
}

impl VerifyingKey {
    /// The key as a JWKS entry (RFC 8037 OKP key).
    pub fn to_jwk(&self) -> serde_json::Value {
        serde_json::json!({
            "kty": "OKP",
            "crv": "Ed25519",
            "alg": "EdDSA",
            "use": "sig",
            "kid": self.kid,
            "x": URL_SAFE_NO_PAD.encode(self.public),
        })
    }

    fn decoding_key(&self) -> Result<DecodingKey, TokenError> {
        DecodingKey::from_ed_components(&URL_SAFE_NO_PAD.encode(self.public)).map_err(|source| {
            TokenError::Key {
                kid: self.kid.clone(),
                source,
            }
        })
    }
}

/// Mints access tokens with the current signing key.
#[derive(Debug, Clone)]
pub struct TokenIssuer {
    key: KeyPair,
    issuer: String,
}

impl TokenIssuer {
    /// An issuer signing with `key` as `issuer` (the gateway's public URL).
    pub fn new(key: KeyPair, issuer: impl Into<String>) -> Self {
        Self {
            key,
            issuer: issuer.into(),
        }
    }

    /// The id of the key it signs with.
    pub fn kid(&self) -> &str {
        &self.key.kid
    }

    /// Mints a token for `tenant` with `scopes`, valid for `ttl`, for the resource `audience`.
    #[allow(clippy::too_many_arguments)] // each argument is a distinct claim; a builder adds nothing
    pub fn issue(
        &self,
        subject: &str,
        tenant: Uuid,
        scopes: &[Scope],
        audience: &str,
        ttl: Duration,
        grant: Option<Uuid>,
        client_id: Option<String>,
    ) -> Result<(String, AccessClaims), TokenError> {
        let now = Utc::now().timestamp();
        let claims = AccessClaims {
            iss: self.issuer.clone(),
            sub: subject.to_owned(),
            aud: audience.to_owned(),
            exp: now + i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2),
            iat: now,
            jti: Uuid::new_v4().simple().to_string(),
            tenant,
            scope: scopes
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(" "),
            grant,
            client_id,
        };
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some(self.key.kid.clone());
        header.typ = Some("at+jwt".into()); // RFC 9068
        let token = jsonwebtoken::encode(&header, &claims, &self.key.encoding_key())
            .map_err(TokenError::Sign)?;
        Ok((token, claims))
    }
}

/// Verifies access tokens against the known public keys, one issuer and one audience.
#[derive(Clone)]
pub struct TokenVerifier {
    keys: HashMap<String, DecodingKey>,
    issuer: String,
    audience: String,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier")
            .field("kids", &self.keys.keys().collect::<Vec<_>>())
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .finish()
    }
}

impl TokenVerifier {
    /// A verifier trusting `keys` for tokens from `issuer` to `audience`.
    pub fn new(
        keys: &[VerifyingKey],
        issuer: impl Into<String>,
        audience: impl Into<String>,
    ) -> Result<Self, TokenError> {
        let keys = keys
            .iter()
            .map(|k| Ok((k.kid.clone(), k.decoding_key()?)))
            .collect::<Result<_, TokenError>>()?;
        Ok(Self {
            keys,
            issuer: issuer.into(),
            audience: audience.into(),
        })
    }

    /// Checks signature, issuer, audience and expiry (no leeway: expiry is exact).
    pub fn verify(&self, token: &str) -> Result<AccessClaims, TokenError> {
        let header = jsonwebtoken::decode_header(token).map_err(TokenError::Malformed)?;
        if header.alg != Algorithm::EdDSA {
            return Err(TokenError::BadSignature);
        }
        let key = header
            .kid
            .as_deref()
            .and_then(|kid| self.keys.get(kid))
            .ok_or(TokenError::UnknownKey)?;
        let mut validation = Validation::new(Algorithm::EdDSA);
        validation.leeway = 0;
        validation.set_audience(&[&self.audience]);
        validation.set_issuer(&[&self.issuer]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        use jsonwebtoken::errors::ErrorKind;
        jsonwebtoken::decode::<AccessClaims>(token, key, &validation)
            .map(|data| data.claims)
            .map_err(|e| match e.kind() {
                ErrorKind::ExpiredSignature => TokenError::Expired,
                ErrorKind::InvalidAudience => TokenError::WrongAudience,
                ErrorKind::InvalidIssuer => TokenError::WrongIssuer,
                ErrorKind::InvalidSignature => TokenError::BadSignature,
                _ => TokenError::Malformed(e),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUD: &str = "http://127.0.0.1:8080/mcp";
    const ISS: &str = "http://127.0.0.1:8080";

    fn issue(key: &KeyPair, aud: &str, ttl: Duration) -> String {
        TokenIssuer::new(key.clone(), ISS)
            .issue(
                "u1",
                Uuid::nil(),
                &[Scope::Sandbox, Scope::Execute],
                aud,
                ttl,
                None,
                None,
            )
            .unwrap()
            .0
    }

    #[test]
    fn a_token_verifies_with_its_key_and_carries_its_claims() {
        let key = KeyPair::generate();
        let verifier = TokenVerifier::new(&[key.verifying_key()], ISS, AUD).unwrap();
        let claims = verifier
            .verify(&issue(&key, AUD, Duration::from_secs(60)))
            .unwrap();
        assert_eq!(claims.scopes(), vec![Scope::Sandbox, Scope::Execute]);
        assert!(claims.has_scope(Scope::Execute));
        assert!(!claims.has_scope(Scope::FilesWrite));
    }

    #[test]
    fn another_keys_signature_is_refused() {
        let key = KeyPair::generate();
        let forged = KeyPair::from_seed(key.kid.clone(), [7; 32]);
        let verifier = TokenVerifier::new(&[key.verifying_key()], ISS, AUD).unwrap();
        let err = verifier
            .verify(&issue(&forged, AUD, Duration::from_secs(60)))
            .unwrap_err();
        assert!(matches!(err, TokenError::BadSignature), "{err:?}");
    }

    #[test]
    fn wrong_audience_unknown_key_and_garbage_are_refused() {
        let key = KeyPair::generate();
        let verifier = TokenVerifier::new(&[key.verifying_key()], ISS, AUD).unwrap();
        let err = verifier
            .verify(&issue(
                &key,
                "http://elsewhere/mcp",
                Duration::from_secs(60),
            ))
            .unwrap_err();
        assert!(matches!(err, TokenError::WrongAudience), "{err:?}");
        let other = KeyPair::generate();
        let err = verifier
            .verify(&issue(&other, AUD, Duration::from_secs(60)))
            .unwrap_err();
        assert!(matches!(err, TokenError::UnknownKey), "{err:?}");
        assert!(matches!(
            verifier.verify("not.a.jwt").unwrap_err(),
            TokenError::Malformed(_)
        ));
    }

    #[test]
    fn an_expired_token_is_refused() {
        let key = KeyPair::generate();
        let verifier = TokenVerifier::new(&[key.verifying_key()], ISS, AUD).unwrap();
        let (token, _) = TokenIssuer::new(key.clone(), ISS)
            .issue(
                "u1",
                Uuid::nil(),
                &[Scope::Sandbox],
                AUD,
                Duration::ZERO,
                None,
                None,
            )
            .unwrap();
        // exp == now is already expired with zero leeway once the second turns; make it certain.
        let mut claims: AccessClaims = serde_json::from_slice(
            &URL_SAFE_NO_PAD
                .decode(token.split('.').nth(1).unwrap())
                .unwrap(),
        )
        .unwrap();
        claims.exp -= 10;
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some(key.kid.clone());
        let expired = jsonwebtoken::encode(&header, &claims, &key.encoding_key()).unwrap();
        assert!(matches!(
            verifier.verify(&expired).unwrap_err(),
            TokenError::Expired
        ));
    }

    #[test]
    fn the_jwk_round_trips_to_a_working_key() {
        let key = KeyPair::generate();
        let jwk: jsonwebtoken::jwk::Jwk =
            serde_json::from_value(key.verifying_key().to_jwk()).unwrap();
        let decoding = DecodingKey::from_jwk(&jwk).unwrap();
        let mut validation = Validation::new(Algorithm::EdDSA);
        validation.set_audience(&[AUD]);
        jsonwebtoken::decode::<AccessClaims>(
            &issue(&key, AUD, Duration::from_secs(60)),
            &decoding,
            &validation,
        )
        .expect("a JWKS consumer can verify our tokens");
    }
}

/// Property tests standing in for fuzzing (bounded cases in `cargo test`): the access-token
/// decoder refuses anything but a token our key signed, and never panics.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    const AUD: &str = "http://127.0.0.1:8080/mcp";
    const ISS: &str = "http://127.0.0.1:8080";

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn any_text_is_refused_without_panicking(token in prop_oneof![
            ".{0,300}",
            "[A-Za-z0-9_-]{0,60}\\.[A-Za-z0-9_-]{0,200}\\.[A-Za-z0-9_-]{0,90}",
        ]) {
            let key = KeyPair::from_seed("k".into(), [3; 32]);
            let verifier = TokenVerifier::new(&[key.verifying_key()], ISS, AUD).unwrap();
            prop_assert!(verifier.verify(&token).is_err());
        }

        #[test]
        fn a_signed_token_changed_anywhere_is_refused(at in any::<prop::sample::Index>(), with in "[A-Za-z0-9_.-]") {
            let key = KeyPair::from_seed("k".into(), [3; 32]);
            let verifier = TokenVerifier::new(&[key.verifying_key()], ISS, AUD).unwrap();
            let (token, claims) = TokenIssuer::new(key, ISS)
                .issue("u1", Uuid::nil(), &[Scope::Sandbox], AUD, Duration::from_secs(60), None, None)
                .unwrap();
            let i = at.index(token.len());
            let mut changed = token.clone();
            changed.replace_range(i..=i, &with);
            match verifier.verify(&changed) {
                Err(_) => {}
                // Base64 padding bits of a segment's last character can change without
                // changing the bytes: then it is the same token.
                Ok(same) => prop_assert_eq!(same.jti, claims.jti),
            }
        }
    }
}
