//! `[retention]`: what is kept after a sandbox ends, for how long, and how much (docs/data.md;
//! the purge job is `crate::retention`'s).

use serde::Deserialize;
use validator::Validate;

/// The most a stored count or number of seconds may be (Postgres `integer`).
const I32_MAX: u64 = i32::MAX as u64;

/// The most a stored byte count may be (Postgres `bigint`).
const I64_MAX: u64 = i64::MAX as u64;

/// The most entries a transcript may be told to keep (Postgres `integer`).
const ENTRIES_MAX: u32 = i32::MAX as u32;

/// The shortest audit retention accepted: an audit trail is for looking back.
const AUDIT_MIN_SECONDS: u64 = 86_400;

/// The `[retention]` settings.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// How long an ended sandbox's transcript is kept, seconds.
    #[validate(range(max = I32_MAX, message = "must be at most 2147483647 (68 years)"))]
    pub transcripts_seconds: u64,
    /// How long an ended sandbox's files are kept, seconds (only 0: they go with the container).
    #[validate(range(
        max = 0,
        message = "only 0 is supported: a sandbox's files live in its container, which is \
                   removed when the sandbox ends"
    ))]
    pub files_seconds: u64,
    /// How long the audit trail (tool calls, download-link openings) is kept, seconds.
    #[validate(range(
        min = AUDIT_MIN_SECONDS,
        max = I32_MAX,
        message = "must be between 86400 (a day) and 2147483647 (68 years)"
    ))]
    pub audit_seconds: u64,
    /// How often the purge job runs, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub purge_interval_seconds: u64,
    /// Most entries one sandbox's transcript keeps.
    #[validate(range(min = 1, max = ENTRIES_MAX, message = "must be between 1 and 2147483647"))]
    pub transcript_max_entries: u32,
    /// Most bytes one sandbox's transcript keeps.
    #[validate(range(min = 1024, max = I64_MAX, message = "must be at least 1024"))]
    pub transcript_max_bytes: u64,
}
