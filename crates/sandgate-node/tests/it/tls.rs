//! Node certificates and the address gateways dial: a node advertised by an IP address (a pod IP
//! on Kubernetes) verifies when its certificate carries that IP as a SAN, and only then; a DNS
//! name and an IP address never stand in for each other. Each side holds its peer to its role (a
//! node answers gateway certificates only, a gateway dials node certificates only), and renewed
//! files serve the next connection with no restart.

use sandgate_node::test_pki::Leaf;
use sandgate_node::{NodeService, NodeTls, RemoteNode};
use sandgate_sandbox::{ChannelError, SandboxError};

use crate::support::{Pki, TestNode};

/// Whether a gateway of the node's CA dialing `url` gets an answer from the node (a typed refusal
/// of an unknown container) rather than a failed handshake.
async fn answered(node: &TestNode, url: &str) -> bool {
    let client = RemoteNode::connect_lazy(url, &node.pki.tls()).expect("a client");
    match client.adopt("any-container").await {
        Err(SandboxError::Channel(ChannelError::AttachLost { reason })) => {
            assert!(
                reason.contains("did not answer"),
                "{url}: a refused handshake reads as an unreachable node, got {reason:?}"
            );
            false
        }
        Err(_) => true,
        Ok(_) => panic!("{url}: no container named any-container exists"),
    }
}

#[tokio::test]
async fn a_node_dialed_by_ip_address_verifies_with_that_ip_in_its_certificate() {
    // Like a pod advertised as https://10.1.2.3:7443: listens on a loopback address other than
    // 127.0.0.1, its certificate names that address only (an IP SAN, no DNS name).
    let node = TestNode::start_with(
        "ip-san",
        "127.0.0.2",
        Some(&["127.0.0.2"]),
        NodeService::new,
    )
    .await;
    let url = format!("https://127.0.0.2:{}", node.addr.port());
    assert!(
        answered(&node, &url).await,
        "a certificate with the node's IP SAN verifies for {url}"
    );
    node.cleanup().await;
}

#[tokio::test]
async fn a_certificate_for_a_dns_name_is_refused_for_an_ip_url_and_the_reverse() {
    // Only a DNS name: good for https://localhost:…, refused for https://127.0.0.1:….
    let dns = TestNode::start_with(
        "dns-only",
        "127.0.0.1",
        Some(&["localhost"]),
        NodeService::new,
    )
    .await;
    let port = dns.addr.port();
    assert!(
        answered(&dns, &format!("https://localhost:{port}")).await,
        "the DNS name of the certificate verifies (so the refusal below is the name's doing)"
    );
    assert!(
        !answered(&dns, &format!("https://127.0.0.1:{port}")).await,
        "a certificate without an IP SAN must not verify for an IP URL"
    );
    dns.cleanup().await;

    // Only an IP address: good for https://127.0.0.1:…, refused for https://localhost:….
    let ip = TestNode::start_with(
        "ip-only",
        "127.0.0.1",
        Some(&["127.0.0.1"]),
        NodeService::new,
    )
    .await;
    let port = ip.addr.port();
    assert!(
        answered(&ip, &format!("https://127.0.0.1:{port}")).await,
        "the IP SAN of the certificate verifies"
    );
    assert!(
        !answered(&ip, &format!("https://localhost:{port}")).await,
        "a certificate with only an IP SAN must not verify for a DNS name"
    );
    ip.cleanup().await;
}

/// Whether a gateway dialing `url` with `tls` gets an answer from the node (see [`answered`]).
async fn answered_with(url: &str, tls: &NodeTls) -> bool {
    let client = RemoteNode::connect_lazy(url, tls).expect("a client");
    match client.adopt("any-container").await {
        Err(SandboxError::Channel(ChannelError::AttachLost { reason })) => {
            assert!(
                reason.contains("did not answer"),
                "{url}: a refused handshake reads as an unreachable node, got {reason:?}"
            );
            false
        }
        Err(_) => true,
        Ok(_) => panic!("{url}: no container named any-container exists"),
    }
}

#[tokio::test]
async fn a_node_answers_only_gateway_certificates_of_its_ca() {
    let node = TestNode::start("roles").await;
    let url = node.url();
    assert!(
        answered_with(&url, &node.pki.tls_of(Leaf::Gateway)).await,
        "a gateway certificate of the CA (clientAuth, the gateway URI) is answered"
    );
    assert!(
        !answered_with(&url, &node.pki.tls_of(Leaf::NoUsage)).await,
        "a leaf of the CA with no extended key usage (any use, to the Web PKI) is no gateway"
    );
    assert!(
        !answered_with(&url, &node.pki.tls_of(Leaf::Node)).await,
        "a node's certificate presented as a client is no gateway"
    );
    node.cleanup().await;
}

#[tokio::test]
async fn a_gateway_refuses_a_server_without_a_node_certificate() {
    for leaf in [Leaf::Gateway, Leaf::NoUsage] {
        let pki = Pki::new("roles CA");
        let tls = pki.tls_of(leaf);
        let node = TestNode::start_presenting("server-role", pki, tls).await;
        assert!(
            !answered_with(&node.url(), &node.pki.tls_of(Leaf::Gateway)).await,
            "a server presenting a {leaf:?} certificate of the CA is not a node"
        );
        node.cleanup().await;
    }
}

#[tokio::test]
async fn renewed_files_serve_the_next_connection_without_a_restart() {
    let dir = std::env::temp_dir().join(format!("sandgate-renew-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let write = |pki: &Pki| {
        let (cert, key) = pki.leaf_pem_of(Leaf::Both, &["127.0.0.1"]);
        // A renewal as cert-manager's csi-driver or a re-run of pki.sh makes it: new files over
        // the old ones.
        std::fs::write(dir.join("tls.key"), key).expect("the key");
        std::fs::write(dir.join("tls.crt"), cert).expect("the certificate");
        std::fs::write(dir.join("ca.crt"), pki.ca_pem()).expect("the CA");
    };
    let (old, new) = (Pki::new("old CA"), Pki::new("new CA"));
    write(&old);
    let files = NodeTls::from_files(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        &dir.join("ca.crt"),
    )
    .expect("the files");
    let node = TestNode::start_presenting("renew", Pki::new("unused"), files).await;
    let url = node.url();
    assert!(
        answered_with(&url, &old.tls_of(Leaf::Gateway)).await,
        "the node serves with the files as they were at start"
    );
    assert!(
        !answered_with(&url, &new.tls_of(Leaf::Gateway)).await,
        "a gateway of the new CA is refused before the renewal (so the answer below is its doing)"
    );
    write(&new);
    assert!(
        answered_with(&url, &new.tls_of(Leaf::Gateway)).await,
        "the next connection after the files changed uses the new certificate and CA"
    );
    assert!(
        !answered_with(&url, &old.tls_of(Leaf::Gateway)).await,
        "a gateway of the old CA is refused once the files changed"
    );
    node.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}
