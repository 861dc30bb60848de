//! The sandbox crate directly (issue 3): `SandboxManager` without the gateway.

use super::*;

pub(crate) fn profile(image: &str) -> SandboxProfile {
    // The defaults of config/default.toml.
    SandboxProfile {
        name: "default".into(),
        image: image.into(),
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
        manager.close(sandbox).await?;
        Ok::<_, anyhow::Error>(rows)
    }
    .await;
    manager.shutdown().await;
    remove_instance(backend.client(), &instance).await;
    result
}
