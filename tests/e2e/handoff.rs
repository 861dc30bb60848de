//! "The human takes over" (issue 13) end to end: a conversation's transcript exported as a
//! notebook (validated by `nbformat`) and as an HTML page (opened in headless Chromium, where a
//! `<script>` or `display(HTML(...))` from the sandbox must not run), download links bound to the
//! app connection, the logged-in users' transcripts page, MCP resources, large files as resource
//! links, retention and the tenant purge; each with the attacker's side.

use std::process::Stdio;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::Connection as _;

use crate::mcp_client::{Client, Era, ToolResult};
use crate::support::oauth::{
    Browser as HttpBrowser, Pkce, REDIRECT, Stack, connect, header, hidden,
};
use crate::support::{self, Gateway, eventually};

/// The test venv's Python (it has nbformat). A hard failure when unset, like python_sdk.rs.
fn python() -> String {
    std::env::var("SANDGATE_TEST_PYTHON").expect(
        "SANDGATE_TEST_PYTHON is not set: it must name the venv from scripts/py-venv.sh \
         (tests/python-requirements.txt has nbformat)",
    )
}

/// An app connected through OAuth (so its token carries a grant) and an MCP client on it.
async fn connected_app(stack: &Stack, browser: &mut HttpBrowser) -> (String, Client) {
    let client_id = stack.register("Helpdesk Bot", REDIRECT).await["client_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let pkce = Pkce::new();
    let scopes = "sandbox execute files:read files:write";
    let (query, _) = connect(stack, browser, &client_id, &pkce, scopes).await;
    let (_, tokens) = stack
        .exchange(&client_id, &query["code"], &pkce.verifier)
        .await;
    let access = tokens["access_token"].as_str().unwrap().to_owned();
    let client = Client::connect(&stack.gateway.mcp_url(), &access, Era::Stateless)
        .await
        .expect("connects");
    (access, client)
}

const HOSTILE_CELL: &str = "from IPython.display import HTML, display\n\
display(HTML('<img src=x onerror=\"document.title=\\'pwned-display\\'\"><b id=\"injected\">bold</b>'))\n\
print('<script>document.title = \"pwned-print\"</script>')";

/// Plays the conversation of the issue: upload, cells (one failing, one with a chart, one with
/// hostile HTML), a command, a fetch. Returns the chart's path.
async fn play_conversation(client: &Client, conversation: &str) -> String {
    client
        .ok(
            "upload_file",
            json!({"conversation_id": conversation, "path": "orders.csv",
                   "content_text": "region,amount\nnorth,10\nsouth,5\nnorth,7\n"}),
        )
        .await;
    client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation,
                   "code": "import pandas as pd\ndf = pd.read_csv('orders.csv')\nprint(len(df), 'rows')\ndf.groupby('region').amount.sum()"}),
        )
        .await;
    let failed = client
        .call(
            "execute_code",
            json!({"conversation_id": conversation, "code": "int(df.amount.sum()) / 0"}),
        )
        .await
        .expect("a tool result");
    assert!(failed.is_error, "the failing cell is an error");
    let chart = client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation,
                   "code": "import matplotlib.pyplot as plt\ndf.groupby('region').amount.sum().plot.bar()\nplt.show()"}),
        )
        .await;
    let chart_path = chart.structured["images"][0]["path"]
        .as_str()
        .expect("the chart was saved")
        .to_owned();
    client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": HOSTILE_CELL}),
        )
        .await;
    client
        .ok(
            "run_terminal_command",
            json!({"conversation_id": conversation, "command": "ls outputs && wc -l orders.csv"}),
        )
        .await;
    client
        .ok(
            "get_file",
            json!({"conversation_id": conversation, "path": chart_path}),
        )
        .await;
    chart_path
}

async fn export(client: &Client, args: Value) -> ToolResult {
    client.ok("export_transcript", args).await
}

/// Runs `code` in the test venv's Python with `arg`; returns stdout, panicking on failure.
async fn run_python(code: &str, arg: &str) -> String {
    let output = tokio::process::Command::new(python())
        .args(["-c", code, arg])
        .stdin(Stdio::null())
        .output()
        .await
        .expect("the test Python runs");
    assert!(
        output.status.success(),
        "python failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

const VALIDATE: &str = "import json, sys, nbformat\n\
nb = nbformat.read(sys.argv[1], as_version=4)\n\
nbformat.validate(nb)\n\
kinds = [o['output_type'] for c in nb.cells if c.cell_type == 'code' for o in c.outputs]\n\
print(json.dumps({'cells': len(nb.cells), 'outputs': kinds, 'nbformat': nb.nbformat}))";

#[tokio::test]
async fn a_person_takes_over_from_the_transcript() {
    let stack = Stack::start(&[]).await;
    let mut browser = HttpBrowser::new(&stack);
    let (_, client) = connected_app(&stack, &mut browser).await;
    let conversation = "ticket-4711";
    let chart_path = play_conversation(&client, conversation).await;

    // The notebook: a resource link plus a download link, valid nbformat 4 with everything in it.
    let notebook = export(&client, json!({"conversation_id": conversation})).await;
    let out = &notebook.structured;
    assert_eq!(out["format"], "ipynb");
    assert_eq!(
        out["calls"], 7,
        "upload, four cells, a command, a fetch: {out}"
    );
    assert_eq!(out["dropped"], 0);
    let uri = out["uri"].as_str().unwrap();
    assert_eq!(
        uri,
        format!("conversation://{conversation}/transcript.ipynb")
    );
    assert!(
        notebook
            .text
            .contains(out["download_url"].as_str().unwrap())
    );
    let http = reqwest::Client::new();
    let response = http
        .get(out["download_url"].as_str().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        header(response.headers(), "content-type"),
        "application/x-ipynb+json"
    );
    let body = response.text().await.unwrap();
    let path = std::env::temp_dir().join(format!("handoff-{}.ipynb", uuid::Uuid::new_v4()));
    std::fs::write(&path, &body).unwrap();
    let report: Value =
        serde_json::from_str(run_python(VALIDATE, path.to_str().unwrap()).await.trim()).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(report["nbformat"], 4);
    let kinds: Vec<&str> = report["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    for kind in ["stream", "execute_result", "error", "display_data"] {
        assert!(
            kinds.contains(&kind),
            "the notebook has {kind} outputs: {kinds:?}"
        );
    }
    let nb: Value = serde_json::from_str(&body).unwrap();
    let cells = nb["cells"].as_array().unwrap();
    let sources: Vec<&str> = cells.iter().filter_map(|c| c["source"].as_str()).collect();
    assert!(
        sources
            .iter()
            .any(|s| s.contains("pd.read_csv('orders.csv')"))
    );
    assert!(sources.iter().any(|s| s.starts_with("%%bash\nls outputs")));
    assert!(
        sources
            .iter()
            .any(|s| s.contains("Uploaded `/home/user/orders.csv`"))
    );
    assert!(
        sources
            .iter()
            .any(|s| s.contains(&format!("Fetched `{chart_path}`")))
    );
    let chart = cells
        .iter()
        .flat_map(|c| c["outputs"].as_array().into_iter().flatten())
        .find_map(|o| o["data"]["image/png"].as_str())
        .expect("the chart is embedded");
    use base64::Engine;
    let png = base64::engine::general_purpose::STANDARD
        .decode(chart)
        .unwrap();
    assert!(png.starts_with(b"\x89PNG"), "an embedded PNG");
    let error = cells
        .iter()
        .flat_map(|c| c["outputs"].as_array().into_iter().flatten())
        .find(|o| o["output_type"] == "error")
        .unwrap();
    assert_eq!(error["ename"], "ZeroDivisionError");

    // The HTML page: served sandboxed, and in a real browser it shows the conversation and runs
    // nothing of what the sandbox printed.
    let page = export(
        &client,
        json!({"conversation_id": conversation, "format": "html"}),
    )
    .await;
    let html_url = page.structured["download_url"].as_str().unwrap().to_owned();
    let response = http.get(&html_url).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let csp = header(response.headers(), "content-security-policy");
    assert!(
        csp.starts_with("sandbox;"),
        "served as a sandboxed document: {csp}"
    );
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(!csp.contains("allow-scripts"), "{csp}");
    assert_eq!(
        header(response.headers(), "x-content-type-options"),
        "nosniff"
    );
    let body = response.text().await.unwrap();
    assert!(
        !body.to_lowercase().contains("<script"),
        "no script element in the page"
    );
    let chromium = crate::webdriver::Browser::start().await;
    chromium.goto(&html_url).await;
    let text = chromium.text("body").await;
    for expected in [
        "pd.read_csv('orders.csv')",
        "3 rows",
        "ZeroDivisionError",
        "ls outputs && wc -l orders.csv",
        "/home/user/orders.csv",
        "<script>document.title = \"pwned-print\"</script>",
    ] {
        assert!(
            text.contains(expected),
            "the page shows {expected:?}:\n{text}"
        );
    }
    chromium.find("img[alt=chart]").await;
    let title = chromium.title().await;
    assert!(
        title.starts_with("Conversation ticket-4711"),
        "no output ran and changed the title: {title:?}"
    );
    let png = chromium.screenshot().await;
    std::fs::write(
        crate::webdriver::artifacts_dir().join("handoff-transcript.png"),
        png,
    )
    .unwrap();
    chromium.quit().await;

    // The logged-in user's page finds it by conversation id, without the bot.
    let found = browser
        .get(&stack.url(&format!("/transcripts?conversation_id={conversation}")))
        .await;
    assert_eq!(found.status, StatusCode::OK);
    assert!(found.body.contains("id=\"found\""), "{}", found.body);
    let other = browser
        .get(&stack.url("/transcripts?conversation_id=someone-elses"))
        .await;
    assert!(other.body.contains("id=\"not-found\""), "{}", other.body);
    let anonymous = HttpBrowser::new(&stack)
        .get(&stack.url(&format!("/transcripts?conversation_id={conversation}")))
        .await;
    assert_eq!(
        anonymous.status,
        StatusCode::SEE_OTHER,
        "logged-out users log in first"
    );

    // Disconnecting the app ends the links it made.
    let apps = browser.get(&stack.url("/apps")).await;
    let grant = hidden(&apps.body, "grant_id").unwrap();
    let csrf = hidden(&apps.body, "csrf").unwrap();
    let done = browser
        .post(
            &stack.url("/apps/disconnect"),
            &[("csrf", &csrf), ("grant_id", &grant)],
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);
    let response = http.get(&html_url).send().await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::GONE,
        "the link died with its connection"
    );
    let response = http
        .get(notebook.structured["download_url"].as_str().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::GONE);
    // The transcript itself outlives the sandbox (closed by the disconnect): the page still has it.
    let found = browser
        .get(&stack.url(&format!("/transcripts?conversation_id={conversation}")))
        .await;
    assert!(found.body.contains("id=\"found\""), "{}", found.body);
}

#[tokio::test]
async fn another_tenant_gets_nothing_of_a_transcript() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[]).await;
    let (a, b) = (gateway.create_tenant().await, gateway.create_tenant().await);
    let alice = Client::connect(&gateway.mcp_url(), &gateway.token(&a).await, Era::Stateless)
        .await
        .unwrap();
    let mallory = Client::connect(&gateway.mcp_url(), &gateway.token(&b).await, Era::Stateless)
        .await
        .unwrap();
    let ran = alice
        .ok(
            "execute_code",
            json!({"conversation_id": "shared-name", "code": "secret = 'alice-only'; secret"}),
        )
        .await;
    let sandbox = ran.structured["sandbox_id"].as_str().unwrap().to_owned();
    let own = export(&alice, json!({"sandbox_id": sandbox})).await;
    assert_eq!(own.structured["calls"], 1);

    // The same conversation name and the real sandbox id from another tenant: exactly like a
    // sandbox that does not exist.
    let theirs = mallory
        .call("export_transcript", json!({"sandbox_id": sandbox}))
        .await
        .unwrap();
    let missing = mallory
        .call(
            "export_transcript",
            json!({"sandbox_id": "sbx_doesnotexist"}),
        )
        .await
        .unwrap();
    assert!(theirs.is_error && missing.is_error);
    assert_eq!(
        theirs.text.replace(&sandbox, "ID"),
        missing.text.replace("sbx_doesnotexist", "ID")
    );
    assert!(!theirs.text.contains("alice-only"));
    let by_name = mallory
        .call(
            "export_transcript",
            json!({"conversation_id": "shared-name"}),
        )
        .await
        .unwrap();
    assert!(by_name.is_error, "{}", by_name.text);
    for (uri, missing) in [
        (
            format!("sandbox://{sandbox}/transcript.ipynb"),
            "sandbox://sbx_doesnotexist/transcript.ipynb".to_owned(),
        ),
        (
            format!("sandbox://{sandbox}/files/.bashrc"),
            "sandbox://sbx_doesnotexist/files/.bashrc".to_owned(),
        ),
    ] {
        let read = |uri: String| async {
            mallory
                .service
                .read_resource(rmcp::model::ReadResourceRequestParams::new(uri))
                .await
                .expect_err("not found")
                .to_string()
        };
        let (theirs, none) = (read(uri.clone()).await, read(missing).await);
        assert_eq!(
            theirs.replace(&sandbox, "ID"),
            none.replace("sbx_doesnotexist", "ID"),
            "another tenant's {uri} reads like a missing one"
        );
        assert!(!theirs.contains("alice-only"));
    }
    let err = mallory
        .service
        .read_resource(rmcp::model::ReadResourceRequestParams::new(
            "conversation://shared-name/transcript.html",
        ))
        .await
        .expect_err("not found");
    assert!(err.to_string().contains("no transcript"), "{err}");
    // A tampered link (another tenant's id swapped in) is refused.
    let url = own.structured["download_url"].as_str().unwrap();
    let tampered = format!("{}x", url);
    let response = reqwest::get(&tampered).await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn files_and_transcripts_are_resources_and_big_files_come_as_links() {
    let database = support::fresh_database().await;
    let gateway =
        Gateway::start(&database, &[("SANDGATE_LIMITS__INLINE_FILE_BYTES", "1000")]).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Sessions)
        .await
        .unwrap();
    // The session's sandbox (no conversation_id: the MCP session is the conversation).
    let made = client
        .ok(
            "execute_code",
            json!({"code": "import os\nos.makedirs('many', exist_ok=True)\n\
                   [open(f'many/f{i:03}.txt', 'w').write(str(i)) for i in range(60)]\n\
                   open('big.bin', 'wb').write(bytes(range(256)) * 20)\nNone"}),
        )
        .await;
    let sandbox = made.structured["sandbox_id"].as_str().unwrap().to_owned();

    // get_file over the inline limit: a resource link and the download link, no base64.
    let big = client.ok("get_file", json!({"path": "big.bin"})).await;
    assert!(
        big.blobs.is_empty() && big.images.is_empty(),
        "nothing inlined"
    );
    assert!(big.text.contains("resources/read"), "{}", big.text);
    let raw = client
        .service
        .call_tool(
            rmcp::model::CallToolRequestParams::new("get_file")
                .with_arguments(json!({"path": "big.bin"}).as_object().unwrap().clone()),
        )
        .await
        .unwrap();
    let link = raw
        .content
        .iter()
        .find_map(|c| c.as_resource_link())
        .expect("a resource_link");
    assert_eq!(link.uri, format!("sandbox://{sandbox}/files/big.bin"));
    assert_eq!(link.size, Some(5120));

    // resources/read: binary as a blob, text as text.
    let read = client
        .service
        .read_resource(rmcp::model::ReadResourceRequestParams::new(
            link.uri.clone(),
        ))
        .await
        .unwrap();
    match &read.contents[0] {
        rmcp::model::ResourceContents::BlobResourceContents { blob, .. } => {
            use base64::Engine;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(blob)
                .unwrap();
            assert_eq!(bytes.len(), 5120);
            assert_eq!(&bytes[..4], &[0, 1, 2, 3]);
        }
        other => panic!("a blob: {other:?}"),
    }
    let text = client
        .service
        .read_resource(rmcp::model::ReadResourceRequestParams::new(format!(
            "sandbox://{sandbox}/files/many/f007.txt"
        )))
        .await
        .unwrap();
    match &text.contents[0] {
        rmcp::model::ResourceContents::TextResourceContents { text, .. } => assert_eq!(text, "7"),
        other => panic!("text: {other:?}"),
    }
    let escape = client
        .service
        .read_resource(rmcp::model::ReadResourceRequestParams::new(format!(
            "sandbox://{sandbox}/files/..%2F..%2Fetc%2Fpasswd"
        )))
        .await;
    assert!(escape.is_err(), "paths outside /home/user are refused");

    // Without ids, the session's sandbox is exported; the session id shows nowhere.
    let exported = export(&client, json!({})).await;
    assert_eq!(
        exported.structured["uri"],
        format!("sandbox://{sandbox}/transcript.ipynb")
    );
    assert_eq!(exported.structured["conversation_id"], Value::Null);
    assert!(!exported.text.contains("mcp-session"), "{}", exported.text);

    // resources/list: the data policy and the session's sandbox, over several pages.
    let listed = client.service.list_all_resources().await.unwrap();
    let uris: Vec<&str> = listed.iter().map(|r| r.uri.as_str()).collect();
    assert_eq!(uris[0], "sandgate://data-policy");
    assert!(uris.contains(&format!("sandbox://{sandbox}/transcript.ipynb").as_str()));
    assert!(uris.contains(&format!("sandbox://{sandbox}/files/many/f059.txt").as_str()));
    assert!(listed.len() > 60, "more than one page: {}", listed.len());
    let first = client.service.list_resources(None).await.unwrap();
    assert!(first.next_cursor.is_some(), "paginated");
    assert_eq!(first.cache_scope, Some(rmcp::model::CacheScope::Private));
    let templates = client.service.list_all_resource_templates().await.unwrap();
    let names: Vec<&str> = templates.iter().map(|t| t.uri_template.as_str()).collect();
    assert!(names.contains(&"sandbox://{sandbox_id}/files/{path}"));
    assert!(names.contains(&"sandbox://{sandbox_id}/transcript.ipynb"));

    // Another conversation (session) of the same tenant does not see this sandbox's files.
    let other = Client::connect(&gateway.mcp_url(), &token, Era::Sessions)
        .await
        .unwrap();
    other.ok("execute_code", json!({"code": "1"})).await;
    let theirs = other.service.list_all_resources().await.unwrap();
    assert!(
        theirs.iter().all(|r| !r.uri.contains(&sandbox)),
        "another session's list names nothing of this sandbox: {theirs:?}"
    );
    // The stateless era has no current conversation: nothing but the policy.
    let stateless = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .unwrap();
    let listed = stateless.service.list_all_resources().await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let transcript = stateless
        .service
        .read_resource(rmcp::model::ReadResourceRequestParams::new(format!(
            "sandbox://{sandbox}/transcript.ipynb"
        )))
        .await
        .unwrap();
    match &transcript.contents[0] {
        rmcp::model::ResourceContents::TextResourceContents {
            text, mime_type, ..
        } => {
            assert_eq!(mime_type.as_deref(), Some("application/x-ipynb+json"));
            let nb: Value = serde_json::from_str(text).unwrap();
            assert_eq!(nb["nbformat"], 4);
        }
        other => panic!("text: {other:?}"),
    }
    assert_eq!(transcript.ttl_ms, Some(0));
}

/// Every row of every table in the public schema whose text holds `needle`.
async fn rows_holding(database_url: &str, needle: &str) -> Vec<String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(database_url).await.unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' AND table_type = 'BASE TABLE'",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mut hits = Vec::new();
    for table in tables {
        let found: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT row_to_json(t)::text FROM \"{table}\" t WHERE row_to_json(t)::text LIKE '%' || $1 || '%'"
        )))
        .bind(needle)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        hits.extend(found.into_iter().map(|row| format!("{table}: {row}")));
    }
    hits
}

#[tokio::test]
async fn retention_purges_transcripts_and_files_and_purge_removes_a_tenant_now() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_RETENTION__PURGE_INTERVAL_SECONDS", "1"),
            ("SANDGATE_RETENTION__AUDIT_SECONDS", "86400"),
        ],
    )
    .await;
    let (short, long) = (gateway.create_tenant().await, gateway.create_tenant().await);
    let set = gateway
        .cli(&[
            "admin",
            "tenant",
            "retention",
            &short,
            "--transcripts",
            "1s",
        ])
        .await;
    assert!(set.contains("1s"), "{set}");
    let marker = |who: &str| format!("marker-{who}-{}", uuid::Uuid::new_v4().simple());
    let (short_marker, long_marker) = (marker("short"), marker("long"));
    let mut sandboxes = Vec::new();
    for (tenant, secret) in [(&short, &short_marker), (&long, &long_marker)] {
        let client = Client::connect(
            &gateway.mcp_url(),
            &gateway.token(tenant).await,
            Era::Stateless,
        )
        .await
        .unwrap();
        client
            .ok(
                "upload_file",
                json!({"conversation_id": "c", "path": "secret.txt", "content_text": secret}),
            )
            .await;
        let ran = client
            .ok(
                "execute_code",
                json!({"conversation_id": "c", "code": format!("print('{secret}')")}),
            )
            .await;
        let sandbox = ran.structured["sandbox_id"].as_str().unwrap().to_owned();
        // Written behind the answer, within milliseconds.
        eventually(
            Duration::from_secs(30),
            "the transcript to hold the cell",
            || async {
                (!rows_holding(&gateway.database_url, secret).await.is_empty()).then_some(())
            },
        )
        .await;
        client
            .ok("close_sandbox", json!({"sandbox_id": sandbox}))
            .await;
        sandboxes.push((client, sandbox));
    }

    // The short-retention tenant's transcript goes after its second; its files went with the
    // container at close. Nothing of the content is left in Postgres.
    let (short_client, _) = &sandboxes[0];
    eventually(
        Duration::from_secs(30),
        "the transcript to be purged",
        || async {
            let r = short_client
                .call("export_transcript", json!({"conversation_id": "c"}))
                .await
                .ok()?;
            r.is_error.then_some(())
        },
    )
    .await;
    assert_eq!(
        rows_holding(&gateway.database_url, &short_marker).await,
        Vec::<String>::new()
    );
    eventually(
        Duration::from_secs(30),
        "the closed sandboxes' containers to be gone",
        || async {
            // Both sandboxes were closed; the pool's warm containers may remain.
            let live = support::containers_of(&gateway.instance);
            let used = sandboxes_containers(&gateway.database_url).await;
            used.iter().all(|c| !live.contains(c)).then_some(())
        },
    )
    .await;

    // The audit trail is kept a day here: a tool call and a download-link opening of two days
    // ago go, today's calls stay.
    let db = &gateway.database_url;
    let mut conn = sqlx::PgConnection::connect(db).await.expect("db");
    sqlx::query(
        "INSERT INTO audit_events (at, tenant_id, tool, outcome, duration_ms)
         VALUES (now() - interval '2 days', $1::uuid, 'execute_code', 'ok', 1)",
    )
    .bind(&long)
    .execute(&mut conn)
    .await
    .expect("an old audit event");
    sqlx::query(
        "INSERT INTO download_events (at, tenant_id, link_id, kind, outcome)
         VALUES (now() - interval '2 days', $1::uuid, 'old-link', 'file', 'ok')",
    )
    .bind(&long)
    .execute(&mut conn)
    .await
    .expect("an old download event");
    let count = |sql: &'static str| {
        let long = long.clone();
        async move {
            let mut conn = sqlx::PgConnection::connect(db).await.expect("db");
            sqlx::query_scalar::<_, i64>(sql)
                .bind(&long)
                .fetch_one(&mut conn)
                .await
                .expect("a count")
        }
    };
    eventually(
        Duration::from_secs(30),
        "the old audit events to be purged",
        || async {
            let old = count(
                "SELECT (SELECT count(*) FROM audit_events WHERE tenant_id = $1::uuid
                       AND at < now() - interval '1 day')
                  + (SELECT count(*) FROM download_events WHERE tenant_id = $1::uuid)",
            )
            .await;
            (old == 0).then_some(())
        },
    )
    .await;
    // The three calls of today (upload, cell, close) stay; they are written in batches behind
    // the answers, so they may still be on their way.
    eventually(
        Duration::from_secs(30),
        "today's calls in the audit trail",
        || async {
            let today = count("SELECT count(*) FROM audit_events WHERE tenant_id = $1::uuid").await;
            (today >= 3).then_some(())
        },
    )
    .await;

    // The default (30 days) keeps the other tenant's transcript after its sandbox ended...
    let (long_client, _) = &sandboxes[1];
    let kept = export(long_client, json!({"conversation_id": "c"})).await;
    assert_eq!(kept.structured["calls"], 2);
    // ...until an operator purges the tenant: now, with its live sandboxes.
    let live = long_client
        .ok(
            "execute_code",
            json!({"conversation_id": "d", "code": format!("x = '{long_marker}'")}),
        )
        .await;
    let live_sandbox = live.structured["sandbox_id"].as_str().unwrap().to_owned();
    // Its transcript is written behind the answer; the purge below is to count it.
    eventually(
        Duration::from_secs(30),
        "the live sandbox's transcript",
        || {
            let (database, id) = (gateway.database_url.clone(), live_sandbox.clone());
            async move {
                use sqlx::Connection;
                let mut conn = sqlx::PgConnection::connect(&database).await.ok()?;
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM transcript_entries WHERE sandbox_id = $1",
                )
                .bind(&id)
                .fetch_one(&mut conn)
                .await
                .ok()?;
                (n > 0).then_some(())
            }
        },
    )
    .await;
    let purged = gateway.cli(&["admin", "tenant", "purge", &long]).await;
    assert!(
        purged.contains("closed 1 live sandboxes, deleted 2 transcripts"),
        "{purged}"
    );
    assert_eq!(
        rows_holding(&gateway.database_url, &long_marker).await,
        Vec::<String>::new()
    );
    let after = long_client
        .call(
            "execute_code",
            json!({"sandbox_id": live_sandbox, "code": "x"}),
        )
        .await
        .unwrap();
    assert!(after.is_error, "the purged sandbox is gone: {}", after.text);
    let gone = long_client
        .call("export_transcript", json!({"conversation_id": "c"}))
        .await
        .unwrap();
    assert!(gone.is_error);
    let unknown = gateway
        .cli_fails(&[
            "admin",
            "tenant",
            "purge",
            &uuid::Uuid::new_v4().to_string(),
        ])
        .await;
    assert!(unknown.contains("no tenant with id"), "{unknown}");
}

async fn sandboxes_containers(database_url: &str) -> Vec<String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(database_url).await.unwrap();
    sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE state = 'closed'")
        .fetch_all(&mut conn)
        .await
        .unwrap()
}

/// The MCP conformance suite's 2026-07-28 `caching` scenario (scripts/mcp-conformance.sh
/// installs Node 22 and the suite under the cache dir on first use): every resource check must
/// pass. `prompts/list` is reported beside them: sandgate offers no prompts, so it answers
/// "method not found" there, which the scenario counts against it.
#[tokio::test]
async fn the_conformance_suites_caching_scenario_passes_its_resource_checks() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[]).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/mcp-conformance.sh"
    );
    let output = tokio::process::Command::new(script)
        .args([gateway.mcp_url().as_str(), token.as_str(), "caching"])
        .stdin(Stdio::null())
        .output()
        .await
        .expect("scripts/mcp-conformance.sh runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the suite ran:\n{stdout}\n{stderr}"
    );
    let path = stdout.lines().last().expect("the checks' path");
    let checks: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).expect("checks.json")).unwrap();
    let _ = std::fs::remove_file(path);
    let status = |id: &str| {
        checks
            .iter()
            .find(|c| c["id"] == id)
            .map(|c| c["status"].as_str().unwrap_or_default().to_owned())
            .unwrap_or_else(|| panic!("the scenario has check {id}: {checks:?}"))
    };
    for id in [
        "sep-2549-tools-list-caching-hints",
        "sep-2549-resources-list-caching-hints",
        "sep-2549-resources-templates-list-caching-hints",
        "sep-2549-resources-read-caching-hints",
        "sep-2549-ttl-non-negative",
        "sep-2549-cache-scope-valid",
        "wire-schema-valid",
    ] {
        assert_eq!(status(id), "SUCCESS", "{id}:\n{stderr}");
    }
}
