//! Sandbox configuration: profiles (what a container is made from and may use), pool sizing and
//! agent timing.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The largest memory limit (memory plus tmpfs sizes) a sandbox container may get, MiB.
pub const MAX_CONTAINER_MEMORY_MB: u64 = 1 << 20;

/// One sandbox profile: the image and the resource limits every container of it gets.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SandboxProfile {
    /// Profile name, recorded on each container's labels and rows.
    pub name: String,
    /// Image to run (any image with `python3`; the agent is injected at creation).
    pub image: String,
    /// Whether the node pulls `image` from its registry before starting sandboxes. The node's
    /// own setting, never part of a profile's identity: not serialized (a snapshot's profile
    /// and its fingerprint stay what they were), defaulted when absent.
    #[serde(default, skip_serializing)]
    pub pull: PullPolicy,
    /// The OCI runtime its containers run under.
    pub runtime: OciRuntime,
    /// Memory limit in MiB; swap is not allowed on top of it.
    pub memory_mb: u64,
    /// CPU quota in cores (e.g. 1.0).
    pub cpus: f64,
    /// Most processes (and threads) inside the container.
    pub pids_limit: i64,
    /// Open-file limit (soft and hard).
    pub nofile: u64,
    /// Size of the tmpfs mounted on /tmp, MiB.
    pub tmp_size_mb: u64,
    /// Size bound of the writable /home/user, MiB.
    pub home_size_mb: u64,
    /// Size of the tmpfs on /opt/packages, where `pip install` puts the user's packages (outside
    /// the home: they neither use its quota nor show among the user's files), MiB.
    pub packages_size_mb: u64,
}

/// The `[sandbox]` defaults of `config/default.toml` (sandgate-service's configuration tests
/// keep the two equal): the profile named `default`, the `sandgate-sandbox:latest` image, runc.
impl Default for SandboxProfile {
    fn default() -> Self {
        SandboxProfile {
            name: "default".into(),
            image: "sandgate-sandbox:latest".into(),
            pull: PullPolicy::Never,
            runtime: OciRuntime::Runc,
            memory_mb: 512,
            cpus: 1.0,
            pids_limit: 256,
            nofile: 1024,
            tmp_size_mb: 64,
            home_size_mb: 512,
            packages_size_mb: 256,
        }
    }
}

impl SandboxProfile {
    /// The memory limit the container gets: the profile's memory plus the sizes of the tmpfs
    /// mounts on /tmp, /home/user and /opt/packages, whose pages the memory cgroup counts.
    /// Filling them is then ENOSPC for user code, never an out-of-memory kill of the sandbox.
    pub fn container_memory_mb(&self) -> u64 {
        self.memory_mb
            .saturating_add(self.tmp_size_mb)
            .saturating_add(self.home_size_mb)
            .saturating_add(self.packages_size_mb)
    }

    /// Checks the values against what Docker and the kernel accept.
    pub fn validate(&self) -> Result<(), ProfileError> {
        if self.image.trim().is_empty() {
            return Err(ProfileError::NoImage);
        }
        match self.pull {
            PullPolicy::Never => {}
            // A moving tag would let two nodes that pulled at different times run different
            // images under one name, and a template's fingerprint would follow whichever.
            PullPolicy::IfMissing if !image_has_digest(&self.image) => {
                return Err(ProfileError::PullNeedsDigest(self.image.clone()));
            }
            PullPolicy::IfMissing | PullPolicy::Always => {
                if !image_has_tag_or_digest(&self.image) {
                    return Err(ProfileError::PullNeedsTag(self.image.clone()));
                }
            }
        }
        if self.memory_mb < 64 {
            return Err(ProfileError::MemoryTooSmall(self.memory_mb));
        }
        if !(self.cpus > 0.0 && self.cpus <= 64.0) {
            return Err(ProfileError::Cpus(self.cpus));
        }
        if self.pids_limit < 16 {
            return Err(ProfileError::PidsTooSmall(self.pids_limit));
        }
        if self.nofile < 64 {
            return Err(ProfileError::NofileTooSmall(self.nofile));
        }
        if self.tmp_size_mb == 0 {
            return Err(ProfileError::NoSize("tmp_size_mb"));
        }
        if self.home_size_mb == 0 {
            return Err(ProfileError::NoSize("home_size_mb"));
        }
        if self.packages_size_mb == 0 {
            return Err(ProfileError::NoSize("packages_size_mb"));
        }
        // The container's limit covers memory and both tmpfs mounts; past this, Docker's i64 of
        // bytes (or any real host) cannot hold the promise that a full disk is only ENOSPC.
        if self.container_memory_mb() > MAX_CONTAINER_MEMORY_MB {
            return Err(ProfileError::ContainerMemoryTooLarge(
                self.container_memory_mb(),
            ));
        }
        Ok(())
    }
}

/// A profile value Docker or the kernel would not accept. [`ProfileError::field`] names the
/// field; the message says what is accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// `image` is empty.
    #[error("must name a Docker image")]
    NoImage,
    /// `pull = "if_missing"` with an image not pinned by digest.
    #[error(
        "{0} is not pinned by digest, which pull = \"if_missing\" needs (nodes that pull at \
         different times would run different images under one tag): name it as \
         REGISTRY/REPOSITORY@sha256:DIGEST (README, \"Images in a registry\"), or set pull = \
         \"always\" to follow a tag"
    )]
    PullNeedsDigest(String),
    /// `pull = "always"` with an image that names neither a tag nor a digest (the engine would
    /// pull every tag of the repository).
    #[error(
        "{0} names neither a tag nor a digest; pulling it would fetch every tag of the repository: add :TAG or @sha256:DIGEST"
    )]
    PullNeedsTag(String),
    /// `memory_mb` is below 64.
    #[error("{0} is too small; at least 64 MiB")]
    MemoryTooSmall(u64),
    /// `cpus` is not in (0, 64].
    #[error("{0} must be more than 0 and at most 64")]
    Cpus(f64),
    /// `pids_limit` is below 16.
    #[error("{0} is too small; at least 16")]
    PidsTooSmall(i64),
    /// `nofile` is below 64.
    #[error("{0} is too small; at least 64")]
    NofileTooSmall(u64),
    /// A tmpfs size (the field named) is 0.
    #[error("must be more than 0")]
    NoSize(&'static str),
    /// Memory and the tmpfs sizes add up to more than [`MAX_CONTAINER_MEMORY_MB`].
    #[error(
        "memory_mb + tmp_size_mb + home_size_mb + packages_size_mb is {0} MiB, more than the {MAX_CONTAINER_MEMORY_MB} MiB a sandbox's memory limit may be (files on the tmpfs mounts count as memory)"
    )]
    ContainerMemoryTooLarge(u64),
}

impl ProfileError {
    /// The profile field whose value is refused.
    pub fn field(&self) -> &'static str {
        match self {
            ProfileError::NoImage
            | ProfileError::PullNeedsDigest(_)
            | ProfileError::PullNeedsTag(_) => "image",
            ProfileError::MemoryTooSmall(_) => "memory_mb",
            ProfileError::Cpus(_) => "cpus",
            ProfileError::PidsTooSmall(_) => "pids_limit",
            ProfileError::NofileTooSmall(_) => "nofile",
            ProfileError::NoSize(field) => field,
            // The last of the three to be set is the likeliest culprit.
            ProfileError::ContainerMemoryTooLarge(_) => "home_size_mb",
        }
    }
}

/// When a node pulls its profile's image from a registry (`pull`: `"never"`, `"if_missing"` or
/// `"always"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PullPolicy {
    /// Never: the image is built or loaded on the engine beforehand (readiness says when it is
    /// missing).
    #[default]
    Never,
    /// At start, when the engine lacks the image (which must be pinned by digest).
    IfMissing,
    /// At every start (the image may name a tag that moves); when the registry cannot be reached
    /// an image already on the engine is used, saying so.
    Always,
}

/// Whether an image reference is pinned by digest (`…@sha256:<64 hex>`).
pub fn image_has_digest(image: &str) -> bool {
    image.rsplit_once('@').is_some_and(|(name, digest)| {
        !name.is_empty()
            && digest
                .strip_prefix("sha256:")
                .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
    })
}

/// Whether an image reference names a tag (after its last `/`) or a digest.
fn image_has_tag_or_digest(image: &str) -> bool {
    image_has_digest(image)
        || image
            .rsplit('/')
            .next()
            .is_some_and(|last| last.contains(':'))
}

/// The runtime a profile's sandboxes run under (`runtime`: `"lean"`, the lean engine, or Docker's
/// `"runc"`, `"runsc"` or `"runsc2024"`). Any
/// other name is refused when the configuration is read, naming the accepted ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OciRuntime {
    /// runc, Docker's default: namespaces, cgroups and seccomp on the host's kernel.
    #[default]
    Runc,
    /// runsc (gVisor): a user-space kernel between the sandbox and the host's; stronger
    /// isolation, slower start. Must be registered with the Docker engine.
    Runsc,
    /// runsc of 2024 (bookworm-backports, systrap), registered as `runsc2024`: gVisor that can
    /// checkpoint and restore sandboxes (docs/snapshots.md).
    Runsc2024,
    /// Not Docker's: the lean engine (`crate::lean`), sandboxes forked from a warmed zygote into
    /// lean containers the node builds itself.
    Lean,
}

impl OciRuntime {
    /// The name the Docker engine knows the runtime by (`lean` for the lean engine).
    pub fn as_str(self) -> &'static str {
        match self {
            OciRuntime::Runc => "runc",
            OciRuntime::Runsc => "runsc",
            OciRuntime::Runsc2024 => "runsc2024",
            OciRuntime::Lean => "lean",
        }
    }

    /// Whether the lean engine runs it (not Docker).
    pub fn is_lean(self) -> bool {
        matches!(self, OciRuntime::Lean)
    }

    /// Whether it is gVisor (either release).
    pub fn is_gvisor(self) -> bool {
        matches!(self, OciRuntime::Runsc | OciRuntime::Runsc2024)
    }
}

impl std::fmt::Display for OciRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A runtime name that is not one of [`OciRuntime`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown runtime {0:?}: expected \"lean\", \"runc\", \"runsc\" or \"runsc2024\"")]
pub struct UnknownRuntime(pub String);

impl std::str::FromStr for OciRuntime {
    type Err = UnknownRuntime;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "runc" => Ok(OciRuntime::Runc),
            "runsc" => Ok(OciRuntime::Runsc),
            "runsc2024" => Ok(OciRuntime::Runsc2024),
            "lean" => Ok(OciRuntime::Lean),
            other => Err(UnknownRuntime(other.to_owned())),
        }
    }
}

/// How the warm pool behaves (the `[pool]` table of the configuration). The ready target follows
/// demand between `min_ready` and `max_ready` (see [`crate::demand`]).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Started-and-ready containers kept waiting per profile however low the demand (the floor).
    pub min_ready: usize,
    /// Most ready containers kept waiting per profile however high the demand (the ceiling; below
    /// `min_ready` it is `min_ready`).
    pub max_ready: usize,
    /// Most containers started at once per profile; 0 adapts it to the machine (up to twice its
    /// CPUs, fewer while starts slow down).
    pub max_concurrent_starts: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            min_ready: 2,
            max_ready: 16,
            max_concurrent_starts: 0,
        }
    }
}

/// Timing of the conversation with a sandbox's agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelConfig {
    /// How long a cell may go on after the `interrupt` sent at its deadline before the kernel is
    /// restarted (and its state lost). Also how long a command may outlive its own timeout.
    pub interrupt_grace: Duration,
    /// How long the agent may take to say ready: at a container's start (it says so before it
    /// loads the data stack) and after a kernel restart.
    pub ready_timeout: Duration,
    /// How long a short call (`ping`, `list_dir`, the answer to a file transfer) may take, and how
    /// long a file read may stall between chunks.
    pub call_timeout: Duration,
}

impl Default for ChannelConfig {
    fn default() -> Self {
        Self {
            interrupt_grace: Duration::from_secs(3),
            ready_timeout: Duration::from_secs(60),
            call_timeout: Duration::from_secs(30),
        }
    }
}

/// Warm pools filled from templates (issue 26, docs/snapshots.md): for each profile whose runtime
/// can take snapshots here, a fresh sandbox with its data stack imported is checkpointed once and
/// its pool filled by restoring it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateConfig {
    /// Whether pools fill from templates where snapshots are available (off: every start is an
    /// ordinary one, as without snapshots).
    pub enabled: bool,
    /// A template older than this is rebuilt (a fresh sandbox checkpointed again).
    pub max_age: Duration,
    /// How long after a failed build or a refused template the next build is tried; doubled
    /// after each failure in a row, up to [`TemplateConfig::max_retry`].
    pub retry: Duration,
    /// The longest wait between builds that keep failing.
    pub max_retry: Duration,
    /// How often the snapshot capability, the template's fingerprint (image, profile, agent)
    /// and its image's digest are checked.
    pub check_interval: Duration,
}

impl Default for TemplateConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_age: Duration::from_secs(6 * 3600),
            retry: Duration::from_secs(30),
            max_retry: Duration::from_secs(1800),
            check_interval: Duration::from_secs(60),
        }
    }
}

/// Everything the [`crate::SandboxManager`] needs besides its backend and profiles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Name of this gateway deployment, written on every container (`sandgate.instance`) so that
    /// reconciliation only ever touches its own containers.
    pub instance: String,
    /// Warm pool sizing.
    pub pool: PoolConfig,
    /// Agent timing.
    pub channel: ChannelConfig,
    /// How long the pool waits before trying again after a failed start.
    pub refill_backoff: Duration,
    /// The long window over which the lease rate is measured (the short one is a sixth of it):
    /// how long the pool stays grown after demand stops. See [`crate::demand`].
    pub demand_window: Duration,
    /// How long a cold start waits for its place among the starts run at once before it is
    /// refused ([`crate::SandboxError::StartQueue`]); the caller is told to retry.
    pub start_wait: Duration,
    /// Restores from snapshots run at once on this engine (a sealed snapshot's opening onto the
    /// tmpfs included); more wait (up to `start_wait`) for a place. Each restore is a burst of the engine's and the runtime's CPU and of memory while
    /// the image is read: unbounded, 50 at once on two cores ran past the agent's timeout, and
    /// more at once than the host has cores only makes each one slower. Default: the cores.
    pub max_concurrent_restores: usize,
    /// Pools filled from templates where snapshots are available.
    pub templates: TemplateConfig,
}

impl ManagerConfig {
    /// Defaults for everything but the instance name.
    pub fn new(instance: impl Into<String>) -> Self {
        Self {
            instance: instance.into(),
            pool: PoolConfig::default(),
            channel: ChannelConfig::default(),
            refill_backoff: Duration::from_secs(2),
            demand_window: crate::demand::LONG_WINDOW,
            start_wait: Duration::from_secs(120),
            max_concurrent_restores: std::thread::available_parallelism().map_or(2, |n| n.get()),
            templates: TemplateConfig::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_container_limit_covers_memory_and_every_tmpfs_mount() {
        assert_eq!(
            SandboxProfile::default().container_memory_mb(),
            512 + 64 + 512 + 256
        );
        assert_eq!(SandboxProfile::default().validate(), Ok(()));
    }

    #[test]
    fn a_home_too_large_to_account_for_is_refused_naming_the_key() {
        let huge = SandboxProfile {
            home_size_mb: MAX_CONTAINER_MEMORY_MB,
            ..SandboxProfile::default()
        };
        let err = huge.validate().unwrap_err();
        assert_eq!(err.field(), "home_size_mb");
        assert!(err.to_string().contains("count as memory"), "{err}");
    }

    #[test]
    fn pulling_if_missing_needs_a_digest_and_pulling_always_a_tag() {
        let digest = format!(
            "registry.internal:5000/sandgate-sandbox@sha256:{}",
            "ab".repeat(32)
        );
        let with = |image: &str, pull| SandboxProfile {
            image: image.into(),
            pull,
            ..SandboxProfile::default()
        };
        assert_eq!(with(&digest, PullPolicy::IfMissing).validate(), Ok(()));
        assert_eq!(with(&digest, PullPolicy::Always).validate(), Ok(()));
        let tagged = "registry.internal:5000/sandgate-sandbox:0.1.0";
        let err = with(tagged, PullPolicy::IfMissing).validate().unwrap_err();
        assert_eq!(err, ProfileError::PullNeedsDigest(tagged.into()));
        assert_eq!(err.field(), "image");
        assert_eq!(with(tagged, PullPolicy::Always).validate(), Ok(()));
        // A port is not a tag.
        let bare = "registry.internal:5000/sandgate-sandbox";
        assert_eq!(
            with(bare, PullPolicy::Always).validate(),
            Err(ProfileError::PullNeedsTag(bare.into()))
        );
        // Never pulls nothing, so anything goes.
        assert_eq!(with(bare, PullPolicy::Never).validate(), Ok(()));
        // A digest of the wrong length or alphabet is no pin.
        for not_a_pin in [
            "x@sha256:abc".to_owned(),
            format!("@sha256:{}", "a".repeat(64)),
            format!("x@sha256:{}", "g".repeat(64)),
        ] {
            assert!(!image_has_digest(&not_a_pin), "{not_a_pin}");
        }
    }

    #[test]
    fn the_pull_setting_is_no_part_of_a_profiles_identity() {
        let pulling = SandboxProfile {
            pull: PullPolicy::Always,
            ..SandboxProfile::default()
        };
        let json = serde_json::to_string(&pulling).expect("serializes");
        assert!(!json.contains("pull"), "{json}");
        let back: SandboxProfile = serde_json::from_str(&json).expect("reads back");
        assert_eq!(back.pull, PullPolicy::Never);
    }
}
