//! `deploy/compose.yaml` end to end: the gateway and Postgres images built here (offline), the
//! stack's sandbox image, the node RPC's certificates made by `deploy/pki.sh`, `docker-compose
//! up` with a project name and a loopback port of this test's own (Postgres, a gateway-only
//! gateway, a node against this host's engine), a real MCP conversation with rmcp's client in
//! both eras, then `down -v` and nothing of the project left on the engine.
//!
//! Needs `docker-compose` (Debian's 1.29; `scripts/stack.sh` installs it) and the stack's
//! environment (`SANDGATE_SANDBOX__IMAGE`; the engine on a local unix socket).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{gateway_image, postgres_image, repo_root, run, run_ok};
use crate::mcp_client::{Client, Era};
use crate::support;

const COMPOSE_DEADLINE: Duration = Duration::from_secs(300);

/// The local socket of the engine the stack uses.
fn docker_socket() -> PathBuf {
    let host = std::env::var("DOCKER_HOST").unwrap_or_default();
    if host.is_empty() {
        return PathBuf::from("/var/run/docker.sock");
    }
    match host.strip_prefix("unix://") {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "DOCKER_HOST={host}: the compose test mounts the engine's socket, so it needs a \
             unix:// one"
        ),
    }
}

fn random_hex() -> String {
    rand::random::<[u8; 24]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A compose project of this test: its own name, env file (with secrets made here) and loopback
/// port. Dropping it runs `down -v` and removes the sandbox containers of its instance, so a
/// failing test leaves nothing either.
struct Project {
    name: String,
    instance: String,
    dir: PathBuf,
    env_file: PathBuf,
    compose_file: String,
    port: u16,
    down: bool,
}

impl Project {
    fn new(gateway_image: &str, postgres_image: &str) -> Project {
        let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
        let name = format!("sgdeploy{id}");
        let instance = format!("e2e-compose-{id}");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let socket = docker_socket();
        let gid = std::fs::metadata(&socket)
            .unwrap_or_else(|e| panic!("{} is there: {e}", socket.display()))
            .gid();
        let sandbox_image = std::env::var("SANDGATE_SANDBOX__IMAGE").expect(
            "SANDGATE_SANDBOX__IMAGE is not set: source the stack's environment (scripts/stack.sh)",
        );
        // The operator's step: the node RPC's CA and certificates (deploy/pki.sh).
        let pki = dir.join("pki");
        let made = std::process::Command::new(repo_root().join("deploy/pki.sh"))
            .arg(&pki)
            .output()
            .expect("deploy/pki.sh runs");
        assert!(
            made.status.success(),
            "deploy/pki.sh failed: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        // The operator's env file (deploy/compose.env.example), with secrets of this test's own.
        let env = format!(
            "GATEWAY_IMAGE={gateway_image}\nPOSTGRES_IMAGE={postgres_image}\nSANDBOX_IMAGE={sandbox_image}\n\
             PORT={port}\nPUBLIC_URL=http://127.0.0.1:{port}\nDOCKER_GID={gid}\nDOCKER_SOCKET={}\n\
             INSTANCE={instance}\nPKI_DIR={}\nPOSTGRES_PASSWORD={}\nKEYS_SECRET={}\nCOOKIE_SECRET={}\n\
             MIGRATOR_DB_PASSWORD={}\nGATEWAY_DB_PASSWORD={}\nNODE_DB_PASSWORD={}\n",
            socket.display(),
            pki.display(),
            random_hex(),
            random_hex(),
            random_hex(),
            random_hex(),
            random_hex(),
            random_hex(),
        );
        let env_file = dir.join("compose.env");
        std::fs::write(&env_file, env).expect("the env file is written");
        Project {
            name,
            instance,
            dir,
            env_file,
            compose_file: repo_root()
                .join("deploy/compose.yaml")
                .to_str()
                .expect("a UTF-8 path")
                .to_owned(),
            port,
            down: false,
        }
    }

    fn args<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        let mut all = vec![
            "--project-name",
            &self.name,
            "--env-file",
            self.env_file.to_str().expect("a UTF-8 path"),
            "--file",
            &self.compose_file,
        ];
        all.extend_from_slice(args);
        all
    }

    /// `docker-compose <args>` that must succeed; its stdout. On failure, the services' logs.
    async fn compose(&self, args: &[&str]) -> String {
        let output = run("docker-compose", &self.args(args), COMPOSE_DEADLINE).await;
        if !output.status.success() {
            panic!(
                "docker-compose {args:?} failed ({}):\n{}\n--- logs\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr),
                self.logs().await
            );
        }
        String::from_utf8(output.stdout).expect("UTF-8 output")
    }

    async fn logs(&self) -> String {
        let output = run(
            "docker-compose",
            &self.args(&["logs", "--no-color", "--tail", "40"]),
            COMPOSE_DEADLINE,
        )
        .await;
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// `sandgate <args>` inside the running gateway container (the operator's admin CLI).
    async fn sandgate(&self, args: &[&str]) -> String {
        let mut all = vec!["exec", "-T", "gateway", "sandgate"];
        all.extend_from_slice(args);
        self.compose(&all).await.trim().to_owned()
    }

    fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Polls `/readyz` until it answers 200; panics with the logs after the deadline.
    async fn wait_ready(&self) {
        let http = reqwest::Client::new();
        let start = Instant::now();
        let mut last = String::new();
        while start.elapsed() < Duration::from_secs(180) {
            match http.get(format!("{}/readyz", self.base_url())).send().await {
                Ok(r) if r.status().is_success() => return,
                Ok(r) => last = format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "/readyz did not answer 200 within 180 s (last: {last})\n--- logs\n{}",
            self.logs().await
        );
    }

    /// The containers of this compose project (running or not), inspected.
    fn containers(&self) -> Vec<Value> {
        inspect_labelled(&format!("com.docker.compose.project={}", self.name))
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if !self.down {
            let _ = std::process::Command::new("docker-compose")
                .args(self.args(&["down", "-v", "--remove-orphans", "--timeout", "5"]))
                .output();
        }
        let ids = support::containers_of(&self.instance);
        if !ids.is_empty() {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f"])
                .args(&ids)
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `docker inspect` of every container (running or not) with `label`.
fn inspect_labelled(label: &str) -> Vec<Value> {
    let ids = support::docker_words(&[
        "ps",
        "-aq",
        "--no-trunc",
        "--filter",
        &format!("label={label}"),
    ]);
    if ids.is_empty() {
        return Vec::new();
    }
    let output = std::process::Command::new("docker")
        .arg("inspect")
        .args(&ids)
        .output()
        .expect("docker inspect runs");
    serde_json::from_slice(&output.stdout).expect("docker inspect prints JSON")
}

fn service(container: &Value) -> &str {
    container["Config"]["Labels"]["com.docker.compose.service"]
        .as_str()
        .unwrap_or_default()
}

fn volumes_of(project: &str) -> Vec<String> {
    support::docker_words(&[
        "volume",
        "ls",
        "-q",
        "--filter",
        &format!("label=com.docker.compose.project={project}"),
    ])
}

/// What the compose file promises about isolation, checked on the running containers (the
/// attacker's view: what could a compromised service reach?).
fn assert_hardened(containers: &[Value], socket: &Path) {
    let services: Vec<&str> = containers.iter().map(service).collect();
    for wanted in ["postgres", "migrate", "node", "gateway"] {
        assert!(
            services.contains(&wanted),
            "a {wanted} container: {services:?}"
        );
    }
    for c in containers {
        let name = service(c);
        let user = c["Config"]["User"].as_str().unwrap_or_default();
        assert!(
            !user.is_empty() && user != "root" && !user.starts_with("0:") && user != "0",
            "{name} runs as a non-root user, not {user:?}"
        );
        assert_eq!(
            c["HostConfig"]["ReadonlyRootfs"], true,
            "{name}: read-only root"
        );
        assert_eq!(
            c["HostConfig"]["CapDrop"],
            json!(["ALL"]),
            "{name}: no capabilities"
        );
        let mounts_socket = c["Mounts"].as_array().into_iter().flatten().any(|m| {
            m["Destination"] == "/var/run/docker.sock"
                || m["Source"] == socket.to_str().unwrap_or_default()
        });
        assert_eq!(
            mounts_socket,
            name == "node",
            "{name}: only the node container has the Docker socket"
        );
        // Only the gateway holds secrets; every sandgate service reaches Postgres as its own
        // role over verified TLS.
        let env: Vec<&str> = c["Config"]["Env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let has = |key: &str| env.iter().any(|e| e.starts_with(&format!("{key}=")));
        if name != "postgres" {
            assert_eq!(
                has("SANDGATE_KEYS__SECRET") || has("SANDGATE_OAUTH__COOKIE_SECRET"),
                name == "gateway",
                "{name}: only the gateway has keys.secret and the cookie secret"
            );
            let url = env
                .iter()
                .find_map(|e| e.strip_prefix("SANDGATE_DATABASE__URL="))
                .unwrap_or_default();
            let role = match name {
                "migrate" => "sandgate_migrator",
                "node" => "sandgate_node",
                _ => "sandgate_gateway",
            };
            assert!(
                url.starts_with(&format!("postgres://{role}:"))
                    && url.contains("sslmode=verify-full"),
                "{name} connects as {role} with sslmode=verify-full"
            );
        }
        // Each service mounts only its own TLS material, never the CA's key.
        for m in c["Mounts"].as_array().into_iter().flatten() {
            let source = m["Source"].as_str().unwrap_or_default();
            if source.contains("/pki") {
                assert!(
                    source.ends_with(&format!("/pki/{name}")) && m["RW"] == false,
                    "{name} mounts only its own TLS directory, read-only: {m}"
                );
            }
        }
        let published: Vec<&Value> = c["HostConfig"]["PortBindings"]
            .as_object()
            .into_iter()
            .flat_map(|ports| ports.values())
            .filter_map(|bindings| bindings.as_array())
            .flatten()
            .collect();
        if name == "gateway" {
            assert!(!published.is_empty(), "the gateway publishes its port");
        }
        for binding in published {
            assert_eq!(
                binding["HostIp"], "127.0.0.1",
                "{name} publishes only on loopback: {binding}"
            );
            assert_eq!(
                name, "gateway",
                "only the gateway publishes a port ({binding})"
            );
        }
    }
}

#[tokio::test]
async fn compose_up_serves_mcp_on_loopback_and_down_leaves_nothing() {
    let (gateway_image, postgres_image) = tokio::join!(gateway_image(), postgres_image());
    let mut project = Project::new(&gateway_image, &postgres_image);
    project.compose(&["up", "-d", "--no-color"]).await;
    project.wait_ready().await;
    assert_hardened(&project.containers(), &docker_socket());

    // Anonymous: a request without a token is refused with the OAuth challenge.
    let anonymous = reqwest::Client::new()
        .post(format!("{}/mcp", project.base_url()))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#)
        .send()
        .await
        .expect("the published port answers");
    assert_eq!(anonymous.status(), 401, "no token: 401");

    // The operator's path to a token: the admin CLI inside the container.
    let tenant = project
        .sandgate(&["admin", "tenant", "create", "deploy-e2e"])
        .await;
    let token = project
        .sandgate(&[
            "admin", "token", "issue", "--tenant", &tenant, "--ttl", "1h",
        ])
        .await;

    let mcp_url = format!("{}/mcp", project.base_url());
    for era in [Era::Stateless, Era::Sessions] {
        let client = Client::connect(&mcp_url, &token, era)
            .await
            .unwrap_or_else(|e| panic!("rmcp's client connects ({era:?}): {e}"));
        let conversation = format!("deploy-{era:?}");
        let created = client
            .ok("create_sandbox", json!({"conversation_id": conversation}))
            .await;
        let sandbox_id = created.structured["sandbox_id"]
            .as_str()
            .expect("a sandbox id")
            .to_owned();
        // The node made the sandbox on the host's engine, labelled with the instance, and talks
        // to its agent over the attach stream through the mounted socket; the gateway reached
        // it over the node RPC (mutual TLS).
        assert!(
            !support::containers_of(&project.instance).is_empty(),
            "sandbox containers of instance {} on the host's engine",
            project.instance
        );
        let cell = client
            .ok(
                "execute_code",
                json!({"sandbox_id": sandbox_id, "code": "import subprocess\nsubprocess.run(['echo', 'from a child'])\nx = 40\nx + 2"}),
            )
            .await;
        assert_eq!(
            cell.structured["stdout"], "from a child\n",
            "{era:?}: child output"
        );
        assert_eq!(
            cell.structured["result"]["text/plain"], "42",
            "{era:?}: the last expression's value"
        );
        let again = client
            .ok(
                "execute_code",
                json!({"sandbox_id": sandbox_id, "code": "x"}),
            )
            .await;
        assert_eq!(
            again.structured["result"]["text/plain"], "40",
            "{era:?}: state kept"
        );
        let closed = client
            .ok("close_sandbox", json!({"sandbox_id": sandbox_id}))
            .await;
        assert_eq!(closed.structured["closed"], true);
        client.service.cancel().await.expect("the client closes");
    }

    project.compose(&["down", "-v", "--timeout", "20"]).await;
    project.down = true;
    let left: Vec<&str> = Vec::new();
    let containers = project.containers();
    assert_eq!(
        containers.iter().map(service).collect::<Vec<_>>(),
        left,
        "no container of project {} is left after down -v",
        project.name
    );
    assert_eq!(
        volumes_of(&project.name),
        Vec::<String>::new(),
        "no volume of project {} is left after down -v",
        project.name
    );
    // Sandboxes outlive `down` by design (the next `up` re-attaches); removing the deployment for
    // good is the documented second step (docs/scale-out.md).
    let sandboxes = support::containers_of(&project.instance);
    if !sandboxes.is_empty() {
        run_ok(
            "docker rm -f of the instance's sandboxes",
            "docker",
            &[
                &["rm", "-f"][..],
                &sandboxes.iter().map(String::as_str).collect::<Vec<_>>(),
            ]
            .concat(),
            COMPOSE_DEADLINE,
        )
        .await;
    }
    assert!(
        support::containers_of(&project.instance).is_empty(),
        "no sandbox container of instance {} is left",
        project.instance
    );
}
