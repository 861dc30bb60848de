//! The private listener (`metrics.listen`): a `sandgate node` answers its probes and is scraped
//! there (it has no other HTTP), and a gateway with one serves `/metrics` there and no longer on
//! its public port, so a proxy in front of the public port cannot expose it.

use std::time::Duration;

use reqwest::StatusCode;

use crate::support::node::{NodeStart, TlsFiles};
use crate::support::{self, Gateway};

/// A loopback address with a port nobody listens on now.
fn free_loopback_addr() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    probe.local_addr().expect("bound").to_string()
}

/// GET `url` until it answers (the listener comes up with the process), then its status and body.
async fn get_when_up(url: &str) -> (StatusCode, String) {
    support::eventually(Duration::from_secs(120), url, || async {
        let response = reqwest::get(url).await.ok()?;
        let status = response.status();
        Some((status, response.text().await.ok()?))
    })
    .await
}

#[tokio::test]
async fn a_node_answers_its_probes_and_metrics_on_the_private_listener() {
    let database = support::fresh_database().await;
    let instance = format!(
        "e2e-nprobe-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let tls = TlsFiles::new(&instance);
    let addr = free_loopback_addr();
    let _node = NodeStart::new(&database, &instance)
        .tls(&tls)
        .env([("SANDGATE_METRICS__LISTEN", addr.as_str())])
        .start()
        .await;

    let (status, body) = get_when_up(&format!("http://{addr}/healthz")).await;
    assert_eq!(status, StatusCode::OK, "/healthz: {body}");
    // Ready once Postgres, the engine and the image answer (a liveness probe never waits on it).
    let ready = support::eventually(Duration::from_secs(120), "the node ready", || async {
        let response = reqwest::get(format!("http://{addr}/readyz")).await.ok()?;
        (response.status() == StatusCode::OK).then_some(())?;
        response.json::<serde_json::Value>().await.ok()
    })
    .await;
    for check in ["postgres", "docker", "sandbox_image"] {
        assert_eq!(
            ready["checks"][check]["ok"],
            serde_json::Value::Bool(true),
            "the node's /readyz checks {check}: {ready}"
        );
    }
    let (status, metrics) = get_when_up(&format!("http://{addr}/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    for series in [
        "sandgate_pool_ready_sandboxes",
        "sandgate_pool_target_sandboxes",
    ] {
        assert!(
            metrics.contains(series),
            "the node exports its own pool ({series}):\n{metrics}"
        );
    }
    support::remove_containers_of(&instance);
}

#[tokio::test]
async fn a_gateway_with_a_private_listener_keeps_metrics_off_its_public_port() {
    let database = support::fresh_database().await;
    let addr = free_loopback_addr();
    let gateway = Gateway::start(&database, &[("SANDGATE_METRICS__LISTEN", addr.as_str())]).await;

    let public = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("the public port answers");
    assert_eq!(
        public.status(),
        StatusCode::NOT_FOUND,
        "/metrics is not on the public port once a private listener is configured"
    );
    let (status, metrics) = get_when_up(&format!("http://{addr}/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        metrics.contains("sandgate_tool_calls")
            || metrics.contains("sandgate_pool_ready_sandboxes"),
        "the gateway's metrics are on the private listener:\n{metrics}"
    );
    let public_ready = reqwest::get(format!("{}/readyz", gateway.base_url))
        .await
        .expect("the public port answers");
    assert_ne!(
        public_ready.status(),
        StatusCode::NOT_FOUND,
        "the public port keeps its probes"
    );
    let (status, _) = get_when_up(&format!("http://{addr}/healthz")).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the private listener answers /healthz too"
    );
    support::remove_containers_of(&gateway.instance);
}
