//! The series of issue 16, driven by the official MCP Python SDK (`bench/series/sdk_series.py`)
//! against a gateway in the default configuration (`pool.min_ready = 2`, the pool following
//! demand): 30 conversations created and closed back to back, and an open-loop load of whole
//! analyst conversations at 30, 60, 120 and 240 per minute with the CPU each took by component.
//! Run twice: on the default profile (runc, ordinary starts) and on a `runsc2024` profile whose
//! pool restores a template (issue 26), otherwise in the same default configuration.

use super::*;

/// Per-minute arrival rates of the open-loop load.
const RATES: &[f64] = &[30.0, 60.0, 120.0, 240.0];
/// Which sandboxes the series' gateway gives.
#[derive(Debug, Clone)]
pub(crate) enum SeriesProfile {
    /// The default configuration: runc, ordinary starts.
    Default,
    /// The default configuration on `runsc2024`, its pool restored from a template made on the
    /// engine's plaintext tmpfs at this path.
    Template(String),
}

impl SeriesProfile {
    /// The rows' id prefix (`sdk.` or `sdk_tpl.`).
    fn prefix(&self) -> &'static str {
        match self {
            SeriesProfile::Default => "sdk.",
            SeriesProfile::Template(_) => "sdk_tpl.",
        }
    }

    fn section(&self) -> &'static str {
        match self {
            SeriesProfile::Default => "series (official Python SDK, default configuration)",
            SeriesProfile::Template(_) => {
                "series (official Python SDK, default configuration on runsc2024 restored from a template)"
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            SeriesProfile::Default => "runc",
            SeriesProfile::Template(_) => "gVisor + template",
        }
    }
}

pub(crate) struct SeriesResults {
    pub(crate) rows: Vec<Row>,
    /// The open-loop levels as the script reported them (rates, CPU by component).
    pub(crate) levels: Vec<Value>,
}

fn series_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/series/sdk_series.py")
}

pub(crate) async fn bench_series(
    opts: &Options,
    docker: &Docker,
    profile: SeriesProfile,
) -> Result<SeriesResults> {
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
    let gateway = match &profile {
        SeriesProfile::Default => Gateway::start_default(&db, 1000).await?,
        SeriesProfile::Template(plain) => {
            let gateway = Gateway::spawn(&db, 1000, template_settings(plain), &["serve"]).await?;
            wait_template(&gateway, Duration::from_secs(300)).await?;
            gateway
        }
    };
    let token = gateway.token().await?;
    let pid = gateway.child.id().context("the gateway runs")?;
    let duration = if opts.quick { 20 } else { 60 };
    let rates: Vec<String> = RATES.iter().map(|r| r.to_string()).collect();
    let mut args = vec![
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
    if let Ok(engine) = std::env::var("BENCH_ENGINE_CPUACCT") {
        args.extend(["--engine-cpuacct".to_owned(), engine]);
    }
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
    let mut rows: Vec<Row> = parsed["rows"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| series_row(r, &profile))
        .collect();
    let mut levels = parsed["levels"].as_array().cloned().unwrap_or_default();
    for level in &mut levels {
        level["profile"] = json!(profile.name());
        level["row_prefix"] = json!(profile.prefix());
        // The level's CPU per conversation, summed, beside its row (for the goals).
        let id = format!(
            "{}open_loop_{}",
            profile.prefix(),
            level["rate_per_min"].as_f64().unwrap_or_default() as u64
        );
        let total = total_cpu(&level["cpu_s_per_conversation"]);
        if let Some(row) = rows.iter_mut().find(|r| r.id == id) {
            row.extra.insert("cpu_s_total".into(), json!(total));
        }
    }
    Ok(SeriesResults { rows, levels })
}

fn series_row(r: &Value, profile: &SeriesProfile) -> Row {
    let name = r["name"].as_str().unwrap_or("?");
    let id = format!(
        "{}{}",
        profile.prefix(),
        name.strip_prefix("sdk.").unwrap_or(name)
    );
    let samples = script_samples(r);
    let what = match name {
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
    let mut row = Row::ms(&id, profile.section(), &what, &samples);
    if let Some(extra) = r["extra"].as_object() {
        row.extra = extra.clone();
    }
    row
}

/// A level's CPU seconds per conversation over every component, counting the engine once:
/// its cgroup where measured, else dockerd, containerd and the shims.
fn total_cpu(cpu: &Value) -> f64 {
    let parts: &[&str] = match cpu.get("engine") {
        Some(_) => &["sandboxes", "engine", "gateway", "postgres", "client"],
        None => &[
            "sandboxes",
            "dockerd",
            "containerd",
            "shims",
            "gateway",
            "postgres",
            "client",
        ],
    };
    parts
        .iter()
        .map(|k| cpu[*k].as_f64().unwrap_or_default())
        .sum()
}

/// The open-loop levels as a markdown table: profile, rate, completed, errors, p99 and the CPU
/// seconds per conversation by component. Where the engine's own cgroup was measured, its
/// column replaces dockerd, containerd and the shims (it holds them and what they start).
pub(crate) fn levels_table(rows: &[Row], levels: &[Value]) -> String {
    let engine = levels
        .iter()
        .all(|l| l["cpu_s_per_conversation"].get("engine").is_some());
    let mut components = vec![("sandboxes", "sandbox containers")];
    if engine {
        components.push(("engine", "engine (dockerd, containerd, shims, runtimes)"));
    } else {
        components.extend([
            ("dockerd", "dockerd"),
            ("containerd", "containerd"),
            ("shims", "runc shims"),
        ]);
    }
    components.extend([
        ("gateway", "gateway"),
        ("postgres", "Postgres"),
        ("client", "SDK client"),
    ]);
    let mut out = String::from("| sandboxes | rate/min | arrived | errors | p50 | p99 |");
    for (_, name) in &components {
        out.push_str(&format!(" {name} |"));
    }
    out.push_str(" CPU s / conversation |\n|---|---:|---:|---:|---:|---:|");
    for _ in &components {
        out.push_str("---:|");
    }
    out.push_str("---:|\n");
    for level in levels {
        let rate = level["rate_per_min"].as_f64().unwrap_or_default();
        let prefix = level["row_prefix"].as_str().unwrap_or("sdk.");
        let row = rows
            .iter()
            .find(|r| r.id == format!("{prefix}open_loop_{}", rate as u64));
        let cpu = &level["cpu_s_per_conversation"];
        out.push_str(&format!(
            "| {} | {rate:.0} | {} | {} | {} ms | {} ms |",
            level["profile"].as_str().unwrap_or("runc"),
            level["arrivals"],
            level["errors"],
            fmt(row.and_then(|r| r.p50)),
            fmt(row.and_then(|r| r.p99)),
        ));
        let mut total = 0.0;
        for (key, _) in &components {
            let v = cpu[key].as_f64().unwrap_or_default();
            total += v;
            out.push_str(&format!(" {v:.3} |"));
        }
        out.push_str(&format!(" {total:.3} |\n"));
    }
    out
}

/// The highest open-loop rate with no errors and a p99 conversation time under 2 s, among the
/// rows whose ids start with `prefix` (`sdk.` or `sdk_tpl.`).
pub(crate) fn highest_sustained(rows: &[Row], prefix: &str) -> Option<f64> {
    let level = format!("{prefix}open_loop_");
    rows.iter()
        .filter(|r| r.id.starts_with(&level))
        .filter(|r| r.errors == 0 && r.n > 0 && r.p99.is_some_and(|p| p < 2000.0))
        .filter_map(|r| r.extra.get("rate_per_min").and_then(Value::as_f64))
        .fold(None, |best: Option<f64>, rate| {
            Some(best.map_or(rate, |b| b.max(rate)))
        })
}
