//! Pausing in a split deployment (issue 27, "Resume anywhere"): two `sandgate node` processes,
//! each on its own Docker engine (the stack's and the second one `scripts/stack.sh` starts),
//! and a `serve --gateway-only` replica in front holding the key custody and the snapshot store,
//! here the S3 one (`snapshots.store = "s3"`) on an S3-compatible server on loopback (moto,
//! tests/shared/s3.rs). The nodes hold neither keys nor store credentials, and leave idle
//! sandboxes to the gateway (`snapshots.paused_by_gateways`). A cell on node A sets a variable
//! and writes a file; the sandbox idles past its timeout and the gateway pauses it through the
//! node RPC (its container gone from engine 1, its sealed snapshot an object in the bucket under
//! the configured prefix and the tenant's, its row paused, not closed by node A); node A is
//! drained; the next call by `conversation_id` resumes it on node B (engine 2, which never saw
//! its checkpoint: the snapshot must travel from the bucket through the gateway) under the same
//! `sandbox_id`, with the variable and the file, and the object is gone. It idles again and is
//! paused from node B (an object again); `close_sandbox` then deletes that object.
//!
//! Skipped, saying so, where an engine has no `runsc2024` runtime.

use std::time::Duration;

use serde_json::{Value, json};

use crate::mcp_client::{Client, Era};
use crate::pause::runsc2024_registered;
use crate::s3::{ACCESS_KEY_ID, Moto, REGION, SECRET_ACCESS_KEY};
use crate::support::eventually;
use crate::support::node::{Engine, TlsFiles};
use crate::support::replicas::Deployment;
use crate::support::scale_out::{SECOND_ENGINE, node_of, nodes_admin, spawn_gateway, spawn_node};

const LIMIT: Duration = Duration::from_secs(300);
/// The test bucket, and the prefix the gateway puts its objects under.
const BUCKET: &str = "sandgate-e2e-snapshots";
const PREFIX: &str = "e2e/pauses";

fn borrowed(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// The plaintext tmpfs of the second engine (`scripts/stack.sh`: beside its pidfile).
fn second_plain_dir() -> String {
    let pidfile = std::env::var("SANDGATE_TEST_DOCKER2_PIDFILE")
        .expect("SANDGATE_TEST_DOCKER2_PIDFILE is set: source scripts/stack.sh's stack.env");
    std::path::Path::new(&pidfile)
        .with_file_name("plain")
        .to_str()
        .expect("a UTF-8 path")
        .to_owned()
}

fn first_plain_dir() -> String {
    std::env::var("SANDGATE_SNAPSHOTS__PLAIN_DIR")
        .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into())
}

/// What every process of the deployment shares: the checkpointing runtime, no pool, a 2 s idle
/// timeout and a fast reaper.
const PAUSING: [(&str, &str); 6] = [
    ("SANDGATE_SANDBOX__RUNTIME", "runsc2024"),
    ("SANDGATE_SNAPSHOTS__TEMPLATES", "false"),
    ("SANDGATE_LIMITS__IDLE_TIMEOUT_SECONDS", "2"),
    ("SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS", "200"),
    ("SANDGATE_POOL__MIN_READY", "0"),
    ("SANDGATE_POOL__MAX_READY", "0"),
];

async fn row_state(database: &str, sandbox_id: &str) -> String {
    sqlx::query_scalar("SELECT state FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut crate::lifecycle::db(database).await)
        .await
        .expect("the sandbox's row")
}

async fn cell(client: &Client, conversation: &str, code: &str) -> Value {
    let answer = client
        .ok(
            "execute_code",
            json!({"conversation_id": conversation, "code": code}),
        )
        .await;
    assert!(
        answer.structured["error"].is_null(),
        "the cell ran: {}",
        answer.text
    );
    answer.structured
}

async fn tenant_of(database: &str, sandbox_id: &str) -> String {
    sqlx::query_scalar("SELECT tenant_id::text FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut crate::lifecycle::db(database).await)
        .await
        .expect("the sandbox's tenant")
}

/// Waits until the bucket holds exactly one object and `engine` runs none of the deployment's
/// containers: paused; the object's key.
async fn until_paused(moto: &Moto, engine: &Engine, instance: &str) -> String {
    eventually(
        LIMIT,
        "the idle sandbox to be paused by the gateway into the bucket",
        || async {
            let keys = moto.keys(BUCKET).await;
            (engine.containers_of(instance).is_empty() && keys.len() == 1).then(|| keys[0].clone())
        },
    )
    .await
}

#[tokio::test]
async fn a_sandbox_paused_into_s3_on_one_engine_s_node_resumes_on_another_s_after_a_drain() {
    let _second_engine = SECOND_ENGINE.lock().await;
    let (first, second) = (Engine::first(), Engine::second());
    if !runsc2024_registered()
        || !second
            .docker_out(&["info", "--format", "{{json .Runtimes}}"])
            .contains("\"runsc2024\"")
    {
        eprintln!("skipping: an engine has no runsc2024 runtime");
        return;
    }
    let deployment = Deployment::new().await;
    let tls = TlsFiles::new(&deployment.instance);
    let _restores = crate::pause::RESTORES.read().await;
    let (plain_a, plain_b) = (first_plain_dir(), second_plain_dir());
    let node_env = |plain: &str| -> Vec<(String, String)> {
        PAUSING
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .chain([
                ("SANDGATE_SNAPSHOTS__PLAIN_DIR".into(), plain.to_owned()),
                (
                    "SANDGATE_SNAPSHOTS__PAUSED_BY_GATEWAYS".into(),
                    "true".into(),
                ),
            ])
            .collect()
    };
    let (env_a, env_b) = (node_env(&plain_a), node_env(&plain_b));
    let node_a = spawn_node(&deployment, &first, &tls, &borrowed(&env_a)).await;
    let node_b = spawn_node(&deployment, &second, &tls, &borrowed(&env_b)).await;
    let moto = Moto::start(&[BUCKET]);
    let mut gateway_env: Vec<(&str, &str)> = PAUSING.to_vec();
    gateway_env.extend([
        ("SANDGATE_SNAPSHOTS__STORE", "s3"),
        ("SANDGATE_SNAPSHOTS__S3__BUCKET", BUCKET),
        ("SANDGATE_SNAPSHOTS__S3__ENDPOINT", moto.endpoint.as_str()),
        ("SANDGATE_SNAPSHOTS__S3__REGION", REGION),
        ("SANDGATE_SNAPSHOTS__S3__ACCESS_KEY_ID", ACCESS_KEY_ID),
        (
            "SANDGATE_SNAPSHOTS__S3__SECRET_ACCESS_KEY",
            SECRET_ACCESS_KEY,
        ),
        ("SANDGATE_SNAPSHOTS__S3__PREFIX", PREFIX),
        ("SANDGATE_SNAPSHOTS__S3__ALLOW_HTTP", "true"),
    ]);
    let gateway = spawn_gateway(0, &deployment, &tls, &gateway_env).await;
    let db = deployment.database.as_str();
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");

    // The conversation's sandbox on node A (node B drained while it is placed).
    nodes_admin(db, "drain", node_b.id()).await;
    let conversation = format!("conv-{}", uuid::Uuid::new_v4().simple());
    let first_cell = cell(
        &client,
        &conversation,
        "v = 41\nopen('/home/user/kept.txt', 'w').write('kept')\nv",
    )
    .await;
    let sandbox_id = first_cell["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned();
    assert_eq!(node_of(db, &sandbox_id).await, node_a.id());
    nodes_admin(db, "undrain", node_b.id()).await;

    // Idle: the gateway pauses it through node A's RPC into the bucket; node A does not close
    // it.
    let key = until_paused(&moto, &first, &deployment.instance).await;
    assert_eq!(
        row_state(db, &sandbox_id).await,
        "paused",
        "paused, not closed by its node"
    );
    let tenant_id = tenant_of(db, &sandbox_id).await;
    assert!(
        key.starts_with(&format!("{PREFIX}/tenants/{tenant_id}/")) && key.ends_with(".sgsnap"),
        "the snapshot is an object under the prefix and the tenant's: {key}"
    );

    // Node A drained: the resume is node B's, on the other engine.
    nodes_admin(db, "drain", node_a.id()).await;
    let after = cell(
        &client,
        &conversation,
        "v += 1\n(v, open('/home/user/kept.txt').read())",
    )
    .await;
    assert_eq!(after["sandbox_id"], sandbox_id.as_str(), "the same sandbox");
    assert_eq!(
        after["result"]["text/plain"], "(42, 'kept')",
        "the variable and the file came across: {after}"
    );
    assert!(after["resumed"].is_object(), "it says it resumed: {after}");
    assert_eq!(
        node_of(db, &sandbox_id).await,
        node_b.id(),
        "resumed on node B"
    );
    assert_eq!(node_b.id(), second.id, "node B is engine 2's");
    assert!(
        first.containers_of(&deployment.instance).is_empty(),
        "nothing came back on engine 1"
    );
    assert_eq!(
        moto.keys(BUCKET).await,
        Vec::<String>::new(),
        "a resumed sandbox's snapshot is deleted from the bucket"
    );

    // Idle again: paused from node B into the bucket; closing it deletes the object.
    let key = until_paused(&moto, &second, &deployment.instance).await;
    assert_eq!(row_state(db, &sandbox_id).await, "paused");
    assert!(
        key.starts_with(&format!("{PREFIX}/tenants/{tenant_id}/")),
        "{key}"
    );
    client
        .ok("close_sandbox", json!({"sandbox_id": sandbox_id}))
        .await;
    eventually(LIMIT, "the closed sandbox's object to go", || async {
        moto.keys(BUCKET).await.is_empty().then_some(())
    })
    .await;
    assert_eq!(row_state(db, &sandbox_id).await, "closed");
    first.remove_containers_of(&deployment.instance);
    second.remove_containers_of(&deployment.instance);
}
