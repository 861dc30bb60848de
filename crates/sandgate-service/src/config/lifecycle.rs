//! `[pool]` (the warm pool) and `[lifecycle]` (reaper and reconciliation timing).

use serde::Deserialize;
use validator::Validate;

use super::ConfigError;

/// Warm pool settings.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Ready containers kept waiting however low the demand (the floor).
    pub min_ready: usize,
    /// Ready containers kept waiting at most however high the demand (the ceiling).
    pub max_ready: usize,
    /// Most containers started at once; 0 adapts it to the machine.
    pub max_concurrent_starts: usize,
    /// The window the lease rate is measured over: how long the pool stays grown after demand
    /// stops, seconds.
    #[validate(range(
        min = 6,
        message = "is too short; at least 6 (the short window is a sixth of it)"
    ))]
    pub demand_window_seconds: u64,
    /// How long a cold start waits for its place among the starts run at once before
    /// `create_sandbox` is refused with a retryable limit, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub start_wait_seconds: u64,
}

impl PoolConfig {
    /// The checks that compare fields: the ceiling is at least the floor.
    pub(super) fn check_together(&self) -> Result<(), ConfigError> {
        if self.max_ready < self.min_ready {
            return Err(ConfigError::Invalid {
                key: "pool.max_ready".into(),
                message: format!(
                    "{} is below pool.min_ready ({}); the ceiling must be at least the floor",
                    self.max_ready, self.min_ready
                ),
            });
        }
        Ok(())
    }
}

/// Reaper and reconciliation timing.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct LifecycleConfig {
    /// Reaper interval, milliseconds.
    #[validate(range(min = 100, message = "must be at least 100"))]
    pub reaper_interval_ms: u64,
    /// Reconciliation interval, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub reconcile_interval_seconds: u64,
    /// Age below which an unknown container is left alone, seconds.
    pub orphan_grace_seconds: u64,
}
