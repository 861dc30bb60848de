"""Processes (PROTOCOL.md, "Processes" and "Sweeps"): who the agent acts as, the environment user
processes get, the process trees and sessions of calls, the sweeps that end what calls leave behind,
and why a kernel ended."""

import collections
import ctypes
import os
import platform
import signal
import subprocess
import tempfile
import time

from .config import HOME, PACKAGES_BASE, SWEEP_S, USER_GID, USER_UID
from .protocol import OpError


class Credentials:
    """Who the agent is and how it acts as the sandbox user.

    As root (in a container), file operations run on a thread whose effective uid/gid are switched to
    the sandbox user's with the raw setresuid/setresgid system calls: those change one thread only
    (glibc's wrappers would change every thread), so the file operation is checked, and creates
    files, exactly as the user would, while the rest of the agent stays root. Child processes get the
    user's uid/gid in full, which also clears every capability.
    """

    # (setresuid, setresgid) system call numbers per architecture.
    SYSCALLS = {"x86_64": (117, 119), "aarch64": (147, 149), "arm64": (147, 149)}

    def __init__(self):
        # On a host (SANDGATE_AGENT_HOME set, the tests) the agent never switches users, even as
        # root: there is no sandbox user there, and sweeping "all uid-1000 processes" would be wrong.
        self.root = os.geteuid() == 0 and "SANDGATE_AGENT_HOME" not in os.environ
        self.libc = None
        if self.root:
            numbers = self.SYSCALLS.get(platform.machine())
            if numbers is None:
                raise RuntimeError(f"unsupported architecture {platform.machine()}")
            self.setresuid, self.setresgid = numbers
            self.libc = ctypes.CDLL(None, use_errno=True)
            os.setgroups([])  # root's supplementary groups must not apply to user-context checks
            # Not dumpable: /proc/<agent>/fd and /mem stay closed to other uids whatever the
            # kernel's (or gVisor's) ptrace-access rules say about root processes.
            self.libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE

    def popen_args(self):
        """Arguments for subprocess.Popen that start a process as the sandbox user."""
        if not self.root:
            return {}
        return {"user": USER_UID, "group": USER_GID, "extra_groups": []}

    def _switch(self, uid, gid):
        def call(number, value):
            if self.libc.syscall(number, -1, value, -1) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"switching the thread's credentials failed: {os.strerror(err)}")

        if uid == 0:
            call(self.setresuid, 0)
            call(self.setresgid, 0)
        else:
            call(self.setresgid, gid)
            call(self.setresuid, uid)

    def run_as_user(self, target, *args):
        """Calls target(*args) with this thread acting as the sandbox user."""
        if not self.root:
            return target(*args)
        self._switch(USER_UID, USER_GID)
        try:
            return target(*args)
        finally:
            self._switch(0, 0)



ProcInfo = collections.namedtuple("ProcInfo", "ppid uid state sid")


def read_processes():
    """pid -> ProcInfo(ppid, real uid, state, session id) of every process visible in /proc."""
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
            # After "(comm)": state, ppid, pgrp, session, ...
            fields = data[data.rindex(b")") + 2 :].split()
            state, ppid, sid = fields[0].decode(), int(fields[1]), int(fields[3])
            uid = None
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        uid = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        procs[pid] = ProcInfo(ppid, uid, state, sid)
    return procs


def tree(procs, roots):
    """The pids in `roots` and all their descendants."""
    children = collections.defaultdict(list)
    for pid, info in procs.items():
        children[info.ppid].append(pid)
    seen = set()
    todo = [pid for pid in roots if pid in procs]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, ()))
    return seen


def belonging(procs, roots):
    """The processes of the calls whose main processes are `roots` (the kernel, commands, jobs):
    each root's tree, and every process of the session the root leads, with its tree.

    Every root leads a session of its own (start_new_session). A process orphaned by a double fork
    or `nohup … &` is reparented out of its call's tree but keeps the call's session, so a sweep
    after *another* call spares it while its own call runs. Only `setsid` leaves the session;
    what also leaves the tree then belongs to no call (PROTOCOL.md, "Sweeps").
    """
    sessions = {pid for pid in roots if pid in procs and procs[pid].sid == pid}
    members = [pid for pid, info in procs.items() if info.sid in sessions]
    return tree(procs, list(roots) + members)


def sweep(rt, keep_roots, keep_pids=()):
    """Kills every user process that does not belong to one of `keep_roots()` (the kernel, running
    commands, background jobs: asked again each round, under `rt.spawn_lock`; see `belonging`)
    nor is one of `keep_pids`, repeating until none is left or SWEEP_S has passed.

    As root the candidates are all processes of the sandbox user, wherever they were reparented
    (setsid, double fork, nohup: none of them changes the uid); on a host (tests), the agent's own
    descendants. Returns the number of processes killed.
    """
    me = os.getpid()
    deadline = time.monotonic() + SWEEP_S
    killed = 0
    while True:
        with rt.spawn_lock:
            procs = read_processes()
            keep = belonging(procs, keep_roots()) | {me} | set(keep_pids)
            if rt.creds is not None and rt.creds.root:
                candidates = {pid for pid, info in procs.items() if info.uid == USER_UID}
            else:
                candidates = tree(procs, [me])
            victims = [pid for pid in candidates - keep if procs[pid].state not in ("Z", "X")]
            if not victims:
                return killed
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, PermissionError):
                    pass
        if time.monotonic() >= deadline:
            rt.log(f"sweep gave up with {len(victims)} processes left")
            return killed
        time.sleep(0.01)


def kill_group(pgid):
    """SIGKILL to the process group `pgid`, if it still exists."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def leader_exited(pid):
    """True once `pid` has exited, without reaping it.

    WNOWAIT leaves the process a zombie, so its pid, which is also the id of its process group,
    cannot be taken by an unrelated process before we have killed the group.
    """
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def user_env(rt, extra=None):
    """The environment of user processes: nothing of the agent's own, plus what the gateway gave
    them (`rt.extra_env`: the egress proxy's variables)."""
    env = {
        "HOME": HOME,
        "USER": "user",
        "LOGNAME": "user",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "MPLBACKEND": "Agg",
        "PYTHONUNBUFFERED": "1",
        # IPython wants a writable profile directory; keep it out of the user's home (and quota).
        "IPYTHONDIR": os.path.join(tempfile.gettempdir(), "sandgate-ipython"),
        # pip installs the user's packages here (pip.conf: user = true), outside the home.
        "PYTHONUSERBASE": PACKAGES_BASE,
    }
    env["PATH"] = os.path.join(PACKAGES_BASE, "bin") + ":" + env["PATH"]
    for name in ("SANDGATE_AGENT_HOME", "MPLCONFIGDIR", "PYTHONPATH", "IPYTHONDIR", "LC_ALL", "TZ"):
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(getattr(rt, "extra_env", None) or {})
    env.update(extra or {})
    return env



def describe_exit(returncode, oom_before, pids_before=None):
    """Why the kernel ended, in words for the model."""
    oom_after = oom_kills()
    pids_after = pids_refusals()
    at_pids_limit = (
        pids_before is not None and pids_after is not None and pids_after > pids_before
    )
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return (
            "the Python kernel was killed by the out-of-memory killer: the sandbox's memory limit "
            "was reached"
        )
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            hint = (
                " (by user code, e.g. `kill -9`)"
                if oom_after is not None
                else " (by user code, or by the out-of-memory killer at the sandbox's memory limit)"
            )
        else:
            hint = {
                signal.SIGSEGV: " (a crash, e.g. in a C extension)",
                signal.SIGABRT: " (an abort, e.g. in a C extension)",
            }.get(sig, "")
        return f"the Python kernel was killed by {name}{hint}"
    if at_pids_limit:
        # numpy's thread pool, for one, ends the process when it cannot start its threads.
        return (
            f"the Python kernel exited with status {returncode} while the sandbox was at its "
            "process limit (too many processes or threads, e.g. a fork bomb): it could not start "
            "a thread or process it needed"
        )
    return f"the Python kernel exited with status {returncode} (e.g. os._exit or sys.exit outside a cell)"


def cgroup_counter(paths, key):
    """The counter `key` of the first readable cgroup event file in `paths` (lines of "<key>
    <count>"), None when none can be read."""
    for path in paths:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key + " "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


def pids_refusals():
    """How often the container's process limit has refused a new process or thread (cgroup v2 or
    v1), None when it cannot be read."""
    return cgroup_counter(("/sys/fs/cgroup/pids.events", "/sys/fs/cgroup/pids/pids.events"), "max")


def oom_kills():
    """The container's out-of-memory kill count (cgroup v2 or v1), None when it cannot be read."""
    return cgroup_counter(
        ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"), "oom_kill"
    )


def start_user_shell(rt, args, output):
    """Starts `bash -c <args…>` as the sandbox user in a session of its own, stdin from /dev/null,
    stdout and stderr to `output` (PIPE or DEVNULL), with the user's environment. (cwd is changed
    by the script: the agent, root without DAC_OVERRIDE, cannot enter the user's home itself.)"""
    try:
        return subprocess.Popen(
            ["bash", "-c", *args],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,
            close_fds=True,
            env=user_env(rt),
            **rt.creds.popen_args(),
        )
    except OSError as err:
        raise OpError("io", f"cannot start bash: {err}")
