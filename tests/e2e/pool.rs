//! The warm pool follows demand through the real gateway (issue 16): a burst of leases grows it up
//! to `pool.max_ready` and never beyond, a tenant's own limit still refuses what it must, and
//! when leases stop the pool shrinks back to `pool.min_ready`, its surplus rows retired and their
//! containers removed (no orphan, nothing lost). Real binary, Postgres and Docker; `/metrics`
//! shows ready, starting, target and the lease wait.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::mcp_client::{Client, Era};
use crate::support::{self, Gateway};

const POOL: [(&str, &str); 6] = [
    ("SANDGATE_POOL__MIN_READY", "1"),
    ("SANDGATE_POOL__MAX_READY", "3"),
    // A short window, so that the shrink shows within seconds.
    ("SANDGATE_POOL__DEMAND_WINDOW_SECONDS", "12"),
    ("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "500"),
    ("SANDGATE_LIFECYCLE__RECONCILE_INTERVAL_SECONDS", "2"),
    ("SANDGATE_LIFECYCLE__ORPHAN_GRACE_SECONDS", "20"),
];

/// A gauge's value in `/metrics`.
async fn gauge(gateway: &Gateway, name: &str) -> i64 {
    let text = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("/metrics answers")
        .text()
        .await
        .expect("a body");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("/metrics has {name}:\n{text}"))
        .trim()
        .parse()
        .expect("a number")
}

async fn warm_rows(url: &str) -> i64 {
    let mut conn = PgConnection::connect(url).await.expect("the database");
    sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state = 'warm'")
        .fetch_one(&mut conn)
        .await
        .expect("count")
}

#[tokio::test]
async fn the_pool_grows_under_a_burst_within_its_ceiling_keeps_tenant_limits_and_shrinks_when_idle()
{
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &POOL).await;
    support::eventually(Duration::from_secs(120), "the floor to fill", || async {
        (gauge(&gateway, "sandgate_pool_ready_sandboxes").await == 1).then_some(())
    })
    .await;
    assert_eq!(gauge(&gateway, "sandgate_pool_target_sandboxes").await, 1);

    // A tenant limited to 2 sandboxes bursts 6 creates: 2 succeed, 4 are refused by its limit,
    // however many warm sandboxes wait.
    let limited = gateway.create_tenant().await;
    gateway
        .cli(&[
            "admin",
            "tenant",
            "limits",
            &limited,
            "--max-sandboxes",
            "2",
        ])
        .await;
    let token = gateway.token(&limited).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let burst =
        futures::future::join_all((0..6).map(|_| client.call("create_sandbox", json!({})))).await;
    let (ok, refused): (Vec<_>, Vec<_>) = burst
        .into_iter()
        .map(|r| r.expect("an answer"))
        .partition(|r| !r.is_error);
    assert_eq!(ok.len(), 2, "the tenant's limit holds under the burst");
    for r in &refused {
        assert!(
            r.text.contains("max concurrent sandboxes"),
            "refused naming the limit: {}",
            r.text
        );
    }

    // Another tenant's burst: every create succeeds, each its own container.
    let open = gateway.create_tenant().await;
    let token = gateway.token(&open).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let burst =
        futures::future::join_all((0..6).map(|_| client.call("create_sandbox", json!({})))).await;
    let ids: HashSet<String> = burst
        .into_iter()
        .map(|r| {
            let r = r.expect("an answer");
            assert!(!r.is_error, "{}", r.text);
            r.structured["sandbox_id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 6);

    // The pool grows to cover the demand, never past its ceiling.
    support::eventually(Duration::from_secs(120), "the pool to grow", || async {
        let ready = gauge(&gateway, "sandgate_pool_ready_sandboxes").await;
        let target = gauge(&gateway, "sandgate_pool_target_sandboxes").await;
        assert!(
            ready <= 3 && target <= 3,
            "never past the ceiling: ready {ready}, target {target}"
        );
        (ready > 1).then_some(())
    })
    .await;
    assert!(gauge(&gateway, "sandgate_pool_start_limit").await >= 1);

    // Leases stop: back to the floor, the surplus rows retired and their containers gone.
    support::eventually(Duration::from_secs(120), "the pool to shrink", || async {
        let ready = gauge(&gateway, "sandgate_pool_ready_sandboxes").await;
        let target = gauge(&gateway, "sandgate_pool_target_sandboxes").await;
        let starting = gauge(&gateway, "sandgate_pool_starting_sandboxes").await;
        assert!(ready <= 3, "never past the ceiling: {ready}");
        (target == 1 && ready == 1 && starting == 0).then_some(())
    })
    .await;
    support::eventually(
        Duration::from_secs(60),
        "one warm row and as many containers as live rows",
        || async {
            let warm = warm_rows(&database).await;
            let containers = support::containers_of(&gateway.instance).len();
            // 2 + 6 leased, 1 warm.
            let done = warm == 1 && containers == 2 + 6 + 1;
            if !done {
                eprintln!("pool: {warm} warm rows, {containers} containers");
            }
            done.then_some(())
        },
    )
    .await;
    let mut conn = PgConnection::connect(&database)
        .await
        .expect("the database");
    let lost: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state = 'lost'")
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(lost, 0, "shrinking loses nothing");
    let metrics = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("/metrics")
        .text()
        .await
        .expect("a body");
    assert!(
        metrics.contains("sandgate_lease_wait_seconds_count 8"),
        "eight leases were timed:\n{metrics}"
    );
}
