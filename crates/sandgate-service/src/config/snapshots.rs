//! `[snapshots]`: memory snapshots of sandboxes on this process's node (docs/snapshots.md) and
//! the warm pool restored from a template.

use std::path::PathBuf;
use std::time::Duration;

use sandgate_sandbox::TemplateConfig;
use serde::Deserialize;
use validator::Validate;

/// The most a tenant's snapshot bytes may be (Postgres `bigint`).
const TENANT_BYTES_MAX: u64 = i64::MAX as u64;

/// The `[snapshots]` settings.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsConfig {
    /// The Docker engine's plaintext tmpfs (scripts/stack.sh: `<cache>/docker/plain`); empty:
    /// no snapshots on this node (every start is an ordinary one, and `/readyz` says so).
    pub plain_dir: PathBuf,
    /// Whether the pool is filled by restoring a template where the profile's runtime can take
    /// snapshots (false: ordinary starts only).
    pub templates: bool,
    /// A template older than this is rebuilt, seconds.
    #[validate(range(min = 60, message = "must be at least 60"))]
    pub template_max_age_seconds: u64,
    /// How long after a failed template build the next is tried, seconds (doubled per failure
    /// in a row, up to 30 minutes).
    #[validate(range(min = 1, max = 1800, message = "must be between 1 and 1800"))]
    pub template_retry_seconds: u64,
    /// The snapshot store's local directory, where paused sandboxes' sealed snapshots rest
    /// (every process that resumes must reach the same one); empty: no pauses, an idle sandbox
    /// is closed.
    pub store_dir: PathBuf,
    /// Whether a leased sandbox idle past its timeout is paused (false: closed, as without a
    /// store).
    pub pause_on_idle: bool,
    /// On a `sandgate node`: the deployment's gateways pause idle sandboxes (they hold the key
    /// custody and the snapshot store; a node holds neither), so this node leaves its idle
    /// leased sandboxes to them and closes one itself only when none paused it within
    /// `transition_deadline_seconds` past its idle deadline (no gateway pausing, or all down).
    /// Ignored by `serve`, which pauses itself.
    pub paused_by_gateways: bool,
    /// A pause or resume still unfinished after this long was cut short by a crash and is
    /// undone (pausing: running again; resuming: paused again), seconds.
    #[validate(range(min = 10, max = 86_400, message = "must be between 10 and 86400"))]
    pub transition_deadline_seconds: u64,
    /// Most sandboxes one tenant may have paused at once; beyond it an idle sandbox is closed.
    #[validate(range(max = 1_000_000, message = "must be at most 1000000"))]
    pub max_paused: u32,
    /// Most bytes of sealed snapshots one tenant may keep; beyond it an idle sandbox is closed.
    #[validate(range(max = TENANT_BYTES_MAX, message = "must fit in a bigint"))]
    pub tenant_max_bytes: u64,
}

impl SnapshotsConfig {
    /// The snapshot store's directory, when pauses are on.
    pub fn store_dir(&self) -> Option<&std::path::Path> {
        (!self.store_dir.as_os_str().is_empty()).then_some(self.store_dir.as_path())
    }

    /// The plaintext tmpfs, when one is configured.
    pub fn plain_dir(&self) -> Option<&std::path::Path> {
        (!self.plain_dir.as_os_str().is_empty()).then_some(self.plain_dir.as_path())
    }

    /// What the sandbox manager's templates follow.
    pub fn templates(&self) -> TemplateConfig {
        TemplateConfig {
            enabled: self.templates,
            max_age: Duration::from_secs(self.template_max_age_seconds),
            retry: Duration::from_secs(self.template_retry_seconds),
            ..TemplateConfig::default()
        }
    }
}
