//! `[limits]`: default tenant limits and per-call bounds.

use serde::Deserialize;
use validator::Validate;

use super::ConfigError;

/// Processes one call in a sandbox may need at once (an agent thread, a shell, the command):
/// `limits.max_calls_per_sandbox` times this must fit in `sandbox.pids_limit`.
pub const PIDS_PER_CALL: i64 = 4;

/// Default tenant limits and per-call bounds.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Most live sandboxes per tenant.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_sandboxes: u32,
    /// Default idle timeout, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub idle_timeout_seconds: u32,
    /// Longest idle timeout a caller may ask for, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_idle_timeout_seconds: u32,
    /// Hard lifetime, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_lifetime_seconds: u32,
    /// Most tool calls per tenant per minute.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_calls_per_minute: u32,
    /// Longest per-call timeout, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_call_timeout_seconds: u32,
    /// Per-call timeout when none is given, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub default_call_timeout_seconds: u32,
    /// Output kept per cell or command, bytes.
    #[validate(range(min = 1024, message = "must be at least 1024"))]
    pub output_limit_bytes: usize,
    /// Largest file moved by get_file / upload_file, bytes.
    pub max_file_bytes: u64,
    /// Largest file get_file returns inline; bigger ones come as a resource link, bytes.
    pub inline_file_bytes: u64,
    /// Largest file `resources/read` returns inline; a bigger one is refused with its download
    /// link (so no read holds a whole large file in the gateway twice, raw and base64), bytes.
    pub inline_resource_bytes: u64,
    /// Most open MCP sessions (2025-11-25 era) per tenant.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_sessions: u32,
    /// Most tool calls per tenant running at once, across replicas.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_calls_in_flight: u32,
    /// Most tool calls running at once in one sandbox (below what its pids limit carries).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_calls_per_sandbox: u32,
    /// How long a call's in-flight slot outlives a replica that died mid-call, seconds (a live
    /// call renews its slot every third of this).
    #[validate(range(min = 3, message = "must be at least 3"))]
    pub call_slot_ttl_seconds: u32,
}

impl LimitsConfig {
    /// The checks that compare fields (and the sandbox's `pids_limit`).
    pub(super) fn check_together(&self, pids_limit: i64) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.to_owned(),
                message,
            })
        };
        if self.idle_timeout_seconds > self.max_idle_timeout_seconds {
            return invalid(
                "limits.idle_timeout_seconds",
                format!(
                    "{} exceeds limits.max_idle_timeout_seconds ({})",
                    self.idle_timeout_seconds, self.max_idle_timeout_seconds
                ),
            );
        }
        if self.default_call_timeout_seconds > self.max_call_timeout_seconds {
            return invalid(
                "limits.default_call_timeout_seconds",
                format!(
                    "{} exceeds limits.max_call_timeout_seconds ({})",
                    self.default_call_timeout_seconds, self.max_call_timeout_seconds
                ),
            );
        }
        // A call in a sandbox can take a thread of the agent, a shell and the command's own
        // process: leave the pids limit room for them all, plus the kernel and background jobs.
        let carried = pids_limit / PIDS_PER_CALL;
        if i64::from(self.max_calls_per_sandbox) > carried {
            return invalid(
                "limits.max_calls_per_sandbox",
                format!(
                    "{} is more than sandbox.pids_limit ({pids_limit}) can carry; at most \
                     {carried} ({PIDS_PER_CALL} processes per call)",
                    self.max_calls_per_sandbox
                ),
            );
        }
        Ok(())
    }
}
