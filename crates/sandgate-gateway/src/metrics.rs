//! Prometheus metrics at `/metrics` (OpenMetrics text): tool calls by tool and outcome and their
//! durations (registered by the MCP endpoint, `sandgate_mcp::metrics`), the warm pool of this
//! process's node, every registered node's numbers from Postgres (so a gateway-only replica
//! exports them too), the sandboxes' output budgets, and refused HTTP requests by reason. Labels
//! are small enums (tool names, outcomes, refusal reasons), never ids of requests, sandboxes or
//! tenants, nodes or hosts (the nodes' numbers are summed over the fleet).

use std::sync::Arc;

use axum::extract::Request;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use sandgate_service::PgPool;
use sandgate_service::metrics::{Certificates, PoolStats, ServiceMetrics, TemplateStatus};

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

/// The gateway's metrics. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    tools: ToolMetrics,
    service: ServiceMetrics,
    refusals: Family<RefusalLabels, Counter>,
    /// The TLS certificates this process loaded, for their expiry gauge.
    certificates: Option<Certificates>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered, and no certificate.
    pub fn new() -> Self {
        Self::with_certificates(None)
    }

    /// Same, exporting the expiry of `certificates` (the ones this process loaded).
    pub fn with_certificates(certificates: Option<Certificates>) -> Self {
        let mut registry = Registry::with_prefix("sandgate");
        let tools = ToolMetrics::register(&mut registry);
        let service = ServiceMetrics::register(&mut registry);
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
                service,
                refusals,
                certificates,
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

    /// Reads every registered node's numbers from Postgres, at most once every few seconds.
    pub async fn refresh_nodes(&self, db: &PgPool) {
        self.inner.service.refresh_nodes(db).await;
    }

    /// Renders the registry as OpenMetrics text.
    fn render(
        &self,
        pool: Option<PoolStats>,
        template: Option<TemplateStatus>,
    ) -> Result<String, std::fmt::Error> {
        if let Some(pool) = pool {
            self.inner.service.set_pool(&pool);
        }
        if let Some(template) = template {
            self.inner.service.set_template(&template);
        }
        if let Some(certificates) = &self.inner.certificates {
            self.inner.service.set_certificates(certificates);
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

/// `GET /metrics` on the public listener: served only when no private listener is configured
/// (`metrics.listen`); with one, it is not found here.
pub async fn metrics(State(state): State<AppState>) -> Response {
    if state.config.metrics.listen_addr().is_some() {
        return StatusCode::NOT_FOUND.into_response();
    }
    answer(
        &state.metrics,
        &state.db,
        &state.sandboxes,
        &state.config.sandbox.name,
    )
    .await
}

/// The metrics as OpenMetrics text (the public and the private listener's).
pub(crate) async fn answer(
    metrics: &Metrics,
    db: &PgPool,
    sandboxes: &crate::sandboxes::SandboxService,
    profile: &str,
) -> Response {
    // Every node's numbers, as the tables hold them (a gateway-only replica has no pool of its
    // own, and the operator scrapes whichever process it likes).
    metrics.refresh_nodes(db).await;
    // The pool of this process's own node (a gateway-only replica has none).
    let pool = ServiceMetrics::local_pool(sandboxes, profile);
    let template = ServiceMetrics::local_template(sandboxes, profile);
    match metrics.render(pool, template) {
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
        let ok = sandgate_service::audit::Outcome::Ok;
        metrics
            .tools()
            .record_call(exec, ok, std::time::Duration::from_millis(3));
        let text = metrics
            .render(
                Some(PoolStats {
                    ready: 2,
                    starting: 1,
                    cold_starting: 1,
                    target: 5,
                    start_limit: 3,
                    start_time: std::time::Duration::from_millis(300),
                    lease_rate: 1.0,
                }),
                None,
            )
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
}
