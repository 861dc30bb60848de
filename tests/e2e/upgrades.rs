//! Upgrades (issue 25): the current binary keeps serving a database that a newer binary
//! migrated one additive step further (a migration it does not know, applied here by the test),
//! whether it only checks the schema (`database.auto_migrate = false`, a deployment) or migrates
//! itself; `sandgate migrate` leaves that migration alone; and a database that lacks one of
//! this binary's migrations is refused with what to run.

use sqlx::Connection;

use crate::support::{self, Gateway, sandgate_command};

/// A migration of a newer binary: it only adds (a table and a column).
const NEWER: i64 = 29991231000000;

async fn migrate(database: &str) -> (bool, String) {
    let output = sandgate_command()
        .arg("migrate")
        .env("SANDGATE_DATABASE__URL", database)
        .output()
        .await
        .expect("the binary runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_binary_keeps_serving_a_schema_one_additive_migration_ahead() {
    let database = support::fresh_database().await;
    let (ok, stderr) = migrate(&database).await;
    assert!(ok, "the first migrate: {stderr}");
    let mut conn = sqlx::PgConnection::connect(&database)
        .await
        .expect("the test database");
    // What a newer binary's `sandgate migrate` would have done.
    sqlx::raw_sql(
        "CREATE TABLE future_things (id bigint PRIMARY KEY);
         ALTER TABLE nodes ADD COLUMN future_zone text;",
    )
    .execute(&mut conn)
    .await
    .expect("the newer migration's SQL");
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES ($1, 'a newer binary''s additive step', true, '\\x00'::bytea, 1)",
    )
    .bind(NEWER)
    .execute(&mut conn)
    .await
    .expect("the newer migration's record");

    let (ok, stderr) = migrate(&database).await;
    assert!(
        ok,
        "sandgate migrate leaves a newer migration alone: {stderr}"
    );

    let instance = format!(
        "e2e-upgrade-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    for auto_migrate in ["false", "true"] {
        let gateway = Gateway::start_gateway_only(
            &database,
            &instance,
            &[("SANDGATE_DATABASE__AUTO_MIGRATE", auto_migrate)],
        )
        .await;
        let tenant = gateway.create_tenant().await;
        let token = gateway.token(&tenant).await;
        assert!(
            !token.is_empty(),
            "auto_migrate={auto_migrate}: a token is issued"
        );
        let ready = reqwest::get(gateway.mcp_url().replace("/mcp", "/healthz"))
            .await
            .expect("healthz answers");
        assert!(
            ready.status().is_success(),
            "auto_migrate={auto_migrate}: the replica serves"
        );
    }

    // One of this binary's migrations missing: refused, saying what to run.
    let (last, _) = sandgate_store_last(&mut conn).await;
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
        .bind(last)
        .execute(&mut conn)
        .await
        .expect("forget the newest known migration");
    let output = sandgate_command()
        .args(["serve", "--gateway-only"])
        .env("SANDGATE_DATABASE__URL", &database)
        .env("SANDGATE_DATABASE__AUTO_MIGRATE", "false")
        .env("SANDGATE_LISTEN", "127.0.0.1:0")
        .output()
        .await
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "a schema behind the binary is refused"
    );
    assert!(
        stderr.contains("older than this binary") && stderr.contains("sandgate migrate"),
        "the refusal says to run sandgate migrate: {stderr}"
    );
}

/// The newest migration this binary knows, as recorded (below the test's newer one).
async fn sandgate_store_last(conn: &mut sqlx::PgConnection) -> (i64, String) {
    sqlx::query_as("SELECT version, description FROM _sqlx_migrations WHERE version < $1 ORDER BY version DESC LIMIT 1")
        .bind(NEWER)
        .fetch_one(conn)
        .await
        .expect("a known migration")
}
