//! The gateway under test: a real `sandgate serve` on its own database and instance, and the
//! memory of a container as its cgroup counts it.

use super::*;

/// A `sandgate serve` process on a loopback port with its own database and instance label.
pub(crate) struct Gateway {
    pub(crate) child: tokio::process::Child,
    pub(crate) mcp_url: String,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) instance: String,
    /// "warm sandbox ready" lines in its log: refills that finished.
    pub(crate) ready_events: Arc<AtomicUsize>,
}

impl Gateway {
    pub(crate) async fn start(
        database_url: &str,
        min_ready: usize,
        max_sandboxes: usize,
    ) -> Result<Gateway> {
        let pool = vec![
            ("SANDGATE_POOL__MIN_READY".into(), min_ready.to_string()),
            // A pool of fixed size: these rows measure with a full pool, as the table says.
            ("SANDGATE_POOL__MAX_READY".into(), min_ready.to_string()),
            ("SANDGATE_DATABASE__MAX_CONNECTIONS".into(), "32".into()),
        ];
        Self::spawn(database_url, max_sandboxes, pool, &["serve"]).await
    }

    /// A gateway in the default configuration but for the tenant's own quotas (sandboxes at once
    /// and calls per minute), which would otherwise be what is measured.
    pub(crate) async fn start_default(database_url: &str, max_sandboxes: usize) -> Result<Gateway> {
        Self::spawn(database_url, max_sandboxes, Vec::new(), &["serve"]).await
    }

    /// `sandgate <args>` (`serve`, or `serve --gateway-only` for the row through a node) with
    /// the bench's settings and `settings` added.
    pub(crate) async fn spawn(
        database_url: &str,
        max_sandboxes: usize,
        settings: Vec<(String, String)>,
        args: &[&str],
    ) -> Result<Gateway> {
        let instance = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let mut env: Vec<(String, String)> = vec![
            ("SANDGATE_DATABASE__URL".into(), database_url.into()),
            ("SANDGATE_INSTANCE".into(), instance.clone()),
            ("SANDGATE_LOG__FORMAT".into(), "json".into()),
            // The manager's debug line "warm sandbox ready" tells the bench when the pool is full.
            (
                "SANDGATE_LOG__FILTER".into(),
                "warn,sandgate_sandbox::manager=debug".into(),
            ),
            (
                "SANDGATE_LIMITS__MAX_SANDBOXES".into(),
                max_sandboxes.to_string(),
            ),
            // The fill holds more idle sandboxes than the memory-derived default allows.
            ("SANDGATE_NODE__SLOTS".into(), max_sandboxes.to_string()),
            // One tenant drives every measurement: its rate limit must not be what is measured.
            (
                "SANDGATE_LIMITS__MAX_CALLS_PER_MINUTE".into(),
                "1000000".into(),
            ),
            (
                "SANDGATE_LIMITS__MAX_CALLS_IN_FLIGHT".into(),
                "100000".into(),
            ),
        ];
        env.extend(settings);
        let mut command = Command::new(BIN);
        command
            .args(args)
            .env("SANDGATE_LISTEN", "127.0.0.1:0")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let Started {
            child,
            first_line,
            ready: ready_events,
        } = start_sandgate(command, "gateway", true, Duration::from_secs(60)).await?;
        let mcp_url = first_line
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://"))
            .with_context(|| format!("unexpected first line: {first_line:?}"))?
            .to_owned();
        env.push((
            "SANDGATE_PUBLIC_URL".into(),
            mcp_url.trim_end_matches("/mcp").to_owned(),
        ));
        Ok(Gateway {
            child,
            mcp_url,
            env,
            instance,
            ready_events,
        })
    }

    pub(crate) async fn cli(&self, args: &[&str]) -> Result<String> {
        let output = Command::new(BIN)
            .args(args)
            .env_remove("RUST_LOG")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .await?;
        if !output.status.success() {
            bail!(
                "sandgate {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8(output.stdout)?.trim().to_owned())
    }

    /// A new tenant's access token with every scope.
    pub(crate) async fn token(&self) -> Result<String> {
        let name = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let tenant = self.cli(&["admin", "tenant", "create", &name]).await?;
        self.cli(&[
            "admin", "token", "issue", "--tenant", &tenant, "--ttl", "2h",
        ])
        .await
    }

    /// Waits until `want` warm sandboxes are in the pool, given `taken` warm leases so far.
    pub(crate) async fn wait_pool(
        &self,
        taken: usize,
        want: usize,
        within: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + within;
        while self.ready_events.load(Ordering::SeqCst) < taken + want {
            if Instant::now() > deadline {
                bail!(
                    "the warm pool did not reach {want} within {within:?} ({} ready events, {taken} taken)",
                    self.ready_events.load(Ordering::SeqCst)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    pub(crate) fn rss_mb(&self) -> Option<f64> {
        let pid = self.child.id()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kb: f64 = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some(kb / 1024.0)
    }

    /// SIGTERM, wait, then remove whatever containers of its instance are left.
    pub(crate) async fn stop(mut self, docker: &Docker) {
        stop_sandgate(&mut self.child).await;
        remove_instance(docker, &self.instance).await;
    }
}

pub(crate) async fn instance_containers(docker: &Docker, instance: &str) -> Vec<(String, String)> {
    let filters = HashMap::from([(
        "label".to_owned(),
        vec![format!("sandgate.instance={instance}")],
    )]);
    let options = ListContainersOptionsBuilder::new()
        .all(true)
        .filters(&filters)
        .build();
    docker
        .list_containers(Some(options))
        .await
        .unwrap_or_default()
        .into_iter()
        .filter_map(|c| {
            let sandbox = c
                .labels
                .as_ref()
                .and_then(|l| l.get("sandgate.sandbox_id"))
                .cloned()
                .unwrap_or_default();
            Some((c.id?, sandbox))
        })
        .collect()
}

pub(crate) async fn remove_instance(docker: &Docker, instance: &str) {
    let containers = instance_containers(docker, instance).await;
    let removals = containers.into_iter().map(|(id, _)| async move {
        let _ = docker
            .remove_container(
                &id,
                Some(RemoveContainerOptionsBuilder::new().force(true).build()),
            )
            .await;
    });
    futures::stream::iter(removals)
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await;
}

pub(crate) async fn fresh_database() -> Result<String> {
    use sqlx::Connection;
    let admin = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let name = format!("sandgate_bench_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&admin).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await?;
    let base = admin.split('?').next().unwrap_or(&admin);
    let root = &base[..base.rfind('/').context("a URL with a database")?];
    Ok(format!("{root}/{name}"))
}

pub(crate) async fn drop_database(url: &str) {
    use sqlx::Connection;
    let Ok(admin) = std::env::var("DATABASE_URL") else {
        return;
    };
    let Some(name) = url.rsplit('/').next() else {
        return;
    };
    if let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&mut conn)
        .await;
    }
}

// Memory of a container, as its cgroup counts it

/// (usage, usage less inactive file pages) in MB, from cgroup v1 or v2.
pub(crate) fn container_memory_mb(container_id: &str) -> Option<(f64, f64)> {
    let v1 = format!("/sys/fs/cgroup/memory/docker/{container_id}");
    let v2 = [
        format!("/sys/fs/cgroup/system.slice/docker-{container_id}.scope"),
        format!("/sys/fs/cgroup/docker/{container_id}"),
    ];
    let read = |p: String| std::fs::read_to_string(p).ok();
    let stat_value = |stat: &str, key: &str| -> Option<f64> {
        stat.lines()
            .find_map(|l| l.strip_prefix(key).map(str::trim))?
            .parse()
            .ok()
    };
    let (usage, inactive) = if let Some(usage) = read(format!("{v1}/memory.usage_in_bytes")) {
        let stat = read(format!("{v1}/memory.stat")).unwrap_or_default();
        (
            usage.trim().parse::<f64>().ok()?,
            stat_value(&stat, "total_inactive_file ").unwrap_or(0.0),
        )
    } else {
        let dir = v2.into_iter().find(|d| std::path::Path::new(d).exists())?;
        let usage = read(format!("{dir}/memory.current"))?;
        let stat = read(format!("{dir}/memory.stat")).unwrap_or_default();
        (
            usage.trim().parse::<f64>().ok()?,
            stat_value(&stat, "inactive_file ").unwrap_or(0.0),
        )
    };
    let mb = 1024.0 * 1024.0;
    Some((usage / mb, (usage - inactive) / mb))
}
