//! The bench's `sandgate` processes: [`start_sandgate`] for every one of them, and the `sandgate
//! node` of the rows through a separate node (`through_node`, `via_node`) with its throwaway
//! mutual-TLS files (a CA made here).

use sandgate_node::test_pki::Pki;

use super::*;

/// A `sandgate` process the bench started: the first line it printed (where it serves) and how
/// many warm sandboxes its log says are ready.
pub(crate) struct Started {
    pub(crate) child: tokio::process::Child,
    pub(crate) first_line: String,
    /// "warm sandbox ready" lines in its log (the manager's debug line; the bench's log filter
    /// keeps it): refills that finished.
    pub(crate) ready: Arc<AtomicUsize>,
}

/// Spawns `command` (a `sandgate` with its JSON log on standard error) and waits up to `within`
/// for its first line of standard output. Its errors, its warnings when `warnings`, and any line
/// that is not JSON show on standard error, after `[who]`; both pipes are drained to the end.
pub(crate) async fn start_sandgate(
    mut command: Command,
    who: &'static str,
    warnings: bool,
    within: Duration,
) -> Result<Started> {
    let mut child = command
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting sandgate ({who})"))?;
    let ready = Arc::new(AtomicUsize::new(0));
    let counter = ready.clone();
    let stderr = child.stderr.take().context("stderr")?;
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("warm sandbox ready") {
                counter.fetch_add(1, Ordering::SeqCst);
            } else if !line.starts_with('{')
                || line.contains("\"level\":\"ERROR\"")
                || (warnings && line.contains("\"level\":\"WARN\""))
            {
                eprintln!("[{who}] {line}");
            }
        }
    });
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first_line = tokio::time::timeout(within, lines.next_line())
        .await
        .with_context(|| format!("sandgate ({who}) printed nothing within {within:?}"))??
        .with_context(|| format!("sandgate ({who}) exited before printing where it serves"))?;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Started {
        child,
        first_line,
        ready,
    })
}

/// A CA made here and one leaf for the node and its gateways, written to a directory of their own.
pub(crate) struct NodeTls {
    pub(crate) pki: Pki,
    dir: PathBuf,
}

impl NodeTls {
    /// New keys in a fresh directory under the temporary directory, named after `instance`.
    pub(crate) fn new(instance: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("{instance}-pki"));
        std::fs::create_dir_all(&dir)?;
        let pki = Pki::new("sandgate bench CA");
        let (cert, key) = pki.leaf_pem();
        for (name, pem) in [
            ("tls.crt", cert),
            ("tls.key", key),
            ("ca.crt", pki.ca_pem()),
        ] {
            std::fs::write(dir.join(name), pem)?;
        }
        Ok(Self { pki, dir })
    }

    /// The settings that point a node or a gateway at these files.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        let path = |name: &str| self.dir.join(name).display().to_string();
        vec![
            ("SANDGATE_NODE__TLS_CERT".to_owned(), path("tls.crt")),
            ("SANDGATE_NODE__TLS_KEY".to_owned(), path("tls.key")),
            ("SANDGATE_NODE__TLS_CA".to_owned(), path("ca.crt")),
        ]
    }
}

impl Drop for NodeTls {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `sandgate node` on a loopback port; killed when dropped.
pub(crate) struct NodeProcess {
    child: tokio::process::Child,
    /// `https://<addr>`: what gateways dial.
    pub(crate) url: String,
    /// "warm sandbox ready" lines in its log: refills that finished.
    pub(crate) ready: Arc<AtomicUsize>,
}

impl NodeProcess {
    /// Starts `sandgate node` for `instance` on `database` with `tls`, plus `env`; returns once it
    /// prints its address. Its errors (and any line that is not JSON) show on standard error.
    pub(crate) async fn start(
        database: &str,
        instance: &str,
        tls: &NodeTls,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let mut command = Command::new(BIN);
        command
            .arg("node")
            .env("SANDGATE_DATABASE__URL", database)
            .env("SANDGATE_INSTANCE", instance)
            .env("SANDGATE_LOG__FORMAT", "json")
            .env(
                "SANDGATE_LOG__FILTER",
                "warn,sandgate_sandbox::manager=debug",
            )
            .env("SANDGATE_NODE__LISTEN", "127.0.0.1:0")
            .envs(tls.env())
            .envs(env.iter().copied());
        let Started {
            child,
            first_line,
            ready,
        } = start_sandgate(command, "node", false, Duration::from_secs(120)).await?;
        let addr = first_line
            .strip_prefix("sandgate node serving at ")
            .with_context(|| format!("unexpected first line from sandgate node: {first_line:?}"))?;
        let url = format!("https://{addr}");
        Ok(Self { child, url, ready })
    }

    /// See [`stop_sandgate`].
    pub(crate) async fn stop(mut self) {
        stop_sandgate(&mut self.child).await;
    }
}

/// SIGTERM to a `sandgate` process, then up to 30 s for it to end, then SIGKILL.
pub(crate) async fn stop_sandgate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await;
        let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    }
    let _ = child.kill().await;
}
