//! The peers (Python scripts under `bench/peers/`).

use super::*;

pub(crate) fn peers_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/peers")
}

/// The samples of one row a Python script printed: `{"samples_ms": [...], "errors": [...]}`.
pub(crate) fn script_samples(r: &Value) -> Samples {
    Samples {
        ms: r["samples_ms"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default(),
        errors: r["errors"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
    }
}

pub(crate) async fn run_peer(python: &str, script: &str, args: &[String]) -> Result<Vec<Row>> {
    let output = tokio::time::timeout(
        Duration::from_secs(600),
        Command::new(python)
            .arg(peers_dir().join(script))
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .with_context(|| format!("{script} took over 10 minutes"))??;
    if !output.status.success() {
        bail!(
            "{script} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let parsed: Value = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("{script} printed no JSON"))?;
    let mut rows = Vec::new();
    for r in parsed["rows"].as_array().cloned().unwrap_or_default() {
        let id = r["name"].as_str().unwrap_or("?").to_owned();
        let samples = script_samples(&r);
        let (section, what, vs) = match id.as_str() {
            "llm_sandbox.open_run_close" => (
                "llm-sandbox 0.3.46",
                "SandboxSession: open + run print(1+1) + close",
                "mcp.create_first_run",
            ),
            "llm_sandbox.run" => (
                "llm-sandbox 0.3.46",
                "SandboxSession.run print(1+1), repeated (no state kept)",
                "mcp.exec_1p1",
            ),
            "llm_sandbox.interactive_open" => (
                "llm-sandbox 0.3.46",
                "InteractiveSandboxSession: open (IPython runner ready)",
                "mcp.create_warm",
            ),
            "llm_sandbox.interactive_run" => (
                "llm-sandbox 0.3.46",
                "InteractiveSandboxSession.run, repeated (state kept)",
                "mcp.exec_1p1",
            ),
            "kernel_gateway.kernel_start" => (
                "jupyter-kernel-gateway 3.0.1",
                "kernel start: POST /api/kernels until kernel_info answers",
                "mcp.create_warm",
            ),
            "kernel_gateway.exec_1p1" => (
                "jupyter-kernel-gateway 3.0.1",
                "1+1 over the websocket (client TCP_NODELAY)",
                "mcp.exec_1p1",
            ),
            "kernel_gateway.exec_1p1_quickack" => (
                "jupyter-kernel-gateway 3.0.1",
                "1+1 over the websocket (client TCP_NODELAY + TCP_QUICKACK)",
                "mcp.exec_1p1",
            ),
            "ipykernel_zmq.exec_1p1" => (
                "ipykernel over ZMQ",
                "1+1, jupyter_client straight to the kernel (host process)",
                "mcp.exec_1p1",
            ),
            _ => ("peers", "failed to run", "mcp.exec_1p1"),
        };
        rows.push(Row::ms(&id, section, what, &samples).vs(vs));
    }
    Ok(rows)
}

pub(crate) async fn bench_peers(opts: &Options) -> Vec<Row> {
    let Ok(python) = std::env::var("BENCH_PYTHON") else {
        eprintln!("[bench] BENCH_PYTHON is not set: skipping the peers");
        return Vec::new();
    };
    let c = opts.counts;
    let mut rows = Vec::new();
    match std::env::var("BENCH_LLM_SANDBOX_IMAGE") {
        Ok(image) => {
            eprintln!("[bench] llm-sandbox");
            match run_peer(
                &python,
                "llm_sandbox_bench.py",
                &[
                    "--image".into(),
                    image,
                    "--sessions".into(),
                    c.peer_sessions.to_string(),
                    "--runs".into(),
                    c.peer_runs.to_string(),
                ],
            )
            .await
            {
                Ok(r) => rows.extend(r),
                Err(e) => eprintln!("[bench] llm-sandbox failed: {e:#}"),
            }
        }
        Err(_) => eprintln!("[bench] BENCH_LLM_SANDBOX_IMAGE is not set: skipping llm-sandbox"),
    }
    eprintln!("[bench] jupyter-kernel-gateway and ipykernel");
    match run_peer(
        &python,
        "jupyter_bench.py",
        &[
            "--kernels".into(),
            c.peer_sessions.to_string(),
            "--runs".into(),
            (c.peer_runs * 2).to_string(),
        ],
    )
    .await
    {
        Ok(r) => rows.extend(r),
        Err(e) => eprintln!("[bench] jupyter peers failed: {e:#}"),
    }
    rows
}
