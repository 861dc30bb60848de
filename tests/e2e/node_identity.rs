//! Node identity (docs/security.md, hole 8), played against the real binaries: a gateway never
//! dials a registered node in cleartext beyond this host's own loopback, whatever its row says; a
//! `sandgate node` answers only gateway certificates of its CA (not a leaf without key usage, not
//! another node's); it refuses to start with a certificate that is not a node's or does not name
//! its advertise_url; `deploy/pki.sh` issues what each role needs, from an existing CA too, and a
//! certificate it revokes is refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sandgate_node::test_pki::Leaf;
use sandgate_node::{NodeTls, RemoteNode};
use sandgate_sandbox::{ChannelError, SandboxError};
use serde_json::json;

use crate::lifecycle::db;
use crate::mcp_client::{Client, Era};
use crate::support::node::{NodeStart, TlsFiles};
use crate::support::{self, Gateway};

/// Whether a gateway dialing `url` with `tls` gets an answer from the node (a typed refusal of
/// an unknown container) rather than a failed handshake.
async fn answered(url: &str, tls: &NodeTls) -> bool {
    let client = RemoteNode::connect_lazy(url, tls).expect("a client");
    match client.adopt("any-container").await {
        Err(SandboxError::Channel(ChannelError::AttachLost { .. })) => false,
        Err(_) => true,
        Ok(_) => panic!("{url}: no container named any-container exists"),
    }
}

#[tokio::test]
async fn a_fake_node_row_with_a_cleartext_url_of_another_host_is_never_dialled() {
    let database = support::fresh_database().await;
    let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    // "Another host": a loopback address other than 127.0.0.1, with a listener that counts who
    // connects.
    let listener = tokio::net::TcpListener::bind("127.0.0.2:0")
        .await
        .expect("a port on 127.0.0.2");
    let addr = listener.local_addr().expect("its address");
    let dialled = Arc::new(AtomicUsize::new(0));
    let counter = dialled.clone();
    let accepting = tokio::spawn(async move {
        while let Ok((_socket, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    let gateway = Gateway::start_gateway_only(
        &database,
        &instance,
        &[("SANDGATE_NODE__LOST_AFTER_SECONDS", "600")],
    )
    .await;
    // (after the gateway's migrations made the table)
    // The attacker's row: a fresh heartbeat and the most room, so placement picks it.
    let fake = "fake-node";
    sqlx::query(
        "INSERT INTO nodes (id, name, advertise_url, slots, memory_bytes, draining, process)
         VALUES ($1, 'attacker', $2, 100000, 1099511627776, false, gen_random_uuid())",
    )
    .bind(fake)
    .bind(format!("http://{addr}"))
    .execute(&mut db(&database).await)
    .await
    .expect("the fake row");
    let tenant = gateway.create_tenant().await;
    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&tenant).await,
        Era::Stateless,
    )
    .await
    .expect("connects");
    for attempt in 0..3 {
        sqlx::query("UPDATE nodes SET heartbeat_at = now() WHERE id = $1")
            .bind(fake)
            .execute(&mut db(&database).await)
            .await
            .expect("a fresh heartbeat");
        let refused = client
            .call(
                "execute_code",
                json!({"conversation_id": format!("c{attempt}"), "code": "1 + 1"}),
            )
            .await
            .expect("a tool result");
        assert!(
            refused.is_error,
            "a sandbox placed on a cleartext node of another host cannot run: {}",
            refused.text
        );
        assert!(
            refused.text.contains(fake) && refused.text.contains("retry"),
            "the answer names the node and is retryable: {}",
            refused.text
        );
    }
    // A dial connects before the call's answer (the channel connects on first use).
    assert_eq!(
        dialled.load(Ordering::SeqCst),
        0,
        "the gateway must never connect to http://{addr}"
    );
    accepting.abort();
}

#[tokio::test]
async fn sandgate_node_answers_only_gateway_certificates_of_its_ca() {
    let database = support::fresh_database().await;
    let instance = format!(
        "e2e-id-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let tls = TlsFiles::new(&instance);
    let node = NodeStart::new(&database, &instance).tls(&tls).start().await;
    let pki = tls.pki();
    assert!(
        answered(&node.url, &pki.tls_of(Leaf::Gateway)).await,
        "a gateway certificate of the CA is answered (so the refusals below are the roles' doing)"
    );
    assert!(
        !answered(&node.url, &pki.tls_of(Leaf::NoUsage)).await,
        "a leaf of the CA with no key usage must be refused"
    );
    assert!(
        !answered(&node.url, &pki.tls_of(Leaf::Node)).await,
        "a node certificate presented as a gateway must be refused"
    );
}

/// Runs `deploy/pki.sh` with `args`; its standard output.
fn pki_sh(args: &[&str]) -> String {
    let out = std::process::Command::new(repo_root().join("deploy/pki.sh"))
        .args(args)
        .output()
        .expect("deploy/pki.sh runs");
    assert!(
        out.status.success(),
        "deploy/pki.sh {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|p| p.join("deploy/pki.sh").exists())
        .expect("the repository root")
        .to_owned()
}

/// `node.tls_*` for the files of `dir` (a directory pki.sh wrote).
fn tls_env(dir: &Path) -> Vec<(String, String)> {
    ["cert:tls.crt", "key:tls.key", "ca:ca.crt"]
        .iter()
        .map(|kv| {
            let (key, file) = kv.split_once(':').expect("key:file");
            (
                format!("SANDGATE_NODE__TLS_{}", key.to_uppercase()),
                dir.join(file).display().to_string(),
            )
        })
        .collect()
}

fn tls_of(dir: &Path, crl: Option<&Path>) -> NodeTls {
    NodeTls::from_files_with_crl(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        &dir.join("ca.crt"),
        crl,
    )
    .expect("pki.sh's files")
}

#[tokio::test]
async fn pki_sh_issues_per_role_certificates_that_sandgate_node_holds_to_their_roles() {
    let database = support::fresh_database().await;
    let instance = format!(
        "e2e-pki-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let dir = std::env::temp_dir().join(format!("sandgate-{instance}"));
    let d = dir.display().to_string();
    pki_sh(&[&d]);
    pki_sh(&["add-node", &d, "n1", "--ip", "127.0.0.1"]);
    pki_sh(&["add-node", &d, "elsewhere", "--dns", "node-9.example"]);
    pki_sh(&["add-gateway", &d, "g2"]);

    // A gateway certificate as a node's, and a node certificate for another name: refused at
    // start, saying what to do.
    for (certs, expect) in [
        ("gateway", "not a node certificate"),
        ("nodes/elsewhere", "does not name 127.0.0.1"),
    ] {
        let stderr = NodeStart::new(&database, &instance)
            .env(tls_env(&dir.join(certs)))
            .try_start()
            .await
            .expect_err("the node must refuse its certificate");
        assert!(
            stderr.contains(expect) && stderr.contains("pki.sh"),
            "{certs}: the refusal says {expect:?} and how to issue one, got: {stderr}"
        );
    }

    // The node certificate add-node issued from the existing CA serves; both gateway
    // certificates are answered, a node's is not.
    let node = NodeStart::new(&database, &instance)
        .env(tls_env(&dir.join("nodes/n1")))
        .start()
        .await;
    let mut node = node;
    // NodeStart's URL says http:// unless its own TlsFiles were used.
    let url = node.url.replacen("http://", "https://", 1);
    for gateway in ["gateway", "gateways/g2"] {
        assert!(
            answered(&url, &tls_of(&dir.join(gateway), None)).await,
            "the {gateway} certificate is a gateway's"
        );
    }
    assert!(
        !answered(&url, &tls_of(&dir.join("node"), None)).await,
        "a node certificate is no gateway's"
    );
    node.kill().await;

    // Revoked: the node reads the CRL (node.tls_crl) and refuses the certificate.
    let crl = pki_sh(&[
        "revoke",
        &d,
        &dir.join("gateways/g2/tls.crt").display().to_string(),
    ]);
    let crl = PathBuf::from(crl.trim());
    let mut node = NodeStart::new(&database, &instance)
        .env(tls_env(&dir.join("nodes/n1")))
        .env([("SANDGATE_NODE__TLS_CRL", crl.display().to_string())])
        .start()
        .await;
    let url = node.url.replacen("http://", "https://", 1);
    assert!(
        answered(&url, &tls_of(&dir.join("gateway"), None)).await,
        "an unrevoked gateway is still answered"
    );
    assert!(
        !answered(&url, &tls_of(&dir.join("gateways/g2"), None)).await,
        "a revoked gateway certificate must be refused"
    );
    node.kill().await;
    let _ = std::fs::remove_dir_all(&dir);
}
