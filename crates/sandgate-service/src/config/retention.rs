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
    /// How long a paused sandbox is kept before it is closed and its snapshot deleted, seconds.
    #[validate(range(min = 1, max = I32_MAX, message = "must be between 1 and 2147483647"))]
    pub paused_seconds: u64,
    /// How often the purge job runs, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub purge_interval_seconds: u64,
    /// Most entries one sandbox's transcript keeps.
    #[validate(range(min = 1, max = ENTRIES_MAX, message = "must be between 1 and 2147483647"))]
    pub transcript_max_entries: u32,
    /// Most bytes one sandbox's transcript keeps.
    #[validate(range(min = 1024, max = I64_MAX, message = "must be at least 1024"))]
    pub transcript_max_bytes: u64,
    /// Most bytes all of one tenant's stored transcripts keep together (an override per tenant
    /// is not offered yet); entries beyond are counted, not kept.
    #[validate(range(min = 1024, max = I64_MAX, message = "must be at least 1024"))]
    pub transcript_tenant_max_bytes: u64,
    /// Most sandboxes one transcript load (export, resource, link, page) reads, newest first.
    #[validate(range(min = 1, max = 10_000, message = "must be between 1 and 10000"))]
    pub transcript_load_max_parts: u32,
    /// Most stored bytes one transcript load reads (its newest sandbox is read whatever its
    /// size, up to `transcript_max_bytes`), newest first.
    #[validate(range(min = 1024, max = I64_MAX, message = "must be at least 1024"))]
    pub transcript_load_max_bytes: u64,
    /// Most transcript loads this process runs at once; more wait a little, then are refused
    /// with a retryable `capacity` error.
    #[validate(range(min = 1, max = 1024, message = "must be between 1 and 1024"))]
    pub transcript_loads_at_once: u32,
}
