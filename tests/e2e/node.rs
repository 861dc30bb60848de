//! `sandgate node`: the real binary serving its engine's sandboxes over the node RPC with mutual
//! TLS (certificates made here), and refusing an address other hosts can reach without TLS; pip
//! in a sandbox on it installs through the package index of the gateway that made the call.

use std::time::Duration;

use sandgate_node::test_pki::Pki;
use sandgate_node::{RemoteNode, SandboxHandle};
use sandgate_sandbox::{ChannelError, CommandOptions, ExecOptions, SandboxError, SandboxProfile};

use crate::support;
use crate::support::node::{NodeStart, TlsFiles};

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
    let tls = TlsFiles::new(&instance);
    let node = NodeStart::new(&database, &instance).tls(&tls).start().await;
    let url = node.url.clone();

    let gateway = RemoteNode::connect_lazy(&url, &tls.pki().tls()).expect("a client");
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
        &Pki::new("a stranger's CA").tls_trusting(&tls.pki().ca_pem()),
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
    let engine = node.id();
    let listed = admin_cli(&database, &["nodes", "list"]).await;
    assert!(
        listed.contains(engine) && listed.contains(&url) && listed.contains(" up "),
        "`admin nodes list` shows the node {engine} at {url}, up; got:\n{listed}"
    );
    // `node.slots` is 0 here: the slots are the host's memory over what one sandbox of the
    // default profile may use at most, so sandboxes at their limits fit together.
    let (slots, memory): (i32, i64) =
        sqlx::query_as("SELECT slots, memory_bytes FROM nodes WHERE id = $1")
            .bind(engine)
            .fetch_one(&mut crate::lifecycle::db(&database).await)
            .await
            .expect("the node's row");
    let most = SandboxProfile::default().container_memory_mb();
    assert_eq!(
        i64::from(slots),
        (memory / i64::try_from(most * 1024 * 1024).expect("fits")).max(1),
        "{slots} slots for {memory} bytes and sandboxes of {most} MiB"
    );

    // A second node on the same engine is refused while the first one heartbeats.
    let second = NodeStart::new(&database, &format!("{instance}-2"))
        .tls(&tls)
        .try_start()
        .await;
    let stderr = second.expect_err("a second node on the same engine must not start");
    assert!(
        stderr.contains("another sandgate node already serves this Docker engine")
            && stderr.contains(&url),
        "the refusal names the engine's node, got: {stderr}"
    );

    // Draining and taking back.
    admin_cli(&database, &["nodes", "drain", engine]).await;
    let listed = admin_cli(&database, &["nodes", "list"]).await;
    assert!(
        listed.contains(" draining "),
        "the node shows as draining:\n{listed}"
    );
    admin_cli(&database, &["nodes", "undrain", engine]).await;
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
}

/// The node's `default` profile by name (image and runtime are the node's own).
fn profile() -> SandboxProfile {
    SandboxProfile {
        image: String::new(),
        ..SandboxProfile::default()
    }
}

#[tokio::test]
async fn pip_on_a_sandgate_node_installs_through_the_gateways_package_index() {
    let (upstream, addr, _wheels) = crate::packages::serve_index().await;
    let cache = crate::wheels::TempDir::new("sandgate-test-node-wheel-cache");
    // The gateway's side: the service's own package index (policy, wheels only, hashes, cache),
    // fetching from the test's loopback index.
    let index = sandgate_service::packages::PackageIndex::new(
        &sandgate_service::packages::PackagesConfig {
            enabled: true,
            index_url: format!("http://{addr}/simple/"),
            ca_bundle: String::new(),
            cache_dir: cache.path().display().to_string(),
            cache_max_mb: 100,
            max_wheel_mb: 10,
            tenant_download_mb_per_hour: 100,
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
    let tls = TlsFiles::new(&instance);
    let node = NodeStart::new(&database, &instance).tls(&tls).start().await;
    let gateway = RemoteNode::connect_lazy(&node.url, &tls.pki().tls()).expect("a client");
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
