//! `[snapshots]`: memory snapshots of sandboxes on this process's node (docs/snapshots.md) and
//! the warm pool restored from a template.

use std::path::PathBuf;
use std::time::Duration;

use sandgate_sandbox::TemplateConfig;
use serde::Deserialize;
use validator::Validate;

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
}

impl SnapshotsConfig {
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
