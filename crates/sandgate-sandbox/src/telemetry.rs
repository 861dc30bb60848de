//! Counters of what sandboxes sent beyond their budgets, for the gateway's `/metrics`. They are
//! process-wide (every channel adds to them); the gateway registers them in its registry.

use std::sync::OnceLock;

use prometheus_client::metrics::counter::Counter;

/// The sandbox crate's counters. Clones share the same values.
#[derive(Debug, Clone, Default)]
pub struct SandboxCounters {
    /// Lines of container stderr not logged because a sandbox was over its log budget.
    pub stderr_lines_dropped: Counter,
    /// Times a sandbox's output was paused because it sent frames or bytes faster than its budget.
    pub output_throttled: Counter,
}

/// The counters of this process.
pub fn counters() -> &'static SandboxCounters {
    static COUNTERS: OnceLock<SandboxCounters> = OnceLock::new();
    COUNTERS.get_or_init(SandboxCounters::default)
}
