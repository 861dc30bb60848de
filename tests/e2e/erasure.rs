//! The delete commands (`sandgate admin tenant|user|client delete`) against the real stack: a
//! deleted tenant's token is refused at once by the running gateway, its sandbox containers
//! are gone, and no row of its id is left in any table with a `tenant_id` (read from
//! information_schema, so a table added later is checked too); another tenant is untouched.
//! A deleted user is signed out at once; a deleted client's tokens are refused at once.

use reqwest::StatusCode;
use serde_json::json;
use sqlx::Connection;

use crate::mcp_client::{Client, Era};
use crate::support::oauth::{Browser, PASSWORD, Stack};
use crate::support::{self, Gateway, container_exists};

/// Rows under `tenant` in every base table with a `tenant_id` column (and the tenant's own
/// row), as (table, count) for the tables that have any.
async fn rows_of(database: &str, tenant: &str) -> Vec<(String, i64)> {
    let mut conn = sqlx::PgConnection::connect(database)
        .await
        .expect("the test database");
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT c.table_name::text FROM information_schema.columns c
           JOIN information_schema.tables t
             ON t.table_schema = c.table_schema AND t.table_name = c.table_name
          WHERE c.table_schema = current_schema() AND c.column_name = 'tenant_id'
            AND t.table_type = 'BASE TABLE'",
    )
    .fetch_all(&mut conn)
    .await
    .expect("the catalog answers");
    assert!(
        tables.len() >= 10,
        "the catalog lists the tables with a tenant_id: {tables:?}"
    );
    let id: uuid::Uuid = tenant.parse().expect("a tenant id");
    let mut found = Vec::new();
    for table in tables.iter().map(String::as_str).chain(["tenants"]) {
        let column = if table == "tenants" {
            "id"
        } else {
            "tenant_id"
        };
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{table}\" WHERE {column} = $1"
        )))
        .bind(id)
        .fetch_one(&mut conn)
        .await
        .expect("the count");
        if n > 0 {
            found.push((table.to_owned(), n));
        }
    }
    found
}

async fn containers_of_tenant(database: &str, tenant: &str) -> Vec<String> {
    let mut conn = sqlx::PgConnection::connect(database)
        .await
        .expect("the test database");
    sqlx::query_scalar(
        "SELECT container_id FROM sandboxes WHERE tenant_id = $1 AND container_id IS NOT NULL",
    )
    .bind(tenant.parse::<uuid::Uuid>().expect("a tenant id"))
    .fetch_all(&mut conn)
    .await
    .expect("the tenant's containers")
}

async fn mcp_status(gateway: &Gateway, token: &str) -> StatusCode {
    reqwest::Client::new()
        .post(gateway.mcp_url())
        .bearer_auth(token)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", "tools/list")
        .json(
            &json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {
            "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                      "io.modelcontextprotocol/clientCapabilities": {}}}}),
        )
        .send()
        .await
        .expect("/mcp answers")
        .status()
}

#[tokio::test]
async fn deleting_a_tenant_refuses_its_token_removes_its_containers_and_leaves_no_row_of_its_id() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(&database, &[("SANDGATE_POOL__MIN_READY", "1")]).await;
    let doomed = gateway.create_tenant().await;
    let other = gateway.create_tenant().await;
    let doomed_token = gateway.token(&doomed).await;
    let other_token = gateway.token(&other).await;
    // Something under the tenant in many tables: a user, a client (and its grant), a package
    // policy, limits, a sandbox with a transcript and audit events.
    gateway
        .cli_stdin(
            &[
                "admin",
                "user",
                "create",
                "--tenant",
                &doomed,
                "--email",
                &format!("del-{}@example.com", &doomed[..8]),
            ],
            &format!("{PASSWORD}\n"),
        )
        .await;
    gateway
        .cli(&[
            "admin", "client", "create", "--tenant", &doomed, "--name", "Reports",
        ])
        .await;
    gateway
        .cli(&["admin", "tenant", "packages", &doomed, "--deny", "numpy"])
        .await;
    gateway
        .cli(&["admin", "tenant", "limits", &doomed, "--max-sandboxes", "3"])
        .await;
    let doomed_client = Client::connect(&gateway.mcp_url(), &doomed_token, Era::Stateless)
        .await
        .expect("the tenant's client connects");
    let other_client = Client::connect(&gateway.mcp_url(), &other_token, Era::Stateless)
        .await
        .expect("the other tenant's client connects");
    for (client, conversation) in [(&doomed_client, "doomed-1"), (&other_client, "kept-1")] {
        let done = client
            .ok(
                "execute_code",
                json!({"conversation_id": conversation, "code": "x = 41\nx + 1"}),
            )
            .await;
        assert!(done.text.contains("42"), "the cell ran: {}", done.text);
    }
    let containers = containers_of_tenant(&database, &doomed).await;
    assert!(!containers.is_empty(), "the tenant has a sandbox container");
    assert!(containers.iter().all(|c| container_exists(c)));
    let before = rows_of(&database, &doomed).await;
    for table in [
        "sandboxes",
        "users",
        "oauth_clients",
        "grants",
        "admin_tokens",
    ] {
        assert!(
            before.iter().any(|(t, _)| t == table),
            "the tenant has rows in {table} before: {before:?}"
        );
    }
    assert_eq!(
        mcp_status(&gateway, &doomed_token).await,
        StatusCode::OK,
        "the token works before"
    );

    // Not without confirmation, and not for an unknown id.
    let refused = gateway
        .cli_fails(&["admin", "tenant", "delete", &doomed])
        .await;
    assert!(refused.contains("--yes"), "asks for --yes: {refused}");
    assert!(
        !rows_of(&database, &doomed).await.is_empty(),
        "nothing deleted without --yes"
    );
    let unknown = uuid::Uuid::new_v4().to_string();
    let refused = gateway
        .cli_fails(&["admin", "tenant", "delete", &unknown, "--yes"])
        .await;
    assert!(
        refused.contains(&format!("no tenant with id {unknown}")),
        "names the unknown id: {refused}"
    );

    let deleted = gateway
        .cli(&["admin", "tenant", "delete", &doomed, "--yes"])
        .await;
    assert!(
        deleted.contains(&format!("deleted tenant {doomed}")),
        "{deleted}"
    );

    // The running gateway refuses the token at once (no wait for a cache to expire).
    assert_eq!(
        mcp_status(&gateway, &doomed_token).await,
        StatusCode::UNAUTHORIZED,
        "the deleted tenant's token is refused: {deleted}"
    );
    for container in &containers {
        assert!(
            !container_exists(container),
            "container {container} of the deleted tenant is gone: {deleted}"
        );
    }
    let after = rows_of(&database, &doomed).await;
    assert!(
        after.is_empty(),
        "no row of the deleted tenant's id is left: {after:?} ({deleted})"
    );
    let mut conn = sqlx::PgConnection::connect(&database)
        .await
        .expect("the test database");
    let recorded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM admin_events WHERE command = 'tenant delete' AND target = $1",
    )
    .bind(&doomed)
    .fetch_one(&mut conn)
    .await
    .expect("the admin trail");
    assert_eq!(recorded, 1, "the deletion is recorded once");

    // The other tenant is untouched: its sandbox kept its variable.
    let kept = other_client
        .ok(
            "execute_code",
            json!({"conversation_id": "kept-1", "code": "x"}),
        )
        .await;
    assert!(
        kept.text.contains("41"),
        "the other tenant's sandbox lives on: {}",
        kept.text
    );
    assert!(
        !rows_of(&database, &other).await.is_empty(),
        "the other tenant's rows stay"
    );
    support::remove_containers_of(&gateway.instance);
}

#[tokio::test]
async fn deleting_a_user_signs_it_out_at_once_and_deleting_a_client_refuses_its_tokens() {
    let stack = Stack::start(&[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let gateway = &stack.gateway;

    // A signed-in user.
    let mut browser = Browser::new(&stack);
    let start = browser.get(&stack.url("/apps")).await;
    let login = start
        .location
        .clone()
        .expect("/apps sends to the login page");
    browser.log_in(&login, &stack.email, PASSWORD).await;
    let apps = browser.get(&stack.url("/apps")).await;
    assert_eq!(apps.status, StatusCode::OK, "signed in: {}", apps.body);
    let mut conn = sqlx::PgConnection::connect(&gateway.database_url)
        .await
        .expect("the test database");
    let user: uuid::Uuid = sqlx::query_scalar("SELECT id FROM users WHERE email = $1")
        .bind(&stack.email)
        .fetch_one(&mut conn)
        .await
        .expect("the user's id");
    let user = user.to_string();
    let refused = gateway.cli_fails(&["admin", "user", "delete", &user]).await;
    assert!(refused.contains("--yes"), "{refused}");
    let unknown = uuid::Uuid::new_v4().to_string();
    let refused = gateway
        .cli_fails(&["admin", "user", "delete", &unknown, "--yes"])
        .await;
    assert!(
        refused.contains(&format!("no user with id {unknown}")),
        "{refused}"
    );
    let deleted = gateway
        .cli(&["admin", "user", "delete", &user, "--yes"])
        .await;
    assert!(deleted.contains("ended 1 session"), "{deleted}");
    let out = browser.get(&stack.url("/apps")).await;
    assert_eq!(
        out.status,
        StatusCode::SEE_OTHER,
        "the deleted user's session no longer works: {}",
        out.body
    );

    // A client with a client-credentials token in use.
    let created = gateway
        .cli(&[
            "admin",
            "client",
            "create",
            "--tenant",
            &stack.tenant,
            "--name",
            "Nightly",
        ])
        .await;
    let field = |k: &str| {
        created
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} printed: {created}"))
            .to_owned()
    };
    let (id, secret) = (field("client_id"), field("client_secret"));
    let tokens: serde_json::Value = stack
        .http
        .post(stack.url("/oauth/token"))
        .basic_auth(&id, Some(&secret))
        .form(&[("grant_type", "client_credentials")])
        .send()
        .await
        .expect("the token endpoint answers")
        .json()
        .await
        .expect("a token response");
    let access = tokens["access_token"].as_str().expect("a token").to_owned();
    assert_eq!(mcp_status(gateway, &access).await, StatusCode::OK);
    let refused = gateway
        .cli_fails(&["admin", "client", "delete", "sgcl_nosuchclient", "--yes"])
        .await;
    assert!(refused.contains("no OAuth client"), "{refused}");
    let deleted = gateway
        .cli(&["admin", "client", "delete", &id, "--yes"])
        .await;
    assert!(deleted.contains("1 app connection"), "{deleted}");
    assert_eq!(
        mcp_status(gateway, &access).await,
        StatusCode::UNAUTHORIZED,
        "the deleted client's token is refused at once"
    );
    let again = stack
        .http
        .post(stack.url("/oauth/token"))
        .basic_auth(&id, Some(&secret))
        .form(&[("grant_type", "client_credentials")])
        .send()
        .await
        .expect("the token endpoint answers");
    assert_eq!(
        again.status(),
        StatusCode::UNAUTHORIZED,
        "the deleted client gets no new token"
    );
    let trail: Vec<String> = sqlx::query_scalar("SELECT command FROM admin_events ORDER BY id")
        .fetch_all(&mut conn)
        .await
        .expect("the admin trail");
    assert_eq!(trail, ["user delete", "client delete"], "both recorded");
}
