//! The service's numbers for `/metrics`: the warm pool of this process's node, every
//! registered node's numbers from Postgres (so a gateway-only replica exports them too), lease
//! waits, the sandboxes' output budgets, and what the audit and transcript writers lost. The
//! gateway owns the registry and the endpoint; [`ServiceMetrics::register`] adds these to it.
//! The nodes' numbers are summed over the fleet: `/metrics` names no node id and no host name
//! (labels are small enums), since anyone who reaches it could read them.

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sandgate_store::PgPool;
use sandgate_store::nodes::NodePool;

/// A warm pool's numbers (this process's own node).
pub use sandgate_sandbox::PoolStats;
/// A warm pool's template (this process's own node).
pub use sandgate_sandbox::TemplateStatus;

use crate::sandboxes::SandboxService;

/// The one label of `sandgate_nodes`: a small enum, never a node's id or host name (`/metrics`
/// answers anyone who reaches it; `sandgate admin nodes` names the nodes to the operator).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeState {
    state: NodeStateValue,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // the label values are the metric's spelling
enum NodeStateValue {
    serving,
    draining,
}

/// Which certificate a `sandgate_tls_certificate_expiry_timestamp_seconds` series is about: a
/// small enum, never a file path or a certificate's subject.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // the label values are the metric's spelling
pub enum CertificateKind {
    /// `node.tls_cert` presented by this process's node RPC server (`sandgate node`, or
    /// `sandgate serve` with `node.listen`).
    node_server,
    /// `node.tls_cert` presented by this gateway as a client to the nodes.
    gateway_client,
    /// The earliest-expiring certificate of the deployment CA bundle (`node.tls_ca`).
    ca,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CertificateLabels {
    certificate: CertificateKind,
}

/// The certificates a process loads (`node.tls_*`) and the roles it uses its own one in, for
/// the expiry gauge. Read at each scrape through the same re-reading [`sandgate_node::NodeTls`]
/// rule as the RPC (files changed on disk are read again, a half-written renewal keeps the
/// previous material), so after a renewal the gauge shows the new certificate's notAfter.
#[derive(Debug, Clone)]
pub struct Certificates {
    tls: sandgate_node::NodeTls,
    own: Vec<CertificateKind>,
}

impl Certificates {
    /// Those of `config`, used as `own`; `None` without node TLS.
    pub fn of(config: &crate::Config, own: Vec<CertificateKind>) -> Option<Self> {
        match config.node.tls() {
            Ok(Some(tls)) => Some(Self { tls, own }),
            Ok(None) => None,
            Err(err) => {
                tracing::warn!(error = %err, "node TLS files unreadable: no certificate expiry metric");
                None
            }
        }
    }
}

/// How long the nodes' numbers read from Postgres are served before they are read again (every
/// replica is scraped; one read per replica per this interval at most).
const NODES_FRESH: Duration = Duration::from_secs(5);

/// How long reading the nodes' numbers may take before a scrape goes on without them.
const NODES_READ_WITHIN: Duration = Duration::from_secs(2);

/// The fleet's gauges, from the `nodes` and `sandboxes` tables, summed over the nodes.
#[derive(Debug, Default)]
struct NodeGauges {
    nodes: Family<NodeState, Gauge>,
    ready: Gauge,
    leased: Gauge,
    slots: Gauge,
    heartbeat_age: Gauge<f64, AtomicU64>,
    /// 1 while the last read of the nodes from Postgres succeeded in time, else 0.
    database_up: Gauge,
    /// When they were last read (single flight: a scrape waits for the read in progress).
    read_at: tokio::sync::Mutex<Option<Instant>>,
}

impl NodeGauges {
    fn register(registry: &mut Registry) -> Self {
        let gauges = Self::default();
        registry.register(
            "nodes",
            "Registered sandbox nodes, serving or draining (takes no new leases)",
            gauges.nodes.clone(),
        );
        registry.register(
            "node_ready_sandboxes",
            "Warm sandboxes recorded on the sandbox nodes (ready to lease)",
            gauges.ready.clone(),
        );
        registry.register(
            "node_leased_sandboxes",
            "Leased sandboxes on the sandbox nodes",
            gauges.leased.clone(),
        );
        registry.register(
            "node_slots",
            "Most live sandboxes the serving sandbox nodes take (their node.slots, summed)",
            gauges.slots.clone(),
        );
        registry.register(
            "node_heartbeat_age_seconds",
            "Seconds since the oldest last heartbeat of a registered sandbox node (past \
             node.away_after_seconds it is away, past node.lost_after_seconds its sandboxes \
             are marked lost)",
            gauges.heartbeat_age.clone(),
        );
        registry.register(
            "database_up",
            "1 when this process's last read of Postgres for /metrics succeeded within 2 s, \
             else 0",
            gauges.database_up.clone(),
        );
        gauges
    }

    /// Sets the gauges to the sums over `pools` (a node no longer registered drops out).
    fn set(&self, pools: &[NodePool]) {
        let count = |draining: bool| pools.iter().filter(|p| p.draining == draining).count();
        for (state, draining) in [
            (NodeStateValue::serving, false),
            (NodeStateValue::draining, true),
        ] {
            self.nodes
                .get_or_create(&NodeState { state })
                .set(i64::try_from(count(draining)).unwrap_or(i64::MAX));
        }
        self.ready.set(pools.iter().map(|p| p.ready).sum());
        self.leased.set(pools.iter().map(|p| p.leased).sum());
        self.slots.set(
            pools
                .iter()
                .filter(|p| !p.draining)
                .map(|p| i64::from(p.slots))
                .sum(),
        );
        self.heartbeat_age.set(
            pools
                .iter()
                .map(|p| p.heartbeat_age_seconds)
                .fold(0.0, f64::max),
        );
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
            Ok(Ok(pools)) => {
                self.database_up.set(1);
                self.set(&pools);
            }
            Ok(Err(err)) => {
                self.database_up.set(0);
                tracing::warn!(error = %err, "reading the nodes for /metrics failed");
            }
            Err(_) => {
                self.database_up.set(0);
                tracing::warn!("reading the nodes for /metrics took too long");
            }
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
    template_age: Gauge<f64, AtomicU64>,
    template_bytes: Gauge,
    nodes: NodeGauges,
    certificates: Family<CertificateLabels, Gauge>,
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
        let template_age = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "template_age_seconds",
            "Age of the template this process's warm pool restores its sandboxes from (0: none in \
             use; sandboxes start afresh)",
            template_age.clone(),
        );
        let template_bytes = Gauge::default();
        registry.register(
            "snapshot_image_bytes",
            "Size of the template's checkpoint image on the engine's plaintext tmpfs (0: none)",
            template_bytes.clone(),
        );
        let nodes = NodeGauges::register(registry);
        let certificates = Family::<CertificateLabels, Gauge>::default();
        registry.register(
            "tls_certificate_expiry_timestamp_seconds",
            "When each TLS certificate this process loaded expires (notAfter, Unix seconds), by \
             certificate: node_server, gateway_client (node.tls_cert in that use), ca (the \
             earliest of node.tls_ca); updated when the files are read again after a renewal",
            certificates.clone(),
        );
        register_counters(registry);
        Self {
            pool_ready,
            pool_starting,
            pool_target,
            pool_start_limit,
            template_age,
            template_bytes,
            nodes,
            certificates,
        }
    }

    /// Sets the certificate expiry gauge from `certificates` as they are now.
    pub fn set_certificates(&self, certificates: &Certificates) {
        let expiry = certificates.tls.expiry();
        let set = |certificate: CertificateKind, at: Option<i64>| {
            if let Some(at) = at {
                self.certificates
                    .get_or_create(&CertificateLabels { certificate })
                    .set(at);
            }
        };
        for kind in &certificates.own {
            set(*kind, expiry.own);
        }
        set(CertificateKind::ca, expiry.ca);
    }

    /// Sets the pool gauges to `pool`.
    pub fn set_pool(&self, pool: &PoolStats) {
        let gauge = |g: &Gauge, n: usize| g.set(i64::try_from(n).unwrap_or(i64::MAX));
        gauge(&self.pool_ready, pool.ready);
        gauge(&self.pool_starting, pool.starting + pool.cold_starting);
        gauge(&self.pool_target, pool.target);
        gauge(&self.pool_start_limit, pool.start_limit);
    }

    /// Sets the template gauges to `status` (none in use: 0).
    pub fn set_template(&self, status: &TemplateStatus) {
        let template = status.template.as_ref();
        self.template_age
            .set(template.map_or(0.0, |t| t.age.as_secs_f64()));
        self.template_bytes
            .set(template.map_or(0, |t| i64::try_from(t.size_bytes).unwrap_or(i64::MAX)));
    }

    /// The template of profile `profile` on this process's own node (none: gateway-only).
    pub fn local_template(sandboxes: &SandboxService, profile: &str) -> Option<TemplateStatus> {
        sandboxes
            .nodes()
            .local()
            .and_then(|m| m.template_status(profile))
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
        "snapshot_checkpoint_seconds",
        "Wall time of a checkpoint of a sandbox (templates, and any other)",
        sandbox.checkpoint_seconds.clone(),
    );
    registry.register(
        "snapshot_restore_seconds",
        "Wall time of a restore of a snapshot into a new sandbox, until its agent answered",
        sandbox.restore_seconds.clone(),
    );
    registry.register(
        "template_restores",
        "Pool starts that tried the pool's template, by outcome (restored; failed or refused: an \
         ordinary start took its place)",
        sandbox.template_restores.clone(),
    );
    registry.register(
        "template_fallbacks",
        "Pool starts that fell back to an ordinary start because the template's restore failed \
         or was refused",
        sandbox.template_fallbacks.clone(),
    );
    registry.register(
        "template_builds",
        "Template builds, by outcome (built and verified, or failed)",
        sandbox.template_builds.clone(),
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
    let egress = crate::egress::metrics::counters();
    registry.register(
        "egress_connections",
        "Egress CONNECTs from sandboxes, by outcome (ok, refused by the policy, the target check \
         or a budget, failed) and kind (tunnel, or intercepted for a secret bound to the host)",
        egress.connections.clone(),
    );
    registry.register(
        "egress_bytes",
        "Bytes egress connections carried, by direction (sent: sandbox to server)",
        egress.bytes.clone(),
    );
    registry.register(
        "egress_secrets_injected",
        "Requests an egress secret's value was put into (one per secret and request)",
        egress.secrets_injected.clone(),
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
    fn the_fleets_numbers_are_exported_summed_and_name_no_node() {
        let mut registry = Registry::with_prefix("sandgate");
        let metrics = ServiceMetrics::register(&mut registry);
        let pool = |id: &str, ready, leased| NodePool {
            id: id.into(),
            name: format!("host-{id}"),
            slots: 40,
            draining: id == "b",
            heartbeat_age_seconds: if id == "b" { 4.5 } else { 1.5 },
            ready,
            leased,
        };
        metrics.nodes.set(&[pool("a", 2, 3), pool("b", 0, 7)]);
        let text = render(&registry);
        for line in [
            r#"sandgate_nodes{state="serving"} 1"#,
            r#"sandgate_nodes{state="draining"} 1"#,
            "sandgate_node_ready_sandboxes 2",
            "sandgate_node_leased_sandboxes 10",
            "sandgate_node_slots 40",
            "sandgate_node_heartbeat_age_seconds 4.5",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        assert!(
            !text.contains("host-") && !text.contains("node=\""),
            "no node id or host name: {text}"
        );
        metrics.nodes.set(&[pool("a", 1, 3)]);
        let text = render(&registry);
        assert!(
            text.contains(r#"sandgate_nodes{state="draining"} 0"#),
            "node b is gone: {text}"
        );
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

    #[test]
    fn snapshot_and_template_metrics_are_exported() {
        use sandgate_sandbox::telemetry::{TemplateRestore, counters};
        let mut registry = Registry::with_prefix("sandgate");
        let metrics = ServiceMetrics::register(&mut registry);
        counters().template_restore(TemplateRestore::refused);
        counters().restore_seconds.observe(1.5);
        metrics.set_template(&TemplateStatus {
            enabled: true,
            snapshots: Some(Ok(())),
            template: Some(sandgate_sandbox::TemplateInfo {
                snapshot_id: "snap_x".into(),
                age: Duration::from_secs(90),
                size_bytes: 28_000_000,
                dir: "/nowhere".into(),
            }),
            last_error: None,
        });
        let text = render(&registry);
        for line in [
            r#"sandgate_template_restores_total{outcome="refused"} "#,
            "sandgate_snapshot_restore_seconds_count ",
            "sandgate_snapshot_checkpoint_seconds_count ",
            "sandgate_template_fallbacks_total ",
            "sandgate_template_age_seconds 90",
            "sandgate_snapshot_image_bytes 28000000",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
    }
}
