//! Through a separate node (issue 15): `execute_code 1+1` through a `serve --gateway-only`
//! gateway and a `sandgate node` process on this engine, over the node RPC with mutual TLS (a CA
//! made here), to set beside `mcp.exec_1p1` (gateway and node in one process). The in-process
//! gateway of the other rows is stopped by then, and this deployment has a database of its own,
//! so its node is the only one registered for the engine.

use super::*;

/// `mcp.exec_1p1_via_node`: `1+1` in a 2025-11-25 session through a gateway-only replica and a
/// node process, after 10 unmeasured calls. A deployment that does not start is the row's error,
/// not the whole run's.
pub(crate) async fn bench_via_node(opts: &Options, docker: &Docker) -> Row {
    let samples = match via_node(opts, docker).await {
        Ok(samples) => samples,
        Err(err) => {
            let mut failed = Samples::default();
            failed.fail(format!("{err:#}"));
            failed
        }
    };
    Row::ms(
        "mcp.exec_1p1_via_node",
        "sandgate via MCP",
        "execute_code 1+1 through a gateway-only replica and a sandgate node (mutual TLS)",
        &samples,
    )
    .vs("mcp.exec_1p1")
}

async fn via_node(opts: &Options, docker: &Docker) -> Result<Samples> {
    let c = opts.counts;
    let db = fresh_database().await?;
    let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let tls = NodeTls::new(&instance)?;
    let node =
        NodeProcess::start(&db, &instance, &tls, &[("SANDGATE_POOL__MIN_READY", "1")]).await?;
    let mut settings = tls.env();
    settings.push(("SANDGATE_INSTANCE".into(), instance.clone()));
    let gateway = Gateway::spawn(&db, 1000, settings, &["serve", "--gateway-only"]).await;
    let result = async {
        let gateway = gateway?;
        let samples = exec_through(&gateway, &node, c).await;
        gateway.stop(docker).await;
        samples
    }
    .await;
    node.stop().await;
    remove_instance(docker, &instance).await;
    drop_database(&db).await;
    drop(tls);
    result
}

async fn exec_through(gateway: &Gateway, node: &NodeProcess, c: Counts) -> Result<Samples> {
    // The node's warm pool has its sandbox, so the create is a warm lease like the other rows'.
    let deadline = Instant::now() + Duration::from_secs(180);
    while node.ready.load(Ordering::SeqCst) < 1 {
        if Instant::now() > deadline {
            bail!("the node's warm pool did not fill within 180 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let token = gateway.token().await?;
    let client = Client::connect(&gateway.mcp_url, &token, Era::Sessions)
        .await
        .map_err(|e| anyhow!(e))?;
    let created = call_ok(
        &client,
        "create_sandbox",
        json!({"conversation_id": "via-node"}),
    )
    .await?;
    let id = sandbox_id(&created)?;
    wait_quiet(Duration::from_secs(90)).await;
    let exec = exec_1p1(&client, &id, c.exec, &Budget::secs(240)).await;
    Ok(exec)
}
