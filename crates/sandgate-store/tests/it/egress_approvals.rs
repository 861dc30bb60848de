//! Hosts approved by a person for one sandbox, against real Postgres: a request is per sandbox,
//! host and port (asking again returns it), capped per sandbox, decided once, only by its
//! tenant, and lets through only its own sandbox until it expires.

use chrono::{Duration, Utc};
use sandgate_store::egress_approvals::{
    self as approvals, Approval, ApprovalState, Asked, MAX_PENDING_PER_SANDBOX,
    MAX_PENDING_PER_TENANT,
};
use sandgate_store::sandboxes::{self, NewLease};
use sandgate_store::tenants;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::support::TestDb;

async fn leased(conn: &mut PgConnection, id: &str, tenant: Uuid, conversation: &str) {
    let lease = NewLease {
        tenant_id: tenant,
        conversation_id: Some(conversation),
        idle_timeout_seconds: 60,
        expires_at: Utc::now() + Duration::hours(1),
        grant_id: None,
    };
    sandboxes::insert_leased(conn, id, "default", &format!("ctr_{id}"), "node1", &lease)
        .await
        .unwrap();
}

fn made(asked: Asked) -> Approval {
    match asked {
        Asked::Request(request) => request,
        other => panic!("a request, not {other:?}"),
    }
}

#[tokio::test]
async fn a_request_is_decided_once_by_its_tenant_and_opens_its_sandbox_alone() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let acme = tenants::create(&mut conn, "acme").await.unwrap().id;
    let other = tenants::create(&mut conn, "other").await.unwrap().id;
    crate::nodes::live_node(&mut conn, "node1").await;
    leased(&mut conn, "sbx_a", acme, "ticket-1").await;
    leased(&mut conn, "sbx_b", acme, "ticket-2").await;
    leased(&mut conn, "sbx_o", other, "ticket-9").await;
    let hour = Duration::hours(1);

    assert!(
        !approvals::approvals_on(&mut conn, acme).await.unwrap(),
        "off by default"
    );
    assert_eq!(
        approvals::request(&mut conn, acme, "sbx_a", "api.x.test", 443, hour)
            .await
            .unwrap(),
        Asked::Off,
        "off: no request"
    );
    approvals::set_approvals(&mut conn, acme, true)
        .await
        .unwrap();
    assert!(approvals::approvals_on(&mut conn, acme).await.unwrap());
    assert!(
        !approvals::approvals_on(&mut conn, other).await.unwrap(),
        "per tenant"
    );

    let first = made(
        approvals::request(&mut conn, acme, "sbx_a", "api.x.test", 443, hour)
            .await
            .unwrap(),
    );
    assert_eq!(first.state, ApprovalState::Pending);
    assert_eq!(first.conversation_id.as_deref(), Some("ticket-1"));
    let again = made(
        approvals::request(&mut conn, acme, "sbx_a", "api.x.test", 443, hour)
            .await
            .unwrap(),
    );
    assert_eq!(
        again.id, first.id,
        "asking again returns the standing request"
    );
    // Another tenant cannot ask on this tenant's sandbox, even with approvals on.
    approvals::set_approvals(&mut conn, other, true)
        .await
        .unwrap();
    assert_eq!(
        approvals::request(&mut conn, other, "sbx_a", "api.x.test", 443, hour)
            .await
            .unwrap(),
        Asked::Full
    );

    // Another tenant neither sees nor decides it.
    assert!(
        approvals::get(&mut conn, other, first.id)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        approvals::list(&mut conn, other, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        approvals::decide(&mut conn, other, first.id, true, "user:x", hour)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        approvals::approved(&mut conn, acme, "sbx_a")
            .await
            .unwrap()
            .is_empty()
    );

    let decided = approvals::decide(&mut conn, acme, first.id, true, "user:a@acme.test", hour)
        .await
        .unwrap()
        .expect("decided");
    assert_eq!(decided.state, ApprovalState::Approved);
    assert_eq!(decided.decided_by.as_deref(), Some("user:a@acme.test"));
    assert!(
        approvals::decide(&mut conn, acme, first.id, false, "user:b@acme.test", hour)
            .await
            .unwrap()
            .is_none(),
        "a decision is made once"
    );
    let open = vec![("api.x.test".to_owned(), 443, "user:a@acme.test".to_owned())];
    assert_eq!(
        approvals::approved(&mut conn, acme, "sbx_a").await.unwrap(),
        open
    );
    assert!(
        approvals::approved(&mut conn, acme, "sbx_b")
            .await
            .unwrap()
            .is_empty(),
        "another sandbox of the tenant is not let through"
    );

    // The switch off: nothing approved lets anything through, nothing is decided.
    let pending = made(
        approvals::request(&mut conn, acme, "sbx_b", "api.z.test", 443, hour)
            .await
            .unwrap(),
    );
    approvals::set_approvals(&mut conn, acme, false)
        .await
        .unwrap();
    assert!(
        approvals::approved(&mut conn, acme, "sbx_a")
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        approvals::decide(&mut conn, acme, pending.id, true, "user:a@acme.test", hour)
            .await
            .unwrap()
            .is_none(),
        "approvals off: no decision"
    );
    approvals::set_approvals(&mut conn, acme, true)
        .await
        .unwrap();
    assert_eq!(
        approvals::approved(&mut conn, acme, "sbx_a").await.unwrap(),
        open
    );
    assert_eq!(
        approvals::withdraw(&mut conn, acme, &[pending.id])
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        approvals::withdraw(&mut conn, other, &[first.id])
            .await
            .unwrap(),
        0,
        "another tenant withdraws nothing"
    );

    // A denial stands; after it expires, asking again makes a pending request under a new id.
    let denied = made(
        approvals::request(&mut conn, acme, "sbx_b", "api.y.test", 8443, hour)
            .await
            .unwrap(),
    );
    approvals::decide(&mut conn, acme, denied.id, false, "user:a@acme.test", hour)
        .await
        .unwrap()
        .unwrap();
    let standing = made(
        approvals::request(&mut conn, acme, "sbx_b", "api.y.test", 8443, hour)
            .await
            .unwrap(),
    );
    assert_eq!(standing.state, ApprovalState::Denied);
    sqlx::query(
        "UPDATE egress_approvals SET expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(denied.id)
    .execute(&mut *conn)
    .await
    .unwrap();
    let asked_again = made(
        approvals::request(&mut conn, acme, "sbx_b", "api.y.test", 8443, hour)
            .await
            .unwrap(),
    );
    assert_eq!(asked_again.state, ApprovalState::Pending);
    assert!(asked_again.decided_by.is_none());
    assert_ne!(
        asked_again.id, denied.id,
        "an old link never decides the new request"
    );
    assert!(
        approvals::get(&mut conn, acme, denied.id)
            .await
            .unwrap()
            .is_none()
    );

    // An expired approval lets nothing through.
    sqlx::query(
        "UPDATE egress_approvals SET expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(first.id)
    .execute(&mut *conn)
    .await
    .unwrap();
    assert!(
        approvals::approved(&mut conn, acme, "sbx_a")
            .await
            .unwrap()
            .is_empty()
    );

    // The cap: past it, no new request for the sandbox.
    for n in 0..MAX_PENDING_PER_SANDBOX {
        let host = format!("h{n}.flood.test");
        assert_eq!(
            approvals::request(&mut conn, acme, "sbx_o2", &host, 443, hour)
                .await
                .unwrap(),
            Asked::Full,
            "no such sandbox: no request"
        );
        made(
            approvals::request(&mut conn, acme, "sbx_a", &host, 443, hour)
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        approvals::request(&mut conn, acme, "sbx_a", "one-more.flood.test", 443, hour)
            .await
            .unwrap(),
        Asked::Full,
        "past the cap"
    );
    // The tenant's cap: its sandboxes together have at most so many pending.
    let mut pending = MAX_PENDING_PER_SANDBOX + 1; // sbx_a's, and sbx_b's asked again
    let mut n = 0;
    while pending < MAX_PENDING_PER_TENANT {
        let sandbox = format!("sbx_t{}", n / MAX_PENDING_PER_SANDBOX);
        if n % MAX_PENDING_PER_SANDBOX == 0 {
            leased(&mut conn, &sandbox, acme, &format!("ticket-{sandbox}")).await;
        }
        made(
            approvals::request(&mut conn, acme, &sandbox, &format!("t{n}.test"), 443, hour)
                .await
                .unwrap(),
        );
        n += 1;
        pending += 1;
    }
    leased(&mut conn, "sbx_last", acme, "ticket-last").await;
    assert_eq!(
        approvals::request(&mut conn, acme, "sbx_last", "last.test", 443, hour)
            .await
            .unwrap(),
        Asked::Full,
        "past the tenant's cap"
    );
    let extra = MAX_PENDING_PER_TENANT - MAX_PENDING_PER_SANDBOX - 1;

    // The list puts the pending first.
    let listed = approvals::list(&mut conn, acme, 500).await.unwrap();
    assert_eq!(listed.len() as i64, MAX_PENDING_PER_SANDBOX + 3 + extra);
    assert!(listed[0].state == ApprovalState::Pending && listed[0].current(Utc::now()));

    // Withdrawn: nothing pending or approved stands.
    let ended = approvals::withdraw_all(&mut conn, acme).await.unwrap();
    assert_eq!(ended as i64, MAX_PENDING_PER_TENANT);
    let later = Utc::now() + Duration::seconds(1);
    assert!(
        approvals::list(&mut conn, acme, 500)
            .await
            .unwrap()
            .iter()
            .all(|a| !a.current(later))
    );

    // The purge job deletes what ran out long enough ago; a tenant's purge, the tenant's.
    assert_eq!(approvals::purge_expired(&mut conn, 3600).await.unwrap(), 0);
    made(
        approvals::request(&mut conn, acme, "sbx_b", "fresh.test", 443, hour)
            .await
            .unwrap(),
    );
    assert_eq!(
        approvals::purge_expired(&mut conn, 0).await.unwrap() as i64,
        MAX_PENDING_PER_SANDBOX + 3 + extra
    );
    assert_eq!(
        approvals::delete_of_tenant(&mut conn, other).await.unwrap(),
        0
    );
    assert_eq!(
        approvals::delete_of_tenant(&mut conn, acme).await.unwrap(),
        1
    );
}
