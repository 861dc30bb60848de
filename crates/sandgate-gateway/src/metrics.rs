//! Prometheus metrics at `/metrics` (OpenMetrics text): tool calls by tool and outcome and their
//! durations (registered by the MCP endpoint, `sandgate_mcp::metrics`), the warm pool of this
//! process's node, every registered node's numbers from Postgres (so a gateway-only replica
//! exports them too), the sandboxes' output budgets, and refused HTTP requests by reason. Labels
//! are small enums (tool names, outcomes, refusal reasons), never ids of requests, sandboxes or
//! tenants; the per-node metrics carry the node's registry id and host name (one series per
//! Docker engine of the deployment: as bounded as the fleet).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use sandgate_sandbox::PoolStats;
use sandgate_store::PgPool;
use sandgate_store::nodes::NodePool;

use crate::AppState;
use crate::mcp::metrics::ToolMetrics;

/// Why a request was refused before (or instead of) being served.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // the label values are the metric's spelling
pub enum RefusalReason {
    /// 401: no valid credentials.
    unauthenticated,
    /// 403 with an `insufficient_scope` challenge.
    insufficient_scope,
    /// Any other 403 (a foreign Origin, a forged form).
    forbidden,
    /// 408: the request's body did not arrive in time.
    timeout,
    /// 413: the body is over its limit.
    too_large,
    /// 429: a rate limit or an account lockout.
    rate_limited,
    /// 503 with `Retry-After`: a bounded queue (password hashing) is full.
    overloaded,
}

impl RefusalReason {
    /// The reason for a response, if it is a refusal.
    pub fn of(response: &Response) -> Option<Self> {
        let challenge = response
            .headers()
            .get(header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        Some(match response.status() {
            StatusCode::UNAUTHORIZED => Self::unauthenticated,
            StatusCode::FORBIDDEN if challenge.contains("insufficient_scope") => {
                Self::insufficient_scope
            }
            StatusCode::FORBIDDEN => Self::forbidden,
            StatusCode::REQUEST_TIMEOUT => Self::timeout,
            StatusCode::PAYLOAD_TOO_LARGE => Self::too_large,
            StatusCode::TOO_MANY_REQUESTS => Self::rate_limited,
            StatusCode::SERVICE_UNAVAILABLE
                if response.headers().contains_key(header::RETRY_AFTER) =>
            {
                Self::overloaded
            }
            _ => return None,
        })
    }
}

/// Labels of a refusal.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    reason: RefusalReason,
}

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

/// The gateway's metrics. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    tools: ToolMetrics,
    pool_ready: Gauge,
    pool_starting: Gauge,
    pool_target: Gauge,
    pool_start_limit: Gauge,
    nodes: NodeGauges,
    refusals: Family<RefusalLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("sandgate");
        let tools = ToolMetrics::register(&mut registry);
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
        let nodes = NodeGauges::register(&mut registry);
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
            sandgate_service::audit::dropped_counter().clone(),
        );
        registry.register(
            "transcript_entries_lost",
            "Transcript entries never written: the queue was full (Postgres away for long), \
             Postgres was still away at shutdown, or the database refused them (not the entries a \
             full transcript does not keep)",
            sandgate_service::transcripts::lost_counter().clone(),
        );
        let refusals = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "http_refusals",
            "HTTP requests refused, by reason (unauthenticated, insufficient_scope, forbidden, \
             timeout, too_large, rate_limited, overloaded)",
            refusals.clone(),
        );
        Self {
            inner: Arc::new(Inner {
                registry,
                tools,
                pool_ready,
                pool_starting,
                pool_target,
                pool_start_limit,
                nodes,
                refusals,
            }),
        }
    }

    /// The tool-call metrics, for the MCP endpoint.
    pub fn tools(&self) -> &ToolMetrics {
        &self.inner.tools
    }

    /// Counts one refused request.
    pub fn record_refusal(&self, reason: RefusalReason) {
        self.inner
            .refusals
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }

    /// Reads every registered node's numbers from Postgres, at most once per [`NODES_FRESH`].
    pub async fn refresh_nodes(&self, db: &PgPool) {
        self.inner.nodes.refresh(db).await;
    }

    /// Renders the registry as OpenMetrics text.
    fn render(&self, pool: Option<PoolStats>) -> Result<String, std::fmt::Error> {
        if let Some(pool) = pool {
            let gauge = |g: &Gauge, n: usize| g.set(i64::try_from(n).unwrap_or(i64::MAX));
            gauge(&self.inner.pool_ready, pool.ready);
            gauge(
                &self.inner.pool_starting,
                pool.starting + pool.cold_starting,
            );
            gauge(&self.inner.pool_target, pool.target);
            gauge(&self.inner.pool_start_limit, pool.start_limit);
        }
        let mut out = String::new();
        encode(&mut out, &self.inner.registry)?;
        Ok(out)
    }
}

/// Middleware: counts every refused response by reason.
pub async fn count_refusals(
    State(metrics): State<Metrics>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    if let Some(reason) = RefusalReason::of(&response) {
        metrics.record_refusal(reason);
    }
    response
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<AppState>) -> Response {
    // Every node's numbers, as the tables hold them (a gateway-only replica has no pool of its
    // own, and the operator scrapes whichever process it likes).
    state.metrics.refresh_nodes(&state.db).await;
    // The pool of this process's own node (a gateway-only replica has none).
    let pool = state
        .sandboxes
        .nodes()
        .local()
        .and_then(|m| m.pool_stats(&state.config.sandbox.name));
    match state.metrics.render(pool) {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_and_the_pool_are_exported() {
        let metrics = Metrics::new();
        let exec = crate::mcp::tools::ToolName::ExecuteCode;
        let ok = sandgate_store::audit::Outcome::Ok;
        metrics
            .tools()
            .record_call(exec, ok, std::time::Duration::from_millis(3));
        let text = metrics
            .render(Some(PoolStats {
                ready: 2,
                starting: 1,
                cold_starting: 1,
                target: 5,
                start_limit: 3,
                start_time: std::time::Duration::from_millis(300),
                lease_rate: 1.0,
            }))
            .unwrap();
        assert!(
            text.contains(r#"sandgate_tool_calls_total{tool="execute_code",outcome="ok"} 1"#),
            "{text}"
        );
        assert!(text.contains("sandgate_pool_ready_sandboxes 2"), "{text}");
        assert!(
            text.contains("sandgate_pool_starting_sandboxes 2"),
            "{text}"
        );
        assert!(text.contains("sandgate_pool_target_sandboxes 5"), "{text}");
        assert!(text.contains("sandgate_pool_start_limit 3"), "{text}");
        assert!(text.contains("sandgate_lease_wait_seconds_count"), "{text}");
    }

    #[test]
    fn every_nodes_numbers_are_exported_and_a_node_gone_from_the_table_drops_out() {
        let metrics = Metrics::new();
        let pool = |id: &str, ready, leased| NodePool {
            id: id.into(),
            name: format!("host-{id}"),
            slots: 40,
            draining: id == "b",
            heartbeat_age_seconds: 1.5,
            ready,
            leased,
        };
        metrics.inner.nodes.set(&[pool("a", 2, 3), pool("b", 0, 7)]);
        let text = metrics.render(None).unwrap();
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
        metrics.inner.nodes.set(&[pool("a", 1, 3)]);
        let text = metrics.render(None).unwrap();
        assert!(!text.contains(r#"node="b""#), "node b is gone: {text}");
    }

    #[test]
    fn sandbox_budget_counters_are_exported() {
        let metrics = Metrics::new();
        sandgate_sandbox::telemetry::counters()
            .stderr_lines_dropped
            .inc_by(3);
        let text = metrics.render(None).unwrap();
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
