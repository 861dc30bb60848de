//! Pause, resume and fork rows (issue 27), through MCP on one gateway (`serve`) whose profile
//! runs on `runsc2024`, with a snapshot store directory of its own and pausing on idle off (so
//! only the timed `pause_sandbox` calls pause). Each round: a cold `create_sandbox`, the
//! analyst's cells (the tickets CSV uploaded, a group-by, a chart), then
//!
//! - `pause_sandbox` until it answers paused (checkpoint, sealing into the store, the container
//!   removed), and the sealed snapshot's size from `list_sandboxes`;
//! - the first `execute_code 1+1` after it, end to end (the resume on the same node: the sealed
//!   snapshot opened, restored into a new container, then the cell);
//! - `fork_sandbox` of the resumed sandbox (a checkpoint left running, restored into a new
//!   sandbox), then the fork's first `1+1`.
//!
//! Not measured here: a resume on another node (the issue's ≤ 1 s goal needs a split
//! deployment, see tests/e2e/pause_remote.rs) and a pause on idle (the reaper's timing).
//!
//! Skipped, with a line saying why, where snapshots cannot be benchmarked
//! ([`snapshot_plain_dir`]).

use super::*;

const SECTION: &str = "pauses";

/// A snapshot store directory of the run's own, removed when dropped.
struct StoreDir(PathBuf);

impl StoreDir {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "sandgate-bench-snapshots-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for StoreDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What one round measured.
#[derive(Default)]
struct Rounds {
    pause: Samples,
    resume: Samples,
    fork: Samples,
    fork_first: Samples,
    snapshot_mb: Vec<f64>,
    paused_containers: Vec<f64>,
}

/// The pause, resume and fork rows, on the engine whose plaintext tmpfs is `plain`.
pub(crate) async fn bench_pauses(opts: &Options, docker: &Docker, plain: &str) -> Result<Vec<Row>> {
    let store = StoreDir::new()?;
    let db = fresh_database().await?;
    let settings = vec![
        (
            "SANDGATE_SANDBOX__RUNTIME".to_owned(),
            "runsc2024".to_owned(),
        ),
        ("SANDGATE_SNAPSHOTS__PLAIN_DIR".to_owned(), plain.to_owned()),
        (
            "SANDGATE_SNAPSHOTS__TEMPLATES".to_owned(),
            "false".to_owned(),
        ),
        (
            "SANDGATE_SNAPSHOTS__STORE_DIR".to_owned(),
            store.0.to_string_lossy().into_owned(),
        ),
        (
            "SANDGATE_SNAPSHOTS__PAUSE_ON_IDLE".to_owned(),
            "false".to_owned(),
        ),
        ("SANDGATE_POOL__MIN_READY".to_owned(), "0".to_owned()),
        ("SANDGATE_POOL__MAX_READY".to_owned(), "0".to_owned()),
    ];
    let gateway = Gateway::spawn(&db, 100, settings, &["serve"]).await?;
    let result = async {
        let token = gateway.token().await?;
        let client = Client::connect(&gateway.mcp_url, &token, Era::Stateless)
            .await
            .map_err(|e| anyhow!(e))?;
        let csv = tickets_csv();
        let mut rounds = Rounds::default();
        let budget = Budget::secs(600);
        for i in 0..opts.counts.cold_creates {
            if budget.spent() {
                break;
            }
            if let Err(err) = round(&client, docker, &gateway, &csv, i, &budget, &mut rounds).await
            {
                eprintln!("[bench] a pause round failed: {err:#}");
                rounds.pause.fail(format!("{err:#}"));
            }
        }
        Ok::<_, anyhow::Error>(rows(rounds))
    }
    .await;
    gateway.stop(docker).await;
    drop_database(&db).await;
    result
}

/// One round: an analyst sandbox paused, resumed and forked (see the module's comment).
async fn round(
    client: &Client,
    docker: &Docker,
    gateway: &Gateway,
    csv: &str,
    i: usize,
    budget: &Budget,
    rounds: &mut Rounds,
) -> Result<()> {
    let conversation = format!("pause-{i}");
    let created = call_ok(
        client,
        "create_sandbox",
        json!({"conversation_id": conversation}),
    )
    .await?;
    let id = sandbox_id(&created)?;
    call_ok(
        client,
        "upload_file",
        json!({"sandbox_id": id, "path": "tickets.csv", "content_text": csv}),
    )
    .await?;
    for code in [GROUP_BY, CHART] {
        let out = call_ok(
            client,
            "execute_code",
            json!({"sandbox_id": id, "code": code}),
        )
        .await?;
        if !out.structured["error"].is_null() {
            bail!("an analyst cell failed: {}", out.text);
        }
    }
    let paused = rounds
        .pause
        .time(
            budget,
            call_ok(client, "pause_sandbox", json!({"sandbox_id": id})),
        )
        .await;
    if paused.is_some() {
        let listed = call_ok(
            client,
            "list_sandboxes",
            json!({"conversation_id": conversation}),
        )
        .await?;
        if let Some(bytes) = listed.structured["sandboxes"]
            .as_array()
            .and_then(|all| all.iter().find(|s| s["sandbox_id"] == id.as_str()))
            .and_then(|s| s["snapshot_bytes"].as_f64())
        {
            rounds.snapshot_mb.push(bytes / 1e6);
        }
        rounds
            .paused_containers
            .push(instance_containers(docker, &gateway.instance).await.len() as f64);
        let resumed = rounds
            .resume
            .time(budget, async {
                let out = call_ok(
                    client,
                    "execute_code",
                    json!({"sandbox_id": id, "code": "summary.shape"}),
                )
                .await?;
                if !out.structured["resumed"].is_object() {
                    bail!("the first call after a pause did not resume: {}", out.text);
                }
                Ok(out)
            })
            .await;
        if resumed.is_some()
            && let Some(forked) = rounds
                .fork
                .time(
                    budget,
                    call_ok(client, "fork_sandbox", json!({"sandbox_id": id})),
                )
                .await
        {
            let fork = sandbox_id(&forked)?;
            rounds
                .fork_first
                .time(
                    budget,
                    call_ok(
                        client,
                        "execute_code",
                        json!({"sandbox_id": fork, "code": "summary.shape"}),
                    ),
                )
                .await;
            call_ok(client, "close_sandbox", json!({"sandbox_id": fork})).await?;
        }
    }
    call_ok(client, "close_sandbox", json!({"sandbox_id": id})).await?;
    Ok(())
}

fn rows(rounds: Rounds) -> Vec<Row> {
    vec![
        Row::ms(
            "pause.pause",
            SECTION,
            "pause_sandbox of an analyst sandbox (runsc2024; checkpoint, sealed into the store, container removed)",
            &rounds.pause,
        ),
        Row::new(
            "pause.snapshot_mb",
            SECTION,
            "… its sealed snapshot in the store (list_sandboxes snapshot_bytes)",
            "MB",
            rounds.snapshot_mb,
        ),
        Row::new(
            "pause.paused_containers",
            SECTION,
            "… the gateway's containers while it is paused (the only sandbox)",
            "containers",
            rounds.paused_containers,
        ),
        Row::ms(
            "pause.resume",
            SECTION,
            "the first execute_code after the pause, end to end (resumed on the same node)",
            &rounds.resume,
        ),
        Row::ms(
            "pause.fork",
            SECTION,
            "fork_sandbox of the resumed sandbox (a running one) until the fork is live",
            &rounds.fork,
        ),
        Row::ms(
            "pause.fork_first_exec",
            SECTION,
            "then the fork's first execute_code",
            &rounds.fork_first,
        ),
    ]
}

/// Issue 27's goals: pause, resume (same node) and fork p50, and the snapshot's size.
pub(crate) fn pause_goals(rows: &[Row]) -> Vec<Goal> {
    let p50 = |id: &str| rows.iter().find(|r| r.id == id).and_then(|r| r.p50);
    let goal = |what, value, limit, unit| Goal {
        what,
        value,
        limit,
        at_most: true,
        unit,
    };
    vec![
        goal(
            "pause of an idle analyst sandbox p50 (MCP, pause_sandbox)",
            p50("pause.pause"),
            1000.0,
            "ms",
        ),
        goal(
            "resume p50, the first call after a pause end to end, same node (MCP)",
            p50("pause.resume"),
            250.0,
            "ms",
        ),
        goal(
            "fork p50 (MCP, fork_sandbox)",
            p50("pause.fork"),
            500.0,
            "ms",
        ),
        goal(
            "sealed snapshot of the analyst conversation p50",
            p50("pause.snapshot_mb"),
            30.0,
            "MB",
        ),
    ]
}
