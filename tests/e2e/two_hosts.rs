//! The operator's walkthrough in docs/scale-out.md ("Two hosts, step by step"), run as written:
//! each `# step N:` block of that section is taken from the file and run with bash, with this
//! test's values for the variables each block declares (both "hosts" on 127.0.0.1 with ports of
//! their own, host B on the second engine of `scripts/stack.sh`, one Postgres of the test's own
//! serving TLS only with the three roles of deploy/postgres/roles.sql, each step connecting as
//! its role with `verify-full`). Then the gateway the steps
//! started hands out sandboxes on both nodes and runs cells in them. A step removed, renamed or
//! broken in the docs fails here.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sandgate_node::test_pki::Pki;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::lifecycle::{plain, sandbox_id};
use crate::mcp_client::{Client, Era};
use crate::support::BIN;
use crate::support::node::{Engine, sandbox_image};
use crate::support::own_postgres::{GATEWAY, MIGRATOR, NODE, OwnPostgres};
use crate::support::scale_out::{SECOND_ENGINE, node_of};

/// The repository's root (where `deploy/pki.sh` is).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|p| p.join("deploy/pki.sh").exists())
        .expect("the repository root")
        .to_owned()
}

/// The code of the block of docs/scale-out.md whose first line is `# step N: …`.
fn step(n: u32) -> String {
    let doc = std::fs::read_to_string(repo_root().join("docs/scale-out.md")).expect("the doc");
    let section = doc
        .split("### Two hosts, step by step")
        .nth(1)
        .expect("docs/scale-out.md has the section \"Two hosts, step by step\"");
    let marker = format!("```sh\n# step {n}:");
    let start = section
        .find(&marker)
        .unwrap_or_else(|| panic!("the section has a block starting `# step {n}:`"));
    let block = &section[start + "```sh\n".len()..];
    block[..block.find("\n```").expect("the block ends")].to_owned()
}

/// bash running `code` from the repository's root with `sandgate` on PATH, the stack's
/// test-only variables removed, and `vars` set.
fn bash(code: &str, vars: &[(&str, String)]) -> Command {
    let bin_dir = Path::new(BIN).parent().expect("the binary's directory");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new("bash");
    command
        .args(["-euo", "pipefail", "-c", code])
        .current_dir(repo_root())
        .env("PATH", path)
        .env_remove("SANDGATE_TEST_PYTHON")
        .env_remove("SANDGATE_TEST_DOCKER2")
        .env_remove("SANDGATE_TEST_DOCKER2_PIDFILE")
        .env_remove("SANDGATE_TEST_TS_SDK")
        .env_remove("DATABASE_URL")
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .kill_on_drop(true);
    command
}

/// Runs step `n` to its end; its standard output. Panics with its output when it fails.
async fn run_step(n: u32, vars: &[(&str, String)]) -> String {
    let output = bash(&step(n), vars).output().await.expect("bash runs");
    assert!(
        output.status.success(),
        "step {n} of docs/scale-out.md failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Starts step `n` (it `exec`s a server) and waits for its first line on stdout.
async fn start_step(n: u32, vars: &[(&str, String)]) -> (Child, String) {
    let mut child = bash(&step(n), vars)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash runs");
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let first = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .unwrap_or_else(|_| panic!("step {n} prints its address within 120 s"))
        .expect("stdout is readable");
    let Some(first) = first else {
        let output = child.wait_with_output().await.expect("its output");
        panic!(
            "step {n} of docs/scale-out.md exited: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    if let Some(stderr) = child.stderr.take() {
        let mut err = BufReader::new(stderr).lines();
        tokio::spawn(async move { while let Ok(Some(_)) = err.next_line().await {} });
    }
    (child, first)
}

fn port_of(addr: &str) -> String {
    addr.rsplit(':').next().expect("host:port").to_owned()
}

#[tokio::test]
async fn the_documented_two_host_steps_run_as_written() {
    let _engine = SECOND_ENGINE.lock().await;
    let (engine_a, engine_b) = (Engine::first(), Engine::second());
    engine_b.ensure_image(&sandbox_image());
    // "One Postgres with the three roles" (docs/scale-out.md, "The database"): a server of the
    // test's own serving TLS only, the roles made by deploy/postgres/roles.sql, and every step
    // connecting as its role with `verify-full`.
    let server = OwnPostgres::with_roles(&Pki::new("postgres CA")).await;
    let url = |role| server.role_url(role);
    let (migrator_url, node_url, gateway_url) = (url(MIGRATOR), url(NODE), url(GATEWAY));
    let database = gateway_url.clone();
    let run = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let instance = format!("e2e-two-hosts-{run}");
    let pki = std::env::temp_dir().join(format!("sandgate-{instance}"));
    let pki_s = pki.display().to_string();
    let common = |extra: &[(&'static str, String)]| -> Vec<(&'static str, String)> {
        let mut vars = vec![
            ("SANDGATE_INSTANCE", instance.clone()),
            ("SANDGATE_POOL__MIN_READY", "0".to_owned()),
            ("SANDGATE_LOG__FORMAT", "json".to_owned()),
        ];
        vars.extend(extra.iter().cloned());
        vars
    };

    run_step(
        1,
        &common(&[
            ("PKI", pki_s.clone()),
            ("HOST_A_IP", "127.0.0.1".into()),
            ("HOST_B_IP", "127.0.0.1".into()),
        ]),
    )
    .await;
    run_step(2, &common(&[("MIGRATOR_DATABASE_URL", migrator_url)])).await;

    let mut nodes = Vec::new();
    for (host, engine) in [("host-a", &engine_a), ("host-b", &engine_b)] {
        let listen = crate::support::front::free_loopback_addr();
        let mut vars = common(&[
            ("HOST", host.to_owned()),
            ("HOST_IP", "127.0.0.1".into()),
            ("NODE_PORT", port_of(&listen)),
            ("NODE_LISTEN", listen.clone()),
            ("CERTS", format!("{pki_s}/nodes/{host}")),
            ("SANDBOX_IMAGE", sandbox_image()),
            ("NODE_DATABASE_URL", node_url.clone()),
        ]);
        if !engine.host.is_empty() {
            vars.push(("SANDGATE_DOCKER__HOST", engine.host.clone()));
        }
        let (child, first) = start_step(3, &vars).await;
        assert!(
            first.starts_with("sandgate node serving at "),
            "the node of {host} prints its address, got {first:?}"
        );
        nodes.push(child);
    }

    let listen = crate::support::front::free_loopback_addr();
    let public_url = format!("http://{listen}");
    let (_gateway, first) = start_step(
        4,
        &common(&[
            ("CERTS", format!("{pki_s}/gateway")),
            ("KEYS_SECRET_FILE", format!("{pki_s}/keys.secret")),
            ("PUBLIC_URL", public_url.clone()),
            ("LISTEN", listen.clone()),
            ("GATEWAY_DATABASE_URL", database.clone()),
        ]),
    )
    .await;
    assert!(
        first.contains(&public_url),
        "the gateway names its URL, got {first:?}"
    );

    let listed = run_step(
        5,
        &common(&[
            ("GATEWAY_DATABASE_URL", database.clone()),
            ("KEYS_SECRET_FILE", format!("{pki_s}/keys.secret")),
            ("PUBLIC_URL", public_url.clone()),
            ("TENANT", instance.clone()),
        ]),
    )
    .await;
    for engine in [&engine_a, &engine_b] {
        assert!(
            listed
                .lines()
                .any(|l| l.contains(&engine.id) && l.contains(" up ")),
            "step 5 lists the node of engine {} as up:\n{listed}",
            engine.id
        );
    }

    // The deployment serves the token step 5 printed: sandboxes until both nodes have one, a
    // cell in each.
    let token = listed
        .lines()
        .last()
        .expect("step 5 prints the token last")
        .trim()
        .to_owned();
    let client = Client::connect(&format!("{public_url}/mcp"), &token, Era::Stateless)
        .await
        .expect("a client connects to the gateway of step 4");
    let mut seen = std::collections::HashSet::new();
    for n in 0..4 {
        let result = client
            .ok(
                "execute_code",
                json!({"conversation_id": format!("ticket-{n}"), "code": format!("{n} * 10")}),
            )
            .await;
        assert_eq!(plain(&result), (n * 10).to_string(), "the cell's value");
        seen.insert(node_of(&database, &sandbox_id(&result)).await);
        if seen.len() == 2 {
            break;
        }
    }
    assert!(
        seen.contains(&engine_a.id) && seen.contains(&engine_b.id),
        "sandboxes on both nodes, got {seen:?}"
    );
    drop(client);
    drop(nodes);
    engine_a.remove_containers_of(&instance);
    engine_b.remove_containers_of(&instance);
    let _ = std::fs::remove_dir_all(&pki);
}
