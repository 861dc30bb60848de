//! The service's numbers for `/metrics`: the warm pool of this process's node, every
//! registered node's numbers from Postgres (so a gateway-only replica exports them too), lease
//! waits, the sandboxes' output budgets, and what the audit and transcript writers lost. The
//! gateway owns the registry and the endpoint; [`ServiceMetrics::register`] adds these to it.
//! The per-node metrics carry the node's registry id and host name (one series per Docker
//! engine of the deployment: as bounded as the fleet).

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sandgate_store::PgPool;
use sandgate_store::nodes::NodePool;

/// A warm pool's numbers (this process's own node).
pub use sandgate_sandbox::PoolStats;

use crate::sandboxes::SandboxService;

/// Labels of a node's metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    /// The node's registry id (its engine's id).
    node: String,
    /// Its host's name.
    host: String,
}

/// How long the nodes' numbers read from Postgres are served before they are read again (every
/// replica is scraped; one read per replica per this interval at most).
const NODES_FRESH: Duration = Duration::from_secs(5);

/// How long reading the nodes' numbers may take before a scrape goes on without them.
const NODES_READ_WITHIN: Duration = Duration::from_secs(2);

/// The per-node gauges, from the `nodes` and `sandboxes` tables.
#[derive(Debug, Default)]
struct NodeGauges {
    ready: Family<NodeLabels, Gauge>,
    leased: Family<NodeLabels, Gauge>,
    slots: Family<NodeLabels, Gauge>,
    draining: Family<NodeLabels, Gauge>,
    heartbeat_age: Family<NodeLabels, Gauge<f64, AtomicU64>>,
    /// When they were last read (single flight: a scrape waits for the read in progress).
    read_at: tokio::sync::Mutex<Option<Instant>>,
}

impl NodeGauges {
    fn register(registry: &mut Registry) -> Self {
        let gauges = Self::default();
        registry.register(
            "node_ready_sandboxes",
            "Warm sandboxes recorded on each sandbox node (ready to lease)",
            gauges.ready.clone(),
        );
        registry.register(
            "node_leased_sandboxes",
            "Leased sandboxes on each sandbox node",
            gauges.leased.clone(),
        );
        registry.register(
            "node_slots",
            "Most live sandboxes each sandbox node takes (node.slots)",
            gauges.slots.clone(),
        );
        registry.register(
            "node_draining",
            "1 when a sandbox node is draining (takes no new leases)",
            gauges.draining.clone(),
        );
        registry.register(
            "node_heartbeat_age_seconds",
            "Seconds since each sandbox node's last heartbeat (past node.lost_after_seconds its \
             sandboxes are marked lost)",
            gauges.heartbeat_age.clone(),
        );
        gauges
    }

    /// Sets the gauges to `pools` (a node no longer registered drops out).
    fn set(&self, pools: &[NodePool]) {
        for family in [&self.ready, &self.leased, &self.slots, &self.draining] {
            family.clear();
        }
        self.heartbeat_age.clear();
        for pool in pools {
            let labels = NodeLabels {
                node: pool.id.clone(),
                host: pool.name.clone(),
            };
            self.ready.get_or_create(&labels).set(pool.ready);
            self.leased.get_or_create(&labels).set(pool.leased);
            self.slots.get_or_create(&labels).set(i64::from(pool.slots));
            self.draining
                .get_or_create(&labels)
                .set(i64::from(pool.draining));
            self.heartbeat_age
                .get_or_create(&labels)
                .set(pool.heartbeat_age_seconds);
        }
    }

    /// Reads the nodes' numbers again when the last read is older than [`NODES_FRESH`]. A
    /// failed read keeps the last numbers (logged; the next scrape after the interval retries).
    async fn refresh(&self, db: &PgPool) {
        let mut read_at = self.read_at.lock().await;
        if read_at.is_some_and(|at| at.elapsed() < NODES_FRESH) {
            return;
        }
        *read_at = Some(Instant::now());
        let read = async {
            let mut conn = db.acquire().await?;
            sandgate_store::nodes::pools(&mut conn).await
        };
        match tokio::time::timeout(NODES_READ_WITHIN, read).await {
            Ok(Ok(pools)) => self.set(&pools),
            Ok(Err(err)) => tracing::warn!(error = %err, "reading the nodes for /metrics failed"),
            Err(_) => tracing::warn!("reading the nodes for /metrics took too long"),
        }
    }
}

/// The service's metrics, registered in the gateway's registry.
#[derive(Debug)]
pub struct ServiceMetrics {
    pool_ready: Gauge,
    pool_starting: Gauge,
    pool_target: Gauge,
    pool_start_limit: Gauge,
    nodes: NodeGauges,
}

impl ServiceMetrics {
    /// Registers the service's metrics in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let pool_ready = Gauge::default();
        registry.register(
            "pool_ready_sandboxes",
            "Started-and-ready sandboxes waiting in this process's warm pool",
            pool_ready.clone(),
        );
        let pool_starting = Gauge::default();
        registry.register(
            "pool_starting_sandboxes",
            "Sandbox starts in flight or waiting for a place (pool refills and cold starts)",
            pool_starting.clone(),
        );
        let pool_target = Gauge::default();
        registry.register(
            "pool_target_sandboxes",
            "Ready sandboxes the warm pool aims for now (follows the lease rate and start time)",
            pool_target.clone(),
        );
        let pool_start_limit = Gauge::default();
        registry.register(
            "pool_start_limit",
            "Sandbox starts allowed at once now (adapts to the machine)",
            pool_start_limit.clone(),
        );
        let nodes = NodeGauges::register(registry);
        register_counters(registry);
        Self {
            pool_ready,
            pool_starting,
            pool_target,
            pool_start_limit,
            nodes,
        }
    }

    /// Sets the pool gauges to `pool`.
    pub fn set_pool(&self, pool: &PoolStats) {
        let gauge = |g: &Gauge, n: usize| g.set(i64::try_from(n).unwrap_or(i64::MAX));
        gauge(&self.pool_ready, pool.ready);
        gauge(&self.pool_starting, pool.starting + pool.cold_starting);
        gauge(&self.pool_target, pool.target);
        gauge(&self.pool_start_limit, pool.start_limit);
    }

    /// The warm pool of profile `profile` on this process's own node (none: gateway-only).
    pub fn local_pool(sandboxes: &SandboxService, profile: &str) -> Option<PoolStats> {
        sandboxes
            .nodes()
            .local()
            .and_then(|m| m.pool_stats(profile))
    }

    /// Reads every registered node's numbers from Postgres, at most once per [`NODES_FRESH`].
    pub async fn refresh_nodes(&self, db: &PgPool) {
        self.nodes.refresh(db).await;
    }
}

/// The counters the sandbox manager and the write-behind queues keep.
fn register_counters(registry: &mut Registry) {
    let sandbox = sandgate_sandbox::telemetry::counters();
    registry.register(
        "lease_wait_seconds",
        "Wall time from a lease's start until its sandbox was handed out (warm or cold)",
        sandbox.lease_wait.clone(),
    );
    registry.register(
        "sandbox_stderr_lines_dropped",
        "Lines of sandbox container stderr not logged because the sandbox was over its log budget",
        sandbox.stderr_lines_dropped.clone(),
    );
    registry.register(
        "sandbox_output_throttled",
        "Times a sandbox's output was paused for sending frames or bytes faster than its budget",
        sandbox.output_throttled.clone(),
    );
    registry.register(
        "audit_dropped",
        "Audit events dropped: the queue was full (Postgres away for long), Postgres was still \
         away at shutdown, or the database refused them",
        crate::audit::dropped_counter().clone(),
    );
    registry.register(
        "transcript_entries_lost",
        "Transcript entries never written: the queue was full (Postgres away for long), \
         Postgres was still away at shutdown, or the database refused them (not the entries a \
         full transcript does not keep)",
        crate::transcripts::lost_counter().clone(),
    );
    registry.register(
        "transcript_entries_over_budget",
        "Transcript entries not kept because their tenant's stored transcripts were at their \
         byte budget (retention.transcript_tenant_max_bytes); each export says so too",
        crate::transcripts::over_budget_counter().clone(),
    );
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    fn render(registry: &Registry) -> String {
        let mut out = String::new();
        encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn every_nodes_numbers_are_exported_and_a_node_gone_from_the_table_drops_out() {
        let mut registry = Registry::with_prefix("sandgate");
        let metrics = ServiceMetrics::register(&mut registry);
        let pool = |id: &str, ready, leased| NodePool {
            id: id.into(),
            name: format!("host-{id}"),
            slots: 40,
            draining: id == "b",
            heartbeat_age_seconds: 1.5,
            ready,
            leased,
        };
        metrics.nodes.set(&[pool("a", 2, 3), pool("b", 0, 7)]);
        let text = render(&registry);
        for line in [
            r#"sandgate_node_ready_sandboxes{node="a",host="host-a"} 2"#,
            r#"sandgate_node_leased_sandboxes{node="a",host="host-a"} 3"#,
            r#"sandgate_node_leased_sandboxes{node="b",host="host-b"} 7"#,
            r#"sandgate_node_slots{node="a",host="host-a"} 40"#,
            r#"sandgate_node_draining{node="a",host="host-a"} 0"#,
            r#"sandgate_node_draining{node="b",host="host-b"} 1"#,
            r#"sandgate_node_heartbeat_age_seconds{node="a",host="host-a"} 1.5"#,
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        metrics.nodes.set(&[pool("a", 1, 3)]);
        let text = render(&registry);
        assert!(!text.contains(r#"node="b""#), "node b is gone: {text}");
    }

    #[test]
    fn sandbox_budget_counters_are_exported() {
        let mut registry = Registry::with_prefix("sandgate");
        let _metrics = ServiceMetrics::register(&mut registry);
        sandgate_sandbox::telemetry::counters()
            .stderr_lines_dropped
            .inc_by(3);
        let text = render(&registry);
        assert!(
            text.contains("sandgate_sandbox_stderr_lines_dropped_total "),
            "{text}"
        );
        assert!(
            text.contains("sandgate_sandbox_output_throttled_total "),
            "{text}"
        );
    }
}
