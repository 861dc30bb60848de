//! Hostile tenants, round two (issue 24, holes 1–4): every read is admitted and bounded. Each
//! test plays the attacker against the real binary and shows another tenant still served:
//!
//! - many sandboxes in one conversation, its transcript read many times at once: the tenant's
//!   byte budget and the load's bounds hold, the export says what it left out, and the
//!   gateway's resident memory stays under a stated bound;
//! - a tenant at `max_calls_in_flight 1` reading resources in parallel: quota refusals with the
//!   tool calls' fields, every read in `admin audit`, a large file linked instead of inlined;
//! - 32 parallel whole-file reads of a 20 MB file through a separate `sandgate node`: the node's
//!   memory stays under a stated bound, the reads beyond its budget are refused retryably.

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::ReadResourceRequestParams;
use serde_json::{Value, json};

use crate::mcp_client::{Client, Era};
use crate::support::node::{Engine, TlsFiles};
use crate::support::replicas::Deployment;
use crate::support::scale_out::{spawn_gateway, spawn_node};
use crate::support::{self, Gateway, eventually, memory_of};

const MIB: u64 = 1 << 20;

/// A stateless client of a new tenant of `gateway`: (tenant id, client).
async fn new_tenant(gateway: &Gateway) -> (String, Arc<Client>) {
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    (tenant, Arc::new(client))
}

/// Another tenant's `1 + 1`, answered.
async fn another_tenant_is_served(client: &Client) {
    let two = client.ok("execute_code", json!({"code": "1 + 1"})).await;
    assert!(two.text.contains('2'), "1 + 1 answered: {}", two.text);
}

/// The JSON-RPC error data of a failed `resources/read` (its `data`).
fn error_data(err: &rmcp::service::ServiceError) -> Value {
    match err {
        rmcp::service::ServiceError::McpError(e) => e.data.clone().unwrap_or(Value::Null),
        other => panic!("a JSON-RPC error, not {other:?}"),
    }
}

async fn read(
    client: &Client,
    uri: &str,
) -> Result<rmcp::model::ReadResourceResult, rmcp::service::ServiceError> {
    client
        .service
        .read_resource(ReadResourceRequestParams::new(uri.to_owned()))
        .await
}

/// Lines of the tenant's audit trail naming `tool`.
async fn audited(gateway: &Gateway, tenant: &str, tool: &str) -> usize {
    let trail = gateway
        .cli(&["admin", "audit", "--tenant", tenant, "--limit", "10000"])
        .await;
    trail.lines().filter(|l| l.contains(tool)).count()
}

#[tokio::test]
async fn a_conversations_transcript_read_many_times_at_once_stays_bounded() {
    let database = support::fresh_database().await;
    // Scaled down: a sandbox keeps 2 MiB, the tenant 5 MiB, one load reads 3 MiB.
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_POOL__MIN_READY", "2"),
            ("SANDGATE_RETENTION__TRANSCRIPT_MAX_BYTES", "2097152"),
            ("SANDGATE_RETENTION__TRANSCRIPT_TENANT_MAX_BYTES", "5242880"),
            ("SANDGATE_RETENTION__TRANSCRIPT_LOAD_MAX_BYTES", "3145728"),
            ("SANDGATE_RETENTION__TRANSCRIPT_LOADS_AT_ONCE", "2"),
        ],
    )
    .await;
    let (_attacker, client) = new_tenant(&gateway).await;
    let (_other, theirs) = new_tenant(&gateway).await;
    let conversation = "ticket-flood";
    // Five sandboxes under one conversation, each with three cells printing ~1 MB.
    for _ in 0..5 {
        let made = client
            .ok("create_sandbox", json!({"conversation_id": conversation}))
            .await;
        let sandbox = made.structured["sandbox_id"]
            .as_str()
            .expect("an id")
            .to_owned();
        for _ in 0..3 {
            client
                .ok(
                    "execute_code",
                    json!({"sandbox_id": sandbox, "code": "print('x' * 1_000_000)"}),
                )
                .await;
        }
        client
            .ok("close_sandbox", json!({"sandbox_id": sandbox}))
            .await;
    }
    let export = client
        .ok(
            "export_transcript",
            json!({"conversation_id": conversation, "format": "html"}),
        )
        .await;
    let out = &export.structured;
    assert!(
        out["over_budget"].as_u64().is_some_and(|n| n > 0),
        "the tenant's budget (5 MiB) dropped calls, and the export counts them: {out}"
    );
    assert!(
        out["omitted_sandboxes"].as_u64().is_some_and(|n| n > 0)
            && export.text.contains("leaves out"),
        "one load reads 3 MiB: the oldest sandboxes are left out, and said: {}",
        export.text
    );
    assert!(
        out["size"].as_u64().is_some_and(|n| n <= 3 * MIB + MIB),
        "the export holds its load's bound: {out}"
    );
    let metrics = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("/metrics answers")
        .text()
        .await
        .expect("metrics text");
    assert!(
        metrics.lines().any(
            |l| l.starts_with("sandgate_transcript_entries_over_budget_total ")
                && !l.ends_with(" 0")
        ),
        "what the budget dropped is counted"
    );

    // Sixteen reads of the whole conversation's transcript at once.
    let uri = format!("conversation://{conversation}/transcript.html");
    let pid = gateway.pid().expect("the gateway runs");
    let mut reads = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (client, uri) = (client.clone(), uri.clone());
        reads.spawn(async move { read(&client, &uri).await });
    }
    another_tenant_is_served(&theirs).await;
    let mut served = 0;
    for result in reads.join_all().await {
        match result {
            Ok(page) => {
                served += 1;
                let text = serde_json::to_string(&page).expect("serializes");
                assert!(
                    text.contains("leaves out"),
                    "the page says what it left out"
                );
            }
            Err(err) => {
                let data = error_data(&err);
                assert!(
                    data["error"] == "capacity" && data["retryable"] == true,
                    "a read beyond the loads at once is a retryable capacity refusal: {err}"
                );
            }
        }
    }
    assert!(served > 0, "some reads are served");
    another_tenant_is_served(&theirs).await;
    let (_, peak) = memory_of(pid);
    // Loads hold at most 2 × 3 MiB of stored entries at once (parsed and rendered: a few
    // times that), plus sixteen answers of ~3 MB on their way out, over the gateway's own
    // resident size (warm pool, TLS, runtime): 400 MiB is well above that and well below
    // sixteen unbounded loads of the whole conversation.
    assert!(
        peak < 400 * MIB,
        "the gateway's peak resident memory stays under 400 MiB: {} MiB",
        peak / MIB
    );
}

#[tokio::test]
async fn resource_reads_are_admitted_refused_and_audited_like_tool_calls() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[("SANDGATE_POOL__MIN_READY", "2")]).await;
    let (tenant, client) = new_tenant(&gateway).await;
    let (_other, theirs) = new_tenant(&gateway).await;
    // The limit first: a tenant's limits are cached once read.
    gateway
        .cli(&[
            "admin",
            "tenant",
            "limits",
            &tenant,
            "--max-calls-in-flight",
            "1",
        ])
        .await;
    let made = client
        .ok(
            "run_terminal_command",
            json!({"command": "head -c 20000000 /dev/zero > big.bin && echo hi > small.txt"}),
        )
        .await;
    let sandbox = made.structured["sandbox_id"]
        .as_str()
        .expect("an id")
        .to_owned();

    // The setup call's slot is freed behind its answer: wait until a call gets through.
    eventually(Duration::from_secs(20), "the slot free", || {
        let (client, sandbox) = (client.clone(), sandbox.clone());
        async move {
            let r = client
                .call("list_files", json!({"sandbox_id": sandbox}))
                .await
                .ok()?;
            (!r.is_error).then_some(())
        }
    })
    .await;
    let container: String = {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&database)
            .await
            .expect("Postgres");
        sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE id = $1")
            .bind(&sandbox)
            .fetch_one(&mut conn)
            .await
            .expect("the sandbox's row")
    };
    // One call holds the tenant's only slot (it waits on a gate file); started again if a
    // moment's leftover slot refused it.
    let gated = loop {
        let call = {
            let (client, sandbox) = (client.clone(), sandbox.clone());
            tokio::spawn(async move {
                client
                    .call(
                        "run_terminal_command",
                        json!({"sandbox_id": sandbox, "timeout_seconds": 120,
                               "command": "while [ ! -e /tmp/gate ]; do sleep 0.2; done"}),
                    )
                    .await
            })
        };
        let running = eventually(Duration::from_secs(30), "the gated call", || {
            let (container, finished) = (container.clone(), call.is_finished());
            async move {
                if finished {
                    return Some(false);
                }
                let waiting =
                    crate::support::sandbox_exec(&container, &["pgrep", "-f", "/tmp/gate"]).await;
                waiting.status.success().then_some(true)
            }
        })
        .await;
        if running {
            break call;
        }
    };
    let file = format!("sandbox://{sandbox}/files/big.bin");
    let refusal = error_data(&read(&client, &file).await.expect_err("refused at the cap"));
    assert_eq!(refusal["error"], "quota_exceeded", "{refusal}");
    assert_eq!(refusal["limit"], "max_calls_in_flight", "{refusal}");
    assert_eq!(refusal["value"], 1, "{refusal}");
    assert_eq!(refusal["retryable"], true, "{refusal}");
    assert!(
        refusal["retry_after_seconds"]
            .as_u64()
            .is_some_and(|s| s >= 1)
    );

    // Twenty parallel reads of the 20 MB file: all refused, none holds the file.
    let mut reads = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let (client, file) = (client.clone(), file.clone());
        reads.spawn(async move { read(&client, &file).await });
    }
    for result in reads.join_all().await {
        let err = result.expect_err("refused at the in-flight cap");
        assert_eq!(error_data(&err)["error"], "quota_exceeded", "{err}");
    }
    let listed = client.service.list_resources(None).await;
    assert!(listed.is_err(), "resources/list is admitted the same way");
    another_tenant_is_served(&theirs).await;

    // The gate opens; the slot frees.
    let opened = crate::support::sandbox_exec(&container, &["touch", "/tmp/gate"]).await;
    assert!(opened.status.success(), "the gate opens");
    gated
        .await
        .expect("the gated call ends")
        .expect("a tool result");
    let small = eventually(Duration::from_secs(20), "a read admitted", || {
        let client = client.clone();
        let uri = format!("sandbox://{sandbox}/files/small.txt");
        async move { read(&client, &uri).await.ok() }
    })
    .await;
    assert!(serde_json::to_string(&small).unwrap().contains("hi"));
    // Past limits.inline_resource_bytes the file is linked, not inlined.
    let big = eventually(Duration::from_secs(20), "the big read answered", || {
        let (client, file) = (client.clone(), file.clone());
        async move {
            let err = read(&client, &file).await.err()?;
            let data = error_data(&err);
            (data["error"] == "limit").then_some(data)
        }
    })
    .await;
    let link = big["download_url"].as_str().expect("a download link");
    let body = reqwest::get(link).await.expect("the link opens");
    let bytes = body.bytes().await.expect("the file streams");
    assert_eq!(bytes.len(), 20_000_000, "the link serves the whole file");

    // Every read is in the audit trail (the refused ones too).
    // The refusal, the twenty, the small file and the big one.
    let expected = 1 + 20 + 1 + 1;
    let reads = eventually(Duration::from_secs(20), "the reads audited", || async {
        let n = audited(&gateway, &tenant, "resources/read").await;
        (n >= expected).then_some(n)
    })
    .await;
    assert!(reads >= expected, "{reads} reads audited");
    assert!(audited(&gateway, &tenant, "resources/list").await >= 1);
}

#[tokio::test]
async fn parallel_whole_file_reads_keep_a_node_within_its_budget_and_another_tenant_served() {
    let deployment = Deployment::new().await;
    let tls = TlsFiles::new(&deployment.instance);
    let node = spawn_node(
        &deployment,
        &Engine::first(),
        &tls,
        &[
            ("SANDGATE_POOL__MIN_READY", "2"),
            ("SANDGATE_NODE__READ_BYTES_IN_FLIGHT", "104857600"),
        ],
    )
    .await;
    let gateway = spawn_gateway(0, &deployment, &tls, &[]).await;
    let (_tenant, client) = new_tenant(&gateway).await;
    let (_other, theirs) = new_tenant(&gateway).await;
    let made = client
        .ok(
            "run_terminal_command",
            json!({"command": "head -c 20000000 /dev/urandom > big.bin"}),
        )
        .await;
    let sandbox = made.structured["sandbox_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let pid = node.pid().expect("the node runs");

    let mut reads = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let (client, sandbox) = (client.clone(), sandbox.clone());
        reads.spawn(async move {
            client
                .call(
                    "get_file",
                    json!({"sandbox_id": sandbox, "path": "big.bin"}),
                )
                .await
                .expect("a tool result")
        });
    }
    another_tenant_is_served(&theirs).await;
    let (mut served, mut busy) = (0, 0);
    for result in reads.join_all().await {
        if !result.is_error {
            served += 1;
            assert_eq!(result.structured["size"], 20_000_000);
            continue;
        }
        busy += 1;
        assert_eq!(
            result.structured["error"], "capacity",
            "a read beyond the node's budget is a capacity refusal: {}",
            result.text
        );
        assert_eq!(result.structured["retryable"], true);
        assert!(
            result.structured["retry_after_seconds"]
                .as_u64()
                .is_some_and(|s| s >= 1),
            "{}",
            result.structured
        );
    }
    assert!(
        served > 0,
        "reads within the budget are served ({busy} refused)"
    );
    another_tenant_is_served(&theirs).await;
    let (_, peak) = memory_of(pid);
    // The node holds at most its 100 MiB budget for whole files (a file and its encoding,
    // reserved together), over its own resident size (runtime, Docker client, warm pool
    // channels): 300 MiB is above that and far below 32 × 20 MB held at once.
    assert!(
        peak < 300 * MIB,
        "the node's peak resident memory stays under 300 MiB: {} MiB",
        peak / MIB
    );
}
