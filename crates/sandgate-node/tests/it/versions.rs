//! Node RPC versions (`sandgate_node::version`): a caller older than the node serves is refused
//! with both versions named, a caller from before versions were sent is served, a malformed
//! version is refused, and a node that does not know a call reads as an older node, not as a
//! lost connection.

use sandgate_node::proto::{self, node_client::NodeClient};
use sandgate_node::status::from_status;
use sandgate_node::version::{RPC_OLDEST, RPC_VERSION, VERSION_HEADER};
use sandgate_node::{RemoteNode, channel_lazy};
use sandgate_sandbox::SandboxError;
use tonic::metadata::MetadataValue;

use crate::support::TestNode;

fn pool_stats(version: Option<&str>) -> tonic::Request<proto::PoolStatsRequest> {
    let mut request = tonic::Request::new(proto::PoolStatsRequest {
        profile: "default".into(),
    });
    if let Some(v) = version {
        request
            .metadata_mut()
            .insert(VERSION_HEADER, MetadataValue::try_from(v).expect("ascii"));
    }
    request
}

#[tokio::test]
async fn a_caller_older_than_the_node_serves_is_refused_naming_both_versions() {
    let node = TestNode::start("versions").await;
    let channel = channel_lazy(&node.url(), Some(&node.pki.tls())).expect("a channel");
    let mut raw = NodeClient::new(channel);

    let old = (RPC_OLDEST - 1).to_string();
    let refused = raw
        .pool_stats(pool_stats(Some(&old)))
        .await
        .expect_err("a caller older than RPC_OLDEST is refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let err = from_status(&node.url(), &refused);
    let SandboxError::VersionSkew {
        caller,
        oldest,
        newest,
        ..
    } = &err
    else {
        panic!("a typed version skew: {err:?}");
    };
    assert_eq!(
        (*caller, *oldest, *newest),
        (RPC_OLDEST - 1, RPC_OLDEST, RPC_VERSION)
    );
    assert!(
        err.to_string().contains("upgrade the gateway"),
        "says what to do: {err}"
    );

    let garbled = raw
        .pool_stats(pool_stats(Some("one")))
        .await
        .expect_err("a version that is no number is refused");
    assert_eq!(garbled.code(), tonic::Code::InvalidArgument);
    assert!(garbled.message().contains(VERSION_HEADER), "{garbled:?}");

    // A gateway from before versions were sent speaks version 1.
    raw.pool_stats(pool_stats(None))
        .await
        .expect("a caller without the header is served");
    raw.pool_stats(pool_stats(Some(&RPC_VERSION.to_string())))
        .await
        .expect("the current version is served");
    // And this build's own client stamps a version the node serves.
    assert!(
        node.client().pool_stats("default").await.is_some(),
        "the gateway's client is served"
    );
    node.cleanup().await;
}

#[tokio::test]
async fn a_node_without_a_call_reads_as_an_older_node_not_a_lost_connection() {
    // A server that knows no call at all: every call is `Unimplemented`, as a call added after
    // the node's version would be.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_routes(tonic::service::Routes::default())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
    });
    let url = format!("http://{addr}");
    let node = RemoteNode::connect_lazy_cleartext(&url).expect("a loopback client");
    let err = node
        .adopt("0123456789ab")
        .await
        .expect_err("the call is unknown there");
    assert!(
        matches!(err, SandboxError::OlderNode { .. }),
        "an older node, not a lost connection: {err:?}"
    );
    assert!(
        err.to_string().contains("upgrade nodes before gateways"),
        "{err}"
    );
    server.abort();
}
