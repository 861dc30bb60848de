//! Several gateway replicas of one deployment (issue 15, "replica-safe gateway"): one Postgres,
//! one Docker engine, the real binary; in front of them, where a test needs one, a round-robin
//! load balancer on loopback with no stickiness. A long call through one replica survives
//! another's reaper; stopping a replica leaves what another leased; a dropped attach connection
//! is re-attached with the kernel kept; 2025-11-25 sessions and 2026-07-28 conversations move
//! between replicas (rmcp's client and the official Python SDK) and survive a replica killed
//! mid-call; a login cookie from one replica is good on another; a person's interrupt from one
//! replica's console stops the bot's cell running through another.

use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::lifecycle::{FAST, db, plain, row_state, sandbox_id};
use crate::mcp_client::{Client, Era, ToolResult};
use crate::support::oauth::{Browser, PASSWORD, hidden};
use crate::support::replicas::{Deployment, RoundRobin, ownership_problems, spawn_replica};
use crate::support::{self, Gateway, TcpProxy, eventually};

const WITHIN: Duration = Duration::from_secs(60);

/// How many live call marks the sandbox has (a call on it has run for over a second).
async fn call_marks(database: &str, sandbox_id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM sandbox_call_marks WHERE sandbox_id = $1 AND until > now()",
    )
    .bind(sandbox_id)
    .fetch_one(&mut db(database).await)
    .await
    .expect("count")
}

/// Runs `execute_code` with `args` on a task of its own (the test meanwhile does something to
/// the deployment); `Err` is a protocol or transport error. Panics when no answer comes within a
/// minute.
fn execute_in_background(
    client: &Arc<Client>,
    args: Value,
) -> JoinHandle<Result<ToolResult, String>> {
    let client = client.clone();
    tokio::spawn(async move {
        tokio::time::timeout(WITHIN, client.call("execute_code", args))
            .await
            .expect("the call ends within a minute")
            .map_err(|e| e.to_string())
    })
}

/// Waits until a call on `sandbox_id` has been running for over a second (its mark is there).
async fn running_on(database: &str, sandbox_id: &str) {
    eventually(WITHIN, "the running call's mark in Postgres", || async {
        (call_marks(database, sandbox_id).await > 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_long_cell_through_one_replica_is_not_closed_by_another_replicas_reaper() {
    let deployment = Deployment::new().await;
    // A is a gateway-only replica (it reaps nothing); the reaper that runs during the cell is
    // B's, the node's (every 500 ms), which knows of A's call only through Postgres.
    let b = spawn_replica(0, &deployment, &FAST).await;
    let a = spawn_replica(
        1,
        &deployment,
        &[("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "600000")],
    )
    .await;
    let tenant = a.create_tenant().await;
    let client = Arc::new(
        Client::connect(&a.mcp_url(), &a.token(&tenant).await, Era::Stateless)
            .await
            .expect("connects to A"),
    );
    let created = client
        .ok(
            "create_sandbox",
            json!({"conversation_id": "long", "keep_alive_seconds": 2}),
        )
        .await;
    let id = sandbox_id(&created);
    // The cell runs three times the idle timeout.
    let cell = execute_in_background(
        &client,
        json!({"sandbox_id": id, "code": "import time\ntime.sleep(6)\n'finished'"}),
    );
    running_on(&deployment.database, &id).await;
    let cell = cell.await.expect("the call task").expect("a tool result");
    assert!(!cell.is_error, "the long cell succeeded: {}", cell.text);
    assert_eq!(
        plain(&cell),
        "'finished'",
        "the long cell's result comes back through A: {}",
        cell.text
    );
    assert_eq!(row_state(&deployment.database, &id).await.0, "leased");
    // B's reaper did run meanwhile: once idle for its timeout, the sandbox is closed by it.
    let reason = eventually(WITHIN, "B's reaper to close the idle sandbox", || async {
        let (state, reason) = row_state(&deployment.database, &id).await;
        (state == "closed").then_some(reason)
    })
    .await;
    assert_eq!(reason.as_deref(), Some("idle"));
    drop(b);
}

#[tokio::test]
async fn stopping_the_node_replica_leaves_running_what_another_replica_leased_from_its_pool() {
    let deployment = Deployment::new().await;
    // A's pool does not learn of B's lease before A stops (its check runs hourly).
    let slow_check = ("SANDGATE_LIFECYCLE__RECONCILE_INTERVAL_SECONDS", "3600");
    let mut a = spawn_replica(0, &deployment, &[slow_check]).await;
    let warm: String = eventually(WITHIN, "a warm sandbox in A's pool", || async {
        sqlx::query_scalar::<_, String>("SELECT id FROM sandboxes WHERE state = 'warm' LIMIT 1")
            .fetch_optional(&mut db(&deployment.database).await)
            .await
            .expect("query")
    })
    .await;
    let b = spawn_replica(
        1,
        &deployment,
        &[slow_check, ("SANDGATE_POOL__MIN_READY", "0")],
    )
    .await;
    let tenant = b.create_tenant().await;
    let client = Client::connect(&b.mcp_url(), &b.token(&tenant).await, Era::Stateless)
        .await
        .expect("connects to B");
    let created = client
        .ok("create_sandbox", json!({"conversation_id": "handover"}))
        .await;
    let id = sandbox_id(&created);
    assert_eq!(id, warm, "B leased the warm sandbox A's pool started");
    client
        .ok(
            "execute_code",
            json!({"sandbox_id": id, "code": "kept = 7"}),
        )
        .await;
    assert!(a.terminate().await, "A stops cleanly on SIGTERM");
    // A ran the engine's node: until a node serves the engine again, B's calls on the sandbox
    // fail with a clear, retryable error, and the sandbox keeps running.
    let away = client
        .call("execute_code", json!({"sandbox_id": id, "code": "kept"}))
        .await
        .expect("a tool result");
    assert!(
        away.is_error && away.text.contains("did not answer") && away.text.contains("retry"),
        "a call while the node is away says so, retryably: {}",
        away.text
    );
    assert_eq!(row_state(&deployment.database, &id).await.0, "leased");
    // The node comes back (A's successor on the same engine): B reaches it at its new address.
    let _c = spawn_replica(0, &deployment, &[slow_check]).await;
    let after = eventually(
        WITHIN,
        "B's sandbox to answer through the returned node",
        || {
            let client = &client;
            let id = id.clone();
            async move {
                let r = client
                    .call(
                        "execute_code",
                        json!({"sandbox_id": id, "code": "kept * 6"}),
                    )
                    .await
                    .ok()?;
                (!r.is_error).then_some(r)
            }
        },
    )
    .await;
    assert_eq!(plain(&after), "42", "B's sandbox still answers, state kept");
    assert_eq!(row_state(&deployment.database, &id).await.0, "leased");
}

/// The Docker engine's socket (what `DOCKER_HOST` names, else the default).
fn docker_socket() -> String {
    std::env::var("DOCKER_HOST")
        .ok()
        .and_then(|h| h.strip_prefix("unix://").map(str::to_owned))
        .unwrap_or_else(|| "/var/run/docker.sock".to_owned())
}

#[tokio::test]
async fn a_dropped_attach_connection_is_reattached_and_the_kernel_kept() {
    // The gateway reaches the engine through a proxy the test controls, so the test can cut the
    // attach connection (as a network cut or an engine restart with live-restore would) while
    // the container runs on.
    let upstream = format!("unix:{}", docker_socket());
    let proxy = TcpProxy::start(upstream.clone()).await;
    let addr = proxy.addr;
    let engine = format!("tcp://{addr}");
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[("SANDGATE_DOCKER__HOST", engine.as_str())]).await;
    let tenant = gateway.create_tenant().await;
    let client = Arc::new(
        Client::connect(
            &gateway.mcp_url(),
            &gateway.token(&tenant).await,
            Era::Stateless,
        )
        .await
        .expect("connects"),
    );
    let created = client
        .ok(
            "execute_code",
            json!({"conversation_id": "cut", "code": "x = 41"}),
        )
        .await;
    let id = sandbox_id(&created);
    let running = execute_in_background(
        &client,
        json!({"sandbox_id": id, "code": "import time\ntime.sleep(4)\nx += 1\nx"}),
    );
    running_on(&database, &id).await;
    proxy.stop().await;
    let proxy = TcpProxy::start_on(addr, upstream).await;
    let interrupted = running
        .await
        .expect("the call task")
        .expect("a tool result");
    assert!(
        interrupted.is_error
            && interrupted.text.contains("connection to sandbox")
            && interrupted.text.contains("retry"),
        "the call in flight gets a clear, retryable error: {}",
        interrupted.text
    );
    // The catalogue's kind (README, "Errors"), beside that text.
    assert_eq!(
        interrupted.structured["error"], "connection_lost",
        "{:?}",
        interrupted.structured
    );
    assert_eq!(interrupted.structured["retryable"], true);
    assert!(
        interrupted.text.contains(&format!(
            "the connection to sandbox {id} was lost while this call ran"
        )),
        "{}",
        interrupted.text
    );
    let next = client
        .ok("execute_code", json!({"sandbox_id": id, "code": "x"}))
        .await;
    assert_eq!(
        plain(&next),
        "42",
        "the next call re-attached: the kernel kept its variables, and the cell that was running \
         finished in it"
    );
    assert_eq!(row_state(&database, &id).await.0, "leased");
    proxy.stop().await;
}

/// A conversation's cells through the balancer: `n` counts up in one sandbox whichever replica
/// serves each call. Returns the sandbox id.
async fn count_up(client: &Client, conversation: Option<&str>, times: u32) -> String {
    let args = |code: &str| {
        let mut args = json!({"code": code});
        if let Some(c) = conversation {
            args["conversation_id"] = json!(c);
        }
        args
    };
    let first = client.ok("execute_code", args("n = 0")).await;
    let id = sandbox_id(&first);
    for i in 1..=times {
        let next = client.ok("execute_code", args("n += 1\nn")).await;
        assert_eq!(
            plain(&next),
            i.to_string(),
            "the kernel's state moved along"
        );
        assert_eq!(sandbox_id(&next), id, "the same sandbox, whichever replica");
    }
    id
}

#[tokio::test]
async fn conversations_in_both_eras_move_between_replicas_and_survive_one_killed_mid_call() {
    let lb = RoundRobin::start().await;
    let deployment = Deployment::new().await.behind(&lb);
    // B runs the node; A, the replica killed below, is gateway-only.
    let b = spawn_replica(0, &deployment, &FAST).await;
    let mut a = spawn_replica(1, &deployment, &FAST).await;
    lb.route(&[&a, &b]);
    let tenant = a.create_tenant().await;
    let token = a.token(&tenant).await;

    // 2025-11-25: initialize through one replica, then every call through the next in turn.
    let legacy = Client::connect(&lb.mcp_url(), &token, Era::Sessions)
        .await
        .expect("initialize through the balancer");
    assert_eq!(legacy.protocol_version(), "2025-11-25");
    let legacy_sandbox = count_up(&legacy, None, 4).await;
    // 2026-07-28: stateless, so any replica serves any call.
    let stateless = Client::connect(&lb.mcp_url(), &token, Era::Stateless)
        .await
        .expect("discover through the balancer");
    let stateless_sandbox = count_up(&stateless, Some("ticket-7"), 4).await;

    // A cell runs on A alone when A is killed (a 2026-07-28 call: its response stream is the
    // call, so the caller learns at once that it broke off).
    lb.route(&[&a]);
    let stateless = Arc::new(stateless);
    let slow = execute_in_background(
        &stateless,
        json!({"conversation_id": "ticket-7", "code": "import time\ntime.sleep(3)\nn += 10\nn"}),
    );
    running_on(&deployment.database, &stateless_sandbox).await;
    lb.route(&[&a, &b]);
    a.kill().await;
    let err = slow
        .await
        .expect("the call task")
        .expect_err("a call running on a killed replica fails, and says so");
    assert!(
        err.contains("Transport"),
        "the failure is the connection's, which the caller retries: {err}"
    );

    // Both conversations go on through B: same sandboxes, state kept. The cut-off cell was
    // interrupted: A's death closed its call's stream to the node, which cancels the call there
    // like a client's cancellation (the kernel and its state live on).
    let after = legacy.ok("execute_code", json!({"code": "n"})).await;
    assert_eq!(sandbox_id(&after), legacy_sandbox);
    assert_eq!(plain(&after), "4", "the session's kernel kept its state");
    let after = stateless
        .ok(
            "execute_code",
            json!({"conversation_id": "ticket-7", "code": "n"}),
        )
        .await;
    assert_eq!(sandbox_id(&after), stateless_sandbox);
    assert_eq!(
        plain(&after),
        "4",
        "the cut-off cell was interrupted, the kernel kept its state"
    );

    let problems = eventually(WITHIN, "Postgres and the engine to agree", || async {
        let problems = ownership_problems(&deployment.database, &deployment.instance).await;
        problems.is_empty().then_some(problems)
    })
    .await;
    assert!(problems.is_empty(), "0 double owners and 0 orphans");
    drop(b);
}

/// A raw JSON-RPC POST to `/mcp` through the balancer; returns (status, session header).
async fn post_mcp(
    lb: &RoundRobin,
    token: &str,
    session: Option<&str>,
    body: Value,
) -> (StatusCode, Option<String>) {
    let mut request = reqwest::Client::new()
        .post(lb.mcp_url())
        .bearer_auth(token)
        .header("accept", "application/json, text/event-stream")
        .json(&body);
    if let Some(session) = session {
        request = request
            .header("mcp-session-id", session)
            .header("mcp-protocol-version", "2025-11-25");
    }
    let response = request.send().await.expect("the balancer answers");
    let session = response
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (response.status(), session)
}

#[tokio::test]
async fn a_session_taken_to_another_replica_still_belongs_to_its_principal_only() {
    let lb = RoundRobin::start().await;
    let deployment = Deployment::new().await.behind(&lb);
    let a = spawn_replica(0, &deployment, &[]).await;
    let b = spawn_replica(1, &deployment, &[]).await;
    let owner = a.token(&a.create_tenant().await).await;
    let intruder = a.token(&a.create_tenant().await).await;
    lb.route(&[&a]);
    let (status, session) = post_mcp(
        &lb,
        &owner,
        None,
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "e2e", "version": "1"}}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let session = session.expect("initialize opens a session");
    // B never saw the session: another tenant presenting it gets what a missing one gets.
    lb.route(&[&b]);
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    let (stolen, _) = post_mcp(&lb, &intruder, Some(&session), list.clone()).await;
    let (missing, _) = post_mcp(&lb, &intruder, Some("no-such-session"), list.clone()).await;
    assert_eq!(
        stolen,
        StatusCode::NOT_FOUND,
        "another principal's session is not found"
    );
    assert_eq!(missing, StatusCode::NOT_FOUND);
    // Its owner's next request works on B: the session was taken over, not refused.
    let (owned, _) = post_mcp(&lb, &owner, Some(&session), list).await;
    assert_eq!(
        owned,
        StatusCode::OK,
        "the owner's session works on another replica"
    );
    // The id itself is nowhere in Postgres.
    let mut conn = db(&deployment.database).await;
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM mcp_session_states
          WHERE position(convert_to($1, 'UTF8') IN id_hash) > 0
             OR initialize_params::text LIKE '%' || $1 || '%'",
    )
    .bind(&session)
    .fetch_one(&mut conn)
    .await
    .expect("count");
    assert_eq!(stored, 0, "no session id stored in clear");
    let states: i64 = sqlx::query_scalar("SELECT count(*) FROM mcp_session_states")
        .fetch_one(&mut conn)
        .await
        .expect("count");
    assert_eq!(
        states, 1,
        "the session's state is stored, keyed by its hash"
    );
}

#[tokio::test]
async fn official_python_sdk_conversations_move_between_replicas_behind_a_balancer() {
    let python = crate::python_sdk::python();
    let lb = RoundRobin::start().await;
    let deployment = Deployment::new().await.behind(&lb);
    let a = spawn_replica(0, &deployment, &[]).await;
    let b = spawn_replica(1, &deployment, &[]).await;
    lb.route(&[&a, &b]);
    let token = a.token(&a.create_tenant().await).await;
    for mode in ["legacy", "2026-07-28"] {
        crate::python_sdk::run_script(&python, &lb.mcp_url(), &token, mode).await;
    }
    let problems = eventually(WITHIN, "Postgres and the engine to agree", || async {
        let problems = ownership_problems(&deployment.database, &deployment.instance).await;
        problems.is_empty().then_some(problems)
    })
    .await;
    assert!(problems.is_empty());
}

#[tokio::test]
async fn a_login_cookie_from_one_replica_is_accepted_by_another_and_refused_under_another_key() {
    let deployment = Deployment::new().await;
    let a = spawn_replica(0, &deployment, &[]).await;
    let b = spawn_replica(1, &deployment, &[]).await;
    let other_key = "another deployment's cookie secret, 32+ characters long";
    let c = spawn_replica(
        2,
        &deployment,
        &[("SANDGATE_OAUTH__COOKIE_SECRET", other_key)],
    )
    .await;
    let tenant = a.create_tenant().await;
    let email = format!(
        "ana-{}@example.com",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    a.cli_stdin(
        &[
            "admin", "user", "create", "--tenant", &tenant, "--email", &email,
        ],
        &format!("{PASSWORD}\n"),
    )
    .await;
    let mut browser = Browser::at(&a.base_url);
    let to_login = browser.get(&format!("{}/apps", a.base_url)).await;
    let login = to_login
        .location
        .expect("the connected-apps page sends a stranger to log in");
    browser.log_in(&login, &email, PASSWORD).await;
    let on_a = browser.get(&format!("{}/apps", a.base_url)).await;
    assert_eq!(on_a.status, StatusCode::OK, "logged in on A");
    let on_b = browser.get(&format!("{}/apps", b.base_url)).await;
    assert_eq!(
        on_b.status,
        StatusCode::OK,
        "B reads the login cookie A issued (keys derived from the shared keys.secret)"
    );
    let on_c = browser.get(&format!("{}/apps", c.base_url)).await;
    assert_ne!(
        on_c.status,
        StatusCode::OK,
        "a replica with another cookie key refuses the cookie"
    );
    assert!(
        on_c.location
            .as_deref()
            .is_some_and(|l| l.contains("/login")),
        "and sends the browser to log in: {:?}",
        on_c.location
    );
}

#[tokio::test]
async fn a_person_on_one_replica_interrupts_the_bots_cell_running_through_another() {
    let deployment = Deployment::new().await;
    let a = spawn_replica(0, &deployment, &[]).await;
    let b = spawn_replica(1, &deployment, &[]).await;
    let tenant = a.create_tenant().await;
    let email = format!(
        "ana-{}@example.com",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    a.cli_stdin(
        &[
            "admin", "user", "create", "--tenant", &tenant, "--email", &email,
        ],
        &format!("{PASSWORD}\n"),
    )
    .await;
    a.cli(&[
        "admin", "user", "role", "--email", &email, "--role", "takeover",
    ])
    .await;
    // The bot's cell runs through A, and has printed.
    let mut bot = Client::connect(&a.mcp_url(), &a.token(&tenant).await, Era::Stateless)
        .await
        .expect("connects to A");
    let (_, unused) = tokio::sync::mpsc::unbounded_channel();
    let mut progress = std::mem::replace(&mut bot.progress, unused);
    let slow = tokio::spawn(async move {
        bot.call(
            "execute_code",
            json!({"conversation_id": "ticket-replicas",
                   "code": "import time\nprint('half way through', flush=True)\ntime.sleep(120)"}),
        )
        .await
        .expect("the interrupted call answers")
    });
    let mut streamed = String::new();
    tokio::time::timeout(WITHIN, async {
        while !streamed.contains("half way through") {
            let p = progress
                .recv()
                .await
                .expect("progress until the cell prints");
            streamed.push_str(p.message.as_deref().unwrap_or_default());
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the bot's cell streams its first line: {streamed:?}"));

    // A person signed in on B presses the interrupt once.
    let mut person = Browser::at(&b.base_url);
    let to_login = person.get(&format!("{}/console", b.base_url)).await;
    let login = to_login.location.expect("a stranger logs in first");
    person.log_in(&login, &email, PASSWORD).await;
    let apps = person.get(&format!("{}/apps", b.base_url)).await;
    let csrf = hidden(&apps.body, "csrf").expect("a CSRF token");
    let stopped = person
        .post(
            &format!("{}/console/interrupt", b.base_url),
            &[("csrf", &csrf), ("conversation", "ticket-replicas")],
        )
        .await;
    assert_eq!(stopped.status, StatusCode::SEE_OTHER, "{}", stopped.body);
    let interrupted = tokio::time::timeout(WITHIN, slow)
        .await
        .expect("B's interrupt stops the cell running through A")
        .expect("the call task");
    assert!(
        interrupted
            .text
            .contains(&format!("a person ({email}) interrupted")),
        "the bot's result says a person interrupted it: {}",
        interrupted.text
    );
    assert_eq!(interrupted.structured["stdout"], "half way through\n");
}
