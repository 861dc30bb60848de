"""Kernels of a lean sandbox: forked, not started (the lean engine; zygote.py).

A lean sandbox's agent is a fork of the zygote, with the data stack already imported. Before it
starts any thread it forks a *kernel fork server*: a root process of the sandbox (the agent's
credentials: its three capabilities, no_new_privs, the sandbox's seccomp filter) that stays
single-threaded and forks each kernel the agent asks for. A kernel is then pandas-ready at once
(the Docker engine's kernel is a new Python that imports the stack in the background), and a
restart after a timeout, a crash or an out-of-memory kill gets a fresh one the same way, in the
same sandbox, its files kept.

The fork server's child switches to the sandbox user (which clears its capabilities), re-seeds
every random generator a copy must not share, and runs the kernel role (cells.py). User code can
neither signal nor trace the fork server (another uid; the seccomp filter forbids ptrace), so it
cannot tamper with the next kernel. Should the fork server be gone anyway, the agent starts kernels
the Docker engine's way (kernels.py).

Messages (JSON, one per SOCK_SEQPACKET packet): agent -> server `{"op": "kernel", "env"}` with the
kernel's two pipe ends attached, answered `{"op": "started", "pid"}` or `{"op": "failed",
"error"}`; server -> agent `{"op": "exited", "pid", "code"}` when a kernel ends.
"""

import ctypes
import json
import os
import queue
import select
import signal
import socket
import threading

from .config import ENV_ARCHIVE_FD, ENV_KERNEL_FDS, HOME, USER_GID, USER_UID
from .reseed import fresh_seed, reseed

MAX_MESSAGE = 1 << 20
START_TIMEOUT_S = 30.0


class ForkedKernel:
    """A kernel process the fork server started: the part of subprocess.Popen's interface that
    kernels.py uses (pid, wait, kill). Its exit code comes from the fork server, its parent."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None
        self._ended = threading.Event()

    def ended(self, code):
        self.returncode = code
        self._ended.set()

    def wait(self, timeout=None):
        self._ended.wait(timeout)
        return self.returncode

    def poll(self):
        return self.returncode

    def kill(self):
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


class KernelForkServer:
    """The agent's handle on its fork server."""

    @classmethod
    def start(cls, archive_fd, log_fd):
        """Forks the server; call before the agent starts any thread. `log_fd`: the agent's log,
        where a kernel that fails before it runs says why."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            ours.close()
            try:
                # Nothing of the agent's (its protocol descriptors above all) reaches a kernel.
                keep = {theirs.fileno(), archive_fd, log_fd}
                for name in os.listdir("/proc/self/fd"):
                    fd = int(name)
                    if fd > 2 and fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                serve(theirs, archive_fd, log_fd)
            finally:
                os._exit(0)
        theirs.close()
        return cls(ours, pid)

    def __init__(self, sock, pid):
        self.sock = sock
        self.pid = pid
        self.lock = threading.Lock()  # one start at a time: answers come in order
        self.kernels_lock = threading.Lock()  # kernels and exited
        self.answers = queue.Queue()
        self.kernels = {}  # pid -> ForkedKernel
        self.exited = {}  # codes of kernels that ended before their start was answered
        self.alive = True
        self.reader = None

    def begin(self):
        """Starts the thread that reads the server's messages (once the agent may have threads)."""
        self.reader = threading.Thread(target=self._read_loop, name="kernel-forks", daemon=True)
        self.reader.start()

    def _read_loop(self):
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if msg.get("op") == "exited":
                with self.kernels_lock:
                    kernel = self.kernels.pop(msg.get("pid"), None)
                    if kernel is None:
                        self.exited[msg.get("pid")] = msg.get("code")
                if kernel is not None:
                    kernel.ended(msg.get("code"))
            else:
                self.answers.put(msg)
        self.alive = False
        self.answers.put(None)
        # Kernels whose end the server can no longer report: their pids may be gone already.
        with self.kernels_lock:
            orphans = list(self.kernels.values())
            self.kernels.clear()
        for kernel in orphans:
            kernel.ended(-9)

    def spawn(self, to_kernel_r, from_kernel_w, env):
        """A new kernel reading `to_kernel_r` and writing `from_kernel_w` (both stay the
        caller's to close), with `env`; raises OSError when the server cannot start one."""
        if not self.alive:
            raise OSError("the kernel fork server is gone")
        with self.lock:
            try:
                socket.send_fds(
                    self.sock,
                    [json.dumps({"op": "kernel", "env": env}).encode()],
                    [to_kernel_r, from_kernel_w],
                )
            except OSError:
                self.alive = False
                raise
            try:
                answer = self.answers.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                answer = None
        if not answer or answer.get("op") != "started":
            raise OSError((answer or {}).get("error") or "the kernel fork server did not answer")
        pid = answer["pid"]
        kernel = ForkedKernel(pid)
        with self.kernels_lock:
            code = self.exited.pop(pid, None)
            if code is None:
                self.kernels[pid] = kernel
        if code is not None:
            kernel.ended(code)
        return kernel


def serve(sock, archive_fd, log_fd):
    """The fork server's loop: single-threaded for ever (it forks)."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def send(obj):
        sock.sendall(json.dumps(obj, separators=(",", ":")).encode())

    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock not in ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except InterruptedError:
            continue
        if not data:
            return
        try:
            req = json.loads(data)
        except ValueError:
            req = {}
        if req.get("op") != "kernel" or len(fds) != 2 or not isinstance(req.get("env"), dict):
            for fd in fds:
                os.close(fd)
            send({"op": "failed", "error": "a kernel needs an env and two descriptors"})
            continue
        try:
            pid = os.fork()
        except OSError as err:
            for fd in fds:
                os.close(fd)
            send({"op": "failed", "error": f"fork: {err}"})
            continue
        if pid == 0:
            sock.close()
            os.close(wake_r)
            os.close(wake_w)
            become_kernel(fds[0], fds[1], req["env"], archive_fd, log_fd)  # never returns
        for fd in fds:
            os.close(fd)
        send({"op": "started", "pid": pid})


def add_user_site():
    """The user's packages directory (PYTHONUSERBASE, where pip installs) on sys.path ahead of
    the system's packages, as a Python started now would have it: the zygote's sys.path was made
    before the directory existed, under another environment."""
    import site
    import sys

    site.USER_BASE = None
    site.USER_SITE = None
    user_site = site.getusersitepackages()
    if user_site in sys.path:
        return
    at = next(
        (i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))),
        len(sys.path),
    )
    sys.path.insert(at, user_site)
    site.addsitedir(user_site)  # its .pth files


def become_kernel(proto_in, proto_out, env, archive_fd, log_fd):
    """In the fork server's child: the sandbox user, fresh generators, the kernel role. Until
    the kernel role starts its failures go to the agent's log; then the log is closed (user code
    never gets it)."""
    try:
        os.dup2(log_fd, 2)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # signals aimed at the agent's group never reach it
        if archive_fd is not None:
            # The kernel's own copy of the archive (the agent's is root's alone), under the same
            # number: the package's import paths name it.
            from .kernels import archive_for_kernel

            copy = archive_for_kernel(archive_fd)
            os.dup2(copy, archive_fd, inheritable=False)
            os.close(copy)
        os.setgroups([])
        os.setresgid(USER_GID, USER_GID, USER_GID)
        os.setresuid(USER_UID, USER_UID, USER_UID)  # clears every capability
        # Changing credentials made the process undumpable (its /proc/self/mem and fd root's);
        # the kernel a Docker sandbox starts with execve as the user is dumpable, and so is this
        # one: its own files in /proc are the user's. (ptrace stays refused by the seccomp filter.)
        ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
        os.environ.clear()
        os.environ.update(env)
        os.environ[ENV_KERNEL_FDS] = f"{proto_in},{proto_out}"
        os.environ.pop(ENV_ARCHIVE_FD, None)
        os.chdir(HOME)
        # From here on code the user controls may run (the .pth files of the packages directory):
        # the agent's log is closed first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        os.close(log_fd)
        add_user_site()
        reseed(fresh_seed(b""))
        from . import cells

        cells.main(None, archive_fd)
    except BaseException as err:
        try:
            os.write(2, f"sandgate-kernel: fatal: {err!r}\n".encode())
        except OSError:
            pass
    os._exit(1)
