//! Snapshot rows (issue 26): sandboxes restored from a template beside ordinary starts.
//!
//! - **Through MCP**: a gateway whose profile runs on `runsc2024` with templates on and an empty
//!   pool (`min_ready 0`), so that every `create_sandbox` is a cold start that restores the
//!   template; beside it a runc gateway with an empty pool (today's cold start). For each create,
//!   the sandbox's own CPU (its cgroup) until the data stack is loaded.
//! - **The sandbox crate**: checkpoint of a live analyst sandbox (left running) and its restore
//!   into a new container until the first `1+1`, one at a time and 16 at once; the image's size.
//!
//! Skipped, with a line saying why, where the engine has no `runsc2024` runtime or
//! `SANDGATE_SNAPSHOTS__PLAIN_DIR` names no plaintext tmpfs (`scripts/stack.sh` sets both up).

use super::*;
use sandgate_sandbox::{OciRuntime, Sandbox, Snapshot};

const SECTION: &str = "snapshots";
/// The cell after a create: the data stack loaded, as the analyst's first cells need it.
const STACK_CELL: &str = "import numpy, pandas, matplotlib.pyplot\n1 + 1";

/// Where the engine keeps plaintext checkpoint images, if snapshots can be benchmarked here.
pub(crate) async fn snapshot_plain_dir(docker: &Docker) -> Option<String> {
    let Ok(plain) = std::env::var("SANDGATE_SNAPSHOTS__PLAIN_DIR") else {
        eprintln!(
            "[bench] SANDGATE_SNAPSHOTS__PLAIN_DIR is not set: the snapshot rows are skipped"
        );
        return None;
    };
    let info = docker.info().await.ok()?;
    let registered = info
        .runtimes
        .as_ref()
        .is_some_and(|r| r.contains_key("runsc2024"));
    if !registered {
        eprintln!("[bench] the engine has no runsc2024 runtime: the snapshot rows are skipped");
        return None;
    }
    Some(plain)
}

/// The snapshot rows, on the engine whose plaintext tmpfs is `plain`.
pub(crate) async fn bench_snapshots(
    opts: &Options,
    docker: &Docker,
    plain: &str,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    rows.extend(cold_with_cpu(opts, docker, Some(plain)).await?);
    rows.extend(cold_with_cpu(opts, docker, None).await?);
    rows.extend(crate_rows(opts, plain).await?);
    Ok(rows)
}

/// The settings of a gateway whose pool restores a template of its `runsc2024` profile.
pub(crate) fn template_settings(plain: &str) -> Vec<(String, String)> {
    vec![
        ("SANDGATE_SANDBOX__RUNTIME".into(), "runsc2024".into()),
        ("SANDGATE_SNAPSHOTS__PLAIN_DIR".into(), plain.into()),
        ("SANDGATE_SNAPSHOTS__TEMPLATES".into(), "true".into()),
    ]
}

/// `/readyz` of the gateway at `mcp_url`.
async fn readyz(mcp_url: &str) -> Result<Value> {
    let url = format!("{}/readyz", mcp_url.trim_end_matches("/mcp"));
    Ok(reqwest::get(url).await?.json().await?)
}

/// Waits until the gateway's default profile restores from a template; its `/readyz` entry.
pub(crate) async fn wait_template(gateway: &Gateway, within: Duration) -> Result<Value> {
    let deadline = Instant::now() + within;
    loop {
        let body = readyz(&gateway.mcp_url).await?;
        let template = &body["templates"]["default"];
        if template["in_use"] == json!(true) {
            return Ok(template.clone());
        }
        if Instant::now() > deadline {
            bail!("no template in use within {within:?}: {body}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// CPU seconds a container's cgroup has used (cgroup v1 `cpuacct` or v2 `cpu.stat`).
pub(crate) fn container_cpu_s(container_id: &str) -> Option<f64> {
    let v1 = format!("/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage");
    if let Ok(ns) = std::fs::read_to_string(v1) {
        return ns.trim().parse::<f64>().ok().map(|ns| ns / 1e9);
    }
    [
        format!("/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat"),
        format!("/sys/fs/cgroup/docker/{container_id}/cpu.stat"),
    ]
    .into_iter()
    .find_map(|p| std::fs::read_to_string(p).ok())?
    .lines()
    .find_map(|l| l.strip_prefix("usage_usec "))?
    .trim()
    .parse::<f64>()
    .ok()
    .map(|us| us / 1e6)
}

/// The container of sandbox `sandbox_id` in the gateway's instance.
async fn container_of(docker: &Docker, gateway: &Gateway, sandbox_id: &str) -> Option<String> {
    instance_containers(docker, &gateway.instance)
        .await
        .into_iter()
        .find_map(|(id, sandbox)| (sandbox == sandbox_id).then_some(id))
}

/// Cold creates through MCP with an empty pool, each followed by the data-stack cell, and the
/// sandbox's own CPU until that cell answered: with a template (`plain` given) or without.
async fn cold_with_cpu(opts: &Options, docker: &Docker, plain: Option<&str>) -> Result<Vec<Row>> {
    let db = fresh_database().await?;
    let mut settings = vec![
        ("SANDGATE_POOL__MIN_READY".to_owned(), "0".to_owned()),
        ("SANDGATE_POOL__MAX_READY".to_owned(), "0".to_owned()),
    ];
    let template = plain.is_some();
    if let Some(plain) = plain {
        settings.extend(template_settings(plain));
    }
    let gateway = Gateway::spawn(&db, 1000, settings, &["serve"]).await?;
    let result = async {
        let made = match template {
            true => Some(wait_template(&gateway, Duration::from_secs(300)).await?),
            false => None,
        };
        let token = gateway.token().await?;
        let client = Client::connect(&gateway.mcp_url, &token, Era::Sessions)
            .await
            .map_err(|e| anyhow!(e))?;
        let (mut create, mut ready, mut cpu, mut memory) = (
            Samples::default(),
            Samples::default(),
            Vec::new(),
            Vec::new(),
        );
        let budget = Budget::secs(300);
        for i in 0..opts.counts.cold_creates {
            let args = json!({"conversation_id": format!("snap-cold-{i}")});
            let Some(created) = create
                .time(&budget, call_ok(&client, "create_sandbox", args))
                .await
            else {
                continue;
            };
            let id = sandbox_id(&created)?;
            let cell = json!({"sandbox_id": id, "code": STACK_CELL});
            let answered = ready
                .time(&budget, call_ok(&client, "execute_code", cell))
                .await
                .is_some();
            if answered && let Some(container) = container_of(docker, &gateway, &id).await {
                cpu.extend(container_cpu_s(&container).map(|s| s * 1000.0));
                memory.extend(container_memory_mb(&container).map(|(usage, _)| usage));
            }
            call_ok(&client, "close_sandbox", json!({"sandbox_id": id})).await?;
        }
        let (kind, what) = match template {
            true => ("snap", "restored from the template (runsc2024)"),
            false => ("runc", "ordinary start (runc, the default profile)"),
        };
        let mut rows = vec![
            Row::ms(
                &format!("{kind}.create_cold"),
                SECTION,
                &format!("create_sandbox, pool empty: {what}"),
                &create,
            ),
            Row::ms(
                &format!("{kind}.stack_ready"),
                SECTION,
                &format!("then the first cell importing numpy, pandas, matplotlib ({what})"),
                &ready,
            ),
            Row::new(
                &format!("{kind}.start_cpu"),
                SECTION,
                &format!("the sandbox's CPU in its cgroup until that cell answered ({what})"),
                "CPU ms",
                cpu,
            ),
            Row::new(
                &format!("{kind}.sandbox_mem"),
                SECTION,
                &format!("… and its cgroup memory usage then ({what})"),
                "MB",
                memory,
            ),
        ];
        if let Some(made) = made {
            let mb = made["bytes"].as_f64().unwrap_or_default() / 1e6;
            rows.push(
                Row::new(
                    "snap.template_mb",
                    SECTION,
                    "the template's checkpoint image on the plaintext tmpfs",
                    "MB",
                    vec![mb],
                )
                .extra("template", made),
            );
        }
        drop(client);
        Ok::<_, anyhow::Error>(rows)
    }
    .await;
    gateway.stop(docker).await;
    drop_database(&db).await;
    result
}

/// The analyst's cells in `sandbox` (a CSV written, a group-by, a chart).
async fn analyst_cells(sandbox: &Sandbox, csv: &str) -> Result<()> {
    sandbox
        .write_file("tickets.csv", csv.as_bytes(), true)
        .await?;
    for code in [GROUP_BY, CHART] {
        let outcome = sandbox.exec(code, ExecOptions::default(), None).await?;
        if let Some(error) = outcome.error {
            bail!("an analyst cell failed: {error:?}");
        }
    }
    Ok(())
}

/// A restore of `snapshot` until its first `1+1` answers; the clone is closed after.
async fn restore_once(manager: &SandboxManager, snapshot: &Snapshot) -> Result<()> {
    let sandbox = manager.restore(snapshot).await?;
    let outcome = sandbox.exec("1+1", ExecOptions::default(), None).await;
    manager.close(sandbox).await?;
    let answer = outcome?
        .result
        .and_then(|r| r.get("text/plain").cloned())
        .unwrap_or_default();
    if answer != "2" {
        bail!("a restored clone answered 1+1 with {answer:?}");
    }
    Ok(())
}

/// Checkpoint and restore at the sandbox crate, on a sandbox that ran the analyst's cells.
async fn crate_rows(opts: &Options, plain: &str) -> Result<Vec<Row>> {
    let image = std::env::var("SANDGATE_SANDBOX__IMAGE")?;
    let backend = DockerBackend::connect("")?.with_snapshots(plain);
    let mut profile = profile(&image);
    profile.name = "snap".into();
    profile.runtime = OciRuntime::Runsc2024;
    let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut config = ManagerConfig::new(instance);
    config.pool = PoolConfig {
        min_ready: 0,
        max_ready: 0,
        max_concurrent_starts: 16,
    };
    let manager = SandboxManager::start(Arc::new(backend), vec![profile], config)?;
    let n = opts.counts.cold_creates;
    let budget = Budget::secs(300);
    let (mut checkpoint, mut restore, mut at_once) =
        (Samples::default(), Samples::default(), Samples::default());
    let mut sizes = Vec::new();
    let csv = tickets_csv();
    let source = manager.lease("snap").await?;
    analyst_cells(&source, &csv).await?;
    let mut last = None;
    for _ in 0..n {
        if let Some(snapshot) = checkpoint
            .time(&budget, async {
                Ok(manager.checkpoint(&source, true).await?)
            })
            .await
        {
            sizes.push(snapshot.size_bytes() as f64 / 1e6);
            last = Some(snapshot);
        }
    }
    if let Some(snapshot) = &last {
        for _ in 0..n {
            restore
                .time(&budget, restore_once(&manager, snapshot))
                .await;
        }
        let all = (0..16).map(|_| async {
            let t0 = Instant::now();
            (restore_once(&manager, snapshot).await, t0.elapsed())
        });
        for (outcome, elapsed) in futures::future::join_all(all).await {
            match outcome {
                Ok(()) => at_once.push(elapsed),
                Err(err) => at_once.fail(format!("{err:#}")),
            }
        }
    }
    drop(last);
    manager.close(source).await?;
    Ok(vec![
        Row::ms(
            "snap.checkpoint",
            SECTION,
            "checkpoint of a live analyst sandbox, left running (runsc2024, sandbox crate)",
            &checkpoint,
        ),
        Row::new(
            "snap.image_mb",
            SECTION,
            "… its image on the plaintext tmpfs (uncompressed; sealed as it is)",
            "MB",
            sizes,
        ),
        Row::ms(
            "snap.restore",
            SECTION,
            "restore into a new container until its first 1+1, one at a time (sandbox crate)",
            &restore,
        ),
        Row::ms(
            "snap.restore_x16",
            SECTION,
            "the same, 16 at once (each from its start)",
            &at_once,
        ),
    ])
}

/// Issue 26's goals: the template's cold start and its CPU, and the SDK series on it.
pub(crate) fn snapshot_goals(rows: &[Row]) -> Vec<Goal> {
    let get = |id: &str| rows.iter().find(|r| r.id == id);
    let p50 = |id: &str| get(id).and_then(|r| r.p50);
    let p99 = |id: &str| get(id).and_then(|r| r.p99);
    let goal = |what, value, limit, at_most, unit| Goal {
        what,
        value,
        limit,
        at_most,
        unit,
    };
    let open_loop = |rate: u32| get(&format!("sdk_tpl.open_loop_{rate}"));
    vec![
        goal(
            "cold create_sandbox p50, pool empty, template present (MCP)",
            p50("snap.create_cold"),
            100.0,
            true,
            "ms",
        ),
        goal(
            "cold create_sandbox with a template / bare container start (naive.lease), p50",
            p50("snap.create_cold")
                .zip(p50("naive.lease"))
                .map(|(s, n)| s / n),
            0.4,
            true,
            "×",
        ),
        goal(
            "a sandbox's start-up CPU to pandas-ready, in its cgroup (template), p50",
            p50("snap.start_cpu").map(|ms| ms / 1000.0),
            0.15,
            true,
            " CPU-s",
        ),
        goal(
            "a whole analyst conversation, CPU at 30/min (SDK, template)",
            open_loop(30).and_then(|r| r.extra.get("cpu_s_total").and_then(Value::as_f64)),
            0.5,
            true,
            " CPU-s",
        ),
        goal(
            "open loop at 120/min: p99 with 0 errors (SDK, template)",
            open_loop(120).and_then(|r| {
                if r.errors == 0 {
                    r.p99
                } else {
                    Some(f64::INFINITY)
                }
            }),
            2000.0,
            true,
            "ms",
        ),
        goal(
            "open loop at 240/min: errors (SDK, template)",
            open_loop(240).map(|r| r.errors as f64),
            0.0,
            true,
            "",
        ),
        goal(
            "back-to-back create_sandbox p50 / execute_code 1+1 p50 (SDK, template)",
            p50("sdk_tpl.b2b_create")
                .zip(p50("sdk_tpl.exec_1p1"))
                .map(|(c, e)| c / e),
            3.0,
            true,
            "×",
        ),
        goal(
            "back-to-back create_sandbox p99 (SDK, template)",
            p99("sdk_tpl.b2b_create"),
            300.0,
            true,
            "ms",
        ),
        goal(
            "a sandbox's memory after the data-stack cell: template / runc, p50",
            p50("snap.sandbox_mem")
                .zip(p50("runc.sandbox_mem"))
                .map(|(s, r)| s / r),
            1.0,
            true,
            "×",
        ),
    ]
}
