//! Clients without the deployment's certificates get nothing from a node, and a node's own
//! failures (its engine's words, paths, addresses) never reach the gateway, only an incident id
//! that the node's log holds beside them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandgate_node::{NodeService, RemoteNode};
use sandgate_sandbox::{ChannelError, SandboxError, SandboxManager, SandboxProfile};

use crate::support::{Pki, TestNode, profile, within};

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

/// Everything logged on this thread (the test's runtime runs the node's tasks here too).
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log")).into_owned()
    }
}

/// Asserts that an error a gateway got from the node holds none of `secrets`, in its text or
/// anywhere in it (it names the node's URL, for the gateway's log: the model reads a fixed
/// text for it), and returns its incident id.
fn incident_of(err: &SandboxError, starting: bool, secrets: &[&str]) -> String {
    let whole = format!("{err} {err:?}");
    for secret in secrets {
        assert!(
            !whole.contains(secret),
            "the gateway got the node's internals ({secret:?}): {whole}"
        );
    }
    match err {
        SandboxError::NodeFailed {
            incident,
            starting: s,
            ..
        } if *s == starting => incident.clone(),
        other => panic!("expected a node failure (starting: {starting}), got {other:?}"),
    }
}

#[tokio::test]
async fn a_nodes_own_failure_reaches_the_gateway_as_an_incident_id_never_its_error_chain() {
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    // A profile of the node's whose image its engine does not have: starting it fails in the
    // engine, with the engine's words (the image's name among them).
    let missing = format!(
        "sandgate-test-missing-{}:never-built",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let broken = SandboxProfile {
        name: "broken".into(),
        image: missing.clone(),
        ..profile()
    };
    let manager: Arc<Mutex<Option<SandboxManager>>> = Arc::default();
    let kept = manager.clone();
    let node = TestNode::start_with_profiles("incident", vec![profile(), broken.clone()], |m| {
        *kept.lock().expect("manager") = Some(m.clone());
        NodeService::new(m)
    })
    .await;
    let client = node.client();
    let limit = Duration::from_secs(120);

    // In one process the same start fails in the engine, with its words in the error's chain.
    let manager = manager
        .lock()
        .expect("manager")
        .clone()
        .expect("the node's manager");
    let local = within(limit, "a local start", manager.launch("broken"))
        .await
        .expect_err("the image is missing");
    assert!(
        matches!(local, SandboxError::Launch(_)),
        "a start that the engine refuses: {local:?}"
    );

    // Through the RPC: a start the engine refuses, and a request the node refuses (the tenant's
    // CPUs beyond what a profile may have).
    let refused_start = within(limit, "a remote start", client.launch(&broken))
        .await
        .expect_err("the image is missing");
    let start = incident_of(
        &refused_start,
        true,
        &[missing.as_str(), "image", "No such"],
    );
    let oversized = SandboxProfile {
        cpus: 1000.0,
        ..profile()
    };
    let refused_request = within(limit, "an oversized start", client.launch(&oversized))
        .await
        .expect_err("1000 CPUs are refused");
    let request = incident_of(&refused_request, false, &["cpus", "at most 64"]);
    assert_ne!(start, request, "each failure has its own incident");

    // The node's log has each incident beside its whole chain: the operator greps for the id.
    let text = log.text();
    for (incident, words) in [(&start, missing.as_str()), (&request, "cpus")] {
        let line = text
            .lines()
            .find(|l| l.contains(incident.as_str()))
            .unwrap_or_else(|| panic!("the node's log names incident {incident}:\n{text}"));
        assert!(
            line.contains(words),
            "the node's log line of incident {incident} holds the reason ({words}): {line}"
        );
    }
    node.cleanup().await;
}
