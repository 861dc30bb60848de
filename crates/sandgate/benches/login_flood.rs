//! The login-flood benchmark (issue 11): 500 concurrent wrong-password sign-ins against a
//! running gateway, once from one address and once spread over 250 loopback addresses
//! (127.0.0.2 and up, by binding each client socket's source address), so that both the
//! per-address limiter and the global bound on password hashing are exercised. It reports the
//! gateway's peak resident memory during each flood (sampled from /proc) and a legitimate MCP
//! call's latency (`execute_code 1+1` through the rmcp client) during the flood next to its
//! latency without one. Not a test: nothing here asserts a duration; it prints a table.
//!
//! Run: `scripts/bench-login-flood.sh` (or `cargo bench -p sandgate --bench login_flood` with
//! `DATABASE_URL` and `SANDGATE_SANDBOX__IMAGE` set). Everything talks to loopback only.

use std::net::{IpAddr, Ipv4Addr};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use serde_json::json;
use sqlx::Connection;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

#[path = "../../../tests/e2e/mcp_client.rs"]
#[allow(dead_code)] // shared with the e2e tests; the bench uses only part of it
mod mcp_client;

#[path = "../../../tests/e2e/login_form.rs"]
mod login_form;

use login_form::LoginForm;
use mcp_client::{Client, Era};

/// The `sandgate` binary (built in the same profile as this bench).
const BIN: &str = env!("CARGO_BIN_EXE_sandgate");
/// Concurrent sign-ins per flood.
const FLOOD: usize = 500;
/// Source addresses of the spread flood.
const ADDRESSES: usize = 250;
/// MCP calls measured without a flood.
const BASELINE_CALLS: usize = 50;

#[tokio::main]
async fn main() -> Result<()> {
    let admin_url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let database = fresh_database(&admin_url).await?;
    let gateway = Gateway::start(&database).await?;
    let tenant = gateway
        .cli(&["admin", "tenant", "create", "flood"], None)
        .await?;
    gateway
        .cli(
            &[
                "admin",
                "user",
                "create",
                "--tenant",
                &tenant,
                "--email",
                "owner@example.com",
            ],
            Some("correct horse battery staple\n"),
        )
        .await?;
    let token = gateway
        .cli(
            &[
                "admin", "token", "issue", "--tenant", &tenant, "--ttl", "1h",
            ],
            None,
        )
        .await?;
    let client = Client::connect(&format!("{}/mcp", gateway.base), &token, Era::Stateless)
        .await
        .map_err(|e| anyhow!(e))?;
    let args = json!({"conversation_id": "bench-flood", "code": "1+1"});
    client.ok("execute_code", args.clone()).await; // lease the sandbox

    let mut baseline = Vec::new();
    for _ in 0..BASELINE_CALLS {
        let started = Instant::now();
        client.ok("execute_code", args.clone()).await;
        baseline.push(started.elapsed());
    }
    let idle_rss = rss_kib(gateway.pid, "VmRSS")?;
    println!("login flood benchmark: {FLOOD} concurrent wrong-password sign-ins");
    println!("gateway RSS before: {:.1} MB", idle_rss as f64 / 1024.0);
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "case", "peak MB", "MCP p50", "MCP p95", "calls", "401", "429", "503", "closed"
    );
    let (p50, p95) = percentiles(&mut baseline);
    println!(
        "{:<34} {:>9} {:>8.1}ms {:>8.1}ms {:>7} {:>7} {:>7} {:>7}",
        "no flood",
        "-",
        p50,
        p95,
        baseline.len(),
        "-",
        "-",
        "-"
    );
    for (case, spread) in [
        ("one address (127.0.0.1)", 1),
        ("250 addresses (127.0.0.2+)", ADDRESSES),
    ] {
        let row = flood(&gateway, &client, &args, spread).await?;
        let mut latencies = row.latencies;
        let (p50, p95) = percentiles(&mut latencies);
        println!(
            "{:<34} {:>9.1} {:>8.1}ms {:>8.1}ms {:>7} {:>7} {:>7} {:>7} {:>7}",
            case,
            row.peak_rss_kib as f64 / 1024.0,
            p50,
            p95,
            latencies.len(),
            row.statuses[0],
            row.statuses[1],
            row.statuses[2],
            row.statuses[3],
        );
    }
    println!(
        "gateway VmHWM (peak RSS over the whole run): {:.1} MB",
        rss_kib(gateway.pid, "VmHWM")? as f64 / 1024.0
    );
    drop(client);
    gateway.stop().await;
    Ok(())
}

/// What one flood produced.
struct FloodRow {
    peak_rss_kib: u64,
    latencies: Vec<Duration>,
    /// Counts of 401, 429 and 503 answers, and of attempts whose connection was closed (the
    /// per-address connection cap) or that got anything else.
    statuses: [u64; 4],
}

/// Fires `FLOOD` sign-ins at once from `spread` source addresses while measuring MCP calls and
/// sampling the gateway's RSS.
async fn flood(
    gateway: &Gateway,
    client: &Client,
    args: &serde_json::Value,
    spread: usize,
) -> Result<FloodRow> {
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (done, peak, pid) = (done.clone(), peak.clone(), gateway.pid);
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Ok(kib) = rss_kib(pid, "VmRSS") {
                    peak.fetch_max(kib, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut attempts = tokio::task::JoinSet::new();
    let clients: Vec<reqwest::Client> = (0..spread)
        .map(|i| {
            let from = if spread == 1 {
                Ipv4Addr::new(127, 0, 0, 1)
            } else {
                let n = 2 + i as u32;
                Ipv4Addr::new(127, 0, (n >> 8) as u8, (n & 0xff) as u8)
            };
            reqwest::Client::builder()
                .local_address(IpAddr::V4(from))
                .redirect(reqwest::redirect::Policy::none())
                .pool_max_idle_per_host(0)
                .build()
                .expect("an HTTP client")
        })
        .collect();
    let start = Arc::new(tokio::sync::Barrier::new(FLOOD + 1));
    for i in 0..FLOOD {
        let http = clients[i % spread].clone();
        let base = gateway.base.clone();
        let start = start.clone();
        attempts.spawn(async move { wrong_sign_in(&http, &base, i, &start).await });
    }
    start.wait().await;
    let mut latencies = Vec::new();
    while !attempts.is_empty() {
        let started = Instant::now();
        client.ok("execute_code", args.clone()).await;
        latencies.push(started.elapsed());
        while let Some(result) = attempts.try_join_next() {
            result??;
        }
    }
    done.store(true, Ordering::Relaxed);
    sampler.await?;
    // Each attempt counted its answer into a shared counter.
    let statuses = [0, 1, 2, 3].map(|i| COUNTS[i].swap(0, Ordering::Relaxed));
    Ok(FloodRow {
        peak_rss_kib: peak.load(Ordering::Relaxed),
        latencies,
        statuses,
    })
}

static COUNTS: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

fn index(status: u16) -> usize {
    match status {
        401 => 0,
        429 => 1,
        503 => 2,
        _ => 3,
    }
}

/// One wrong-password sign-in: the form (for its CSRF cookie), then, when every attempt has its
/// form, the POST.
async fn wrong_sign_in(
    http: &reqwest::Client,
    base: &str,
    i: usize,
    start: &tokio::sync::Barrier,
) -> Result<()> {
    let form = LoginForm::load(http, base).await;
    start.wait().await;
    let status = match form {
        Ok(form) => form
            .submit(
                http,
                base,
                &format!("nobody-{i}@example.com"),
                "wrong",
                "/apps",
            )
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0),
        Err(_) => 0,
    };
    COUNTS[index(status)].fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// p50 and p95 in milliseconds.
fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    if samples.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[i].as_secs_f64() * 1000.0
    };
    (at(0.50), at(0.95))
}

/// A line of /proc/<pid>/status in KiB (`VmRSS`, `VmHWM`).
fn rss_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow!("no {field} in /proc/{pid}/status"))
}

async fn fresh_database(admin: &str) -> Result<String> {
    let name = format!("sandgate_flood_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(admin).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await?;
    let base = admin.split('?').next().unwrap_or(admin);
    let cut = base
        .rfind('/')
        .filter(|i| *i > "postgres://".len())
        .unwrap_or(base.len());
    Ok(format!("{}/{name}", &base[..cut]))
}

/// The gateway under test: `sandgate serve` on a free loopback port.
struct Gateway {
    child: tokio::process::Child,
    pid: u32,
    base: String,
    env: Vec<(String, String)>,
}

impl Gateway {
    async fn start(database: &str) -> Result<Gateway> {
        let env = vec![
            ("SANDGATE_DATABASE__URL".to_owned(), database.to_owned()),
            (
                "SANDGATE_INSTANCE".to_owned(),
                format!("flood-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            ),
            ("SANDGATE_LOG__FORMAT".to_owned(), "json".to_owned()),
            ("SANDGATE_LOG__FILTER".to_owned(), "warn".to_owned()),
            ("SANDGATE_POOL__MIN_READY".to_owned(), "1".to_owned()),
        ];
        let mut child = Command::new(BIN)
            .arg("serve")
            .env("SANDGATE_LISTEN", "127.0.0.1:0")
            .env_remove("SANDGATE_TEST_PYTHON")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().context("the gateway runs")?;
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await??
            .context("sandgate printed its URL")?;
        let base = line
            .rsplit(' ')
            .next()
            .context("a URL")?
            .trim_end_matches("/mcp")
            .to_owned();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let mut env = env;
        env.push(("SANDGATE_PUBLIC_URL".to_owned(), base.clone()));
        Ok(Gateway {
            child,
            pid,
            base,
            env,
        })
    }

    async fn cli(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut child = Command::new(BIN)
            .args(args)
            .env_remove("SANDGATE_TEST_PYTHON")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut input = child.stdin.take().context("stdin")?;
        input.write_all(stdin.unwrap_or("").as_bytes()).await?;
        drop(input);
        let output = child.wait_with_output().await?;
        anyhow::ensure!(
            output.status.success(),
            "sandgate {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8(output.stdout)?.trim().to_owned())
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
        let instance = self
            .env
            .iter()
            .find(|(k, _)| k == "SANDGATE_INSTANCE")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        // Remove this run's sandbox containers (labelled with its instance only).
        if let Ok(out) = std::process::Command::new("docker")
            .args([
                "ps",
                "-aq",
                "--filter",
                &format!("label=sandgate.instance={instance}"),
            ])
            .output()
        {
            let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            if !ids.is_empty() {
                let _ = std::process::Command::new("docker")
                    .args(["rm", "-f"])
                    .args(&ids)
                    .output();
            }
        }
    }
}
