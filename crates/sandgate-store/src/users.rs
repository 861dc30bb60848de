//! Users: the people of a tenant who log in to approve apps and use the console (argon2 hashes
//! only), their roles, and their browser sessions (hashed ids).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// What a user may do in the console (stored as text in `users.role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum Role {
    /// Reads the tenant's conversations; runs nothing.
    #[default]
    Viewer,
    /// May also run cells and commands and move files in the tenant's sandboxes.
    Takeover,
    /// May also approve or deny the hosts a conversation's sandbox asked for outside the
    /// tenant's egress policy (`crate::egress_approvals`).
    Approver,
}

impl Role {
    /// The stored (and shown) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Takeover => "takeover",
            Role::Approver => "approver",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "viewer" => Some(Role::Viewer),
            "takeover" => Some(Role::Takeover),
            "approver" => Some(Role::Approver),
            _ => None,
        }
    }
}

impl Role {
    /// Whether the role may run code and move files (the takeover role's rights).
    pub fn may_act(self) -> bool {
        matches!(self, Role::Takeover | Role::Approver)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

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
    /// What the user may do in the console.
    pub role: Role,
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
         RETURNING id, tenant_id, email, password_hash, role, created_at",
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
        "SELECT id, tenant_id, email, password_hash, role, created_at FROM users WHERE lower(email) = lower($1)",
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
    /// The user's role.
    pub role: Role,
    /// When the user last proved their password in this session.
    pub authenticated_at: DateTime<Utc>,
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
        "SELECT s.user_id, u.tenant_id, u.email, u.role, s.authenticated_at, s.csrf_token, s.expires_at
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

/// Records that the session's user proved their password again (the console's confirmation).
#[tracing::instrument(skip_all)]
pub async fn reauthenticated(conn: &mut PgConnection, id_hash: &[u8]) -> Result<(), StoreError> {
    sqlx::query("UPDATE user_sessions SET authenticated_at = now() WHERE id_hash = $1")
        .bind(id_hash)
        .execute(conn)
        .await?;
    Ok(())
}

/// Sets the role of the user with this email (case-insensitive); the user, or `None` when
/// there is none.
#[tracing::instrument(skip_all)]
pub async fn set_role(
    conn: &mut PgConnection,
    email: &str,
    role: Role,
) -> Result<Option<User>, StoreError> {
    Ok(sqlx::query_as::<_, User>(
        "UPDATE users SET role = $2 WHERE lower(email) = lower($1)
         RETURNING id, tenant_id, email, password_hash, role, created_at",
    )
    .bind(email)
    .bind(role)
    .fetch_optional(conn)
    .await?)
}

/// Ends every session of the user with this email (a stolen cookie stops working at once);
/// how many ended, or `None` when there is no such user.
#[tracing::instrument(skip_all)]
pub async fn revoke_sessions(
    conn: &mut PgConnection,
    email: &str,
) -> Result<Option<u64>, StoreError> {
    let Some(user) = by_email(conn, email).await? else {
        return Ok(None);
    };
    let done = sqlx::query("DELETE FROM user_sessions WHERE user_id = $1")
        .bind(user.id)
        .execute(conn)
        .await?;
    Ok(Some(done.rows_affected()))
}
