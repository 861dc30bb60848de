//! What the node tells a zygote's child about the container it is to build: the one value that
//! crosses from the node (Rust) through the zygote (Python) into [`crate::child::enter`] (Rust).

use serde::{Deserialize, Serialize};

/// The version of this crate's C interface and of [`EnterSpec`]; the zygote reports the version of
/// the library it loaded, and a node refuses a zygote whose library is not its own.
pub const ABI_VERSION: u32 = 1;

/// A hash of this crate's sources (build.rs): the zygote reports the one of the library it loaded,
/// and a node refuses a library built from other sources than its own.
pub const SOURCE_HASH: &str = env!("SANDGATE_LEAN_SOURCE_HASH");

/// Where the zygote's child binds the image's root before it pivots into it: a directory the node
/// makes in every root filesystem it unpacks (empty, never seen from inside a sandbox).
pub const STAGING_DIR: &str = "/.sandgate-lean";

/// The capabilities a sandbox's agent keeps (Docker's profile grants the same three): SETUID and
/// SETGID to start the kernel and commands as uid 1000 (which clears all of theirs), KILL to end
/// what user code leaves behind. Numbers from `linux/capability.h`.
pub const AGENT_CAPABILITIES: [u32; 3] = [CAP_SETGID, CAP_SETUID, CAP_KILL];

/// `CAP_KILL` (linux/capability.h).
pub const CAP_KILL: u32 = 5;
/// `CAP_SETGID`.
pub const CAP_SETGID: u32 = 6;
/// `CAP_SETUID`.
pub const CAP_SETUID: u32 = 7;

/// The sandbox's container, as the child builds it for itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnterSpec {
    /// The `cgroup.procs` files (as the zygote sees them) the child writes itself into first, one
    /// per controller hierarchy (cgroup v1) or one (v2): the node made them and set the limits.
    pub cgroup_procs: Vec<String>,
    /// The cgroup hierarchies mounted read-only under `/sys/fs/cgroup` inside the sandbox (its own
    /// cgroup as their root), so the agent can say why a kernel died (out of memory, the process
    /// limit): [`CgroupMount::V2`], or one [`CgroupMount::V1`] per controller.
    pub cgroup_mounts: Vec<CgroupMount>,
    /// The host name inside the sandbox.
    pub hostname: String,
    /// Size of the tmpfs on /tmp, MiB.
    pub tmp_size_mb: u64,
    /// Size of the tmpfs on the home directory, MiB.
    pub home_size_mb: u64,
    /// Size of the tmpfs on the packages directory, MiB.
    pub packages_size_mb: u64,
    /// The sandbox user's home directory (a tmpfs owned by `uid`).
    pub home: String,
    /// Where the user's packages go (a tmpfs owned by `uid`).
    pub packages: String,
    /// The sandbox user.
    pub uid: u32,
    /// The sandbox user's group.
    pub gid: u32,
    /// The open-file limit (soft and hard).
    pub nofile: u64,
    /// Descriptors the child keeps open (besides 0, 1 and 2); every other one is closed before the
    /// first line of sandbox code runs.
    pub keep_fds: Vec<i32>,
}

/// `/proc` paths hidden from a sandbox (a file gets `/dev/null` over it, a directory an empty
/// read-only tmpfs): Docker's default masked paths.
pub const MASKED_PATHS: [&str; 10] = [
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/sysrq-trigger",
];

/// `/proc` paths a sandbox may read but never write: Docker's default read-only paths.
pub const READONLY_PATHS: [&str; 4] = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"];

/// The device nodes of a sandbox's `/dev` (name, major, minor): Docker's default set, less the
/// console.
pub const DEVICES: [(&str, u32, u32); 6] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

/// One cgroup hierarchy a sandbox sees (read-only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupMount {
    /// The unified hierarchy, at `/sys/fs/cgroup`.
    V2,
    /// A v1 controller's hierarchy, at `/sys/fs/cgroup/<controller>`.
    V1(String),
}
