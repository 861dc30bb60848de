//! Past one machine (issue 15, "Tests on real parts"): two `serve --gateway-only` replicas and
//! two `sandgate node` processes, each node on its own Docker engine of this machine (the
//! stack's and the second one `scripts/stack.sh` starts), one Postgres, mutual TLS with a CA made
//! here, and a round-robin load balancer with no stickiness in front of the replicas.
//! Conversations in both protocol eras go through it while the test kills a replica, drains a
//! node, then stops a node's engine; after each, Postgres and both engines agree (0 containers
//! owned twice or on the wrong node's engine, 0 orphans, 0 live rows without a container), and
//! every call the event touched got a clear answer the caller can act on. At the end, the
//! official Python SDK's conversation runs through the same deployment in both eras.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::lifecycle::{FAST, plain, row_state, sandbox_id};
use crate::mcp_client::{Client, Era, ToolResult};
use crate::support::eventually;
use crate::support::node::{Engine, NodeProcess, TlsFiles};
use crate::support::replicas::{Deployment, RoundRobin};
use crate::support::scale_out::{
    SECOND_ENGINE, kill_second_engine, node_of, nodes_admin, nodes_cli, nodes_with_leases,
    ownership_problems_on, spawn_gateway, spawn_node,
};

const WITHIN: Duration = Duration::from_secs(90);

/// `execute_code` with `code` in `sandbox`.
fn cell(sandbox: &str, code: &str) -> Value {
    json!({"sandbox_id": sandbox, "code": code})
}

/// Waits until Postgres and both engines agree for the deployment; panics with what differs and
/// the latest warnings of `nodes`.
async fn agree(deployment: &Deployment, engines: &[&Engine], nodes: &[&NodeProcess], after: &str) {
    let mut last = Vec::new();
    let agreed = tokio::time::timeout(WITHIN, async {
        loop {
            last = ownership_problems_on(&deployment.database, &deployment.instance, engines).await;
            if last.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    if agreed.is_err() {
        for node in nodes {
            eprintln!("[scale_out] node {}'s latest warnings:", node.id());
            for line in node.warnings() {
                eprintln!("[scale_out]   {line}");
            }
        }
    }
    assert!(
        agreed.is_ok(),
        "after {after}: 0 double owners, 0 cross-owned, 0 orphans expected; still: {last:#?}"
    );
}

/// A conversation: the sandbox of `conversation` (created through the balancer), with `n = 1`.
async fn open(client: &Client, conversation: &str) -> String {
    let first = client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": "n = 1\nn"}),
        )
        .await;
    sandbox_id(&first)
}

/// One more step of a conversation: `n += 1`, and the value it should have reached.
async fn step(client: &Client, sandbox: &str, expect: u32) {
    let next = client.ok("execute_code", cell(sandbox, "n += 1\nn")).await;
    assert_eq!(
        plain(&next),
        expect.to_string(),
        "sandbox {sandbox} kept its kernel's state"
    );
}

/// Whether the text a model reads tells it what to do next: retry, or start a new sandbox.
fn actionable(result: &ToolResult) -> bool {
    let text = result.text.to_lowercase();
    result.is_error
        && (text.contains("retry")
            || text.contains("try again")
            || text.contains("create_sandbox")
            || text.contains("new sandbox"))
}

#[tokio::test]
async fn two_gateways_two_nodes_survive_a_killed_replica_a_drained_node_and_a_lost_engine() {
    let _second_engine = SECOND_ENGINE.lock().await;
    let (first, second) = (Engine::first(), Engine::second());
    let engines = [&first, &second];
    let lb = RoundRobin::start().await;
    let deployment = Deployment::new().await.behind(&lb);
    let tls = TlsFiles::new(&deployment.instance);
    let node_a = spawn_node(&deployment, &first, &tls, &FAST).await;
    let node_b = spawn_node(&deployment, &second, &tls, &FAST).await;
    let mut g0 = spawn_gateway(0, &deployment, &tls, &FAST).await;
    let g1 = spawn_gateway(1, &deployment, &tls, &FAST).await;
    lb.route(&[&g0, &g1]);
    let listed = nodes_cli(&deployment.database, &["list"]).await;
    for node in [&node_a, &node_b] {
        assert!(
            listed.contains(node.id()) && listed.contains(&node.url),
            "`admin nodes list` shows node {} at {}:\n{listed}",
            node.id(),
            node.url
        );
    }
    let tenant = g0.create_tenant().await;
    let token = g0.token(&tenant).await;

    // Conversations in both eras, every call through the next replica in turn. The first lands
    // where placement puts it; draining that node sends the next ones to the other.
    let stateless = Arc::new(
        Client::connect(&lb.mcp_url(), &token, Era::Stateless)
            .await
            .expect("discover through the balancer"),
    );
    let legacy = Client::connect(&lb.mcp_url(), &token, Era::Sessions)
        .await
        .expect("initialize through the balancer");
    assert_eq!(legacy.protocol_version(), "2025-11-25");
    let s1 = open(&stateless, "ticket-1").await;
    let on_s1 = node_of(&deployment.database, &s1).await;
    let other = if on_s1 == node_a.id() {
        node_b.id()
    } else {
        node_a.id()
    };
    nodes_admin(&deployment.database, "drain", &on_s1).await;
    let s2 = open(&stateless, "ticket-2").await;
    let l1 = open(&legacy, "session-1").await;
    nodes_admin(&deployment.database, "undrain", &on_s1).await;
    assert_eq!(node_of(&deployment.database, &s2).await, other);
    assert_eq!(node_of(&deployment.database, &l1).await, other);
    for (sandbox, client) in [(&s1, &*stateless), (&s2, &*stateless), (&l1, &legacy)] {
        step(client, sandbox, 2).await;
    }
    let leased_on = nodes_with_leases(&deployment.database).await;
    assert!(
        leased_on.contains(node_a.id()) && leased_on.contains(node_b.id()),
        "leases on both nodes before anything breaks: {leased_on:?}"
    );
    agree(
        &deployment,
        &engines,
        &[&node_a, &node_b],
        "the conversations started",
    )
    .await;

    // (a) A replica is killed while a cell runs through it: the call breaks off as a transport
    // error (the caller retries); every conversation goes on through the other replica, with its
    // sandbox and its kernel's state.
    lb.route(&[&g0]);
    let slow = {
        let stateless = stateless.clone();
        let s2 = s2.clone();
        tokio::spawn(async move {
            tokio::time::timeout(
                WITHIN,
                stateless.call(
                    "execute_code",
                    cell(&s2, "import time\ntime.sleep(3)\nn += 10\nn"),
                ),
            )
            .await
            .expect("the call ends")
            .map_err(|e| e.to_string())
        })
    };
    eventually(WITHIN, "the slow cell's mark in Postgres", || async {
        let marks: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sandbox_call_marks WHERE sandbox_id = $1 AND until > now()",
        )
        .bind(&s2)
        .fetch_one(&mut crate::lifecycle::db(&deployment.database).await)
        .await
        .expect("count");
        (marks > 0).then_some(())
    })
    .await;
    lb.route(&[&g0, &g1]);
    g0.kill().await;
    let err = slow
        .await
        .expect("the call task")
        .expect_err("a call on a killed replica fails, and says so");
    eprintln!("[scale_out] killed replica, call in flight: {err}");
    assert!(
        err.contains("Transport"),
        "the failure is the connection's, which the caller retries: {err}"
    );
    step(&stateless, &s1, 3).await;
    step(&legacy, &l1, 3).await;
    // The node saw the killed replica's RPC stream close: a cancellation, so it interrupted the
    // cell (as when a client cancels); the kernel kept its state.
    let after = stateless.ok("execute_code", cell(&s2, "n")).await;
    assert_eq!(
        plain(&after),
        "2",
        "the cut-off cell was interrupted on its node, before `n += 10`; the kernel kept n"
    );
    agree(
        &deployment,
        &engines,
        &[&node_a, &node_b],
        "a replica was killed",
    )
    .await;

    // (b) A node is drained: its sandboxes keep serving, new ones go to the other node; with
    // both drained, a new sandbox is refused with an answer that says to retry.
    nodes_admin(&deployment.database, "drain", node_b.id()).await;
    for (sandbox, client) in [(&s1, &*stateless), (&l1, &legacy)] {
        let kept = client.ok("execute_code", cell(sandbox, "n")).await;
        assert_eq!(
            plain(&kept),
            "3",
            "{sandbox} still serves on a draining node"
        );
    }
    let s3 = open(&stateless, "ticket-3").await;
    assert_eq!(
        node_of(&deployment.database, &s3).await,
        node_a.id(),
        "a new sandbox goes to the node that is not draining"
    );
    nodes_admin(&deployment.database, "drain", node_a.id()).await;
    let refused = stateless
        .call(
            "create_sandbox",
            json!({"conversation_id": "ticket-while-everything-drains"}),
        )
        .await
        .expect("a tool result, not a protocol error");
    eprintln!("[scale_out] every node draining: {}", refused.text);
    assert!(
        actionable(&refused) && refused.text.contains("node"),
        "with every node draining, a new sandbox is refused clearly: {}",
        refused.text
    );
    nodes_admin(&deployment.database, "undrain", node_a.id()).await;
    nodes_admin(&deployment.database, "undrain", node_b.id()).await;
    agree(
        &deployment,
        &engines,
        &[&node_a, &node_b],
        "a node was drained",
    )
    .await;

    // (c) Node B's engine stops. Calls on its sandboxes are answered with an error that says what
    // to do; node A's sandboxes are untouched. When the engine is back, its sandboxes (their
    // containers did not survive the engine) are lost, said so plainly, and nothing is left over.
    let mut on_b: Vec<(&String, &Client)> = Vec::new();
    for (sandbox, client) in [(&s1, &*stateless), (&s2, &*stateless), (&l1, &legacy)] {
        if node_of(&deployment.database, sandbox).await == node_b.id() {
            on_b.push((sandbox, client));
        }
    }
    assert!(
        !on_b.is_empty(),
        "node B holds sandboxes of the conversations"
    );
    let engine_down = kill_second_engine().await;
    for (sandbox, client) in &on_b {
        let answer = client
            .call("execute_code", cell(sandbox, "n"))
            .await
            .expect("a tool result, not a protocol error");
        eprintln!("[scale_out] engine down, {sandbox}: {}", answer.text);
        assert!(
            actionable(&answer),
            "a call on {sandbox} while its node's engine is down says what to do: {}",
            answer.text
        );
    }
    let untouched = stateless.ok("execute_code", cell(&s3, "n")).await;
    assert_eq!(plain(&untouched), "1", "node A's sandbox is untouched");
    engine_down.restart().await;
    for (sandbox, client) in &on_b {
        let answer = eventually(WITHIN, "the lost sandbox to be reported lost", || async {
            let answer = client
                .call("execute_code", cell(sandbox, "n"))
                .await
                .expect("a tool result");
            (answer.is_error && row_state(&deployment.database, sandbox).await.0 != "leased")
                .then_some(answer)
        })
        .await;
        eprintln!("[scale_out] engine back, {sandbox}: {}", answer.text);
        assert!(
            actionable(&answer) && answer.text.contains(sandbox.as_str()),
            "a call on a sandbox whose container the engine lost names it and says to start \
             anew: {}",
            answer.text
        );
    }
    agree(
        &deployment,
        &engines,
        &[&node_a, &node_b],
        "node B's engine was stopped and came back",
    )
    .await;
    // The deployment still serves new conversations, in both eras.
    let s4 = open(&stateless, "ticket-4").await;
    step(&stateless, &s4, 2).await;
    let l2 = open(&legacy, "session-2").await;
    step(&legacy, &l2, 2).await;
    // And the official Python SDK's support-analyst conversation, in both eras, through the
    // balancer: two replicas, two nodes.
    let python = crate::python_sdk::python();
    for mode in ["legacy", "2026-07-28"] {
        crate::python_sdk::run_script(&python, &lb.mcp_url(), &token, mode).await;
    }
    agree(
        &deployment,
        &engines,
        &[&node_a, &node_b],
        "new conversations after the outage",
    )
    .await;
    drop((g1, node_a, node_b));
}

/// The container of a sandbox's row.
async fn container_of(database: &str, sandbox_id: &str) -> String {
    sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut crate::lifecycle::db(database).await)
        .await
        .expect("the sandbox's row")
}

/// How many transcript entries the sandboxes in `ids` have.
async fn transcript_entries(database: &str, ids: &[&String]) -> i64 {
    let ids: Vec<String> = ids.iter().map(|s| (*s).clone()).collect();
    sqlx::query_scalar("SELECT count(*) FROM transcript_entries WHERE sandbox_id = ANY($1)")
        .bind(&ids)
        .fetch_one(&mut crate::lifecycle::db(database).await)
        .await
        .expect("a count")
}

/// Opens `conversation` of `client` on node `on`: every other node of `all` drained meanwhile.
async fn open_on(
    database: &str,
    client: &Client,
    conversation: &str,
    on: &str,
    all: &[&str],
) -> String {
    for node in all.iter().filter(|n| **n != on) {
        nodes_admin(database, "drain", node).await;
    }
    let sandbox = open(client, conversation).await;
    for node in all.iter().filter(|n| **n != on) {
        nodes_admin(database, "undrain", node).await;
    }
    assert_eq!(
        node_of(database, &sandbox).await,
        on,
        "{conversation} was placed on {on}"
    );
    sandbox
}

#[tokio::test]
async fn purging_a_tenant_removes_its_containers_on_every_node_and_a_silent_node_removes_the_rest_on_return()
 {
    let _second_engine = SECOND_ENGINE.lock().await;
    let (first, second) = (Engine::first(), Engine::second());
    let engines = [&first, &second];
    let deployment = Deployment::new().await;
    let tls = TlsFiles::new(&deployment.instance);
    let node_a = spawn_node(&deployment, &first, &tls, &FAST).await;
    let mut node_b = spawn_node(&deployment, &second, &tls, &FAST).await;
    let gateway = spawn_gateway(0, &deployment, &tls, &FAST).await;
    let db = deployment.database.as_str();
    let (victim, other) = (gateway.create_tenant().await, gateway.create_tenant().await);
    let connect = |tenant: String| {
        let gateway = &gateway;
        async move {
            let token = gateway.token(&tenant).await;
            Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
                .await
                .expect("a client")
        }
    };
    let (victims, others) = (connect(victim.clone()).await, connect(other.clone()).await);
    let all = [node_a.id(), node_b.id()];

    // The tenant to purge has a sandbox on each node, with a transcript; so has another tenant.
    let v_a = open_on(db, &victims, "v-a", node_a.id(), &all).await;
    let v_b = open_on(db, &victims, "v-b", node_b.id(), &all).await;
    let o_a = open_on(db, &others, "o-a", node_a.id(), &all).await;
    let o_b = open_on(db, &others, "o-b", node_b.id(), &all).await;
    let victim_containers = [container_of(db, &v_a).await, container_of(db, &v_b).await];
    eventually(WITHIN, "the purged tenant's transcripts", || async {
        (transcript_entries(db, &[&v_a, &v_b]).await >= 2).then_some(())
    })
    .await;

    // The purge (the admin command with the gateway's configuration: this host's engine is
    // node A's, node B is reached over the node RPC with the deployment's certificates).
    let purged = gateway.cli(&["admin", "tenant", "purge", &victim]).await;
    eprintln!("[purge] both nodes up:\n{purged}");
    assert!(
        purged.contains("closed 2 live sandboxes")
            && purged.contains("removed 2 containers")
            && !purged.contains("could not be removed"),
        "both sandboxes closed and both containers removed, one per node: {purged}"
    );
    for (engine, container) in engines.iter().zip(&victim_containers) {
        assert!(
            !engine
                .containers_of(&deployment.instance)
                .contains(container),
            "the purged tenant's container {container} is gone from engine {}",
            engine.id
        );
    }
    assert_eq!(
        transcript_entries(db, &[&v_a, &v_b]).await,
        0,
        "its transcripts are gone"
    );
    for sandbox in [&v_a, &v_b] {
        let after = victims
            .call("execute_code", cell(sandbox, "n"))
            .await
            .expect("a tool result");
        assert!(after.is_error, "{sandbox} is closed: {}", after.text);
    }
    for sandbox in [&o_a, &o_b] {
        step(&others, sandbox, 2).await;
    }
    agree(
        &deployment,
        &engines,
        &[&node_a, &node_b],
        "the purge with both nodes up",
    )
    .await;

    // Node B is silent (its process killed; its engine runs on): the purge removes what it can,
    // names node B for the rest, and node B removes it when it comes back.
    let v_b2 = open_on(db, &victims, "v-b2", node_b.id(), &all).await;
    let stranded = container_of(db, &v_b2).await;
    node_b.kill().await;
    let purged = gateway.cli(&["admin", "tenant", "purge", &victim]).await;
    eprintln!("[purge] node B silent:\n{purged}");
    assert!(
        purged.contains("closed 1 live sandboxes")
            && purged.contains(&format!("1 containers on node {}", node_b.id()))
            && purged.contains("could not be removed now")
            && purged.contains("next reconciliation")
            && purged.contains(&stranded),
        "the report names node B and its container, and who removes it: {purged}"
    );
    assert!(
        second
            .containers_of(&deployment.instance)
            .contains(&stranded),
        "the container is still on node B's engine, as the report says"
    );
    let returned = spawn_node(&deployment, &second, &tls, &FAST).await;
    eventually(
        WITHIN,
        "node B's reconciliation to remove the purged container",
        || async {
            (!second
                .containers_of(&deployment.instance)
                .contains(&stranded))
            .then_some(())
        },
    )
    .await;
    // The other tenant's sandbox on node B went on running: the returned node serves it (the
    // gateway first finds node B's new address).
    let kept = eventually(WITHIN, "the other tenant's sandbox on node B", || async {
        let answer = others.call("execute_code", cell(&o_b, "n")).await.ok()?;
        (!answer.is_error).then_some(answer)
    })
    .await;
    assert_eq!(
        plain(&kept),
        "2",
        "the other tenant's kernel kept its state"
    );
    agree(
        &deployment,
        &engines,
        &[&node_a, &returned],
        "node B came back after the purge",
    )
    .await;
    drop((gateway, node_a, returned, node_b));
}

#[tokio::test]
async fn a_start_cut_short_by_its_engine_leaves_no_container_once_the_engine_is_back() {
    let _second_engine = SECOND_ENGINE.lock().await;
    let second = Engine::second();
    let deployment = Deployment::new().await;
    let tls = TlsFiles::new(&deployment.instance);
    // A warm start on a fiftieth of a CPU takes seconds to reach the agent's ready frame; the
    // engine dies meanwhile, so the start fails and its container cannot be removed then.
    // Unknown containers are spared for an hour: only the node's memory of the failed start
    // can get this one removed soon.
    let node = spawn_node(
        &deployment,
        &second,
        &tls,
        &[
            ("SANDGATE_SANDBOX__CPUS", "0.02"),
            ("SANDGATE_LIFECYCLE__RECONCILE_INTERVAL_SECONDS", "2"),
            ("SANDGATE_LIFECYCLE__ORPHAN_GRACE_SECONDS", "3600"),
        ],
    )
    .await;
    let starting = eventually(WITHIN, "the warm start's container", || async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        second
            .containers_of(&deployment.instance)
            .into_iter()
            .next()
    })
    .await;
    let engine_down = kill_second_engine().await;
    engine_down.restart().await;
    eprintln!(
        "[scale_out] after the restart, the cut-short start's container: {}",
        second.describe(&starting)
    );
    eventually(
        WITHIN,
        "the node to remove the container of its cut-short start",
        || async {
            (!second
                .containers_of(&deployment.instance)
                .contains(&starting))
            .then_some(())
        },
    )
    .await;
    let mut conn = crate::lifecycle::db(&deployment.database).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE container_id = $1")
        .bind(&starting)
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(rows, 0, "nothing ever recorded the cut-short start");
    drop(node);
}
