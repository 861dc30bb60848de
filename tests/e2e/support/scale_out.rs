//! Past one machine (issue 15): two Docker engines on this machine (the stack's, and the second
//! one `scripts/stack.sh` starts), a `sandgate node` process per engine, `serve --gateway-only`
//! replicas in front of them, all on one Postgres, over mutual TLS with certificates made here.
//! Plus what a test does to them: drain a node, stop and restart the second engine, and check
//! that Postgres and both engines agree.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::Connection;

use super::node::{Engine, NodeProcess, NodeStart, TlsFiles};
use super::replicas::Deployment;
use super::{Gateway, eventually, sandgate_command};

/// How fast the registry notices a silent node in these tests, seconds: heartbeat and
/// `node.away_after_seconds` = `node.lost_after_seconds` (the same on nodes and gateways).
pub const HEARTBEAT: &str = "1";
/// See [`HEARTBEAT`].
pub const LOST_AFTER: &str = "15";

/// The settings every process of a two-node deployment shares: database, instance, secret,
/// public URL, the node TLS files, and how fast a silent node counts as lost.
fn shared_env(deployment: &Deployment, tls: &TlsFiles) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vec![
        ("SANDGATE_DATABASE__URL".into(), deployment.database.clone()),
        ("SANDGATE_INSTANCE".into(), deployment.instance.clone()),
        ("SANDGATE_KEYS__SECRET".into(), deployment.secret.clone()),
        ("SANDGATE_LOG__FORMAT".into(), "json".into()),
        ("SANDGATE_NODE__HEARTBEAT_SECONDS".into(), HEARTBEAT.into()),
        (
            "SANDGATE_NODE__AWAY_AFTER_SECONDS".into(),
            LOST_AFTER.into(),
        ),
        (
            "SANDGATE_NODE__LOST_AFTER_SECONDS".into(),
            LOST_AFTER.into(),
        ),
    ];
    if let Some(url) = &deployment.public_url {
        env.push(("SANDGATE_PUBLIC_URL".into(), url.clone()));
    }
    env.extend(tls.env());
    env
}

/// Starts `sandgate node` for `engine` on a free loopback port (mutual TLS with `tls`), with the
/// deployment's settings and `extra_env`; returns once it prints its address. A warm pool of one
/// per node by default.
pub async fn spawn_node(
    deployment: &Deployment,
    engine: &Engine,
    tls: &TlsFiles,
    extra_env: &[(&str, &str)],
) -> NodeProcess {
    NodeStart::new(&deployment.database, &deployment.instance)
        .engine(engine)
        .tls(tls)
        .env(shared_env(deployment, tls))
        .env([("SANDGATE_POOL__MIN_READY", "1")])
        .env(extra_env.iter().copied())
        .start()
        .await
}

/// Starts replica `index` as `sandgate serve --gateway-only`: no node and no Docker of its own,
/// the registry's nodes reached over mutual TLS with `tls`.
pub async fn spawn_gateway(
    index: usize,
    deployment: &Deployment,
    tls: &TlsFiles,
    extra_env: &[(&str, &str)],
) -> Gateway {
    let _ = index;
    let mut env = shared_env(deployment, tls);
    for (k, v) in extra_env {
        env.retain(|(key, _)| key != k);
        env.push(((*k).into(), (*v).into()));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Gateway::start_gateway_only(&deployment.database, &deployment.instance, &env).await
}

/// Runs `sandgate admin nodes <verb> <id>` (drain, undrain) against `database`; its output.
pub async fn nodes_admin(database: &str, verb: &str, id: &str) -> String {
    nodes_cli(database, &[verb, id]).await
}

/// Runs `sandgate admin nodes <args>` against `database`; its output (it must succeed).
pub async fn nodes_cli(database: &str, args: &[&str]) -> String {
    let output = sandgate_command()
        .args(["admin", "nodes"])
        .args(args)
        .env("SANDGATE_DATABASE__URL", database)
        .output()
        .await
        .expect("the binary runs");
    assert!(
        output.status.success(),
        "sandgate admin nodes {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The second engine's dockerd: the pid in `SANDGATE_TEST_DOCKER2_PIDFILE`, checked to be a
/// dockerd serving `SANDGATE_TEST_DOCKER2`'s socket (never the first engine's).
pub fn second_dockerd() -> Option<u32> {
    let pidfile = std::env::var("SANDGATE_TEST_DOCKER2_PIDFILE")
        .expect("SANDGATE_TEST_DOCKER2_PIDFILE is not set: source scripts/stack.sh's stack.env");
    let socket = std::env::var("SANDGATE_TEST_DOCKER2").expect("SANDGATE_TEST_DOCKER2 is set");
    let pid: u32 = std::fs::read_to_string(&pidfile)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let is_second =
        args.first().is_some_and(|a| a.ends_with("dockerd")) && args.iter().any(|a| a == &socket);
    is_second.then_some(pid)
}

/// Held by every test that runs a node on the second engine, for its whole run: one of them stops
/// that engine, which would take another's node down with it (cargo runs tests in parallel).
pub static SECOND_ENGINE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Stops the second engine abruptly (SIGKILL to its dockerd: a crashed engine). Only the second
/// one: the pid must be a dockerd listening on the second engine's socket. The engine comes back
/// with [`EngineDown::restart`], or when the guard is dropped (a failed test leaves it running).
pub async fn kill_second_engine() -> EngineDown {
    let pid = second_dockerd().expect(
        "the second engine's dockerd is running (its pidfile names it and it serves its socket)",
    );
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "SIGKILL reached dockerd {pid}");
    eventually(
        Duration::from_secs(30),
        "the second dockerd to be gone",
        || async { (!Path::new(&format!("/proc/{pid}")).exists()).then_some(()) },
    )
    .await;
    EngineDown { restarted: false }
}

/// The second engine, stopped by [`kill_second_engine`].
#[derive(Debug)]
#[must_use = "the engine comes back when this is restarted or dropped"]
pub struct EngineDown {
    restarted: bool,
}

impl EngineDown {
    /// Starts the second engine again the way the stack does (`scripts/stack.sh docker2`); it
    /// answers when this returns.
    pub async fn restart(mut self) {
        self.restarted = true;
        let output = tokio::process::Command::new(stack_script())
            .arg("docker2")
            .output()
            .await
            .expect("scripts/stack.sh runs");
        assert!(
            output.status.success(),
            "scripts/stack.sh docker2 failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for EngineDown {
    fn drop(&mut self) {
        if !self.restarted {
            let _ = std::process::Command::new(stack_script())
                .arg("docker2")
                .output();
        }
    }
}

fn stack_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/stack.sh")
}

/// Whether Postgres and the engines agree for `instance`: every container labelled with it on
/// any engine is a live (warm or leased) row's, on the engine of the node the row names; no
/// container serves two live rows; every live row has its container. Returns what differs.
pub async fn ownership_problems_on(
    database: &str,
    instance: &str,
    engines: &[&Engine],
) -> Vec<String> {
    let mut conn = sqlx::PgConnection::connect(database)
        .await
        .expect("the test database answers");
    let live: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT id, container_id, node FROM sandboxes WHERE state IN ('warm', 'leased')",
    )
    .fetch_all(&mut conn)
    .await
    .expect("rows");
    let mut problems = Vec::new();
    let mut owner = HashMap::new();
    for (id, container, _) in &live {
        if let Some(other) = owner.insert(container.clone(), id.clone()) {
            problems.push(format!(
                "container {container} is owned twice (by {other} and {id})"
            ));
        }
    }
    let mut found: HashMap<String, &Engine> = HashMap::new();
    for engine in engines {
        for container in engine.containers_of(instance) {
            if let Some(first) = found.insert(container.clone(), engine) {
                problems.push(format!(
                    "container {container} is on two engines ({} and {})",
                    first.id, engine.id
                ));
            }
            if !owner.contains_key(&container) {
                problems.push(format!(
                    "container {container} on engine {} has no live row (an orphan): {}",
                    engine.id,
                    engine.describe(&container)
                ));
            }
        }
    }
    for (id, container, node) in &live {
        match found.get(container) {
            None => problems.push(format!("live sandbox {id} has no container on any engine")),
            Some(engine) if &engine.id != node => problems.push(format!(
                "sandbox {id}'s row names node {node}, but its container is on engine {} \
                 (cross-owned)",
                engine.id
            )),
            Some(_) => {}
        }
    }
    problems
}

/// The nodes the live leased sandboxes of `database` are on.
pub async fn nodes_with_leases(database: &str) -> HashSet<String> {
    let mut conn = sqlx::PgConnection::connect(database)
        .await
        .expect("the test database answers");
    sqlx::query_scalar::<_, String>("SELECT DISTINCT node FROM sandboxes WHERE state = 'leased'")
        .fetch_all(&mut conn)
        .await
        .expect("nodes")
        .into_iter()
        .collect()
}

/// The node a sandbox's row names.
pub async fn node_of(database: &str, sandbox_id: &str) -> String {
    let mut conn = sqlx::PgConnection::connect(database)
        .await
        .expect("the test database answers");
    sqlx::query_scalar("SELECT node FROM sandboxes WHERE id = $1")
        .bind(sandbox_id)
        .fetch_one(&mut conn)
        .await
        .expect("the sandbox's row")
}
