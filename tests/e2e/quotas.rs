//! A malicious tenant against the real binary (issue 11, part B1): other principals' MCP
//! sessions, the cap on open sessions, bursts of long calls against the calls-in-flight cap
//! (also across a gateway that dies mid-call), the per-sandbox cap, and calls per minute counted
//! when calls start. Each test plays the attacker and shows the legitimate path still working.
//!
//! Long calls wait on a gate file in their sandbox, which the test opens with `docker exec`
//! once it has seen what it needs: how many calls run at once never depends on timing.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::Connection;

use crate::mcp_client::{Client, Era, ToolResult};
use crate::support::oauth::Stack;
use crate::support::{Gateway, eventually, fresh_database};

/// A shell command that waits until the gate file exists, then says so.
const WAIT_FOR_GATE: &str = "while [ ! -e /tmp/gate ]; do sleep 0.2; done; echo through the gate";

/// Opens the gate in `sandbox_id`'s container: every call waiting on it finishes.
async fn open_gate(database_url: &str, sandbox_id: &str) {
    let mut conn = sqlx::PgConnection::connect(database_url)
        .await
        .expect("Postgres");
    let container: String = sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut conn)
        .await
        .expect("the sandbox's row");
    let opened = crate::support::sandbox_exec(&container, &["touch", "/tmp/gate"]).await;
    assert!(
        opened.status.success(),
        "the gate opens: {}",
        String::from_utf8_lossy(&opened.stderr)
    );
}

/// Whether a result is a quota refusal naming `limit`, and its `retry_after_seconds`.
fn quota_refusal(result: &ToolResult, limit: &str) -> Option<u64> {
    (result.is_error
        && result.structured["error"] == "quota_exceeded"
        && result.structured["limit"] == limit)
        .then(|| result.structured["retry_after_seconds"].as_u64())
        .flatten()
}

/// Starts `n` calls of `WAIT_FOR_GATE` into `sandbox_id` at once; returns them running.
fn gated_calls(
    client: &std::sync::Arc<Client>,
    sandbox_id: &str,
    n: usize,
) -> tokio::task::JoinSet<ToolResult> {
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..n {
        let client = client.clone();
        let args =
            json!({"sandbox_id": sandbox_id, "command": WAIT_FOR_GATE, "timeout_seconds": 120});
        calls.spawn(async move {
            client
                .call("run_terminal_command", args)
                .await
                .expect("a tool result, never a protocol error")
        });
    }
    calls
}

/// Collects the calls that have answered so far until `answered` of them have (refusals answer
/// at once; admitted calls wait on the gate).
async fn first_answers(
    calls: &mut tokio::task::JoinSet<ToolResult>,
    answered: usize,
) -> Vec<ToolResult> {
    let mut results = Vec::new();
    while results.len() < answered {
        let result = tokio::time::timeout(Duration::from_secs(60), calls.join_next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "refusals answer while the admitted calls wait on the gate; {} of {answered} \
                     did: {results:?}",
                    results.len()
                )
            })
            .expect("a call")
            .expect("the call task finishes");
        results.push(result);
    }
    results
}

async fn all_answers(calls: tokio::task::JoinSet<ToolResult>) -> Vec<ToolResult> {
    tokio::time::timeout(Duration::from_secs(120), calls.join_all())
        .await
        .expect("the calls end once the gate is open")
}

/// The value of `sandgate_quota_refusals_total{limit="<limit>"}`, 0 when absent.
async fn quota_refusals(stack: &Stack, limit: &str) -> u64 {
    stack
        .metric(&format!(
            "sandgate_quota_refusals_total{{limit=\"{limit}\"}}"
        ))
        .await
}

/// Refused calls of the stack's database by error kind.
async fn refused_rows(database_url: &str, kind: &str) -> i64 {
    let mut conn = sqlx::PgConnection::connect(database_url)
        .await
        .expect("Postgres");
    sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE outcome = 'refused' AND error_kind = $1",
    )
    .bind(kind)
    .fetch_one(&mut conn)
    .await
    .expect("the audit trail")
}

async fn set_limits(gateway: &Gateway, tenant: &str, limits: &[(&str, &str)]) {
    let mut args = vec!["admin", "tenant", "limits", tenant];
    for (flag, value) in limits {
        args.push(flag);
        args.push(value);
    }
    gateway.cli(&args).await;
}

/// A stateless client of the stack's tenant (shareable by concurrent calls) and a sandbox.
async fn client_with_sandbox(stack: &Stack) -> (std::sync::Arc<Client>, String) {
    let token = stack.gateway.token(&stack.tenant).await;
    let client = Client::connect(&stack.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    let sandbox = new_sandbox(&client).await;
    (std::sync::Arc::new(client), sandbox)
}

async fn new_sandbox(client: &Client) -> String {
    client.ok("create_sandbox", json!({})).await.structured["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned()
}

// ---- sessions (2025-11-25 era) over raw HTTP: the test needs to hold the session id ----

/// A raw MCP request's answer.
#[derive(Debug)]
struct Raw {
    status: StatusCode,
    session: Option<String>,
    retry_after: Option<String>,
    body: String,
}

impl Raw {
    /// The JSON-RPC message in the body (plain JSON, or the first SSE `data:` line holding one).
    fn message(&self) -> Value {
        // An SSE answer may start with a priming event whose data is empty.
        std::iter::once(self.body.as_str())
            .chain(self.body.lines().filter_map(|l| l.strip_prefix("data:")))
            .find_map(|json| serde_json::from_str::<Value>(json.trim()).ok())
            .unwrap_or(Value::Null)
    }
}

async fn raw(
    stack: &Stack,
    method: reqwest::Method,
    token: &str,
    session: Option<&str>,
    body: Option<Value>,
) -> Raw {
    let mut request = stack
        .http
        .request(method.clone(), stack.gateway.mcp_url())
        .bearer_auth(token)
        .header("mcp-protocol-version", "2025-11-25");
    request = match method {
        reqwest::Method::GET => request.header("accept", "text/event-stream"),
        _ => request.header("accept", "application/json, text/event-stream"),
    };
    if let Some(session) = session {
        request = request.header("mcp-session-id", session);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("/mcp answers");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (status, session, retry_after) = (
        response.status(),
        header("mcp-session-id"),
        header("retry-after"),
    );
    // A GET that is allowed opens an endless SSE stream: its status says enough.
    let body = if method == reqwest::Method::GET && status.is_success() {
        String::new()
    } else {
        tokio::time::timeout(Duration::from_secs(60), response.text())
            .await
            .expect("the answer ends")
            .unwrap_or_default()
    };
    Raw {
        status,
        session,
        retry_after,
        body,
    }
}

/// A POST in `session` with `token`.
async fn post(stack: &Stack, token: &str, session: &str, body: Value) -> Raw {
    raw(
        stack,
        reqwest::Method::POST,
        token,
        Some(session),
        Some(body),
    )
    .await
}

/// `initialize` (+ `notifications/initialized`) with `token`: the raw answer to initialize.
async fn open_session(stack: &Stack, token: &str) -> Raw {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "sandgate-e2e-raw", "version": "0.1.0"}}});
    let answer = raw(stack, reqwest::Method::POST, token, None, Some(init)).await;
    if let Some(session) = &answer.session {
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let ack = raw(
            stack,
            reqwest::Method::POST,
            token,
            Some(session),
            Some(initialized),
        )
        .await;
        assert_eq!(ack.status, StatusCode::ACCEPTED, "{ack:?}");
    }
    answer
}

fn tools_list() -> Value {
    json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
}

fn tools_call(name: &str, arguments: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
           "params": {"name": name, "arguments": arguments}})
}

#[tokio::test]
async fn another_principals_session_looks_missing_and_the_owner_keeps_it() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "1")]).await;
    let owner = stack.gateway.token(&stack.tenant).await;
    let other_tenant = stack.gateway.create_tenant().await;
    let attacker = stack.gateway.token(&other_tenant).await;
    let opened = open_session(&stack, &owner).await;
    assert_eq!(opened.status, StatusCode::OK, "{opened:?}");
    let session = opened.session.clone().expect("a session id");
    // The owner's session works, and its calls use the session as their conversation.
    let created = post(
        &stack,
        &owner,
        &session,
        tools_call("create_sandbox", json!({})),
    )
    .await;
    assert_eq!(created.status, StatusCode::OK, "{created:?}");
    let sandbox = created.message()["result"]["structuredContent"]["sandbox_id"]
        .as_str()
        .unwrap_or_else(|| panic!("a sandbox: {created:?}"))
        .to_owned();

    // The attacker, with the owner's session id and a made-up one: the same 404, every method.
    let made_up = uuid::Uuid::new_v4().to_string();
    let attempts = [
        (reqwest::Method::POST, Some(tools_list())),
        (
            reqwest::Method::POST,
            Some(tools_call("list_files", json!({"sandbox_id": sandbox}))),
        ),
        (
            reqwest::Method::POST,
            Some(tools_call("close_sandbox", json!({}))),
        ),
        (reqwest::Method::GET, None),
        (reqwest::Method::DELETE, None),
    ];
    for (method, body) in attempts {
        let stolen = raw(
            &stack,
            method.clone(),
            &attacker,
            Some(&session),
            body.clone(),
        )
        .await;
        let missing = raw(&stack, method.clone(), &attacker, Some(&made_up), body).await;
        assert_eq!(
            stolen.status,
            StatusCode::NOT_FOUND,
            "{method} with another tenant's session: {stolen:?}"
        );
        assert_eq!(
            (stolen.status, &stolen.body),
            (missing.status, &missing.body),
            "{method}: another principal's session answers exactly like a missing one"
        );
    }

    // The owner's session is unharmed: listing, calling (its conversation's sandbox is still
    // there) and its SSE stream.
    let listed = post(&stack, &owner, &session, tools_list()).await;
    assert_eq!(listed.status, StatusCode::OK, "{listed:?}");
    assert!(listed.body.contains("execute_code"), "{listed:?}");
    let again = post(
        &stack,
        &owner,
        &session,
        tools_call(
            "run_terminal_command",
            json!({"command": "echo still mine"}),
        ),
    )
    .await;
    let result = &again.message()["result"];
    assert_eq!(
        result["structuredContent"]["sandbox_id"],
        sandbox.as_str(),
        "{again:?}"
    );
    assert!(
        result["structuredContent"]["stdout"]
            .as_str()
            .is_some_and(|s| s.contains("still mine")),
        "{again:?}"
    );
    let stream = raw(&stack, reqwest::Method::GET, &owner, Some(&session), None).await;
    assert_eq!(stream.status, StatusCode::OK, "{stream:?}");

    // The session id is nowhere in Postgres, in any text column of any table.
    let mut conn = sqlx::PgConnection::connect(&stack.gateway.database_url)
        .await
        .expect("Postgres");
    let columns: Vec<(String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text FROM information_schema.columns
          WHERE table_schema = 'public' AND data_type IN ('text', 'character varying', 'jsonb')",
    )
    .fetch_all(&mut conn)
    .await
    .expect("the catalogue");
    assert!(columns.len() > 10, "{columns:?}");
    for (table, column) in &columns {
        let hits: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{table}\" WHERE \"{column}\"::text LIKE '%' || $1 || '%'"
        )))
        .bind(&session)
        .fetch_one(&mut conn)
        .await
        .expect("a text search");
        assert_eq!(
            hits, 0,
            "the session id is stored in clear in {table}.{column}"
        );
    }
    let bound: i64 = sqlx::query_scalar("SELECT count(*) FROM mcp_sessions")
        .fetch_one(&mut conn)
        .await
        .expect("the bindings");
    assert_eq!(
        bound, 1,
        "the owner's session is recorded (by its keyed hash)"
    );
    let conversation: Option<String> =
        sqlx::query_scalar("SELECT conversation_id FROM sandboxes WHERE id = $1")
            .bind(&sandbox)
            .fetch_one(&mut conn)
            .await
            .expect("the sandbox row");
    assert!(
        conversation
            .as_deref()
            .is_some_and(|c| c.starts_with("mcp-session:") && c.len() == "mcp-session:".len() + 64),
        "the conversation key is the session's keyed hash: {conversation:?}"
    );

    // The owner ends its session: gone for everyone, and its slot is free.
    let deleted = raw(
        &stack,
        reqwest::Method::DELETE,
        &owner,
        Some(&session),
        None,
    )
    .await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT, "{deleted:?}");
    let after = post(&stack, &owner, &session, tools_list()).await;
    assert_eq!(after.status, StatusCode::NOT_FOUND, "{after:?}");
    let bound: i64 = sqlx::query_scalar("SELECT count(*) FROM mcp_sessions")
        .fetch_one(&mut conn)
        .await
        .expect("the bindings");
    assert_eq!(bound, 0, "a closed session's binding is gone");
}

#[tokio::test]
async fn open_sessions_are_capped_per_tenant() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    set_limits(&stack.gateway, &stack.tenant, &[("--max-sessions", "2")]).await;
    let token = stack.gateway.token(&stack.tenant).await;
    let first = open_session(&stack, &token).await;
    let second = open_session(&stack, &token).await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    assert_eq!(second.status, StatusCode::OK, "{second:?}");
    let refused = open_session(&stack, &token).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{refused:?}");
    assert_eq!(refused.session, None, "no session is handed out");
    assert!(refused.retry_after.is_some(), "{refused:?}");
    let error = &refused.message()["error"];
    assert_eq!(error["data"]["limit"], "max_sessions", "{refused:?}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_sessions (2)") && m.contains("DELETE")),
        "the refusal says which limit and what to do: {refused:?}"
    );
    // The rmcp client is refused too.
    let client = Client::connect(&stack.gateway.mcp_url(), &token, Era::Sessions).await;
    assert!(client.is_err(), "a third session is refused");
    // Another tenant is not affected.
    let other = stack.gateway.create_tenant().await;
    let theirs = open_session(&stack, &stack.gateway.token(&other).await).await;
    assert_eq!(theirs.status, StatusCode::OK, "{theirs:?}");
    // Closing a session frees its slot.
    let closed = raw(
        &stack,
        reqwest::Method::DELETE,
        &token,
        first.session.as_deref(),
        None,
    )
    .await;
    assert_eq!(closed.status, StatusCode::NO_CONTENT, "{closed:?}");
    let third = open_session(&stack, &token).await;
    assert_eq!(third.status, StatusCode::OK, "{third:?}");
    assert!(quota_refusals(&stack, "max_sessions").await >= 2);
    assert!(refused_rows(&stack.gateway.database_url, "session_limit").await >= 2);
}

#[tokio::test]
async fn a_burst_of_long_calls_is_refused_at_the_in_flight_cap_while_another_tenant_goes_through() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "2")]).await;
    set_limits(
        &stack.gateway,
        &stack.tenant,
        &[("--max-calls-in-flight", "3")],
    )
    .await;
    let (client, sandbox) = client_with_sandbox(&stack).await;
    let other = stack.gateway.create_tenant().await;
    let theirs = Client::connect(
        &stack.gateway.mcp_url(),
        &stack.gateway.token(&other).await,
        Era::Stateless,
    )
    .await
    .expect("connects");

    let mut calls = gated_calls(&client, &sandbox, 10);
    // Seven are refused at once (three run, waiting on the gate).
    let refused = first_answers(&mut calls, 7).await;
    for result in &refused {
        let retry = quota_refusal(result, "max_calls_in_flight");
        assert!(
            retry.is_some_and(|s| s >= 1),
            "a retryable refusal naming the limit, with retry_after_seconds: {result:?}"
        );
        assert!(
            result.text.contains("max_calls_in_flight (3)") && result.text.contains("retry in"),
            "{}",
            result.text
        );
    }
    // Meanwhile another tenant's calls go through.
    let sandbox_b = new_sandbox(&theirs).await;
    let echoed = theirs
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": sandbox_b, "command": "echo other tenant"}),
        )
        .await;
    assert!(echoed.text.contains("other tenant"), "{}", echoed.text);
    // And this tenant is still full.
    let full = client
        .call("list_files", json!({"sandbox_id": sandbox}))
        .await
        .expect("a tool result");
    assert!(
        quota_refusal(&full, "max_calls_in_flight").is_some(),
        "{full:?}"
    );

    open_gate(&stack.gateway.database_url, &sandbox).await;
    let ran = all_answers(calls).await;
    assert_eq!(ran.len(), 3);
    for result in &ran {
        assert!(
            !result.is_error && result.text.contains("through the gate"),
            "{result:?}"
        );
    }
    // The slots are free again once the calls ended (freed behind their answers, so a call
    // right after may still meet the cap for a moment: poll).
    let free = eventually(Duration::from_secs(10), "the slots freed", || {
        let (client, sandbox) = (&client, &sandbox);
        async move {
            let result = client
                .call("list_files", json!({"sandbox_id": sandbox}))
                .await
                .ok()?;
            quota_refusal(&result, "max_calls_in_flight")
                .is_none()
                .then_some(result)
        }
    })
    .await;
    assert!(!free.is_error, "{free:?}");
    let refused = quota_refusals(&stack, "max_calls_in_flight").await;
    assert!(
        refused >= 8,
        "8 refusals expected at least, {refused} counted"
    );
    let rows = eventually(
        Duration::from_secs(10),
        "the refusals' audit rows",
        || async {
            let n = refused_rows(&stack.gateway.database_url, "calls_in_flight").await;
            (n == refused as i64).then_some(n)
        },
    )
    .await;
    assert_eq!(rows, refused as i64);
}

/// The expiry (unix seconds) of the one live in-flight slot in the database, if there is one.
async fn live_slot_expiry(database_url: String) -> Option<f64> {
    let mut conn = sqlx::PgConnection::connect(&database_url).await.ok()?;
    sqlx::query_scalar(
        "SELECT s.v::float8 FROM call_quotas q, jsonb_each(q.in_flight) s(k, v)
          WHERE s.v::float8 > extract(epoch FROM now())",
    )
    .fetch_optional(&mut conn)
    .await
    .ok()
    .flatten()
}

#[tokio::test]
async fn the_in_flight_cap_holds_across_replicas_and_a_dead_replicas_slots_expire() {
    let database = fresh_database().await;
    let env = [
        ("SANDGATE_LIMITS__CALL_SLOT_TTL_SECONDS", "6"),
        ("SANDGATE_POOL__MIN_READY", "1"),
    ];
    let mut first = Gateway::start(&database, &env).await;
    // A gateway-only replica: the engine's one node is the first's.
    let second = Gateway::start_gateway_only(
        &database,
        &first.instance,
        &[("SANDGATE_POOL__MIN_READY", "0"), env[0]],
    )
    .await;
    let tenant = first.create_tenant().await;
    set_limits(&first, &tenant, &[("--max-calls-in-flight", "1")]).await;
    let client = std::sync::Arc::new(
        Client::connect(
            &first.mcp_url(),
            &first.token(&tenant).await,
            Era::Stateless,
        )
        .await
        .expect("connects"),
    );
    let other_replica = Client::connect(
        &second.mcp_url(),
        &second.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("connects to the other replica");
    let sandbox = new_sandbox(&client).await;
    let calls = gated_calls(&client, &sandbox, 1);
    let taken = eventually(Duration::from_secs(30), "the call's slot", || {
        live_slot_expiry(database.clone())
    })
    .await;
    // A cheap call that needs no sandbox.
    let probe = json!({"sandbox_id": "sbx_missing"});
    let refused = other_replica
        .call("list_files", probe.clone())
        .await
        .expect("a tool result");
    assert!(
        quota_refusal(&refused, "max_calls_in_flight").is_some(),
        "the other replica counts the running call: {refused:?}"
    );
    // The running call renews its slot (every third of the 6 s TTL; 3 s lost its slot when renewals stalled over 2 s in the full suite on 2 busy cores): it outlives its first TTL.
    eventually(Duration::from_secs(30), "the slot's renewal", || {
        let database = database.clone();
        async move { live_slot_expiry(database).await.filter(|e| *e > taken) }
    })
    .await;

    // The replica dies mid-call: nobody frees the slot, it expires.
    first.kill().await;
    drop(calls);
    eventually(
        Duration::from_secs(60),
        "the dead replica's slot to expire",
        || {
            let (client, probe) = (&other_replica, probe.clone());
            async move {
                let result = client.call("list_files", probe).await.ok()?;
                if quota_refusal(&result, "max_calls_in_flight").is_some() {
                    return None;
                }
                assert!(
                    result.text.contains("no sandbox sbx_missing"),
                    "an admitted call: {result:?}"
                );
                Some(())
            }
        },
    )
    .await;
    assert_eq!(
        live_slot_expiry(database).await,
        None,
        "no live slot is left"
    );
}

#[tokio::test]
async fn many_concurrent_commands_into_one_sandbox_get_clear_refusals_not_thread_errors() {
    // 100 calls at once from one address: over the default per-address connection cap, and
    // more database connections (and patience for them) than the defaults, so that on a busy
    // test machine the burst is refused by the sandbox's cap and not by the database pool.
    let stack = Stack::start(&[
        ("SANDGATE_POOL__MIN_READY", "1"),
        ("SANDGATE_HTTP__MAX_CONNECTIONS_PER_ADDRESS", "0"),
        ("SANDGATE_DATABASE__MAX_CONNECTIONS", "40"),
        ("SANDGATE_DATABASE__ACQUIRE_TIMEOUT_MS", "30000"),
    ])
    .await;
    set_limits(
        &stack.gateway,
        &stack.tenant,
        &[
            ("--max-calls-in-flight", "500"),
            ("--max-calls-per-minute", "5000"),
        ],
    )
    .await;
    let (client, sandbox) = client_with_sandbox(&stack).await;
    // The default cap is 32 per sandbox (pids_limit 256 / 4).
    let mut calls = gated_calls(&client, &sandbox, 100);
    let refused = first_answers(&mut calls, 100 - 32).await;
    for result in &refused {
        assert!(
            quota_refusal(result, "max_calls_per_sandbox").is_some(),
            "a clear, retryable refusal: {result:?}"
        );
        assert!(
            result.text.contains("max_calls_per_sandbox (32)"),
            "{}",
            result.text
        );
    }
    open_gate(&stack.gateway.database_url, &sandbox).await;
    let ran = all_answers(calls).await;
    assert_eq!(ran.len(), 32);
    for result in &ran {
        assert!(
            !result.is_error && result.text.contains("through the gate"),
            "every admitted command runs: {result:?}"
        );
        assert!(
            !result.text.contains("can't start new thread"),
            "{result:?}"
        );
    }
    assert_eq!(quota_refusals(&stack, "max_calls_per_sandbox").await, 68);
    // The sandbox is fine afterwards.
    client
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": sandbox, "command": "echo ok"}),
        )
        .await;
}

#[tokio::test]
async fn calls_per_minute_count_when_calls_start_and_refusals_do_not_count() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "1")]).await;
    // 3 per minute: a burst of 3, then one every 20 s. (A slow interval: the 16 calls below must
    // all reach the gateway within it, or a refill admits one more; on a busy CI host 16 calls
    // took longer than 6 s.) Set before the tenant's first call, so that no limits the gateway
    // cached before the change (dropped when its notification arrives, which on a busy host
    // came after the calls below: all 16 were admitted) can serve them.
    set_limits(
        &stack.gateway,
        &stack.tenant,
        &[("--max-calls-per-minute", "3")],
    )
    .await;
    // create_sandbox is the burst's first call; two long calls fit after it, none of them has
    // finished when the rest arrive.
    let (client, sandbox) = client_with_sandbox(&stack).await;
    let mut calls = gated_calls(&client, &sandbox, 16);
    let refused = first_answers(&mut calls, 14).await;
    for result in &refused {
        let retry = quota_refusal(result, "max_calls_per_minute");
        assert!(
            retry.is_some_and(|s| (1..=20).contains(&s)),
            "refused for the rate, retry within one interval (20 s): {result:?}"
        );
        assert!(
            result.text.contains("max_calls_per_minute (3)"),
            "{}",
            result.text
        );
    }
    // Knocking again and again does not push the next admission out: a refusal never says
    // more than one interval (were refusals counted, each would add 20 s).
    for _ in 0..10 {
        let result = client
            .call("list_files", json!({"sandbox_id": sandbox}))
            .await
            .expect("a tool result");
        if let Some(retry) = quota_refusal(&result, "max_calls_per_minute") {
            assert!(retry <= 20, "{result:?}");
        }
    }
    open_gate(&stack.gateway.database_url, &sandbox).await;
    let ran = all_answers(calls).await;
    assert_eq!(
        ran.len(),
        2,
        "the burst ran up to the limit (create_sandbox and two of these), counted at start"
    );
    assert!(ran.iter().all(|r| !r.is_error), "{ran:?}");
    assert!(quota_refusals(&stack, "max_calls_per_minute").await >= 14);
    assert!(refused_rows(&stack.gateway.database_url, "rate_limited").await >= 14);
    // After the interval, calls are admitted again.
    eventually(Duration::from_secs(60), "the next admission", || {
        let client = client.clone();
        let sandbox = sandbox.clone();
        async move {
            let result = client
                .call("list_files", json!({"sandbox_id": sandbox}))
                .await
                .ok()?;
            (!result.is_error).then_some(())
        }
    })
    .await;
}
