//! `sandgate node` processes for the tests: [`NodeStart`] is the one place a test starts one (on
//! the stack's engine or the second one, in cleartext or with mutual TLS, with the settings the
//! test adds), and [`NodeProcess`] the running node. Plus what a node is configured with: the
//! Docker [`Engine`] it serves and the deployment's [`TlsFiles`].

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandgate_node::test_pki::Pki;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;

use super::sandgate_command;

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

    /// What the engine says of a container: its state, the error it recorded, when it was
    /// created and the sandbox it belongs to (for a failing test's message).
    pub fn describe(&self, container: &str) -> String {
        self.docker_out(&[
            "inspect",
            "--format",
            "{{.State.Status}} (error: {{json .State.Error}}, exit code {{.State.ExitCode}}), \
             created {{.Created}}, sandbox {{index .Config.Labels \"sandgate.sandbox_id\"}}",
            container,
        ])
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
pub struct TlsFiles {
    dir: PathBuf,
    pki: Pki,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The CA holds a private key.
        f.debug_struct("TlsFiles").field("dir", &self.dir).finish()
    }
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
        TlsFiles { dir, pki }
    }

    /// The CA: for clients of the node RPC made in the test itself ([`Pki::tls`]).
    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    /// The file of `name` (`tls.crt`, `tls.key`, `ca.crt`).
    pub fn file(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name)
    }

    /// Replaces the certificate and key with `cert`/`key`, as a renewal does (each file
    /// renamed into place whole; the process reads them again on its next use).
    pub fn renew(&self, cert: &str, key: &str) {
        for (file, pem) in [("tls.key", key), ("tls.crt", cert)] {
            let staged = self.dir.join(format!("{file}.new"));
            std::fs::write(&staged, pem).expect("a PEM file");
            std::fs::rename(&staged, self.dir.join(file)).expect("renamed into place");
        }
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

/// How a test's `sandgate node` is started: database, instance, engine, TLS and whatever else it
/// sets. [`NodeStart::new`] gives a node of the stack's engine on a free loopback port, in
/// cleartext, with no warm pool, its sandboxes under `SANDGATE_TEST_RUNTIME` when that is set.
#[derive(Debug, Clone)]
pub struct NodeStart {
    instance: String,
    engine: Engine,
    tls: bool,
    migrate: bool,
    copy_image: bool,
    env: Vec<(String, String)>,
}

impl NodeStart {
    /// A node of `instance` on `database` (see the type).
    pub fn new(database: &str, instance: &str) -> NodeStart {
        let start = NodeStart {
            instance: instance.to_owned(),
            engine: Engine::first(),
            tls: false,
            migrate: true,
            copy_image: true,
            env: Vec::new(),
        };
        let start = start.env([
            ("SANDGATE_DATABASE__URL", database),
            ("SANDGATE_INSTANCE", instance),
            ("SANDGATE_NODE__LISTEN", "127.0.0.1:0"),
            ("SANDGATE_POOL__MIN_READY", "0"),
        ]);
        // SANDGATE_TEST_RUNTIME=runsc runs the sandboxes under gVisor (scripts/test.sh does).
        match std::env::var("SANDGATE_TEST_RUNTIME") {
            Ok(runtime) => start.env([("SANDGATE_SANDBOX__RUNTIME", runtime)]),
            Err(_) => start,
        }
    }

    /// Serves `engine` instead of the stack's (its image copied there when missing).
    pub fn engine(mut self, engine: &Engine) -> NodeStart {
        self.engine = engine.clone();
        if engine.host.is_empty() {
            self.env.retain(|(key, _)| key != "SANDGATE_DOCKER__HOST");
            self
        } else {
            self.env([("SANDGATE_DOCKER__HOST", engine.host.as_str())])
        }
    }

    /// Leaves the database as it is: by default `sandgate migrate` runs first with the node's
    /// settings (a node never migrates; a deployment migrates before its nodes start).
    pub fn without_migrating(mut self) -> NodeStart {
        self.migrate = false;
        self
    }

    /// Leaves the engine's images as they are: by default the stack's sandbox image is copied
    /// there first when missing (a node that must pull its image needs it absent).
    pub fn without_copying_the_image(mut self) -> NodeStart {
        self.copy_image = false;
        self
    }

    /// Serves the node RPC with mutual TLS with `tls`'s keys.
    pub fn tls(mut self, tls: &TlsFiles) -> NodeStart {
        self.tls = true;
        self.env(tls.env())
    }

    /// Adds settings, or overrides ones set before.
    pub fn env<K, V>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> NodeStart
    where
        K: Into<String>,
        V: Into<String>,
    {
        for (key, value) in vars {
            let key = key.into();
            self.env.retain(|(k, _)| *k != key);
            self.env.push((key, value.into()));
        }
        self
    }

    /// Starts the node and waits until it prints its address; panics with its standard error
    /// when it exits first.
    pub async fn start(self) -> NodeProcess {
        let host = self.engine.host.clone();
        self.try_start()
            .await
            .unwrap_or_else(|stderr| panic!("sandgate node for {host:?} exited: {stderr}"))
    }

    /// Starts the node and waits until it prints its address; its standard error when it exits
    /// first (a node that must be refused).
    pub async fn try_start(self) -> Result<NodeProcess, String> {
        if self.copy_image {
            self.engine.ensure_image(&sandbox_image());
        }
        if self.migrate {
            let migrated = sandgate_command()
                .arg("migrate")
                .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .output()
                .await
                .expect("sandgate migrate runs");
            assert!(
                migrated.status.success(),
                "sandgate migrate before the node: {}",
                String::from_utf8_lossy(&migrated.stderr)
            );
        }
        let mut child = sandgate_command()
            .arg("node")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
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
        let warnings = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(stderr) = child.stderr.take() {
            let mut err = BufReader::new(stderr).lines();
            // With RUST_LOG set, the node's log shows on the test's standard error; its latest
            // warnings are kept either way, for a failing test to show.
            let show = std::env::var_os("RUST_LOG").is_some();
            let kept = warnings.clone();
            tokio::spawn(async move {
                while let Ok(Some(line)) = err.next_line().await {
                    if show {
                        eprintln!("[node] {line}");
                    }
                    if line.contains("\"level\":\"WARN\"") || line.contains("\"level\":\"ERROR\"") {
                        let mut kept = kept.lock().expect("warnings");
                        if kept.len() == KEPT_WARNINGS {
                            kept.pop_front();
                        }
                        kept.push_back(line);
                    }
                }
            });
        }
        let scheme = if self.tls { "https" } else { "http" };
        Ok(NodeProcess {
            child: Some(child),
            url: format!("{scheme}://{addr}"),
            engine: self.engine,
            instance: self.instance,
            warnings,
        })
    }
}

/// A running `sandgate node`. Dropping it kills the process and removes the containers of its
/// instance on its engine.
#[derive(Debug)]
pub struct NodeProcess {
    child: Option<Child>,
    /// `https://127.0.0.1:<port>` (`http://` in cleartext): what gateways dial.
    pub url: String,
    /// The engine it serves; its id is the node's.
    pub engine: Engine,
    instance: String,
    /// Its latest [`KEPT_WARNINGS`] warnings and errors (its log is JSON).
    warnings: Arc<Mutex<VecDeque<String>>>,
}

/// How many of a node's latest warnings [`NodeProcess::warnings`] keeps.
const KEPT_WARNINGS: usize = 40;

impl NodeProcess {
    /// The node's registry id (its engine's).
    pub fn id(&self) -> &str {
        &self.engine.id
    }

    /// The node process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// The node's latest warnings and errors, oldest first, one log line each.
    pub fn warnings(&self) -> Vec<String> {
        self.warnings
            .lock()
            .expect("warnings")
            .iter()
            .cloned()
            .collect()
    }

    /// Kills the process with SIGKILL (a crashed node host) and waits for it to be gone; its
    /// containers stay.
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
