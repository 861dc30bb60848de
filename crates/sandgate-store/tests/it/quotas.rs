//! Call quotas and session caps against real Postgres, under real concurrency: many
//! connections start calls (or open sessions) at once, and never more are admitted than the
//! limit; refused starts count for nothing; freed and expired slots are free again.

use futures::future::join_all;
use sandgate_store::mcp_sessions::{self, SessionOwner};
use sandgate_store::quotas::{self, Admission, CallLimits};
use sandgate_store::{PgPool, tenants};
use uuid::Uuid;

use crate::support::TestDb;

fn slot() -> String {
    Uuid::new_v4().simple().to_string()
}

/// Starts `n` calls at once, each on its own connection; returns (slot, admission) of each.
async fn burst(
    pool: &PgPool,
    tenant: Uuid,
    n: usize,
    limits: CallLimits,
) -> Vec<(String, Admission)> {
    join_all((0..n).map(|_| async move {
        let mut conn = pool.acquire().await.expect("a connection");
        let slot = slot();
        let admission = quotas::admit(&mut conn, tenant, &slot, limits)
            .await
            .expect("admit runs");
        (slot, admission)
    }))
    .await
}

fn admitted(results: &[(String, Admission)]) -> Vec<String> {
    results
        .iter()
        .filter(|(_, a)| *a == Admission::Admitted)
        .map(|(s, _)| s.clone())
        .collect()
}

#[tokio::test]
async fn a_burst_is_admitted_up_to_the_in_flight_cap_and_freed_slots_are_free_again() {
    let db = TestDb::new().await;
    let tenant = tenants::create(&mut db.pool.acquire().await.unwrap(), "acme")
        .await
        .unwrap();
    let other = tenants::create(&mut db.pool.acquire().await.unwrap(), "other")
        .await
        .unwrap();
    let limits = CallLimits {
        per_minute: 10_000,
        in_flight: 5,
        slot_ttl_seconds: 60,
    };
    let results = burst(&db.pool, tenant.id, 30, limits).await;
    let running = admitted(&results);
    assert_eq!(running.len(), 5, "exactly the cap is admitted: {results:?}");
    assert!(
        results
            .iter()
            .all(|(_, a)| matches!(a, Admission::Admitted | Admission::OverInFlight)),
        "the refusals name the calls in flight: {results:?}"
    );
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(quotas::in_flight(&mut conn, tenant.id).await.unwrap(), 5);
    // Another tenant is not affected.
    let theirs = burst(&db.pool, other.id, 3, limits).await;
    assert_eq!(admitted(&theirs).len(), 3);
    // Two calls end: two more fit, and no more.
    for slot in &running[..2] {
        quotas::release(&mut conn, tenant.id, slot).await.unwrap();
    }
    let again = burst(&db.pool, tenant.id, 10, limits).await;
    assert_eq!(admitted(&again).len(), 2, "{again:?}");
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn slots_expire_unless_renewed() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    let limits = CallLimits {
        per_minute: 10_000,
        in_flight: 1,
        slot_ttl_seconds: 60,
    };
    let (a, b) = (slot(), slot());
    assert_eq!(
        quotas::admit(&mut conn, tenant.id, &a, limits)
            .await
            .unwrap(),
        Admission::Admitted
    );
    assert_eq!(
        quotas::admit(&mut conn, tenant.id, &b, limits)
            .await
            .unwrap(),
        Admission::OverInFlight
    );
    assert!(quotas::renew(&mut conn, tenant.id, &a, 60).await.unwrap());
    // A replica that died: its slot's expiry passes (moved into the past here, not waited for).
    sqlx::query(
        "UPDATE call_quotas SET in_flight = jsonb_set(in_flight, ARRAY[$2], to_jsonb(extract(epoch FROM now()) - 1)) WHERE tenant_id = $1",
    )
    .bind(tenant.id)
    .bind(&a)
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(quotas::in_flight(&mut conn, tenant.id).await.unwrap(), 0);
    assert!(
        !quotas::renew(&mut conn, tenant.id, "gone", 60)
            .await
            .unwrap(),
        "an unknown slot is not renewed"
    );
    assert_eq!(
        quotas::admit(&mut conn, tenant.id, &b, limits)
            .await
            .unwrap(),
        Admission::Admitted,
        "the expired slot is free"
    );
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn calls_per_minute_count_at_start_and_refusals_do_not_count() {
    let db = TestDb::new().await;
    let tenant = tenants::create(&mut db.pool.acquire().await.unwrap(), "acme")
        .await
        .unwrap();
    let limits = CallLimits {
        per_minute: 4,
        in_flight: 1000,
        slot_ttl_seconds: 60,
    };
    // Calls that are still running count: a burst of long calls cannot exceed the rate.
    let results = burst(&db.pool, tenant.id, 20, limits).await;
    assert_eq!(admitted(&results).len(), 4, "{results:?}");
    for (_, admission) in &results {
        if let Admission::OverRate {
            retry_after_seconds,
        } = admission
        {
            assert!(
                (1..=15).contains(retry_after_seconds),
                "the next call fits within 60/4 s: {admission:?}"
            );
        } else {
            assert_eq!(*admission, Admission::Admitted);
        }
    }
    // Knocking again does not push the next admission further out.
    let mut conn = db.pool.acquire().await.unwrap();
    let tat_before: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT rate_tat FROM call_quotas WHERE tenant_id = $1")
            .bind(tenant.id)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    let more = burst(&db.pool, tenant.id, 10, limits).await;
    assert!(admitted(&more).is_empty());
    let tat_after: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT rate_tat FROM call_quotas WHERE tenant_id = $1")
            .bind(tenant.id)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert_eq!(tat_before, tat_after, "refused calls do not count");
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn sessions_are_capped_per_tenant_and_closed_or_expired_ones_free_their_slot() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    drop(conn);
    let owner = SessionOwner {
        tenant_id: tenant.id,
        subject: "user-1".into(),
        client_id: Some("client-1".into()),
    };
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    let bound = join_all((0..12u8).map(|i| {
        let (pool, owner) = (db.pool.clone(), owner.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            let ok = mcp_sessions::bind_under_cap(&mut tx, &[i; 32], &owner, 3, later)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            ok.then_some(i)
        }
    }))
    .await
    .into_iter()
    .flatten()
    .collect::<Vec<_>>();
    assert_eq!(
        bound.len(),
        3,
        "concurrent opens respect the cap: {bound:?}"
    );
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(
        mcp_sessions::owner(&mut conn, &[bound[0]; 32])
            .await
            .unwrap(),
        Some(owner.clone())
    );
    mcp_sessions::delete(&mut conn, &[bound[0]; 32])
        .await
        .unwrap();
    assert_eq!(
        mcp_sessions::owner(&mut conn, &[bound[0]; 32])
            .await
            .unwrap(),
        None
    );
    let mut tx = db.pool.begin().await.unwrap();
    assert!(
        mcp_sessions::bind_under_cap(&mut tx, &[100; 32], &owner, 3, later)
            .await
            .unwrap(),
        "a closed session's slot is free"
    );
    assert!(
        !mcp_sessions::bind_under_cap(&mut tx, &[101; 32], &owner, 3, later)
            .await
            .unwrap(),
        "and then the cap holds again"
    );
    tx.commit().await.unwrap();
    sqlx::query("UPDATE mcp_sessions SET expires_at = now() - interval '1 s' WHERE id_hash = $1")
        .bind(&[100u8; 32][..])
        .execute(&mut *conn)
        .await
        .unwrap();
    assert_eq!(
        mcp_sessions::open_count(&mut conn, tenant.id)
            .await
            .unwrap(),
        2
    );
    let mut tx = db.pool.begin().await.unwrap();
    assert!(
        mcp_sessions::bind_under_cap(&mut tx, &[101; 32], &owner, 3, later)
            .await
            .unwrap(),
        "an expired session's slot is free"
    );
    tx.commit().await.unwrap();
    drop(conn);
    db.drop_db().await;
}

/// The admission that reads the call's sandbox in the same statement: the tenant's own row,
/// another tenant's as missing, and a refused start changes nothing while still reading.
#[tokio::test]
async fn an_admission_reads_only_its_own_tenants_sandbox_and_a_refusal_changes_nothing() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let owner = tenants::create(&mut conn, "owner").await.unwrap();
    let intruder = tenants::create(&mut conn, "intruder").await.unwrap();
    let lease = sandgate_store::sandboxes::NewLease {
        tenant_id: owner.id,
        conversation_id: None,
        idle_timeout_seconds: 60,
        expires_at: chrono::Utc::now() + chrono::Duration::hours(1),
        grant_id: None,
    };
    sandgate_store::sandboxes::insert_leased(&mut conn, "sbx_owned", "default", "c", "n", &lease)
        .await
        .unwrap();
    let limits = CallLimits {
        per_minute: 10_000,
        in_flight: 1,
        slot_ttl_seconds: 60,
    };

    let (admission, row) =
        quotas::admit_and_read(&mut conn, owner.id, &slot(), limits, Some("sbx_owned"))
            .await
            .unwrap();
    assert_eq!(admission, Admission::Admitted);
    let row = row.expect("the owner's sandbox is read with the admission");
    assert_eq!(
        (row.id.as_str(), row.tenant_id),
        ("sbx_owned", Some(owner.id))
    );

    let (admission, row) =
        quotas::admit_and_read(&mut conn, intruder.id, &slot(), limits, Some("sbx_owned"))
            .await
            .unwrap();
    assert_eq!(admission, Admission::Admitted, "the intruder's own quota");
    assert!(row.is_none(), "another tenant's sandbox reads as missing");

    let (admission, row) =
        quotas::admit_and_read(&mut conn, owner.id, &slot(), limits, Some("sbx_owned"))
            .await
            .unwrap();
    assert_eq!(
        admission,
        Admission::OverInFlight,
        "the cap of one is taken"
    );
    assert!(row.is_some(), "a refused start still reads the row");
    assert_eq!(
        quotas::in_flight(&mut conn, owner.id).await.unwrap(),
        1,
        "the refused start took no slot"
    );

    let (_, row) = quotas::admit_and_read(&mut conn, owner.id, &slot(), limits, Some("sbx_nope"))
        .await
        .unwrap();
    assert!(row.is_none(), "a missing sandbox reads as missing");
}
