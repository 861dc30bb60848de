//! The node hop (issue 15): `exec 1+1` through `RemoteSandbox`, straight to a separate
//! `sandgate node` process over the node RPC (gRPC, mutual TLS with a throwaway CA, loopback),
//! beside `crate.exec_1p1` (the same call in-process).
//!
//! The node gets a database of its own, so its registration never meets another process's
//! (the registry refuses a second node per engine only within one database), and it runs in a
//! phase of its own, after the MCP gateway has stopped.

use super::*;

use sandgate_node::RemoteNode;

/// A `sandgate node` process with its own database, instance and CA.
struct OwnNode {
    process: NodeProcess,
    tls: NodeTls,
    instance: String,
    database: String,
}

impl OwnNode {
    async fn start(image: &str) -> Result<OwnNode> {
        let database = fresh_database().await?;
        let instance = format!(
            "bench-node-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let tls = NodeTls::new(&instance)?;
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
        let process = NodeProcess::start(
            &database,
            &instance,
            &tls,
            &[
                ("SANDGATE_SANDBOX__IMAGE", image),
                ("SANDGATE_POOL__MIN_READY", "0"),
            ],
        )
        .await?;
        Ok(OwnNode {
            process,
            tls,
            instance,
            database,
        })
    }

    /// Stops the node, then removes what is left of its instance, its database and certificates.
    async fn stop(self, docker: &Docker) {
        self.process.stop().await;
        remove_instance(docker, &self.instance).await;
        drop_database(&self.database).await;
        drop(self.tls);
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
    let node = match OwnNode::start(image).await {
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
        let gateway = RemoteNode::connect_lazy(&node.process.url, &node.tls.pki.tls())?;
        let sandbox =
            tokio::time::timeout(Duration::from_secs(180), gateway.launch(&profile(image)))
                .await
                .context("the node did not start a sandbox within 180 s")??;
        wait_quiet(Duration::from_secs(90)).await;
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
