//! The sandbox's seccomp filter: an allowlist modelled on Docker's default profile.
//!
//! The filter is compiled to BPF once per zygote ([`SandboxFilter::compile`]) and installed in
//! every child between the fork and the first line of tenant code ([`SandboxFilter::install`]);
//! every descendant (the agent, kernels, shells, `pip`) inherits it.
//!
//! What it does, in the order the kernel sees it:
//!
//! - A call made through another ABI than the one this binary was built for (i386 `int 0x80` on
//!   x86_64) kills the process: seccompiler's architecture check.
//! - A call on the allowlist ([`allowed_syscalls`]) is allowed. The list is Docker's unconditional
//!   allow list (moby `profiles/seccomp/default.json`) for a container holding only `CAP_SETUID`,
//!   `CAP_SETGID` and `CAP_KILL`, minus a few calls Docker allows that a Python sandbox never needs
//!   (see [`allowed_syscalls`]). Three calls are allowed only for some arguments, as in Docker:
//!   `clone` without namespace flags, `socket` except `AF_ALG` and `AF_VSOCK`, and `personality`
//!   with the values Docker lists.
//! - `clone3` fails with `ENOSYS`, so that glibc falls back to `clone`, whose flags the filter can
//!   read (`clone3` passes them in memory, out of the filter's reach). Docker does the same.
//! - Anything else fails with `EPERM`, as in Docker (`SCMP_ACT_ERRNO`). x32 calls (numbers with
//!   bit 30 set) are never on the list, since the filter compares whole numbers.
//!
//! The `clone3` rule is a second, four-instruction program installed after the allowlist: a
//! seccompiler filter has one action for the calls it matches, and the kernel keeps the errno of
//! the most recently installed filter when two return `SECCOMP_RET_ERRNO` (seccomp(2), "If multiple
//! filters exist...": the first-seen action of highest precedence wins, newest filter first).

use std::collections::BTreeMap;

use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

/// Errors building or installing the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// This binary was built for an architecture the filter has no system call table for.
    #[error("no seccomp filter for the {arch} architecture (only x86_64 and aarch64)")]
    UnsupportedArchitecture {
        /// The architecture this binary was built for (`std::env::consts::ARCH`).
        arch: &'static str,
    },
    /// An argument rule of one system call could not be built.
    #[error("building the argument rule for {syscall}")]
    BuildRule {
        /// The system call whose rule failed.
        syscall: &'static str,
        /// seccompiler's reason.
        #[source]
        source: BackendError,
    },
    /// The allowlist could not be compiled to BPF.
    #[error("compiling the seccomp allowlist")]
    CompileAllowlist(#[source] BackendError),
    /// The `clone3`-returns-`ENOSYS` program could not be compiled to BPF.
    #[error("compiling the seccomp clone3 program")]
    CompileClone3(#[source] BackendError),
    /// The kernel refused the allowlist (no `no_new_privs` and no `CAP_SYS_ADMIN`, or no seccomp).
    #[error("installing the seccomp allowlist")]
    InstallAllowlist(#[source] seccompiler::Error),
    /// The kernel refused the `clone3` program; the allowlist is installed (`clone3` gets `EPERM`).
    #[error("installing the seccomp clone3 program")]
    InstallClone3(#[source] seccompiler::Error),
}

/// The compiled sandbox filter: BPF instructions, built once (per zygote) and installed in every child.
#[derive(Debug, Clone)]
pub struct SandboxFilter {
    /// The allowlist; any call not on it gets `EPERM`.
    allowlist: BpfProgram,
    /// `clone3` gets `ENOSYS`, everything else passes to the allowlist. Installed second.
    clone3_enosys: BpfProgram,
}

impl SandboxFilter {
    /// Compiles the allowlist for the architecture this binary was built for.
    pub fn compile() -> Result<SandboxFilter, SeccompError> {
        let Some(target) = arch::TARGET else {
            return Err(SeccompError::UnsupportedArchitecture {
                arch: std::env::consts::ARCH,
            });
        };
        Ok(SandboxFilter {
            allowlist: compile_allowlist(target)?,
            clone3_enosys: compile_clone3_enosys(target)?,
        })
    }

    /// Installs the filter on the calling thread (the process must be single-threaded, or use TSYNC;
    /// no_new_privs must already be set by the caller, or the caller must have CAP_SYS_ADMIN).
    /// Async-signal-safe apart from the system call (no allocation): it may be called between fork and exec.
    ///
    /// seccompiler sets `no_new_privs` itself before each `seccomp(2)` call, so after this returns
    /// the flag is set whatever the caller did. On error the process may hold the allowlist alone
    /// ([`SeccompError::InstallClone3`]); the caller should treat any error as fatal to the child.
    pub fn install(&self) -> Result<(), SeccompError> {
        // Order matters: the clone3 program must be the newer one for its ENOSYS to win over the
        // allowlist's EPERM. Installing it needs `seccomp`, which the allowlist allows.
        seccompiler::apply_filter(&self.allowlist).map_err(SeccompError::InstallAllowlist)?;
        seccompiler::apply_filter(&self.clone3_enosys).map_err(SeccompError::InstallClone3)
    }

    /// The number of BPF instructions (for logs).
    #[allow(
        clippy::len_without_is_empty,
        reason = "a compiled filter is never empty; len is only for logs"
    )]
    pub fn len(&self) -> usize {
        self.allowlist.len() + self.clone3_enosys.len()
    }
}

/// The system calls the sandbox may make (their names), for docs and tests.
///
/// Docker's unconditional allow list for this architecture, plus `clone`, `socket` and
/// `personality` (allowed for some arguments only, see the module docs), minus these, which Docker
/// allows and we refuse: `ptrace`, `process_vm_readv` and `process_vm_writev` (Docker allows them
/// on kernels from 4.8; here one tenant process could read or steer the agent), `name_to_handle_at`
/// (half of the handle-based escape whose other half, `open_by_handle_at`, both refuse),
/// `clock_adjtime` and `adjtimex` (read-only without `CAP_SYS_TIME`, never needed), and on x86_64
/// `modify_ldt` (16-bit segments, a history of kernel bugs, used by nothing in the image).
/// Empty on an architecture without a table.
pub fn allowed_syscalls() -> &'static [&'static str] {
    &ALLOWED_NAMES
}

/// One allowed system call: its name and this architecture's number for it.
#[derive(Debug, Clone, Copy)]
struct Syscall {
    name: &'static str,
    nr: i64,
}

/// The flags of `clone` that make new namespaces (Docker's mask `0x7E020000`). `CLONE_NEWTIME`
/// (`0x80`) is missing because `clone` reads those bits as the exit signal; only `clone3` and
/// `unshare` can ask for a time namespace, and both are refused.
const CLONE_NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;

/// `AF_ALG`, the kernel's crypto API as sockets (linux/socket.h); Docker refuses it.
const AF_ALG: u64 = 38;
/// `AF_VSOCK`, sockets to the hypervisor and other VMs (linux/socket.h); Docker refuses it.
const AF_VSOCK: u64 = 40;

/// The `personality` values Docker allows: `PER_LINUX`, `PER_LINUX32`, `UNAME26`,
/// `UNAME26 | PER_LINUX32`, and `0xffffffff` (query without change).
const PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// Compiles the allowlist: every allowed call, unconditionally or by its argument rules; the rest
/// `EPERM`.
fn compile_allowlist(target: TargetArch) -> Result<BpfProgram, SeccompError> {
    let mut rules = BTreeMap::new();
    for call in &ALLOWED {
        let chain = argument_rules(call.name).map_err(|source| SeccompError::BuildRule {
            syscall: call.name,
            source,
        })?;
        rules.insert(call.nr, chain);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        target,
    )
    .map_err(SeccompError::CompileAllowlist)?;
    filter.try_into().map_err(SeccompError::CompileAllowlist)
}

/// Compiles the program that answers `clone3` with `ENOSYS` and lets everything else through to
/// the allowlist.
fn compile_clone3_enosys(target: TargetArch) -> Result<BpfProgram, SeccompError> {
    let filter = SeccompFilter::new(
        BTreeMap::from([(arch::CLONE3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        target,
    )
    .map_err(SeccompError::CompileClone3)?;
    filter.try_into().map_err(SeccompError::CompileClone3)
}

/// The argument rules of one allowed call: any one rule allows it; an empty list allows it
/// whatever its arguments.
///
/// Every comparison reads the low 32 bits of the first argument (`Dword`): the kernel reads
/// `socket`'s domain and `personality`'s value as 32-bit ints and keeps only the low 32 bits of
/// `clone`'s flags, so a 64-bit comparison could be dodged by setting the high bits.
fn argument_rules(name: &str) -> Result<Vec<SeccompRule>, BackendError> {
    match name {
        "clone" => Ok(vec![SeccompRule::new(vec![first_argument(
            SeccompCmpOp::MaskedEq(CLONE_NAMESPACE_FLAGS),
            0,
        )?])?]),
        "socket" => Ok(vec![SeccompRule::new(vec![
            first_argument(SeccompCmpOp::Ne, AF_ALG)?,
            first_argument(SeccompCmpOp::Ne, AF_VSOCK)?,
        ])?]),
        "personality" => PERSONALITIES
            .iter()
            .map(|&value| SeccompRule::new(vec![first_argument(SeccompCmpOp::Eq, value)?]))
            .collect(),
        _ => Ok(Vec::new()),
    }
}

/// A comparison of the low 32 bits of a call's first argument.
fn first_argument(op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, BackendError> {
    SeccompCondition::new(0, SeccompCmpArgLen::Dword, op, value)
}

/// `"SYS_read"` → `"read"`, at compile time.
const fn strip_sys_prefix(ident: &'static str) -> &'static str {
    let (prefix, name) = ident.split_at(4);
    assert!(
        matches!(prefix.as_bytes(), b"SYS_"),
        "system call constants are named SYS_*"
    );
    name
}

/// A table of [`Syscall`]s from `nr::SYS_*` constant names.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! syscalls {
    ($($sys:ident),* $(,)?) => {
        &[$(Syscall { name: strip_sys_prefix(stringify!($sys)), nr: nr::$sys }),*]
    };
}

/// System call numbers: libc's `SYS_*`, plus those newer than the libc this crate builds with
/// (Linux 6.5 to 6.13; from 451 on the numbers are the same on every architecture). A constant
/// defined here shadows libc's if a later libc adds it.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[allow(non_upper_case_globals, reason = "named as libc names system calls")]
mod nr {
    pub(super) use libc::*;

    pub(super) const SYS_cachestat: c_long = 451;
    pub(super) const SYS_map_shadow_stack: c_long = 453;
    pub(super) const SYS_futex_wake: c_long = 454;
    pub(super) const SYS_futex_wait: c_long = 455;
    pub(super) const SYS_futex_requeue: c_long = 456;
    pub(super) const SYS_statmount: c_long = 457;
    pub(super) const SYS_listmount: c_long = 458;
    pub(super) const SYS_setxattrat: c_long = 463;
    pub(super) const SYS_getxattrat: c_long = 464;
    pub(super) const SYS_listxattrat: c_long = 465;
    pub(super) const SYS_removexattrat: c_long = 466;

    // Older calls some libc targets lack (arch/x86/entry/syscalls/syscall_64.tbl,
    // include/uapi/asm-generic/unistd.h).
    #[cfg(target_arch = "x86_64")]
    pub(super) const SYS_io_pgetevents: c_long = 333;
    #[cfg(target_arch = "x86_64")]
    pub(super) const SYS_uretprobe: c_long = 335;
    #[cfg(target_arch = "aarch64")]
    pub(super) const SYS_sync_file_range: c_long = 84;
    #[cfg(target_arch = "aarch64")]
    pub(super) const SYS_io_pgetevents: c_long = 292;
    #[cfg(target_arch = "aarch64")]
    pub(super) const SYS_fchmodat2: c_long = 452;
}

/// The allowed calls both architectures have, in Docker's (alphabetical) order.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const COMMON: &[Syscall] = syscalls![
    SYS_accept,
    SYS_accept4,
    SYS_bind,
    SYS_brk,
    SYS_cachestat,
    SYS_capget,
    SYS_capset,
    SYS_chdir,
    SYS_clock_getres,
    SYS_clock_gettime,
    SYS_clock_nanosleep,
    SYS_clone,
    SYS_close,
    SYS_close_range,
    SYS_connect,
    SYS_copy_file_range,
    SYS_dup,
    SYS_dup3,
    SYS_epoll_create1,
    SYS_epoll_ctl,
    SYS_epoll_pwait,
    SYS_epoll_pwait2,
    SYS_eventfd2,
    SYS_execve,
    SYS_execveat,
    SYS_exit,
    SYS_exit_group,
    SYS_faccessat,
    SYS_faccessat2,
    SYS_fadvise64,
    SYS_fallocate,
    SYS_fanotify_mark,
    SYS_fchdir,
    SYS_fchmod,
    SYS_fchmodat,
    SYS_fchmodat2,
    SYS_fchown,
    SYS_fchownat,
    SYS_fcntl,
    SYS_fdatasync,
    SYS_fgetxattr,
    SYS_flistxattr,
    SYS_flock,
    SYS_fremovexattr,
    SYS_fsetxattr,
    SYS_fstat,
    SYS_fstatfs,
    SYS_fsync,
    SYS_ftruncate,
    SYS_futex,
    SYS_futex_requeue,
    SYS_futex_wait,
    SYS_futex_waitv,
    SYS_futex_wake,
    SYS_get_robust_list,
    SYS_getcpu,
    SYS_getcwd,
    SYS_getdents64,
    SYS_getegid,
    SYS_geteuid,
    SYS_getgid,
    SYS_getgroups,
    SYS_getitimer,
    SYS_getpeername,
    SYS_getpgid,
    SYS_getpid,
    SYS_getppid,
    SYS_getpriority,
    SYS_getrandom,
    SYS_getresgid,
    SYS_getresuid,
    SYS_getrusage,
    SYS_getsid,
    SYS_getsockname,
    SYS_getsockopt,
    SYS_gettid,
    SYS_gettimeofday,
    SYS_getuid,
    SYS_getxattr,
    SYS_getxattrat,
    SYS_inotify_add_watch,
    SYS_inotify_init1,
    SYS_inotify_rm_watch,
    SYS_io_cancel,
    SYS_io_destroy,
    SYS_io_getevents,
    SYS_io_pgetevents,
    SYS_io_setup,
    SYS_io_submit,
    SYS_ioctl,
    SYS_ioprio_get,
    SYS_ioprio_set,
    SYS_kill,
    SYS_landlock_add_rule,
    SYS_landlock_create_ruleset,
    SYS_landlock_restrict_self,
    SYS_lgetxattr,
    SYS_linkat,
    SYS_listen,
    SYS_listmount,
    SYS_listxattr,
    SYS_listxattrat,
    SYS_llistxattr,
    SYS_lremovexattr,
    SYS_lseek,
    SYS_lsetxattr,
    SYS_madvise,
    SYS_map_shadow_stack,
    SYS_membarrier,
    SYS_memfd_create,
    SYS_memfd_secret,
    SYS_mincore,
    SYS_mkdirat,
    SYS_mknodat,
    SYS_mlock,
    SYS_mlock2,
    SYS_mlockall,
    SYS_mmap,
    SYS_mprotect,
    SYS_mq_getsetattr,
    SYS_mq_notify,
    SYS_mq_open,
    SYS_mq_timedreceive,
    SYS_mq_timedsend,
    SYS_mq_unlink,
    SYS_mremap,
    SYS_mseal,
    SYS_msgctl,
    SYS_msgget,
    SYS_msgrcv,
    SYS_msgsnd,
    SYS_msync,
    SYS_munlock,
    SYS_munlockall,
    SYS_munmap,
    SYS_nanosleep,
    SYS_newfstatat,
    SYS_openat,
    SYS_openat2,
    SYS_personality,
    SYS_pidfd_open,
    SYS_pidfd_send_signal,
    SYS_pipe2,
    SYS_pkey_alloc,
    SYS_pkey_free,
    SYS_pkey_mprotect,
    SYS_ppoll,
    SYS_prctl,
    SYS_pread64,
    SYS_preadv,
    SYS_preadv2,
    SYS_prlimit64,
    SYS_process_mrelease,
    SYS_pselect6,
    SYS_pwrite64,
    SYS_pwritev,
    SYS_pwritev2,
    SYS_read,
    SYS_readahead,
    SYS_readlinkat,
    SYS_readv,
    SYS_recvfrom,
    SYS_recvmmsg,
    SYS_recvmsg,
    SYS_remap_file_pages,
    SYS_removexattr,
    SYS_removexattrat,
    SYS_renameat2,
    SYS_restart_syscall,
    SYS_rseq,
    SYS_rt_sigaction,
    SYS_rt_sigpending,
    SYS_rt_sigprocmask,
    SYS_rt_sigqueueinfo,
    SYS_rt_sigreturn,
    SYS_rt_sigsuspend,
    SYS_rt_sigtimedwait,
    SYS_rt_tgsigqueueinfo,
    SYS_sched_get_priority_max,
    SYS_sched_get_priority_min,
    SYS_sched_getaffinity,
    SYS_sched_getattr,
    SYS_sched_getparam,
    SYS_sched_getscheduler,
    SYS_sched_rr_get_interval,
    SYS_sched_setaffinity,
    SYS_sched_setattr,
    SYS_sched_setparam,
    SYS_sched_setscheduler,
    SYS_sched_yield,
    SYS_seccomp,
    SYS_semctl,
    SYS_semget,
    SYS_semop,
    SYS_semtimedop,
    SYS_sendfile,
    SYS_sendmmsg,
    SYS_sendmsg,
    SYS_sendto,
    SYS_set_robust_list,
    SYS_set_tid_address,
    SYS_setfsgid,
    SYS_setfsuid,
    SYS_setgid,
    SYS_setgroups,
    SYS_setitimer,
    SYS_setpgid,
    SYS_setpriority,
    SYS_setregid,
    SYS_setresgid,
    SYS_setresuid,
    SYS_setreuid,
    SYS_setsid,
    SYS_setsockopt,
    SYS_setuid,
    SYS_setxattr,
    SYS_setxattrat,
    SYS_shmat,
    SYS_shmctl,
    SYS_shmdt,
    SYS_shmget,
    SYS_shutdown,
    SYS_sigaltstack,
    SYS_signalfd4,
    SYS_socket,
    SYS_socketpair,
    SYS_splice,
    SYS_statfs,
    SYS_statmount,
    SYS_statx,
    SYS_symlinkat,
    SYS_sync,
    SYS_sync_file_range,
    SYS_syncfs,
    SYS_sysinfo,
    SYS_tee,
    SYS_tgkill,
    SYS_timer_create,
    SYS_timer_delete,
    SYS_timer_getoverrun,
    SYS_timer_gettime,
    SYS_timer_settime,
    SYS_timerfd_create,
    SYS_timerfd_gettime,
    SYS_timerfd_settime,
    SYS_times,
    SYS_tkill,
    SYS_truncate,
    SYS_umask,
    SYS_uname,
    SYS_unlinkat,
    SYS_utimensat,
    SYS_vmsplice,
    SYS_wait4,
    SYS_waitid,
    SYS_write,
    SYS_writev,
];
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const COMMON: &[Syscall] = &[];

/// What differs by architecture: the seccompiler target, the calls only it has, `clone3`'s number.
#[cfg(target_arch = "x86_64")]
mod arch {
    use super::{Syscall, TargetArch, nr, strip_sys_prefix};

    /// The architecture the filter checks calls against.
    pub(super) const TARGET: Option<TargetArch> = Some(TargetArch::x86_64);
    /// `clone3`, answered with `ENOSYS`.
    pub(super) const CLONE3: i64 = nr::SYS_clone3;
    /// The legacy calls x86_64 keeps (the generic table dropped them), and `arch_prctl`, which
    /// sets the thread pointer at every exec.
    pub(super) const ONLY: &[Syscall] = syscalls![
        SYS_access,
        SYS_alarm,
        SYS_arch_prctl,
        SYS_chmod,
        SYS_chown,
        SYS_creat,
        SYS_dup2,
        SYS_epoll_create,
        SYS_epoll_ctl_old,
        SYS_epoll_wait,
        SYS_epoll_wait_old,
        SYS_eventfd,
        SYS_fork,
        SYS_futimesat,
        SYS_get_thread_area,
        SYS_getdents,
        SYS_getpgrp,
        SYS_getrlimit,
        SYS_inotify_init,
        SYS_lchown,
        SYS_link,
        SYS_lstat,
        SYS_mkdir,
        SYS_mknod,
        SYS_open,
        SYS_pause,
        SYS_pipe,
        SYS_poll,
        SYS_readlink,
        SYS_rename,
        SYS_renameat,
        SYS_rmdir,
        SYS_select,
        SYS_set_thread_area,
        SYS_setrlimit,
        SYS_signalfd,
        SYS_stat,
        SYS_symlink,
        SYS_time,
        SYS_unlink,
        SYS_uretprobe,
        SYS_utime,
        SYS_utimes,
        SYS_vfork,
    ];
}

/// What differs by architecture: the seccompiler target, the calls only it has, `clone3`'s number.
#[cfg(target_arch = "aarch64")]
mod arch {
    use super::{Syscall, TargetArch, nr};

    /// The architecture the filter checks calls against.
    pub(super) const TARGET: Option<TargetArch> = Some(TargetArch::aarch64);
    /// `clone3`, answered with `ENOSYS`.
    pub(super) const CLONE3: i64 = nr::SYS_clone3;
    /// aarch64 uses the generic table, whose calls are all in `COMMON`.
    pub(super) const ONLY: &[Syscall] = &[];
}

/// No table for this architecture: [`SandboxFilter::compile`] says so.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
mod arch {
    use super::{Syscall, TargetArch};

    /// None: no filter for this architecture.
    pub(super) const TARGET: Option<TargetArch> = None;
    /// Unused without a target.
    pub(super) const CLONE3: i64 = -1;
    /// Nothing.
    pub(super) const ONLY: &[Syscall] = &[];
}

/// The number of allowed calls on this architecture.
const ALLOWED_LEN: usize = COMMON.len() + arch::ONLY.len();
/// Every allowed call on this architecture.
static ALLOWED: [Syscall; ALLOWED_LEN] = concat(COMMON, arch::ONLY);
/// Their names, for [`allowed_syscalls`].
static ALLOWED_NAMES: [&str; ALLOWED_LEN] = names(&ALLOWED);

/// `first` then `second`, at compile time.
const fn concat<const N: usize>(first: &[Syscall], second: &[Syscall]) -> [Syscall; N] {
    assert!(first.len() + second.len() == N);
    let mut out = [Syscall { name: "", nr: -1 }; N];
    let mut i = 0;
    while i < first.len() {
        out[i] = first[i];
        i += 1;
    }
    let mut j = 0;
    while j < second.len() {
        out[i + j] = second[j];
        j += 1;
    }
    out
}

/// The names of `calls`, at compile time.
const fn names<const N: usize>(calls: &[Syscall; N]) -> [&'static str; N] {
    let mut out = [""; N];
    let mut i = 0;
    while i < N {
        out[i] = calls[i].name;
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests;
