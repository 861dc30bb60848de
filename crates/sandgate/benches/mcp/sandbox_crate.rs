//! The sandbox crate directly (issue 3): `SandboxManager` without the gateway.

use super::*;

pub(crate) fn profile(image: &str) -> SandboxProfile {
    // The defaults of config/default.toml.
    SandboxProfile {
        name: "default".into(),
        image: image.into(),
        pull: sandgate_sandbox::PullPolicy::Never,
        runtime: sandgate_sandbox::OciRuntime::Runc,
        memory_mb: 512,
        cpus: 1.0,
        pids_limit: 256,
        nofile: 1024,
        tmp_size_mb: 64,
        home_size_mb: 512,
        packages_size_mb: 256,
    }
}

pub(crate) async fn bench_crate(
    opts: &Options,
    backend: &DockerBackend,
    image: &str,
) -> Result<Vec<Row>> {
    let c = opts.counts;
    let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut config = ManagerConfig::new(instance.clone());
    // A pool of fixed size: these rows measure a lease and a start, not the demand controller.
    config.pool = PoolConfig {
        min_ready: 2,
        max_ready: 2,
        max_concurrent_starts: 2,
    };
    let manager = SandboxManager::start(Arc::new(backend.clone()), vec![profile(image)], config)?;
    let result = async {
        let mut rows = Vec::new();
        let budget = Budget::secs(240);
        // `--exec-only`: the exec row alone, beside `mcp.exec_1p1` (the gateway's share is the
        // difference, measured in the same run).
        let full = !opts.exec_only;
        if full {
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
        }
        let sandbox = manager.lease("default").await?;
        wait_quiet(Duration::from_secs(90)).await;
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
        if full {
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
            let mut rng = StdRng::seed_from_u64(7);
            for _ in 0..c.files {
                let data = random_bytes(&mut rng, MIB);
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
        }
        manager.close(sandbox).await?;
        Ok::<_, anyhow::Error>(rows)
    }
    .await;
    manager.shutdown().await;
    remove_instance(backend.client(), &instance).await;
    result
}

/// The cold rows alone (for `--series-only`): `create_sandbox` through MCP with an empty pool, and
/// the start path step by step.
pub(crate) async fn bench_cold(
    opts: &Options,
    docker: &Docker,
    backend: &DockerBackend,
    image: &str,
) -> Result<Vec<Row>> {
    let mut rows = vec![cold_creates(opts.counts, docker).await?];
    rows.extend(start_path(opts, backend, image).await?);
    Ok(rows)
}

/// The start path step by step, straight on the backend and the agent channel: create + attach +
/// start the container; the agent's ready frame; a first `1+1` sent at once (it waits for the
/// kernel's shell); then `import pandas, matplotlib.pyplot` (it waits for what the background
/// preload has not finished yet).
pub(crate) async fn start_path(
    opts: &Options,
    backend: &DockerBackend,
    image: &str,
) -> Result<Vec<Row>> {
    use sandgate_sandbox::{AgentChannel, ChannelConfig, SandboxBackend as _};
    let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let (mut launch, mut ready, mut total) =
        (Samples::default(), Samples::default(), Samples::default());
    let (mut first, mut stack) = (Samples::default(), Samples::default());
    for i in 0..opts.counts.cold_creates {
        let spec = LaunchSpec {
            profile: profile(image),
            instance: instance.clone(),
            sandbox_id: format!("sbx_benchstart{i}"),
        };
        let t0 = Instant::now();
        let launched = backend.launch(&spec).await?;
        let t1 = Instant::now();
        let channel = AgentChannel::open(
            spec.sandbox_id.clone(),
            launched.streams,
            ChannelConfig::default(),
        );
        let step = async {
            channel.wait_ready(Duration::from_secs(60)).await?;
            let t2 = Instant::now();
            channel.exec("1+1", ExecOptions::default(), None).await?;
            let t3 = Instant::now();
            let done = channel
                .exec(
                    "import pandas, matplotlib.pyplot",
                    ExecOptions::default(),
                    None,
                )
                .await?;
            if let Some(err) = done.error {
                bail!("importing the data stack failed: {}", err.value);
            }
            Ok((t2, t3, Instant::now()))
        }
        .await;
        let _ = backend.remove(&launched.container_id).await;
        let (t2, t3, t4) = step?;
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1000.0;
        launch.ms.push(ms(t0, t1));
        ready.ms.push(ms(t1, t2));
        total.ms.push(ms(t0, t2));
        first.ms.push(ms(t2, t3));
        stack.ms.push(ms(t3, t4));
    }
    let section = "sandbox crate";
    Ok(vec![
        Row::ms(
            "crate.start_ready",
            section,
            "cold start until the agent is ready (create, attach, start, ready frame)",
            &total,
        ),
        Row::ms(
            "crate.start_launch",
            section,
            "… of which create + attach + start the container",
            &launch,
        ),
        Row::ms(
            "crate.start_agent",
            section,
            "… of which the agent's start until its ready frame",
            &ready,
        ),
        Row::ms(
            "crate.start_first_exec",
            section,
            "then a first 1+1 at once (waits for the kernel's shell)",
            &first,
        ),
        Row::ms(
            "crate.start_data_stack",
            section,
            "then import pandas + matplotlib.pyplot (waits for the background preload)",
            &stack,
        ),
    ])
}
