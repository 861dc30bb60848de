//! Snapshot rows: recorded only for the tenant's own sandbox, read and deleted only by it.

use chrono::{Duration, Utc};
use sandgate_store::sandboxes::{self, NewLease};
use sandgate_store::snapshots::{self, NewSnapshot};
use sandgate_store::{StoreError, tenants};

use crate::support::TestDb;

async fn leased(conn: &mut sqlx::PgConnection, tenant_id: uuid::Uuid, id: &str) {
    let lease = NewLease {
        tenant_id,
        conversation_id: None,
        idle_timeout_seconds: 60,
        expires_at: Utc::now() + Duration::hours(1),
        grant_id: None,
    };
    sandboxes::insert_leased(conn, id, "default", &format!("ctr_{id}"), "node1", &lease)
        .await
        .unwrap();
}

fn snapshot<'a>(id: &'a str, tenant_id: uuid::Uuid, sandbox_id: &'a str) -> NewSnapshot<'a> {
    NewSnapshot {
        id,
        tenant_id,
        sandbox_id,
        node: "node1",
        wrapped_key: b"wrapped",
        image_bytes: 28_000_000,
        sealed_bytes: 28_100_000,
    }
}

#[tokio::test]
async fn a_snapshot_belongs_to_its_tenant_alone() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let owner = tenants::create(&mut conn, "owner").await.unwrap();
    let intruder = tenants::create(&mut conn, "intruder").await.unwrap();
    leased(&mut conn, owner.id, "sbx_owned").await;

    let row = snapshots::insert(&mut conn, &snapshot("snap_1", owner.id, "sbx_owned"))
        .await
        .expect("the owner's sandbox can be snapshotted");
    assert_eq!(row.wrapped_key, b"wrapped");
    assert_eq!(
        (row.image_bytes, row.sealed_bytes),
        (28_000_000, 28_100_000)
    );
    let refused = snapshots::insert(&mut conn, &snapshot("snap_2", intruder.id, "sbx_owned"))
        .await
        .expect_err("another tenant's sandbox cannot be recorded as the intruder's");
    assert!(
        matches!(refused, StoreError::NotFound("sandbox")),
        "{refused:?}"
    );
    let taken = snapshots::insert(&mut conn, &snapshot("snap_1", owner.id, "sbx_owned"))
        .await
        .expect_err("an id is used once");
    assert!(matches!(taken, StoreError::Conflict(_)), "{taken:?}");

    assert_eq!(
        snapshots::get(&mut conn, owner.id, "snap_1").await.unwrap(),
        Some(row.clone())
    );
    assert_eq!(
        snapshots::get(&mut conn, intruder.id, "snap_1")
            .await
            .unwrap(),
        None,
        "another tenant's snapshot reads like a missing one"
    );
    assert_eq!(
        snapshots::of_sandbox(&mut conn, intruder.id, "sbx_owned")
            .await
            .unwrap(),
        vec![]
    );
    assert_eq!(
        snapshots::of_sandbox(&mut conn, owner.id, "sbx_owned")
            .await
            .unwrap(),
        vec![row]
    );
    assert_eq!(
        snapshots::sealed_bytes_of_tenant(&mut conn, owner.id)
            .await
            .unwrap(),
        28_100_000
    );
    assert_eq!(
        snapshots::sealed_bytes_of_tenant(&mut conn, intruder.id)
            .await
            .unwrap(),
        0
    );
    assert!(
        !snapshots::delete(&mut conn, intruder.id, "snap_1")
            .await
            .unwrap(),
        "the intruder deletes nothing"
    );
    assert!(
        snapshots::delete(&mut conn, owner.id, "snap_1")
            .await
            .unwrap()
    );
    assert_eq!(
        snapshots::get(&mut conn, owner.id, "snap_1").await.unwrap(),
        None
    );
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn a_deleted_tenant_takes_its_snapshots_along() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "gone").await.unwrap();
    leased(&mut conn, tenant.id, "sbx_gone").await;
    snapshots::insert(&mut conn, &snapshot("snap_g", tenant.id, "sbx_gone"))
        .await
        .unwrap();
    sqlx::query("DELETE FROM tenants WHERE id = $1")
        .bind(tenant.id)
        .execute(&mut *conn)
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM snapshots")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(left, 0, "no snapshot outlives its tenant");
    drop(conn);
    db.drop_db().await;
}
