//! Through MCP: the real binary and the rmcp client over Streamable HTTP.

use super::*;

pub(crate) struct McpResults {
    pub(crate) rows: Vec<Row>,
}

pub(crate) async fn bench_mcp(opts: &Options, docker: &Docker) -> Result<McpResults> {
    let c = opts.counts;
    let mut rows = Vec::new();
    let csv = tickets_csv();

    // Cold create: a gateway whose pool is empty and stays empty (min_ready 0).
    if !opts.exec_only {
        rows.push(cold_creates(c, docker).await?);
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

    let (warm_rows, taken) = warm_creates(&gateway, &client, opts).await?;
    rows.extend(warm_rows);

    // Per-call work on one sandbox.
    let (call_rows, id, budget) = per_call(&gateway, &client, &token, taken, c).await?;
    rows.extend(call_rows);

    if opts.exec_only {
        drop(client);
        gateway.stop(docker).await;
        drop_database(&db).await;
        return Ok(McpResults { rows });
    }
    rows.extend(cells_and_files(&client, &id, &csv, c, budget).await?);

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

/// Cold create: a gateway whose pool is empty and stays empty (min_ready 0).
pub(crate) async fn cold_creates(c: Counts, docker: &Docker) -> Result<Row> {
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
    let row = Row::ms(
        "mcp.create_cold",
        "sandgate via MCP",
        "create_sandbox, pool empty (cold start)",
        &cold,
    );
    drop(client);
    gateway.stop(docker).await;
    drop_database(&db).await;
    Ok(row)
}

/// Warm create (pool full before each), its first cell, and close; a new conversation's life.
/// Returns the rows and how many pool members are taken.
async fn warm_creates(
    gateway: &Gateway,
    client: &Client,
    opts: &Options,
) -> Result<(Vec<Row>, usize)> {
    let c = opts.counts;
    let mut rows = Vec::new();
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
                    client,
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
                    client,
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
                call_ok(client, "close_sandbox", json!({"sandbox_id": id})),
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
    Ok((rows, taken))
}

/// Per-call work on one sandbox: `1+1` in both eras, `true`. Returns the rows, the sandbox
/// and the time budget the following loops share.
async fn per_call(
    gateway: &Gateway,
    client: &Client,
    token: &str,
    taken: usize,
    c: Counts,
) -> Result<(Vec<Row>, String, Budget)> {
    let mut rows = Vec::new();
    gateway
        .wait_pool(taken, MIN_READY, Duration::from_secs(120))
        .await?;
    wait_quiet(Duration::from_secs(90)).await;
    let created = call_ok(
        client,
        "create_sandbox",
        json!({"conversation_id": "per-call"}),
    )
    .await?;
    let id = sandbox_id(&created)?;
    let budget = Budget::secs(240);
    let exec = exec_1p1(client, &id, c.exec, &budget).await;
    rows.push(Row::ms(
        "mcp.exec_1p1",
        "sandgate via MCP",
        "execute_code 1+1 (2025-11-25 session)",
        &exec,
    ));

    // The same cell in the stateless era (a new HTTP request, no session).
    {
        let stateless = Client::connect(&gateway.mcp_url, token, Era::Stateless)
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
                client,
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
    Ok((rows, id, budget))
}

/// The data-stack cells (a pandas group-by, a matplotlib chart) and 1 MiB through
/// `upload_file` + `get_file`, on the sandbox `id`.
async fn cells_and_files(
    client: &Client,
    id: &str,
    csv: &str,
    c: Counts,
    budget: Budget,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    call_ok(
        client,
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
                    client,
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
                    client,
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

    let mut rng = StdRng::seed_from_u64(42);
    let mut upload = Samples::default();
    let mut get = Samples::default();
    let mut both = Samples::default();
    for _ in 0..c.files {
        let data = random_bytes(&mut rng, MIB);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
        let t0 = Instant::now();
        let up = upload
            .time(
                &budget,
                call_ok(
                    client,
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
                    client,
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
    call_ok(client, "close_sandbox", json!({"sandbox_id": id})).await?;
    Ok(rows)
}

/// Waits until only the warm pool is left (every leased container gone) and its refills have
/// finished: the container count is `MIN_READY` and no refill has finished for a while.
pub(crate) async fn settle_pool(gateway: &Gateway, docker: &Docker) {
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

pub(crate) async fn conversations(
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

pub(crate) async fn memory(
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

pub(crate) async fn settle_refills(gateway: &Gateway) {
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
