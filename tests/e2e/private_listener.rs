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

/// A certificate file's notAfter, Unix seconds, as `openssl x509` reads it.
fn not_after(path: &std::path::Path) -> i64 {
    let output = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-enddate", "-in"])
        .arg(path)
        .output()
        .expect("openssl runs");
    let text = String::from_utf8_lossy(&output.stdout);
    let date = text
        .trim()
        .strip_prefix("notAfter=")
        .unwrap_or_else(|| panic!("openssl prints notAfter: {text}"));
    // e.g. `Jan  2 00:00:00 2031 GMT`
    let date = date.split_whitespace().collect::<Vec<_>>().join(" ");
    chrono::NaiveDateTime::parse_from_str(&date, "%b %d %H:%M:%S %Y GMT")
        .unwrap_or_else(|e| panic!("{date:?}: {e}"))
        .and_utc()
        .timestamp()
}

/// The value of the expiry series of `certificate` in a `/metrics` body.
fn expiry_in(metrics: &str, certificate: &str) -> Option<i64> {
    let prefix = format!(
        "sandgate_tls_certificate_expiry_timestamp_seconds{{certificate=\"{certificate}\"}} "
    );
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
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
    let node = NodeStart::new(&database, &instance)
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
    // The certificates it loaded, with their real notAfter (the CA's too); no path, no id.
    assert_eq!(
        expiry_in(&metrics, "node_server"),
        Some(not_after(&tls.file("tls.crt"))),
        "the node's server certificate expiry:\n{metrics}"
    );
    assert_eq!(
        expiry_in(&metrics, "ca"),
        Some(not_after(&tls.file("ca.crt"))),
        "the CA's expiry:\n{metrics}"
    );
    assert_eq!(
        expiry_in(&metrics, "gateway_client"),
        None,
        "a node is no gateway"
    );
    let dir = tls.file("tls.crt");
    let dir = dir.parent().expect("a directory").to_string_lossy();
    assert!(
        !metrics.contains(dir.as_ref()) && !metrics.contains(node.id()),
        "no certificate path ({dir}) and no node id in the node's /metrics:\n{metrics}"
    );
    // A renewal on disk: the next scrape reports the new certificate, with no restart.
    let (cert, key) = tls.pki().leaf_pem_expiring(2031);
    tls.renew(&cert, &key);
    let renewed = not_after(&tls.file("tls.crt"));
    assert_eq!(
        chrono::DateTime::from_timestamp(renewed, 0).map(|t| t.to_rfc3339()),
        Some("2031-01-02T00:00:00+00:00".to_owned()),
        "the renewed certificate's notAfter"
    );
    let (_, metrics) = get_when_up(&format!("http://{addr}/metrics")).await;
    assert_eq!(
        expiry_in(&metrics, "node_server"),
        Some(renewed),
        "the renewed certificate's expiry:\n{metrics}"
    );
    support::remove_containers_of(&instance);
}

#[tokio::test]
async fn a_gateway_with_a_private_listener_keeps_metrics_off_its_public_port() {
    let database = support::fresh_database().await;
    let addr = free_loopback_addr();
    let tls = TlsFiles::new(&format!(
        "gw-private-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let mut env: Vec<(&str, &str)> = vec![("SANDGATE_METRICS__LISTEN", addr.as_str())];
    let tls_env = tls.env();
    env.extend(tls_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let gateway = Gateway::start(&database, &env).await;

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
    // Its node.tls_cert is its client certificate and its in-process node's server one.
    let cert = not_after(&tls.file("tls.crt"));
    for certificate in ["gateway_client", "node_server"] {
        assert_eq!(
            expiry_in(&metrics, certificate),
            Some(cert),
            "the {certificate} certificate's expiry:\n{metrics}"
        );
    }
    assert_eq!(
        expiry_in(&metrics, "ca"),
        Some(not_after(&tls.file("ca.crt")))
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
