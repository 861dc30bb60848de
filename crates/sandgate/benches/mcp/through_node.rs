//! The node hop (issue 15): `exec 1+1` through `RemoteSandbox`, straight to a separate
//! `sandgate node` process over the node RPC (gRPC, mutual TLS with a throwaway CA, loopback),
//! beside `crate.exec_1p1` (the same call in-process).
//!
//! The node gets a database of its own, so its registration never meets another process's
//! (the registry refuses a second node per engine only within one database), and it runs in a
//! phase of its own, after the MCP gateway has stopped.

use super::*;

use sandgate_node::RemoteNode;
use sandgate_node::test_pki::Pki;

/// A `sandgate node` process on a loopback port, with its own database, instance and CA.
struct NodeProcess {
    child: tokio::process::Child,
    url: String,
    instance: String,
    database: String,
    dir: PathBuf,
    pki: Pki,
}

impl NodeProcess {
    async fn start(image: &str) -> Result<NodeProcess> {
        let database = fresh_database().await?;
        let instance = format!(
            "bench-node-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let dir = std::env::temp_dir().join(&instance);
        std::fs::create_dir_all(&dir)?;
        let pki = Pki::new("sandgate bench CA");
        let (cert, key) = pki.leaf_pem();
        for (name, pem) in [
            ("node.crt", &cert),
            ("node.key", &key),
            ("ca.crt", &pki.ca_pem()),
        ] {
            std::fs::write(dir.join(name), pem)?;
        }
        let path = |name: &str| dir.join(name).display().to_string();
        let migrated = Command::new(BIN)
            .arg("migrate")
            .env_remove("RUST_LOG")
            .env("SANDGATE_DATABASE__URL", &database)
            .output()
            .await?;
        if !migrated.status.success() {
            bail!(
                "sandgate migrate failed: {}",
                String::from_utf8_lossy(&migrated.stderr)
            );
        }
        let mut child = Command::new(BIN)
            .arg("node")
            .env_remove("RUST_LOG")
            .env("SANDGATE_DATABASE__URL", &database)
            .env("SANDGATE_INSTANCE", &instance)
            .env("SANDGATE_SANDBOX__IMAGE", image)
            .env("SANDGATE_LOG__FORMAT", "json")
            .env("SANDGATE_LOG__FILTER", "warn")
            .env("SANDGATE_POOL__MIN_READY", "0")
            .env("SANDGATE_NODE__LISTEN", "127.0.0.1:0")
            .env("SANDGATE_NODE__TLS_CERT", path("node.crt"))
            .env("SANDGATE_NODE__TLS_KEY", path("node.key"))
            .env("SANDGATE_NODE__TLS_CA", path("ca.crt"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting sandgate node")?;
        let stderr = child.stderr.take().context("stderr")?;
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[node] {line}");
            }
        });
        let stdout = child.stdout.take().context("stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .context("sandgate node did not print its address within 60 s")??
            .context("sandgate node exited before printing its address")?;
        let addr = line
            .strip_prefix("sandgate node serving at ")
            .with_context(|| format!("unexpected first line: {line:?}"))?;
        let url = format!("https://{addr}");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(NodeProcess {
            child,
            url,
            instance,
            database,
            dir,
            pki,
        })
    }

    /// SIGTERM, wait, then remove what is left of its instance, its database and certificates.
    async fn stop(mut self, docker: &Docker) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
            let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        }
        let _ = self.child.kill().await;
        remove_instance(docker, &self.instance).await;
        drop_database(&self.database).await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const NODE_EXEC: (&str, &str, &str) = (
    "node.exec_1p1",
    "sandbox node",
    "exec 1+1 through RemoteSandbox to a `sandgate node` process (gRPC, mutual TLS, loopback)",
);

/// `node.exec_1p1`: 10 warm-up calls, then `exec` calls of `1+1` on one sandbox of the node.
/// A node that does not start (e.g. a binary from before the node existed, in an A/B run) is
/// the row's error, not the whole run's.
pub(crate) async fn bench_node(opts: &Options, docker: &Docker, image: &str) -> Result<Vec<Row>> {
    let (name, system, what) = NODE_EXEC;
    let node = match NodeProcess::start(image).await {
        Ok(node) => node,
        Err(err) => {
            let mut failed = Samples::default();
            failed.fail(format!("{err:#}"));
            return Ok(vec![
                Row::ms(name, system, what, &failed).vs("crate.exec_1p1"),
            ]);
        }
    };
    let result = async {
        let gateway = RemoteNode::connect_lazy(&node.url, &node.pki.tls())?;
        let sandbox =
            tokio::time::timeout(Duration::from_secs(180), gateway.launch(&profile(image)))
                .await
                .context("the node did not start a sandbox within 180 s")??;
        let budget = Budget::secs(240);
        let mut exec = Samples::default();
        for i in 0..opts.counts.exec + 10 {
            let mut sink = Samples::default();
            let target = if i < 10 { &mut sink } else { &mut exec };
            target
                .time(&budget, async {
                    Ok(sandbox.exec("1+1", ExecOptions::default(), None).await?)
                })
                .await;
        }
        gateway.remove(sandbox.container_id()).await?;
        Ok::<_, anyhow::Error>(vec![
            Row::ms(name, system, what, &exec).vs("crate.exec_1p1"),
        ])
    }
    .await;
    node.stop(docker).await;
    result
}
