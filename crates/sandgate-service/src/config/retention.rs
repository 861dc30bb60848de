//! `[retention]`: what is kept after a sandbox ends, for how long, and how much (docs/data.md;
//! the purge job is `crate::retention`'s).

use serde::Deserialize;

use super::ConfigError;

/// The `[retention]` settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// How long an ended sandbox's transcript is kept, seconds.
    pub transcripts_seconds: u64,
    /// How long an ended sandbox's files are kept, seconds (only 0: they go with the container).
    pub files_seconds: u64,
    /// How long the audit trail (tool calls, download-link openings) is kept, seconds.
    pub audit_seconds: u64,
    /// How often the purge job runs, seconds.
    pub purge_interval_seconds: u64,
    /// Most entries one sandbox's transcript keeps.
    pub transcript_max_entries: u32,
    /// Most bytes one sandbox's transcript keeps.
    pub transcript_max_bytes: u64,
}

impl RetentionConfig {
    /// Checks the settings; errors name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: &str| {
            Err(ConfigError::Invalid {
                key: format!("retention.{key}"),
                message: message.to_owned(),
            })
        };
        if self.files_seconds != 0 {
            return invalid(
                "files_seconds",
                "only 0 is supported: a sandbox's files live in its container, which is removed when the sandbox ends",
            );
        }
        if self.transcripts_seconds > i32::MAX as u64 {
            return invalid(
                "transcripts_seconds",
                "must be at most 2147483647 (68 years)",
            );
        }
        if !(AUDIT_MIN_SECONDS..=i32::MAX as u64).contains(&self.audit_seconds) {
            return invalid(
                "audit_seconds",
                "must be between 86400 (a day) and 2147483647 (68 years)",
            );
        }
        if self.purge_interval_seconds == 0 {
            return invalid("purge_interval_seconds", "must be at least 1");
        }
        if self.transcript_max_entries == 0 || self.transcript_max_entries > i32::MAX as u32 {
            return invalid("transcript_max_entries", "must be between 1 and 2147483647");
        }
        if self.transcript_max_bytes < 1024 || self.transcript_max_bytes > i64::MAX as u64 {
            return invalid("transcript_max_bytes", "must be at least 1024");
        }
        Ok(())
    }
}

/// The shortest audit retention accepted: an audit trail is for looking back.
const AUDIT_MIN_SECONDS: u64 = 86_400;
