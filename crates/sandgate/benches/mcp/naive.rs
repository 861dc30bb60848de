//! The naive Docker-API path: what a service without a warm kernel does per call.

use super::*;

pub(crate) fn naive_config(
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

pub(crate) async fn create_start(
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

pub(crate) async fn remove(docker: &Docker, id: &str) -> Result<()> {
    docker
        .remove_container(
            id,
            Some(RemoveContainerOptionsBuilder::new().force(true).build()),
        )
        .await?;
    Ok(())
}

/// `docker exec`: runs `cmd` (with `stdin` fed when given) and returns its stdout.
pub(crate) async fn exec(
    docker: &Docker,
    id: &str,
    cmd: &[&str],
    stdin: Option<&[u8]>,
) -> Result<Vec<u8>> {
    let created = docker
        .create_exec(
            id,
            CreateExecOptions {
                cmd: Some(cmd.iter().map(|s| (*s).to_owned()).collect()),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                attach_stdin: Some(stdin.is_some()),
                // As the sandbox user, as user code runs: /home/user is uid 1000's, mode 0700,
                // and the container's root holds no DAC override.
                user: Some("1000:1000".into()),
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
pub(crate) async fn fresh_container(docker: &Docker, image: &str, instance: &str) -> Result<()> {
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

pub(crate) async fn bench_naive(opts: &Options, docker: &Docker, image: &str) -> Result<Vec<Row>> {
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
        let mut rng = StdRng::seed_from_u64(9);
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
            let data = random_bytes(&mut rng, MIB);
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
