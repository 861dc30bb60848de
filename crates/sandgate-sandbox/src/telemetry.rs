//! Process-wide measurements for the gateway's `/metrics`: what sandboxes sent beyond their
//! budgets, how long leases waited, and what snapshots and templates cost and did. Every channel,
//! lease and snapshot adds to them; the gateway registers them in its registry.

use std::sync::OnceLock;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// What became of a pool start that tried its profile's template.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // the label values are the metric's spelling
pub enum TemplateRestore {
    /// The clone was restored and answered.
    restored,
    /// The restore failed (an ordinary start took its place).
    failed,
    /// The template's image had changed since it was taken: refused and discarded.
    refused,
}

/// The label of [`SandboxCounters::template_restores`].
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestoreOutcome {
    /// What became of it.
    pub outcome: TemplateRestore,
}

/// What became of an attempt to build a profile's template.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // the label values are the metric's spelling
pub enum TemplateBuild {
    /// Built and verified: in use.
    built,
    /// Failed or failed verification: discarded, tried again later.
    failed,
}

/// The label of [`SandboxCounters::template_builds`].
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildOutcome {
    /// What became of it.
    pub outcome: TemplateBuild,
}

/// The sandbox crate's counters. Clones share the same values.
#[derive(Debug, Clone)]
pub struct SandboxCounters {
    /// Lines of container stderr not logged because a sandbox was over its log budget.
    pub stderr_lines_dropped: Counter,
    /// Times a sandbox's output was paused because it sent frames or bytes faster than its budget.
    pub output_throttled: Counter,
    /// Seconds a new lease took until its sandbox was handed out (warm or cold start included).
    pub lease_wait: Histogram,
    /// Seconds a checkpoint of a sandbox took (successful ones).
    pub checkpoint_seconds: Histogram,
    /// Seconds a restore of a snapshot into a new sandbox took, until its agent answered
    /// (successful ones).
    pub restore_seconds: Histogram,
    /// Pool starts (refills and cold starts) that tried a template, by outcome.
    pub template_restores: Family<RestoreOutcome, Counter>,
    /// Pool starts that fell back to an ordinary start because the template's restore failed or
    /// was refused.
    pub template_fallbacks: Counter,
    /// Template builds, by outcome.
    pub template_builds: Family<BuildOutcome, Counter>,
}

impl Default for SandboxCounters {
    fn default() -> Self {
        Self {
            stderr_lines_dropped: Counter::default(),
            output_throttled: Counter::default(),
            // 1 ms to ~65 s.
            lease_wait: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            // 10 ms to ~160 s.
            checkpoint_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 15)),
            restore_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 15)),
            template_restores: Family::default(),
            template_fallbacks: Counter::default(),
            template_builds: Family::default(),
        }
    }
}

impl SandboxCounters {
    /// Counts a pool start's try of a template.
    pub fn template_restore(&self, outcome: TemplateRestore) {
        self.template_restores
            .get_or_create(&RestoreOutcome { outcome })
            .inc();
    }

    /// Counts a template build.
    pub fn template_build(&self, outcome: TemplateBuild) {
        self.template_builds
            .get_or_create(&BuildOutcome { outcome })
            .inc();
    }
}

/// The counters of this process.
pub fn counters() -> &'static SandboxCounters {
    static COUNTERS: OnceLock<SandboxCounters> = OnceLock::new();
    COUNTERS.get_or_init(SandboxCounters::default)
}
