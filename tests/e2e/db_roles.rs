//! Database roles per process kind (issue 25) and a node with least privilege (issue 24, hole
//! 7): on a Postgres of the test's own (TLS only, `verify-full` everywhere), the deployment's
//! `deploy/postgres/roles.sql` makes the roles, `sandgate migrate` runs as the migrator, a
//! `sandgate node` runs as the node role with no signing key and no secret in its environment
//! (and a configuration that is not loopback), a gateway replica as the gateway role, and a
//! cell runs through both. The node's role then plays a node taken over by an attacker: it
//! cannot read `signing_keys` nor create tables.

use std::time::Duration;

use sandgate_node::test_pki::Pki;
use serde_json::json;
use sqlx::Connection;

use crate::mcp_client::{Client, Era};
use crate::support::node::{NodeStart, TlsFiles};
use crate::support::own_postgres::{
    GATEWAY, MIGRATOR, NODE, OwnPostgres, PASSWORD, SUPERUSER, make_roles,
};
use crate::support::{self, Gateway, eventually, sandgate_command};

/// The SQLSTATE of what `sql` fails with as `conn`'s role (it must fail).
async fn refusal(conn: &mut sqlx::PgConnection, sql: &str) -> String {
    let err = sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut *conn)
        .await
        .expect_err(sql);
    err.as_database_error()
        .and_then(|e| e.code().map(|c| c.into_owned()))
        .unwrap_or_else(|| panic!("{sql}: not a database error: {err}"))
}

#[tokio::test]
async fn a_node_role_serves_sandboxes_but_cannot_read_signing_keys_nor_create_tables() {
    let server = OwnPostgres::with_roles(&Pki::new("postgres CA")).await;
    let url = |role| server.role_url(role);
    // Idempotent: an operator runs it again to change a password.
    make_roles(&url((SUPERUSER, PASSWORD)));

    let instance = format!(
        "e2e-roles-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let tls = TlsFiles::new(&instance);
    // A node's environment: its role's URL, no keys.secret, no cookie secret, and a public
    // URL and listen address a gateway would need both secrets for.
    let node_start = NodeStart::new(&url(NODE), &instance)
        .without_migrating()
        .tls(&tls)
        .env([
            ("SANDGATE_PUBLIC_URL", "https://mcp.example.test"),
            ("SANDGATE_LISTEN", "0.0.0.0:8080"),
            ("SANDGATE_POOL__MIN_READY", "1"),
        ]);
    let Err(refused) = node_start.clone().try_start().await else {
        panic!("a node must refuse a database that was never migrated");
    };
    assert!(
        refused.contains("sandgate migrate"),
        "the node says to run `sandgate migrate`: {refused}"
    );

    let migrated = sandgate_command()
        .arg("migrate")
        .env("SANDGATE_DATABASE__URL", url(MIGRATOR))
        .env_remove("DATABASE_URL")
        .output()
        .await
        .expect("the binary runs");
    assert!(
        migrated.status.success(),
        "sandgate migrate as the migrator role: {}",
        String::from_utf8_lossy(&migrated.stderr)
    );

    let node = node_start.start().await;
    let gateway_url = url(GATEWAY);
    let mut gateway_env: Vec<(&str, &str)> = vec![
        ("SANDGATE_DATABASE__AUTO_MIGRATE", "false"),
        (
            "SANDGATE_KEYS__SECRET",
            "a keys secret of the roles test, 32+ chars",
        ),
    ];
    let tls_env = tls.env();
    gateway_env.extend(tls_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let gateway = Gateway::start_gateway_only(&gateway_url, &instance, &gateway_env).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("an MCP client");
    let answer = client.ok("execute_code", json!({"code": "1 + 1"})).await;
    assert!(
        answer.text.contains('2'),
        "the cell runs on the node through the gateway: {}",
        answer.text
    );

    // The node wrote its rows as its role: its registration, heartbeats and warm sandboxes.
    let warm: i64 = eventually(Duration::from_secs(120), "a warm row of the node", || {
        let admin_url = server.socket_url("sandgate");
        let id = node.id().to_owned();
        async move {
            let mut conn = sqlx::PgConnection::connect(&admin_url).await.ok()?;
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM sandboxes WHERE node = $1 AND state = 'warm'",
            )
            .bind(id)
            .fetch_one(&mut conn)
            .await
            .ok()?;
            (n > 0).then_some(n)
        }
    })
    .await;
    assert!(warm > 0);
    let denied: Vec<String> = node
        .warnings()
        .into_iter()
        .filter(|w| w.contains("permission denied"))
        .collect();
    assert!(
        denied.is_empty(),
        "the node's role has what the node needs: {denied:?}"
    );

    // The gateway made a signing key; the node's role cannot read it, nor make any table.
    let mut admin = sqlx::PgConnection::connect(&server.socket_url("sandgate"))
        .await
        .expect("the superuser connects");
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM signing_keys")
        .fetch_one(&mut admin)
        .await
        .expect("signing keys");
    assert!(keys > 0, "the gateway's role made a signing key");
    let mut as_node = sqlx::PgConnection::connect(&url(NODE))
        .await
        .expect("the node role connects over verify-full TLS");
    for sql in [
        "SELECT * FROM signing_keys",
        "SELECT * FROM grants",
        "SELECT * FROM tenants",
        "SELECT * FROM transcript_entries",
        "CREATE TABLE stolen (seed bytea)",
        "CREATE TEMPORARY TABLE stolen (seed bytea)",
        "INSERT INTO _sqlx_migrations (version, description, installed_on, success, checksum, \
         execution_time) VALUES (1, 'x', now(), true, '', 0)",
    ] {
        assert_eq!(
            refusal(&mut as_node, sql).await,
            "42501",
            "the node's role is refused (insufficient_privilege): {sql}"
        );
    }
    let super_of = |role: &'static str| {
        let admin_url = server.socket_url("sandgate");
        async move {
            let mut conn = sqlx::PgConnection::connect(&admin_url)
                .await
                .expect("connects");
            sqlx::query_scalar::<_, bool>("SELECT rolsuper FROM pg_roles WHERE rolname = $1")
                .bind(role)
                .fetch_one(&mut conn)
                .await
                .expect("the role exists")
        }
    };
    for role in [MIGRATOR.0, GATEWAY.0, NODE.0] {
        assert!(!super_of(role).await, "{role} is not a superuser");
    }
    let mut as_gateway = sqlx::PgConnection::connect(&gateway_url)
        .await
        .expect("the gateway role connects");
    assert_eq!(
        refusal(&mut as_gateway, "CREATE TABLE stolen (seed bytea)").await,
        "42501",
        "the gateway's role creates no tables either"
    );
    drop(client);
    drop(gateway);
    drop(node);
    support::remove_containers_of(&instance);
}
