//! The lean engine beside Docker (runc), measured at the sandbox crate (docs/benchmarks.md, "The
//! lean engine"). Not a test: it prints figures and asserts none.
//!
//! ```text
//! cargo build -p sandgate-lean && cargo run --release -p sandgate-sandbox --example lean_bench
//! ```
//!
//! For each engine, with no warm pool:
//! - `start`: `N` sandboxes one at a time: lease (a cold start), then the first cell importing
//!   numpy, pandas and matplotlib.pyplot; wall time of each, and the whole machine's CPU (from
//!   `/proc/stat`) per sandbox over create, that cell and close;
//! - `burst`: 10 at once, each a lease and that cell;
//! - `memory`: 50 alive after a small pandas cell: each sandbox's PSS (the sum over its processes,
//!   `/proc/<pid>/smaps_rollup`) and its memory cgroup's usage.
//!
//! Environment: `SANDGATE_SANDBOX__IMAGE` (the image), `SANDGATE_CACHE` (the lean directory is
//! `<cache>/lean`), `BENCH_N` (default 20), `BENCH_ALIVE` (default 50), `BENCH_ENGINES`
//! (default `lean,runc`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandgate_sandbox::{
    DockerBackend, Engines, ExecOptions, LeanBackend, LeanConfig, ManagerConfig, OciRuntime,
    PoolConfig, Sandbox, SandboxManager, SandboxProfile,
};

const IMPORTS: &str = "import numpy, pandas, matplotlib.pyplot\nnumpy.__version__";
const SMALL_PANDAS: &str =
    "import pandas as pd\ndf = pd.DataFrame({'a': range(1000), 'b': range(1000)})\nint(df.a.sum())";

fn machine_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or_default();
    let ticks: u64 = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4) // idle, iowait
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum();
    ticks as f64 / 100.0
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn summary(name: &str, mut values: Vec<f64>, unit: &str) {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    println!(
        "{name}: n={} p50={:.1}{unit} p90={:.1}{unit} max={:.1}{unit}",
        values.len(),
        pct(&values, 0.5),
        pct(&values, 0.9),
        values.last().copied().unwrap_or(f64::NAN)
    );
}

fn cgroup_procs(container_id: &str) -> Vec<i32> {
    let candidates = [
        format!("/sys/fs/cgroup/memory/sandgate-lean/{container_id}/cgroup.procs"),
        format!("/sys/fs/cgroup/sandgate-lean/{container_id}/cgroup.procs"),
        format!("/sys/fs/cgroup/memory/docker/{container_id}/cgroup.procs"),
        format!("/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cgroup.procs"),
    ];
    for path in candidates {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        }
    }
    Vec::new()
}

fn cgroup_usage(container_id: &str) -> Option<f64> {
    let candidates = [
        format!("/sys/fs/cgroup/memory/sandgate-lean/{container_id}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/sandgate-lean/{container_id}/memory.current"),
        format!("/sys/fs/cgroup/memory/docker/{container_id}/memory.usage_in_bytes"),
    ];
    candidates
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| t.trim().parse::<f64>().ok())
        .map(|b| b / 1e6)
}

fn pss_mb(pids: &[i32]) -> f64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok())
        .filter_map(|text| {
            text.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .sum::<f64>()
        / 1024.0
}

async fn manager(engine: &str, instance: &str) -> SandboxManager {
    let image = std::env::var("SANDGATE_SANDBOX__IMAGE").expect("SANDGATE_SANDBOX__IMAGE");
    let docker = DockerBackend::connect("").expect("docker");
    let (runtime, backend): (OciRuntime, Arc<dyn sandgate_sandbox::SandboxBackend>) = match engine {
        "lean" => {
            let cache =
                std::env::var("SANDGATE_CACHE").unwrap_or_else(|_| "/var/cache/sandgate".into());
            let config =
                LeanConfig::beside_executable_in(std::path::PathBuf::from(cache).join("lean"))
                    .expect("the lean library and keeper are built");
            let lean = LeanBackend::new(docker.client().clone(), config).expect("lean engine");
            lean.warm(&image).await.expect("the zygote starts");
            (OciRuntime::Lean, Arc::new(Engines::new(docker, Ok(lean))))
        }
        _ => (OciRuntime::Runc, Arc::new(docker)),
    };
    let mut config = ManagerConfig::new(instance);
    config.pool = PoolConfig {
        min_ready: 0,
        max_ready: 0,
        max_concurrent_starts: 16,
    };
    let profile = SandboxProfile {
        image,
        runtime,
        ..SandboxProfile::default()
    };
    SandboxManager::start(backend, vec![profile], config).expect("manager")
}

async fn cell(sandbox: &Sandbox, code: &str) {
    let out = sandbox
        .exec(code, ExecOptions::default(), None)
        .await
        .expect("the cell ran");
    assert!(out.error.is_none(), "the cell failed: {out:?}");
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::var("BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let alive: usize = std::env::var("BENCH_ALIVE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let engines = std::env::var("BENCH_ENGINES").unwrap_or_else(|_| "lean,runc".into());
    for engine in engines.split(',') {
        let instance = format!("sandgate-bench-{engine}-{}", std::process::id());
        let manager = manager(engine, &instance).await;
        // One throwaway start: images and zygotes warm, caches filled.
        let first = manager.lease("default").await.expect("lease");
        cell(&first, IMPORTS).await;
        manager.close(first).await.expect("close");

        let mut walls = Vec::new();
        let cpu_before = machine_cpu_seconds();
        let started = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            let sandbox = manager.lease("default").await.expect("lease");
            cell(&sandbox, IMPORTS).await;
            walls.push(t.elapsed().as_secs_f64() * 1000.0);
            manager.close(sandbox).await.expect("close");
        }
        let cpu = (machine_cpu_seconds() - cpu_before) / n as f64;
        summary(
            &format!("{engine}.start (lease + import cell)"),
            walls,
            " ms",
        );
        println!(
            "{engine}.lifecycle_cpu: {:.3} CPU-s per sandbox (create, import cell, close; whole machine), {:.1} s wall for {n}",
            cpu,
            started.elapsed().as_secs_f64()
        );

        let burst_started = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let manager = manager.clone();
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                let sandbox = manager.lease("default").await.expect("lease");
                cell(&sandbox, IMPORTS).await;
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                manager.close(sandbox).await.expect("close");
                ms
            }));
        }
        let mut burst = Vec::new();
        for task in tasks {
            burst.push(task.await.expect("task"));
        }
        summary(
            &format!("{engine}.burst10 (10 at once, lease + import cell)"),
            burst,
            " ms",
        );
        let _ = burst_started;

        let mut live = Vec::new();
        for _ in 0..alive {
            let sandbox = manager.lease("default").await.expect("lease");
            cell(&sandbox, SMALL_PANDAS).await;
            live.push(sandbox);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pss: Vec<f64> = live
            .iter()
            .map(|s| pss_mb(&cgroup_procs(s.container_id())))
            .collect();
        let usage: Vec<f64> = live
            .iter()
            .filter_map(|s| cgroup_usage(s.container_id()))
            .collect();
        summary(
            &format!("{engine}.pss_after_pandas_cell ({alive} alive)"),
            pss,
            " MB",
        );
        summary(
            &format!("{engine}.cgroup_usage_after_pandas_cell ({alive} alive)"),
            usage,
            " MB",
        );
        for sandbox in live {
            let _ = manager.close(sandbox).await;
        }
        manager.shutdown().await;
    }
}
