//! Nodes: the engine lock, which nodes may take leases, warm leases only on the nodes the
//! placement chose (in its order), and the lost-node sweep.

use chrono::{Duration, Utc};
use sandgate_store::nodes::{self, NewNode};
use sandgate_store::sandboxes::{self, NewLease, SandboxState};
use sandgate_store::tenants;
use sqlx::PgConnection;

use crate::support::TestDb;

/// Registers node `id` (a fresh heartbeat, not draining).
pub async fn live_node(conn: &mut PgConnection, id: &str) {
    let node = NewNode {
        id,
        name: &format!("host-{id}"),
        advertise_url: "",
        slots: 10,
        memory_bytes: 0,
        draining: false,
        process: uuid::Uuid::new_v4(),
    };
    nodes::register_locked(conn, &node)
        .await
        .expect("a node registers");
}

fn lease(tenant_id: uuid::Uuid) -> NewLease<'static> {
    NewLease {
        tenant_id,
        conversation_id: None,
        idle_timeout_seconds: 60,
        expires_at: Utc::now() + Duration::hours(1),
        grant_id: None,
    }
}

/// Makes node `id`'s last heartbeat `seconds` old.
async fn silence(conn: &mut PgConnection, id: &str, seconds: i64) {
    sqlx::query("UPDATE nodes SET heartbeat_at = now() - make_interval(secs => $2) WHERE id = $1")
        .bind(id)
        .bind(seconds as f64)
        .execute(conn)
        .await
        .expect("update");
}

#[tokio::test]
async fn only_one_live_connection_holds_an_engine_and_its_end_frees_it() {
    let db = TestDb::new().await;
    let mut first = db.pool.acquire().await.unwrap().detach();
    let mut second = db.pool.acquire().await.unwrap().detach();
    assert!(nodes::try_lock(&mut first, "engine-1").await.unwrap());
    assert!(
        !nodes::try_lock(&mut second, "engine-1").await.unwrap(),
        "a second process must not get an engine another live one holds"
    );
    assert!(
        nodes::try_lock(&mut second, "engine-2").await.unwrap(),
        "another engine is free"
    );
    // The first process dies: its session ends, and the engine is free at once.
    drop(first);
    let mut third = db.pool.acquire().await.unwrap().detach();
    let mut freed = false;
    for _ in 0..100 {
        if nodes::try_lock(&mut third, "engine-1").await.unwrap() {
            freed = true;
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(freed, "the engine is free once its holder's session ended");
    drop((second, third));
    db.drop_db().await;
}

#[tokio::test]
async fn only_live_undrained_nodes_are_placeable_and_a_warm_lease_takes_the_chosen_in_order() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    for node in ["drained", "silent", "other", "own"] {
        live_node(&mut conn, node).await;
        for n in 0..2 {
            sandboxes::insert_warm(
                &mut conn,
                &format!("sbx_{node}_{n}"),
                "default",
                &format!("ctr_{node}_{n}"),
                node,
            )
            .await
            .unwrap();
        }
    }
    nodes::set_draining(&mut conn, "drained", true)
        .await
        .unwrap();
    silence(&mut conn, "silent", 60).await;
    let placeable: Vec<String> = nodes::placeable(&mut conn, 30)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.node.id)
        .collect();
    assert_eq!(
        placeable,
        ["other", "own"],
        "only live, undrained nodes take leases"
    );

    // The placement's choice, best first: the own node, then the other.
    let chosen = ["own".to_owned(), "other".to_owned()];
    let mut leased = Vec::new();
    while let Some(row) = sandboxes::lease_warm(&mut conn, "default", &chosen, &lease(tenant.id))
        .await
        .unwrap()
    {
        leased.push(row.id);
    }
    assert_eq!(
        leased,
        ["sbx_own_0", "sbx_own_1", "sbx_other_0", "sbx_other_1"],
        "the first chosen node's rows first, each node's oldest first; the rows of nodes not \
         chosen (draining, silent) are never leased"
    );
    let none = sandboxes::lease_warm(&mut conn, "default", &[], &lease(tenant.id))
        .await
        .unwrap();
    assert!(none.is_none(), "no node chosen, no lease: {none:?}");
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn the_sweep_marks_a_silent_nodes_sandboxes_lost_naming_it_once() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    live_node(&mut conn, "gone").await;
    live_node(&mut conn, "alive").await;
    sandboxes::insert_leased(
        &mut conn,
        "sbx_gone",
        "default",
        "c1",
        "gone",
        &lease(tenant.id),
    )
    .await
    .unwrap();
    sandboxes::insert_warm(&mut conn, "sbx_gone_warm", "default", "c2", "gone")
        .await
        .unwrap();
    sandboxes::insert_leased(
        &mut conn,
        "sbx_alive",
        "default",
        "c3",
        "alive",
        &lease(tenant.id),
    )
    .await
    .unwrap();

    let none = sandboxes::sweep_silent_nodes(&mut conn, 30).await.unwrap();
    assert!(none.is_empty(), "no node is silent yet: {none:?}");

    silence(&mut conn, "gone", 45).await;
    let mut swept: Vec<String> = sandboxes::sweep_silent_nodes(&mut conn, 30)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    swept.sort();
    assert_eq!(swept, ["sbx_gone", "sbx_gone_warm"]);
    let row = sandboxes::get(&mut conn, tenant.id, "sbx_gone")
        .await
        .unwrap()
        .expect("the row");
    assert_eq!(row.state, SandboxState::Lost);
    let reason = row.close_reason.unwrap_or_default();
    assert!(
        reason.contains("node host-gone (gone)") && reason.contains("stopped answering at"),
        "the reason names the node and when it went silent: {reason}"
    );
    let alive = sandboxes::get(&mut conn, tenant.id, "sbx_alive")
        .await
        .unwrap()
        .expect("the row");
    assert_eq!(
        alive.state,
        SandboxState::Leased,
        "a live node's sandbox is untouched"
    );
    let again = sandboxes::sweep_silent_nodes(&mut conn, 30).await.unwrap();
    assert!(again.is_empty(), "the sweep is idempotent: {again:?}");
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn a_purge_finds_a_tenants_lost_sandboxes_on_silent_nodes_only_and_pools_count_live_rows() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    let other = tenants::create(&mut conn, "globex").await.unwrap();
    live_node(&mut conn, "gone").await;
    live_node(&mut conn, "alive").await;
    for (id, container, node, owner) in [
        ("sbx_mine", "c1", "gone", tenant.id),
        ("sbx_theirs", "c2", "gone", other.id),
        ("sbx_mine_alive", "c3", "alive", tenant.id),
    ] {
        sandboxes::insert_leased(&mut conn, id, "default", container, node, &lease(owner))
            .await
            .unwrap();
    }
    sandboxes::insert_warm(&mut conn, "sbx_warm", "default", "c4", "alive")
        .await
        .unwrap();
    let pools = nodes::pools(&mut conn).await.unwrap();
    let alive = pools.iter().find(|p| p.id == "alive").expect("node alive");
    assert_eq!((alive.ready, alive.leased, alive.slots), (1, 1, 10));
    let gone = pools.iter().find(|p| p.id == "gone").expect("node gone");
    assert_eq!((gone.ready, gone.leased), (0, 2));
    assert!(
        !gone.draining && gone.heartbeat_age_seconds < 30.0,
        "{gone:?}"
    );

    silence(&mut conn, "gone", 45).await;
    sandboxes::sweep_silent_nodes(&mut conn, 30).await.unwrap();
    let found: Vec<String> = sandboxes::lost_on_silent_nodes(&mut conn, tenant.id, 30)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.container_id)
        .collect();
    assert_eq!(
        found,
        ["c1"],
        "the tenant's lost sandbox on the silent node, not another tenant's, not a live one"
    );
    let pools = nodes::pools(&mut conn).await.unwrap();
    let gone = pools.iter().find(|p| p.id == "gone").expect("node gone");
    assert_eq!((gone.ready, gone.leased), (0, 0), "lost rows are not live");
    assert!(gone.heartbeat_age_seconds >= 45.0, "{gone:?}");
    drop(conn);
    db.drop_db().await;
}
