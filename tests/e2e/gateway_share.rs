//! The gateway's share of a call (issue 16): what it keeps off Postgres and how that stays
//! correct. Live tokens and tenant limits are cached per replica and invalidated across
//! replicas (LISTEN/NOTIFY): a disconnect through one gateway is refused at once by another,
//! and an operator's change of a tenant's limits is seen by every replica. Audit events are
//! written in batches behind the answers and never lost on graceful shutdown. (Events during a
//! Postgres outage are kept: `lifecycle::calls_during_a_postgres_outage_…`.) Transcript
//! entries are written the same way: every cell that answered is there after a SIGTERM, and an
//! export right after the cells shows them all, in order.

use reqwest::StatusCode;
use serde_json::json;
use sqlx::Connection;

use crate::mcp_client::{Client, Era};
use crate::support::oauth::*;
use crate::support::{self, Gateway, eventually};

/// The stack's Postgres with two gateway processes on one database: the second shares the
/// first's tenant and user.
async fn two_replicas() -> (Stack, Stack) {
    let first = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    // A gateway-only replica: the engine's node is the first's.
    let gateway = Gateway::start_gateway_only(
        &first.gateway.database_url,
        &first.gateway.instance,
        &[("SANDGATE_POOL__MIN_READY", "0")],
    )
    .await;
    let second = Stack {
        gateway,
        tenant: first.tenant.clone(),
        email: first.email.clone(),
        http: first.http.clone(),
    };
    (first, second)
}

/// An access token for `stack`'s MCP URL under the user's grant to `client_id`, through the
/// consent page (the first approval).
async fn token_through(stack: &Stack, client_id: &str) -> (String, Browser) {
    let mut browser = Browser::new(stack);
    let pkce = Pkce::new();
    let (query, _) = connect(stack, &mut browser, client_id, &pkce, "sandbox execute").await;
    (
        exchange(stack, client_id, &query["code"], &pkce).await,
        browser,
    )
}

/// Another access token under the same grant, for `stack`'s MCP URL: the user already approved
/// the client, so signing in on this replica redirects with a code at once (same grant).
async fn token_again(stack: &Stack, client_id: &str) -> String {
    let mut browser = Browser::new(stack);
    let pkce = Pkce::new();
    let url = authorize_url(stack, client_id, REDIRECT, &pkce, "st-2", "sandbox execute");
    let start = browser.get(&url).await;
    let login = start.location.expect("the authorize page asks to sign in");
    let after = browser.log_in(&login, &stack.email, PASSWORD).await;
    let back = browser
        .get(after.location.as_deref().expect("login redirects back"))
        .await;
    let location = back
        .location
        .unwrap_or_else(|| panic!("an approved client is redirected at once: {}", back.body));
    assert!(location.starts_with(REDIRECT), "{location}");
    exchange(stack, client_id, &query_of(&location)["code"], &pkce).await
}

async fn exchange(stack: &Stack, client_id: &str, code: &str, pkce: &Pkce) -> String {
    let (status, tokens) = stack.exchange(client_id, code, &pkce.verifier).await;
    assert_eq!(status, StatusCode::OK, "{tokens}");
    tokens["access_token"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_grant_disconnected_through_one_gateway_is_refused_at_once_by_another() {
    let (a, b) = two_replicas().await;
    let client_id = a.register("Two Replicas", REDIRECT).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (token_a, mut browser) = token_through(&a, &client_id).await;
    let token_b = token_again(&b, &client_id).await;
    // B serves calls with its token (and so holds the grant as live in its cache).
    let client_b = Client::connect(&b.gateway.mcp_url(), &token_b, Era::Stateless)
        .await
        .expect("connects to B");
    for _ in 0..3 {
        let result = client_b
            .call(
                "execute_code",
                json!({"sandbox_id": "sbx_missing", "code": "1"}),
            )
            .await
            .expect("a tool result");
        assert!(result.text.contains("no sandbox sbx_missing"), "{result:?}");
    }
    let (status, _, body) = b.mcp_status(&token_b).await;
    assert_ne!(
        status,
        StatusCode::UNAUTHORIZED,
        "B accepts the token before the disconnect: {body}"
    );

    // The person disconnects the app on A's page.
    let apps = browser.get(&a.url("/apps")).await;
    assert!(apps.body.contains("Two Replicas"), "{}", apps.body);
    let grant = hidden(&apps.body, "grant_id").unwrap();
    let csrf = hidden(&apps.body, "csrf").unwrap();
    let done = browser
        .post(
            &a.url("/apps/disconnect"),
            &[("csrf", &csrf), ("grant_id", &grant)],
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);

    // The very next request to B is refused: no waiting, no retry.
    let (status, _, body) = b.mcp_status(&token_b).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "B refuses the disconnected grant's token at once: {body}"
    );
    assert_eq!(
        body["error_description"],
        "the access token was revoked or its app was disconnected"
    );
    let (status, _, _) = a.mcp_status(&token_a).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "and so does A");
}

#[tokio::test]
async fn a_tenant_limit_changed_by_the_operator_is_seen_by_every_replica() {
    let (a, b) = two_replicas().await;
    let token = b.gateway.token(&b.tenant).await;
    let client = Client::connect(&b.gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects to B");
    // B loads (and caches) the tenant's limits.
    let first = client
        .call("list_files", json!({"sandbox_id": "sbx_missing"}))
        .await
        .expect("a tool result");
    assert!(first.text.contains("no sandbox sbx_missing"), "{first:?}");

    // The operator lowers the longest idle timeout with A's configuration.
    a.gateway
        .cli(&[
            "admin",
            "tenant",
            "limits",
            &a.tenant,
            "--max-idle-seconds",
            "50",
        ])
        .await;

    // B hears of the change from Postgres (a notification its listener handles as it arrives,
    // usually before the CLI has even answered; on a loaded machine a moment later): well within
    // the cache's TTL, so the push, not the expiry, is what B acts on.
    // Each attempt is a new conversation: one created before B heard keeps what it was given.
    let attempt = std::sync::atomic::AtomicUsize::new(0);
    let refused = eventually(
        sandgate_service::cache::TTL / 2,
        "B to apply the new limit",
        || async {
            let n = attempt.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let answer = client
                .call(
                    "create_sandbox",
                    json!({"conversation_id": format!("c-limits-{n}"), "keep_alive_seconds": 100}),
                )
                .await
                .expect("a tool result");
            (answer.is_error && answer.text.contains("50 s")).then_some(answer)
        },
    )
    .await;
    assert!(refused.is_error, "B applies the new limit: {refused:?}");
}

/// A gateway on a fresh database (no warm pool), a tenant of it and a stateless client.
async fn one_gateway() -> (String, Gateway, String, Client) {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    (database, gateway, tenant, client)
}

#[tokio::test]
async fn no_audit_event_is_lost_when_the_gateway_stops_right_after_its_calls() {
    const CALLS: usize = 40;
    let database = support::fresh_database().await;
    let mut gateway = Gateway::start(&database, &[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = std::sync::Arc::new(
        Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
            .await
            .expect("connects"),
    );
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..CALLS {
        let client = client.clone();
        calls.spawn(async move {
            client
                .call(
                    "list_files",
                    json!({"sandbox_id": format!("sbx_missing{i}")}),
                )
                .await
                .expect("a tool result")
        });
    }
    let answered = calls.join_all().await.len();
    assert_eq!(answered, CALLS);
    // SIGTERM at once: the events still queued are written before the process exits.
    assert!(gateway.terminate().await, "the gateway stops cleanly");
    let mut conn = sqlx::PgConnection::connect(&database)
        .await
        .expect("the test database");
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE tool = 'list_files' AND tenant_id = $1::uuid",
    )
    .bind(&tenant)
    .fetch_one(&mut conn)
    .await
    .expect("count");
    assert_eq!(
        rows, CALLS as i64,
        "one audit row per answered call, all written before exit"
    );
}

/// The audit writer never drops an event while Postgres answers.
#[tokio::test]
async fn no_audit_event_is_counted_as_dropped_in_normal_operation() {
    let (_, gateway, _, client) = one_gateway().await;
    client
        .call("list_files", json!({"sandbox_id": "sbx_missing"}))
        .await
        .expect("a tool result");
    let metrics = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("/metrics answers")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("sandgate_audit_dropped_total 0"),
        "the dropped-events counter is exported and zero:\n{metrics}"
    );
    assert!(
        metrics.contains("sandgate_transcript_entries_lost_total 0"),
        "the lost-entries counter is exported and zero:\n{metrics}"
    );
}

/// The `print(i)` cells of a sandbox's transcript as stored, in the order of their positions,
/// and whether the positions run 1, 2, 3… without a gap.
async fn stored_cells(database: &str, sandbox: &str) -> (Vec<String>, bool) {
    let mut conn = sqlx::PgConnection::connect(database)
        .await
        .expect("the test database");
    let rows: Vec<(i32, String)> = sqlx::query_as(
        "SELECT seq, body->>'code' FROM transcript_entries WHERE sandbox_id = $1 ORDER BY seq",
    )
    .bind(sandbox)
    .fetch_all(&mut conn)
    .await
    .expect("the transcript's entries");
    let consecutive = rows
        .iter()
        .enumerate()
        .all(|(i, (seq, _))| *seq == i as i32 + 1);
    (
        rows.into_iter().map(|(_, code)| code).collect(),
        consecutive,
    )
}

fn cells(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("print({i})")).collect()
}

/// Transcript entries are written behind the answer; a SIGTERM right after many cells still
/// finds every one of them in Postgres, in the order the cells ran.
#[tokio::test]
async fn no_transcript_entry_is_lost_when_the_gateway_stops_right_after_its_cells() {
    const CELLS: usize = 30;
    let (database, mut gateway, _, client) = one_gateway().await;
    let created = client.ok("create_sandbox", json!({})).await;
    let sandbox = created.structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();
    for code in cells(CELLS) {
        client
            .ok("execute_code", json!({"sandbox_id": sandbox, "code": code}))
            .await;
    }
    // SIGTERM at once: the entries still queued are written before the process exits.
    assert!(gateway.terminate().await, "the gateway stops cleanly");
    let (stored, consecutive) = stored_cells(&database, &sandbox).await;
    assert_eq!(
        stored,
        cells(CELLS),
        "every cell that answered is in the transcript, in the order it ran"
    );
    assert!(consecutive, "positions 1..={CELLS} without a gap");
}

/// A person who takes over right after the last cell sees every cell, in order: the export
/// waits for the entries its gateway has queued.
#[tokio::test]
async fn a_transcript_exported_right_after_its_cells_has_every_one_in_order() {
    const CELLS: usize = 20;
    let (_, _gateway, _, client) = one_gateway().await;
    let conversation = "ticket-write-behind";
    for code in cells(CELLS) {
        client
            .ok(
                "execute_code",
                json!({"conversation_id": conversation, "code": code}),
            )
            .await;
    }
    let exported = client
        .ok(
            "export_transcript",
            json!({"conversation_id": conversation, "format": "ipynb"}),
        )
        .await;
    assert_eq!(
        exported.structured["calls"], CELLS,
        "the export counts every cell: {}",
        exported.structured
    );
    let notebook: serde_json::Value = reqwest::get(
        exported.structured["download_url"]
            .as_str()
            .expect("a download link"),
    )
    .await
    .expect("the link answers")
    .json()
    .await
    .expect("a notebook");
    let sources: Vec<String> = notebook["cells"]
        .as_array()
        .expect("cells")
        .iter()
        .filter(|c| c["cell_type"] == "code")
        .map(|c| match &c["source"] {
            serde_json::Value::Array(lines) => {
                lines.iter().filter_map(|l| l.as_str()).collect::<String>()
            }
            other => other.as_str().unwrap_or_default().to_owned(),
        })
        .collect();
    assert_eq!(sources, cells(CELLS), "every cell, in the order it ran");
}
