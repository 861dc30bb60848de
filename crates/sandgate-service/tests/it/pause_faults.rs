//! A pause cut short (issue 27): a fault injected at each step of the reaper's checkpoint, and a
//! pause whose process died at each of its steps (halted there and dropped), leave the sandbox
//! running or paused with its variables, never lost, and what they left in the store is swept; the same pause without a fault leaves it paused, its container gone, its sealed
//! snapshot in the store and recorded.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sandgate_sandbox::{ExecOptions, SnapshotFaults, SnapshotStep};
use sandgate_service::sandboxes::{NodeSet, OwnNode, PauseHalts, PauseStep, Pausing};
use sandgate_service::snapshots::{SnapshotCustody, SnapshotKeys, SnapshotStore};
use sandgate_service::{Caller, SandboxService};
use sandgate_store::sandboxes::{self, NewLease, SandboxState};
use sandgate_store::{pauses, tenants};

use tokio::io::AsyncWriteExt;

use crate::support::{SnapEngine, TestDb, register_node, within};

const LIMIT: Duration = Duration::from_secs(180);
const SECRET: &[u8] = b"the test deployment's secret, at least 32 characters";
const NODE: &str = "node-pause-faults";

async fn state(db: &TestDb, tenant: uuid::Uuid, id: &str) -> SandboxState {
    let mut conn = db.pool.acquire().await.unwrap();
    sandboxes::get(&mut conn, tenant, id)
        .await
        .unwrap()
        .expect("the row")
        .state
}

/// Makes the sandbox's idle clock read an hour ago: the next reaper pass finds it idle.
async fn make_idle(db: &TestDb, id: &str) {
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("UPDATE sandboxes SET last_used_at = now() - interval '1 hour' WHERE id = $1")
        .bind(id)
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// Makes the sandbox's transition (a pause begun) an hour old: past any deadline, cut short.
async fn began_long_ago(db: &TestDb, id: &str) {
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("UPDATE sandboxes SET transition_at = now() - interval '1 hour' WHERE id = $1")
        .bind(id)
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// The value of `code` run in the tenant's sandbox `id` through the service.
async fn value(service: &SandboxService, caller: &Caller, id: &str, code: &str) -> String {
    let resolved = within(
        LIMIT,
        "resolving",
        service.resolve(caller, Some(id), None, None),
    )
    .await
    .expect("the sandbox is live");
    let outcome = within(
        LIMIT,
        "a cell",
        resolved.sandbox.exec(code, ExecOptions::default(), None),
    )
    .await
    .expect("the cell runs");
    assert!(outcome.error.is_none(), "the cell failed: {outcome:?}");
    outcome
        .result
        .and_then(|r| r.get("text/plain").cloned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_cut_short_at_any_step_leaves_the_sandbox_running() {
    let db = TestDb::new().await;
    let faults = Arc::new(SnapshotFaults::default());
    let engine = SnapEngine::with_faults("pause", Some(faults.clone())).await;
    let store_dir = std::env::temp_dir().join(format!(
        "sandgate-pause-it-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let store = SnapshotStore::local(&store_dir).expect("a store");
    let config = sandgate_service::Config::load(None).expect("the default configuration");
    let profile = engine.profile.clone();
    let nodes = NodeSet::new(
        Some(OwnNode {
            id: NODE.into(),
            manager: engine.manager.clone(),
        }),
        None,
        // Heard within the hour: the node registered below stays placeable through the test.
        (3600, 3600),
    );
    // A process's service; each call is another process on the same node and database.
    let process = || {
        SandboxService::new(
            db.pool.clone(),
            nodes.clone(),
            profile.clone(),
            config.limits.clone(),
        )
        .with_pausing(Pausing {
            custody: SnapshotCustody::new(db.pool.clone(), SnapshotKeys::new(SECRET)),
            store: store.clone(),
            on_idle: true,
            transition_deadline: Duration::from_secs(600),
            max_paused: 10,
            tenant_max_bytes: u64::MAX,
            retention: Duration::from_secs(3600),
            transcripts: sandgate_service::transcripts::bound_of(&config.retention),
        })
    };
    let service = process();
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "owner").await.unwrap().id;
    // The node registered, as its process does at start: a resume is placed on a live node.
    register_node(&db, NODE, 0).await;
    let sandbox = within(LIMIT, "a lease", engine.manager.lease("snap"))
        .await
        .expect("a runsc2024 sandbox");
    let id = sandbox.id().to_owned();
    let lease = NewLease {
        tenant_id: tenant,
        conversation_id: Some("conv-1"),
        idle_timeout_seconds: 600,
        expires_at: Utc::now() + chrono::Duration::hours(1),
        grant_id: None,
    };
    sandboxes::insert_leased(&mut conn, &id, "snap", sandbox.container_id(), NODE, &lease)
        .await
        .unwrap();
    drop(conn);
    // The service reaches it by adopting its container, as after a restart.
    drop(sandbox);
    let caller = Caller {
        tenant,
        subject: "test".into(),
        token_id: "test".into(),
        grant: None,
        limits: service.limits(tenant).await.unwrap(),
        read_at_admission: None,
        person: None,
    };
    value(&service, &caller, &id, "kept = 41\nkept").await;

    // The steps a checkpoint through Docker's API reaches (`CheckpointMoved` did not fire on
    // this engine's route: the image is not moved there).
    let steps = [
        SnapshotStep::CheckpointLinked,
        SnapshotStep::CheckpointTaken,
    ];
    for step in steps {
        faults.arm(step);
        // The end of the last call restarts the idle clock behind its answer: let it land.
        service.drain_removals().await;
        make_idle(&db, &id).await;
        let paused = within(LIMIT, "a reaper pass", service.reap()).await;
        assert!(
            paused.is_ok(),
            "{step}: the pass itself goes on: {paused:?}"
        );
        assert!(!faults.pending(), "{step}: the fault fired");
        assert_eq!(
            state(&db, tenant, &id).await,
            SandboxState::Leased,
            "{step}: a failed pause leaves the sandbox leased"
        );
        assert_eq!(
            engine.containers().await,
            1,
            "{step}: its container runs on"
        );
        assert_eq!(
            value(&service, &caller, &id, "kept += 1\nkept").await,
            (42 + SnapshotStep::CHECKPOINT
                .iter()
                .position(|s| *s == step)
                .unwrap())
            .to_string(),
            "{step}: its variables are kept"
        );
    }

    // A pause whose process died once it began (the row says pausing, nothing else happened):
    // undone past the transition deadline, the sandbox runs on.
    service.drain_removals().await;
    let mut conn = db.pool.acquire().await.unwrap();
    pauses::begin_pause(&mut conn, &id, false)
        .await
        .unwrap()
        .expect("the pause begins");
    drop(conn);
    began_long_ago(&db, &id).await;
    within(LIMIT, "a reaper pass", service.reap())
        .await
        .expect("the pass");
    assert_eq!(state(&db, tenant, &id).await, SandboxState::Leased);
    assert_eq!(value(&service, &caller, &id, "kept").await, "43");

    // A pause whose process died at each of its steps (the task stopped there and dropped, as
    // a crash would leave it: no clean-up ran). Another process finds the sandbox running
    // (the transition undone past its deadline) or, once the pause was recorded, paused: it
    // removes the left-over container and resumes it from the store. Variables kept each time.
    let halts = Arc::new(PauseHalts::default());
    let mut kept = 43;
    for step in PauseStep::ALL {
        let doomed = process().with_pause_halts(halts.clone());
        make_idle(&db, &id).await;
        halts.arm(step);
        let pass = tokio::spawn({
            let doomed = doomed.clone();
            async move { doomed.reap().await }
        });
        within(LIMIT, "the pause to reach its step", halts.reached()).await;
        pass.abort();
        let _ = pass.await;
        drop(doomed);
        let restarted = process();
        if step == PauseStep::Recorded {
            assert_eq!(
                state(&db, tenant, &id).await,
                SandboxState::Paused,
                "{step}: a recorded pause stands"
            );
            let reconciled = within(
                LIMIT,
                "a reconciliation pass",
                restarted.reconcile(Duration::from_secs(600), true),
            )
            .await
            .expect("the pass");
            assert_eq!(
                reconciled.removed, 1,
                "{step}: its old container is removed"
            );
            assert_eq!(engine.containers().await, 0, "{step}: nothing runs");
        } else {
            assert_eq!(
                state(&db, tenant, &id).await,
                SandboxState::Pausing,
                "{step}: the row says what was cut short"
            );
            began_long_ago(&db, &id).await;
            within(LIMIT, "a reaper pass", restarted.reap())
                .await
                .expect("the pass");
            assert_eq!(
                state(&db, tenant, &id).await,
                SandboxState::Leased,
                "{step}: the cut pause is undone"
            );
            assert_eq!(
                engine.containers().await,
                1,
                "{step}: its container runs on"
            );
        }
        kept += 1;
        assert_eq!(
            value(&restarted, &caller, &id, "kept += 1\nkept").await,
            kept.to_string(),
            "{step}: its variables are kept"
        );
        assert_eq!(
            state(&db, tenant, &id).await,
            SandboxState::Leased,
            "{step}: it runs again"
        );
        restarted.drain_removals().await;
    }

    // What those crashes left in the store (the stored step's whole snapshot, never recorded,
    // its data key gone) is swept; a sweep of snapshots younger than its bound keeps them.
    assert_eq!(
        process()
            .sweep_snapshots(Duration::from_secs(3600))
            .await
            .expect("a sweep"),
        0,
        "a snapshot younger than the sweep's bound stays (a pause may be writing it)"
    );
    // An object of a tenant this deployment does not know (a store shared with another one)
    // is not the sweep's to judge.
    let stranger = uuid::Uuid::new_v4();
    let mut foreign = store.writer(stranger, "snap_of_another_deployment");
    foreign.write_all(b"sealed elsewhere").await.unwrap();
    foreign.shutdown().await.unwrap();
    assert_eq!(
        process()
            .sweep_snapshots(Duration::ZERO)
            .await
            .expect("a sweep"),
        1,
        "the unrecorded snapshot of the pause cut after the store's write goes, nothing else"
    );
    assert!(
        store
            .contains(stranger, "snap_of_another_deployment")
            .await
            .unwrap(),
        "another deployment's object stays"
    );

    // Without a fault the pause completes: paused, container gone, the snapshot recorded and
    // in the store.
    let service = process();
    service.drain_removals().await;
    make_idle(&db, &id).await;
    within(LIMIT, "a reaper pass", service.reap())
        .await
        .expect("the pass");
    let mut conn = db.pool.acquire().await.unwrap();
    let row = sandboxes::get(&mut conn, tenant, &id)
        .await
        .unwrap()
        .expect("the row");
    assert_eq!(row.state, SandboxState::Paused);
    let snapshot = row.snapshot_id.clone().expect("its snapshot");
    assert!(
        sandgate_store::snapshots::get(&mut conn, tenant, &snapshot)
            .await
            .unwrap()
            .is_some(),
        "the snapshot is recorded"
    );
    assert!(
        store.contains(tenant, &snapshot).await.unwrap(),
        "and stored"
    );
    assert_eq!(
        process()
            .sweep_snapshots(Duration::ZERO)
            .await
            .expect("a sweep"),
        0,
        "a paused sandbox's snapshot is never swept"
    );
    assert!(
        store.contains(tenant, &snapshot).await.unwrap(),
        "still stored"
    );
    assert_eq!(engine.containers().await, 0, "its container is gone");
    drop(conn);

    // Its object gone from the store (a bucket emptied by hand): the next call finds the
    // sandbox lost, saying why, and the snapshot's row goes too (it would count in the
    // tenant's quota for ever).
    store.delete(tenant, &snapshot).await.expect("deleted");
    let resolved = within(
        LIMIT,
        "resolving",
        service.resolve(&caller, Some(&id), None, None),
    )
    .await;
    match resolved {
        Err(err) => assert!(
            err.to_string()
                .contains("its snapshot is gone from the snapshot store"),
            "the call hears why: {err}"
        ),
        Ok(_) => panic!("a sandbox whose snapshot is gone cannot resume"),
    }
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(state(&db, tenant, &id).await, SandboxState::Lost);
    assert!(
        sandgate_store::snapshots::get(&mut conn, tenant, &snapshot)
            .await
            .unwrap()
            .is_none(),
        "the lost snapshot's row is gone"
    );
    assert_eq!(
        sandgate_store::snapshots::sealed_bytes_of_tenant(&mut conn, tenant)
            .await
            .unwrap(),
        0,
        "and counts in the tenant's quota no more"
    );
    drop(conn);
    engine.cleanup().await;
    let _ = std::fs::remove_dir_all(&store_dir);
    db.drop_db().await;
}
