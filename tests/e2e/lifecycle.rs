//! Chaos tests of the sandbox lifecycle (issue 5's "Done when"): a gateway killed mid-cell,
//! idle timeouts, expiry while the gateway is down, containers removed behind its back, tenant
//! limits, a Postgres outage, two gateways sharing one pool, and the audit trail of all of it.
//! The real binary, Postgres and Docker throughout.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, Row};

use crate::mcp_client::{Client, Era, ToolResult};
use crate::support::{self, Gateway, TcpProxy, containers_of_sandbox};

/// Fast lifecycle timing for tests: the reaper every 500 ms, reconciliation every 2 s, and
/// containers unknown to Postgres (and not started by the process itself) taken for orphans
/// after 20 s.
pub(crate) const FAST: [(&str, &str); 3] = [
    ("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "500"),
    ("SANDGATE_LIFECYCLE__RECONCILE_INTERVAL_SECONDS", "2"),
    ("SANDGATE_LIFECYCLE__ORPHAN_GRACE_SECONDS", "20"),
];

/// A client that counts the calls that got an answer, to check the audit trail against.
struct Counted {
    client: Client,
    answered: Arc<AtomicUsize>,
}

impl Counted {
    async fn connect(gateway: &Gateway, token: &str, answered: &Arc<AtomicUsize>) -> Counted {
        let client = Client::connect(&gateway.mcp_url(), token, Era::Stateless)
            .await
            .expect("client connects");
        Counted {
            client,
            answered: answered.clone(),
        }
    }

    /// Calls a tool; panics on a protocol-level error (the tools answer problems as results).
    async fn call(&self, tool: &str, args: Value) -> ToolResult {
        let result = self
            .client
            .call(tool, args.clone())
            .await
            .unwrap_or_else(|e| panic!("{tool} {args} failed at the protocol level: {e}"));
        self.answered.fetch_add(1, Ordering::SeqCst);
        result
    }

    /// Calls a tool that must succeed.
    async fn ok(&self, tool: &str, args: Value) -> ToolResult {
        let result = self.call(tool, args.clone()).await;
        assert!(
            !result.is_error,
            "{tool} {args} returned isError: {}",
            result.text
        );
        result
    }
}

pub(crate) fn sandbox_id(result: &ToolResult) -> String {
    result.structured["sandbox_id"]
        .as_str()
        .expect("the result names a sandbox id")
        .to_owned()
}

pub(crate) fn plain(result: &ToolResult) -> String {
    result.structured["result"]["text/plain"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

pub(crate) async fn db(url: &str) -> PgConnection {
    PgConnection::connect(url)
        .await
        .expect("the test database answers")
}

/// (state, close_reason) of a sandbox row.
pub(crate) async fn row_state(url: &str, sandbox_id: &str) -> (String, Option<String>) {
    let row = sqlx::query("SELECT state, close_reason FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut db(url).await)
        .await
        .expect("the sandbox has a row");
    (row.get("state"), row.get("close_reason"))
}

/// Whether the containers of `instance` are exactly those of the live (warm or leased) rows and
/// no row is `lost`: nothing orphaned, nothing lost. `None` (with what differs, logged) until so.
async fn consistent(url: &str, instance: &str) -> Option<()> {
    let mut conn = db(url).await;
    let live: HashSet<String> =
        sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE state IN ('warm', 'leased')")
            .fetch_all(&mut conn)
            .await
            .expect("rows")
            .into_iter()
            .collect();
    let lost: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state = 'lost'")
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(lost, 0, "no sandbox may be lost");
    let containers: HashSet<String> = support::containers_of(instance).into_iter().collect();
    (live == containers).then_some(())
}

/// Polls the audit trail (through `sandgate admin audit`) until it holds `expected` events.
async fn assert_audit_count(gateway: &Gateway, tenant: &str, expected: usize) {
    let mut last = String::new();
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        last = gateway
            .cli(&["admin", "audit", "--tenant", tenant, "--limit", "10000"])
            .await;
        // A header line, then one line per event.
        seen = last.lines().count().saturating_sub(1);
        if seen == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "the audit trail should hold one event per call: {expected} calls, {seen} events:\n{last}"
    );
}

async fn tenant_with_token(gateway: &Gateway) -> (String, String) {
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    (tenant, token)
}

#[tokio::test]
async fn a_gateway_killed_mid_cell_comes_back_with_the_sandbox_and_its_variables() {
    let database = support::fresh_database().await;
    let mut first = Gateway::start(&database, &FAST).await;
    let (tenant, token) = tenant_with_token(&first).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&first, &token, &answered).await;

    let sid = sandbox_id(&client.ok("create_sandbox", json!({})).await);
    client
        .ok(
            "execute_code",
            json!({"sandbox_id": sid, "code": "x = 41\nbefore = 'defined before the crash'"}),
        )
        .await;
    // A cell that is still running when the gateway dies.
    let running = {
        let client = Client::connect(&first.mcp_url(), &token, Era::Stateless)
            .await
            .expect("client connects");
        let sid = sid.clone();
        tokio::spawn(async move {
            client
                .call(
                    "execute_code",
                    json!({"sandbox_id": sid, "code": "import time\nopen('started', 'w').close()\ntime.sleep(4)\nx += 1"}),
                )
                .await
        })
    };
    support::eventually(
        Duration::from_secs(30),
        "the cell to be running",
        || async {
            let probe = client
                .call(
                    "run_terminal_command",
                    json!({"sandbox_id": sid, "command": "test -f started"}),
                )
                .await;
            (!probe.is_error).then_some(())
        },
    )
    .await;
    // Audit events are written a few milliseconds behind the answers (a crash loses what is
    // not yet written); this test is about the kernel surviving, so let the trail catch up.
    assert_audit_count(&first, &tenant, answered.load(Ordering::SeqCst)).await;
    first.kill().await;
    assert!(
        running.await.expect("the call task ends").is_err(),
        "the running call cannot get an answer from a killed gateway"
    );

    let second = Gateway::start_instance(&database, &first.instance, &FAST).await;
    // Tokens name the gateway's URL as their audience, and the new process has a new port.
    let token = second.token(&tenant).await;
    let client = Counted::connect(&second, &token, &answered).await;
    let after = client
        .ok(
            "execute_code",
            json!({"sandbox_id": sid, "code": "(x, before)"}),
        )
        .await;
    assert_eq!(
        plain(&after),
        "(42, 'defined before the crash')",
        "the kernel survived the crash: the variables are there and the running cell finished"
    );
    assert_eq!(row_state(&database, &sid).await.0, "leased");
    support::eventually(
        Duration::from_secs(60),
        "every container of the instance to have a live row (no orphan) and no row lost",
        || consistent(&database, &second.instance),
    )
    .await;
    assert_audit_count(&second, &tenant, answered.load(Ordering::SeqCst)).await;
    drop(second);
    drop(first);
}

#[tokio::test]
async fn a_sandbox_idle_for_its_timeout_is_closed_within_seconds_never_before() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &FAST).await;
    let (tenant, token) = tenant_with_token(&gateway).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&gateway, &token, &answered).await;

    // Created with a long idle timeout, then shortened by a later call (every tool takes
    // keep_alive_seconds).
    let sid = sandbox_id(
        &client
            .ok("create_sandbox", json!({"keep_alive_seconds": 30}))
            .await,
    );
    client
        .ok(
            "list_files",
            json!({"sandbox_id": sid, "keep_alive_seconds": 3}),
        )
        .await;
    let last_use = Instant::now();
    let closed_after = support::eventually(
        Duration::from_secs(20),
        "the idle sandbox to be closed",
        || async {
            let listed = gateway
                .cli(&["admin", "sandboxes", "--tenant", &tenant])
                .await;
            (!listed.contains(&sid)).then(|| last_use.elapsed())
        },
    )
    .await;
    assert!(
        closed_after >= Duration::from_millis(2900),
        "closed after {closed_after:?}: never before its 3 s idle timeout"
    );
    assert!(
        closed_after <= Duration::from_secs(6),
        "closed after {closed_after:?}: within a few seconds of its 3 s idle timeout"
    );
    assert_eq!(
        row_state(&database, &sid).await,
        ("closed".to_owned(), Some("idle".to_owned()))
    );
    support::eventually(
        Duration::from_secs(10),
        "its container to be removed",
        || async { containers_of_sandbox(&sid).is_empty().then_some(()) },
    )
    .await;
    let refused = client
        .call("execute_code", json!({"sandbox_id": sid, "code": "1 + 1"}))
        .await;
    assert!(refused.is_error, "a call on an expired sandbox fails");
    assert!(
        refused.text.contains("expired after 3 s idle at")
            && refused.text.contains("call create_sandbox"),
        "the answer says what happened and what to do: {}",
        refused.text
    );
    assert_audit_count(&gateway, &tenant, answered.load(Ordering::SeqCst)).await;
}

#[tokio::test]
async fn a_sandbox_used_every_second_outlives_its_idle_timeout() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &FAST).await;
    let (tenant, token) = tenant_with_token(&gateway).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&gateway, &token, &answered).await;

    let sid = sandbox_id(
        &client
            .ok("create_sandbox", json!({"keep_alive_seconds": 4}))
            .await,
    );
    client
        .ok(
            "execute_code",
            json!({"sandbox_id": sid, "code": "calls = 0"}),
        )
        .await;
    // Eight calls a second apart: the sandbox ends up older than its 4 s idle timeout (by the
    // ticks alone, seven seconds), never idle for more than about a second.
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    for _ in 0..8 {
        ticker.tick().await;
        client
            .ok(
                "execute_code",
                json!({"sandbox_id": sid, "code": "calls += 1\ncalls"}),
            )
            .await;
    }
    let listed = gateway
        .cli(&["admin", "sandboxes", "--tenant", &tenant])
        .await;
    assert!(
        listed.contains(&sid),
        "alive past its idle timeout in total age: {listed}"
    );
    let last = client
        .ok("execute_code", json!({"sandbox_id": sid, "code": "calls"}))
        .await;
    assert!(
        plain(&last) == "8",
        "the same kernel served every call: {}",
        plain(&last)
    );
    assert_audit_count(&gateway, &tenant, answered.load(Ordering::SeqCst)).await;
}

#[tokio::test]
async fn a_sandbox_that_expired_while_the_gateway_was_stopped_is_closed_at_start_up() {
    let database = support::fresh_database().await;
    let mut first = Gateway::start(&database, &FAST).await;
    let (tenant, token) = tenant_with_token(&first).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&first, &token, &answered).await;
    let sid = sandbox_id(
        &client
            .ok("create_sandbox", json!({"keep_alive_seconds": 3}))
            .await,
    );
    assert!(first.terminate().await, "the gateway stops cleanly");
    assert_eq!(
        containers_of_sandbox(&sid).len(),
        1,
        "a leased sandbox keeps running while the gateway is stopped"
    );
    // Let its idle deadline pass while no gateway runs.
    support::eventually(
        Duration::from_secs(10),
        "the sandbox's idle deadline to pass",
        || async {
            let passed: bool = sqlx::query_scalar(
                "SELECT now() > last_used_at + make_interval(secs => idle_timeout_seconds) FROM sandboxes WHERE id = $1",
            )
            .bind(&sid)
            .fetch_one(&mut db(&database).await)
            .await
            .expect("the row");
            passed.then_some(())
        },
    )
    .await;

    // The start-up reaper runs before the gateway serves: closed by the time it is up.
    let second = Gateway::start_instance(&database, &first.instance, &FAST).await;
    assert_eq!(
        row_state(&database, &sid).await,
        ("closed".to_owned(), Some("idle".to_owned())),
        "closed at start-up"
    );
    assert!(
        containers_of_sandbox(&sid).is_empty(),
        "its container is removed at start-up"
    );
    let token = second.token(&tenant).await;
    let client = Counted::connect(&second, &token, &answered).await;
    let refused = client.call("list_files", json!({"sandbox_id": sid})).await;
    assert!(
        refused.is_error && refused.text.contains("expired after 3 s idle"),
        "{}",
        refused.text
    );
    assert_audit_count(&second, &tenant, answered.load(Ordering::SeqCst)).await;
    drop(second);
    drop(first);
}

#[tokio::test]
async fn a_container_removed_behind_the_gateways_back_is_reported_lost_and_replaced() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &FAST).await;
    let (tenant, token) = tenant_with_token(&gateway).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&gateway, &token, &answered).await;
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());

    let sid = sandbox_id(
        &client
            .ok("create_sandbox", json!({"conversation_id": conversation}))
            .await,
    );
    client
        .ok("execute_code", json!({"sandbox_id": sid, "code": "x = 1"}))
        .await;
    let containers = containers_of_sandbox(&sid);
    assert_eq!(containers.len(), 1);
    support::remove_container(&containers[0]);

    let lost = client
        .call("execute_code", json!({"sandbox_id": sid, "code": "x"}))
        .await;
    assert!(lost.is_error, "a call on a vanished sandbox fails");
    assert!(
        lost.text.contains(&format!("sandbox {sid} was lost"))
            && lost.text.contains("call create_sandbox"),
        "the answer says the sandbox was lost and what to do: {}",
        lost.text
    );
    assert_eq!(row_state(&database, &sid).await.0, "lost");

    let fresh = client
        .ok("create_sandbox", json!({"conversation_id": conversation}))
        .await;
    assert_eq!(fresh.structured["created"], true, "a fresh sandbox");
    let fresh_id = sandbox_id(&fresh);
    assert_ne!(fresh_id, sid);
    let answer = client
        .ok(
            "execute_code",
            json!({"sandbox_id": fresh_id, "code": "'x' in dir()"}),
        )
        .await;
    assert_eq!(plain(&answer), "False", "the fresh sandbox starts empty");
    assert_audit_count(&gateway, &tenant, answered.load(Ordering::SeqCst)).await;
}

#[tokio::test]
async fn tenant_limits_refuse_clearly_and_closing_a_sandbox_frees_a_place() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &FAST).await;
    let (tenant, token) = tenant_with_token(&gateway).await;
    let limits = gateway
        .cli(&[
            "admin",
            "tenant",
            "limits",
            &tenant,
            "--max-sandboxes",
            "2",
            "--memory-mb",
            "256",
        ])
        .await;
    assert!(
        limits.contains("max_sandboxes") && limits.contains("(tenant)"),
        "{limits}"
    );
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&gateway, &token, &answered).await;

    let first = sandbox_id(&client.ok("create_sandbox", json!({})).await);
    let _second = sandbox_id(&client.ok("create_sandbox", json!({})).await);
    let third = client.call("create_sandbox", json!({})).await;
    assert!(third.is_error, "the third sandbox is refused");
    assert!(
        third.text.contains("max concurrent sandboxes") && third.text.contains('2'),
        "the error names the limit: {}",
        third.text
    );
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state = 'leased'")
        .fetch_one(&mut db(&database).await)
        .await
        .expect("count");
    assert_eq!(live, 2, "nothing half-created is left behind");

    // The tenant's memory limit, not the profile's, is the container's (plus the default tmpfs
    // sizes, /tmp 64 MiB, /home/user 512 MiB and /opt/packages 256 MiB, whose pages the cgroup
    // counts).
    let memory = client
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": first, "command": "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"}),
        )
        .await;
    assert_eq!(
        memory.structured["stdout"]
            .as_str()
            .unwrap_or_default()
            .trim(),
        ((256u64 + 64 + 512 + 256) << 20).to_string(),
        "the sandbox runs with the tenant's 256 MiB (+ its tmpfs sizes)"
    );

    client
        .ok("close_sandbox", json!({"sandbox_id": first}))
        .await;
    client.ok("create_sandbox", json!({})).await;
    assert_audit_count(&gateway, &tenant, answered.load(Ordering::SeqCst)).await;

    // Calls per minute, for another tenant.
    let (busy_tenant, busy_token) = tenant_with_token(&gateway).await;
    gateway
        .cli(&[
            "admin",
            "tenant",
            "limits",
            &busy_tenant,
            "--max-calls-per-minute",
            "3",
        ])
        .await;
    let busy_answered = Arc::new(AtomicUsize::new(0));
    let busy = Counted::connect(&gateway, &busy_token, &busy_answered).await;
    for _ in 0..3 {
        busy.ok("list_files", json!({"conversation_id": "c"})).await;
    }
    let refused = busy
        .call("list_files", json!({"conversation_id": "c"}))
        .await;
    assert!(
        refused.is_error && refused.text.contains("max_calls_per_minute (3)"),
        "the fourth call in a minute is refused naming the limit: {}",
        refused.text
    );
    assert_audit_count(&gateway, &busy_tenant, busy_answered.load(Ordering::SeqCst)).await;
}

#[tokio::test]
async fn calls_during_a_postgres_outage_fail_retryably_and_work_again_after_it() {
    let database = support::fresh_database().await;
    let proxy = TcpProxy::start(support::addr_of(&database)).await;
    let proxy_addr = proxy.addr;
    let proxied = support::with_addr(&database, proxy_addr);
    let gateway = Gateway::start(&proxied, &FAST).await;
    let (tenant, token) = tenant_with_token(&gateway).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&gateway, &token, &answered).await;
    let sid = sandbox_id(&client.ok("create_sandbox", json!({})).await);
    client
        .ok("execute_code", json!({"sandbox_id": sid, "code": "x = 7"}))
        .await;

    proxy.stop().await;
    let outage = Instant::now();
    let mut failed = 0;
    while outage.elapsed() < Duration::from_secs(10) {
        let during = client
            .call("execute_code", json!({"sandbox_id": sid, "code": "x"}))
            .await;
        assert!(during.is_error, "no call can succeed without Postgres");
        assert!(
            during.text.contains("temporarily unavailable") && during.text.contains("retry"),
            "the error says to retry: {}",
            during.text
        );
        failed += 1;
    }
    assert!(failed >= 2, "several calls were tried during the outage");

    let back = TcpProxy::start_on(proxy_addr, support::addr_of(&database)).await;
    let recovered = support::eventually(
        Duration::from_secs(30),
        "calls to work again once Postgres is back",
        || async {
            let after = client
                .call("execute_code", json!({"sandbox_id": sid, "code": "x"}))
                .await;
            (!after.is_error).then_some(after)
        },
    )
    .await;
    assert_eq!(plain(&recovered), "7", "the sandbox's state is intact");
    assert_audit_count(&gateway, &tenant, answered.load(Ordering::SeqCst)).await;
    drop(gateway);
    back.stop().await;
}

#[tokio::test]
async fn two_gateways_leasing_from_one_pool_never_share_a_container() {
    const LEASES_PER_GATEWAY: usize = 50;
    const WORKERS_PER_GATEWAY: usize = 2;
    let database = support::fresh_database().await;
    let pool = [
        ("SANDGATE_POOL__MIN_READY", "3"),
        ("SANDGATE_POOL__MAX_CONCURRENT_STARTS", "2"),
    ];
    // The default orphan grace (120 s): each gateway must leave the other's starts alone, and a
    // start takes a while when both fill their pools on two busy cores.
    let env: Vec<(&str, &str)> = FAST
        .iter()
        .filter(|(k, _)| !k.ends_with("ORPHAN_GRACE_SECONDS"))
        .chain(pool.iter())
        .copied()
        .collect();
    let first = Gateway::start(&database, &env).await;
    // The second is a gateway-only replica: one engine has one node (the first's), and both
    // lease from its pool through Postgres.
    let second = Gateway::start_gateway_only(&database, &first.instance, &env).await;
    let tenant = first.create_tenant().await;
    first
        .cli(&[
            "admin",
            "tenant",
            "limits",
            &tenant,
            "--max-sandboxes",
            "200",
        ])
        .await;
    let answered = Arc::new(AtomicUsize::new(0));

    let mut workers = tokio::task::JoinSet::new();
    for gateway in [&first, &second] {
        // A token's audience is its gateway's URL.
        let token = gateway.token(&tenant).await;
        for _ in 0..WORKERS_PER_GATEWAY {
            let client = Counted::connect(gateway, &token, &answered).await;
            workers.spawn(async move {
                let mut leases = Vec::new();
                for _ in 0..LEASES_PER_GATEWAY / WORKERS_PER_GATEWAY {
                    let sid = sandbox_id(&client.ok("create_sandbox", json!({})).await);
                    // Claims the container: a second lease of it would find the claim and fail.
                    let claim = client
                        .ok(
                            "execute_code",
                            json!({"sandbox_id": sid, "code": "import os, socket\nos.close(os.open('/home/user/.claimed', os.O_CREAT | os.O_EXCL | os.O_WRONLY))\nsocket.gethostname()"}),
                        )
                        .await;
                    leases.push((sid.clone(), plain(&claim)));
                    client.ok("close_sandbox", json!({"sandbox_id": sid})).await;
                }
                leases
            });
        }
    }
    let mut sandboxes = HashSet::new();
    let mut hosts = HashSet::new();
    let mut total = 0;
    while let Some(leases) = workers.join_next().await {
        for (sid, host) in leases.expect("a worker finished") {
            total += 1;
            assert!(
                sandboxes.insert(sid.clone()),
                "sandbox {sid} was handed out twice"
            );
            assert!(
                hosts.insert(host.clone()),
                "container {host} was handed out twice"
            );
        }
    }
    assert_eq!(total, 2 * LEASES_PER_GATEWAY);
    let warm_leases: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sandboxes WHERE tenant_id = $1::uuid AND leased_at > created_at + interval '50 milliseconds'",
    )
    .bind(&tenant)
    .fetch_one(&mut db(&database).await)
    .await
    .expect("count");
    assert!(
        warm_leases > 0,
        "some leases came from the shared warm pool"
    );
    assert_audit_count(&first, &tenant, answered.load(Ordering::SeqCst)).await;
    drop(second);
    drop(first);
}

#[tokio::test]
async fn a_close_answers_before_removal_and_a_crash_in_between_leaves_no_orphan() {
    let database = support::fresh_database().await;
    let mut first = Gateway::start(&database, &FAST).await;
    let (tenant, token) = tenant_with_token(&first).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let client = Counted::connect(&first, &token, &answered).await;

    // The ordinary path: close answers, the container goes behind the answer.
    let closed = sandbox_id(&client.ok("create_sandbox", json!({})).await);
    assert_eq!(containers_of_sandbox(&closed).len(), 1);
    let answer = client
        .ok("close_sandbox", json!({"sandbox_id": closed}))
        .await;
    assert_eq!(answer.structured["sandbox_id"], closed.as_str());
    assert_eq!(row_state(&database, &closed).await.0, "closed");
    let after = client
        .call("execute_code", json!({"sandbox_id": closed, "code": "1"}))
        .await;
    assert!(
        after.is_error && after.text.contains("closed"),
        "a closed sandbox refuses calls at once, container or not: {}",
        after.text
    );
    support::eventually(
        Duration::from_secs(30),
        "the closed sandbox's container to be removed",
        || async { containers_of_sandbox(&closed).is_empty().then_some(()) },
    )
    .await;

    // A close whose removal is still running when the gateway is told to stop: graceful
    // shutdown waits for it.
    let drained = sandbox_id(&client.ok("create_sandbox", json!({})).await);
    client
        .ok("close_sandbox", json!({"sandbox_id": drained}))
        .await;
    assert!(first.terminate().await, "the gateway stops cleanly");
    assert!(
        containers_of_sandbox(&drained).is_empty(),
        "graceful shutdown finishes the removals of answered closes"
    );

    // The crash: the row is marked closed (what close_sandbox does before it answers) and the
    // process dies before it removes the container. Reproduced exactly: kill the gateway, then
    // mark the row as close_sandbox does.
    let mut second = Gateway::start_instance(&database, &first.instance, &FAST).await;
    let token = second.token(&tenant).await;
    let client = Counted::connect(&second, &token, &answered).await;
    let orphan = sandbox_id(&client.ok("create_sandbox", json!({})).await);
    second.kill().await;
    let marked = sqlx::query(
        "UPDATE sandboxes SET state = 'closed', closed_at = now(), close_reason = 'closed'
         WHERE id = $1 AND state = 'leased'",
    )
    .bind(&orphan)
    .execute(&mut db(&database).await)
    .await
    .expect("mark the row closed");
    assert_eq!(marked.rows_affected(), 1);
    assert_eq!(
        containers_of_sandbox(&orphan).len(),
        1,
        "the crash left the container of a closed row behind"
    );

    // The next start reconciles: the container of a closed row is removed, nothing is lost.
    let third = Gateway::start_instance(&database, &first.instance, &FAST).await;
    support::eventually(
        Duration::from_secs(60),
        "reconciliation to remove the closed row's container",
        || async { containers_of_sandbox(&orphan).is_empty().then_some(()) },
    )
    .await;
    support::eventually(
        Duration::from_secs(60),
        "Docker and Postgres to agree (no orphan, nothing lost)",
        || consistent(&database, &third.instance),
    )
    .await;
    assert_eq!(row_state(&database, &orphan).await.0, "closed");
    drop(third);
}
