//! The audit trail: one event per tool call (who, which sandbox, outcome, duration), one per
//! operator change of a tenant's egress (what changed: `detail`), and one per egress connection
//! of a sandbox (target, outcome, bytes: `detail`).
//! Never the code, its output, file contents or tokens.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// One audited tool call.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AuditEvent {
    /// When the call ended.
    pub at: DateTime<Utc>,
    /// The caller's tenant.
    pub tenant_id: Uuid,
    /// The access token's `jti`.
    pub token_id: Option<String>,
    /// The token's subject.
    pub subject: Option<String>,
    /// The conversation, if one was named or bound.
    pub conversation_id: Option<String>,
    /// The sandbox the call reached, if any.
    pub sandbox_id: Option<String>,
    /// Tool name.
    pub tool: String,
    /// How the call ended.
    pub outcome: Outcome,
    /// A short machine-readable error kind, when not ok.
    pub error_kind: Option<ErrorKind>,
    /// How long the call took.
    pub duration_ms: i32,
}

/// How a tool call ended (stored as text in `audit_events.outcome`; also a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum Outcome {
    /// The call did what was asked.
    Ok,
    /// The user's code or command failed (the tool worked).
    UserError,
    /// Refused: bad input, a limit, a missing or ended sandbox.
    Refused,
    /// sandgate failed (database, Docker, the agent).
    Failed,
    /// The client cancelled the call.
    Cancelled,
}

impl Outcome {
    /// The stored (and shown) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::UserError => "user_error",
            Outcome::Refused => "refused",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// Why a tool call did not succeed, machine-readable (stored as text in
/// `audit_events.error_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum ErrorKind {
    /// The call's arguments were malformed.
    InvalidParams,
    /// The client cancelled the call.
    Cancelled,
    /// No such sandbox for the tenant.
    NotFound,
    /// The sandbox had ended.
    Ended,
    /// The sandbox's container was lost.
    Lost,
    /// A tenant limit refused the call.
    Limit,
    /// Over the tenant's calls per minute.
    RateLimited,
    /// Over the tenant's calls in flight.
    CallsInFlight,
    /// Over the sandbox's concurrent calls.
    SandboxBusy,
    /// Over the tenant's open MCP sessions (refused at `initialize`).
    SessionLimit,
    /// Postgres was unavailable.
    Unavailable,
    /// Another database failure.
    Internal,
    /// The agent in the sandbox refused the operation (a bad path, a missing file).
    SandboxRefused,
    /// The sandbox manager failed.
    Sandbox,
    /// The token lacks the scope the tool needs (refused before the tool ran).
    InsufficientScope,
    /// The request's body was over the limit (refused before the tool ran).
    RequestTooLarge,
}

impl ErrorKind {
    /// The stored (and shown) name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidParams => "invalid_params",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Ended => "ended",
            ErrorKind::Lost => "lost",
            ErrorKind::Limit => "limit",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::CallsInFlight => "calls_in_flight",
            ErrorKind::SandboxBusy => "sandbox_busy",
            ErrorKind::SessionLimit => "session_limit",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Internal => "internal",
            ErrorKind::SandboxRefused => "sandbox_refused",
            ErrorKind::Sandbox => "sandbox",
            ErrorKind::InsufficientScope => "insufficient_scope",
            ErrorKind::RequestTooLarge => "request_too_large",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// Appends an event (its `at` is set by the database).
#[tracing::instrument(skip_all, fields(tenant_id = %event.tenant_id, tool = %event.tool))]
pub async fn record(conn: &mut PgConnection, event: &AuditEvent) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO audit_events (tenant_id, token_id, subject, conversation_id, sandbox_id, tool,
                                   outcome, error_kind, duration_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(event.tenant_id)
    .bind(&event.token_id)
    .bind(&event.subject)
    .bind(&event.conversation_id)
    .bind(&event.sandbox_id)
    .bind(&event.tool)
    .bind(event.outcome)
    .bind(event.error_kind)
    .bind(event.duration_ms)
    .execute(conn)
    .await?;
    Ok(())
}

/// Appends `events` in one statement, each with its own `at` (when its call ended), in order.
/// Audit rows are the record of what happened, so this commit waits for the WAL like any other.
#[tracing::instrument(skip_all, fields(events = events.len()))]
pub async fn record_batch(
    conn: &mut PgConnection,
    events: &[AuditEvent],
) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    let mut insert = sqlx::QueryBuilder::<sqlx::Postgres>::new(
        "INSERT INTO audit_events (at, tenant_id, token_id, subject, conversation_id, sandbox_id,
                                   tool, outcome, error_kind, duration_ms) ",
    );
    insert.push_values(events, |mut row, event| {
        row.push_bind(event.at)
            .push_bind(event.tenant_id)
            .push_bind(&event.token_id)
            .push_bind(&event.subject)
            .push_bind(&event.conversation_id)
            .push_bind(&event.sandbox_id)
            .push_bind(&event.tool)
            .push_bind(event.outcome)
            .push_bind(event.error_kind)
            .push_bind(event.duration_ms);
    });
    insert.build().execute(conn).await?;
    Ok(())
}

/// A tenant's most recent events, newest first.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn recent(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    limit: i64,
) -> Result<Vec<AuditEvent>, StoreError> {
    Ok(sqlx::query_as::<_, AuditEvent>(
        "SELECT at, tenant_id, token_id, subject, conversation_id, sandbox_id, tool, outcome,
                error_kind, duration_ms
         FROM audit_events WHERE tenant_id = $1 ORDER BY at DESC, id DESC LIMIT $2",
    )
    .bind(tenant_id)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// An audit event as the trail shows it: the event, and what an operator's change was.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AuditLine {
    /// The event.
    #[sqlx(flatten)]
    pub event: AuditEvent,
    /// For an operator's change (`sandgate admin …`), what changed; `None` for a tool call.
    pub detail: Option<String>,
}

/// Appends an operator's change of `tenant_id`'s settings (`action`, e.g.
/// `admin_tenant_secret_set`, in the event's tool column), by `subject`, with what changed. The
/// caller keeps secret values out of `detail`.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, action = %action))]
pub async fn record_change(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    subject: &str,
    action: &str,
    detail: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO audit_events (tenant_id, subject, tool, outcome, duration_ms, detail)
         VALUES ($1, $2, $3, 'ok', 0, $4)",
    )
    .bind(tenant_id)
    .bind(subject)
    .bind(action)
    .bind(detail)
    .execute(conn)
    .await?;
    Ok(())
}

/// One connection a sandbox made (or tried to make) through the egress component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressConnection {
    /// The sandbox's tenant.
    pub tenant_id: Uuid,
    /// The sandbox.
    pub sandbox_id: String,
    /// `ok` for a connection made, `refused` for one the policy or the checks refused, `failed`
    /// for one the server did not accept.
    pub outcome: Outcome,
    /// How long it was open (or how long deciding took), in milliseconds.
    pub duration_ms: i32,
    /// The target, the outcome in words and the bytes each way (never what they carried).
    pub detail: String,
}

/// Appends an egress connection, as the event `egress_connect` of the sandbox's tenant.
#[tracing::instrument(skip_all, fields(tenant_id = %connection.tenant_id, sandbox_id = %connection.sandbox_id))]
pub async fn record_egress(
    conn: &mut PgConnection,
    connection: &EgressConnection,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO audit_events (tenant_id, sandbox_id, tool, outcome, duration_ms, detail)
         VALUES ($1, $2, 'egress_connect', $3, $4, $5)",
    )
    .bind(connection.tenant_id)
    .bind(&connection.sandbox_id)
    .bind(connection.outcome)
    .bind(connection.duration_ms)
    .bind(&connection.detail)
    .execute(conn)
    .await?;
    Ok(())
}

/// [`recent`] with each event's detail.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn recent_lines(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    limit: i64,
) -> Result<Vec<AuditLine>, StoreError> {
    Ok(sqlx::query_as::<_, AuditLine>(
        "SELECT at, tenant_id, token_id, subject, conversation_id, sandbox_id, tool, outcome,
                error_kind, duration_ms, detail
         FROM audit_events WHERE tenant_id = $1 ORDER BY at DESC, id DESC LIMIT $2",
    )
    .bind(tenant_id)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// The audit tables a retention period applies to, each with a `bigserial` id and an `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuditTable {
    /// `audit_events`: one row per tool call.
    ToolCalls,
    /// `download_events`: one row per opening of a download link.
    Downloads,
    /// `package_installs`: one row per wheel handed to a sandbox.
    PackageInstalls,
}

impl AuditTable {
    fn name(self) -> &'static str {
        match self {
            AuditTable::ToolCalls => "audit_events",
            AuditTable::Downloads => "download_events",
            AuditTable::PackageInstalls => "package_installs",
        }
    }

    /// The batch purge of this table (`$1`: the period, seconds; `$2`: the batch size).
    fn purge_sql(self) -> &'static str {
        match self {
            AuditTable::ToolCalls => {
                "DELETE FROM audit_events WHERE id IN (
                     SELECT id FROM audit_events
                     WHERE at < now() - make_interval(secs => $1::double precision) LIMIT $2)"
            }
            AuditTable::Downloads => {
                "DELETE FROM download_events WHERE id IN (
                     SELECT id FROM download_events
                     WHERE at < now() - make_interval(secs => $1::double precision) LIMIT $2)"
            }
            AuditTable::PackageInstalls => {
                "DELETE FROM package_installs WHERE id IN (
                     SELECT id FROM package_installs
                     WHERE at < now() - make_interval(secs => $1::double precision) LIMIT $2)"
            }
        }
    }
}

/// Deletes at most `batch` rows of `table` older than `seconds`; returns how many it deleted. Callers repeat it while it deletes a whole batch, so that a first purge of a
/// large table never holds one long transaction.
#[tracing::instrument(skip_all, fields(table = table.name()))]
pub async fn purge_older_than(
    conn: &mut PgConnection,
    table: AuditTable,
    seconds: i64,
    batch: i64,
) -> Result<u64, StoreError> {
    let done = sqlx::query(table.purge_sql())
        .bind(seconds)
        .bind(batch)
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}
