//! The zygote's child builds its own container: [`enter`] runs between the fork and the first line
//! of sandbox code, as root with every capability, in a process that is single-threaded (the
//! zygote checks before each fork).
//!
//! The order is fixed and each step depends on the one before:
//! 1. join the sandbox's cgroups (the node made them and set the limits), so everything after is
//!    charged there;
//! 2. new mount, network, IPC, UTS and cgroup namespaces (the pid namespace is the zygote's doing:
//!    a process cannot enter a new one itself, only its children can);
//! 3. the image's root bound read-only at [`STAGING_DIR`], tmpfs `/tmp`, home and packages
//!    directories, a `/proc` of the new pid namespace with Docker's masked and read-only paths, a
//!    minimal `/dev`; `pivot_root` into it, the old root detached;
//! 4. the host name, `lo` up (the agent's proxies listen on loopback), rlimits;
//! 5. every descriptor but 0, 1, 2 and the kept ones closed;
//! 6. capabilities: the bounding set cut to the agent's three, ambient and inheritable cleared,
//!    permitted and effective the three;
//! 7. `no_new_privs`, then the seccomp allowlist (which forbids every call used above).

use std::ffi::CString;
use std::io;

use crate::seccomp::SandboxFilter;
use crate::spec::{
    AGENT_CAPABILITIES, CgroupMount, DEVICES, EnterSpec, MASKED_PATHS, READONLY_PATHS, STAGING_DIR,
};
use crate::sys;

/// A step of [`enter`] that failed, with the system's error.
#[derive(Debug, thiserror::Error)]
#[error("building the sandbox's container failed at {step}: {source}")]
pub struct EnterError {
    /// What was being done.
    pub step: String,
    /// The system call's error.
    #[source]
    pub source: io::Error,
}

trait Step<T> {
    fn at(self, step: impl Into<String>) -> Result<T, EnterError>;
}

impl<T> Step<T> for io::Result<T> {
    fn at(self, step: impl Into<String>) -> Result<T, EnterError> {
        self.map_err(|source| EnterError {
            step: step.into(),
            source,
        })
    }
}

/// Builds the sandbox's container around the calling process (see the module's steps) and leaves
/// it as the sandbox's agent: root with [`AGENT_CAPABILITIES`], `no_new_privs`, `filter` installed.
/// On an error the caller must exit at once: the process is half-built and must never run sandbox
/// code.
pub fn enter(spec: &EnterSpec, filter: &SandboxFilter) -> Result<(), EnterError> {
    for procs in &spec.cgroup_procs {
        std::fs::write(procs, b"0").at(format!("joining the cgroup {procs}"))?;
    }
    sys::unshare(
        libc::CLONE_NEWNS
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWCGROUP,
    )
    .at("unsharing the namespaces")?;
    build_root(spec)?;
    sys::sethostname(&spec.hostname).at("setting the host name")?;
    sys::loopback_up().at("bringing lo up")?;
    sys::setrlimit(libc::RLIMIT_NOFILE, spec.nofile).at("limiting open files")?;
    sys::setrlimit(libc::RLIMIT_CORE, 0).at("forbidding core dumps")?;
    sys::close_other_fds(&spec.keep_fds).at("closing inherited descriptors")?;
    sys::keep_only_capabilities(&AGENT_CAPABILITIES).at("dropping capabilities")?;
    sys::no_new_privs().at("setting no_new_privs")?;
    filter.install().map_err(|err| EnterError {
        step: "installing the seccomp filter".into(),
        source: io::Error::other(err),
    })?;
    Ok(())
}

fn build_root(spec: &EnterSpec) -> Result<(), EnterError> {
    let root = STAGING_DIR;
    let at = |path: &str| format!("{root}{path}");
    // Nothing mounted from here on propagates back to the zygote or the host.
    sys::mount(None, "/", None, libc::MS_REC | libc::MS_PRIVATE, None)
        .at("making the mounts private")?;
    // The zygote's root without what is mounted under it (its /proc, /sys, /dev, /tmp).
    sys::mount(Some("/"), root, None, libc::MS_BIND, None).at("binding the image's root")?;
    remount_read_only(root, libc::MS_NOSUID | libc::MS_NODEV).at("making the root read-only")?;
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    tmpfs(
        &at("/tmp"),
        nosuid_nodev,
        &format!("size={}m,mode=1777", spec.tmp_size_mb),
    )?;
    tmpfs(
        &at(&spec.home),
        nosuid_nodev,
        &format!(
            "size={}m,mode=0700,uid={},gid={}",
            spec.home_size_mb, spec.uid, spec.gid
        ),
    )?;
    tmpfs(
        &at(&spec.packages),
        nosuid_nodev,
        &format!(
            "size={}m,mode=0755,uid={},gid={}",
            spec.packages_size_mb, spec.uid, spec.gid
        ),
    )?;
    sys::mount(
        Some("proc"),
        &at("/proc"),
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )
    .at("mounting /proc")?;
    build_dev(&at("/dev"))?;
    build_sys(&at("/sys"), &spec.cgroup_mounts)?;
    // The sandbox's own /dev/null (made above), never the host's: a bind shares the inode, and
    // root in the sandbox could chmod a bind of the host's.
    let null = at("/dev/null");
    for path in MASKED_PATHS {
        mask(&at(path), &null)?;
    }
    for path in READONLY_PATHS {
        read_only(&at(path))?;
    }
    sys::pivot_into(&c_path(root).at("the root's path")?).at("pivoting into the root")?;
    Ok(())
}

/// Makes the mount at `path` read-only, with `flags` (`MS_NOSUID`, `MS_NODEV`, `MS_NOEXEC`) too.
fn remount_read_only(path: &str, flags: libc::c_ulong) -> std::io::Result<()> {
    sys::mount(
        None,
        path,
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | flags,
        None,
    )
}

fn tmpfs(target: &str, flags: libc::c_ulong, data: &str) -> Result<(), EnterError> {
    sys::mount(Some("tmpfs"), target, Some("tmpfs"), flags, Some(data))
        .at(format!("mounting a tmpfs on {target}"))
}

/// A tmpfs `/dev` with Docker's device nodes, `/dev/shm`, `/dev/pts` and the usual links, then
/// read-only (the nodes stay usable; nothing new can be made there).
fn build_dev(dev: &str) -> Result<(), EnterError> {
    tmpfs(dev, libc::MS_NOSUID | libc::MS_NOEXEC, "size=64k,mode=0755")?;
    for (name, major, minor) in DEVICES {
        let path = format!("{dev}/{name}");
        sys::mknod_char(&path, major, minor, 0o666).at(format!("making {path}"))?;
    }
    for dir in ["shm", "pts"] {
        let path = format!("{dev}/{dir}");
        std::fs::create_dir(&path).at(format!("making {path}"))?;
    }
    tmpfs(
        &format!("{dev}/shm"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "size=64m,mode=1777",
    )?;
    sys::mount(
        Some("devpts"),
        &format!("{dev}/pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .at("mounting /dev/pts")?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        std::os::unix::fs::symlink(target, format!("{dev}/{name}"))
            .at(format!("linking /dev/{name}"))?;
    }
    remount_read_only(dev, libc::MS_NOSUID | libc::MS_NOEXEC).at("making /dev read-only")
}

/// A read-only `/sys` holding only the sandbox's cgroups (Docker shows the whole sysfs read-only;
/// nothing in a sandbox needs more than its cgroup's counters).
fn build_sys(sys_dir: &str, mounts: &[CgroupMount]) -> Result<(), EnterError> {
    tmpfs(
        sys_dir,
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "size=16k,mode=0755",
    )?;
    let cgroup = format!("{sys_dir}/fs/cgroup");
    std::fs::create_dir_all(&cgroup).at("making /sys/fs/cgroup")?;
    let flags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    for mount in mounts {
        match mount {
            CgroupMount::V2 => sys::mount(Some("cgroup2"), &cgroup, Some("cgroup2"), flags, None)
                .at("mounting the cgroup2 hierarchy")?,
            CgroupMount::V1(controller) => {
                let target = format!("{cgroup}/{controller}");
                std::fs::create_dir(&target).at(format!("making {target}"))?;
                sys::mount(
                    Some("cgroup"),
                    &target,
                    Some("cgroup"),
                    flags,
                    Some(controller),
                )
                .at(format!("mounting the cgroup {controller} hierarchy"))?;
            }
        }
    }
    remount_read_only(sys_dir, libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC)
        .at("making /sys read-only")
}

fn mask(path: &str, null: &str) -> Result<(), EnterError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(()); // not in this kernel's /proc: nothing to hide
    };
    if meta.is_dir() {
        sys::mount(
            Some("tmpfs"),
            path,
            Some("tmpfs"),
            libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            Some("size=0"),
        )
    } else {
        sys::mount(Some(null), path, None, libc::MS_BIND, None).and_then(|()| {
            remount_read_only(path, libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC)
        })
    }
    .at(format!("masking {path}"))
}

fn read_only(path: &str) -> Result<(), EnterError> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    sys::mount(Some(path), path, None, libc::MS_BIND | libc::MS_REC, None)
        .and_then(|()| remount_read_only(path, libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC))
        .at(format!("making {path} read-only"))
}

/// A path as a C string; an interior NUL is an invalid-input error.
pub(crate) fn c_path(path: &str) -> io::Result<CString> {
    CString::new(path).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))
}
