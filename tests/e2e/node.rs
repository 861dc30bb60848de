//! `sandgate node`: the real binary serving its engine's sandboxes over the node RPC with mutual
//! TLS (certificates made here), and refusing an address other hosts can reach without TLS.

use std::process::Stdio;
use std::time::Duration;

use sandgate_node::RemoteNode;
use sandgate_node::test_pki::Pki;
use sandgate_sandbox::{ChannelError, ExecOptions, SandboxError, SandboxProfile};
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
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let pki = Pki::new("e2e deployment CA");
    let (cert, key) = pki.leaf_pem();
    for (name, pem) in [
        ("node.crt", &cert),
        ("node.key", &key),
        ("ca.crt", &pki.ca_pem()),
    ] {
        std::fs::write(dir.join(name), pem).expect("a PEM file");
    }
    let path = |name: &str| dir.join(name).display().to_string();
    let mut child = support::sandgate_command()
        .arg("node")
        .env("SANDGATE_DATABASE__URL", &database)
        .env("SANDGATE_INSTANCE", &instance)
        .env("SANDGATE_POOL__MIN_READY", "0")
        .env("SANDGATE_NODE__LISTEN", "127.0.0.1:0")
        .env("SANDGATE_NODE__TLS_CERT", path("node.crt"))
        .env("SANDGATE_NODE__TLS_KEY", path("node.key"))
        .env("SANDGATE_NODE__TLS_CA", path("ca.crt"))
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("RUST_LOG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .kill_on_drop(true)
        .spawn()
        .expect("the sandgate binary starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("the node prints its address within 60 s")
        .expect("stdout is readable")
        .expect("the node printed a line before exiting (run with RUST_LOG=info to see why)");
    let addr = line
        .strip_prefix("sandgate node serving at ")
        .unwrap_or_else(|| panic!("unexpected first line from sandgate node: {line:?}"))
        .to_owned();
    let url = format!("https://{addr}");

    let gateway = RemoteNode::connect_lazy(&url, &pki.tls()).expect("a client");
    let profile = SandboxProfile {
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
    };
    let sandbox = tokio::time::timeout(Duration::from_secs(180), gateway.launch(&profile))
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
    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Removes the test's containers when it ends, passed or not (the node's warm pool follows
/// demand, so it may have started more than the test leased).
struct RemoveOnDrop(String);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        support::remove_containers_of(&self.0);
    }
}
