//! The filter's tests: the table, then behaviour seen from inside filtered child processes.
//!
//! The behaviour tests start `python3` (and `bash`, `unshare`) with the filter installed between
//! fork and exec, as the lean engine installs it between fork and tenant code, and probe system
//! calls with ctypes. Each refused call is also made without the filter
//! (`escape_probes_are_not_refused_by_the_host`), so a probe cannot pass because the host refused
//! the call for its own reasons.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use super::*;

/// Calls the sandbox must never make, from the brief and Docker's `CAP_SYS_*`-only lists.
const FORBIDDEN: &[&str] = &[
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "syslog",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "open_tree",
    "move_mount",
    "mount_setattr",
    "pidfd_getfd",
    "kcmp",
    "vhangup",
    "iopl",
    "ioperm",
    "uselib",
    "mbind",
    "set_mempolicy",
    "get_mempolicy",
    "move_pages",
    "set_mempolicy_home_node",
    "lsm_set_self_attr",
    "fanotify_init",
    "nfsservctl",
    "modify_ldt",
    "process_madvise",
    "sethostname",
    "setdomainname",
    "clone3",
];

/// Calls Python, the data stack, shells and the agent cannot do without.
const REQUIRED: &[&str] = &[
    "read",
    "write",
    "openat",
    "close",
    "mmap",
    "mprotect",
    "munmap",
    "brk",
    "clone",
    "execve",
    "wait4",
    "waitid",
    "exit_group",
    "futex",
    "rt_sigaction",
    "setresuid",
    "setresgid",
    "setgroups",
    "capget",
    "capset",
    "prctl",
    "kill",
    "tgkill",
    "pidfd_open",
    "pidfd_send_signal",
    "memfd_create",
    "fcntl",
    "sendfile",
    "socket",
    "socketpair",
    "connect",
    "bind",
    "epoll_pwait",
    "getrandom",
    "seccomp",
    "personality",
];

#[test]
fn compiles_for_this_architecture() {
    let filter = SandboxFilter::compile().expect("the filter should compile on x86_64/aarch64");
    assert!(filter.len() > 0, "a compiled filter has instructions");
    assert!(
        filter.len() < 4096,
        "the kernel refuses programs of 4096 instructions or more; got {}",
        filter.len()
    );
}

#[test]
fn allowlist_leaves_out_every_escape_call() {
    let allowed = allowed_syscalls();
    let leaked: Vec<_> = FORBIDDEN
        .iter()
        .filter(|name| allowed.contains(name))
        .collect();
    assert!(
        leaked.is_empty(),
        "these calls must not be on the allowlist: {leaked:?}"
    );
}

#[test]
fn allowlist_keeps_what_python_and_the_agent_need() {
    let allowed = allowed_syscalls();
    let missing: Vec<_> = REQUIRED
        .iter()
        .filter(|name| !allowed.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "these calls must be on the allowlist: {missing:?}"
    );
}

#[test]
fn allowlist_names_each_call_once() {
    let mut by_name = BTreeMap::new();
    let mut by_number = BTreeMap::new();
    for call in &ALLOWED {
        assert!(
            by_name.insert(call.name, call.nr).is_none(),
            "{} is listed twice",
            call.name
        );
        if let Some(other) = by_number.insert(call.nr, call.name) {
            panic!(
                "{} and {other} share number {}: one would shadow the other",
                call.name, call.nr
            );
        }
    }
}

#[test]
fn allowlist_has_no_x32_numbers() {
    let x32: Vec<_> = ALLOWED
        .iter()
        .filter(|call| !(0..0x4000_0000).contains(&call.nr))
        .map(|call| call.name)
        .collect();
    assert!(
        x32.is_empty(),
        "numbers with the x32 bit (or negative) must not be allowed: {x32:?}"
    );
}

#[test]
fn clone_mask_is_dockers() {
    assert_eq!(
        CLONE_NAMESPACE_FLAGS, 0x7E02_0000,
        "the namespace mask on clone's flags should be Docker's (2114060288)"
    );
}

#[cfg(target_arch = "x86_64")]
#[test]
fn x86_64_numbers_match_the_kernel_table() {
    let number = |name: &str| ALLOWED.iter().find(|call| call.name == name).map(|c| c.nr);
    // Spot checks of the numbers this crate defines itself (syscall_64.tbl).
    for (name, nr) in [
        ("read", 0),
        ("io_pgetevents", 333),
        ("uretprobe", 335),
        ("cachestat", 451),
        ("fchmodat2", 452),
        ("futex_wake", 454),
        ("statmount", 457),
        ("removexattrat", 466),
    ] {
        assert_eq!(number(name), Some(nr), "{name} should be allowed as {nr}");
    }
}

/// The real interpreter behind `python3` (pyenv's shim is a shell script; resolving it once keeps
/// each test to one interpreter start).
fn python() -> &'static str {
    static PYTHON: OnceLock<String> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .expect("python3 should be on PATH");
        String::from_utf8(out.stdout)
            .expect("a UTF-8 path")
            .trim()
            .to_owned()
    })
}

/// Sets `no_new_privs` on the calling process.
#[allow(unsafe_code, reason = "prctl is an FFI call")]
fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Runs `command` with the filter installed between fork and exec, as the lean engine does.
#[allow(unsafe_code, reason = "pre_exec is unsafe")]
fn run_filtered(command: &mut Command) -> Output {
    // Compiled in the parent: the child only installs it.
    let filter = SandboxFilter::compile().expect("the filter should compile");
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe work
    // is sound: prctl and seccomp are system calls, `install` does not allocate, and
    // `last_os_error` wraps an errno without allocating. It captures only the filter (owned).
    unsafe {
        command.pre_exec(move || {
            set_no_new_privs()?;
            filter.install().map_err(|_| io::Error::last_os_error())
        });
    }
    command
        .stdin(Stdio::null())
        .output()
        .expect("the filtered child should start")
}

/// Runs `command` without a filter, as a control.
fn run_unfiltered(command: &mut Command) -> Output {
    command
        .stdin(Stdio::null())
        .output()
        .expect("the child should start")
}

/// `stdout` and `stderr` of a child, for assertion messages.
fn describe(out: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The ordinary life of a kernel: threads (clone3 falls back to clone), subprocesses (vfork-style
/// clone), fork, sockets on loopback, asyncio, a multiprocessing pool, and the agent's steps to
/// run a command as uid 1000 and stop it by pidfd.
const ORDINARY_PYTHON: &str = r#"
import asyncio, multiprocessing, os, signal, socket, subprocess, sys, threading

seen = []
threads = [threading.Thread(target=seen.append, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
assert sorted(seen) == [0, 1, 2, 3], seen

subprocess.run(["/bin/true"], check=True)
out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
assert out.stdout.strip() == "42", out

pid = os.fork()
if pid == 0:
    os._exit(7)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7

a, b = socket.socketpair()
a.sendall(b"ping"); assert b.recv(4) == b"ping"
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.bind(("127.0.0.1", 0)); server.listen()
client = socket.create_connection(server.getsockname())
conn, _ = server.accept()
client.sendall(b"tcp"); assert conn.recv(3) == b"tcp"
socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()
socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()

async def main():
    await asyncio.sleep(0)
    return "async"
assert asyncio.run(main()) == "async"

with multiprocessing.get_context("fork").Pool(2) as pool:
    assert pool.map(abs, [-1, -2]) == [1, 2]

fd = os.memfd_create("scratch")
os.write(fd, b"memfd"); os.lseek(fd, 0, 0)
r, w = os.pipe()
assert os.sendfile(w, fd, 0, 5) == 5 and os.read(r, 5) == b"memfd"

r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.dup2(w, 1)
    os.setgroups([]); os.setresgid(1000, 1000, 1000); os.setresuid(1000, 1000, 1000)
    os.execv("/usr/bin/id", ["id", "-u"])
os.close(w)
assert os.read(r, 64).strip() == b"1000"
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

sleeper = subprocess.Popen(["sleep", "30"])
pidfd = os.pidfd_open(sleeper.pid)
signal.pidfd_send_signal(pidfd, signal.SIGKILL)
assert sleeper.wait() == -signal.SIGKILL
os.kill(os.getpid(), 0)

print("ordinary ok")
"#;

#[test]
fn ordinary_python_runs_under_the_filter() {
    let out = run_filtered(Command::new(python()).args(["-c", ORDINARY_PYTHON]));
    assert!(
        out.status.success() && out.stdout.ends_with(b"ordinary ok\n"),
        "threads, subprocess, fork, sockets, asyncio, multiprocessing, memfd, setresuid and pidfd \
         should all work under the filter:\n{}",
        describe(&out)
    );
}

#[test]
fn bash_coreutils_and_pip_run_under_the_filter() {
    let script = format!(
        "echo hello | tr a-z A-Z && ls / >/dev/null && id -u && {} -m pip --version >/dev/null \
         && echo done",
        python()
    );
    let out = run_filtered(Command::new("bash").args(["-c", &script]));
    assert!(
        out.status.success() && out.stdout == b"HELLO\n0\ndone\n",
        "bash, coreutils and pip should run under the filter:\n{}",
        describe(&out)
    );
}

#[test]
fn unshare_command_is_refused() {
    let out = run_filtered(Command::new("unshare").args(["-n", "true"]));
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"),
        "`unshare -n true` should fail with EPERM under the filter:\n{}",
        describe(&out)
    );
}

/// One system call made with ctypes, and the errno the filter must give it.
struct Probe {
    /// What the probe tries, for messages.
    name: &'static str,
    /// The system call number (any 64-bit value: x32 numbers too).
    nr: i64,
    /// Its arguments: chosen so that, unfiltered and as root, the call fails harmlessly or does
    /// nothing outside the probing process.
    args: Vec<i64>,
    /// The errno expected under the filter.
    errno: i32,
    /// The call forks on success (the child exits at once).
    forks: bool,
}

/// Builds a [`Probe`] expecting `EPERM` (or another errno after `=>`).
macro_rules! probe {
    ($name:literal, $nr:expr, [$($arg:expr),*]) => {
        probe!($name, $nr, [$($arg),*] => libc::EPERM)
    };
    ($name:literal, $nr:expr, [$($arg:expr),*] => $errno:expr) => {
        Probe { name: $name, nr: $nr, args: vec![$($arg as i64),*], errno: $errno, forks: false }
    };
}

/// The escape calls, each made so that it would work (or fail with something else than the
/// filter's errno) without the filter. `parent` is a process the probe is not allowed to touch.
fn escape_probes(parent: i64) -> Vec<Probe> {
    use libc::*;
    let mut probes = vec![
        probe!("unshare(CLONE_NEWNET)", SYS_unshare, [CLONE_NEWNET]),
        probe!("setns", SYS_setns, [-1, 0]),
        probe!("mount", SYS_mount, [0, 0, 0, 0, 0]),
        probe!("umount2", SYS_umount2, [0, 0]),
        probe!("pivot_root", SYS_pivot_root, [0, 0]),
        probe!("chroot", SYS_chroot, [0]),
        probe!("keyctl", SYS_keyctl, [9999]),
        probe!("add_key", SYS_add_key, [0, 0, 0, 0, 0]),
        probe!("request_key", SYS_request_key, [0, 0, 0, 0]),
        probe!("bpf", SYS_bpf, [9999, 0, 0]),
        probe!("perf_event_open", SYS_perf_event_open, [0, 0, -1, -1, 0]),
        probe!("userfaultfd", SYS_userfaultfd, [0x7fff_ffff]),
        probe!(
            "ptrace(PEEKDATA, parent)",
            SYS_ptrace,
            [PTRACE_PEEKDATA, parent, 0, 0]
        ),
        probe!(
            "process_vm_readv(parent)",
            SYS_process_vm_readv,
            [parent, 0, 0, 0, 0, 0]
        ),
        probe!(
            "process_vm_writev(parent)",
            SYS_process_vm_writev,
            [parent, 0, 0, 0, 0, 0]
        ),
        probe!("io_uring_setup", SYS_io_uring_setup, [0, 0]),
        probe!("io_uring_enter", SYS_io_uring_enter, [-1, 0, 0, 0, 0, 0]),
        probe!("io_uring_register", SYS_io_uring_register, [-1, 0, 0, 0]),
        probe!("kexec_load", SYS_kexec_load, [0, 9999, 0, 0]),
        probe!("kexec_file_load", SYS_kexec_file_load, [-1, -1, 0, 0, 0]),
        probe!("init_module", SYS_init_module, [0, 0, 0]),
        probe!("finit_module", SYS_finit_module, [-1, 0, 0]),
        probe!("delete_module", SYS_delete_module, [0, 0]),
        probe!("open_by_handle_at", SYS_open_by_handle_at, [-1, 0, 0]),
        probe!("name_to_handle_at", SYS_name_to_handle_at, [-1, 0, 0, 0, 0]),
        probe!("acct", SYS_acct, [1]),
        probe!("swapon", SYS_swapon, [1, 0]),
        probe!("swapoff", SYS_swapoff, [1]),
        probe!("reboot", SYS_reboot, [0, 0, 0, 0]),
        probe!("settimeofday(NULL, NULL)", SYS_settimeofday, [0, 0]),
        probe!("clock_settime", SYS_clock_settime, [0, 0]),
        probe!("clock_adjtime", SYS_clock_adjtime, [0, 0]),
        probe!("adjtimex", SYS_adjtimex, [0]),
        probe!("syslog(SIZE_BUFFER)", SYS_syslog, [10, 0, 0]),
        probe!("quotactl", SYS_quotactl, [0, 0, 0, 0]),
        probe!("lookup_dcookie", SYS_lookup_dcookie, [0, 0, 0]),
        probe!("fsopen", SYS_fsopen, [0, 0]),
        probe!("fsconfig", SYS_fsconfig, [-1, 0, 0, 0, 0]),
        probe!("fsmount", SYS_fsmount, [-1, 0, 0]),
        probe!("fspick", SYS_fspick, [-1, 0, 0]),
        probe!("open_tree", SYS_open_tree, [-1, 0, 0]),
        probe!("move_mount", SYS_move_mount, [-1, 0, -1, 0, 0]),
        probe!("mount_setattr", SYS_mount_setattr, [-1, 0, 0, 0, 0]),
        probe!("pidfd_getfd", SYS_pidfd_getfd, [-1, 0, 0]),
        probe!("kcmp(parent, parent)", SYS_kcmp, [parent, parent, 0, 0, 0]),
        probe!("vhangup (no controlling tty)", SYS_vhangup, []),
        probe!("mbind", SYS_mbind, [0, 0, 0, 0, 0, 0]),
        probe!("set_mempolicy(MPOL_DEFAULT)", SYS_set_mempolicy, [0, 0, 0]),
        probe!("get_mempolicy", SYS_get_mempolicy, [0, 0, 0, 0, 0]),
        probe!("move_pages", SYS_move_pages, [0, 0, 0, 0, 0, 0]),
        probe!("lsm_set_self_attr", 460, [0, 0, 0, 0]),
        probe!("fanotify_init", SYS_fanotify_init, [0xffff_ffff_u32, 0]),
        probe!("nfsservctl", SYS_nfsservctl, [0, 0, 0]),
        probe!(
            "personality(ADDR_NO_RANDOMIZE)",
            SYS_personality,
            [ADDR_NO_RANDOMIZE]
        ),
        probe!(
            "socket(AF_VSOCK)",
            SYS_socket,
            [super::AF_VSOCK, SOCK_STREAM, 0]
        ),
        probe!(
            "socket(AF_ALG)",
            SYS_socket,
            [super::AF_ALG, SOCK_SEQPACKET, 0]
        ),
        probe!(
            "socket(AF_VSOCK | 1 << 32)",
            SYS_socket,
            [(1_i64 << 32) | super::AF_VSOCK as i64, SOCK_STREAM, 0]
        ),
        probe!("clone3", SYS_clone3, [0, 0] => libc::ENOSYS),
        Probe {
            forks: true,
            ..probe!(
                "clone(CLONE_NEWUSER | CLONE_NEWNET)",
                SYS_clone,
                [CLONE_NEWUSER | CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0]
            )
        },
    ];
    #[cfg(target_arch = "x86_64")]
    probes.extend([
        probe!("iopl", SYS_iopl, [0]),
        probe!("ioperm", SYS_ioperm, [0, 0, 0]),
        probe!("uselib", SYS_uselib, [0]),
        probe!("modify_ldt(read)", SYS_modify_ldt, [0, 0, 0]),
        probe!("x32 getpid", 0x4000_0000 | SYS_getpid, []),
    ]);
    probes
}

/// Makes each probe's call and prints `{name: errno}` (0 when the call succeeded). It leaves its
/// session first so that `vhangup` has no terminal to hang up.
const PROBE_PYTHON: &str = r#"
import ctypes, json, os, sys
try:
    os.setsid()
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
results = {}
for probe in json.loads(sys.argv[1]):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(probe["nr"]), *[ctypes.c_long(a) for a in probe["args"]])
    if probe["forks"] and rc == 0:
        os._exit(0)
    if probe["forks"] and rc > 0:
        os.waitpid(rc, 0)
    results[probe["name"]] = ctypes.get_errno() if rc == -1 else 0
print(json.dumps(results))
"#;

/// Runs the probes in a child python (filtered or not) and returns each probe's errno.
fn run_probes(probes: &[Probe], filtered: bool) -> BTreeMap<String, i32> {
    let list: Vec<_> = probes
        .iter()
        .map(|p| serde_json::json!({"name": p.name, "nr": p.nr, "args": p.args, "forks": p.forks}))
        .collect();
    let list = serde_json::to_string(&list).expect("probes serialize");
    let mut command = Command::new(python());
    command.args(["-c", PROBE_PYTHON, &list]);
    let out = if filtered {
        run_filtered(&mut command)
    } else {
        run_unfiltered(&mut command)
    };
    assert!(
        out.status.success(),
        "the probe script should finish:\n{}",
        describe(&out)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("probe output should be JSON ({e}):\n{}", describe(&out)))
}

#[test]
fn escape_calls_get_the_filters_errno() {
    let probes = escape_probes(i64::from(std::process::id()));
    let results = run_probes(&probes, true);
    let wrong: Vec<String> = probes
        .iter()
        .filter(|p| results.get(p.name) != Some(&p.errno))
        .map(|p| {
            format!(
                "{}: expected errno {}, got {:?}",
                p.name,
                p.errno,
                results.get(p.name)
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "under the filter these calls should fail with EPERM (clone3: ENOSYS):\n{}",
        wrong.join("\n")
    );
}

/// `/proc/self/status` says this process is root and has no seccomp filter of its own (inside a
/// container the host's filter would answer the probes itself).
fn unconfined_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |key: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(key))
            .map(|rest| rest.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    field("Uid:").first() == Some(&"0") && field("Seccomp:").first() == Some(&"0")
}

#[test]
fn escape_probes_are_not_refused_by_the_host() {
    if !unconfined_root() {
        eprintln!("skipped: the control needs root without a seccomp filter");
        return;
    }
    let probes = escape_probes(i64::from(std::process::id()));
    let results = run_probes(&probes, false);
    let vacuous: Vec<String> = probes
        .iter()
        .filter(|p| results.get(p.name).is_none_or(|&errno| errno == p.errno))
        .map(|p| format!("{}: {:?}", p.name, results.get(p.name)))
        .collect();
    assert!(
        vacuous.is_empty(),
        "without the filter these probes already fail with the filter's errno, so they prove \
         nothing about it; change their arguments:\n{}",
        vacuous.join("\n")
    );
}

/// Calls i386's getpid through `int 0x80` from executable memory and prints the result.
#[cfg(target_arch = "x86_64")]
const INT80_PYTHON: &str = r#"
import ctypes, mmap
code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20 (getpid); int 0x80; ret
getpid = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
print(getpid())
"#;

#[cfg(target_arch = "x86_64")]
#[test]
fn i386_calls_kill_the_process() {
    let control = run_unfiltered(Command::new(python()).args(["-c", INT80_PYTHON]));
    if !control.status.success() {
        eprintln!(
            "skipped: this kernel has no i386 emulation:\n{}",
            describe(&control)
        );
        return;
    }
    let out = run_filtered(Command::new(python()).args(["-c", INT80_PYTHON]));
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSYS),
        "an i386 system call should kill the process with SIGSYS (seccomp's arch check):\n{}",
        describe(&out)
    );
}
