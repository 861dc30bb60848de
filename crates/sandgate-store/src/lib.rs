//! Postgres access for sandgate.
//!
//! The database is the source of truth for who owns which sandbox. Functions here take a
//! `&mut PgConnection` (or a transaction deref'd to one) so the caller decides the transaction
//! boundary; they take and return plain domain types and know nothing of HTTP or Docker.

use std::time::Duration;

pub use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
pub use sqlx::{PgConnection, PgPool, Postgres, Transaction};

pub mod admin_tokens;
pub mod audit;
pub mod call_marks;
pub mod changes;
pub mod clients;
pub mod conversations;
pub mod downloads;
pub mod egress;
pub mod egress_approvals;
pub mod erasure;
pub mod grants;
pub mod hygiene;
pub mod interrupts;
pub mod keys;
pub mod mcp_session_states;
pub mod mcp_sessions;
pub mod nodes;
pub mod packages;
pub mod pauses;
pub mod quotas;
pub mod sandboxes;
pub mod schema;
pub mod snapshots;
pub mod tenants;
pub mod transcripts;
pub mod users;

/// What went wrong talking to Postgres.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached (or stopped answering); retrying later may work.
    #[error("database unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// The TLS handshake with Postgres failed: its certificate is not trusted by the CA bundle
    /// (`sslrootcert`), names another host than the URL's (`sslmode=verify-full`), or the
    /// server does not speak TLS. Retrying will not help until the URL or the server changes.
    #[error(
        "the TLS handshake with Postgres failed (check database.url's sslmode and sslrootcert, \
         and that the server's certificate names the URL's host)"
    )]
    Tls(#[source] sqlx::Error),
    /// A query failed for another reason.
    #[error("database query failed")]
    Query(#[source] sqlx::Error),
    /// Applying migrations failed.
    #[error("applying database migrations failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// A row that must exist did not.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// A uniqueness rule refused the change.
    #[error("{0}")]
    Conflict(&'static str),
}

impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        match err {
            sqlx::Error::Tls(_) => StoreError::Tls(err),
            // rustls reports a refused certificate as an I/O error of the handshake.
            sqlx::Error::Io(ref io) if is_tls_refusal(io) => StoreError::Tls(err),
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable(err),
            other => StoreError::Query(other),
        }
    }
}

/// Whether an I/O error is rustls refusing the server's certificate (or another TLS alert).
fn is_tls_refusal(io: &std::io::Error) -> bool {
    io.get_ref()
        .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
}

impl StoreError {
    /// The error of applying migrations: the database's errors sorted as queries' are.
    pub fn from_migrate(err: sqlx::migrate::MigrateError) -> Self {
        match err {
            sqlx::migrate::MigrateError::Execute(inner) => match StoreError::from(inner) {
                StoreError::Query(inner) => {
                    StoreError::Migrate(sqlx::migrate::MigrateError::Execute(inner))
                }
                other => other,
            },
            other => StoreError::Migrate(other),
        }
    }

    /// True when the failure is the database being away rather than the query being wrong:
    /// callers turn these into retryable errors.
    pub fn is_unavailable(&self) -> bool {
        // A refused TLS handshake is Postgres out of reach too (a 503, not an internal error).
        matches!(self, StoreError::Unavailable(_) | StoreError::Tls(_))
    }
}

/// Settings for the connection pool.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// Most connections the pool opens.
    pub max_connections: u32,
    /// How long a caller waits for a connection before failing fast.
    pub acquire_timeout: Duration,
}

/// A pooled connection idle for longer than this is checked (one round trip) before it is
/// handed out; one used more recently is handed out as it is.
pub const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// Opens a lazily connecting pool: the gateway starts (and reports not ready) even while
/// Postgres is down, and recovers by itself when it returns.
pub fn connect_lazy(url: &str, settings: &PoolSettings) -> Result<PgPool, StoreError> {
    let options: PgConnectOptions = url.parse().map_err(StoreError::Query)?;
    Ok(PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        // A connection that died while Postgres was away must not be handed out again: one
        // idle for a while is pinged first. sqlx's `test_before_acquire` would ping every time,
        // a round trip before every statement of every call (two on an `execute_code`'s
        // path); a connection used within the last [`PING_IF_IDLE_FOR`] is taken as alive.
        // Should it have died in that moment (Postgres restarted), its statement fails as
        // `Unavailable` ("retry in a moment") and sqlx closes it.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > PING_IF_IDLE_FOR {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .connect_lazy_with(options))
}

/// A connection from the pool; failing to get one is a [`StoreError`] like any query's.
pub async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>, StoreError> {
    Ok(pool.acquire().await?)
}

/// Begins a transaction on a connection from the pool.
pub async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, StoreError> {
    Ok(pool.begin().await?)
}

/// Commits `tx`.
pub async fn commit(tx: Transaction<'_, Postgres>) -> Result<(), StoreError> {
    Ok(tx.commit().await?)
}

/// Applies the migrations in the repository's `migrations/` folder (embedded at build time);
/// see [`schema::migrate`].
pub async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    schema::migrate(pool).await
}

/// Checks that Postgres answers a trivial query.
#[tracing::instrument(skip_all)]
pub async fn ping(pool: &PgPool) -> Result<(), StoreError> {
    sqlx::query("SELECT 1").execute(pool).await?;
    Ok(())
}
