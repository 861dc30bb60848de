//! Hosts outside a tenant's egress policy approved during a conversation (issue 29, its
//! optional part): a sandbox's refused CONNECT to a name becomes a request a person of the
//! tenant with the `approver` role approves or denies in the console; approved, the name and
//! port are allowed for that sandbox alone until the approval expires.
//!
//! Off unless the tenant's settings say so ([`approvals_on`]). Requests are per sandbox, host
//! and port (asking again returns the same request), at most [`MAX_PENDING_PER_SANDBOX`]
//! pending at once per sandbox and [`MAX_PENDING_PER_TENANT`] per tenant, and every query names the tenant, so another tenant's request
//! is as missing as one that never was.

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::{Acquire as _, PgConnection};
use uuid::Uuid;

use crate::StoreError;

/// Most requests one sandbox may have pending at once: past it a refused host makes none.
pub const MAX_PENDING_PER_SANDBOX: i64 = 20;

/// Most requests one tenant may have pending at once (its sandboxes together), so that many
/// conversations cannot bury the console's page.
pub const MAX_PENDING_PER_TENANT: i64 = 100;

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum ApprovalState {
    /// Nobody has decided yet.
    Pending,
    /// A person allowed it (until `expires_at`).
    Approved,
    /// A person refused it (until `expires_at`; asked again after, it is a new request).
    Denied,
}

impl ApprovalState {
    /// The stored (and shown) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Approved => "approved",
            Self::Denied => "denied",
        }
    }
}

/// One request.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Approval {
    /// Its id (in the console's link).
    pub id: Uuid,
    /// The tenant.
    pub tenant_id: Uuid,
    /// The sandbox that asked, the only one an approval lets through.
    pub sandbox_id: String,
    /// The sandbox's conversation when it asked.
    pub conversation_id: Option<String>,
    /// The name asked for (lower-case, checked as a rule's name is).
    pub host: String,
    /// The port asked for.
    pub port: i32,
    /// Where it stands.
    pub state: ApprovalState,
    /// When the sandbox (last) asked.
    pub requested_at: DateTime<Utc>,
    /// When a person decided.
    pub decided_at: Option<DateTime<Utc>>,
    /// Who decided (`user:<email>`).
    pub decided_by: Option<String>,
    /// Pending: until when it may be decided; decided: until when the decision holds.
    pub expires_at: DateTime<Utc>,
}

impl Approval {
    /// Whether it still stands at `now`.
    pub fn current(&self, now: DateTime<Utc>) -> bool {
        self.expires_at > now
    }
}

/// What asking for a host did.
#[derive(Debug, Clone, PartialEq)]
pub enum Asked {
    /// The tenant has approvals off: no request.
    Off,
    /// The sandbox has [`MAX_PENDING_PER_SANDBOX`] pending already, its tenant
    /// [`MAX_PENDING_PER_TENANT`], or the sandbox is not the tenant's: no request.
    Full,
    /// The standing request (pending, approved or denied), or the new one.
    Request(Approval),
}

/// The columns of an [`Approval`], in SQL.
macro_rules! columns {
    () => {
        "id, tenant_id, sandbox_id, conversation_id, host, port, state, requested_at, \
         decided_at, decided_by, expires_at"
    };
}

/// Whether the tenant has approvals on.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn approvals_on(conn: &mut PgConnection, tenant_id: Uuid) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar::<_, bool>(
        "SELECT approvals FROM tenant_egress_settings WHERE tenant_id = $1",
    )
    .bind(tenant_id)
    .fetch_optional(conn)
    .await?
    .unwrap_or(false))
}

/// Turns the tenant's approvals on or off. Off, pending requests are left to expire and
/// standing approvals to run out: turning off stops new ones, [`withdraw_all`] ends the others.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn set_approvals(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    on: bool,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO tenant_egress_settings (tenant_id, approvals) VALUES ($1, $2)
         ON CONFLICT (tenant_id) DO UPDATE SET approvals = EXCLUDED.approvals, updated_at = now()",
    )
    .bind(tenant_id)
    .bind(on)
    .execute(conn)
    .await?;
    Ok(())
}

/// Ends every pending request and standing approval of the tenant; how many.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn withdraw_all(conn: &mut PgConnection, tenant_id: Uuid) -> Result<u64, StoreError> {
    let done = sqlx::query(
        "UPDATE egress_approvals SET expires_at = now()
         WHERE tenant_id = $1 AND state IN ('pending', 'approved') AND expires_at > now()",
    )
    .bind(tenant_id)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Ends the tenant's pending requests and standing approvals among `ids`; how many.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn withdraw(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    let done = sqlx::query(
        "UPDATE egress_approvals SET expires_at = now()
         WHERE tenant_id = $1 AND id = ANY($2) AND state IN ('pending', 'approved')
           AND expires_at > now()",
    )
    .bind(tenant_id)
    .bind(ids)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// The sandbox's request for `host:port`: the standing one (pending, approved or denied), or a
/// new pending one open for `pending_for` (an expired one is asked again, under a new id, so
/// an old link or page never decides it), naming the sandbox's conversation. The tenant's
/// switch is read in the same transaction (shared lock: an `--approvals off` waits for it, or
/// it for the switch).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %sandbox_id, host = %host))]
pub async fn request(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    sandbox_id: &str,
    host: &str,
    port: i32,
    pending_for: TimeDelta,
) -> Result<Asked, StoreError> {
    let mut tx = conn.begin().await?;
    let on = sqlx::query_scalar::<_, bool>(
        "SELECT approvals FROM tenant_egress_settings WHERE tenant_id = $1 FOR SHARE",
    )
    .bind(tenant_id)
    .fetch_optional(&mut *tx)
    .await?
    .unwrap_or(false);
    if !on {
        tx.commit().await?;
        return Ok(Asked::Off);
    }
    // One tenant's requests are made one at a time (a lock of their own, not the sandbox's
    // row, which leases and calls update), so the caps hold.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('sandgate.egress_approvals:' || $1::text, 0))")
        .bind(tenant_id)
        .execute(&mut *tx)
        .await?;
    let Some(conversation_id) = sqlx::query_scalar::<_, Option<String>>(
        "SELECT conversation_id FROM sandboxes WHERE id = $1 AND tenant_id = $2",
    )
    .bind(sandbox_id)
    .bind(tenant_id)
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Ok(Asked::Full);
    };
    let existing = sqlx::query_as::<_, Approval>(concat!(
        "SELECT ",
        columns!(),
        " FROM egress_approvals
         WHERE tenant_id = $1 AND sandbox_id = $2 AND host = $3 AND port = $4"
    ))
    .bind(tenant_id)
    .bind(sandbox_id)
    .bind(host)
    .bind(port)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(standing) = existing.as_ref().filter(|a| a.current(Utc::now())) {
        let standing = standing.clone();
        tx.commit().await?;
        return Ok(Asked::Request(standing));
    }
    let (of_sandbox, of_tenant): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE sandbox_id = $2), count(*) FROM egress_approvals
         WHERE tenant_id = $1 AND state = 'pending' AND expires_at > now()",
    )
    .bind(tenant_id)
    .bind(sandbox_id)
    .fetch_one(&mut *tx)
    .await?;
    if of_sandbox >= MAX_PENDING_PER_SANDBOX || of_tenant >= MAX_PENDING_PER_TENANT {
        tx.commit().await?;
        return Ok(Asked::Full);
    }
    let made = sqlx::query_as::<_, Approval>(concat!(
        "INSERT INTO egress_approvals
             (id, tenant_id, sandbox_id, conversation_id, host, port, state, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, 'pending', now() + $7)
         ON CONFLICT (tenant_id, sandbox_id, host, port) DO UPDATE
         SET id = EXCLUDED.id, state = 'pending', requested_at = now(), decided_at = NULL,
             decided_by = NULL,
             conversation_id = EXCLUDED.conversation_id, expires_at = EXCLUDED.expires_at
         RETURNING ",
        columns!(),
        ""
    ))
    .bind(Uuid::new_v4())
    .bind(tenant_id)
    .bind(sandbox_id)
    .bind(conversation_id)
    .bind(host)
    .bind(port)
    .bind(pending_for)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Asked::Request(made))
}

/// The hosts and ports approved for the sandbox now, with who approved each; none while the
/// tenant has approvals off.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %sandbox_id))]
pub async fn approved(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    sandbox_id: &str,
) -> Result<Vec<(String, i32, String)>, StoreError> {
    Ok(sqlx::query_as::<_, (String, i32, String)>(
        "SELECT a.host, a.port, coalesce(a.decided_by, '') FROM egress_approvals a
         JOIN tenant_egress_settings s ON s.tenant_id = a.tenant_id AND s.approvals
         WHERE a.tenant_id = $1 AND a.sandbox_id = $2 AND a.state = 'approved'
           AND a.expires_at > now()
         ORDER BY a.host, a.port",
    )
    .bind(tenant_id)
    .bind(sandbox_id)
    .fetch_all(conn)
    .await?)
}

/// The tenant's requests, the pending first, then the newest; at most `limit`.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn list(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    limit: i64,
) -> Result<Vec<Approval>, StoreError> {
    Ok(sqlx::query_as::<_, Approval>(concat!(
        "SELECT ",
        columns!(),
        " FROM egress_approvals WHERE tenant_id = $1
         ORDER BY (state = 'pending' AND expires_at > now()) DESC, requested_at DESC, id
         LIMIT $2"
    ))
    .bind(tenant_id)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// The tenant's request `id`; `None` for one of another tenant, as for none.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, id = %id))]
pub async fn get(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: Uuid,
) -> Result<Option<Approval>, StoreError> {
    Ok(sqlx::query_as::<_, Approval>(concat!(
        "SELECT ",
        columns!(),
        " FROM egress_approvals WHERE tenant_id = $1 AND id = $2"
    ))
    .bind(tenant_id)
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// Decides the tenant's pending request `id` (`approve` or deny) as `by`, the decision
/// standing for `holds_for`; the request as decided, or `None` when it is not the tenant's,
/// not pending, expired, or the tenant has approvals off.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, id = %id))]
pub async fn decide(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: Uuid,
    approve: bool,
    by: &str,
    holds_for: TimeDelta,
) -> Result<Option<Approval>, StoreError> {
    let state = if approve {
        ApprovalState::Approved
    } else {
        ApprovalState::Denied
    };
    Ok(sqlx::query_as::<_, Approval>(concat!(
        "UPDATE egress_approvals
         SET state = $3, decided_at = now(), decided_by = $4, expires_at = now() + $5
         WHERE tenant_id = $1 AND id = $2 AND state = 'pending' AND expires_at > now()
           AND EXISTS (SELECT 1 FROM tenant_egress_settings s
                       WHERE s.tenant_id = $1 AND s.approvals)
         RETURNING ",
        columns!(),
        ""
    ))
    .bind(tenant_id)
    .bind(id)
    .bind(state)
    .bind(by)
    .bind(holds_for)
    .fetch_optional(conn)
    .await?)
}

/// Deletes every request of the tenant (`sandgate admin tenant purge`); how many.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn delete_of_tenant(conn: &mut PgConnection, tenant_id: Uuid) -> Result<u64, StoreError> {
    let done = sqlx::query("DELETE FROM egress_approvals WHERE tenant_id = $1")
        .bind(tenant_id)
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

/// Deletes the requests that ran out more than `seconds` ago (the purge job); how many.
#[tracing::instrument(skip_all)]
pub async fn purge_expired(conn: &mut PgConnection, seconds: i64) -> Result<u64, StoreError> {
    let done = sqlx::query(
        "DELETE FROM egress_approvals WHERE expires_at < now() - make_interval(secs => $1)",
    )
    .bind(seconds as f64)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}
