//! The error catalogue end to end (README, "Errors"): each kind a client can provoke through MCP
//! comes back as `isError: true` with `structuredContent` naming the kind, whether a retry may
//! help and when, beside the text the model reads; a malformed call is a JSON-RPC error whose
//! data names `invalid_params`. The same answers pass the official TypeScript SDK's outputSchema
//! check (`ts_sdk.rs`).
//!
//! Provoked here beyond what a client causes on a healthy stack: `unavailable` (the gateway's
//! Postgres connection cut by stopping a TCP proxy in front of it, as `lifecycle.rs`'s outage
//! test does), `node_away` (the `sandgate node` holding the sandbox killed well before
//! `node.lost_after_seconds`; once that passes the sandbox is `lost`, `placement.rs`),
//! `capacity` (no warm pool, one start at a time and `pool.start_wait_seconds = 1`, with four
//! creates at once), `sandbox_failed` (a cold start of an image the engine does not have) and
//! `internal` (Postgres answering but the sandboxes' table renamed away by hand: a failing
//! query, not an outage). `connection_lost` is provoked in `replicas.rs`
//! (`a_dropped_attach_connection_is_reattached_and_the_kernel_kept`: the engine's connection cut
//! by a proxy while a cell runs), which checks its kind, `retryable` and text. Every kind of the
//! catalogue is thus provoked through MCP somewhere; the unit tests of
//! `sandgate_service::sandboxes::kind` and `sandgate_mcp::errors` check the mapping of the
//! variants no test reaches (a remote node's start queue, an agent's internal error).

use serde_json::{Value, json};
use sqlx::Connection;

use crate::lifecycle::FAST;
use crate::mcp_client::{Client, Era, ToolResult};
use crate::support::node::NodeStart;
use crate::support::{self, Gateway, TcpProxy};

/// Asserts `result` is a tool error of `kind` with `retryable`, whose text contains `text`.
#[track_caller]
fn assert_kind(result: &ToolResult, kind: &str, retryable: bool, text: &str) {
    assert!(result.is_error, "{kind}: isError is true: {result:?}");
    assert_eq!(
        result.structured["error"], kind,
        "the structured error names {kind}: {result:?}"
    );
    assert_eq!(
        result.structured["retryable"], retryable,
        "{kind}: retryable is {retryable}: {result:?}"
    );
    assert!(
        result.text.contains(text),
        "{kind}: the text says {text:?}: {}",
        result.text
    );
}

/// The id a tool answer names.
fn sandbox_of(result: &ToolResult) -> String {
    result.structured["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned()
}

/// Removes `sandbox_id`'s container behind sandgate's back.
async fn remove_container(database_url: &str, sandbox_id: &str) {
    let container = crate::placement::container_of(database_url, sandbox_id).await;
    crate::support::remove_container(&container);
}

/// A stateless client of a new tenant of `gateway`.
async fn new_tenant_client(gateway: &Gateway) -> Client {
    let tenant = gateway.create_tenant().await;
    Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("connects")
}

/// A gateway on a fresh database, a tenant limited to one call per minute (for the quota) and
/// one without that limit (for everything else), each with a stateless client.
pub(crate) struct Catalogue {
    pub(crate) database: String,
    pub(crate) gateway: Gateway,
    pub(crate) token: String,
    pub(crate) quota_token: String,
}

impl Catalogue {
    pub(crate) async fn start() -> Catalogue {
        let database = support::fresh_database().await;
        let gateway = Gateway::start(&database, &[("SANDGATE_POOL__MIN_READY", "2")]).await;
        let tenant = gateway.create_tenant().await;
        let token = gateway.token(&tenant).await;
        let limited = gateway.create_tenant().await;
        gateway
            .cli(&[
                "admin",
                "tenant",
                "limits",
                &limited,
                "--max-calls-per-minute",
                "1",
            ])
            .await;
        let quota_token = gateway.token(&limited).await;
        Catalogue {
            database,
            gateway,
            token,
            quota_token,
        }
    }
}

#[tokio::test]
async fn every_error_kind_a_client_can_provoke_names_itself_beside_its_text() {
    let stack = Catalogue::start().await;
    let client = Client::connect(&stack.gateway.mcp_url(), &stack.token, Era::Stateless)
        .await
        .expect("connects");
    let call = |tool: &'static str, args: Value| {
        let client = &client;
        async move {
            client
                .call(tool, args)
                .await
                .expect("a tool result, not a protocol error")
        }
    };
    let sid = sandbox_of(&client.ok("create_sandbox", json!({})).await);

    let missing = format!("sbx_{}", uuid::Uuid::new_v4().simple());
    let not_found = call("execute_code", json!({"sandbox_id": missing, "code": "1"})).await;
    assert_kind(
        &not_found,
        "not_found",
        false,
        &format!("no sandbox {missing} exists; call create_sandbox to get one"),
    );
    assert!(not_found.structured.get("retry_after_seconds").is_none());

    let outside = call(
        "get_file",
        json!({"sandbox_id": sid, "path": "/etc/passwd"}),
    )
    .await;
    assert_kind(
        &outside,
        "bad_path",
        false,
        "files are confined to /home/user",
    );
    let absent = call("get_file", json!({"sandbox_id": sid, "path": "nope.csv"})).await;
    assert_kind(&absent, "bad_path", false, "nope.csv");

    client
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": sid, "command": "mkdir -p locked && chmod 500 locked"}),
        )
        .await;
    let denied = call(
        "upload_file",
        json!({"sandbox_id": sid, "path": "locked/a.txt", "content_text": "x"}),
    )
    .await;
    assert_kind(&denied, "sandbox_refused", false, "ermission denied");

    let no_job = call("kill_job", json!({"sandbox_id": sid, "job_id": "job-999"})).await;
    assert_kind(
        &no_job,
        "no_such_job",
        false,
        "There is no background job \"job-999\" in this sandbox; list_jobs shows its jobs",
    );

    let failed = call(
        "run_terminal_command",
        json!({"sandbox_id": sid, "command": "echo out; exit 3"}),
    )
    .await;
    assert_kind(&failed, "command_failed", false, "[exit code 3]");
    assert_eq!(
        failed.structured["exit_code"], 3,
        "the command's own output stays"
    );
    assert_eq!(failed.structured["stdout"], "out\n");

    let slow = call(
        "run_terminal_command",
        json!({"sandbox_id": sid, "command": "sleep 30", "timeout_seconds": 1}),
    )
    .await;
    assert_kind(&slow, "timeout", false, "[timed out after 1 s");
    assert_eq!(slow.structured["timed_out"], true);

    let limit = call(
        "create_sandbox",
        json!({"keep_alive_seconds": 4_000_000_000u32}),
    )
    .await;
    assert_kind(&limit, "limit", false, "limit reached: max idle timeout");

    let raised = call("execute_code", json!({"sandbox_id": sid, "code": "1/0"})).await;
    assert!(raised.is_error, "a raising cell is an error");
    assert_eq!(
        raised.structured["error"]["name"], "ZeroDivisionError",
        "a cell's error stays the exception it raised"
    );

    let malformed = client
        .call("execute_code", json!({"sandbox_id": sid}))
        .await
        .expect_err("a missing argument is a protocol error");
    let rmcp::ServiceError::McpError(data) = malformed else {
        panic!("a JSON-RPC error: {malformed:?}");
    };
    assert_eq!(data.code, rmcp::model::ErrorCode::INVALID_PARAMS);
    let data = data.data.expect("error data");
    assert_eq!(data["error"], "invalid_params");
    assert_eq!(data["retryable"], false);

    let lost_id = sandbox_of(&client.ok("create_sandbox", json!({})).await);
    remove_container(&stack.database, &lost_id).await;
    let lost = call("execute_code", json!({"sandbox_id": lost_id, "code": "1"})).await;
    assert_kind(&lost, "lost", false, &format!("sandbox {lost_id} was lost"));

    client.ok("close_sandbox", json!({"sandbox_id": sid})).await;
    let ended = call("list_files", json!({"sandbox_id": sid})).await;
    assert_kind(
        &ended,
        "ended",
        false,
        &format!("sandbox {sid} was closed at"),
    );

    let limited = Client::connect(&stack.gateway.mcp_url(), &stack.quota_token, Era::Stateless)
        .await
        .expect("connects");
    limited.ok("create_sandbox", json!({})).await;
    let refused = limited
        .call("create_sandbox", json!({}))
        .await
        .expect("a tool result");
    assert_kind(
        &refused,
        "quota_exceeded",
        true,
        "limit reached: max_calls_per_minute (1)",
    );
    assert_eq!(refused.structured["limit"], "max_calls_per_minute");
    assert_eq!(refused.structured["value"], 1);
    assert!(
        refused.structured["retry_after_seconds"]
            .as_u64()
            .is_some_and(|s| s >= 1),
        "says when to retry: {:?}",
        refused.structured
    );
}

#[tokio::test]
async fn a_call_while_the_database_is_away_is_unavailable_and_retryable() {
    let database = support::fresh_database().await;
    let proxy = TcpProxy::start(support::addr_of(&database)).await;
    let proxy_addr = proxy.addr;
    let gateway = Gateway::start(&support::with_addr(&database, proxy_addr), &FAST).await;
    let client = new_tenant_client(&gateway).await;
    let sid = sandbox_of(&client.ok("create_sandbox", json!({})).await);

    proxy.stop().await;
    let away = client
        .call("execute_code", json!({"sandbox_id": sid, "code": "1"}))
        .await
        .expect("a tool result, not a protocol error");
    assert_kind(
        &away,
        "unavailable",
        true,
        "sandgate's database is temporarily unavailable; retry in a few seconds",
    );
    assert!(away.structured.get("retry_after_seconds").is_none());

    let back = TcpProxy::start_on(proxy_addr, support::addr_of(&database)).await;
    drop(gateway);
    back.stop().await;
}

#[tokio::test]
async fn a_call_to_a_sandbox_on_a_silent_node_is_node_away_and_retryable() {
    // The node is silent far shorter than `node.lost_after_seconds`: its sandbox is not lost.
    const SLOW_LOSS: [(&str, &str); 2] = [
        ("SANDGATE_NODE__HEARTBEAT_SECONDS", "1"),
        ("SANDGATE_NODE__LOST_AFTER_SECONDS", "600"),
    ];
    let database = support::fresh_database().await;
    let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut node = NodeStart::new(&database, &instance)
        .env(SLOW_LOSS)
        .start()
        .await;
    let gateway = Gateway::start_gateway_only(&database, &instance, &SLOW_LOSS).await;
    let client = new_tenant_client(&gateway).await;
    let sid = sandbox_of(&client.ok("create_sandbox", json!({})).await);

    node.kill().await;
    let away = client
        .call("execute_code", json!({"sandbox_id": sid, "code": "1"}))
        .await
        .expect("a tool result, not a protocol error");
    assert_kind(
        &away,
        "node_away",
        true,
        &format!("the sandbox node {} did not answer (", node.id()),
    );
    assert!(
        away.text
            .contains("retry in a few seconds; if it stays silent its sandboxes are marked lost"),
        "says what to do: {}",
        away.text
    );
    assert!(away.structured.get("retry_after_seconds").is_none());
}

#[tokio::test]
async fn creates_waiting_past_the_start_queue_are_capacity_with_a_retry_time() {
    // No warm pool, one start at a time, and a second's wait for a place: of several cold
    // starts at once, those behind the first wait past it. No template either: a clone of one
    // restores in well under the second, and then every start fits in its wait.
    let database = support::fresh_database().await;
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_SNAPSHOTS__TEMPLATES", "false"),
            ("SANDGATE_POOL__MIN_READY", "0"),
            ("SANDGATE_POOL__MAX_READY", "0"),
            ("SANDGATE_POOL__MAX_CONCURRENT_STARTS", "1"),
            ("SANDGATE_POOL__START_WAIT_SECONDS", "1"),
        ],
    )
    .await;
    let client = new_tenant_client(&gateway).await;
    let creates = (0..4).map(|_| client.call("create_sandbox", json!({})));
    let answers: Vec<ToolResult> = futures::future::join_all(creates)
        .await
        .into_iter()
        .map(|r| r.expect("a tool result, not a protocol error"))
        .collect();
    let refused = answers
        .iter()
        .find(|a| a.is_error)
        .unwrap_or_else(|| panic!("a create waited past the start queue: {answers:?}"));
    assert_kind(
        refused,
        "capacity",
        true,
        "limit reached: sandbox starts (no sandbox could be started within 1 s: the sandbox \
         node is busy starting others); retry in a minute",
    );
    assert_eq!(
        refused.structured["retry_after_seconds"], 60,
        "says when to retry: {:?}",
        refused.structured
    );
    assert!(
        answers.iter().any(|a| !a.is_error),
        "the first start in the queue went through"
    );
}

#[tokio::test]
async fn a_create_whose_sandbox_cannot_start_is_sandbox_failed_and_retryable() {
    // The engine cannot start the configured image (it does not exist), and no warm pool hides
    // that: the cold start fails underneath the call.
    let database = support::fresh_database().await;
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_POOL__MIN_READY", "0"),
            ("SANDGATE_POOL__MAX_READY", "0"),
            (
                "SANDGATE_SANDBOX__IMAGE",
                "sandgate-e2e-no-such-image:absent",
            ),
        ],
    )
    .await;
    let client = new_tenant_client(&gateway).await;
    let failed = client
        .call("create_sandbox", json!({}))
        .await
        .expect("a tool result, not a protocol error");
    assert_kind(
        &failed,
        "sandbox_failed",
        true,
        "starting a sandbox failed; retry in a few seconds",
    );
    assert!(failed.structured.get("retry_after_seconds").is_none());
}

#[tokio::test]
async fn a_call_whose_query_fails_is_internal_and_names_nothing_inside() {
    // Postgres answers, but the sandboxes' table is gone from under the gateway (renamed by
    // hand): the call's query fails, which is not an outage.
    let stack = Catalogue::start().await;
    let client = Client::connect(&stack.gateway.mcp_url(), &stack.token, Era::Stateless)
        .await
        .expect("connects");
    let sid = sandbox_of(&client.ok("create_sandbox", json!({})).await);
    let mut conn = sqlx::PgConnection::connect(&stack.database)
        .await
        .expect("Postgres");
    sqlx::query("ALTER TABLE sandboxes RENAME TO sandboxes_hidden")
        .execute(&mut conn)
        .await
        .expect("the table is renamed");
    let failed = client
        .call("execute_code", json!({"sandbox_id": sid, "code": "1"}))
        .await
        .expect("a tool result, not a protocol error");
    assert_kind(
        &failed,
        "internal",
        true,
        "sandgate hit an internal error; retry the call, and if it persists, tell the user",
    );
    assert!(
        !failed.text.contains("sandboxes"),
        "no internals: {}",
        failed.text
    );
    sqlx::query("ALTER TABLE sandboxes_hidden RENAME TO sandboxes")
        .execute(&mut conn)
        .await
        .expect("the table is back");
}
