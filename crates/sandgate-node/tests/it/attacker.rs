//! Clients without the deployment's certificates get nothing from a node.

use sandgate_node::RemoteNode;
use sandgate_sandbox::{ChannelError, SandboxError};

use crate::support::{Pki, TestNode};

/// The error a refused client sees: no typed failure from the node, only an unreachable node.
fn assert_refused(err: SandboxError, who: &str) {
    match err {
        SandboxError::Channel(ChannelError::AttachLost { reason }) => assert!(
            reason.contains("did not answer"),
            "{who}: the node never answered, got {reason:?}"
        ),
        other => panic!("{who}: expected a refused connection, got {other:?}"),
    }
}

#[tokio::test]
async fn a_client_with_a_certificate_of_another_ca_is_refused() {
    let node = TestNode::start("foreign-ca").await;
    // A certificate from another CA, trusting the node's CA (so only the node's check can fail).
    let other = Pki::new("someone else's CA");
    let tls = other.tls_trusting(&node.pki.ca_pem());
    let client = RemoteNode::connect_lazy(&node.url(), &tls).expect("a client");
    let err = client.adopt("any-container").await.expect_err("refused");
    assert_refused(err, "a client of another CA");
    // The same node answers a client of its own CA (with a typed refusal of the container).
    let err = node
        .client()
        .adopt("any-container")
        .await
        .expect_err("not ours");
    assert!(
        !matches!(err, SandboxError::Channel(ChannelError::AttachLost { .. })),
        "the node answers its own CA's client, got {err:?}"
    );
    node.cleanup().await;
}

#[tokio::test]
async fn a_node_of_another_ca_is_not_trusted_by_the_gateway() {
    let node = TestNode::start("foreign-node").await;
    // The gateway's own CA differs from the one that signed the node's certificate.
    let other = Pki::new("the gateway's CA");
    let client = RemoteNode::connect_lazy(&node.url(), &other.tls()).expect("a client");
    let err = client.adopt("any-container").await.expect_err("refused");
    assert_refused(err, "a gateway that does not trust the node's CA");
    node.cleanup().await;
}

#[tokio::test]
async fn plain_http2_without_tls_is_refused() {
    let node = TestNode::start("plain").await;
    let tcp = tokio::net::TcpStream::connect(node.addr)
        .await
        .expect("the port is open");
    // An HTTP/2 client speaking cleartext: the node expects a TLS handshake and drops it.
    let handshake = h2::client::handshake(tcp).await;
    let refused = match handshake {
        Err(_) => true,
        Ok((mut send, conn)) => {
            let driver = tokio::spawn(conn);
            let request = http::Request::post("/sandgate.node.v1.Node/Ping")
                .header("content-type", "application/grpc")
                .body(())
                .expect("a request");
            let answered = match send.send_request(request, true) {
                Ok((response, _)) => response.await.is_ok(),
                Err(_) => false,
            };
            driver.abort();
            !answered
        }
    };
    assert!(
        refused,
        "a cleartext HTTP/2 request got an answer from the node"
    );
    node.cleanup().await;
}
