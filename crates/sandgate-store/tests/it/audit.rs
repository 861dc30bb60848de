//! The audit trail: typed outcomes round-trip.

use chrono::Utc;
use sandgate_store::audit::{self, AuditEvent, AuditTable, ErrorKind, Outcome};
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

#[tokio::test]
async fn the_purge_deletes_events_older_than_the_period_in_batches_and_keeps_the_rest() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    let day = chrono::Duration::days(1);
    let mut events = Vec::new();
    for age in [0, 2, 10, 11, 12] {
        let old = AuditEvent {
            at: Utc::now() - day * age,
            ..event(tenant.id, Outcome::Ok, None)
        };
        sqlx::query(
            "INSERT INTO download_events (at, tenant_id, link_id, kind, outcome)
             VALUES ($1, $2, 'link', 'file', 'ok')",
        )
        .bind(old.at)
        .bind(tenant.id)
        .execute(&mut *conn)
        .await
        .unwrap();
        events.push(old);
    }
    // The batch writer keeps each event's own time (record() stamps now()).
    audit::record_batch(&mut conn, &events).await.unwrap();
    let period = 5 * 86_400;
    // Three events are older than five days; a batch of two takes two of them, the next the
    // third, the one after that none.
    let batches: Vec<u64> = {
        let mut done = Vec::new();
        for _ in 0..3 {
            done.push(
                audit::purge_older_than(&mut conn, AuditTable::ToolCalls, period, 2)
                    .await
                    .unwrap(),
            );
        }
        done
    };
    assert_eq!(batches, vec![2, 1, 0]);
    let ages: Vec<i64> = audit::recent(&mut conn, tenant.id, 10)
        .await
        .unwrap()
        .iter()
        .map(|e| (Utc::now() - e.at).num_days())
        .collect();
    assert_eq!(ages, vec![0, 2], "the newer events stay, newest first");
    // Download-link openings have their own table and the same period.
    let downloads = audit::purge_older_than(&mut conn, AuditTable::Downloads, period, 100)
        .await
        .unwrap();
    assert_eq!(downloads, 3);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM download_events WHERE tenant_id = $1")
        .bind(tenant.id)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(left, 2);
}
