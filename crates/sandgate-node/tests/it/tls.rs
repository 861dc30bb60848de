//! Node certificates and the address gateways dial: a node advertised by an IP address (a pod IP
//! on Kubernetes) verifies when its certificate carries that IP as a SAN, and only then; a DNS
//! name and an IP address never stand in for each other.

use sandgate_node::{NodeService, RemoteNode};
use sandgate_sandbox::{ChannelError, SandboxError};

use crate::support::TestNode;

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
