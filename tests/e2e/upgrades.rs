//! Upgrades (issue 25): the current binary keeps serving a database that a newer binary
//! migrated one additive step further (a migration it does not know, applied here by the test),
//! whether it only checks the schema (`database.auto_migrate = false`, a deployment) or migrates
//! itself, with a `sandgate node` (which never migrates) running its sandboxes; `sandgate migrate` leaves that migration alone; and a database that lacks one of
//! this binary's migrations is refused with what to run.

use std::time::Duration;

use sqlx::Connection;

use serde_json::json;

use crate::mcp_client::{Client, Era};
use crate::support::node::NodeStart;
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
    // A node of this binary (it never migrates) registers, heartbeats and runs sandboxes on the
    // newer schema; so does a replica that only checks it, and one that migrates itself.
    let node = NodeStart::new(&database, &instance)
        .without_migrating()
        .start()
        .await;
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
        let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
            .await
            .expect("client connects");
        let answer = client
            .ok("execute_code", json!({"code": "kept = 6 * 7\nkept"}))
            .await;
        assert_eq!(
            answer.structured["result"]["text/plain"], "42",
            "auto_migrate={auto_migrate}: a cell runs on the node: {}",
            answer.text
        );
        let id = answer.structured["sandbox_id"].as_str().unwrap().to_owned();
        let again = client
            .ok("execute_code", json!({"sandbox_id": id, "code": "kept"}))
            .await;
        assert_eq!(
            again.structured["result"]["text/plain"], "42",
            "auto_migrate={auto_migrate}: its state is kept: {}",
            again.text
        );
        client.ok("close_sandbox", json!({"sandbox_id": id})).await;
    }
    drop(node);
    support::remove_containers_of(&instance);

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

/// The warm rows of `instance`'s node: (sandbox id, container id).
async fn warm_rows(database: &str) -> Vec<(String, String)> {
    sqlx::query_as("SELECT id, container_id FROM sandboxes WHERE state = 'warm' ORDER BY id")
        .fetch_all(&mut crate::lifecycle::db(database).await)
        .await
        .expect("the warm rows")
}

/// The id of the image a container was created from (empty when it is gone).
fn container_image(container: &str) -> String {
    support::docker_words(&["inspect", "--format", "{{.Image}}", container]).join("")
}

/// The engine's id of `image`.
fn image_id(image: &str) -> String {
    support::docker_words(&["image", "inspect", "--format", "{{.Id}}", image]).join("")
}

#[tokio::test]
async fn a_node_restarted_with_a_new_sandbox_image_retires_its_old_warm_sandboxes_and_keeps_the_leased()
 {
    use crate::lifecycle::{FAST, plain, sandbox_id};

    // The "new release" of the sandbox image: the stack's with one more label (another id).
    let old_image = crate::support::node::sandbox_image();
    let run = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let new_image = format!("sandgate-sandbox-e2e-roll:{run}");
    let mut build = std::process::Command::new("docker")
        .args(["build", "-q", "-t", &new_image, "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("docker build runs");
    {
        use std::io::Write;
        let mut stdin = build.stdin.take().expect("piped");
        writeln!(stdin, "FROM {old_image}\nLABEL sandgate.e2e.roll={run}").expect("the Dockerfile");
    }
    assert!(
        build.wait().expect("docker build ends").success(),
        "docker build of {new_image}"
    );
    let (old_id, new_id) = (image_id(&old_image), image_id(&new_image));
    assert_ne!(old_id, new_id, "the new image has an id of its own");

    let database = support::fresh_database().await;
    let env: Vec<(&str, &str)> = FAST
        .iter()
        .copied()
        .chain([("SANDGATE_POOL__MIN_READY", "2")])
        .collect();
    let mut first = Gateway::start(&database, &env).await;
    let tenant = first.create_tenant().await;
    let token = first.token(&tenant).await;
    let client = Client::connect(&first.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let leased = sandbox_id(
        &client
            .ok(
                "execute_code",
                json!({"code": "kept = 'from the old image'"}),
            )
            .await,
    );
    let old_warm = support::eventually(
        Duration::from_secs(120),
        "two warm sandboxes of the old image",
        || async {
            let rows = warm_rows(&database).await;
            (rows.len() >= 2).then_some(rows)
        },
    )
    .await;
    for (_, container) in &old_warm {
        assert_eq!(
            container_image(container),
            old_id,
            "warm before the roll: the old image"
        );
    }
    // The node's process ends (a roll) and comes back with the new image.
    first.kill().await;
    let env: Vec<(&str, &str)> = env
        .into_iter()
        .chain([("SANDGATE_SANDBOX__IMAGE", new_image.as_str())])
        .collect();
    let second = Gateway::start_instance(&database, &first.instance, &env).await;

    support::eventually(
        Duration::from_secs(120),
        "the old warm sandboxes retired (rows and containers gone) and warm ones of the new image",
        || async {
            let rows = warm_rows(&database).await;
            let old_gone = old_warm.iter().all(|(id, container)| {
                !rows.iter().any(|(r, _)| r == id) && container_image(container).is_empty()
            });
            let new_ready = !rows.is_empty()
                && rows
                    .iter()
                    .all(|(_, container)| container_image(container) == new_id);
            (old_gone && new_ready).then_some(())
        },
    )
    .await;

    // The leased sandbox keeps its container, image and variables; a new one gets the new image.
    let token = second.token(&tenant).await;
    let client = Client::connect(&second.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let kept = client
        .ok(
            "execute_code",
            json!({"sandbox_id": leased, "code": "kept"}),
        )
        .await;
    assert_eq!(
        plain(&kept),
        "'from the old image'",
        "the leased sandbox lives on"
    );
    let container: String = sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE id = $1")
        .bind(&leased)
        .fetch_one(&mut crate::lifecycle::db(&database).await)
        .await
        .expect("the leased row");
    assert_eq!(
        container_image(&container),
        old_id,
        "a leased sandbox keeps its image"
    );
    let fresh = sandbox_id(&client.ok("execute_code", json!({"code": "1"})).await);
    let container: String = sqlx::query_scalar("SELECT container_id FROM sandboxes WHERE id = $1")
        .bind(&fresh)
        .fetch_one(&mut crate::lifecycle::db(&database).await)
        .await
        .expect("the new row");
    assert_eq!(
        container_image(&container),
        new_id,
        "a lease after the roll: the new image"
    );
    drop(second);
    drop(first);
    let _ = std::process::Command::new("docker")
        .args(["rmi", &new_image])
        .output();
}
