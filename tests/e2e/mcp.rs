//! The MCP endpoint end to end: the real binary, real Postgres, real Docker, rmcp's client.

use std::time::Duration;

use serde_json::{Value, json};

use crate::mcp_client::{Client, Era};
use crate::support::{self, Gateway};

const SALES_CSV: &str = "region,product,amount\nnorth,widget,10\nsouth,widget,5\nnorth,gadget,7\nsouth,gadget,3\nnorth,widget,1\n";

/// A fresh database, a gateway on it, a tenant and its token.
pub(crate) async fn stack() -> (Gateway, String) {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[]).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    (gateway, token)
}

/// The support-analyst conversation: create, upload, analyse, chart, get the chart, list, a
/// failing cell, close.
async fn support_analyst(era: Era) {
    let (gateway, token) = stack().await;
    let client = Client::connect(&gateway.mcp_url(), &token, era)
        .await
        .expect("client connects");
    let expected = match era {
        Era::Sessions => "2025-11-25",
        Era::Stateless => "2026-07-28",
    };
    assert_eq!(client.protocol_version(), expected, "negotiated era");

    let tools = client.service.list_all_tools().await.expect("tools/list");
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "close_sandbox",
            "create_sandbox",
            "execute_code",
            "export_transcript",
            "fork_sandbox",
            "get_file",
            "install_packages",
            "kill_job",
            "list_files",
            "list_jobs",
            "list_sandboxes",
            "pause_sandbox",
            "run_terminal_command",
            "upload_file"
        ]
    );
    for tool in &tools {
        assert!(
            tool.output_schema.is_some(),
            "{} has an output schema",
            tool.name
        );
        assert!(
            tool.description.as_deref().is_some_and(|d| d.len() > 40),
            "{} is described",
            tool.name
        );
    }

    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let created = client
        .ok("create_sandbox", json!({"conversation_id": conversation}))
        .await;
    assert_eq!(created.structured["created"], true);
    let sandbox_id = created.structured["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned();
    assert!(
        created.structured["expires_at"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );

    let again = client
        .ok("create_sandbox", json!({"conversation_id": conversation}))
        .await;
    assert_eq!(
        again.structured["sandbox_id"],
        sandbox_id.as_str(),
        "same conversation, same sandbox"
    );
    assert_eq!(again.structured["created"], false);

    let uploaded = client
        .ok(
            "upload_file",
            json!({"sandbox_id": sandbox_id, "path": "data/sales.csv", "content_text": SALES_CSV}),
        )
        .await;
    assert_eq!(uploaded.structured["path"], "/home/user/data/sales.csv");
    assert_eq!(uploaded.structured["size"], SALES_CSV.len());

    let grouped = client
        .ok(
            "execute_code",
            json!({"sandbox_id": sandbox_id, "code": "import pandas as pd\ndf = pd.read_csv('data/sales.csv')\ntotals = df.groupby('region')['amount'].sum()\nprint(totals.to_dict())\ntotals"}),
        )
        .await;
    assert_eq!(grouped.structured["stdout"], "{'north': 18, 'south': 8}\n");
    let plain = grouped.structured["result"]["text/plain"]
        .as_str()
        .unwrap_or_default();
    assert!(
        plain.contains("north") && plain.contains("18"),
        "last expression's value: {plain}"
    );
    assert!(
        grouped.text.contains("north"),
        "the text block shows the output"
    );

    let chart = client
        .ok(
            "execute_code",
            json!({"sandbox_id": sandbox_id, "code": "import matplotlib.pyplot as plt\nplt.bar(totals.index, totals.values)\nplt.title('Sales by region')\nplt.show()"}),
        )
        .await;
    assert_eq!(
        chart.images.len(),
        1,
        "one chart comes back inline: {}",
        chart.text
    );
    assert_eq!(chart.images[0].0, "image/png");
    assert!(chart.images[0].1.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    let chart_path = chart.structured["images"][0]["path"]
        .as_str()
        .expect("the chart was saved")
        .to_owned();
    assert!(chart_path.starts_with("/home/user/"), "{chart_path}");

    let fetched = client
        .ok(
            "get_file",
            json!({"sandbox_id": sandbox_id, "path": chart_path}),
        )
        .await;
    assert_eq!(fetched.structured["mime_type"], "image/png");
    assert_eq!(
        fetched.images.len(),
        1,
        "an image comes back as image content"
    );
    assert_eq!(
        fetched.images[0].1, chart.images[0].1,
        "the saved file is the chart that was shown"
    );

    // A person can open the expiring download link; a tampered one is refused.
    let link = fetched.structured["download_url"]
        .as_str()
        .expect("a download link")
        .to_owned();
    assert!(
        link.starts_with(&format!("{}/files/", gateway.base_url)),
        "{link}"
    );
    let download = reqwest::get(&link).await.expect("the link answers");
    assert_eq!(download.status(), 200);
    assert_eq!(download.headers()["content-type"], "image/png");
    assert_eq!(download.headers()["x-content-type-options"], "nosniff");
    let bytes = download.bytes().await.expect("the file");
    assert_eq!(
        bytes.as_ref(),
        chart.images[0].1.as_slice(),
        "the link serves the same file"
    );
    // The link is one sealed token: change its last character.
    let last = link.chars().last().unwrap();
    let tampered = format!(
        "{}{}",
        &link[..link.len() - 1],
        if last == 'A' { 'B' } else { 'A' }
    );
    assert_eq!(
        reqwest::get(&tampered).await.expect("answers").status(),
        404
    );

    let csv = client
        .ok(
            "get_file",
            json!({"sandbox_id": sandbox_id, "path": "data/sales.csv"}),
        )
        .await;
    assert_eq!(
        csv.texts.last().map(String::as_str),
        Some(SALES_CSV),
        "text comes back as text"
    );

    let binary: Vec<u8> = vec![0, 159, 146, 150, 255, 1, 2, 3];
    let encoded = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(&binary)
    };
    client
        .ok(
            "upload_file",
            json!({"sandbox_id": sandbox_id, "path": "blob.bin", "content_base64": encoded}),
        )
        .await;
    let blob = client
        .ok(
            "get_file",
            json!({"sandbox_id": sandbox_id, "path": "blob.bin"}),
        )
        .await;
    assert_eq!(blob.structured["mime_type"], "application/octet-stream");
    assert_eq!(
        blob.blobs.len(),
        1,
        "binary comes back as an embedded blob: {}",
        blob.text
    );
    assert_eq!(blob.blobs[0].1, binary, "byte for byte");

    let listing = client
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": sandbox_id, "command": "ls -la /home/user data outputs"}),
        )
        .await;
    assert_eq!(listing.structured["exit_code"], 0);
    let stdout = listing.structured["stdout"].as_str().unwrap_or_default();
    assert!(
        stdout.contains("sales.csv") && stdout.contains(".png"),
        "ls shows the files: {stdout}"
    );

    let files = client
        .ok(
            "list_files",
            json!({"sandbox_id": sandbox_id, "path": "data"}),
        )
        .await;
    assert_eq!(files.structured["entries"][0]["name"], "sales.csv");
    assert_eq!(files.structured["entries"][0]["type"], "file");

    let failing = client
        .call(
            "execute_code",
            json!({"sandbox_id": sandbox_id, "code": "df['missing_column']"}),
        )
        .await
        .expect("a failing cell is a tool result, not a protocol error");
    assert!(failing.is_error, "isError for a failing cell");
    assert_eq!(failing.structured["error"]["name"], "KeyError");
    let traceback = failing.structured["error"]["traceback"]
        .as_array()
        .map(|t| t.len())
        .unwrap_or(0);
    assert!(traceback > 0, "a traceback comes back");

    let command_failed = client
        .call(
            "run_terminal_command",
            json!({"sandbox_id": sandbox_id, "command": "exit 3"}),
        )
        .await
        .expect("a tool result");
    assert!(command_failed.is_error);
    assert_eq!(command_failed.structured["exit_code"], 3);

    let malformed = client
        .call("execute_code", json!({"sandbox_id": sandbox_id}))
        .await;
    assert!(
        malformed.is_err(),
        "a call without `code` is a JSON-RPC error"
    );

    let closed = client
        .ok("close_sandbox", json!({"sandbox_id": sandbox_id}))
        .await;
    assert_eq!(closed.structured["closed"], true);
    let after = client
        .call(
            "execute_code",
            json!({"sandbox_id": sandbox_id, "code": "1"}),
        )
        .await
        .expect("a tool result");
    assert!(
        after.is_error && after.text.contains("closed"),
        "a closed sandbox says so: {}",
        after.text
    );

    // Prometheus counts the calls by tool and outcome.
    let metrics = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("/metrics answers")
        .text()
        .await
        .expect("text");
    for line in [
        r#"sandgate_tool_calls_total{tool="create_sandbox",outcome="ok"} 2"#,
        r#"sandgate_tool_calls_total{tool="execute_code",outcome="user_error"} 1"#,
        // the call without `code`, and the call on the closed sandbox
        r#"sandgate_tool_calls_total{tool="execute_code",outcome="refused"} 2"#,
        r#"sandgate_tool_calls_total{tool="close_sandbox",outcome="ok"} 1"#,
    ] {
        assert!(metrics.contains(line), "/metrics has {line}:\n{metrics}");
    }

    // The audit trail holds one event per call (written in batches behind the answers).
    let audit = support::eventually(Duration::from_secs(10), "16 audit events", || async {
        let n = gateway_audit_count(&gateway).await;
        (n >= 16).then_some(n)
    })
    .await;
    assert_eq!(audit, 16, "one audit event per tool call");
}

async fn gateway_audit_count(gateway: &Gateway) -> i64 {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&gateway.database_url)
        .await
        .expect("db");
    sqlx::query_scalar("SELECT count(*) FROM audit_events")
        .fetch_one(&mut conn)
        .await
        .expect("count")
}

#[tokio::test]
async fn support_analyst_conversation_with_sessions() {
    support_analyst(Era::Sessions).await;
}

#[tokio::test]
async fn support_analyst_conversation_stateless() {
    support_analyst(Era::Stateless).await;
}

#[tokio::test]
async fn a_conversation_keeps_its_sandbox_across_reconnects() {
    let (gateway, token) = stack().await;
    let conversation = "ticket-4711";
    let first = Client::connect(&gateway.mcp_url(), &token, Era::Sessions)
        .await
        .expect("connects");
    let created = first
        .ok("create_sandbox", json!({"conversation_id": conversation}))
        .await;
    first
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": "answer = 42"}),
        )
        .await;
    first.service.cancel().await.expect("disconnects");

    for era in [Era::Sessions, Era::Stateless] {
        let client = Client::connect(&gateway.mcp_url(), &token, era)
            .await
            .expect("reconnects");
        let again = client
            .ok("create_sandbox", json!({"conversation_id": conversation}))
            .await;
        assert_eq!(
            again.structured["sandbox_id"],
            created.structured["sandbox_id"]
        );
        assert_eq!(again.structured["created"], false);
        let value = client
            .ok(
                "execute_code",
                json!({"conversation_id": conversation, "code": "answer"}),
            )
            .await;
        assert_eq!(
            value.structured["result"]["text/plain"], "42",
            "state survives the reconnect"
        );
    }
}

#[tokio::test]
async fn another_tenants_sandbox_looks_exactly_like_a_missing_one() {
    let (gateway, token_a) = stack().await;
    let tenant_b = gateway.create_tenant().await;
    let token_b = gateway.token(&tenant_b).await;
    let a = Client::connect(&gateway.mcp_url(), &token_a, Era::Stateless)
        .await
        .expect("A connects");
    let b = Client::connect(&gateway.mcp_url(), &token_b, Era::Stateless)
        .await
        .expect("B connects");
    let sandbox_a = a.ok("create_sandbox", json!({})).await.structured["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();
    a.ok(
        "execute_code",
        json!({"sandbox_id": sandbox_a, "code": "secret = 'A-only'"}),
    )
    .await;
    a.ok(
        "upload_file",
        json!({"sandbox_id": sandbox_a, "path": "a.txt", "content_text": "A"}),
    )
    .await;

    let calls: Vec<(&str, Value)> = vec![
        ("execute_code", json!({"code": "secret = 'B was here'"})),
        ("run_terminal_command", json!({"command": "rm -f a.txt"})),
        (
            "upload_file",
            json!({"path": "a.txt", "content_text": "B", "overwrite": true}),
        ),
        ("get_file", json!({"path": "a.txt"})),
        ("list_files", json!({})),
        ("close_sandbox", json!({})),
    ];
    for (tool, args) in calls {
        b.assert_foreign_looks_missing(tool, args, &sandbox_a).await;
    }
    let still = a
        .ok(
            "execute_code",
            json!({"sandbox_id": sandbox_a, "code": "secret"}),
        )
        .await;
    assert_eq!(
        still.structured["result"]["text/plain"], "'A-only'",
        "nothing of A changed"
    );
    let file = a
        .ok(
            "get_file",
            json!({"sandbox_id": sandbox_a, "path": "a.txt"}),
        )
        .await;
    assert_eq!(
        file.texts.last().map(String::as_str),
        Some("A"),
        "A's file is untouched"
    );
}

#[tokio::test]
async fn progress_notifications_stream_output_while_a_cell_runs() {
    let (gateway, token) = stack().await;
    let mut client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("connects");
    let result = client
        .ok(
            "execute_code",
            json!({"code": "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.3)"}),
        )
        .await;
    assert_eq!(result.structured["stdout"], "tick 0\ntick 1\ntick 2\n");
    let mut streamed = String::new();
    while let Ok(p) = client.progress.try_recv() {
        streamed.push_str(p.message.as_deref().unwrap_or_default());
    }
    assert!(
        streamed.contains("tick 0") && streamed.contains("tick 2"),
        "output streamed as progress: {streamed:?}"
    );
}

#[tokio::test]
async fn cancelling_a_call_interrupts_the_cell_and_keeps_state() {
    let (gateway, token) = stack().await;
    for era in [Era::Sessions, Era::Stateless] {
        let client = Client::connect(&gateway.mcp_url(), &token, era)
            .await
            .expect("connects");
        let id = client.ok("create_sandbox", json!({})).await.structured["sandbox_id"]
            .as_str()
            .unwrap()
            .to_owned();
        client
            .ok(
                "execute_code",
                json!({"sandbox_id": id, "code": "kept = 'yes'"}),
            )
            .await;
        // A cell far longer than the test (its own timeout ten minutes): the next call is
        // answered within the deadline only if the cancel interrupted it.
        let slow = client.call(
            "execute_code",
            json!({"sandbox_id": id, "code": "import time\ntime.sleep(3600)", "timeout_seconds": 600}),
        );
        // Dropping the call's future cancels it (notifications/cancelled, or the stream closing).
        let _ = tokio::time::timeout(Duration::from_secs(1), slow).await;
        let next = tokio::time::timeout(
            Duration::from_secs(300),
            client.ok("execute_code", json!({"sandbox_id": id, "code": "kept"})),
        )
        .await
        .unwrap_or_else(|_| panic!("the cancelled cell was interrupted ({era:?})"));
        assert_eq!(
            next.structured["result"]["text/plain"], "'yes'",
            "state survives the interrupt ({era:?})"
        );
    }
}

#[tokio::test]
async fn bad_tokens_get_401_with_a_challenge_and_foreign_origins_403() {
    let (gateway, token) = stack().await;
    let http = reqwest::Client::new();
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    let post = |auth: Option<String>, origin: Option<&str>| {
        let mut request = http
            .post(gateway.mcp_url())
            .header("accept", "application/json, text/event-stream")
            .json(&body);
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        request.send()
    };

    // Another deployment's token: right shape, wrong key. Another audience: our key, other resource.
    let tenant = gateway.create_tenant().await;
    let other = support::fresh_database().await;
    let other_gateway = Gateway::start(&other, &[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let other_tenant = other_gateway.create_tenant().await;
    let foreign_key = other_gateway.token(&other_tenant).await;
    let expired = gateway
        .cli(&[
            "admin", "token", "issue", "--tenant", &tenant, "--ttl", "1s",
        ])
        .await;
    let wrong_audience = {
        // Same keys and tenant, but minted for another public URL (audience).
        let output = support::sandgate_command()
            .args(["admin", "token", "issue", "--tenant", &tenant])
            .env("SANDGATE_DATABASE__URL", &gateway.database_url)
            .env("SANDGATE_PUBLIC_URL", "http://127.0.0.1:1")
            .output()
            .await
            .expect("runs");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    };
    // The 1 s token's life ends within two seconds (exp has second resolution).
    support::eventually(
        Duration::from_secs(5),
        "the 1 s token to expire",
        || async {
            let response = post(Some(format!("Bearer {expired}")), None).await.ok()?;
            (response.status() == 401).then_some(())
        },
    )
    .await;

    for (what, auth) in [
        ("missing", None),
        ("garbage", Some("Bearer not-a-token".to_owned())),
        ("expired", Some(format!("Bearer {expired}"))),
        ("wrongly signed", Some(format!("Bearer {foreign_key}"))),
        ("wrong audience", Some(format!("Bearer {wrong_audience}"))),
    ] {
        let response = post(auth, None).await.expect("a response");
        assert_eq!(response.status(), 401, "{what} token");
        let challenge = response
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(
            challenge.starts_with("Bearer ") && challenge.contains("resource_metadata="),
            "{what}: WWW-Authenticate names the metadata: {challenge}"
        );
    }
    let ok = post(Some(format!("Bearer {token}")), None)
        .await
        .expect("a response");
    assert_eq!(ok.status(), 200, "a good token is accepted");
    let foreign_origin = post(
        Some(format!("Bearer {token}")),
        Some("https://evil.example"),
    )
    .await
    .expect("a response");
    assert_eq!(foreign_origin.status(), 403, "a foreign Origin is refused");
    let own_origin = post(Some(format!("Bearer {token}")), Some(&gateway.base_url))
        .await
        .expect("a response");
    assert_eq!(own_origin.status(), 200, "the gateway's own origin is fine");

    let metadata: Value = http
        .get(format!(
            "{}/.well-known/oauth-protected-resource/mcp",
            gateway.base_url
        ))
        .send()
        .await
        .expect("metadata")
        .json()
        .await
        .expect("JSON");
    assert_eq!(metadata["resource"], gateway.mcp_url());
}
