//! One-off measurements of snapshot restores through the sandbox manager (docs/snapshots.md,
//! "Restoring without Docker's copies"). Not a test: it prints figures and asserts none.
//!
//! ```text
//! cargo run -p sandgate-sandbox --example snapshot_bench -- restore|analyst
//! ```
//!
//! - `restore`: a template (the `runsc2024` profile, its data stack imported) checkpointed and
//!   left running, then `N` restores one at a time (restore, first `1+1`), then 4 and 16 at once.
//! - `analyst`: `N` support-analyst conversations at the sandbox crate (write `tickets.csv`,
//!   group-by, chart, read the chart, close) in a fresh runc sandbox and in a gVisor sandbox
//!   restored from the template; wall and CPU per conversation.
//!
//! Environment: `SANDGATE_SANDBOX__IMAGE` (the image), `BENCH_DOCKER` (engine; default the
//! local one), `BENCH_PLAIN` (its plaintext tmpfs), `BENCH_ENGINE_CPUACCT` (a cgroup v1
//! `cpuacct.usage` holding the engine's dockerd, containerd and shims; engine CPU is 0 without
//! it), `BENCH_N` (default 10). Container CPU is the container's own `cpuacct` group
//! (`/sys/fs/cgroup/cpuacct/docker/<id>`), read before it is removed.

use std::sync::Arc;
use std::time::Instant;

use sandgate_sandbox::{
    DockerBackend, ExecOptions, ManagerConfig, OciRuntime, PoolConfig, Sandbox, SandboxManager,
    SandboxProfile, Snapshot,
};

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

type Error = Box<dyn std::error::Error + Send + Sync>;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// 10 000 tickets as CSV (the bench's shape; a fixed linear congruential sequence).
fn tickets_csv() -> String {
    let (regions, products) = (
        ["EMEA", "NA", "LATAM", "APAC"],
        ["billing", "login", "shipping", "returns", "api"],
    );
    let mut x: u64 = 0x5eed_cafe_f00d_d00d;
    let mut next = |n: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % n
    };
    let mut csv = String::from("ticket_id,region,product,minutes,csat\n");
    for id in 0..10_000 {
        let (r, p) = (regions[next(4) as usize], products[next(5) as usize]);
        csv.push_str(&format!("{id},{r},{p},{},{}\n", 5 + next(600), 1 + next(5)));
    }
    csv
}

fn read_ns(path: &str) -> f64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e9)
}

fn engine_cpu() -> f64 {
    std::env::var("BENCH_ENGINE_CPUACCT").map_or(0.0, |p| read_ns(&p))
}

fn container_cpu(sandbox: &Sandbox) -> f64 {
    read_ns(&format!(
        "/sys/fs/cgroup/cpuacct/docker/{}/cpuacct.usage",
        sandbox.container_id()
    ))
}

/// min / p50 / max of `values`.
fn spread(values: &[f64]) -> String {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => "-".into(),
        n => format!("{:.3} / {:.3} / {:.3}", v[0], v[n / 2], v[n - 1]),
    }
}

async fn exec_ok(sandbox: &Sandbox, code: &str) -> Result<String, Error> {
    let outcome = sandbox.exec(code, ExecOptions::default(), None).await?;
    if let Some(error) = outcome.error {
        return Err(format!("the cell failed: {error:?}").into());
    }
    Ok(outcome
        .result
        .and_then(|r| r.get("text/plain").cloned())
        .unwrap_or_default())
}

async fn manager() -> Result<SandboxManager, Error> {
    let plain = env("BENCH_PLAIN", "/var/cache/sandgate/docker/plain");
    let backend = DockerBackend::connect(&env("BENCH_DOCKER", ""))?.with_snapshots(plain);
    let route = backend.snapshot_route_of("runsc2024").await?;
    let load = std::fs::read_to_string("/proc/loadavg")?;
    println!("engine route: {route}; load average: {}", load.trim());
    let image = std::env::var("SANDGATE_SANDBOX__IMAGE")?;
    let profile = |name: &str, runtime| SandboxProfile {
        name: name.into(),
        image: image.clone(),
        runtime,
        ..SandboxProfile::default()
    };
    let mut config = ManagerConfig::new(format!("bench-snap-{}", std::process::id()));
    config.pool = PoolConfig {
        min_ready: 0,
        max_ready: 0,
        max_concurrent_starts: 16,
    };
    let profiles = vec![
        profile("snap", OciRuntime::Runsc2024),
        profile("runc", OciRuntime::Runc),
    ];
    Ok(SandboxManager::start(Arc::new(backend), profiles, config)?)
}

/// The template: a gVisor sandbox with its data stack imported, checkpointed and left running.
async fn template(manager: &SandboxManager) -> Result<(Sandbox, Snapshot), Error> {
    let template = manager.lease("snap").await?;
    exec_ok(&template, "import numpy, pandas, matplotlib.pyplot").await?;
    let (t0, e0) = (Instant::now(), engine_cpu());
    let snapshot = manager.checkpoint(&template, true).await?;
    println!(
        "checkpoint (left running): {:.3} s wall, engine {:.3} CPU-s, image {:.1} MB",
        t0.elapsed().as_secs_f64(),
        engine_cpu() - e0,
        snapshot.size_bytes() as f64 / 1e6
    );
    Ok((template, snapshot))
}

/// One restore and its first answer: (restore s, first answer s, engine CPU, container CPU).
async fn one_restore(manager: &SandboxManager, snapshot: &Snapshot) -> Result<[f64; 4], Error> {
    let (t0, e0) = (Instant::now(), engine_cpu());
    let sandbox = manager.restore(snapshot).await?;
    let restored = t0.elapsed().as_secs_f64();
    let answer = exec_ok(&sandbox, "1+1").await?;
    let first = t0.elapsed().as_secs_f64() - restored;
    let cpu = [engine_cpu() - e0, container_cpu(&sandbox)];
    manager.close(sandbox).await?;
    if answer != "2" {
        return Err(format!("1+1 answered {answer}").into());
    }
    Ok([restored, first, cpu[0], cpu[1]])
}

async fn restores(manager: &SandboxManager, n: usize) -> Result<(), Error> {
    let (template, snapshot) = template(manager).await?;
    let mut rows = Vec::new();
    for _ in 0..n {
        rows.push(one_restore(manager, &snapshot).await?);
    }
    let col = |i: usize| rows.iter().map(|r| r[i]).collect::<Vec<_>>();
    println!(
        "{n} restores one at a time (min / p50 / max): restore {} s, first 1+1 {} s, \
         engine {} CPU-s, container {} CPU-s",
        spread(&col(0)),
        spread(&col(1)),
        spread(&col(2)),
        spread(&col(3))
    );
    for at_once in [4, 16] {
        let (t0, e0) = (Instant::now(), engine_cpu());
        let all =
            futures::future::join_all((0..at_once).map(|_| one_restore(manager, &snapshot))).await;
        let wall = t0.elapsed().as_secs_f64();
        let ok: Vec<_> = all.iter().filter_map(|r| r.as_ref().ok()).collect();
        let failed: Vec<_> = all.iter().filter_map(|r| r.as_ref().err()).collect();
        println!(
            "{at_once} at once: {}/{at_once} answered 1+1, {wall:.2} s wall in all, engine {:.2} + \
             containers {:.2} CPU-s; per restore {} s; failures: {failed:?}",
            ok.len(),
            engine_cpu() - e0,
            ok.iter().map(|r| r[3]).sum::<f64>(),
            spread(&ok.iter().map(|r| r[0]).collect::<Vec<_>>())
        );
    }
    manager.close(template).await?;
    Ok(())
}

/// One analyst conversation in `sandbox`, closed at the end: container CPU.
async fn conversation(manager: &SandboxManager, sandbox: Sandbox, csv: &str) -> Result<f64, Error> {
    sandbox
        .write_file("tickets.csv", csv.as_bytes(), true)
        .await?;
    if !exec_ok(&sandbox, GROUP_BY).await?.contains("EMEA") {
        return Err("the group-by did not show the regions".into());
    }
    let chart = sandbox.exec(CHART, ExecOptions::default(), None).await?;
    if chart.displays.is_empty() {
        return Err("the chart cell showed no image".into());
    }
    let (png, _) = sandbox.read_file("chart.png", 10 << 20).await?;
    if png.len() < 1000 {
        return Err("chart.png is too small".into());
    }
    let cpu = container_cpu(&sandbox);
    manager.close(sandbox).await?;
    Ok(cpu)
}

async fn analyst(manager: &SandboxManager, n: usize) -> Result<(), Error> {
    let csv = tickets_csv();
    let (template, snapshot) = template(manager).await?;
    for kind in ["runc, fresh", "gVisor, restored from the template"] {
        let mut rows = Vec::new();
        for _ in 0..n {
            let (t0, e0) = (Instant::now(), engine_cpu());
            let sandbox = if kind.starts_with("runc") {
                manager.lease("runc").await?
            } else {
                manager.restore(&snapshot).await?
            };
            let ready = t0.elapsed().as_secs_f64();
            let ctr = conversation(manager, sandbox, &csv).await?;
            rows.push([ready, t0.elapsed().as_secs_f64(), engine_cpu() - e0, ctr]);
        }
        let col = |i: usize| rows.iter().map(|r| r[i]).collect::<Vec<_>>();
        let total: Vec<f64> = rows.iter().map(|r| r[2] + r[3]).collect();
        println!(
            "analyst conversation, {kind}, n={n} (min / p50 / max): sandbox ready {} s, \
             whole conversation {} s; engine {} + container {} = {} CPU-s",
            spread(&col(0)),
            spread(&col(1)),
            spread(&col(2)),
            spread(&col(3)),
            spread(&total)
        );
    }
    manager.close(template).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let n: usize = env("BENCH_N", "10").parse()?;
    let manager = manager().await?;
    let result = match mode.as_str() {
        "restore" => restores(&manager, n).await,
        "analyst" => analyst(&manager, n).await,
        other => Err(format!("unknown mode {other:?}: restore or analyst").into()),
    };
    manager.shutdown().await;
    result
}
