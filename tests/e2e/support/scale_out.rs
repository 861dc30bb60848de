//! Past one machine (issue 15): two Docker engines on this machine (the stack's, and the second
//! one `scripts/stack.sh` starts), a `sandgate node` process per engine, `serve --gateway-only`
//! replicas in front of them, all on one Postgres, over mutual TLS with certificates made here.
//! Plus what a test does to them: drain a node, stop and restart the second engine, and check
//! that Postgres and both engines agree.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sandgate_node::test_pki::Pki;
use sqlx::Connection;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::replicas::Deployment;
use super::{Gateway, eventually, sandgate_command};

/// A Docker engine of this machine, as the docker CLI and `SANDGATE_DOCKER__HOST` name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Engine {
    /// `unix:///…`; empty: the CLI's default (`DOCKER_HOST`, else the default socket).
    pub host: String,
    /// Its id (`docker info`), which is the id of the node that serves it.
    pub id: String,
}

impl Engine {
    /// The stack's engine, the one every other test uses.
    pub fn first() -> Engine {
        Self::at(std::env::var("DOCKER_HOST").unwrap_or_default())
    }

    /// The second engine `scripts/stack.sh up` starts (`SANDGATE_TEST_DOCKER2` in stack.env).
    pub fn second() -> Engine {
        let host = std::env::var("SANDGATE_TEST_DOCKER2").expect(
            "SANDGATE_TEST_DOCKER2 is not set: the two-node tests need the second Docker engine \
             that scripts/stack.sh up starts; run it, then source its stack.env",
        );
        let engine = Self::at(host);
        assert_ne!(
            engine.id,
            Engine::first().id,
            "the second engine reports the first one's id; two nodes on one id are refused"
        );
        engine
    }

    fn at(host: String) -> Engine {
        let mut engine = Engine {
            host,
            id: String::new(),
        };
        let id = engine.docker_out(&["info", "--format", "{{.ID}}"]);
        assert!(
            !id.is_empty(),
            "the Docker engine at {:?} answers `docker info`",
            engine.host
        );
        engine.id = id;
        engine
    }

    /// `docker` aimed at this engine.
    pub fn docker(&self) -> std::process::Command {
        let mut command = std::process::Command::new("docker");
        if !self.host.is_empty() {
            command.args(["-H", &self.host]);
        }
        command
    }

    /// What `docker <args>` prints on this engine, trimmed (empty when it fails).
    pub fn docker_out(&self, args: &[&str]) -> String {
        let output = self
            .docker()
            .args(args)
            .output()
            .expect("the docker CLI runs");
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Ids of every container (running or not) labelled with `instance`.
    pub fn containers_of(&self, instance: &str) -> Vec<String> {
        self.docker_out(&[
            "ps",
            "-aq",
            "--no-trunc",
            "--filter",
            &format!("label=sandgate.instance={instance}"),
        ])
        .split_whitespace()
        .map(str::to_owned)
        .collect()
    }

    /// Removes every container labelled with `instance` (a test's own).
    pub fn remove_containers_of(&self, instance: &str) {
        let ids = self.containers_of(instance);
        if !ids.is_empty() {
            let _ = self.docker().args(["rm", "-f"]).args(&ids).output();
        }
    }

    /// Makes sure `image` is on this engine, copying it from the first engine when it is not
    /// (`docker save | docker load`: no registry here). `scripts/stack.sh` copies the stack's
    /// image; a worktree whose recipe differs gets its own here, once per tag.
    pub fn ensure_image(&self, image: &str) {
        if self
            .docker()
            .args(["image", "inspect", image])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("the docker CLI runs")
            .success()
        {
            return;
        }
        let mut save = Engine::first()
            .docker()
            .args(["save", image])
            .stdout(Stdio::piped())
            .spawn()
            .expect("docker save runs");
        let status = self
            .docker()
            .args(["load", "-q"])
            .stdin(save.stdout.take().expect("piped"))
            .stdout(Stdio::null())
            .status()
            .expect("docker load runs");
        assert!(
            save.wait().expect("docker save ends").success() && status.success(),
            "{image} could be copied to the engine at {}",
            self.host
        );
    }
}

/// The sandbox image of this run (`SANDGATE_SANDBOX__IMAGE`).
pub fn sandbox_image() -> String {
    std::env::var("SANDGATE_SANDBOX__IMAGE").expect(
        "SANDGATE_SANDBOX__IMAGE is not set: source the stack's environment (scripts/stack.sh)",
    )
}

/// A deployment's private CA and one certificate (for 127.0.0.1, server and client use) that
/// nodes and gateways present, as PEM files in a directory of the test's own.
#[derive(Debug)]
pub struct TlsFiles {
    dir: PathBuf,
}

impl TlsFiles {
    /// A new CA and certificate, written under the temporary directory.
    pub fn new(name: &str) -> TlsFiles {
        let dir = std::env::temp_dir().join(format!("sandgate-pki-{name}"));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let pki = Pki::new(&format!("{name} CA"));
        let (cert, key) = pki.leaf_pem();
        for (file, pem) in [
            ("tls.crt", cert),
            ("tls.key", key),
            ("ca.crt", pki.ca_pem()),
        ] {
            std::fs::write(dir.join(file), pem).expect("a PEM file");
        }
        TlsFiles { dir }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    /// `node.tls_*`: the same keys serve a node (server) and a gateway (client).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("SANDGATE_NODE__TLS_CERT".into(), self.path("tls.crt")),
            ("SANDGATE_NODE__TLS_KEY".into(), self.path("tls.key")),
            ("SANDGATE_NODE__TLS_CA".into(), self.path("ca.crt")),
        ]
    }
}

impl Drop for TlsFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How fast the registry notices a silent node in these tests, seconds: heartbeat and
/// `node.lost_after_seconds` (the same on nodes and gateways).
pub const HEARTBEAT: &str = "1";
/// See [`HEARTBEAT`].
pub const LOST_AFTER: &str = "15";

/// A running `sandgate node`. Dropping it kills the process and removes the containers of the
/// deployment on its engine.
#[derive(Debug)]
pub struct NodeProcess {
    child: Option<Child>,
    /// `https://127.0.0.1:<port>`: what gateways dial.
    pub url: String,
    /// The engine it serves; its id is the node's.
    pub engine: Engine,
    instance: String,
}

impl NodeProcess {
    /// The node's registry id (its engine's).
    pub fn id(&self) -> &str {
        &self.engine.id
    }

    /// Kills the process with SIGKILL (a crashed node host) and waits for it to be gone.
    #[allow(dead_code)] // for tests of a lost node process
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.expect("SIGKILL");
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
        self.engine.remove_containers_of(&self.instance);
    }
}

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

/// Starts `sandgate node` for `engine` on a free loopback port (mutual TLS with `tls`), `extra_env`
/// added; returns once it prints its address. A warm pool of one per node by default.
pub async fn spawn_node(
    deployment: &Deployment,
    engine: &Engine,
    tls: &TlsFiles,
    extra_env: &[(&str, &str)],
) -> NodeProcess {
    engine.ensure_image(&sandbox_image());
    let mut env = shared_env(deployment, tls);
    env.push(("SANDGATE_NODE__LISTEN".into(), "127.0.0.1:0".into()));
    env.push(("SANDGATE_POOL__MIN_READY".into(), "1".into()));
    if !engine.host.is_empty() {
        env.push(("SANDGATE_DOCKER__HOST".into(), engine.host.clone()));
    }
    // SANDGATE_TEST_RUNTIME=runsc runs the sandboxes under gVisor (scripts/test.sh does).
    if let Ok(runtime) = std::env::var("SANDGATE_TEST_RUNTIME") {
        env.push(("SANDGATE_SANDBOX__RUNTIME".into(), runtime));
    }
    for (k, v) in extra_env {
        env.retain(|(key, _)| key != k);
        env.push(((*k).into(), (*v).into()));
    }
    let mut command = sandgate_command();
    command
        .arg("node")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let (child, addr) = start_node_command(command)
        .await
        .unwrap_or_else(|stderr| panic!("sandgate node for {:?} exited: {stderr}", engine.host));
    NodeProcess {
        child: Some(child),
        url: format!("https://{addr}"),
        engine: engine.clone(),
        instance: deployment.instance.clone(),
    }
}

/// Runs a prepared `sandgate node` command (its pipes are set here) and waits until it prints
/// its address; its child and address, or its standard error when it exits first.
pub async fn start_node_command(mut command: Command) -> Result<(Child, String), String> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the sandgate binary starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .expect("the node prints its address or exits within 120 s")
        .expect("stdout is readable");
    let Some(line) = line else {
        let output = child.wait_with_output().await.expect("the node's output");
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    };
    let addr = line
        .strip_prefix("sandgate node serving at ")
        .unwrap_or_else(|| panic!("unexpected first line from sandgate node: {line:?}"))
        .to_owned();
    // Keep draining both pipes so the node never blocks on a full one.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    if let Some(stderr) = child.stderr.take() {
        let mut err = BufReader::new(stderr).lines();
        // With RUST_LOG set, the node's log shows on the test's standard error.
        let show = std::env::var_os("RUST_LOG").is_some();
        tokio::spawn(async move {
            while let Ok(Some(line)) = err.next_line().await {
                if show {
                    eprintln!("[node] {line}");
                }
            }
        });
    }
    Ok((child, addr))
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
fn second_dockerd() -> Option<u32> {
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
                    "container {container} on engine {} has no live row (an orphan)",
                    engine.id
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
