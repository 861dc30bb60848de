//! The node's side: starting a zygote inside an image's root filesystem, and the messages node and
//! zygote exchange (`SOCK_SEQPACKET`, descriptors attached).
#![allow(unsafe_code)] // One `pre_exec` hook: system calls between fork and exec, nothing else.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::sys;
pub use crate::sys::{MAX_FDS, kill, recv_message, sealed_memfd, send_message, seqpacket_pair};

/// How to start one zygote.
#[derive(Debug)]
pub struct ZygoteLaunch {
    /// The image's unpacked root filesystem on the host; it becomes the zygote's root.
    pub rootfs: PathBuf,
    /// The program to run, as a path inside `rootfs` (the image's `python3`).
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its whole environment.
    pub env: Vec<(String, String)>,
    /// Descriptors the zygote inherits under their own numbers (the caller tells it which in
    /// `args` or `env`).
    pub inherit: Vec<OwnedFd>,
}

/// Starts a zygote: in mount, network, IPC and UTS namespaces of its own, whose root is `rootfs`
/// (bound onto itself, read-only), with the host's `/sys` and `/dev` and a `/proc` under it (the
/// zygote writes its children into their cgroups), a private `/tmp`, in a session of its own. Its
/// stdout and stderr are piped to the caller; stdin is empty.
pub fn spawn_zygote(launch: ZygoteLaunch) -> io::Result<Child> {
    let c = |p: PathBuf| CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other);
    let root = c(launch.rootfs.clone())?;
    let proc_dir = c(launch.rootfs.join("proc"))?;
    let sys_dir = c(launch.rootfs.join("sys"))?;
    let dev_dir = c(launch.rootfs.join("dev"))?;
    let tmp_dir = c(launch.rootfs.join("tmp"))?;
    let inherit: Vec<i32> = launch.inherit.iter().map(AsRawFd::as_raw_fd).collect();
    let mut command = Command::new(OsStr::new(&launch.program));
    command
        .args(&launch.args)
        .env_clear()
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let hook = move || -> io::Result<()> {
        sys::setsid()?;
        sys::unshare(
            libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS,
        )?;
        sys::mount_c(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
        sys::mount_c(Some(&root), &root, None, libc::MS_BIND, None)?;
        sys::mount_c(
            Some(c"proc"),
            &proc_dir,
            Some(c"proc"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        )?;
        sys::mount_c(
            Some(c"/sys"),
            &sys_dir,
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )?;
        sys::mount_c(
            Some(c"/dev"),
            &dev_dir,
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )?;
        sys::mount_c(
            Some(c"tmpfs"),
            &tmp_dir,
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV,
            Some(c"size=64m,mode=1777"),
        )?;
        // The image's tree read-only for the zygote too (the mounts under it stay as they are).
        sys::mount_c(
            None,
            &root,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            None,
        )?;
        sys::pivot_into(&root)?;
        for fd in &inherit {
            sys::inherit(*fd)?;
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before exec; it only makes system calls on values
    // prepared above (C strings, descriptor numbers) and allocates nothing, so it is safe after a
    // fork of a multi-threaded process.
    unsafe {
        command.pre_exec(hook);
    }
    let child = command.spawn();
    drop(launch.inherit); // the zygote has its copies; ours close
    child
}

/// Starts `binary` with `args`, detached: a session of its own, stdio to /dev/null, not waited
/// for (it outlives the caller).
pub fn spawn_detached(binary: &std::path::Path, args: &[&OsStr]) -> io::Result<()> {
    let mut command = Command::new(binary);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: the hook only calls setsid, which allocates nothing.
    unsafe {
        command.pre_exec(sys::setsid);
    }
    command.spawn().map(drop)
}
