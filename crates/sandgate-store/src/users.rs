//! Users: the people of a tenant who log in to approve apps (argon2 hashes only) and their
//! browser sessions (hashed ids).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// A user row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct User {
    /// Id.
    pub id: Uuid,
    /// The tenant the user belongs to.
    pub tenant_id: Uuid,
    /// Login email.
    pub email: String,
    /// argon2id PHC string.
    pub password_hash: String,
    /// When created.
    pub created_at: DateTime<Utc>,
}

/// Creates a user. `Conflict` when the email is taken.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn create(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    email: &str,
    password_hash: &str,
) -> Result<User, StoreError> {
    sqlx::query_as::<_, User>(
        "INSERT INTO users (id, tenant_id, email, password_hash) VALUES ($1, $2, $3, $4)
         RETURNING id, tenant_id, email, password_hash, created_at",
    )
    .bind(Uuid::now_v7())
    .bind(tenant_id)
    .bind(email)
    .bind(password_hash)
    .fetch_one(conn)
    .await
    .map_err(|err| match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => {
            StoreError::Conflict("a user with that email exists already")
        }
        _ => StoreError::from(err),
    })
}

/// Finds a user by email (case-insensitive).
#[tracing::instrument(skip_all)]
pub async fn by_email(conn: &mut PgConnection, email: &str) -> Result<Option<User>, StoreError> {
    Ok(sqlx::query_as::<_, User>(
        "SELECT id, tenant_id, email, password_hash, created_at FROM users WHERE lower(email) = lower($1)",
    )
    .bind(email)
    .fetch_optional(conn)
    .await?)
}

/// A live browser session with its user.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Session {
    /// The user.
    pub user_id: Uuid,
    /// The user's tenant.
    pub tenant_id: Uuid,
    /// The user's email.
    pub email: String,
    /// The session's CSRF token (forms carry it back).
    pub csrf_token: String,
    /// When it ends.
    pub expires_at: DateTime<Utc>,
}

/// Records a session (the caller keeps the secret; only its hash is stored).
#[tracing::instrument(skip_all)]
pub async fn create_session(
    conn: &mut PgConnection,
    id_hash: &[u8],
    user_id: Uuid,
    csrf_token: &str,
    expires_at: DateTime<Utc>,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO user_sessions (id_hash, user_id, csrf_token, expires_at) VALUES ($1, $2, $3, $4)",
    )
    .bind(id_hash)
    .bind(user_id)
    .bind(csrf_token)
    .bind(expires_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// The unexpired session with this id hash, if any.
#[tracing::instrument(skip_all)]
pub async fn session(
    conn: &mut PgConnection,
    id_hash: &[u8],
) -> Result<Option<Session>, StoreError> {
    Ok(sqlx::query_as::<_, Session>(
        "SELECT s.user_id, u.tenant_id, u.email, s.csrf_token, s.expires_at
         FROM user_sessions s JOIN users u ON u.id = s.user_id
         WHERE s.id_hash = $1 AND s.expires_at > now()",
    )
    .bind(id_hash)
    .fetch_optional(conn)
    .await?)
}

/// Ends a session (logout).
#[tracing::instrument(skip_all)]
pub async fn delete_session(conn: &mut PgConnection, id_hash: &[u8]) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM user_sessions WHERE id_hash = $1")
        .bind(id_hash)
        .execute(conn)
        .await?;
    Ok(())
}
