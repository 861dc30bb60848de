//! Transcript appends (written behind the calls, in batches): positions in order, the bound,
//! and late entries after a tenant's purge.

use chrono::{Duration, Utc};
use sandgate_store::sandboxes::{self, NewLease};
use sandgate_store::tenants;
use sandgate_store::transcripts::{self, Appended, Bound, NewEntry, Owner};
use sqlx::types::JsonValue;

use crate::support::TestDb;

#[tokio::test]
async fn a_batch_gets_consecutive_positions_and_late_entries_after_a_purge_are_not_written() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    let lease = NewLease {
        tenant_id: tenant.id,
        conversation_id: Some("c"),
        idle_timeout_seconds: 60,
        expires_at: Utc::now() + Duration::hours(1),
        grant_id: None,
    };
    sandboxes::insert_leased(&mut conn, "sbx_t", "default", "ctr", "node1", &lease)
        .await
        .unwrap();
    let owner = Owner {
        tenant_id: tenant.id,
        sandbox_id: "sbx_t",
        conversation_id: Some("c"),
    };
    let bodies: Vec<JsonValue> = (0..3)
        .map(|i| JsonValue::String(format!("cell {i}")))
        .collect();
    let entries: Vec<NewEntry<'_>> = bodies
        .iter()
        .map(|body| NewEntry {
            at: Utc::now(),
            kind: "cell",
            body,
            bytes: 10,
        })
        .collect();
    let bound = Bound {
        max_entries: 4,
        max_bytes: 1_000,
        tenant_max_bytes: 10_000,
    };
    let first = transcripts::append_all(&mut conn, owner, &entries, bound)
        .await
        .unwrap();
    assert_eq!(
        first,
        vec![Appended::Kept(1), Appended::Kept(2), Appended::Kept(3)]
    );
    let second = transcripts::append_all(&mut conn, owner, &entries, bound)
        .await
        .unwrap();
    assert_eq!(
        second,
        vec![Appended::Kept(4), Appended::Dropped, Appended::Dropped],
        "the bound holds across batches"
    );
    let summary = transcripts::of_sandbox(&mut conn, tenant.id, "sbx_t")
        .await
        .unwrap()
        .expect("the transcript");
    assert_eq!((summary.entries, summary.dropped), (4, 2));

    // The operator purges the tenant; entries of calls that answered before it arrive after.
    sandboxes::end_all_of_tenant(&mut conn, tenant.id, "purged")
        .await
        .unwrap();
    transcripts::purge_tenant(&mut conn, tenant.id)
        .await
        .unwrap();
    let late = transcripts::append_all(&mut conn, owner, &entries, bound)
        .await
        .unwrap();
    assert!(late.is_empty(), "nothing written after the purge: {late:?}");
    assert!(
        transcripts::of_sandbox(&mut conn, tenant.id, "sbx_t")
            .await
            .unwrap()
            .is_none(),
        "the purged transcript does not come back"
    );
}
