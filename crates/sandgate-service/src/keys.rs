//! The key ring: the signing key for new access tokens and every key that still verifies,
//! loaded from Postgres and refreshed so that a rotation by any replica is seen by all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use chrono::Utc;
use sandgate_auth::{AccessClaims, KeyPair, TokenError, TokenIssuer, TokenVerifier, VerifyingKey};
use sandgate_store::{PgPool, StoreError, keys};

/// How long a retired key keeps verifying: longer than any access token lives.
pub const RETIRED_KEY_GRACE: Duration = Duration::from_secs(24 * 3600);
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
    pub async fn load(db: PgPool, issuer_url: String, audience: String) -> Result<Self, KeyError> {
        let loaded = Self::fetch(&db, &issuer_url, &audience).await?;
        Ok(Self {
            db,
            issuer_url,
            audience,
            loaded: Arc::new(ArcSwap::from_pointee(loaded)),
            last_forced: Arc::default(),
        })
    }

    async fn fetch(db: &PgPool, issuer_url: &str, audience: &str) -> Result<Loaded, KeyError> {
        let mut tx = db.begin().await?;
        let fresh = KeyPair::generate();
        let active = keys::ensure_active(
            &mut tx,
            &fresh.kid,
            fresh.seed(),
            &fresh.verifying_key().public,
        )
        .await?;
        let rows = keys::verifying(&mut tx, Utc::now() - RETIRED_KEY_GRACE).await?;
        tx.commit().await?;
        let seed: [u8; 32] = active
            .seed
            .as_slice()
            .try_into()
            .map_err(|_| KeyError::Malformed(active.kid.clone()))?;
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
        let loaded = Self::fetch(&self.db, &self.issuer_url, &self.audience).await?;
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

/// Rotates the signing key: a new key signs from now on; the old ones keep verifying for
/// [`RETIRED_KEY_GRACE`].
#[tracing::instrument(skip_all)]
pub async fn rotate(db: &PgPool) -> Result<String, KeyError> {
    let fresh = KeyPair::generate();
    let mut tx = db.begin().await?;
    keys::insert_and_retire_others(
        &mut tx,
        &fresh.kid,
        fresh.seed(),
        &fresh.verifying_key().public,
    )
    .await?;
    tx.commit().await?;
    Ok(fresh.kid)
}
