//! The key ring: the signing key for new access tokens and every key that still verifies,
//! loaded from Postgres and refreshed so that a rotation by any replica is seen by all.
//!
//! Seeds are stored sealed ([`SeedSealer`]: XChaCha20-Poly1305 under a key-encryption key
//! derived from `keys.secret`), so a copy of the database alone signs nothing. Seeds written in
//! clear by an older version are sealed when the ring first loads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use chrono::Utc;
use hmac::{Hmac, Mac};
use sandgate_auth::{AccessClaims, KeyPair, TokenError, TokenIssuer, TokenVerifier, VerifyingKey};
use sandgate_store::{PgPool, StoreError, keys};
use sha2::Sha256;

pub use crate::config::RETIRED_KEY_GRACE;

/// A 32-byte key for one `purpose`, derived from the deployment's secret (HMAC-SHA256 as a
/// PRF, keyed by the secret: each purpose gets an independent key).
pub fn derive_key(secret: &[u8], purpose: &str) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"sandgate key derivation v1\0");
    mac.update(purpose.as_bytes());
    mac.finalize().into_bytes().into()
}

/// Seals and opens signing-key seeds with the key-encryption key. Sealed form:
/// `version (1) ‖ nonce (24) ‖ ciphertext+tag (48)`, the key id bound as associated data (a
/// sealed seed cannot be moved to another row).
#[derive(Clone)]
pub struct SeedSealer {
    cipher: Arc<XChaCha20Poly1305>,
}

impl std::fmt::Debug for SeedSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedSealer").finish_non_exhaustive()
    }
}

const SEALED_SEED_V1: u8 = 1;

impl SeedSealer {
    /// The sealer whose key is derived from the deployment's secret.
    pub fn new(secret: &[u8]) -> Self {
        let key = derive_key(secret, "signing-key seeds");
        Self {
            cipher: Arc::new(XChaCha20Poly1305::new(&key.into())),
        }
    }

    /// `seed` sealed for key `kid`.
    pub fn seal(&self, kid: &str, seed: &[u8; 32]) -> Vec<u8> {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let sealed = self
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: seed,
                    aad: kid.as_bytes(),
                },
            )
            .expect("sealing 32 bytes cannot fail");
        let mut out = Vec::with_capacity(1 + nonce.len() + sealed.len());
        out.push(SEALED_SEED_V1);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// The seed of key `kid`, or `None` when `sealed` was not sealed by this key for that kid
    /// (another secret, altered, truncated).
    pub fn open(&self, kid: &str, sealed: &[u8]) -> Option<[u8; 32]> {
        let (&version, rest) = sealed.split_first()?;
        if version != SEALED_SEED_V1 || rest.len() < 24 {
            return None;
        }
        let (nonce, ciphertext) = rest.split_at(24);
        let nonce = XNonce::from(<[u8; 24]>::try_from(nonce).ok()?);
        let seed = self
            .cipher
            .decrypt(
                &nonce,
                Payload {
                    msg: ciphertext,
                    aad: kid.as_bytes(),
                },
            )
            .ok()?;
        seed.as_slice().try_into().ok()
    }
}

/// How keys are stored and how long retired ones verify, from the configuration.
#[derive(Debug, Clone)]
pub struct KeySettings {
    /// Seals the seeds at rest.
    pub sealer: SeedSealer,
    /// How long a retired key keeps verifying: the longer of [`RETIRED_KEY_GRACE`] and the
    /// longest admin-token lifetime (a rotation must not end admin tokens).
    pub retired_grace: Duration,
}

impl KeySettings {
    /// The settings of `config`.
    pub fn of(config: &crate::Config) -> Self {
        Self {
            sealer: SeedSealer::new(config.keys.secret_bytes()),
            retired_grace: RETIRED_KEY_GRACE
                .max(Duration::from_secs(config.keys.admin_token_max_ttl_seconds)),
        }
    }
}
/// How often the ring reloads from Postgres, and the least time between reloads forced by an
/// unknown `kid`.
const REFRESH_EVERY: Duration = Duration::from_secs(30);
const MIN_FORCED_REFRESH: Duration = Duration::from_secs(1);

/// What went wrong with keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Postgres failed.
    #[error("loading signing keys failed")]
    Store(#[from] StoreError),
    /// A stored key is malformed.
    #[error("stored signing key {0} is malformed")]
    Malformed(String),
    /// A stored seed does not open with this deployment's secret.
    #[error(
        "stored signing key {0} cannot be decrypted with keys.secret: was keys.secret changed? \
         Set it back to the value it had when the key was made (every replica needs the same \
         value), or, to start over with new keys (every issued token ends), delete the rows of \
         the signing_keys table"
    )]
    Undecryptable(String),
    /// Building the verifier failed.
    #[error("building the token verifier failed")]
    Token(#[from] TokenError),
}

impl From<sqlx::Error> for KeyError {
    /// A failed acquire, begin or commit: classified like any other database failure.
    fn from(err: sqlx::Error) -> Self {
        StoreError::from(err).into()
    }
}

#[derive(Debug)]
struct Loaded {
    issuer: TokenIssuer,
    verifier: TokenVerifier,
    public: Vec<VerifyingKey>,
    at: Instant,
}

/// Shared, refreshable access to the signing and verifying keys.
#[derive(Debug, Clone)]
pub struct KeyRing {
    db: PgPool,
    settings: KeySettings,
    issuer_url: String,
    audience: String,
    /// The keys in use: readers take a snapshot without locking; a reload swaps it whole.
    loaded: Arc<ArcSwap<Loaded>>,
    /// When an unknown `kid` last forced a reload: bounds how often made-up kids can make us
    /// query Postgres, independently of when the keys were last loaded for other reasons.
    last_forced: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl KeyRing {
    /// Loads the keys, creating the first signing key if there is none.
    #[tracing::instrument(skip_all)]
    pub async fn load(
        db: PgPool,
        settings: KeySettings,
        issuer_url: String,
        audience: String,
    ) -> Result<Self, KeyError> {
        seal_clear_seeds(&db, &settings.sealer).await?;
        let loaded = Self::fetch(&db, &settings, &issuer_url, &audience).await?;
        Ok(Self {
            db,
            settings,
            issuer_url,
            audience,
            loaded: Arc::new(ArcSwap::from_pointee(loaded)),
            last_forced: Arc::default(),
        })
    }

    async fn fetch(
        db: &PgPool,
        settings: &KeySettings,
        issuer_url: &str,
        audience: &str,
    ) -> Result<Loaded, KeyError> {
        let mut tx = db.begin().await?;
        let fresh = KeyPair::generate();
        let active = keys::ensure_active(
            &mut tx,
            &fresh.kid,
            &settings.sealer.seal(&fresh.kid, fresh.seed()),
            &fresh.verifying_key().public,
        )
        .await?;
        let grace =
            chrono::Duration::from_std(settings.retired_grace).unwrap_or(chrono::Duration::MAX);
        let rows = keys::verifying(&mut tx, Utc::now() - grace).await?;
        tx.commit().await?;
        let seed = open_seed(&settings.sealer, &active)?;
        let public = rows
            .iter()
            .map(|row| {
                Ok(VerifyingKey {
                    kid: row.kid.clone(),
                    public: row
                        .public_key
                        .as_slice()
                        .try_into()
                        .map_err(|_| KeyError::Malformed(row.kid.clone()))?,
                })
            })
            .collect::<Result<Vec<_>, KeyError>>()?;
        Ok(Loaded {
            issuer: TokenIssuer::new(KeyPair::from_seed(active.kid, seed), issuer_url),
            verifier: TokenVerifier::new(&public, issuer_url, audience)?,
            public,
            at: Instant::now(),
        })
    }

    fn current(&self) -> Arc<Loaded> {
        self.loaded.load_full()
    }

    /// Reloads from Postgres.
    #[tracing::instrument(skip_all)]
    pub async fn refresh(&self) -> Result<(), KeyError> {
        let loaded =
            Self::fetch(&self.db, &self.settings, &self.issuer_url, &self.audience).await?;
        self.loaded.store(Arc::new(loaded));
        Ok(())
    }

    /// Reloads when the loaded keys are older than the refresh period.
    #[tracing::instrument(skip_all)]
    pub async fn refresh_if_stale(&self) {
        if self.current().at.elapsed() >= REFRESH_EVERY
            && let Err(err) = self.refresh().await
        {
            tracing::warn!(error = %err, "refreshing signing keys failed; keeping the old ones");
        }
    }

    /// The issuer for new tokens.
    pub fn issuer(&self) -> TokenIssuer {
        self.current().issuer.clone()
    }

    /// The public keys, for the JWKS document.
    pub fn public_keys(&self) -> Vec<VerifyingKey> {
        self.current().public.clone()
    }

    fn may_force_refresh(&self) -> bool {
        let mut last = self.last_forced.lock().expect("key ring lock");
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < MIN_FORCED_REFRESH) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// Verifies an access token. A token signed by a key we have not loaded yet (rotated by
    /// another replica) triggers one reload before it is refused.
    #[tracing::instrument(skip_all)]
    pub async fn verify(&self, token: &str) -> Result<AccessClaims, TokenError> {
        self.refresh_if_stale().await;
        let loaded = self.current();
        match loaded.verifier.verify(token) {
            Err(TokenError::UnknownKey) if self.may_force_refresh() => {
                if let Err(err) = self.refresh().await {
                    tracing::warn!(error = %err, "reloading keys for an unknown kid failed");
                }
                self.current().verifier.verify(token)
            }
            other => other,
        }
    }
}

/// The clear seed of a stored key: opened from its sealed form (or, in a row not sealed yet,
/// as stored).
fn open_seed(sealer: &SeedSealer, row: &keys::SigningKeyRow) -> Result<[u8; 32], KeyError> {
    match (&row.sealed_seed, &row.seed) {
        (Some(sealed), _) => sealer
            .open(&row.kid, sealed)
            .ok_or_else(|| KeyError::Undecryptable(row.kid.clone())),
        (None, Some(clear)) => clear
            .as_slice()
            .try_into()
            .map_err(|_| KeyError::Malformed(row.kid.clone())),
        (None, None) => Err(KeyError::Malformed(row.kid.clone())),
    }
}

/// Seals every seed still stored in clear (rows written before seeds were sealed), in one
/// transaction: afterwards no clear seed is left in Postgres.
#[tracing::instrument(skip_all)]
pub async fn seal_clear_seeds(db: &PgPool, sealer: &SeedSealer) -> Result<usize, KeyError> {
    let mut tx = db.begin().await?;
    let rows = keys::clear_seeds(&mut tx).await?;
    for row in &rows {
        let seed = open_seed(sealer, row)?;
        keys::seal(&mut tx, &row.kid, &sealer.seal(&row.kid, &seed)).await?;
    }
    tx.commit().await?;
    if !rows.is_empty() {
        tracing::info!(
            keys = rows.len(),
            "sealed signing-key seeds stored in clear"
        );
    }
    Ok(rows.len())
}

/// Rotates the signing key: a new key signs from now on; the old ones keep verifying for
/// the settings' `retired_grace`.
#[tracing::instrument(skip_all)]
pub async fn rotate(db: &PgPool, settings: &KeySettings) -> Result<String, KeyError> {
    let fresh = KeyPair::generate();
    let mut tx = db.begin().await?;
    keys::insert_and_retire_others(
        &mut tx,
        &fresh.kid,
        &settings.sealer.seal(&fresh.kid, fresh.seed()),
        &fresh.verifying_key().public,
    )
    .await?;
    tx.commit().await?;
    Ok(fresh.kid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_open_only_with_the_same_secret_and_kid() {
        let sealer = SeedSealer::new(b"a secret of at least thirty-two characters");
        let seed = [42u8; 32];
        let sealed = sealer.seal("kid-1", &seed);
        assert!(
            !sealed.windows(32).any(|w| w == seed),
            "the seed does not appear in its sealed form"
        );
        assert_eq!(sealer.open("kid-1", &sealed), Some(seed));
        assert_eq!(sealer.open("kid-2", &sealed), None, "bound to its key id");
        let other = SeedSealer::new(b"another secret of at least thirty-two chars");
        assert_eq!(
            other.open("kid-1", &sealed),
            None,
            "another secret cannot open it"
        );
        let mut altered = sealed.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert_eq!(sealer.open("kid-1", &altered), None, "altered is refused");
        assert_eq!(
            sealer.open("kid-1", &sealed[..40]),
            None,
            "truncated is refused"
        );
        assert_eq!(sealer.open("kid-1", &[]), None);
    }
}
