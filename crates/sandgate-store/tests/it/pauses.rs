//! Pause and resume transitions: a transition is ended only by the caller that began it.

use chrono::{Duration, Utc};
use sandgate_store::pauses::{self, PausedKind};
use sandgate_store::sandboxes::{self, NewLease, SandboxState};
use sandgate_store::tenants;
use sqlx::PgConnection;

use crate::support::TestDb;

/// The transition of `id` began an hour ago (its process died, or hangs), as the reaper's
/// deadline sees it.
async fn began_long_ago(conn: &mut PgConnection, id: &str) {
    sqlx::query("UPDATE sandboxes SET transition_at = now() - interval '1 hour' WHERE id = $1")
        .bind(id)
        .execute(conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_transition_undone_and_begun_again_is_ended_only_by_its_new_beginner() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let tenant = tenants::create(&mut conn, "acme").await.unwrap();
    crate::nodes::live_node(&mut conn, "node1").await;
    let lease = NewLease {
        tenant_id: tenant.id,
        conversation_id: None,
        idle_timeout_seconds: 60,
        expires_at: Utc::now() + Duration::hours(1),
        grant_id: None,
    };
    sandboxes::insert_leased(&mut conn, "sbx_p", "default", "ctr_1", "node1", &lease)
        .await
        .unwrap();

    // A pause that ran past the deadline is undone; another begins.
    let late = pauses::begin_pause(&mut conn, "sbx_p", false)
        .await
        .unwrap()
        .expect("the first pause begins");
    began_long_ago(&mut conn, "sbx_p").await;
    let undone = pauses::undo_cut_transitions(&mut conn, None, 60)
        .await
        .unwrap();
    assert_eq!(undone.len(), 1, "the late pause is undone");
    let pause = pauses::begin_pause(&mut conn, "sbx_p", false)
        .await
        .unwrap()
        .expect("a second pause begins");
    // The late one's outcome, however it ends, does not end the second.
    for ended in [
        pauses::finish_pause(&mut conn, &late, "snap_late", PausedKind::Memory)
            .await
            .unwrap(),
        pauses::abort_pause(&mut conn, &late).await.unwrap(),
    ] {
        assert!(ended.is_none(), "the late pause ended another's: {ended:?}");
    }
    let paused = pauses::finish_pause(&mut conn, &pause, "snap_2", PausedKind::Memory)
        .await
        .unwrap()
        .expect("the second pause ends as it says");
    assert_eq!(paused.state, SandboxState::Paused);
    assert_eq!(paused.snapshot_id.as_deref(), Some("snap_2"));

    // The same for a resume.
    let late = pauses::begin_resume(&mut conn, tenant.id, "sbx_p")
        .await
        .unwrap()
        .expect("the first resume begins");
    began_long_ago(&mut conn, "sbx_p").await;
    pauses::undo_cut_transitions(&mut conn, None, 60)
        .await
        .unwrap();
    let resume = pauses::begin_resume(&mut conn, tenant.id, "sbx_p")
        .await
        .unwrap()
        .expect("a second resume begins");
    for ended in [
        pauses::finish_resume(&mut conn, &late, "ctr_late", "node1")
            .await
            .unwrap(),
        pauses::abort_resume(&mut conn, &late).await.unwrap(),
    ] {
        assert!(
            ended.is_none(),
            "the late resume ended another's: {ended:?}"
        );
    }
    let live = pauses::finish_resume(&mut conn, &resume, "ctr_2", "node1")
        .await
        .unwrap()
        .expect("the second resume ends as it says");
    assert_eq!(live.state, SandboxState::Leased);
    assert_eq!(live.container_id, "ctr_2");
}
