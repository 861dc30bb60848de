//! `deploy/compose.yaml` end to end: the gateway, Postgres and proxy images built here
//! (offline), the stack's sandbox image, the node RPC's certificates and the proxy's made by
//! `deploy/pki.sh`, `docker-compose up` with a project name and a loopback port of this test's
//! own (Postgres, a gateway-only gateway, a node against this host's engine, nginx with TLS in
//! front), a real MCP conversation through the proxy over TLS with the official Python SDK in
//! both eras (trusting the deployment's CA), `/metrics` refused by the proxy, then `down -v` and
//! nothing of the project left on the engine.
//!
//! Needs `docker-compose` (Debian's 1.29; `scripts/stack.sh` installs it) and the stack's
//! environment (`SANDGATE_SANDBOX__IMAGE`; the engine on a local unix socket).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{gateway_image, postgres_image, proxy_image, repo_root, run, run_ok};
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

/// A static PEP 503 index in `dir`: `simple/<project>/index.html` linking each wheel (with its
/// sha256, which the gateway checks) under `files/`; readable by the index container's user.
fn static_index(dir: &Path) -> PathBuf {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::PermissionsExt;
    let built = crate::wheels::build(
        "sandgate-compose-index",
        &[crate::wheels::Wheel {
            name: "sgcompose",
            version: "1.0",
            source: "ANSWER = 'installed through the compose gateway'\n",
            requires: &[],
        }],
    );
    let files = dir.join("files");
    std::fs::create_dir_all(&files).expect("the index's directory");
    for entry in std::fs::read_dir(built.path()).expect("the built wheels") {
        let entry = entry.expect("a wheel");
        let name = entry.file_name().to_string_lossy().into_owned();
        let bytes = std::fs::read(entry.path()).expect("the wheel's bytes");
        std::fs::write(files.join(&name), &bytes).expect("the wheel is copied");
        let project = name
            .split('-')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        let page = dir.join("simple").join(&project);
        std::fs::create_dir_all(&page).expect("the project's directory");
        let sha: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        std::fs::write(
            page.join("index.html"),
            format!(
                "<!DOCTYPE html><html><body>\n<a href=\"../../files/{name}#sha256={sha}\">{name}</a><br/>\n</body></html>\n"
            ),
        )
        .expect("the project page is written");
    }
    // The container's user (1000) reads it; the test's temporary directories are private.
    for path in [dir.parent().expect("the project's directory"), dir] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .expect("the directory is opened");
    }
    let _ = std::process::Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(dir)
        .status();
    dir.to_path_buf()
}

/// The name the proxy's certificate is for and `PUBLIC_URL` names (with the port).
const PUBLIC_HOST: &str = "localhost";

const CONVERSATION: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/e2e/python/compose_deploy.py"
);

/// A compose project of this test: its own name, env file (with secrets made here) and loopback
/// port (the proxy's). Dropping it runs `down -v` and removes the sandbox containers of its instance, so a
/// failing test leaves nothing either.
struct Project {
    name: String,
    instance: String,
    dir: PathBuf,
    env_file: PathBuf,
    compose_file: String,
    /// The test's own additions (the package index service), a second `--file`.
    test_file: String,
    port: u16,
    /// The deployment's CA (`deploy/pki.sh`), which signed the proxy's certificate.
    ca_file: PathBuf,
    down: bool,
}

impl Project {
    fn new(gateway_image: &str, postgres_image: &str, proxy_image: &str) -> Project {
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
        // ...and the proxy's certificate, for the name PUBLIC_URL has.
        let made = std::process::Command::new(repo_root().join("deploy/pki.sh"))
            .arg("add-proxy")
            .arg(&pki)
            .args([PUBLIC_HOST, "--dns", PUBLIC_HOST])
            .output()
            .expect("deploy/pki.sh add-proxy runs");
        assert!(
            made.status.success(),
            "deploy/pki.sh add-proxy failed: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        // The package index a PyPI mirror would be, inside the compose network (containers do
        // not reach this host's loopback): static PEP 503 pages and wheels built here, served
        // by Python's http.server in a container of the sandbox image (which has python3).
        let index = static_index(&dir.join("index"));
        let test_file = dir.join("compose.test.yaml");
        std::fs::write(
            &test_file,
            format!(
                "services:\n  index:\n    image: \"${{SANDBOX_IMAGE}}\"\n    entrypoint: [\"python3\", \"-m\", \"http.server\", \"--directory\", \"/index\", \"--bind\", \"0.0.0.0\", \"8000\"]\n    read_only: true\n    cap_drop: [ALL]\n    volumes: [\"{}:/index:ro\"]\n    networks: [frontend]\n",
                index.display()
            ),
        )
        .expect("the test's compose file is written");
        // The operator's env file (deploy/compose.env.example), with secrets of this test's own.
        let env = format!(
            "GATEWAY_IMAGE={gateway_image}\nPOSTGRES_IMAGE={postgres_image}\nSANDBOX_IMAGE={sandbox_image}\n\
             PROXY_IMAGE={proxy_image}\nPROXY_ADDRESS=127.0.0.1\nPROXY_PORT={port}\n\
             PROXY_TLS_DIR={}/proxies/{PUBLIC_HOST}\nPUBLIC_URL=https://{PUBLIC_HOST}:{port}\n\
             DOCKER_GID={gid}\nDOCKER_SOCKET={}\n\
             INSTANCE={instance}\nPKI_DIR={}\nPOSTGRES_PASSWORD={}\nKEYS_SECRET={}\nCOOKIE_SECRET={}\n\
             MIGRATOR_DB_PASSWORD={}\nGATEWAY_DB_PASSWORD={}\nNODE_DB_PASSWORD={}\n\
             PACKAGES_INDEX_URL=http://index:8000/simple/\n",
            pki.display(),
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
            test_file: test_file.to_str().expect("a UTF-8 path").to_owned(),
            port,
            ca_file: pki.join("ca.crt"),
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
            "--file",
            &self.test_file,
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

    /// The proxy's URL, as `PUBLIC_URL` says it.
    fn base_url(&self) -> String {
        format!("https://{PUBLIC_HOST}:{}", self.port)
    }

    /// An HTTPS client that trusts the deployment's CA and nothing else.
    fn http(&self) -> reqwest::Client {
        let pem = std::fs::read(&self.ca_file).expect("the deployment's CA");
        reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("a PEM certificate"))
            .https_only(true)
            .build()
            .expect("an HTTPS client")
    }

    /// Polls `/readyz` through the proxy until it answers 200; panics with the logs after the
    /// deadline.
    async fn wait_ready(&self) {
        let http = self.http();
        let start = Instant::now();
        let mut last = String::new();
        while start.elapsed() < Duration::from_secs(180) {
            match http.get(format!("{}/readyz", self.base_url())).send().await {
                Ok(r) if r.status().is_success() => return,
                Ok(r) => last = format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
                Err(e) => last = format!("{e:?}"),
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
    for wanted in ["postgres", "migrate", "node", "gateway", "proxy"] {
        assert!(
            services.contains(&wanted),
            "a {wanted} container: {services:?}"
        );
    }
    for c in containers {
        let name = service(c);
        if name == "index" {
            // The test's package index, not the deployment's.
            continue;
        }
        let networks: Vec<&String> = c["NetworkSettings"]["Networks"]
            .as_object()
            .map(|n| n.keys().collect())
            .unwrap_or_default();
        if name == "proxy" {
            assert!(
                networks.iter().all(|n| n.ends_with("_frontend")),
                "the proxy is on the frontend network only (nothing of the backend): {networks:?}"
            );
        } else if name != "gateway" {
            assert!(
                networks.iter().all(|n| n.ends_with("_backend")),
                "{name} is on the internal backend network only (no way out): {networks:?}"
            );
        }
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
        if name == "proxy" {
            assert!(
                !env.iter().any(|e| e.starts_with("SANDGATE_")),
                "the proxy has no sandgate configuration, let alone secrets: {env:?}"
            );
        } else if name != "postgres" {
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
                let own = match name {
                    "proxy" => format!("/pki/proxies/{PUBLIC_HOST}"),
                    _ => format!("/pki/{name}"),
                };
                assert!(
                    source.ends_with(&own) && m["RW"] == false,
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
        if name == "proxy" {
            assert!(!published.is_empty(), "the proxy publishes its port");
        }
        for binding in published {
            assert_eq!(
                binding["HostIp"], "127.0.0.1",
                "{name} publishes only on loopback (PROXY_ADDRESS of the test): {binding}"
            );
            assert_eq!(
                name, "proxy",
                "only the proxy publishes a port, not the gateway ({binding})"
            );
        }
    }
}

/// `/metrics` through the proxy is refused in every spelling (nginx's rule, or the gateway's own
/// 404 or 401: its metrics are on their own listener), while the gateway's metrics listener
/// answers on the compose network (the refusal is not vacuous).
async fn metrics_stay_private(project: &Project) {
    let http = project.http();
    for path in [
        "/metrics",
        "/metrics/",
        "/%6detrics",
        "/metrics?format=text",
    ] {
        let answer = http
            .get(format!("{}{path}", project.base_url()))
            .send()
            .await
            .expect("the proxy answers");
        let status = answer.status().as_u16();
        let body = answer.text().await.unwrap_or_default();
        assert!(
            [404, 401].contains(&status) && !body.contains("sandgate_"),
            "GET {path} through the proxy is refused, not answered with the metrics: {status}"
        );
    }
    // From a container on the frontend network (the test's index, which has python3).
    let script = "import urllib.request\nprint(urllib.request.urlopen('http://gateway:9464/metrics').read().decode())";
    let metrics = project
        .compose(&["exec", "-T", "index", "python3", "-c", script])
        .await;
    assert!(
        metrics.contains("sandgate_database_up 1"),
        "the gateway's metrics listener serves them on the compose network:\n{metrics}"
    );
}

#[tokio::test]
async fn compose_up_serves_mcp_through_tls_proxy_and_down_leaves_nothing() {
    let (gateway_image, postgres_image, proxy_image) =
        tokio::join!(gateway_image(), postgres_image(), proxy_image());
    let mut project = Project::new(&gateway_image, &postgres_image, &proxy_image);
    project.compose(&["up", "-d", "--no-color"]).await;
    project.wait_ready().await;
    assert_hardened(&project.containers(), &docker_socket());

    // A client that does not trust the deployment's CA is refused by TLS itself.
    let untrusting = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .build()
        .expect("a client");
    assert!(
        untrusting
            .get(format!("{}/healthz", project.base_url()))
            .send()
            .await
            .is_err(),
        "the proxy's certificate is checked against the deployment's CA only"
    );

    // Anonymous: a request without a token is refused with the OAuth challenge, naming the
    // public URL (the proxy kept Host).
    let anonymous = project
        .http()
        .post(format!("{}/mcp", project.base_url()))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#)
        .send()
        .await
        .expect("the proxy answers");
    assert_eq!(anonymous.status(), 401, "no token: 401");
    let challenge = anonymous
        .headers()
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        challenge.contains(&project.base_url()),
        "the challenge points at the public URL {}: {challenge}",
        project.base_url()
    );
    metrics_stay_private(&project).await;

    // The operator's path to a token: the admin CLI inside the container.
    let tenant = project
        .sandgate(&["admin", "tenant", "create", "deploy-e2e"])
        .await;
    let token = project
        .sandgate(&[
            "admin", "token", "issue", "--tenant", &tenant, "--ttl", "1h",
        ])
        .await;

    // The official Python SDK through the proxy over TLS, trusting the deployment's CA, in both
    // eras at once: the node makes the sandboxes on the host's engine (labelled with the
    // instance) and the gateway reaches it over the node RPC (mutual TLS). In one era pip in
    // the sandbox (no network): the agent's loopback index, relayed by the node to the gateway,
    // which downloads from the index service and checks the sha256.
    let python = crate::python_sdk::python();
    let mcp_url = format!("{}/mcp", project.base_url());
    let ca = project.ca_file.to_str().expect("a UTF-8 path").to_owned();
    let trust = [("SSL_CERT_FILE", ca.as_str())];
    let (auto, legacy) = tokio::join!(
        crate::python_sdk::run_python_with_env(
            &python,
            CONVERSATION,
            &["--mode", "auto", "--pip", "sgcompose"],
            &mcp_url,
            &token,
            &trust,
            Duration::from_secs(300),
        ),
        crate::python_sdk::run_python_with_env(
            &python,
            CONVERSATION,
            &["--mode", "legacy"],
            &mcp_url,
            &token,
            &trust,
            Duration::from_secs(300),
        ),
    );
    assert!(
        auto.contains("ok (auto"),
        "the 2026-07-28 conversation: {auto}"
    );
    assert!(
        auto.contains("sgcompose.ANSWER = 'installed through the compose gateway'"),
        "the next cell imports the package pip installed: {auto}"
    );
    assert!(
        legacy.contains("ok (legacy"),
        "the 2025-11-25 conversation: {legacy}"
    );

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
