//! Placement and node lifecycle (issue 15) on the one shared engine: a drained node takes no
//! new lease, gives up its warm sandboxes and runs its leased ones out; a `sandgate node`
//! killed while it holds a leased sandbox has it marked lost, the caller is told so, and the
//! node's return removes the container without taking the row back. Two engines side by side
//! are the two-node test's (`scripts/stack.sh`'s second engine).

use std::time::Duration;

use serde_json::json;

use crate::lifecycle::{FAST, db, plain, row_state, sandbox_id};
use crate::mcp_client::{Client, Era};
use crate::support::node::{Engine, NodeProcess, NodeStart};
use crate::support::{self, Gateway, eventually};

const WITHIN: Duration = Duration::from_secs(90);

/// A fast heartbeat and a short silence before a node counts as away, then lost.
const QUICK_NODE: [(&str, &str); 3] = [
    ("SANDGATE_NODE__HEARTBEAT_SECONDS", "1"),
    ("SANDGATE_NODE__AWAY_AFTER_SECONDS", "3"),
    ("SANDGATE_NODE__LOST_AFTER_SECONDS", "3"),
];

/// Away after 3 s of silence, lost only after 10 minutes: a node restart in between loses
/// nothing.
const AWAY_NOT_LOST: [(&str, &str); 3] = [
    ("SANDGATE_NODE__HEARTBEAT_SECONDS", "1"),
    ("SANDGATE_NODE__AWAY_AFTER_SECONDS", "3"),
    ("SANDGATE_NODE__LOST_AFTER_SECONDS", "600"),
];

/// How many warm rows the deployment has.
async fn warm_rows(database: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state = 'warm'")
        .fetch_one(&mut db(database).await)
        .await
        .expect("count")
}

/// A sandbox's container id.
pub(crate) async fn container_of(database: &str, sandbox_id: &str) -> String {
    sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut db(database).await)
        .await
        .expect("the row")
}

#[tokio::test]
async fn a_drained_node_takes_no_new_lease_gives_up_its_pool_and_runs_its_sandboxes_out() {
    let database = support::fresh_database().await;
    let env: Vec<(&str, &str)> = FAST.iter().chain(QUICK_NODE.iter()).copied().collect();
    let gateway = Gateway::start(&database, &env).await;
    let tenant = gateway.create_tenant().await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("connects");
    let before = client
        .ok(
            "execute_code",
            json!({"conversation_id": "before", "code": "x = 41"}),
        )
        .await;
    let id = sandbox_id(&before);
    eventually(WITHIN, "a warm sandbox in the node's pool", || async {
        (warm_rows(&database).await > 0).then_some(())
    })
    .await;

    let engine = Engine::first().id;
    gateway.cli(&["admin", "nodes", "drain", &engine]).await;
    // The node hears of it at its next heartbeat: its pool stops refilling and its warm
    // sandboxes go, rows and containers.
    eventually(
        WITHIN,
        "the drained node's warm sandboxes to go",
        || async {
            let containers = support::containers_of(&gateway.instance);
            (warm_rows(&database).await == 0 && containers.len() == 1).then_some(())
        },
    )
    .await;
    let refused = client
        .call("create_sandbox", json!({"conversation_id": "after"}))
        .await
        .expect("a tool result");
    assert!(
        refused.is_error
            && refused.text.contains("limit reached")
            && refused.text.contains("draining")
            && refused.text.contains("retry"),
        "a lease with every node draining is refused clearly and retryably: {}",
        refused.text
    );
    // The leased sandbox runs on.
    let kept = client
        .ok("execute_code", json!({"sandbox_id": id, "code": "x + 1"}))
        .await;
    assert_eq!(
        plain(&kept),
        "42",
        "a drained node's leased sandbox still serves"
    );
    assert_eq!(
        support::containers_of(&gateway.instance).len(),
        1,
        "no warm sandbox came back while draining"
    );

    gateway.cli(&["admin", "nodes", "undrain", &engine]).await;
    let after = client
        .ok("create_sandbox", json!({"conversation_id": "after"}))
        .await;
    assert_ne!(
        sandbox_id(&after),
        id,
        "a new lease once the node takes leases again"
    );
}

/// Starts `sandgate node` for `instance` on a loopback port (cleartext), with a fast heartbeat
/// and the fast clocks of the lifecycle tests.
async fn start_node(database: &str, instance: &str) -> NodeProcess {
    NodeStart::new(database, instance)
        .env(QUICK_NODE)
        .env(FAST)
        .start()
        .await
}

#[tokio::test]
async fn a_killed_node_s_sandbox_is_lost_with_a_clear_error_and_its_return_removes_the_container() {
    let database = support::fresh_database().await;
    let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut node = start_node(&database, &instance).await;
    let env: Vec<(&str, &str)> = FAST.iter().chain(QUICK_NODE.iter()).copied().collect();
    let gateway = Gateway::start_gateway_only(&database, &instance, &env).await;
    let tenant = gateway.create_tenant().await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("connects");
    let created = client.ok("execute_code", json!({"code": "x = 1\nx"})).await;
    let id = sandbox_id(&created);
    let container = container_of(&database, &id).await;
    assert!(
        support::containers_of(&instance).contains(&container),
        "the gateway-only replica placed the sandbox on the node"
    );

    node.kill().await;
    // Before the sweep a call gets a retryable "did not answer"; after it, the sandbox is lost,
    // and the error names the node and says what to do.
    let lost = eventually(WITHIN, "a call to say the sandbox was lost", || async {
        let r = client
            .call("execute_code", json!({"sandbox_id": id, "code": "x"}))
            .await
            .expect("a tool result");
        assert!(
            r.is_error,
            "a call to a killed node's sandbox fails: {}",
            r.text
        );
        assert!(
            r.text.contains("retry") || r.text.contains("create_sandbox"),
            "every failure says what to do: {}",
            r.text
        );
        r.text.contains("was lost").then_some(r.text)
    })
    .await;
    assert!(
        lost.contains(&id)
            && lost.contains(node.id())
            && lost.contains("stopped answering at")
            && lost.contains("create_sandbox"),
        "the error names the sandbox, its node and when it went silent, and what to do: {lost}"
    );
    assert_eq!(row_state(&database, &id).await.0, "lost");
    assert!(
        support::containers_of(&instance).contains(&container),
        "the container outlives its node's process (nobody else may remove it)"
    );

    // The node returns: its reconciliation removes the container of the lost row, and the row
    // stays lost (never adopted back).
    let _node = start_node(&database, &instance).await;
    eventually(
        WITHIN,
        "the returned node to remove the lost sandbox's container",
        || async { (!support::containers_of(&instance).contains(&container)).then_some(()) },
    )
    .await;
    assert_eq!(
        row_state(&database, &id).await.0,
        "lost",
        "the row stays lost"
    );
    let fresh = client.ok("execute_code", json!({"code": "'fresh'"})).await;
    assert_ne!(sandbox_id(&fresh), id, "a new sandbox on the returned node");
}

#[tokio::test]
async fn a_node_away_past_its_away_deadline_keeps_its_sandboxes_and_variables_when_it_returns() {
    let database = support::fresh_database().await;
    let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let node_start = || {
        NodeStart::new(&database, &instance)
            .env(AWAY_NOT_LOST)
            .env(FAST)
    };
    let mut node = node_start().start().await;
    let env: Vec<(&str, &str)> = FAST.iter().chain(AWAY_NOT_LOST.iter()).copied().collect();
    let gateway = Gateway::start_gateway_only(&database, &instance, &env).await;
    let tenant = gateway.create_tenant().await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("connects");
    let mut ids = Vec::new();
    for (conversation, value) in [("a", 1), ("b", 2)] {
        let created = client
            .ok(
                "execute_code",
                json!({"conversation_id": conversation, "code": format!("x = {value}\nx")}),
            )
            .await;
        ids.push((sandbox_id(&created), value));
    }

    // Killed with its containers left running (a crash, an upgrade), and silent past the away
    // deadline: every call gets a retryable answer naming the node, and nothing is lost.
    node.kill().await;
    let node_id = node.id().to_owned();
    eventually(
        WITHIN,
        "the node to be away in `admin nodes list`",
        || async {
            let listed = gateway.cli(&["admin", "nodes", "list"]).await;
            listed.contains(" away ").then_some(())
        },
    )
    .await;
    for (id, _) in &ids {
        let r = client
            .call("execute_code", json!({"sandbox_id": id, "code": "x"}))
            .await
            .expect("a tool result");
        assert!(
            r.is_error && r.text.contains(&node_id) && r.text.contains("retry"),
            "a call on an away node's sandbox gets a retryable answer naming the node: {}",
            r.text
        );
        assert_eq!(
            row_state(&database, id).await.0,
            "leased",
            "{id} is not lost"
        );
    }

    // It returns (same engine, containers still there): it takes them back, with their state.
    let _node = node_start().start().await;
    for (id, value) in &ids {
        let kept = eventually(WITHIN, "the returned node to serve the sandbox", || async {
            let r = client
                .call("execute_code", json!({"sandbox_id": id, "code": "x"}))
                .await
                .expect("a tool result");
            (!r.is_error).then_some(r)
        })
        .await;
        assert_eq!(
            plain(&kept),
            value.to_string(),
            "{id} kept its variables across the node's absence"
        );
    }
}

#[tokio::test]
async fn a_gateway_only_replica_needs_no_docker_and_stays_ready_while_its_nodes_drain() {
    let database = support::fresh_database().await;
    let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    // An engine address nothing answers at: a gateway-only replica never talks to Docker.
    let env: Vec<(&str, &str)> = QUICK_NODE
        .iter()
        .copied()
        .chain([("SANDGATE_DOCKER__HOST", "tcp://127.0.0.1:1")])
        .collect();
    let gateway = Gateway::start_gateway_only(&database, &instance, &env).await;
    let readyz = || async {
        let response = reqwest::get(format!("{}/readyz", gateway.base_url))
            .await
            .expect("/readyz answers");
        let status = response.status();
        let body: serde_json::Value = response.json().await.expect("a JSON body");
        (status, body)
    };
    let (status, body) = readyz().await;
    assert_eq!(status, 503, "no node registered yet: {body}");
    assert_eq!(body["checks"]["postgres"]["ok"], true, "{body}");
    assert_eq!(body["checks"]["nodes"]["ok"], false, "{body}");
    assert!(
        body["checks"]["nodes"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("sandgate node")),
        "the failed check says what to do: {body}"
    );
    assert!(
        body["checks"].get("docker").is_none(),
        "a gateway-only replica does not check Docker: {body}"
    );

    let node = start_node(&database, &instance).await;
    let body = eventually(
        WITHIN,
        "the replica to be ready once a node runs",
        || async {
            let (status, body) = readyz().await;
            (status == 200).then_some(body)
        },
    )
    .await;
    assert_eq!(body["checks"]["nodes"]["ok"], true, "{body}");
    assert_eq!(body["checks"]["new_sandboxes"]["ok"], true, "{body}");

    // Every node draining (a roll): the replica stays ready (its pages and the leased sandboxes
    // serve) and says that new sandboxes wait, and what to do.
    gateway.cli(&["admin", "nodes", "drain", node.id()]).await;
    let (status, body) = readyz().await;
    assert_eq!(status, 200, "a drain does not take the replica out: {body}");
    assert_eq!(body["status"], "ready", "{body}");
    assert_eq!(body["checks"]["nodes"]["ok"], true, "{body}");
    assert_eq!(body["checks"]["new_sandboxes"]["ok"], false, "{body}");
    assert!(
        body["checks"]["new_sandboxes"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("draining") && e.contains("nodes undrain")),
        "says why and what to do: {body}"
    );
    gateway.cli(&["admin", "nodes", "undrain", node.id()]).await;
    let (status, body) = readyz().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["checks"]["new_sandboxes"]["ok"], true, "{body}");
}

/// The value of the unlabelled series `metric` (or `metric{labels}`) in a `/metrics` text.
fn node_series(text: &str, metric: &str) -> Option<f64> {
    let prefix = format!("{metric} ");
    text.lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn a_gateway_only_replica_exports_the_nodes_pool_numbers_from_postgres_naming_no_node() {
    let database = support::fresh_database().await;
    let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let _node = start_node(&database, &instance).await;
    let env: Vec<(&str, &str)> = FAST.iter().chain(QUICK_NODE.iter()).copied().collect();
    let gateway = Gateway::start_gateway_only(&database, &instance, &env).await;
    let node = Engine::first().id;
    let scrape = || async {
        reqwest::get(format!("{}/metrics", gateway.base_url))
            .await
            .expect("/metrics answers")
            .text()
            .await
            .expect("a body")
    };
    // The node's numbers, though this replica has no node (and no pool) of its own.
    let text = eventually(WITHIN, "the node's series on the replica", || async {
        let text = scrape().await;
        node_series(&text, "sandgate_node_leased_sandboxes").map(|_| text)
    })
    .await;
    assert_eq!(
        node_series(&text, "sandgate_node_leased_sandboxes"),
        Some(0.0),
        "nothing leased yet:\n{text}"
    );
    assert!(
        node_series(&text, "sandgate_node_slots").is_some_and(|s| s >= 1.0),
        "the node's slots:\n{text}"
    );
    assert_eq!(
        node_series(&text, r#"sandgate_nodes{state="draining"}"#),
        Some(0.0)
    );
    assert!(
        node_series(&text, "sandgate_node_heartbeat_age_seconds").is_some_and(|age| age >= 0.0),
        "the node's heartbeat age:\n{text}"
    );

    // A lease through the replica shows on its /metrics (within the few seconds it caches).
    let tenant = gateway.create_tenant().await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("a client");
    let ran = client
        .ok(
            "execute_code",
            json!({"conversation_id": "metrics", "code": "1 + 1"}),
        )
        .await;
    let sandbox = sandbox_id(&ran);
    let text = eventually(WITHIN, "the lease on the replica's /metrics", || async {
        let text = scrape().await;
        (node_series(&text, "sandgate_node_leased_sandboxes") == Some(1.0)).then_some(text)
    })
    .await;
    // Anyone who reaches /metrics reads it: it names no tenant, sandbox, node or host.
    assert!(
        !text.contains(&sandbox)
            && !text.contains(&tenant)
            && !text.contains(&node)
            && !text.contains("node=\"")
            && !text.contains("host=\""),
        "no sandbox, tenant, node id or host name in /metrics:\n{text}"
    );
    gateway.cli(&["admin", "nodes", "drain", &node]).await;
    eventually(WITHIN, "the drain on the replica's /metrics", || async {
        let text = scrape().await;
        (node_series(&text, r#"sandgate_nodes{state="draining"}"#) == Some(1.0)).then_some(())
    })
    .await;
}
