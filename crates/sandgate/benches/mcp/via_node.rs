//! Through a separate node (issue 15): `execute_code 1+1` through a `serve --gateway-only`
//! gateway and a `sandgate node` process on this engine, over the node RPC with mutual TLS (a CA
//! made here), to set beside `mcp.exec_1p1` (gateway and node in one process). The in-process
//! gateway of the other rows is stopped by then, and this deployment has a database of its own,
//! so its node is the only one registered for the engine.

use sandgate_node::test_pki::Pki;

use super::*;

/// A `sandgate node` on a loopback port, until dropped (then killed).
struct NodeProcess {
    /// Held for its `kill_on_drop`.
    _child: tokio::process::Child,
    /// "warm sandbox ready" lines in its log: refills that finished.
    ready: Arc<AtomicUsize>,
}

impl NodeProcess {
    async fn start(database_url: &str, instance: &str, tls: &[(String, String)]) -> Result<Self> {
        let mut child = Command::new(BIN)
            .arg("node")
            .env_remove("RUST_LOG")
            .env("SANDGATE_DATABASE__URL", database_url)
            .env("SANDGATE_INSTANCE", instance)
            .env("SANDGATE_LOG__FORMAT", "json")
            .env(
                "SANDGATE_LOG__FILTER",
                "warn,sandgate_sandbox::manager=debug",
            )
            .env("SANDGATE_POOL__MIN_READY", "1")
            .env("SANDGATE_NODE__LISTEN", "127.0.0.1:0")
            .envs(tls.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting sandgate node")?;
        let ready = Arc::new(AtomicUsize::new(0));
        let counter = ready.clone();
        let stderr = child.stderr.take().context("stderr")?;
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("warm sandbox ready") {
                    counter.fetch_add(1, Ordering::SeqCst);
                } else if !line.starts_with('{') || line.contains("\"level\":\"ERROR\"") {
                    eprintln!("[node] {line}");
                }
            }
        });
        let stdout = child.stdout.take().context("stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .context("sandgate node did not print its address within 120 s")??
            .context("sandgate node exited before printing its address")?;
        if !line.starts_with("sandgate node serving at ") {
            bail!("unexpected first line from sandgate node: {line:?}");
        }
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self {
            _child: child,
            ready,
        })
    }
}

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
    let dir = std::env::temp_dir().join(format!("{instance}-pki"));
    std::fs::create_dir_all(&dir)?;
    let pki = Pki::new("bench deployment CA");
    let (cert, key) = pki.leaf_pem();
    for (name, pem) in [
        ("tls.crt", cert),
        ("tls.key", key),
        ("ca.crt", pki.ca_pem()),
    ] {
        std::fs::write(dir.join(name), pem)?;
    }
    let path = |name: &str| dir.join(name).display().to_string();
    let tls = vec![
        ("SANDGATE_NODE__TLS_CERT".to_owned(), path("tls.crt")),
        ("SANDGATE_NODE__TLS_KEY".to_owned(), path("tls.key")),
        ("SANDGATE_NODE__TLS_CA".to_owned(), path("ca.crt")),
    ];
    let node = NodeProcess::start(&db, &instance, &tls).await?;
    let mut settings = tls.clone();
    settings.push(("SANDGATE_INSTANCE".into(), instance.clone()));
    let gateway = Gateway::spawn(&db, 1000, settings, &["serve", "--gateway-only"]).await;
    let result = async {
        let gateway = gateway?;
        let samples = exec_through(&gateway, &node, c).await;
        gateway.stop(docker).await;
        samples
    }
    .await;
    drop(node);
    remove_instance(docker, &instance).await;
    drop_database(&db).await;
    let _ = std::fs::remove_dir_all(&dir);
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
