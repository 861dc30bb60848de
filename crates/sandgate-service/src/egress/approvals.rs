//! A person's decisions on the hosts a sandbox asked for outside its tenant's egress policy
//! (the console's egress page): the tenant's requests, and approving or denying one, audited
//! under the person in the same transaction. Every call names the tenant: another tenant's
//! request is as missing as one that never was.

use sandgate_store::{PgPool, StoreError};
use uuid::Uuid;

use sandgate_store::egress_approvals as store;
pub use sandgate_store::egress_approvals::{Approval, ApprovalState, MAX_PENDING_PER_SANDBOX};

use super::relay::APPROVAL_HOLDS_FOR;

/// What deciding a request did.
#[derive(Debug, Clone, PartialEq)]
pub enum Decided {
    /// Decided now: the request as it stands.
    Now(Approval),
    /// Not pending any more (decided before, or expired): the request as it stands.
    Already(Approval),
    /// Not one of the tenant's (or none).
    Missing,
}

/// The tenant's requests, the pending first, then the newest; at most `limit`.
pub async fn list(db: &PgPool, tenant: Uuid, limit: i64) -> Result<Vec<Approval>, StoreError> {
    let mut conn = db.acquire().await?;
    store::list(&mut conn, tenant, limit).await
}

/// The tenant's request `id`.
pub async fn get(db: &PgPool, tenant: Uuid, id: Uuid) -> Result<Option<Approval>, StoreError> {
    let mut conn = db.acquire().await?;
    store::get(&mut conn, tenant, id).await
}

/// Approves (or denies) the tenant's pending request `id` as `by` (`user:<email>`), for
/// [`APPROVAL_HOLDS_FOR`], audited as `console_egress_approve` / `console_egress_deny` with
/// the host, the sandbox and the conversation, in one transaction.
pub async fn decide(
    db: &PgPool,
    tenant: Uuid,
    id: Uuid,
    approve: bool,
    by: &str,
) -> Result<Decided, StoreError> {
    let mut tx = db.begin().await?;
    let Some(request) = store::decide(&mut tx, tenant, id, approve, by, APPROVAL_HOLDS_FOR).await?
    else {
        let known = store::get(&mut tx, tenant, id).await?;
        tx.commit().await?;
        return Ok(known.map_or(Decided::Missing, Decided::Already));
    };
    let (action, verb) = if approve {
        ("console_egress_approve", "approved")
    } else {
        ("console_egress_deny", "denied")
    };
    let detail = format!(
        "{verb} {}:{} for sandbox {} (conversation {}) until {}",
        request.host,
        request.port,
        request.sandbox_id,
        request.conversation_id.as_deref().unwrap_or("-"),
        request.expires_at.format("%Y-%m-%d %H:%M UTC")
    );
    sandgate_store::audit::record_change(&mut tx, tenant, by, action, &detail).await?;
    tx.commit().await?;
    tracing::info!(%id, host = %request.host, port = request.port, sandbox_id = %request.sandbox_id, decided = verb, "egress request decided");
    Ok(Decided::Now(request))
}
