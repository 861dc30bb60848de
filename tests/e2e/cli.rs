//! The binary's operational surface: configuration errors, health and readiness, shutdown.

use std::time::Duration;

use crate::support::{self, Gateway, TcpProxy};

#[tokio::test]
async fn a_bad_listen_address_fails_naming_the_key() {
    let output = support::sandgate_command()
        .arg("serve")
        .env("SANDGATE_LISTEN", "nonsense")
        .env(
            "SANDGATE_DATABASE__URL",
            "postgres://nobody@127.0.0.1:1/none",
        )
        .output()
        .await
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "serve must refuse a bad listen address"
    );
    assert!(
        stderr.contains("listen"),
        "the error should name `listen`, got: {stderr}"
    );
}

#[tokio::test]
async fn readyz_names_postgres_when_it_goes_away_and_recovers_when_it_returns() {
    let database = support::fresh_database().await;
    let proxy = TcpProxy::start(support::addr_of(&database)).await;
    let proxied = support::with_addr(&database, proxy.addr);
    let mut gateway = Gateway::start(&proxied, &[("SANDGATE_POOL__MIN_READY", "0")]).await;
    let http = reqwest::Client::new();

    let health = http
        .get(format!("{}/healthz", gateway.base_url))
        .send()
        .await
        .expect("healthz answers");
    assert_eq!(health.status(), 200);
    assert!(
        health.headers().contains_key("x-request-id"),
        "responses carry a request id"
    );

    let ready = http
        .get(format!("{}/readyz", gateway.base_url))
        .send()
        .await
        .expect("readyz answers");
    let status = ready.status();
    let body: serde_json::Value = ready.json().await.expect("readyz is JSON");
    assert_eq!(status, 200, "ready with the whole stack up: {body}");
    for check in ["postgres", "docker", "sandbox_image"] {
        assert_eq!(
            body["checks"][check]["ok"], true,
            "check {check} should pass: {body}"
        );
    }
    // It says which engine serves the profile: the one the suite runs on.
    let runtime = std::env::var("SANDGATE_TEST_RUNTIME").unwrap_or_else(|_| "runc".into());
    let engine = body["engines"]["default"].as_str().unwrap_or_default();
    let expected = if runtime == "lean" {
        "lean (forked from a warmed zygote)".to_owned()
    } else {
        format!("docker ({runtime})")
    };
    assert_eq!(
        engine, expected,
        "the default profile's engine is named: {body}"
    );

    // Postgres disappears (every connection cut, nothing listening): readiness must say so.
    let upstream = support::addr_of(&database);
    proxy.stop().await;
    let body = support::eventually(Duration::from_secs(15), "readyz to turn 503", || async {
        let response = http
            .get(format!("{}/readyz", gateway.base_url))
            .send()
            .await
            .ok()?;
        (response.status() == 503).then_some(())?;
        response.json::<serde_json::Value>().await.ok()
    })
    .await;
    assert_eq!(body["status"], "not_ready");
    assert_eq!(
        body["checks"]["postgres"]["ok"], false,
        "postgres named as failing: {body}"
    );
    assert_eq!(
        body["checks"]["docker"]["ok"], true,
        "docker still fine: {body}"
    );

    // It comes back on the same address: the gateway recovers without a restart.
    let proxy = restart_proxy_on(proxy_addr_of(&proxied), upstream).await;
    support::eventually(Duration::from_secs(15), "readyz to recover", || async {
        let response = http
            .get(format!("{}/readyz", gateway.base_url))
            .send()
            .await
            .ok()?;
        (response.status() == 200).then_some(())
    })
    .await;
    assert!(
        gateway.terminate().await,
        "SIGTERM shuts the gateway down cleanly"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn readyz_names_a_missing_sandbox_image() {
    let database = support::fresh_database().await;
    let gateway = Gateway::start(
        &database,
        &[("SANDGATE_SANDBOX__IMAGE", "sandgate-sandbox:does-not-exist")],
    )
    .await;
    let response = reqwest::get(format!("{}/readyz", gateway.base_url))
        .await
        .expect("readyz answers");
    assert_eq!(response.status(), 503);
    let body: serde_json::Value = response.json().await.expect("JSON");
    assert_eq!(body["checks"]["sandbox_image"]["ok"], false, "{body}");
    let error = body["checks"]["sandbox_image"]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("does-not-exist") && error.contains("build"),
        "says which image and how to fix: {error}"
    );
}

fn proxy_addr_of(url: &str) -> std::net::SocketAddr {
    support::addr_of(url).parse().expect("proxy address")
}

async fn restart_proxy_on(addr: std::net::SocketAddr, upstream: String) -> support::TcpProxy {
    support::TcpProxy::start_on(addr, upstream).await
}
