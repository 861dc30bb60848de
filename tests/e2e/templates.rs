//! A warm pool restored from a template through the real binary (issue 26): with the sandbox
//! profile on `runsc2024` and the engine's plaintext tmpfs configured, `/readyz` reports snapshots
//! available and the template in use, and a conversation's `create_sandbox` + `execute_code`
//! (rmcp's client) run in a sandbox restored from it, whose first cell is number 1 with pandas
//! loaded. With runc, `/readyz` says why there are no snapshots and sandboxes start afresh.
//!
//! The engine is the one the other tests use; its plaintext tmpfs `SANDGATE_SNAPSHOTS__PLAIN_DIR`
//! (stack.env) or stack.sh's `/var/cache/sandgate/docker/plain`.

use std::time::Duration;

use serde_json::{Value, json};

use crate::mcp_client::{Client, Era};
use crate::support::{self, Gateway};

const LIMIT: Duration = Duration::from_secs(300);

fn plain_dir() -> String {
    std::env::var("SANDGATE_SNAPSHOTS__PLAIN_DIR")
        .unwrap_or_else(|_| "/var/cache/sandgate/docker/plain".into())
}

async fn readyz(gateway: &Gateway) -> Value {
    reqwest::get(format!("{}/readyz", gateway.base_url))
        .await
        .expect("/readyz answers")
        .json()
        .await
        .expect("/readyz is JSON")
}

/// A counter's value in `/metrics` (0 when absent).
async fn counter(gateway: &Gateway, series: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", gateway.base_url))
        .await
        .expect("/metrics answers")
        .text()
        .await
        .expect("a body");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{series} ")))
        .map_or(0.0, |v| v.trim().parse().expect("a number"))
}

#[tokio::test]
async fn a_runsc2024_pool_restored_from_its_template_serves_a_conversation() {
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    // No warm pool: every create is a cold start, which restores the template once it is in use.
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_SANDBOX__RUNTIME", "runsc2024"),
            ("SANDGATE_SNAPSHOTS__PLAIN_DIR", plain.as_str()),
            ("SANDGATE_POOL__MIN_READY", "0"),
            ("SANDGATE_POOL__MAX_READY", "0"),
        ],
    )
    .await;
    let ready = support::eventually(LIMIT, "/readyz to report the template in use", || async {
        let body = readyz(&gateway).await;
        (body["templates"]["default"]["in_use"] == json!(true)).then_some(body)
    })
    .await;
    assert_eq!(ready["status"], "ready", "{ready}");
    assert_eq!(ready["snapshots"]["default"], "available", "{ready}");
    let snapshot_id = ready["templates"]["default"]["snapshot_id"]
        .as_str()
        .unwrap_or_else(|| panic!("the template's id: {ready}"))
        .to_owned();
    assert!(snapshot_id.starts_with("snap_"), "{ready}");
    assert!(
        ready["templates"]["default"]["bytes"].as_u64() > Some(0),
        "{ready}"
    );

    let restored = r#"sandgate_template_restores_total{outcome="restored"}"#;
    let before = counter(&gateway, restored).await;
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let created = client.ok("create_sandbox", json!({})).await;
    let sandbox_id = created.structured["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned();
    let cell = client
        .ok(
            "execute_code",
            json!({
                "sandbox_id": sandbox_id,
                "code": "import sys\nloaded = 'pandas' in sys.modules\nimport pandas\n(loaded, 1 + 1)",
            }),
        )
        .await;
    assert_eq!(
        cell.structured["result"]["text/plain"], "(True, 2)",
        "pandas was loaded before the cell, and 1 + 1 answers: {}",
        cell.text
    );
    assert_eq!(cell.structured["execution_count"], 1, "{}", cell.text);
    assert!(
        counter(&gateway, restored).await > before,
        "the sandbox was restored from the template"
    );
    assert_eq!(
        counter(&gateway, "sandgate_template_fallbacks_total").await,
        0.0,
        "no restore fell back to an ordinary start"
    );
    client
        .ok("close_sandbox", json!({"sandbox_id": sandbox_id}))
        .await;
    // A graceful stop deletes the template's plaintext image from the tmpfs.
    let mut gateway = gateway;
    assert!(gateway.terminate().await, "sandgate stops on SIGTERM");
    let image = std::path::Path::new(&plain)
        .join("sandgate/images")
        .join(&snapshot_id);
    assert!(
        !image.exists(),
        "{} is left after the stop",
        image.display()
    );
}

#[tokio::test]
async fn a_runc_pool_keeps_ordinary_starts_and_readyz_says_why() {
    let database = support::fresh_database().await;
    let _restores = crate::pause::RESTORES.read().await;
    let plain = plain_dir();
    let gateway = Gateway::start(
        &database,
        &[
            ("SANDGATE_SANDBOX__RUNTIME", "runc"),
            ("SANDGATE_SNAPSHOTS__PLAIN_DIR", plain.as_str()),
        ],
    )
    .await;
    let body = support::eventually(
        LIMIT,
        "/readyz to report the snapshot capability",
        || async {
            let body = readyz(&gateway).await;
            (body["snapshots"]["default"] != json!("unknown")).then_some(body)
        },
    )
    .await;
    assert_eq!(
        body["status"], "ready",
        "snapshots are information, never a failure: {body}"
    );
    let why = body["snapshots"]["default"].as_str().unwrap_or_default();
    assert!(why.contains("runc"), "the reason names the runtime: {body}");
    assert_eq!(body["templates"]["default"]["in_use"], false, "{body}");
    let tenant = gateway.create_tenant().await;
    let token = gateway.token(&tenant).await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let cell = client.ok("execute_code", json!({"code": "1 + 1"})).await;
    assert_eq!(
        cell.structured["result"]["text/plain"], "2",
        "{}",
        cell.text
    );
}
