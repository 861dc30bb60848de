//! The MCP endpoint's metrics: tool calls by tool and outcome, their durations, and quota
//! refusals by limit. They are
//! registered in the registry the gateway serves at `/metrics`. Labels are small enums (tool
//! names, outcomes), never ids.

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use sandgate_service::audit::Outcome;

use crate::tools::ToolName;

/// Labels of a tool call.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    tool: ToolName,
    outcome: OutcomeLabel,
}

/// Labels of a tool's duration.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabels {
    tool: ToolName,
}

/// Labels of a call or session refused by a quota: the limit's name (`max_calls_per_minute`,
/// `max_calls_in_flight`, `max_calls_per_sandbox`, `max_sessions`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    limit: &'static str,
}

/// A call's outcome as a label value (the audit trail's names).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
struct OutcomeLabel(Outcome);

impl EncodeLabelValue for OutcomeLabel {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.0.as_str())
    }
}

impl EncodeLabelValue for ToolName {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Tool-call counters and durations. Cheap to clone (the families share their values).
#[derive(Debug, Clone)]
pub struct ToolMetrics {
    calls: Family<CallLabels, Counter>,
    durations: Family<ToolLabels, Histogram>,
    quota_refusals: Family<QuotaLabels, Counter>,
}

impl ToolMetrics {
    /// Registers the tool-call metrics in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "tool_calls",
            "MCP tool calls by tool and outcome (ok, user_error, refused, failed, cancelled)",
            calls.clone(),
        );
        let durations = Family::<ToolLabels, Histogram>::new_with_constructor(|| {
            // 1 ms .. ~65 s
            Histogram::new(exponential_buckets(0.001, 2.0, 17))
        });
        registry.register(
            "tool_call_duration_seconds",
            "Wall time of MCP tool calls",
            durations.clone(),
        );
        let quota_refusals = Family::<QuotaLabels, Counter>::default();
        registry.register(
            "quota_refusals",
            "Tool calls and MCP sessions refused by a tenant quota, by limit (max_calls_per_minute, \
             max_calls_in_flight, max_calls_per_sandbox, max_sessions)",
            quota_refusals.clone(),
        );
        Self {
            calls,
            durations,
            quota_refusals,
        }
    }

    /// Counts one tool call.
    pub fn record_call(&self, tool: ToolName, outcome: Outcome, elapsed: Duration) {
        self.calls
            .get_or_create(&CallLabels {
                tool,
                outcome: OutcomeLabel(outcome),
            })
            .inc();
        self.durations
            .get_or_create(&ToolLabels { tool })
            .observe(elapsed.as_secs_f64());
    }

    /// Counts one call or session refused by the quota named `limit`.
    pub fn record_quota_refusal(&self, limit: &'static str) {
        self.quota_refusals
            .get_or_create(&QuotaLabels { limit })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    #[test]
    fn calls_are_counted_by_tool_and_outcome() {
        let mut registry = Registry::with_prefix("sandgate");
        let metrics = ToolMetrics::register(&mut registry);
        let exec = ToolName::ExecuteCode;
        metrics.record_call(exec, Outcome::Ok, Duration::from_millis(3));
        metrics.record_call(exec, Outcome::Ok, Duration::from_millis(5));
        metrics.record_call(exec, Outcome::UserError, Duration::from_millis(5));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"sandgate_tool_calls_total{tool="execute_code",outcome="ok"} 2"#),
            "{text}"
        );
        assert!(text.contains(r#"outcome="user_error"} 1"#), "{text}");
        assert!(
            text.contains("sandgate_tool_call_duration_seconds_count{tool=\"execute_code\"} 3"),
            "{text}"
        );
    }
}
