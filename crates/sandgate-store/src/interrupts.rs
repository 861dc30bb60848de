//! A person's interrupt for every gateway replica (migration `20261208130505_call_interrupts`):
//! [`request`] keeps the interrupt as a row and notifies [`CHANNEL`] with its id; an
//! [`InterruptListener`] hears the ids and [`get`] reads what to interrupt. The row, not the
//! payload, says what: a role that may notify but not insert (the node's) interrupts nothing.

use sqlx::PgConnection;
use sqlx::postgres::PgListener;
use uuid::Uuid;

use crate::{PgPool, StoreError};

/// The notification channel.
pub const CHANNEL: &str = "sandgate_interrupt";

/// An interrupt as kept.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct InterruptRow {
    /// The sandbox whose running calls stop.
    pub sandbox_id: String,
    /// The person who asked (their email).
    pub by_email: String,
    /// The process that asked (it interrupted its own calls already).
    pub origin: Uuid,
}

/// Keeps an interrupt of `sandbox_id`'s calls by `by` and notifies every listener, in one
/// transaction (the notification is sent at its commit); rows older than an hour go.
#[tracing::instrument(skip_all, fields(sandbox_id))]
pub async fn request(
    conn: &mut PgConnection,
    tenant: Uuid,
    sandbox_id: &str,
    by: &str,
    origin: Uuid,
) -> Result<i64, StoreError> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    sqlx::query("DELETE FROM call_interrupts WHERE created_at < now() - interval '1 hour'")
        .execute(&mut *tx)
        .await?;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO call_interrupts (tenant_id, sandbox_id, by_email, origin)
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(tenant)
    .bind(sandbox_id)
    .bind(by)
    .bind(origin)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(id.to_string())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(id)
}

/// The interrupt `id`, if it was asked for within the last minute (an old id notified again
/// interrupts nothing).
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<InterruptRow>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT sandbox_id, by_email, origin FROM call_interrupts
         WHERE id = $1 AND created_at > now() - interval '1 minute'",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// A connection listening on [`CHANNEL`].
pub struct InterruptListener(PgListener);

impl std::fmt::Debug for InterruptListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterruptListener").finish_non_exhaustive()
    }
}

impl InterruptListener {
    /// Connects and listens.
    pub async fn connect(pool: &PgPool) -> Result<Self, StoreError> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(CHANNEL).await?;
        Ok(Self(listener))
    }

    /// The next notified id (`Some(None)`: a payload that is not one). `Ok(None)`: the
    /// connection was lost and listening again now (what was notified in between is lost).
    pub async fn next(&mut self) -> Result<Option<Option<i64>>, StoreError> {
        Ok(self.0.try_recv().await?.map(|n| n.payload().parse().ok()))
    }
}
