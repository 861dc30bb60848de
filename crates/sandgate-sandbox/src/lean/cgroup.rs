//! A lean sandbox's own cgroup: made and limited by the node before the child joins it, emptied
//! and removed when the sandbox goes. cgroup v2, v1, and v1 beside an empty unified hierarchy (the
//! "hybrid" mode, treated as v1).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sandgate_lean::spec::CgroupMount;

use crate::config::SandboxProfile;

const ROOT: &str = "/sys/fs/cgroup";
/// The folder under each hierarchy that holds the lean engine's sandboxes.
const PARENT: &str = "sandgate-lean";
/// The v1 controllers a sandbox is limited by (cpu and cpuacct are often one hierarchy).
const V1_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

/// Which cgroup hierarchies this host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The unified hierarchy only.
    V2,
    /// One hierarchy per controller (with or without an empty unified one beside them).
    V1,
}

impl Layout {
    /// What `/sys/fs/cgroup` holds here.
    pub fn detect() -> io::Result<Self> {
        if Path::new(ROOT).join("cgroup.controllers").exists() {
            return Ok(Self::V2);
        }
        for controller in V1_CONTROLLERS {
            if !Path::new(ROOT)
                .join(controller)
                .join("cgroup.procs")
                .exists()
            {
                return Err(io::Error::other(format!(
                    "neither cgroup v2 nor the v1 {controller} controller is mounted under {ROOT}"
                )));
            }
        }
        Ok(Self::V1)
    }

    /// What a sandbox sees of its cgroup (mounted read-only inside it).
    pub fn mounts(self) -> Vec<CgroupMount> {
        match self {
            Self::V2 => vec![CgroupMount::V2],
            Self::V1 => ["memory", "pids"]
                .into_iter()
                .map(|c| CgroupMount::V1(c.to_owned()))
                .collect(),
        }
    }
}

/// One sandbox's cgroup (a directory per hierarchy).
#[derive(Debug, Clone)]
pub struct SandboxCgroup {
    layout: Layout,
    dirs: Vec<PathBuf>,
}

impl SandboxCgroup {
    /// The cgroup of the sandbox `name` (not made yet).
    pub fn new(layout: Layout, name: &str) -> Self {
        let dirs = match layout {
            Layout::V2 => vec![Path::new(ROOT).join(PARENT).join(name)],
            Layout::V1 => V1_CONTROLLERS
                .iter()
                .map(|c| Path::new(ROOT).join(c).join(PARENT).join(name))
                .collect(),
        };
        Self { layout, dirs }
    }

    /// Makes it with the profile's limits: memory (the profile's plus its tmpfs sizes, no swap),
    /// CPU quota, process count.
    pub fn create(&self, profile: &SandboxProfile) -> io::Result<()> {
        let memory = profile.container_memory_mb() * 1024 * 1024;
        let period: u64 = 100_000;
        let quota = ((profile.cpus * period as f64) as u64).max(1000);
        match self.layout {
            Layout::V2 => {
                let parent = Path::new(ROOT).join(PARENT);
                std::fs::create_dir_all(&parent)?;
                // The controllers must be enabled for the parent's children.
                std::fs::write(parent.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
                let dir = &self.dirs[0];
                make_dir(dir)?;
                std::fs::write(dir.join("memory.max"), memory.to_string())?;
                write_if_present(&dir.join("memory.swap.max"), "0")?;
                std::fs::write(dir.join("pids.max"), profile.pids_limit.to_string())?;
                std::fs::write(dir.join("cpu.max"), format!("{quota} {period}"))?;
            }
            Layout::V1 => {
                for dir in &self.dirs {
                    make_dir(dir)?;
                }
                let [memory_dir, pids_dir, cpu_dir] = [&self.dirs[0], &self.dirs[1], &self.dirs[2]];
                std::fs::write(memory_dir.join("memory.limit_in_bytes"), memory.to_string())?;
                write_if_present(
                    &memory_dir.join("memory.memsw.limit_in_bytes"),
                    &memory.to_string(),
                )?;
                std::fs::write(pids_dir.join("pids.max"), profile.pids_limit.to_string())?;
                std::fs::write(cpu_dir.join("cpu.cfs_period_us"), period.to_string())?;
                std::fs::write(cpu_dir.join("cpu.cfs_quota_us"), quota.to_string())?;
            }
        }
        Ok(())
    }

    /// The `cgroup.procs` files the child writes itself into.
    pub fn procs_files(&self) -> Vec<String> {
        self.dirs
            .iter()
            .map(|d| d.join("cgroup.procs").to_string_lossy().into_owned())
            .collect()
    }

    /// The processes in it now (empty when it does not exist).
    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.dirs[0].join("cgroup.procs"))
            // 0 stands for a process outside the reader's pid namespace: never a pid to kill.
            .map(|text| {
                text.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .filter(|pid| *pid > 0)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether it exists.
    pub fn exists(&self) -> bool {
        self.dirs[0].exists()
    }

    /// How often the memory limit has killed a process in it.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match self.layout {
            Layout::V2 => ("memory.events", "oom_kill"),
            Layout::V1 => ("memory.oom_control", "oom_kill"),
        };
        std::fs::read_to_string(self.dirs[0].join(file))
            .ok()
            .and_then(|text| {
                text.lines().find_map(|line| {
                    let (name, value) = line.split_once(' ')?;
                    (name == key).then(|| value.trim().parse().ok()).flatten()
                })
            })
            .unwrap_or(0)
    }

    /// Its memory limit in bytes.
    pub fn memory_limit(&self) -> Option<u64> {
        let file = match self.layout {
            Layout::V2 => "memory.max",
            Layout::V1 => "memory.limit_in_bytes",
        };
        std::fs::read_to_string(self.dirs[0].join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Kills every process in it (until none is left, or `deadline` passes) and removes it.
    pub async fn destroy(&self, deadline: Duration) -> io::Result<()> {
        let started = std::time::Instant::now();
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                kill9(pid);
            }
            if started.elapsed() > deadline {
                return Err(io::Error::other(format!(
                    "processes of {} outlived SIGKILL",
                    self.dirs[0].display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for dir in &self.dirs {
            // A cgroup is removed once its last process has been reaped, a moment after it died.
            let mut tries = 0;
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if tries < 200 => {
                        let _ = e;
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}

fn make_dir(dir: &Path) -> io::Result<()> {
    match std::fs::create_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

fn write_if_present(path: &Path, value: &str) -> io::Result<()> {
    if path.exists() {
        std::fs::write(path, value)?;
    }
    Ok(())
}

fn kill9(pid: i32) {
    let _ = sandgate_lean::host::kill(pid, SIGKILL);
}

const SIGKILL: i32 = 9;
