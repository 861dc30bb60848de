//! Egress in a deployment with separate nodes (issue 29, docs/egress.md "Where the egress
//! component runs"): the sandbox runs on a `sandgate node` process, and a `serve --gateway-only`
//! replica holds the egress component. The node relays the sandbox's CONNECTs back to the
//! gateway on the call's own stream; the gateway decides them by the tenant's policy, dials,
//! terminates TLS for a host a secret is bound to and fills the value in, and audits. The node
//! carries the intercepted connection's TLS bytes only: the value is never on it nor in the
//! sandbox. Under runsc as under runc (scripts/test.sh runs the `egress` tests in both passes).

use std::time::Duration;

use serde_json::json;

use crate::egress_secrets::{get_cell, https_server, run, sandbox_of, search_cell, sha256_hex};
use crate::mcp_client::{Client, Era};
use crate::support::node::NodeStart;
use crate::support::{self, Gateway};

#[tokio::test]
async fn egress_from_a_sandbox_on_a_sandgate_node_is_decided_and_filled_in_by_the_gateway() {
    let pki = sandgate_node::test_pki::Pki::new("sandgate e2e split egress test CA");
    let (port, seen) = https_server(&pki, &["shop.sandgate.test", "plain.sandgate.test"]).await;
    let dir = std::env::temp_dir().join(format!("sandgate-egress-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("test-ca.pem");
    std::fs::write(&ca_file, pki.ca_pem()).unwrap();
    let server = format!("127.0.0.1:{port}");
    let hosts = format!(
        "shop.sandgate.test={server},plain.sandgate.test={server},private.sandgate.test=10.1.2.3"
    );

    let database = support::fresh_database().await;
    let instance = format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    // The node gets none of the egress settings: it decides nothing.
    let node = NodeStart::new(&database, &instance).start().await;
    let gateway = Gateway::start_gateway_only(
        &database,
        &instance,
        &[
            ("SANDGATE_EGRESS__TEST_HOSTS", &hosts),
            ("SANDGATE_EGRESS__TEST_CA_FILE", ca_file.to_str().unwrap()),
        ],
    )
    .await;
    let acme = gateway.create_tenant().await;
    let other = gateway.create_tenant().await;
    for name in ["shop", "plain", "private"] {
        let rule = format!("{name}.sandgate.test:{port}");
        gateway
            .cli(&["admin", "tenant", "egress", &acme, "--allow", &rule])
            .await;
    }
    let value = format!("shpat_{}", uuid::Uuid::new_v4().simple());
    gateway
        .cli_stdin(
            &[
                "admin",
                "tenant",
                "secret",
                "set",
                &acme,
                "SHOP_TOKEN",
                "--host",
                "shop.sandgate.test",
                "--header",
                "authorization",
            ],
            &value,
        )
        .await;

    let client = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&acme).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    let sandbox = sandbox_of(&client, "split-egress-1").await;
    assert!(
        !node.engine.containers_of(&instance).is_empty(),
        "the sandbox runs on the node's engine (the replica has none)"
    );

    // The variables reached the sandbox through the node.
    let env = run(
        &client,
        &sandbox,
        "import os\nprint(os.environ['SHOP_TOKEN'])\nprint(os.environ['HTTPS_PROXY'])",
    )
    .await;
    let placeholder = env.lines().next().unwrap_or_default().to_owned();
    assert!(
        placeholder.starts_with("sgp_") && env.ends_with("http://127.0.0.1:3128"),
        "a sandbox on a node gets the proxy and a placeholder: {env}"
    );

    // The bound host: the value in the header at the server, the echo redacted.
    let url = format!("https://shop.sandgate.test:{port}/echo");
    let got = run(
        &client,
        &sandbox,
        &get_cell(&url, "{'Authorization': 'Bearer ' + tok}", "True"),
    )
    .await;
    let head = seen
        .lock()
        .unwrap()
        .last()
        .cloned()
        .unwrap_or_default()
        .to_lowercase();
    assert!(
        head.contains(&format!("authorization: bearer {}", value.to_lowercase())),
        "the server got the value in the bound header: {head} (the cell: {got})"
    );
    assert!(
        got.starts_with("STATUS 200")
            && got.contains(&format!("ECHO Bearer {placeholder}"))
            && !got.contains(&value),
        "the echo comes back with the placeholder only: {got}"
    );

    // A host no secret is bound to: a plain tunnel, the placeholder goes as it is.
    let plain = run(
        &client,
        &sandbox,
        &get_cell(
            &format!("https://plain.sandgate.test:{port}/echo"),
            "{'Authorization': 'Bearer ' + tok}",
            "False",
        ),
    )
    .await;
    let head = seen.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(
        plain.starts_with("STATUS 200") && head.contains(&placeholder) && !head.contains(&value),
        "an unbound host gets the placeholder only: {plain} / {head}"
    );

    // Refusals come from the gateway's policy and address checks, with their reasons.
    let before = seen.lock().unwrap().len();
    for (target, why) in [
        (
            "other.sandgate.test",
            "is not in this tenant's egress policy",
        ),
        ("private.sandgate.test", "10.1.2.3"),
    ] {
        let out = run(
            &client,
            &sandbox,
            &get_cell(&format!("https://{target}:{port}/"), "{}", "False"),
        )
        .await;
        assert!(
            out.starts_with("ERROR ProxyError") && out.contains("403") && out.contains(why),
            "{target} is refused for {why}: {out}"
        );
    }
    assert_eq!(
        seen.lock().unwrap().len(),
        before,
        "refused connections never reach a server"
    );

    // A terminal command relays through the node too.
    let command = client
        .ok(
            "run_terminal_command",
            json!({
                "sandbox_id": sandbox,
                "command": format!(
                    "python3 -c \"import os, requests; print(requests.get('https://shop.sandgate.test:{port}/echo', headers={{'Authorization': 'Bearer ' + os.environ['SHOP_TOKEN']}}, timeout=60).status_code)\""
                ),
                "timeout_seconds": 120,
            }),
        )
        .await;
    let head = seen
        .lock()
        .unwrap()
        .last()
        .cloned()
        .unwrap_or_default()
        .to_lowercase();
    assert!(
        command.structured["stdout"].as_str().map(str::trim) == Some("200")
            && head.contains(&format!("authorization: bearer {}", value.to_lowercase())),
        "a command reaches the bound host with the value filled in: {} / {head}",
        command.text
    );

    // Nothing in the sandbox on the node holds the value.
    let searched = run(
        &client,
        &sandbox,
        &search_cell("shpat_", value.len(), &sha256_hex(value.as_bytes())),
    )
    .await;
    assert!(
        !searched.contains("FOUND") && searched.contains("SEARCHED "),
        "the search found no value in the sandbox: {searched}"
    );

    // A tenant without a policy gets no variables (its client finds no route), and a CONNECT
    // to the proxy by hand is refused.
    let theirs = Client::connect(
        &gateway.mcp_url(),
        &gateway.token(&other).await,
        Era::Stateless,
    )
    .await
    .expect("client connects");
    let their_sandbox = sandbox_of(&theirs, "split-egress-2").await;
    let out = run(
        &theirs,
        &their_sandbox,
        &format!(
            "import os, requests\nprint(sorted(k for k in os.environ if 'proxy' in k.lower()))\n\
             try:\n    requests.get('{url}', timeout=30)\nexcept Exception as err:\n    print('DIRECT', type(err).__name__)\n\
             try:\n    requests.get('{url}', timeout=30, proxies={{'https': 'http://127.0.0.1:3128'}})\nexcept Exception as err:\n    print('PROXY', err)\n"
        ),
    )
    .await;
    assert!(
        out.starts_with("[]\nDIRECT ConnectionError\nPROXY")
            && out.contains("403")
            && out.contains("no egress policy"),
        "a tenant without policy gets nothing: {out}"
    );

    // The gateway audited each connection: the injection by name, the refusals.
    let trail = support::eventually(
        Duration::from_secs(30),
        "egress connections audited",
        || async {
            let trail = gateway.cli(&["admin", "audit", "--tenant", &acme]).await;
            (trail.matches("egress_connect").count() >= 5).then_some(trail)
        },
    )
    .await;
    assert!(
        trail.contains("intercepted, secrets injected: SHOP_TOKEN")
            && trail.contains(&format!("other.sandgate.test:{port} refused"))
            && trail.contains("10.1.2.3")
            && !trail.contains(&value),
        "{trail}"
    );
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
}
