//! Bounds on what anonymous callers can make the database hold (issue 11): account lockout
//! after repeated failed sign-ins, the cap on dynamic clients that never completed a flow, and
//! the purge of what has expired.
//!
//! A dynamic client (`dcr` or `cimd`) has *completed a flow* once a user approved it: a grant
//! references it (a revoked grant still counts).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// Dynamic clients with no grant, as a SQL condition on `c`.
const UNUSED_DYNAMIC: &str = "c.kind IN ('dcr', 'cimd')
     AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.client_id = c.id)";

/// When the user's lockout ends, if it is locked now.
#[tracing::instrument(skip_all, fields(%user_id))]
pub async fn locked_until(
    conn: &mut PgConnection,
    user_id: Uuid,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    Ok(sqlx::query_scalar::<_, Option<DateTime<Utc>>>(
        "SELECT locked_until FROM users WHERE id = $1 AND locked_until > now()",
    )
    .bind(user_id)
    .fetch_optional(conn)
    .await?
    .flatten())
}

/// How failed sign-ins lock an account.
#[derive(Debug, Clone, Copy)]
pub struct Lockout {
    /// Consecutive failures that lock the account.
    pub after_failures: i32,
    /// The first lock's length, seconds; each further failure doubles it.
    pub base_seconds: i64,
    /// The longest lock, seconds.
    pub max_seconds: i64,
}

/// Counts a failed sign-in; returns the end of the lock it started, if it started one.
#[tracing::instrument(skip_all, fields(%user_id))]
pub async fn record_failed_login(
    conn: &mut PgConnection,
    user_id: Uuid,
    rule: Lockout,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    Ok(sqlx::query_scalar::<_, Option<DateTime<Utc>>>(
        "UPDATE users SET failed_logins = failed_logins + 1,
             locked_until = CASE WHEN failed_logins + 1 >= $2
                 THEN now() + make_interval(secs => LEAST($4::float8,
                     $3::float8 * power(2, LEAST(failed_logins + 1 - $2, 30))))
                 ELSE locked_until END
         WHERE id = $1
         RETURNING CASE WHEN locked_until > now() THEN locked_until END",
    )
    .bind(user_id)
    .bind(rule.after_failures)
    .bind(rule.base_seconds)
    .bind(rule.max_seconds)
    .fetch_optional(conn)
    .await?
    .flatten())
}

/// A successful sign-in: the failure count starts again.
#[tracing::instrument(skip_all, fields(%user_id))]
pub async fn clear_failed_logins(conn: &mut PgConnection, user_id: Uuid) -> Result<(), StoreError> {
    sqlx::query("UPDATE users SET failed_logins = 0, locked_until = NULL WHERE id = $1 AND failed_logins > 0")
        .bind(user_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Makes room for one more dynamic client: deletes the oldest dynamic clients that never
/// completed a flow beyond the newest `cap - 1` of them. Returns how many were evicted.
#[tracing::instrument(skip_all, fields(cap))]
pub async fn evict_unused_clients(conn: &mut PgConnection, cap: i64) -> Result<u64, StoreError> {
    Ok(sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM oauth_clients WHERE id IN (
             SELECT c.id FROM oauth_clients c WHERE {UNUSED_DYNAMIC}
             ORDER BY c.created_at DESC OFFSET GREATEST($1 - 1, 0))"
    )))
    .bind(cap)
    .execute(conn)
    .await?
    .rows_affected())
}

/// What one purge removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Expired authorization codes.
    pub codes: u64,
    /// Expired login sessions.
    pub sessions: u64,
    /// Expired refresh tokens.
    pub refresh_tokens: u64,
    /// Revocation records of access tokens that have expired anyway.
    pub revoked_access_tokens: u64,
    /// Dynamic clients older than the cut-off that never completed a flow.
    pub unused_clients: u64,
}

/// Deletes what has expired, and dynamic clients created before `unused_before` that never
/// completed a flow.
#[tracing::instrument(skip_all)]
pub async fn purge(
    conn: &mut PgConnection,
    unused_before: DateTime<Utc>,
) -> Result<Purged, StoreError> {
    let mut purged = Purged::default();
    let mut delete = async |sql: &str| -> Result<u64, StoreError> {
        Ok(sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut *conn)
            .await?
            .rows_affected())
    };
    purged.codes = delete("DELETE FROM auth_codes WHERE expires_at < now()").await?;
    purged.sessions = delete("DELETE FROM user_sessions WHERE expires_at < now()").await?;
    purged.refresh_tokens = delete("DELETE FROM refresh_tokens WHERE expires_at < now()").await?;
    purged.revoked_access_tokens =
        delete("DELETE FROM revoked_access_tokens WHERE expires_at < now()").await?;
    purged.unused_clients = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM oauth_clients c WHERE {UNUSED_DYNAMIC} AND c.created_at < $1"
    )))
    .bind(unused_before)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(purged)
}
