//! Process-wide measurements for the gateway's `/metrics`: what sandboxes sent beyond their
//! budgets, and how long leases waited. Every channel and lease adds to them; the gateway
//! registers them in its registry.

use std::sync::OnceLock;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// The sandbox crate's counters. Clones share the same values.
#[derive(Debug, Clone)]
pub struct SandboxCounters {
    /// Lines of container stderr not logged because a sandbox was over its log budget.
    pub stderr_lines_dropped: Counter,
    /// Times a sandbox's output was paused because it sent frames or bytes faster than its budget.
    pub output_throttled: Counter,
    /// Seconds a new lease took until its sandbox was handed out (warm or cold start included).
    pub lease_wait: Histogram,
}

impl Default for SandboxCounters {
    fn default() -> Self {
        Self {
            stderr_lines_dropped: Counter::default(),
            output_throttled: Counter::default(),
            // 1 ms to ~65 s.
            lease_wait: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
        }
    }
}

/// The counters of this process.
pub fn counters() -> &'static SandboxCounters {
    static COUNTERS: OnceLock<SandboxCounters> = OnceLock::new();
    COUNTERS.get_or_init(SandboxCounters::default)
}
