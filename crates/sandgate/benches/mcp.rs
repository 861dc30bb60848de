//! sandgate's benchmark, side by side with what a user would pick instead (issues 3 and 7).
//!
//! Run it with `scripts/bench.sh` (it brings the stack up, builds, installs the peers and passes
//! their settings). In one run, on one Docker engine and one image, it measures:
//!
//! - **through MCP** (the real `sandgate serve` binary, the rmcp client over Streamable HTTP):
//!   warm and cold `create_sandbox`, `execute_code` of `1+1` / a pandas group-by / a matplotlib
//!   chart, `run_terminal_command true`, `upload_file` + `get_file` of 1 MiB, the support-analyst
//!   conversation at 1, 10 and 50 at once, and memory (each idle sandbox's cgroup, the gateway's
//!   RSS) at 0, 10, 50 and 150 sandboxes;
//! - **the sandbox crate** directly (`SandboxManager`): warm lease, cold start, `1+1`, `true`,
//!   1 MiB write + read;
//! - **the naive Docker-API path**: create + start + exec per call, `docker exec` into a running
//!   container, a fresh container per call;
//! - **the peers** (Python scripts under `bench/peers/`): llm-sandbox, jupyter-kernel-gateway and
//!   an ipykernel over ZMQ.
//!
//! Every loop is bounded in count and in time. The result is printed as a table (medians, p99 and
//! ratios) and written as JSON.
//!
//! Environment: `DATABASE_URL` (a Postgres superuser), `SANDGATE_SANDBOX__IMAGE`,
//! `BENCH_PYTHON` (the peers' virtualenv python; peers are skipped without it),
//! `BENCH_LLM_SANDBOX_IMAGE` (the image llm-sandbox runs). Arguments: `--out FILE`,
//! `--quick` (fewer iterations), `--no-peers`, `--no-150`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use base64::Engine;
use bollard::Docker;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder, StartContainerOptions, WaitContainerOptions,
};
use futures::StreamExt;
use sandgate_sandbox::backend::LaunchSpec;
use sandgate_sandbox::{
    CommandOptions, DockerBackend, ExecOptions, ManagerConfig, PoolConfig, SandboxManager,
    SandboxProfile,
};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

#[path = "../../../tests/e2e/mcp_client.rs"]
#[allow(dead_code)] // shared with the e2e tests; the bench uses only part of it
mod mcp_client;

use mcp_client::{Client, Era};

/// The `sandgate` binary (built in the same profile as this bench).
const BIN: &str = env!("CARGO_BIN_EXE_sandgate");
const MIB: usize = 1 << 20;
/// Warm pool size of the benchmarked gateway (what an operator expecting bursts would set).
const MIN_READY: usize = 10;

// ---------------------------------------------------------------------------------------------
// Samples, rows, the report

/// One measured quantity.
#[derive(Debug, Clone, Serialize)]
struct Row {
    /// Stable id, e.g. `mcp.exec_1p1`.
    id: String,
    /// Table section.
    section: String,
    /// What was measured, for a reader.
    what: String,
    /// `ms` or `MB`.
    unit: &'static str,
    n: usize,
    p50: Option<f64>,
    p99: Option<f64>,
    mean: Option<f64>,
    max: Option<f64>,
    errors: usize,
    /// The sandgate row this one is compared with.
    vs: Option<String>,
    /// This row's p50 over the compared row's p50 (how many times slower the alternative is).
    ratio_p50: Option<f64>,
    /// The same for p99.
    ratio_p99: Option<f64>,
    /// The first error messages, when there were errors.
    error_samples: Vec<String>,
    /// Extra figures (throughput, wall time …).
    extra: serde_json::Map<String, Value>,
    samples: Vec<f64>,
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    // Nearest rank.
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

impl Row {
    fn new(id: &str, section: &str, what: &str, unit: &'static str, samples: Vec<f64>) -> Row {
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        let mean = (!sorted.is_empty()).then(|| sorted.iter().sum::<f64>() / sorted.len() as f64);
        Row {
            id: id.into(),
            section: section.into(),
            what: what.into(),
            unit,
            n: sorted.len(),
            p50: percentile(&sorted, 0.5),
            p99: percentile(&sorted, 0.99),
            mean,
            max: sorted.last().copied(),
            errors: 0,
            vs: None,
            ratio_p50: None,
            ratio_p99: None,
            error_samples: Vec::new(),
            extra: serde_json::Map::new(),
            samples,
        }
    }

    fn ms(id: &str, section: &str, what: &str, s: &Samples) -> Row {
        let mut row = Row::new(id, section, what, "ms", s.ms.clone());
        row.errors = s.errors.len();
        row.error_samples = s.errors.iter().take(3).cloned().collect();
        row
    }

    fn vs(mut self, id: &str) -> Row {
        self.vs = Some(id.into());
        self
    }

    fn extra(mut self, key: &str, value: Value) -> Row {
        self.extra.insert(key.into(), value);
        self
    }
}

/// Timings of one operation, in milliseconds, plus its failures.
#[derive(Debug, Default, Clone)]
struct Samples {
    ms: Vec<f64>,
    errors: Vec<String>,
}

impl Samples {
    fn push(&mut self, elapsed: Duration) {
        self.ms.push(elapsed.as_secs_f64() * 1000.0);
    }

    fn fail(&mut self, err: impl std::fmt::Display) {
        self.errors.push(err.to_string());
    }

    /// Times `f` unless the budget is spent; a failure is recorded, not fatal.
    async fn time<T, F>(&mut self, budget: &Budget, f: F) -> Option<T>
    where
        F: Future<Output = Result<T>>,
    {
        if budget.spent() {
            return None;
        }
        let t0 = Instant::now();
        match f.await {
            Ok(v) => {
                self.push(t0.elapsed());
                Some(v)
            }
            Err(e) => {
                self.fail(format!("{e:#}"));
                None
            }
        }
    }
}

/// A time budget for one loop: loops stop early rather than run long.
#[derive(Debug, Clone, Copy)]
struct Budget(Instant);

impl Budget {
    fn secs(s: u64) -> Budget {
        Budget(Instant::now() + Duration::from_secs(s))
    }
    fn spent(&self) -> bool {
        Instant::now() >= self.0
    }
}

#[derive(Debug, Clone, Copy)]
struct Counts {
    warm_creates: usize,
    cold_creates: usize,
    exec: usize,
    heavy: usize,
    files: usize,
    naive: usize,
    peer_sessions: usize,
    peer_runs: usize,
}

impl Counts {
    fn full() -> Counts {
        Counts {
            warm_creates: 40,
            cold_creates: 10,
            exec: 300,
            heavy: 30,
            files: 30,
            naive: 20,
            peer_sessions: 10,
            peer_runs: 50,
        }
    }
    fn quick() -> Counts {
        Counts {
            warm_creates: 10,
            cold_creates: 3,
            exec: 50,
            heavy: 5,
            files: 5,
            naive: 5,
            peer_sessions: 3,
            peer_runs: 10,
        }
    }
}

#[derive(Debug)]
struct Options {
    out: PathBuf,
    counts: Counts,
    peers: bool,
    live_150: bool,
    quick: bool,
    /// Only the per-call MCP rows (1+1 in both eras, `true`): for A/B runs of the gateway.
    exec_only: bool,
}

fn options() -> Result<Options> {
    let mut out = PathBuf::from("bench-results.json");
    let mut quick = false;
    let mut peers = true;
    let mut live_150 = true;
    let mut exec_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = args.next().context("--out needs a path")?.into(),
            "--quick" => quick = true,
            "--no-peers" => peers = false,
            "--no-150" => live_150 = false,
            "--exec-only" => exec_only = true,
            // What `cargo bench` passes to every bench target.
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(Options {
        out,
        counts: if quick {
            Counts::quick()
        } else {
            Counts::full()
        },
        peers,
        live_150,
        quick,
        exec_only,
    })
}

// ---------------------------------------------------------------------------------------------
// The workload: a support analyst's conversation

/// 10 000 support tickets as CSV, the same every run.
fn tickets_csv() -> String {
    let regions = ["EMEA", "NA", "LATAM", "APAC"];
    let products = ["billing", "login", "shipping", "returns", "api"];
    let mut rng = XorShift(0x5eed_cafe_f00d_d00d);
    let mut csv = String::from("ticket_id,region,product,minutes,csat\n");
    for id in 0..10_000 {
        let region = regions[(rng.next() % 4) as usize];
        let product = products[(rng.next() % 5) as usize];
        let minutes = 5 + rng.next() % 600;
        let csat = 1 + rng.next() % 5;
        csv.push_str(&format!("{id},{region},{product},{minutes},{csat}\n"));
    }
    csv
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

const GROUP_BY: &str = "import pandas as pd\n\
df = pd.read_csv('tickets.csv')\n\
summary = df.groupby('region').agg(tickets=('ticket_id', 'count'), mean_minutes=('minutes', 'mean'), csat=('csat', 'mean')).round(2)\n\
summary";

const CHART: &str = "import matplotlib.pyplot as plt\n\
fig, ax = plt.subplots(figsize=(6, 4))\n\
summary['mean_minutes'].plot.bar(ax=ax, color='#4c72b0')\n\
ax.set_title('Mean minutes to resolve, by region')\n\
ax.set_ylabel('minutes')\n\
fig.savefig('chart.png')\n\
plt.show()";

async fn call_ok(client: &Client, tool: &str, args: Value) -> Result<mcp_client::ToolResult> {
    let result = client
        .call(tool, args)
        .await
        .map_err(|e| anyhow!("{tool}: protocol error: {e}"))?;
    if result.is_error {
        bail!(
            "{tool}: isError: {}",
            result.text.chars().take(300).collect::<String>()
        );
    }
    Ok(result)
}

fn sandbox_id(result: &mcp_client::ToolResult) -> Result<String> {
    result.structured["sandbox_id"]
        .as_str()
        .map(str::to_owned)
        .context("no sandbox_id in the result")
}

/// The whole conversation: create, upload, analyse, chart, get the chart, close.
async fn conversation(client: &Client, conversation_id: &str, csv: &str) -> Result<()> {
    let created = call_ok(
        client,
        "create_sandbox",
        json!({"conversation_id": conversation_id}),
    )
    .await?;
    let id = sandbox_id(&created)?;
    call_ok(
        client,
        "upload_file",
        json!({"sandbox_id": id, "path": "tickets.csv", "content_text": csv}),
    )
    .await?;
    let analysed = call_ok(
        client,
        "execute_code",
        json!({"sandbox_id": id, "code": GROUP_BY}),
    )
    .await?;
    if !analysed.text.contains("EMEA") {
        bail!("the group-by did not show the regions: {}", analysed.text);
    }
    let chart = call_ok(
        client,
        "execute_code",
        json!({"sandbox_id": id, "code": CHART}),
    )
    .await?;
    if chart.images.is_empty() {
        bail!("the chart cell returned no image");
    }
    let file = call_ok(
        client,
        "get_file",
        json!({"sandbox_id": id, "path": "chart.png"}),
    )
    .await?;
    if file.images.is_empty() {
        bail!("get_file chart.png returned no image");
    }
    call_ok(client, "close_sandbox", json!({"sandbox_id": id})).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The gateway under test

/// A `sandgate serve` process on a loopback port with its own database and instance label.
struct Gateway {
    child: tokio::process::Child,
    mcp_url: String,
    env: Vec<(String, String)>,
    instance: String,
    /// "warm sandbox ready" lines in its log: refills that finished.
    ready_events: Arc<AtomicUsize>,
}

impl Gateway {
    async fn start(database_url: &str, min_ready: usize, max_sandboxes: usize) -> Result<Gateway> {
        let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let mut env: Vec<(String, String)> = vec![
            ("SANDGATE_DATABASE__URL".into(), database_url.into()),
            ("SANDGATE_INSTANCE".into(), instance.clone()),
            ("SANDGATE_LOG__FORMAT".into(), "json".into()),
            // The manager's debug line "warm sandbox ready" tells the bench when the pool is full.
            (
                "SANDGATE_LOG__FILTER".into(),
                "warn,sandgate_sandbox::manager=debug".into(),
            ),
            ("SANDGATE_POOL__MIN_READY".into(), min_ready.to_string()),
            (
                "SANDGATE_LIMITS__MAX_SANDBOXES".into(),
                max_sandboxes.to_string(),
            ),
            // One tenant drives every measurement: its rate limit must not be what is measured.
            (
                "SANDGATE_LIMITS__MAX_CALLS_PER_MINUTE".into(),
                "1000000".into(),
            ),
            ("SANDGATE_DATABASE__MAX_CONNECTIONS".into(), "32".into()),
        ];
        let mut child = Command::new(BIN)
            .arg("serve")
            .env_remove("RUST_LOG")
            .env("SANDGATE_LISTEN", "127.0.0.1:0")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting sandgate serve")?;
        let ready_events = Arc::new(AtomicUsize::new(0));
        let stderr = child.stderr.take().context("stderr")?;
        let counter = ready_events.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("warm sandbox ready") {
                    counter.fetch_add(1, Ordering::SeqCst);
                } else if !line.starts_with('{')
                    || line.contains("\"level\":\"ERROR\"")
                    || line.contains("\"level\":\"WARN\"")
                {
                    eprintln!("[gateway] {line}");
                }
            }
        });
        let stdout = child.stdout.take().context("stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .context("sandgate did not print its URL within 60 s")??
            .context("sandgate exited before printing its URL")?;
        let mcp_url = line
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://"))
            .with_context(|| format!("unexpected first line: {line:?}"))?
            .to_owned();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        env.push((
            "SANDGATE_PUBLIC_URL".into(),
            mcp_url.trim_end_matches("/mcp").to_owned(),
        ));
        Ok(Gateway {
            child,
            mcp_url,
            env,
            instance,
            ready_events,
        })
    }

    async fn cli(&self, args: &[&str]) -> Result<String> {
        let output = Command::new(BIN)
            .args(args)
            .env_remove("RUST_LOG")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .await?;
        if !output.status.success() {
            bail!(
                "sandgate {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8(output.stdout)?.trim().to_owned())
    }

    /// A new tenant's access token with every scope.
    async fn token(&self) -> Result<String> {
        let name = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let tenant = self.cli(&["admin", "tenant", "create", &name]).await?;
        self.cli(&[
            "admin", "token", "issue", "--tenant", &tenant, "--ttl", "2h",
        ])
        .await
    }

    /// Waits until `want` warm sandboxes are in the pool, given `taken` warm leases so far.
    async fn wait_pool(&self, taken: usize, want: usize, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        while self.ready_events.load(Ordering::SeqCst) < taken + want {
            if Instant::now() > deadline {
                bail!(
                    "the warm pool did not reach {want} within {within:?} ({} ready events, {taken} taken)",
                    self.ready_events.load(Ordering::SeqCst)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    fn rss_mb(&self) -> Option<f64> {
        let pid = self.child.id()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kb: f64 = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some(kb / 1024.0)
    }

    /// SIGTERM, wait, then remove whatever containers of its instance are left.
    async fn stop(mut self, docker: &Docker) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
            let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        }
        let _ = self.child.kill().await;
        remove_instance(docker, &self.instance).await;
    }
}

async fn instance_containers(docker: &Docker, instance: &str) -> Vec<(String, String)> {
    let filters = HashMap::from([(
        "label".to_owned(),
        vec![format!("sandgate.instance={instance}")],
    )]);
    let options = ListContainersOptionsBuilder::new()
        .all(true)
        .filters(&filters)
        .build();
    docker
        .list_containers(Some(options))
        .await
        .unwrap_or_default()
        .into_iter()
        .filter_map(|c| {
            let sandbox = c
                .labels
                .as_ref()
                .and_then(|l| l.get("sandgate.sandbox_id"))
                .cloned()
                .unwrap_or_default();
            Some((c.id?, sandbox))
        })
        .collect()
}

async fn remove_instance(docker: &Docker, instance: &str) {
    let containers = instance_containers(docker, instance).await;
    let removals = containers.into_iter().map(|(id, _)| async move {
        let _ = docker
            .remove_container(
                &id,
                Some(RemoveContainerOptionsBuilder::new().force(true).build()),
            )
            .await;
    });
    futures::stream::iter(removals)
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await;
}

async fn fresh_database() -> Result<String> {
    use sqlx::Connection;
    let admin = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let name = format!("sandgate_bench_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&admin).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await?;
    let base = admin.split('?').next().unwrap_or(&admin);
    let root = &base[..base.rfind('/').context("a URL with a database")?];
    Ok(format!("{root}/{name}"))
}

async fn drop_database(url: &str) {
    use sqlx::Connection;
    let Ok(admin) = std::env::var("DATABASE_URL") else {
        return;
    };
    let Some(name) = url.rsplit('/').next() else {
        return;
    };
    if let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&mut conn)
        .await;
    }
}

// ---------------------------------------------------------------------------------------------
// Memory of a container, as its cgroup counts it

/// (usage, usage less inactive file pages) in MB, from cgroup v1 or v2.
fn container_memory_mb(container_id: &str) -> Option<(f64, f64)> {
    let v1 = format!("/sys/fs/cgroup/memory/docker/{container_id}");
    let v2 = [
        format!("/sys/fs/cgroup/system.slice/docker-{container_id}.scope"),
        format!("/sys/fs/cgroup/docker/{container_id}"),
    ];
    let read = |p: String| std::fs::read_to_string(p).ok();
    let stat_value = |stat: &str, key: &str| -> Option<f64> {
        stat.lines()
            .find_map(|l| l.strip_prefix(key).map(str::trim))?
            .parse()
            .ok()
    };
    let (usage, inactive) = if let Some(usage) = read(format!("{v1}/memory.usage_in_bytes")) {
        let stat = read(format!("{v1}/memory.stat")).unwrap_or_default();
        (
            usage.trim().parse::<f64>().ok()?,
            stat_value(&stat, "total_inactive_file ").unwrap_or(0.0),
        )
    } else {
        let dir = v2.into_iter().find(|d| std::path::Path::new(d).exists())?;
        let usage = read(format!("{dir}/memory.current"))?;
        let stat = read(format!("{dir}/memory.stat")).unwrap_or_default();
        (
            usage.trim().parse::<f64>().ok()?,
            stat_value(&stat, "inactive_file ").unwrap_or(0.0),
        )
    };
    let mb = 1024.0 * 1024.0;
    Some((usage / mb, (usage - inactive) / mb))
}

// ---------------------------------------------------------------------------------------------
// Through MCP

struct McpResults {
    rows: Vec<Row>,
}

async fn bench_mcp(opts: &Options, docker: &Docker) -> Result<McpResults> {
    let c = opts.counts;
    let mut rows = Vec::new();
    let csv = tickets_csv();

    // Cold create: a gateway whose pool is empty and stays empty (min_ready 0).
    if !opts.exec_only {
        let db = fresh_database().await?;
        let gateway = Gateway::start(&db, 0, 1000).await?;
        let token = gateway.token().await?;
        let client = Client::connect(&gateway.mcp_url, &token, Era::Sessions)
            .await
            .map_err(|e| anyhow!(e))?;
        let mut cold = Samples::default();
        let budget = Budget::secs(180);
        for i in 0..c.cold_creates {
            let created = cold
                .time(
                    &budget,
                    call_ok(
                        &client,
                        "create_sandbox",
                        json!({"conversation_id": format!("cold-{i}")}),
                    ),
                )
                .await;
            if let Some(created) = created {
                let id = sandbox_id(&created)?;
                call_ok(&client, "close_sandbox", json!({"sandbox_id": id})).await?;
            }
        }
        rows.push(Row::ms(
            "mcp.create_cold",
            "sandgate via MCP",
            "create_sandbox, pool empty (cold start)",
            &cold,
        ));
        drop(client);
        gateway.stop(docker).await;
        drop_database(&db).await;
    }

    let db = fresh_database().await?;
    let gateway = Gateway::start(&db, MIN_READY, 1000).await?;
    let token = gateway.token().await?;
    let client = Client::connect(&gateway.mcp_url, &token, Era::Sessions)
        .await
        .map_err(|e| anyhow!(e))?;
    gateway
        .wait_pool(0, MIN_READY, Duration::from_secs(180))
        .await?;
    let rss_fresh = gateway.rss_mb();

    // Warm create (pool full before each), its first cell, and close; a new conversation's life.
    let mut warm = Samples::default();
    let mut first = Samples::default();
    let mut close = Samples::default();
    let mut session = Samples::default();
    let mut create_first = Samples::default();
    let budget = Budget::secs(300);
    let mut taken = 0;
    for i in 0..c.warm_creates {
        if budget.spent() || opts.exec_only {
            break;
        }
        gateway
            .wait_pool(taken, MIN_READY, Duration::from_secs(120))
            .await?;
        let t0 = Instant::now();
        let Some(created) = warm
            .time(
                &budget,
                call_ok(
                    &client,
                    "create_sandbox",
                    json!({"conversation_id": format!("warm-{i}")}),
                ),
            )
            .await
        else {
            continue;
        };
        taken += 1;
        let id = sandbox_id(&created)?;
        let ran = first
            .time(
                &budget,
                call_ok(
                    &client,
                    "execute_code",
                    json!({"sandbox_id": id, "code": "1+1"}),
                ),
            )
            .await;
        if ran.is_some() {
            create_first.push(t0.elapsed());
        }
        let closed = close
            .time(
                &budget,
                call_ok(&client, "close_sandbox", json!({"sandbox_id": id})),
            )
            .await;
        if ran.is_some() && closed.is_some() {
            session.push(t0.elapsed());
        }
    }
    rows.push(Row::ms(
        "mcp.create_warm",
        "sandgate via MCP",
        "create_sandbox, warm pool",
        &warm,
    ));
    rows.push(Row::ms(
        "mcp.first_exec",
        "sandgate via MCP",
        "first execute_code 1+1 in a new sandbox",
        &first,
    ));
    rows.push(Row::ms(
        "mcp.close",
        "sandgate via MCP",
        "close_sandbox (container removed)",
        &close,
    ));
    rows.push(Row::ms(
        "mcp.create_first_run",
        "sandgate via MCP",
        "create_sandbox + first execute_code 1+1",
        &create_first,
    ));
    rows.push(Row::ms(
        "mcp.session",
        "sandgate via MCP",
        "create + first 1+1 + close",
        &session,
    ));

    // Per-call work on one sandbox.
    gateway
        .wait_pool(taken, MIN_READY, Duration::from_secs(120))
        .await?;
    let created = call_ok(
        &client,
        "create_sandbox",
        json!({"conversation_id": "per-call"}),
    )
    .await?;
    let id = sandbox_id(&created)?;
    let budget = Budget::secs(240);
    let mut exec = Samples::default();
    for i in 0..c.exec + 10 {
        let mut sink = Samples::default();
        let target = if i < 10 { &mut sink } else { &mut exec };
        let result = target
            .time(
                &budget,
                call_ok(
                    &client,
                    "execute_code",
                    json!({"sandbox_id": id, "code": "1+1"}),
                ),
            )
            .await;
        if let Some(result) = result
            && result.structured["result"]["text/plain"] != "2"
        {
            exec.fail(format!("1+1 answered {}", result.structured["result"]));
        }
    }
    rows.push(Row::ms(
        "mcp.exec_1p1",
        "sandgate via MCP",
        "execute_code 1+1 (2025-11-25 session)",
        &exec,
    ));

    // The same cell in the stateless era (a new HTTP request, no session).
    {
        let stateless = Client::connect(&gateway.mcp_url, &token, Era::Stateless)
            .await
            .map_err(|e| anyhow!(e))?;
        let mut s = Samples::default();
        for i in 0..(c.exec / 2) + 10 {
            let mut sink = Samples::default();
            let target = if i < 10 { &mut sink } else { &mut s };
            target
                .time(
                    &budget,
                    call_ok(
                        &stateless,
                        "execute_code",
                        json!({"sandbox_id": id, "code": "1+1"}),
                    ),
                )
                .await;
        }
        rows.push(Row::ms(
            "mcp.exec_1p1_stateless",
            "sandgate via MCP",
            "execute_code 1+1 (2026-07-28 stateless)",
            &s,
        ));
    }

    let mut cmd = Samples::default();
    for _ in 0..c.exec / 2 {
        cmd.time(
            &budget,
            call_ok(
                &client,
                "run_terminal_command",
                json!({"sandbox_id": id, "command": "true"}),
            ),
        )
        .await;
    }
    rows.push(Row::ms(
        "mcp.command_true",
        "sandgate via MCP",
        "run_terminal_command true",
        &cmd,
    ));

    if opts.exec_only {
        drop(client);
        gateway.stop(docker).await;
        drop_database(&db).await;
        return Ok(McpResults { rows });
    }
    call_ok(
        &client,
        "upload_file",
        json!({"sandbox_id": id, "path": "tickets.csv", "content_text": csv}),
    )
    .await?;
    let mut group_by = Samples::default();
    for _ in 0..c.heavy {
        group_by
            .time(
                &budget,
                call_ok(
                    &client,
                    "execute_code",
                    json!({"sandbox_id": id, "code": GROUP_BY}),
                ),
            )
            .await;
    }
    rows.push(Row::ms(
        "mcp.exec_groupby",
        "sandgate via MCP",
        "execute_code: read 10 000-row CSV + group-by",
        &group_by,
    ));
    let mut chart = Samples::default();
    for _ in 0..c.heavy {
        let result = chart
            .time(
                &budget,
                call_ok(
                    &client,
                    "execute_code",
                    json!({"sandbox_id": id, "code": CHART}),
                ),
            )
            .await;
        if result.is_some_and(|r| r.images.is_empty()) {
            chart.fail("the chart cell returned no image");
        }
    }
    rows.push(Row::ms(
        "mcp.exec_chart",
        "sandgate via MCP",
        "execute_code: matplotlib bar chart (PNG back)",
        &chart,
    ));

    let mut rng = XorShift(42);
    let mut upload = Samples::default();
    let mut get = Samples::default();
    let mut both = Samples::default();
    for _ in 0..c.files {
        let data = rng.bytes(MIB);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
        let t0 = Instant::now();
        let up = upload
            .time(
                &budget,
                call_ok(
                    &client,
                    "upload_file",
                    json!({"sandbox_id": id, "path": "blob.bin", "content_base64": b64, "overwrite": true}),
                ),
            )
            .await;
        if up.is_none() {
            continue;
        }
        let got = get
            .time(
                &budget,
                call_ok(
                    &client,
                    "get_file",
                    json!({"sandbox_id": id, "path": "blob.bin"}),
                ),
            )
            .await;
        match got {
            Some(r) if r.blobs.first().is_some_and(|(_, b)| b == &data) => both.push(t0.elapsed()),
            Some(_) => both.fail("get_file returned other bytes than were uploaded"),
            None => {}
        }
    }
    rows.push(Row::ms(
        "mcp.upload_1mib",
        "sandgate via MCP",
        "upload_file 1 MiB",
        &upload,
    ));
    rows.push(Row::ms(
        "mcp.get_1mib",
        "sandgate via MCP",
        "get_file 1 MiB",
        &get,
    ));
    rows.push(Row::ms(
        "mcp.file_1mib",
        "sandgate via MCP",
        "upload_file + get_file 1 MiB (bytes checked)",
        &both,
    ));
    call_ok(&client, "close_sandbox", json!({"sandbox_id": id})).await?;

    // The support-analyst conversation at 1, 10 and 50 at once.
    let levels: &[(usize, usize)] = if opts.quick {
        &[(1, 2), (10, 1), (50, 1)]
    } else {
        &[(1, 5), (10, 2), (50, 1)]
    };
    let mut level_rows = Vec::new();
    for &(concurrency, per_worker) in levels {
        // Start each level with a full pool (as after a quiet spell) and the previous level's
        // containers gone.
        settle_pool(&gateway, docker).await;
        let row = conversations(
            &gateway,
            &token,
            concurrency,
            per_worker,
            &csv,
            Budget::secs(420),
        )
        .await?;
        level_rows.push(row);
    }
    rows.extend(level_rows);

    // Memory: idle sandboxes (each ran one cell) and the gateway's RSS at 0, 10, 50 (, 150).
    settle_pool(&gateway, docker).await;
    rows.push(Row::new(
        "mem.gateway_rss_fresh",
        "memory",
        "gateway resident memory after start (warm pool full, no call yet)",
        "MB",
        rss_fresh.into_iter().collect(),
    ));
    rows.extend(memory(&gateway, &token, docker, opts.live_150).await?);

    drop(client);
    gateway.stop(docker).await;
    drop_database(&db).await;
    Ok(McpResults { rows })
}

/// Waits until only the warm pool is left (every leased container gone) and its refills have
/// finished: the container count is `MIN_READY` and no refill has finished for a while.
async fn settle_pool(gateway: &Gateway, docker: &Docker) {
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        if instance_containers(docker, &gateway.instance).await.len() <= MIN_READY {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Refills run two at a time and a start takes a few seconds: quiet for 8 s means done.
    let mut last = gateway.ready_events.load(Ordering::SeqCst);
    let mut quiet_since = Instant::now();
    while Instant::now() < deadline && quiet_since.elapsed() < Duration::from_secs(8) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = gateway.ready_events.load(Ordering::SeqCst);
        if now != last {
            last = now;
            quiet_since = Instant::now();
        }
    }
}

async fn conversations(
    gateway: &Gateway,
    token: &str,
    concurrency: usize,
    per_worker: usize,
    csv: &str,
    budget: Budget,
) -> Result<Row> {
    let mut clients = Vec::new();
    for _ in 0..concurrency {
        clients.push(
            Client::connect(&gateway.mcp_url, token, Era::Sessions)
                .await
                .map_err(|e| anyhow!(e))?,
        );
    }
    let run = uuid::Uuid::new_v4().simple().to_string();
    let t0 = Instant::now();
    let workers = clients.iter().enumerate().map(|(w, client)| {
        let run = run.clone();
        async move {
            let mut s = Samples::default();
            for k in 0..per_worker {
                let id = format!("conv-{run}-{w}-{k}");
                let per_call =
                    tokio::time::timeout(Duration::from_secs(180), conversation(client, &id, csv));
                s.time(&budget, async {
                    per_call
                        .await
                        .map_err(|_| anyhow!("the conversation took over 180 s"))?
                })
                .await;
            }
            s
        }
    });
    let results = futures::future::join_all(workers).await;
    let wall = t0.elapsed();
    let mut all = Samples::default();
    for s in results {
        all.ms.extend(s.ms);
        all.errors.extend(s.errors);
    }
    let done = all.ms.len();
    let throughput = done as f64 / wall.as_secs_f64();
    let id = format!("mcp.conversation_x{concurrency}");
    let what = format!(
        "support-analyst conversation, {concurrency} at once ({} in all)",
        concurrency * per_worker
    );
    Ok(Row::ms(&id, "conversations", &what, &all)
        .extra("concurrency", json!(concurrency))
        .extra("conversations", json!(concurrency * per_worker))
        .extra("wall_s", json!(wall.as_secs_f64()))
        .extra("per_minute", json!(throughput * 60.0)))
}

async fn memory(
    gateway: &Gateway,
    token: &str,
    docker: &Docker,
    live_150: bool,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut rss = vec![("0", gateway.rss_mb())];
    let clients = {
        let mut v = Vec::new();
        for _ in 0..10 {
            v.push(
                Client::connect(&gateway.mcp_url, token, Era::Sessions)
                    .await
                    .map_err(|e| anyhow!(e))?,
            );
        }
        v
    };
    let mut live: Vec<String> = Vec::new();
    let mut errors = Samples::default();
    let targets: &[usize] = if live_150 { &[10, 50, 150] } else { &[10, 50] };
    let mut per_sandbox = Vec::new();
    let mut create_times = Samples::default();
    let budget = Budget::secs(600);
    for &target in targets {
        // Create up to `target` sandboxes, ten at a time, each running one cell.
        while live.len() < target && !budget.spent() {
            let batch = (target - live.len()).min(clients.len());
            let base = live.len();
            let made = futures::future::join_all(clients.iter().take(batch).enumerate().map(
                |(k, client)| async move {
                    let t0 = Instant::now();
                    let created = call_ok(
                        client,
                        "create_sandbox",
                        json!({"conversation_id": format!("idle-{}", base + k)}),
                    )
                    .await?;
                    let elapsed = t0.elapsed();
                    let id = sandbox_id(&created)?;
                    call_ok(
                        client,
                        "execute_code",
                        json!({"sandbox_id": id, "code": "import pandas as pd, numpy as np, matplotlib.pyplot as plt\nx = 1\nx"}),
                    )
                    .await?;
                    Ok::<_, anyhow::Error>((id, elapsed))
                },
            ))
            .await;
            for m in made {
                match m {
                    Ok((id, elapsed)) => {
                        live.push(id);
                        create_times.push(elapsed);
                    }
                    Err(e) => errors.fail(format!("{e:#}")),
                }
            }
            if errors.errors.len() > 20 {
                break;
            }
        }
        // Let the pool's refills finish so that nothing is starting while memory is read.
        settle_refills(gateway).await;
        let leased: std::collections::HashSet<&str> = live.iter().map(String::as_str).collect();
        let containers = instance_containers(docker, &gateway.instance).await;
        let mut usage = Vec::new();
        let mut working = Vec::new();
        for (container, sandbox) in &containers {
            if !leased.contains(sandbox.as_str()) {
                continue;
            }
            if let Some((u, w)) = container_memory_mb(container) {
                usage.push(u);
                working.push(w);
            }
        }
        rss.push((
            match target {
                10 => "10",
                50 => "50",
                _ => "150",
            },
            gateway.rss_mb(),
        ));
        per_sandbox.push((target, live.len(), usage, working));
    }
    for (target, count, usage, working) in per_sandbox {
        let usage_copy = usage.clone();
        rows.push(
            Row::new(
                &format!("mem.sandbox_at_{target}"),
                "memory",
                &format!("idle sandbox, cgroup memory usage ({count} live)"),
                "MB",
                usage,
            )
            .extra("live", json!(count)),
        );
        // Usage less inactive file pages (what `docker stats` shows); kept in the JSON only
        // when it differs, since tmpfs and anonymous pages are never "inactive file".
        if working != usage_copy {
            rows.push(Row::new(
                &format!("mem.sandbox_working_at_{target}"),
                "memory",
                &format!("idle sandbox, usage less inactive file cache ({count} live)"),
                "MB",
                working,
            ));
        }
    }
    for (at, mb) in rss {
        rows.push(Row::new(
            &format!("mem.gateway_rss_at_{at}"),
            "memory",
            &format!("gateway resident memory, {at} leased sandboxes"),
            "MB",
            mb.into_iter().collect(),
        ));
    }
    let mut row = Row::ms(
        "mem.create_under_load",
        "memory",
        "create_sandbox while filling to the most sandboxes (10 at once)",
        &create_times,
    );
    row.errors = errors.errors.len();
    row.error_samples = errors.errors.iter().take(3).cloned().collect();
    rows.push(row.extra("live_reached", json!(live.len())));
    Ok(rows)
}

async fn settle_refills(gateway: &Gateway) {
    let mut last = gateway.ready_events.load(Ordering::SeqCst);
    let mut quiet_since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline && quiet_since.elapsed() < Duration::from_secs(8) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = gateway.ready_events.load(Ordering::SeqCst);
        if now != last {
            last = now;
            quiet_since = Instant::now();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The sandbox crate directly (issue 3)

fn profile(image: &str) -> SandboxProfile {
    // The defaults of config/default.toml.
    SandboxProfile {
        name: "default".into(),
        image: image.into(),
        runtime: "runc".into(),
        memory_mb: 512,
        cpus: 1.0,
        pids_limit: 256,
        nofile: 1024,
        tmp_size_mb: 64,
        home_size_mb: 512,
    }
}

async fn bench_crate(opts: &Options, backend: &DockerBackend, image: &str) -> Result<Vec<Row>> {
    let c = opts.counts;
    let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut config = ManagerConfig::new(instance.clone());
    config.pool = PoolConfig {
        min_ready: 2,
        max_concurrent_starts: 2,
    };
    let manager = SandboxManager::start(Arc::new(backend.clone()), vec![profile(image)], config)?;
    let result = async {
        let mut rows = Vec::new();
        let budget = Budget::secs(240);
        let mut warm = Samples::default();
        for _ in 0..c.warm_creates {
            let deadline = Instant::now() + Duration::from_secs(120);
            while manager.ready_count("default") < 2 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if let Some(sandbox) = warm
                .time(&budget, async { Ok(manager.lease("default").await?) })
                .await
            {
                manager.close(sandbox).await?;
            }
        }
        rows.push(Row::ms(
            "crate.lease_warm",
            "sandbox crate",
            "SandboxManager::lease, warm pool",
            &warm,
        ));
        let mut cold = Samples::default();
        for _ in 0..c.cold_creates {
            if let Some(sandbox) = cold
                .time(&budget, async { Ok(manager.launch("default").await?) })
                .await
            {
                manager.close(sandbox).await?;
            }
        }
        rows.push(Row::ms(
            "crate.start_cold",
            "sandbox crate",
            "cold start (create, start, attach, agent ready)",
            &cold,
        ));
        let sandbox = manager.lease("default").await?;
        let mut exec = Samples::default();
        for i in 0..c.exec + 10 {
            let mut sink = Samples::default();
            let target = if i < 10 { &mut sink } else { &mut exec };
            target
                .time(&budget, async {
                    Ok(sandbox.exec("1+1", ExecOptions::default(), None).await?)
                })
                .await;
        }
        rows.push(Row::ms(
            "crate.exec_1p1",
            "sandbox crate",
            "exec 1+1 round trip",
            &exec,
        ));
        let mut cmd = Samples::default();
        for _ in 0..c.exec / 2 {
            cmd.time(&budget, async {
                Ok(sandbox
                    .command("true", CommandOptions::default(), None)
                    .await?)
            })
            .await;
        }
        rows.push(Row::ms(
            "crate.command_true",
            "sandbox crate",
            "command `true` round trip",
            &cmd,
        ));
        let mut files = Samples::default();
        let mut rng = XorShift(7);
        for _ in 0..c.files {
            let data = rng.bytes(MIB);
            files
                .time(&budget, async {
                    sandbox.write_file("blob.bin", &data, true).await?;
                    let (back, _) = sandbox.read_file("blob.bin", 2 * MIB as u64).await?;
                    if back != data {
                        bail!("read back other bytes");
                    }
                    Ok(())
                })
                .await;
        }
        rows.push(Row::ms(
            "crate.file_1mib",
            "sandbox crate",
            "write + read 1 MiB",
            &files,
        ));
        manager.close(sandbox).await?;
        Ok::<_, anyhow::Error>(rows)
    }
    .await;
    manager.shutdown().await;
    remove_instance(backend.client(), &instance).await;
    result
}

// ---------------------------------------------------------------------------------------------
// The naive Docker-API path

fn naive_config(
    image: &str,
    instance: &str,
    cmd: Vec<String>,
) -> bollard::models::ContainerCreateBody {
    // sandgate's own hardened configuration (same limits, no network, init), another command.
    let spec = LaunchSpec {
        profile: profile(image),
        instance: instance.into(),
        sandbox_id: format!("naive_{}", uuid::Uuid::new_v4().simple()),
    };
    let mut body = sandgate_sandbox::docker::container_config(&spec);
    body.cmd = Some(cmd);
    body.open_stdin = Some(false);
    body.attach_stdin = Some(false);
    body
}

async fn create_start(
    docker: &Docker,
    body: bollard::models::ContainerCreateBody,
) -> Result<String> {
    let id = docker
        .create_container(
            None::<bollard::query_parameters::CreateContainerOptions>,
            body,
        )
        .await?
        .id;
    docker
        .start_container(&id, None::<StartContainerOptions>)
        .await?;
    Ok(id)
}

async fn remove(docker: &Docker, id: &str) -> Result<()> {
    docker
        .remove_container(
            id,
            Some(RemoveContainerOptionsBuilder::new().force(true).build()),
        )
        .await?;
    Ok(())
}

/// `docker exec`: runs `cmd` (with `stdin` fed when given) and returns its stdout.
async fn exec(docker: &Docker, id: &str, cmd: &[&str], stdin: Option<&[u8]>) -> Result<Vec<u8>> {
    let created = docker
        .create_exec(
            id,
            CreateExecOptions {
                cmd: Some(cmd.iter().map(|s| (*s).to_owned()).collect()),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                attach_stdin: Some(stdin.is_some()),
                ..CreateExecOptions::default()
            },
        )
        .await?;
    let mut out = Vec::new();
    match docker.start_exec(&created.id, None).await? {
        StartExecResults::Attached {
            mut output,
            mut input,
        } => {
            if let Some(data) = stdin {
                input.write_all(data).await?;
                input.shutdown().await?;
            }
            drop(input);
            while let Some(chunk) = output.next().await {
                if let bollard::container::LogOutput::StdOut { message } = chunk? {
                    out.extend_from_slice(&message);
                }
            }
        }
        StartExecResults::Detached => bail!("exec detached"),
    }
    let inspected = docker.inspect_exec(&created.id).await?;
    if inspected.exit_code != Some(0) {
        bail!("{cmd:?} exited with {:?}", inspected.exit_code);
    }
    Ok(out)
}

/// A fresh container that runs `python3 -c 'print(1)'` to exit; its output read over attach.
async fn fresh_container(docker: &Docker, image: &str, instance: &str) -> Result<()> {
    let body = naive_config(
        image,
        instance,
        vec!["python3".into(), "-c".into(), "print(1)".into()],
    );
    let id = docker
        .create_container(Some(CreateContainerOptionsBuilder::new().build()), body)
        .await?
        .id;
    let run = async {
        let attached = docker
            .attach_container(
                &id,
                Some(
                    AttachContainerOptionsBuilder::new()
                        .stdout(true)
                        .stderr(true)
                        .stream(true)
                        .build(),
                ),
            )
            .await?;
        docker
            .start_container(&id, None::<StartContainerOptions>)
            .await?;
        let mut out = Vec::new();
        let mut output = attached.output;
        while let Some(chunk) = output.next().await {
            if let bollard::container::LogOutput::StdOut { message } = chunk? {
                out.extend_from_slice(&message);
            }
        }
        let mut wait = docker.wait_container(&id, None::<WaitContainerOptions>);
        while let Some(w) = wait.next().await {
            w?;
        }
        if out != b"1\n" {
            bail!("printed {:?}", String::from_utf8_lossy(&out));
        }
        Ok(())
    }
    .await;
    remove(docker, &id).await?;
    run
}

async fn bench_naive(opts: &Options, docker: &Docker, image: &str) -> Result<Vec<Row>> {
    let c = opts.counts;
    let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let sleeper = || naive_config(image, &instance, vec!["sleep".into(), "infinity".into()]);
    let result = async {
        let mut rows = Vec::new();
        let budget = Budget::secs(240);
        let mut lease = Samples::default();
        for _ in 0..c.naive {
            if let Some(id) = lease.time(&budget, create_start(docker, sleeper())).await {
                remove(docker, &id).await?;
            }
        }
        rows.push(
            Row::ms(
                "naive.lease",
                "naive Docker API",
                "create + start a container (nothing preloaded)",
                &lease,
            )
            .vs("crate.lease_warm"),
        );
        let mut per_call = Samples::default();
        for _ in 0..c.naive {
            per_call
                .time(&budget, async {
                    let id = create_start(docker, sleeper()).await?;
                    let out = exec(docker, &id, &["python3", "-c", "print(1+1)"], None).await;
                    remove(docker, &id).await?;
                    if out? != b"2\n" {
                        bail!("unexpected output");
                    }
                    Ok(())
                })
                .await;
        }
        rows.push(
            Row::ms(
                "naive.per_call",
                "naive Docker API",
                "create + start + exec python3 -c 'print(1+1)' + remove, per call",
                &per_call,
            )
            .vs("crate.exec_1p1"),
        );
        let mut fresh = Samples::default();
        for _ in 0..c.naive {
            fresh
                .time(&budget, fresh_container(docker, image, &instance))
                .await;
        }
        rows.push(
            Row::ms(
                "naive.fresh_container",
                "naive Docker API",
                "fresh container per call: python3 -c 'print(1)' to exit",
                &fresh,
            )
            .vs("mcp.exec_1p1"),
        );
        let id = create_start(docker, sleeper()).await?;
        let mut py = Samples::default();
        let mut tru = Samples::default();
        let mut files = Samples::default();
        let mut rng = XorShift(9);
        for _ in 0..c.naive * 3 {
            py.time(
                &budget,
                exec(docker, &id, &["python3", "-c", "print(1+1)"], None),
            )
            .await;
        }
        for _ in 0..c.naive * 3 {
            tru.time(&budget, exec(docker, &id, &["true"], None)).await;
        }
        for _ in 0..c.naive {
            let data = rng.bytes(MIB);
            files
                .time(&budget, async {
                    exec(
                        docker,
                        &id,
                        &["sh", "-c", "cat > /home/user/blob.bin"],
                        Some(&data),
                    )
                    .await?;
                    let back = exec(docker, &id, &["cat", "/home/user/blob.bin"], None).await?;
                    if back != data {
                        bail!("read back {} other bytes", back.len());
                    }
                    Ok(())
                })
                .await;
        }
        remove(docker, &id).await?;
        rows.push(
            Row::ms(
                "naive.exec_python",
                "naive Docker API",
                "docker exec python3 -c 'print(1+1)' in a running container",
                &py,
            )
            .vs("mcp.exec_1p1"),
        );
        rows.push(
            Row::ms(
                "naive.exec_true",
                "naive Docker API",
                "docker exec true in a running container",
                &tru,
            )
            .vs("crate.command_true"),
        );
        rows.push(
            Row::ms(
                "naive.file_1mib",
                "naive Docker API",
                "docker exec: write 1 MiB (stdin) + read it (cat)",
                &files,
            )
            .vs("crate.file_1mib"),
        );
        Ok::<_, anyhow::Error>(rows)
    }
    .await;
    remove_instance(docker, &instance).await;
    result
}

// ---------------------------------------------------------------------------------------------
// The peers (Python)

fn peers_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/peers")
}

async fn run_peer(python: &str, script: &str, args: &[String]) -> Result<Vec<Row>> {
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
        let samples = Samples {
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
        };
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

async fn bench_peers(opts: &Options) -> Vec<Row> {
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

// ---------------------------------------------------------------------------------------------
// Report

fn fmt(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) if v >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
        None => "—".into(),
    }
}

fn ratio(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 10.0 => format!("{v:.0}×"),
        Some(v) => format!("{v:.1}×"),
        None => String::new(),
    }
}

fn fill_ratios(rows: &mut [Row]) {
    let p: HashMap<String, (Option<f64>, Option<f64>)> = rows
        .iter()
        .map(|r| (r.id.clone(), (r.p50, r.p99)))
        .collect();
    for row in rows.iter_mut() {
        if let Some((Some(b50), b99)) = row.vs.as_ref().and_then(|v| p.get(v)) {
            row.ratio_p50 = row.p50.map(|v| v / b50);
            row.ratio_p99 = match (row.p99, b99) {
                (Some(a), Some(b)) => Some(a / b),
                _ => None,
            };
        }
    }
}

fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let mut section = "";
    out.push_str("| measured | n | p50 | p99 | errors | vs sandgate (p50 / p99) |\n");
    out.push_str("|---|---:|---:|---:|---:|---|\n");
    for r in rows {
        if r.section != section {
            section = &r.section;
            out.push_str(&format!("| **{section}** | | | | | |\n"));
        }
        let vs = match (&r.vs, r.ratio_p50) {
            (Some(v), Some(_)) => format!(
                "{} / {} slower than `{v}`",
                ratio(r.ratio_p50),
                ratio(r.ratio_p99)
            ),
            _ => String::new(),
        };
        let mut what = r.what.clone();
        if let Some(pm) = r.extra.get("per_minute").and_then(Value::as_f64) {
            what.push_str(&format!("; {pm:.1} conversations/min"));
        }
        out.push_str(&format!(
            "| `{}` {} | {} | {} {} | {} {} | {} | {} |\n",
            r.id,
            what,
            r.n,
            fmt(r.p50),
            r.unit,
            fmt(r.p99),
            r.unit,
            r.errors,
            vs
        ));
    }
    out
}

struct Goal {
    what: &'static str,
    value: Option<f64>,
    limit: f64,
    /// true: the value must be at most the limit; false: at least.
    at_most: bool,
    unit: &'static str,
}

fn goals(rows: &[Row]) -> Vec<Goal> {
    let get = |id: &str| rows.iter().find(|r| r.id == id);
    let p50 = |id: &str| get(id).and_then(|r| r.p50);
    let p99 = |id: &str| get(id).and_then(|r| r.p99);
    let ratio = |id: &str| get(id).and_then(|r| r.ratio_p50);
    let errors = |id: &str| get(id).map(|r| r.errors as f64);
    vec![
        Goal {
            what: "warm create_sandbox p50 (MCP)",
            value: p50("mcp.create_warm"),
            limit: 10.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "warm create_sandbox p99 (MCP)",
            value: p99("mcp.create_warm"),
            limit: 40.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "execute_code 1+1 p50 (MCP)",
            value: p50("mcp.exec_1p1"),
            limit: 3.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "errors in 50 concurrent conversations",
            value: errors("mcp.conversation_x50"),
            limit: 0.0,
            at_most: true,
            unit: "",
        },
        Goal {
            what: "idle sandbox memory p50 (cgroup, 50 live)",
            value: p50("mem.sandbox_at_50"),
            limit: 110.0,
            at_most: true,
            unit: "MB",
        },
        Goal {
            what: "errors reaching 150 live sandboxes",
            value: get("mem.sandbox_at_150")
                .map(|_| errors("mem.create_under_load").unwrap_or(0.0)),
            limit: 0.0,
            at_most: true,
            unit: "",
        },
        Goal {
            what: "gateway RSS with 50 sandboxes",
            value: p50("mem.gateway_rss_at_50"),
            limit: 100.0,
            at_most: true,
            unit: "MB",
        },
        Goal {
            what: "llm-sandbox open+run+close / ours (p50)",
            value: ratio("llm_sandbox.open_run_close"),
            limit: 20.0,
            at_most: false,
            unit: "×",
        },
        Goal {
            what: "llm-sandbox repeated run / ours (p50)",
            value: ratio("llm_sandbox.run"),
            limit: 10.0,
            at_most: false,
            unit: "×",
        },
        Goal {
            what: "llm-sandbox interactive run / ours (p50)",
            value: ratio("llm_sandbox.interactive_run"),
            limit: 10.0,
            at_most: false,
            unit: "×",
        },
    ]
}

fn goal_table(goals: &[Goal]) -> String {
    let mut out = String::from("| goal | target | this run | |\n|---|---:|---:|---|\n");
    for g in goals {
        let target = format!(
            "{} {}{}",
            if g.at_most { "≤" } else { "≥" },
            g.limit,
            g.unit
        );
        let (value, verdict) = match g.value {
            None => ("not measured".to_owned(), String::new()),
            Some(v) => {
                let met = if g.at_most {
                    v <= g.limit
                } else {
                    v >= g.limit
                };
                let verdict = if met {
                    "met".to_owned()
                } else if g.limit > 0.0 {
                    let by = if g.at_most { v / g.limit } else { g.limit / v };
                    format!("**missed** ({by:.1}× off)")
                } else {
                    "**missed**".to_owned()
                };
                (format!("{}{}", fmt(Some(v)), g.unit), verdict)
            }
        };
        out.push_str(&format!(
            "| {} | {target} | {value} | {verdict} |\n",
            g.what
        ));
    }
    out
}

fn machine() -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_default();
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0 / 1024.0);
    m.insert("cpu".into(), json!(cpu));
    m.insert(
        "cores".into(),
        json!(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0)
        ),
    );
    m.insert("memory_gib".into(), json!(mem_gib));
    m.insert(
        "kernel".into(),
        json!(
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
        ),
    );
    m
}

// ---------------------------------------------------------------------------------------------

fn main() -> Result<()> {
    let opts = options()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(opts))
}

async fn run(opts: Options) -> Result<()> {
    let image = std::env::var("SANDGATE_SANDBOX__IMAGE")
        .context("SANDGATE_SANDBOX__IMAGE is not set (run scripts/bench.sh)")?;
    let backend = DockerBackend::connect("")?;
    backend.ensure_image(&image).await?;
    let docker = backend.client().clone();
    let version = docker.version().await?;
    let started = chrono::Utc::now();
    let t0 = Instant::now();

    let mut rows = Vec::new();
    eprintln!("[bench] sandgate through MCP");
    rows.extend(bench_mcp(&opts, &docker).await?.rows);
    if !opts.exec_only {
        eprintln!("[bench] the sandbox crate directly");
        rows.extend(bench_crate(&opts, &backend, &image).await?);
        eprintln!("[bench] the naive Docker-API path");
        rows.extend(bench_naive(&opts, &docker, &image).await?);
    }
    if opts.peers && !opts.exec_only {
        rows.extend(bench_peers(&opts).await);
    }
    fill_ratios(&mut rows);
    let goals = goals(&rows);

    let mut machine = machine();
    machine.insert("docker".into(), json!(version.version));
    machine.insert("image".into(), json!(image));
    let table = table(&rows);
    let goal_table = goal_table(&goals);
    println!(
        "\nsandgate benchmark, {} ({:.0} s){}\n",
        started.format("%Y-%m-%d %H:%M UTC"),
        t0.elapsed().as_secs_f64(),
        if opts.quick { ", --quick" } else { "" }
    );
    println!(
        "machine: {} · {} cores · {:.0} GiB · Docker {} · kernel {}\n",
        machine["cpu"].as_str().unwrap_or(""),
        machine["cores"],
        machine["memory_gib"].as_f64().unwrap_or(0.0),
        machine["docker"].as_str().unwrap_or(""),
        machine["kernel"].as_str().unwrap_or("")
    );
    println!("{table}");
    println!("{goal_table}");
    let report = json!({
        "started": started.to_rfc3339(),
        "seconds": t0.elapsed().as_secs_f64(),
        "quick": opts.quick,
        "machine": machine,
        "rows": rows,
        "table_markdown": table,
        "goals_markdown": goal_table,
    });
    std::fs::write(&opts.out, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", opts.out.display()))?;
    eprintln!("[bench] wrote {}", opts.out.display());
    Ok(())
}
