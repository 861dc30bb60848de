//! TLS in front, as shipped (issue 25): Debian's nginx running `deploy/nginx/sandgate.conf` in
//! front of two `serve --gateway-only` replicas and two `sandgate node`s on two engines, and
//! Debian's Prometheus running `deploy/prometheus/` against the private listeners of all four.
//! The files are used as written but for addresses, ports and paths, and a proxy read timeout
//! shorter than the calls (3 s rather than 610 s, so nothing waits a minute).
//!
//! Through the proxy: the official Python SDK's support-analyst conversation in both protocol
//! eras; a cell's output arriving as progress notifications while the cell still runs, on a
//! client whose own read timeout is the proxy's (a buffering proxy would hold the stream back and
//! the client give up); calls longer than the proxy's read timeout answered; `/metrics` not found
//! in any spelling. Prometheus scrapes all four targets and loads the alert rules, which
//! `promtool check rules` accepts.

use std::time::Duration;

use crate::lifecycle::FAST;
use crate::support::eventually;
use crate::support::front::{Nginx, Prometheus, free_loopback_addr, promtool, repo_file};
use crate::support::node::{Engine, TlsFiles};
use crate::support::replicas::Deployment;
use crate::support::scale_out::{SECOND_ENGINE, spawn_gateway, spawn_node};

/// The proxy's read (and send) timeout in this test; the calls sleep longer.
const PROXY_READ_TIMEOUT: &str = "3s";
/// How long the long cells sleep, seconds: past two proxy read timeouts.
const SLEEP: &str = "7";

const THROUGH_PROXY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/e2e/python/through_proxy.py"
);

/// `env` as the `(key, value)` pairs the launchers take.
fn pairs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

#[tokio::test]
async fn nginx_with_tls_in_front_of_two_gateways_and_prometheus_scraping_them() {
    let _second_engine = SECOND_ENGINE.lock().await;
    let (first, second) = (Engine::first(), Engine::second());
    let proxy_addr = free_loopback_addr();
    let proxy_port = proxy_addr.rsplit(':').next().expect("a port").to_owned();
    let mut deployment = Deployment::new().await;
    deployment.public_url = Some(format!("https://localhost:{proxy_port}"));
    let tls = TlsFiles::new(&deployment.instance);

    let private: Vec<String> = (0..4).map(|_| free_loopback_addr()).collect();
    let node_env = |addr: &str| -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = FAST
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        env.push(("SANDGATE_METRICS__LISTEN".into(), addr.to_owned()));
        env
    };
    let (env_a, env_b) = (node_env(&private[2]), node_env(&private[3]));
    let _node_a = spawn_node(&deployment, &first, &tls, &pairs(&env_a)).await;
    let _node_b = spawn_node(&deployment, &second, &tls, &pairs(&env_b)).await;
    let gateway_env = |addr: &str| -> Vec<(String, String)> {
        let mut env = node_env(addr);
        env.extend([
            // The one X-Forwarded-For entry the proxy writes (deploy/nginx/sandgate.conf).
            (
                "SANDGATE_HTTP__CLIENT_ADDRESS_HEADER".into(),
                "x-forwarded-for".into(),
            ),
            // Keep-alives well inside the proxy's 3 s read timeout.
            ("SANDGATE_MCP__SSE_KEEP_ALIVE_SECONDS".into(), "1".into()),
        ]);
        env
    };
    let (env_g0, env_g1) = (gateway_env(&private[0]), gateway_env(&private[1]));
    let g0 = spawn_gateway(0, &deployment, &tls, &pairs(&env_g0)).await;
    let g1 = spawn_gateway(1, &deployment, &tls, &pairs(&env_g1)).await;
    let upstreams = [
        g0.base_url.trim_start_matches("http://").to_owned(),
        g1.base_url.trim_start_matches("http://").to_owned(),
    ];
    let upstream_refs: Vec<&str> = upstreams.iter().map(String::as_str).collect();
    let proxy = Nginx::start(&proxy_addr, &upstream_refs, PROXY_READ_TIMEOUT).await;
    let prometheus_addr = free_loopback_addr();
    let prometheus = Prometheus::start(
        &prometheus_addr,
        &[&private[0], &private[1]],
        &[&private[2], &private[3]],
    )
    .await;

    metrics_stay_private(&proxy, &private[0]).await;

    let tenant = g0.create_tenant().await;
    let token = g0.token(&tenant).await;
    let python = crate::python_sdk::python();
    let ca = proxy.ca_file.to_str().expect("utf-8").to_owned();
    let mut runs = tokio::task::JoinSet::new();
    for mode in ["auto", "legacy"] {
        let (python, url, token, ca) = (python.clone(), proxy.mcp_url(), token.clone(), ca.clone());
        runs.spawn(async move {
            let env = [("SSL_CERT_FILE", ca.as_str())];
            let out = crate::python_sdk::run_python_with_env(
                &python,
                crate::python_sdk::SCRIPT,
                &["--mode", mode],
                &url,
                &token,
                &env,
                Duration::from_secs(360),
            )
            .await;
            assert!(
                out.contains(&format!("ok ({mode}")),
                "analyst {mode}: {out}"
            );
            let args = ["--mode", mode, "--sleep", SLEEP, "--read-timeout", "3"];
            let out = crate::python_sdk::run_python_with_env(
                &python,
                THROUGH_PROXY,
                &args,
                &url,
                &token,
                &env,
                Duration::from_secs(240),
            )
            .await;
            assert!(
                out.contains(&format!("ok ({mode}")),
                "through_proxy {mode}: {out}"
            );
        });
    }
    let mut failed = Vec::new();
    while let Some(joined) = runs.join_next().await {
        if let Err(panicked) = joined {
            failed.push(panicked.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "every conversation through the proxy passed; failed: {failed:#?}\nnginx's error log:\n{}",
        proxy.error_log()
    );

    scraped_and_rules_loaded(&prometheus, &private).await;
    crate::support::remove_containers_of(&deployment.instance);
}

/// `/metrics` is not found through the proxy in any spelling nginx or a gateway would take for
/// it, while a gateway's private listener serves it (the check is not vacuous).
async fn metrics_stay_private(proxy: &Nginx, gateway_private: &str) {
    assert_eq!(
        proxy.status("/healthz").await,
        "200",
        "the proxy reaches a gateway"
    );
    assert_eq!(
        proxy.status("/metrics").await,
        "404",
        "GET /metrics through the proxy"
    );
    // Every other spelling is refused too (404 from nginx's rule, or the gateway's own 404 or
    // 401 for a path it does not serve): none is answered with the metrics.
    for path in [
        "/metrics?format=text",
        "//metrics",
        "/./metrics",
        "/x/../metrics",
        "/%6detrics",
        "/metrics/",
    ] {
        let status = proxy.status(path).await;
        assert!(
            ["404", "401"].contains(&status.as_str()),
            "GET {path} through the proxy: {status}"
        );
    }
    let private = reqwest::get(format!("http://{gateway_private}/metrics"))
        .await
        .expect("the private listener answers");
    assert!(
        private.status().is_success(),
        "/metrics on the private listener"
    );
    let text = private.text().await.expect("a body");
    assert!(
        text.contains("sandgate_database_up 1"),
        "the gateway reads Postgres:\n{text}"
    );
}

/// Prometheus sees all four targets up, the gateways' view of two serving nodes, the nodes'
/// pools and every alert rule; `promtool` accepts the rules and the configuration.
async fn scraped_and_rules_loaded(prometheus: &Prometheus, private: &[String]) {
    // The shipped scrape interval is 15 s: the first scrape of each target is within one.
    eventually(Duration::from_secs(90), "all four targets up", || async {
        let targets = prometheus.api("/api/v1/targets").await?;
        let active = targets["data"]["activeTargets"].as_array()?.clone();
        let up: Vec<&str> = active
            .iter()
            .filter(|t| t["health"] == "up")
            .filter_map(|t| t["labels"]["instance"].as_str())
            .collect();
        private
            .iter()
            .all(|p| up.contains(&p.as_str()))
            .then_some(())
    })
    .await;
    let query = |q: &'static str| async move {
        let answer = prometheus.api(&format!("/api/v1/query?query={q}")).await?;
        answer["data"]["result"].as_array().cloned()
    };
    let serving = eventually(Duration::from_secs(60), "the nodes gauge", || async {
        let result =
            query("sandgate_nodes%7Bstate%3D%22serving%22%2Cjob%3D%22sandgate-gateway%22%7D")
                .await?;
        (result.len() == 2).then_some(result)
    })
    .await;
    for sample in &serving {
        assert_eq!(
            sample["value"][1], "2",
            "each gateway sees two serving nodes: {sample}"
        );
    }
    let pools = query("sandgate_pool_target_sandboxes%7Bjob%3D%22sandgate-node%22%7D")
        .await
        .expect("a query answer");
    assert_eq!(pools.len(), 2, "both nodes export their pool: {pools:?}");
    let rules = prometheus.api("/api/v1/rules").await.expect("rules answer");
    let loaded: usize = rules["data"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| g["rules"].as_array().map_or(0, Vec::len))
        .sum();
    let shipped = repo_file("deploy/prometheus/sandgate-alerts.yml")
        .matches("- alert:")
        .count();
    assert_eq!(
        loaded, shipped,
        "Prometheus loaded every alert rule: {rules}"
    );
    let rules_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/prometheus/sandgate-alerts.yml"
    );
    let (ok, out) = promtool(&["check", "rules", rules_path]).await;
    assert!(ok, "promtool check rules: {out}");
    let config = prometheus.config.to_str().expect("utf-8");
    let (ok, out) = promtool(&["check", "config", config]).await;
    assert!(ok, "promtool check config: {out}");
}

/// The shipped alert rules: `promtool check rules` accepts them and their unit tests
/// (`deploy/prometheus/sandgate-alerts.test.yml`: the certificate-expiry alert fires for a
/// certificate under 14 days, not for one at 90, and stops after a renewal) pass.
#[tokio::test]
async fn the_alert_rules_pass_promtool_test_rules() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/prometheus");
    let (ok, out) = promtool(&["check", "rules", &format!("{dir}/sandgate-alerts.yml")]).await;
    assert!(ok, "promtool check rules: {out}");
    let (ok, out) = promtool(&["test", "rules", &format!("{dir}/sandgate-alerts.test.yml")]).await;
    assert!(ok, "promtool test rules: {out}");
    assert!(
        repo_file("deploy/prometheus/sandgate-alerts.yml")
            .contains("sandgate_tls_certificate_expiry_timestamp_seconds"),
        "the certificate-expiry rule is shipped"
    );
}
