//! Sandbox rows: warm leasing, tenancy, ending and why.

use chrono::{Duration, Utc};
use sandgate_store::sandboxes::{self, CloseReason, NewLease, SandboxState};
use sandgate_store::tenants;

use crate::support::TestDb;

fn lease(tenant_id: uuid::Uuid, conversation: Option<&str>) -> NewLease<'_> {
    NewLease {
        tenant_id,
        conversation_id: conversation,
        idle_timeout_seconds: 60,
        expires_at: Utc::now() + Duration::hours(1),
        grant_id: None,
    }
}

#[tokio::test]
async fn two_leases_never_get_the_same_warm_row() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    crate::nodes::live_node(&mut conn, "node1").await;
    sandboxes::insert_warm(&mut conn, "sbx_a", "default", "ctr_a", "node1")
        .await
        .unwrap();
    sandboxes::insert_warm(&mut conn, "sbx_b", "default", "ctr_b", "node1")
        .await
        .unwrap();

    let node1 = ["node1".to_owned()];
    // Two transactions at once: SKIP LOCKED hands each a different row.
    let mut first = db.pool.begin().await.unwrap();
    let mut second = db.pool.begin().await.unwrap();
    let a = sandboxes::lease_warm(&mut first, "default", &node1, &lease(tenant.id, None))
        .await
        .unwrap()
        .expect("a warm row for the first lease");
    let b = sandboxes::lease_warm(&mut second, "default", &node1, &lease(tenant.id, None))
        .await
        .unwrap()
        .expect("a warm row for the second lease");
    assert_ne!(a.id, b.id, "two leases, two rows");
    first.commit().await.unwrap();
    second.commit().await.unwrap();

    let none = sandboxes::lease_warm(&mut conn, "default", &node1, &lease(tenant.id, None))
        .await
        .unwrap();
    assert!(none.is_none(), "the pool's rows are all leased: {none:?}");
    assert_eq!(
        sandboxes::count_live(&mut conn, tenant.id).await.unwrap(),
        2
    );
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn another_tenants_sandbox_reads_like_a_missing_one() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let owner = tenants::create(&mut conn, "owner").await.unwrap();
    let intruder = tenants::create(&mut conn, "intruder").await.unwrap();
    sandboxes::insert_leased(
        &mut conn,
        "sbx_owned",
        "default",
        "ctr_owned",
        "node1",
        &lease(owner.id, Some("conv-1")),
    )
    .await
    .unwrap();

    let mine = sandboxes::get(&mut conn, owner.id, "sbx_owned")
        .await
        .unwrap();
    assert!(mine.is_some(), "the owner sees its sandbox");
    let theirs = sandboxes::get(&mut conn, intruder.id, "sbx_owned")
        .await
        .unwrap();
    assert!(theirs.is_none(), "another tenant gets nothing: {theirs:?}");
    let by_conv = sandboxes::by_conversation(&mut conn, intruder.id, "conv-1")
        .await
        .unwrap();
    assert!(
        by_conv.is_none(),
        "nor through the conversation: {by_conv:?}"
    );
    let touched = sandboxes::touch(&mut conn, intruder.id, "sbx_owned", Some(5))
        .await
        .unwrap();
    assert!(touched.is_none(), "nor can it touch it: {touched:?}");
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn an_ended_sandbox_keeps_why_and_ends_only_once() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    for (id, container) in [("sbx_idle", "ctr_1"), ("sbx_lost", "ctr_2")] {
        sandboxes::insert_leased(
            &mut conn,
            id,
            "default",
            container,
            "node1",
            &lease(tenant.id, None),
        )
        .await
        .unwrap();
    }

    let idle = sandboxes::end(&mut conn, "sbx_idle", &CloseReason::Idle)
        .await
        .unwrap()
        .expect("a live row ends");
    assert_eq!(idle.state, SandboxState::Closed);
    assert_eq!(idle.close_reason(), Some(CloseReason::Idle));
    let again = sandboxes::end(&mut conn, "sbx_idle", &CloseReason::Closed)
        .await
        .unwrap();
    assert!(
        again.is_none(),
        "an ended row does not end twice: {again:?}"
    );

    let why = CloseReason::Lost("the container ran out of memory (OOM-killed)".into());
    let lost = sandboxes::end(&mut conn, "sbx_lost", &why)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lost.state, SandboxState::Lost);
    assert_eq!(lost.close_reason(), Some(why));
    assert_eq!(
        sandboxes::count_live(&mut conn, tenant.id).await.unwrap(),
        0
    );
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn overdue_finds_sandboxes_past_their_idle_timeout_or_lifetime_on_its_node() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    let fresh = lease(tenant.id, None);
    let expired = NewLease {
        expires_at: Utc::now() - Duration::seconds(1),
        ..lease(tenant.id, None)
    };
    sandboxes::insert_leased(&mut conn, "sbx_fresh", "default", "c1", "node1", &fresh)
        .await
        .unwrap();
    sandboxes::insert_leased(&mut conn, "sbx_old", "default", "c2", "node1", &expired)
        .await
        .unwrap();
    sandboxes::insert_leased(
        &mut conn,
        "sbx_elsewhere",
        "default",
        "c3",
        "node2",
        &expired,
    )
    .await
    .unwrap();

    let now = Utc::now();
    let due: Vec<String> = sandboxes::overdue(&mut conn, "node1", now)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(
        due,
        vec!["sbx_old".to_owned()],
        "only the expired one of this node"
    );
    // An hour later the fresh one is idle too.
    let later: Vec<String> = sandboxes::overdue(&mut conn, "node1", now + Duration::hours(2))
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert!(later.contains(&"sbx_fresh".to_owned()), "{later:?}");
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn count_leased_on_node_counts_only_that_nodes_leased_rows() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    assert_eq!(
        sandboxes::count_leased_on_node(&mut conn, "node1")
            .await
            .unwrap(),
        0,
        "a node without rows runs none"
    );
    for (id, node) in [("sbx_1", "node1"), ("sbx_2", "node1"), ("sbx_3", "node2")] {
        sandboxes::insert_leased(&mut conn, id, "default", id, node, &lease(tenant.id, None))
            .await
            .unwrap();
    }
    sandboxes::insert_warm(&mut conn, "sbx_warm", "default", "ctr_warm", "node1")
        .await
        .unwrap();
    sandboxes::end(&mut conn, "sbx_2", &CloseReason::Closed)
        .await
        .unwrap();
    assert_eq!(
        sandboxes::count_leased_on_node(&mut conn, "node1")
            .await
            .unwrap(),
        1,
        "node1's one live lease: not the closed one, the warm one, or node2's"
    );
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn the_idle_clock_never_moves_back() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    sandboxes::insert_leased(
        &mut conn,
        "sbx_a",
        "default",
        "c1",
        "node1",
        &lease(tenant.id, None),
    )
    .await
    .unwrap();
    let ids = ["sbx_a".to_owned()];
    let clock = |row: Option<sandboxes::SandboxRow>| row.expect("the row").last_used_at;
    let ahead = Utc::now() + Duration::seconds(30);
    sandboxes::touch_live(&mut conn, &ids, ahead).await.unwrap();
    let read = sandboxes::get(&mut conn, tenant.id, "sbx_a").await.unwrap();
    // Postgres keeps microseconds.
    let written = clock(read).expect("a clock");
    assert!(
        (written - ahead).num_milliseconds().abs() < 1,
        "touch_live sets the clock to the time given: {written} vs {ahead}"
    );
    sandboxes::touch_live(&mut conn, &ids, Utc::now())
        .await
        .unwrap();
    let touched = sandboxes::touch(&mut conn, tenant.id, "sbx_a", None)
        .await
        .unwrap();
    assert_eq!(
        clock(touched),
        Some(written),
        "an earlier time, from touch_live or a call's touch, leaves the later clock alone"
    );
    drop(conn);
    db.drop_db().await;
}
