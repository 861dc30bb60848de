//! The audit trail: typed outcomes round-trip.

use chrono::Utc;
use sandgate_store::audit::{self, AuditEvent, ErrorKind, Outcome};
use sandgate_store::tenants;
use uuid::Uuid;

use crate::support::TestDb;

fn event(tenant_id: Uuid, outcome: Outcome, error_kind: Option<ErrorKind>) -> AuditEvent {
    AuditEvent {
        at: Utc::now(),
        tenant_id,
        token_id: Some("jti-1".into()),
        subject: Some("user-1".into()),
        conversation_id: None,
        sandbox_id: Some("sbx_1".into()),
        tool: "execute_code".into(),
        outcome,
        error_kind,
        duration_ms: 12,
    }
}

#[tokio::test]
async fn events_keep_their_outcome_and_error_kind() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    let other = tenants::create(&mut conn, "other").await.unwrap();
    audit::record(&mut conn, &event(tenant.id, Outcome::Ok, None))
        .await
        .unwrap();
    audit::record(
        &mut conn,
        &event(tenant.id, Outcome::Refused, Some(ErrorKind::SandboxRefused)),
    )
    .await
    .unwrap();
    audit::record(
        &mut conn,
        &event(other.id, Outcome::Failed, Some(ErrorKind::Unavailable)),
    )
    .await
    .unwrap();

    let recent = audit::recent(&mut conn, tenant.id, 10).await.unwrap();
    let seen: Vec<(Outcome, Option<ErrorKind>)> =
        recent.iter().map(|e| (e.outcome, e.error_kind)).collect();
    assert_eq!(
        seen,
        vec![
            (Outcome::Refused, Some(ErrorKind::SandboxRefused)),
            (Outcome::Ok, None)
        ],
        "newest first, and only this tenant's"
    );
    // Stored as the names operators and dashboards read.
    let stored: (String, Option<String>) = sqlx::query_as(
        "SELECT outcome, error_kind FROM audit_events WHERE tenant_id = $1 AND outcome <> 'ok'",
    )
    .bind(tenant.id)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(stored, ("refused".into(), Some("sandbox_refused".into())));
    drop(conn);
    db.drop_db().await;
}
