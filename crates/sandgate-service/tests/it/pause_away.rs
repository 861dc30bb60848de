//! A gateway's pause pass and *away* nodes (issue 27, docs/scale-out.md): a gateway-only
//! process holding the key custody pauses idle sandboxes on the registered nodes, but not on a
//! node that is away (silent past `node.away_after_seconds`, not yet lost): that node cannot
//! checkpoint them now, and a pause begun there holds the row `pausing` until the RPC gives up,
//! then restarts the sandbox's idle clock. Postgres only: neither node runs (their URLs are a
//! loopback port nothing listens on), so a pause the pass does try fails and is undone, and that
//! undo (the idle clock restarted) is the trace that the pass reached a sandbox.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sandgate_sandbox::SandboxProfile;
use sandgate_service::SandboxService;
use sandgate_service::sandboxes::{NodeSet, Pausing};
use sandgate_service::snapshots::{SnapshotCustody, SnapshotKeys, SnapshotStore};
use sandgate_store::sandboxes::{self, NewLease, SandboxState};
use sandgate_store::tenants;

use crate::support::{TestDb, register_node, within};

const LIMIT: Duration = Duration::from_secs(120);
const SECRET: &[u8] = b"the test deployment's secret, at least 32 characters";
/// `node.away_after_seconds` and `node.lost_after_seconds` of the test's gateway.
const LIVENESS: (u64, u64) = (30, 600);

/// A leased sandbox of `tenant` on `node`, last used an hour ago (idle past its 60 s timeout).
async fn idle_sandbox(db: &TestDb, tenant: uuid::Uuid, id: &str, node: &str) -> DateTime<Utc> {
    let mut conn = db.pool.acquire().await.unwrap();
    let lease = NewLease {
        tenant_id: tenant,
        conversation_id: None,
        idle_timeout_seconds: 60,
        expires_at: Utc::now() + chrono::Duration::hours(2),
        grant_id: None,
    };
    sandboxes::insert_leased(
        &mut conn,
        id,
        "default",
        &format!("container-{id}"),
        node,
        &lease,
    )
    .await
    .unwrap();
    sqlx::query_scalar(
        "UPDATE sandboxes SET last_used_at = date_trunc('second', now()) - interval '1 hour'
         WHERE id = $1 RETURNING last_used_at",
    )
    .bind(id)
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// The sandbox's state and idle clock.
async fn row(db: &TestDb, tenant: uuid::Uuid, id: &str) -> (SandboxState, Option<DateTime<Utc>>) {
    let mut conn = db.pool.acquire().await.unwrap();
    let row = sandboxes::get(&mut conn, tenant, id)
        .await
        .unwrap()
        .expect("the row");
    (row.state, row.last_used_at)
}

#[tokio::test]
async fn the_gateways_pause_pass_leaves_the_sandboxes_of_an_away_node_alone() {
    let db = TestDb::new().await;
    let store_dir = std::env::temp_dir().join(format!(
        "sandgate-pause-away-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let config = sandgate_service::Config::load(None).expect("the default configuration");
    // A gateway-only replica: no node of its own, every node reached over the RPC.
    let nodes = NodeSet::new(None, None, LIVENESS);
    let service = SandboxService::new(
        db.pool.clone(),
        nodes,
        SandboxProfile::default(),
        config.limits.clone(),
    )
    .with_pausing(Pausing {
        custody: SnapshotCustody::new(db.pool.clone(), SnapshotKeys::new(SECRET)),
        store: SnapshotStore::local(&store_dir).expect("a store"),
        on_idle: true,
        transition_deadline: Duration::from_secs(600),
        max_paused: 10,
        tenant_max_bytes: u64::MAX,
        retention: Duration::from_secs(3600),
        transcripts: sandgate_service::transcripts::bound_of(&config.retention),
    });
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "owner").await.unwrap().id;
    drop(conn);
    // One node up (heartbeat a second ago), one away (silent 60 s: past 30, short of 600).
    register_node(&db, "node-up", 1).await;
    register_node(&db, "node-away", 60).await;
    let up_used = idle_sandbox(&db, tenant, "sbx_on_up_node", "node-up").await;
    let away_used = idle_sandbox(&db, tenant, "sbx_on_away_node", "node-away").await;

    let pass = within(LIMIT, "a reaper pass", service.reap()).await;
    assert!(pass.is_ok(), "the pass itself goes on: {pass:?}");

    let (state, used) = row(&db, tenant, "sbx_on_away_node").await;
    assert_eq!(
        state,
        SandboxState::Leased,
        "the away node's sandbox is still leased"
    );
    assert_eq!(
        used,
        Some(away_used),
        "no pause of the away node's sandbox was begun (its idle clock is untouched)"
    );
    // The control: the pass did reach the node that is up (its pause failed, nothing serves
    // that node's URL, and was undone, restarting the idle clock).
    let (state, used) = row(&db, tenant, "sbx_on_up_node").await;
    assert_eq!(state, SandboxState::Leased, "a failed pause is undone");
    assert!(
        used.is_some_and(|u| u > up_used),
        "the pass tried to pause the up node's idle sandbox: {used:?} after {up_used}"
    );
    let _ = std::fs::remove_dir_all(&store_dir);
    db.drop_db().await;
}
