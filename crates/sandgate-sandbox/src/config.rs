//! Sandbox profiles: what a sandbox container is made from and what it may use.

use serde::Deserialize;

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
        Ok(())
    }
}
