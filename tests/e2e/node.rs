//! `sandgate node`: the real binary serving its engine's sandboxes over the node RPC with mutual
//! TLS (certificates made here), and refusing an address other hosts can reach without TLS; pip
//! in a sandbox on it installs through the package index of the gateway that made the call.

use std::process::Stdio;
use std::time::Duration;

use sandgate_node::test_pki::Pki;
use sandgate_node::{RemoteNode, SandboxHandle};
use sandgate_sandbox::{ChannelError, CommandOptions, ExecOptions, SandboxError, SandboxProfile};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support;

#[tokio::test]
async fn sandgate_node_refuses_a_reachable_address_without_tls_naming_the_keys() {
    let output = support::sandgate_command()
        .arg("node")
        .env("SANDGATE_NODE__LISTEN", "0.0.0.0:7443")
        .env(
            "SANDGATE_DATABASE__URL",
            "postgres://nobody@127.0.0.1:1/none",
        )
        .output()
        .await
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the node must refuse to start");
    assert!(
        stderr.contains("node.listen") && stderr.contains("node.tls_cert"),
        "the error names the address key and the TLS keys, got: {stderr}"
    );
}

#[tokio::test]
async fn sandgate_node_serves_its_sandboxes_to_a_gateway_with_a_certificate_of_its_ca() {
    let database = support::fresh_database().await;
    let instance = format!(
        "e2e-node-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let _cleanup = RemoveOnDrop(instance.clone());
    let dir = std::env::temp_dir().join(&instance);
    let pki = write_certificates(&dir);
    let (mut child, addr) = start_node(&database, &instance, &dir)
        .await
        .unwrap_or_else(|stderr| panic!("the node did not start: {stderr}"));
    let url = format!("https://{addr}");

    let gateway = RemoteNode::connect_lazy(&url, &pki.tls()).expect("a client");
    let sandbox = tokio::time::timeout(Duration::from_secs(180), gateway.launch(&profile()))
        .await
        .expect("a launch within 180 s")
        .expect("the node starts a sandbox of its own profile");
    let outcome = sandbox
        .exec("1 + 1", ExecOptions::default(), None)
        .await
        .expect("the cell runs on the node");
    assert_eq!(
        outcome
            .result
            .and_then(|b| b.get("text/plain").cloned())
            .as_deref(),
        Some("2"),
        "the cell's value comes back through the node"
    );
    assert!(
        support::containers_of(&instance).contains(&sandbox.container_id().to_owned()),
        "the sandbox is a container of the node's instance"
    );

    // A client whose certificate another CA signed gets nothing.
    let stranger = RemoteNode::connect_lazy(
        &url,
        &Pki::new("a stranger's CA").tls_trusting(&pki.ca_pem()),
    )
    .expect("a client");
    let refused = stranger
        .adopt(sandbox.container_id())
        .await
        .expect_err("refused");
    assert!(
        matches!(
            refused,
            SandboxError::Channel(ChannelError::AttachLost { .. })
        ),
        "a stranger's call never reaches the node, got {refused:?}"
    );

    gateway
        .remove(sandbox.container_id())
        .await
        .expect("the node removes the container");
    assert!(
        !support::containers_of(&instance).contains(&sandbox.container_id().to_owned()),
        "the container is gone"
    );

    // The node is registered under its engine's id, with the URL it serves.
    let engine = engine_id();
    let listed = admin_cli(&database, &["nodes", "list"]).await;
    assert!(
        listed.contains(&engine) && listed.contains(&url) && listed.contains(" up "),
        "`admin nodes list` shows the node {engine} at {url}, up; got:\n{listed}"
    );

    // A second node on the same engine is refused while the first one heartbeats.
    let second = start_node(&database, &format!("{instance}-2"), &dir).await;
    let stderr = second
        .map(|(child, addr)| (child.id(), addr))
        .expect_err("a second node on the same engine must not start");
    assert!(
        stderr.contains("another sandgate node already serves this Docker engine")
            && stderr.contains(&url),
        "the refusal names the engine's node, got: {stderr}"
    );

    // Draining and taking back.
    admin_cli(&database, &["nodes", "drain", &engine]).await;
    let listed = admin_cli(&database, &["nodes", "list"]).await;
    assert!(
        listed.contains(" draining "),
        "the node shows as draining:\n{listed}"
    );
    admin_cli(&database, &["nodes", "undrain", &engine]).await;
    let listed = admin_cli(&database, &["nodes", "list"]).await;
    assert!(
        listed.contains(" up "),
        "the node takes leases again:\n{listed}"
    );
    let unknown = admin_cli_fails(&database, &["nodes", "drain", "no-such-engine"]).await;
    assert!(
        unknown.contains("no sandbox node with id"),
        "draining an unknown node says so, got: {unknown}"
    );

    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The node's `default` profile by name (image and runtime are the node's own).
fn profile() -> SandboxProfile {
    SandboxProfile {
        name: "default".into(),
        image: String::new(),
        runtime: sandgate_sandbox::OciRuntime::Runc,
        memory_mb: 512,
        cpus: 1.0,
        pids_limit: 256,
        nofile: 1024,
        tmp_size_mb: 64,
        home_size_mb: 512,
        packages_size_mb: 256,
    }
}

/// Writes a node certificate of a new CA into `dir` (`node.crt`, `node.key`, `ca.crt`); the CA.
fn write_certificates(dir: &std::path::Path) -> Pki {
    std::fs::create_dir_all(dir).expect("a temp dir");
    let pki = Pki::new("e2e deployment CA");
    let (cert, key) = pki.leaf_pem();
    for (name, pem) in [
        ("node.crt", &cert),
        ("node.key", &key),
        ("ca.crt", &pki.ca_pem()),
    ] {
        std::fs::write(dir.join(name), pem).expect("a PEM file");
    }
    pki
}

#[tokio::test]
async fn pip_on_a_sandgate_node_installs_through_the_gateways_package_index() {
    let (upstream, addr, _wheels) = crate::packages::serve_index().await;
    let cache = crate::packages::TempDir::new("sandgate-test-node-wheel-cache");
    // The gateway's side: the service's own package index (policy, wheels only, hashes, cache),
    // fetching from the test's loopback index.
    let index = sandgate_service::packages::PackageIndex::new(
        &sandgate_service::packages::PackagesConfig {
            enabled: true,
            index_url: format!("http://{addr}/simple/"),
            ca_bundle: String::new(),
            cache_dir: cache.path().display().to_string(),
            max_wheel_mb: 10,
            fetch_timeout_seconds: 30,
        },
        None,
    )
    .expect("a package index");

    let database = support::fresh_database().await;
    let instance = format!(
        "e2e-node-pip-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let _cleanup = RemoveOnDrop(instance.clone());
    let dir = std::env::temp_dir().join(&instance);
    let pki = write_certificates(&dir);
    let (mut child, addr) = start_node(&database, &instance, &dir)
        .await
        .unwrap_or_else(|stderr| panic!("the node did not start: {stderr}"));
    let gateway =
        RemoteNode::connect_lazy(&format!("https://{addr}"), &pki.tls()).expect("a client");
    let sandbox = tokio::time::timeout(Duration::from_secs(180), gateway.launch(&profile()))
        .await
        .expect("a launch within 180 s")
        .expect("the node starts a sandbox");
    let handle = SandboxHandle::Remote(sandbox.clone());
    let handler = index.for_call(uuid::Uuid::new_v4(), handle.id());
    let options = CommandOptions {
        timeout: Duration::from_secs(120),
        ..CommandOptions::default()
    };
    let installed = handle
        .with_index(
            &handler,
            handle.command("pip install sgdemo", options, None),
        )
        .await
        .expect("the command runs on the node");
    assert_eq!(
        installed.exit_code,
        Some(0),
        "pip on the node installs through the gateway; stdout: {}\nstderr: {}",
        installed.stdout,
        installed.stderr
    );
    assert!(
        installed
            .stdout
            .contains("Successfully installed sgdemo-1.0 sgdemo-dep-1.0")
            || installed
                .stdout
                .contains("Successfully installed sgdemo-dep-1.0 sgdemo-1.0"),
        "the package and its dependency: {}",
        installed.stdout
    );
    assert_eq!(
        upstream.downloads_of("sgdemo-1.0-py3-none-any.whl"),
        1,
        "the gateway fetched the wheel from its upstream"
    );
    let imported = handle
        .exec("import sgdemo; sgdemo.ANSWER", ExecOptions::default(), None)
        .await
        .expect("the next cell runs");
    assert_eq!(
        imported
            .result
            .and_then(|b| b.get("text/plain").cloned())
            .as_deref(),
        Some("42"),
        "the next cell imports what pip installed"
    );

    // The gateway's refusals reach pip on the node as in one process: no sdist is ever built.
    let sdist = handle
        .with_index(
            &handler,
            handle.command("pip install sgsdist", CommandOptions::default(), None),
        )
        .await
        .expect("the command runs");
    assert_ne!(sdist.exit_code, Some(0), "an sdist-only package is refused");
    assert!(
        format!("{}{}", sdist.stdout, sdist.stderr).contains("publishes no binary wheel"),
        "pip prints the gateway's reason: {sdist:?}"
    );

    gateway
        .remove(sandbox.container_id())
        .await
        .expect("the node removes the container");
    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts `sandgate node` on a free loopback port with the certificates in `dir`; its child and
/// address once it serves, or its standard error when it exits first.
async fn start_node(
    database: &str,
    instance: &str,
    dir: &std::path::Path,
) -> Result<(tokio::process::Child, String), String> {
    let path = |name: &str| dir.join(name).display().to_string();
    let mut child = support::sandgate_command()
        .arg("node")
        .env("SANDGATE_DATABASE__URL", database)
        .env("SANDGATE_INSTANCE", instance)
        .env("SANDGATE_POOL__MIN_READY", "0")
        .env("SANDGATE_NODE__LISTEN", "127.0.0.1:0")
        .env("SANDGATE_NODE__TLS_CERT", path("node.crt"))
        .env("SANDGATE_NODE__TLS_KEY", path("node.key"))
        .env("SANDGATE_NODE__TLS_CA", path("ca.crt"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the sandgate binary starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("the node prints its address or exits within 60 s")
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
        tokio::spawn(async move { while let Ok(Some(_)) = err.next_line().await {} });
    }
    Ok((child, addr))
}

/// The engine's id, as `docker info` reports it.
fn engine_id() -> String {
    let output = std::process::Command::new("docker")
        .args(["info", "--format", "{{.ID}}"])
        .output()
        .expect("the docker CLI runs");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// Runs `sandgate admin …` against `database`; its standard output (it must succeed).
async fn admin_cli(database: &str, args: &[&str]) -> String {
    admin_run(database, args, true).await
}

/// Runs `sandgate admin …` that must fail; its standard error.
async fn admin_cli_fails(database: &str, args: &[&str]) -> String {
    admin_run(database, args, false).await
}

/// Runs `sandgate admin …`, checks it succeeded or failed as `succeed` says, and returns its
/// standard output (success) or standard error (failure).
async fn admin_run(database: &str, args: &[&str], succeed: bool) -> String {
    let output = support::sandgate_command()
        .arg("admin")
        .args(args)
        .env("SANDGATE_DATABASE__URL", database)
        .output()
        .await
        .expect("the binary runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    assert_eq!(
        output.status.success(),
        succeed,
        "sandgate admin {args:?}: unexpected exit; stderr: {stderr}"
    );
    if succeed { stdout } else { stderr }
}

/// Removes the test's containers when it ends, passed or not (the node's warm pool follows
/// demand, so it may have started more than the test leased).
struct RemoveOnDrop(String);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        support::remove_containers_of(&self.0);
    }
}
