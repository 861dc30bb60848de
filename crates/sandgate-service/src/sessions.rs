//! MCP sessions (2025-11-25 era, `Mcp-Session-Id`) belong to the principal that opened them:
//! tenant, subject and OAuth client, recorded at `initialize`. A request that carries a session
//! id with another principal's token is answered as if the session did not exist.
//!
//! The binding lives in Postgres (`mcp_sessions`) so every replica can check it, keyed by
//! HMAC-SHA256 of the session id under a key derived from `keys.secret` (the configuration
//! every replica shares): the id itself never reaches Postgres, and the
//! legacy era's conversation key is that hash too. Each open session takes one of its tenant's
//! `max_sessions` slots until it is closed (DELETE) or unused for `mcp.session_idle_seconds`.
//!
//! A binding never changes owner, so this process remembers the ones it has seen (bounded LRU):
//! checking the owner of a session this process served costs no round trip. A session it has
//! not seen (opened on another replica) is read from Postgres once.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use hmac::{Hmac, Mac};
use sandgate_store::mcp_session_states;
use sandgate_store::mcp_sessions::{self, SessionOwner};
use sandgate_store::{PgPool, StoreError};
use sha2::Sha256;

/// Sessions remembered by this process (about 200 bytes each).
const CACHE_SESSIONS: usize = 50_000;

/// The keyed hash of a session id: what Postgres and the audit trail see instead of the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionHash([u8; 32]);

impl SessionHash {
    /// The conversation key of the session's calls (when they name no conversation).
    pub fn conversation_key(&self) -> String {
        format!("mcp-session:{}", hex::encode(self.0))
    }
}

/// The principal a request acts for.
pub type Principal = SessionOwner;

/// Why a session could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The tenant has `max_sessions` open sessions already.
    #[error(
        "limit reached: max_sessions ({max}): this tenant has {max} open MCP sessions; close \
         one (DELETE /mcp with its Mcp-Session-Id) or wait until an idle one ends, then retry \
         in {retry_after_seconds} s"
    )]
    OverCap {
        /// The limit.
        max: u32,
        /// When a retry may fit, seconds.
        retry_after_seconds: u32,
    },
    /// Postgres failed (or is away): the binding could not be recorded or checked.
    #[error("the session's owner could not be recorded or checked")]
    Store(#[from] StoreError),
}

/// What [`SessionBindings::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// The session is the caller's.
    Owner,
    /// No such session, or another principal's: the same answer.
    NotFound,
}

#[derive(Debug)]
struct Seen {
    owner: SessionOwner,
    renewed: Instant,
}

/// The session bindings. Cheap to clone.
#[derive(Clone)]
pub struct SessionBindings {
    db: PgPool,
    key: Arc<[u8; 32]>,
    idle: Duration,
    seen: Arc<Mutex<lru::LruCache<SessionHash, Seen>>>,
}

impl std::fmt::Debug for SessionBindings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionBindings")
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

impl SessionBindings {
    /// Bindings in `db`, hashing ids with a key derived from `secret` for this purpose only;
    /// a session unused for `idle` ends.
    pub fn new(db: PgPool, secret: &[u8], idle: Duration) -> Self {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
        mac.update(b"sandgate mcp session ids v1");
        Self {
            db,
            key: Arc::new(mac.finalize().into_bytes().into()),
            idle,
            seen: Arc::new(Mutex::new(lru::LruCache::new(
                NonZeroUsize::new(CACHE_SESSIONS).expect("non-zero"),
            ))),
        }
    }

    /// The keyed hash of a session id.
    pub fn hash(&self, session_id: &[u8]) -> SessionHash {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key[..]).expect("any key length");
        mac.update(session_id);
        SessionHash(mac.finalize().into_bytes().into())
    }

    /// Records `owner` as the owner of a session just opened, unless its tenant is at
    /// `max_sessions` (checked and recorded atomically across replicas).
    #[tracing::instrument(skip_all, fields(tenant_id = %owner.tenant_id))]
    pub async fn bind(
        &self,
        session: SessionHash,
        owner: &Principal,
        max_sessions: u32,
    ) -> Result<(), SessionError> {
        let expires = Utc::now() + self.idle;
        let mut tx = self.db.begin().await.map_err(StoreError::from)?;
        let bound =
            mcp_sessions::bind_under_cap(&mut tx, &session.0, owner, max_sessions, expires).await?;
        tx.commit().await.map_err(StoreError::from)?;
        if !bound {
            return Err(SessionError::OverCap {
                max: max_sessions,
                retry_after_seconds: 1,
            });
        }
        self.remember(session, owner.clone());
        Ok(())
    }

    /// Whether `caller` owns the session. An owner's use renews the session's life (at most
    /// every few seconds, in the background).
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant_id))]
    pub async fn check(
        &self,
        session: SessionHash,
        caller: &Principal,
    ) -> Result<Ownership, SessionError> {
        let renew_every = (self.idle / 4).min(Duration::from_secs(60));
        let known = {
            let mut seen = self.seen.lock().expect("session cache");
            seen.get_mut(&session).map(|s| {
                let due = s.renewed.elapsed() >= renew_every;
                let owner = s.owner.clone();
                if due && owner == *caller {
                    s.renewed = Instant::now();
                }
                (owner, due)
            })
        };
        let owner = match known {
            Some((owner, due)) => {
                if owner == *caller && due {
                    self.renew_later(session);
                }
                owner
            }
            None => {
                let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
                let Some(owner) = mcp_sessions::owner(&mut conn, &session.0).await? else {
                    return Ok(Ownership::NotFound);
                };
                drop(conn);
                self.remember(session, owner.clone());
                owner
            }
        };
        Ok(if owner == *caller {
            Ownership::Owner
        } else {
            Ownership::NotFound
        })
    }

    /// Forgets a session its owner closed: its slot is free.
    #[tracing::instrument(skip_all)]
    pub async fn forget(&self, session: SessionHash) -> Result<(), SessionError> {
        self.seen.lock().expect("session cache").pop(&session);
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        mcp_sessions::delete(&mut conn, &session.0).await?;
        Ok(())
    }

    /// Records what another replica needs to take the session over (rmcp's session state: the
    /// client's `initialize` parameters, as JSON), under the session's keyed hash.
    #[tracing::instrument(skip_all)]
    pub async fn save_state(
        &self,
        session: SessionHash,
        state: &serde_json::Value,
    ) -> Result<(), SessionError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        mcp_session_states::save(&mut conn, &session.0, state).await?;
        Ok(())
    }

    /// The state [`Self::save_state`] recorded, while the session is open; `None` for a closed,
    /// expired or unknown session (rmcp then answers 404 and the client starts a new one).
    #[tracing::instrument(skip_all)]
    pub async fn load_state(
        &self,
        session: SessionHash,
    ) -> Result<Option<serde_json::Value>, SessionError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        Ok(mcp_session_states::load(&mut conn, &session.0).await?)
    }

    /// Forgets a session's state (it was closed, or refused at its tenant's cap).
    #[tracing::instrument(skip_all)]
    pub async fn delete_state(&self, session: SessionHash) -> Result<(), SessionError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        mcp_session_states::delete(&mut conn, &session.0).await?;
        Ok(())
    }

    fn remember(&self, session: SessionHash, owner: SessionOwner) {
        self.seen.lock().expect("session cache").put(
            session,
            Seen {
                owner,
                renewed: Instant::now(),
            },
        );
    }

    fn renew_later(&self, session: SessionHash) {
        let (db, expires) = (self.db.clone(), Utc::now() + self.idle);
        tokio::spawn(async move {
            let renewed = async {
                let mut conn = db.acquire().await?;
                mcp_sessions::renew(&mut conn, &session.0, expires).await
            }
            .await;
            if let Err(err) = renewed {
                tracing::warn!(error = %err, "renewing an MCP session's binding failed");
            }
        });
    }
}
