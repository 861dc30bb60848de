//! The series of issue 16, driven by the official MCP Python SDK (`bench/series/sdk_series.py`)
//! against a gateway in the default configuration (`pool.min_ready = 2`, the pool following
//! demand): 30 conversations created and closed back to back, and an open-loop load of whole
//! analyst conversations at 30, 60, 120 and 240 per minute with the CPU each took by component.

use super::*;

/// Per-minute arrival rates of the open-loop load.
const RATES: &[f64] = &[30.0, 60.0, 120.0, 240.0];
/// Section of the table the series' rows go in.
const SECTION: &str = "series (official Python SDK, default configuration)";

pub(crate) struct SeriesResults {
    pub(crate) rows: Vec<Row>,
    /// The open-loop levels as the script reported them (rates, CPU by component).
    pub(crate) levels: Vec<Value>,
}

fn series_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/series/sdk_series.py")
}

pub(crate) async fn bench_series(opts: &Options, docker: &Docker) -> Result<SeriesResults> {
    let Ok(python) = std::env::var("BENCH_SDK_PYTHON") else {
        eprintln!("[bench] BENCH_SDK_PYTHON is not set: the SDK series is skipped");
        return Ok(SeriesResults {
            rows: Vec::new(),
            levels: Vec::new(),
        });
    };
    let db = fresh_database().await?;
    // The default configuration: only the tenant's own limits are lifted, so that what is
    // measured is the service and not one tenant's quota.
    let gateway = Gateway::start_default(&db, 1000).await?;
    let token = gateway.token().await?;
    let pid = gateway.child.id().context("the gateway runs")?;
    let duration = if opts.quick { 20 } else { 60 };
    let rates: Vec<String> = RATES.iter().map(|r| r.to_string()).collect();
    let args = vec![
        "--url".to_owned(),
        gateway.mcp_url.clone(),
        "--token".to_owned(),
        token,
        "--back-to-back".to_owned(),
        "30".to_owned(),
        "--rates".to_owned(),
        rates.join(","),
        "--duration".to_owned(),
        duration.to_string(),
        "--instance".to_owned(),
        gateway.instance.clone(),
        "--gateway-pid".to_owned(),
        pid.to_string(),
    ];
    let output = tokio::time::timeout(
        Duration::from_secs(1800),
        Command::new(&python)
            .arg(series_script())
            .args(&args)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("the SDK series took over 30 minutes")??;
    gateway.stop(docker).await;
    drop_database(&db).await;
    if !output.status.success() {
        bail!("sdk_series.py failed with {}", output.status);
    }
    let parsed: Value =
        serde_json::from_slice(&output.stdout).context("sdk_series.py printed no JSON")?;
    let rows = parsed["rows"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(series_row)
        .collect();
    let levels = parsed["levels"].as_array().cloned().unwrap_or_default();
    Ok(SeriesResults { rows, levels })
}

fn series_row(r: &Value) -> Row {
    let id = r["name"].as_str().unwrap_or("?").to_owned();
    let samples = script_samples(r);
    let what = match id.as_str() {
        "sdk.b2b_create" => "create_sandbox, 30 conversations back to back".to_owned(),
        "sdk.b2b_first_exec" => "first execute_code 1+1 in each, back to back".to_owned(),
        "sdk.b2b_close" => "close_sandbox, back to back".to_owned(),
        "sdk.exec_1p1" => "execute_code 1+1, same client, one sandbox".to_owned(),
        other => match other.strip_prefix("sdk.open_loop_") {
            Some(rate) => format!(
                "analyst conversation, open loop at {rate}/min (Poisson, {} arrivals); from arrival to close",
                r["extra"]["arrivals"]
            ),
            None => other.to_owned(),
        },
    };
    let mut row = Row::ms(&id, SECTION, &what, &samples);
    if let Some(extra) = r["extra"].as_object() {
        row.extra = extra.clone();
    }
    row
}

/// The open-loop levels as a markdown table: rate, completed, errors, p99 and the CPU seconds
/// per conversation by component; then the highest rate sustained.
pub(crate) fn levels_table(rows: &[Row], levels: &[Value]) -> String {
    let components = [
        ("sandboxes", "sandbox containers"),
        ("gateway", "gateway"),
        ("postgres", "Postgres"),
        ("dockerd", "dockerd"),
        ("containerd", "containerd"),
        ("shims", "runc shims"),
        ("client", "SDK client"),
    ];
    let mut out = String::from("| rate/min | arrived | errors | p50 | p99 |");
    for (_, name) in components {
        out.push_str(&format!(" {name} |"));
    }
    out.push_str(" CPU s / conversation |\n|---:|---:|---:|---:|---:|");
    for _ in components {
        out.push_str("---:|");
    }
    out.push_str("---:|\n");
    for level in levels {
        let rate = level["rate_per_min"].as_f64().unwrap_or_default();
        let row = rows
            .iter()
            .find(|r| r.id == format!("sdk.open_loop_{}", rate as u64));
        let cpu = &level["cpu_s_per_conversation"];
        out.push_str(&format!(
            "| {rate:.0} | {} | {} | {} ms | {} ms |",
            level["arrivals"],
            level["errors"],
            fmt(row.and_then(|r| r.p50)),
            fmt(row.and_then(|r| r.p99)),
        ));
        let mut total = 0.0;
        for (key, _) in components {
            let v = cpu[key].as_f64().unwrap_or_default();
            total += v;
            out.push_str(&format!(" {v:.3} |"));
        }
        out.push_str(&format!(" {total:.3} |\n"));
    }
    out
}

/// The highest open-loop rate with no errors and a p99 conversation time under 2 s.
pub(crate) fn highest_sustained(rows: &[Row]) -> Option<f64> {
    rows.iter()
        .filter(|r| r.id.starts_with("sdk.open_loop_"))
        .filter(|r| r.errors == 0 && r.n > 0 && r.p99.is_some_and(|p| p < 2000.0))
        .filter_map(|r| r.extra.get("rate_per_min").and_then(Value::as_f64))
        .fold(None, |best: Option<f64>, rate| {
            Some(best.map_or(rate, |b| b.max(rate)))
        })
}
