//! Sandbox configuration: profiles (what a container is made from and may use), pool sizing and
//! agent timing.

use std::time::Duration;

use serde::Deserialize;

/// The largest memory limit (memory plus tmpfs sizes) a sandbox container may get, MiB.
pub const MAX_CONTAINER_MEMORY_MB: u64 = 1 << 20;

/// One sandbox profile: the image and the resource limits every container of it gets.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SandboxProfile {
    /// Profile name, recorded on each container's labels and rows.
    pub name: String,
    /// Image to run (any image with `python3`; the agent is injected at creation).
    pub image: String,
    /// OCI runtime: `runc` (default) or `runsc` (gVisor).
    pub runtime: String,
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
}

impl SandboxProfile {
    /// The memory limit the container gets: the profile's memory plus the sizes of the tmpfs
    /// mounts on /tmp and /home/user, whose pages the memory cgroup counts. Filling them is then
    /// ENOSPC for user code, never an out-of-memory kill of the sandbox.
    pub fn container_memory_mb(&self) -> u64 {
        self.memory_mb
            .saturating_add(self.tmp_size_mb)
            .saturating_add(self.home_size_mb)
    }

    /// Checks the values against what Docker and the kernel accept; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.image.trim().is_empty() {
            return Err("image: must name a Docker image".into());
        }
        if !matches!(self.runtime.as_str(), "runc" | "runsc") {
            return Err(format!(
                "runtime: must be \"runc\" or \"runsc\", not {:?}",
                self.runtime
            ));
        }
        if self.memory_mb < 64 {
            return Err(format!(
                "memory_mb: {} is too small; at least 64 MiB",
                self.memory_mb
            ));
        }
        if !(self.cpus > 0.0 && self.cpus <= 64.0) {
            return Err(format!(
                "cpus: {} must be more than 0 and at most 64",
                self.cpus
            ));
        }
        if self.pids_limit < 16 {
            return Err(format!(
                "pids_limit: {} is too small; at least 16",
                self.pids_limit
            ));
        }
        if self.nofile < 64 {
            return Err(format!("nofile: {} is too small; at least 64", self.nofile));
        }
        if self.tmp_size_mb == 0 || self.home_size_mb == 0 {
            return Err("tmp_size_mb and home_size_mb: must be more than 0".into());
        }
        // The container's limit covers memory and both tmpfs mounts; past this, Docker's i64 of
        // bytes (or any real host) cannot hold the promise that a full disk is only ENOSPC.
        if self.container_memory_mb() > MAX_CONTAINER_MEMORY_MB {
            return Err(format!(
                "home_size_mb: memory_mb + tmp_size_mb + home_size_mb is {} MiB, more than the {} MiB a sandbox's memory limit may be (files on the tmpfs mounts count as memory)",
                self.container_memory_mb(),
                MAX_CONTAINER_MEMORY_MB
            ));
        }
        Ok(())
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> SandboxProfile {
        SandboxProfile {
            name: "default".into(),
            image: "sandgate-sandbox:latest".into(),
            runtime: "runc".into(),
            memory_mb: 512,
            cpus: 1.0,
            pids_limit: 256,
            nofile: 1024,
            tmp_size_mb: 64,
            home_size_mb: 512,
        }
    }

    #[test]
    fn the_container_limit_covers_memory_and_both_tmpfs_mounts() {
        assert_eq!(profile().container_memory_mb(), 512 + 64 + 512);
        assert_eq!(profile().validate(), Ok(()));
    }

    #[test]
    fn a_home_too_large_to_account_for_is_refused_naming_the_key() {
        let huge = SandboxProfile {
            home_size_mb: MAX_CONTAINER_MEMORY_MB,
            ..profile()
        };
        let err = huge.validate().unwrap_err();
        assert!(err.starts_with("home_size_mb:"), "{err}");
    }
}
