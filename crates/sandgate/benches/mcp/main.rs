//! sandgate's benchmark, side by side with what a user would pick instead (issues 3 and 7).
//!
//! Run it with `scripts/bench.sh` (it brings the stack up, builds, installs the peers and passes
//! their settings). In one run, on one Docker engine and one image, it measures:
//!
//! - **through a separate node**: `execute_code 1+1` through `serve --gateway-only` and a
//!   `sandgate node` process over mutual TLS (`mcp.exec_1p1_via_node`, beside `mcp.exec_1p1`);
//! - **through MCP** (the real `sandgate serve` binary, the rmcp client over Streamable HTTP):
//!   warm and cold `create_sandbox`, `execute_code` of `1+1` / a pandas group-by / a matplotlib
//!   chart, `run_terminal_command true`, `upload_file` + `get_file` of 1 MiB, the support-analyst
//!   conversation at 1, 10 and 50 at once, and memory (each idle sandbox's cgroup, the gateway's
//!   RSS) at 0, 10, 50 and 150 sandboxes;
//! - **the sandbox crate** directly (`SandboxManager`): warm lease, cold start, `1+1`, `true`,
//!   1 MiB write + read;
//! - **a sandbox node** (`sandgate node`, its own process and database): `1+1` through
//!   `RemoteSandbox` over the node RPC (mutual TLS on loopback), after the MCP gateway stopped;
//! - **the naive Docker-API path**: create + start + exec per call, `docker exec` into a running
//!   container, a fresh container per call;
//! - **the peers** (Python scripts under `bench/peers/`): llm-sandbox, jupyter-kernel-gateway and
//!   an ipykernel over ZMQ;
//! - **the SDK series** (issue 16, `bench/series/sdk_series.py` with the official MCP Python SDK,
//!   against a gateway in the default configuration): 30 conversations created and closed back to
//!   back, and an open-loop load of whole analyst conversations at 30/60/120/240 per minute
//!   (seeded Poisson arrivals) with the CPU each took by component; plus the start path step by
//!   step (container, agent ready, first cell, data stack);
//! - **snapshots** (issue 26, where the engine has `runsc2024` and a plaintext tmpfs): cold
//!   `create_sandbox` restoring a template beside an ordinary runc start, each with the
//!   sandbox's CPU until pandas is loaded; checkpoint and restore at the sandbox crate; and the
//!   SDK series again on a `runsc2024` profile whose pool restores its template;
//! - **pauses** (issue 27, same conditions): `pause_sandbox` of an analyst sandbox, the first
//!   call after it (the resume), `fork_sandbox`, and the sealed snapshot's size.
//!
//! Every loop is bounded in count and in time. The result is printed as a table (medians, p99 and
//! ratios) and written as JSON.
//!
//! Environment: `DATABASE_URL` (a Postgres superuser), `SANDGATE_SANDBOX__IMAGE`,
//! `BENCH_PYTHON` (the peers' virtualenv python; peers are skipped without it),
//! `BENCH_LLM_SANDBOX_IMAGE` (the image llm-sandbox runs), `BENCH_SDK_PYTHON` (a python with the
//! MCP SDK; the series is skipped without it). Arguments: `--out FILE`, `--quick` (fewer
//! iterations), `--no-peers`, `--no-150`, `--no-series`, `--series-only`, `--no-snapshots`,
//! `--snapshots-only`, `--pauses-only`.
//! `BENCH_ENGINE_CPUACCT` (a cgroup v1 `cpuacct.usage` holding the engine, which
//! `scripts/bench.sh` makes) adds the engine's whole CPU to the series.

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
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use sandgate_sandbox::backend::LaunchSpec;
use sandgate_sandbox::{
    CommandOptions, DockerBackend, ExecOptions, ManagerConfig, PoolConfig, SandboxManager,
    SandboxProfile,
};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

#[path = "../../../../tests/e2e/mcp_client.rs"]
#[allow(dead_code)] // shared with the e2e tests; the bench uses only part of it
mod mcp_client;

use mcp_client::{Client, Era};

/// The `sandgate` binary (built in the same profile as this bench).
const BIN: &str = env!("CARGO_BIN_EXE_sandgate");
const MIB: usize = 1 << 20;
/// Warm pool size of the benchmarked gateway (what an operator expecting bursts would set).
const MIN_READY: usize = 10;

mod gateway;
mod naive;
mod node_process;
mod pauses;
mod peers;
mod report;
mod samples;
mod sandbox_crate;
mod series;
mod snapshots;
mod through_mcp;
mod through_node;
mod via_node;
mod workload;

use gateway::*;
use naive::*;
use node_process::*;
use pauses::*;
use peers::*;
use report::*;
use samples::*;
use sandbox_crate::*;
use series::*;
use snapshots::*;
use through_mcp::*;
use through_node::*;
use via_node::*;
use workload::*;

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
    /// Whether to run the SDK series (back to back, open loop).
    series: bool,
    /// Only the SDK series and the cold start rows.
    series_only: bool,
    /// Whether to run the snapshot rows and the series on a template (issue 26).
    snapshots: bool,
    /// Only the snapshot rows and the series on a template.
    snapshots_only: bool,
    /// Only the pause, resume and fork rows.
    pauses_only: bool,
}

fn options() -> Result<Options> {
    let mut out = PathBuf::from("bench-results.json");
    let mut quick = false;
    let mut peers = true;
    let mut live_150 = true;
    let mut exec_only = false;
    let mut series = true;
    let mut series_only = false;
    let mut snapshots = true;
    let mut snapshots_only = false;
    let mut pauses_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = args.next().context("--out needs a path")?.into(),
            "--quick" => quick = true,
            "--no-peers" => peers = false,
            "--no-150" => live_150 = false,
            "--exec-only" => exec_only = true,
            "--no-series" => series = false,
            "--series-only" => series_only = true,
            "--no-snapshots" => snapshots = false,
            "--snapshots-only" => snapshots_only = true,
            "--pauses-only" => pauses_only = true,
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
        series,
        series_only,
        snapshots,
        snapshots_only,
        pauses_only,
    })
}

/// `--snapshots-only`: the snapshot rows and the series on a template, printed and written as JSON.
async fn snapshots_only(opts: &Options, docker: &Docker) -> Result<()> {
    let plain = snapshot_plain_dir(docker)
        .await
        .context("the snapshot rows cannot run on this engine")?;
    let mut rows = bench_snapshots(opts, docker, &plain).await?;
    rows.extend(bench_pauses(opts, docker, &plain).await?);
    let series = bench_series(opts, docker, SeriesProfile::Template(plain)).await?;
    rows.extend(series.rows);
    println!("{}", table(&rows));
    println!("{}", levels_table(&rows, &series.levels));
    let mut goals = snapshot_goals(&rows);
    goals.extend(pause_goals(&rows));
    println!("{}", goal_table(&goals));
    let report = json!({"rows": rows, "series_levels": series.levels, "snapshots_only": true});
    std::fs::write(&opts.out, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", opts.out.display()))?;
    Ok(())
}

/// `--pauses-only`: the pause, resume and fork rows, printed and written as JSON.
async fn pauses_only(opts: &Options, docker: &Docker) -> Result<()> {
    let plain = snapshot_plain_dir(docker)
        .await
        .context("the pause rows cannot run on this engine")?;
    let rows = bench_pauses(opts, docker, &plain).await?;
    println!("{}", table(&rows));
    println!("{}", goal_table(&pause_goals(&rows)));
    let report = json!({"rows": rows, "pauses_only": true});
    std::fs::write(&opts.out, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", opts.out.display()))?;
    Ok(())
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
    let mut levels = Vec::new();
    if opts.snapshots_only {
        return snapshots_only(&opts, &docker).await;
    }
    if opts.pauses_only {
        return pauses_only(&opts, &docker).await;
    }
    if opts.series_only {
        eprintln!("[bench] cold starts");
        rows.extend(bench_cold(&opts, &docker, &backend, &image).await?);
    } else {
        eprintln!("[bench] sandgate through MCP");
        rows.extend(bench_mcp(&opts, &docker).await?.rows);
        eprintln!("[bench] through a separate node (serve --gateway-only + sandgate node)");
        rows.push(bench_via_node(&opts, &docker).await);
    }
    let plain = match opts.snapshots && !opts.exec_only {
        true => snapshot_plain_dir(&docker).await,
        false => None,
    };
    if let Some(plain) = &plain {
        eprintln!("[bench] snapshots: template restores, checkpoint and restore");
        // A failure here is reported, and the rest of the run goes on.
        match bench_snapshots(&opts, &docker, plain).await {
            Ok(snapshot_rows) => rows.extend(snapshot_rows),
            Err(err) => eprintln!("[bench] the snapshot rows failed: {err:#}"),
        }
        eprintln!("[bench] pauses: pause_sandbox, the resume, fork_sandbox");
        match bench_pauses(&opts, &docker, plain).await {
            Ok(pause_rows) => rows.extend(pause_rows),
            Err(err) => eprintln!("[bench] the pause rows failed: {err:#}"),
        }
    }
    if opts.series && !opts.exec_only {
        eprintln!("[bench] the SDK series (back to back, open loop)");
        let series = bench_series(&opts, &docker, SeriesProfile::Default).await?;
        rows.extend(series.rows);
        levels = series.levels;
        if let Some(plain) = plain {
            eprintln!("[bench] the SDK series again, on runsc2024 restored from a template");
            match bench_series(&opts, &docker, SeriesProfile::Template(plain)).await {
                Ok(series) => {
                    rows.extend(series.rows);
                    levels.extend(series.levels);
                }
                Err(err) => eprintln!("[bench] the series on a template failed: {err:#}"),
            }
        }
    }
    if opts.exec_only {
        eprintln!("[bench] the sandbox crate directly (exec only)");
        rows.extend(bench_crate(&opts, &backend, &image).await?);
        eprintln!("[bench] through a sandbox node process (exec only)");
        rows.extend(bench_node(&opts, &docker, &image).await?);
    }
    if !opts.exec_only && !opts.series_only {
        eprintln!("[bench] the sandbox crate directly");
        rows.extend(bench_crate(&opts, &backend, &image).await?);
        eprintln!("[bench] through a sandbox node process");
        rows.extend(bench_node(&opts, &docker, &image).await?);
        rows.extend(start_path(&opts, &backend, &image).await?);
        eprintln!("[bench] the naive Docker-API path");
        rows.extend(bench_naive(&opts, &docker, &image).await?);
    }
    if opts.peers && !opts.exec_only && !opts.series_only {
        rows.extend(bench_peers(&opts).await);
    }
    fill_ratios(&mut rows);
    let goals = goals(&rows);

    let mut machine = machine();
    machine.insert("docker".into(), json!(version.version));
    machine.insert("image".into(), json!(image));
    let table = table(&rows);
    let goal_table = goal_table(&goals);
    let levels_table = levels_table(&rows, &levels);
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
    if !levels.is_empty() {
        println!("{levels_table}");
    }
    println!("{goal_table}");
    let report = json!({
        "started": started.to_rfc3339(),
        "seconds": t0.elapsed().as_secs_f64(),
        "quick": opts.quick,
        "machine": machine,
        "rows": rows,
        "table_markdown": table,
        "goals_markdown": goal_table,
        "series_levels": levels,
        "series_levels_markdown": levels_table,
    });
    std::fs::write(&opts.out, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", opts.out.display()))?;
    eprintln!("[bench] wrote {}", opts.out.display());
    Ok(())
}
